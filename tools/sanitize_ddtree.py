"""One representative call of each DDTree op, for compute-sanitizer memcheck / racecheck runs."""
import torch

import torch_kdtree  # noqa: F401
from torch_kdtree.ops import ddtree_build, kv_commit, tree_accept, value_checks

g = torch.Generator().manual_seed(0)
R, L, K, B = 4, 15, 256, 256
lp = torch.log_softmax(torch.randn(R, L, 4096, generator=g) * 2, -1).topk(K, -1)
with value_checks(False):
    tree = ddtree_build(lp.values.contiguous().cuda(), lp.indices.contiguous().cuda(), torch.arange(R).cuda(), B)
    acc = tree_accept(tree.tokens, tree.parents, tree.tokens.roll(-1, 1).contiguous())
    kv = torch.randn(61, 32, 16, 576, device="cuda", dtype=torch.bfloat16)
    bt = torch.arange(32, device="cuda", dtype=torch.int32).reshape(R, 8)
    kv_commit(kv, bt, torch.full((R,), 9, device="cuda", dtype=torch.int32), acc.indices, acc.lengths)
    # ddtree_build's other paths: quantized drafts (tie re-sort), peaked drafts (the select path
    # gives up, the serial loop runs with a full list and pool), L = 32 (lp rows cut in shared
    # memory, higher ranks read from global memory)
    q = (lp.values * 4).round() / 4
    ddtree_build(q.contiguous().cuda(), lp.indices.contiguous().cuda(), torch.arange(R).cuda(), B)
    peaked = torch.log_softmax(torch.randn(2, 32, 4096, generator=g) * 30, -1).topk(1024, -1)
    ddtree_build(peaked.values.contiguous().cuda(), peaked.indices.contiguous().cuda(), torch.arange(2).cuda(), 1024)
torch.cuda.synchronize()
print("ok", acc.lengths.tolist())
