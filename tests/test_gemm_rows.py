"""kdtree::gemm_rows (tree-sized linear layers): the reference against a float64 oracle, bad inputs,
opcheck and torch.compile on CPU; on CUDA the kernel against the reference on fresh random inputs
(one and two m16 tiles of rows, ragged N and K, split and unsplit K, one to three weights sharing x
in one launch), rows past M never read, the same bits on every run, CUDA graph replay, opcheck and a
compiled fullgraph step."""
import pytest
import torch

from .conftest import rel_err, requires_cuda_kernel
from torch_kdtree.ops import gemm_rows, gemm_rows_reference

requires_kernel = requires_cuda_kernel("kdtree::gemm_rows")


def case(gen, M, K, N, dtype=torch.float32, device="cpu"):
    x = torch.randn(M, K, generator=gen, device=device).to(dtype)
    w = (torch.randn(N, K, generator=gen, device=device) / K ** 0.5).to(dtype)
    return x, w


@pytest.mark.parametrize("M,K,N", [(1, 8, 1), (5, 72, 33), (17, 264, 130), (32, 1024, 64)])
def test_reference_matches_float64_oracle(fresh_seed, M, K, N):
    gen = torch.Generator().manual_seed(fresh_seed)
    x, w = case(gen, M, K, N)
    oracle = torch.einsum("mk,nk->mn", x.double(), w.double())
    got = gemm_rows_reference(x, w)
    assert got.dtype == torch.float32 and got.shape == (M, N)
    torch.testing.assert_close(got.double(), oracle, rtol=1e-5, atol=1e-5)
    # bf16: the fp32 sums rounded once
    xb, wb = x.bfloat16(), w.bfloat16()
    want = torch.einsum("mk,nk->mn", xb.double(), wb.double()).float().bfloat16()
    assert (gemm_rows_reference(xb, wb).float() - want.float()).abs().max() <= want.float().abs().max() * 2 ** -7


def test_several_weights_are_each_weight_alone(fresh_seed):
    """A list of weights sharing x: one output per weight, each the single-weight result (the
    reference against the float64 oracle too)."""
    gen = torch.Generator().manual_seed(fresh_seed)
    x, w1 = case(gen, 9, 64, 48)
    w2, w3 = case(gen, 1, 64, 8)[1], case(gen, 1, 64, 130)[1]
    got = gemm_rows(x.view(3, 3, 64), [w1, w2, w3])
    assert [tuple(y.shape) for y in got] == [(3, 3, 48), (3, 3, 8), (3, 3, 130)]
    for y, w in zip(got, (w1, w2, w3)):
        assert torch.equal(y.view(9, -1), gemm_rows_reference(x, w))
        torch.testing.assert_close(y.view(9, -1).double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5)
    assert isinstance(gemm_rows(x, w1), torch.Tensor) and isinstance(gemm_rows(x, [w1]), list)


def test_op_on_cpu_is_the_reference_and_keeps_leading_dims(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    x, w = case(gen, 12, 64, 48)
    got = gemm_rows(x.view(3, 4, 64), w)
    assert got.shape == (3, 4, 48) and torch.equal(got.view(12, 48), gemm_rows_reference(x, w))


@pytest.mark.parametrize("x_shape,w_shape,dtypes,message", [
    ((33, 64), (8, 64), (torch.float32,) * 2, "at most 32 rows"),
    ((4, 12), (8, 12), (torch.float32,) * 2, "multiple of 8"),
    ((4, 64), (8, 72), (torch.float32,) * 2, r"weight must be \[N >= 1, K = 64\]"),
    ((4, 64), (0, 64), (torch.float32,) * 2, r"weight must be \[N >= 1"),
    ((4, 64), (8, 64), (torch.float32, torch.bfloat16), "weight must be torch.float32"),
    ((4, 64), (8, 64), (torch.int32, torch.int32), "x must be"),
])
def test_bad_inputs_raise(x_shape, w_shape, dtypes, message):
    x = torch.zeros(x_shape, dtype=dtypes[0])
    w = torch.zeros(w_shape, dtype=dtypes[1])
    with pytest.raises((ValueError, TypeError), match=message):
        gemm_rows(x, w)


@pytest.mark.parametrize("weights,message", [
    (lambda w: [], "1 to 3 weights sharing x, got 0"),
    (lambda w: [w, w, w, w], "1 to 3 weights sharing x, got 4"),
    (lambda w: [w, w[:, :32].contiguous()], r"weights\[1\] must be \[N >= 1, K = 64\]"),
    (lambda w: [w, w.double()], r"weights\[1\] must be torch.float32"),
])
def test_bad_weight_lists_raise(weights, message):
    x, w = torch.zeros(4, 64), torch.zeros(8, 64)
    with pytest.raises((ValueError, TypeError), match=message):
        gemm_rows(x, weights(w))


def test_non_contiguous_weight_raises():
    with pytest.raises(ValueError, match="weight must be contiguous"):
        gemm_rows(torch.zeros(4, 64), torch.zeros(64, 16).T)


def test_where_it_pays_rows_and_k():
    """The measured rule (run 182): 5-16 rows at any K; 17-20 rows only where K >= 4096; nothing else."""
    from torch_kdtree.ops import gemm_rows_pays

    assert [r for r in range(0, 40) if gemm_rows_pays(r, 1024)] == list(range(5, 17))
    assert [r for r in range(0, 40) if gemm_rows_pays(r, 7168)] == list(range(5, 21))
    assert gemm_rows_pays(17, 4096) and not gemm_rows_pays(17, 4088)
    assert gemm_rows_pays(17) and not gemm_rows_pays(21) and not gemm_rows_pays(4)  # for some K


def test_linear_in_rows_form_asks_per_call(monkeypatch, fresh_seed):
    """models.kimi_k2.gemv.linear(form="rows") runs gemm_rows only for the calls whose rows and K pay
    (17 rows: the long-K weight yes, the short-K one no), and gives the module's output either way."""
    from torch_kdtree.models.kimi_k2 import gemv

    calls = []
    real = gemv.gemm_rows
    monkeypatch.setattr(gemv, "gemm_rows", lambda x, w: calls.append(tuple(w.shape)) or real(x, w))
    g = torch.Generator().manual_seed(fresh_seed)
    long_k, short_k = torch.nn.Linear(4096, 24, bias=False), torch.nn.Linear(1024, 24, bias=False)
    for m in (long_k, short_k):
        m.weight.data = torch.randn(m.weight.shape, generator=g)
    for rows, want in ((9, [(24, 4096), (24, 1024)]), (17, [(24, 4096)]), (21, [])):
        calls.clear()
        for m in (long_k, short_k):
            x = torch.randn(1, rows, m.in_features, generator=g)
            torch.testing.assert_close(gemv.linear(m, x, "rows"), m(x), rtol=1e-5, atol=1e-4)
        assert calls == want, (rows, calls)


def test_linears_share_one_launch_where_it_pays(monkeypatch, fresh_seed):
    """models.kimi_k2.gemv.linears: linears that read the same x run as one gemm_rows call of all their
    weights in the "rows" form where it pays (q_a + kv_a, gate + up), else one by one; the modules'
    outputs either way."""
    from torch_kdtree.models.kimi_k2 import gemv

    calls = []
    real = gemv.gemm_rows
    monkeypatch.setattr(gemv, "gemm_rows", lambda x, w: calls.append(
        [tuple(t.shape) for t in w] if isinstance(w, list) else tuple(w.shape)) or real(x, w))
    g = torch.Generator().manual_seed(fresh_seed)
    a, b = torch.nn.Linear(1024, 24, bias=False), torch.nn.Linear(1024, 40, bias=False)
    for m in (a, b):
        m.weight.data = torch.randn(m.weight.shape, generator=g)
    for rows, form, want in ((9, "rows", [[(24, 1024), (40, 1024)]]), (17, "rows", []), (9, "", [])):
        calls.clear()
        x = torch.randn(1, rows, 1024, generator=g)
        out = gemv.linears([a, b], x, form)
        for y, m in zip(out, (a, b)):
            torch.testing.assert_close(y, m(x), rtol=1e-5, atol=1e-4)
        assert calls == want, (rows, form, calls)


def test_opcheck_cpu(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    x, w = case(gen, 7, 64, 24)
    torch.library.opcheck(torch.ops.kdtree.gemm_rows.default, (x, [w]))
    torch.library.opcheck(torch.ops.kdtree.gemm_rows.default, (x, [w, case(gen, 1, 64, 40)[1]]))


def test_compiles_with_fullgraph_on_cpu(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    x, w = case(gen, 9, 128, 40)
    w2 = case(gen, 1, 128, 24)[1]
    step = lambda x: gemm_rows(torch.nn.functional.silu(x), w).sum(-1)  # noqa: E731
    torch.testing.assert_close(torch.compile(step, fullgraph=True)(x), step(x))
    pair = lambda x: [y.sum(-1) for y in gemm_rows(x * 2, [w, w2])]  # noqa: E731
    torch.testing.assert_close(torch.compile(pair, fullgraph=True)(x), pair(x))


# --------------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------------

CUDA_CASES = [
    (1, 8, 1),          # the smallest: one chunk, one output
    (5, 7168, 1536),    # a B = 4 tree through K2's q_a (split K)
    (16, 1536, 1536),   # one full m16 tile
    (17, 7168, 2112),   # B = 16: two tiles, the second with one row
    (32, 2304, 7168),   # two full tiles, N past many blocks
    (9, 136, 100),      # ragged K (not a multiple of 64) and N (not of 64)
    (3, 65536, 8),      # one block of N, K split many ways
]


@requires_kernel
@pytest.mark.parametrize("M,K,N", CUDA_CASES)
def test_cuda_kernel_matches_reference(fresh_seed, M, K, N):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    x, w = case(gen, M, K, N, torch.bfloat16, "cuda")
    got = gemm_rows(x, w)
    want = gemm_rows_reference(x.cpu(), w.cpu())
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    # the same products in another fp32 order: a bf16 rounding apart at most, element by element
    assert (got.cpu().float() - want.float()).abs().max() <= want.float().abs().max() * 2 ** -7 + 1e-6
    assert rel_err(got.cpu(), want) < 4e-3


@requires_kernel
@pytest.mark.parametrize("M,K,Ns", [
    (5, 7168, (1536, 576)),       # K2's q_a + kv_a at B = 4 (split K, 24 + 9 tiles)
    (17, 7168, (256, 256)),       # the shared expert's gate + up at B = 16 (two m16 tiles)
    (9, 136, (100, 8, 65)),       # three weights, ragged K and N, one-tile weights between
    (3, 65536, (8, 24)),          # K split many ways over two one-block weights
    (12, 1024, (7168, 64, 2048)), # one weight of 112 tiles beside smaller ones
])
def test_cuda_several_weights_match_the_reference(fresh_seed, M, K, Ns):
    """Up to three weights in one launch (their tiles side by side, one split choice, the partials'
    columns at each weight's offset): every output equals that weight's reference within a bf16
    rounding, and the one-weight call's bits where the split choice agrees."""
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    x = torch.randn(M, K, generator=gen, device="cuda").bfloat16()
    ws = [(torch.randn(N, K, generator=gen, device="cuda") / K ** 0.5).bfloat16() for N in Ns]
    got = gemm_rows(x, ws)
    for y, w in zip(got, ws):
        want = gemm_rows_reference(x.cpu(), w.cpu())
        assert y.shape == (M, w.shape[0]) and y.dtype == torch.bfloat16
        assert (y.cpu().float() - want.float()).abs().max() <= want.float().abs().max() * 2 ** -7 + 1e-6
        assert rel_err(y.cpu(), want) < 4e-3
    assert all(torch.equal(a, b) for a, b in zip(gemm_rows(x, ws), got))  # the same bits every call


@requires_kernel
def test_cuda_reads_no_rows_past_m_and_is_deterministic(fresh_seed):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    x, w = case(gen, 17, 1024, 320, torch.bfloat16, "cuda")
    big = torch.full((32, 1024), float("nan"), device="cuda", dtype=torch.bfloat16)
    big[:17] = x
    got = gemm_rows(big[:17], w)
    assert torch.isfinite(got.float()).all()
    assert all(torch.equal(gemm_rows(x, w), got) for _ in range(3))


@requires_kernel
def test_cuda_graph_replays_with_new_inputs(fresh_seed):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    x, w = case(gen, 11, 2048, 512, torch.bfloat16, "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gemm_rows(x, w)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemm_rows(x, w)
    for _ in range(3):
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out.cpu(), gemm_rows_reference(x.cpu(), w.cpu())) < 4e-3


@requires_kernel
def test_opcheck_cuda(fresh_seed):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    x, w = case(gen, 6, 512, 96, torch.bfloat16, "cuda")
    torch.library.opcheck(torch.ops.kdtree.gemm_rows.default, (x, [w]))
    torch.library.opcheck(torch.ops.kdtree.gemm_rows.default, (x, [w, case(gen, 1, 512, 40, torch.bfloat16, "cuda")[1]]))


@requires_kernel
def test_cuda_compiles_with_fullgraph(fresh_seed):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    x, w = case(gen, 13, 1024, 256, torch.bfloat16, "cuda")
    step = lambda x: gemm_rows(torch.nn.functional.silu(x), w).float().sum(-1)  # noqa: E731
    got = torch.compile(step, fullgraph=True)(x)
    torch.testing.assert_close(got, step(x), rtol=2e-2, atol=2e-2)


@requires_kernel
def test_cuda_bad_dtype_raises():
    x = torch.zeros(4, 64, device="cuda")
    with pytest.raises(TypeError, match="bfloat16 on cuda"):
        gemm_rows(x, torch.zeros(8, 64, device="cuda"))
