"""The target's token at every verified node: greedy argmax, or one Gumbel-max sample per node.

Sample-and-walk (docs/ddtree.md) is lossless when every node's token is an independent draw from the
target's processed distribution at that node.  ``argmax(scores + Gumbel noise)`` is such a draw
(the Gumbel-max trick), needs no ``multinomial`` and no host synchronisation, and keeps one
fixed shape, so it runs inside a captured CUDA graph; the noise comes from the default
generator (graph-safe: each replay draws fresh numbers).

Logits processing follows transformers' warpers exactly, in their order: temperature, top-k
(ties with the k-th value kept), top-p (``cumsum(softmax(ascending)) <= 1 - top_p`` removed,
the most likely token always kept), min-p (tokens whose probability after the others is below
``min_p`` times the most likely one's removed).  The parameters are device tensors with one value
per request, so changing them needs no new graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingMode:
    """The structural part of token selection (fixed when a step is captured).

    do_sample: Gumbel-max sampling, else argmax.  filtered: top-k / top-p / min-p masking is
    applied (two sorts and a softmax over the vocabulary per node, skipped when none is in use).
    min_new: the end-of-sequence tokens are masked at nodes whose request has emitted fewer than
    its ``min_new_tokens`` (transformers' MinNewTokensLengthLogitsProcessor; one elementwise pass
    over the logits, skipped when no request asks for it).  penalty: ``repetition_penalty`` on the
    tokens each node's prediction follows -- the prompt, the emitted tokens and the node's path in
    the tree (transformers' RepetitionPenaltyLogitsProcessor).
    """

    do_sample: bool = False
    filtered: bool = False
    min_new: bool = False
    penalty: bool = False


class SamplingParams:
    """Per-request sampling parameters on the device: temperature float32 [R], top_k int64 [R]
    (V = no top-k), top_p float32 [R] (1.0 = no top-p), min_p float32 [R] (0.0 = no min-p)."""

    def __init__(self, batch_size: int, vocab_size: int, device):
        self.vocab_size = vocab_size
        self.temperature = torch.ones(batch_size, dtype=torch.float32, device=device)
        self.top_k = torch.full((batch_size,), vocab_size, dtype=torch.int64, device=device)
        self.top_p = torch.ones(batch_size, dtype=torch.float32, device=device)
        self.min_p = torch.zeros(batch_size, dtype=torch.float32, device=device)

    def set(self, temperature: float, top_k: int | None, top_p: float | None,
            min_p: float | None = None) -> SamplingMode:
        """Fill the buffers in place; returns the mode these values need (filtered or not)."""
        if not temperature > 0:
            raise ValueError(f"generate: temperature must be > 0 when sampling, got {temperature}")
        if top_p is not None and not 0.0 < top_p <= 1.0:
            raise ValueError(f"generate: top_p must be in (0, 1], got {top_p}")
        if top_k is not None and top_k < 0:
            raise ValueError(f"generate: top_k must be >= 0, got {top_k}")
        if min_p is not None and not 0.0 <= min_p <= 1.0:
            raise ValueError(f"generate: min_p must be in [0, 1], got {min_p}")
        k = self.vocab_size if not top_k else min(int(top_k), self.vocab_size)
        p = 1.0 if top_p is None else float(top_p)
        m = 0.0 if min_p is None else float(min_p)
        self.temperature.fill_(float(temperature))
        self.top_k.fill_(k)
        self.top_p.fill_(p)
        self.min_p.fill_(m)
        return SamplingMode(do_sample=True, filtered=k < self.vocab_size or p < 1.0 or m > 0.0)


def process_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """float32 scores [R, N, V] after temperature, top-k (``top_k <= 0``: none), top-p and min-p
    (``min_p`` None or 0: none; removed entries -inf), as transformers' TemperatureLogitsWarper,
    TopKLogitsWarper, TopPLogitsWarper and MinPLogitsWarper compute them, in that order."""
    scores = logits.float() / temperature[:, None, None]
    V = scores.shape[-1]
    k = torch.where(top_k > 0, top_k, V).clamp(1, V)
    kth = scores.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None, None]
                                                             .expand(*scores.shape[:2], 1))
    scores = scores.masked_fill(scores < kth, float("-inf"))
    ascending, order = scores.sort(dim=-1)
    remove = ascending.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)[:, None, None]
    remove[..., -1] = False
    scores = scores.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    if min_p is None:
        return scores
    # min-p on what top-k / top-p left: the most likely token is never below min_p (<= 1) of itself
    probs = scores.softmax(dim=-1)
    return scores.masked_fill(probs < min_p[:, None, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))


def gumbel_like(scores: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise, ``-log(-log(U))`` with U ~ Uniform[0, 1) (U = 0 gives -inf: that
    token is never drawn by this noise, an event of probability 0)."""
    return -torch.log(-torch.log(torch.rand_like(scores)))


ARGMAX_CHUNK = 2048


def argmax_last(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` (the first maximal index) in two stages -- the first maximum of each chunk
    of ARGMAX_CHUNK entries, then the first chunk holding the row's maximum -- so that a row of
    a large vocabulary is spread over many blocks instead of one (inductor reduces each row of
    a single-stage argmax in one program)."""
    V = x.shape[-1]
    if V % ARGMAX_CHUNK or V <= ARGMAX_CHUNK:
        return x.argmax(dim=-1)
    chunks = x.reshape(*x.shape[:-1], V // ARGMAX_CHUNK, ARGMAX_CHUNK)
    inner = chunks.argmax(dim=-1)  # [..., C]
    best = chunks.gather(-1, inner[..., None])[..., 0]  # each chunk's first maximum
    c = best.argmax(dim=-1, keepdim=True)  # the first chunk holding the row's maximum
    return (c * ARGMAX_CHUNK + inner.gather(-1, c))[..., 0]


def select_tokens(logits: torch.Tensor, mode: SamplingMode, params: SamplingParams | None, tp=None) -> torch.Tensor:
    """int64 [R, N]: the target's token at each of N nodes of R requests from logits [R, N, V]
    (with ``tp``, a tensor-parallel head's vocabulary shard [R, N, V / world] on each rank:
    :func:`select_tokens_sharded`)."""
    if tp is not None and tp.world > 1:
        return select_tokens_sharded(logits, mode, params, tp)
    if not mode.do_sample:
        return argmax_last(logits)
    if mode.filtered:
        scores = process_logits(logits, params.temperature, params.top_k, params.top_p, params.min_p)
    else:
        scores = logits.float() / params.temperature[:, None, None]
    return argmax_last(scores + gumbel_like(scores))


def select_tokens_sharded(logits: torch.Tensor, mode: SamplingMode, params: SamplingParams | None,
                          tp) -> torch.Tensor:
    """:func:`select_tokens` over a vocabulary split in contiguous shards across the ranks of ``tp``:
    every rank returns the same global ids, equal to the unsharded result.  Greedy: each shard's
    first maximum, gathered, the first rank holding the largest (ties to the lower global id, as
    ``argmax``).  Gumbel-max: every rank draws the noise of the whole vocabulary from the default
    generator (in step on every rank of the SPMD loop, so the same numbers an unsharded draw
    gives) and keeps its shard's part.  With top-k / top-p / min-p the shards' logits are gathered."""
    if mode.do_sample and mode.filtered:
        return select_tokens(tp.all_gather(logits, -1), mode, params)
    local = logits.shape[-1]
    start = tp.rank * local
    if mode.do_sample:
        scores = logits.float() / params.temperature[:, None, None]
        noise = gumbel_like(scores.new_empty((*scores.shape[:-1], local * tp.world)))
        logits = scores + noise[..., start : start + local]
    idx = argmax_last(logits)
    best = logits.gather(-1, idx[..., None])[..., 0].float()
    values, ids = tp.stack(best), tp.stack(idx + start)  # [P, R, N]
    rank = values.argmax(0)  # the first rank holding the maximum: the lower global id on ties
    return ids.gather(0, rank[None])[0]


__all__ = ["SamplingMode", "SamplingParams", "process_logits", "select_tokens", "select_tokens_sharded", "gumbel_like",
           "argmax_last"]
