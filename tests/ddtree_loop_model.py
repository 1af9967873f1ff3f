"""A lane-by-lane Python model of the ddtree_build CUDA kernel's best-first loop (csrc/ddtree_build.cu):
the uniform next key `cur`, the 32-lane sorted register list merged with two ballots, and the
overflow pool.  It mirrors the kernel's list and pool mechanics statement for statement, so a
CPU test can check them against the reference on many inputs (the GPU tests check the kernel).
"""
from __future__ import annotations

import struct

E = (1 << 64) - 1  # kEmpty
W = 32


def _orderable(f: float) -> int:
    # the kernel's make_key has no -0 fix: its scores are never -0 (checked here)
    u = struct.unpack("<I", struct.pack("<f", f))[0]
    assert u != 0x80000000, "a -0 score reached make_key"
    return u ^ ((0xFFFFFFFF if u & 0x80000000 else 0) | 0x80000000)


def _from_orderable(o: int) -> float:
    u = (o & 0x7FFFFFFF) if o & 0x80000000 else (~o & 0xFFFFFFFF)
    return struct.unpack("<f", struct.pack("<I", u))[0]


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def make_key(score: float, parent: int, rank: int, depth: int) -> int:
    return ((~_orderable(score) & 0xFFFFFFFF) << 32) | (parent << 16) | (rank << 6) | depth


def build_loop_model(lp: list, ids: list, root: int, budget: int, L: int, K: int, kc: int | None = None):
    """Returns (tokens, parents, depths) like ops.ddtree._build_one, computed the kernel's way."""
    kc = K if kc is None else kc
    N = budget + 1
    node_score = [0.0] * N
    node_info = [0] * N
    pool: list = []
    pool_best, pool_best_idx = E, -1
    cur = make_key(_f32(lp[0][0] + 0.0), 0, 0, 1)
    key = [E] * W
    head, length = E, 0
    rest, rest_in_list = E, False

    def push_pool(x):
        nonlocal pool_best, pool_best_idx
        if x == E:
            return
        pool.append(x)
        if x < pool_best:
            pool_best, pool_best_idx = x, len(pool) - 1

    def shfl(i):
        return key[i & 31]

    n = 1
    while n < N:
        if cur == E:
            break
        second = key[1]
        lo = cur & 0xFFFFFFFF
        s = _from_orderable(~(cur >> 32) & 0xFFFFFFFF)
        p, rank, d = lo >> 16, (lo >> 6) & 0x3FF, lo & 0x3F
        sp = node_score[p]
        sib = min(rank + 1, K - 1)
        lp_sib = lp[d - 1][sib]  # shared-memory cache or global: the same value
        lp_child = lp[min(d, L - 1)][0]
        node_score[n] = s
        node_info[n] = lo
        a = make_key(_f32(sp + lp_sib), p, rank + 1, d) if rank + 1 < K else E
        b = make_key(_f32(s + lp_child), n, 0, d + 1) if d < L else E
        x, y = min(a, b), max(a, b)
        chain = x < rest
        drop = 1 if (not chain and rest_in_list) else 0
        from_pool = not chain and not rest_in_list and rest != E
        nxt = x if chain else rest
        ins1 = y if chain else x
        ins2 = E if chain else y
        pa = sum(k < ins1 for k in key) - drop
        pb1 = sum(k < ins2 for k in key) - drop + 1
        merged = []
        for lane in range(W):
            src = lane + drop - (lane > pa) - (lane > pb1)
            assert 0 <= src <= 32
            moved = shfl(src)
            merged.append(ins1 if lane == pa else ins2 if lane == pb1 else E if src > 31 else moved)
        len_new = length - drop + (ins1 != E) + (ins2 != E)
        ov0 = ov1 = E
        if len_new > W:
            src32 = 32 + drop - (32 > pa) - (32 > pb1)
            moved32 = shfl(min(src32, 31))
            ov0 = ins1 if pa == 32 else ins2 if pb1 == 32 else E if src32 > 31 else moved32
            if len_new > W + 1:
                assert drop == 0
                ov1 = ins2 if pb1 == 33 else shfl(31)
        # the full sorted merge, for checking the kernel's lane formulas
        full = sorted([k for k in key[drop:] if k != E] + [k for k in (ins1, ins2) if k != E])
        full += [E] * (W + 2 - len(full))
        assert merged == full[:W] and (ov0, ov1) == (full[W], full[W + 1]), "merge"
        head = min(second if drop else head, ins1)
        assert head == merged[0]
        key = merged
        length = min(len_new, W)
        if from_pool:
            pool[pool_best_idx] = pool[-1]
            pool.pop()
            pool_best = min(pool, default=E)
            pool_best_idx = pool.index(pool_best) if pool else -1
        push_pool(ov0)
        push_pool(ov1)
        rest_in_list = head < pool_best
        rest = head if rest_in_list else pool_best
        assert rest == min(key + pool + [E]), "rest is the frontier's best"
        cur = nxt
        n += 1
    tokens, parents, depths = [root], [-1], [0]
    for i in range(1, n):
        info = node_info[i]
        d = info & 0x3F
        tokens.append(ids[d - 1][(info >> 6) & 0x3FF])
        parents.append(info >> 16)
        depths.append(d)
    return tokens, parents, depths
