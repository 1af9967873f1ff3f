"""kdtree::moe_router (RMSNorm + router GEMV (fp32 or bf16 weights) + noaux_tc choice in one op): the CPU reference
against a float64 oracle and against the model's own modules, bad inputs, opcheck and
torch.compile; on CUDA the kernel against the reference on fresh random inputs every run (several
chunks of tokens, group-limited routing, K2's sizes), determinism and a CUDA graph replayed with
new inputs."""
import math

import pytest
import torch

from .conftest import requires_cuda_kernel
from .test_moe_route import oracle as route_oracle
from torch_kdtree.ops import moe_route_reference, moe_router, moe_router_reference

requires_kernel = requires_cuda_kernel("kdtree::moe_router")

CASES = [  # T, H, E, top_k, n_group, topk_group, renormalize, scaling
    (1, 256, 64, 8, 1, 1, True, 2.827),
    (3, 512, 384, 8, 1, 1, True, 2.827),
    (6, 384, 256, 8, 8, 4, True, 2.5),    # two chunks of tokens on CUDA, group-limited routing
    (2, 128, 16, 3, 4, 2, False, 1.0),
]


def make_inputs(gen, T, H, E, device="cpu", w_dtype=torch.float32):
    x = (torch.randn((T, H), generator=gen, device=device) * 3).to(torch.bfloat16)
    norm = (torch.rand((H,), generator=gen, device=device) + 0.5).to(torch.bfloat16)
    w = (torch.randn((E, H), generator=gen, device=device) / math.sqrt(H)).to(w_dtype)
    bias = torch.randn((E,), generator=gen, device=device) * 0.1
    return x, norm, w, bias


def norm_oracle(x, norm, eps, slack=2.0 ** -16):
    """float64 statistics, then the two bf16 roundings of the model's RMSNorm, for x · rsqrt(...)
    moved by ±slack (relative) before its rounding: (low, high).  Statistics in fp32 instead of
    float64 (error far below 2^-16) can only flip that first rounding where x · rsqrt(...) sits within
    slack of a bf16 rounding midpoint; elsewhere low == high, the one correct result.  (A flip can
    move the output by two ulps where the product crosses a power of two: seed 14367967 gave
    bf16(0.949 · 1.0547) = 1.0 against bf16(0.949 · 1.0469) = 0.9922.)"""
    xd = x.double()
    y = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    return tuple((norm.double() * (y * f).to(torch.bfloat16).double()).to(torch.bfloat16)
                 for f in (1 - slack, 1 + slack))


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16], ids=["fp32_router", "bf16_router"])
@pytest.mark.parametrize("T,H,E,k,n_group,topk_group,renorm,scaling", CASES)
def test_reference_matches_float64_oracle(fresh_seed, T, H, E, k, n_group, topk_group, renorm, scaling, w_dtype):
    gen = torch.Generator().manual_seed(fresh_seed)
    x, norm, w, bias = make_inputs(gen, T, H, E, w_dtype=w_dtype)
    x_norm, logits, ids, weights = moe_router_reference(x, norm, 1e-6, w, bias, k, n_group, topk_group, renorm,
                                                        scaling)
    low, high = norm_oracle(x, norm, 1e-6)
    # exactly the oracle's value, or near a rounding midpoint of x · rsqrt(...) its neighbour's
    assert ((x_norm == low) | (x_norm == high)).all()
    want_logits = x_norm.double() @ w.double().T
    torch.testing.assert_close(logits.double(), want_logits, rtol=1e-5, atol=1e-5)
    want_ids, want_w = route_oracle(logits, bias, k, n_group, topk_group, renorm, scaling)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights.double(), want_w, rtol=1e-6, atol=1e-7)


def test_reference_matches_the_models_modules(fresh_seed):
    """The model's post-attention RMSNorm and KimiK2Router on the same input."""
    from torch_kdtree.models.kimi_k2 import KimiK2Config
    from torch_kdtree.models.kimi_k2.modeling import KimiK2RMSNorm
    from torch_kdtree.models.kimi_k2.moe import KimiK2Router

    gen = torch.Generator().manual_seed(fresh_seed)
    cfg = KimiK2Config(hidden_size=64, n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2,
                       norm_topk_prob=True, routed_scaling_factor=2.5)
    norm, router = KimiK2RMSNorm(64, 1e-6).to(torch.bfloat16), KimiK2Router(cfg)
    x, nw, w, bias = make_inputs(gen, 3, 64, 32)
    with torch.no_grad():
        norm.weight.copy_(nw)
        router.weight.copy_(w)
        router.e_score_correction_bias.copy_(bias)
        want_x = norm(x)
        want_ids, want_w = router.route(torch.nn.functional.linear(want_x.float(), router.weight))
    x_norm, _, ids, weights = moe_router(x, norm.weight, norm.eps, router.weight, router.e_score_correction_bias, 4,
                                         4, 2, True, 2.5)
    assert torch.equal(x_norm, want_x)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w)


def test_bad_inputs_raise():
    x, norm, w, bias = make_inputs(torch.Generator().manual_seed(0), 2, 64, 16)
    with pytest.raises(TypeError, match="x must be torch.bfloat16"):
        moe_router(x.float(), norm, 1e-6, w, bias, 4)
    with pytest.raises(TypeError, match="router_weight must be"):
        moe_router(x, norm, 1e-6, w.half(), bias, 4)
    with pytest.raises(ValueError, match=r"norm_weight must be \[H = 64\]"):
        moe_router(x, norm[:32], 1e-6, w, bias, 4)
    with pytest.raises(ValueError, match=r"norm_weight must be \[H = 64\] and router_weight \[E, H\]"):
        moe_router(x, norm, 1e-6, w[:, :32].contiguous(), bias, 4)
    with pytest.raises(ValueError, match="multiple of 8"):
        moe_router(x[:, :60].contiguous(), norm[:60], 1e-6, w[:, :60].contiguous(), bias, 4)
    with pytest.raises(ValueError, match=r"bias must be \[E = 16\]"):
        moe_router(x, norm, 1e-6, w, bias[:8], 4)
    with pytest.raises(ValueError, match="top_k must be in"):
        moe_router(x, norm, 1e-6, w, bias, 17)
    with pytest.raises(ValueError, match="n_group must divide E"):
        moe_router(x, norm, 1e-6, w, bias, 4, n_group=3)


def test_opcheck_cpu():
    x, norm, w, bias = make_inputs(torch.Generator().manual_seed(3), 5, 64, 32)
    torch.library.opcheck(torch.ops.kdtree.moe_router.default, (x, norm, 1e-6, w, bias, 4, 4, 2, True, 2.0))
    torch.library.opcheck(torch.ops.kdtree.moe_router.default, (x, norm, 1e-5, w, bias, 8))


def test_compiles_with_fullgraph_on_cpu(fresh_seed):
    x, norm, w, bias = make_inputs(torch.Generator().manual_seed(fresh_seed), 3, 128, 64)
    torch._dynamo.reset()

    def step(x):
        x_norm, logits, ids, weights = moe_router(x * 1, norm, 1e-6, w, bias, 8, 1, 1, True, 2.5)
        return x_norm, ids, weights * 2

    x_norm, ids, weights = torch.compile(step, fullgraph=True)(x)
    want = moe_router_reference(x, norm, 1e-6, w, bias, 8, 1, 1, True, 2.5)
    assert torch.equal(x_norm, want[0]) and torch.equal(ids, want[2]) and torch.equal(weights, want[3] * 2)


# --------------------------------------------------------------------------------------------
# CUDA: the kernel against the reference (fresh random inputs every run)
# --------------------------------------------------------------------------------------------

def check_cuda(x, norm, w, bias, k, n_group=1, topk_group=1, renorm=True, scaling=1.0):
    got = moe_router(x, norm, 1e-6, w, bias, k, n_group, topk_group, renorm, scaling)
    x_norm = moe_router_reference(x, norm, 1e-6, w, bias, k, n_group, topk_group, renorm, scaling)[0].cpu()
    # rsqrtf and the fp32 sum-of-squares order can flip only the first rounding, and only where
    # x · rsqrt(...) sits near a bf16 midpoint: exactly one of the float64 oracle's two candidates,
    # and the reference's value wherever the two agree
    low, high = norm_oracle(x.cpu(), norm.cpu(), 1e-6)
    got_norm = got[0].cpu()
    assert ((got_norm == low) | (got_norm == high)).all()
    assert torch.equal(got_norm[low == high], x_norm[low == high])
    torch.testing.assert_close(got[1], got[0].float() @ w.float().T, rtol=2e-5, atol=2e-5)
    # the choice itself is exact given the kernel's logits
    want_ids, want_w = moe_route_reference(got[1], bias, k, n_group, topk_group, renorm, scaling)
    assert torch.equal(got[2], want_ids)
    torch.testing.assert_close(got[3], want_w, rtol=1e-6, atol=1e-7)
    return got


@requires_kernel
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16], ids=["fp32_router", "bf16_router"])
@pytest.mark.parametrize("T,H,E,k,n_group,topk_group,renorm,scaling",
                         CASES + [(1, 7168, 384, 8, 1, 1, True, 2.827),   # Kimi K2
                                  (4, 2048, 64, 8, 1, 1, True, 2.827),    # the 2p2b test model
                                  (9, 7168, 256, 8, 8, 4, True, 2.5),     # DeepSeek-V3, three chunks
                                  (2, 4096, 1024, 32, 64, 8, True, 1.0)])
def test_cuda_kernel_matches_reference(fresh_seed, T, H, E, k, n_group, topk_group, renorm, scaling, w_dtype):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    x, norm, w, bias = make_inputs(gen, T, H, E, "cuda", w_dtype)
    check_cuda(x, norm, w, bias, k, n_group, topk_group, renorm, scaling)


@requires_kernel
def test_cuda_deterministic_and_opcheck(fresh_seed):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    x, norm, w, bias = make_inputs(gen, 5, 1024, 128, "cuda")
    a = moe_router(x, norm, 1e-6, w, bias, 8)
    b = moe_router(x, norm, 1e-6, w, bias, 8)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    torch.library.opcheck(torch.ops.kdtree.moe_router.default, (x, norm, 1e-6, w, bias, 8, 4, 2, True, 2.0))


@requires_kernel
def test_cuda_compiles_with_fullgraph(fresh_seed):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    x, norm, w, bias = make_inputs(gen, 2, 2048, 64, "cuda")
    torch._dynamo.reset()

    def step(x):
        return moe_router(x + 0, norm, 1e-6, w, bias, 8, 1, 1, True, 2.5)

    got = torch.compile(step, fullgraph=True)(x)
    want = moe_router(x, norm, 1e-6, w, bias, 8, 1, 1, True, 2.5)
    assert all(torch.equal(u, v) for u, v in zip(got, want))


@requires_kernel
def test_cuda_graph_replays_with_new_inputs(fresh_seed):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    x, norm, w, bias = make_inputs(gen, 3, 2048, 64, "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe_router(x, norm, 1e-6, w, bias, 8)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_router(x, norm, 1e-6, w, bias, 8)
    for _ in range(3):  # several replays: the per-chunk tickets must come back to zero each time
        x.copy_(make_inputs(gen, 3, 2048, 64, "cuda")[0])
        graph.replay()
        torch.cuda.synchronize()
        want = moe_router(x, norm, 1e-6, w, bias, 8)
        assert all(torch.equal(u, v) for u, v in zip(out, want))

