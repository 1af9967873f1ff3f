"""kdtree::mla_tree_attention: the reference against independent oracles, the CUDA kernel against the
reference, and the op's behaviour under opcheck, torch.compile and CUDA graphs -- over bf16 / fp32
caches and over an fp8 cache (e4m3 rows + fp32 power-of-two scales, ``kv_scale``)."""

import pytest
import torch
import torch.nn.functional as F

from .conftest import rel_err, requires_cuda
from torch_kdtree.models.kimi_k2.cache import fp8_quantize
from torch_kdtree.ops.mla import fp8_rows_to_keys
from torch_kdtree.ops import ddtree_build, mla_tree_attention

D, DV = 576, 512
FP8 = torch.float8_e4m3fn
SCALE = 0.144680  # K2 with YaRN factor 64 (docs/kimi_k2.md)


def random_tree_visible(R, N, gen, device="cpu"):
    """visible [R, N, N] of DDTree trees built by ddtree_build from random sorted log-probs."""
    if N == 1:
        return torch.ones(R, 1, 1, dtype=torch.bool, device=device)
    L = min(16, N - 1)
    K = min(8, N - 1)
    lp = torch.randn(R, L, K, generator=gen).sort(dim=-1, descending=True).values.log_softmax(-1)
    ids = torch.randint(0, 1000, (R, L, K), generator=gen)
    roots = torch.randint(0, 1000, (R,), generator=gen)
    tree = ddtree_build(lp.to(device), ids.to(device), roots.to(device), N - 1)
    return tree.visible


def chain_visible(R, N, device="cpu"):
    return torch.ones(N, N, dtype=torch.bool, device=device).tril().expand(R, N, N).contiguous()


def make_case(R, N, H, page_size, lens, gen, dtype=torch.bfloat16, device="cpu", visible=None, extra_pages=2):
    """Random logical sequences [lens[r] + N, 576] per request, scattered over shuffled physical pages.

    Returns (q, kv_cache, block_table, cache_lens, visible, logical) where logical[r] is request r's
    sequence in position order (what the oracles read, never through the block table)."""
    logical = [torch.randn(L + N, D, generator=gen).to(dtype) for L in lens]
    need = [(L + N + page_size - 1) // page_size for L in lens]
    max_pages = max(need) + 1
    num_pages = sum(need) + extra_pages
    perm = torch.randperm(num_pages, generator=gen)
    kv = torch.full((num_pages, page_size, D), float("nan"), dtype=dtype)  # slots past a length must never be read
    bt = torch.full((R, max_pages), -1, dtype=torch.int32)
    nxt = 0
    for r, L in enumerate(lens):
        pages = perm[nxt: nxt + need[r]]
        nxt += need[r]
        bt[r, : need[r]] = pages.to(torch.int32)
        flat = torch.zeros(need[r] * page_size, D, dtype=dtype)
        flat[: L + N] = logical[r]
        kv[pages] = flat.view(need[r], page_size, D)
    # pages of a request past its length point at a valid page (as a real allocator may leave them)
    bt[bt < 0] = int(perm[0])
    q = torch.randn(R, N, H, D, generator=gen).to(dtype)
    cache_lens = torch.tensor(lens, dtype=torch.int32)
    if visible is None:
        visible = random_tree_visible(R, N, gen)
    return (q.to(device), kv.to(device), bt.to(device), cache_lens.to(device), visible.to(device),
            [x.to(device) for x in logical])


def make_fp8_case(R, N, H, page_size, lens, gen, q_dtype=torch.bfloat16, device="cpu", visible=None):
    """make_case's random sequences quantised as an fp8 cache stores them (the cache's own quantiser,
    ``fp8_quantize``): every row first scaled by 2^k, k uniform in [-10, 2] (scales of many powers of
    two; larger keys would make the softmax nearly hard), and 5 entries per row set to ±2^-15 ..
    2^-21 of the row's max (subnormal e4m3 codes and zeros).  Slots past a length stay NaN (codes
    0x7f, scale NaN): they must never be read.

    Returns (q in q_dtype, kv_cache float8_e4m3fn [num_pages, page_size, 640] (512 e4m3 latent
    values, then 64 bf16 rope values as 128 bytes), kv_scale fp32 [num_pages, page_size],
    block_table, cache_lens, visible, logical) with logical[r] request r's dequantised sequence
    (fp32, exact: e4m3 latent times its scale, bf16 rope) in position order."""
    q, kv, bt, cl, vis, _ = make_case(R, N, H, page_size, lens, gen, dtype=torch.float32, visible=visible)
    rows = kv.view(-1, D).clone()
    used = torch.isfinite(rows).all(-1)
    rows = rows * torch.exp2(torch.randint(-10, 3, (rows.shape[0], 1), generator=gen).float())
    tiny = torch.exp2(-torch.tensor([15.0, 16.0, 17.0, 18.0, 21.0]))
    signs = torch.randint(0, 2, (rows.shape[0], 5), generator=gen).float() * 2 - 1
    rows[:, :5] = rows.abs().amax(-1, keepdim=True) * tiny * signs
    values, scale = fp8_quantize(rows, D - DV)
    values.view(torch.uint8)[~used, :DV] = 0x7F  # e4m3 NaN
    values.view(torch.uint8)[~used, DV:] = 0xFF  # bf16 NaN (0xFFFF)
    scale[~used] = float("nan")
    kv8, scale = values.view(*kv.shape[:2], -1), scale.view(kv.shape[:2]).contiguous()
    deq = fp8_rows_to_keys(kv8, scale)
    logical = []
    for r, L in enumerate(lens):
        pos = torch.arange(L + N)
        logical.append(deq[bt[r].long()[pos // page_size], pos % page_size])
    return (q.to(q_dtype).to(device), kv8.to(device), scale.to(device), bt.to(device), cl.to(device),
            vis.to(device), [x.to(device) for x in logical])


def dequantized(kv8, scale, dtype):
    """The whole fp8 cache as dtype rows [..., 576] (exact in bf16 and fp32: 4 significant bits times
    2^k, and bf16 rope values)."""
    return fp8_rows_to_keys(kv8, scale).to(dtype)


def oracle(q, visible, logical, lens, scale):
    """float64, one (request, node) at a time: keys = the whole prefix + the visible tree entries."""
    R, N, H, _ = q.shape
    out = torch.zeros(R, N, H, DV, dtype=torch.float64)
    lse = torch.zeros(R, N, H, dtype=torch.float64)
    for r in range(R):
        seq = logical[r].double().cpu()
        L = lens[r]
        for i in range(N):
            keys = torch.cat([seq[:L], seq[L:][visible[r, i].cpu()]])
            s = q[r, i].double().cpu() @ keys.T * scale  # [H, keys]
            lse[r, i] = torch.logsumexp(s, -1)
            out[r, i] = torch.softmax(s, -1) @ keys[:, :DV]
    return out, lse


# ---------------------------------------------------------------------------------------------
# CPU: the reference
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 6e-3)])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_reference_matches_float64_oracle_on_ddtree_trees(fresh_seed, dtype, tol, page_size):
    gen = torch.Generator().manual_seed(fresh_seed)
    lens = [0, 37, 130]
    q, kv, bt, cl, vis, logical = make_case(3, 9, 4, page_size, lens, gen, dtype=dtype)
    out, lse = mla_tree_attention(q, kv, bt, cl, vis, SCALE, return_lse=True)
    assert out.dtype == dtype and out.shape == (3, 9, 4, DV)
    ref_out, ref_lse = oracle(q, vis, logical, lens, SCALE)
    assert rel_err(out, ref_out) < tol
    assert rel_err(lse, ref_lse) < 1e-5


def test_single_node_equals_plain_decode_attention(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    lens = [50, 3]
    q, kv, bt, cl, vis, logical = make_case(2, 1, 8, 16, lens, gen, dtype=torch.float32)
    out = mla_tree_attention(q, kv, bt, cl, vis, SCALE)
    for r in range(2):
        keys = logical[r]  # prefix + the node itself
        want = F.scaled_dot_product_attention(q[r, 0][:, None, :], keys[None].expand(8, -1, -1),
                                              keys[None, :, :DV].expand(8, -1, -1), scale=SCALE)
        torch.testing.assert_close(out[r, 0], want[:, 0], rtol=1e-5, atol=1e-5)


def test_chain_tree_equals_causal_attention(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    lens = [40, 0]
    N, H = 7, 4
    q, kv, bt, cl, vis, logical = make_case(2, N, H, 8, lens, gen, dtype=torch.float32, visible=chain_visible(2, N))
    out = mla_tree_attention(q, kv, bt, cl, vis, SCALE)
    for r, L in enumerate(lens):
        # causal attention over the whole sequence; the prefix queries are arbitrary
        q_full = torch.cat([torch.randn(L, H, D, generator=gen), q[r]]).transpose(0, 1)  # [H, L+N, D]
        keys = logical[r][None].expand(H, -1, -1)
        want = F.scaled_dot_product_attention(q_full, keys, keys[..., :DV], is_causal=True, scale=SCALE)
        torch.testing.assert_close(out[r], want[:, L:].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_out_variant_writes_out_and_lse_like_the_functional_op(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    q, kv, bt, cl, vis, logical = make_case(2, 5, 2, 4, [9, 21], gen)
    out = torch.full((2, 5, 2, DV), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((2, 5, 2), float("nan"))
    got = mla_tree_attention(q, kv, bt, cl, vis, SCALE, out=out)
    assert got is out
    torch.ops.kdtree.mla_tree_attention_out(q, kv, bt, cl, vis, SCALE, out, lse)
    want = torch.ops.kdtree.mla_tree_attention(q, kv, bt, cl, vis, SCALE)
    assert torch.equal(out, want)
    _, ref_lse = oracle(q, vis, logical, [9, 21], SCALE)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=1e-4)


def test_row_that_sees_nothing_gives_zero_and_minus_inf_lse():
    gen = torch.Generator().manual_seed(0)
    vis = torch.eye(3, dtype=torch.bool)[None].clone()
    vis[0, 1, 1] = False
    q, kv, bt, cl, vis, _ = make_case(1, 3, 2, 4, [0], gen, visible=vis)
    out, lse = mla_tree_attention(q, kv, bt, cl, vis, SCALE, return_lse=True)
    assert torch.equal(out[0, 1], torch.zeros(2, DV, dtype=out.dtype)) and (lse[0, 1] == float("-inf")).all()
    assert torch.isfinite(lse[0, 0]).all() and torch.isfinite(lse[0, 2]).all()


def _bad_case():
    gen = torch.Generator().manual_seed(1)
    return make_case(2, 3, 2, 4, [5, 6], gen)


@pytest.mark.parametrize("mutate,err,match", [
    (lambda a: a.update(q=a["q"][..., :512].contiguous()), ValueError, "head dim must be 576"),
    (lambda a: a.update(kv_cache=a["kv_cache"][..., :512].contiguous()), ValueError, r"\[num_pages, page_size, 576\]"),
    (lambda a: a.update(block_table=a["block_table"][:, :2].contiguous()), ValueError, "too few"),
    (lambda a: a.update(cache_lens=torch.tensor([5, -1], dtype=torch.int32)), ValueError, "non-negative"),
    (lambda a: a.update(block_table=a["block_table"] + 1000), ValueError, "page ids"),
    (lambda a: a.update(q=a["q"].half()), TypeError, "q must be"),
    (lambda a: a.update(kv_cache=a["kv_cache"].float()), TypeError, "must equal q dtype"),
    (lambda a: a.update(block_table=a["block_table"].long()), TypeError, "block_table must be torch.int32"),
    (lambda a: a.update(cache_lens=a["cache_lens"].long()), TypeError, "cache_lens must be torch.int32"),
    (lambda a: a.update(visible=a["visible"].to(torch.uint8)), TypeError, "visible must be torch.bool"),
    (lambda a: a.update(visible=a["visible"][:, :2].contiguous()), ValueError, r"visible must be \[R, N, N\]"),
    (lambda a: a.update(cache_lens=a["cache_lens"][:1].contiguous()), ValueError, "R = 2 rows"),
    (lambda a: a.update(q=a["q"].transpose(1, 2)), ValueError, "contiguous"),
])
def test_bad_inputs_raise_clear_errors(mutate, err, match):
    q, kv, bt, cl, vis, _ = _bad_case()
    args = dict(q=q, kv_cache=kv, block_table=bt, cache_lens=cl, visible=vis)
    mutate(args)
    with pytest.raises(err, match=match):
        mla_tree_attention(args["q"], args["kv_cache"], args["block_table"], args["cache_lens"], args["visible"], SCALE)


def test_bad_out_buffers_raise_clear_errors():
    q, kv, bt, cl, vis, _ = _bad_case()
    with pytest.raises(ValueError, match="out must be"):
        mla_tree_attention(q, kv, bt, cl, vis, SCALE, out=torch.empty(2, 3, 2, 576, dtype=q.dtype))
    with pytest.raises(TypeError, match="out must be"):
        mla_tree_attention(q, kv, bt, cl, vis, SCALE, out=torch.empty(2, 3, 2, DV))


def test_opcheck_cpu():
    gen = torch.Generator().manual_seed(2)
    q, kv, bt, cl, vis, _ = make_case(2, 4, 2, 8, [11, 3], gen)
    torch.library.opcheck(torch.ops.kdtree.mla_tree_attention.default, (q, kv, bt, cl, vis, SCALE))
    out = torch.empty(2, 4, 2, DV, dtype=q.dtype)
    lse = torch.empty(2, 4, 2)
    torch.library.opcheck(torch.ops.kdtree.mla_tree_attention_out.default, (q, kv, bt, cl, vis, SCALE, out, lse))
    torch.library.opcheck(torch.ops.kdtree.mla_tree_attention_out.default, (q, kv, bt, cl, vis, SCALE, out, None))
    torch.library.opcheck(torch.ops.kdtree.mla_tree_attention.default, (q, kv, bt, cl, vis, SCALE, True))
    torch.library.opcheck(torch.ops.kdtree.mla_tree_attention_out.default, (q, kv, bt, cl, vis, SCALE, out, lse, True))


def test_prefix_ready_does_not_change_the_result_cpu(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    q, kv, bt, cl, vis, _ = make_case(2, 4, 2, 8, [11, 3], gen)
    want = mla_tree_attention(q, kv, bt, cl, vis, SCALE)
    assert torch.equal(mla_tree_attention(q, kv, bt, cl, vis, SCALE, prefix_ready=True), want)


def test_torch_compile_fullgraph_cpu(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    q, kv, bt, cl, vis, _ = make_case(2, 4, 2, 8, [11, 3], gen, dtype=torch.float32)

    def step(q, kv, bt, cl, vis, out):
        o = mla_tree_attention(q, kv, bt, cl, vis, SCALE)
        o2, lse = mla_tree_attention(q * 2, kv, bt, cl, vis, SCALE, out=out, return_lse=True)
        return o + 1, o2, lse

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    got = compiled(q, kv, bt, cl, vis, torch.empty(2, 4, 2, DV))
    want = step(q, kv, bt, cl, vis, torch.empty(2, 4, 2, DV))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


# ---------------------------------------------------------------------------------------------
# CPU: an fp8 cache
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_fp8_cache_equals_the_op_on_the_dequantised_cache(fresh_seed, q_dtype, page_size):
    """The independent oracle: dequantise the whole cache first (kv * scale, exact in bf16 and fp32)
    and call the op on those rows -- the fp8 call gives the same bits, out and lse; and both are
    within the bf16 / fp32 tolerance of the float64 oracle on the dequantised sequences."""
    gen = torch.Generator().manual_seed(fresh_seed)
    lens = [0, 37, 130]
    q, kv8, scale, bt, cl, vis, logical = make_fp8_case(3, 9, 4, page_size, lens, gen, q_dtype=q_dtype)
    codes = kv8.view(torch.uint8)
    assert bool((((codes & 0x78) == 0) & ((codes & 0x07) != 0)).any()), "no subnormal e4m3 codes in the case"
    assert len(set(torch.log2(scale[torch.isfinite(scale)]).tolist())) >= 10, "too few distinct scales"
    out, lse = mla_tree_attention(q, kv8, bt, cl, vis, SCALE, return_lse=True, kv_scale=scale)
    assert out.dtype == q_dtype and out.shape == (3, 9, 4, DV)
    want, want_lse = mla_tree_attention(q, dequantized(kv8, scale, q_dtype), bt, cl, vis, SCALE, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    ref_out, ref_lse = oracle(q, vis, logical, lens, SCALE)
    assert rel_err(out, ref_out) < (1e-5 if q_dtype == torch.float32 else 6e-3)
    assert rel_err(lse, ref_lse) < 1e-5


def test_fp8_out_variant_and_functional_op_agree(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    q, kv8, scale, bt, cl, vis, _ = make_fp8_case(2, 5, 2, 4, [9, 21], gen)
    out = torch.full((2, 5, 2, DV), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((2, 5, 2), float("nan"))
    torch.ops.kdtree.mla_tree_attention_out(q, kv8, bt, cl, vis, SCALE, out, lse, False, scale)
    want = torch.ops.kdtree.mla_tree_attention(q, kv8, bt, cl, vis, SCALE, False, scale)
    assert torch.equal(out, want)
    assert torch.equal(mla_tree_attention(q, kv8, bt, cl, vis, SCALE, kv_scale=scale, prefix_ready=True), want)


def _bad_fp8_case():
    gen = torch.Generator().manual_seed(3)
    q, kv8, scale, bt, cl, vis, _ = make_fp8_case(2, 3, 2, 4, [5, 6], gen)
    return dict(q=q, kv_cache=kv8, block_table=bt, cache_lens=cl, visible=vis, kv_scale=scale)


@pytest.mark.parametrize("mutate,err,match", [
    (lambda a: a.update(kv_scale=None), ValueError,
     r"kv_scale is required with a torch.float8_e4m3fn kv_cache: float32 \[num_pages, page_size\]"),
    (lambda a: a.update(kv_scale=a["kv_scale"].half()), TypeError, "kv_scale must be torch.float32"),
    (lambda a: a.update(kv_scale=a["kv_scale"][:, :2].contiguous()), ValueError,
     r"kv_scale must be float32 \[num_pages, page_size\] = \(\d+, 4\).*got \(\d+, 2\)"),
    (lambda a: a.update(kv_scale=a["kv_scale"][None]), ValueError, r"kv_scale must be float32 \[num_pages, page_size\]"),
    (lambda a: a.update(kv_scale=a["kv_scale"].t().contiguous().t()), ValueError, "kv_scale must be contiguous"),
    (lambda a: a.update(kv_scale=a["kv_scale"].to("meta")), ValueError, "kv_scale on meta"),
    (lambda a: a.update(kv_cache=a["kv_cache"].view(torch.uint8).view(torch.float8_e5m2)), TypeError,
     "kv_cache must be .*float8_e4m3fn, got torch.float8_e5m2"),
    (lambda a: a.update(q=a["q"].half()), TypeError, "q must be"),
    (lambda a: a.update(kv_cache=dequantized(a["kv_cache"], a["kv_scale"], torch.float32)), TypeError,
     "must equal q dtype"),
    (lambda a: a.update(kv_cache=dequantized(a["kv_cache"], a["kv_scale"], torch.bfloat16)), ValueError,
     "kv_scale is given but kv_cache is torch.bfloat16: scales belong to a torch.float8_e4m3fn cache"),
    # the all-e4m3 rows of 576 bytes (session 39's layout) are not this cache's
    (lambda a: a.update(kv_cache=a["kv_cache"][..., :576].contiguous()), ValueError,
     r"a torch.float8_e4m3fn kv_cache must be \[num_pages, page_size, 640\] \(512 e4m3 latent values, then 64 bf16"),
])
def test_fp8_bad_inputs_raise_clear_errors(mutate, err, match):
    args = _bad_fp8_case()
    mutate(args)
    with pytest.raises(err, match=match):
        mla_tree_attention(args["q"], args["kv_cache"], args["block_table"], args["cache_lens"], args["visible"], SCALE,
                           kv_scale=args["kv_scale"])
    if any(isinstance(t, torch.Tensor) and t.is_meta for t in args.values()):
        return  # the dispatcher sends a call with a meta tensor to the fake kernel: the wrapper's check
    with pytest.raises(err, match=match):  # the op itself (its CPU kernel checks the same)
        torch.ops.kdtree.mla_tree_attention(args["q"], args["kv_cache"], args["block_table"], args["cache_lens"],
                                            args["visible"], SCALE, False, args["kv_scale"])


def test_mla_tree_attention_output_refuses_an_fp8_cache():
    from torch_kdtree.ops import mla_tree_attention_output
    args = _bad_fp8_case()
    w = torch.zeros(2 * (128 + 128), DV, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="mla_tree_attention_output: kv_cache must be q's dtype, got "
                                        "torch.float8_e4m3fn: an fp8 cache is read by mla_tree_attention"):
        mla_tree_attention_output(args["q"], args["kv_cache"], args["block_table"], args["cache_lens"],
                                  args["visible"], SCALE, w, 128)


# opcheck's test_schema compares every input before and after with torch.allclose, which has no
# float8 kernel on the CPU; the bf16 opchecks run it on the same schema, and the fp8 inputs are
# checked unchanged here bit for bit.
FP8_OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _opcheck_fp8(q, kv8, scale, bt, cl, vis, out, lse):
    def raw(*ts):  # bytes (NaN scales of unused slots compare equal to themselves)
        return [t.view(torch.uint8) if t.is_floating_point() else t for t in ts]

    before = [t.clone() for t in raw(q, kv8, scale, bt, cl, vis)]
    for prefix_ready in (False, True):
        torch.library.opcheck(torch.ops.kdtree.mla_tree_attention.default,
                              (q, kv8, bt, cl, vis, SCALE, prefix_ready, scale), test_utils=FP8_OPCHECK_UTILS)
        torch.library.opcheck(torch.ops.kdtree.mla_tree_attention_out.default,
                              (q, kv8, bt, cl, vis, SCALE, out, lse, prefix_ready, scale), test_utils=FP8_OPCHECK_UTILS)
        torch.library.opcheck(torch.ops.kdtree.mla_tree_attention_out.default,
                              (q, kv8, bt, cl, vis, SCALE, out, None, prefix_ready, scale),
                              test_utils=FP8_OPCHECK_UTILS)
    after = raw(q, kv8, scale, bt, cl, vis)
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "an input the schema does not mark mutable changed"


def test_opcheck_cpu_fp8():
    gen = torch.Generator().manual_seed(4)
    q, kv8, scale, bt, cl, vis, _ = make_fp8_case(2, 4, 2, 8, [11, 3], gen)
    _opcheck_fp8(q, kv8, scale, bt, cl, vis, torch.empty(2, 4, 2, DV, dtype=q.dtype), torch.empty(2, 4, 2))


def test_torch_compile_fullgraph_cpu_fp8(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    q, kv8, scale, bt, cl, vis, _ = make_fp8_case(2, 4, 2, 8, [11, 3], gen, q_dtype=torch.float32)

    def step(q, kv, scale, bt, cl, vis, out):
        o = mla_tree_attention(q, kv, bt, cl, vis, SCALE, kv_scale=scale)
        o2, lse = mla_tree_attention(q * 2, kv, bt, cl, vis, SCALE, out=out, return_lse=True, kv_scale=scale * 2)
        return o + 1, o2, lse

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    got = compiled(q, kv8, scale, bt, cl, vis, torch.empty(2, 4, 2, DV))
    want = step(q, kv8, scale, bt, cl, vis, torch.empty(2, 4, 2, DV))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


# ---------------------------------------------------------------------------------------------
# CUDA: the kernel against the reference (fresh inputs every run, outputs poisoned first)
# ---------------------------------------------------------------------------------------------

BF16_TOL = 1e-2  # ||out - ref|| / ||ref||: P and out are rounded to bf16 (about 2e-3 seen in emulation)


def _cuda_case(R, N, H, page_size, lens, seed):
    gen = torch.Generator().manual_seed(seed)
    vis = random_tree_visible(R, N, gen, device="cuda")  # the CUDA ddtree_build kernel
    return make_case(R, N, H, page_size, lens, gen, device="cuda", visible=vis)


def _reference_on_cuda(q, kv, bt, cl, vis):
    """(out, lse) of the pure-torch reference, run on the CUDA tensors themselves (float32 math)."""
    from torch_kdtree.ops.mla import _attend
    return _attend(q, kv, bt, cl, vis, SCALE)


def _kernel_vs_reference(q, kv, bt, cl, vis):
    R, N, H, _ = q.shape
    out = torch.full((R, N, H, DV), float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.full((R, N, H), float("nan"), device="cuda")
    torch.ops.kdtree.mla_tree_attention_out(q, kv, bt, cl, vis, SCALE, out, lse)
    ref, ref_lse = _reference_on_cuda(q, kv, bt, cl, vis)
    assert not torch.isnan(out).any(), "unwritten or NaN outputs"
    err = rel_err(out, ref)
    assert err < BF16_TOL, f"relative error {err:.3e}"
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=2e-3)
    assert torch.equal(torch.ops.kdtree.mla_tree_attention(q, kv, bt, cl, vis, SCALE), out)
    # prefix_ready (committed key tiles copied before the programmatic-launch wait) changes only
    # when the copies are issued: the same bits
    out2 = torch.full_like(out, float("nan"))
    lse2 = torch.full_like(lse, float("nan"))
    torch.ops.kdtree.mla_tree_attention_out(q, kv, bt, cl, vis, SCALE, out2, lse2, True)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    return err


@requires_cuda
@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
@pytest.mark.parametrize("R,N,H,lens", [
    (1, 1, 8, [700]),                 # decode, 8 rows: the 16-row tile, split over the sequence
    (3, 1, 16, [31, 40, 64]),         # decode: committed key tiles whole, cut by L, or none
    (3, 5, 8, [0, 333, 2000]),        # ragged, an empty prefix, tree tiles straddling pages
    (2, 17, 16, [4097, 65]),          # 272 rows: several 64-row blocks, one partial
    (1, 3, 128, [1500]),              # H = 128
    (2, 64, 8, [100, 3000]),          # 512 rows
])
def test_cuda_kernel_matches_reference(fresh_seed, page_size, R, N, H, lens):
    _kernel_vs_reference(*_cuda_case(R, N, H, page_size, lens, fresh_seed)[:5])


@requires_cuda
@pytest.mark.parametrize("H", [8, 32, 64])
def test_cuda_kernel_matches_reference_at_1025_nodes(fresh_seed, H):
    _kernel_vs_reference(*_cuda_case(2, 1025, H, 64, [3000, 40], fresh_seed)[:5])


@requires_cuda
@pytest.mark.parametrize("N,H", [(1, 8), (16, 8), (4, 64)])
def test_cuda_kernel_matches_reference_past_128k_context(fresh_seed, N, H):
    _kernel_vs_reference(*_cuda_case(2, N, H, 256, [131072 + 4321, 9000], fresh_seed)[:5])


@requires_cuda
def test_cuda_single_node_equals_plain_decode_attention(fresh_seed):
    q, kv, bt, cl, vis, logical = _cuda_case(2, 1, 64, 64, [5000, 77], fresh_seed)
    out = mla_tree_attention(q, kv, bt, cl, vis, SCALE)
    for r in range(2):
        keys = logical[r].float()
        want = F.scaled_dot_product_attention(q[r, 0].float()[:, None], keys[None].expand(64, -1, -1),
                                              keys[None, :, :DV].expand(64, -1, -1), scale=SCALE)[:, 0]
        assert rel_err(out[r, 0], want) < BF16_TOL


@requires_cuda
def test_cuda_chain_tree_equals_causal_attention(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    N, H, L = 40, 8, 3000
    q, kv, bt, cl, vis, logical = make_case(1, N, H, 64, [L], gen, device="cuda", visible=chain_visible(1, N))
    out = mla_tree_attention(q, kv, bt, cl, vis, SCALE)
    q_full = torch.cat([torch.randn(L, H, D, device="cuda"), q[0].float()]).transpose(0, 1)
    keys = logical[0].float()[None].expand(H, -1, -1)
    want = F.scaled_dot_product_attention(q_full, keys, keys[..., :DV], is_causal=True, scale=SCALE)
    assert rel_err(out[0], want[:, L:].transpose(0, 1)) < BF16_TOL


@requires_cuda
def test_cuda_kernel_is_deterministic(fresh_seed):
    q, kv, bt, cl, vis, _ = _cuda_case(1, 2, 8, 16, [50000], fresh_seed)  # many splits and a combine
    a = mla_tree_attention(q, kv, bt, cl, vis, SCALE)
    b = mla_tree_attention(q, kv, bt, cl, vis, SCALE)
    assert torch.equal(a, b)


@requires_cuda
def test_cuda_bad_inputs_raise_clear_errors():
    q, kv, bt, cl, vis, _ = _cuda_case(1, 2, 8, 16, [40], 0)  # 42 positions: 3 pages of 16
    with pytest.raises(RuntimeError, match="(?i)bfloat16"):
        torch.ops.kdtree.mla_tree_attention(q.float(), kv.float(), bt, cl, vis, SCALE)
    with pytest.raises(RuntimeError, match="head dim must be 576"):
        torch.ops.kdtree.mla_tree_attention(q[..., :512].contiguous(), kv, bt, cl, vis, SCALE)
    with pytest.raises(RuntimeError, match="too few"):
        torch.ops.kdtree.mla_tree_attention(q, kv, bt[:, :0].contiguous(), cl, vis, SCALE)
    with pytest.raises(ValueError, match="too few"):
        # eager value check in the wrapper: 30 committed + 2 nodes need 2 pages of 16, the table has 1
        mla_tree_attention(q, kv, bt[:, :1].contiguous(), cl + 20, vis, SCALE)


@requires_cuda
def test_opcheck_cuda():
    q, kv, bt, cl, vis, _ = _cuda_case(2, 4, 8, 16, [300, 7], 3)
    torch.library.opcheck(torch.ops.kdtree.mla_tree_attention.default, (q, kv, bt, cl, vis, SCALE))
    out = torch.empty(2, 4, 8, DV, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(2, 4, 8, device="cuda")
    torch.library.opcheck(torch.ops.kdtree.mla_tree_attention_out.default, (q, kv, bt, cl, vis, SCALE, out, lse))
    torch.library.opcheck(torch.ops.kdtree.mla_tree_attention_out.default, (q, kv, bt, cl, vis, SCALE, out, None))
    torch.library.opcheck(torch.ops.kdtree.mla_tree_attention.default, (q, kv, bt, cl, vis, SCALE, True))
    torch.library.opcheck(torch.ops.kdtree.mla_tree_attention_out.default, (q, kv, bt, cl, vis, SCALE, out, lse, True))


@requires_cuda
def test_torch_compile_fullgraph_cuda(fresh_seed):
    q, kv, bt, cl, vis, _ = _cuda_case(2, 8, 16, 64, [1000, 20000], fresh_seed)

    def step(q, kv, bt, cl, vis, out):
        o, lse = mla_tree_attention(q, kv, bt, cl, vis, SCALE, out=out, return_lse=True)
        return o.float().sum(-1), lse + 1

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    got = compiled(q, kv, bt, cl, vis, torch.empty(2, 8, 16, DV, device="cuda", dtype=torch.bfloat16))
    want = step(q, kv, bt, cl, vis, torch.empty(2, 8, 16, DV, device="cuda", dtype=torch.bfloat16))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@requires_cuda
@pytest.mark.parametrize("prefix_ready", [False, True])
def test_cuda_graph_replays_with_changed_lengths(fresh_seed, prefix_ready):
    gen = torch.Generator().manual_seed(fresh_seed)
    R, N, H, page_size = 2, 16, 8, 64
    # the block table covers 40k positions; lengths change between replays, shapes never do
    q, kv, bt, cl, vis, _ = make_case(R, N, H, page_size, [40000 - N, 40000 - N], gen, device="cuda",
                                      visible=random_tree_visible(R, N, gen, device="cuda"))
    _check_replays_with_changed_lengths(
        lambda lens, out, lse: torch.ops.kdtree.mla_tree_attention_out(q, kv, bt, lens, vis, SCALE, out, lse,
                                                                       prefix_ready),
        lambda lens: _reference_on_cuda(q, kv, bt, lens, vis)[0], R, N, H)


def _check_replays_with_changed_lengths(run, reference, R, N, H):
    """``run(lens, out, lse)`` (mla_tree_attention_out over a block table of 40k positions) captured
    in a CUDA graph, replayed with the lengths changed in place (shapes never change): every replay
    writes all of ``out`` and stays within BF16_TOL of ``reference(lens)``."""
    out = torch.full((R, N, H, DV), float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(R, N, H, device="cuda")
    static_lens = torch.tensor([10, 10], dtype=torch.int32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run(static_lens, out, lse)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(static_lens, out, lse)
    for lens in ([10, 10], [39000, 5], [0, 25000], [40000 - N, 257]):
        static_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        assert not torch.isnan(out).any()
        assert rel_err(out, reference(static_lens)) < BF16_TOL, lens


# ---------------------------------------------------------------------------------------------
# CUDA: an fp8 cache (e4m3 rows + power-of-two scales, converted to bf16 keys in shared memory)
# ---------------------------------------------------------------------------------------------

def _cuda_fp8_case(R, N, H, page_size, lens, seed):
    gen = torch.Generator().manual_seed(seed)
    vis = random_tree_visible(R, N, gen, device="cuda")
    return make_fp8_case(R, N, H, page_size, lens, gen, device="cuda", visible=vis)


def _fp8_kernel_vs_reference(q, kv8, scale, bt, cl, vis):
    """The fp8 kernel against the reference (fp32 math on the gathered rows times their scales), and
    bit for bit against the bf16 kernel on the dequantised cache at every N·H: the shared-memory
    conversion gives exactly the dequantised latent keys, the rope is read as stored, Q·Kᵀ runs the
    bf16 path's k-steps in its order, and the tiles and splits are bf16's (mla.cu's header; session
    41's layout, whose fp8 could not have the 64-row tile, differed above 16 rows: run 188).
    prefix_ready and the functional op give the same bits as the fp8 call."""
    from torch_kdtree.ops.mla import _attend
    R, N, H, _ = q.shape
    out = torch.full((R, N, H, DV), float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.full((R, N, H), float("nan"), device="cuda")
    torch.ops.kdtree.mla_tree_attention_out(q, kv8, bt, cl, vis, SCALE, out, lse, False, scale)
    ref, ref_lse = _attend(q, kv8, bt, cl, vis, SCALE, scale)
    assert not torch.isnan(out).any(), "unwritten or NaN outputs"
    err = rel_err(out, ref)
    assert err < BF16_TOL, f"relative error {err:.3e}"
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=2e-3)
    bf16_out, bf16_lse = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
    torch.ops.kdtree.mla_tree_attention_out(q, dequantized(kv8, scale, torch.bfloat16), bt, cl, vis, SCALE, bf16_out,
                                            bf16_lse)
    assert torch.equal(out, bf16_out) and torch.equal(lse, bf16_lse), "fp8 keys differ from the dequantised bf16 keys"
    assert torch.equal(torch.ops.kdtree.mla_tree_attention(q, kv8, bt, cl, vis, SCALE, False, scale), out)
    out2, lse2 = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
    torch.ops.kdtree.mla_tree_attention_out(q, kv8, bt, cl, vis, SCALE, out2, lse2, True, scale)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    return err


@requires_cuda
@pytest.mark.parametrize("lens", [[700, 33], [20000, 4097]])  # both split over the sequence (R = 2)
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("H", [8, 16, 64])
@pytest.mark.parametrize("N", [1, 5, 17, 65])
def test_cuda_fp8_kernel_matches_reference(fresh_seed, N, H, page_size, lens):
    """N·H from 8 rows (decode: the 16-row tile) to 4160 (verify-sized: the 64-row tile), fresh random
    rows whose scales span many powers of two, with subnormal e4m3 codes and zeros, and bf16 rope
    values."""
    _fp8_kernel_vs_reference(*_cuda_fp8_case(2, N, H, page_size, lens, fresh_seed)[:6])


@requires_cuda
@pytest.mark.parametrize("N,H", [(1, 8), (16, 8), (4, 64)])
def test_cuda_fp8_kernel_matches_reference_past_128k_context(fresh_seed, N, H):
    _fp8_kernel_vs_reference(*_cuda_fp8_case(2, N, H, 256, [131072 + 4321, 9000], fresh_seed)[:6])


@requires_cuda
def test_cuda_fp8_bad_inputs_raise_clear_errors():
    q, kv8, scale, bt, cl, vis, _ = _cuda_fp8_case(1, 2, 8, 16, [40], 0)
    op = torch.ops.kdtree.mla_tree_attention
    with pytest.raises(RuntimeError, match="kv_scale is required with a Float8_e4m3fn kv_cache"):
        op(q, kv8, bt, cl, vis, SCALE)
    with pytest.raises(RuntimeError, match="kv_scale must be Float"):
        op(q, kv8, bt, cl, vis, SCALE, False, scale.half())
    with pytest.raises(RuntimeError, match=r"kv_scale must be float32 \[num_pages, page_size\]"):
        op(q, kv8, bt, cl, vis, SCALE, False, scale[:, :3].contiguous())
    with pytest.raises(RuntimeError, match="kv_scale is given but kv_cache is BFloat16"):
        op(q, dequantized(kv8, scale, torch.bfloat16), bt, cl, vis, SCALE, False, scale)
    with pytest.raises(RuntimeError, match="kv_cache must be BFloat16 or Float8_e4m3fn"):
        op(q, kv8.view(torch.uint8).view(torch.float8_e5m2), bt, cl, vis, SCALE, False, scale)
    with pytest.raises(RuntimeError, match="q must be BFloat16"):
        op(q.float(), kv8, bt, cl, vis, SCALE, False, scale)
    with pytest.raises(RuntimeError, match=r"an fp8 kv_cache must be \[num_pages, page_size, 640\]"):
        op(q, kv8[..., :576].contiguous(), bt, cl, vis, SCALE, False, scale)
    with pytest.raises(RuntimeError, match="kv_scale must be a CUDA tensor"):
        op(q, kv8, bt, cl, vis, SCALE, False, scale.cpu())
    w = torch.zeros(8 * (128 + 128), DV, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="kv_cache must be BFloat16, got Float8_e4m3fn"):
        torch.ops.kdtree.mla_tree_attention_output(q, kv8, bt, cl, vis, SCALE, w, 128)


@requires_cuda
def test_opcheck_cuda_fp8():
    q, kv8, scale, bt, cl, vis, _ = _cuda_fp8_case(2, 4, 8, 16, [300, 7], 3)
    _opcheck_fp8(q, kv8, scale, bt, cl, vis, torch.empty(2, 4, 8, DV, device="cuda", dtype=torch.bfloat16),
                 torch.empty(2, 4, 8, device="cuda"))


@requires_cuda
def test_torch_compile_fullgraph_cuda_fp8(fresh_seed):
    q, kv8, scale, bt, cl, vis, _ = _cuda_fp8_case(2, 8, 16, 64, [1000, 20000], fresh_seed)

    def step(q, kv, scale, bt, cl, vis, out):
        o, lse = mla_tree_attention(q, kv, bt, cl, vis, SCALE, out=out, return_lse=True, kv_scale=scale)
        return o.float().sum(-1), lse + 1

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    got = compiled(q, kv8, scale, bt, cl, vis, torch.empty(2, 8, 16, DV, device="cuda", dtype=torch.bfloat16))
    want = step(q, kv8, scale, bt, cl, vis, torch.empty(2, 8, 16, DV, device="cuda", dtype=torch.bfloat16))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@requires_cuda
@pytest.mark.parametrize("N,H", [(1, 8), (16, 8)])
def test_cuda_fp8_graph_replays_with_changed_lengths(fresh_seed, N, H):
    gen = torch.Generator().manual_seed(fresh_seed)
    R, page_size = 2, 64
    q, kv8, scale, bt, cl, vis, _ = make_fp8_case(R, N, H, page_size, [40000 - N, 40000 - N], gen, device="cuda",
                                                  visible=random_tree_visible(R, N, gen, device="cuda"))
    from torch_kdtree.ops.mla import _attend
    _check_replays_with_changed_lengths(
        lambda lens, out, lse: torch.ops.kdtree.mla_tree_attention_out(q, kv8, bt, lens, vis, SCALE, out, lse, True,
                                                                       scale),
        lambda lens: _attend(q, kv8, bt, lens, vis, SCALE, scale)[0], R, N, H)
