"""Decode-sized linear layers under ``torch.compile``.

For a handful of rows a linear layer is a GEMV: bound by reading the weight, yet a cuBLAS call
costs ~5 us of fixed latency on the H200 whatever its size, and the RMSNorm feeding it is one
more kernel.  Written as a broadcast multiply and a sum, inductor emits one reduction kernel
that reads the weight once and fuses the producers of ``x`` (the norm's scaling) into its loads.
Eager code, large weights (the vocabulary head) and modules that others hook (tensor-parallel
wrappers, DTensor weights) keep ``module(x)``.

Where ``kdtree::gemv`` has a CUDA kernel, bf16 layers of at most FUSED_ROWS rows go to it instead,
eager or compiled (:func:`use_fused`): it takes the RMSNorm before a projection (and the SwiGLU
product and the residual add) into the same kernel.  On the H200 (RESULTS.md, run 35) it matches
inductor's form at one row on 5-10 MB weights, beats it on the SwiGLU down projections and K2's
7168-wide inputs, and is 1.5-5x faster at 2-4 rows (a small tree verify, a few requests).
"""
from __future__ import annotations

import torch
from torch import nn

from torch_kdtree.ops import gemv as fused_gemv

GEMV_ROWS = 4                 # at most this many rows (tokens) per call
GEMV_MAX_WEIGHT = 1 << 25     # elements; larger weights stay on cuBLAS (bandwidth-bound anyway)
FUSED_ROWS = 4                # kdtree::gemv: at most this many rows (one block of rows in the kernel)

# Read once at import (torch_kdtree has loaded its kernels by now), a constant for torch.compile.
_HAS_GEMV_CUDA = torch._C._dispatch_has_kernel_for_dispatch_key("kdtree::gemv", "CUDA")


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


def use_fused(x: torch.Tensor, *modules: nn.Module) -> bool:
    """True when ``kdtree::gemv`` should compute these modules (linears and RMSNorms) on ``x``:
    the CUDA kernel built, x bf16 on CUDA with at most FUSED_ROWS rows, and every module plain --
    bf16 contiguous weights that are not DTensors, no bias, no hooks (tensor-parallel wrappers)."""
    return (_HAS_GEMV_CUDA and _on_gpu(x) and x.dtype == torch.bfloat16 and x.numel() <= FUSED_ROWS * x.shape[-1]
            and plain_bf16(*modules))


def plain_bf16(*modules: nn.Module) -> bool:
    """Every module's ``weight`` is a plain contiguous bf16 tensor (not a DTensor), with no bias and
    no hooks (tensor-parallel wrappers): a fused kernel may read it directly."""
    for m in modules:
        w = m.weight
        if (getattr(m, "bias", None) is not None or m._forward_hooks or m._forward_pre_hooks
                or w.dtype != torch.bfloat16 or hasattr(w, "placements") or not w.is_contiguous()):
            return False
    return True


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


__all__ = ["linear", "matvec", "use_fused", "plain_bf16", "fused_gemv", "use_gemv", "use_gemv_rows", "GEMV_ROWS",
           "GEMV_MAX_WEIGHT", "FUSED_ROWS"]
