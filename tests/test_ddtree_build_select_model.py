import pytest
import torch

from torch_kdtree.ops.ddtree import _build_one

from .ddtree_oracles import DRAFT_KINDS, draft_logprobs
from .ddtree_select_model import build_select_model


@pytest.mark.parametrize("kind", DRAFT_KINDS)
@pytest.mark.parametrize("L,K,budget", [(1, 5, 3), (3, 2, 14), (2, 6, 60), (15, 16, 128), (15, 64, 256), (4, 200, 300),
                                        (32, 8, 1024)])
def test_kernel_select_model_is_exact_or_gives_up(kind, L, K, budget, fresh_seed):
    # The CUDA kernel's select path (threshold, level-by-level set, sort, tie checks), modelled
    # step by step: whenever it does not give up, it pops exactly the reference's nodes.
    g = torch.Generator().manual_seed(fresh_seed)
    lp, ids = draft_logprobs(kind, 2, L, K, g)
    for r in range(2):
        got = build_select_model(lp[r].numpy(), ids[r].numpy(), 5, budget)
        if got is not None:
            want = _build_one(lp[r].tolist(), ids[r].tolist(), 5, budget, L, K)
            assert got == tuple(want), f"{kind} L={L} K={K} B={budget} seed={fresh_seed}"


@pytest.mark.parametrize("B", [128, 256, 1024])
def test_kernel_select_model_takes_the_benchmark_drafts(B):
    # the benchmark's drafts (L = 15, K = B) go down the select path and match the reference
    lp = torch.log_softmax(torch.randn(15, 4096, generator=torch.Generator().manual_seed(B)) * 2, -1).topk(B, -1)
    got = build_select_model(lp.values.numpy(), lp.indices.numpy(), 0, B)
    assert got is not None
    assert got == tuple(_build_one(lp.values.tolist(), lp.indices.tolist(), 0, B, 15, B))
