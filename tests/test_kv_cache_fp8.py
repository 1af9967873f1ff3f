"""The fp8 latent cache (``kv_cache_dtype="fp8"``): rows of an e4m3 latent with one fp32 power-of-two
scale per (layer, token) and a bf16 rope part, written quantised, read dequantised, moved with their scales by ``kv_commit``; the
decode plan runs mla_tree_attention over it (tree_op: the op reads the rows and their scales) where
the kernel is, torch ops elsewhere; greedy DDTree equals greedy autoregressive decoding over the same
fp8 cache in both forms; and the fp8 cache keeps the fp32 cache's top-1 over a long generation.

Tiny random targets in fp32 on the CPU (models/generation/tiny.py).
"""
import functools

import pytest
import torch

from conftest import one_thread, requires_cuda

from torch_kdtree.models import KimiK2Cache
from torch_kdtree.models.generation import OracleDrafter
from torch_kdtree.models.generation.tiny import tiny_drafter, tiny_target

E4M3_HALF_STEP = 2.0 ** -4      # 3 mantissa bits: rounding moves a normal value by <= 2^-4 of itself
E4M3_SUBNORMAL_HALF = 2.0 ** -10  # subnormals are 2^-9 apart (in units of the row's scale)


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    with one_thread(), torch.no_grad():
        yield


@functools.lru_cache(maxsize=None)
def target(seed: int, **overrides):
    return tiny_target(seed, **overrides)


def prompts(R: int, seed: int, lo: int = 3, hi: int = 9):
    """R left-padded random prompts and their attention mask."""
    g = torch.Generator().manual_seed(2000 + seed)
    lengths = torch.randint(lo, hi + 1, (R,), generator=g)
    T = int(lengths.max())
    ids, mask = torch.zeros(R, T, dtype=torch.long), torch.zeros(R, T, dtype=torch.long)
    for r, n in enumerate(lengths.tolist()):
        ids[r, T - n:] = torch.randint(3, 128, (n,), generator=g)
        mask[r, T - n:] = 1
    return ids, mask


def shuffled_cache(R: int, max_tokens: int, *, layers: int = 2, D: int = 576, page_size: int = 4, seed: int = 0):
    cache = KimiK2Cache(layers, R, max_tokens, D, page_size=page_size, dtype=torch.float32, kv_cache_dtype="fp8")
    order = torch.randperm(cache.kv.shape[1], generator=torch.Generator().manual_seed(seed))
    cache.block_table.copy_(order.view_as(cache.block_table))
    return cache


# --------------------------------------------------------------------------------------------
# the layout
# --------------------------------------------------------------------------------------------

def test_fp8_rows_round_trip_within_half_an_e4m3_step():
    """Rows of many magnitudes (a row of zeros, rows spanning 2^20 of range, huge and tiny rows)
    written through the cache at shuffled pages and read back: every latent element within half an
    e4m3 step of itself (2^-4 relative for normal values, 2^-10 scales for subnormal ones), every rope
    element its bf16 rounding exactly; the scale a power of two with the latent's max |value| in
    [224, 448) of it; the dequantised values exact in bf16."""
    g = torch.Generator().manual_seed(1)
    R, T, D, L = 2, 11, 576, 512
    rows = torch.randn(R, T, D, generator=g)
    rows[0, 0] = 0
    rows[0, 1] *= 1e4
    rows[0, 2] *= 1e-6
    rows[1, 0] *= torch.exp2(torch.randint(-10, 10, (D,), generator=g).float())  # 2^20 of range in a row
    rows[1, 1, :L] *= 1e-3  # a latent much smaller than its rope part
    rows[1, 2, L:] *= 1e5   # a rope part much larger than its latent
    cache = shuffled_cache(R, 16)
    slots = cache.slots(T)
    for layer in range(2):
        cache.write(layer, slots, rows * (layer + 1))
    cache.advance(T)
    for layer in range(2):
        x = rows * (layer + 1)
        got = cache.read(layer, T)
        assert got.dtype == torch.float32 and got.shape == (R, T, D)
        scale = cache.kv_scale[layer].view(-1)[slots.view(-1)].view(R, T)
        assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))  # powers of two
        ratio = x[..., :L].abs().amax(-1) / scale
        nonzero = x[..., :L].abs().amax(-1) > 0
        assert bool(((ratio[nonzero] >= 224) & (ratio[nonzero] < 448)).all())
        assert torch.equal(scale[~nonzero], torch.ones_like(scale[~nonzero]))
        bound = torch.maximum(E4M3_HALF_STEP * x[..., :L].abs(), E4M3_SUBNORMAL_HALF * scale[..., None])
        err = (got[..., :L] - x[..., :L]).abs()
        assert bool((err <= bound).all()), float((err / bound).max())
        assert torch.equal(got[..., L:], x[..., L:].to(torch.bfloat16).float())  # the rope part: bf16
        assert torch.equal(got[0, 0], torch.zeros(D))
        assert torch.equal(got.to(torch.bfloat16).float(), got)  # exact in bf16: kernels may dequantise there
        worst = float((err / x[..., :L].abs().amax(-1, keepdim=True).clamp_min(1e-30)).amax())
        print(f"layer {layer}: largest latent |error| / the latent's max |value| = {worst:.4f}")


def test_fp8_rows_hold_the_e4m3_latent_then_the_bf16_rope_bytes():
    """The stored bytes, read independently of the cache's code: a row's first 512 bytes are the
    latent / scale cast to e4m3, the next 128 the rope's bf16 values in little-endian byte order."""
    g = torch.Generator().manual_seed(3)
    cache = shuffled_cache(1, 4, layers=1)
    x = torch.randn(1, 1, 576, generator=g) * 3
    slots = cache.slots(1)
    cache.write(0, slots, x)
    slot = int(slots[0, 0])
    raw = cache.kv.view(torch.uint8)[0, slot // cache.page_size, slot % cache.page_size]
    scale = float(cache.kv_scale[0].view(-1)[slot])
    assert raw.shape == (640,)
    assert torch.equal(raw[:512], (x[0, 0, :512] / scale).to(torch.float8_e4m3fn).view(torch.uint8))
    rope = x[0, 0, 512:].to(torch.bfloat16).view(torch.int16).int() & 0xFFFF
    assert torch.equal(raw[512::2].int() | (raw[513::2].int() << 8), rope)


def test_fp8_cache_layout_and_bytes_per_token():
    """kv float8_e4m3fn [layers, pages, page, 640] (512 e4m3 + 64 bf16 values) and kv_scale fp32
    [layers, pages, page]: 644 B per token and layer, 39,284 B per token over K2's 61 layers (bf16:
    70,272; 1.79x the tokens)."""
    from torch_kdtree.models.kimi_k2 import KimiK2Config

    config = KimiK2Config(num_hidden_layers=61, kv_lora_rank=512, qk_rope_head_dim=64)
    fp8 = KimiK2Cache.for_model(config, 1, 64, dtype=torch.bfloat16, kv_cache_dtype="fp8")
    bf16 = KimiK2Cache.for_model(config, 1, 64, dtype=torch.bfloat16)
    assert fp8.kv.dtype == torch.float8_e4m3fn and fp8.kv.shape == (61, 1, 64, 640) and fp8.quantized
    assert fp8.entry_dim == bf16.entry_dim == 576 and fp8.rope_dim == 64
    assert fp8.kv_scale.dtype == torch.float32 and fp8.kv_scale.shape == (61, 1, 64)
    assert fp8.bytes_per_token == 61 * (512 + 2 * 64 + 4) == 39_284 and bf16.bytes_per_token == 70_272
    assert bf16.kv_scale is None and not bf16.quantized
    assert fp8.kv.element_size() * fp8.kv.shape[-1] % 16 == 0  # rows stay 16-byte aligned for vector loads
    assert KimiK2Cache.for_model(config, 1, 64, kv_cache_dtype=torch.float8_e4m3fn).quantized


def test_kv_commit_moves_fp8_rows_and_their_scales():
    """cache.commit (kdtree::kv_commit on the rows as 16-bit words and on the scales) moves every
    layer's accepted rows and scales bit for bit to the slots after the committed prefix."""
    g = torch.Generator().manual_seed(2)
    R, prefix = 3, torch.tensor([5, 0, 9], dtype=torch.int32)
    cache = shuffled_cache(R, 20, layers=3, seed=2)
    for layer in range(3):  # every slot holds a distinct quantised row
        cache.write(layer, torch.arange(cache.kv.shape[1] * cache.page_size), torch.randn(
            cache.kv.shape[1] * cache.page_size, 576, generator=g) * torch.rand(1, generator=g) * 10)
    cache.lengths.copy_(prefix)
    indices = torch.tensor([[0, 2, 5, -1, -1, -1], [0, 1, 3, 4, -1, -1], [0, -1, -1, -1, -1, -1]], dtype=torch.int32)
    lengths = torch.tensor([3, 4, 1], dtype=torch.int32)
    slot = lambda r, pos: int(cache.slots_at(torch.tensor([r]), torch.tensor([pos]))[0])  # noqa: E731
    raw, scales = cache.kv.view(torch.uint8).clone(), cache.kv_scale.clone()
    want_raw, want_scales = raw.clone(), scales.clone()
    for r in range(R):
        for j in range(int(lengths[r])):
            src, dst = slot(r, int(prefix[r]) + int(indices[r, j])), slot(r, int(prefix[r]) + j)
            P = cache.page_size
            want_raw[:, dst // P, dst % P] = raw[:, src // P, src % P]
            want_scales[:, dst // P, dst % P] = scales[:, src // P, src % P]
    cache.commit(indices, lengths)
    assert torch.equal(cache.kv.view(torch.uint8), want_raw) and torch.equal(cache.kv_scale, want_scales)
    assert not torch.equal(want_raw, raw)  # rows really moved
    assert torch.equal(cache.lengths, prefix)  # advance is the caller's


# --------------------------------------------------------------------------------------------
# the plan, bad inputs
# --------------------------------------------------------------------------------------------

def test_plan_runs_mla_tree_attention_over_an_fp8_cache():
    """With every kdtree kernel available (the CUDA plan's forms), a bf16 K2-shaped model over an fp8
    cache runs its tree attention as tree_op (mla_tree_attention reads the e4m3 rows and their scales;
    mla_prepare / mla_decode, which a bf16 cache takes, read and write bf16 rows only) and says why
    once; an fp32 model on CUDA keeps torch ops (the CUDA kernel's query is bf16); a prefill notes its
    dequantised reads; a plan made for a bf16 cache with mla_decode is refused with an fp8 cache, and
    the MLA op refuses fp8 rows without their scales."""
    from torch_kdtree.models.kimi_k2.plan import ALL, Target, plan_pass
    from torch_kdtree.ops import mla_tree_attention

    model = tiny_target(3).to(torch.bfloat16)
    cuda = Target("cuda", kernels=ALL)
    for R, N in ((1, 1), (2, 1), (1, 8)):
        fp8 = plan_pass(model, tokens=N, rows=R * N, tree=True, target=cuda, kv_cache_dtype=torch.float8_e4m3fn)
        bf16 = plan_pass(model, tokens=N, rows=R * N, tree=True, target=cuda, kv_cache_dtype=torch.bfloat16)
        assert {lp.attention for lp in fp8.layers} == {"tree_op"}
        assert {lp.attention for lp in bf16.layers} & {"decode", "prepare", "prepare_output", "tree_op"}
        assert sum("fp8 latent cache: mla_tree_attention reads the e4m3 rows and their scales" in r
                   for r in fp8.reasons) == 1
        assert any("mla_prepare and mla_decode read / write bf16 rows only" in r for r in fp8.reasons)
        assert "fp8 latent cache" in str(fp8).splitlines()[0]
        assert [lp.qkv for lp in fp8.layers] == [lp.qkv for lp in bf16.layers]  # the projections keep their kernels
        fp32 = plan_pass(model, tokens=N, rows=R * N, tree=True, target=cuda, dtype=torch.float32,
                         kv_cache_dtype=torch.float8_e4m3fn)
        assert {lp.attention for lp in fp32.layers} == {"torch"}
        assert any("CUDA kernel takes a bf16 query" in r for r in fp32.reasons)
        cpu = plan_pass(model, tokens=N, rows=R * N, tree=True, target=Target("cpu", kernels=ALL), dtype=torch.float32,
                        kv_cache_dtype=torch.float8_e4m3fn)
        assert {lp.attention for lp in cpu.layers} == {"tree_op"}  # the op's CPU kernel (its reference) takes fp32
    prefill = plan_pass(model, tokens=5, rows=5, tree=False, target=cuda, kv_cache_dtype=torch.float8_e4m3fn)
    assert any("dequantised cache rows" in r for r in prefill.reasons)
    cache = KimiK2Cache.for_model(model, 1, 16, page_size=4, dtype=torch.bfloat16, kv_cache_dtype="fp8")
    assert model.model.plan_pass(1, 1, tree=True, cache=cache).fp8_cache
    kernel_plan = plan_pass(model, tokens=1, rows=1, tree=True, target=cuda, kv_cache_dtype=torch.bfloat16)
    assert {lp.attention for lp in kernel_plan.layers} == {"decode"}
    with pytest.raises(ValueError, match="do not read an fp8 latent cache"):
        model(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long), cache,
              torch.ones(1, 1, 1, dtype=torch.bool), plan=kernel_plan)
    q = torch.zeros(1, 1, 2, 576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="kv_scale is required with a torch.float8_e4m3fn kv_cache"):
        mla_tree_attention(q, cache.layer(0), cache.block_table, cache.lengths, torch.ones(1, 1, 1, dtype=torch.bool),
                           0.1)


def test_unknown_kv_cache_dtypes_are_refused_by_name():
    model = target(4)
    ids = torch.randint(3, 128, (1, 4))
    with pytest.raises(ValueError, match="generate: kv_cache_dtype 'fp4' is not one of auto, fp8, fp8_e4m3"):
        model.generate(ids, max_new_tokens=2, kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="e5m2 is not implemented"):
        model.generate(ids, max_new_tokens=2, kv_cache_dtype="fp8_e5m2")
    with pytest.raises(TypeError, match="must be a name"):
        model.generate(ids, max_new_tokens=2, kv_cache_dtype=8)
    with pytest.raises(ValueError, match="not a latent cache dtype"):
        KimiK2Cache(1, 1, 4, 576, kv_cache_dtype=torch.int8)
    with pytest.raises(ValueError, match="even latent width"):
        KimiK2Cache(1, 1, 4, 575, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="0 < rope_dim < entry_dim"):
        KimiK2Cache(1, 1, 4, 64, kv_cache_dtype="fp8", rope_dim=64)


def test_casting_an_fp8_cache_keeps_its_rows_and_scales():
    """.to(dtype), .half(), .float(), a move, and a cast of a module holding the cache keep an fp8
    cache's e4m3 rows and fp32 scales bit for bit and change only the dtype reads dequantise to; a
    cast to another float8 format is refused and changes nothing.  A bf16 cache is cast as any
    module's buffers (rows converted), but never to float8 (it has no scales)."""
    g = torch.Generator().manual_seed(8)
    cache = shuffled_cache(2, 16)
    cache.write(1, cache.slots(5), torch.randn(2, 5, 576, generator=g) * 3)
    cache.advance(5)
    codes, scales, rows = cache.kv.view(torch.uint8).clone(), cache.kv_scale.clone(), cache.read(1, 5)
    holder = torch.nn.Module()
    holder.cache = cache
    for cast, dtype in ((lambda c: c.to(torch.bfloat16), torch.bfloat16), (lambda c: c.half(), torch.float16),
                        (lambda c: c.float(), torch.float32), (lambda c: c.to("cpu", torch.bfloat16), torch.bfloat16),
                        (lambda c: c.to("cpu"), torch.bfloat16), (lambda c: holder.to(torch.float16), torch.float16),
                        (lambda c: c.to(torch.float8_e4m3fn), torch.float16)):
        cast(cache)
        assert cache.kv.dtype == torch.float8_e4m3fn and cache.kv_scale.dtype == torch.float32 and cache.quantized
        assert torch.equal(cache.kv.view(torch.uint8), codes) and torch.equal(cache.kv_scale, scales)
        assert cache.dtype == dtype and cache.read(1, 5).dtype == dtype
        assert torch.equal(cache.read(1, 5).float(), rows)  # power-of-two scales: exact in every dtype here
        cache.check_layout()
    with pytest.raises(ValueError, match="cannot cast an fp8 cache to torch.float8_e5m2"):
        cache.to(torch.float8_e5m2)
    assert torch.equal(cache.kv.view(torch.uint8), codes) and cache.kv_scale.dtype == torch.float32
    bf16 = KimiK2Cache(2, 1, 8, 576, page_size=4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="would drop the scales fp8 rows need"):
        bf16.to(torch.float8_e4m3fn)
    assert bf16.kv.dtype == torch.bfloat16 and bf16.kv_scale is None
    bf16.float()
    assert bf16.kv.dtype == torch.float32 and bf16.dtype == torch.float32 and not bf16.quantized


def test_bad_caches_give_clear_errors():
    """Issue 50's bad inputs: an fp8 cache without its scales, scales of the wrong dtype or shape,
    scales beside rows that are not fp8, rows of a dtype no path reads, a block table of another
    dtype -- refused by the model's forward (prefill and tree pass) with what is wrong; an fp8
    compute dtype refused by the cache's constructor; a cache that is not a KimiK2Cache refused."""
    model = target(7)
    ids = torch.randint(3, 128, (1, 4))
    tree = (ids[:, :1], torch.zeros(1, 1, dtype=torch.long))
    one = torch.ones(1, 1, 1, dtype=torch.bool)

    def fp8():
        return KimiK2Cache.for_model(model, 1, 16, page_size=4, dtype=torch.float32, kv_cache_dtype="fp8")

    def plain():
        return KimiK2Cache.for_model(model, 1, 16, page_size=4, dtype=torch.float32)

    broken = []
    c = fp8()
    c.kv_scale = None
    broken.append((c, "an fp8 cache needs its scales: kv_scale float32 \\(2, 4, 4\\)"))
    c = fp8()
    c.kv_scale = c.kv_scale.half()
    broken.append((c, "kv_scale must be float32 \\(2, 4, 4\\).*got torch.float16"))
    c = fp8()
    c.kv_scale = c.kv_scale[:, :, :2]
    broken.append((c, "kv_scale must be float32 \\(2, 4, 4\\).*\\(2, 4, 2\\)"))
    c = plain()
    c.kv_scale = torch.ones(c.kv.shape[:3])
    broken.append((c, "kv_scale is set but the rows are torch.float32"))
    c = plain()
    c.kv = c.kv.to(torch.int8)
    broken.append((c, "kv must be .* rows of float8_e4m3fn, bfloat16, float16, float32 or float64; got torch.int8"))
    c = plain()
    c.kv = c.kv.to(torch.float8_e5m2)
    broken.append((c, "got torch.float8_e5m2"))
    c = fp8()
    c.block_table = c.block_table.long()
    broken.append((c, "block_table must be int32"))
    for cache, message in broken:
        with pytest.raises(ValueError, match=message):
            model(ids, cache=cache)
        with pytest.raises(ValueError, match=message):
            model(*tree, cache, one)
        with pytest.raises(ValueError, match=message):
            cache.check_layout()
    model(ids, cache=fp8())  # the same calls with whole caches run
    model(*tree, plain(), one)
    with pytest.raises(ValueError, match="dtype is the compute dtype.*for fp8 storage pass kv_cache_dtype"):
        KimiK2Cache(1, 1, 4, 576, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="cache must be a KimiK2Cache"):
        model(ids, cache=object())
    with pytest.raises(TypeError, match="cache must be a KimiK2Cache"):
        model.model(ids, cache=object())
    with pytest.raises(ValueError, match="not a latent cache dtype"):
        model.generate(ids, max_new_tokens=2, kv_cache_dtype=torch.float8_e5m2)


# --------------------------------------------------------------------------------------------
# generation over an fp8 cache
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,budget,block_size,R,seed", [
    ("random_dflash", 1, 4, 1, 0),
    ("random_dflash", 7, 4, 3, 1),
    ("random_dflash", 256, 4, 1, 2),
    ("random_dflash", "auto", 5, 2, 3),
    ("oracle_80", 6, 4, 2, 4),
    ("oracle_80", 12, 6, 3, 5),
])
def test_greedy_ddtree_equals_autoregressive_with_an_fp8_cache(kind, budget, block_size, R, seed):
    """The sacred property over the same fp8 cache: tree passes write quantised rows, kv_commit moves
    the accepted rows with their scales, and greedy DDTree emits greedy autoregressive's tokens."""
    model = target(seed)
    ids, mask = prompts(R, seed)
    drafter = tiny_drafter(model, seed=seed, block_size=block_size) if kind == "random_dflash" else \
        OracleDrafter(model, block_size, accuracy=0.8, second_choice=0.5, seed=seed)
    ar = model.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=None, kv_cache_dtype="fp8")
    dd = model.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=None, kv_cache_dtype="fp8",
                        drafter=drafter, tree_budget=budget, return_dict_in_generate=True)
    assert torch.equal(dd.sequences, ar)
    if kind == "oracle_80":
        assert dd.mean_accept_length > 1.5  # accepted drafts: commits really moved rows and scales


def test_compiled_step_over_an_fp8_cache_equals_eager():
    """The DDTree and autoregressive steps over an fp8 cache trace with fullgraph=True (aot_eager):
    the quantising writes and the commit of the rows' 16-bit view and the scales included."""
    model = target(6)
    ids, mask = prompts(2, 6)
    drafter = tiny_drafter(model, seed=6, block_size=4)
    ar = model.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=None, kv_cache_dtype="fp8")
    try:
        torch._dynamo.reset()
        dd = model.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=None, kv_cache_dtype="fp8",
                            drafter=drafter, tree_budget=5, compile_step="aot_eager")
    finally:
        torch._dynamo.reset()
    assert torch.equal(dd, ar)


@torch.no_grad()
def _greedy_decode(model, prompt, new: int, kv_cache_dtype: str, tokens=None):
    """Prefill ``prompt`` [R, P], then ``new - 1`` absorbed decode steps (the generation path) feeding
    the argmax (``tokens`` None) or ``tokens`` [R, new - 1]; the logits of the ``new`` positions that
    each predict the next token [R, new, V] and the tokens fed [R, new - 1]."""
    R, P = prompt.shape
    cache = KimiK2Cache.for_model(model, R, P + new, page_size=64, dtype=model.dtype, device=prompt.device,
                                  kv_cache_dtype=kv_cache_dtype)
    last = model(prompt, cache=cache).logits[:, -1]
    cache.advance(P)
    plan = model.model.plan_pass(R, 1, tree=True, cache=cache)
    visible = torch.ones(R, 1, 1, dtype=torch.bool, device=prompt.device)
    logits, fed = [last], []
    for t in range(new - 1):
        token = last.argmax(-1) if tokens is None else tokens[:, t]
        fed.append(token)
        last = model(token[:, None], cache.lengths.long()[:, None], cache, visible, plan=plan).logits[:, 0]
        cache.advance(1)
        logits.append(last)
    return torch.stack(logits, 1), torch.stack(fed, 1)


def test_fp8_cache_keeps_the_fp32_caches_top1_over_a_long_greedy_generation():
    """4 requests x 512 greedy tokens decoded over an fp32 cache, then the same tokens fed through an
    fp8 cache (and a bf16 one, for scale): top-1 agreement >= 99 % outside near-ties, with the
    relative logit error max|d logit| / max|logit| per position printed.

    Near-tie: the fp32 cache's top-2 gap is below 2^-4 of the position's largest |logit|.  e4m3 keeps
    3 mantissa bits, so the cache rounds every value by up to 2^-4 of itself, and the logits move by
    that order relative to their own scale (median ~0.02 here); a decision closer than 2^-4 of the
    logits' scale is one fp8 keys cannot be expected to keep.  The rule reads the fp32 run only, so
    it is fixed before the fp8 logits are seen.

    The target is the tiny one at K2's own initializer_range (0.02).  Its greedy generations fall into
    loops, and some seeds loop through near-tied states (seeds 7 and 8: 80-90 % of the positions are
    near-ties, and fp8 keeps the top-1 at 54-62 % of all positions, 100 % of the decided ones); this
    seed's are mostly decided (~60 %), which the test asserts.  The default tiny target (0.2,
    chosen so that attention steers greedy decoding) has nearly hard attention that amplifies any
    cache rounding ~16x more: a bf16 cache already moves its logits by ~0.6 % of their range, fp8 by
    ~12 %, and fp8 keeps ~88-91 % of its non-tie top-1s (bench/STATUS.md)."""
    model = tiny_target(0, initializer_range=0.02)
    prompt = torch.randint(3, 128, (4, 8), generator=torch.Generator().manual_seed(0))
    ref, tokens = _greedy_decode(model, prompt, 512, "auto")
    gap = ref.topk(2, -1).values.diff(dim=-1).neg()[..., 0]
    scale = ref.abs().amax(-1)
    decided = gap >= E4M3_HALF_STEP * scale
    results = {}
    for name in ("fp8", "bfloat16"):
        logits, _ = _greedy_decode(model, prompt, 512, name, tokens)
        agree = logits.argmax(-1) == ref.argmax(-1)
        error = (logits - ref).abs().amax(-1) / scale
        results[name] = agree[decided].float().mean().item()
        print(f"{name} cache vs fp32 over {agree.numel()} greedy positions: top-1 agreement "
              f"{agree.float().mean().item():.2%} at all, {results[name]:.2%} at the {int(decided.sum())} "
              f"non-near-ties; relative logit error median {error.median().item():.4f}, "
              f"p99 {error.quantile(0.99).item():.4f}, max {error.max().item():.4f}")
    assert decided.float().mean() >= 0.4  # most positions are decided: the agreement is not vacuous
    assert results["fp8"] >= 0.99
    assert results["bfloat16"] >= 0.99


# --------------------------------------------------------------------------------------------
# the tree_op form over an fp8 cache (kdtree::mla_tree_attention with kv_scale; its CPU kernel)
# --------------------------------------------------------------------------------------------

def _plan_with_every_kernel(inner):
    """A replacement for ``inner.plan_pass`` planning for Target("cpu", kernels=ALL): the fused forms
    a GPU plan selects, run on the CPU through the ops' reference kernels."""
    from torch_kdtree.models.kimi_k2.plan import ALL, Target, plan_pass

    def plan(R, T, *, tree, cache=None, dtype=None, compiled=False):
        keys = cache.block_table.shape[1] * cache.page_size if cache is not None else 0
        return plan_pass(inner, tokens=T, rows=R * T, tree=tree, target=Target("cpu", compiled, ALL), dtype=dtype,
                         cache_keys=keys, kv_cache_dtype=cache.kv.dtype if cache is not None else None)
    return plan


def _count_tree_op_calls(monkeypatch):
    """Record (kv_cache dtype, kv_scale given) of every mla_tree_attention call the fused forms make."""
    from torch_kdtree.models.kimi_k2 import fused

    calls, real = [], fused.mla_tree_attention

    def counting(q, kv_cache, *args, kv_scale=None, **kwargs):
        calls.append((kv_cache.dtype, kv_scale is not None))
        return real(q, kv_cache, *args, kv_scale=kv_scale, **kwargs)
    monkeypatch.setattr(fused, "mla_tree_attention", counting)
    return calls


@pytest.mark.parametrize("kind,budget,block_size,R,seed", [
    ("random_dflash", 7, 4, 2, 21),
    ("random_dflash", "auto", 5, 1, 22),
    ("oracle_80", 6, 4, 2, 23),
])
def test_greedy_ddtree_equals_autoregressive_with_an_fp8_cache_through_mla_tree_attention(
        monkeypatch, kind, budget, block_size, R, seed):
    """The sacred property over the same fp8 cache with the plan a GPU makes (tree passes and
    autoregressive steps as tree_op: kdtree::mla_tree_attention reading the e4m3 rows with the layer's
    scales, here through its CPU kernel; the rows written by the torch quantiser): greedy DDTree emits
    greedy autoregressive's tokens."""
    model = tiny_target(seed)  # fresh: its plan_pass is replaced for this test
    monkeypatch.setattr(model.model, "plan_pass", _plan_with_every_kernel(model.model))
    calls = _count_tree_op_calls(monkeypatch)
    ids, mask = prompts(R, seed)
    drafter = tiny_drafter(model, seed=seed, block_size=block_size) if kind == "random_dflash" else \
        OracleDrafter(model, block_size, accuracy=0.8, second_choice=0.5, seed=seed)
    ar = model.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=None, kv_cache_dtype="fp8")
    assert calls and set(calls) == {(torch.float8_e4m3fn, True)}
    calls.clear()
    dd = model.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=None, kv_cache_dtype="fp8",
                        drafter=drafter, tree_budget=budget, return_dict_in_generate=True)
    assert calls and set(calls) == {(torch.float8_e4m3fn, True)}
    assert torch.equal(dd.sequences, ar)
    if kind == "oracle_80":
        assert dd.mean_accept_length > 1.5  # accepted drafts: commits really moved rows and scales


@pytest.mark.parametrize("R,N,page_size", [(1, 1, 4), (3, 1, 64), (2, 9, 4), (1, 17, 1)])
def test_fp8_tree_op_logits_equal_the_torch_forms_to_fp32_rounding(monkeypatch, R, N, page_size):
    """One pass over the same fp8 cache (after a prefill) planned for every kernel (tree_op: the op
    reads e4m3 rows and scales) and the same plan with torch-op attention (dequantised cache.read):
    the logits agree to fp32 rounding; the first layer's rows (the same input in both passes) are the
    same bytes, and every later layer's, whose inputs went through the two forms' attention (equal to
    fp32 rounding), rows within one e4m3 step (a value on a rounding boundary may round either way:
    run 174's torch 2.11 wrote one such value at R 2, N 9, page 4)."""
    import dataclasses

    model = tiny_target(5)
    g = torch.Generator().manual_seed(40 + R * N)
    V = model.config.vocab_size
    prompt = torch.randint(3, V, (R, 11), generator=g)
    cache = KimiK2Cache.for_model(model, R, 11 + N + 3, page_size=page_size, dtype=torch.float32, kv_cache_dtype="fp8")
    order = torch.randperm(cache.kv.shape[1], generator=g)  # shuffled pages: the block table matters
    cache.block_table.copy_(order.view_as(cache.block_table))
    model(prompt, cache=cache)
    cache.advance(11)
    visible = torch.ones(N, N, dtype=torch.bool).tril()
    visible[1:, 1:] &= torch.rand(N - 1, N - 1, generator=g) < 0.6  # a tree: ancestors kept at random
    visible |= torch.eye(N, dtype=torch.bool)
    visible = visible.expand(R, N, N).contiguous()
    tokens = torch.randint(3, V, (R, N), generator=g)
    positions = cache.lengths.long()[:, None] + visible.sum(-1) - 1
    plan = _plan_with_every_kernel(model.model)(R, N, tree=True, cache=cache)
    assert {lp.attention for lp in plan.layers} == {"tree_op"}
    torch_plan = dataclasses.replace(plan, layers=tuple(dataclasses.replace(lp, attention="torch")
                                                        for lp in plan.layers))
    calls = _count_tree_op_calls(monkeypatch)
    rows, scales = cache.kv.view(torch.uint8).clone(), cache.kv_scale.clone()
    want = model(tokens, positions, cache, visible, plan=torch_plan).logits
    assert not calls
    written = cache.kv.view(torch.uint8).clone(), cache.kv_scale.clone()
    cache.kv.view(torch.uint8).copy_(rows)
    cache.kv_scale.copy_(scales)
    got = model(tokens, positions, cache, visible, plan=plan).logits
    assert len(calls) == model.config.num_hidden_layers and set(calls) == {(torch.float8_e4m3fn, True)}
    assert torch.equal(cache.kv[0].view(torch.uint8), written[0][0]) and torch.equal(cache.kv_scale[0], written[1][0])
    from torch_kdtree.ops.mla import fp8_rows_to_keys

    a, b = fp8_rows_to_keys(cache.kv, cache.kv_scale), fp8_rows_to_keys(written[0], written[1])
    L = cache.entry_dim - cache.rope_dim
    # the latent: one e4m3 step, 2^-3 of the value's binade, at least the smallest subnormal step
    # (2^-9) of its scale; the rope: one bf16 step (2^-7 of the binade)
    binade = torch.frexp(torch.maximum(a.abs(), b.abs())).exponent.float()
    step = torch.cat([torch.maximum(2.0 ** (binade[..., :L] - 4),
                                    2.0 ** -9 * torch.minimum(cache.kv_scale, written[1])[..., None]),
                      2.0 ** (binade[..., L:] - 8)], dim=-1)
    assert bool(((a - b).abs() <= step).all())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@requires_cuda
def test_cuda_inductor_writes_and_reads_fp8_rows_as_eager_does():
    """The compiled steps write an fp8 cache through inductor: the quantiser (its bf16 rope viewed as
    bytes, a bitcast to another element size) and the dequantising read give the eager bytes and
    values bit for bit, on shuffled pages."""
    g = torch.Generator(device="cuda").manual_seed(11)
    cache = KimiK2Cache(2, 2, 16, 576, page_size=4, dtype=torch.bfloat16, device="cuda", kv_cache_dtype="fp8")
    cache.block_table.copy_(torch.randperm(cache.kv.shape[1], device="cuda").view_as(cache.block_table).int())
    rows = (torch.randn(2, 5, 576, device="cuda", generator=g) * 3).to(torch.bfloat16)

    def step(cache, rows):
        slots = cache.slots(5)
        cache.write(1, slots, rows)
        return cache.read(1, 5)

    cache_eager = KimiK2Cache(2, 2, 16, 576, page_size=4, dtype=torch.bfloat16, device="cuda", kv_cache_dtype="fp8")
    cache_eager.block_table.copy_(cache.block_table)
    want = step(cache_eager, rows)
    got = torch.compile(step, fullgraph=True)(cache, rows)
    assert torch.equal(got, want)
    assert torch.equal(cache.kv.view(torch.uint8), cache_eager.kv.view(torch.uint8))
    assert torch.equal(cache.kv_scale, cache_eager.kv_scale)
