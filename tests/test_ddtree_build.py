import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_kdtree.ops import ddtree_build, ddtree_build_reference

from .conftest import poison_cuda_allocator, requires_cuda
from .ddtree_oracles import DRAFT_KINDS, build_oracle, draft_logprobs, random_logprobs
from .ddtree_select_model import build_select_model


def _check_against_oracle(lp, ids, roots, budget):
    tree = ddtree_build_reference(lp, ids, roots, budget)
    N = budget + 1
    for r in range(lp.shape[0]):
        tok, par, dep, scores, all_scores = build_oracle(lp[r].numpy(), ids[r].numpy(), int(roots[r]), budget)
        n = len(tok)
        assert tree.tokens[r, :n].tolist() == tok
        assert tree.parents[r, :n].tolist() == par
        assert tree.depths[r, :n].tolist() == dep
        assert (tree.tokens[r, n:] == -1).all() and (tree.parents[r, n:] == -1).all() and (tree.depths[r, n:] == -1).all()
        # the node set is the top-B prefixes by score (as a multiset of scores)
        assert sorted(scores[1:], reverse=True) == all_scores[: n - 1]
        # pop scores never increase
        assert all(a >= b for a, b in zip(scores[1:], scores[2:]))
        vis = tree.visible[r]
        for i in range(N):
            expect = set()
            a = i
            if i < n:
                while a >= 0:
                    expect.add(a)
                    a = par[a]
            else:
                expect = {i}
            assert set(torch.nonzero(vis[i]).flatten().tolist()) == expect


@pytest.mark.parametrize("L,K,budget", [(1, 1, 1), (1, 4, 4), (2, 3, 12), (3, 3, 10), (4, 2, 9), (3, 4, 30), (2, 5, 40)])
def test_reference_matches_bruteforce_topB_prefixes(L, K, budget, fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed)
    lp, ids = random_logprobs(2, L, K, g)
    _check_against_oracle(lp, ids, torch.tensor([7, 9]), budget)


@pytest.mark.parametrize("L,K,budget", [(3, 3, 12), (4, 3, 20), (2, 4, 16)])
def test_reference_matches_bruteforce_with_forced_ties(L, K, budget, fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed)
    lp, ids = random_logprobs(3, L, K, g, ties=True)
    _check_against_oracle(lp, ids, torch.tensor([1, 2, 3]), budget)


def test_all_equal_logprobs_tie_break_is_parent_then_rank():
    # every score ties at depth 1 (0.0) and children add 0.0: the order is fully decided by
    # (parent index, rank)
    lp = torch.zeros(1, 2, 2)
    ids = torch.tensor([[[10, 11], [20, 21]]])
    tree = ddtree_build_reference(lp, ids, torch.tensor([5]), 6)
    assert tree.parents[0].tolist() == [-1, 0, 0, 1, 1, 2, 2]
    assert tree.tokens[0].tolist() == [5, 10, 11, 20, 21, 20, 21]


def test_budget_at_most_depth_can_branch():
    # depth-1 rank 1 (-0.1) beats depth-2 rank 0 (-0.1 + -1.0): with B = 2 <= L = 4 the tree
    # is two siblings, not a chain
    lp = torch.tensor([[[-0.05, -0.1], [-1.0, -2.0], [-1.0, -2.0], [-1.0, -2.0]]])
    ids = torch.tensor([[[1, 2], [3, 4], [5, 6], [7, 8]]])
    tree = ddtree_build_reference(lp, ids, torch.tensor([0]), 2)
    assert tree.parents[0].tolist() == [-1, 0, 0]
    assert tree.depths[0].tolist() == [0, 1, 1]


def test_exhausted_rank_space_pads():
    lp = torch.log(torch.tensor([[[0.6, 0.4]]]))
    ids = torch.tensor([[[3, 4]]])
    tree = ddtree_build_reference(lp, ids, torch.tensor([0]), 5)
    assert tree.tokens[0].tolist() == [0, 3, 4, -1, -1, -1]
    assert tree.depths[0].tolist() == [0, 1, 1, -1, -1, -1]
    assert tree.visible[0, 4].tolist() == [False, False, False, False, True, False]


@settings(max_examples=40, deadline=None)
@given(L=st.integers(1, 6), K=st.integers(1, 6), budget=st.integers(1, 48), ties=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_tree_properties(L, K, budget, ties, seed):
    g = torch.Generator().manual_seed(seed)
    lp, ids = random_logprobs(2, L, K, g, ties=ties)
    tree = ddtree_build_reference(lp, ids, torch.tensor([0, 1]), budget)
    for r in range(2):
        par = tree.parents[r].tolist()
        dep = tree.depths[r].tolist()
        tok = tree.tokens[r].tolist()
        n = sum(1 for d in dep if d >= 0)
        assert n == min(budget + 1, 1 + sum(K ** d for d in range(1, L + 1)))
        assert par[0] == -1 and dep[0] == 0
        for i in range(1, n):
            assert 0 <= par[i] < i
            assert dep[i] == dep[par[i]] + 1 <= L
        kids = {}
        for i in range(1, n):
            kids.setdefault(par[i], []).append(i)
        for p, cs in kids.items():
            toks = [tok[c] for c in cs]
            assert len(set(toks)) == len(toks), "siblings carry distinct tokens"
            d = dep[cs[0]] - 1
            ranks = [ids[r, d].tolist().index(t) for t in toks]
            assert ranks == sorted(ranks), "lower index = better rank among siblings"
        # visible = ancestor-or-self
        vis = tree.visible[r]
        for i in range(n):
            assert vis[i, i]
            if i:
                assert torch.equal(vis[i] & ~torch.nn.functional.one_hot(torch.tensor(i), budget + 1).bool(), vis[par[i]])


def test_scores_sum_in_float32_order():
    # Found by search: here float32 sums tie where float64 sums do not, so the pop order under
    # float32 accumulation (the project's rule) differs from the float64 order.
    lp = torch.tensor([[[0.0, -4.4703484e-08], [-4.9999997e-01, -5.0e-01], [0.0, -4.4703484e-08]]])
    ids = torch.arange(6).reshape(1, 3, 2)
    tree = ddtree_build_reference(lp, ids, torch.tensor([0]), 8)
    tok, par, *_ = build_oracle(lp[0].numpy(), ids[0].numpy(), 0, 8)
    assert tree.parents[0].tolist() == par and tree.tokens[0].tolist() == tok
    assert par[1:] == [0, 0, 1, 3, 1, 2, 3, 5]  # float64 accumulation would give [0, 0, 1, 3, 1, 5, 2, 3]


# ------------------------------------------------------------------ bad inputs

def _good(R=1, L=3, K=4):
    lp, ids = random_logprobs(R, L, K, torch.Generator().manual_seed(0))
    return lp, ids, torch.zeros(R, dtype=torch.int64)


@pytest.mark.parametrize("fn", [ddtree_build, ddtree_build_reference])
def test_bad_inputs_raise_clear_errors(fn):
    lp, ids, roots = _good()
    with pytest.raises(TypeError, match="logprobs must be torch.float32"):
        fn(lp.double(), ids, roots, 4)
    with pytest.raises(TypeError, match="token_ids must be torch.int64"):
        fn(lp, ids.int(), roots, 4)
    with pytest.raises(ValueError, match="logprobs must have 3 dimensions"):
        fn(lp[0], ids, roots, 4)
    with pytest.raises(ValueError, match="token_ids shape"):
        fn(lp, ids[:, :2].contiguous(), roots, 4)
    with pytest.raises(ValueError, match="root_tokens must have R"):
        fn(lp, ids, torch.zeros(2, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="budget must be in"):
        fn(lp, ids, roots, 0)
    with pytest.raises(ValueError, match="budget must be in"):
        fn(lp, ids, roots, 1025)
    with pytest.raises(TypeError, match="budget must be an int"):
        fn(lp, ids, roots, 4.0)
    with pytest.raises(ValueError, match="sorted descending"):
        fn(lp.flip(-1).contiguous(), ids, roots, 4)
    nan = lp.clone()
    nan[0, 1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        fn(nan, ids, roots, 4)
    with pytest.raises(ValueError, match="must be contiguous"):
        fn(lp.transpose(1, 2).contiguous().transpose(1, 2), ids, roots, 4)
    with pytest.raises(ValueError, match="depth L must be in"):
        big_lp, big_ids, _ = _good(L=33, K=1)
        fn(big_lp, big_ids, roots, 4)
    with pytest.raises(ValueError, match="K must be in"):
        fn(torch.zeros(1, 1, 1025), torch.zeros(1, 1, 1025, dtype=torch.int64), roots, 4)
    with pytest.raises(ValueError, match="one device"):
        fn(lp, ids, roots.to("meta"), 4)


def test_opcheck_cpu():
    lp, ids = random_logprobs(2, 4, 5, torch.Generator().manual_seed(1))
    torch.library.opcheck(torch.ops.kdtree.ddtree_build.default, (lp, ids, torch.tensor([1, 2]), 12))


# ------------------------------------------------------------------ CUDA kernel

@requires_cuda
@pytest.mark.parametrize("R,L,K,budget,ties", [
    (1, 1, 1, 1, False), (1, 15, 64, 64, False), (8, 15, 64, 64, True), (3, 4, 3, 200, False),
    (8, 15, 256, 256, False), (2, 32, 1024, 1024, False), (8, 15, 1024, 1024, True), (4, 5, 7, 1024, True),
    (1, 15, 16, 16, False), (5, 2, 1000, 600, False),
])
def test_cuda_kernel_bit_identical_to_reference(R, L, K, budget, ties, fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed)
    lp, ids = random_logprobs(R, L, K, g, ties=ties)
    roots = torch.randint(0, 1000, (R,), generator=g)
    _assert_kernel_matches_reference(lp, ids, budget, f"seed {fresh_seed}", roots)


@requires_cuda
def test_cuda_kernel_peaked_rows_overflow_the_register_list(fresh_seed):
    # very peaked depth rows make deep chains and many pool spills; flat rows make wide trees
    g = torch.Generator().manual_seed(fresh_seed)
    R, L, K = 6, 15, 1024
    scale = torch.tensor([0.01, 0.3, 1.0, 3.0, 10.0, 30.0])[:, None, None]
    lp = torch.log_softmax(torch.randn(R, L, K, generator=g) * scale, -1).sort(-1, descending=True).values
    ids = torch.argsort(torch.rand(R, L, 4096, generator=g), -1)[..., :K].contiguous()
    roots = torch.arange(R)
    for budget in (31, 32, 33, 100, 1024):
        ref = ddtree_build_reference(lp, ids, roots, budget)
        out = ddtree_build(lp.cuda(), ids.cuda(), roots.cuda(), budget)
        for name, a, b in zip(ref._fields, ref, out):
            assert torch.equal(a, b.cpu()), f"{name} differs at budget {budget} (seed {fresh_seed})"


@requires_cuda
@pytest.mark.parametrize("kind", DRAFT_KINDS)
@pytest.mark.parametrize("R,L,K,budget", [
    (3, 15, 16, 16),      # token ids cached in shared memory (L * K <= 2048)
    (3, 15, 64, 64),
    (2, 15, 256, 256),    # ids gathered from global memory
    (2, 15, 1024, 1024),  # 60 KB of lp in dynamic shared memory; list full, pool spills
    (2, 32, 1024, 1024),  # lp rows cut to 640 ranks: higher ranks read from global memory
    (3, 4, 7, 1024),      # rank space exhausted before the budget (padding)
    (2, 3, 2, 30),
])
def test_cuda_kernel_bit_identical_on_shaped_drafts(kind, R, L, K, budget, fresh_seed):
    # chains (peaked, lp = 0 children tying their parents), wide sibling runs (flat), heavy
    # ties and all-equal scores with -0.0 entries (ties, zeros): every pop path of the loop
    g = torch.Generator().manual_seed(fresh_seed)
    lp, ids = draft_logprobs(kind, R, L, K, g)
    roots = torch.randint(0, 1000, (R,), generator=g)
    ref = ddtree_build_reference(lp, ids, roots, budget)
    poison_cuda_allocator()
    out = ddtree_build(lp.cuda(), ids.cuda(), roots.cuda(), budget)
    for name, a, b in zip(ref._fields, ref, out):
        assert torch.equal(a, b.cpu()), f"{name} differs ({kind}, seed {fresh_seed})"


def _topk_drafts(R, L, K, g):
    # the benchmark's drafts: top-K of log_softmax(randn * 2) over a 4096-token vocabulary
    lp = torch.log_softmax(torch.randn(R, L, 4096, generator=g) * 2, -1).topk(K, -1)
    return lp.values.contiguous(), lp.indices.contiguous()


def _assert_kernel_matches_reference(lp, ids, budget, what, roots=None):
    roots = torch.arange(lp.shape[0]) + 3 if roots is None else roots
    ref = ddtree_build_reference(lp, ids, roots, budget)
    poison_cuda_allocator()
    out = ddtree_build(lp.cuda(), ids.cuda(), roots.cuda(), budget)
    for name, a, b in zip(ref._fields, ref, out):
        assert torch.equal(a, b.cpu()), f"{name} differs ({what})"


@requires_cuda
@pytest.mark.parametrize("L,budget", [(15, 32), (15, 64), (15, 256), (15, 1024), (32, 1024)])
def test_cuda_kernel_bit_identical_on_benchmark_drafts(L, budget, fresh_seed):
    # the select path (threshold, level-by-level set, sort) on fresh drafts, R > 1
    g = torch.Generator().manual_seed(fresh_seed)
    lp, ids = _topk_drafts(8, L, budget, g)
    _assert_kernel_matches_reference(lp, ids, budget, f"seed {fresh_seed}")


# Inputs on which the select path's model (tests/ddtree_select_model.py) ends each way; fixed
# seeds, so that each path is taken every run (the model is asserted on them first).
_SELECT_PATHS = [
    ("sorted once", "topk", 15, 64, 64, 0),
    ("sorted once", "topk", 15, 256, 256, 0),
    ("sorted once", "bench", 5, 4, 200, 0),  # L*K < B: t = -inf, the whole tree (1364 nodes)
    ("sorted once", "bench", 3, 8, 1024, 0),  # the whole tree has 584 < B nodes: padding
    ("sorted twice", "ties", 3, 10, 500, 0),  # equal scores under parents of unequal scores
    ("sorted twice", "quantized", 15, 1024, 1024, 3),
    ("gave up: order check", "ties", 5, 4, 200, 1),  # equal scores under tied parents
    ("gave up: more than CAP nodes", "peaked", 15, 256, 256, 0),
    ("gave up: more than CAP nodes", "zeros", 15, 1024, 1024, 0),
    ("gave up: lp > 0", "positive", 15, 256, 256, 0),
]


def _path_drafts(kind, R, L, K, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "topk":
        return _topk_drafts(R, L, K, g)
    if kind == "quantized":  # benchmark drafts rounded to 1/4: many exact float ties
        lp, ids = _topk_drafts(R, L, K, g)
        return ((lp * 4).round() / 4).contiguous(), ids
    return draft_logprobs(kind, R, L, K, g)


@pytest.mark.parametrize("path,kind,L,K,budget,seed", _SELECT_PATHS)
def test_select_path_inputs_take_their_path(path, kind, L, K, budget, seed):
    lp, ids = _path_drafts(kind, 2, L, K, seed)
    for r in range(2):
        trace = []
        build_select_model(lp[r].numpy(), ids[r].numpy(), 0, budget, trace)
        assert trace[-1] == path


@requires_cuda
@pytest.mark.parametrize("path,kind,L,K,budget,seed", _SELECT_PATHS)
def test_cuda_kernel_bit_identical_on_every_select_path(path, kind, L, K, budget, seed):
    # every way the select path ends (kept, re-sorted, or given up for the serial loop)
    lp, ids = _path_drafts(kind, 2, L, K, seed)
    _assert_kernel_matches_reference(lp, ids, budget, path)


@requires_cuda
def test_opcheck_cuda():
    lp, ids = random_logprobs(2, 4, 5, torch.Generator().manual_seed(1))
    torch.library.opcheck(torch.ops.kdtree.ddtree_build.default, (lp.cuda(), ids.cuda(), torch.tensor([1, 2]).cuda(), 12))


@requires_cuda
def test_cuda_structural_errors():
    lp, ids, roots = _good()
    with pytest.raises(RuntimeError, match="budget must be in"):
        torch.ops.kdtree.ddtree_build(lp.cuda(), ids.cuda(), roots.cuda(), 2000)
    with pytest.raises(RuntimeError, match="logprobs must be"):
        torch.ops.kdtree.ddtree_build(lp.double().cuda(), ids.cuda(), roots.cuda(), 4)
    with pytest.raises(ValueError, match="one device"):
        ddtree_build(lp.cuda(), ids, roots, 4)
