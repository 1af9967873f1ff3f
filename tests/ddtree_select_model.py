"""A Python model of the ddtree_build CUDA kernel's parallel ("select") path (csrc/ddtree_build.cu).

The pop order is the first B nodes of the whole tree sorted by the total order (score desc,
then parent's index, then rank), because a node never precedes its parent or left sibling.  So:
1. threshold t: any t whose node set S_t = {nodes with score >= t} holds >= B nodes contains
   them.  The spine-deviation family F = {(0, .., 0, r)} (L sorted rows) gives one: an 8-way
   search over t for count_F(t) >= B, count_F(t) close to B (count_F <= count).
2. enumerate S_t level by level (children of a node with score s at depth d: the ranks r with
   f32(s + lp[d][r]) >= t, a prefix), into slots in level order; more than CAP nodes: give up.
3. sort by (score desc, slot) and check every adjacent equal-score pair that can matter (within
   the first B + 1, or in the run tied with the B-th) against the total order using the sorted
   positions of their parents; on a miss sort again by (score, parent's position, slot) and
   check again; a second miss gives up (the kernel then runs the exact serial loop).
It needs every lp <= 0 (then a child never outscores its parent).  Returns (tokens, parents,
depths), or None when the kernel gives up and runs the exact serial loop instead.
"""
from __future__ import annotations

import struct

import numpy as np

CAP = 2048
PROBES = 8
MAX_ROUNDS = 12


def _ord(f) -> int:
    f = float(np.float32(f))
    u = struct.unpack("<I", struct.pack("<f", f))[0]
    return (u ^ 0xFFFFFFFF) if u & 0x80000000 else (u | 0x80000000)


def _from_ord(o: int) -> np.float32:
    u = (o & 0x7FFFFFFF) if o & 0x80000000 else (o ^ 0xFFFFFFFF)
    return np.float32(struct.unpack("<f", struct.pack("<I", u))[0])


def _count_row(s: np.float32, row: np.ndarray, t) -> int:
    # the kernel's binary search: ranks r with f32(s + row[r]) >= t form a prefix
    lo, hi = 0, len(row)
    while lo < hi:
        mid = (lo + hi) // 2
        if np.float32(s + row[mid]) >= t:
            lo = mid + 1
        else:
            hi = mid
    return lo


def threshold(lp: np.ndarray, B: int):
    L, K = lp.shape
    spine = [np.float32(0.0)]
    for d in range(1, L):
        spine.append(np.float32(spine[-1] + lp[d - 1, 0]))
    if L * K < B:
        return np.float32(-np.inf), 0
    lo = min(_ord(np.float32(spine[d] + lp[d, K - 1])) for d in range(L))
    hi = max(_ord(np.float32(spine[d] + lp[d, 0])) for d in range(L)) + 1
    cnt_lo = L * K
    rounds = 0
    while rounds < MAX_ROUNDS and hi - lo > 1 and cnt_lo > B + B // 8:
        probes = [lo + (hi - lo) * (w + 1) // (PROBES + 1) for w in range(PROBES)]
        counts = [sum(_count_row(spine[d], lp[d], _from_ord(p)) for d in range(L)) for p in probes]
        new_hi = hi
        for p, c in zip(probes, counts):
            if c >= B:
                lo, cnt_lo = p, c
            elif p < new_hi:
                new_hi = p
        hi = new_hi
        rounds += 1
    return _from_ord(lo), rounds


def enumerate_set(lp: np.ndarray, t):
    """Slots in level order: lists (score, parent_slot_plus1, rank, depth), or None past CAP."""
    L, K = lp.shape
    sc, par, rank, dep = [], [], [], []
    n1 = _count_row(np.float32(0.0), lp[0], t)
    if n1 > CAP:
        return None
    for r in range(n1):
        sc.append(np.float32(np.float32(0.0) + lp[0, r]))
        par.append(0)
        rank.append(r)
        dep.append(1)
    beg, end = 0, n1
    for d in range(1, L):
        if end == beg:
            break
        counts = [_count_row(sc[i], lp[d], t) for i in range(beg, end)]
        offs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int)
        total = int(sum(counts))
        if end + total > CAP:
            return None
        for j in range(total):
            k = int(np.searchsorted(offs, j, side="right")) - 1  # largest k with offs[k] <= j
            r = j - offs[k]
            assert 0 <= r < counts[k]
            sc.append(np.float32(sc[beg + k] + lp[d, r]))
            par.append(beg + k + 1)
            rank.append(r)
            dep.append(d + 1)
        beg, end = end, end + total
    return sc, par, rank, dep


def _check(order, pos, par, hi, B) -> bool:
    n = len(order)
    for i in range(n - 1):
        if not (i < B or (n > B and hi[order[i]] == hi[order[B - 1]])):
            continue
        u, v = order[i], order[i + 1]
        if hi[u] != hi[v]:
            continue
        qu = pos[par[u] - 1] if par[u] else -1
        qv = pos[par[v] - 1] if par[v] else -1
        if not (qu < qv or (qu == qv and u < v)):
            return False
    return True


def build_select_model(lp, ids, root: int, budget: int, trace: list | None = None):
    trace = [] if trace is None else trace
    lp = np.asarray(lp, dtype=np.float32)
    ids = np.asarray(ids)
    if not (lp[:, 0] <= 0).all():  # scores may grow along a path: S_t is not prefix-closed
        trace.append("gave up: lp > 0")
        return None
    t, _ = threshold(lp, budget)
    got = enumerate_set(lp, t)
    if got is None:
        trace.append("gave up: more than CAP nodes")
        return None
    sc, par, rank, dep = got
    n = len(sc)
    hi = [(~_ord(s)) & 0xFFFFFFFF for s in sc]
    order = sorted(range(n), key=lambda s: (hi[s], s))
    pos = [0] * n
    for i, s in enumerate(order):
        pos[s] = i
    if not _check(order, pos, par, hi, budget):
        pp = [pos[par[s] - 1] + 1 if par[s] else 0 for s in range(n)]
        order = sorted(range(n), key=lambda s: (hi[s], pp[s], s))
        for i, s in enumerate(order):
            pos[s] = i
        if not _check(order, pos, par, hi, budget):
            trace.append("gave up: order check")
            return None
        trace.append("sorted twice")
    else:
        trace.append("sorted once")
    nb = min(budget, n)
    tokens, parents, depths = [root], [-1], [0]
    for i in range(nb):
        s = order[i]
        tokens.append(int(ids[dep[s] - 1, rank[s]]))
        parents.append(pos[par[s] - 1] + 1 if par[s] else 0)
        depths.append(dep[s])
    return tokens, parents, depths
