import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_kdtree.ops import (ddtree_build_reference, kv_commit, kv_commit_reference, tree_accept,
                              tree_accept_reference)

from .conftest import HAS_CUDA, poison_cuda_allocator, requires_cuda
from .ddtree_oracles import accept_oracle, commit_oracle, random_logprobs


def _tree_and_targets(R, L, K, budget, g, p_follow=0.7):
    """A built tree and target tokens that follow a random root-to-node path with some probability."""
    lp, ids = random_logprobs(R, L, K, g)
    tree = ddtree_build_reference(lp, ids, torch.randint(0, 100, (R,), generator=g), budget)
    N = budget + 1
    post = torch.randint(0, 2 * K, (R, N), generator=g)
    for r in range(R):
        cur = 0
        while True:
            kids = [i for i in range(N) if int(tree.parents[r, i]) == cur and i > 0]
            if not kids or torch.rand((), generator=g) > p_follow:
                break
            c = kids[int(torch.randint(0, len(kids), (), generator=g))]
            post[r, cur] = tree.tokens[r, c]
            cur = c
    return tree, post


@settings(max_examples=30, deadline=None)
@given(L=st.integers(1, 6), K=st.integers(1, 5), budget=st.integers(1, 40), seed=st.integers(0, 2**31 - 1),
       p=st.sampled_from([0.0, 0.5, 0.9, 1.0]))
def test_accept_reference_matches_python_walk(L, K, budget, seed, p):
    g = torch.Generator().manual_seed(seed)
    tree, post = _tree_and_targets(3, L, K, budget, g, p)
    acc = tree_accept_reference(tree.tokens, tree.parents, post)
    for r in range(3):
        path, nxt = accept_oracle(tree.tokens[r].tolist(), tree.parents[r].tolist(), post[r].tolist())
        n = len(path)
        assert acc.indices[r, :n].tolist() == path and (acc.indices[r, n:] == -1).all()
        assert int(acc.lengths[r]) == n and int(acc.next_tokens[r]) == nxt


def test_accept_takes_lowest_index_child_on_duplicate_tokens():
    tokens = torch.tensor([[0, 5, 5, 7]])
    parents = torch.tensor([[-1, 0, 0, 2]], dtype=torch.int32)
    post = torch.tensor([[5, 9, 7, 3]])
    acc = tree_accept_reference(tokens, parents, post)
    assert acc.indices.tolist() == [[0, 1, -1, -1]] and acc.lengths.tolist() == [2] and acc.next_tokens.tolist() == [9]


def test_accept_bad_inputs():
    t = torch.zeros(1, 4, dtype=torch.int64)
    p = torch.tensor([[-1, 0, 1, 2]], dtype=torch.int32)
    with pytest.raises(TypeError, match="parents must be torch.int32"):
        tree_accept(t, p.long(), t)
    with pytest.raises(ValueError, match="share one"):
        tree_accept(t, p, t[:, :3].contiguous())
    with pytest.raises(ValueError, match="earlier node index"):
        tree_accept(t, torch.tensor([[-1, 0, 3, 2]], dtype=torch.int32), t)
    with pytest.raises(ValueError, match="parents\\[:, 0\\] must be -1"):
        tree_accept(t, torch.tensor([[0, 0, 1, 2]], dtype=torch.int32), t)
    with pytest.raises(ValueError, match="N must be in"):
        z = torch.zeros(1, 1026, dtype=torch.int64)
        tree_accept(z, torch.full((1, 1026), -1, dtype=torch.int32), z)


# ------------------------------------------------------------------ kv_commit

def _cache_case(R, layers, page_size, D, dtype, g, max_len=24):
    """A paged cache with shuffled pages, committed lengths and accepted paths (increasing indices)."""
    N = 12
    lens = torch.randint(0, 40, (R,), generator=g, dtype=torch.int32)
    pages_per_req = (int(lens.max()) + N + page_size - 1) // page_size + 1
    num_pages = R * pages_per_req + 3
    perm = torch.randperm(num_pages, generator=g)[: R * pages_per_req].to(torch.int32)
    block_table = perm.reshape(R, pages_per_req).contiguous()
    kv = torch.randn(layers, num_pages, page_size, D, generator=g).to(dtype)
    lengths = torch.randint(0, 6, (R,), generator=g, dtype=torch.int32)
    indices = torch.full((R, N), -1, dtype=torch.int32)
    for r in range(R):
        n = int(lengths[r])
        if n:
            rest = torch.sort(torch.randperm(N - 1, generator=g)[: n - 1] + 1).values
            indices[r, :n] = torch.cat([torch.zeros(1, dtype=torch.long), rest]).to(torch.int32)
    return kv, block_table, lens, indices, lengths


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_commit_reference_matches_sequential_copy(page_size, dtype, fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed)
    kv, bt, lens, idx, lengths = _cache_case(4, 3, page_size, 40, dtype, g)
    expect = commit_oracle(kv, bt, lens, idx, lengths)
    kv_commit_reference(kv, bt, lens, idx, lengths)
    assert torch.equal(kv, expect)


def test_commit_overlapping_path_is_right():
    # indices [0, 2, 3]: row 2 is both a source (j=1) and a destination (j=2)
    kv = torch.arange(8, dtype=torch.float32).reshape(1, 1, 8, 1).clone()
    bt = torch.zeros(1, 1, dtype=torch.int32)
    kv_commit(kv, bt, torch.tensor([1], dtype=torch.int32), torch.tensor([[0, 2, 3, -1]], dtype=torch.int32),
              torch.tensor([3], dtype=torch.int32))
    assert kv.flatten().tolist() == [0, 1, 3, 4, 4, 5, 6, 7]


def test_commit_bad_inputs():
    g = torch.Generator().manual_seed(0)
    kv, bt, lens, idx, lengths = _cache_case(2, 2, 4, 8, torch.float32, g)
    lengths = torch.tensor([3, 2], dtype=torch.int32)
    idx[:, :3] = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(TypeError, match="block_table must be torch.int32"):
        kv_commit(kv, bt.long(), lens, idx, lengths)
    with pytest.raises(ValueError, match="kv_cache must have 4 dimensions"):
        kv_commit(kv[0], bt, lens, idx, lengths)
    with pytest.raises(TypeError, match="kv_cache must be"):
        kv_commit(kv.to(torch.int32), bt, lens, idx, lengths)
    bad = idx.clone()
    bad[0, 1] = 99
    with pytest.raises(ValueError, match="node indices in"):
        kv_commit(kv, bt, lens, bad, lengths)
    bad = idx.clone()
    bad[0, :3] = torch.tensor([0, 2, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="must increase"):
        kv_commit(kv, bt, lens, bad, lengths)
    with pytest.raises(ValueError, match="too few to cover"):
        kv_commit(kv, bt[:, :1].contiguous(), torch.tensor([100, 0], dtype=torch.int32), idx, lengths)
    bad_bt = bt.clone()
    bad_bt[:] = kv.shape[1] + 5
    with pytest.raises(ValueError, match="page ids in"):
        kv_commit(kv, bad_bt, lens, idx, lengths)
    with pytest.raises(ValueError, match="lengths must be in"):
        kv_commit(kv, bt, lens, idx, torch.tensor([13, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="agree on R"):
        kv_commit(kv, bt, lens[:1].contiguous(), idx, lengths)


def test_opcheck_cpu():
    g = torch.Generator().manual_seed(3)
    tree, post = _tree_and_targets(2, 4, 3, 10, g)
    torch.library.opcheck(torch.ops.kdtree.tree_accept.default, (tree.tokens, tree.parents, post))
    kv, bt, lens, idx, lengths = _cache_case(2, 2, 4, 8, torch.float32, g)
    torch.library.opcheck(torch.ops.kdtree.kv_commit.default, (kv, bt, lens, idx, lengths))


# ------------------------------------------------------------------ the chain, compiled

def _step(lp, ids, roots, post_table, kv, bt, lens, budget: int):
    """build -> (toy target: a lookup table of next tokens) -> accept -> commit -> advance lengths."""
    tokens, parents, depths, visible = torch.ops.kdtree.ddtree_build(lp, ids, roots, budget)
    post = post_table[tokens.clamp(min=0)]
    indices, lengths, next_tokens = torch.ops.kdtree.tree_accept(tokens, parents, post)
    torch.ops.kdtree.kv_commit(kv, bt, lens, indices, lengths)
    lens.add_(lengths)
    return tokens, parents, depths, visible, indices, lengths, next_tokens


def _chain_inputs(device, g, R=3, L=5, K=8, budget=20, vocab=64):
    lp, ids = random_logprobs(R, L, K, g, vocab=vocab)
    roots = torch.randint(0, vocab, (R,), generator=g)
    post_table = torch.randint(0, vocab, (vocab,), generator=g)
    # make the toy target agree with the drafter's top choice often
    post_table[ids[0, :, 0]] = ids[0, :, 0].roll(-1)
    lens = torch.tensor([0, 3, 7], dtype=torch.int32)[:R]
    # Every tree row the commit may read sits at position lens[r] + node index (< budget + 1): the
    # block table covers them all (5 pages did not, and a fresh seed accepting a late node of the
    # last request failed kv_commit's range check).
    page = 4
    pages = (int(lens.max()) + budget + 1 + page - 1) // page
    kv = torch.randn(2, R * pages + 1, page, 8, generator=g)
    bt = torch.randperm(R * pages + 1, generator=g)[: R * pages].reshape(R, pages).to(torch.int32)
    return [t.to(device) for t in (lp, ids, roots, post_table, kv, bt, lens)] + [budget]


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if HAS_CUDA else []))
def test_compiled_chain_equals_eager(device, fresh_seed):
    args = _chain_inputs(device, torch.Generator().manual_seed(fresh_seed))
    eager_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    expect = _step(*eager_args)
    compiled = torch.compile(_step, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    got = compiled(*args)
    for a, b in zip(expect, got):
        assert torch.equal(a, b)
    assert torch.equal(args[4], eager_args[4]) and torch.equal(args[6], eager_args[6])


# ------------------------------------------------------------------ CUDA kernels

@requires_cuda
@pytest.mark.parametrize("R,L,K,budget", [(1, 15, 16, 16), (8, 15, 64, 64), (4, 8, 5, 200), (2, 32, 1024, 1024)])
def test_cuda_accept_bit_identical_to_reference(R, L, K, budget, fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed)
    tree, post = _tree_and_targets(R, L, K, budget, g, p_follow=0.9)
    ref = tree_accept_reference(tree.tokens, tree.parents, post)
    poison_cuda_allocator(1 << 24)
    out = tree_accept(tree.tokens.cuda(), tree.parents.cuda(), post.cuda())
    for name, a, b in zip(ref._fields, ref, out):
        assert torch.equal(a, b.cpu()), f"{name} differs (seed {fresh_seed})"


@requires_cuda
@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
@pytest.mark.parametrize("dtype,D", [(torch.bfloat16, 576), (torch.float32, 40), (torch.bfloat16, 7), (torch.float16, 64)])
def test_cuda_commit_bit_identical_to_reference(page_size, dtype, D, fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed)
    kv, bt, lens, idx, lengths = _cache_case(5, 4, page_size, D, dtype, g)
    ref = kv.clone()
    kv_commit_reference(ref, bt, lens, idx, lengths)
    kv_gpu = kv.cuda()
    kv_commit(kv_gpu, bt.cuda(), lens.cuda(), idx.cuda(), lengths.cuda())
    assert torch.equal(kv_gpu.cpu(), ref)


@requires_cuda
def test_opcheck_cuda():
    g = torch.Generator().manual_seed(3)
    tree, post = _tree_and_targets(2, 4, 3, 10, g)
    torch.library.opcheck(torch.ops.kdtree.tree_accept.default, (tree.tokens.cuda(), tree.parents.cuda(), post.cuda()))
    kv, bt, lens, idx, lengths = _cache_case(2, 2, 4, 8, torch.float32, g)
    torch.library.opcheck(torch.ops.kdtree.kv_commit.default,
                          tuple(t.cuda() for t in (kv, bt, lens, idx, lengths)))


@requires_cuda
def test_cuda_graph_chain_replays_with_new_inputs(fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed)
    static = _chain_inputs("cuda", g)
    budget = static[-1]
    static_t = static[:-1]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm up (kernel attributes, allocator) outside the capture
            _step(*[t.clone() for t in static_t], budget)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _step(*static_t, budget)
    for trial in range(3):
        fresh = _chain_inputs("cpu", torch.Generator().manual_seed(fresh_seed + 1 + trial))
        expect = _step(*[t.clone() for t in fresh[:-1]], budget)
        for dst, src in zip(static_t, fresh[:-1]):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(expect, outs):
            assert torch.equal(a, b.cpu())
        # the step mutated the static cache and lengths the same way the CPU step did
        ref_kv, ref_lens = fresh[4].clone(), fresh[6].clone()
        _step(*(fresh[:4] + [ref_kv, fresh[5], ref_lens]), budget)
        assert torch.equal(static_t[4].cpu(), ref_kv) and torch.equal(static_t[6].cpu(), ref_lens)
