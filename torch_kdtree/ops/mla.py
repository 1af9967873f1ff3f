"""Tree-verify MLA attention: ``kdtree::mla_tree_attention`` and ``kdtree::mla_tree_attention_out``.

Absorbed MLA (docs/kimi_k2.md) is MQA with d_k = 576 (512 latent + 64 rope) and d_v = 512 (the
latent part of the same cache row).  N tree nodes of R requests attend over one layer's paged
latent cache: node i sees every committed position [0, cache_lens[r]) and tree node j (whose
entry is already stored at position cache_lens[r] + j) iff visible[r, i, j].

:func:`mla_tree_attention_reference` is the ground truth and the CPU kernel of both ops; the
CUDA kernel (csrc/mla.cu) is compared with it by relative error.

An fp8 latent cache (models/kimi_k2/cache.py, ``kv_cache_dtype="fp8"``) is read as it is stored:
``kv_cache`` float8_e4m3fn rows of 640 bytes -- the 512 latent values in e4m3, then the 64 rope
values in bf16 (128 bytes, viewed as float8 storage) -- plus ``kv_scale`` float32 [num_pages,
page_size] (the layer's per-token power-of-two scales of the latent part, ``cache.kv_scale[layer]``).
A key is ``[latent.float() * scale | rope]``, exact in bf16 and fp32, so the query stays bf16 (fp32
on the CPU) and the kernel's products are those of the dequantised cache.
"""
from __future__ import annotations

import numbers

import torch

from ._checks import check_same_device, check_tensor, value_checks_active

KV_DIM = 576  # latent (512) + rope (64): the key dimension
V_DIM = 512  # the latent part of a cache row is the value
ROPE_DIM = KV_DIM - V_DIM
FP8_ROW_BYTES = V_DIM + 2 * ROPE_DIM  # an fp8 cache row: 512 e4m3 latent values, then 64 bf16 rope values
_FLOAT_DTYPES = (torch.bfloat16, torch.float32)
FP8 = torch.float8_e4m3fn
_CACHE_DTYPES = _FLOAT_DTYPES + (FP8,)
_SCORES_PER_CHUNK = 1 << 24  # bounds the reference's float32 score tile (64 MiB)


def _check(q, kv_cache, block_table, cache_lens, visible, softmax_scale, out=None, lse=None, kv_scale=None) -> None:
    op = "mla_tree_attention"
    check_tensor(op, "q", q, _FLOAT_DTYPES, 4)
    check_tensor(op, "kv_cache", kv_cache, _CACHE_DTYPES, 3)
    check_tensor(op, "block_table", block_table, torch.int32, 2)
    check_tensor(op, "cache_lens", cache_lens, torch.int32, 1)
    check_tensor(op, "visible", visible, torch.bool, 3)
    check_same_device(op, q=q, kv_cache=kv_cache, block_table=block_table, cache_lens=cache_lens, visible=visible)
    R, N, H, D = q.shape
    if D != KV_DIM:
        raise ValueError(f"{op}: q head dim must be {KV_DIM} (512 absorbed latent + 64 rope), got {D}")
    if kv_cache.dtype == FP8:
        if kv_cache.shape[2] != FP8_ROW_BYTES:
            raise ValueError(f"{op}: a {FP8} kv_cache must be [num_pages, page_size, {FP8_ROW_BYTES}] (512 e4m3 "
                             f"latent values, then 64 bf16 rope values as 128 bytes: KimiK2Cache's fp8 rows), got "
                             f"{tuple(kv_cache.shape)}")
        if kv_scale is None:
            raise ValueError(f"{op}: kv_scale is required with a {FP8} kv_cache: float32 [num_pages, page_size] = "
                             f"{tuple(kv_cache.shape[:2])}, the layer's per-token scales (cache.kv_scale[layer])")
        check_tensor(op, "kv_scale", kv_scale, torch.float32)
        check_same_device(op, kv_cache=kv_cache, kv_scale=kv_scale)
        if tuple(kv_scale.shape) != tuple(kv_cache.shape[:2]):
            raise ValueError(f"{op}: kv_scale must be float32 [num_pages, page_size] = {tuple(kv_cache.shape[:2])} "
                             f"(one scale per cache row), got {tuple(kv_scale.shape)}")
    else:
        if kv_cache.shape[2] != KV_DIM:
            raise ValueError(f"{op}: kv_cache must be [num_pages, page_size, {KV_DIM}], got {tuple(kv_cache.shape)}")
        if kv_cache.dtype != q.dtype:
            raise TypeError(f"{op}: kv_cache dtype {kv_cache.dtype} must equal q dtype {q.dtype}")
        if kv_scale is not None:
            raise ValueError(f"{op}: kv_scale is given but kv_cache is {kv_cache.dtype}: scales belong to a {FP8} "
                             f"cache (pass kv_scale=None)")
    if N < 1 or H < 1:
        raise ValueError(f"{op}: q must have N >= 1 nodes and H >= 1 heads, got shape {tuple(q.shape)}")
    if block_table.shape[0] != R or cache_lens.shape[0] != R:
        raise ValueError(f"{op}: block_table and cache_lens must have R = {R} rows, got "
                         f"{block_table.shape[0]} and {cache_lens.shape[0]}")
    if tuple(visible.shape) != (R, N, N):
        raise ValueError(f"{op}: visible must be [R, N, N] = {(R, N, N)}, got {tuple(visible.shape)}")
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"{op}: softmax_scale must be a float, got {type(softmax_scale).__name__}")
    if out is not None:
        check_tensor(op, "out", out, q.dtype, 4)
        check_same_device(op, q=q, out=out)
        if tuple(out.shape) != (R, N, H, V_DIM):
            raise ValueError(f"{op}: out must be [R, N, H, {V_DIM}] = {(R, N, H, V_DIM)}, got {tuple(out.shape)}")
    if lse is not None:
        check_tensor(op, "lse", lse, torch.float32, 3)
        check_same_device(op, q=q, lse=lse)
        if tuple(lse.shape) != (R, N, H):
            raise ValueError(f"{op}: lse must be [R, N, H] = {(R, N, H)}, got {tuple(lse.shape)}")
    if not value_checks_active(cache_lens) or R == 0:
        return
    check_pages(op, kv_cache.shape[0], kv_cache.shape[1], block_table, cache_lens, N)


def check_pages(op: str, num_pages: int, page_size: int, block_table: torch.Tensor, cache_lens: torch.Tensor,
                n: int) -> None:
    """Value checks (they read the tensors) of a paged cache's block table for n new positions per
    request: cache_lens non-negative, and the entries covering positions [0, cache_lens + n) present
    and page ids in [0, num_pages)."""
    if (cache_lens < 0).any():
        raise ValueError(f"{op}: cache_lens must be non-negative")
    need_pages = (cache_lens.long() + n + page_size - 1) // page_size
    if (need_pages > block_table.shape[1]).any():
        raise ValueError(f"{op}: block_table has {block_table.shape[1]} pages per request, too few for positions "
                         f"[0, cache_lens + {n}) = {int(cache_lens.max()) + n} positions with page_size {page_size}")
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < need_pages[:, None]
    if (used & ((block_table < 0) | (block_table >= num_pages))).any():
        raise ValueError(f"{op}: block_table entries covering positions [0, cache_lens + {n}) must be page ids "
                         f"in [0, {num_pages})")


def fp8_rows_to_keys(rows: torch.Tensor, scale: torch.Tensor, rope_dim: int = ROPE_DIM) -> torch.Tensor:
    """fp8 cache rows [..., n + 2 rope_dim] (uint8 or float8_e4m3fn storage; 640 bytes for K2) and
    their scales [...] -> float32 rows [..., n + rope_dim]: ``[latent (n e4m3 values) * scale | rope
    (rope_dim bf16 values)]``, exact."""
    b = rows.view(torch.uint8)
    n = b.shape[-1] - 2 * rope_dim
    latent = b[..., :n].view(FP8).float() * scale[..., None]
    rope = b[..., n:].contiguous().view(torch.bfloat16).float()
    return torch.cat([latent, rope], dim=-1)


def _attend(q, kv_cache, block_table, cache_lens, visible, softmax_scale, kv_scale=None):
    """(out in q's dtype [R, N, H, 512], lse float32 [R, N, H]) by gathering and a float32 softmax;
    fp8 rows are dequantised as gathered (:func:`fp8_rows_to_keys`: exact in fp32)."""
    R, N, H, _ = q.shape
    page_size = kv_cache.shape[1]
    out = torch.empty((R, N, H, V_DIM), dtype=q.dtype, device=q.device)
    lse = torch.empty((R, N, H), dtype=torch.float32, device=q.device)
    for r in range(R):
        L = int(cache_lens[r])
        pos = torch.arange(L + N, device=q.device)
        pages = block_table[r].long()[pos // page_size]
        slot = pos % page_size
        if kv_scale is None:
            keys = kv_cache[pages, slot].float()  # [L + N, 576]
        else:  # gathered as bytes (index kernels need not cover float8), then dequantised
            keys = fp8_rows_to_keys(kv_cache.view(torch.uint8)[pages, slot], kv_scale[pages, slot])
        values = keys[:, :V_DIM]
        chunk = max(1, _SCORES_PER_CHUNK // (H * (L + N)))
        for n0 in range(0, N, chunk):
            n1 = min(N, n0 + chunk)
            s = torch.einsum("nhd,kd->nhk", q[r, n0:n1].float(), keys) * float(softmax_scale)
            s[:, :, L:].masked_fill_(~visible[r, n0:n1, None, :], float("-inf"))
            m = torch.logsumexp(s, dim=-1)  # [n, H]; -inf for a row that sees nothing
            p = torch.exp(s - torch.where(torch.isfinite(m), m, 0.0)[..., None])
            out[r, n0:n1] = (p @ values).to(q.dtype)
            lse[r, n0:n1] = m
    return out, lse


def mla_tree_attention_reference(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                                 cache_lens: torch.Tensor, visible: torch.Tensor,
                                 softmax_scale: float, prefix_ready: bool = False,
                                 kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch reference (and CPU kernel) of ``kdtree::mla_tree_attention`` (``prefix_ready`` is
    a scheduling hint for the CUDA kernel; it does not change the result)."""
    _check(q, kv_cache, block_table, cache_lens, visible, softmax_scale, kv_scale=kv_scale)
    return _attend(q, kv_cache, block_table, cache_lens, visible, softmax_scale, kv_scale)[0]


def mla_tree_attention_out_reference(q, kv_cache, block_table, cache_lens, visible, softmax_scale, out, lse,
                                     prefix_ready: bool = False, kv_scale=None) -> None:
    """Pure-torch reference (and CPU kernel) of ``kdtree::mla_tree_attention_out``."""
    _check(q, kv_cache, block_table, cache_lens, visible, softmax_scale, out, lse, kv_scale)
    o, m = _attend(q, kv_cache, block_table, cache_lens, visible, softmax_scale, kv_scale)
    out.copy_(o)
    if lse is not None:
        lse.copy_(m)


def mla_tree_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, cache_lens: torch.Tensor,
                       visible: torch.Tensor, softmax_scale: float, *, out: torch.Tensor | None = None,
                       return_lse: bool = False, prefix_ready: bool = False, kv_scale: torch.Tensor | None = None):
    """Absorbed-MLA attention of N tree nodes over one layer's paged latent KV cache.

    Args:
        q: [R, N, H, 576] bfloat16 (float32 accepted by the CPU kernel): per node and head the
            absorbed query q_nope·W_UK (512) followed by the rotated rope query (64). Contiguous.
        kv_cache: [num_pages, page_size, 576] in q's dtype: one layer of the latent cache, rows
            ``[kv_a_layernorm(c) (512) | rope(k_rope) (64)]``; e.g. ``cache[layer]`` of the
            contiguous all-layer tensor [num_layers, num_pages, page_size, 576].  Or an fp8 cache
            (with ``kv_scale``): float8_e4m3fn [num_pages, page_size, 640], the latent part as 512
            e4m3 values, then the rope part as 64 bf16 values (128 bytes).
        block_table: int32 [R, max_pages], logical page -> physical page; must cover
            cache_lens[r] + N positions.
        cache_lens: int32 [R], committed prefix length (on the device; one CUDA graph serves
            every step). Tree node j's entry is already stored at position cache_lens[r] + j.
        visible: bool [R, N, N]; node i sees tree node j iff visible[r, i, j] (``Tree.visible``:
            ancestor-or-self). Every committed position is visible to every node.
        softmax_scale: multiplies q·k before the softmax (K2: 192**-0.5 · mscale², docs/kimi_k2.md).
        out: optional caller-owned [R, N, H, 512] output in q's dtype (the hot path: no allocation).
        return_lse: also return the log-sum-exp float32 [R, N, H] (natural log, scaled scores).
        prefix_ready: the caller's promise that cache_lens, block_table and the committed rows
            [0, cache_lens[r]) of kv_cache were not written by the kernel launched just before this
            op (only by earlier ones), so the CUDA kernel, launched with programmatic dependent
            launch, may copy committed keys before waiting for that kernel (the model's passes: the
            previous kernel writes only the query and the new rows).  It never changes the result;
            leave it False when in doubt.
        kv_scale: float32 [num_pages, page_size], required with a float8_e4m3fn ``kv_cache`` (None
            otherwise): key = [latent * scale | rope] (``KimiK2Cache.kv_scale[layer]``,
            power-of-two scales, so the dequantised keys are exact in bf16).

    Returns ``out`` [R, N, H, 512] = softmax(scale · q·kᵀ over the visible keys) · v with v the
    first 512 dims of each key, or ``(out, lse)`` when ``return_lse``. A row that sees no key
    (only possible when cache_lens[r] = 0 and visible[r, i] is all false) gives 0 and lse -inf.
    Ops: ``kdtree::mla_tree_attention`` (functional) and ``kdtree::mla_tree_attention_out``
    (writes ``out`` and, when given, ``lse``; returns nothing).
    """
    if out is None and not return_lse:
        _check(q, kv_cache, block_table, cache_lens, visible, softmax_scale, kv_scale=kv_scale)
        return torch.ops.kdtree.mla_tree_attention(q, kv_cache, block_table, cache_lens, visible, float(softmax_scale),
                                                   bool(prefix_ready), kv_scale)
    if out is None:
        out = q.new_empty((*q.shape[:3], V_DIM))
    lse = q.new_empty(q.shape[:3], dtype=torch.float32) if return_lse else None
    _check(q, kv_cache, block_table, cache_lens, visible, softmax_scale, out, lse, kv_scale)
    torch.ops.kdtree.mla_tree_attention_out(q, kv_cache, block_table, cache_lens, visible, float(softmax_scale),
                                            out, lse, bool(prefix_ready), kv_scale)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------------------------
# registration: CPU kernels (the reference) and fake kernels
# --------------------------------------------------------------------------------------------

torch.library.register_kernel("kdtree::mla_tree_attention", "cpu", mla_tree_attention_reference)
torch.library.register_kernel("kdtree::mla_tree_attention_out", "cpu", mla_tree_attention_out_reference)


@torch.library.register_fake("kdtree::mla_tree_attention")
def _(q, kv_cache, block_table, cache_lens, visible, softmax_scale, prefix_ready=False, kv_scale=None):
    return q.new_empty((*q.shape[:3], V_DIM))


@torch.library.register_fake("kdtree::mla_tree_attention_out")
def _(q, kv_cache, block_table, cache_lens, visible, softmax_scale, out, lse, prefix_ready=False, kv_scale=None):
    return None
