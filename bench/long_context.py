"""Pure helpers of bench/bench_long_context.py (no GPU): the context list and its names, the
memory arithmetic (latent cache, weights, prefill transients) against one H200, the wall-time
estimate of a run, and the step table it prints.  tests/test_bench_long_context.py checks them."""
from __future__ import annotations

import argparse
from typing import NamedTuple, Sequence

from torch_kdtree.plan.memory import KV_DTYPE_BYTES, KV_ROPE_BYTES, KV_SCALE_BYTES, cache_tokens_per_request

KI = 1024
# K2's window: 262,144 positions (max_position_embeddings); "256k" is that many tokens.
WINDOW = 262_144
# The contexts of issue 50's table ("1k ... 256k", k = 1024 as in bench_mla_tree_attention).
CONTEXTS = (1 * KI, 4 * KI, 16 * KI, 64 * KI, 128 * KI, 200 * KI, 256 * KI)
# Tokens the timed steps at one context may add (a warm step and 16 timed steps per budget, up to
# block_size tokens each at B = 16): a prompt is cut to WINDOW - RESERVE so every timed position
# stays inside K2's window.
RESERVE = 256
CACHE_DTYPES = ("bf16", "fp8")
H200_BYTES = 141e9  # HBM of one H200 (nvidia-smi: 143,771 MiB; ~139 GiB usable)
PREFILL_CHUNK = 8192  # models/kimi_k2/modeling.py's PREFILL_CHUNK (the default chunk)


def context_label(n: int) -> str:
    """1024 -> "1k", 204800 -> "200k"; other counts as they are."""
    return f"{n // KI}k" if n % KI == 0 else str(n)


def parse_context(raw: str) -> int:
    """"16k" (x 1024) or a plain token count, >= 1."""
    text = raw.strip().lower()
    try:
        n = int(text[:-1]) * KI if text.endswith("k") else int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a context such as 16k or 4096, got {raw!r}")
    return n


def parse_contexts(raw: str) -> tuple[int, ...]:
    """``--long-contexts``: comma-separated contexts ("1k,64k,200k"; "all": :data:`CONTEXTS`),
    sorted, each at most :data:`WINDOW`."""
    if raw.strip().lower() == "all":
        return CONTEXTS
    contexts = sorted({parse_context(part) for part in raw.split(",") if part.strip()})
    if not contexts or contexts[-1] > WINDOW:
        raise argparse.ArgumentTypeError(f"expected contexts of at most {context_label(WINDOW)} "
                                         f"(K2's window), e.g. 1k,64k,200k; got {raw!r}")
    return tuple(contexts)


def parse_cache_dtypes(raw: str) -> tuple[str, ...]:
    """``--long-cache-dtypes``: a non-empty subset of bf16,fp8 (in that order)."""
    names = {part.strip().lower() for part in raw.split(",") if part.strip()}
    if not names or not names <= set(CACHE_DTYPES):
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(CACHE_DTYPES)}, got {raw!r}")
    return tuple(d for d in CACHE_DTYPES if d in names)


CONFIG_NAMES = ("k2_slice", "2p2b")  # bench_generate's configurations


def parse_configs(raw: str) -> tuple[str, ...]:
    """``--long-configs``: a non-empty subset of k2_slice,2p2b (in that order)."""
    names = {part.strip() for part in raw.split(",") if part.strip()}
    if not names or not names <= set(CONFIG_NAMES):
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(CONFIG_NAMES)}, got {raw!r}")
    return tuple(n for n in CONFIG_NAMES if n in names)


def prompt_length(context: int) -> int:
    """The prompt prefilled for a context: the context, cut so the timed steps stay in the window."""
    return min(context, WINDOW - RESERVE)


# --------------------------------------------------------------------------------------------
# memory
# --------------------------------------------------------------------------------------------

def cache_bytes_per_token(config: dict, kv_cache_dtype: str) -> int:
    """Bytes one token takes in the latent cache over all layers (KimiK2Cache.bytes_per_token):
    bf16 rows of kv_lora_rank + qk_rope_head_dim; fp8 one byte per latent value, the rope part in
    bf16, and a 4-byte scale."""
    latent, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
    per_layer = latent * KV_DTYPE_BYTES[kv_cache_dtype] + rope * KV_ROPE_BYTES + KV_SCALE_BYTES[kv_cache_dtype]
    return config["num_hidden_layers"] * per_layer


def session_capacity(max_prompt: int, max_new: int, block_size: int, budget: int) -> int:
    """Tokens per request a GenerationSession allocates (session.py: prompt + new + L + nodes + 2)."""
    return cache_tokens_per_request(max_prompt + max_new, budget, block_size)


def weight_bytes(config: dict, *, int4_experts: bool) -> int:
    """The target's weights in bytes (bf16; routed experts as INT4 nibbles + bf16 group-32 scales
    when ``int4_experts``), from the config alone."""
    c = config
    H, h = c["hidden_size"], c["num_attention_heads"]
    dn, dr, dv, dc, ql = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"], \
        c["q_lora_rank"]
    attention = (H * ql + ql + ql * h * (dn + dr) if ql else H * h * (dn + dr)) + H * (dc + dr) + dc + \
        dc * h * (dn + dv) + h * dv * H
    norms = 2 * H
    dense = 3 * H * c["intermediate_size"]
    E, I = c["n_routed_experts"], c["moe_intermediate_size"]
    shared = 3 * H * I * c.get("n_shared_experts", 0)
    routed = 3 * E * H * I
    routed_bytes = routed // 2 + routed // 32 * 2 if int4_experts else 2 * routed
    router = E * H  # bf16 weight; the score-correction bias is fp32 (E)
    layers = c["num_hidden_layers"]
    moe_layers = layers - c["first_k_dense_replace"]
    params16 = layers * (attention + norms) + c["first_k_dense_replace"] * dense + \
        moe_layers * (shared + router) + 2 * c["vocab_size"] * H + H
    return 2 * params16 + moe_layers * (routed_bytes + 4 * E)


class Memory(NamedTuple):
    """Bytes of one bench run on one GPU (the largest of its phases; all sessions alive)."""

    weights: int
    dense_experts_at_build: int  # the random target's bf16 experts, replaced by INT4 after its build
    caches: dict                 # bytes of each session's latent cache, by cache dtype
    drafter_context: int         # each session's DFlash context K/V
    prefill_kv: int              # K/V expanded over the largest context (the sdpa prefill form)
    prefill_chunk: int           # activations of one chunk (residual stream, MoE slots, latents)

    @property
    def peak(self) -> int:
        build = self.weights + self.dense_experts_at_build
        run = self.weights + sum(self.caches.values()) + len(self.caches) * self.drafter_context + \
            self.prefill_kv + self.prefill_chunk
        return max(build, run)

    def fields(self) -> dict:
        out = {"weights_GB": self.weights / 1e9, "peak_GB": self.peak / 1e9}
        out.update({f"cache_{k}_GB": v / 1e9 for k, v in self.caches.items()})
        return out


def memory(config: dict, *, int4_experts: bool, max_context: int, capacities: dict, drafter_kv_per_token: int,
           chunk: int = PREFILL_CHUNK) -> Memory:
    """The memory arithmetic of a run: ``capacities`` {cache dtype: tokens per request of its
    session}; ``drafter_kv_per_token`` the drafter's context K/V bytes per token (all layers)."""
    H, h = config["hidden_size"], config["num_attention_heads"]
    dn, dr, dv = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    D = config["kv_lora_rank"] + dr
    E, I = config["n_routed_experts"], config["moe_intermediate_size"]
    moe_layers = config["num_hidden_layers"] - config["first_k_dense_replace"]
    dense_experts = moe_layers * 3 * E * H * I * 2 if int4_experts else 0
    caches = {k: cache_bytes_per_token(config, k) * n for k, n in capacities.items()}
    # kv_b_proj's output [S, h, dn + dv] and K [S, h, dn + dr] in bf16 (KimiK2Attention._expanded)
    prefill_kv = max_context * h * (2 * dn + dv + dr) * 2
    # a few live copies of the residual stream (bf16 and fp32 norm temporaries), the MoE's gate/up
    # of k slots per token, the latent rows read from the cache (bf16 over the context)
    k = config["num_experts_per_tok"]
    prefill_chunk = chunk * (4 * H * 2 + 2 * H * 4 + 3 * k * I * 2) + max_context * D * 2
    cap = max(capacities.values(), default=0)
    return Memory(weight_bytes(config, int4_experts=int4_experts), dense_experts, caches,
                  drafter_kv_per_token * cap, prefill_kv, prefill_chunk)


# --------------------------------------------------------------------------------------------
# time
# --------------------------------------------------------------------------------------------

class Rates(NamedTuple):
    """The assumptions of :func:`wall_seconds` (H200, k2_slice; RESULTS.md and issue 44's numbers)."""

    startup: float = 45.0          # pytest, CUDA, the random target and drafters
    compile_per_graph: float = 25.0  # inductor "combo" per captured step (AR, B = 16, the oracle's look-ahead)
    attention_tflops: float = 150.0  # the prefill's causal SDPA (memory-efficient kernel, dq 192 / dv 128)
    prefill_us_per_token: float = 3.0  # projections, INT4 MoE, norms, per prompt token (4 layers)
    step_ms: float = 4.0           # a B = 16 step (~1.2-2 ms) plus the oracle's look-ahead (7 AR passes)
    fp8_step_ms: float = 30.0      # fp8 step + look-ahead: kept at the torch-attention figure (over the whole
    #                                capacity) until a GPU run times the kernel path, so the estimate stays an upper bound
    accept: float = 2.7            # tokens per DDTree step with the 80 % oracle (issue 44: 2.74)


def prefill_seconds(config: dict, tokens: int, rates: Rates = Rates()) -> float:
    """Estimated prefill seconds of a ``tokens``-long prompt: causal attention (tokens^2 / 2 pairs x
    heads x 2 (dq + dv) flops per layer) at ``attention_tflops`` plus a per-token cost."""
    h, layers = config["num_attention_heads"], config["num_hidden_layers"]
    dq = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    flops = layers * tokens * tokens / 2 * h * 2 * (dq + config["v_head_dim"])
    return flops / (rates.attention_tflops * 1e12) + tokens * rates.prefill_us_per_token * 1e-6


def wall_seconds(config: dict, contexts: Sequence[int], cache_dtypes: Sequence[str], *, drift_tokens: int,
                 drift_prompt: int, steps: int = 16, rates: Rates = Rates()) -> dict:
    """Estimated H200 seconds of one bench run, by part: ``startup``, ``compile`` (3 compiled
    graphs per session), ``prefill`` (every context per cache dtype, a warm-up prefill, the drift's
    two), ``steps`` and ``drift`` (``drift_tokens`` of B = 16 generation); ``total``."""
    sessions = len(set(cache_dtypes) | ({"bf16"} if drift_tokens else set()))
    prefill = sum(prefill_seconds(config, prompt_length(c), rates) for c in contexts) * len(cache_dtypes)
    steps_s = 0.0
    for kv in cache_dtypes:
        per_step = rates.fp8_step_ms if kv == "fp8" else rates.step_ms
        steps_s += len(contexts) * (2 * steps + 4) * per_step / 1e3
    drift = 0.0
    if drift_tokens:
        drift = drift_tokens / rates.accept * rates.step_ms / 1e3
        prefill += prefill_seconds(config, drift_prompt, rates) + prefill_seconds(config, drift_prompt + drift_tokens,
                                                                                  rates)
    parts = {"startup": rates.startup, "compile": sessions * 3 * rates.compile_per_graph, "prefill": prefill,
             "steps": steps_s, "drift": drift}
    parts["total"] = sum(parts.values())
    return parts


# --------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------

def _cell(value, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def step_table(rows: Sequence[dict], cache_dtypes: Sequence[str] = CACHE_DTYPES) -> str:
    """The table context x {AR, B = 16} x cache dtypes: per context (its label and the measured
    cache length), each dtype's prefill seconds, AR and B = 16 step ms, and the attention's share of
    each step (%).  ``rows``: dicts with ``context`` (the label's number), ``cache`` (dtype name),
    ``length`` (tokens in the cache when timed), ``prefill_s``, ``ar_ms``, ``tree_ms``,
    ``ar_attention``, ``tree_attention`` (shares in [0, 1]; None or missing: not measured)."""
    by = {(r["context"], r["cache"]): r for r in rows}
    contexts = sorted({r["context"] for r in rows})
    head = ["context", "tokens"]
    for part in ("prefill s", "AR ms", "B=16 ms", "AR attn %", "B=16 attn %"):
        head += [f"{part} {kv}" for kv in cache_dtypes]
    lines = [head]
    for c in contexts:
        present = [by[(c, kv)] for kv in cache_dtypes if (c, kv) in by]
        line = [context_label(c), str(max((r.get("length") or 0) for r in present))]
        for key, fmt, scale in (("prefill_s", ".2f", 1), ("ar_ms", ".3f", 1), ("tree_ms", ".3f", 1),
                                ("ar_attention", ".0f", 100), ("tree_attention", ".0f", 100)):
            for kv in cache_dtypes:
                v = by.get((c, kv), {}).get(key)
                line.append(_cell(None if v is None else v * scale, fmt))
        lines.append(line)
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    text = [" | ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in lines]
    text.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(text)


def drift_line(after_ms: float, fresh_ms: float, context: int, generated: int, tolerance: float = 0.03) -> str:
    """One line: the B = 16 step after ``generated`` sustained tokens against a fresh cache at the
    same context, their ratio and whether it is within ``tolerance`` (issue 50: 3 %)."""
    ratio = after_ms / fresh_ms
    verdict = "within" if abs(ratio - 1) <= tolerance else "NOT within"
    return (f"drift: B=16 step at {context} tokens after {generated} generated {after_ms:.4f} ms, fresh cache "
            f"{fresh_ms:.4f} ms, ratio {ratio:.4f} ({verdict} {tolerance:.0%})")


__all__ = ["CONTEXTS", "WINDOW", "RESERVE", "CACHE_DTYPES", "H200_BYTES", "context_label", "parse_context",
           "parse_contexts", "parse_cache_dtypes", "parse_configs", "prompt_length", "cache_bytes_per_token", "session_capacity",
           "weight_bytes", "Memory", "memory", "Rates", "prefill_seconds", "wall_seconds", "step_table", "drift_line"]
