"""kdtree::moe_gemv (bf16 routed experts for decode-sized batches): the CPU reference against an
independent float64 oracle, bad inputs, opcheck and torch.compile; on CUDA the kernel against
the reference on fresh random weights and routings every run, determinism, CUDA graphs."""
import pytest
import torch
import torch.nn.functional as F

from .conftest import rel_err, requires_cuda_kernel
from torch_kdtree.ops import gemv, moe_gemv, moe_gemv_reference, moe_route, value_checks

requires_kernel = requires_cuda_kernel("kdtree::moe_gemv")


def make_experts(gen, E, H, I, dtype=torch.bfloat16, device="cpu"):
    """Weights scaled so activations stay O(1) through gate/up and down."""
    g = torch.randn((E, I, H), generator=gen, device=device) / H**0.5
    u = torch.randn((E, I, H), generator=gen, device=device) / H**0.5
    d = torch.randn((E, H, I), generator=gen, device=device) / I**0.5
    return g.to(dtype), u.to(dtype), d.to(dtype)


def make_routing(gen, T, k, E, device="cpu"):
    ids = torch.rand((T, E), generator=gen, device=device).argsort(dim=1)[:, :k].to(torch.int32)
    w = torch.rand((T, k), generator=gen, device=device) + 0.1
    return ids, (w / w.sum(-1, keepdim=True) * 2.5).float()


def make_shared(gen, H, Is, dtype=torch.bfloat16, device="cpu"):
    """A shared expert as nn.Linear weights: gate / up [Is, H], down [H, Is]."""
    g = torch.randn((Is, H), generator=gen, device=device) / H**0.5
    u = torch.randn((Is, H), generator=gen, device=device) / H**0.5
    d = torch.randn((H, Is), generator=gen, device=device) / Is**0.5
    return g.to(dtype), u.to(dtype), d.to(dtype)


def oracle(x, gate, up, down, ids, w, shared_gate=None, shared_up=None, shared_down=None):
    """float64, one (token, slot) at a time with explicit loops over the weight rows' products;
    the op's rounding points applied by casting through x's dtype; the shared expert last."""
    dt = x.dtype
    rnd = lambda v: v.to(dt).double()  # noqa: E731
    T, H = x.shape
    out = torch.zeros((T, H), dtype=torch.float64)
    for t in range(T):
        xt = x[t].double().cpu()
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < gate.shape[0]:
                continue
            g = rnd((gate[e].double().cpu() * xt).sum(-1))
            u = rnd((up[e].double().cpu() * xt).sum(-1))
            a = rnd(g / (1 + torch.exp(-g)) * u)
            y = (down[e].double().cpu() * a).sum(-1)
            out[t] += float(w[t, j]) * y
        if shared_gate is not None:
            g = rnd((shared_gate.double().cpu() * xt).sum(-1))
            u = rnd((shared_up.double().cpu() * xt).sum(-1))
            out[t] += (shared_down.double().cpu() * rnd(g / (1 + torch.exp(-g)) * u)).sum(-1)
    return out


# --------------------------------------------------------------------------------------------
# reference (CPU)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("T,k,E,H,I", [(1, 8, 16, 64, 32), (3, 2, 5, 40, 24), (5, 4, 8, 128, 64)])
def test_reference_matches_float64_oracle_in_float32(fresh_seed, T, k, E, H, I):
    gen = torch.Generator().manual_seed(fresh_seed)
    gate, up, down = make_experts(gen, E, H, I, torch.float32)
    x = torch.randn((T, H), generator=gen)
    ids, w = make_routing(gen, T, k, E)
    got = moe_gemv_reference(x, gate, up, down, ids, w)
    torch.testing.assert_close(got.double(), oracle(x, gate, up, down, ids, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("Is", [16, 48])
def test_reference_with_a_shared_expert_matches_float64_oracle(fresh_seed, Is):
    gen = torch.Generator().manual_seed(fresh_seed)
    gate, up, down = make_experts(gen, 8, 64, 32, torch.float32)
    shared = make_shared(gen, 64, Is, torch.float32)
    x = torch.randn((3, 64), generator=gen)
    ids, w = make_routing(gen, 3, 4, 8)
    got = moe_gemv_reference(x, gate, up, down, ids, w, *shared)
    torch.testing.assert_close(got.double(), oracle(x, gate, up, down, ids, w, *shared), rtol=1e-5, atol=1e-5)
    # the shared term is the model's shared MLP, added to the routed sum
    sg, su, sd = shared
    mlp = F.linear(F.silu(F.linear(x, sg)) * F.linear(x, su), sd)
    torch.testing.assert_close(got, moe_gemv_reference(x, gate, up, down, ids, w) + mlp, rtol=1e-5, atol=1e-5)


def test_reference_in_bfloat16_rounds_where_the_oracle_does(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    gate, up, down = make_experts(gen, 8, 128, 64)
    x = torch.randn((4, 128), generator=gen).to(torch.bfloat16)
    ids, w = make_routing(gen, 4, 3, 8)
    got = moe_gemv_reference(x, gate, up, down, ids, w)
    want = oracle(x, gate, up, down, ids, w)
    # fp32 against fp64 sums may land on either side of a bf16 rounding boundary: a few ulps
    assert rel_err(got, want) < 8e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_residual_is_added_after_the_rounding(fresh_seed, dtype):
    """residual + bf16(out) with one more rounding: the decoder layer's ``h + moe(x)``, from the
    float64 oracle (float32: to fp32 accuracy; bf16: the oracle rounded the way the layer rounds)."""
    gen = torch.Generator().manual_seed(fresh_seed)
    gate, up, down = make_experts(gen, 8, 64, 32, dtype)
    shared = make_shared(gen, 64, 16, dtype)
    x = torch.randn((3, 64), generator=gen).to(dtype)
    res = (torch.randn((3, 64), generator=gen) * 4).to(dtype)
    ids, w = make_routing(gen, 3, 4, 8)
    got = moe_gemv_reference(x, gate, up, down, ids, w, *shared, residual=res)
    assert got.dtype == dtype and got.shape == (3, 64)
    want = res.double() + oracle(x, gate, up, down, ids, w, *shared)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    else:
        assert rel_err(got, want) < 8e-3
        # exactly the layer's add of the rounded MoE output
        plain = moe_gemv_reference(x, gate, up, down, ids, w, *shared)
        assert torch.equal(got, res + plain)


def test_reference_agrees_with_the_models_expert_formula(fresh_seed):
    """The same experts as a per-token dense MLP (F.linear), float32."""
    gen = torch.Generator().manual_seed(fresh_seed)
    gate, up, down = make_experts(gen, 6, 48, 16, torch.float32)
    x = torch.randn((3, 48), generator=gen)
    ids, w = make_routing(gen, 3, 2, 6)
    want = torch.zeros_like(x)
    for t in range(3):
        for j in range(2):
            e = int(ids[t, j])
            want[t] += w[t, j] * F.linear(F.silu(F.linear(x[t], gate[e])) * F.linear(x[t], up[e]), down[e])
    torch.testing.assert_close(moe_gemv_reference(x, gate, up, down, ids, w), want, rtol=1e-5, atol=1e-5)


def test_duplicate_ids_count_twice_and_out_of_range_ids_count_nothing(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    gate, up, down = make_experts(gen, 4, 32, 16, torch.float32)
    x = torch.randn((2, 32), generator=gen)
    w = torch.tensor([[0.25, 0.75], [1.0, 0.5]])
    one = moe_gemv_reference(x, gate, up, down, torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
                             torch.tensor([[1.0, 0.0], [1.0, 0.0]]))
    dup = moe_gemv_reference(x, gate, up, down, torch.tensor([[1, 1], [3, 3]], dtype=torch.int32), w)
    torch.testing.assert_close(dup, one * w.sum(-1, keepdim=True), rtol=1e-5, atol=1e-6)
    with value_checks(False):
        bad = moe_gemv_reference(x, gate, up, down, torch.tensor([[1, 9], [-1, 3]], dtype=torch.int32), w)
    want = moe_gemv_reference(x, gate, up, down, torch.tensor([[1, 0], [0, 3]], dtype=torch.int32),
                              torch.tensor([[0.25, 0.0], [0.0, 0.5]]))
    torch.testing.assert_close(bad, want)


# --------------------------------------------------------------------------------------------
# bad inputs
# --------------------------------------------------------------------------------------------

@pytest.fixture
def small():
    gen = torch.Generator().manual_seed(0)
    gate, up, down = make_experts(gen, 4, 32, 16)
    x = torch.randn((2, 32), generator=gen).to(torch.bfloat16)
    ids, w = make_routing(gen, 2, 2, 4)
    return x, gate, up, down, ids, w


def test_bad_dtypes_raise(small):
    x, gate, up, down, ids, w = small
    with pytest.raises(TypeError, match="topk_ids must be torch.int32"):
        moe_gemv(x, gate, up, down, ids.long(), w)
    with pytest.raises(TypeError, match="topk_weights must be torch.float32"):
        moe_gemv(x, gate, up, down, ids, w.to(torch.bfloat16))
    with pytest.raises(TypeError, match="down_proj must be torch.bfloat16"):
        moe_gemv(x, gate, up, down.float(), ids, w)


def test_bad_shapes_raise(small):
    x, gate, up, down, ids, w = small
    with pytest.raises(ValueError, match=r"down_proj must be \[E, H, I\]"):
        moe_gemv(x, gate, up, down.transpose(1, 2).contiguous(), ids, w)
    with pytest.raises(ValueError, match="gate_proj and up_proj must be"):
        moe_gemv(x, gate, up[:, :8].contiguous(), down, ids, w)
    with pytest.raises(ValueError, match="must both be"):
        moe_gemv(x, gate, up, down, ids[:1].contiguous(), w[:1].contiguous())
    with pytest.raises(ValueError, match="top-k must be in"):
        moe_gemv(x, gate, up, down, torch.zeros((2, 17), dtype=torch.int32), torch.zeros((2, 17)))
    with pytest.raises(ValueError, match="multiples of 8"):
        moe_gemv(x[:, :12].contiguous(), gate[..., :12].contiguous(), up[..., :12].contiguous(),
                 down[:, :12].contiguous(), ids, w)
    with pytest.raises(ValueError, match="contiguous"):
        moe_gemv(x, gate, up, down, ids.t().contiguous().t(), w)
    with pytest.raises(ValueError, match=r"residual must be \[T, H\]"):
        moe_gemv(x, gate, up, down, ids, w, residual=x[:1].contiguous())
    with pytest.raises(TypeError, match="residual must be torch.bfloat16"):
        moe_gemv(x, gate, up, down, ids, w, residual=x.float())


def test_bad_shared_expert_raises(small):
    x, gate, up, down, ids, w = small
    sg, su, sd = make_shared(torch.Generator().manual_seed(1), 32, 16)
    with pytest.raises(ValueError, match="come together"):
        moe_gemv(x, gate, up, down, ids, w, sg, su)
    with pytest.raises(ValueError, match=r"shared_down \[H, Is\]"):
        moe_gemv(x, gate, up, down, ids, w, sg, su, sd.t().contiguous())
    with pytest.raises(ValueError, match="multiple of 8"):
        moe_gemv(x, gate, up, down, ids, w, sg[:12].contiguous(), su[:12].contiguous(), sd[:, :12].contiguous())
    with pytest.raises(TypeError, match="shared_up must be torch.bfloat16"):
        moe_gemv(x, gate, up, down, ids, w, sg, su.float(), sd)


def test_expert_ids_out_of_range_raise(small):
    x, gate, up, down, ids, w = small
    with pytest.raises(ValueError, match=r"expert ids in \[0, 4\)"):
        moe_gemv(x, gate, up, down, torch.tensor([[0, 4], [1, 2]], dtype=torch.int32), w)
    with pytest.raises(ValueError, match=r"expert ids in \[0, 4\)"):
        moe_gemv(x, gate, up, down, torch.tensor([[0, 1], [-1, 2]], dtype=torch.int32), w)


# --------------------------------------------------------------------------------------------
# opcheck and torch.compile (CPU)
# --------------------------------------------------------------------------------------------

def test_opcheck_cpu(small):
    torch.library.opcheck(torch.ops.kdtree.moe_gemv.default, small)
    shared = make_shared(torch.Generator().manual_seed(2), 32, 16)
    torch.library.opcheck(torch.ops.kdtree.moe_gemv.default, small + shared)
    logits = torch.randn(small[0].shape[0], small[1].shape[0])
    torch.library.opcheck(torch.ops.kdtree.moe_gemv.default, small + shared + (None, logits))
    torch.library.opcheck(torch.ops.kdtree.moe_gemv.default, small + (None, None, None, small[0] * 3))


def test_route_logits_changes_nothing_on_cpu(small):
    shared = make_shared(torch.Generator().manual_seed(3), 32, 16)
    want = moe_gemv(*small, *shared)
    logits = torch.randn(small[0].shape[0], small[1].shape[0])
    assert torch.equal(moe_gemv(*small, *shared, route_logits=logits), want)
    assert torch.equal(moe_gemv_reference(*small, *shared, route_logits=logits), want)


def test_bad_route_logits_raise(small):
    T, E = small[0].shape[0], small[1].shape[0]
    with pytest.raises(ValueError, match="route_logits must be float32"):
        moe_gemv(*small, route_logits=torch.randn(T, E).to(torch.bfloat16))
    with pytest.raises(ValueError, match="route_logits must be float32"):
        moe_gemv(*small, route_logits=torch.randn(T + 1, E))
    with pytest.raises(ValueError, match="route_logits must be float32"):
        moe_gemv(*small, route_logits=torch.randn(T * E))
    with pytest.raises(TypeError, match="route_logits must be a tensor"):
        moe_gemv(*small, route_logits=True)


def test_compiles_with_fullgraph_on_cpu(small):
    x, gate, up, down, ids, w = small
    torch._dynamo.reset()

    def step(x, ids, w):
        return moe_gemv(x, gate, up, down, ids, w).float() * 2

    got = torch.compile(step, fullgraph=True)(x, ids, w)
    assert torch.equal(got, moe_gemv_reference(x, gate, up, down, ids, w).float() * 2)


# --------------------------------------------------------------------------------------------
# CUDA: the kernel against the reference (fresh random weights and routings every run)
# --------------------------------------------------------------------------------------------

def cuda_case(seed, T, k, E, H, I):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    gate, up, down = make_experts(gen, E, H, I, device="cuda")
    x = torch.randn((T, H), generator=gen, device="cuda").to(torch.bfloat16)
    ids, w = make_routing(gen, T, k, E, device="cuda")
    return x, gate, up, down, ids, w


@requires_kernel
@pytest.mark.parametrize("T,k,E,H,I", [
    (1, 8, 64, 2048, 512),    # the 2p2b decode step
    (4, 8, 64, 2048, 512),    # four requests
    (2, 8, 48, 7168, 256),    # K2 hidden size, TP-8 expert slice
    (3, 6, 10, 136, 24),      # rows shorter than a warp's loads, odd sizes
    (17, 8, 64, 512, 128),    # a tree-verify-sized batch
    (1, 1, 3, 8, 8),          # smallest shapes
])
def test_cuda_kernel_matches_reference(fresh_seed, T, k, E, H, I):
    args = cuda_case(fresh_seed, T, k, E, H, I)
    got = moe_gemv(*args)
    want = moe_gemv_reference(*(a.cpu() for a in args))
    assert got.dtype == torch.bfloat16 and got.shape == (T, H)
    # same rounding points; fp32 sums in another order may cross a bf16 boundary: a few ulps
    assert rel_err(got, want) < 8e-3


@requires_kernel
@pytest.mark.parametrize("T,k,E,H,I,Is", [
    (1, 8, 64, 2048, 512, 512),     # the 2p2b decode step with its shared expert
    (4, 8, 48, 7168, 256, 256),     # K2 TP-8 slice, four requests
    (3, 6, 10, 136, 24, 1040),      # Is past the up-front chunks (> 512), odd sizes
    (2, 2, 5, 64, 64, 8),           # Is < I
])
def test_cuda_kernel_with_shared_expert_matches_reference(fresh_seed, T, k, E, H, I, Is):
    args = cuda_case(fresh_seed, T, k, E, H, I)
    shared = make_shared(torch.Generator(device="cuda").manual_seed(fresh_seed + 7), H, Is, device="cuda")
    got = moe_gemv(*args, *shared)
    want = moe_gemv_reference(*(a.cpu() for a in args + shared))
    assert got.shape == (T, H)
    assert rel_err(got, want) < 8e-3
    # the residual add in the down kernel: exactly residual + the rounded output
    res = torch.randn((T, H), device="cuda").to(torch.bfloat16) * 4
    assert torch.equal(moe_gemv(*args, *shared, residual=res), res + got)
    res_want = moe_gemv_reference(*(a.cpu() for a in args + shared), residual=res.cpu())
    assert rel_err(moe_gemv(*args, *shared, residual=res), res_want) < 8e-3


@requires_kernel
def test_cuda_kernel_with_residual_only_matches_reference(fresh_seed):
    args = cuda_case(fresh_seed, 3, 6, 10, 136, 24)
    res = torch.randn((3, 136), device="cuda").to(torch.bfloat16)
    got = moe_gemv(*args, residual=res)
    assert torch.equal(got, res + moe_gemv(*args))
    assert rel_err(got, moe_gemv_reference(*(a.cpu() for a in args), residual=res.cpu())) < 8e-3


@requires_kernel
def test_cuda_duplicate_and_out_of_range_ids(fresh_seed):
    x, gate, up, down, ids, w = cuda_case(fresh_seed, 3, 4, 8, 256, 64)
    ids[0, 1] = ids[0, 0]
    ids[1, 2] = 8
    ids[2, 0] = -3
    with value_checks(False):
        got = moe_gemv(x, gate, up, down, ids, w)
        want = moe_gemv_reference(*(a.cpu() for a in (x, gate, up, down, ids, w)))
    assert rel_err(got, want) < 8e-3


@requires_kernel
@pytest.mark.parametrize("T,k,E,H,I,Is", [(1, 8, 64, 2048, 512, 512), (3, 6, 10, 136, 24, 1040), (2, 3, 8, 256, 64, 0)])
def test_cuda_route_logits_gives_the_same_bits(fresh_seed, T, k, E, H, I, Is):
    """route_logits (the shared expert's gate/up blocks first in the grid and without the
    programmatic-launch wait) changes the launch order only: the same bits as without it, with an
    out-of-range and a duplicate id, and close to the reference; a malformed one raises in the
    kernel's own checks."""
    args = cuda_case(fresh_seed, T, k, E, H, I)
    args[4][0, -1] = E
    if k > 1:
        args[4][-1, 0] = args[4][-1, 1]
    if Is:
        args = args + make_shared(torch.Generator(device="cuda").manual_seed(fresh_seed + 7), H, Is, device="cuda")
    res = torch.randn((T, H), device="cuda").to(torch.bfloat16)
    logits = torch.randn((T, E), device="cuda")

    def hinted(**kw):  # the hint's promise: nothing but a reader of the logits may still run (here: nothing)
        torch.cuda.synchronize()
        return moe_gemv(*args, route_logits=logits, **kw)

    with value_checks(False):
        base = moe_gemv(*args)
        assert torch.equal(hinted(), base)
        if Is:
            want_res = moe_gemv(*args, residual=res)
            assert torch.equal(hinted(residual=res), want_res)
        want = moe_gemv_reference(*(a.cpu() for a in args))
    assert rel_err(base, want) < 8e-3
    full = args + (None,) * (9 - len(args))
    with pytest.raises(RuntimeError, match="route_logits must be float32"):
        torch.ops.kdtree.moe_gemv(*full, None, logits[:, :1].to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="route_logits must be on x's device"):
        torch.ops.kdtree.moe_gemv(*full, None, logits.cpu())


@requires_kernel
@requires_cuda_kernel("kdtree::gemv")
@requires_cuda_kernel("kdtree::moe_route")
def test_cuda_route_logits_in_the_models_launch_chain(fresh_seed):
    """The chain route_logits is made for, as the model runs it: the router's kdtree::gemv launch
    (RMSNorm prologue, x returned, fp32 logits), kdtree::moe_route, then moe_gemv with those logits --
    the shared expert's blocks read x and write their activations while moe_route may still run.
    Captured in a CUDA graph (fixed addresses, as in the decode step) and replayed on fresh hidden
    states: every replay equals the eager chain without the hint bit for bit."""
    T, k, E, H, I, Is = 1, 8, 64, 2048, 512, 512
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    gate, up, down = make_experts(gen, E, H, I, device="cuda")
    shared = make_shared(gen, H, Is, device="cuda")
    router = (torch.randn((E, H), generator=gen, device="cuda") / H**0.5).to(torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(H, generator=gen, device="cuda")).to(torch.bfloat16)
    bias = 0.1 * torch.randn(E, generator=gen, device="cuda")
    h = torch.randn((T, H), generator=gen, device="cuda").to(torch.bfloat16)

    def chain(h, settled):
        logits, x = gemv(h, [router], norm_w, 1e-6, fp32_outputs=1, return_input=True)
        ids, w = moe_route(logits, bias, k, 1, 1, True, 2.5)
        return moe_gemv(x, gate, up, down, ids, w, *shared, residual=h, route_logits=logits if settled else None)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(h, True)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(h, True)
    for _ in range(4):
        h.copy_(torch.randn(h.shape, generator=gen, device="cuda"))
        graph.replay()
        want = chain(h.clone(), False)
        torch.cuda.synchronize()
        assert torch.equal(out, want)


@requires_kernel
def test_cuda_results_are_deterministic(fresh_seed):
    args = cuda_case(fresh_seed, 4, 8, 64, 1024, 256)
    first = moe_gemv(*args)
    for _ in range(3):
        assert torch.equal(moe_gemv(*args), first)


@requires_kernel
def test_opcheck_cuda(fresh_seed):
    torch.library.opcheck(torch.ops.kdtree.moe_gemv.default, cuda_case(fresh_seed, 2, 4, 8, 256, 64))
    shared = make_shared(torch.Generator(device="cuda").manual_seed(fresh_seed), 256, 64, device="cuda")
    torch.library.opcheck(torch.ops.kdtree.moe_gemv.default, cuda_case(fresh_seed, 2, 4, 8, 256, 64) + shared)
    case = cuda_case(fresh_seed, 2, 4, 8, 256, 64)
    torch.library.opcheck(torch.ops.kdtree.moe_gemv.default, case + shared + (case[0] * 2,))
    # (route_logits is opchecked on CPU only: opcheck's back-to-back calls break the hint's promise
    # that only moe_route, reading the logits, may still run)


@requires_kernel
def test_cuda_compiles_with_fullgraph(fresh_seed):
    x, gate, up, down, ids, w = cuda_case(fresh_seed, 2, 8, 16, 512, 128)
    torch._dynamo.reset()

    def step(x, ids, w):
        return moe_gemv(x, gate, up, down, ids, w) + x

    got = torch.compile(step, fullgraph=True)(x, ids, w)
    want = moe_gemv_reference(*(a.cpu() for a in (x, gate, up, down, ids, w))).float() + x.cpu().float()
    assert rel_err(got, want) < 8e-3


@requires_kernel
def test_cuda_graph_replays_with_new_routings(fresh_seed):
    x, gate, up, down, ids, w = cuda_case(fresh_seed, 2, 8, 64, 512, 128)
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed + 1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), value_checks(False):
        moe_gemv(x, gate, up, down, ids, w)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_gemv(x, gate, up, down, ids, w)
    for _ in range(3):
        new_ids, new_w = make_routing(gen, 2, 8, 64, device="cuda")
        ids.copy_(new_ids)
        w.copy_(new_w)
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        want = moe_gemv_reference(*(a.cpu() for a in (x, gate, up, down, ids, w)))
        assert rel_err(out, want) < 8e-3
