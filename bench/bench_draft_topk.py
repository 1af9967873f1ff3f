"""Draft top-K timings (issue 7): kdtree::draft_topk vs the torch path (float + log_softmax + topk).

Run: pytest bench/bench_draft_topk.py --benchmark-only -s
Shapes: R in {1, 8}, L = 15, V = 163840 (the K2 vocabulary), k in {16, 64, 256, 1024}, bf16
logits.  gpu_us / torch_us are per call inside a CUDA graph of 20 calls (bench/conftest.py), both
measured in the same run; target 25 us (issue 7, R = 1); speedup = torch_us / gpu_us.  gbs is the
logits read rate; ceiling_ratio = gbs / the HBM ceiling (bench/conftest.py: max of a read-only
stream and a device copy, both measured in the same run).
pytest-benchmark itself times one eager call plus a synchronisation (Python and launch overhead
included), reported as eager_us.
"""
import pytest
import torch

from torch_kdtree.ops import draft_topk_partial

from .conftest import cuda_time_us, hbm_ceiling, record, requires_cuda

L, V = 15, 163840
TARGET_US = 25.0


def torch_path(logits: torch.Tensor, k: int):
    return torch.topk(torch.log_softmax(logits.float(), dim=-1), k, dim=-1)


def drafter_like_logits(R: int) -> torch.Tensor:
    """Most of the vocabulary in a narrow band, a few tokens well above it (bf16)."""
    g = torch.Generator(device="cuda").manual_seed(R)
    x = torch.randn(R, L, V, device="cuda", generator=g) * 2
    x[..., torch.randint(V, (64,), device="cuda", generator=g)] += 12
    return x.bfloat16()


def eager_us(benchmark, fn) -> float:
    def call():
        fn()
        torch.cuda.synchronize()

    benchmark.pedantic(call, rounds=50, iterations=1, warmup_rounds=5)
    return benchmark.stats.stats.median * 1e6


@requires_cuda
@pytest.mark.parametrize("R", [1, 8])
@pytest.mark.parametrize("k", [16, 64, 256, 1024])
def test_draft_topk(benchmark, k, R):
    logits = drafter_like_logits(R)
    op = torch.ops.kdtree.draft_topk
    us = cuda_time_us(lambda: op(logits, k))
    torch_us = cuda_time_us(lambda: torch_path(logits, k))
    eager = eager_us(benchmark, lambda: op(logits, k))
    nbytes = logits.numel() * logits.element_size()
    gbs = nbytes / (us * 1e-6) / 1e9
    ceiling = hbm_ceiling()
    record(benchmark, op="draft_topk", R=R, L=L, V=V, k=k, gpu_us=us, target_us=TARGET_US, target_ratio=us / TARGET_US,
           torch_us=torch_us, speedup_vs_torch=torch_us / us, eager_us=eager, gbs=gbs,
           ceiling_ratio=gbs / ceiling.gbs, **ceiling.fields())


@requires_cuda
@pytest.mark.parametrize("R", [1, 8])
@pytest.mark.parametrize("k", [64, 1024])
def test_draft_topk_tp8_rank(benchmark, k, R):
    """One TP-8 rank's share: draft_topk_partial over V/8 plus draft_topk_merge of 8 gathered
    parts (the all-gather between them is not timed), against the unsplit torch path."""
    P = 8
    shard = drafter_like_logits(R)[..., : V // P].contiguous()
    part = draft_topk_partial(shard, k, 0)
    vals = part.values.expand(P, -1, -1, -1).contiguous()
    ids = (part.token_ids[None] + torch.arange(P, device="cuda")[:, None, None, None] * (V // P)).contiguous()
    lse = part.lse.expand(P, -1, -1).contiguous()

    def step():
        torch.ops.kdtree.draft_topk_partial(shard, k, 0)
        return torch.ops.kdtree.draft_topk_merge(vals, ids, lse, k)

    us = cuda_time_us(step)
    merge_us = cuda_time_us(lambda: torch.ops.kdtree.draft_topk_merge(vals, ids, lse, k))
    full = torch.cat([shard] * P, dim=-1)
    torch_us = cuda_time_us(lambda: torch_path(full, k))
    eager = eager_us(benchmark, step)
    record(benchmark, op="draft_topk_tp8_rank", R=R, L=L, V=V, k=k, gpu_us=us, merge_us=merge_us,
           target_us=TARGET_US, target_ratio=us / TARGET_US, torch_us=torch_us, speedup_vs_torch=torch_us / us,
           eager_us=eager)
