"""Representative mla_prepare and mla_output calls for compute-sanitizer memcheck / racecheck:
mla_prepare with one token and a chunked 17-token pass, 8 and 16 heads, dn 64 and 128, both RoPE
layouts, a slot past the cache and a negative one (skipped by the kernel); mla_output with dv not a
multiple of the block's 32 rows and dc 1024; mla_tree_attention_output with several splits (some
empty), one split, and dv 40; mla_decode with several ring refills at 2 and at 3 stages, empty
splits, two requests, dn 192 and a slot past the cache (skipped); each result against the CPU
reference.  mla_decode's ring stages come from shapes (csrc/mla_absorb.cu): 3 when the launch's
heads x requests clusters of 8 blocks fill at most half the SMs and all fit at 3 stages at once
(an H100 or H200: up to 4 clusters always, 8 with 132 SMs; sm_120: never), else 2."""
import torch

import torch_kdtree  # noqa: F401
from torch_kdtree.ops import (mla_decode, mla_decode_reference, mla_output, mla_output_reference, mla_prepare,
                              mla_prepare_reference, mla_tree_attention_output, mla_tree_attention_output_reference,
                              value_checks)

g = torch.Generator().manual_seed(0)


def call(M, heads, dn, dv, dc, dr, interleave, bad_slots=False):
    q = torch.randn(M, heads, dn + dr, generator=g).bfloat16()
    ckv = torch.randn(M, dc + dr, generator=g).bfloat16()
    ang = torch.rand(M, dr // 2, generator=g) * 10
    nw = (torch.rand(dc, generator=g) + 0.5).bfloat16()
    w = (torch.randn(heads * (dn + dv), dc, generator=g) / dn ** 0.5).bfloat16()
    kv = torch.randn(2, 5, 16, dc + dr, generator=g).bfloat16()
    slots = torch.randperm(80, generator=g)[:M]
    if bad_slots:
        slots[0], slots[-1] = 80, -1
    args = [q, ckv, ang.cos(), ang.sin(), nw, 1e-6, w, kv, 1, slots, interleave]
    cuda = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    got = mla_prepare(*cuda).cpu()
    keep = (slots >= 0) & (slots < 80)
    ref_args = list(args)
    ref_args[9] = slots[keep]
    for i in (0, 1, 2, 3):
        ref_args[i] = args[i][keep]
    want = mla_prepare_reference(*ref_args)
    err = float((got[keep].float() - want.float()).norm() / want.float().norm())
    same_cache = float((cuda[7].cpu().float() - ref_args[7].float()).norm() / ref_args[7].float().norm())
    return "OK" if err < 1e-2 and same_cache < 1e-2 else f"MISMATCH {err} {same_cache}"


with value_checks(False):
    print(call(1, 8, 128, 128, 512, 64, True))
    print(call(17, 16, 128, 128, 512, 64, True))
    print(call(5, 4, 64, 32, 256, 32, False, bad_slots=True))


def output(M, heads, dn, dv, dc):
    o = torch.randn(M, heads, dc, generator=g).bfloat16()
    w = (torch.randn(heads * (dn + dv), dc, generator=g) / dc ** 0.5).bfloat16()
    got = mla_output(o.cuda(), w.cuda(), dn).cpu()
    want = mla_output_reference(o, w, dn)
    err = float((got.float() - want.float()).norm() / want.float().norm())
    return "OK" if err < 1e-2 else f"MISMATCH {err}"


print(output(1, 8, 128, 128, 512))
print(output(5, 4, 64, 40, 1024))


def attention_output(R, N, H, lens, page_size, dn, dv):
    """mla_tree_attention_output (attention + the merge-output kernel) against the two ops'
    references: several splits with empty ones, and one split (the attention writes the row)."""
    D = 576
    need = [(L + N + page_size - 1) // page_size for L in lens]
    pages = sum(need) + 1
    kv = torch.randn(pages, page_size, D, generator=g).bfloat16()
    bt = torch.zeros(R, max(need) + 1, dtype=torch.int32)
    at = 0
    for r, n in enumerate(need):
        bt[r, :n] = torch.arange(at, at + n, dtype=torch.int32)
        at += n
    cl = torch.tensor(lens, dtype=torch.int32)
    vis = torch.ones(N, N, dtype=torch.bool).tril().expand(R, N, N).contiguous()
    q = torch.randn(R, N, H, D, generator=g).bfloat16()
    w = (torch.randn(H * (dn + dv), 512, generator=g) / 512 ** 0.5).bfloat16()
    args = (q, kv, bt, cl, vis, 0.1, w, dn)
    got = mla_tree_attention_output(*[a.cuda() if isinstance(a, torch.Tensor) else a for a in args],
                                    prefix_ready=True).cpu()
    want = mla_tree_attention_output_reference(*args)
    err = float((got.float() - want.float()).norm() / want.float().norm())
    return "OK" if err < 2e-2 else f"MISMATCH {err}"


print(attention_output(1, 1, 16, [767], 16, 128, 128))
print(attention_output(2, 1, 16, [1000, 5], 64, 128, 128))
print(attention_output(1, 1, 8, [40], 16, 128, 128))
print(attention_output(2, 3, 4, [17, 300], 32, 64, 40))


def decode(lens, H, dn, dv, page_size, bad_slot=False):
    """mla_decode (one cluster launch) against its reference; with bad_slot the first request's
    slot lies past the cache: the kernel skips the write (value checks off) and the reference is
    given the true slot, so only that cache row may differ."""
    R, D = len(lens), 576
    max_pages = max((n + page_size) // page_size for n in lens) + 1
    pages = R * max_pages + 2
    bt = torch.randperm(pages, generator=g)[: R * max_pages].view(R, max_pages).int()
    cl = torch.tensor(lens, dtype=torch.int32)
    slots = bt.long().gather(1, (cl.long() // page_size)[:, None])[:, 0] * page_size + cl.long() % page_size
    ang = torch.rand(R, 32, generator=g) * 10
    args = [torch.randn(R, H, dn + 64, generator=g).bfloat16(), (torch.randn(R, D, generator=g) * 3).bfloat16(),
            ang.cos(), ang.sin(), (torch.rand(512, generator=g) + 0.5).bfloat16(), 1e-6,
            (torch.randn(H * (dn + dv), 512, generator=g) / dn ** 0.5).bfloat16(),
            torch.randn(2, pages, page_size, D, generator=g).bfloat16(), 1, slots, bt, cl, 0.07, True]
    cuda = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    if bad_slot:
        cuda[9] = cuda[9].clone()
        cuda[9][0] = pages * page_size
    got = mla_decode(*cuda, prefix_ready=True).cpu()
    want = mla_decode_reference(*args)
    err = float((got.float() - want.float()).norm() / want.float().norm())
    keep = torch.ones(pages * page_size, dtype=torch.bool)
    if bad_slot:
        keep[slots[0]] = False
    cache, ref = cuda[7][1].view(-1, D)[keep].cpu().float(), args[7][1].view(-1, D)[keep].float()
    cache_err = float((cache - ref).norm() / ref.norm())
    return "OK" if err < 1e-2 and cache_err < 1e-2 else f"MISMATCH {err} {cache_err}"


with value_checks(False):
    print(decode([767], 16, 128, 128, 16))  # 16 clusters: 2 stages
    print(decode([2000, 3], 8, 128, 128, 64))  # 16 clusters: 2 stages
    print(decode([1500], 4, 128, 128, 16))  # 4 clusters: 3 stages on an H100 / H200
    print(decode([2000, 3], 2, 128, 128, 64))  # 4 clusters: 3 stages there
    print(decode([40, 300], 4, 192, 40, 7, bad_slot=True))  # 8 clusters: 3 stages with 132 SMs
