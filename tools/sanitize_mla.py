"""Representative mla_tree_attention calls for compute-sanitizer memcheck / racecheck: both tiles
(16-row and 64-row), split + combine and single-split paths, tree masks, odd page size, padding rows;
each with and without prefix_ready (the 16-row tile's committed key tiles copied before the wait);
and the same over an fp8 cache (640-byte rows of an e4m3 latent and a bf16 rope, + fp32 scales: the
ring's latent, rope and scale copies, the shared-memory conversion of the latent and Q·Kᵀ's rope
steps read from the ring, through both tiles as bf16 takes them), page sizes 1 and 64 included."""
import torch

import torch_kdtree  # noqa: F401
from torch_kdtree.models.kimi_k2.cache import fp8_quantize
from torch_kdtree.ops import ddtree_build, mla_tree_attention, value_checks

g = torch.Generator(device="cuda").manual_seed(0)


def call(R, N, H, page_size, lens, prefix_ready=False, fp8=False):
    max_keys = max(lens) + N
    pages_per_req = (max_keys + page_size - 1) // page_size + 1
    kv = torch.randn(R * pages_per_req, page_size, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    kv_scale = None
    if fp8:  # the cache's quantiser: power-of-two scales, of many sizes here
        rows = kv.float() * torch.exp2(torch.randint(-8, 4, kv.shape[:2] + (1,), device="cuda", generator=g).float())
        kv, kv_scale = fp8_quantize(rows, 64)  # 640-byte rows: e4m3 latent, bf16 rope
    bt = torch.randperm(R * pages_per_req, device="cuda", generator=g).to(torch.int32).view(R, pages_per_req)
    q = torch.randn(R, N, H, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    if N > 1:
        lp = torch.randn(R, 4, min(4, N - 1), device="cuda", generator=g).sort(-1, descending=True).values
        ids = torch.randint(0, 100, lp.shape, device="cuda", generator=g)
        vis = ddtree_build(lp, ids, torch.zeros(R, dtype=torch.int64, device="cuda"), N - 1).visible
    else:
        vis = torch.ones(R, 1, 1, device="cuda", dtype=torch.bool)
    lens_t = torch.tensor(lens, device="cuda", dtype=torch.int32)
    out, lse = mla_tree_attention(q, kv, bt, lens_t, vis, 0.1447, return_lse=True, kv_scale=kv_scale)
    out2, lse2 = mla_tree_attention(q, kv, bt, lens_t, vis, 0.1447, return_lse=True, prefix_ready=True,
                                    kv_scale=kv_scale)
    same = torch.equal(out, out2) and torch.equal(lse, lse2)
    return f"{out.float().abs().sum().item()} {'same' if same else 'MISMATCH with prefix_ready'}"


with value_checks(False):
    print(call(2, 1, 8, 16, [1200, 40]))      # 16-row tile, several splits, an early-exiting split
    print(call(3, 1, 16, 16, [31, 40, 64]))   # 16-row tile: key tiles whole, cut by the length, none
    print(call(1, 5, 16, 7, [1500]))          # 64-row tile (80 rows: one partial block), page size 7
    print(call(1, 9, 64, 64, [100]))          # 576 rows, one split, tree tiles
    # fp8 cache
    print(call(2, 1, 8, 16, [1200, 40], fp8=True))     # 16-row tile, several splits, an early-exiting split
    print(call(3, 1, 16, 1, [31, 40, 64], fp8=True))   # page size 1: every row through its own table entry
    print(call(1, 5, 16, 7, [1500], fp8=True))         # 80 rows (64-row tile: one partial block), page size 7
    print(call(2, 17, 8, 64, [3000, 65], fp8=True))    # 136 rows, splits, a tree over page edges
    print(call(1, 65, 64, 64, [100], fp8=True))        # 4160 rows, one split
torch.cuda.synchronize()
print("ok")
