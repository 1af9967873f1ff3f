"""Tree-sized linear layers: ``kdtree::gemm_rows``.

``y = x @ weight.T`` for a few rows ``x`` [M <= 32, K] and an ``nn.Linear`` weight [N, K] without
bias, products summed in fp32 and rounded once to x's dtype.  Made for the linears of a tree-verify
pass (T = B + 1 = 5 ... 33 tokens), where reading the weight bounds the time: the CUDA kernel
(csrc/gemm_rows.cu) streams the weight once through tensor-core products (the rows ride in one or two
m16 tiles), split over K so that the whole GPU streams it, the splits summed in a fixed order (the
result does not depend on the run, but the fp32 summation order differs from a GEMM's: equal to the
reference to fp32 rounding before the final bf16 rounding).  bf16 only on CUDA; the CPU kernel is
:func:`gemm_rows_reference` (any float dtype).
"""
from __future__ import annotations

import torch

from ._checks import check_same_device, check_tensor

MAX_ROWS = 32
# Where the kernel pays against cuBLAS (bench/RESULTS.md run 182, H100, weights read from HBM): one m16
# tile of rows (5-16) at 1.0-1.55x on every K2 / 2p2b shape but MLP down (0.95x); two tiles at 17 rows
# ahead where K >= 4096 (q_a and kv_a 1.09-1.12x, shared up 1.40x, MLP up 1.04x, 2p2b MLP down 1.08x) and
# behind where K <= 2304 (0.85-0.98x); at 32 rows at par or behind but shared up.  Callers route these.
PAYS_ROWS = (5, 16)
PAYS_ROWS_LONG_K = (17, 20, 4096)  # (first row, last row, smallest K)


def gemm_rows_pays(rows: int, k: int | None = None) -> bool:
    """Whether a linear of ``rows`` rows and ``k`` inputs should go through ``kdtree::gemm_rows``
    (PAYS_ROWS at any K; PAYS_ROWS_LONG_K's rows where K is that long).  ``k`` None: whether it pays
    for some K (a plan's per-pass choice; each call then asks with its own K)."""
    if PAYS_ROWS[0] <= rows <= PAYS_ROWS[1]:
        return True
    lo, hi, min_k = PAYS_ROWS_LONG_K
    return lo <= rows <= hi and (k is None or k >= min_k)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(x, weight, op="gemm_rows") -> None:
    check_tensor(op, "x", x, _DTYPES, 2)
    if x.device.type != "cpu" and x.dtype != torch.bfloat16:
        raise TypeError(f"{op}: x must be torch.bfloat16 on {x.device.type} (other float dtypes are CPU-only), "
                        f"got {x.dtype}")
    check_tensor(op, "weight", weight, x.dtype, 2)
    M, K = x.shape
    if M > MAX_ROWS:
        raise ValueError(f"{op}: at most {MAX_ROWS} rows of x, got {M} (a GEMM is the form for more)")
    if K == 0 or K % 8:
        raise ValueError(f"{op}: K must be a positive multiple of 8, got {K}")
    if weight.shape[1] != K or weight.shape[0] == 0:
        raise ValueError(f"{op}: weight must be [N >= 1, K = {K}], got {tuple(weight.shape)}")
    check_same_device(op, x=x, weight=weight)


def gemm_rows_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Pure-torch reference (and CPU kernel) of ``kdtree::gemm_rows``: fp32 products, one rounding."""
    _check(x, weight)
    return (x.float() @ weight.float().T).to(x.dtype)


def gemm_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for x [..., K] of at most 32 rows in all (flattened, made contiguous) and
    weight [N, K] in x's dtype; returns [..., N].  No host synchronisation (CUDA-graph safe)."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K).contiguous()
    _check(x2, weight)
    return torch.ops.kdtree.gemm_rows(x2, weight).view(*lead, weight.shape[0])


torch.library.register_kernel("kdtree::gemm_rows", "cpu", gemm_rows_reference)


@torch.library.register_fake("kdtree::gemm_rows")
def _(x, weight):
    return x.new_empty((x.shape[0], weight.shape[0]))


__all__ = ["gemm_rows", "gemm_rows_reference", "gemm_rows_pays", "MAX_ROWS", "PAYS_ROWS", "PAYS_ROWS_LONG_K"]
