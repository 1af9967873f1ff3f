"""Chunked prefill (issue 50: a 200k-token prompt): a prompt longer than ``prefill_chunk_size`` runs
as passes of that many tokens, each attending to the cache and itself, with the logits, cache rows
and generation of a one-pass prefill (to fp32 rounding); the three attention forms of the prefill
(one SDPA over a bool mask, per-request SDPA with a lower-right causal bias, key blocks with an
online softmax) agree; padding, committed prefixes and the fp8 cache included.

Tiny random targets in fp32 on the CPU (the logit comparisons at K2's initializer range 0.02: the
tiny target's default 0.2 makes attention near-hard, which turns fp32 rounding into ~1e-5 of the
logits); the CUDA test at the end runs on a GPU only.
"""
import pytest
import torch

from conftest import HAS_CUDA
from torch_kdtree.models import KimiK2Cache
from torch_kdtree.models.generation import GenerationSession, OracleDrafter
from torch_kdtree.models.generation.tiny import tiny_drafter, tiny_target
from torch_kdtree.models.kimi_k2 import modeling
from torch_kdtree.models.kimi_k2.cache import fp8_dequantize

FORMS = ("mask", "sdpa", "blocks")


@pytest.fixture(autouse=True, scope="module")
def _no_grad():
    with torch.no_grad():
        yield


def target(seed: int, **overrides):
    return tiny_target(seed, initializer_range=0.02, **overrides)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _ragged(R: int, T: int, seed: int, vocab: int = 128):
    """Right-padded random prompts [R, T] and their lengths (the first request T long)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 3, T + 1, (R,), generator=g)
    lengths[0] = T
    ids = torch.randint(3, vocab, (R, T), generator=g) * (torch.arange(T)[None] < lengths[:, None])
    return ids, lengths


def _rows(cache: KimiK2Cache, layer: int, n: int) -> torch.Tensor:
    """Rows at positions 0..n-1 of every request, dequantised (fp8) or as stored, in fp32."""
    return cache.read(layer, n).float()


def _prefilled(model, ids, lengths, *, prefix=None, kv="float32", chunk=None, page_size=4):
    """A cache (pages shuffled) after an optional committed ``prefix`` [R, P] (one pass) and a
    prefill of ``ids`` with ``lengths``: (logits [R, T, V], cache)."""
    R = ids.shape[0]
    P = 0 if prefix is None else prefix.shape[1]
    cache = KimiK2Cache.for_model(model, R, P + ids.shape[1] + 8, page_size=page_size, dtype=torch.float32,
                                  kv_cache_dtype=kv)
    order = torch.randperm(cache.kv.shape[1], generator=torch.Generator().manual_seed(R))
    cache.block_table.copy_(order.view_as(cache.block_table))
    if prefix is not None:
        model(prefix, cache=cache, return_logits=False, prefill_chunk_size=P)
        cache.advance(P)
    logits = model(ids, cache=cache, input_lengths=lengths, prefill_chunk_size=chunk).logits
    return logits, cache


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kv", ["float32", "fp8"])
def test_chunked_prefill_equals_one_pass(monkeypatch, form, kv):
    """Ragged right-padded prompts after ragged committed prefixes, prefilled in one pass (the bool
    mask form) and in chunks of 1, 7 and 16 tokens under each attention form: the valid positions'
    logits within fp32 rounding (fp8: within the effect of an e4m3 code flip in layer 1's latents), every cache row written (fp32: within rounding; fp8: the same e4m3
    codes and scales but where rounding moved a value across a code boundary), lengths untouched."""
    model = target(11)
    ids, lengths = _ragged(3, 23, seed=12)
    prefix = torch.randint(3, 128, (3, 6), generator=torch.Generator().manual_seed(13))
    want, ref = _prefilled(model, ids, lengths, prefix=prefix, kv=kv)
    monkeypatch.setattr(modeling, "PREFILL_ATTENTION", form)
    for chunk in (1, 7, 16, None):
        got, cache = _prefilled(model, ids, lengths, prefix=prefix, kv=kv, chunk=chunk)
        assert torch.equal(cache.lengths, ref.lengths) and cache.lengths.tolist() == [6, 6, 6]
        for r, n in enumerate(lengths.tolist()):
            assert rel_err(got[r, :n], want[r, :n]) <= (1e-5 if kv == "float32" else 5e-4), (chunk, r)
        end = 6 + int(lengths.max())
        for layer in range(2):
            a, b = _rows(cache, layer, end), _rows(ref, layer, end)
            for r, n in enumerate(lengths.tolist()):
                if kv == "float32":
                    assert rel_err(a[r, : 6 + n], b[r, : 6 + n]) <= 1e-5
                else:  # e4m3 codes: equal but for rare flips by one code (layer 1's rows follow layer 0's rounding)
                    same = (a[r, : 6 + n] == b[r, : 6 + n]).float().mean()
                    assert same >= (1.0 if layer == 0 else 0.99), (chunk, layer, r, float(same))
                    assert rel_err(a[r, : 6 + n], b[r, : 6 + n]) <= 2 ** -3


@pytest.mark.parametrize("form", FORMS)
def test_prefill_forms_agree_without_a_cache(monkeypatch, form):
    """No cache: one pass, and chunks (a scratch cache holds the latents), under every form, equal the
    bool-mask pass of each prompt alone (padding changes nothing)."""
    model = target(14)
    ids, lengths = _ragged(2, 29, seed=15)
    alone = [model(ids[r : r + 1, :n]).logits[0] for r, n in enumerate(lengths.tolist())]
    monkeypatch.setattr(modeling, "PREFILL_ATTENTION", form)
    for chunk in (None, 4, 10):
        got = model(ids, input_lengths=lengths, prefill_chunk_size=chunk).logits
        for r, n in enumerate(lengths.tolist()):
            assert rel_err(got[r, :n], alone[r]) <= 1e-5, (chunk, r)


def test_a_long_prompt_builds_no_mask_on_the_cpu(monkeypatch):
    """Past PREFILL_MASK_ELEMENTS (R * T * S) the prefill builds no [R, 1, T, S] mask: on the CPU a
    prompt with no prefix and no padding takes one causal SDPA call (the sdpa form, batched), one after
    a committed prefix attends in key blocks (each of <= PREFILL_SCORE_ELEMENTS fp32 scores); both give
    the mask pass's logits.  Below the threshold, the mask form as before."""
    model = target(16)
    ids = torch.randint(3, 128, (2, 48), generator=torch.Generator().manual_seed(17))
    want = model(ids).logits
    calls = []
    for name in ("_attend_blocks", "_attend_causal"):
        def spy(self, q, latent, batch, real=getattr(modeling.KimiK2Attention, name), name=name):
            assert batch.mask is None
            calls.append((name, q.shape[1]))
            return real(self, q, latent, batch)

        monkeypatch.setattr(modeling.KimiK2Attention, name, spy)
    monkeypatch.setattr(modeling, "PREFILL_MASK_ELEMENTS", 600)
    monkeypatch.setattr(modeling, "PREFILL_SCORE_ELEMENTS", 2 * 2 * 28 * 64)  # 64-key blocks
    got = model(ids).logits
    assert calls == [("_attend_causal", 48)] * 2 and rel_err(got, want) <= 1e-5  # both layers
    calls.clear()
    cache = KimiK2Cache.for_model(model, 2, 64, page_size=8, dtype=torch.float32)
    got = model(ids, cache=cache, prefill_chunk_size=16).logits  # chunks of 16: the first masked (2 * 16 * 16 keys)
    assert calls == [("_attend_blocks", 16)] * 4 and rel_err(got, want) <= 1e-5
    calls.clear()
    model(ids, prefill_chunk_size=24)  # no cache: a scratch one; the first chunk has no prefix
    assert calls == [("_attend_causal", 24)] * 2 + [("_attend_blocks", 24)] * 2


def _assert_same_prefill(sessions, lengths, layers: int, rows_rel_err: float) -> None:
    """Two (session, DFlash drafter) pairs prefilled with the same prompts: the same lengths and
    first token, cache rows within ``rows_rel_err``, the drafter's context K/V to fp32 rounding;
    greedy generation at B = 6 afterwards emits the same tokens."""
    from torch_kdtree.models.generation.budget import FixedBudget

    (one, d1), (two, d2) = sessions
    assert torch.equal(one.cache.lengths, two.cache.lengths) and one.cache.lengths.tolist() == lengths.tolist()
    assert torch.equal(one.root, two.root)
    T = int(lengths.max())
    for layer in range(layers):
        a, b = _rows(one.cache, layer, T), _rows(two.cache, layer, T)
        for r, n in enumerate(lengths.tolist()):
            assert rel_err(b[r, :n], a[r, :n]) <= rows_rel_err
    assert torch.equal(d1.context_lengths, d2.context_lengths)
    for r, n in enumerate(lengths.tolist()):
        assert rel_err(d2.context_k[:, r, :n], d1.context_k[:, r, :n]) <= 1e-5
        assert rel_err(d2.context_v[:, r, :n], d1.context_v[:, r, :n]) <= 1e-5
    for s, _ in sessions:
        s.run(FixedBudget(6))
    assert one.tokens()[0].tolist() == two.tokens()[0].tolist()


def test_session_prefill_in_chunks_equals_one_pass():
    """GenerationSession.prefill in chunks of 7 (each committed to the cache and the drafter's context
    before the next) leaves the cache rows, lengths, the DFlash drafter's context K/V and the first
    token of a one-pass prefill; greedy generation afterwards emits the same tokens."""
    model = tiny_target(18)
    ids, lengths = _ragged(2, 30, seed=19)
    sessions = []
    for chunk in (64, 7):
        drafter = tiny_drafter(model, seed=18)
        s = GenerationSession(model, drafter, batch_size=2, max_prompt=32, max_new=12, budgets=(0, 6),
                              prefill_chunk_size=chunk)
        s.prefill(ids, lengths, max_new=12, eos=[])
        sessions.append((s, drafter))
    _assert_same_prefill(sessions, lengths, 2, rows_rel_err=1e-5)


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_generate_with_a_small_prefill_chunk_equals_one_pass(kv):
    """generate(prefill_chunk_size=...) (transformers' GenerationConfig field): left-padded prompts,
    greedy autoregressive and DDTree (80 % oracle) decoding over the same cache dtype emit the tokens
    of the default one-pass prefill."""
    model = tiny_target(20)
    g = torch.Generator().manual_seed(21)
    ids = torch.randint(3, 128, (2, 26), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    common = dict(attention_mask=mask, max_new_tokens=10, eos_token_id=None, kv_cache_dtype=kv)
    want = model.generate(ids, **common)
    assert torch.equal(model.generate(ids, prefill_chunk_size=6, **common), want)
    oracle = OracleDrafter(model, 4, accuracy=0.8, seed=22)
    assert torch.equal(model.generate(ids, prefill_chunk_size=5, drafter=oracle, tree_budget=6, **common), want)


def test_prefill_chunk_size_is_checked():
    model = tiny_target(23)
    ids = torch.randint(3, 128, (1, 12))
    for bad in (0, -3, 2.5, "8", True):
        with pytest.raises(ValueError, match="prefill_chunk_size must be a positive int"):
            model.generate(ids, max_new_tokens=2, prefill_chunk_size=bad)
        with pytest.raises(ValueError, match="prefill_chunk_size must be a positive int"):
            model(ids, prefill_chunk_size=bad)
    assert modeling.prefill_chunk(None) == modeling.PREFILL_CHUNK == 8192
    plan = model.model.plan_pass(1, 12, tree=False)
    with pytest.raises(ValueError, match="a plan covers one pass"):
        model(ids, plan=plan, prefill_chunk_size=5)
    model(ids, plan=plan, prefill_chunk_size=12)  # one pass: the plan fits
    with pytest.raises(ValueError, match="PREFILL_ATTENTION"):
        old, modeling.PREFILL_ATTENTION = modeling.PREFILL_ATTENTION, "flash"
        try:
            model(ids)
        finally:
            modeling.PREFILL_ATTENTION = old


def test_fp8_rows_of_a_chunked_prefill_dequantise_like_the_one_pass_rows():
    """Layer 0's latents depend on the tokens alone: chunked or not, an fp8 cache holds the same codes
    and scales for them (bit for bit), and dequantising gives the one-pass rows."""
    model = target(24)
    ids = torch.randint(3, 128, (1, 33), generator=torch.Generator().manual_seed(25))
    _, one = _prefilled(model, ids, None, kv="fp8")
    _, chunked = _prefilled(model, ids, None, kv="fp8", chunk=8)
    slots = one.slots(33)
    for cache in (one, chunked):
        assert torch.equal(cache.slots(33), slots)
    row = one.kv.shape[-1]  # 640 bytes: the e4m3 latent, then the bf16 rope
    codes = [c.kv[0].view(-1, row)[slots[0]].view(torch.uint8) for c in (one, chunked)]
    scales = [c.kv_scale[0].view(-1)[slots[0]] for c in (one, chunked)]
    assert torch.equal(codes[0], codes[1]) and torch.equal(scales[0], scales[1])
    rows = fp8_dequantize(chunked.kv[0].view(-1, row)[slots[0]], scales[1], torch.float32, chunked.rope_dim)
    assert torch.equal(rows, one.read(0, 33)[0])


# --------------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("penalty,int4,kv,oracle", [(False, False, "auto", False), (True, True, "auto", False),
                                                    (False, False, "fp8", True)])
def test_session_chain_prefill_equals_the_eager_prefill(penalty, int4, kv, oracle):
    """A short prompt's prefill as one tree pass over its chain (GenerationSession._chain_prefill,
    what a CUDA session captures per prompt size) leaves the eager prefill's cache rows, lengths,
    DFlash context K/V, first token and (repetition penalty) seen tokens, to fp32 rounding, and
    greedy generation afterwards emits the same tokens; right padding, ragged lengths, an INT4
    target, an fp8 cache (rows within one e4m3 step: rounding may cross a quantisation boundary) and
    an oracle drafter over a DFlash one included.  The chain ran (its plan), the eager session's did not."""
    from torch_kdtree.models.generation import SamplingMode
    from torch_kdtree.models.generation.budget import FixedBudget

    model = target(30, **({"hidden_size": 128, "moe_intermediate_size": 64} if int4 else {}))
    if int4:
        from torch_kdtree.models.generation.tiny import quantize_experts_int4

        quantize_experts_int4(model)
    ids, lengths = _ragged(3, 27, seed=31)
    mode = SamplingMode(penalty=penalty)
    sessions = []
    for chain in (0, 64):
        drafter = dflash = tiny_drafter(model, seed=32)
        if oracle:
            drafter = OracleDrafter(model, accuracy=0.7, seed=32, inner=dflash)
        s = GenerationSession(model, drafter, batch_size=3, max_prompt=32, max_new=12, budgets=(0, 6), mode=mode,
                              chain_prefill=chain, kv_cache_dtype=kv)
        s.prefill(ids, lengths, max_new=12, eos=[], repetition_penalty=1.3 if penalty else 1.0)
        sessions.append((s, dflash))
    (eager, _), (chain, _) = sessions
    assert not eager.prefill_plans and list(chain.prefill_plans) == [32]  # size_bucket(27)
    assert torch.equal(eager.out[:, :1], chain.out[:, :1]) and torch.equal(eager.done, chain.done)
    assert torch.equal(eager.seen[:, :-1], chain.seen[:, :-1])  # less the sink column
    _assert_same_prefill(sessions, lengths, len(model.model.layers), rows_rel_err=1 / 16 if kv == "fp8" else 1e-5)
    # the same session again, with other prompts of the same size: the staged inputs are replaced
    ids2, lengths2 = _ragged(3, 20, seed=33)
    for s, _ in sessions:
        s.prefill(ids2, lengths2, max_new=12, eos=[], repetition_penalty=1.3 if penalty else 1.0)
        s.run(FixedBudget(0))
    assert list(chain.prefill_plans) == [32] and eager.tokens()[0].tolist() == chain.tokens()[0].tolist()


def test_chain_prefill_sizes_and_refusals():
    """Which prompts take the chain prefill: up to ``chain_prefill`` tokens (the session's prompt
    size at most), rounded up to size_bucket, and only when that fits one prefill chunk; a bad
    ``chain_prefill`` is refused by name."""
    model = target(34)
    s = GenerationSession(model, None, batch_size=1, max_prompt=48, max_new=4, budgets=(0,), chain_prefill=40)
    assert s._prefill_ids.shape == (1, 40)
    assert [s._chain_tokens(T, 8192) for T in (1, 16, 17, 33, 40, 41)] == [16, 16, 32, 40, 40, 0]
    assert s._chain_tokens(17, 24) == 0 and s._chain_tokens(17, 32) == 32  # the bucket must fit the chunk
    assert GenerationSession(model, None, batch_size=1, max_prompt=48, max_new=4,
                             budgets=(0,))._prefill_ids.shape[1] == 0  # the CPU default: never
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="chain_prefill must be an int >= 0"):
            GenerationSession(model, None, batch_size=1, max_prompt=8, max_new=4, budgets=(0,), chain_prefill=bad)
    ids, lengths = _ragged(1, 30, seed=35)
    s = GenerationSession(model, None, batch_size=1, max_prompt=32, max_new=4, budgets=(0,), chain_prefill=16)
    s.prefill(ids, lengths, max_new=4, eos=[])
    assert not s.prefill_plans  # 30 tokens > 16: the eager prefill
    for bad in (torch.tensor([31]), torch.tensor([-1]), torch.tensor([3, 4])):
        with pytest.raises(ValueError, match=r"lengths must be \[R = 1\] values in \[0, T = 30\]"):
            s.prefill(ids, bad, max_new=4, eos=[])


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_captured_chain_prefill_replays_the_eager_chain_bit_for_bit():
    """On CUDA the chain prefill is captured once per prompt size and replayed: for two different
    sets of ragged prompts of one size its cache rows, DFlash context and first tokens are those of
    the same pass run eagerly, bit for bit (the graph reads the staged prompts, not the ones it was
    captured with), and within bf16 rounding of the eager prefill's."""
    from torch_kdtree.models.generation.session import PREFILL_GRAPH_TOKENS

    model = target(36, num_attention_heads=8, num_key_value_heads=8).to("cuda", torch.bfloat16)
    runs = {}
    for name, graphs, chain in (("graph", True, None), ("eager chain", False, PREFILL_GRAPH_TOKENS),
                                ("eager", False, 0)):
        drafter = tiny_drafter(model, seed=37).to("cuda", torch.bfloat16)
        s = GenerationSession(model, drafter, batch_size=2, max_prompt=48, max_new=8, budgets=(0, 4),
                              cuda_graphs=graphs, chain_prefill=chain)
        for seed in (38, 39):
            ids, lengths = _ragged(2, 40 - seed % 2 * 5, seed=seed)
            s.prefill(ids, lengths, max_new=8, eos=[])
            ctx = [drafter.context_k[:, r, :n].clone() for r, n in enumerate(drafter.context_lengths.tolist())]
            runs[name, seed] = (s.cache.read(1, 40).float().clone(), ctx, s.root.clone(), lengths)
        runs[name] = s
    assert ("prefill", 48) in runs["graph"].graphs and not runs["eager"].prefill_plans
    for seed in (38, 39):
        (g_rows, g_ctx, g_root, lengths), (e_rows, e_ctx, e_root, _) = runs["graph", seed], runs["eager chain", seed]
        assert torch.equal(g_root, e_root) and len(g_ctx) == len(e_ctx)
        # the context's written rows only: rows past a request's length all go to one sink slot,
        # where several writes race (by design: it is masked), so its value is not deterministic
        assert all(torch.equal(g, e) for g, e in zip(g_ctx, e_ctx)) and [c.shape[1] for c in g_ctx] == lengths.tolist()
        for r, n in enumerate(lengths.tolist()):
            assert torch.equal(g_rows[r, :n], e_rows[r, :n])
            assert rel_err(g_rows[r, :n], runs["eager", seed][0][r, :n]) <= 3e-2


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_long_prefill_takes_fused_sdpa_and_agrees_with_the_other_forms(monkeypatch):
    """bf16, 8 heads (K2's per-rank count), 3,000-token prompts after a 100-token prefix, in chunks of
    1,024 (PREFILL_MASK_ELEMENTS lowered to 2^18 so that they count as long): the automatic form on
    CUDA is the fused lower-right causal SDPA (no mask), and its logits and cache rows agree
    with the bool-mask and key-block forms (bf16 rounding); a 40,000-token prompt prefills in chunks of
    4,096 with a peak of allocated memory far below what one pass's mask alone would take (1.6 GB)."""
    import copy

    model = copy.deepcopy(target(26, num_attention_heads=8, num_key_value_heads=8)).to("cuda", torch.bfloat16)
    g = torch.Generator().manual_seed(27)
    prefix = torch.randint(3, 128, (2, 100), generator=g).cuda()
    ids = torch.randint(3, 128, (2, 3000), generator=g).cuda()
    lengths = torch.tensor([3000, 2100], device="cuda")
    monkeypatch.setattr(modeling, "PREFILL_MASK_ELEMENTS", 1 << 18)  # the 100-token prefix masks, the chunks do not
    taken = []
    real = modeling.KimiK2Attention._prefill_form
    monkeypatch.setattr(modeling.KimiK2Attention, "_prefill_form",
                        lambda self, batch, q: taken.append(real(self, batch, q)) or taken[-1])
    results = {}
    for form in ("auto",) + FORMS:
        monkeypatch.setattr(modeling, "PREFILL_ATTENTION", form)
        cache = KimiK2Cache.for_model(model, 2, 3200, dtype=torch.bfloat16, device="cuda")
        model(prefix, cache=cache, return_logits=False, prefill_chunk_size=100)
        cache.advance(100)
        logits = model(ids, cache=cache, input_lengths=lengths, prefill_chunk_size=1024).logits
        results[form] = (logits, cache.read(1, 3100).float())
    assert set(taken[: len(taken) // 4]) == {"mask", "sdpa"}  # "auto": the 100-token prefix masks, the chunks sdpa
    for form in FORMS:
        for r, n in enumerate(lengths.tolist()):
            assert rel_err(results[form][0][r, :n], results["auto"][0][r, :n]) <= 3e-2, form
            assert rel_err(results[form][1][r, : 100 + n], results["auto"][1][r, : 100 + n]) <= 3e-2, form
    monkeypatch.setattr(modeling, "PREFILL_ATTENTION", "auto")
    cache = KimiK2Cache.for_model(model, 1, 40_000, dtype=torch.bfloat16, device="cuda")
    long_ids = torch.randint(3, 128, (1, 40_000), generator=g).cuda()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = model(long_ids, cache=cache, return_logits=False, prefill_chunk_size=4096)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert torch.isfinite(out.last_hidden_state).all() and peak < 1.0e9, peak


def test_prefill_input_lengths_are_checked_while_value_checks_are_on():
    """input_lengths outside [0, T] or of another shape are refused by name; the range check reads
    the device, so with the value checks off (a session's prefill on CUDA, like its steps) only the
    shape is checked."""
    from torch_kdtree.ops import value_checks

    model = target(40)
    ids = torch.randint(3, 128, (2, 6))
    for bad in (torch.tensor([7, 2]), torch.tensor([-1, 2]), torch.tensor([6])):
        with pytest.raises(ValueError, match=r"input_lengths must be \[R = 2\] values in \[0, T = 6\]"):
            model(ids, input_lengths=bad)
    with value_checks(False):
        with pytest.raises(ValueError, match="input_lengths must be"):
            model(ids, input_lengths=torch.tensor([6]))
        assert model(ids, input_lengths=torch.tensor([6, 3])).logits.shape == (2, 6, 128)
