"""The paged latent KV cache of Kimi K2 (absorbed MLA).

One tensor ``kv`` [num_layers, num_pages, page_size, D] with D = kv_lora_rank + qk_rope_head_dim
(576 for K2): per token and layer ``[kv_a_layernorm(c) (512) | rope(k_rope) (64)]`` — the layout
``kdtree::kv_commit`` moves and ``kdtree::mla_tree_attention`` reads (one layer is ``kv[layer]``).
``block_table`` int32 [R, max_pages] maps each request's logical pages to physical pages and
``lengths`` int32 [R] (on the device) is each request's committed prefix length.

Allocated once for a maximum number of tokens per request.  A forward writes its new tokens'
entries right after the committed prefix (token i of request r at position ``lengths[r] + i``)
and never moves ``lengths``: the caller commits with :meth:`KimiK2Cache.advance` (after a
prefill or a decode step) or ``kv_commit`` + ``advance`` (after a tree verify).  Every tensor
keeps its address for the cache's life, so one CUDA graph serves every step.
"""
from __future__ import annotations

import torch
from torch import nn

from torch_kdtree.ops._checks import value_checks_active

__all__ = ["KimiK2Cache", "CacheOverflowError"]


class CacheOverflowError(ValueError):
    """A write would go past a request's allocated pages."""


class KimiK2Cache(nn.Module):
    """Paged latent KV cache for R requests (module docstring).

    Args:
        num_layers: decoder layers (one cache layer each).
        batch_size: R, requests served together.
        max_tokens: tokens each request may hold (prompt + generated + one tree in flight).
        entry_dim: D = kv_lora_rank + qk_rope_head_dim.
        page_size: tokens per page.
        dtype, device: of the ``kv`` tensor (the model's compute dtype).
    Pages are assigned contiguously (request r owns pages [r * P, (r + 1) * P)); a different
    page assignment can be written into ``block_table`` by the caller.
    """

    def __init__(self, num_layers: int, batch_size: int, max_tokens: int, entry_dim: int, *, page_size: int = 64,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None):
        super().__init__()
        if min(num_layers, batch_size, max_tokens, entry_dim, page_size) < 1:
            raise ValueError("KimiK2Cache: num_layers, batch_size, max_tokens, entry_dim and page_size must be >= 1")
        pages_per_request = -(-max_tokens // page_size)
        num_pages = batch_size * pages_per_request
        self.page_size = page_size
        self.register_buffer("kv", torch.zeros(num_layers, num_pages, page_size, entry_dim, dtype=dtype,
                                               device=device), persistent=False)
        table = torch.arange(num_pages, dtype=torch.int32, device=device).view(batch_size, pages_per_request)
        self.register_buffer("block_table", table, persistent=False)
        self.register_buffer("lengths", torch.zeros(batch_size, dtype=torch.int32, device=device), persistent=False)
        self._mark_static()

    @classmethod
    def for_model(cls, config, batch_size: int, max_tokens: int, *, page_size: int = 64,
                  dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None) -> "KimiK2Cache":
        """A cache sized for ``config`` (a :class:`KimiK2Config` or a model with ``.config``)."""
        config = getattr(config, "config", config)
        return cls(config.num_hidden_layers, batch_size, max_tokens, config.kv_lora_rank + config.qk_rope_head_dim,
                   page_size=page_size, dtype=dtype, device=device)

    def _mark_static(self) -> None:
        # Static addresses let compiled steps mutate the cache inside CUDA graphs (no re-recording).
        for t in (self.kv, self.block_table, self.lengths):
            torch._dynamo.mark_static_address(t)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._mark_static()
        return self

    @property
    def batch_size(self) -> int:
        return self.block_table.shape[0]

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
        """Store ``entries`` [..., D] at the flat ``slots`` [...] of ``layer``.  One ``index_put_``
        on the whole ``kv`` tensor (not on a view of it): inductor then writes in place instead
        of copying the cache in and out of the compiled step."""
        slots = slots.reshape(-1)
        index = (torch.full_like(slots, layer), slots // self.page_size, slots % self.page_size)
        self.kv.index_put_(index, entries.reshape(-1, self.kv.shape[-1]).to(self.kv.dtype))

    def read(self, layer: int, num_tokens: int) -> torch.Tensor:
        """[R, num_tokens, D]: the entries at positions 0..num_tokens-1 of every request (positions
        past a request's pages are clamped to its last page; callers mask them)."""
        pos = torch.arange(num_tokens, device=self.lengths.device)
        pages = (pos // self.page_size).clamp(max=self.block_table.shape[1] - 1)
        page = self.block_table.long()[:, pages]
        return self.kv[layer][page, pos % self.page_size]

    def advance(self, num_tokens) -> None:
        """Commit ``num_tokens`` (an int or an int tensor [R]) more tokens of each request."""
        if isinstance(num_tokens, torch.Tensor):
            num_tokens = num_tokens.to(device=self.lengths.device, dtype=self.lengths.dtype)
        self.lengths.add_(num_tokens)

    def reset(self) -> None:
        """Forget every request's tokens (the entries are overwritten by later writes)."""
        self.lengths.zero_()

