"""The MoE block's input norm, router GEMV and noaux_tc choice in one op: ``kdtree::moe_router``.

From the residual stream ``x`` [T, H] (bf16), the post-attention RMSNorm's ``norm_weight`` [H]
(bf16), the router's ``router_weight`` [E, H] (fp32, or bf16 as K2's checkpoints ship it) and
``e_score_correction_bias`` [E]:

1. ``x_norm = bf16(norm_weight · bf16(x · rsqrt(mean(x²) + eps)))`` (the model's RMSNorm, fp32
   statistics) -- the routed and shared experts' input;
2. ``logits = x_norm.float() @ router_weight.float().T`` in fp32;
3. ``(topk_ids, topk_weights) = moe_route(logits, bias, ...)`` (see ops/moe_route.py).

Returns ``(x_norm, logits, topk_ids, topk_weights)``.  The CUDA kernel (csrc/moe_router.cu) is one
launch: every block normalises the rows, warps compute segments of router rows, and the last
block to finish picks the experts; the CPU kernel is :func:`moe_router_reference`.  The CUDA
kernel's logits differ from the reference's by fp32 summation order only; on CUDA, calls on one
device must be stream-ordered (the kernel keeps a per-device ticket that it resets every launch).
"""
from __future__ import annotations

import torch

from ._checks import check_same_device, check_tensor
from .moe_route import MAX_EXPERTS, MAX_GROUPS, MAX_TOPK, _check as _check_route, moe_route_reference

MAX_HIDDEN = 45056  # the CUDA kernel keeps at least one normalised row (bf16) in 88 KB of shared memory


def _check(x, norm_weight, router_weight, bias, top_k, n_group, topk_group, op="moe_router") -> None:
    check_tensor(op, "x", x, torch.bfloat16, 2)
    check_tensor(op, "norm_weight", norm_weight, torch.bfloat16, 1)
    check_tensor(op, "router_weight", router_weight, (torch.float32, torch.bfloat16), 2)
    check_tensor(op, "bias", bias, torch.float32, 1)
    check_same_device(op, x=x, norm_weight=norm_weight, router_weight=router_weight, bias=bias)
    H = x.shape[1]
    if H == 0 or H % 8 or H > MAX_HIDDEN:
        raise ValueError(f"{op}: H must be a positive multiple of 8 up to {MAX_HIDDEN}, got {H}")
    if norm_weight.shape[0] != H or router_weight.shape[1] != H:
        raise ValueError(f"{op}: norm_weight must be [H = {H}] and router_weight [E, H], got "
                         f"{tuple(norm_weight.shape)} and {tuple(router_weight.shape)}")
    E = router_weight.shape[0]
    _check_route(x.new_empty((0, E), dtype=torch.float32), bias, top_k, n_group, topk_group, op=op)


def rms_norm_bf16(x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm rounding points: bf16(w · bf16(x · rsqrt(mean(x²) + eps)))."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return norm_weight * h.to(x.dtype)


def moe_router_reference(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, router_weight: torch.Tensor,
                         bias: torch.Tensor, top_k: int, n_group: int = 1, topk_group: int = 1,
                         renormalize: bool = True, scaling: float = 1.0):
    """Pure-torch reference (and CPU kernel) of ``kdtree::moe_router`` (module docstring)."""
    _check(x, norm_weight, router_weight, bias, top_k, n_group, topk_group)
    x_norm = rms_norm_bf16(x, norm_weight, eps)
    logits = x_norm.float() @ router_weight.float().T
    ids, weights = moe_route_reference(logits, bias, top_k, n_group, topk_group, renormalize, scaling)
    return x_norm, logits, ids, weights


def moe_router(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, router_weight: torch.Tensor,
               bias: torch.Tensor, top_k: int, n_group: int = 1, topk_group: int = 1, renormalize: bool = True,
               scaling: float = 1.0):
    """RMSNorm, router logits and the noaux_tc expert choice of a MoE block.

    Args:
        x: bf16 [T, H] (H a multiple of 8, at most 45056); norm_weight: bf16 [H]; eps: the norm's epsilon.
        router_weight: float32 or bfloat16 [E, H] (E <= 1024); bias: float32 [E] (selection only).
        top_k (<= 32), n_group, topk_group, renormalize, scaling: as :func:`moe_route`.
    Returns (x_norm bf16 [T, H], logits float32 [T, E], topk_ids int32 [T, top_k], topk_weights
    float32 [T, top_k]).  No host synchronisation on CUDA (CUDA-graph safe); deterministic.
    """
    _check(x, norm_weight, router_weight, bias, top_k, n_group, topk_group)
    return torch.ops.kdtree.moe_router(x, norm_weight, eps, router_weight, bias, top_k, n_group, topk_group,
                                       renormalize, scaling)


torch.library.register_kernel("kdtree::moe_router", "cpu", moe_router_reference)


@torch.library.register_fake("kdtree::moe_router")
def _(x, norm_weight, eps, router_weight, bias, top_k, n_group=1, topk_group=1, renormalize=True, scaling=1.0):
    T, E = x.shape[0], router_weight.shape[0]
    f32 = torch.float32
    return (x.new_empty(x.shape), x.new_empty((T, E), dtype=f32), x.new_empty((T, top_k), dtype=torch.int32),
            x.new_empty((T, top_k), dtype=f32))


__all__ = ["moe_router", "moe_router_reference", "rms_norm_bf16", "MAX_HIDDEN", "MAX_EXPERTS", "MAX_TOPK",
           "MAX_GROUPS"]
