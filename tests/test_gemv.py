"""kdtree::gemv (decode-sized linear layers with an RMSNorm / SwiGLU prologue and a residual
epilogue): the CPU reference against an independent float64 oracle and against the model's own
modules, bad inputs, opcheck and torch.compile; on CUDA the kernel against the reference on fresh
random inputs every run, determinism, CUDA graphs."""
import re

import pytest
import torch
import torch.nn.functional as F

from .conftest import cuda_kernels_run, rel_err, requires_cuda_kernel
from torch_kdtree.ops import gemv, gemv_reference

requires_kernel = requires_cuda_kernel("kdtree::gemv")


def make_case(gen, M, K, Ns, prologue=None, residual=False, dtype=torch.bfloat16, device="cpu"):
    """x [M, K], weights [N_i, K] scaled to O(1) outputs, and the prologue / residual inputs."""
    x = (torch.randn((M, K), generator=gen, device=device) * 3).to(dtype)
    weights = [(torch.randn((N, K), generator=gen, device=device) / K**0.5).to(dtype) for N in Ns]
    kw = {}
    if prologue == "norm":
        kw["norm_weight"] = (1 + 0.5 * torch.randn((K,), generator=gen, device=device)).to(dtype)
        kw["eps"] = 1e-5
    elif prologue == "swiglu":
        kw["up"] = torch.randn((M, K), generator=gen, device=device).to(dtype)
    if residual:
        kw["residual"] = torch.randn((M, Ns[0]), generator=gen, device=device).to(dtype)
    return x, weights, kw


def oracle(x, weights, norm_weight=None, eps=1e-6, up=None, residual=None, fp32_outputs=0, return_input=False):
    """float64, row by row with explicit sums; the op's rounding points applied by casting through
    x's dtype (none for the first fp32_outputs outputs); the prologue's rows appended last when
    return_input."""
    dt = x.dtype
    rnd = lambda v: v.to(dt).double()  # noqa: E731

    def prologue(m):
        xm = x[m].double().cpu()
        if norm_weight is not None:
            r = 1.0 / float(torch.sqrt((xm * xm).sum() / xm.numel() + eps))
            xm = rnd(norm_weight.double().cpu() * rnd(xm * r))
        elif up is not None:
            xm = rnd(xm / (1 + torch.exp(-xm)) * up[m].double().cpu())
        return xm

    outs = []
    for i, w in enumerate(weights):
        out = torch.empty((x.shape[0], w.shape[0]), dtype=torch.float64)
        for m in range(x.shape[0]):
            y = (w.double().cpu() * prologue(m)).sum(-1)
            if i >= fp32_outputs:
                y = rnd(y)
            if residual is not None:
                y = rnd(residual[m].double().cpu() + y)
            out[m] = y
        outs.append(out)
    if return_input:
        outs.append(torch.stack([prologue(m) for m in range(x.shape[0])]))
    return outs


# --------------------------------------------------------------------------------------------
# reference (CPU)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("prologue", [None, "norm", "swiglu"])
@pytest.mark.parametrize("M,K,Ns,residual", [(1, 64, (32,), False), (3, 40, (24, 8), False),
                                             (5, 128, (16,), True), (2, 96, (8, 16, 24, 32), False)])
def test_reference_matches_float64_oracle_in_float32(fresh_seed, prologue, M, K, Ns, residual):
    gen = torch.Generator().manual_seed(fresh_seed)
    x, weights, kw = make_case(gen, M, K, Ns, prologue, residual, torch.float32)
    got = gemv_reference(x, weights, **kw)
    want = oracle(x, weights, **kw)
    assert len(got) == len(Ns)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prologue", [None, "norm", "swiglu"])
def test_reference_in_bfloat16_rounds_where_the_oracle_does(fresh_seed, prologue):
    gen = torch.Generator().manual_seed(fresh_seed)
    x, weights, kw = make_case(gen, 4, 256, (64, 32), prologue)
    for g, w in zip(gemv_reference(x, weights, **kw), oracle(x, weights, **kw)):
        # fp32 against fp64 sums may land on either side of a bf16 rounding boundary: a few ulps
        assert rel_err(g, w) < 8e-3


@pytest.mark.parametrize("prologue", [None, "norm", "swiglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_fp32_outputs_and_returned_input_match_the_oracle(fresh_seed, prologue, dtype):
    """fp32_outputs: the first outputs are the fp32 sums, unrounded (a router's logits); return_input:
    the prologue's output comes last, in x's dtype."""
    gen = torch.Generator().manual_seed(fresh_seed)
    x, weights, kw = make_case(gen, 3, 128, (24, 16, 8), prologue, False, dtype)
    got = gemv_reference(x, weights, **kw, fp32_outputs=2, return_input=True)
    want = oracle(x, weights, **kw, fp32_outputs=2, return_input=True)
    assert [g.dtype for g in got] == [torch.float32, torch.float32, dtype, dtype]
    assert [tuple(g.shape) for g in got] == [(3, 24), (3, 16), (3, 8), (3, 128)]
    # fp32 sums, unrounded: against float64 sums of the products of the input the reference used (its
    # returned input; checked against the oracle's below).  In bf16 the oracle's own prologue output
    # may sit one rounding step away from it (fp64 vs fp32 norm), which moves these sums by ~1e-3.
    for g, w in zip(got[:2], weights[:2]):
        torch.testing.assert_close(g.double(), got[3].double() @ w.double().T, rtol=1e-5, atol=1e-5)
    if dtype == torch.float32:  # no rounding of the input: the oracle's sums themselves
        for g, w in zip(got[:2], want[:2]):
            torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: fp32 vs fp64 may cross a rounding boundary
    for g, w in zip(got[2:], want[2:]):
        assert rel_err(g, w) < tol
    # the rounded outputs are those of a plain call; the returned input is what the products used
    plain = gemv_reference(x, weights, **kw)
    assert torch.equal(got[2], plain[2])
    assert torch.equal(got[0], gemv_reference(got[3], weights[:1], fp32_outputs=1)[0])


def test_reference_agrees_with_the_models_modules(fresh_seed):
    """RMSNorm + linear, SwiGLU MLP down projection + residual, as the model writes them (bf16)."""
    from torch_kdtree.models.kimi_k2.modeling import KimiK2RMSNorm

    gen = torch.Generator().manual_seed(fresh_seed)
    x, (wq, wk), _ = make_case(gen, 3, 128, (48, 24))
    norm = KimiK2RMSNorm(128, 1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn((128,), generator=gen))
    xn = norm(x)
    want = [F.linear(xn.float(), w.float()).to(torch.bfloat16) for w in (wq, wk)]
    got = gemv_reference(x, [wq, wk], norm.weight.detach(), 1e-5)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    g_, u_ = x, torch.randn(x.shape, generator=gen).to(torch.bfloat16)
    res = torch.randn((3, 48), generator=gen).to(torch.bfloat16)
    act = (F.silu(g_.float()) * u_.float()).to(torch.bfloat16)
    want = res + F.linear(act.float(), wq.float()).to(torch.bfloat16)
    assert torch.equal(gemv_reference(g_, [wq], up=u_, residual=res)[0], want)


def test_wrapper_flattens_leading_dimensions(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    x, weights, kw = make_case(gen, 6, 64, (16,), "norm", True, torch.float32)
    flat = gemv(x, weights, **kw)[0]
    kw["residual"] = kw["residual"].view(2, 3, 16)
    shaped = gemv(x.view(2, 3, 64), weights, **kw)[0]
    assert shaped.shape == (2, 3, 16) and torch.equal(shaped.reshape(6, 16), flat)


# --------------------------------------------------------------------------------------------
# bad inputs
# --------------------------------------------------------------------------------------------

@pytest.fixture
def small():
    gen = torch.Generator().manual_seed(0)
    return make_case(gen, 2, 32, (16, 8))


def test_bad_dtypes_raise(small):
    x, (w0, w1), _ = small
    with pytest.raises(TypeError, match=r"weights\[1\] must be torch.bfloat16"):
        gemv(x, [w0, w1.float()])
    with pytest.raises(TypeError, match="norm_weight must be torch.bfloat16"):
        gemv(x, [w0], torch.ones(32))
    with pytest.raises(TypeError, match="x must be"):
        gemv(x.int(), [w0])


def test_bad_shapes_raise(small):
    x, (w0, w1), _ = small
    with pytest.raises(ValueError, match=r"weights\[0\] must be \[N, K = 32\]"):
        gemv(x, [w0[:, :16].contiguous()])
    with pytest.raises(ValueError, match="1 to 4 tensors"):
        gemv(x, [w0] * 5)
    with pytest.raises(ValueError, match="1 to 4 tensors"):
        gemv(x, [])
    with pytest.raises(ValueError, match="multiple of 8"):
        gemv(x[:, :12].contiguous(), [w0[:, :12].contiguous()])
    with pytest.raises(ValueError, match=r"norm_weight must be \[K = 32\]"):
        gemv(x, [w0], torch.ones(16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="up must be x's shape"):
        gemv(x, [w0], up=x[:1].contiguous())
    with pytest.raises(ValueError, match="exclusive"):
        gemv(x, [w0], torch.ones(32, dtype=torch.bfloat16), up=x)
    with pytest.raises(ValueError, match="exactly one weight"):
        gemv(x, [w0, w1], residual=torch.zeros((2, 16), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"residual must be \[M, N\]"):
        gemv(x, [w0], residual=torch.zeros((2, 8), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        gemv(x, [w0.t().contiguous().t()])
    with pytest.raises(ValueError, match="eps must be"):
        gemv(x, [w0], torch.ones(32, dtype=torch.bfloat16), eps=-1.0)
    with pytest.raises(ValueError, match=r"fp32_outputs must be an int in \[0, 2\]"):
        gemv(x, [w0, w1], fp32_outputs=3)
    with pytest.raises(ValueError, match="fp32_outputs must be"):
        gemv(x, [w0], fp32_outputs=-1)
    with pytest.raises(ValueError, match="fp32_outputs must be"):
        gemv(x, [w0], fp32_outputs=True)
    with pytest.raises(ValueError, match="cannot go with fp32_outputs"):
        gemv(x, [w0], residual=torch.zeros((2, 16), dtype=torch.bfloat16), fp32_outputs=1)
    with pytest.raises(TypeError, match="return_input must be a bool"):
        gemv(x, [w0], return_input=1)


# --------------------------------------------------------------------------------------------
# opcheck and torch.compile (CPU)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("prologue,residual,extra", [(None, False, {}), ("norm", False, {}), ("swiglu", True, {}),
                                                     ("norm", False, {"fp32_outputs": 1, "return_input": True}),
                                                     (None, False, {"return_input": True})])
def test_opcheck_cpu(prologue, residual, extra):
    gen = torch.Generator().manual_seed(1)
    x, weights, kw = make_case(gen, 3, 64, (16,) if residual else (16, 24), prologue, residual)
    torch.library.opcheck(torch.ops.kdtree.gemv.default, (x, weights), {**kw, **extra})


def test_compiles_with_fullgraph_on_cpu(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    x, weights, kw = make_case(gen, 2, 64, (16, 8), "norm")
    torch._dynamo.reset()

    def step(x):
        a, b = gemv(x, weights, **kw)
        return a.float().sum(-1) + b.float().sum(-1)

    want = [o.float().sum(-1) for o in gemv_reference(x, weights, **kw)]
    assert torch.equal(torch.compile(step, fullgraph=True)(x), want[0] + want[1])

    def router_step(x):
        logits, b, xn = gemv(x, weights, **kw, fp32_outputs=1, return_input=True)
        return logits.sum(-1) + xn.float().sum(-1)

    torch._dynamo.reset()
    ref = gemv_reference(x, weights, **kw, fp32_outputs=1, return_input=True)
    # (inductor may sum in another order than eager)
    torch.testing.assert_close(torch.compile(router_step, fullgraph=True)(x), ref[0].sum(-1) + ref[2].float().sum(-1),
                               rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# CUDA: the kernel against the reference (fresh random inputs every run)
# --------------------------------------------------------------------------------------------

CUDA_CASES = [
    (1, 2048, (1536, 576), "norm", False),    # 2p2b q_a + kv_a with the input norm
    (4, 1536, (3072,), "norm", False),        # q_b with q_a_layernorm, four rows
    (1, 2048, (2048,), None, True),           # o_proj + residual
    (2, 6144, (2048,), "swiglu", True),       # dense MLP down + residual
    (3, 7168, (1536, 576), "norm", False),    # K2 hidden size
    (5, 136, (7, 33, 1, 64), None, False),    # M past a block's rows, ragged N, short rows
    (1, 18432, (256,), "swiglu", False),      # K past one block of rows in shared memory
    (9, 8, (3,), "norm", True),               # smallest K
]


def cuda_case(seed, M, K, Ns, prologue, residual):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return make_case(gen, M, K, Ns, prologue, residual, device="cuda")


@requires_kernel
@pytest.mark.parametrize("M,K,Ns,prologue,residual", CUDA_CASES)
def test_cuda_kernel_matches_reference(fresh_seed, M, K, Ns, prologue, residual):
    x, weights, kw = cuda_case(fresh_seed, M, K, Ns, prologue, residual)
    got = gemv(x, weights, **kw)
    want = gemv_reference(x.cpu(), [w.cpu() for w in weights], **{k: v.cpu() if torch.is_tensor(v) else v
                                                                  for k, v in kw.items()})
    assert len(got) == len(Ns)
    for g, w, N in zip(got, want, Ns):
        assert g.dtype == torch.bfloat16 and g.shape == (M, N)
        # same rounding points; fp32 sums in another order may cross a bf16 boundary: a few ulps
        assert rel_err(g, w) < 8e-3


@requires_kernel
@pytest.mark.parametrize("M,K,Ns,prologue,fp32", [
    (1, 2048, (64,), "norm", 1),                  # 2p2b: post-attention norm + router
    (1, 7168, (384, 256, 256), "norm", 1),        # K2 rank: norm + router + the shared expert's gate, up
    (4, 7168, (384, 256, 256), "norm", 1),
    (3, 136, (7, 33, 1), "swiglu", 3),
    (2, 264, (40,), None, 0),
    (5, 64, (0,), "norm", 0),                     # no rows at all: the input still comes back
])
def test_cuda_fp32_outputs_and_returned_input(fresh_seed, M, K, Ns, prologue, fp32):
    x, weights, kw = cuda_case(fresh_seed, M, K, Ns, prologue, False)
    got = gemv(x, weights, **kw, fp32_outputs=fp32, return_input=True)
    cpu = {k: v.cpu() if torch.is_tensor(v) else v for k, v in kw.items()}
    want = gemv_reference(x.cpu(), [w.cpu() for w in weights], **cpu, fp32_outputs=fp32, return_input=True)
    assert [g.dtype for g in got] == [w.dtype for w in want]
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got[:fp32], want[:fp32]):
        # fp32 sums in another order (and a norm that may round a few inputs the other way)
        if w.numel():
            assert rel_err(g, w) < 2e-3
    for g, w in zip(got[fp32:], want[fp32:]):
        if w.numel():
            assert rel_err(g, w) < 8e-3
    # the returned input is exactly the kernel's GEMV input: a plain call on it gives the same bits
    xn = got[-1]
    if prologue is None:
        assert torch.equal(xn, x)
    if sum(Ns):
        again = gemv(xn, weights, fp32_outputs=fp32)
        for a, b in zip(again, got[:-1]):
            assert torch.equal(a, b)
    # and the bf16 outputs are those of the call without the new arguments
    plain = gemv(x, weights, **kw)
    for a, b in zip(plain[fp32:], got[fp32:-1]):
        assert torch.equal(a, b)


@requires_kernel
def test_cuda_results_are_deterministic(fresh_seed):
    x, weights, kw = cuda_case(fresh_seed, 4, 1024, (512, 64), "norm", False)
    first = gemv(x, weights, **kw)
    for _ in range(3):
        for a, b in zip(gemv(x, weights, **kw), first):
            assert torch.equal(a, b)


@requires_kernel
@pytest.mark.parametrize("M,K,Ns,prologue,residual", [c for c in CUDA_CASES if c[0] > 1] +
                         [(4, 7168, (300, 5), "norm", False), (3, 1024, (7168,), None, True)])
def test_cuda_each_row_of_a_batch_gives_the_bits_of_a_decode_call(fresh_seed, M, K, Ns, prologue, residual):
    """A call of M rows (gemv_ring_kernel's general instantiation, several rows per block) and each
    of its rows alone (M = 1: the decode instantiation <kB, 1, 3> where 3 ring stages fit) run the
    same items in the same order, so the same bits -- a verify pass and a decode pass agree
    whichever kernel each shape gets."""
    x, weights, kw = cuda_case(fresh_seed, M, K, Ns, prologue, residual)
    if not residual:  # and the router form: an fp32 first output and the prologue's output
        kw.update(fp32_outputs=1, return_input=True)
    batch = gemv(x, weights, **kw)
    for m in range(M):
        row_kw = {k: (v[m:m + 1] if k in ("up", "residual") else v) for k, v in kw.items()}
        for a, b in zip(gemv(x[m:m + 1], weights, **row_kw), batch):
            assert torch.equal(a, b[m:m + 1]), m


@requires_kernel
def test_cuda_decode_shape_runs_the_decode_instantiation(fresh_seed):
    """The bit-equality test above compares two instantiations only if the shapes really select them:
    M = 1 with 3 ring stages runs gemv_ring_kernel<kB, 1, 3>, M = 4 the general ring kernel."""
    def kernels(M):
        x, weights, kw = cuda_case(fresh_seed, M, 2048, (1536, 576), "norm", False)
        return cuda_kernels_run(lambda: gemv(x, weights, **kw), "gemv")[1]

    decode, general = kernels(1), kernels(4)
    assert any(re.search(r"gemv_ring_kernel<\d+, 1, 3>", n) for n in decode), decode
    assert any("gemv_ring_kernel" in n for n in general), general
    assert not any(re.search(r"gemv_ring_kernel<\d+, 1, 3>", n) for n in general), general


@requires_kernel
def test_cuda_reads_no_rows_past_its_inputs(fresh_seed):
    """x and up as the first rows of NaN-filled buffers (M = 5: one full block of rows and one
    short one): a read of a row past M would turn outputs into NaN."""
    x, weights, kw = cuda_case(fresh_seed, 5, 264, (40,), "swiglu", True)
    bigs = [torch.full((8, 264), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    bigs[0][:5], bigs[1][:5] = x, kw["up"]
    got = gemv(bigs[0][:5], weights, up=bigs[1][:5], residual=kw["residual"])[0]
    assert torch.isfinite(got.float()).all()
    want = gemv_reference(x.cpu(), [weights[0].cpu()], up=kw["up"].cpu(), residual=kw["residual"].cpu())[0]
    assert rel_err(got, want) < 8e-3


@requires_kernel
@pytest.mark.parametrize("prologue,residual,extra", [("norm", False, {}), ("swiglu", True, {}),
                                                     ("norm", False, {"fp32_outputs": 1, "return_input": True})])
def test_opcheck_cuda(fresh_seed, prologue, residual, extra):
    x, weights, kw = cuda_case(fresh_seed, 2, 256, (64,) if residual else (64, 32), prologue, residual)
    torch.library.opcheck(torch.ops.kdtree.gemv.default, (x, weights), {**kw, **extra})


@requires_kernel
def test_cuda_compiles_with_fullgraph(fresh_seed):
    x, weights, kw = cuda_case(fresh_seed, 2, 512, (128, 64), "norm", False)
    torch._dynamo.reset()

    def step(x):
        a, b = gemv(x, weights, **kw)
        return torch.cat([a, b], -1) * 2

    got = torch.compile(step, fullgraph=True)(x)
    want = torch.cat(gemv_reference(x.cpu(), [w.cpu() for w in weights], kw["norm_weight"].cpu(), kw["eps"]), -1)
    assert rel_err(got, want.float() * 2) < 8e-3

    def router_step(x):  # the router form: fp32 logits, a bf16 projection and the normalised input
        logits, b, xn = gemv(x, weights, **kw, fp32_outputs=1, return_input=True)
        return logits.softmax(-1), b.float() + 1, xn * 2

    torch._dynamo.reset()
    got = torch.compile(router_step, fullgraph=True)(x)
    eager = router_step(x)
    for g, e in zip(got, eager):
        assert g.dtype == e.dtype and torch.allclose(g.float(), e.float(), rtol=1e-5, atol=1e-6)
    assert got[0].dtype == torch.float32 and got[2].dtype == torch.bfloat16


@requires_kernel
def test_cuda_graph_replays_with_new_inputs(fresh_seed):
    x, weights, kw = cuda_case(fresh_seed, 2, 1024, (256,), "norm", True)
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed + 1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gemv(x, weights, **kw)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(x, weights, **kw)[0]
    for _ in range(3):
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda") * 3)
        kw["residual"].copy_(torch.randn(kw["residual"].shape, generator=gen, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        want = gemv_reference(x.cpu(), [weights[0].cpu()], kw["norm_weight"].cpu(), kw["eps"],
                              residual=kw["residual"].cpu())[0]
        assert rel_err(out, want) < 8e-3
