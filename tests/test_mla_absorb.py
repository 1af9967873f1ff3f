"""kdtree::mla_prepare and kdtree::mla_output: the references against float64 oracles written from
the definitions (complex-number RoPE, a norm from vector_norm, per-head matrix products), the
model's own torch path, the CUDA kernels against the references on fresh random inputs, opcheck,
torch.compile, CUDA graphs and bad inputs."""
import math

import pytest
import torch

from conftest import HAS_CUDA, poison_cuda_allocator, requires_cuda_kernel
from torch_kdtree.ops import mla_output, mla_output_reference, mla_prepare, mla_prepare_reference

requires_prepare_cuda = requires_cuda_kernel("kdtree::mla_prepare")
requires_output_cuda = requires_cuda_kernel("kdtree::mla_output")

# (M tokens, heads, dn, dv, dc, dr, interleave)
CASES = [(1, 8, 128, 128, 512, 64, True), (3, 16, 128, 128, 512, 64, True), (5, 4, 64, 32, 256, 32, False),
         (17, 2, 128, 128, 512, 64, True)]


def _inputs(seed, M, heads, dn, dv, dc, dr, dtype=torch.bfloat16, device="cpu", layers=3, pages=6, page_size=16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(M, heads, dn + dr, generator=g)
    ckv = torch.randn(M, dc + dr, generator=g) * 3
    ang = torch.rand(M, dr // 2, generator=g) * 50
    nw = torch.rand(dc, generator=g) + 0.5
    w = torch.randn(heads * (dn + dv), dc, generator=g) / math.sqrt(dn)
    kv = torch.randn(layers, pages, page_size, dc + dr, generator=g)
    slots = torch.randperm(pages * page_size, generator=g)[:M]
    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return dict(q=cast(q), ckv=cast(ckv), cos=ang.cos().to(device), sin=ang.sin().to(device), norm_weight=cast(nw),
                eps=1e-6, w_kv_b=cast(w), kv_cache=cast(kv), layer=1, slots=slots.to(device))


def _call(fn, a, interleave):
    return fn(a["q"], a["ckv"], a["cos"], a["sin"], a["norm_weight"], a["eps"], a["w_kv_b"], a["kv_cache"],
              a["layer"], a["slots"], interleave)


def _oracle(a, interleave):
    """float64 from the definitions: RoPE as a complex rotation, the norm from vector_norm, the
    absorption as one matrix product per head.  Returns (query, cache rows of the slots)."""
    q, ckv = a["q"].double(), a["ckv"].double()
    dc = a["norm_weight"].shape[0]
    dr = a["kv_cache"].shape[-1] - dc
    M, heads, qd = q.shape
    dn = qd - dr
    rot = torch.complex(a["cos"].double(), a["sin"].double())  # e^{i theta}, [M, dr / 2]

    def rope(x):  # [..., dr] -> [x1 c - x2 s | x2 c + x1 s]
        x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., : dr // 2], x[..., dr // 2:])
        z = torch.complex(x1, x2) * rot.view(M, *([1] * (x.dim() - 2)), dr // 2)
        return torch.cat([z.real, z.imag], dim=-1)

    c = ckv[:, :dc]
    rms = torch.linalg.vector_norm(c, dim=-1, keepdim=True) / math.sqrt(dc)
    latent = torch.cat([a["norm_weight"].double() * c / torch.sqrt(rms ** 2 + a["eps"]), rope(ckv[:, dc:])], -1)
    dv = a["w_kv_b"].shape[0] // heads - dn
    w = a["w_kv_b"].double()
    q_abs = torch.stack([q[:, h, :dn] @ w[h * (dn + dv): h * (dn + dv) + dn] for h in range(heads)], dim=1)
    return torch.cat([q_abs, rope(q[:, :, dn:])], dim=-1), latent


def _compiled_graph(fn):
    """torch.compile(fn, fullgraph=True), warmed up on a side stream, captured in a CUDA graph:
    (graph, the output tensor its replays write)."""
    compiled = torch.compile(fn, fullgraph=True)
    compiled()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        compiled()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = compiled()
    return graph, out


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("M,heads,dn,dv,dc,dr,interleave", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_matches_float64_oracle(fresh_seed, M, heads, dn, dv, dc, dr, interleave, dtype):
    a = _inputs(fresh_seed, M, heads, dn, dv, dc, dr, dtype)
    before = a["kv_cache"].clone()
    out = _call(mla_prepare_reference, a, interleave)
    want_q, want_latent = _oracle(a, interleave)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert out.shape == (M, heads, dc + dr) and out.dtype == dtype
    assert _rel(out, want_q) <= tol
    flat, flat0 = a["kv_cache"][1].view(-1, dc + dr), before[1].view(-1, dc + dr)
    assert _rel(flat[a["slots"]], want_latent) <= tol
    # Nothing else in the cache moved: other layers, other slots of this layer.
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[a["slots"]] = False
    assert torch.equal(flat[untouched], flat0[untouched])
    assert torch.equal(a["kv_cache"][0], before[0]) and torch.equal(a["kv_cache"][2], before[2])


def test_reference_rounds_like_the_model(fresh_seed):
    """The norm's result is rounded to ckv's dtype before the weight multiplies it, and q_abs to
    q's dtype (KimiK2RMSNorm and the model's absorbed path, in bf16)."""
    from torch_kdtree.models.kimi_k2.modeling import KimiK2RMSNorm, apply_rope

    a = _inputs(fresh_seed, 2, 4, 128, 128, 512, 64)
    out = _call(mla_prepare_reference, a, True)
    norm = KimiK2RMSNorm(512, 1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(a["norm_weight"])
    latent = torch.cat([norm(a["ckv"][:, :512]), apply_rope(a["ckv"][:, 512:], a["cos"], a["sin"], True)], -1)
    assert torch.equal(a["kv_cache"][1].view(-1, 576)[a["slots"]], latent)
    q_rope = apply_rope(a["q"][..., 128:], a["cos"][:, None], a["sin"][:, None], True)
    assert torch.equal(out[..., 512:], q_rope)


def test_bad_inputs_raise():
    a = _inputs(0, 2, 4, 128, 128, 512, 64)

    def bad(exc, match, **changes):
        b = {**a, **changes}
        with pytest.raises(exc, match=match):
            _call(mla_prepare, b, True)

    bad(TypeError, "cos must be torch.float32", cos=a["cos"].bfloat16())
    bad(TypeError, "slots must be torch.int64", slots=a["slots"].int())
    bad(TypeError, "ckv dtype", ckv=a["ckv"].float())
    bad(ValueError, r"ckv must be \[M, dc \+ dr\]", ckv=a["ckv"][:, :570].contiguous())
    bad(ValueError, r"cos and sin must be \[M, dr / 2\]", sin=a["sin"][:1].contiguous())
    bad(ValueError, r"slots must be \[M\]", slots=a["slots"][:1].contiguous())
    bad(ValueError, "w_kv_b must be", w_kv_b=a["w_kv_b"][:, :256].contiguous())
    bad(ValueError, "w_kv_b must be", w_kv_b=a["w_kv_b"][: 4 * 128].contiguous())  # dv = 0
    bad(ValueError, "layer must be an int", layer=3)
    bad(ValueError, "layer must be an int", layer=-1)
    bad(ValueError, "eps must be a non-negative float", eps=-1.0)
    bad(ValueError, "slots must be flat cache slots", slots=torch.tensor([0, 6 * 16]))
    bad(ValueError, "slots must be flat cache slots", slots=torch.tensor([-1, 3]))
    bad(ValueError, "must be contiguous", q=a["q"].transpose(0, 1).contiguous().transpose(0, 1))
    bad(ValueError, "cache row", norm_weight=a["norm_weight"][:511].contiguous())
    bad(ValueError, "q's last dimension", q=a["q"][..., :64].contiguous())


def test_opcheck_cpu(fresh_seed):
    a = _inputs(fresh_seed, 3, 4, 64, 32, 256, 32)
    args = (a["q"], a["ckv"], a["cos"], a["sin"], a["norm_weight"], a["eps"], a["w_kv_b"], a["kv_cache"], 1,
            a["slots"], True)
    torch.library.opcheck(torch.ops.kdtree.mla_prepare.default, args)


def test_compiles_with_fullgraph_on_cpu(fresh_seed):
    a = _inputs(fresh_seed, 2, 4, 64, 32, 256, 32, torch.float32)
    want_cache = a["kv_cache"].clone()
    want = _call(mla_prepare_reference, {**a, "kv_cache": want_cache}, True)

    def step(q, ckv, kv_cache):
        return mla_prepare(q, ckv, a["cos"], a["sin"], a["norm_weight"], 1e-6, a["w_kv_b"], kv_cache, 1, a["slots"])

    got = torch.compile(step, fullgraph=True)(a["q"], a["ckv"], a["kv_cache"])
    assert torch.equal(got, want) and torch.equal(a["kv_cache"], want_cache)


@pytest.mark.parametrize("form", ["prepare", "prepare_output"])
def test_models_prepare_path_matches_its_torch_path(form):
    """A decode plan's mla_prepare forms (the op's reference on CPU; with mla_tree_attention or with
    mla_tree_attention_output) give the torch tree attention's logits and cache: decoding token by
    token after ragged prompts (shuffled pages), then a three-node tree."""
    from test_kimi_model import VOCAB, decode_one_by_one, make_model, prefilled_cache, rel_err, with_attention

    model = make_model(3)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (5, 3)]
    tokens = torch.randint(0, VOCAB, (2, 4), generator=g)
    tree = torch.randint(0, VOCAB, (2, 3), generator=g)
    visible = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool).expand(2, 3, 3).contiguous()
    runs = []
    for attention in ("torch", form):
        cache = prefilled_cache(model, prompts, page_size=3)
        tree_plan = with_attention(model.model.plan_pass(2, 3, tree=True, cache=cache), attention)
        with torch.no_grad():
            logits = decode_one_by_one(model, cache, tokens, attention)
            depth = torch.tensor([0, 1, 1])
            tree_logits = model(tree, cache.lengths.long()[:, None] + depth, cache, visible, plan=tree_plan).logits
        runs.append((logits, tree_logits, cache.kv.clone()))
    (a, ta, kv_a), (b, tb, kv_b) = runs
    assert rel_err(b, a) <= 1e-5 and rel_err(tb, ta) <= 1e-5 and rel_err(kv_b, kv_a) <= 1e-6


def test_models_op_choice_by_pass_size():
    """The plan on CUDA (bf16): mla_prepare for passes of <= PREPARE_ROWS tokens, with the output op
    at <= OUTPUT_ROWS (one token of one request: mla_decode, with K2's latent), the torch products
    around mla_tree_attention above; fp32 or the CPU: the torch tree attention."""
    from test_kimi_model import make_model

    from torch_kdtree.models.kimi_k2.plan import ALL, OUTPUT_ROWS, PREPARE_ROWS, Target, plan_pass

    model = make_model(5)
    cuda = Target("cuda", False, ALL)

    def attention(R, N, m=model):
        return plan_pass(m, tokens=N, rows=R * N, tree=True, target=cuda, cache_keys=64).layers[0].attention

    assert attention(1, PREPARE_ROWS) == "tree_op"  # fp32: no bf16 kernel forms
    bf16 = make_model(5).to(torch.bfloat16)
    assert attention(1, 1, bf16) == "decode" and OUTPUT_ROWS == 1
    assert attention(1, 2, bf16) == "prepare" and attention(2, 2, bf16) == "prepare"
    assert attention(1, PREPARE_ROWS + 1, bf16) == "tree_op"
    assert plan_pass(bf16, tokens=1, rows=1, tree=True, target=Target("cpu")).layers[0].attention == "torch"


# --------------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------------

@requires_prepare_cuda
@pytest.mark.parametrize("M,heads,dn,dv,dc,dr,interleave", CASES + [(32, 16, 128, 128, 512, 64, True)])
def test_cuda_kernel_matches_reference(fresh_seed, M, heads, dn, dv, dc, dr, interleave):
    a = _inputs(fresh_seed, M, heads, dn, dv, dc, dr, device="cuda")
    cpu = {k: (v.cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    poison_cuda_allocator()
    got = _call(mla_prepare, a, interleave).cpu()
    want = _call(mla_prepare_reference, cpu, interleave)  # writes cpu["kv_cache"]
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert _rel(got, want) <= 4e-3
    assert (got.float() - want.float()).abs().max().item() <= 0.02 * want.float().abs().max().item()
    kv, kv_want = a["kv_cache"].cpu(), cpu["kv_cache"]
    slots = cpu["slots"]
    flat, flat_want = kv[1].view(-1, dc + dr), kv_want[1].view(-1, dc + dr)
    assert _rel(flat[slots], flat_want[slots]) <= 4e-3
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[untouched], flat_want[untouched])
    assert torch.equal(kv[0], kv_want[0]) and torch.equal(kv[2], kv_want[2])


@requires_prepare_cuda
def test_cuda_skips_out_of_range_slots_without_value_checks(fresh_seed):
    """With value checks off (as while a graph is captured) the kernel skips slots outside the
    cache (past its end, negative) instead of writing out of bounds."""
    a = _inputs(fresh_seed, 2, 4, 128, 128, 512, 64, device="cuda", layers=2)
    before = a["kv_cache"].clone()
    a["slots"] = torch.tensor([6 * 16 + 5, -3], device="cuda")
    from torch_kdtree.ops import value_checks

    with value_checks(False):
        _call(mla_prepare, a, True)
    torch.cuda.synchronize()
    assert torch.equal(a["kv_cache"], before)


@requires_prepare_cuda
def test_opcheck_cuda(fresh_seed):
    a = _inputs(fresh_seed, 3, 8, 128, 128, 512, 64, device="cuda")
    args = (a["q"], a["ckv"], a["cos"], a["sin"], a["norm_weight"], a["eps"], a["w_kv_b"], a["kv_cache"], 1,
            a["slots"], True)
    torch.library.opcheck(torch.ops.kdtree.mla_prepare.default, args)


@requires_prepare_cuda
def test_cuda_compiles_with_fullgraph_and_replays_in_a_graph(fresh_seed):
    a = _inputs(fresh_seed, 1, 8, 128, 128, 512, 64, device="cuda")
    q, ckv = a["q"].clone(), a["ckv"].clone()

    def step():
        return mla_prepare(q, ckv, a["cos"], a["sin"], a["norm_weight"], 1e-6, a["w_kv_b"], a["kv_cache"], 1,
                           a["slots"])

    graph, out = _compiled_graph(step)
    for seed in (fresh_seed + 1, fresh_seed + 2):
        b = _inputs(seed, 1, 8, 128, 128, 512, 64, device="cuda")
        q.copy_(b["q"])
        ckv.copy_(b["ckv"])
        graph.replay()
        torch.cuda.synchronize()
        cpu = {k: (v.cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
        cpu["q"], cpu["ckv"] = b["q"].cpu(), b["ckv"].cpu()
        want = _call(mla_prepare_reference, cpu, True)
        assert _rel(out.cpu(), want) <= 4e-3
        assert _rel(a["kv_cache"][1].view(-1, 576)[a["slots"]].cpu(),
                    cpu["kv_cache"][1].view(-1, 576)[a["slots"].cpu()]) <= 4e-3


@requires_prepare_cuda
def test_cuda_bad_sizes_raise():
    a = _inputs(0, 2, 4, 64, 32, 384, 64, device="cuda")  # dc 384: not a multiple of 256
    with pytest.raises(RuntimeError, match="multiple of 256"):
        _call(mla_prepare, a, True)
    a = _inputs(0, 2, 4, 64, 32, 256, 4, device="cuda")  # dr 4: rows not 16-byte multiples
    with pytest.raises(RuntimeError, match="multiple of 8"):
        _call(mla_prepare, a, True)
    a = _inputs(0, 2, 4, 64, 32, 256, 32, device="cuda", dtype=torch.float32)
    with pytest.raises(RuntimeError, match="must be BFloat16"):
        _call(mla_prepare, a, True)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_inputs_on_two_devices_raise():
    a = _inputs(0, 2, 4, 128, 128, 512, 64, device="cuda")
    with pytest.raises(ValueError, match="device"):
        _call(mla_prepare, {**a, "slots": a["slots"].cpu()}, True)


# --------------------------------------------------------------------------------------------
# mla_output
# --------------------------------------------------------------------------------------------

# (M tokens, heads, dn, dv, dc)
OUT_CASES = [(1, 8, 128, 128, 512), (3, 16, 128, 128, 512), (5, 4, 64, 40, 256), (17, 2, 0, 96, 1024)]


def _output_inputs(seed, M, heads, dn, dv, dc, dtype=torch.bfloat16, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(M, heads, dc, generator=g)
    w = torch.randn(heads * (dn + dv), dc, generator=g) / math.sqrt(dc)
    return o.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype)


@pytest.mark.parametrize("M,heads,dn,dv,dc", OUT_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_output_reference_matches_float64_oracle(fresh_seed, M, heads, dn, dv, dc, dtype):
    o, w = _output_inputs(fresh_seed, M, heads, dn, dv, dc, dtype)
    got = mla_output_reference(o, w, dn)
    want = torch.empty(M, heads, dv, dtype=torch.float64)
    for h in range(heads):  # W_UV[h]: the last dv rows of head h's block of kv_b_proj's weight
        rows = w[h * (dn + dv) + dn: (h + 1) * (dn + dv)].double()
        for m in range(M):
            want[m, h] = rows @ o[m, h].double()
    assert got.shape == (M, heads, dv) and got.dtype == dtype
    assert _rel(got, want) <= (1e-5 if dtype == torch.float32 else 1e-2)


def test_output_reference_equals_the_models_gemv_form(fresh_seed):
    """The model's former decode formula (a multiply + fp32 sum over the latent) rounds the same way."""
    o, w = _output_inputs(fresh_seed, 2, 4, 128, 128, 512)
    w_uv = w.view(4, 256, 512)[:, 128:]
    former = (o.float()[..., None, :] * w_uv.float()).sum(-1).to(o.dtype)
    assert _rel(mla_output_reference(o, w, 128), former) <= 1e-2


def test_output_bad_inputs_raise():
    o, w = _output_inputs(0, 2, 4, 128, 128, 512)
    with pytest.raises(TypeError, match="o_lat must be"):
        mla_output(o.int(), w, 128)
    with pytest.raises(ValueError, match="o_lat must have 3 dimensions"):
        mla_output(o[0], w, 128)
    with pytest.raises(ValueError, match="w_kv_b must be"):
        mla_output(o, w[:, :256].contiguous(), 128)
    with pytest.raises(ValueError, match="w_kv_b must be"):
        mla_output(o, w, 256)  # dv = 0
    with pytest.raises(ValueError, match="w_kv_b must be"):
        mla_output(o, w[:1001].contiguous(), 128)  # rows not a multiple of h
    with pytest.raises(ValueError, match="qk_nope_head_dim must be"):
        mla_output(o, w, -1)
    with pytest.raises(ValueError, match="must be contiguous"):
        mla_output(o.transpose(0, 1).contiguous().transpose(0, 1), w, 128)


def test_output_opcheck_and_compile_cpu(fresh_seed):
    o, w = _output_inputs(fresh_seed, 3, 4, 64, 40, 256, torch.float32)
    torch.library.opcheck(torch.ops.kdtree.mla_output.default, (o, w, 64))
    got = torch.compile(lambda o: mla_output(o, w, 64), fullgraph=True)(o)
    assert torch.equal(got, mla_output_reference(o, w, 64))


@requires_output_cuda
@pytest.mark.parametrize("M,heads,dn,dv,dc", OUT_CASES + [(32, 16, 128, 128, 512)])
def test_cuda_output_kernel_matches_reference(fresh_seed, M, heads, dn, dv, dc):
    o, w = _output_inputs(fresh_seed, M, heads, dn, dv, dc, device="cuda")
    poison_cuda_allocator()
    got = mla_output(o, w, dn).cpu()
    want = mla_output_reference(o.cpu(), w.cpu(), dn)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert _rel(got, want) <= 4e-3
    assert (got.float() - want.float()).abs().max().item() <= 0.02 * want.float().abs().max().item()


@requires_output_cuda
def test_cuda_output_opcheck_compile_and_graph_replay(fresh_seed):
    o, w = _output_inputs(fresh_seed, 2, 8, 128, 128, 512, device="cuda")
    torch.library.opcheck(torch.ops.kdtree.mla_output.default, (o, w, 128))
    graph, out = _compiled_graph(lambda: mla_output(o, w, 128))
    for seed in (fresh_seed + 1, fresh_seed + 2):
        fresh, _ = _output_inputs(seed, 2, 8, 128, 128, 512, device="cuda")
        o.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(out.cpu(), mla_output_reference(o.cpu(), w.cpu(), 128)) <= 4e-3


@requires_output_cuda
def test_cuda_output_bad_sizes_raise():
    o, w = _output_inputs(0, 2, 4, 64, 32, 384, device="cuda")
    with pytest.raises(RuntimeError, match="multiple of 256"):
        mla_output(o, w, 64)
    o, w = _output_inputs(0, 2, 4, 64, 32, 256, device="cuda", dtype=torch.float32)
    with pytest.raises(RuntimeError, match="must be BFloat16"):
        mla_output(o, w, 64)
