"""noaux_tc expert selection (DeepSeek-V3 / Kimi K2 routing) from router logits: ``kdtree::moe_route``.

From fp32 ``logits`` [T, E] and the fp32 ``e_score_correction_bias`` [E] (docs/kimi_k2.md, routing):

1. ``scores = sigmoid(logits)``; ``choice = scores + bias`` (the bias only selects; NaN ranks last);
2. with ``n_group > 1``: each group of E / n_group experts is scored by the sum of its two largest
   choices, the best ``topk_group`` groups are kept (ties: lower group first) and the other
   groups' experts cannot be chosen;
3. ``topk_ids`` int32 [T, top_k]: the top_k largest choices, largest first, equal choices lower
   expert id first (a total order, so the result is unique);
4. ``topk_weights`` fp32 [T, top_k] = ``scores[topk_ids]``, divided by their sum (+ 1e-20) when
   ``renormalize`` (``norm_topk_prob``), times ``scaling`` (``routed_scaling_factor``).

The CUDA kernel (csrc/moe_route.cu) is one launch, one block per token; the CPU kernel is
:func:`moe_route_reference`.
"""
from __future__ import annotations

import torch

from ._checks import check_same_device, check_tensor

MAX_EXPERTS = 1024
MAX_TOPK = 32
MAX_GROUPS = 64


def _check(logits, bias, top_k, n_group, topk_group, op="moe_route") -> None:
    check_tensor(op, "logits", logits, torch.float32, 2)
    check_tensor(op, "bias", bias, torch.float32, 1)
    check_same_device(op, logits=logits, bias=bias)
    E = logits.shape[1]
    if bias.shape[0] != E:
        raise ValueError(f"{op}: bias must be [E = {E}], got {tuple(bias.shape)}")
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"{op}: E must be in [1, {MAX_EXPERTS}], got {E}")
    if not 1 <= top_k <= min(MAX_TOPK, E):
        raise ValueError(f"{op}: top_k must be in [1, min({MAX_TOPK}, E)], got {top_k}")
    if not (1 <= n_group <= MAX_GROUPS and E % n_group == 0):
        raise ValueError(f"{op}: n_group must divide E and be in [1, {MAX_GROUPS}], got {n_group}")
    if n_group > 1 and not (E // n_group >= 2 and 1 <= topk_group <= n_group and topk_group * (E // n_group) >= top_k):
        raise ValueError(f"{op}: with n_group > 1, groups need >= 2 experts and topk_group in [1, n_group] keeping "
                         f">= top_k experts, got n_group = {n_group}, topk_group = {topk_group}")


def _descending(x: torch.Tensor) -> torch.Tensor:
    """Indices sorting each row largest first, equal values lower index first."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices


def moe_route_reference(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int = 1, topk_group: int = 1,
                        renormalize: bool = True, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference (and CPU kernel) of ``kdtree::moe_route`` (module docstring)."""
    _check(logits, bias, top_k, n_group, topk_group)
    T, E = logits.shape
    scores = logits.sigmoid()
    choice = torch.nan_to_num(scores + bias, nan=float("-inf"))
    if n_group > 1:
        grouped = choice.view(T, n_group, E // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, _descending(group_scores)[:, :topk_group], True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(T, E)
    ids = _descending(choice)[:, :top_k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids.to(torch.int32), weights * scaling


def moe_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int = 1, topk_group: int = 1,
              renormalize: bool = True, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids and weights of the noaux_tc router.

    Args:
        logits: float32 [T, E] router logits (E <= 1024).  bias: float32 [E] (selection only).
        top_k: experts per token (<= 32); n_group / topk_group: group-limited choice (1: off).
        renormalize: weights divided by their sum; scaling: multiplies the weights.
    Returns (topk_ids int32 [T, top_k], topk_weights float32 [T, top_k]), largest choice first.
    No host synchronisation on CUDA (CUDA-graph safe); deterministic.
    """
    _check(logits, bias, top_k, n_group, topk_group)
    return torch.ops.kdtree.moe_route(logits, bias, top_k, n_group, topk_group, renormalize, scaling)


torch.library.register_kernel("kdtree::moe_route", "cpu", moe_route_reference)


@torch.library.register_fake("kdtree::moe_route")
def _(logits, bias, top_k, n_group=1, topk_group=1, renormalize=True, scaling=1.0):
    T = logits.shape[0]
    return logits.new_empty((T, top_k), dtype=torch.int32), logits.new_empty((T, top_k))


__all__ = ["moe_route", "moe_route_reference", "MAX_EXPERTS", "MAX_TOPK", "MAX_GROUPS"]
