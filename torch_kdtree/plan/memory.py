"""Bytes on one GPU: weights under TP / EP, the MLA latent cache, what the engine reserves per
request, and whether a context at a concurrency fits a card.

Placement is this engine's tensor-parallel plan (docs/parallel.md, issue 46): embedding,
q_a / kv_a projections, norms and router replicated; q_b / kv_b by head, o_proj by input; the
dense and shared MLPs and the routed experts by intermediate size (or whole experts per GPU with
EP); lm_head by vocabulary.  The latent cache is replicated on every TP rank (each writes the
same rows); decode context parallelism (DCP) gives each of ``dcp`` ranks 1/dcp of every
request's tokens.  Per request the engine reserves what ``GenerationSession`` allocates: the
context plus a tree in flight, rounded up to pages, and the drafter's K/V of every context token.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from .presets import GiB
from .shapes import DrafterShape, TargetShape, WeightFormat, ceil_div

KV_DTYPE_BYTES = {"bf16": 2, "fp8": 1}  # the latent part's bytes per value
# KimiK2Cache's fp8 layout (models/kimi_k2/cache.py): the latent in e4m3 with one fp32 scale per token and
# layer, the rope part in bf16.
KV_SCALE_BYTES = {"bf16": 0, "fp8": 4}
KV_ROPE_BYTES = 2  # either dtype
DEFAULT_PAGE_SIZE = 64  # KimiK2Cache's default page; also vLLM's FlashMLA block size
DEFAULT_MEM_FRACTION = 0.9  # vLLM's default gpu_memory_utilization
# CUDA context, NCCL buffers, CUDA-graph pools, a prefill chunk's activations: an assumption, not a
# measurement (vLLM's K2-Thinking log on 8x H200 implies ~8 GiB for vLLM's own profile-run peak).
DEFAULT_OVERHEAD_BYTES = 4 * GiB
DRAFTER_SLOT_ALIGN = 16  # DFlashDraftModel.setup_cache rounds its context slots up to 16
ACTIVATION_ROWS = 16  # hidden-sized bf16 rows alive per verified tree node (an estimate)
# A drafter session's store of AR steps' taps per request (models/generation/session.py DEFER_ROWS; a
# test keeps the two equal: this package imports no torch): rows of taps x hidden bf16 values.
TAP_STORE_ROWS = 128

REPLICATE, ROWS, COLS = "replicate", "rows", "cols"  # how TP splits a [rows, cols] weight
# Weight groups each checkpoint format stores quantised; the rest is bf16 (fp32 where marked).
QUANTISED_GROUPS = {"bf16": set(), "int": {"routed_experts"},
                    "fp8": {"attention", "dense_mlp", "shared_experts", "routed_experts"}}


@dataclass(frozen=True)
class Tensor:
    """``count`` copies of a [rows, cols] weight and how TP places it."""

    name: str
    group: str
    rows: int
    cols: int
    count: int
    split: str = REPLICATE
    per_expert: bool = False      # one per routed expert (count is per expert)
    dtype_bytes: int | None = None  # fixed element size; None: bf16 or the checkpoint's format
    max_parts: int | None = None  # distinct shards at most (GQA KV heads), replicated beyond


def target_tensors(t: TargetShape) -> list[Tensor]:
    """Every weight of the text model (norms as [n, 1]; MTP layers are not loaded and not listed)."""
    L, Lm, H = t.layers, t.moe_layers, t.hidden
    qk = t.qk_nope + t.qk_rope
    shared = t.moe_intermediate * t.shared_experts
    out = [
        Tensor("kv_a_proj_with_mqa", "attention", t.latent_dim, H, L),
        Tensor("kv_b_proj (by head)", "attention", t.heads * (t.qk_nope + t.v_head), t.kv_lora, L, ROWS),
        Tensor("o_proj (by input)", "attention", H, t.heads * t.v_head, L, COLS),
        Tensor("layer norms", "norms", 2 * H + t.kv_lora + (t.q_lora or 0), 1, L, dtype_bytes=2),
    ]
    if t.q_lora:
        out += [Tensor("q_a_proj", "attention", t.q_lora, H, L),
                Tensor("q_b_proj (by head)", "attention", t.heads * qk, t.q_lora, L, ROWS)]
    else:
        out.append(Tensor("q_proj (by head)", "attention", t.heads * qk, H, L, ROWS))
    out += [
        Tensor("dense gate/up", "dense_mlp", t.dense_intermediate, H, 2 * t.dense_layers, ROWS),
        Tensor("dense down", "dense_mlp", H, t.dense_intermediate, t.dense_layers, COLS),
        Tensor("shared gate/up", "shared_experts", shared, H, 2 * Lm, ROWS),
        Tensor("shared down", "shared_experts", H, shared, Lm, COLS),
        Tensor("router", "router", t.experts, H, Lm, dtype_bytes=2),
        Tensor("e_score_correction_bias", "router", t.experts, 1, Lm, dtype_bytes=4),
        Tensor("expert gate/up", "routed_experts", t.moe_intermediate, H, 2 * Lm, ROWS, per_expert=True),
        Tensor("expert down", "routed_experts", H, t.moe_intermediate, Lm, COLS, per_expert=True),
        Tensor("embed_tokens", "embedding", t.vocab, H, 1, dtype_bytes=2),
        Tensor("final norm", "norms", H, 1, 1, dtype_bytes=2),
    ]
    if not t.tied_embeddings:
        out.append(Tensor("lm_head (by vocabulary)", "lm_head", t.vocab, H, 1, ROWS, dtype_bytes=2))
    return out


def drafter_tensors(d: DrafterShape) -> list[Tensor]:
    """A DFlash drafter's weights, sharded like the target (issue 46): heads, MLP and fc over TP."""
    H, L, b = d.hidden, d.layers, d.dtype_bytes
    return [
        Tensor("fc (by input)", "drafter", H, d.taps * H, 1, COLS, dtype_bytes=b),
        Tensor("q_proj", "drafter", d.heads * d.head_dim, H, L, ROWS, dtype_bytes=b),
        Tensor("k_proj/v_proj", "drafter", d.kv_heads * d.head_dim, H, 2 * L, ROWS, dtype_bytes=b,
               max_parts=d.kv_heads),
        Tensor("o_proj", "drafter", H, d.heads * d.head_dim, L, COLS, dtype_bytes=b),
        Tensor("gate/up", "drafter", d.intermediate, H, 2 * L, ROWS, dtype_bytes=b),
        Tensor("down", "drafter", H, d.intermediate, L, COLS, dtype_bytes=b),
        Tensor("norms", "drafter", 2 * H + 2 * H * L + 2 * d.head_dim * L, 1, 1, dtype_bytes=b),
    ]


def _shard(n: int, parts: int, name: str) -> int:
    if n % parts:
        raise ValueError(f"{name}: {n} does not split evenly over {parts} GPUs")
    return n // parts


def stored_bytes(t: Tensor, fmt: WeightFormat, rows: int, cols: int) -> int:
    """Bytes of one [rows, cols] copy of ``t`` as stored (quantised with its scales where the format
    covers ``t``'s group)."""
    if t.dtype_bytes is not None:
        return rows * cols * t.dtype_bytes
    if t.group in QUANTISED_GROUPS[fmt.kind]:
        if fmt.kind == "int":  # packed along the input; one bf16 scale per group of inputs
            if cols % fmt.group_size:
                raise ValueError(f"{t.name}: {cols} inputs per GPU is not a whole number of "
                                 f"{fmt.group_size}-wide scale groups")
            return rows * cols * fmt.bits // 8 + rows * (cols // fmt.group_size) * 2
        bn, bk = fmt.block  # fp8: one byte a weight, an fp32 scale per block
        return rows * cols + ceil_div(rows, bn) * ceil_div(cols, bk) * 4
    return rows * cols * 2


def tensor_bytes_per_gpu(t: Tensor, fmt: WeightFormat, tp: int, ep: int = 1, experts: int = 1) -> int:
    rows, cols, count = t.rows, t.cols, t.count
    if t.per_expert and ep > 1:
        count *= ceil_div(experts, ep)  # whole experts on each GPU
    else:
        count *= experts if t.per_expert else 1
        parts = min(tp, t.max_parts or tp)
        if t.split == ROWS:
            rows = _shard(rows, parts, t.name)
        elif t.split == COLS:
            cols = _shard(cols, parts, t.name)
    return count * stored_bytes(t, fmt, rows, cols)


def weights_per_gpu(t: TargetShape, tp: int = 1, ep: int = 1) -> dict[str, int]:
    """Target weight bytes on one GPU by group (``tp = ep = 1``: the whole checkpoint)."""
    out: dict[str, int] = {}
    for w in target_tensors(t):
        out[w.group] = out.get(w.group, 0) + tensor_bytes_per_gpu(w, t.weights, tp, ep, t.experts)
    return out


def drafter_weights_per_gpu(d: DrafterShape, tp: int = 1) -> int:
    return sum(tensor_bytes_per_gpu(w, WeightFormat(), tp) for w in drafter_tensors(d))


def vision_weights(t: TargetShape) -> int:
    """The vision tower and projector in bf16, replicated (vLLM's ``--mm-encoder-tp-mode data``)."""
    return 2 * t.vision.parameters if t.vision else 0


# ---------------------------------------------------------------------------- KV cache


def kv_bytes_per_token_per_layer(t: TargetShape, kv_dtype: str = "bf16") -> int:
    """The latent row (and its scale, fp8) of one token in one layer: 1152 B in bf16, 644 B in fp8 for K2
    (512 e4m3 latent values + 64 bf16 rope values + a 4-byte scale)."""
    return t.kv_lora * KV_DTYPE_BYTES[kv_dtype] + t.qk_rope * KV_ROPE_BYTES + KV_SCALE_BYTES[kv_dtype]


def kv_bytes_per_token(t: TargetShape, kv_dtype: str = "bf16") -> int:
    """One token's latent rows over every layer: one copy, held whole by every TP rank."""
    return t.layers * kv_bytes_per_token_per_layer(t, kv_dtype)


def drafter_kv_bytes_per_token(d: DrafterShape, tp: int = 1) -> int:
    """The drafter's K and V of one context token on one GPU (its KV heads split over TP up to their count)."""
    return d.layers * 2 * (d.kv_heads // min(tp, d.kv_heads)) * d.head_dim * d.dtype_bytes


def cache_tokens_per_request(context: int, tree_budget: int = 0, block_size: int = 1) -> int:
    """Tokens GenerationSession makes KimiK2Cache hold per request: the context (prompt + new), the
    draft block's L = block_size - 1 and the tree's nodes in flight, and two spare rows."""
    L = block_size - 1
    return context + L + max(tree_budget + 1, L) + 2


def tokens_for_memory(kv_bytes: int, bytes_per_token: int, page_size: int = DEFAULT_PAGE_SIZE) -> int:
    """Whole pages of ``bytes_per_token`` tokens that fit in ``kv_bytes`` (vLLM's block count too)."""
    return max(0, kv_bytes) // (page_size * bytes_per_token) * page_size


def engine_cache_bytes(t: TargetShape, requests: int, context: int, *, tree_budget: int = 0, block_size: int = 1,
                       page_size: int = DEFAULT_PAGE_SIZE, kv_dtype: str = "bf16", dcp: int = 1) -> int:
    """What KimiK2Cache allocates on one GPU: ``kv`` [layers, pages, page_size, D] (and fp8's
    ``kv_scale`` [layers, pages, page_size]), ``block_table`` int32 [R, pages per request] and
    ``lengths`` int32 [R]; with DCP a GPU keeps 1/dcp of the tokens."""
    tokens = ceil_div(cache_tokens_per_request(context, tree_budget, block_size), dcp)
    pages = ceil_div(tokens, page_size)
    return requests * (pages * page_size * kv_bytes_per_token(t, kv_dtype) + pages * 4 + 4)


def drafter_cache_bytes(d: DrafterShape, requests: int, context: int, tp: int = 1) -> int:
    """The drafter's context K/V (capacity prompt + new + L + 2, plus a block, rounded to 16 slots)
    and its int64 lengths, on one GPU."""
    slots = ceil_div(context + d.depths + 2 + d.block_size, DRAFTER_SLOT_ALIGN) * DRAFTER_SLOT_ALIGN
    return requests * (slots * drafter_kv_bytes_per_token(d, tp) + 8)


def tap_store_bytes(t: TargetShape, d: DrafterShape | None, requests: int) -> int:
    """The AR steps' stored taps of a session with a drafter (its context projection runs for them in
    one batch before the next tree step): TAP_STORE_ROWS rows of taps x hidden bf16 values a request."""
    return 0 if d is None else requests * TAP_STORE_ROWS * d.taps * t.hidden * 2


def verify_scratch_bytes(t: TargetShape, d: DrafterShape | None, tree_budget: int, requests: int, tp: int) -> int:
    """Activations of a step that scale with budget x batch: fp32 logits over this GPU's vocabulary
    slice for the B + 1 tree nodes and the L draft depths, and ACTIVATION_ROWS hidden rows per node;
    with a drafter, also the AR steps' tap store (:func:`tap_store_bytes`)."""
    nodes, depths = tree_budget + 1, d.depths if d is not None else 0
    per_request = (nodes + depths) * (t.vocab // tp) * 4 + nodes * t.hidden * 2 * ACTIVATION_ROWS
    return requests * per_request + tap_store_bytes(t, d, requests)


# ---------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Deployment:
    """Where and how the model runs (the CLI's flags)."""

    gpu_bytes: int
    num_gpus: int = 8
    tp: int = 8
    dcp: int = 1
    ep: int = 1
    kv_dtype: str = "bf16"
    mem_fraction: float = DEFAULT_MEM_FRACTION
    overhead_bytes: int = DEFAULT_OVERHEAD_BYTES
    context: int = 262144
    concurrency: int = 1
    tree_budget: int = 0
    page_size: int = DEFAULT_PAGE_SIZE
    vision: bool = False

    @property
    def replicas(self) -> int:
        """Data-parallel copies of the TP group (each holds its own KV)."""
        return self.num_gpus // self.tp

    @property
    def requests_per_replica(self) -> int:
        return ceil_div(self.concurrency, self.replicas)


def check_deployment(t: TargetShape, d: DrafterShape | None, dep: Deployment) -> None:
    """Raise ValueError naming every setting that cannot work (then every weight must split)."""
    bad = []
    if min(dep.num_gpus, dep.tp, dep.dcp, dep.ep, dep.context, dep.concurrency, dep.page_size) < 1:
        bad.append("num_gpus, tp, dcp, ep, context, concurrency and page_size must be >= 1")
    elif dep.num_gpus % dep.tp:
        bad.append(f"TP {dep.tp} does not divide {dep.num_gpus} GPUs")
    elif dep.tp % dep.dcp:
        bad.append(f"DCP {dep.dcp} must divide TP {dep.tp} (DCP ranks are TP ranks)")
    elif dep.num_gpus % dep.ep or dep.ep > t.experts:
        bad.append(f"EP {dep.ep} must divide {dep.num_gpus} GPUs and be at most {t.experts} experts")
    if dep.kv_dtype not in KV_DTYPE_BYTES:
        bad.append(f"kv_dtype {dep.kv_dtype!r} is not one of {sorted(KV_DTYPE_BYTES)}")
    if not 0 < dep.mem_fraction <= 1:
        bad.append(f"mem_fraction {dep.mem_fraction} is not in (0, 1]")
    if dep.overhead_bytes < 0 or dep.tree_budget < 0:
        bad.append("overhead and tree_budget must be >= 0")
    if dep.tree_budget and d is None:
        bad.append("a tree budget needs a drafter")
    if bad:
        raise ValueError("; ".join(bad))
    weights_per_gpu(t, dep.tp, dep.ep)  # raises for a weight TP cannot split
    if d is not None:
        if d.hidden != t.hidden:
            raise ValueError(f"drafter hidden_size {d.hidden} differs from the target's {t.hidden}")
        drafter_weights_per_gpu(d, dep.tp)


def _fixed_bytes(t: TargetShape, d: DrafterShape | None, dep: Deployment) -> dict[str, int]:
    """Everything on a GPU but the KV: weights by group, overhead and scratch."""
    out = weights_per_gpu(t, dep.tp, dep.ep)
    if dep.vision and t.vision is not None:
        out["vision"] = vision_weights(t)
    if d is not None:
        out["drafter"] = drafter_weights_per_gpu(d, dep.tp)
    out["overhead"] = dep.overhead_bytes
    out["verify_scratch"] = verify_scratch_bytes(t, d, dep.tree_budget, dep.requests_per_replica, dep.tp)
    return out


def kv_pool_bytes(t: TargetShape, d: DrafterShape | None, dep: Deployment) -> int:
    """Bytes left for the target's and the drafter's KV on one GPU (negative: weights do not fit)."""
    return int(dep.mem_fraction * dep.gpu_bytes) - sum(_fixed_bytes(t, d, dep).values())


def request_bytes_per_gpu(t: TargetShape, d: DrafterShape | None, dep: Deployment, context: int) -> int:
    """KV one request of ``context`` tokens reserves on one GPU (target cache + drafter cache)."""
    block = d.block_size if d is not None else 1
    out = engine_cache_bytes(t, 1, context, tree_budget=dep.tree_budget, block_size=block,
                             page_size=dep.page_size, kv_dtype=dep.kv_dtype, dcp=dep.dcp)
    return out + (drafter_cache_bytes(d, 1, context, dep.tp) if d is not None else 0)


def fits(t: TargetShape, d: DrafterShape | None, dep: Deployment) -> bool:
    if t.max_positions and dep.context > t.max_positions:
        return False
    pool = kv_pool_bytes(t, d, dep)
    return pool >= 0 and dep.requests_per_replica * request_bytes_per_gpu(t, d, dep, dep.context) <= pool


def largest(ok, lo: int, hi: int) -> int:
    """The largest n in [lo, hi] with ok(n), for ok true up to some n and false beyond; lo - 1 if none."""
    if not ok(lo):
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def max_concurrency(t: TargetShape, d: DrafterShape | None, dep: Deployment) -> int:
    """Most concurrent requests of ``dep.context`` tokens that fit (0: not even one)."""
    return largest(lambda n: fits(t, d, replace(dep, concurrency=n)), 1, 1 << 24)


@dataclass
class Plan:
    """The numbers of one deployment (``as_dict`` is the CLI's --json)."""

    deployment: Deployment
    fixed_bytes_per_gpu: dict[str, int] = field(default_factory=dict)
    weights_bytes_per_gpu: int = 0
    usable_bytes_per_gpu: int = 0
    kv_pool_bytes_per_gpu: int = 0
    kv_bytes_per_token_per_layer: int = 0
    kv_bytes_per_token: int = 0
    kv_bytes_per_token_per_gpu: float = 0.0
    drafter_kv_bytes_per_token_per_gpu: int = 0
    kv_tokens_per_gpu: int = 0
    kv_tokens_per_replica: int = 0
    reserved_tokens_per_request: int = 0
    request_bytes_per_gpu: int = 0
    max_context_by_memory: int = 0
    max_context_per_request: int = 0
    max_concurrency: int = 0
    model_max_positions: int = 0
    fits: bool = False
    reasons: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def evaluate(t: TargetShape, d: DrafterShape | None, dep: Deployment) -> Plan:
    """Every number of the plan for one deployment (see :class:`Plan`)."""
    check_deployment(t, d, dep)
    fixed = _fixed_bytes(t, d, dep)
    pool = kv_pool_bytes(t, d, dep)
    R = dep.requests_per_replica
    per_token = kv_bytes_per_token(t, dep.kv_dtype)
    drafter_token = drafter_kv_bytes_per_token(d, dep.tp) if d is not None else 0
    # A GPU keeps 1/dcp of the latent rows but the drafter's rows of every token.
    tokens_gpu = tokens_for_memory(pool, per_token + dep.dcp * drafter_token, dep.page_size)
    by_memory = largest(lambda c: R * request_bytes_per_gpu(t, d, dep, c) <= pool, 1, 1 << 40)
    plan = Plan(
        deployment=dep, fixed_bytes_per_gpu=fixed,
        weights_bytes_per_gpu=sum(v for k, v in fixed.items() if k not in ("overhead", "verify_scratch")),
        usable_bytes_per_gpu=int(dep.mem_fraction * dep.gpu_bytes), kv_pool_bytes_per_gpu=pool,
        kv_bytes_per_token_per_layer=kv_bytes_per_token_per_layer(t, dep.kv_dtype), kv_bytes_per_token=per_token,
        kv_bytes_per_token_per_gpu=per_token / dep.dcp,
        drafter_kv_bytes_per_token_per_gpu=drafter_token, kv_tokens_per_gpu=tokens_gpu,
        kv_tokens_per_replica=tokens_gpu * dep.dcp,
        reserved_tokens_per_request=cache_tokens_per_request(dep.context, dep.tree_budget,
                                                             d.block_size if d is not None else 1),
        request_bytes_per_gpu=R * request_bytes_per_gpu(t, d, dep, dep.context),
        max_context_by_memory=max(0, by_memory),
        max_context_per_request=max(0, min(by_memory, t.max_positions or by_memory)),
        max_concurrency=max_concurrency(t, d, dep), model_max_positions=t.max_positions,
        fits=fits(t, d, dep))
    if pool < 0:
        plan.reasons.append(f"weights, overhead and scratch exceed the usable memory by {-pool / GiB:.2f} GiB")
    elif plan.request_bytes_per_gpu > pool:
        plan.reasons.append(f"the KV of {dep.concurrency} x {dep.context:,} tokens needs "
                            f"{plan.request_bytes_per_gpu / GiB:.2f} GiB per GPU, {pool / GiB:.2f} GiB is left")
    if t.max_positions and dep.context > t.max_positions:
        plan.reasons.append(f"{dep.context:,} tokens is beyond the model's {t.max_positions:,} positions")
    return plan


__all__ = ["KV_DTYPE_BYTES", "DEFAULT_PAGE_SIZE", "DEFAULT_MEM_FRACTION", "DEFAULT_OVERHEAD_BYTES", "Tensor",
           "target_tensors", "drafter_tensors", "stored_bytes", "tensor_bytes_per_gpu", "weights_per_gpu",
           "drafter_weights_per_gpu", "vision_weights", "kv_bytes_per_token_per_layer", "kv_bytes_per_token",
           "drafter_kv_bytes_per_token", "cache_tokens_per_request", "tokens_for_memory", "engine_cache_bytes",
           "drafter_cache_bytes", "verify_scratch_bytes", "tap_store_bytes", "Deployment", "check_deployment", "kv_pool_bytes",
           "request_bytes_per_gpu", "fits", "largest", "max_concurrency", "Plan", "evaluate"]
