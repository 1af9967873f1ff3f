"""Decode-sized linear layers written for inductor.

For a handful of rows a linear layer is a GEMV: bound by reading the weight, yet a cuBLAS call
costs ~5 us of fixed latency on the H200 whatever its size, and the RMSNorm feeding it is one
more kernel.  Written as a broadcast multiply and a sum, inductor emits one reduction kernel
that reads the weight once and fuses the producers of ``x`` (the norm's scaling) into its loads.
The plan (plan.py, ``LayerPlan.matvec``) asks for this form in compiled CUDA passes of at most
``GEMV_ROWS`` rows; weights larger than ``GEMV_MAX_WEIGHT`` (the vocabulary head) keep the GEMM.
"""
from __future__ import annotations

import torch
from torch import nn

from torch_kdtree.ops import gemm_rows, gemm_rows_pays

GEMV_MAX_WEIGHT = 1 << 25  # elements; larger weights stay on cuBLAS (bandwidth-bound anyway)


def matvec(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` in fp32 as a broadcast product and a sum over the input dimension."""
    return (x.float()[..., None, :] * weight.float()).sum(-1)


def products_as_matvec(form, weight: torch.Tensor) -> bool:
    """Whether a product with ``weight`` takes the multiply + sum form (``form`` True or "matvec",
    a LayerPlan's ``linear_form``; weight not huge)."""
    return form in (True, "matvec") and weight.numel() <= GEMV_MAX_WEIGHT


def gemm_rows_takes(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` goes through kdtree::gemm_rows in the "rows" form: rows and K that
    pay (``gemm_rows_pays``), a contiguous weight of x's dtype."""
    k = weight.shape[-1]
    return gemm_rows_pays(x.numel() // max(1, k), k) and weight.is_contiguous() and weight.dtype == x.dtype


def linear(module: nn.Linear, x: torch.Tensor, form=False) -> torch.Tensor:
    """``module(x)``; with ``form`` True / "matvec" the same product as an fp32 multiply + sum (one
    fused reduction kernel under inductor), rounded to x's dtype like the GEMM; with "rows" through
    ``kdtree::gemm_rows`` where ``gemm_rows_pays`` says so for this call's rows and K (the weight
    streamed once; the plan asks for "rows" at row counts where it pays for some K)."""
    if products_as_matvec(form, module.weight):
        y = matvec(x, module.weight)
        if module.bias is not None:
            y = y + module.bias.float()
        return y.to(x.dtype)
    if form == "rows" and gemm_rows_takes(module.weight, x):
        y = gemm_rows(x, module.weight)
        return y if module.bias is None else y + module.bias
    return module(x)


def linears(modules, x: torch.Tensor, form=False) -> list[torch.Tensor]:
    """``[linear(m, x, form) for m in modules]`` for linears that read the same ``x``; in the "rows"
    form, where kdtree::gemm_rows takes every one of them (bf16 weights without bias, rows and K
    that pay), in one launch (q_a and kv_a; gate and up: one launch fewer, one split choice for their
    tiles together)."""
    if form == "rows" and all(m.bias is None and gemm_rows_takes(m.weight, x) for m in modules):
        return gemm_rows(x, [m.weight for m in modules])
    return [linear(m, x, form) for m in modules]


__all__ = ["linear", "linears", "gemm_rows_takes", "matvec", "products_as_matvec", "GEMV_MAX_WEIGHT"]
