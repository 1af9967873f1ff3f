"""Decode-sized linear layers with a fused prologue and epilogue: ``kdtree::gemv``.

``outs[i] = prologue(x) @ weights[i].T`` for up to four weights ``[N_i, K]`` that share the input
``x`` ``[M, K]`` (e.g. MLA's q_a and kv_a projections, or an MLP's gate and up), one launch.
The prologue is one of:

- none: ``x``;
- ``norm_weight`` [K] (RMSNorm): ``bf16(norm_weight · bf16(x · rsqrt(mean(x²) + eps)))`` -- the
  rounding points of the model's ``KimiK2RMSNorm`` / transformers' ``DeepseekV3RMSNorm``, sum of
  squares in fp32;
- ``up`` [M, K] (SwiGLU, ``x`` the gate projection): ``bf16(silu(x) · up)`` in fp32.

Products are summed in fp32 and rounded once to x's dtype: ``y_i = bf16(prologue(x) @ W_i.T)``.
With one weight and a ``residual`` [M, N]: ``out = bf16(residual + y)`` (the residual add a
decoder layer does after its attention or MLP).  ``fp32_outputs = n`` keeps the first n outputs as
the fp32 sums (a router's logits); ``return_input`` also returns the prologue's output (the
normalised input that a router's experts read next), so a norm, a router and more projections of
the same input are one launch.

The CUDA kernel (csrc/gemv.cu) streams each weight once (bulk copies into shared-memory stages, or
loads into registers where those do not fit: the same bits) with its loads issued before the prologue:
made for a few rows (decode, up to a handful of tokens), where a GEMM's fixed cost and a separate
norm kernel dominate; larger M works (blocks of 4 rows re-read the weight) but belongs to a GEMM.
The CPU kernel is :func:`gemv_reference`.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from ._checks import check_same_device, check_tensor

MAX_WEIGHTS = 4
MAX_K = 48 * 1024  # the kernel keeps a row of the prologue's output in 96 KB of shared memory
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(x, weights, norm_weight, eps, up, residual, fp32_outputs=0, return_input=False, op="gemv") -> None:
    check_tensor(op, "x", x, _DTYPES, 2)
    if x.device.type != "cpu" and x.dtype != torch.bfloat16:
        raise TypeError(f"{op}: x must be torch.bfloat16 on {x.device.type} (other float dtypes are CPU-only), "
                        f"got {x.dtype}")
    if not isinstance(weights, (list, tuple)) or not 1 <= len(weights) <= MAX_WEIGHTS:
        raise ValueError(f"{op}: weights must be a list of 1 to {MAX_WEIGHTS} tensors, got "
                         f"{len(weights) if isinstance(weights, (list, tuple)) else type(weights).__name__}")
    M, K = x.shape
    if K == 0 or K % 8 or K > MAX_K:
        raise ValueError(f"{op}: K must be a positive multiple of 8 up to {MAX_K}, got {K}")
    named = {"x": x}
    for i, w in enumerate(weights):
        check_tensor(op, f"weights[{i}]", w, x.dtype, 2)
        if w.shape[1] != K:
            raise ValueError(f"{op}: weights[{i}] must be [N, K = {K}], got {tuple(w.shape)}")
        named[f"weights[{i}]"] = w
    if norm_weight is not None and up is not None:
        raise ValueError(f"{op}: norm_weight (RMSNorm) and up (SwiGLU) are exclusive prologues")
    if norm_weight is not None:
        check_tensor(op, "norm_weight", norm_weight, x.dtype, 1)
        if norm_weight.shape[0] != K:
            raise ValueError(f"{op}: norm_weight must be [K = {K}], got {tuple(norm_weight.shape)}")
        if not eps >= 0:
            raise ValueError(f"{op}: eps must be >= 0, got {eps}")
        named["norm_weight"] = norm_weight
    if up is not None:
        check_tensor(op, "up", up, x.dtype, 2)
        if up.shape != x.shape:
            raise ValueError(f"{op}: up must be x's shape {tuple(x.shape)}, got {tuple(up.shape)}")
        named["up"] = up
    if isinstance(fp32_outputs, bool) or not isinstance(fp32_outputs, int) or not 0 <= fp32_outputs <= len(weights):
        raise ValueError(f"{op}: fp32_outputs must be an int in [0, {len(weights)}] (the number of weights), got "
                         f"{fp32_outputs!r}")
    if not isinstance(return_input, bool):
        raise TypeError(f"{op}: return_input must be a bool, got {type(return_input).__name__}")
    if residual is not None:
        if len(weights) != 1:
            raise ValueError(f"{op}: a residual needs exactly one weight, got {len(weights)}")
        if fp32_outputs:
            raise ValueError(f"{op}: a residual is added to a rounded output; it cannot go with fp32_outputs")
        check_tensor(op, "residual", residual, x.dtype, 2)
        if tuple(residual.shape) != (M, weights[0].shape[0]):
            raise ValueError(f"{op}: residual must be [M, N] = {(M, weights[0].shape[0])}, got "
                             f"{tuple(residual.shape)}")
        named["residual"] = residual
    check_same_device(op, **named)


def gemv_reference(x: torch.Tensor, weights: Sequence[torch.Tensor], norm_weight: Optional[torch.Tensor] = None,
                   eps: float = 1e-6, up: Optional[torch.Tensor] = None,
                   residual: Optional[torch.Tensor] = None, fp32_outputs: int = 0,
                   return_input: bool = False) -> list[torch.Tensor]:
    """Pure-torch reference (and CPU kernel) of ``kdtree::gemv``, with the rounding points of the
    module docstring."""
    _check(x, weights, norm_weight, eps, up, residual, fp32_outputs, return_input)
    dt = x.dtype
    xf = x.float()
    if norm_weight is not None:
        xn = (norm_weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dt).float()).to(dt)
    elif up is not None:
        xn = (F.silu(xf) * up.float()).to(dt)
    else:
        xn = x
    outs = [(xn.float() @ w.float().T) for w in weights]
    outs = [o if i < fp32_outputs else o.to(dt) for i, o in enumerate(outs)]
    if residual is not None:
        outs[0] = (residual.float() + outs[0].float()).to(dt)
    if return_input:
        outs.append(xn.clone() if xn is x else xn)
    return outs


def gemv(x: torch.Tensor, weights: Sequence[torch.Tensor], norm_weight: Optional[torch.Tensor] = None,
         eps: float = 1e-6, up: Optional[torch.Tensor] = None,
         residual: Optional[torch.Tensor] = None, fp32_outputs: int = 0,
         return_input: bool = False) -> list[torch.Tensor]:
    """Linear layers sharing one input, with an optional RMSNorm or SwiGLU prologue and a residual.

    Args:
        x: [..., K] (flattened to rows, made contiguous); bf16 on CUDA (bf16 / fp16 / fp32 on CPU). K a multiple of 8.
        weights: 1 to 4 weights [N_i, K] in x's dtype (nn.Linear layout, no bias).
        norm_weight: [K]: the input is ``RMSNorm(x) · norm_weight`` (``eps`` inside the rsqrt).
        up: x's shape: the input is ``silu(x) · up``. Exclusive with ``norm_weight``.
        residual: [..., N] with one weight: returns ``residual + y``.
        fp32_outputs: the first this many outputs are the fp32 sums, not rounded to x's dtype (a
            router's logits).
        return_input: also return the prologue's output (x's shape and dtype: e.g. the normalised
            input that the experts after a router read), after the outputs.
    Returns a list of [..., N_i] in x's dtype (fp32 for the first ``fp32_outputs``), then the
    prologue's output if asked.  No host synchronisation (CUDA-graph safe); deterministic.
    """
    lead = x.shape[:-1]
    K = x.shape[-1]
    x2 = x.reshape(-1, K).contiguous()
    up2 = up.reshape(-1, K).contiguous() if up is not None else None
    res2 = residual.reshape(-1, residual.shape[-1]).contiguous() if residual is not None else None
    weights = list(weights)
    _check(x2, weights, norm_weight, eps, up2, res2, fp32_outputs, return_input)
    outs = torch.ops.kdtree.gemv(x2, weights, norm_weight, eps, up2, res2, fp32_outputs, return_input)
    return [o.view(*lead, o.shape[-1]) for o in outs]


torch.library.register_kernel("kdtree::gemv", "cpu", gemv_reference)


@torch.library.register_fake("kdtree::gemv")
def _(x, weights, norm_weight=None, eps=1e-6, up=None, residual=None, fp32_outputs=0, return_input=False):
    outs = [x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32 if i < fp32_outputs else x.dtype)
            for i, w in enumerate(weights)]
    if return_input:
        outs.append(torch.empty_like(x))
    return outs


__all__ = ["gemv", "gemv_reference", "MAX_WEIGHTS", "MAX_K"]
