"""Draft top-K ops: ``kdtree::draft_topk``, ``kdtree::draft_topk_partial``, ``kdtree::draft_topk_merge``.

The drafter's logits [R, L, V] become per-depth top-K log-probabilities and token ids, the
input of ``ddtree_build``.  One order is used everywhere:

    entries are ranked by their float32 logit, larger first; equal logits: lower token id first.

(-0.0 and +0.0 are equal.)  Ranking by the logit rather than by the rounded log-prob makes the
ids independent of how the log-sum-exp was summed, so every implementation returns the same ids;
log-probs are ``(x - max) - log(sum(exp(x - max)))`` in float32 like ``torch.log_softmax`` and
agree to float32 rounding (the sums run in different orders; the reference sums in float64
and rounds once).  Log-probs along K are therefore non-increasing.

Vocabulary-parallel form: rank p holds the slice [vocab_start_p, vocab_start_p + V_p) and calls
``draft_topk_partial`` (its top-k raw logits, global ids and its log-sum-exp); after gathering
the P results, ``draft_topk_merge`` returns exactly the ids of the unsplit call and its log-probs
up to float32 rounding.

The functions named ``*_reference`` are the ground truth and the CPU kernels; the CUDA kernels
live in ``csrc/topk.cu`` (draft_topk, draft_topk_partial) and ``csrc/topk_merge.cu``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ._checks import check_same_device, check_tensor, value_checks_active

MAX_K = 1024
MAX_VOCAB = 262144
MAX_TOKEN_ID = 2**31 - 1  # ids travel through the merge as 32-bit keys
LOGIT_DTYPES = (torch.bfloat16, torch.float32)


class TopK(NamedTuple):
    """logprobs float32 [R, L, k], sorted descending; token_ids int64 [R, L, k]."""

    logprobs: torch.Tensor
    token_ids: torch.Tensor


class PartialTopK(NamedTuple):
    """One vocabulary shard's result: values float32 [R, L, k] (raw logits, sorted by the
    top-K order), token_ids int64 [R, L, k] (global ids), lse float32 [R, L] (log-sum-exp of
    the shard's logits)."""

    values: torch.Tensor
    token_ids: torch.Tensor
    lse: torch.Tensor


def _check_int(op: str, name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, torch.SymInt)):
        raise TypeError(f"{op}: {name} must be an int, got {type(v).__name__}")


def _check_logits(op: str, logits, k) -> None:
    check_tensor(op, "logits", logits, LOGIT_DTYPES, 3)
    _check_int(op, "k", k)
    V = logits.shape[2]
    if not 1 <= V <= MAX_VOCAB:
        raise ValueError(f"{op}: vocabulary size V = logits.shape[2] must be in [1, {MAX_VOCAB}], got {V}")
    if not 1 <= k <= MAX_K:
        raise ValueError(f"{op}: k must be in [1, {MAX_K}], got {k}")
    if k > V:
        raise ValueError(f"{op}: k = {k} exceeds the vocabulary size V = {V}")


def _check_partial(logits, k, vocab_start) -> None:
    op = "draft_topk_partial"
    _check_logits(op, logits, k)
    _check_int(op, "vocab_start", vocab_start)
    V = logits.shape[2]
    if vocab_start < 0 or vocab_start + V - 1 > MAX_TOKEN_ID:
        raise ValueError(f"{op}: the shard's ids [vocab_start, vocab_start + V) = [{vocab_start}, {vocab_start + V}) "
                         f"must lie in [0, 2**31)")


def _check_merge(values, token_ids, lse, k) -> None:
    op = "draft_topk_merge"
    check_tensor(op, "values", values, torch.float32, 4)
    check_tensor(op, "token_ids", token_ids, torch.int64, 4)
    check_tensor(op, "lse", lse, torch.float32, 3)
    check_same_device(op, values=values, token_ids=token_ids, lse=lse)
    if token_ids.shape != values.shape:
        raise ValueError(f"{op}: token_ids shape {tuple(token_ids.shape)} != values shape {tuple(values.shape)}")
    P, R, L, kin = values.shape
    if tuple(lse.shape) != (P, R, L):
        raise ValueError(f"{op}: lse must have shape [P, R, L] = {(P, R, L)}, got {tuple(lse.shape)}")
    if P < 1 or kin < 1:
        raise ValueError(f"{op}: need at least one part with at least one entry, got values shape {tuple(values.shape)}")
    _check_int(op, "k", k)
    if not 1 <= k <= MAX_K:
        raise ValueError(f"{op}: k must be in [1, {MAX_K}], got {k}")
    if k > P * kin:
        raise ValueError(f"{op}: k = {k} exceeds the {P} x {kin} candidates")
    if value_checks_active(token_ids) and token_ids.numel():
        if ((token_ids < 0) | (token_ids > MAX_TOKEN_ID)).any():
            raise ValueError(f"{op}: token_ids must lie in [0, 2**31)")


def _lse(x: torch.Tensor) -> torch.Tensor:
    """float64 log-sum-exp over the last dim of float32 ``x``.  torch's float32 CPU log_softmax
    sums exp() sequentially per SIMD lane and is off by up to ~7e-5 at V = 262144; the
    reference instead rounds the exact value once, so it is the float32 log-softmax to within
    one rounding and a fair yardstick for kernels that sum in other orders."""
    return torch.logsumexp(x.double(), dim=-1)


def _top_order(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of float32 ``x`` along the last dim, larger first,
    equal values lower index first: the first k of a stable descending sort, which keeps equal
    values in index order.

    Sorting all V entries took ~3 ms for 14 rows of a 4096-token vocabulary on one CPU core (the
    CPU kernel runs in every tree step; ~0.15 ms this way), so the order is first taken among the
    2k largest candidates
    (``topk``, any order among equal values): put in id order and sorted stably by value, they
    give the same first k whenever every entry equal to the k-th value is a candidate, which holds
    when the smallest candidate is below the k-th value (every other entry is at most the
    smallest candidate).  Otherwise (ties at the candidates' edge, NaN, k > V / 2) the full sort."""
    V = x.shape[-1]
    c = 2 * k
    if c < V and x.numel() and not bool(x.isnan().any()):
        ids = x.topk(c, dim=-1, sorted=False).indices.sort(dim=-1).values  # candidates, in id order
        vals = x.gather(-1, ids)
        order = torch.sort(vals, dim=-1, descending=True, stable=True).indices
        kth = vals.gather(-1, order[..., k - 1 : k])
        if bool((vals.amin(dim=-1, keepdim=True) < kth).all()):
            return ids.gather(-1, order[..., :k]).contiguous()
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k].contiguous()


# --------------------------------------------------------------------------------------------
# references (the CPU kernels)
# --------------------------------------------------------------------------------------------

def draft_topk_reference(logits: torch.Tensor, k: int) -> TopK:
    """Pure-torch reference (and CPU kernel) of ``kdtree::draft_topk``: log_softmax of the
    float32 logits (summed in float64, rounded to float32 once), ids from a stable descending
    sort of the float32 logits."""
    _check_logits("draft_topk", logits, k)
    x = logits.float()
    ids = _top_order(x, k)
    lse = _lse(x)
    return TopK((x.gather(-1, ids).double() - lse[..., None]).float(), ids)


def draft_topk_partial_reference(logits: torch.Tensor, k: int, vocab_start: int) -> PartialTopK:
    """Pure-torch reference (and CPU kernel) of ``kdtree::draft_topk_partial``."""
    _check_partial(logits, k, vocab_start)
    x = logits.float()
    order = _top_order(x, k)
    return PartialTopK(x.gather(-1, order), order + vocab_start, _lse(x).float())


def draft_topk_merge_reference(values: torch.Tensor, token_ids: torch.Tensor, lse: torch.Tensor, k: int) -> TopK:
    """Pure-torch reference (and CPU kernel) of ``kdtree::draft_topk_merge``."""
    _check_merge(values, token_ids, lse, k)
    P, R, L, kin = values.shape
    v = values.permute(1, 2, 0, 3).reshape(R, L, P * kin)
    ids = token_ids.permute(1, 2, 0, 3).reshape(R, L, P * kin)
    # (value desc, id asc): stable sort by id, then a stable sort by value keeps the id order.
    by_id = torch.sort(ids, dim=-1, stable=True).indices
    v, ids = v.gather(-1, by_id), ids.gather(-1, by_id)
    order = _top_order(v, k)
    lse_all = torch.logsumexp(lse.double(), dim=0)
    return TopK((v.gather(-1, order).double() - lse_all[..., None]).float(), ids.gather(-1, order))


# --------------------------------------------------------------------------------------------
# typed wrappers
# --------------------------------------------------------------------------------------------

def draft_topk(logits: torch.Tensor, k: int) -> TopK:
    """Fused log-softmax + top-K over the vocabulary (schema
    ``draft_topk(Tensor logits, int k) -> (Tensor logprobs, Tensor token_ids)``).

    Args:
        logits: bfloat16 or float32 [R, L, V], contiguous; 1 <= V <= 262144.  Finite or -inf
            (masked tokens get log-prob -inf); NaN / +inf give unspecified log-probs.
        k: 1 <= k <= min(V, 1024).

    Returns :class:`TopK`: ``logprobs`` float32 [R, L, k], ``log_softmax(logits.float())`` at
    the chosen ids, and ``token_ids`` int64 [R, L, k]: the k entries with the largest float32
    logits, larger first, equal logits lower id first.  CUDA-graph safe (no host sync; the
    workspace size depends only on the shapes).
    """
    _check_logits("draft_topk", logits, k)
    return TopK(*torch.ops.kdtree.draft_topk(logits, k))


def draft_topk_partial(logits: torch.Tensor, k: int, vocab_start: int) -> PartialTopK:
    """One vocabulary shard's top-K (schema ``draft_topk_partial(Tensor logits, int k,
    int vocab_start) -> (Tensor values, Tensor token_ids, Tensor lse)``).

    Args:
        logits: bfloat16 or float32 [R, L, V_p], this rank's slice of the vocabulary.
        k: 1 <= k <= min(V_p, 1024); use the k of the final result on every rank.
        vocab_start: global id of the slice's first entry; ids must stay below 2**31.

    Returns :class:`PartialTopK`: ``values`` float32 [R, L, k], the raw logits (as float32) of
    the shard's top-k in the top-K order; ``token_ids`` int64 [R, L, k], global ids
    (local index + vocab_start); ``lse`` float32 [R, L], ``logsumexp(logits.float(), -1)``.
    Stack the ranks' outputs along a new leading dim P and pass them to :func:`draft_topk_merge`.
    """
    _check_partial(logits, k, vocab_start)
    return PartialTopK(*torch.ops.kdtree.draft_topk_partial(logits, k, vocab_start))


def draft_topk_merge(values: torch.Tensor, token_ids: torch.Tensor, lse: torch.Tensor, k: int) -> TopK:
    """Merge vocabulary shards' partial top-K (schema ``draft_topk_merge(Tensor values,
    Tensor token_ids, Tensor lse, int k) -> (Tensor logprobs, Tensor token_ids)``).

    Args:
        values: float32 [P, R, L, k_in], the parts' raw logits (``PartialTopK.values`` stacked).
        token_ids: int64 [P, R, L, k_in], their global ids, distinct, in [0, 2**31).
        lse: float32 [P, R, L], the parts' log-sum-exp.
        k: 1 <= k <= min(1024, P * k_in).

    Returns :class:`TopK`: the k entries of the union with the largest values (equal values:
    lower id first), log-prob = value - logsumexp over P of lse.  The entries need not be
    sorted.  When every part holds its own top-k_in with k <= k_in (``draft_topk_partial`` with
    the same k), the ids equal those of ``draft_topk`` on the unsplit logits and the log-probs
    agree to float32 rounding.
    """
    _check_merge(values, token_ids, lse, k)
    return TopK(*torch.ops.kdtree.draft_topk_merge(values, token_ids, lse, k))


# --------------------------------------------------------------------------------------------
# registration: CPU kernels (the references) and fake kernels
# --------------------------------------------------------------------------------------------

torch.library.register_kernel("kdtree::draft_topk", "cpu", draft_topk_reference)
torch.library.register_kernel("kdtree::draft_topk_partial", "cpu", draft_topk_partial_reference)
torch.library.register_kernel("kdtree::draft_topk_merge", "cpu", draft_topk_merge_reference)


@torch.library.register_fake("kdtree::draft_topk")
def _(logits, k):
    R, L, _ = logits.shape
    return logits.new_empty((R, L, k), dtype=torch.float32), logits.new_empty((R, L, k), dtype=torch.int64)


@torch.library.register_fake("kdtree::draft_topk_partial")
def _(logits, k, vocab_start):
    R, L, _ = logits.shape
    return (logits.new_empty((R, L, k), dtype=torch.float32), logits.new_empty((R, L, k), dtype=torch.int64),
            logits.new_empty((R, L), dtype=torch.float32))


@torch.library.register_fake("kdtree::draft_topk_merge")
def _(values, token_ids, lse, k):
    _, R, L, _ = values.shape
    return values.new_empty((R, L, k), dtype=torch.float32), values.new_empty((R, L, k), dtype=torch.int64)
