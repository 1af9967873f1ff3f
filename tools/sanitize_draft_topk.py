"""Representative calls of the draft top-K ops, for compute-sanitizer memcheck / racecheck runs:
bf16 with 16-byte loads (a cluster of 8 CTAs, k = 1024), float32 with scalar loads (unaligned
base, V = 262136) and few distinct values (the full-key radix fallback), partial + merge, and the
bf16 instance that keeps its chunk in shared memory (forced: it is chosen for launches in waves)."""
import os

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

w = (torch.randn(1, 4, 163840, generator=g) * 2).bfloat16()
w[0, 3] = 0  # all equal: the exact fallback, in the scratch that aliases the chunk
os.environ["KDTREE_TOPK_CHUNK"] = "shared"
for k in (16, 1024):
    lp, ids = draft_topk(w.cuda(), k)
    assert torch.equal(ids.cpu(), draft_topk_reference(w, k).token_ids)
del os.environ["KDTREE_TOPK_CHUNK"]
torch.cuda.synchronize()
print("ok")
