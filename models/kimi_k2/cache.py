"""The paged latent KV cache of Kimi K2 (absorbed MLA).

One tensor ``kv`` [num_layers, num_pages, page_size, D] with D = kv_lora_rank + qk_rope_head_dim
(576 for K2): per token and layer ``[kv_a_layernorm(c) (512) | rope(k_rope) (64)]`` — the layout
``kdtree::kv_commit`` moves and ``kdtree::mla_tree_attention`` reads (one layer is ``kv[layer]``;
an fp8 cache's rows are D + qk_rope_head_dim bytes, below).  ``block_table`` int32 [R, max_pages] maps each request's logical pages to physical pages and
``lengths`` int32 [R] (on the device) is each request's committed prefix length.

``kv_cache_dtype="fp8"`` stores each row as its latent part in float8_e4m3fn with one fp32 scale per
(layer, token), ``kv_scale`` [num_layers, num_pages, page_size] (latent = value * scale), followed by
its rope part in bf16 -- the 64 values as 128 bytes of the same float8 tensor: 512 + 128 bytes of row
and 4 of scale, 644 B per token and layer for K2 (1.79x the tokens of bf16 per byte).  The scale is
the power of two at or above the latent's max |value| / 448 (e4m3's largest finite value), so the
dequantised values are exact in bf16 (an attention kernel may dequantise into its bf16 operands
without rounding).  The rope part stays bf16 because e4m3's 3 mantissa bits move each value by up to
2^-4 of itself whatever the scale, and the rope dims carry the position: with all 576 values in e4m3
(580 B) the shipped pair's greedy tokens agreed with a bf16 cache's at 98.70 % of 2,000 positions,
with the rope in bf16 at 99.55 % (tests/test_default_pair.py; bench/RESULTS.md).  The rows stay 16-byte
aligned (640 B), the scales a tensor of their own, so ``kv_commit`` moves both as they are
(:meth:`KimiK2Cache.commit`).  Writes quantise, reads dequantise to the compute ``dtype``;
``kdtree::mla_tree_attention`` reads the rows as stored, with ``kv_scale[layer]`` (the decode plan's
``tree_op`` form), the other MLA kernels bf16 rows only.  Moving an fp8 cache (``.to(device)``,
``.cuda()``) moves its rows and scales; casting it (``.to(torch.bfloat16)``, ``.half()``, a model's
cast) keeps the fp8 rows and fp32 scales and changes only the dtype reads dequantise to.  A 16-bit or fp32 cache is cast as any
module's buffers are, but never to a float8 dtype (that would drop the scales: build the cache with
``kv_cache_dtype="fp8"``).  :meth:`KimiK2Cache.check_layout` refuses an fp8 cache without its
scales, scales beside rows that are not fp8, and rows of a dtype no path reads; the model runs it
on every cache it is given.

Allocated once for a maximum number of tokens per request.  A forward writes its new tokens'
entries right after the committed prefix (token i of request r at position ``lengths[r] + i``)
and never moves ``lengths``: the caller commits with :meth:`KimiK2Cache.advance` (after a
prefill or a decode step) or :meth:`KimiK2Cache.commit` (``kv_commit``) + ``advance`` (after a
tree verify).  Every tensor keeps its address for the cache's life, so one CUDA graph serves
every step.
"""
from __future__ import annotations

import torch
from torch import nn

from torch_kdtree.ops import kv_commit
from torch_kdtree.ops.mla import fp8_rows_to_keys
from torch_kdtree.ops._checks import value_checks_active

__all__ = ["KimiK2Cache", "CacheOverflowError", "KV_CACHE_DTYPES", "COMPUTE_DTYPES", "resolve_kv_cache_dtype",
           "fp8_quantize", "fp8_dequantize"]

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value
# kv_cache_dtype names (vLLM's and SGLang's words; "auto": the model's dtype).
KV_CACHE_DTYPES = {"auto": None, "fp8": FP8, "fp8_e4m3": FP8, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                   "float16": torch.float16, "fp16": torch.float16, "half": torch.float16, "float32": torch.float32,
                   "fp32": torch.float32, "float": torch.float32}
# Compute dtypes (what reads return); "auto" stores the rows in it.
COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                              "float8_e8m0fnu") if hasattr(torch, n))


class CacheOverflowError(ValueError):
    """A write would go past a request's allocated pages."""


def resolve_kv_cache_dtype(kv_cache_dtype, dtype: torch.dtype) -> torch.dtype:
    """The storage dtype a ``kv_cache_dtype`` (a name of :data:`KV_CACHE_DTYPES` or a torch dtype)
    means for a model computing in ``dtype``."""
    if isinstance(kv_cache_dtype, torch.dtype):
        if kv_cache_dtype not in (FP8, torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype} is not a latent cache dtype (torch.float8_e4m3fn, "
                             f"bfloat16, float16 or float32)")
        return kv_cache_dtype
    if not isinstance(kv_cache_dtype, str):
        raise TypeError(f"kv_cache_dtype must be a name ({', '.join(KV_CACHE_DTYPES)}) or a torch.dtype, got "
                        f"{type(kv_cache_dtype).__name__}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        e5m2 = " (e5m2 is not implemented: the fp8 cache is e4m3)" if "e5m2" in kv_cache_dtype else ""
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}{e5m2}")
    return KV_CACHE_DTYPES[kv_cache_dtype] or dtype


def _cast_of(fn, device: torch.device) -> tuple[torch.dtype | None, torch.device]:
    """What an ``nn.Module._apply`` function does to floating tensors on ``device``: the dtype it casts
    them to (None: it keeps each one's dtype) and the device it moves them to (two probes)."""
    a = fn(torch.zeros((), dtype=torch.float32, device=device))
    b = fn(torch.zeros((), dtype=torch.float16, device=device))
    return (a.dtype if a.dtype == b.dtype else None), a.device


def fp8_quantize(entries: torch.Tensor, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``entries`` [..., D] = [latent (D - rope_dim) | rope (rope_dim)] as (fp8 rows [..., D +
    rope_dim], fp32 scales [...]): each row's latent in e4m3 with latent ~= values * scale, then its
    rope in bf16 (2 rope_dim bytes of the float8 tensor); each scale the power of two at or above the
    latent's max |value| / 448 (1 for a latent of zeros)."""
    x = entries.float()
    latent, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    amax = latent.abs().amax(-1)
    scale = torch.ldexp(torch.ones_like(amax), torch.frexp(amax / FP8_MAX).exponent)  # 2^e >= amax / 448
    values = (latent / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    rope_bytes = rope.to(torch.bfloat16).contiguous().view(torch.uint8)
    return torch.cat([values.view(torch.uint8), rope_bytes], dim=-1).view(FP8), scale


def fp8_dequantize(rows: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rope_dim: int) -> torch.Tensor:
    """fp8 rows [..., D + rope_dim] (:func:`fp8_quantize`) as [latent * scale | rope] [..., D] in ``dtype``
    (exact for bf16 / fp32: 4 significant bits times a power of two, and bf16 rope values)."""
    return fp8_rows_to_keys(rows, scale, rope_dim).to(dtype)


class KimiK2Cache(nn.Module):
    """Paged latent KV cache for R requests (module docstring).

    Args:
        num_layers: decoder layers (one cache layer each).
        batch_size: R, requests served together.
        max_tokens: tokens each request may hold (prompt + generated + one tree in flight).
        entry_dim: D = kv_lora_rank + qk_rope_head_dim.
        page_size: tokens per page.
        dtype, device: the model's compute dtype (the ``kv`` tensor's, unless ``kv_cache_dtype``
            says otherwise; what fp8 reads dequantise to) and the device.
        kv_cache_dtype: ``"auto"`` (``dtype``), ``"fp8"`` (e4m3 latent + bf16 rope rows and fp32
            scales, module docstring), another name of :data:`KV_CACHE_DTYPES` or a torch dtype.
        rope_dim: the rope part's width at the end of each entry (qk_rope_head_dim; 64 for K2),
            kept in bf16 by an fp8 cache.
    Pages are assigned contiguously (request r owns pages [r * P, (r + 1) * P)); a different
    page assignment can be written into ``block_table`` by the caller.
    """

    def __init__(self, num_layers: int, batch_size: int, max_tokens: int, entry_dim: int, *, page_size: int = 64,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                 kv_cache_dtype: str | torch.dtype = "auto", rope_dim: int = 64):
        super().__init__()
        if min(num_layers, batch_size, max_tokens, entry_dim, page_size) < 1:
            raise ValueError("KimiK2Cache: num_layers, batch_size, max_tokens, entry_dim and page_size must be >= 1")
        if dtype not in COMPUTE_DTYPES:
            fp8 = " (for fp8 storage pass kv_cache_dtype=\"fp8\")" if dtype in _FLOAT8 else ""
            raise ValueError(f"KimiK2Cache: dtype is the compute dtype reads return, one of "
                             f"{', '.join(str(d) for d in COMPUTE_DTYPES)}; got {dtype}{fp8}")
        storage = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
        if storage == FP8 and not (0 < rope_dim < entry_dim and (entry_dim - rope_dim) % 2 == 0):
            raise ValueError(f"KimiK2Cache: an fp8 cache needs 0 < rope_dim < entry_dim and an even latent width "
                             f"entry_dim - rope_dim (its bf16 rope part starts on a 16-bit word; kv_commit moves "
                             f"rows as 16-bit words), got entry_dim {entry_dim}, rope_dim {rope_dim}")
        pages_per_request = -(-max_tokens // page_size)
        num_pages = batch_size * pages_per_request
        self.page_size = page_size
        self.dtype = dtype
        self.rope_dim = rope_dim
        row = entry_dim + rope_dim if storage == FP8 else entry_dim  # fp8: the rope's bf16 takes 2 bytes a value
        self.register_buffer("kv", torch.zeros(num_layers, num_pages, page_size, row, dtype=storage,
                                               device=device), persistent=False)
        scale = torch.ones(num_layers, num_pages, page_size, device=device) if storage == FP8 else None
        self.register_buffer("kv_scale", scale, persistent=False)
        table = torch.arange(num_pages, dtype=torch.int32, device=device).view(batch_size, pages_per_request)
        self.register_buffer("block_table", table, persistent=False)
        self.register_buffer("lengths", torch.zeros(batch_size, dtype=torch.int32, device=device), persistent=False)
        self._mark_static()

    @classmethod
    def for_model(cls, config, batch_size: int, max_tokens: int, *, page_size: int = 64,
                  dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                  kv_cache_dtype: str | torch.dtype = "auto") -> "KimiK2Cache":
        """A cache sized for ``config`` (a :class:`KimiK2Config` or a model with ``.config``)."""
        config = getattr(config, "config", config)
        return cls(config.num_hidden_layers, batch_size, max_tokens, config.kv_lora_rank + config.qk_rope_head_dim,
                   page_size=page_size, dtype=dtype, device=device, kv_cache_dtype=kv_cache_dtype,
                   rope_dim=config.qk_rope_head_dim)

    def _mark_static(self) -> None:
        # Static addresses let compiled steps mutate the cache inside CUDA graphs (no re-recording).
        for t in (self.kv, self.kv_scale, self.block_table, self.lengths):
            if t is not None:
                torch._dynamo.mark_static_address(t)

    def _apply(self, fn, recurse=True):
        """Moves and casts (``.to``, ``.cuda()``, ``.half()``, a parent module's cast): an fp8 cache's
        rows stay e4m3 and its scales fp32 (they follow moves only; a cast changes the dtype reads
        dequantise to); a cast of other rows to a float8 dtype is refused (no scales)."""
        cast, device = _cast_of(fn, self.kv.device)
        if cast in _FLOAT8 and not (self.quantized and cast == FP8):
            if self.quantized:
                raise ValueError(f"KimiK2Cache: cannot cast an fp8 cache to {cast}: its rows stay {FP8} with "
                                 f"their fp32 scales (other float8 formats are not implemented)")
            raise ValueError(f"KimiK2Cache: cannot cast {self.kv.dtype} rows to {cast}: that would drop the "
                             f"scales fp8 rows need; build the cache with kv_cache_dtype=\"fp8\" (e4m3 rows + "
                             f"fp32 scales) instead")
        if self.quantized:
            kept = {name: self._buffers.pop(name) for name in ("kv", "kv_scale")}
            try:
                super()._apply(fn, recurse)
                kept = {name: t if t is None else t.to(device=device)  # follow the move, not the cast
                        for name, t in kept.items()}
            finally:
                self._buffers.update(kept)
        else:
            super()._apply(fn, recurse)
        if cast is not None and cast not in _FLOAT8:
            self.dtype = cast
        self._mark_static()
        return self

    @property
    def batch_size(self) -> int:
        return self.block_table.shape[0]

    @property
    def quantized(self) -> bool:
        """Whether the rows are fp8 (e4m3 latent with per-(layer, token) scales in ``kv_scale``, bf16 rope)."""
        return self.kv.dtype == FP8

    @property
    def entry_dim(self) -> int:
        """D: the values per token and layer that writes take and reads return (576 for K2)."""
        return self.kv.shape[-1] - (self.rope_dim if self.quantized else 0)

    def check_layout(self) -> None:
        """Raise a ValueError naming what is wrong when the tensors do not form a cache any path
        reads: rows of a dtype other than e4m3 / bf16 / fp16 / fp32 / fp64 (of the ``dtype`` it
        computes in), an fp8 cache without fp32 scales [layers, pages, page_size] on the rows'
        device, scales beside rows that are not fp8, a block table or lengths of another dtype,
        shape or device.  Metadata only (no device reads): the model calls it on every cache."""
        kv, scale = self.kv, self.kv_scale
        if kv.dim() != 4 or kv.dtype not in (FP8,) + COMPUTE_DTYPES:
            raise ValueError(f"KimiK2Cache: kv must be [layers, pages, page_size, D] rows of float8_e4m3fn, "
                             f"bfloat16, float16, float32 or float64; got {kv.dtype} {tuple(kv.shape)}")
        if self.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"KimiK2Cache: dtype (what reads return) must be one of "
                             f"{', '.join(str(d) for d in COMPUTE_DTYPES)}, got {self.dtype}")
        if self.quantized:
            if scale is None:
                raise ValueError(f"KimiK2Cache: an fp8 cache needs its scales: kv_scale float32 "
                                 f"{tuple(kv.shape[:3])} (one per layer and token), got None; build it with "
                                 f"kv_cache_dtype=\"fp8\"")
            if not 0 < 2 * self.rope_dim < kv.shape[-1] or (kv.shape[-1] - 2 * self.rope_dim) % 2:
                raise ValueError(f"KimiK2Cache: fp8 rows of {kv.shape[-1]} bytes cannot hold an even-width e4m3 "
                                 f"latent and {self.rope_dim} bf16 rope values")
            if scale.dtype != torch.float32 or scale.shape != kv.shape[:3] or scale.device != kv.device:
                raise ValueError(f"KimiK2Cache: kv_scale must be float32 {tuple(kv.shape[:3])} on {kv.device} "
                                 f"(one scale per layer and token), got {scale.dtype} {tuple(scale.shape)} on "
                                 f"{scale.device}")
        elif scale is not None:
            raise ValueError(f"KimiK2Cache: kv_scale is set but the rows are {kv.dtype}: scales belong to an fp8 "
                             f"cache (kv float8_e4m3fn)")
        table, lengths = self.block_table, self.lengths
        if table.dtype != torch.int32 or table.dim() != 2 or table.device != kv.device:
            raise ValueError(f"KimiK2Cache: block_table must be int32 [R, max_pages] on {kv.device}, got "
                             f"{table.dtype} {tuple(table.shape)} on {table.device}")
        if lengths.dtype != torch.int32 or lengths.shape != table.shape[:1] or lengths.device != kv.device:
            raise ValueError(f"KimiK2Cache: lengths must be int32 [{table.shape[0]}] on {kv.device}, got "
                             f"{lengths.dtype} {tuple(lengths.shape)} on {lengths.device}")

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes over every layer: its rows, and its scales when quantised."""
        layers, _, _, D = self.kv.shape
        return layers * (D * self.kv.element_size() + (self.kv_scale.element_size() if self.quantized else 0))

    @property
    def capacity(self) -> int:
        """Tokens one request can hold (its block-table row's pages)."""
        return self.block_table.shape[1] * self.page_size

    def layer(self, i: int) -> torch.Tensor:
        """Layer i's [num_pages, page_size, D] view (what ``mla_tree_attention`` reads)."""
        return self.kv[i]

    def check_room(self, new_tokens) -> None:
        """Raise :class:`CacheOverflowError` when ``lengths + new_tokens`` exceeds the capacity or
        uses block-table entries that are not valid pages.  Eager only (it reads ``lengths``):
        skipped while compiling or capturing a CUDA graph."""
        if not value_checks_active(self.lengths):
            return
        end = self.lengths.long() + torch.as_tensor(new_tokens, device=self.lengths.device).long()
        over = end > self.capacity
        if over.any():
            r = int(over.nonzero()[0, 0])
            raise CacheOverflowError(f"KimiK2Cache: request {r} needs {int(end[r])} tokens (committed "
                                     f"{int(self.lengths[r])} + new), more than its capacity of {self.capacity} "
                                     f"({self.block_table.shape[1]} pages x {self.page_size}); allocate a larger cache")
        pages_used = (end + self.page_size - 1) // self.page_size
        used = torch.arange(self.block_table.shape[1], device=end.device)[None, :] < pages_used[:, None]
        bad = used & ((self.block_table < 0) | (self.block_table >= self.kv.shape[1]))
        if bad.any():
            raise CacheOverflowError(f"KimiK2Cache: block_table entries must be page ids in [0, {self.kv.shape[1]})")

    def slots(self, num_new: int) -> torch.Tensor:
        """int64 [R, num_new]: flat slot (page * page_size + offset) of positions
        ``lengths[r] + i`` — where the next ``num_new`` tokens of each request go."""
        pos = self.lengths.long()[:, None] + torch.arange(num_new, device=self.lengths.device)
        page = self.block_table.long().gather(1, pos // self.page_size)
        return page * self.page_size + pos % self.page_size

    def slots_at(self, requests: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """int64 flat slots of (request, position) pairs given as two index tensors of one shape."""
        page = self.block_table.long()[requests, positions // self.page_size]
        return page * self.page_size + positions % self.page_size

    def write(self, layer: int, slots: torch.Tensor, entries: torch.Tensor) -> None:
        """Store ``entries`` [..., D] at the flat ``slots`` [...] of ``layer`` (quantised, with their
        scales, in an fp8 cache).  One ``index_put_`` on the whole ``kv`` tensor (not on a view of
        it): inductor then writes in place instead of copying the cache in and out of the compiled step."""
        slots = slots.reshape(-1)
        index = (torch.full_like(slots, layer), slots // self.page_size, slots % self.page_size)
        entries = entries.reshape(-1, self.entry_dim)
        if self.quantized:
            values, scale = fp8_quantize(entries, self.rope_dim)
            self.kv.index_put_(index, values)
            self.kv_scale.index_put_(index, scale)
        else:
            self.kv.index_put_(index, entries.to(self.kv.dtype))

    def read(self, layer: int, num_tokens: int) -> torch.Tensor:
        """[R, num_tokens, D]: the entries at positions 0..num_tokens-1 of every request (positions
        past a request's pages are clamped to its last page; callers mask them), in the ``kv``
        tensor's dtype, or dequantised to ``dtype`` from an fp8 cache."""
        pos = torch.arange(num_tokens, device=self.lengths.device)
        pages = (pos // self.page_size).clamp(max=self.block_table.shape[1] - 1)
        page = self.block_table.long()[:, pages]
        rows = self.kv[layer][page, pos % self.page_size]
        if self.quantized:
            return fp8_dequantize(rows, self.kv_scale[layer][page, pos % self.page_size], self.dtype, self.rope_dim)
        return rows

    def commit(self, indices: torch.Tensor, lengths: torch.Tensor) -> None:
        """``kdtree::kv_commit`` of every layer's rows (and scales) of the accepted tree nodes:
        for j < lengths[r], position ``self.lengths[r] + indices[r, j]`` moves to ``self.lengths[r] + j``.
        ``lengths`` is not added to the committed lengths: :meth:`advance` does that.  The op moves
        rows bit for bit; fp8 rows go through it as 16-bit words and the scales as rows of one fp32."""
        if self.quantized:
            kv_commit(self.kv.view(torch.bfloat16), self.block_table, self.lengths, indices, lengths)
            kv_commit(self.kv_scale[..., None], self.block_table, self.lengths, indices, lengths)
        else:
            kv_commit(self.kv, self.block_table, self.lengths, indices, lengths)

    def rows(self, requests: torch.Tensor) -> "KimiK2Cache":
        """A cache of the requests ``requests`` (int indices [R']) that shares this one's rows and
        scales: its block table and lengths are copies of theirs, so writes land in the same pages
        and its committed lengths move independently (a pass over some of the requests: the eager
        CPU session's tree passes once requests have finished)."""
        view = KimiK2Cache.__new__(KimiK2Cache)
        nn.Module.__init__(view)
        view.page_size, view.dtype, view.rope_dim = self.page_size, self.dtype, self.rope_dim
        for name, t in (("kv", self.kv), ("kv_scale", self.kv_scale), ("block_table", self.block_table[requests]),
                        ("lengths", self.lengths[requests])):
            view.register_buffer(name, t, persistent=False)
        return view

    def advance(self, num_tokens) -> None:
        """Commit ``num_tokens`` (an int or an int tensor [R]) more tokens of each request."""
        if isinstance(num_tokens, torch.Tensor):
            num_tokens = num_tokens.to(device=self.lengths.device, dtype=self.lengths.dtype)
        self.lengths.add_(num_tokens)

    def reset(self) -> None:
        """Forget every request's tokens (the entries are overwritten by later writes)."""
        self.lengths.zero_()

