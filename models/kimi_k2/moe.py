"""Kimi K2 feed-forward blocks: the SwiGLU MLP (dense layers, shared expert), the noaux_tc router
and the routed experts (bf16/fp32 stacked weights, or INT4 through ``kdtree::int4_moe``).

Sizes come from weight shapes, never from the config, wherever a tensor-parallel shard changes
them (experts' intermediate size, number of local experts), so parallelism is applied from
outside by replacing or sharding the weights.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torch_kdtree.ops import Int4MoEWeights, int4_dequantize, int4_layout_fits, int4_moe, int4_moe_weights

from .fixed_dtype import FixedDtype


class KimiK2MLP(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))`` (dense layer 0 and the shared expert)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
        """x [T, H] -> (topk_ids int32 [T, k], topk_weights float32 [T, k])."""
        return self.route(self.logits(x))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The router's fp32 logits [T, E] of x [T, H]: fp32 products of the upcast values."""
        return F.linear(x.float(), self.weight.float())

    def route(self, logits: torch.Tensor, topk=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The choice from fp32 logits [T, E] in torch ops (``topk(choice, k)`` -> ids: default
        ``torch.topk``; the plan may pass :func:`rank_topk`, the same ids without sort kernels)."""
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            T, E = choice.shape
            grouped = choice.view(T, self.n_group, E // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(T, E)
        ids = topk(choice, self.top_k) if topk is not None else choice.topk(self.top_k, dim=-1).indices
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
    INT4 experts of sizes ``int4_moe`` does not tile (H not a multiple of 128, I of 64: test-sized
    configs) are stored dequantised as dense weights (in the model's dtype after a cast) and
    ``dequantized`` says why.
    """

    _INT4 = ("w13_qweight", "w13_scales", "w2_qweight", "w2_scales")
    _DENSE = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.group_size = 0  # INT4 group size; 0 while the storage is dense
        self.dequantized: str | None = None  # why INT4 experts are stored dense (set_int4)
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
        I, H = gate_packed.shape[1], 8 * gate_packed.shape[2]
        if not int4_layout_fits(H, I, group_size):
            deq = [int4_dequantize(p, s, group_size) for p, s in
                   ((gate_packed, gate_scale), (up_packed, up_scale), (down_packed, down_scale))]
            self.set_dense(*deq)
            self.dequantized = (f"INT4 experts of H = {H}, I = {I} (group {group_size}) are outside int4_moe's "
                                f"tiles (H % 128, I % 64): stored dequantised")
            return
        weights = int4_moe_weights(gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale,
                                   group_size=group_size)
        self._drop(self._DENSE)
        self._drop(self._INT4)
        for name, t in weights.tensors().items():
            self.register_buffer(name, t)
        self.group_size = weights.group_size
        self.dequantized = None

    def int4_weights(self) -> Int4MoEWeights:
        return Int4MoEWeights(self.w13_qweight, self.w13_scales, self.w2_qweight, self.w2_scales, self.group_size)

    def dense_weights(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [E, I, H], up [E, I, H], down [E, H, I]); INT4 storage is dequantised exactly."""
        if self.is_int4:
            return self.int4_weights().dequantize(dtype or torch.float32)
        return tuple(p if dtype is None else p.to(dtype) for p in (self.gate_proj, self.up_proj, self.down_proj))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_ids int32 [T, k], topk_weights float32 [T, k] -> [T, H] in x's dtype:
        ``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])``, accumulated in fp32 (INT4
        storage through ``kdtree::int4_moe``; dense storage with one weight copy per (token, slot))."""
        if self.is_int4:
            return int4_moe(x, self.int4_weights(), topk_ids, topk_weights)
        return self._gathered(x, topk_ids, topk_weights)

    def _gathered(self, x, topk_ids, topk_weights):
        """One weight copy per (token, slot): fixed shapes (compiles), cheap for decode-sized T."""
        ids = topk_ids.long()
        gate, up, down = self.gate_proj[ids], self.up_proj[ids], self.down_proj[ids]  # [T, k, ., .]
        h = F.silu(torch.einsum("th,tkih->tki", x, gate)) * torch.einsum("th,tkih->tki", x, up)
        y = torch.einsum("tki,tkhi->tkh", h, down)
        return (y.float() * topk_weights[..., None]).sum(1).to(x.dtype)

    def looped(self, x, topk_ids, topk_weights):
        """:meth:`forward` of dense storage as an eager loop over the experts in use (data-dependent
        shapes: large prefills, where the gathered copies would not fit)."""
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MoE output for x (already normalised): routed experts plus the shared expert."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        topk_ids, topk_weights = self.gate(x)
        y = self.experts(x, topk_ids, topk_weights)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.view(shape)


__all__ = ["KimiK2MLP", "KimiK2Router", "KimiK2Experts", "KimiK2MoE", "rank_topk"]
