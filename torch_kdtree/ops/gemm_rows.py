"""Tree-sized linear layers: ``kdtree::gemm_rows``.

``y = x @ weight.T`` for a few rows ``x`` [M <= 32, K] and an ``nn.Linear`` weight [N, K] without
bias, products summed in fp32 and rounded once to x's dtype; or for up to three weights that read the
same x (q_a and kv_a; gate and up; q, k and v) in one launch.  Made for the linears of a tree-verify
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
MAX_WEIGHTS = 3  # weights sharing one x in one launch (q_a + kv_a; gate + up; q + k + v)


def _check(x, weights, op="gemm_rows") -> None:
    check_tensor(op, "x", x, _DTYPES, 2)
    if x.device.type != "cpu" and x.dtype != torch.bfloat16:
        raise TypeError(f"{op}: x must be torch.bfloat16 on {x.device.type} (other float dtypes are CPU-only), "
                        f"got {x.dtype}")
    if not 1 <= len(weights) <= MAX_WEIGHTS:
        raise ValueError(f"{op}: 1 to {MAX_WEIGHTS} weights sharing x, got {len(weights)}")
    M, K = x.shape
    if M > MAX_ROWS:
        raise ValueError(f"{op}: at most {MAX_ROWS} rows of x, got {M} (a GEMM is the form for more)")
    if K == 0 or K % 8:
        raise ValueError(f"{op}: K must be a positive multiple of 8, got {K}")
    for i, weight in enumerate(weights):
        name = "weight" if len(weights) == 1 else f"weights[{i}]"
        check_tensor(op, name, weight, x.dtype, 2)
        if weight.shape[1] != K or weight.shape[0] == 0:
            raise ValueError(f"{op}: {name} must be [N >= 1, K = {K}], got {tuple(weight.shape)}")
        check_same_device(op, x=x, **{name: weight})


def gemm_rows_reference(x: torch.Tensor, weights):
    """Pure-torch reference (and CPU kernel) of ``kdtree::gemm_rows``: per weight, fp32 products and
    one rounding.  ``weights`` a list (the op's form: a list back) or one weight (one tensor back)."""
    if isinstance(weights, torch.Tensor):
        return gemm_rows_reference(x, [weights])[0]
    _check(x, weights)
    return [(x.float() @ w.float().T).to(x.dtype) for w in weights]


def gemm_rows(x: torch.Tensor, weight):
    """``x @ weight.T`` for x [..., K] of at most 32 rows in all (flattened, made contiguous) and
    weight [N, K] in x's dtype; returns [..., N].  ``weight`` a list of up to three weights [N_i, K]:
    all of them in one launch (their tiles side by side in one grid), returning the list of
    [..., N_i].  No host synchronisation (CUDA-graph safe)."""
    single = isinstance(weight, torch.Tensor)
    weights = [weight] if single else list(weight)
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K).contiguous()
    _check(x2, weights)
    out = [y.view(*lead, w.shape[0]) for y, w in zip(torch.ops.kdtree.gemm_rows(x2, weights), weights)]
    return out[0] if single else out


torch.library.register_kernel("kdtree::gemm_rows", "cpu", gemm_rows_reference)


@torch.library.register_fake("kdtree::gemm_rows")
def _(x, weights):
    return [x.new_empty((x.shape[0], w.shape[0])) for w in weights]


__all__ = ["gemm_rows", "gemm_rows_reference", "gemm_rows_pays", "MAX_ROWS", "MAX_WEIGHTS", "PAYS_ROWS",
           "PAYS_ROWS_LONG_K"]
