"""Decode-sized linear layers under ``torch.compile``.

For a handful of rows a linear layer is a GEMV: bound by reading the weight, yet a cuBLAS call
costs ~5 us of fixed latency on the H200 whatever its size, and the RMSNorm feeding it is one
more kernel.  Written as a broadcast multiply and a sum, inductor emits one reduction kernel
that reads the weight once and fuses the producers of ``x`` (the norm's scaling) into its loads.
Eager code, large weights (the vocabulary head) and modules that others hook (tensor-parallel
wrappers, DTensor weights) keep ``module(x)``.
"""
from __future__ import annotations

import torch
from torch import nn

GEMV_ROWS = 4                 # at most this many rows (tokens) per call
GEMV_MAX_WEIGHT = 1 << 25     # elements; larger weights stay on cuBLAS (bandwidth-bound anyway)


def _on_gpu(x: torch.Tensor) -> bool:
    return x.is_cuda


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when ``x @ weight.T`` should be the fused multiply + sum (compiling, CUDA, few rows,
    a weight that is neither huge nor a DTensor)."""
    return (torch.compiler.is_compiling() and _on_gpu(x) and x.numel() <= GEMV_ROWS * x.shape[-1]
            and weight.numel() <= GEMV_MAX_WEIGHT and not hasattr(weight, "placements"))


def use_gemv_rows(rows: int, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """:func:`use_gemv` for a per-head (batched) product of ``rows`` tokens."""
    return (torch.compiler.is_compiling() and _on_gpu(x) and rows <= GEMV_ROWS
            and weight.numel() <= GEMV_MAX_WEIGHT and not hasattr(weight, "placements"))


def matvec(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` in fp32 as a broadcast product and a sum over the input dimension."""
    return (x.float()[..., None, :] * weight.float()).sum(-1)


def linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``; under torch.compile on CUDA with <= GEMV_ROWS rows, the same product as
    an fp32 multiply + sum (one fused reduction kernel), rounded to x's dtype like the GEMM."""
    hooked = module._forward_hooks or module._forward_pre_hooks  # e.g. tensor-parallel wrappers
    if use_gemv(x, module.weight) and not hooked:
        y = matvec(x, module.weight)
        if module.bias is not None:
            y = y + module.bias.float()
        return y.to(x.dtype)
    return module(x)


__all__ = ["linear", "matvec", "use_gemv", "use_gemv_rows", "GEMV_ROWS", "GEMV_MAX_WEIGHT"]
