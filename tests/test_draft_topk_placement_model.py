"""A CPU model of how csrc/topk.cu's cluster kernel splits the placement of a row's top-k among
its S CTAs, run on the same logits kinds as tests/test_draft_topk.py.

The kernel's per-CTA thresholds (tau_c: the m-th largest thread maximum, on 16 key bits), the
candidate lists (entries >= the CTA's threshold), the 1024 value buckets counted from a base, and
the ownership rule (CTA r places the buckets whose start s < tk = min(total, k) has s * S // tk
== r) are modelled step by step; every CTA computes its own bucket starts, as the kernel does.
Positions are exact ranks whatever the buckets, so what can go wrong is ownership: a position
that no CTA places (left unwritten) or that two place.  These tests check that, with the
kernel's rule (the base is the cluster's smallest tau_c), every position below tk has exactly one
placer; and that the model does see the bug the rule fixed (each CTA counting from its own tau_c
left positions unplaced when one CTA's chunk lies far below the row's top).  The kernel itself is
compared with the reference on the GPU in tests/test_draft_topk.py."""
import pytest
import torch

from .test_draft_topk import KINDS, make_logits

ID_BITS = 18
THREADS = 512
BUCKETS = 1024
CAP = 2048


def orderable(x: torch.Tensor) -> torch.Tensor:
    """Bf16 / F32::orderable of csrc/topk_select.cuh, as int64 (bf16: 16 bits, float32: 32)."""
    if x.dtype == torch.bfloat16:
        u = x.view(torch.int16).to(torch.int64) & 0xFFFF
        sign, mag, nan = 0x8000, 0x7FFF, (0x7F80, 0x7FC0)
    else:
        u = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        sign, mag, nan = 0x80000000, 0x7FFFFFFF, (0x7F800000, 0x7FC00000)
    full = 2 * sign - 1
    m = u & mag
    u = torch.where(m == 0, torch.zeros_like(u), torch.where(m > nan[0], torch.full_like(u, nan[1]), u))
    return torch.where(u & sign != 0, (~u) & full, u | sign)


def cluster_plan(V: int, W: int):
    """plan_cluster of csrc/topk.cu: (S, C)."""
    want = -(-V // (THREADS * W * 2))
    S = 1
    while S < want and S < 8:
        S <<= 1
    C = -(-(-(-V // S)) // 8) * 8
    return S, C


def placers(row: torch.Tensor, k: int, base_rule: str = "cluster"):
    """For one row (1-D bf16 or float32): None when the kernel takes its exact fallback (more
    than 2048 candidates), else (tk, a list of the CTAs placing each output position < tk)."""
    bf16 = row.dtype == torch.bfloat16
    W = 8 if bf16 else 4
    V = row.numel()
    S, C = cluster_plan(V, W)
    okey = orderable(row)
    key = (okey << ID_BITS) | ((1 << ID_BITS) - 1 - torch.arange(V))
    local = S == 1 or k * S <= THREADS
    m = k if local else -(-k // S)
    tau_c = []
    for c in range(S):
        lo, hi = c * C, min(V, (c + 1) * C)
        if hi <= lo:
            tau_c.append(1)
            continue
        thread = (torch.arange(hi - lo) // W) % THREADS  # slot j of thread t: entries (j * 512 + t) * W + [0, W)
        tmax = torch.zeros(THREADS, dtype=torch.int64).scatter_reduce(0, thread, okey[lo:hi], "amax")
        held = (torch.arange(THREADS) * W < hi - lo)
        m16 = (tmax if bf16 else tmax >> 16)[held].sort(descending=True).values
        t16 = int(m16[m - 1]) if m16.numel() >= m else None
        tau_c.append(1 if t16 is None else max(1, t16 if bf16 else t16 << 16))
    tau = tau_c if local else [min(tau_c)] * S  # the compaction's threshold, per CTA
    cand = torch.cat([key[c * C:min(V, (c + 1) * C)][okey[c * C:min(V, (c + 1) * C)] >= tau[c]]
                      for c in range(S)])
    total = cand.numel()
    if total > CAP:
        return None
    tk = min(total, k)
    rank_of = torch.empty(total, dtype=torch.int64)
    rank_of[cand.argsort(descending=True)] = torch.arange(total)  # the exact output position
    owners = [[] for _ in range(tk)]
    v16 = cand >> ID_BITS if bf16 else cand >> (ID_BITS + 16)
    for r in range(S):
        b = min(tau_c) if base_rule == "cluster" else tau[r]
        b16 = b if bf16 else b >> 16
        base16 = b16 - min(b16, 128)
        bucket = torch.where(v16 <= base16, torch.zeros_like(v16), (v16 - base16).clamp(max=BUCKETS - 1))
        count = torch.bincount(bucket, minlength=BUCKETS)
        start = count.flip(0).cumsum(0).flip(0) - count  # candidates in higher buckets
        st = start[bucket]
        own = (st < tk) & (st * S // tk == r)
        for p in rank_of[own & (rank_of < tk)].tolist():
            owners[p].append(r)
    return tk, owners


CASES = [(torch.bfloat16, 163840, k) for k in (1, 16, 64, 256, 1024)] + [(torch.float32, 100003, 16),
                                                                           (torch.float32, 100003, 777)]


@pytest.mark.parametrize("dtype,V,k", CASES)
@pytest.mark.parametrize("kind", KINDS)
def test_every_position_has_exactly_one_placer(kind, dtype, V, k, fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    rows = make_logits(kind, (1, 2, V), dtype, gen).view(2, V)
    for row in rows:
        got = placers(row, k)
        if got is None:  # the exact fallback: its own test in tests/test_draft_topk.py
            continue
        tk, owners = got
        bad = [(p, o) for p, o in enumerate(owners) if len(o) != 1]
        assert not bad, f"{kind}: positions with other than one placer (position, CTAs): {bad[:8]}"


def test_model_sees_the_per_cta_base_bug():
    """The rule before the fix (each CTA counting buckets from its own tau_c, local mode) on a
    row whose chunk 3 lies far below the rest: CTA 3 puts every top candidate in its top bucket at
    start 0, and its positions [2 * 3, 2 * 3 + 2) (k = 16) are placed by nobody."""
    gen = torch.Generator().manual_seed(0)
    row = make_logits("low_block", (1, 1, 163840), torch.bfloat16, gen).view(-1)
    tk, owners = placers(row, 16, base_rule="per_cta")
    assert [p for p, o in enumerate(owners) if not o] == [6, 7]
    tk, owners = placers(row, 16)
    assert all(len(o) == 1 for o in owners)
