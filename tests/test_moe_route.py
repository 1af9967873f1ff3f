"""kdtree::moe_route (noaux_tc expert selection): the CPU reference against an independent
pure-Python oracle and against the model's router, ties, groups, NaN, bad inputs, opcheck and
torch.compile; on CUDA the kernel against the reference on fresh random logits every run and a
CUDA graph replayed with new logits."""
import math

import pytest
import torch

from .conftest import requires_cuda_kernel
from torch_kdtree.ops import moe_route, moe_route_reference

requires_kernel = requires_cuda_kernel("kdtree::moe_route")


def oracle(logits, bias, top_k, n_group=1, topk_group=1, renormalize=True, scaling=1.0):
    """Python floats, one token at a time: sorted() with (-value, index) keys."""
    T, E = logits.shape
    ids, weights = [], []
    for t in range(T):
        scores = [1 / (1 + math.exp(-float(v))) for v in logits[t]]
        choice = [s + float(b) for s, b in zip(scores, bias)]
        choice = [-math.inf if math.isnan(c) else c for c in choice]
        if n_group > 1:
            g = E // n_group
            gscore = [sum(sorted(choice[i * g:(i + 1) * g], reverse=True)[:2]) for i in range(n_group)]
            kept = sorted(range(n_group), key=lambda i: (-gscore[i], i))[:topk_group]
            choice = [c if e // g in kept else -math.inf for e, c in enumerate(choice)]
        chosen = sorted(range(E), key=lambda e: (-choice[e], e))[:top_k]
        w = [scores[e] for e in chosen]
        if renormalize:
            total = sum(w)
            w = [v / (total + 1e-20) for v in w]
        ids.append(chosen)
        weights.append([v * scaling for v in w])
    return torch.tensor(ids, dtype=torch.int32), torch.tensor(weights, dtype=torch.float64)


CASES = [  # T, E, top_k, n_group, topk_group, renormalize, scaling
    (1, 64, 8, 1, 1, True, 2.827),
    (5, 384, 8, 1, 1, True, 2.827),
    (3, 256, 8, 8, 4, True, 2.5),      # DeepSeek-V3's group-limited routing
    (4, 16, 3, 4, 2, False, 1.0),
    (2, 7, 7, 1, 1, True, 1.0),        # every expert chosen
]


def make_logits(gen, T, E, device="cpu"):
    return torch.randn((T, E), generator=gen, device=device) * 2, torch.randn((E,), generator=gen, device=device) * 0.1


@pytest.mark.parametrize("T,E,k,n_group,topk_group,renorm,scaling", CASES)
def test_reference_matches_python_oracle(fresh_seed, T, E, k, n_group, topk_group, renorm, scaling):
    gen = torch.Generator().manual_seed(fresh_seed)
    logits, bias = make_logits(gen, T, E)
    ids, w = moe_route_reference(logits, bias, k, n_group, topk_group, renorm, scaling)
    want_ids, want_w = oracle(logits, bias, k, n_group, topk_group, renorm, scaling)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w.double(), want_w, rtol=1e-6, atol=1e-7)


def test_ties_go_to_the_lower_expert_id_and_nan_ranks_last():
    logits = torch.tensor([[0.0, 1.0, 0.0, 1.0, float("nan"), 0.0, 1.0, -3.0]])
    bias = torch.zeros(8)
    ids, _ = moe_route_reference(logits, bias, 6)
    assert ids.tolist() == [[1, 3, 6, 0, 2, 5]]
    want_ids, _ = oracle(logits, bias, 6)
    assert torch.equal(ids, want_ids)
    ids, _ = moe_route_reference(logits, bias, 8)
    assert ids[0, -1] == 4  # NaN after -3.0


def test_bias_selects_but_does_not_weigh():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0]])
    bias = torch.tensor([0.0, 5.0, 0.0, 0.0])
    ids, w = moe_route_reference(logits, bias, 2, renormalize=False)
    assert ids.tolist() == [[1, 0]]
    torch.testing.assert_close(w, torch.sigmoid(torch.tensor([[0.0, 2.0]])))


def test_reference_matches_the_models_router(fresh_seed):
    """KimiK2Router's eager torch code (topk) on the same logits: same ids, same weights."""
    from torch_kdtree.models.kimi_k2 import KimiK2Config
    from torch_kdtree.models.kimi_k2.moe import KimiK2Router

    gen = torch.Generator().manual_seed(fresh_seed)
    for n_group, topk_group in ((1, 1), (4, 2)):
        cfg = KimiK2Config(hidden_size=32, n_routed_experts=64, num_experts_per_tok=6, n_group=n_group,
                           topk_group=topk_group, norm_topk_prob=True, routed_scaling_factor=2.5)
        router = KimiK2Router(cfg)
        with torch.no_grad():
            router.weight.copy_(torch.randn(64, 32, generator=gen))
            router.e_score_correction_bias.copy_(torch.randn(64, generator=gen) * 0.1)
            x = torch.randn(5, 32, generator=gen)
            want_ids, want_w = router.route(torch.nn.functional.linear(x, router.weight))
        ids, w = moe_route_reference(x @ router.weight.T, router.e_score_correction_bias, 6, n_group, topk_group,
                                     True, 2.5)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(w, want_w)


# --------------------------------------------------------------------------------------------
# bad inputs
# --------------------------------------------------------------------------------------------

def test_bad_inputs_raise():
    logits, bias = torch.zeros(2, 16), torch.zeros(16)
    with pytest.raises(TypeError, match="logits must be torch.float32"):
        moe_route(logits.bfloat16(), bias, 4)
    with pytest.raises(TypeError, match="bias must be torch.float32"):
        moe_route(logits, bias.double(), 4)
    with pytest.raises(ValueError, match=r"bias must be \[E = 16\]"):
        moe_route(logits, torch.zeros(8), 4)
    with pytest.raises(ValueError, match="top_k must be in"):
        moe_route(logits, bias, 17)
    with pytest.raises(ValueError, match="top_k must be in"):
        moe_route(logits, bias, 0)
    with pytest.raises(ValueError, match="n_group must divide E"):
        moe_route(logits, bias, 4, n_group=3)
    with pytest.raises(ValueError, match="keeping >= top_k"):
        moe_route(logits, bias, 8, n_group=4, topk_group=1)
    with pytest.raises(ValueError, match="E must be in"):
        moe_route(torch.zeros(1, 1025), torch.zeros(1025), 4)
    with pytest.raises(ValueError, match="must have 2 dimensions"):
        moe_route(torch.zeros(16), bias, 4)


# --------------------------------------------------------------------------------------------
# opcheck and torch.compile (CPU)
# --------------------------------------------------------------------------------------------

def test_opcheck_cpu():
    gen = torch.Generator().manual_seed(3)
    logits, bias = make_logits(gen, 3, 32)
    torch.library.opcheck(torch.ops.kdtree.moe_route.default, (logits, bias, 4, 4, 2, True, 2.0))
    torch.library.opcheck(torch.ops.kdtree.moe_route.default, (logits, bias, 8))


def test_compiles_with_fullgraph_on_cpu(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    logits, bias = make_logits(gen, 3, 64)
    torch._dynamo.reset()

    def step(logits):
        ids, w = moe_route(logits * 1.0, bias, 8, 1, 1, True, 2.5)
        return ids, w * 2

    ids, w = torch.compile(step, fullgraph=True)(logits)
    want_ids, want_w = moe_route_reference(logits, bias, 8, 1, 1, True, 2.5)
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w * 2)


# --------------------------------------------------------------------------------------------
# CUDA: the kernel against the reference (fresh random logits every run)
# --------------------------------------------------------------------------------------------

@requires_kernel
@pytest.mark.parametrize("T,E,k,n_group,topk_group,renorm,scaling", CASES + [(17, 1024, 32, 64, 8, True, 1.5)])
def test_cuda_kernel_matches_reference(fresh_seed, T, E, k, n_group, topk_group, renorm, scaling):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    logits, bias = make_logits(gen, T, E, "cuda")
    ids, w = moe_route(logits, bias, k, n_group, topk_group, renorm, scaling)
    want_ids, want_w = moe_route_reference(logits.cpu(), bias.cpu(), k, n_group, topk_group, renorm, scaling)
    # sigmoid on the GPU may differ from the CPU's in the last bit: equal ids unless two choices are
    # within a few ulps (fresh random logits: practically never), weights to fp32 rounding
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(w.cpu(), want_w, rtol=2e-6, atol=1e-7)


@requires_kernel
@pytest.mark.parametrize("E,k,n_group,topk_group", [(384, 8, 1, 1), (64, 8, 1, 1), (256, 8, 8, 4), (1024, 32, 1, 1),
                                                    (96, 4, 1, 1)])
def test_cuda_kernel_with_ties_and_clustered_winners(fresh_seed, E, k, n_group, topk_group):
    """The kernel ranks only the experts at or above the k-th largest of its warps' maxima: integer
    logits (many exact ties, broken by expert id), winners packed into one warp's experts (a loose
    bound: many candidates), winners spread one per warp, and rows where every logit is equal."""
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    T = 8
    logits = torch.randint(-2, 3, (T, E), generator=gen, device="cuda").float()
    start = 32 if E >= 64 + k else 0
    logits[:3, start:start + k + 3] = 5.0 + torch.randint(0, 2, (3, k + 3), generator=gen, device="cuda").float()
    logits[3, ::32] = 6.0
    logits[4] = 1.0
    bias = torch.zeros(E, device="cuda")
    ids, w = moe_route(logits, bias, k, n_group, topk_group)
    want_ids, want_w = moe_route_reference(logits.cpu(), bias.cpu(), k, n_group, topk_group)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(w.cpu(), want_w, rtol=2e-6, atol=1e-7)
    assert ids[4].tolist() == list(range(k))  # all equal: the lowest ids


@requires_kernel
def test_cuda_ties_and_nan():
    logits = torch.tensor([[0.0, 1.0, 0.0, 1.0, float("nan"), 0.0, 1.0, -3.0]], device="cuda")
    ids, _ = moe_route(logits, torch.zeros(8, device="cuda"), 8)
    assert ids.tolist() == [[1, 3, 6, 0, 2, 5, 7, 4]]


@requires_kernel
def test_opcheck_cuda(fresh_seed):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    logits, bias = make_logits(gen, 3, 64, "cuda")
    torch.library.opcheck(torch.ops.kdtree.moe_route.default, (logits, bias, 8, 8, 4, True, 2.0))


@requires_kernel
def test_cuda_compiles_with_fullgraph(fresh_seed):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    logits, bias = make_logits(gen, 2, 384, "cuda")
    torch._dynamo.reset()

    def step(logits):
        return moe_route(logits.sigmoid().logit(), bias, 8, 1, 1, True, 2.827)

    ids, w = torch.compile(step, fullgraph=True)(logits)
    want_ids, want_w = moe_route_reference(logits.cpu().sigmoid().logit(), bias.cpu(), 8, 1, 1, True, 2.827)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(w.cpu(), want_w, rtol=1e-5, atol=1e-6)


@requires_kernel
def test_cuda_graph_replays_with_new_logits(fresh_seed):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    logits, bias = make_logits(gen, 4, 64, "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe_route(logits, bias, 8)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, w = moe_route(logits, bias, 8)
    for _ in range(3):
        logits.copy_(torch.randn(logits.shape, generator=gen, device="cuda") * 2)
        graph.replay()
        torch.cuda.synchronize()
        want_ids, want_w = moe_route_reference(logits.cpu(), bias.cpu(), 8)
        assert torch.equal(ids.cpu(), want_ids)
        torch.testing.assert_close(w.cpu(), want_w, rtol=2e-6, atol=1e-7)
