"""Representative calls of the draft top-K ops, for compute-sanitizer memcheck / racecheck runs:
bf16 with 16-byte loads (a cluster of 8 CTAs, k = 1024), float32 with scalar loads (unaligned
base, V = 262136) and few distinct values (the full-key radix fallback), partial + merge, and the
bf16 instance that keeps its chunk in shared memory.  The kernel picks that instance from shapes
(csrc/topk.cu, use_smem_chunk): for a launch in waves (more CTAs than SMs) where three of its CTAs
fit on an SM (an H100 or H200; never on sm_120's 100 KB SMs, which run the register instance
again), so the last calls have SMs // 8 + 1 rows of 8 CTAs, just more CTAs than SMs; the first
(two rows) runs the register instance."""
import torch

import torch_kdtree  # noqa: F401
from torch_kdtree.ops import draft_topk, draft_topk_merge, draft_topk_partial, draft_topk_reference

g = torch.Generator().manual_seed(0)
x = (torch.randn(1, 2, 163840, generator=g) * 3).bfloat16()
lp, ids = draft_topk(x.cuda(), 1024)
assert torch.equal(ids.cpu(), draft_topk_reference(x, 1024).token_ids)

y = torch.randint(-4, 3, (1 * 1 * 262136 + 1,), generator=g).float()
yc = y.cuda()[1:].view(1, 1, 262136)
lp, ids = draft_topk(yc, 1000)
assert torch.equal(ids.cpu(), draft_topk_reference(y[1:].view(1, 1, 262136), 1000).token_ids)

parts = [draft_topk_partial(x[..., i * 40960:(i + 1) * 40960].contiguous().cuda(), 256, i * 40960) for i in range(4)]
merged = draft_topk_merge(torch.stack([p.values for p in parts]), torch.stack([p.token_ids for p in parts]),
                          torch.stack([p.lse for p in parts]), 256)
assert torch.equal(merged.token_ids.cpu(), draft_topk_reference(x, 256).token_ids)

sms = torch.cuda.get_device_properties(0).multi_processor_count
rows = sms // 8 + 1  # V = 163840: clusters of 8 CTAs a row, so rows * 8 > SMs (in waves)
w = (torch.randn(1, rows, 163840, generator=g) * 2).bfloat16()
w[0, 3] = 0  # all equal: the exact fallback, in the scratch that aliases the chunk
for k in (16, 1024):
    lp, ids = draft_topk(w.cuda(), k)
    assert torch.equal(ids.cpu(), draft_topk_reference(w, k).token_ids)
print(f"in waves: {rows} rows x 8 CTAs on {sms} SMs")
torch.cuda.synchronize()
print("ok")
