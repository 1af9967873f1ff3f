"""KV-capacity planner for Kimi K2.x (issue 49): does a context fit, at what concurrency, and what
must change if not.  ``python -m torch_kdtree.plan --help``, or ``plan(...)`` for the same numbers.

Pure arithmetic on a ``config.json`` (plain json; no torch, no transformers):

- ``shapes``: the sizes read from a target (MLA) or DFlash drafter config;
- ``presets``: named GPUs, models and drafters, each with the source of its numbers;
- ``memory``: weights per GPU under TP / EP, the latent cache's bytes per token (replicated on
  every TP rank, split by DCP), what the engine reserves per request, whether it fits;
- ``advice``: the smallest changes that make it fit, and the KV dtype x DCP x context grid;
- ``report`` / ``cli``: the table, the JSON object, the plot, the command line.
"""
from .advice import fixes, what_if
from .cli import main, plan, run
from .memory import (Deployment, Plan, cache_tokens_per_request, drafter_cache_bytes, drafter_kv_bytes_per_token,
                     drafter_weights_per_gpu, engine_cache_bytes, evaluate, fits, kv_bytes_per_token,
                     kv_bytes_per_token_per_layer, tokens_for_memory, weights_per_gpu)
from .presets import DRAFTERS, GPUS, MODELS, GiB
from .shapes import DrafterShape, TargetShape, WeightFormat

__all__ = ["plan", "run", "main", "evaluate", "fits", "fixes", "what_if", "Deployment", "Plan", "TargetShape",
           "DrafterShape", "WeightFormat", "GPUS", "MODELS", "DRAFTERS", "GiB", "weights_per_gpu",
           "drafter_weights_per_gpu", "kv_bytes_per_token", "kv_bytes_per_token_per_layer",
           "drafter_kv_bytes_per_token", "cache_tokens_per_request", "engine_cache_bytes", "drafter_cache_bytes",
           "tokens_for_memory"]
