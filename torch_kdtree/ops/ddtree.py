"""DDTree step ops: ``kdtree::ddtree_build``, ``kdtree::tree_accept``, ``kdtree::kv_commit``.

The functions named ``*_reference`` are the ground truth and the CPU kernels; the CUDA kernels
in ``csrc/ddtree_build.cu`` and ``csrc/ddtree.cu`` must equal them bit for bit.  Algorithm: docs/ddtree.md.
"""
from __future__ import annotations

import heapq
import struct
from typing import NamedTuple

import torch

from ._checks import check_same_device, check_tensor, value_checks_active

MAX_BUDGET = 1024
MAX_DEPTH = 32
MAX_K = 1024

_F32 = struct.Struct("f")


def _f32(x: float) -> float:
    # Python floats are float64; rounding the exact-in-float64 sum of two float32 values to
    # float32 is the correctly rounded float32 sum (53 >= 2 * 24 + 2), so this is float32 addition.
    return _F32.unpack(_F32.pack(x))[0]


class Tree(NamedTuple):
    """A batch of draft trees, N = budget + 1 rows per request (row 0 is the root).

    tokens int64 [R, N] (-1 for padding), parents int32 [R, N] (-1 for the root and padding),
    depths int32 [R, N] (0 for the root, -1 for padding), visible bool [R, N, N]
    (visible[r, i, j]: node j is i or an ancestor of i; a padding row sees only itself).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    visible: torch.Tensor


class Accepted(NamedTuple):
    """indices int32 [R, N]: accepted node indices in path order from the root, -1 padded;
    lengths int32 [R]: number of accepted nodes (root included); next_tokens int64 [R]: the
    target's token after the accepted path (the next step's root)."""

    indices: torch.Tensor
    lengths: torch.Tensor
    next_tokens: torch.Tensor


# --------------------------------------------------------------------------------------------
# ddtree_build
# --------------------------------------------------------------------------------------------

def _check_build(logprobs, token_ids, root_tokens, budget) -> None:
    op = "ddtree_build"
    check_tensor(op, "logprobs", logprobs, torch.float32, 3)
    check_tensor(op, "token_ids", token_ids, torch.int64, 3)
    check_tensor(op, "root_tokens", root_tokens, torch.int64, 1)
    check_same_device(op, logprobs=logprobs, token_ids=token_ids, root_tokens=root_tokens)
    if token_ids.shape != logprobs.shape:
        raise ValueError(f"{op}: token_ids shape {tuple(token_ids.shape)} != logprobs shape {tuple(logprobs.shape)}")
    R, L, K = logprobs.shape
    if root_tokens.shape[0] != R:
        raise ValueError(f"{op}: root_tokens must have R = {R} entries, got {root_tokens.shape[0]}")
    if not 1 <= L <= MAX_DEPTH:
        raise ValueError(f"{op}: depth L must be in [1, {MAX_DEPTH}], got {L}")
    if not 1 <= K <= MAX_K:
        raise ValueError(f"{op}: K must be in [1, {MAX_K}], got {K}")
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise TypeError(f"{op}: budget must be an int, got {type(budget).__name__}")
    if not 1 <= budget <= MAX_BUDGET:
        raise ValueError(f"{op}: budget must be in [1, {MAX_BUDGET}], got {budget}")
    if value_checks_active(logprobs) and logprobs.numel():
        if torch.isnan(logprobs).any():
            raise ValueError(f"{op}: logprobs contains NaN")
        if (logprobs[..., 1:] > logprobs[..., :-1]).any():
            raise ValueError(f"{op}: logprobs must be sorted descending along the last dimension (top-K order)")
        if (token_ids < 0).any():
            raise ValueError(f"{op}: token_ids must be non-negative")


def _on_cpu(*args) -> bool:
    """Whether the op dispatches to its CPU kernel (the reference), which checks its inputs itself:
    every argument a plain CPU tensor, outside tracing (a traced call runs the fake kernel, which
    does not).  Otherwise the public function checks them before the call."""
    return not torch.compiler.is_compiling() and all(type(a) is torch.Tensor and a.device.type == "cpu"
                                                     for a in args)


def _build_one(lp: list, ids: list, root: int, budget: int, L: int, K: int):
    """Best-first build of one tree, exactly as docs/ddtree.md: heap order (-score, parent, rank)."""
    score = [0.0]
    parent = [-1]
    depth = [0]
    token = [root]
    heap = [(-lp[0][0], 0, 0)]
    while len(token) - 1 < budget and heap:
        neg, p, r = heapq.heappop(heap)
        s = -neg
        d = depth[p] + 1
        n = len(token)
        score.append(s)
        parent.append(p)
        depth.append(d)
        token.append(ids[d - 1][r])
        if r + 1 < K:
            heapq.heappush(heap, (-_f32(score[p] + lp[d - 1][r + 1]), p, r + 1))
        if d < L:
            heapq.heappush(heap, (-_f32(s + lp[d][0]), n, 0))
    return token, parent, depth


def ddtree_build_reference(logprobs: torch.Tensor, token_ids: torch.Tensor, root_tokens: torch.Tensor,
                           budget: int) -> Tree:
    """Pure-torch/Python reference (and CPU kernel) of ``kdtree::ddtree_build``."""
    _check_build(logprobs, token_ids, root_tokens, budget)
    R, L, K = logprobs.shape
    N = budget + 1
    dev = logprobs.device
    tokens = torch.full((R, N), -1, dtype=torch.int64)
    parents = torch.full((R, N), -1, dtype=torch.int32)
    depths = torch.full((R, N), -1, dtype=torch.int32)
    visible = torch.zeros((R, N, N), dtype=torch.bool)
    lp_all = logprobs.detach().cpu().tolist()
    ids_all = token_ids.detach().cpu().tolist()
    roots = root_tokens.detach().cpu().tolist()
    for r in range(R):
        tok, par, dep = _build_one(lp_all[r], ids_all[r], roots[r], budget, L, K)
        n = len(tok)
        tokens[r, :n] = torch.tensor(tok, dtype=torch.int64)
        parents[r, :n] = torch.tensor(par, dtype=torch.int32)
        depths[r, :n] = torch.tensor(dep, dtype=torch.int32)
        vis = visible[r]
        for i in range(N):
            if 0 < i < n:
                vis[i] = vis[par[i]]
            vis[i, i] = True
    return Tree(tokens.to(dev), parents.to(dev), depths.to(dev), visible.to(dev))


def ddtree_build(logprobs: torch.Tensor, token_ids: torch.Tensor, root_tokens: torch.Tensor, budget: int) -> Tree:
    """Best-first DDTree draft tree for each of R requests.

    Args:
        logprobs: float32 [R, L, K], per-depth top-K log-probabilities sorted descending
            (row d-1 is depth d's marginal); L <= 32, K <= 1024.
        token_ids: int64 [R, L, K], the token of each entry of ``logprobs``.
        root_tokens: int64 [R], the last committed token of each request (tree row 0).
        budget: B, the number of non-root nodes, 1 <= B <= 1024; N = B + 1 rows.

    A node is a prefix of ranks (r_1..r_d) with score lp[0, r_1] + ... + lp[d-1, r_d] summed
    in float32 from depth 1; nodes are popped best-first (score desc, then parent index asc,
    then rank asc) until B exist.  Returns :class:`Tree`; node indices are pop order, so
    parents[i] < i.
    """
    if not (_on_cpu(logprobs, token_ids, root_tokens) and type(budget) is int):  # else the CPU kernel checks
        _check_build(logprobs, token_ids, root_tokens, budget)
    return Tree(*torch.ops.kdtree.ddtree_build(logprobs, token_ids, root_tokens, budget))


# --------------------------------------------------------------------------------------------
# tree_accept
# --------------------------------------------------------------------------------------------

def _check_accept(tokens, parents, target_tokens) -> None:
    op = "tree_accept"
    check_tensor(op, "tokens", tokens, torch.int64, 2)
    check_tensor(op, "parents", parents, torch.int32, 2)
    check_tensor(op, "target_tokens", target_tokens, torch.int64, 2)
    check_same_device(op, tokens=tokens, parents=parents, target_tokens=target_tokens)
    if parents.shape != tokens.shape or target_tokens.shape != tokens.shape:
        raise ValueError(f"{op}: tokens, parents and target_tokens must share one [R, N] shape, got "
                         f"{tuple(tokens.shape)}, {tuple(parents.shape)}, {tuple(target_tokens.shape)}")
    N = tokens.shape[1]
    if not 1 <= N <= MAX_BUDGET + 1:
        raise ValueError(f"{op}: N must be in [1, {MAX_BUDGET + 1}], got {N}")
    if value_checks_active(tokens) and tokens.numel():
        if (parents[:, 0] != -1).any():
            raise ValueError(f"{op}: parents[:, 0] must be -1 (row 0 is the root)")
        idx = torch.arange(N, device=parents.device, dtype=torch.int32)
        if ((parents < -1) | (parents >= idx)).any():
            raise ValueError(f"{op}: parents[r, i] must be -1 or an earlier node index (< i)")


def tree_accept_reference(tokens: torch.Tensor, parents: torch.Tensor, target_tokens: torch.Tensor) -> Accepted:
    """Pure-torch/Python reference (and CPU kernel) of ``kdtree::tree_accept``."""
    _check_accept(tokens, parents, target_tokens)
    R, N = tokens.shape
    dev = tokens.device
    tok = tokens.cpu()
    par = parents.cpu()
    post = target_tokens.cpu()
    indices = torch.full((R, N), -1, dtype=torch.int32)
    lengths = torch.zeros(R, dtype=torch.int32)
    next_tokens = torch.zeros(R, dtype=torch.int64)
    for r in range(R):
        # next_child[p] = the lowest-index child of p whose token is the target's token at p
        match = torch.zeros(N, dtype=torch.bool)
        valid = par[r, 1:] >= 0
        p = par[r, 1:].clamp(min=0).long()
        match[1:] = valid & (tok[r, 1:] == post[r][p])
        next_child = torch.full((N,), N, dtype=torch.int64)
        kids = torch.nonzero(match).flatten()
        next_child.scatter_reduce_(0, par[r][kids].long(), kids, reduce="amin")
        path = [0]
        while next_child[path[-1]] < N:
            path.append(int(next_child[path[-1]]))
        indices[r, : len(path)] = torch.tensor(path, dtype=torch.int32)
        lengths[r] = len(path)
        next_tokens[r] = post[r, path[-1]]
    return Accepted(indices.to(dev), lengths.to(dev), next_tokens.to(dev))


def tree_accept(tokens: torch.Tensor, parents: torch.Tensor, target_tokens: torch.Tensor) -> Accepted:
    """Walk each verified tree with the target's per-node tokens.

    Args:
        tokens: int64 [R, N] node tokens (row 0 the root), e.g. ``Tree.tokens``.
        parents: int32 [R, N] parent indices (-1 for the root and padding), parents[i] < i.
        target_tokens: int64 [R, N], the target's token at each node (argmax or a sample of
            its logits at that node).

    From the root, repeatedly move to the child whose token equals the target's token at the
    current node (the lowest-index one if several match); the visited nodes are accepted and
    the target's token at the last one is ``next_tokens``.  Returns :class:`Accepted`.
    """
    if not _on_cpu(tokens, parents, target_tokens):  # the CPU kernel, the reference, checks them itself
        _check_accept(tokens, parents, target_tokens)
    return Accepted(*torch.ops.kdtree.tree_accept(tokens, parents, target_tokens))


# --------------------------------------------------------------------------------------------
# kv_commit
# --------------------------------------------------------------------------------------------

def _check_commit(kv_cache, block_table, cache_lens, indices, lengths) -> None:
    op = "kv_commit"
    check_tensor(op, "kv_cache", kv_cache, (torch.bfloat16, torch.float16, torch.float32), 4)
    check_tensor(op, "block_table", block_table, torch.int32, 2)
    check_tensor(op, "cache_lens", cache_lens, torch.int32, 1)
    check_tensor(op, "indices", indices, torch.int32, 2)
    check_tensor(op, "lengths", lengths, torch.int32, 1)
    check_same_device(op, kv_cache=kv_cache, block_table=block_table, cache_lens=cache_lens,
                      indices=indices, lengths=lengths)
    R = block_table.shape[0]
    if cache_lens.shape[0] != R or indices.shape[0] != R or lengths.shape[0] != R:
        raise ValueError(f"{op}: block_table, cache_lens, indices and lengths must agree on R = {R}, got "
                         f"{cache_lens.shape[0]}, {indices.shape[0]}, {lengths.shape[0]}")
    if not value_checks_active(kv_cache) or R == 0:
        return
    _, num_pages, page_size, _ = kv_cache.shape
    N = indices.shape[1]
    if ((lengths < 0) | (lengths > N)).any():
        raise ValueError(f"{op}: lengths must be in [0, N = {N}]")
    if (cache_lens < 0).any():
        raise ValueError(f"{op}: cache_lens must be non-negative")
    j = torch.arange(N, device=indices.device, dtype=torch.int32)
    live = j < lengths[:, None].to(torch.int32)
    if (live & ((indices < 0) | (indices >= N))).any():
        raise ValueError(f"{op}: indices[r, j] for j < lengths[r] must be node indices in [0, {N})")
    if N > 1 and (live[:, 1:] & (indices[:, 1:] <= indices[:, :-1])).any():
        raise ValueError(f"{op}: accepted indices must increase along the path")
    # The last logical position touched: max(src, dst) = cache_len + max(indices[len-1], len-1).
    last_src = indices.gather(1, (lengths.long() - 1).clamp(min=0)[:, None])[:, 0]
    last = cache_lens.long() + torch.maximum(last_src.long(), lengths.long() - 1)
    need_pages = torch.where(lengths > 0, last // page_size + 1, torch.zeros_like(last))
    if (need_pages > block_table.shape[1]).any():
        raise ValueError(f"{op}: block_table has {block_table.shape[1]} pages per request, too few to cover "
                         f"position {int(last.max())} with page_size {page_size}")
    pages_used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < need_pages[:, None]
    if (pages_used & ((block_table < 0) | (block_table >= num_pages))).any():
        raise ValueError(f"{op}: block_table entries for the touched positions must be page ids in [0, {num_pages})")


def kv_commit_reference(kv_cache: torch.Tensor, block_table: torch.Tensor, cache_lens: torch.Tensor,
                        indices: torch.Tensor, lengths: torch.Tensor) -> None:
    """Pure-torch reference (and CPU kernel) of ``kdtree::kv_commit``: gather every accepted row
    of every layer, then scatter them to the slots right after the committed prefix."""
    _check_commit(kv_cache, block_table, cache_lens, indices, lengths)
    R, N = indices.shape
    page_size = kv_cache.shape[2]
    j = torch.arange(N, device=kv_cache.device)
    live = j[None, :] < lengths.long()[:, None]  # [R, N]: request r's accepted rows j < lengths[r]
    req = torch.arange(R, device=kv_cache.device)[:, None].expand(R, N)[live]
    base = cache_lens.long()[:, None].expand(R, N)[live]
    src = base + indices.long()[live]
    dst = base + j[None, :].expand(R, N)[live]
    bt = block_table.long()
    rows = kv_cache[:, bt[req, src // page_size], src % page_size]  # a copy: every source read first
    kv_cache[:, bt[req, dst // page_size], dst % page_size] = rows


def kv_commit(kv_cache: torch.Tensor, block_table: torch.Tensor, cache_lens: torch.Tensor,
              indices: torch.Tensor, lengths: torch.Tensor) -> None:
    """Compact the accepted tree nodes' cache entries, all layers in one launch (in place).

    Args:
        kv_cache: [num_layers, num_pages, page_size, D] bfloat16/float16/float32 (D = 576 for
            K2's latent cache), mutated.
        block_table: int32 [R, max_pages], logical page -> physical page.
        cache_lens: int32 [R], committed prefix length; tree node i sits at position
            cache_lens[r] + i.
        indices: int32 [R, N], accepted node indices in path order (``Accepted.indices``).
        lengths: int32 [R], accepted count.

    For j < lengths[r], every layer's entry at position cache_lens[r] + indices[r, j] moves to
    cache_lens[r] + j (sources are read before any destination is written).  ``cache_lens`` is
    not changed: the caller advances it.
    """
    if not _on_cpu(kv_cache, block_table, cache_lens, indices, lengths):  # the CPU kernel checks them itself
        _check_commit(kv_cache, block_table, cache_lens, indices, lengths)
    torch.ops.kdtree.kv_commit(kv_cache, block_table, cache_lens, indices, lengths)


# --------------------------------------------------------------------------------------------
# registration: CPU kernels (the references) and fake kernels
# --------------------------------------------------------------------------------------------

torch.library.register_kernel("kdtree::ddtree_build", "cpu", ddtree_build_reference)
torch.library.register_kernel("kdtree::tree_accept", "cpu", tree_accept_reference)
torch.library.register_kernel("kdtree::kv_commit", "cpu", kv_commit_reference)


@torch.library.register_fake("kdtree::ddtree_build")
def _(logprobs, token_ids, root_tokens, budget):
    R = logprobs.shape[0]
    N = budget + 1
    return (logprobs.new_empty((R, N), dtype=torch.int64), logprobs.new_empty((R, N), dtype=torch.int32),
            logprobs.new_empty((R, N), dtype=torch.int32), logprobs.new_empty((R, N, N), dtype=torch.bool))


@torch.library.register_fake("kdtree::tree_accept")
def _(tokens, parents, target_tokens):
    R, N = tokens.shape
    return (tokens.new_empty((R, N), dtype=torch.int32), tokens.new_empty((R,), dtype=torch.int32),
            tokens.new_empty((R,), dtype=torch.int64))


@torch.library.register_fake("kdtree::kv_commit")
def _(kv_cache, block_table, cache_lens, indices, lengths):
    return None
