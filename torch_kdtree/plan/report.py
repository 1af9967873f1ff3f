"""The planner's output: the table, the assumptions behind it, the JSON object and the plot."""
from __future__ import annotations

import importlib.util
from dataclasses import replace

from .advice import Fix
from .memory import (ACTIVATION_ROWS, Deployment, Plan, drafter_kv_bytes_per_token, kv_bytes_per_token,
                     kv_bytes_per_token_per_layer, kv_pool_bytes, tokens_for_memory)
from .presets import GiB
from .shapes import DrafterShape, TargetShape

GROUP_LABELS = {
    "routed_experts": "routed experts", "attention": "attention (MLA)", "dense_mlp": "dense MLP (layer 0)",
    "shared_experts": "shared experts", "router": "routers + bias", "norms": "norms",
    "embedding": "embedding (replicated)", "lm_head": "lm_head (by vocabulary)", "vision": "vision tower (--vision)",
    "drafter": "drafter", "overhead": "overhead (--overhead)", "verify_scratch": "step scratch (+ AR tap store)",
}


def assumptions(t: TargetShape, d: DrafterShape | None, dep: Deployment, sources: list[str]) -> list[str]:
    """Every assumption the numbers rest on, in words (the run's presets first)."""
    out = list(sources)
    out += [
        "Placement is this engine's TP plan (issue 46): embedding, q_a/kv_a projections, norms, router "
        "replicated; q_b/kv_b by head, o_proj by input; dense MLP, shared and routed experts by intermediate "
        "size (whole experts per GPU with --ep > 1); lm_head by vocabulary. vLLM also shards the embedding by "
        f"vocabulary: {t.vocab * t.hidden * 2 * (dep.tp - 1) / dep.tp / GiB:.2f} GiB less per GPU at TP {dep.tp}.",
        "Weights: " + {
            "int": f"routed experts INT{t.weights.bits}, packed, with a bf16 scale per {t.weights.group_size} inputs "
                   "(compressed-tensors; its weight_shape tensors, ~0.5 MB, left out)",
            "fp8": "every projection in the layers e4m3 with an fp32 scale per "
                   f"{t.weights.block[0]}x{t.weights.block[1]} block",
            "bf16": "all bf16 (no quantization_config)"}[t.weights.kind]
        + "; the rest bf16, the routing bias fp32.",
        "Latent cache: (kv_lora_rank + qk_rope_head_dim) values per token and layer, held whole by every TP rank; "
        "--dcp N gives each of N TP ranks 1/N of every request's tokens (vLLM's decode context parallelism; this "
        "engine has no DCP yet). fp8 = the engine's layout: one e4m3 byte per latent value, the rope part in bf16, "
        "and an fp32 scale per token and layer (644 B per token and layer for K2, against 1152 B in bf16).",
        "Per request the engine reserves prompt + new + L + max(budget + 1, L) + 2 tokens in whole pages "
        "(GenerationSession), and the drafter keeps K/V of every context token (slots rounded to 16); both come "
        "out of one pool, as the headline KV tokens per GPU counts them.",
        f"Overhead (--overhead) covers the CUDA context, NCCL buffers, CUDA-graph pools and a prefill chunk's "
        f"activations: {dep.overhead_bytes / GiB:.2f} GiB. The 4 GiB default is an assumption; vLLM's K2-Thinking "
        "log (46.80 GiB of KV at fraction 0.90 on 8x H200 TP-8) implies ~8 GiB for vLLM.",
        f"Verify scratch: per request, fp32 logits over the GPU's vocabulary slice for the B + 1 tree nodes and "
        f"the L draft depths, and {ACTIVATION_ROWS} hidden-sized bf16 rows per node (an estimate).",
        "--mem-fraction has vLLM's meaning: the share of the card (as CUDA reports it) for weights, KV and "
        "overhead.",
    ]
    if t.vision is not None:
        out.append(f"Vision tower (MoonViT + projector, ~{t.vision.parameters / 1e9:.2f} B parameters): this engine "
                   "loads the text model only, so it counts only with --vision, in bf16 and replicated (vLLM's "
                   "--mm-encoder-tp-mode data).")
    if t.weights.kind == "fp8":
        out.append("This engine's loader reads bf16 and INT4 checkpoints only: the FP8 sizes are what another engine "
                   "would hold.")
    if d is not None:
        out.append("Drafter: bf16 weights sharded like the target (heads, MLP and fc over TP; KV heads split up to "
                   "their count), embedding and lm_head borrowed; its KV is not split by DCP.")
    return out


def plan_dict(t: TargetShape, plan: Plan, fix_list: list[Fix], grid: dict, labels: dict, notes: list[str]) -> dict:
    """The --json object: every Plan field, the fixes, the grid, the inputs and the assumptions."""
    out = plan.as_dict()
    out.update(labels)
    out["fixes"] = [{"flags": f.flags, "why": f.why} for f in fix_list]
    out["what_if"] = grid
    out["assumptions"] = notes
    out["weights_format"] = t.weights.describe()
    return out


def _gib(n: int | float) -> str:
    return f"{n / GiB:8.2f}"


def table(t: TargetShape, d: DrafterShape | None, plan: Plan, fix_list: list[Fix], grid: dict, labels: dict,
          notes: list[str]) -> str:
    dep = plan.deployment
    lines = [
        f"{labels['model']} on {dep.num_gpus} x {labels['gpu']} ({dep.gpu_bytes / GiB:.2f} GiB each): TP {dep.tp} "
        f"x {dep.replicas} replica(s), DCP {dep.dcp}, EP {dep.ep}; KV {dep.kv_dtype}, page {dep.page_size} tokens",
        f"memory fraction {dep.mem_fraction:.2f} -> {_gib(plan.usable_bytes_per_gpu).strip()} GiB usable per GPU",
        "",
        f"{'per GPU':44s}{'GiB':>8s}",
    ]
    rest = ("overhead", "verify_scratch")
    for group, n in plan.fixed_bytes_per_gpu.items():
        if group not in rest:
            label = GROUP_LABELS.get(group, group)
            label += f" ({t.weights.describe()})" if group == "routed_experts" else ""
            lines.append(f"  {label:42s}{_gib(n)}")
    lines.append(f"  {'= weights':42s}{_gib(plan.weights_bytes_per_gpu)}")
    lines += [f"  {GROUP_LABELS[group]:42s}{_gib(plan.fixed_bytes_per_gpu[group])}" for group in rest]
    lines.append(f"  {'= KV pool (latent cache + drafter KV)':42s}{_gib(plan.kv_pool_bytes_per_gpu)}")
    per_layer = kv_bytes_per_token_per_layer(t, dep.kv_dtype)
    lines += [
        "",
        f"KV bytes per token     {plan.kv_bytes_per_token:,} B = {t.layers} layers x ({t.kv_lora} + {t.qk_rope}) x "
        f"{per_layer // t.latent_dim} B, held whole by each of {dep.tp} TP ranks; / DCP {dep.dcp} -> "
        f"{plan.kv_bytes_per_token_per_gpu:,.0f} B per GPU"
        + (f" (+ drafter {plan.drafter_kv_bytes_per_token_per_gpu:,} B)" if d is not None else ""),
        f"KV tokens per GPU      {plan.kv_tokens_per_gpu:,}"
        + (f" ({plan.kv_tokens_per_replica:,} per replica with DCP {dep.dcp})" if dep.dcp > 1 else ""),
        f"request                {dep.context:,} tokens x {dep.concurrency} concurrent ({dep.requests_per_replica} per "
        f"replica), tree budget {dep.tree_budget}: reserves {plan.reserved_tokens_per_request:,} tokens each, "
        f"{plan.request_bytes_per_gpu / GiB:.2f} GiB per GPU",
        f"longest context        {plan.max_context_per_request:,} tokens per request at concurrency "
        f"{dep.concurrency} (memory allows {plan.max_context_by_memory:,}; the model {t.max_positions:,})",
        f"most requests          {plan.max_concurrency} concurrent at {dep.context:,} tokens",
        f"fits                   {'YES' if plan.fits else 'NO: ' + '; '.join(plan.reasons)}",
    ]
    if fix_list:
        lines += ["", "smallest changes that make it fit:"]
        lines += [f"  {f.flags:32s} {f.why}" for f in fix_list]
    lines += ["", "what if: most concurrent requests at each context (- none fits, x beyond the model's positions)"]
    head = f"  {'KV':5s}{'DCP':>4s}" + "".join(f"{c:>10,}" for c in grid["contexts"])
    lines.append(head)
    for row in grid["rows"]:
        cells = "".join(f"{'x' if n is None else '-' if n == 0 else n:>10}" for n in row["max_concurrency"])
        lines.append(f"  {row['kv_dtype']:5s}{row['dcp']:>4d}{cells}")
    lines += ["", "assumptions:"] + [f"  - {n}" for n in notes]
    return "\n".join(lines)


def plot(t: TargetShape, d: DrafterShape | None, dep: Deployment, path: str) -> None:
    """KV tokens per replica (what a request sees) against the memory fraction, one line per
    KV dtype x DCP, with the tokens the request needs as a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fractions = [f / 100 for f in range(50, 101)]
    fig, ax = plt.subplots(figsize=(8, 5))
    for kv_dtype in ("bf16", "fp8"):
        for dcp in [n for n in range(1, dep.tp + 1) if dep.tp % n == 0]:
            option = replace(dep, kv_dtype=kv_dtype, dcp=dcp)
            per_token = kv_bytes_per_token(t, kv_dtype)
            drafter = drafter_kv_bytes_per_token(d, dep.tp) if d is not None else 0
            ys = [dcp * tokens_for_memory(kv_pool_bytes(t, d, replace(option, mem_fraction=f)),
                                          per_token + dcp * drafter, dep.page_size) for f in fractions]
            ax.plot(fractions, ys, label=f"{kv_dtype}, DCP {dcp}")
    need = dep.requests_per_replica * dep.context
    ax.axhline(need, color="black", linestyle="--", label=f"{dep.concurrency} x {dep.context:,} tokens")
    ax.set_xlabel("memory fraction")
    ax.set_ylabel("KV tokens per replica")
    ax.set_title(f"KV capacity, {dep.num_gpus} GPUs of {dep.gpu_bytes / GiB:.1f} GiB, TP {dep.tp}")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


__all__ = ["assumptions", "plan_dict", "table", "plot", "have_matplotlib"]
