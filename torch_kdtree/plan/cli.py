"""``python -m torch_kdtree.plan``: the command line, and :func:`plan`, the same as one call."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from .advice import Fix, fixes, what_if
from .memory import DEFAULT_MEM_FRACTION, DEFAULT_OVERHEAD_BYTES, DEFAULT_PAGE_SIZE, Deployment, Plan, evaluate
from .presets import DRAFTERS, GPUS, MODELS, GiB
from .report import assumptions, have_matplotlib, plan_dict, plot, table
from .shapes import DrafterShape, TargetShape, read_config

DEFAULT_TREE_BUDGET = 16  # the budget the engine's benchmarks verify with a drafter


@dataclass
class Result:
    target: TargetShape
    drafter: DrafterShape | None
    plan: Plan
    fixes: list[Fix]
    grid: dict
    labels: dict
    notes: list[str]

    def as_dict(self) -> dict:
        return plan_dict(self.target, self.plan, self.fixes, self.grid, self.labels, self.notes)

    def table(self) -> str:
        return table(self.target, self.drafter, self.plan, self.fixes, self.grid, self.labels, self.notes)


def _label(spec: str, presets: dict) -> tuple[str, str]:
    """(name for the table, where its numbers come from)."""
    if spec in presets:
        return f"{presets[spec].name} [{spec}]", f"{spec}: {presets[spec].source}"
    return spec, f"{spec}: read from that config.json"


def run(model: str = "kimi-k2.6", *, gpu: str = "h200", gpu_memory_gib: float | None = None, num_gpus: int = 8,
        tp: int | None = None, dcp: int = 1, ep: int = 1, kv_dtype: str = "bf16",
        mem_fraction: float = DEFAULT_MEM_FRACTION, overhead_gib: float = DEFAULT_OVERHEAD_BYTES / GiB,
        context: int | None = None, concurrency: int = 1, drafter: str | None = None,
        tree_budget: int | None = None, page_size: int = DEFAULT_PAGE_SIZE, vision: bool = False) -> Result:
    """Plan one deployment.  ``model`` / ``drafter``: a preset name, a config.json or a directory;
    ``gpu``: a preset unless ``gpu_memory_gib`` is given; ``tp`` defaults to ``num_gpus``,
    ``context`` to the model's positions, ``tree_budget`` to 16 with a drafter (0 without).
    Raises ValueError naming what cannot work."""
    path, config, _ = read_config(model, MODELS, "--model")
    target = TargetShape.from_config(config, path)
    draft = None
    if drafter is not None:
        dpath, dconfig, directory = read_config(drafter, DRAFTERS, "--drafter")
        draft = DrafterShape.from_config(dconfig, directory, dpath)
    if tree_budget is None:
        tree_budget = DEFAULT_TREE_BUDGET if draft is not None else 0
    if tree_budget and draft is None:
        raise ValueError("--tree-budget needs --drafter (the tree is built from the drafter's proposals)")
    if context is None:
        if not target.max_positions:
            raise ValueError("--context is needed: the config has no max_position_embeddings")
        context = target.max_positions
    if gpu_memory_gib is not None:
        gpu_bytes, gpu_label, gpu_source = int(gpu_memory_gib * GiB), f"{gpu_memory_gib:g} GiB GPU", \
            f"GPU memory: {gpu_memory_gib:g} GiB as given (--gpu-memory)"
    else:
        if gpu not in GPUS:
            raise ValueError(f"--gpu {gpu!r} is not one of {sorted(GPUS)}")
        gpu_bytes, gpu_label, gpu_source = GPUS[gpu].total_bytes, GPUS[gpu].name, f"{gpu}: {GPUS[gpu].source}"
    dep = Deployment(gpu_bytes=gpu_bytes, num_gpus=num_gpus, tp=tp or num_gpus, dcp=dcp, ep=ep, kv_dtype=kv_dtype,
                     mem_fraction=mem_fraction, overhead_bytes=int(overhead_gib * GiB), context=context,
                     concurrency=concurrency, tree_budget=tree_budget, page_size=page_size, vision=vision)
    plan = evaluate(target, draft, dep)
    model_label, model_source = _label(model, MODELS)
    labels = {"model": model_label, "gpu": gpu_label, "drafter": None}
    sources = [gpu_source, model_source]
    if drafter is not None:
        labels["drafter"], drafter_source = _label(drafter, DRAFTERS)
        sources.append(drafter_source)
    return Result(target, draft, plan, fixes(target, draft, dep), what_if(target, draft, dep), labels,
                  assumptions(target, draft, dep, sources))


def plan(model: str = "kimi-k2.6", **settings) -> dict:
    """:func:`run`'s result as the --json object (``kv_bytes_per_token``, ``weights_bytes_per_gpu``,
    ``kv_tokens_per_gpu``, ``max_context_per_request``, ``fits``, the fixes, the grid, ...)."""
    return run(model, **settings).as_dict()


# ---------------------------------------------------------------------------- argparse


def _number(kind, low, *, strict: bool):
    def parse(text: str):
        try:
            value = kind(text.replace("_", "").replace(",", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"{text} must be {'>' if strict else '>='} {low}")
        return value
    return parse


def _fraction(text: str) -> float:
    value = _number(float, 0, strict=True)(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]")
    return value


positive_int, non_negative_int = _number(int, 0, strict=True), _number(int, 0, strict=False)
positive_float, non_negative_float = _number(float, 0, strict=True), _number(float, 0, strict=False)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torch_kdtree.plan",
        description="KV-capacity planner for Kimi K2.x (MLA): weights per GPU, latent-cache bytes per token, "
                    "KV tokens per GPU, the longest context per request, whether it fits and what would make it fit.",
        epilog="example: python -m torch_kdtree.plan --model kimi-k2.6 --gpu rtx-pro-6000 --tp 8 --context 200000")
    p.add_argument("--model", default="kimi-k2.6",
                   help=f"a preset ({', '.join(MODELS)}) or a config.json path or directory (default kimi-k2.6)")
    card = p.add_mutually_exclusive_group()
    card.add_argument("--gpu", choices=sorted(GPUS), default="h200", help="a GPU preset (default h200)")
    card.add_argument("--gpu-memory", type=positive_float, metavar="GiB",
                      help="the card's memory as CUDA reports it, instead of --gpu")
    p.add_argument("--num-gpus", type=positive_int, default=8, help="GPUs in all (default 8)")
    p.add_argument("--tp", type=positive_int, help="tensor-parallel size (default --num-gpus; the rest are replicas)")
    p.add_argument("--dcp", type=positive_int, default=1, help="decode context parallel size, divides TP (default 1)")
    p.add_argument("--ep", type=positive_int, default=1, help="expert parallel size: whole experts per GPU (default 1)")
    p.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16", help="latent cache dtype (default bf16)")
    p.add_argument("--mem-fraction", type=_fraction, default=DEFAULT_MEM_FRACTION,
                   help="share of the card for weights + KV + overhead, as vLLM's gpu_memory_utilization (default 0.9)")
    p.add_argument("--overhead", type=non_negative_float, default=DEFAULT_OVERHEAD_BYTES / GiB, metavar="GiB",
                   help="activations, CUDA graphs, communication buffers (default 4)")
    p.add_argument("--context", type=positive_int, help="tokens per request, prompt + new (default: the model's limit)")
    p.add_argument("--concurrency", type=positive_int, default=1, help="requests at once (default 1)")
    p.add_argument("--drafter", help=f"a DFlash preset ({', '.join(DRAFTERS)}) or a config.json path or directory")
    p.add_argument("--tree-budget", type=non_negative_int,
                   help=f"DDTree verify budget B (default {DEFAULT_TREE_BUDGET} with --drafter, else 0)")
    p.add_argument("--page-size", type=positive_int, default=DEFAULT_PAGE_SIZE, help="tokens per KV page (default 64)")
    p.add_argument("--vision", action="store_true", help="count the K2.5/K2.6 vision tower (this engine skips it)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--plot", metavar="FILE.png", help="draw KV tokens against the memory fraction (needs matplotlib)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.plot and not have_matplotlib():
        parser.error("--plot needs matplotlib, which is not installed (pip install matplotlib)")
    try:
        result = run(args.model, gpu=args.gpu, gpu_memory_gib=args.gpu_memory, num_gpus=args.num_gpus, tp=args.tp,
                     dcp=args.dcp, ep=args.ep, kv_dtype=args.kv_dtype, mem_fraction=args.mem_fraction,
                     overhead_gib=args.overhead, context=args.context, concurrency=args.concurrency,
                     drafter=args.drafter, tree_budget=args.tree_budget, page_size=args.page_size, vision=args.vision)
    except ValueError as e:
        parser.error(str(e))
    print(json.dumps(result.as_dict(), indent=2) if args.json else result.table())
    if args.plot:
        plot(result.target, result.drafter, result.plan.deployment, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


__all__ = ["run", "plan", "Result", "build_parser", "main"]
