"""The absorbed-MLA steps around ``mla_tree_attention`` in a decode / tree-verify pass:
``kdtree::mla_prepare`` before it and ``kdtree::mla_output`` after it; ``kdtree::mla_decode`` runs
all three for one token per request (one launch on CUDA).

mla_prepare
-----------
Between the query / latent projections and the attention a decode step has four small steps that
torch code runs as four to five kernels (~8-10 us a layer on the H200, run 44).  This op does
them in one launch, for M tokens of one layer:

1. ``q`` [M, h, dn + dr] splits into q_nope [.., dn] and q_pe [.., dr]; ``q_rope = rope(q_pe)``
   (fp32 products, rounded to q's dtype);
2. ``ckv`` [M, dc + dr] splits into c [.., dc] and k_pe [.., dr]; the cache entry is
   ``[norm_weight * rmsnorm(c) | rope(k_pe)]`` with ``rmsnorm(c) = c * rsqrt(mean(c^2) + eps)`` in
   fp32, rounded to ckv's dtype before the weight multiplies it (KimiK2RMSNorm), written to
   ``kv_cache[layer]`` at the flat ``slots`` (page * page_size + offset) -- in place;
3. ``q_abs[m, h] = q_nope[m, h] @ W_UK[h]`` in fp32, rounded to q's dtype, where W_UK[h] is the
   first dn rows of head h's block of ``w_kv_b`` ([h * (dn + dv), dc], kv_b_proj's weight);
4. returns ``cat([q_abs, q_rope], -1)`` [M, h, dc + dr] in the cache's dtype: the query of
   ``mla_tree_attention``.

RoPE rotates pairs (x1, x2) -- interleaved (x0, x1), (x2, x3), ... with ``interleave`` (DeepSeek),
else the two halves -- by ``cos`` / ``sin`` [M, dr / 2] (fp32) into ``[x1 c - x2 s | x2 c + x1 s]``
(the model's ``apply_rope``).  dc, dr and dn come from the shapes: dc = norm_weight's size,
dr = the cache row minus dc, dn = q's last dimension minus dr.

mla_output
----------
``out[m, h] = o_lat[m, h] @ W_UV[h]^T`` in fp32, rounded to o_lat's dtype: the attention's
latent output [M, h, dc] mapped to the heads' values [M, h, dv], W_UV[h] being the last dv rows of
head h's block of ``w_kv_b`` (dv = rows / h - dn, ``qk_nope_head_dim`` = dn) -- o_proj's input.

The CUDA kernels (csrc/mla_absorb.cu) take bf16 tensors (fp32 cos / sin, int64 slots) with dc a
multiple of 256 up to 1024 (and, for mla_prepare, dn <= 256 and dr a multiple of 8 up to 256);
the ``*_reference`` functions are the ground truth and the CPU kernels.
"""
from __future__ import annotations

import numbers

import torch

from ._checks import check_same_device, check_tensor, value_checks_active

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(q, ckv, cos, sin, norm_weight, eps, w_kv_b, kv_cache, layer, slots, op="mla_prepare") -> None:
    check_tensor(op, "q", q, _FLOAT_DTYPES, 3)
    check_tensor(op, "ckv", ckv, _FLOAT_DTYPES, 2)
    check_tensor(op, "cos", cos, torch.float32, 2)
    check_tensor(op, "sin", sin, torch.float32, 2)
    check_tensor(op, "norm_weight", norm_weight, _FLOAT_DTYPES, 1)
    check_tensor(op, "w_kv_b", w_kv_b, _FLOAT_DTYPES, 2)
    check_tensor(op, "kv_cache", kv_cache, _FLOAT_DTYPES, 4)
    check_tensor(op, "slots", slots, torch.int64, 1)
    check_same_device(op, q=q, ckv=ckv, cos=cos, sin=sin, norm_weight=norm_weight, w_kv_b=w_kv_b,
                      kv_cache=kv_cache, slots=slots)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
        raise ValueError(f"{op}: eps must be a non-negative float, got {eps!r}")
    if isinstance(layer, bool) or not isinstance(layer, numbers.Integral) or not 0 <= layer < kv_cache.shape[0]:
        raise ValueError(f"{op}: layer must be an int in [0, {kv_cache.shape[0]}), got {layer!r}")
    M, heads, qd = q.shape
    dc, D = norm_weight.shape[0], kv_cache.shape[3]
    dr = D - dc
    if dc < 1 or dr < 2 or dr % 2:
        raise ValueError(f"{op}: the cache row ({D}) must be norm_weight's dc ({dc}) plus an even rope dim >= 2")
    dn = qd - dr
    if dn < 1:
        raise ValueError(f"{op}: q's last dimension ({qd}) must be dn + dr with dn >= 1 and dr = {dr}")
    if tuple(ckv.shape) != (M, D):
        raise ValueError(f"{op}: ckv must be [M, dc + dr] = {(M, D)}, got {tuple(ckv.shape)}")
    if tuple(cos.shape) != (M, dr // 2) or tuple(sin.shape) != (M, dr // 2):
        raise ValueError(f"{op}: cos and sin must be [M, dr / 2] = {(M, dr // 2)}, got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    if tuple(slots.shape) != (M,):
        raise ValueError(f"{op}: slots must be [M] = {(M,)}, got {tuple(slots.shape)}")
    rows = w_kv_b.shape[0]
    if heads < 1 or w_kv_b.shape[1] != dc or rows % heads or rows // heads <= dn:
        raise ValueError(f"{op}: w_kv_b must be [h * (dn + dv), dc] = [{heads} * ({dn} + dv), {dc}] with dv >= 1, "
                         f"got {tuple(w_kv_b.shape)}")
    if ckv.dtype != q.dtype:
        raise TypeError(f"{op}: ckv dtype {ckv.dtype} must equal q dtype {q.dtype}")
    if not value_checks_active(slots) or M == 0:
        return
    capacity = kv_cache.shape[1] * kv_cache.shape[2]
    if ((slots < 0) | (slots >= capacity)).any():
        raise ValueError(f"{op}: slots must be flat cache slots in [0, num_pages * page_size = {capacity})")


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    if interleave:
        x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    else:
        x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def _nope_dim(q: torch.Tensor, norm_weight: torch.Tensor, kv_cache: torch.Tensor) -> int:
    """dn: q's last dimension minus dr, the cache row's rope part (the row minus norm_weight's dc)."""
    return q.shape[-1] - (kv_cache.shape[-1] - norm_weight.shape[0])


def mla_prepare_reference(q: torch.Tensor, ckv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          norm_weight: torch.Tensor, eps: float, w_kv_b: torch.Tensor, kv_cache: torch.Tensor,
                          layer: int, slots: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Pure-torch reference (and CPU kernel) of ``kdtree::mla_prepare`` (module docstring)."""
    _check(q, ckv, cos, sin, norm_weight, eps, w_kv_b, kv_cache, layer, slots)
    M, heads, _ = q.shape
    dc = norm_weight.shape[0]
    D = kv_cache.shape[3]
    dr = D - dc
    dn = _nope_dim(q, norm_weight, kv_cache)
    q_nope, q_pe = q.split([dn, dr], dim=-1)
    q_rope = _rope(q_pe, cos[:, None, :], sin[:, None, :], interleave)
    c, k_pe = ckv.split([dc, dr], dim=-1)
    h = c.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    latent = torch.cat([norm_weight * h.to(ckv.dtype), _rope(k_pe, cos, sin, interleave)], dim=-1)
    kv_cache[layer].view(-1, D).index_copy_(0, slots, latent.to(kv_cache.dtype))
    w_uk = w_kv_b.view(heads, -1, dc)[:, :dn]
    q_abs = torch.einsum("mhd,hdc->mhc", q_nope.float(), w_uk.float()).to(q.dtype)
    return torch.cat([q_abs, q_rope], dim=-1).to(kv_cache.dtype)


def mla_prepare(q: torch.Tensor, ckv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm_weight: torch.Tensor,
                eps: float, w_kv_b: torch.Tensor, kv_cache: torch.Tensor, layer: int, slots: torch.Tensor,
                interleave: bool = True) -> torch.Tensor:
    """RoPE, the latent norm, the cache write and the W_UK absorption of absorbed MLA in one op.

    Args:
        q: [M, h, dn + dr] the query projection's output (q_b_proj or q_proj), per head.
        ckv: [M, dc + dr] kv_a_proj_with_mqa's output (latent c, then k_pe); q's dtype.
        cos, sin: float32 [M, dr / 2], the tokens' RoPE angles.
        norm_weight: [dc] kv_a_layernorm's weight; eps: its epsilon.
        w_kv_b: [h * (dn + dv), dc] kv_b_proj's weight (per head: W_UK's dn rows, then W_UV's dv).
        kv_cache: [num_layers, num_pages, page_size, dc + dr] the paged latent cache, written in
            place at layer ``layer``.
        slots: int64 [M], flat slots (page * page_size + offset) of the tokens' cache entries.
        interleave: RoPE pairs interleaved (DeepSeek / K2) or the two halves.
    Returns the attention query [M, h, dc + dr] in kv_cache's dtype (module docstring).
    Slots outside the cache raise in eager mode; the CUDA kernel never writes out of bounds.
    """
    _check(q, ckv, cos, sin, norm_weight, eps, w_kv_b, kv_cache, layer, slots)
    return torch.ops.kdtree.mla_prepare(q, ckv, cos, sin, norm_weight, float(eps), w_kv_b, kv_cache, int(layer),
                                        slots, bool(interleave))


torch.library.register_kernel("kdtree::mla_prepare", "cpu", mla_prepare_reference)


@torch.library.register_fake("kdtree::mla_prepare")
def _(q, ckv, cos, sin, norm_weight, eps, w_kv_b, kv_cache, layer, slots, interleave):
    M, heads, _ = q.shape
    return q.new_empty((M, heads, kv_cache.shape[3]), dtype=kv_cache.dtype)


# --------------------------------------------------------------------------------------------
# mla_output
# --------------------------------------------------------------------------------------------

def _check_output(o_lat, w_kv_b, qk_nope_head_dim, op="mla_output") -> None:
    check_tensor(op, "o_lat", o_lat, _FLOAT_DTYPES, 3)
    check_tensor(op, "w_kv_b", w_kv_b, _FLOAT_DTYPES, 2)
    check_same_device(op, o_lat=o_lat, w_kv_b=w_kv_b)
    M, heads, dc = o_lat.shape
    dn = qk_nope_head_dim
    if isinstance(dn, bool) or not isinstance(dn, numbers.Integral) or dn < 0:
        raise ValueError(f"{op}: qk_nope_head_dim must be a non-negative int, got {dn!r}")
    rows = w_kv_b.shape[0]
    if heads < 1 or w_kv_b.shape[1] != dc or rows % heads or rows // heads <= dn:
        raise ValueError(f"{op}: w_kv_b must be [h * (dn + dv), dc] = [{heads} * ({dn} + dv), {dc}] with dv >= 1, "
                         f"got {tuple(w_kv_b.shape)}")


def mla_output_reference(o_lat: torch.Tensor, w_kv_b: torch.Tensor, qk_nope_head_dim: int) -> torch.Tensor:
    """Pure-torch reference (and CPU kernel) of ``kdtree::mla_output`` (module docstring)."""
    _check_output(o_lat, w_kv_b, qk_nope_head_dim)
    heads, dc = o_lat.shape[1], o_lat.shape[2]
    w_uv = w_kv_b.view(heads, -1, dc)[:, qk_nope_head_dim:]
    return torch.einsum("mhc,hdc->mhd", o_lat.float(), w_uv.float()).to(o_lat.dtype).contiguous()


def mla_output(o_lat: torch.Tensor, w_kv_b: torch.Tensor, qk_nope_head_dim: int) -> torch.Tensor:
    """The heads' values from the absorbed attention's latent output: ``o_lat[m, h] @ W_UV[h]^T``.

    Args:
        o_lat: [M, h, dc] ``mla_tree_attention``'s output.
        w_kv_b: [h * (dn + dv), dc] kv_b_proj's weight (per head: W_UK's dn rows, then W_UV's dv).
        qk_nope_head_dim: dn.
    Returns [M, h, dv] in o_lat's dtype (fp32 sums).
    """
    _check_output(o_lat, w_kv_b, qk_nope_head_dim)
    return torch.ops.kdtree.mla_output(o_lat, w_kv_b, int(qk_nope_head_dim))


torch.library.register_kernel("kdtree::mla_output", "cpu", mla_output_reference)


@torch.library.register_fake("kdtree::mla_output")
def _(o_lat, w_kv_b, qk_nope_head_dim):
    M, heads, _ = o_lat.shape
    return o_lat.new_empty((M, heads, w_kv_b.shape[0] // heads - qk_nope_head_dim))


# --------------------------------------------------------------------------------------------
# mla_tree_attention_output: the attention and W_UV in one op
# --------------------------------------------------------------------------------------------

def _check_attention_output(q, kv_cache, block_table, cache_lens, visible, softmax_scale, w_kv_b,
                            qk_nope_head_dim) -> None:
    from .mla import _check as _check_attention

    op = "mla_tree_attention_output"
    if isinstance(kv_cache, torch.Tensor) and kv_cache.dtype == torch.float8_e4m3fn:
        raise TypeError(f"{op}: kv_cache must be q's dtype, got {kv_cache.dtype}: an fp8 cache is read by "
                        f"mla_tree_attention with its kv_scale (then mla_output)")
    _check_attention(q, kv_cache, block_table, cache_lens, visible, softmax_scale)
    check_tensor(op, "w_kv_b", w_kv_b, _FLOAT_DTYPES, 2)
    check_same_device(op, q=q, w_kv_b=w_kv_b)
    H, dn = q.shape[2], qk_nope_head_dim
    if isinstance(dn, bool) or not isinstance(dn, numbers.Integral) or dn < 0:
        raise ValueError(f"{op}: qk_nope_head_dim must be a non-negative int, got {dn!r}")
    rows = w_kv_b.shape[0]
    if w_kv_b.shape[1] != 512 or rows % H or rows // H <= dn:
        raise ValueError(f"{op}: w_kv_b must be [H * (dn + dv), 512] = [{H} * ({dn} + dv), 512] with dv >= 1, "
                         f"got {tuple(w_kv_b.shape)}")


def mla_tree_attention_output_reference(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                                        cache_lens: torch.Tensor, visible: torch.Tensor, softmax_scale: float,
                                        w_kv_b: torch.Tensor, qk_nope_head_dim: int,
                                        prefix_ready: bool = False) -> torch.Tensor:
    """Pure-torch reference (and CPU kernel) of ``kdtree::mla_tree_attention_output``: the
    composition of the two references, ``mla_output(mla_tree_attention(...))`` (the latent output
    rounded to q's dtype in between, as when the two ops run one after the other)."""
    from .mla import mla_tree_attention_reference

    _check_attention_output(q, kv_cache, block_table, cache_lens, visible, softmax_scale, w_kv_b, qk_nope_head_dim)
    R, N, H, _ = q.shape
    o_lat = mla_tree_attention_reference(q, kv_cache, block_table, cache_lens, visible, softmax_scale)
    return mla_output_reference(o_lat.reshape(R * N, H, -1), w_kv_b, qk_nope_head_dim).view(R, N, H, -1)


def mla_tree_attention_output(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                              cache_lens: torch.Tensor, visible: torch.Tensor, softmax_scale: float,
                              w_kv_b: torch.Tensor, qk_nope_head_dim: int, *, prefix_ready: bool = False) -> torch.Tensor:
    """``mla_output(mla_tree_attention(q, ...).view(R * N, H, 512), w_kv_b, qk_nope_head_dim)`` as
    one op: the heads' values [R, N, H, dv] of the absorbed attention (arguments as in
    :func:`~torch_kdtree.ops.mla_tree_attention` and :func:`mla_output`; w_kv_b [H * (dn + dv), 512];
    the result in q's dtype).  On CUDA the attention's split merge and the W_UV product run in one kernel
    (the latent rows are never written), with the same bits as the two ops one after the other."""
    _check_attention_output(q, kv_cache, block_table, cache_lens, visible, softmax_scale, w_kv_b, qk_nope_head_dim)
    return torch.ops.kdtree.mla_tree_attention_output(q, kv_cache, block_table, cache_lens, visible,
                                                      float(softmax_scale), w_kv_b, int(qk_nope_head_dim),
                                                      bool(prefix_ready))


torch.library.register_kernel("kdtree::mla_tree_attention_output", "cpu", mla_tree_attention_output_reference)


@torch.library.register_fake("kdtree::mla_tree_attention_output")
def _(q, kv_cache, block_table, cache_lens, visible, softmax_scale, w_kv_b, qk_nope_head_dim, prefix_ready=False):
    R, N, H, _ = q.shape
    return q.new_empty((R, N, H, w_kv_b.shape[0] // H - qk_nope_head_dim))


# --------------------------------------------------------------------------------------------
# mla_decode: mla_prepare, the attention and mla_output of one token per request in one op
# --------------------------------------------------------------------------------------------

def _check_decode(q, ckv, cos, sin, norm_weight, eps, w_kv_b, kv_cache, layer, slots, block_table, cache_lens,
                  softmax_scale) -> None:
    op = "mla_decode"
    _check(q, ckv, cos, sin, norm_weight, eps, w_kv_b, kv_cache, layer, slots, op=op)
    check_tensor(op, "block_table", block_table, torch.int32, 2)
    check_tensor(op, "cache_lens", cache_lens, torch.int32, 1)
    check_same_device(op, q=q, block_table=block_table, cache_lens=cache_lens)
    R = q.shape[0]
    if kv_cache.shape[3] != 576 or norm_weight.shape[0] != 512:
        raise ValueError(f"{op}: the attention needs cache rows of 576 (dc 512 + dr 64) and norm_weight [512], got "
                         f"{tuple(kv_cache.shape)} and {tuple(norm_weight.shape)}")
    if block_table.shape[0] != R or cache_lens.shape[0] != R:
        raise ValueError(f"{op}: block_table and cache_lens must have R = {R} rows (one token per request), got "
                         f"{block_table.shape[0]} and {cache_lens.shape[0]}")
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"{op}: softmax_scale must be a float, got {type(softmax_scale).__name__}")
    if kv_cache.dtype != q.dtype:
        raise TypeError(f"{op}: kv_cache dtype {kv_cache.dtype} must equal q dtype {q.dtype}")
    if not value_checks_active(cache_lens) or R == 0:
        return
    from .mla import check_pages

    page_size = kv_cache.shape[2]
    check_pages(op, kv_cache.shape[1], page_size, block_table, cache_lens, 1)  # the committed keys and the new one
    pos = cache_lens.long()
    page = block_table.long().gather(1, (pos // page_size)[:, None])[:, 0]
    if not torch.equal(slots, page * page_size + pos % page_size):
        raise ValueError(f"{op}: slots[r] must be the cache slot of position cache_lens[r] (the new token's entry, "
                         f"through block_table)")


def mla_decode_reference(q: torch.Tensor, ckv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         norm_weight: torch.Tensor, eps: float, w_kv_b: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                         slots: torch.Tensor, block_table: torch.Tensor, cache_lens: torch.Tensor, softmax_scale: float,
                         interleave: bool, prefix_ready: bool = False) -> torch.Tensor:
    """Pure-torch reference (and CPU kernel) of ``kdtree::mla_decode``: the three references one
    after the other, as the model runs them for a token per request (``prefix_ready`` is a
    scheduling hint for the CUDA kernel; it does not change the result)."""
    _check_decode(q, ckv, cos, sin, norm_weight, eps, w_kv_b, kv_cache, layer, slots, block_table, cache_lens,
                  softmax_scale)
    R, heads, _ = q.shape
    dn = _nope_dim(q, norm_weight, kv_cache)
    query = mla_prepare_reference(q, ckv, cos, sin, norm_weight, eps, w_kv_b, kv_cache, layer, slots, interleave)
    visible = torch.ones((R, 1, 1), dtype=torch.bool, device=q.device)
    out = mla_tree_attention_output_reference(query.view(R, 1, heads, -1), kv_cache[layer], block_table, cache_lens,
                                              visible, softmax_scale, w_kv_b, dn)
    return out.view(R, heads, -1)


def mla_decode(q: torch.Tensor, ckv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm_weight: torch.Tensor,
               eps: float, w_kv_b: torch.Tensor, kv_cache: torch.Tensor, layer: int, slots: torch.Tensor,
               block_table: torch.Tensor, cache_lens: torch.Tensor, softmax_scale: float, interleave: bool = True, *,
               prefix_ready: bool = False) -> torch.Tensor:
    """The absorbed-MLA core of a decode step (one new token per request) as one op:
    ``mla_tree_attention_output(mla_prepare(q, ckv, ...).view(R, 1, h, 576), kv_cache[layer], block_table,
    cache_lens, visible=True, softmax_scale, w_kv_b, dn)``.

    Args:
        q, ckv, cos, sin, norm_weight, eps, w_kv_b, kv_cache, layer, interleave: as in
            :func:`mla_prepare`, with M = R (q [R, h, dn + 64], ckv [R, 576]).
        slots: int64 [R], the flat cache slot of each request's new token, which must be position
            ``cache_lens[r]`` through ``block_table`` (checked in eager mode).
        block_table, cache_lens, softmax_scale, prefix_ready: as in
            :func:`~torch_kdtree.ops.mla_tree_attention` (keys: the committed positions
            [0, cache_lens[r]) and the new token).
    Returns the heads' values [R, h, dv] in q's dtype (o_proj's input); writes the new tokens'
    cache rows.  On CUDA one launch: a thread-block cluster of 8 blocks per (request, head), each
    with an eighth of the keys, merged through distributed shared memory (csrc/mla_absorb.cu).
    """
    _check_decode(q, ckv, cos, sin, norm_weight, eps, w_kv_b, kv_cache, layer, slots, block_table, cache_lens,
                  softmax_scale)
    return torch.ops.kdtree.mla_decode(q, ckv, cos, sin, norm_weight, float(eps), w_kv_b, kv_cache, int(layer), slots,
                                       block_table, cache_lens, float(softmax_scale), bool(interleave),
                                       bool(prefix_ready))


torch.library.register_kernel("kdtree::mla_decode", "cpu", mla_decode_reference)


@torch.library.register_fake("kdtree::mla_decode")
def _(q, ckv, cos, sin, norm_weight, eps, w_kv_b, kv_cache, layer, slots, block_table, cache_lens, softmax_scale,
      interleave, prefix_ready=False):
    R, heads, _ = q.shape
    return q.new_empty((R, heads, w_kv_b.shape[0] // heads - _nope_dim(q, norm_weight, kv_cache)))


__all__ = ["mla_decode", "mla_decode_reference", "mla_output", "mla_output_reference", "mla_prepare",
           "mla_prepare_reference", "mla_tree_attention_output", "mla_tree_attention_output_reference"]
