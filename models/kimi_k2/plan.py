"""The decode plan: which implementation each layer of a forward pass runs, decided once.

A :class:`PassPlan` is computed on the host for one pass shape (tokens per request N, rows R * N,
tree pass or prefill, compiled or eager) on one :class:`Target` (device type, compute dtype, the
``kdtree`` kernels available there) from the model's config and weights.  For every layer it says
which attention form, projection kernels, router and expert path run, and why a fused kernel was
left out (a shape outside its contract, a hooked module, a DTensor weight) — once, in
``reasons``, instead of by an op's error deep inside a forward.  The model's modules keep pure-torch
reference forwards (``docs/design.md``); :mod:`.fused` runs the fused forms a plan selects.

A generation session plans each of its step shapes when it is built (``print(session.plan)``); a
model called without a plan plans that pass on the host when it is called (a prefill, eager use).
Tests assert on plans and pass them explicitly to run a path (``plan_pass(..., target=Target("cpu",
kernels=ALL))`` runs the fused forms on the CPU, through the ops' reference kernels).

Field values:

- ``attention``: ``expanded`` (prefill: K/V per head, SDPA), ``torch`` (absorbed MQA over the
  paged cache in torch ops: any latent size, any cache), ``tree_op`` (``kdtree::mla_tree_attention``,
  K2's 512 + 64 latent; the only kernel form over an fp8 cache, whose e4m3 rows and scales it reads),
  ``prepare`` (``mla_prepare`` then ``mla_tree_attention``), ``prepare_output`` (``mla_prepare`` then
  ``mla_tree_attention_output``), ``decode`` (``mla_decode``: all of it in one launch, one token per
  request).
- ``qkv``: ``gemv_norm`` (the input RMSNorm inside the q_a / kv_a ``kdtree::gemv`` launch,
  q_a_layernorm inside q_b's, the residual add inside o_proj's) or ``torch``.
- ``mlp`` (dense layers): ``gemv_norm`` (the norm inside gate/up's launch, SwiGLU and the
  residual inside down's) or ``torch``.
- ``router``: how the router's fp32 logits are computed: ``gemv_norm`` (with the post-attention
  norm in one ``kdtree::gemv`` launch), ``matvec``, ``mm`` (one fp32-output GEMM of the 16-bit
  values), ``linear`` (fp32 upcast), or ``module`` (the router called as a module: it is hooked).
- ``route``: the expert choice: ``moe_route`` (``kdtree::moe_route``), ``rank_topk`` (a fused
  comparison count, compiled on CUDA) or ``topk``.
- ``experts``: ``int4_moe``, ``moe_gemv``, ``row_gemv``, ``grouped_mm``, ``gathered``, ``looped``,
  ``grouped_padded`` (training only: differentiable bf16 grouped GEMMs, training/target.py).
- ``shared``: ``fused`` (the shared expert and the residual add inside the experts' launches),
  ``torch`` or ``none``.
- ``matvec``: decode-sized compiled CUDA passes write the small projections as multiply + sum
  (one inductor reduction kernel each, :mod:`.gemv`).
- ``gemm_rows``: tree-sized bf16 passes (``gemm_rows_pays``: 5-16 rows, and 17-20 rows for the
  linears of K >= 4096) run their linear layers through ``kdtree::gemm_rows`` (q_a and kv_a, gate
  and up: one launch each pair), which streams each weight once through tensor cores where a
  cuBLAS GEMM of 5-17 rows read it at 0.3-0.5 of the bandwidth inside a step (bench/RESULTS.md run 178).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import torch
from torch import nn

from torch_kdtree.ops.gemm_rows import gemm_rows_pays
from torch_kdtree.ops.gemv import MAX_K as GEMV_MAX_K
from torch_kdtree.ops.moe import int4_decode_path_fits
from torch_kdtree.ops.moe_gemv import MAX_TOPK as MOE_GEMV_MAX_K
from torch_kdtree.ops.moe_route import MAX_EXPERTS as ROUTE_MAX_E, MAX_GROUPS as ROUTE_MAX_G, MAX_TOPK as ROUTE_MAX_K

# kdtree::gemv: at most this many rows (one block of rows in the kernel); the fused projections,
# norms and the router's gemv launch all use it, so a token's values never depend on the batch.
FUSED_ROWS = 4
# Compiled CUDA passes of at most this many rows write linears as multiply + sum (gemv.py).
GEMV_ROWS = 4
# kdtree::gemm_rows takes the linear layers of bf16 passes of gemm_rows_pays' row counts (5-16: a tree
# verify of B = 4 ... 15 for one request, at any K; 17-20, B = 16 ... 19, the linears of K >= 4096 only:
# torch_kdtree.ops.gemm_rows.PAYS_ROWS says why); fewer rows keep the decode forms, more a GEMM.
# mla_prepare replaces the torch RoPE / norm / cache write / W_UK forms up to this many tokens, and
# mla_tree_attention_output the separate W_UV product up to this many (bench/RESULTS.md runs 49-58).
PREPARE_ROWS = 4
OUTPUT_ROWS = 1
# mla_decode's clusters read every key of the request per head: it beats the three-kernel path up
# to ~1024 keys per request with 8 heads (RESULTS.md run 76); larger caches keep the three kernels.
DECODE_MAX_KEYS = 1024
# moe_gemv: a GEMV per (token, slot) that streams each touched expert once; more slots share experts
# and the grouped GEMM reads each one once.
MOE_GEMV_SLOTS = 32
# Compiled CUDA passes: per-(token, slot) expert GEMVs as multiply + sum up to this many slots.
ROW_GEMV_SLOTS = 16
# Eager dense experts: the per-(token, slot) weight gather for at most GATHER_SLOTS slots and
# GATHER_LIMIT gathered weight elements (T * k * 3 * I * H), else a loop over the experts in use.
# The gather copies every slot's weights: on a CPU core a 17-node tree of 2 requests (136 slots) over
# 32 experts of 3 x 128 x 256 took 131 ms a step gathered and 19 ms looped; at the AR step's 8 slots
# the two were within 3 % (smoke pair, experts dense; bench/RESULTS.md, CPU notes 2026-12-05).  A
# bound on slots, not elements, gives a tensor-parallel rank (a slice of I) the single process's form.
GATHER_SLOTS = 16
GATHER_LIMIT = 1 << 26
# rank_topk's [T, E, E] comparison, at most this many elements.
RANK_TOPK_MAX = 1 << 22
# The latent row mla_tree_attention and its relatives read: 512 latent + 64 rope.
MLA_LATENT, MLA_ROPE = 512, 64
# The attention forms whose MLA kernels read or write the latent cache as bf16 rows only (mla_prepare's
# cache write, mla_decode, mla_tree_attention_output): refused over an fp8 cache.  ``tree_op``
# (mla_tree_attention) reads fp8 rows with their scales; the torch quantiser writes them.
MLA_FORMS = ("prepare", "prepare_output", "decode")
FP8 = torch.float8_e4m3fn

ALL = "all"  # Target.kernels: pretend every kdtree kernel exists (tests run fused forms on the CPU)
_OPS = ("gemv", "gemm_rows", "mla_prepare", "mla_decode", "mla_tree_attention", "moe_gemv", "moe_route", "int4_moe")


def _kernels_on(device_type: str) -> frozenset[str]:
    key = device_type.upper()
    return frozenset(op for op in _OPS if torch._C._dispatch_has_kernel_for_dispatch_key(f"kdtree::{op}", key))


# Read once at import (torch_kdtree registered its kernels before the models load): a constant, so
# that a plan made while torch.compile traces a forward asks the dispatcher nothing.
_CUDA_KERNELS = _kernels_on("cuda")


@dataclass(frozen=True)
class Target:
    """Where a pass runs: ``device`` type (``"cuda"``, ``"cpu"``), whether the pass is compiled
    (``torch.compile``: inductor's fusions change which forms pay), and the ``kdtree`` ops with a
    kernel there (None: ask the dispatcher; :data:`ALL`: every op, for tests).  Fused kernels are
    planned on CUDA only (on the CPU an op's kernel is its reference), unless ``kernels=ALL``."""

    device: str = "cpu"
    compiled: bool = False
    kernels: Optional[frozenset | str] = None

    def has(self, op: str) -> bool:
        if self.kernels == ALL:
            return True
        if self.device != "cuda":
            return False
        kernels = self.kernels if self.kernels is not None else _CUDA_KERNELS
        return op in kernels

    @property
    def gpu_forms(self) -> bool:
        """Torch forms written for CUDA under inductor (multiply + sum GEMVs, rank_topk); the forms
        that need an ATen CUDA kernel (grouped_mm, fp32-output mm) ask for ``device == "cuda"``."""
        return self.device == "cuda" or self.kernels == ALL


@dataclass(frozen=True)
class LayerPlan:
    """One decoder layer's implementation choices (module docstring for the values)."""

    attention: str
    qkv: str = "torch"
    mlp: str = "torch"
    router: str = ""
    route: str = ""
    experts: str = ""
    shared: str = ""
    matvec: bool = False
    rows_gemm: bool = False
    route_hint: bool = False
    reduce: bool = False  # tensor parallel: all-reduce the attention and MLP outputs (fused residuals: first rank)

    @property
    def linear_form(self) -> str:
        """How the layer's plain linear layers run: "matvec", "rows" (kdtree::gemm_rows where
        ``gemm_rows_pays`` says so for the call's K, else the module) or "" (the module)."""
        return "matvec" if self.matvec else "rows" if self.rows_gemm else ""

    @property
    def reference(self) -> bool:
        """Whether the layer's own (pure torch) forward is exactly this plan."""
        return self == _reference_like(self)

    def describe(self) -> str:
        parts = [f"attention={self.attention}", f"qkv={self.qkv}"]
        if self.experts:
            parts += [f"router={self.router}", f"route={self.route}", f"experts={self.experts}", f"shared={self.shared}"]
            if self.route_hint:
                parts.append("route_hint")
        else:
            parts.append(f"mlp={self.mlp}")
        if self.matvec:
            parts.append("matvec")
        if self.rows_gemm:
            parts.append("gemm_rows")
        if self.reduce:
            parts.append("all_reduce")
        return " ".join(parts)


def _reference_like(lp: LayerPlan) -> LayerPlan:
    """The reference forward's choices for a layer of the same kind as ``lp``."""
    attention = "expanded" if lp.attention == "expanded" else "torch"
    if not lp.experts:
        return LayerPlan(attention, reduce=lp.reduce)
    int4 = lp.experts == "int4_moe"  # INT4 storage has one implementation: int4_moe (its reference on CPU)
    return LayerPlan(attention, router="linear", route="topk", experts="int4_moe" if int4 else "gathered",
                     shared=lp.shared if lp.shared == "none" else "torch", reduce=lp.reduce)


@dataclass(frozen=True)
class PassPlan:
    """The plan of one pass shape: ``layers[i]`` for decoder layer i, and ``reasons`` (why a
    fused form was not taken, each said once)."""

    tokens: int              # N, tokens per request
    rows: int                # R * N
    tree: bool               # absorbed tree / decode pass (else prefill)
    target: Target
    dtype: torch.dtype
    layers: tuple[LayerPlan, ...]
    reasons: tuple[str, ...] = field(default=())
    kv_cache_dtype: Optional[torch.dtype] = None  # the latent cache's storage (None: dtype)
    # the torch attention form reads the cache only up to the longest request's length + N, rounded
    # up to a page, instead of the block table's whole reach: eager CPU tree passes (a host read of
    # the lengths per pass, free there; compiled or CUDA passes keep the fixed shape)
    live_keys: bool = False

    @property
    def fp8_cache(self) -> bool:
        return self.kv_cache_dtype == FP8

    def __str__(self) -> str:
        kind = f"tree pass N={self.tokens}" if self.tree else "prefill"
        head = (f"{kind}, {self.rows} rows, {self.target.device} {str(self.dtype).replace('torch.', '')}"
                f"{', fp8 latent cache' if self.fp8_cache else ''}{', compiled' if self.target.compiled else ''}"
                f"{', live keys' if self.live_keys else ''}")
        lines, i = [head], 0
        while i < len(self.layers):  # runs of identical layers on one line
            j = i
            while j + 1 < len(self.layers) and self.layers[j + 1] == self.layers[i]:
                j += 1
            span = f"layer {i}" if i == j else f"layers {i}-{j}"
            lines.append(f"  {span}: {self.layers[i].describe()}")
            i = j + 1
        lines += [f"  note: {r}" for r in self.reasons]
        return "\n".join(lines)

    def reference(self) -> "PassPlan":
        """The same pass run by every layer's reference forward."""
        return replace(self, layers=tuple(_reference_like(lp) for lp in self.layers), reasons=())


# --------------------------------------------------------------------------------------------
# the rules
# --------------------------------------------------------------------------------------------

def _gemv_takes(*modules: nn.Linear) -> bool:
    """kdtree::gemv's shape contract for these layers' inputs: K a multiple of 8 up to its MAX_K."""
    return all(m.weight.shape[1] % 8 == 0 and m.weight.shape[1] <= GEMV_MAX_K for m in modules)


def _hooked(*modules: nn.Module, ours: frozenset = frozenset()) -> bool:
    """Whether a wrapper hooks one of the modules (hooks with ids in ``ours``, tensor parallelism's
    reductions, are the plan's to run)."""
    return any(set(m._forward_hooks) - ours or set(m._forward_pre_hooks) - ours for m in modules)


def _plain_bf16(*modules: nn.Module) -> bool:
    """Every module's weight a plain contiguous bf16 tensor without bias: a kernel may read it."""
    for m in modules:
        w = m.weight
        if getattr(m, "bias", None) is not None or w.dtype != torch.bfloat16 or not w.is_contiguous():
            return False
    return True


class _Planner:
    def __init__(self, model, *, tokens: int, rows: int, tree: bool, target: Target, dtype: torch.dtype,
                 cache_keys: int, fp8_cache: bool = False):
        self.model, self.N, self.rows, self.tree, self.t = model, tokens, rows, tree, target
        self.dtype, self.cache_keys, self.fp8_cache = dtype, cache_keys, fp8_cache
        self.bf16 = dtype == torch.bfloat16
        self.reasons: list[str] = []
        tp = getattr(model, "tp", None)
        self.ours = frozenset(tp.hook_ids) if tp is not None else frozenset()
        self.reduce = tp is not None  # at world 1 too: the collectives stay in the graph (NCCL size-1 runs)

    def note(self, reason: str) -> None:
        if reason not in self.reasons:
            self.reasons.append(reason)

    # attention ---------------------------------------------------------------------------
    def attention(self, layer) -> tuple[str, str]:
        attn, t = layer.self_attn, self.t
        if not self.tree:
            if self.fp8_cache:
                self.note("fp8 latent cache: the prefill attends over dequantised cache rows")
            return "expanded", "torch"
        projections = ((attn.q_proj,) if hasattr(attn, "q_proj") else (attn.q_a_proj, attn.q_a_layernorm, attn.q_b_proj))
        qkv = "torch"
        if t.has("gemv") and self.bf16 and self.rows <= FUSED_ROWS:
            if _hooked(attn, ours=self.ours):
                self.note("hooked attention: its projections run as module calls")
            elif (_plain_bf16(layer.input_layernorm, attn.kv_a_proj_with_mqa, attn.o_proj, *projections)
                  and _gemv_takes(attn.kv_a_proj_with_mqa, attn.o_proj, *projections[::2])):
                qkv = "gemv_norm"
        dc, dr = attn.kv_lora_rank, attn.qk_rope_head_dim
        if not (dc == MLA_LATENT and dr == MLA_ROPE):
            if t.has("mla_tree_attention"):
                self.note(f"latent {dc} + rope {dr} is not the MLA kernels' {MLA_LATENT} + {MLA_ROPE}: "
                          f"tree attention in torch ops")
            return "torch", qkv
        if not t.has("mla_tree_attention"):
            return "torch", qkv
        if self.fp8_cache:
            if t.device == "cuda" and not self.bf16:
                self.note(f"fp8 latent cache, {str(self.dtype).replace('torch.', '')} compute: "
                          f"mla_tree_attention's CUDA kernel takes a bf16 query: tree attention in torch ops")
                return "torch", qkv
            self.note("fp8 latent cache: mla_tree_attention reads the e4m3 rows and their scales (tree_op, the rows "
                      "written by the torch quantiser); mla_prepare and mla_decode read / write bf16 rows only")
            return "tree_op", qkv
        prepared = (t.has("mla_prepare") and self.bf16 and self.rows <= PREPARE_ROWS
                    and _plain_bf16(attn.kv_b_proj, attn.kv_a_layernorm)
                    and attn.qk_nope_head_dim <= 256 and attn.v_head_dim <= 256)
        if not prepared:
            return "tree_op", qkv
        if self.N == 1 and self.rows <= OUTPUT_ROWS and t.has("mla_decode") and self.cache_keys <= DECODE_MAX_KEYS:
            return "decode", qkv
        if self.N == 1 and self.rows <= OUTPUT_ROWS and self.cache_keys > DECODE_MAX_KEYS and t.has("mla_decode"):
            self.note(f"{self.cache_keys} cache positions per request > {DECODE_MAX_KEYS}: mla_prepare + "
                      f"mla_tree_attention_output instead of mla_decode")
        return ("prepare_output" if self.rows <= OUTPUT_ROWS else "prepare"), qkv

    # feed-forward ------------------------------------------------------------------------
    def dense_mlp(self, layer) -> str:
        mlp, t = layer.mlp, self.t
        if (t.has("gemv") and self.bf16 and self.rows <= FUSED_ROWS and not _hooked(mlp, ours=self.ours)
                and _plain_bf16(layer.post_attention_layernorm, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
                and _gemv_takes(mlp.gate_proj, mlp.down_proj)):
            return "gemv_norm"
        return "torch"

    def moe(self, layer, matvec: bool) -> dict:
        moe, t = layer.mlp, self.t
        gate, experts, shared = moe.gate, moe.experts, moe.shared_experts
        k, E = gate.top_k, gate.weight.shape[0]
        slots = self.rows * k
        hooked = _hooked(moe, gate, experts, *((shared,) if shared is not None else ()), ours=self.ours)
        if hooked:
            self.note("hooked MoE block: its router, experts and shared expert run as module calls")
        # the choice
        if (not hooked and t.has("moe_route") and E <= ROUTE_MAX_E and k <= ROUTE_MAX_K and gate.n_group <= ROUTE_MAX_G
                and E % gate.n_group == 0):
            route = "moe_route"
        elif t.compiled and t.gpu_forms and self.rows * E * E <= RANK_TOPK_MAX:
            route = "rank_topk"
        else:
            route = "topk"
        # the experts
        if experts.dequantized is not None:
            self.note(experts.dequantized)
        if experts.is_int4:
            kind = "int4_moe"
        elif (t.has("moe_gemv") and self.bf16 and experts.gate_proj.dtype == torch.bfloat16
              and slots <= MOE_GEMV_SLOTS and k <= MOE_GEMV_MAX_K
              and experts.gate_proj.shape[1] % 8 == 0 and experts.gate_proj.shape[2] % 8 == 0):
            kind = "moe_gemv"
        elif t.compiled and t.gpu_forms and slots <= ROW_GEMV_SLOTS:
            kind = "row_gemv"
        elif t.device == "cuda" and self.bf16 and _grouped_mm_available():
            kind = "grouped_mm"
        elif t.compiled or (slots <= GATHER_SLOTS
                            and slots * 3 * experts.gate_proj.shape[1] * experts.gate_proj.shape[2] <= GATHER_LIMIT):
            kind = "gathered"
        else:
            kind = "looped"
        # the shared expert and the residual inside the experts' launches
        shared_form = "none" if shared is None else "torch"
        if shared is not None and not hooked and shared.gate_proj.weight.shape[0] % 8 == 0 \
                and _plain_bf16(shared.gate_proj, shared.up_proj, shared.down_proj):
            if kind == "moe_gemv":
                shared_form = "fused"
            elif (kind == "int4_moe" and t.has("int4_moe") and self.bf16
                  and int4_decode_path_fits(self.rows, k, experts.int4_weights().hidden_size,
                                            experts.int4_weights().intermediate_size)):
                shared_form = "fused"
        # the logits
        if hooked:
            router = "module"
        elif (kind == "moe_gemv" and shared_form in ("fused", "none") and route == "moe_route" and t.has("gemv")
              and self.rows <= FUSED_ROWS and _plain_bf16(layer.post_attention_layernorm, gate) and _gemv_takes(gate)):
            router = "gemv_norm"  # INT4 blocks keep inductor's norm and router kernels (RESULTS.md runs 63, 93, 102)
        elif matvec:
            router = "matvec"
        elif (t.device == "cuda" and self.dtype in (torch.bfloat16, torch.float16) and gate.weight.dtype == self.dtype
              and hasattr(torch.ops.aten.mm, "dtype")):
            router = "mm"
        else:
            router = "linear"
        hint = kind == "moe_gemv" and shared_form == "fused" and route == "moe_route" and router != "module"
        return {"router": router, "route": route, "experts": kind, "shared": shared_form, "route_hint": hint}

    def layer(self, layer) -> LayerPlan:
        attention, qkv = self.attention(layer)
        matvec = self.t.compiled and self.t.gpu_forms and self.rows <= GEMV_ROWS
        rows_gemm = not matvec and self.bf16 and gemm_rows_pays(self.rows) and self.t.has("gemm_rows")
        if hasattr(layer.mlp, "experts"):
            return LayerPlan(attention, qkv, matvec=matvec, rows_gemm=rows_gemm, reduce=self.reduce,
                             **self.moe(layer, matvec))
        return LayerPlan(attention, qkv, mlp=self.dense_mlp(layer), matvec=matvec, rows_gemm=rows_gemm,
                         reduce=self.reduce)


def _grouped_mm_available() -> bool:
    import torch.nn.functional as F

    return (getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)) is not None


def _has_dtensor(model: nn.Module) -> bool:
    return any(hasattr(p, "placements") for p in model.parameters())


def plan_pass(model, *, tokens: int, rows: int, tree: bool, target: Target, dtype: torch.dtype | None = None,
              cache_keys: int = 0, kv_cache_dtype: torch.dtype | None = None) -> PassPlan:
    """The :class:`PassPlan` of one pass of ``model`` (a :class:`KimiK2ForCausalLM` or its
    ``KimiK2Model``): ``tokens`` per request, ``rows`` = requests * tokens, a ``tree`` (absorbed)
    pass or a prefill, on ``target``, in ``dtype`` (default: the model's), over a cache of
    ``cache_keys`` positions per request (its block table's reach; mla_decode's limit) stored in
    ``kv_cache_dtype`` (``cache.kv.dtype``; None: ``dtype``; over fp8 the kernel form is ``tree_op``)."""
    inner = getattr(model, "model", model)
    dtype = dtype or next(inner.parameters()).dtype
    planner = _Planner(inner, tokens=tokens, rows=rows, tree=tree, target=target, dtype=dtype, cache_keys=cache_keys,
                       fp8_cache=kv_cache_dtype == FP8)
    if _has_dtensor(inner):
        planner.note("DTensor weights: every layer runs its reference forward")
        layers = tuple(_reference_like(planner.layer(layer)) for layer in inner.layers)
    else:
        layers = tuple(planner.layer(layer) for layer in inner.layers)
    live = tree and target.device == "cpu" and not target.compiled
    return PassPlan(tokens, rows, tree, target, dtype, layers, tuple(planner.reasons), kv_cache_dtype, live)


def target_of(device: torch.device, compiled: bool) -> Target:
    """The :class:`Target` of a pass on ``device`` (kernels from the dispatcher)."""
    return Target(device.type, compiled)


__all__ = ["ALL", "Target", "LayerPlan", "PassPlan", "plan_pass", "target_of"]
