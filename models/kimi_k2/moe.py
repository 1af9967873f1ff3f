"""Kimi K2 feed-forward blocks: the SwiGLU MLP (dense layers, shared expert), the noaux_tc router
and the routed experts (bf16/fp32 stacked weights, or INT4 through ``kdtree::int4_moe``).

Sizes come from weight shapes, never from the config, wherever a tensor-parallel shard changes
them (experts' intermediate size, number of local experts), so parallelism is applied from
outside by replacing or sharding the weights.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from torch_kdtree.ops import Int4MoEWeights, int4_moe, int4_moe_weights, moe_gemv, moe_route, moe_router
from torch_kdtree.ops.moe import int4_decode_path_fits
from torch_kdtree.ops.moe_router import MAX_HIDDEN as _ROUTER_MAX_H
from torch_kdtree.ops.moe_route import MAX_EXPERTS as _ROUTE_MAX_E, MAX_GROUPS as _ROUTE_MAX_G, MAX_TOPK as _ROUTE_MAX_K

from .fixed_dtype import FixedDtype
from . import gemv
from .gemv import fused_gemv, linear, matvec, plain_bf16, use_fused, use_gemv

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
# Above this many gathered weight elements (T * k * 3 * I * H) the eager dense path loops over
# experts instead of gathering one weight copy per (token, slot).
_GATHER_LIMIT = 1 << 26
# Under torch.compile on CUDA, at most this many (token, slot) rows use per-row expert GEMVs
# written as multiply + sum (inductor emits reduction kernels that read each touched expert's
# weights in place); above it rows share experts and the grouped GEMM reads each expert once.
_GEMV_ROWS = 16
# bf16 experts on CUDA: at most this many (token, slot) rows go to ``kdtree::moe_gemv`` (a GEMV per
# row that streams each touched expert once: decode of up to 4 requests at top-8); more rows share
# experts and the grouped GEMM reads each one once.
_MOE_GEMV_SLOTS = 32

# Read once at import (torch_kdtree has loaded its kernels by now), a constant for torch.compile.
_HAS_MOE_GEMV_CUDA = torch._C._dispatch_has_kernel_for_dispatch_key("kdtree::moe_gemv", "CUDA")
_HAS_MOE_ROUTE_CUDA = torch._C._dispatch_has_kernel_for_dispatch_key("kdtree::moe_route", "CUDA")
_HAS_MOE_ROUTER_CUDA = torch._C._dispatch_has_kernel_for_dispatch_key("kdtree::moe_router", "CUDA")
# The shared expert as one more slot of kdtree::moe_gemv (when the routed experts take it).
_SHARED_IN_MOE_GEMV = True
# When kdtree::moe_route chose the experts from logits whose product read x (KimiK2MoE.route_gemv: x
# and the logits from one kdtree::gemv launch; or the router inside KimiK2MoE.forward), the experts'
# kdtree::moe_gemv gets those logits as route_logits: the shared expert's gate/up blocks then run
# beside moe_route instead of after it (the same bits; tests/test_generate.py checks on CUDA that no
# kernel runs between moe_route and moe_gemv in the compiled steps).  On the H200 (bench/RESULTS.md
# run 149) 2p2b gained 1.4 % a step (0.5386 / 0.5413 vs 0.5476 / 0.5467 ms).  KDTREE_MOE_SHARED_EARLY=0
# turns it off (read at import).  int4_moe had the same hint for a while and lost on k2_slice both
# with its shared-expert blocks first in the grid (run 149: 0.3195 / 0.3190 vs 0.3116 / 0.3117 ms) and
# last (run 151: 0.3162 / 0.3150 / 0.3158 vs 0.3140 / 0.3153 / 0.3137), so it was removed.
_SHARED_EARLY = os.environ.get("KDTREE_MOE_SHARED_EARLY", "1") != "0"
# Decode-sized bf16 passes on CUDA: the post-attention RMSNorm, the router product and the choice
# in one kdtree::moe_router launch (KimiK2MoE.router_fused_ok).  Off: the model's CUDA tests pass
# with it, but decode was slower with it on the H200 (bench/RESULTS.md run 42, fp32 routers: 2p2b
# 0.7374 vs 0.7273 ms, k2_slice 0.5126 vs 0.4767 ms per step; run 58, bf16 routers: 0.6513 vs
# 0.6321 and 0.4539 vs 0.4038).  KDTREE_ROUTER_FUSED=1 turns it on (read at import).
_ROUTER_FUSED = os.environ.get("KDTREE_ROUTER_FUSED", "0") == "1"
# Decode-sized bf16 passes on CUDA (when moe_router is off) whose experts (and shared expert) run in
# kdtree::moe_gemv: the post-attention RMSNorm and the router's fp32 logits in one kdtree::gemv
# launch, then kdtree::moe_route (KimiK2MoE.router_gemv_ok).  On the H200 (RESULTS.md run 63) 2p2b
# went 0.6429 -> 0.6365 ms per step; k2_slice's INT4 blocks, with the shared expert's gate and up
# in the same launch, went 0.3850 -> 0.3925, so INT4 blocks keep inductor's norm + router + shared
# kernels.  KDTREE_ROUTER_GEMV=0 turns it off (read at import).
_ROUTER_GEMV = os.environ.get("KDTREE_ROUTER_GEMV", "1") != "0"
# Router logits of passes too large for the multiply + sum (use_gemv: tree verification, prefill)
# on CUDA with bf16 / fp16 x and weight: one cuBLAS GEMM with fp32 output (aten::mm.dtype: tensor
# cores, fp32 accumulation of the exact products of the 16-bit values) instead of F.linear on
# upcast copies, whose fp32 GEMM ran on CUDA cores in a few tiles: 21.6 + 5.4 us (split-K reduce)
# per MoE layer of k2_slice's B = 16 verification step on the H200 (bench/RESULTS.md run 152); the
# step went 1.263 -> 1.182 ms with it (run 154).  The same products, summed in another order (the
# single-token steps sum in a third order already: expert choices near a tie may go either way,
# see tests/test_generate.py, assert_equal_up_to_bf16_ties).  KDTREE_ROUTER_MM=0 turns it off
# (read at import).
_ROUTER_MM = os.environ.get("KDTREE_ROUTER_MM", "1") != "0"
_HAS_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")
# INT4 experts on CUDA, decode-sized passes (the shapes of int4_moe's decode path):
# the shared expert and the residual add inside kdtree::int4_moe's two launches
# (KimiK2MoE._int4_shared_fits).  On the H200 (RESULTS.md runs 92-93) k2_slice went 0.3751 -> 0.3622
# and 0.3730 -> 0.3581 ms per step; with the norm and router logits also in a kdtree::gemv launch
# (route_gemv) it was 0.3776, so INT4 blocks keep inductor's norm and router kernels.  The router's
# logits alone in a kdtree::gemv launch (no prologue, after inductor's norm) were slower too (run
# 102: 0.3619 vs 0.3449).
# KDTREE_INT4_SHARED=0 turns it off (read at import).
_INT4_SHARED = os.environ.get("KDTREE_INT4_SHARED", "1") != "0"
_HAS_INT4_MOE_CUDA = torch._C._dispatch_has_kernel_for_dispatch_key("kdtree::int4_moe", "CUDA")


class KimiK2MLP(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))`` (dense layer 0 and the shared expert)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def fused_ok(self, x: torch.Tensor, norm: nn.Module) -> bool:
        """Whether ``forward(x, norm, residual)`` takes the two-launch ``kdtree::gemv`` path (the
        module itself unhooked: a wrapper would expect ``forward(x)``)."""
        hooked = self._forward_hooks or self._forward_pre_hooks
        return not hooked and use_fused(x, norm, self.gate_proj, self.up_proj, self.down_proj)

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """``down(silu(gate(x)) * up(x))``; with ``norm`` (an RMSNorm) and ``residual``:
        ``residual + MLP(norm(x))`` -- when :meth:`fused_ok`, two kdtree::gemv launches (the norm
        inside gate/up's, SwiGLU and the residual add inside down's)."""
        if norm is not None and residual is not None and self.fused_ok(x, norm):
            g, u = fused_gemv(x, [self.gate_proj.weight, self.up_proj.weight], norm.weight, norm.eps)
            return fused_gemv(g, [self.down_proj.weight], up=u, residual=residual)[0]
        if norm is not None:
            x = norm(x)
        y = linear(self.down_proj, F.silu(linear(self.gate_proj, x)) * linear(self.up_proj, x))
        return y if residual is None else residual + y


def rank_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [T, k] of the k largest entries of each row of ``x`` [T, E], largest first, equal
    values lower index first, by counting for every entry the entries that beat it (an [E, E]
    comparison per row): only compares and sums, so under torch.compile it is a fused reduction
    instead of topk's sort kernels -- for decode-sized T (the router's k of E experts)."""
    E = x.shape[-1]
    idx = torch.arange(E, device=x.device)
    a, b = x[:, :, None], x[:, None, :]
    beaten = (b > a) | ((b == a) & (idx[None, None, :] < idx[None, :, None]))  # [T, e, j]: j beats e
    rank = beaten.sum(-1)  # [T, E], distinct per row
    r = torch.arange(k, device=x.device)
    return ((rank[:, None, :] == r[None, :, None]) * idx).sum(-1)


# rank_topk's [T, E, E] comparison, at most this many elements: T <= 1024 rows at E = 64, T <= 28
# at E = 384 (a decode step or a tree verify of a few requests).
_RANK_TOPK_MAX = 1 << 22


def _rank_topk_fits(choice: torch.Tensor) -> bool:
    """Route with rank_topk (a fused reduction) instead of topk (gatherTopK + a bitonic sort, ~10 us
    a layer in the B = 16 verify step, run 27) when compiling on CUDA and the comparison is small.
    AR and tree passes then also break exact score ties the same way (lower expert id first)."""
    T, E = choice.shape
    return torch.compiler.is_compiling() and gemv._on_gpu(choice) and T * E * E <= _RANK_TOPK_MAX


class KimiK2Router(FixedDtype):
    """noaux_tc routing (kimi_k2.md): sigmoid scores in fp32; ``e_score_correction_bias`` only
    selects; optional group-limited choice (``n_group`` groups scored by their top-2, the best
    ``topk_group`` kept); weights renormalised over the top-k and scaled.

    ``e_score_correction_bias`` [E] stays fp32 whatever dtype the model is cast to: a bf16 bias
    would flip near-tied expert choices.  ``weight`` [E, H] is stored in the model's dtype, as K2's
    checkpoints ship it (bf16), and the logits are fp32 products of its upcast values
    (kimi_k2.md: ``x.float() @ W_gate.float().T``) -- exact for a bf16 checkpoint, with half the
    bytes per decode step of an fp32 copy (11 MB per layer for K2's 384 x 7168).
    """

    fixed_dtype = ("e_score_correction_bias",)

    def __init__(self, config):
        super().__init__()
        E, H = config.n_routed_experts, config.hidden_size
        self.weight = nn.Parameter(torch.empty(E, H))
        self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group or 1
        self.topk_group = config.topk_group or 1
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_ids int32 [T, k], topk_weights float32 [T, k]).  On CUDA the choice is
        one ``kdtree::moe_route`` launch (same rule, ties lower expert id first), eager or compiled."""
        return self.route(self.logits(x))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The router's fp32 logits [T, E] of x [T, H]."""
        if use_gemv(x, self.weight):
            return matvec(x, self.weight)
        if self.mm_fits(x):
            return torch.mm(x, self.weight.t(), out_dtype=torch.float32)
        return F.linear(x.float(), self.weight.float())

    def mm_fits(self, x: torch.Tensor) -> bool:
        """Whether :meth:`logits` takes one fp32-output GEMM of the 16-bit x and weight (_ROUTER_MM).
        Only for x really on CUDA (aten::mm.dtype has no CPU kernel in torch 2.11)."""
        w = self.weight
        return (_ROUTER_MM and _HAS_MM_OUT_DTYPE and x.is_cuda and x.dim() == 2
                and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype
                and not hasattr(w, "placements"))

    def _use_route_op(self, logits: torch.Tensor) -> bool:
        return gemv._on_gpu(logits) and self.route_op_fits()

    def route_op_fits(self) -> bool:
        """kdtree::moe_route has a CUDA kernel and takes this router's expert count, k and groups."""
        return (_HAS_MOE_ROUTE_CUDA and self.weight.shape[0] <= _ROUTE_MAX_E and self.top_k <= _ROUTE_MAX_K
                and self.n_group <= _ROUTE_MAX_G)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The choice from fp32 logits [T, E] (moe_route where it runs, else torch ops)."""
        if self._use_route_op(logits):
            return moe_route(logits, self.e_score_correction_bias.float(), self.top_k, self.n_group, self.topk_group,
                             bool(self.norm_topk_prob), float(self.routed_scaling_factor))
        return self._route(logits)

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The choice in torch ops, from fp32 logits [T, E]."""
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            T, E = choice.shape
            grouped = choice.view(T, self.n_group, E // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(T, E)
        if _rank_topk_fits(choice):  # compiled on CUDA, small T: no sort kernels
            ids = rank_topk(choice, self.top_k)
        else:
            ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids.to(torch.int32), weights * self.routed_scaling_factor


class KimiK2Experts(FixedDtype):
    """Routed experts, stacked over the E experts of this rank, in one of two storages:

    - dense (bf16/fp32): ``gate_proj`` [E, I, H], ``up_proj`` [E, I, H], ``down_proj`` [E, H, I]
      (transformers' fused ``gate_up_proj`` is ``cat([gate_proj, up_proj], dim=1)``); computed
      on CUDA bf16 by ``kdtree::moe_gemv`` for decode-sized batches and ``grouped_mm`` above
      that, else a per-(token, slot) weight gather (fixed shapes, for small token counts and
      ``torch.compile``) or an eager loop over the used experts.
    - INT4 (w4a16, compressed-tensors groups): buffers ``w13_qweight``, ``w13_scales``,
      ``w2_qweight``, ``w2_scales`` in ``kdtree::int4_moe``'s layout (:class:`Int4MoEWeights`),
      computed by :func:`torch_kdtree.ops.int4_moe`.

    The loader fills either with :meth:`set_dense` / :meth:`set_int4`; each drops the other storage.
    """

    _INT4 = ("w13_qweight", "w13_scales", "w2_qweight", "w2_scales")
    _DENSE = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.group_size = 0  # INT4 group size; 0 while the storage is dense
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def fixed_dtype_names(self) -> tuple[str, ...]:
        return self._INT4 if self.is_int4 else ()  # the kernel reads int32 nibbles and bf16 scales

    @property
    def is_int4(self) -> bool:
        return self.group_size > 0

    @property
    def num_experts(self) -> int:
        return (self.w13_qweight if self.is_int4 else self.gate_proj).shape[0]

    def _drop(self, names) -> None:
        for name in names:
            self._parameters.pop(name, None)
            self._buffers.pop(name, None)

    @torch.no_grad()
    def set_dense(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        """Take dense expert weights: gate/up [E, I, H], down [E, H, I] (stored as given)."""
        E, I, H = gate.shape
        if tuple(up.shape) != (E, I, H) or tuple(down.shape) != (E, H, I):
            raise ValueError(f"KimiK2Experts.set_dense: expected gate/up [E, I, H] and down [E, H, I], got "
                             f"{tuple(gate.shape)}, {tuple(up.shape)}, {tuple(down.shape)}")
        self._drop(self._INT4)
        self.group_size = 0
        for name, t in zip(self._DENSE, (gate, up, down)):
            self._drop((name,))
            self.register_parameter(name, nn.Parameter(t.contiguous(), requires_grad=False))

    @torch.no_grad()
    def set_int4(self, gate_packed: torch.Tensor, gate_scale: torch.Tensor, up_packed: torch.Tensor,
                 up_scale: torch.Tensor, down_packed: torch.Tensor, down_scale: torch.Tensor) -> None:
        """Take compressed-tensors ``pack-quantized`` experts stacked over E (int32 packed
        [E, out, in/8], bf16 scale [E, out, in/group]) and repack them once for ``int4_moe``."""
        if gate_packed.dim() != 3 or gate_scale.dim() != 3 or gate_scale.shape[-1] == 0:
            raise ValueError(f"KimiK2Experts.set_int4: expected stacked [E, out, in/8] and [E, out, in/group] "
                             f"tensors, got {tuple(gate_packed.shape)} and {tuple(gate_scale.shape)}")
        group_size = 8 * gate_packed.shape[-1] // gate_scale.shape[-1]
        weights = int4_moe_weights(gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale,
                                   group_size=group_size)
        self._drop(self._DENSE)
        self._drop(self._INT4)
        for name, t in weights.tensors().items():
            self.register_buffer(name, t)
        self.group_size = weights.group_size

    def int4_weights(self) -> Int4MoEWeights:
        return Int4MoEWeights(self.w13_qweight, self.w13_scales, self.w2_qweight, self.w2_scales, self.group_size)

    def dense_weights(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [E, I, H], up [E, I, H], down [E, H, I]); INT4 storage is dequantised exactly."""
        if self.is_int4:
            return self.int4_weights().dequantize(dtype or torch.float32)
        return tuple(p if dtype is None else p.to(dtype) for p in (self.gate_proj, self.up_proj, self.down_proj))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_ids int32 [T, k], topk_weights float32 [T, k] -> [T, H] in x's dtype:
        ``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])``, accumulated in fp32."""
        if self.is_int4:
            return int4_moe(x, self.int4_weights(), topk_ids, topk_weights)
        if self._use_moe_gemv(x, topk_ids):
            return moe_gemv(x, self.gate_proj, self.up_proj, self.down_proj, topk_ids, topk_weights)
        if gemv._on_gpu(x) and topk_ids.numel() <= _GEMV_ROWS and torch.compiler.is_compiling():
            return self._row_gemv(x, topk_ids, topk_weights)
        if _grouped_mm is not None and x.is_cuda and x.dtype == torch.bfloat16:
            return self._grouped(x, topk_ids, topk_weights)
        elements = topk_ids.numel() * 3 * self.gate_proj.shape[1] * self.gate_proj.shape[2]
        if torch.compiler.is_compiling() or elements <= _GATHER_LIMIT:
            return self._gathered(x, topk_ids, topk_weights)
        return self._looped(x, topk_ids, topk_weights)

    def _use_moe_gemv(self, x: torch.Tensor, topk_ids: torch.Tensor) -> bool:
        """bf16 weights on CUDA, decode-sized (<= _MOE_GEMV_SLOTS token-slots), plain tensors
        (not DTensor shards), and the kernel built: the fused GEMV op, eager or compiled."""
        return topk_ids.dtype == torch.int32 and self._moe_gemv_fits(x, topk_ids.numel())

    def _moe_gemv_fits(self, x: torch.Tensor, slots: int) -> bool:
        """:meth:`_use_moe_gemv` for ``slots`` int32 token-slots."""
        return (gemv._on_gpu(x) and x.dtype == torch.bfloat16 and self.gate_proj.dtype == torch.bfloat16
                and slots <= _MOE_GEMV_SLOTS and not hasattr(self.gate_proj, "placements") and _HAS_MOE_GEMV_CUDA)

    def _grouped(self, x, topk_ids, topk_weights):
        """Rows sorted by expert, one ``grouped_mm`` per projection (fixed shapes, no host sync)."""
        T, k = topk_ids.shape
        flat = topk_ids.reshape(-1).long()
        order = flat.argsort(stable=True)
        counts = torch.zeros(self.gate_proj.shape[0], dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)
        rows = x[order // k]
        h = F.silu(_grouped_mm(rows, self.gate_proj.transpose(1, 2), offs=offs)) * \
            _grouped_mm(rows, self.up_proj.transpose(1, 2), offs=offs)
        y_sorted = _grouped_mm(h, self.down_proj.transpose(1, 2), offs=offs)
        y = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted)
        return (y.view(T, k, -1).float() * topk_weights[..., None]).sum(1).to(x.dtype)

    def _row_gemv(self, x, topk_ids, topk_weights):
        """Decode-sized batches under torch.compile: ``W[ids] @ x`` per (token, slot) as a product
        and a sum, which inductor fuses into reduction kernels with indirect weight loads (no
        gathered copy, no sort).  fp32 accumulation; gate/up and the expert outputs are rounded
        to x's dtype where the GEMM path rounds them."""
        ids = topk_ids.long()
        xf = x.float()[:, None, None, :]
        gate = (xf * self.gate_proj[ids].float()).sum(-1).to(x.dtype)  # [T, k, I]
        up = (xf * self.up_proj[ids].float()).sum(-1).to(x.dtype)
        h = (F.silu(gate) * up).float()[:, :, None, :]
        y = (h * self.down_proj[ids].float()).sum(-1).to(x.dtype)  # [T, k, H]
        return (y.float() * topk_weights[..., None]).sum(1).to(x.dtype)

    def _gathered(self, x, topk_ids, topk_weights):
        """One weight copy per (token, slot): fixed shapes, cheap for decode-sized T."""
        ids = topk_ids.long()
        gate, up, down = self.gate_proj[ids], self.up_proj[ids], self.down_proj[ids]  # [T, k, ., .]
        h = F.silu(torch.einsum("th,tkih->tki", x, gate)) * torch.einsum("th,tkih->tki", x, up)
        y = torch.einsum("tki,tkhi->tkh", h, down)
        return (y.float() * topk_weights[..., None]).sum(1).to(x.dtype)

    def _looped(self, x, topk_ids, topk_weights):
        """Eager loop over the experts in use (data-dependent shapes: prefill only)."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        ids = topk_ids.long()
        for e in torch.unique(ids).tolist():
            t, j = torch.nonzero(ids == e, as_tuple=True)
            xe = x[t]
            y = F.linear(F.silu(F.linear(xe, self.gate_proj[e])) * F.linear(xe, self.up_proj[e]), self.down_proj[e])
            out.index_add_(0, t, y.float() * topk_weights[t, j, None])
        return out.to(x.dtype)


class KimiK2MoE(nn.Module):
    """MoE block: router (``gate``), routed ``experts`` and the ``shared_experts`` MLP."""

    def __init__(self, config):
        super().__init__()
        self.gate = KimiK2Router(config)
        self.experts = KimiK2Experts(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size)
        n_shared = config.n_shared_experts or 0
        self.shared_experts = KimiK2MLP(config.hidden_size, config.moe_intermediate_size * n_shared) \
            if n_shared else None

    def router_fused_ok(self, h: torch.Tensor, norm: nn.Module) -> bool:
        """Whether :meth:`route_fused` takes one ``kdtree::moe_router`` launch for ``norm(h)`` and the
        router: the CUDA kernel built, h bf16 on CUDA with at most gemv.FUSED_ROWS rows (the same
        rows as the fused projections, so a token's logits never depend on the batch), a plain bf16
        norm, a plain fp32 or bf16 router weight, nothing hooked."""
        gate = self.gate
        w = gate.weight
        hooked = self._forward_hooks or self._forward_pre_hooks or gate._forward_hooks or gate._forward_pre_hooks
        return (_ROUTER_FUSED and _HAS_MOE_ROUTER_CUDA and not hooked and gemv._on_gpu(h)
                and h.dtype == torch.bfloat16 and h.numel() <= gemv.FUSED_ROWS * h.shape[-1]
                and h.shape[-1] % 8 == 0 and h.shape[-1] <= _ROUTER_MAX_H and plain_bf16(norm)
                and w.dtype in (torch.float32, torch.bfloat16) and w.is_contiguous() and not hasattr(w, "placements")
                and w.shape[0] <= _ROUTE_MAX_E and gate.top_k <= _ROUTE_MAX_K and gate.n_group <= _ROUTE_MAX_G)

    def route_fused(self, h: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """(norm(h), (topk_ids, topk_weights)) in one ``kdtree::moe_router`` launch."""
        gate = self.gate
        x, _, ids, weights = moe_router(h.reshape(-1, h.shape[-1]), norm.weight, norm.eps, gate.weight,
                                        gate.e_score_correction_bias.float(), gate.top_k, gate.n_group,
                                        gate.topk_group, bool(gate.norm_topk_prob),
                                        float(gate.routed_scaling_factor))
        return x.view(h.shape), (ids, weights)

    def router_gemv_ok(self, h: torch.Tensor, norm: nn.Module) -> bool:
        """Whether :meth:`route_gemv` computes ``norm(h)`` and the router's logits in one
        ``kdtree::gemv`` launch: the kernel built, h bf16 on CUDA with at most gemv.FUSED_ROWS rows
        (the fused projections' rows), a plain bf16 norm and router weight, nothing hooked, the
        choice on ``kdtree::moe_route``, and the experts (with the shared expert, if any) on
        ``kdtree::moe_gemv`` -- not INT4 experts (slower there, see _ROUTER_GEMV)."""
        gate = self.gate
        hooked = self._forward_hooks or self._forward_pre_hooks or gate._forward_hooks or gate._forward_pre_hooks
        if not (_ROUTER_GEMV and not hooked and use_fused(h, norm, gate) and gate.route_op_fits()):
            return False
        if self.experts.is_int4:
            return False
        in_moe_gemv = self.experts._moe_gemv_fits(h, h.numel() // h.shape[-1] * gate.top_k)  # int32 ids
        return in_moe_gemv and (self.shared_experts is None or self._shared_fits(in_moe_gemv))

    def route_gemv(self, h: torch.Tensor, norm: nn.Module
                   ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        """``(norm(h), (topk_ids, topk_weights), logits)`` from one ``kdtree::gemv`` launch (the norm
        as its prologue, returned; the router's fp32 logits) and one ``kdtree::moe_route``; the
        logits are :meth:`forward`'s ``route_logits``."""
        gate = self.gate
        logits, x = fused_gemv(h.reshape(-1, h.shape[-1]), [gate.weight], norm.weight, norm.eps, fp32_outputs=1,
                               return_input=True)
        return x.view(h.shape), gate.route(logits), logits

    def forward(self, x: torch.Tensor, routing: tuple[torch.Tensor, torch.Tensor] | None = None,
                residual: torch.Tensor | None = None, route_logits: torch.Tensor | None = None) -> torch.Tensor:
        """The MoE output for x (already normalised); ``routing`` = (topk_ids, topk_weights) when the
        caller has chosen the experts (:meth:`route_fused`, :meth:`route_gemv`), else the router runs
        here.  With ``residual`` (x's shape; callers pass it only when :meth:`fuses_residual`):
        ``residual + MoE(x)``, the add inside kdtree::moe_gemv's down kernel when that computes the
        block.  ``route_logits`` (with ``routing``; :meth:`route_gemv`'s logits): the logits
        kdtree::moe_route chose ``routing`` from, computed from x -- passed on to kdtree::moe_gemv as
        its launch-order hint (the same result).  The router here passes its own logits the same way
        when it chooses in kdtree::moe_route."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        res = residual.reshape(-1, shape[-1]) if residual is not None else None
        gate = self.gate
        if routing is None and (gate._forward_hooks or gate._forward_pre_hooks):
            # a wrapper hooks the router (tensor parallelism): call it as a module, without the hint
            topk_ids, topk_weights = gate(x)
            route_logits = None
        elif routing is None:
            logits = gate.logits(x)  # read x: x is complete before moe_route runs
            topk_ids, topk_weights = gate.route(logits)
            route_logits = logits if gate._use_route_op(logits) else None
        else:
            topk_ids, topk_weights = routing
        shared = self.shared_experts
        if self._int4_shared_fits(x):  # the shared expert (and the residual) inside int4_moe
            y = int4_moe(x, self.experts.int4_weights(), topk_ids, topk_weights,
                         shared=(shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight),
                         residual=res)
            return y.view(shape)
        if shared is not None and self._shared_in_moe_gemv(x, topk_ids):
            # the shared expert as one more slot of the routed experts' two launches
            e = self.experts
            y = moe_gemv(x, e.gate_proj, e.up_proj, e.down_proj, topk_ids, topk_weights, shared.gate_proj.weight,
                         shared.up_proj.weight, shared.down_proj.weight, res,
                         route_logits=route_logits if _SHARED_EARLY else None)
            return y.view(shape)
        y = self.experts(x, topk_ids, topk_weights)
        if shared is not None:
            y = y + shared(x)
        if res is not None:
            y = res + y
        return y.view(shape)

    def fuses_residual(self, x: torch.Tensor) -> bool:
        """Whether the decoder layer should hand its residual to :meth:`forward` for ``x`` (the
        normalised input): the block runs as one kdtree::moe_gemv call (bf16 experts) or one
        kdtree::int4_moe call (INT4 experts, :meth:`_int4_shared_fits`) with the shared expert, which
        then also adds the residual, and nothing hooks this module (a tensor-parallel wrapper
        reducing its output must see the MoE output alone).  Elsewhere the layer adds it itself."""
        if self.experts.is_int4:
            return self._int4_shared_fits(x)
        if self._forward_hooks or self._forward_pre_hooks or self.shared_experts is None:
            return False
        slots = x.numel() // x.shape[-1] * self.gate.top_k  # the router's int32 ids
        return self._shared_fits(self.experts._moe_gemv_fits(x, slots))

    def _int4_shared_fits(self, x: torch.Tensor) -> bool:
        """INT4 experts whose decode-sized CUDA calls take the shared expert (plain bf16 weights,
        intermediate size a multiple of 8) and the residual add into kdtree::int4_moe's decode path
        (x bf16 of a shape that path takes, ``int4_decode_path_fits``), nothing hooked (a
        tensor-parallel wrapper reducing the block's output must see the MoE output alone)."""
        shared = self.shared_experts
        if not (_INT4_SHARED and _HAS_INT4_MOE_CUDA and self.experts.is_int4 and shared is not None):
            return False
        hooked = any(m._forward_hooks or m._forward_pre_hooks for m in (self, shared, self.experts))
        w = self.experts.int4_weights()
        return (not hooked and gemv._on_gpu(x) and x.dtype == torch.bfloat16
                and int4_decode_path_fits(x.numel() // x.shape[-1], self.gate.top_k, w.hidden_size,
                                          w.intermediate_size)
                and shared.gate_proj.weight.shape[0] % 8 == 0
                and plain_bf16(shared.gate_proj, shared.up_proj, shared.down_proj))

    def _shared_in_moe_gemv(self, x: torch.Tensor, topk_ids: torch.Tensor) -> bool:
        """The routed experts go to kdtree::moe_gemv and the shared expert's weights are plain bf16
        (intermediate size a multiple of 8): the op computes both."""
        return not self.experts.is_int4 and self._shared_fits(self.experts._use_moe_gemv(x, topk_ids))

    def _shared_fits(self, routed_in_moe_gemv: bool) -> bool:
        """The shared expert can join the routed experts' moe_gemv launches (non-INT4 experts)."""
        shared = self.shared_experts
        return (_SHARED_IN_MOE_GEMV and routed_in_moe_gemv
                and shared.gate_proj.weight.shape[0] % 8 == 0
                and not (shared._forward_hooks or shared._forward_pre_hooks)
                and plain_bf16(shared.gate_proj, shared.up_proj, shared.down_proj))


__all__ = ["KimiK2MLP", "KimiK2Router", "KimiK2Experts", "KimiK2MoE"]
