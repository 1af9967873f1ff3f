"""kdtree::mla_decode (mla_prepare, the attention and the W_UV product of one token per request in one
op): the reference against a float64 oracle in the non-absorbed form (per-head keys and values
expanded from the latents), the model's decode path with and without the op, the CUDA kernel
against the reference on fresh random inputs (paged caches with shuffled pages, lengths around
the kernel's 32-key tiles and 8 splits), opcheck, torch.compile, CUDA graphs and bad inputs."""
import math

import pytest
import torch

from conftest import cuda_kernels_run, poison_cuda_allocator, requires_cuda_kernel
from torch_kdtree.ops import mla_decode, mla_decode_reference, value_checks

requires_decode_cuda = requires_cuda_kernel("kdtree::mla_decode")
DC, DR = 512, 64


def _inputs(seed, lens, heads, dn=128, dv=128, page_size=16, dtype=torch.bfloat16, device="cpu", layers=2,
            interleave=True):
    """One new token per request after ``lens`` committed ones, in a paged cache whose pages are
    handed out in a random order (with spare pages left unused)."""
    g = torch.Generator().manual_seed(seed)
    R = len(lens)
    max_pages = max((n + page_size) // page_size for n in lens) + 1
    num_pages = R * max_pages + 3
    perm = torch.randperm(num_pages, generator=g)[: R * max_pages].view(R, max_pages).int()
    lens_t = torch.tensor(lens, dtype=torch.int32)
    pos = lens_t.long()
    slots = perm.long().gather(1, (pos // page_size)[:, None])[:, 0] * page_size + pos % page_size
    ang = torch.rand(R, DR // 2, generator=g) * 50
    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return dict(q=cast(torch.randn(R, heads, dn + DR, generator=g)),
                ckv=cast(torch.randn(R, DC + DR, generator=g) * 3),
                cos=ang.cos().to(device), sin=ang.sin().to(device),
                norm_weight=cast(torch.rand(DC, generator=g) + 0.5), eps=1e-6,
                w_kv_b=cast(torch.randn(heads * (dn + dv), DC, generator=g) / math.sqrt(dn)),
                kv_cache=cast(torch.randn(layers, num_pages, page_size, DC + DR, generator=g)), layer=layers - 1,
                slots=slots.to(device), block_table=perm.to(device), cache_lens=lens_t.to(device),
                softmax_scale=0.9 / math.sqrt(dn + DR), interleave=interleave)


ARGS = ("q", "ckv", "cos", "sin", "norm_weight", "eps", "w_kv_b", "kv_cache", "layer", "slots", "block_table",
        "cache_lens", "softmax_scale", "interleave")


def _call(fn, a, **kw):
    return fn(*(a[k] for k in ARGS), **kw)


def _cpu(a):
    return {k: (v.cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _oracle(a):
    """float64, the non-absorbed form: per head, keys [c W_UK^T | rope(k_pe)] and values c W_UV^T
    of every position (the new token's latent from the definitions: norm, complex-number RoPE),
    scores with [q_nope | rope(q_pe)], an exact softmax.  Returns (out [R, h, dv], new rows [R, 576])."""
    q, ckv = a["q"].double(), a["ckv"].double()
    R, heads, qd = q.shape
    dn = qd - DR
    dv = a["w_kv_b"].shape[0] // heads - dn
    w = a["w_kv_b"].double().view(heads, dn + dv, DC)
    page_size = a["kv_cache"].shape[2]
    cache = a["kv_cache"][a["layer"]].double()
    rot = torch.complex(a["cos"].double(), a["sin"].double())
    interleave = a["interleave"]

    def rope(x, r):
        x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., : DR // 2], x[..., DR // 2:])
        z = torch.complex(x1, x2) * rot[r]
        return torch.cat([z.real, z.imag], dim=-1)

    out = torch.empty(R, heads, dv, dtype=torch.float64)
    new_rows = torch.empty(R, DC + DR, dtype=torch.float64)
    for r in range(R):
        L = int(a["cache_lens"][r])
        c = ckv[r, :DC]
        rms = torch.linalg.vector_norm(c) / math.sqrt(DC)
        new = torch.cat([a["norm_weight"].double() * c / torch.sqrt(rms ** 2 + a["eps"]), rope(ckv[r, DC:], r)])
        new_rows[r] = new
        pos = torch.arange(L)
        rows = cache[a["block_table"][r].long()[pos // page_size], pos % page_size]
        latent = torch.cat([rows, new[None]])  # [L + 1, 576]
        for h in range(heads):
            k = torch.cat([latent[:, :DC] @ w[h, :dn].T, latent[:, DC:]], dim=-1)
            v = latent[:, :DC] @ w[h, dn:].T
            qh = torch.cat([q[r, h, :dn], rope(q[r, h, dn:], r)])
            p = torch.softmax(k @ qh * a["softmax_scale"], dim=0)
            out[r, h] = p @ v
    return out, new_rows


@pytest.mark.parametrize("lens,heads,dn,dv,page_size", [([0], 4, 128, 128, 16), ([37], 8, 128, 128, 16),
                                                        ([5, 70, 1], 4, 64, 40, 4), ([130, 9], 2, 192, 96, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_matches_float64_oracle(fresh_seed, lens, heads, dn, dv, page_size, dtype):
    a = _inputs(fresh_seed, lens, heads, dn, dv, page_size, dtype)
    want, want_rows = _oracle(a)  # before the reference writes the cache
    before = a["kv_cache"].clone()
    got = _call(mla_decode_reference, a)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.shape == (len(lens), heads, dv) and got.dtype == dtype
    assert _rel(got, want) <= tol
    flat, flat0 = a["kv_cache"][a["layer"]].view(-1, DC + DR), before[a["layer"]].view(-1, DC + DR)
    assert _rel(flat[a["slots"]], want_rows) <= (1e-6 if dtype == torch.float32 else 1e-2)
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[a["slots"]] = False
    assert torch.equal(flat[untouched], flat0[untouched]) and torch.equal(a["kv_cache"][0], before[0])


def test_bad_inputs_raise():
    a = _inputs(0, [5, 20], 4)

    def bad(exc, match, **changes):
        with pytest.raises(exc, match=match):
            _call(mla_decode, {**a, **changes})

    bad(ValueError, "slots\\[r\\] must be the cache slot of position cache_lens", slots=a["slots"].flip(0))
    bad(ValueError, "cache_lens must be non-negative", cache_lens=torch.tensor([-1, 3], dtype=torch.int32))
    bad(ValueError, "too few for position", cache_lens=torch.tensor([5, 10_000], dtype=torch.int32))
    bad(ValueError, "block_table entries covering", block_table=torch.full_like(a["block_table"], -1))
    bad(TypeError, "block_table must be torch.int32", block_table=a["block_table"].long())
    bad(TypeError, "cache_lens must be torch.int32", cache_lens=a["cache_lens"].long())
    bad(ValueError, "block_table and cache_lens must have R = 2", cache_lens=a["cache_lens"][:1].contiguous())
    bad(ValueError, "cache rows of 576", kv_cache=a["kv_cache"][..., :320].contiguous(),
        norm_weight=a["norm_weight"][:256].contiguous(), ckv=a["ckv"][:, :320].contiguous(),
        w_kv_b=a["w_kv_b"][:, :256].contiguous())
    bad(TypeError, "softmax_scale must be a float", softmax_scale="0.1")
    bad(TypeError, "kv_cache dtype", kv_cache=a["kv_cache"].float())
    bad(ValueError, r"slots must be \[M\]", slots=a["slots"][:1].contiguous())
    bad(ValueError, "layer must be an int", layer=2)


def test_opcheck_and_compile_cpu(fresh_seed):
    a = _inputs(fresh_seed, [3, 40], 4, 64, 40, page_size=8, dtype=torch.float32)
    torch.library.opcheck(torch.ops.kdtree.mla_decode.default, tuple(a[k] for k in ARGS))
    want_cache = a["kv_cache"].clone()
    want = _call(mla_decode_reference, {**a, "kv_cache": want_cache})
    step = torch.compile(lambda q, ckv, kv: mla_decode(q, a["ckv"], a["cos"], a["sin"], a["norm_weight"], 1e-6,
                                                        a["w_kv_b"], kv, a["layer"], a["slots"], a["block_table"],
                                                        a["cache_lens"], a["softmax_scale"], True), fullgraph=True)
    got = step(a["q"], a["ckv"], a["kv_cache"])
    assert torch.equal(got, want) and torch.equal(a["kv_cache"], want_cache)


@pytest.mark.parametrize("ragged", [False, True], ids=["one_request", "two_ragged_requests"])
def test_models_decode_path_matches_its_torch_path(monkeypatch, ragged):
    """A decode plan's mla_decode form (its reference on CPU) and the torch tree attention give the
    same logits and cache, decoding token by token after prompts in shuffled pages; the op runs in
    every layer of every one-token pass."""
    from test_kimi_model import VOCAB, decode_one_by_one, make_model, prefilled_cache, rel_err

    from torch_kdtree.models.kimi_k2 import fused

    model = make_model(3)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in ((5, 3) if ragged else (6,))]
    R = len(prompts)
    tokens = torch.randint(0, VOCAB, (R, 4), generator=g)
    calls = []
    real = fused.mla_decode
    monkeypatch.setattr(fused, "mla_decode", lambda *args, **kw: calls.append(1) or real(*args, **kw))  # a spy
    runs = []
    for attention in ("torch", "decode"):
        calls.clear()
        cache = prefilled_cache(model, prompts, page_size=3)
        with torch.no_grad():
            logits = decode_one_by_one(model, cache, tokens, attention)
        runs.append((logits, cache.kv.clone(), len(calls)))
    (a, kv_a, n_a), (b, kv_b, n_b) = runs
    assert n_a == 0 and n_b == 4 * model.config.num_hidden_layers
    assert rel_err(b, a) <= 1e-5 and rel_err(kv_b, kv_a) <= 1e-6


def test_models_op_choice():
    """The plan takes mla_decode for one token of one request (bf16 on CUDA, K2's latent) over a
    cache of at most DECODE_MAX_KEYS positions per request, and says why when the cache is larger."""
    from test_kimi_model import make_model

    from torch_kdtree.models.kimi_k2.plan import ALL, DECODE_MAX_KEYS, Target, plan_pass

    model = make_model(5).to(torch.bfloat16)
    cuda = Target("cuda", True, ALL)

    def plan(R, keys):
        return plan_pass(model, tokens=1, rows=R, tree=True, target=cuda, cache_keys=keys)

    assert plan(1, DECODE_MAX_KEYS).layers[0].attention == "decode"
    large = plan(1, DECODE_MAX_KEYS + 64)
    assert large.layers[0].attention == "prepare_output"
    assert any(f"> {DECODE_MAX_KEYS}" in r and "mla_decode" in r for r in large.reasons)
    assert plan(2, 64).layers[0].attention == "prepare"


# --------------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------------

CUDA_CASES = [([0], 16, 128, 128, 64), ([31], 16, 128, 128, 64), ([32], 8, 128, 128, 16), ([33], 8, 128, 128, 1),
              ([255], 16, 128, 128, 64), ([256], 16, 128, 128, 64), ([700], 16, 128, 128, 64),
              ([5000], 8, 128, 128, 64), ([3, 300, 129], 8, 128, 128, 16), ([77, 1], 4, 64, 40, 4),
              ([400], 2, 192, 256, 32), ([90], 1, 128, 128, 7)]


@requires_decode_cuda
@pytest.mark.parametrize("prefix_ready", [False, True])
@pytest.mark.parametrize("lens,heads,dn,dv,page_size", CUDA_CASES)
def test_cuda_kernel_matches_reference(fresh_seed, lens, heads, dn, dv, page_size, prefix_ready):
    a = _inputs(fresh_seed, lens, heads, dn, dv, page_size, device="cuda", interleave=fresh_seed % 2 == 0)
    cpu = _cpu(a)
    poison_cuda_allocator()
    got = _call(mla_decode, a, prefix_ready=prefix_ready).cpu()
    want = _call(mla_decode_reference, cpu)  # writes cpu["kv_cache"]
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert _rel(got, want) <= 1e-2
    assert (got.float() - want.float()).abs().max().item() <= 0.03 * want.float().abs().max().item()
    kv, kv_want = a["kv_cache"].cpu(), cpu["kv_cache"]
    slots = cpu["slots"]
    flat, flat_want = kv[-1].view(-1, DC + DR), kv_want[-1].view(-1, DC + DR)
    assert _rel(flat[slots], flat_want[slots]) <= 4e-3
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[untouched], flat_want[untouched]) and torch.equal(kv[0], kv_want[0])


PER_REQUEST = ("q", "ckv", "cos", "sin", "slots", "block_table", "cache_lens")


def _default_stages(heads: int, requests: int) -> int:
    """mla_decode_cuda's ring depth: 3 when the launch's blocks (8 per head and request) fill at most
    half the SMs and a block's shared memory holds 3 stages of 32 rows (+ the kernel's ~24 KB of
    static shared memory), else 2.  The op also requires all the launch's clusters (one per head and
    request) to fit at once at 3 stages, by the occupancy API; that is not mirrored here: where half
    the SMs' blocks fit, so do their clusters on the GPUs tested (H200: 15 clusters of 8 at 3 stages,
    RESULTS.md run 138), and where they would not, the op picks 2 and the tests that use this helper
    fail rather than pass by accident."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    fits = props.shared_memory_per_block_optin >= 3 * 32 * 1152 + 24 * 1024
    return 3 if heads * 8 * requests <= props.multi_processor_count // 2 and fits else 2


def _run_decode(a):
    return cuda_kernels_run(lambda: _call(mla_decode, {**a, "kv_cache": a["kv_cache"].clone()}, prefix_ready=True),
                            "mla_decode_kernel")


@requires_decode_cuda
def test_cuda_ring_depths_agree(fresh_seed):
    """A request alone (8 heads: 64 blocks, at most half an H200's SMs, so 3 key stages) and the same
    request in a launch of two (128 blocks: 2 stages) give the same bits: the depth changes only the
    loads.  The profiler sees each launch's depth."""
    a = _inputs(fresh_seed, [1000, 3], 8, device="cuda")
    alone = {k: (v[:1] if k in PER_REQUEST else v) for k, v in a.items()}
    both, names_both = _run_decode(a)
    one, names_one = _run_decode(alone)
    assert any(f"mla_decode_kernel<{_default_stages(8, 2)}>" in n for n in names_both), names_both
    assert any(f"mla_decode_kernel<{_default_stages(8, 1)}>" in n for n in names_one), names_one
    assert torch.equal(one, both[:1])


@requires_decode_cuda
@pytest.mark.parametrize("lens,heads", [([700], 8), ([700, 5], 16)])
def test_cuda_default_ring_depth(fresh_seed, lens, heads):
    """A launch of few blocks takes 3 key stages and a full one 2 (the kernel the profiler sees)."""
    a = _inputs(fresh_seed, lens, heads, device="cuda")
    _, names = _run_decode(a)
    assert any(f"mla_decode_kernel<{_default_stages(heads, len(lens))}>" in n for n in names), names


@requires_decode_cuda
def test_cuda_repeated_calls_give_the_same_bits(fresh_seed):
    """Twenty calls on the same inputs, each after L2 is flushed (so the key tiles come from HBM and
    land late), give the same bits: a tile read before its copies land (the ring's copy-group
    count, run 74) shows up as differing results.  12 tiles per block, so the ring refills."""
    a = _inputs(fresh_seed, [3000], 16, device="cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    outs = []
    for _ in range(20):
        flush.add_(1)
        outs.append(_call(mla_decode, a, prefix_ready=True))
    torch.cuda.synchronize()
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    want = _call(mla_decode_reference, _cpu({**a, "kv_cache": a["kv_cache"]}))
    assert _rel(outs[0].cpu(), want) <= 1e-2


@requires_decode_cuda
def test_cuda_skips_an_out_of_range_slot_without_value_checks(fresh_seed):
    a = _inputs(fresh_seed, [10], 8, device="cuda")
    before = a["kv_cache"].clone()
    with value_checks(False):
        _call(mla_decode, {**a, "slots": torch.tensor([-5], device="cuda")})
        _call(mla_decode, {**a, "slots": torch.tensor([a["kv_cache"][0].numel() // 576], device="cuda")})
    torch.cuda.synchronize()
    assert torch.equal(a["kv_cache"], before)


@requires_decode_cuda
def test_cuda_opcheck(fresh_seed):
    a = _inputs(fresh_seed, [70, 2], 8, device="cuda")
    torch.library.opcheck(torch.ops.kdtree.mla_decode.default, tuple(a[k] for k in ARGS))


@requires_decode_cuda
def test_cuda_compiles_with_fullgraph_and_replays_in_a_graph(fresh_seed):
    """Compiled, captured once, replayed with new inputs and new lengths (read on the device)."""
    a = _inputs(fresh_seed, [600], 16, device="cuda")
    q, ckv, lens, slots = a["q"].clone(), a["ckv"].clone(), a["cache_lens"].clone(), a["slots"].clone()

    def step():
        return mla_decode(q, ckv, a["cos"], a["sin"], a["norm_weight"], 1e-6, a["w_kv_b"], a["kv_cache"], a["layer"],
                          slots, a["block_table"], lens, a["softmax_scale"], True, prefix_ready=True)

    compiled = torch.compile(step, fullgraph=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        compiled()
        compiled()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = compiled()
    for seed, n in ((fresh_seed + 1, 611), (fresh_seed + 2, 17)):
        b = _inputs(seed, [n], 16, device="cuda")
        q.copy_(b["q"])
        ckv.copy_(b["ckv"])
        lens.fill_(n)
        pos = torch.tensor([n])
        slots.copy_(a["block_table"].cpu().long()[0, pos // 16] * 16 + pos % 16)
        cpu = _cpu({**a, "q": q, "ckv": ckv, "cache_lens": lens, "slots": slots})
        graph.replay()
        torch.cuda.synchronize()
        want = _call(mla_decode_reference, cpu)
        assert _rel(out.cpu(), want) <= 1e-2
        assert _rel(a["kv_cache"][-1].view(-1, 576)[slots].cpu(), cpu["kv_cache"][-1].view(-1, 576)[slots.cpu()]) <= 4e-3


@requires_decode_cuda
def test_cuda_bad_sizes_raise():
    a = _inputs(0, [5], 4, dn=320, device="cuda")
    with pytest.raises(RuntimeError, match="dn"):
        _call(mla_decode, a)
    a = _inputs(0, [5], 2, dv=300, device="cuda")
    with pytest.raises(RuntimeError, match="dv <= 256"):
        _call(mla_decode, a)
    a = _inputs(0, [5], 4, device="cuda", dtype=torch.float32)
    with pytest.raises(RuntimeError, match="must be BFloat16"):
        _call(mla_decode, a)
