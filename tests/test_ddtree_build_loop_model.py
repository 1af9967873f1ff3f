import pytest
import torch

from torch_kdtree.ops.ddtree import _build_one

from .ddtree_loop_model import build_loop_model
from .ddtree_oracles import DRAFT_KINDS, draft_logprobs


@pytest.mark.parametrize("kind", DRAFT_KINDS)
@pytest.mark.parametrize("L,K,budget", [(1, 1, 1), (3, 2, 30), (15, 64, 64), (15, 40, 300), (4, 200, 200), (2, 6, 60)])
def test_kernel_loop_model_matches_reference(kind, L, K, budget, fresh_seed):
    # The list/pool mechanics of the CUDA loop, modelled lane by lane, pop exactly the
    # reference's nodes: chains (peaked), long pool spills (flat, budget >> 32), ties.
    g = torch.Generator().manual_seed(fresh_seed)
    lp, ids = draft_logprobs(kind, 2, L, K, g)
    for r in range(2):
        lpl, idl = lp[r].tolist(), ids[r].tolist()
        want = _build_one(lpl, idl, 5, budget, L, K)
        got = build_loop_model(lpl, idl, 5, budget, L, K)
        assert got == tuple(want), f"{kind} L={L} K={K} B={budget} seed={fresh_seed}"
