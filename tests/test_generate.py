"""``KimiK2ForCausalLM.generate``: DDTree speculative decoding against autoregressive decoding.

Tiny random targets in fp32 on the CPU (models/generation/tiny.py).  The sacred property:
greedy DDTree output equals greedy autoregressive output token for token, whatever the drafter
(random DFlash, DFlash loaded from its checkpoint, the perfect oracle, partial oracles whose
accepted paths leave the spine), budget (1, B <= L, B > L, 256, auto), block size and batch.
Sampling: the distribution of generated sequences equals the exact autoregressive one
(enumerated), by a chi-square test at a stated false-alarm rate with fixed seeds.
"""
import functools

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)
from transformers.generation.streamers import BaseStreamer

from conftest import one_thread, requires_cuda_kernel
from torch_kdtree.models.dflash import DFlashDraftModel
from torch_kdtree.models.generation import BudgetPlanner, OracleDrafter, process_logits
from torch_kdtree.models.generation.tiny import tiny_drafter, tiny_target
from torch_kdtree.models.generation.ties import (SCORE_TIE, bf16_ulp, check_equal_up_to_bf16_ties, decoded_logits,
                                                 greedy_resume, last_position, routing_margins)
from torch_kdtree.ops import ddtree_build, tree_accept

requires_mla_cuda = requires_cuda_kernel("kdtree::mla_tree_attention")


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """One CPU thread: these matrices are tiny, extra threads only add contention."""
    with one_thread():
        yield


@functools.lru_cache(maxsize=None)
def target(seed: int, **overrides):
    return tiny_target(seed, **overrides)


def prompts(R: int, seed: int, vocab: int = 128, lo: int = 3, hi: int = 9, left: bool = True):
    """R prompts of random lengths in [lo, hi], padded (left by default) with 0; and the mask."""
    g = torch.Generator().manual_seed(1000 + seed)
    lengths = torch.randint(lo, hi + 1, (R,), generator=g)
    T = int(lengths.max())
    ids = torch.zeros(R, T, dtype=torch.long)
    mask = torch.zeros(R, T, dtype=torch.long)
    for r, n in enumerate(lengths.tolist()):
        cols = slice(T - n, T) if left else slice(0, n)
        ids[r, cols] = torch.randint(3, vocab, (n,), generator=g)
        mask[r, cols] = 1
    return ids, mask


@functools.lru_cache(maxsize=None)
def autoregressive(seed: int, R: int, max_new: int) -> torch.Tensor:
    ids, mask = prompts(R, seed)
    return target(seed).generate(ids, attention_mask=mask, max_new_tokens=max_new, eos_token_id=None)


def make_drafter(kind: str, model, seed: int, block_size: int, tmp_path_factory=None):
    if kind == "random_dflash":
        return tiny_drafter(model, seed=seed, block_size=block_size)
    if kind == "dflash_checkpoint":  # the real module through its public checkpoint format
        path = tmp_path_factory.mktemp("dflash")
        tiny_drafter(model, seed=seed, block_size=block_size, num_hidden_layers=2).save_pretrained(path)
        return DFlashDraftModel.from_pretrained(path)
    if kind == "oracle":
        return OracleDrafter(model, block_size, accuracy=1.0, seed=seed)
    if kind == "oracle_80":
        return OracleDrafter(model, block_size, accuracy=0.8, second_choice=0.5, seed=seed)
    if kind == "oracle_60_inner":
        return OracleDrafter(model, accuracy=0.6, seed=seed, inner=tiny_drafter(model, seed=seed, block_size=block_size))
    if kind == "oracle_off_spine":  # the top choice always wrong, the true token second: sibling paths only
        return OracleDrafter(model, block_size, accuracy=0.0, second_choice=1.0, seed=seed)
    raise ValueError(kind)


# --------------------------------------------------------------------------------------------
# greedy: DDTree == autoregressive
# --------------------------------------------------------------------------------------------

def test_autoregressive_generate_equals_an_argmax_loop_without_cache():
    model = target(0)
    ids, mask = prompts(2, 0, lo=5, hi=5)
    out = model.generate(ids, max_new_tokens=6, eos_token_id=None, speculative=None)
    seq = ids
    with torch.no_grad():
        for _ in range(6):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)


SACRED = [  # drafter, budget, block size, R, seed   (L = block size - 1)
    ("random_dflash", 1, 4, 1, 0),
    ("random_dflash", 2, 4, 2, 1),  # B <= L
    ("random_dflash", 7, 4, 3, 2),  # B > L
    ("random_dflash", 256, 4, 1, 3),
    ("dflash_checkpoint", 5, 3, 2, 4),
    ("dflash_checkpoint", "auto", 4, 2, 5),
    ("oracle", 1, 4, 2, 6),
    ("oracle", 2, 5, 1, 7),
    ("oracle", 8, 6, 3, 8),
    ("oracle", 256, 4, 2, 9),
    ("oracle_80", 3, 4, 2, 10),
    ("oracle_80", 12, 5, 3, 11),
    ("oracle_80", "auto", 4, 2, 12),
    ("oracle_60_inner", 16, 4, 2, 13),
    ("oracle_60_inner", 256, 3, 1, 14),
    ("oracle_off_spine", 14, 4, 2, 15),
]


@pytest.mark.parametrize("kind,budget,block_size,R,seed", SACRED)
def test_greedy_ddtree_equals_autoregressive(kind, budget, block_size, R, seed, tmp_path_factory):
    model = target(seed)
    max_new = 8 if budget == 256 else 14
    ids, mask = prompts(R, seed)
    drafter = make_drafter(kind, model, seed, block_size, tmp_path_factory)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, eos_token_id=None, drafter=drafter,
                         tree_budget=budget, return_dict_in_generate=True)
    assert out.sequences.shape == (R, ids.shape[1] + max_new)
    assert torch.equal(out.sequences, autoregressive(seed, R, max_new))
    L = block_size - 1
    if kind == "oracle":  # the greedy chain is the spine: every step accepts min(B, L) + 1
        assert (out.accept_lengths[out.accept_lengths > 0] == min(budget, L) + 1).all(), out.accept_lengths
    if kind == "oracle_off_spine":  # B = 2 + 4 + 8 covers the binary tree to depth L = 3
        assert (out.accept_lengths[out.accept_lengths > 0] == L + 1).all(), out.accept_lengths


def int4_model(seed: int, **overrides):
    """tiny_target with hidden 128 and experts' intermediate 64 (int4_moe's tiles), its routed
    experts quantised to compressed-tensors INT4 (symmetric, groups of 32) and loaded with
    set_int4: the model's INT4 paths (kdtree::int4_moe; on CUDA decode-sized passes fuse the
    shared expert and the residual into it, tree verifies of more than 32 slots do not)."""
    from torch_kdtree.models.generation.tiny import quantize_experts_int4
    from torch_kdtree.models.kimi_k2 import KimiK2Experts

    model = quantize_experts_int4(tiny_target(seed, hidden_size=128, moe_intermediate_size=64, **overrides))
    assert all(m.is_int4 for m in model.modules() if isinstance(m, KimiK2Experts))
    return model


int4_target = functools.lru_cache(maxsize=None)(int4_model)


@pytest.mark.parametrize("kind,budget,seed", [("oracle_80", 6, 40), ("random_dflash", 12, 41)])
def test_greedy_ddtree_equals_autoregressive_with_an_int4_target(kind, budget, seed):
    model = int4_target(seed)
    ids, mask = prompts(2, seed)
    drafter = make_drafter(kind, model, seed, 4)
    ar = model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None)
    dd = model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None, drafter=drafter,
                        tree_budget=budget, return_dict_in_generate=True)
    assert torch.equal(dd.sequences, ar)
    if kind == "oracle_80":
        assert dd.mean_accept_length > 1.5  # drafts were accepted: tree verifies really ran


@pytest.mark.parametrize("seed", range(20, 28))
def test_greedy_ddtree_equals_autoregressive_over_seeds(seed):
    model = target(seed)
    ids, mask = prompts(2, seed)
    drafter = make_drafter("oracle_80", model, seed, 4)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=14, eos_token_id=None, drafter=drafter,
                         tree_budget=6, return_dict_in_generate=True)
    assert torch.equal(out.sequences, autoregressive(seed, 2, 14))
    assert out.mean_accept_length > 1.5  # drafts were accepted: the commit really moved entries


def test_a_calls_prefill_and_step_seconds_are_parts_of_its_wall_time():
    """prefill_seconds (the time to the first token) and step_seconds (inside the decoding steps) of
    a call: both positive, together within the call's wall clock, and the prefill grows with the
    prompt (a 1,024-token prompt against a 4-token one, the same session sizes)."""
    import time

    model = target(23)
    drafter = make_drafter("oracle_80", model, 23, 4)
    for speculative in (None, "ddtree"):
        prefills = []
        for n in (4, 1024):
            ids = torch.randint(3, 128, (2, n), generator=torch.Generator().manual_seed(n))
            kw = dict(drafter=drafter, tree_budget=6) if speculative else {}
            model.generate(ids, max_new_tokens=8, eos_token_id=None, **kw)  # the session, once
            t0 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=8, eos_token_id=None, return_dict_in_generate=True, **kw)
            wall = time.perf_counter() - t0
            assert out.prefill_seconds > 0 and out.step_seconds > 0
            assert out.prefill_seconds + out.step_seconds <= wall
            prefills.append(out.prefill_seconds)
        assert prefills[1] > 2 * prefills[0], prefills  # 256x the prompt: far more than timer noise


def test_oracle_accuracy_controls_acceptance():
    model = target(30)
    ids, mask = prompts(1, 30)
    means = []
    drafter = OracleDrafter(model, 5, second_choice=0.0, seed=1)
    for accuracy in (0.0, 0.5, 1.0):
        drafter.set_accuracy(accuracy)  # in place: the captured session is reused
        out = model.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=None, drafter=drafter,
                             tree_budget=4, return_dict_in_generate=True)
        means.append(out.mean_accept_length)
    assert means[0] == 1.0 and means[2] == 5.0 and 1.0 < means[1] < 5.0, means
    assert len(model.__dict__["_ddtree_sessions"]) == 1


@pytest.mark.parametrize("compile_step", [False, "aot_eager"])
def test_oracle_looks_ahead_through_each_budgets_verify_pass(compile_step):
    """In a session the oracle decodes its continuation through the coming step's own verify pass
    (that budget's plan, [R, B + 1] nodes: the verify's rounding), min(L, B) passes a look-ahead,
    not through one-token passes; in fp32 both give the same greedy tokens (a B-node tree reaches
    depth B at most: deeper depths repeat the last), the cache's lengths are left as they were, and
    a perfect oracle's step then accepts min(B, L) + 1 tokens."""
    from torch_kdtree.models.generation import GenerationSession

    model = target(32)
    ids, mask = prompts(2, 32, left=False)
    drafter = OracleDrafter(model, 5, accuracy=1.0, seed=1)  # L = 4
    try:
        torch._dynamo.reset()
        session = GenerationSession(model, drafter, batch_size=2, max_prompt=16, max_new=24, budgets=(0, 2, 6),
                                    compile_step=compile_step)
        calls = []
        for b, fn in list(session._passes.items()):
            session._passes[b] = lambda *a, b=b, fn=fn: calls.append((b, tuple(a[0].shape))) or fn(*a)
        session.prefill(ids, mask.sum(1), max_new=20, eos=[])
        lengths = session.cache.lengths.clone()
        for budget in (2, 6):
            calls.clear()
            session._look_ahead(budget)
            through_verify = drafter.continuation.clone()
            assert calls == [(budget, (2, budget + 1))] * min(4, budget)
            assert torch.equal(session.cache.lengths, lengths)
            drafter.prepare(session.root)  # one token at a time
            reach = min(4, budget)
            assert torch.equal(through_verify[:, :reach], drafter.continuation[:, :reach])
            assert (through_verify[:, reach:] == through_verify[:, reach - 1 : reach]).all()
            assert torch.equal(session.cache.lengths, lengths)
        for budget in (6, 2):
            session.step(budget)
        steps = session.accept_log[:2].tolist()
        assert steps == [[5, 5], [3, 3]], steps
    finally:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()


def test_step_compiles_as_one_graph_and_equals_eager():
    """The whole step (drafter, top-K, build, verify, sampling, accept, commit, outputs) traces
    with fullgraph=True; through AOT autograd it gives the eager tokens."""
    from torch_kdtree.models.generation import GenerationSession

    model = target(31)
    ids, mask = prompts(2, 31, left=False)
    outs = []
    try:
        for compile_step in (False, "aot_eager"):
            torch._dynamo.reset()
            drafter = make_drafter("oracle_60_inner", model, 2, 4)
            session = GenerationSession(model, drafter, batch_size=2, max_prompt=16, max_new=16, budgets=(0, 5),
                                        compile_step=compile_step)
            session.prefill(ids, mask.sum(1), max_new=12, eos=[])
            for i in range(6):
                session.step(0 if i == 2 else 5)  # an autoregressive step in between
            outs.append(session.tokens())
    finally:  # leave no compiled state or counters to later tests
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
    assert torch.equal(outs[0][0], outs[1][0]) and outs[0][1] == outs[1][1]


def test_compiled_steps_of_two_models_and_a_dozen_budgets_in_one_process():
    """Every (model, budget) step compiles once, on a code object of its own: two models and twelve
    budgets (more than dynamo's recompile limit of 8 for one code object) all compile with
    fullgraph=True, run, and give each model's autoregressive tokens (fp32)."""
    budgets = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24)
    try:
        torch._dynamo.reset()
        for seed in (41, 42):
            model, (ids, mask) = target(seed), prompts(1, seed)
            ar = model.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None, compile_step="aot_eager")
            assert torch.equal(ar, autoregressive(seed, 1, 8))
            drafter = make_drafter("random_dflash", model, seed, 4)
            for budget in budgets:
                dd = model.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None, drafter=drafter,
                                    tree_budget=budget, compile_step="aot_eager")
                assert torch.equal(dd, ar), (seed, budget)
    finally:
        torch._dynamo.reset()


def test_inductor_compiled_ddtree_on_cpu_equals_autoregressive():
    """generate(compile_step=True) on CPU: the steps through inductor's C++ backend (an INT4 target,
    the oracle drafter, whose look-ahead once tripped that backend: pytorch/pytorch#196570) give
    the eager autoregressive tokens exactly (fp32)."""
    model = int4_target(96)
    ids, mask = prompts(3, 96)
    ar = model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None)
    try:
        torch._dynamo.reset()
        dd = model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None,
                            drafter=make_drafter("oracle_80", model, 97, 6), tree_budget=8, compile_step=True)
    finally:
        torch._dynamo.reset()
    assert torch.equal(dd, ar)


def test_compile_step_forms_reach_torch_compile(monkeypatch):
    """compile_step: True -> inductor, a name -> that backend, a dict -> inductor with those
    options ("combo" / "tuned" name option sets); generate's default "auto" compiles only CUDA
    graphs on CUDA (eager here)."""
    seen = []

    def fake_compile(fn, **kwargs):
        seen.append(kwargs)
        return fn

    model = target(32)
    ids, mask = prompts(1, 32, left=False)
    monkeypatch.setattr(torch, "compile", fake_compile)
    for form, want in ((True, {"backend": "inductor"}), ("aot_eager", {"backend": "aot_eager"}),
                       ({"combo_kernels": True}, {"backend": "inductor", "options": {"combo_kernels": True}}),
                       ("combo", {"backend": "inductor", "options": {"combo_kernels": True}}),
                       ("tuned", {"backend": "inductor",
                                  "options": {"combo_kernels": True, "coordinate_descent_tuning": True}})):
        seen.clear()
        model.generate(ids, attention_mask=mask, max_new_tokens=2, eos_token_id=None, compile_step=form)
        assert seen and all({k: v for k, v in kw.items() if k in ("backend", "options")} == want for kw in seen)
    seen.clear()
    model.generate(ids, attention_mask=mask, max_new_tokens=2, eos_token_id=None)
    assert seen == []


@pytest.mark.parametrize("speculative", [None, "ddtree"])
def test_batch_of_different_prompt_lengths_equals_single_runs(speculative):
    model = target(40)
    ids, mask = prompts(3, 40, lo=2, hi=10)
    right_ids, right_mask = prompts(3, 40, lo=2, hi=10, left=False)

    def run(i, m):
        drafter = make_drafter("oracle_80", model, 3, 4) if speculative else None
        out = model.generate(i, attention_mask=m, max_new_tokens=12, eos_token_id=None, drafter=drafter, tree_budget=6)
        return out[:, i.shape[1]:]

    batched = run(ids, mask)
    assert torch.equal(run(right_ids, right_mask), batched)  # right padding: the same continuations
    for r in range(3):
        alone = ids[r, mask[r].bool()][None]
        assert torch.equal(run(alone, None)[0], batched[r]), r


def test_eos_and_max_new_tokens_stop_where_autoregressive_stops():
    seed, R = 50, 3
    model = target(seed)
    ids, mask = prompts(R, seed)
    T = ids.shape[1]
    full = autoregressive(seed, R, 16)[:, T:]
    # an EOS that request 0 first emits a few tokens in; the others end elsewhere or not at all
    k = next(k for k in range(3, 16) if int(full[0, k]) not in full[0, :k].tolist())
    eos = int(full[0, k])
    ends = []
    for r in range(R):
        hits = (full[r] == eos).nonzero()
        ends.append(int(hits[0, 0]) + 1 if hits.numel() else 16)
    expected = torch.zeros(R, max(ends), dtype=torch.long)  # pad_token_id 0 after each end
    for r, n in enumerate(ends):
        expected[r, :n] = full[r, :n]
    ar = model.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(ar[:, T:], expected)
    for budget, block in ((8, 6), (3, 4)):  # perfect drafts: EOS sits inside a multi-token step
        drafter = make_drafter("oracle", model, seed, block)
        dd = model.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=[eos, 127], pad_token_id=0,
                            drafter=drafter, tree_budget=budget)
        assert torch.equal(dd, ar), (budget, block)
    drafter = make_drafter("oracle", model, seed, 6)
    for n in (1, 2, 5, 7):  # steps of 6 tokens overshoot: truncated to n
        dd = model.generate(ids, attention_mask=mask, max_new_tokens=n, eos_token_id=None, drafter=drafter,
                            tree_budget=8)
        assert torch.equal(dd[:, T:], full[:, :n]), n


def test_eager_cpu_tree_passes_run_over_the_running_requests_only():
    """Once a request has finished (its EOS), an eager CPU session's tree passes take the running
    requests' rows only, through a view of their cache rows; the output is still autoregressive's,
    and the cache view writes into the shared pages."""
    from torch_kdtree.models.kimi_k2 import KimiK2Cache

    seed, R = 41, 3
    model = target(seed)
    ids, mask = prompts(R, seed)
    full = model.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=None)[:, ids.shape[1]:]
    eos = int(full[0, 2])  # request 0 ends at its third token, the others after their eighth or never
    assert eos not in full[0, :2].tolist() and all(eos not in full[r, :8].tolist() for r in (1, 2))
    ar = model.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=eos, pad_token_id=0)
    rows = []
    hook = model.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]) if len(args) > 3 else None)
    try:
        dd = model.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=eos, pad_token_id=0,
                            drafter=make_drafter("oracle_80", model, seed, 4), tree_budget=6)
    finally:
        hook.remove()
    assert torch.equal(dd, ar)
    assert rows[0] == R and min(rows) < R  # tree passes over fewer rows after request 0 finished
    # the view: its writes land in the parent's pages; its lengths are its own
    cache = KimiK2Cache(2, 3, 16, 4, page_size=4, dtype=torch.float32)
    cache.advance(torch.tensor([5, 2, 7]))
    view = cache.rows(torch.tensor([2, 0]))
    assert view.lengths.tolist() == [7, 5] and view.batch_size == 2 and view.capacity == cache.capacity
    view.write(1, view.slots(1), torch.tensor([[[1.0, 2, 3, 4]], [[5.0, 6, 7, 8]]]))
    torch.testing.assert_close(cache.read(1, 8)[[2, 0], [7, 5]], torch.tensor([[1.0, 2, 3, 4], [5.0, 6, 7, 8]]))
    view.advance(1)
    assert cache.lengths.tolist() == [5, 2, 7]


# --------------------------------------------------------------------------------------------
# sampling: sample-and-walk is lossless
# --------------------------------------------------------------------------------------------

def test_logits_processing_matches_transformers_warpers():
    g = torch.Generator().manual_seed(60)
    logits = torch.randn(3, 5, 50, generator=g) * 3
    for temperature, top_k, top_p, min_p in ((1.0, 50, 1.0, None), (0.7, 10, 1.0, None), (1.3, 50, 0.8, None),
                                             (0.5, 7, 0.6, None), (1.0, 1, 0.3, None), (1.0, 50, 1.0, 0.05),
                                             (0.7, 20, 0.9, 0.1), (1.3, 50, 1.0, 1.0), (1.0, 50, 1.0, 0.0)):
        ours = process_logits(logits, torch.full((3,), temperature), torch.full((3,), top_k),
                              torch.full((3,), top_p), None if min_p is None else torch.full((3,), min_p))
        theirs = logits.view(15, 50)
        if temperature != 1.0:
            theirs = TemperatureLogitsWarper(temperature)(None, theirs)
        theirs = TopKLogitsWarper(top_k)(None, theirs)
        if top_p < 1.0:
            theirs = TopPLogitsWarper(top_p)(None, theirs)
        if min_p is not None:
            theirs = MinPLogitsWarper(min_p)(None, theirs)
        assert torch.equal(ours.view(15, 50), theirs), (temperature, top_k, top_p, min_p)
        if min_p:  # it removed something beyond what top-k / top-p did (else the case tests nothing)
            assert (ours == float("-inf")).sum() > (process_logits(
                logits, torch.full((3,), temperature), torch.full((3,), top_k), torch.full((3,), top_p)) == float("-inf")).sum()


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of counts against probabilities; cells expecting < 5 merged into one."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]).double()
    exp = torch.cat([expected[~small], expected[small].sum()[None]]).double()
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def _exact_distribution(model, prompt: torch.Tensor, steps: int, temperature, top_k, top_p, min_p=None,
                        penalty=None) -> torch.Tensor:
    """P(t_1 .. t_steps | prompt) for every sequence over the vocabulary, by enumeration."""
    V = model.config.vocab_size
    probs = torch.ones(1)
    prefixes = prompt[None]
    with torch.no_grad():
        for _ in range(steps):
            logits = model(prefixes).logits[:, -1:]
            if penalty is not None:  # transformers' processor, before the warpers (its order)
                from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
                logits = RepetitionPenaltyLogitsProcessor(penalty)(prefixes, logits[:, 0].float())[:, None]
            n = prefixes.shape[0]
            p = process_logits(logits, torch.full((n,), float(temperature)), torch.full((n,), top_k),
                               torch.full((n,), float(top_p)),
                               None if min_p is None else torch.full((n,), float(min_p))).softmax(-1)[:, 0]
            probs = (probs[:, None] * p).reshape(-1)
            prefixes = torch.cat([prefixes.repeat_interleave(V, 0), torch.arange(V).repeat(n)[:, None]], dim=1)
    return probs


@pytest.mark.parametrize("speculative,temperature,top_k,top_p,min_p,penalty", [
    (None, 1.0, 0, 1.0, None, None),  # validates the harness: plain autoregressive sampling
    ("ddtree", 1.0, 0, 1.0, None, None),
    ("ddtree", 0.7, 2, 0.9, None, None),  # temperature, top-k and top-p on every node
    ("ddtree", 1.0, 0, 1.0, 0.3, None),  # min-p on every node
    ("ddtree", 1.0, 0, 1.0, None, 5.0),  # repetition penalty before the warpers (its path term: test below)
])
def test_sampled_sequences_follow_the_autoregressive_distribution(speculative, temperature, top_k, top_p, min_p,
                                                                   penalty):
    """The first three generated tokens over a 3-token vocabulary (27 sequences): n = 1200
    requests in one batch against the enumerated autoregressive distribution, Pearson's
    chi-square; false-alarm rate 1e-3 per case (fixed seeds, so the outcome is deterministic).
    With DDTree (random drafter, B = 6, K = V) most first steps walk below the root, so tokens
    2 and 3 come from one tree."""
    model = target(70, vocab_size=3, bos_token_id=1, eos_token_id=2)
    # with a penalty, a prompt of one token: the others are penalised only once generated (the
    # path term's effect on these three tokens is too rare for this test to see: the node-by-node
    # test_repetition_penalty_covers_each_nodes_own_path checks it)
    prompt = torch.tensor([1, 0, 2, 1, 1]) if penalty is None else torch.tensor([1, 1, 1, 1, 1])
    probs = _exact_distribution(model, prompt, 3, temperature, top_k, top_p, min_p, penalty)
    if min_p is not None:  # the case must test a cut: some sequence removed by min-p alone
        assert (probs == 0).sum() > (_exact_distribution(model, prompt, 3, temperature, top_k, top_p) == 0).sum()
    if penalty is not None:  # ... and a penalty that moves the distribution
        assert (probs - _exact_distribution(model, prompt, 3, temperature, top_k, top_p)).abs().max() > 0.05
    n = 1200
    drafter = tiny_drafter(model, seed=71, block_size=4) if speculative else None
    torch.manual_seed(72)
    out = model.generate(prompt.repeat(n, 1), max_new_tokens=3, eos_token_id=None, do_sample=True,
                         temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=penalty,
                         drafter=drafter, tree_budget=6, page_size=16, return_dict_in_generate=True)
    gen = out.sequences[:, prompt.numel():]
    counts = torch.bincount((gen * torch.tensor([9, 3, 1])).sum(1), minlength=27)
    if speculative:
        walked = (out.accept_lengths[:, 0] >= 2).float().mean().item()
        assert walked > 0.5, walked  # sample-and-walk really emitted several samples from one tree
    assert (counts[probs == 0] == 0).all()  # nothing outside the top-k / top-p / min-p support
    assert _chi_square_p_value(counts, probs) > 1e-3


# --------------------------------------------------------------------------------------------
# the budget cost model
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_counterfactual_accept_length_equals_the_smaller_budgets_walk(seed):
    """A step at budget B says exactly what any b <= B would have accepted: the accepted path's
    nodes with index <= b (budget.py).  Checked against building and walking the b-tree."""
    g = torch.Generator().manual_seed(seed)
    R, L, V, B = 3, 5, 6, 40
    logits = torch.randn(R, L, V, generator=g) * 2
    lp, ids = torch.log_softmax(logits, -1).sort(-1, descending=True)
    root = torch.randint(0, V, (R,), generator=g)
    table = torch.randint(0, V, (V,) * (L + 1), generator=g)  # the "target": next token of each path

    def post_of(tree):
        path = tree.tokens.new_zeros(R, tree.tokens.shape[1], L + 1)
        for r in range(R):
            for i in range(tree.tokens.shape[1]):
                node, chain = i, []
                while node >= 0:
                    chain.append(int(tree.tokens[r, node]))
                    node = int(tree.parents[r, node])
                chain = chain[::-1] if tree.tokens[r, i] >= 0 else [0]
                path[r, i, : len(chain)] = torch.tensor(chain)
        return table[tuple(path.unbind(-1))]

    big = ddtree_build(lp.contiguous(), ids.contiguous(), root, B)
    acc_big = tree_accept(big.tokens, big.parents, post_of(big))
    for b in (1, 3, 8, 17, B):
        small = ddtree_build(lp[..., :b].contiguous(), ids[..., :b].contiguous(), root, b)
        acc = tree_accept(small.tokens, small.parents, post_of(small))
        within = ((acc_big.indices >= 0) & (acc_big.indices <= b)).sum(1)
        assert torch.equal(within.int(), acc.lengths), b


def test_planner_explores_then_picks_most_tokens_per_second():
    """One step at the largest budget tells a(b) for every b; then the best rate runs in full
    segments.  Exploration policy and its bounds: tests/test_budget_planner.py."""
    planner = BudgetPlanner((0, 4, 16), {0: 1.0, 4: 2.0, 16: 4.0})
    assert (planner.current, planner.segment_steps) == (16, 1)  # nothing known: one step at the largest
    planner.observe(16, {4: (30.0, 10.0), 16: (50.0, 10.0)}, 4.0, 1)  # a(4) = 3, a(16) = 5
    assert (planner.current, planner.segment_steps) == (4, None)  # 3 / 2 > 5 / 4 > 1 / 1
    planner.observe(4, {4: (80.0, 80.0)}, 3.0, 8)  # the drafts got worse: a(4) ~ 1
    keep = 0.5 ** (8 / planner.time_half_life)  # step times follow the measurements, over ~16 steps
    assert planner.seconds[4] == pytest.approx(2.0 * keep + 3.0 * (1 - keep))
    assert planner.current == 16  # the stale a(16) = 5: 5 / 4 > 1 / 1 > 1 / 2.5; running it measures it
    planner.observe(16, {4: (80.0, 80.0), 16: (96.0, 80.0)}, 4.0, 8)  # a(16) ~ 1.4 (new 1.2, old 5 aged)
    assert (planner.current, planner.segment_steps) == (0, None)  # 1 / 1 > 1.0 / 2.5 > 1.4 / 4


# --------------------------------------------------------------------------------------------
# transformers-facing behaviour
# --------------------------------------------------------------------------------------------

class Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_streamer_receives_the_prompt_then_every_generated_token():
    model = target(80)
    ids, _ = prompts(1, 80)
    streamer = Collect()
    out = model.generate(ids, max_new_tokens=30, eos_token_id=None, drafter=make_drafter("oracle", model, 0, 4),
                         tree_budget=4, streamer=streamer, sync_every=2)
    assert streamer.ended and streamer.chunks[0] == ids[0].tolist()
    assert sum(streamer.chunks[1:], []) == out[0, ids.shape[1]:].tolist()
    assert len(streamer.chunks) > 3  # tokens arrived as generation went, not at the end
    with pytest.raises(ValueError, match="batch size 1"):
        model.generate(prompts(2, 80)[0], max_new_tokens=2, streamer=Collect())


def test_generation_config_fields_and_refusals():
    model = target(81)
    ids, _ = prompts(1, 81, lo=4, hi=4)
    assert model.generate(ids, max_length=10, eos_token_id=None).shape == (1, 10)
    assert torch.equal(model.generate(ids, max_length=4), ids)  # nothing left to generate
    with pytest.raises(NotImplementedError, match="num_beams"):
        model.generate(ids, max_new_tokens=2, num_beams=2)
    with pytest.raises(NotImplementedError, match="no_repeat_ngram_size"):
        model.generate(ids, max_new_tokens=2, no_repeat_ngram_size=3)
    with pytest.raises(ValueError, match="repetition_penalty must be"):
        model.generate(ids, max_new_tokens=2, repetition_penalty=0.0)
    with pytest.raises(ValueError, match="min_p must be in"):
        model.generate(ids, max_new_tokens=2, do_sample=True, min_p=1.5)
    with pytest.raises(TypeError, match="unexpected"):
        model.generate(ids, max_new_tokens=2, not_a_field=1)
    with pytest.raises(ValueError, match="needs a drafter"):
        model.generate(ids, max_new_tokens=2, speculative="ddtree")
    with pytest.raises(ValueError, match="tree_budget"):
        model.generate(ids, max_new_tokens=2, drafter=make_drafter("oracle", model, 0, 4), tree_budget=0)
    with pytest.raises(ValueError, match="contiguous"):
        model.generate(torch.ones(1, 4, dtype=torch.long), attention_mask=torch.tensor([[1, 0, 1, 1]]),
                       max_new_tokens=2)


def _processed_greedy(model, prompt: torch.Tensor, n: int, processor, eos: int | None = None) -> list:
    """Greedy decoding by full forward passes through one of transformers' own logits processors
    (stopping after ``eos``): the independent reference for the processors generate implements."""
    seq = prompt[None]
    with torch.no_grad():
        for _ in range(n):
            token = processor(seq, model(seq).logits[:, -1].float()).argmax(-1)
            seq = torch.cat([seq, token[:, None]], 1)
            if eos is not None and int(token) == eos:
                break
    return seq[0, prompt.numel():].tolist()


def _min_new_oracle(model, prompt: torch.Tensor, n: int, eos: int, min_new: int) -> list:
    from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

    return _processed_greedy(model, prompt, n, MinNewTokensLengthLogitsProcessor(prompt.numel(), min_new, eos), eos)


def test_min_new_tokens_holds_back_end_of_sequence_as_transformers_does():
    """A target whose greedy continuation soon hits the chosen end-of-sequence token: without
    min_new_tokens generation stops there; with it the token is masked until that many new tokens
    exist (then allowed), exactly as transformers' processor does it, and DDTree (an oracle and a
    random DFlash drafter) emits the autoregressive tokens."""
    model = target(86)
    prompt = prompts(1, 86, lo=6, hi=6)[0][0]
    free = model.generate(prompt[None], max_new_tokens=12, eos_token_id=None)[0, prompt.numel():].tolist()
    j = next(i for i in range(2, len(free)) if free[i] not in free[:i])  # a token new at step j + 1 >= 3
    eos = free[j]
    stopped = model.generate(prompt[None], max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    assert stopped[0, prompt.numel():].tolist() == free[: j + 1]
    for min_new in (1, j, j + 1, 9):
        want = _min_new_oracle(model, prompt, 12, eos, min_new)
        assert eos not in want[:min_new] and (min_new > j or want == free[: j + 1])
        assert min_new <= j or want[j] != eos  # held back where it would have ended
        for drafter in (None, make_drafter("oracle", model, 0, 4), make_drafter("random_dflash", model, 1, 4)):
            out = model.generate(prompt[None], max_new_tokens=12, eos_token_id=eos, pad_token_id=0, min_new_tokens=min_new,
                                 drafter=drafter, tree_budget=5, return_dict_in_generate=True)
            got = out.sequences[0, prompt.numel():].tolist()
            assert got == want + [0] * (len(got) - len(want)), (min_new, type(drafter).__name__, got, want)
    # the mask inside a compiled step (fullgraph), as a CUDA session runs it
    torch._dynamo.reset()
    compiled = model.generate(prompt[None], max_new_tokens=12, eos_token_id=eos, min_new_tokens=j + 1,
                              drafter=make_drafter("random_dflash", model, 1, 4), tree_budget=5, compile_step="aot_eager")
    torch._dynamo.reset()
    assert compiled[0, prompt.numel():].tolist() == _min_new_oracle(model, prompt, 12, eos, j + 1)
    with pytest.raises(ValueError, match="min_new_tokens must be"):
        model.generate(prompt[None], max_new_tokens=4, eos_token_id=eos, min_new_tokens=-1)


def _penalty_oracle(model, prompt: torch.Tensor, n: int, penalty: float) -> list:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    return _processed_greedy(model, prompt, n, RepetitionPenaltyLogitsProcessor(penalty))


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_as_transformers_applies_it(penalty):
    """Greedy tokens under repetition_penalty (> 1 discourages repeats, < 1 encourages them) equal
    transformers' processor over full forward passes, for AR and for DDTree (an oracle and a
    random DFlash drafter: each tree node is penalised for the drafts on its own path) and in a
    compiled step; and the penalty changed the output (else the test would test nothing)."""
    model = target(88, logit_scale=0.3)  # flat logits: the penalty decides many tokens
    prompt = prompts(1, 88, lo=8, hi=8)[0][0]
    want = _penalty_oracle(model, prompt, 16, penalty)
    assert want != model.generate(prompt[None], max_new_tokens=16, eos_token_id=None)[0, prompt.numel():].tolist()
    for drafter in (None, make_drafter("oracle", model, 0, 4), make_drafter("random_dflash", model, 1, 4)):
        got = model.generate(prompt[None], max_new_tokens=16, eos_token_id=None, repetition_penalty=penalty,
                             drafter=drafter, tree_budget=7)
        assert got[0, prompt.numel():].tolist() == want, type(drafter).__name__
    torch._dynamo.reset()
    compiled = model.generate(prompt[None], max_new_tokens=16, eos_token_id=None, repetition_penalty=penalty,
                              drafter=make_drafter("random_dflash", model, 1, 4), tree_budget=7, compile_step="aot_eager")
    torch._dynamo.reset()
    assert compiled[0, prompt.numel():].tolist() == want
    # a batch of prompts of other lengths (left-padded): each request penalises its own tokens only
    ids, mask = prompts(3, 89, lo=4, hi=9)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=None, repetition_penalty=penalty,
                         drafter=make_drafter("random_dflash", model, 1, 4), tree_budget=5)
    for r in range(3):
        real = ids[r][mask[r].bool()]
        assert out[r, ids.shape[1]:].tolist() == _penalty_oracle(model, real, 10, penalty), r


@pytest.mark.parametrize("penalty", [1.5, 0.6])
def test_repetition_penalty_covers_each_nodes_own_path(penalty):
    """The penalty a tree node gets is the one its prediction would get in autoregressive decoding:
    the prompt, the emitted tokens and the drafts on its own path below the root -- not its
    siblings' or cousins' -- checked node by node against transformers' processor on that
    sequence, with a small token range so that paths repeat tokens of the prompt and of each other."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from torch_kdtree.models.generation import GenerationSession, SamplingMode

    model = target(88, logit_scale=0.3)
    V, R, L, K, B = model.config.vocab_size, 2, 4, 5, 14
    session = GenerationSession(model, make_drafter("random_dflash", model, 1, L + 1), batch_size=R, max_prompt=9,
                                max_new=32, budgets=(0, B), mode=SamplingMode(penalty=True))
    ids, mask = prompts(R, 90, vocab=12, lo=5, hi=9, left=False)
    session.prefill(ids, mask.sum(1), max_new=32, eos=[], repetition_penalty=penalty)
    g = torch.Generator().manual_seed(91)
    lp = torch.randn(R, L, K, generator=g).sort(-1, descending=True).values
    tok = torch.stack([torch.stack([torch.randperm(12, generator=g)[:K] for _ in range(L)]) for _ in range(R)])
    tree = ddtree_build(lp, tok, session.root.clone(), B)
    logits = torch.randn(R, B + 1, V, generator=g)
    logits[..., :12] += 1.0  # the repeated tokens compete for the argmax
    got = session._select(logits, tree.depths.clamp(min=0).long(), tree)
    proc = RepetitionPenaltyLogitsProcessor(penalty)
    repeats = 0
    for r in range(R):
        context = ids[r][mask[r].bool()].tolist() + [int(session.root[r])]
        for i in range(B + 1):
            path, j = [], i
            while j > 0:
                path.append(int(tree.tokens[r, j]))
                j = int(tree.parents[r, j])
            seq = context + path[::-1]
            repeats += len(seq) - len(set(seq))
            want = proc(torch.tensor([seq]), logits[r, i][None].clone()).argmax(-1)
            assert int(got[r, i]) == int(want), (r, i, seq)
    assert repeats > 0


def test_min_new_tokens_with_sampling_and_batches():
    """Sampled requests of different prompt lengths never end before min_new_tokens (the
    end-of-sequence token is the most likely one from the start here), and do end after it."""
    model = target(87)
    ids, mask = prompts(6, 87)
    first = model.generate(ids, attention_mask=mask, max_new_tokens=1, eos_token_id=None)[:, -1]
    eos = int(first.mode().values)  # a likely first token: sampled often, early
    drafter = make_drafter("random_dflash", model, 2, 4)
    runs = {}
    for min_new in (None, 5):
        torch.manual_seed(5)
        out = model.generate(ids.repeat(8, 1), attention_mask=mask.repeat(8, 1), max_new_tokens=16, eos_token_id=eos,
                             pad_token_id=0, do_sample=True, min_new_tokens=min_new, drafter=drafter, tree_budget=6,
                             return_dict_in_generate=True)
        runs[min_new] = out.sequences[:, ids.shape[1]:]
    assert (runs[None][:, :5] == eos).any(1).sum() >= 2  # without the rule some requests end this early
    gen = runs[5]
    assert not (gen[:, :5] == eos).any()
    ended = (gen == eos).any(1)
    assert ended.any()  # the rule held back, and then let through, the end-of-sequence token


def test_num_return_sequences_samples_each_prompt_that_many_times():
    """transformers' layout: prompt r's samples on rows r*n ... r*n + n - 1, each starting with its
    prompt; the samples differ (independent draws); greedy decoding refuses n > 1."""
    model = target(92)
    ids, mask = prompts(2, 92)
    n = 4
    torch.manual_seed(3)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None, do_sample=True,
                         num_return_sequences=n, drafter=make_drafter("random_dflash", model, 1, 4), tree_budget=5)
    assert out.shape == (2 * n, ids.shape[1] + 12)
    assert torch.equal(out[:, : ids.shape[1]], ids.repeat_interleave(n, 0))
    for r in range(2):
        rows = out[r * n : (r + 1) * n, ids.shape[1]:]
        assert len({tuple(x) for x in rows.tolist()}) > 1, r
    with pytest.raises(ValueError, match="num_return_sequences"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, num_return_sequences=2)


def test_profile_mode_reports_accept_lengths_and_phase_times():
    model = target(82)
    ids, mask = prompts(2, 82)
    drafter = make_drafter("oracle_80", model, 1, 4)
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=None, drafter=drafter,
                           tree_budget=5, return_dict_in_generate=True)
    prof = model.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=None, drafter=drafter,
                          tree_budget=5, profile=True, return_dict_in_generate=True)
    assert torch.equal(prof.sequences, plain.sequences)
    assert [row["accept"] for row in prof.profile] == prof.accept_lengths.T.tolist()
    for row in prof.profile:
        for phase in ("draft", "topk", "build", "verify", "accept", "commit"):
            assert row[f"{phase}_ms"] > 0, (phase, row)
        assert row["total_ms"] >= row["verify_ms"]
    # the decode plan of the step, as the session made it (the CPU: the reference forms, the experts
    # looped over as 12 rows x top-k exceed the gather's GATHER_SLOTS)
    assert prof.plan.splitlines()[0] == "budget 5 (tree of 6 nodes): tree pass N=6, 12 rows, cpu float32, live keys"
    assert "layer 1: attention=torch qkv=torch router=linear route=topk experts=looped" in prof.plan
    assert plain.plan is None


def test_second_call_reuses_the_session():
    model = target(83)
    ids, mask = prompts(2, 83)
    drafter = make_drafter("random_dflash", model, 2, 4)
    first = model.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None, drafter=drafter, tree_budget=3)
    (session,) = model.__dict__["_ddtree_sessions"].values()
    second = model.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None, drafter=drafter,
                            tree_budget=3)
    assert list(model.__dict__["_ddtree_sessions"].values()) == [session] and torch.equal(first, second)


def test_session_sizes_are_few_and_close_to_the_request():
    """generate's session sizes (_bucket): never below the request, multiples of 16 to 128, four
    sizes an octave to 8,192 (<= 25 % over), then at most 1,023 tokens over (the KV planner's
    context stays close to what a long request allocates)."""
    from torch_kdtree.models.generation.generate import _bucket

    sizes = [_bucket(n) for n in range(1, 70_000)]
    for n, b in enumerate(sizes, start=1):
        assert n <= b and b % 16 == 0, (n, b)
        assert b - n < (16 if n <= 128 else max(16, n // 4) if n <= 8192 else 1024), (n, b)
    assert len(set(sizes[:8192])) == 8 + 4 * 6  # 16..128 in 16s, then 4 sizes in each octave to 8,192
    assert _bucket(200_000) - 200_000 < 1024 and _bucket(262_144) == 262_144


def test_a_compiled_session_serves_smaller_requests_and_only_those_that_fit():
    """A captured or compiled session (each size costs a compilation per budget) serves a later
    request whose prompt and new tokens fit and whose own session would be at least half its
    cache; a larger or a much smaller request gets a session of its own.  Each output equals the
    eager session's built for that request alone (fp32)."""
    model = target(99)
    drafter = make_drafter("random_dflash", model, 3, 4)
    twin = make_drafter("random_dflash", model, 3, 4)  # the same weights, its own context caches
    sessions = model.__dict__.setdefault("_ddtree_sessions", {})
    sessions.clear()

    def run(R_seed, lo, hi, new, compile_step, drafter=drafter):
        ids, mask = prompts(2, R_seed, lo=lo, hi=hi)
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, compile_step=compile_step,
                              eos_token_id=None, drafter=drafter, tree_budget=3)

    def eager(*request):  # a fresh eager session for exactly this request (the twin's), then forgotten
        before = dict(sessions)
        out = run(*request, False, drafter=twin)
        sessions.clear()
        sessions.update(before)
        return out

    big = (99, 20, 30, 40)
    assert torch.equal(run(*big, "aot_eager"), eager(*big))
    (first,) = sessions.values()
    for smaller in ((100, 12, 20, 30), (101, 3, 9, 24)):  # prompts <= 32 and <= 40 new: the first session
        assert torch.equal(run(*smaller, "aot_eager"), eager(*smaller))
        assert list(sessions.values()) == [first], smaller
    assert first.max_prompt == 32 and first.max_new == 48
    tiny = (102, 3, 5, 8)  # its own session would be 16 + 16: under half of 32 + 48
    assert torch.equal(run(*tiny, "aot_eager"), eager(*tiny))
    assert len(sessions) == 2 and first in sessions.values()
    longer = (103, 3, 9, 60)  # more new tokens than the first session holds
    assert torch.equal(run(*longer, "aot_eager"), eager(*longer))
    assert len(sessions) == 3
    # an eager request builds its exact sizes (cheap; its arithmetic never depends on an earlier call),
    # also with cuda_graphs left on (they do not apply on the CPU)
    sessions.clear()
    run(*big, False)
    run(101, 3, 9, 24, False)
    assert len(sessions) == 2


def test_session_is_rebuilt_when_another_session_reallocated_its_drafter():
    """An oracle wrapping a DFlash drafter re-allocates the DFlash context caches; the DFlash
    session built before must not run on the old buffers (its graphs would)."""
    model = target(85)
    ids, mask = prompts(2, 85)
    dflash = make_drafter("random_dflash", model, 4, 4)
    common = dict(attention_mask=mask, max_new_tokens=8, eos_token_id=None, tree_budget=4)
    first = model.generate(ids, drafter=dflash, **common)
    (old,) = model.__dict__["_ddtree_sessions"].values()
    oracle = OracleDrafter(model, accuracy=0.8, inner=dflash)
    assert torch.equal(model.generate(ids, drafter=oracle, **common), first)
    assert not old.drafter_is_current()
    assert torch.equal(model.generate(ids, drafter=dflash, **common), first)
    assert old not in model.__dict__["_ddtree_sessions"].values()


# --------------------------------------------------------------------------------------------
# GPU: bf16, CUDA graphs, no host synchronisation inside a step
# --------------------------------------------------------------------------------------------

GPU_HEADS = {"num_attention_heads": 8, "num_key_value_heads": 8}  # the MLA kernel's smallest head count


def gpu_target(seed: int):
    return tiny_target(seed, **GPU_HEADS).to("cuda", torch.bfloat16)


def test_routing_margins_names_each_moe_layer_from_its_router_scores():
    """routing_margins (the sacred tests' failure diagnostics): one entry per MoE layer, the gap the
    float64 scores of that layer's input give at the positions asked for, and the router restored."""
    from torch_kdtree.models.kimi_k2.moe import KimiK2MoE, KimiK2Router

    model = target(21, num_hidden_layers=3)
    prefix = torch.randint(0, 128, (12,), generator=torch.Generator().manual_seed(21))
    blocks = [m for m in model.modules() if isinstance(m, KimiK2MoE)]
    inputs = []
    hooks = [b.register_forward_pre_hook(lambda mod, args, kw: inputs.append(args[0].reshape(-1, args[0].shape[-1])),
                                         with_kwargs=True) for b in blocks]
    real = KimiK2Router.route
    try:
        found = routing_margins(model, prefix, 8)
    finally:
        for h in hooks:
            h.remove()
    assert KimiK2Router.route is real
    assert sorted(layer for _, layer, _ in found) == list(range(len(blocks))) and len(blocks) >= 2
    assert found == sorted(found)
    for gap, layer, pos in found:
        gate = blocks[layer].gate
        x = inputs[layer][8:].double()
        scores = (x @ gate.weight.double().T).sigmoid() + gate.e_score_correction_bias.double()
        top = scores.topk(gate.top_k + 1, dim=-1).values
        want = top[:, -2] - top[:, -1]
        assert 8 <= pos < 12 and abs(gap - want.min().item()) <= 1e-5 * max(1.0, scores.abs().max().item())
        assert int(want.argmin()) + 8 == pos or abs(want[pos - 8].item() - want.min().item()) <= 1e-5


def test_tie_diagnostics_see_the_routers_where_the_plan_launches_moe_route():
    """A plan with a kdtree::moe_route kernel (CUDA's; here kernels=ALL through the reference)
    chooses the experts without ``KimiK2Router.route``: routing_margins and expert_tie_flip's
    prefills must still see every router, with the gaps of the default plan's pass (run 175 on the
    H200 found the diagnostics blind: no router seen, every tie called a divergence)."""
    from torch_kdtree.models.kimi_k2.moe import KimiK2MoE
    from torch_kdtree.models.kimi_k2.plan import ALL, Target, plan_pass

    model = target(21, num_hidden_layers=3)
    prefix = torch.randint(0, 128, (12,), generator=torch.Generator().manual_seed(21))
    blocks = [m for m in model.modules() if isinstance(m, KimiK2MoE)]
    kernels = Target("cpu", False, ALL)
    unhooked = plan_pass(model, tokens=12, rows=12, tree=False, target=kernels)
    assert {lp.route for lp in unhooked.layers if lp.route} == {"moe_route"} and len(blocks) >= 2
    plain = routing_margins(model, prefix, 8)
    base, rows = last_position(model, prefix)
    model.model.plan_pass = lambda R, T, *, tree, dtype=None, **kw: plan_pass(model, tokens=T, rows=R * T, tree=tree,
                                                                              target=kernels, dtype=dtype)
    found = routing_margins(model, prefix, 8)
    k_base, k_rows = last_position(model, prefix)
    assert [(layer, pos) for _, layer, pos in found] == [(layer, pos) for _, layer, pos in plain]
    for (gap, _, _), (want, _, _) in zip(found, plain):
        assert abs(gap - want) <= 1e-5
    assert len(k_rows) == len(rows) == len(blocks)
    for (row, router), (want, want_router) in zip(k_rows, rows):
        assert router is want_router
        torch.testing.assert_close(row, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_base, base, rtol=1e-4, atol=1e-4)
    knocked, _ = last_position(model, prefix, (0, int(k_rows[0][0].argmax())))  # layer 0's top expert out
    assert not torch.equal(knocked, k_base)


def assert_equal_up_to_bf16_ties(model, ids, mask, got, want, resume=None, max_resumes: int = 8):
    """got == want token for token up to bf16 ties (the sacred tests' rule:
    torch_kdtree.models.generation.ties.check_equal_up_to_bf16_ties, which says what counts as a
    tie); prints each accepted tie, and fails naming the first divergence no tie explains."""
    result = check_equal_up_to_bf16_ties(model, ids, mask, got, want, resume=resume, max_resumes=max_resumes,
                                         log=print)
    if not result.equal:
        raise AssertionError(result.divergence)


def _expert_tie(seed: int, gap: float):
    """A tiny fp32 target whose one MoE layer, at the last position of a prefill of ``prefix``, has
    its 2nd and 3rd biased router scores ``gap`` apart (the 3rd expert's bias moved to make it so),
    with the token that argmax gives and the (different) one that taking the 3rd expert gives."""
    for s in range(seed, seed + 50):
        model = target(s)
        prefix = torch.randint(3, 128, (10,), generator=torch.Generator().manual_seed(s))
        _, ((row, router),) = last_position(model, prefix)
        top = (row.sigmoid() + router.e_score_correction_bias).topk(3)
        with torch.no_grad():
            router.e_score_correction_bias[top.indices[2]] += float(top.values[1] - top.values[2]) - gap
        base, _ = last_position(model, prefix)
        flipped, _ = last_position(model, prefix, (0, int(top.indices[1])))
        if flipped.argmax() != base.argmax() and base.max() - base[flipped.argmax()] > 0.5:
            return model, prefix, int(base.argmax()), int(flipped.argmax()), flipped, int(top.indices[1])
    raise AssertionError("no seed gave an expert swap that changes the argmax")


def test_an_expert_choice_tie_explains_a_divergence_only_when_its_other_side_gives_the_token(capsys):
    """The sacred bf16 tests' second allowance (expert_tie_flip): a divergence between the two tokens
    that the two sides of a near-tied expert choice give passes (in either order); one whose scores
    are not near a tie, or where one token is given by neither choice, fails."""
    model, prefix, want, other, flipped, expert = _expert_tie(31, 1e-3)
    # the knocked-out pass against an independent construction: the expert's bias pushed far down
    # (the MoE layer is the last one, so other positions' choices do not reach the last logits)
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    saved = bias.clone()
    with torch.no_grad():
        bias[expert] = -100.0
        oracle = model(prefix[None]).logits[0, -1].float()
        bias.copy_(saved)
    assert (flipped - oracle).abs().max() <= 1e-5 * oracle.abs().max()
    ids, mask = prefix[None], torch.ones(1, len(prefix), dtype=torch.long)
    sequence = lambda token: torch.cat([prefix, torch.tensor([token])])[None]
    for got, expected in ((other, want), (want, other)):  # either pass may side with the prefill
        assert_equal_up_to_bf16_ties(model, ids, mask, sequence(got), sequence(expected))
        assert "expert-choice tie" in capsys.readouterr().out
    base = model(prefix[None]).logits[0, -1].float()
    neither = int(torch.minimum(base, flipped).argmin())
    for got, expected in ((neither, want), (other, neither)):
        with pytest.raises(AssertionError, match="diverges at token 0"):
            assert_equal_up_to_bf16_ties(model, ids, mask, sequence(got), sequence(expected))
    # the library check behind the assertion (the demo's on a GPU) returns its verdict instead
    ok = check_equal_up_to_bf16_ties(model, ids, mask, sequence(other), sequence(want))
    assert ok.equal and ok.ties == 1 and ok.divergence is None and "expert-choice tie" in ok.lines[0]
    bad = check_equal_up_to_bf16_ties(model, ids, mask, sequence(neither), sequence(want))
    assert not bad.equal and bad.ties == 0 and bad.divergence.startswith("request 0 diverges at token 0")
    same = check_equal_up_to_bf16_ties(model, ids, mask, sequence(want), sequence(want))
    assert same.equal and same.ties == 0 and same.lines == []
    model, prefix, want, other, _, _ = _expert_tie(31, 4 * SCORE_TIE)  # `sequence` now extends this prefix
    with pytest.raises(AssertionError, match="diverges at token 0"):
        assert_equal_up_to_bf16_ties(model, prefix[None], mask, sequence(other), sequence(want))


def _decoding_tie(first_seed: int):
    """A bf16 tiny target (CPU) and a prefix [16] (its prompt: the first 6 tokens) whose last position
    has two tokens within 4 bf16 ulps of the top in single-token decoding (decoded_logits) but more
    than 4 ulps apart in a prefill, the prefill's argmax one of them: (model, prompt, prefix, the
    prefill's argmax, the other)."""
    for s in range(first_seed, first_seed + 2000):
        model = target(s).to(torch.bfloat16)
        prefix = torch.randint(3, 128, (16,), generator=torch.Generator().manual_seed(s))
        with torch.no_grad():
            pre = model(prefix[None]).logits[0, -1].float()
        dec = decoded_logits(model, prefix[:6], prefix)
        a, b = dec.topk(2).indices.tolist()
        if (dec[b] >= dec[a] - 4 * bf16_ulp(dec) and abs(pre[a] - pre[b]) > 4 * bf16_ulp(pre)
                and int(pre.argmax()) in (a, b)):
            top = int(pre.argmax())
            return model, prefix[:6], prefix, top, b if top == a else a
    raise AssertionError("no seed gave a tie that only single-token decoding shows")


def test_decoded_logits_are_the_prefills_in_fp32():
    """decoded_logits (the sacred tests' single-token-decoding view of a position) against a
    prefill of the same tokens: equal up to fp32 rounding on an fp32 target, and None where the
    prefix is the prompt."""
    model = target(41)
    prefix = torch.randint(3, 128, (12,), generator=torch.Generator().manual_seed(41))
    with torch.no_grad():
        want = model(prefix[None]).logits[0, -1].float()
    got = decoded_logits(model, prefix[:5], prefix)
    assert got.shape == want.shape and (got - want).abs().max() <= 1e-4 * want.abs().max()
    assert decoded_logits(model, prefix, prefix) is None


def test_a_tie_in_single_token_decoding_explains_a_divergence(capsys):
    """A divergence between two tokens that single-token decoding (the autoregressive step's kind of
    pass) ranks within 4 bf16 ulps of its top passes, in either order, though a prefill puts them
    more than 4 ulps apart; a token off the top in both views fails."""
    model, prompt, prefix, top, other = _decoding_tie(300)
    mask = torch.ones(1, len(prompt), dtype=torch.long)
    sequence = lambda token: torch.cat([prefix, torch.tensor([token])])[None]
    for got, want in ((other, top), (top, other)):
        assert_equal_up_to_bf16_ties(model, prompt[None], mask, sequence(got), sequence(want))
        assert "a bf16 tie in single-token decoding" in capsys.readouterr().out
    with torch.no_grad():
        pre = model(prefix[None]).logits[0, -1].float()
    dec = decoded_logits(model, prompt, prefix)
    low = int(torch.minimum(pre, dec).argmin())
    with pytest.raises(AssertionError, match="diverges at token 10"):
        assert_equal_up_to_bf16_ties(model, prompt[None], mask, sequence(low), sequence(top))


_greedy = greedy_resume  # resume for assert_equal_up_to_bf16_ties (test_default_pair, the TP tests import it)


def test_ties_are_checked_past_the_first_with_a_resumed_decoding(capsys):
    """With ``resume``, the tokens after an accepted tie are checked against autoregressive decoding
    resumed from got's side of it: a run that follows that decoding to the end passes, and a later
    token off it fails (which, without ``resume``, would go unchecked)."""
    model, prefix, want, other, _, _ = _expert_tie(31, 1e-3)
    resume = _greedy(model)
    mask = torch.ones(1, len(prefix), dtype=torch.long)
    side = lambda token: torch.cat([prefix, torch.tensor([token])])
    ref = torch.cat([side(want), resume(side(want), 5)])[None]  # the autoregressive run
    run = torch.cat([side(other), resume(side(other), 5)])[None]  # tie, then the other side's own decoding
    assert not torch.equal(run[0, len(prefix) + 1:], ref[0, len(prefix) + 1:])  # the check has work to do
    assert_equal_up_to_bf16_ties(model, prefix[None], mask, run, ref, resume=resume)
    out = capsys.readouterr().out
    assert "expert-choice tie" in out and "equal to the resumed decoding to the end" in out
    # a token 3 after the tie that no tie explains: the least likely one after the resumed history
    at = len(prefix) + 3
    with torch.no_grad():
        bad = int(model(run[:, :at]).logits[0, -1].argmin())
    wrong = run.clone()
    wrong[0, at] = bad
    assert_equal_up_to_bf16_ties(model, prefix[None], mask, wrong, ref)  # unchecked past the first tie
    with pytest.raises(AssertionError, match="diverges at token 3"):
        assert_equal_up_to_bf16_ties(model, prefix[None], mask, wrong, ref, resume=resume)
    # max_resumes bounds the decodings: with none, the check stops at the tie and says so
    assert_equal_up_to_bf16_ties(model, prefix[None], mask, wrong, ref, resume=resume, max_resumes=0)
    assert "not checked after token 0" in capsys.readouterr().out


@requires_mla_cuda
@pytest.mark.parametrize("kind,budget,compile_step", [("oracle_80", 8, "auto"), ("random_dflash", 16, False),
                                                      ("oracle", 32, "auto"), ("oracle_80", "auto", "auto")])
def test_cuda_bf16_ddtree_equals_autoregressive(kind, budget, compile_step):
    """The same kernels in bf16, CUDA graphs (steps compiled by inductor, the default, or eager
    ops): DDTree output equals autoregressive output (up to bf16 ties, see the helper)."""
    model = gpu_target(90)
    ids, mask = prompts(3, 90)
    ids, mask = ids.cuda(), mask.cuda()
    drafter = make_drafter(kind, model, 91, 6)
    if not isinstance(drafter, OracleDrafter):
        drafter = drafter.to("cuda", torch.bfloat16)
    ar = model.generate(ids, attention_mask=mask, max_new_tokens=40, eos_token_id=None, compile_step=compile_step)
    dd = model.generate(ids, attention_mask=mask, max_new_tokens=40, eos_token_id=None, drafter=drafter,
                        tree_budget=budget, compile_step=compile_step)
    assert_equal_up_to_bf16_ties(model, ids, mask, dd, ar, resume=_greedy(model, compile_step))


@requires_mla_cuda
@pytest.mark.skipif(not torch._C._dispatch_has_kernel_for_dispatch_key("kdtree::int4_moe", "CUDA"),
                    reason="needs the int4_moe CUDA kernel")
@pytest.mark.parametrize("kind,budget,seed,new_tokens,compile_step", [
    ("oracle_80", 8, 92, 40, "auto"), ("random_dflash", 16, 92, 40, "auto"),
    # bench/RESULTS.md runs 154-158: here requests 1 and 2 can diverge (tokens 17 and 12, logit gaps
    # 1.59 and 2.25) at expert-choice ties (score gaps 0.003 and 0.005), whichever GEMM computes the
    # verification's router logits: the expert-choice allowance of assert_equal_up_to_bf16_ties.
    # Checked past its first tie, request 0 meets a tie at token 30 that only single-token decoding
    # shows (runs 160-162: prefill logit gap 1.44, decoding 2 ulps, its router choosing another expert)
    ("oracle_80", 16, 96, 32, True)])
def test_cuda_int4_ddtree_equals_autoregressive(kind, budget, seed, new_tokens, compile_step):
    """An INT4 target in bf16 with CUDA graphs: the autoregressive steps' MoE blocks take
    int4_moe's decode path with the shared expert and residual fused in, the tree verifies (more
    than 32 slots) the grouped path; DDTree output equals autoregressive output up to bf16 ties."""
    model = int4_model(seed, **GPU_HEADS).to("cuda", torch.bfloat16)
    ids, mask = prompts(3, seed)
    ids, mask = ids.cuda(), mask.cuda()
    drafter = make_drafter(kind, model, seed + 1, 6)
    if not isinstance(drafter, OracleDrafter):
        drafter = drafter.to("cuda", torch.bfloat16)
    ar = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, eos_token_id=None,
                        compile_step=compile_step)
    dd = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, eos_token_id=None, drafter=drafter,
                        tree_budget=budget, compile_step=compile_step)
    assert_equal_up_to_bf16_ties(model, ids, mask, dd, ar, resume=_greedy(model, compile_step))


@requires_mla_cuda
@pytest.mark.parametrize("compile_step", ["auto", False])
def test_cuda_perfect_oracle_accepts_every_draft_through_the_verify_pass(compile_step):
    """bf16, CUDA graphs: the oracle's look-ahead runs each budget's verify pass, so a perfect
    oracle's chain is what the verify chooses, even on this random target's flat logits (where
    one-token passes, other kernels, part from it within a few tokens): the steps before a
    request's last (cut by max_new_tokens) accept L + 1 tokens -- all of them but, at most, one in
    ten (the true path's ancestors sit in other slots of the verify's tree than of the chain, so
    the attention may sum them in another order: a last-bit difference, a flip only at a tie)."""
    model = gpu_target(94)
    ids, mask = prompts(2, 94)
    drafter = OracleDrafter(model, 6, accuracy=1.0, seed=1)  # L = 5
    out = model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=96, eos_token_id=None,
                         drafter=drafter, tree_budget=8, compile_step=compile_step, return_dict_in_generate=True)
    full = []
    for row in out.accept_lengths.cpu():
        running = row[row > 0]
        full += (running[:-1] == 6).tolist()
    print(f"perfect oracle, compile_step={compile_step}: {sum(full)} of {len(full)} steps accept L + 1; "
          f"{out.accept_lengths.tolist()}")
    assert len(full) >= 28 and sum(full) >= 0.9 * len(full), out.accept_lengths.tolist()


@requires_mla_cuda
def test_cuda_compiled_step_in_graphs_equals_autoregressive():
    model = gpu_target(98)
    ids, mask = prompts(2, 98)
    ids, mask = ids.cuda(), mask.cuda()
    drafter = make_drafter("oracle_80", model, 99, 5)
    ar = model.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=None, compile_step=True)
    dd = model.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=None, drafter=drafter,
                        tree_budget=8, compile_step=True)
    assert_equal_up_to_bf16_ties(model, ids, mask, dd, ar, resume=_greedy(model, True))


@requires_mla_cuda
def test_cuda_steps_replay_captured_graphs_without_running_python():
    model = gpu_target(92)
    ids, mask = prompts(2, 92)
    drafter = make_drafter("random_dflash", model, 93, 4).to("cuda", torch.bfloat16)
    model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=24, eos_token_id=None, drafter=drafter,
                   tree_budget=8)  # builds and captures the session (the same shapes as below)
    replays, forwards = 0, 0
    replay, forward = torch.cuda.CUDAGraph.replay, type(model).forward

    def counting_replay(self):
        nonlocal replays
        replays += 1
        return replay(self)

    def counting_forward(self, *args, **kwargs):
        nonlocal forwards
        forwards += 1
        return forward(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda.CUDAGraph, "replay", counting_replay)
        mp.setattr(type(model), "forward", counting_forward)
        out = model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=24, eos_token_id=None,
                             drafter=drafter, tree_budget=8, return_dict_in_generate=True)
    steps = len(out.budgets)
    assert replays >= steps + 1 and steps >= 3
    assert forwards == 0  # the prefill (a prompt of <= PREFILL_GRAPH_TOKENS) and every step ran as graph replays
    (session,) = model.__dict__["_ddtree_sessions"].values()
    assert set(session.graphs) == {8, ("prefill", 16)}  # the step, and the prefill of prompts of <= 16 tokens
    assert all(isinstance(g, torch.cuda.CUDAGraph) for g in session.graphs.values())


@requires_mla_cuda
@pytest.mark.parametrize("budget", [0, 16])
def test_cuda_no_host_sync_inside_steps(budget):
    from torch_kdtree.models.generation import GenerationSession, SamplingMode

    model = gpu_target(94)
    drafter = make_drafter("oracle_80", model, 95, 5) if budget else None
    session = GenerationSession(model, drafter, batch_size=2, max_prompt=16, max_new=64, budgets=(budget,),
                                mode=SamplingMode(do_sample=True))
    ids, mask = prompts(2, 94, left=False)
    session.prefill(ids, mask.sum(1), max_new=64, eos=[], sampling=(0.8, 0, 1.0))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(8):
            session.step(budget)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert int(session.out_len.min()) > 1


@requires_mla_cuda
def test_cuda_sampling_in_graphs_draws_fresh_noise_every_replay():
    model = gpu_target(96)
    drafter = make_drafter("random_dflash", model, 97, 4).to("cuda", torch.bfloat16)
    prompt = torch.tensor([[5, 9, 17, 3]], device="cuda").repeat(16, 1)
    torch.manual_seed(0)
    a = model.generate(prompt, max_new_tokens=12, do_sample=True, eos_token_id=None, drafter=drafter, tree_budget=8)
    b = model.generate(prompt, max_new_tokens=12, do_sample=True, eos_token_id=None, drafter=drafter, tree_budget=8)
    assert len({tuple(row) for row in a[:, 4:].tolist()}) > 1  # requests differ within a batch
    assert not torch.equal(a, b)  # and between calls
    assert ((a >= 0) & (a < model.config.vocab_size)).all()


@requires_mla_cuda
def test_cuda_logits_processors_run_inside_compiled_graphs():
    """repetition_penalty, min_new_tokens and min_p (checked against transformers on the CPU) inside
    compiled, captured CUDA steps: each changes what it should and nothing fails to compile or
    capture.  (Greedy DDTree == AR under a penalty is the CPU tests' claim: the bf16 tie checker
    here decodes without the penalty.)"""
    model = gpu_target(94)
    ids, mask = prompts(2, 94)
    ids, mask = ids.cuda(), mask.cuda()
    drafter = make_drafter("random_dflash", model, 95, 4).to("cuda", torch.bfloat16)
    common = dict(attention_mask=mask, max_new_tokens=16, drafter=drafter, tree_budget=8)
    plain = model.generate(ids, eos_token_id=None, **common)
    penalised = model.generate(ids, eos_token_id=None, repetition_penalty=1.5, **common)
    assert not torch.equal(plain, penalised)
    eos = int(plain[0, ids.shape[1]])  # request 0's first greedy token
    held = model.generate(ids, eos_token_id=eos, pad_token_id=0, min_new_tokens=6, **common)
    assert held.shape[1] >= ids.shape[1] + 6 and not (held[:, ids.shape[1] : ids.shape[1] + 6] == eos).any()
    torch.manual_seed(0)
    sampled = model.generate(ids.repeat(4, 1), attention_mask=mask.repeat(4, 1), max_new_tokens=16, eos_token_id=None,
                             do_sample=True, min_p=0.1, drafter=drafter, tree_budget=8, num_return_sequences=2)
    assert sampled.shape == (16, ids.shape[1] + 16)
    assert ((sampled >= 0) & (sampled < model.config.vocab_size)).all()
    assert len({tuple(row) for row in sampled[:, ids.shape[1]:].tolist()}) > 1


def test_two_stage_argmax_is_the_first_maximum():
    from torch_kdtree.models.generation.sampling import ARGMAX_CHUNK, argmax_last

    g = torch.Generator().manual_seed(5)
    V = 4 * ARGMAX_CHUNK
    x = torch.randn(3, 2, V, generator=g)
    assert torch.equal(argmax_last(x), x.argmax(-1))
    tied = torch.zeros(2, V)
    tied[0, [5, ARGMAX_CHUNK + 1, 3 * ARGMAX_CHUNK]] = 2.0  # ties inside and across chunks
    tied[1, [ARGMAX_CHUNK + 7, 2 * ARGMAX_CHUNK + 7]] = float("inf")
    assert argmax_last(tied).tolist() == [5, ARGMAX_CHUNK + 7]
    odd = torch.randn(2, V + 3, generator=g)  # not a multiple of the chunk: one stage
    assert torch.equal(argmax_last(odd), odd.argmax(-1))


# ------------------------------------------------------------------------------------------------
# inductor's programmatic dependent launch in the compiled steps
# ------------------------------------------------------------------------------------------------

def test_inductor_options_add_pdl_on_cuda_devices_of_sm90_and_newer(monkeypatch):
    from torch_kdtree.models.generation.session import PDL_OPTION, inductor_options

    opts = {"combo_kernels": True}
    out = inductor_options(opts, torch.device("cpu"))
    assert out == opts and out is not opts
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    has_option = hasattr(torch._inductor.config.triton, PDL_OPTION.split(".")[1])
    cuda = torch.device("cuda")
    assert inductor_options(opts, cuda) == ({**opts, PDL_OPTION: True} if has_option else opts)
    assert opts == {"combo_kernels": True}  # not changed in place
    assert inductor_options({}, cuda) == ({PDL_OPTION: True} if has_option else {})
    assert inductor_options({PDL_OPTION: False}, cuda) == {PDL_OPTION: False}  # the caller's choice wins
    capability[0] = (8, 0)
    assert inductor_options(opts, cuda) == opts
    capability[0] = (12, 0)
    assert inductor_options(opts, cuda) == ({**opts, PDL_OPTION: True} if has_option else opts)


@pytest.mark.parametrize("compile_step, expected", [
    (True, {"backend": "inductor"}),
    ("combo", {"backend": "inductor", "options": {"combo_kernels": True}}),
    ({"max_autotune": False}, {"backend": "inductor", "options": {"max_autotune": False}}),
    ("aot_eager", {"backend": "aot_eager"}),
])
def test_session_compiles_steps_with_inductor_options(monkeypatch, compile_step, expected):
    """The session hands torch.compile the backend and inductor_options' options (on the CPU: the
    caller's options alone)."""
    from torch_kdtree.models.generation import session as session_mod

    seen = []

    def fake_compile(fn, **kw):
        seen.append(kw)
        return fn

    monkeypatch.setattr(session_mod.torch, "compile", fake_compile)
    model = tiny_target(41)
    session_mod.GenerationSession(model, None, batch_size=1, max_prompt=8, max_new=4, budgets=(0,),
                                  compile_step=compile_step)
    assert seen == [{"fullgraph": True, "dynamic": False, **expected}]


@requires_mla_cuda
def test_cuda_compiled_steps_triton_kernels_wait_before_reading_predecessors():
    """With inductor's PDL on (the default of compiled steps on sm_90+), every Triton kernel of the
    compiled autoregressive and DDTree steps that is launched with PDL calls gdc_wait: a kernel that
    never waits could finish before its predecessor, and the next kernel's wait would then not
    cover the predecessor's writes.  At least one kernel must be launched with PDL (the option is
    really applied)."""
    from torch._inductor import utils as inductor_utils

    from torch_kdtree.models.generation.session import PDL_OPTION, inductor_options

    if PDL_OPTION not in inductor_options({}, torch.device("cuda")):
        pytest.skip("inductor PDL does not apply here (torch without the option, pre-sm_90, or KDTREE_PDL=0)")
    model = gpu_target(97)
    ids, mask = prompts(2, 97)
    drafter = make_drafter("random_dflash", model, 98, 4).to("cuda", torch.bfloat16)
    fresh = getattr(inductor_utils, "fresh_cache", None) or inductor_utils.fresh_inductor_cache
    with fresh():
        _, codes = inductor_utils.run_and_get_code(
            lambda: model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=8, eos_token_id=None,
                                   drafter=drafter, tree_budget=8))
    kernels = [chunk.split("''', device_str")[0] for code in codes for chunk in code.split("async_compile.triton(")[1:]]
    pdl = [k for k in kernels if "'launch_pdl': True" in k]
    assert pdl, f"no Triton kernel launched with PDL among the {len(kernels)} of the compiled steps"
    no_wait = [k.split("'")[1] for k in pdl if "gdc_wait" not in k]
    assert not no_wait, f"Triton kernels launched with PDL that never wait: {no_wait}"


def _top_level_args(call: str) -> list[str]:
    """The comma-separated arguments of the call whose "(" opens ``call`` (nesting respected)."""
    depth, cur, out = 0, "", []
    for ch in call:
        if ch in "([":
            depth += 1
            if depth == 1 and ch == "(":
                continue
        elif ch in ")]":
            depth -= 1
            if depth == 0:
                out.append(cur.strip())
                return out
        if depth == 1 and ch == ",":
            out.append(cur.strip())
            cur = ""
        elif depth >= 1:
            cur += ch
    raise AssertionError(f"unbalanced call: {call}")


def _checked_route_logits_calls(codes: list[str], op: str) -> int:
    """For every ``kdtree::<op>`` call of inductor's wrapper code that passes route_logits (its last
    argument): the kdtree::moe_route call before it takes that same buffer as its logits, nothing is
    launched between the two (the hint's promise: moe_route is the kernel just before the op), and
    the op's x was named before moe_route (written earlier).  Returns the number of such calls."""
    import re

    launch = re.compile(r"\.run\(|torch\.ops\.|extern_kernels\.|\.launch\(|_kernel\(")

    def buffer_of(arg: str):  # "buf7", "arg3_1" or reinterpret_tensor(buf7, ...) -> the buffer; else None
        m = re.match(r"(?:reinterpret_tensor\()?((?:buf|arg)\w*)", arg.strip())
        return m.group(1) if m else None

    checked = 0
    for code in codes:
        lines = code.splitlines()
        for i, line in enumerate(lines):
            marker = f"kdtree.{op}.default("
            if marker not in line:
                continue
            args = _top_level_args(line[line.index(marker) + len(marker) - 1 :])
            hint = buffer_of(args[-1].split("=", 1)[-1] if args[-1].startswith("route_logits=") else args[-1])
            if hint is None:
                continue
            routes = [j for j in range(i) if "kdtree.moe_route.default(" in lines[j]]
            assert routes, f"{op} with route_logits but no moe_route before it: {line.strip()}"
            r = routes[-1]
            route_call = "moe_route.default("
            route_args = _top_level_args(lines[r][lines[r].index(route_call) + len(route_call) - 1 :])
            assert buffer_of(route_args[0]) == hint, \
                f"{op}'s route_logits {hint} is not moe_route's logits {route_args[0]}"
            between = [l.strip() for l in lines[r + 1 : i]
                       if launch.search(l) and not l.strip().startswith("assert_")]  # host-side checks
            assert not between, f"launches between moe_route and {op}: {between}"
            x_name = buffer_of(args[0])
            named = re.compile(rf"\b{x_name}\b")
            assert x_name.startswith("arg") or any(named.search(l) for l in lines[:r]), f"{x_name} after moe_route"
            checked += 1
    return checked


@requires_mla_cuda
@pytest.mark.skipif(not torch._C._dispatch_has_kernel_for_dispatch_key("kdtree::moe_gemv", "CUDA"),
                    reason="needs the moe_gemv CUDA kernel")
@pytest.mark.parametrize("budget", [0, 5], ids=["autoregressive", "tree"])
def test_cuda_compiled_steps_launch_the_experts_right_after_the_route_they_get_logits_of(budget):
    """route_logits promises that kdtree::moe_route is the kernel launched just before the experts'
    op and that x was complete before it ran.  In the compiled steps (inductor's wrapper code) of a
    bf16 target -- the autoregressive step, whose plan computes the norm and router logits in one
    kdtree::gemv launch, and a tree of 6 nodes, whose router product is a GEMM -- every moe_gemv
    call with the hint passes moe_route's own logits, with nothing launched in between, and an x
    named before moe_route."""
    from torch._inductor import utils as inductor_utils

    fresh = getattr(inductor_utils, "fresh_cache", None) or inductor_utils.fresh_inductor_cache
    model = tiny_target(95, **GPU_HEADS).to("cuda", torch.bfloat16)  # not gpu_target's: a fresh compile
    ids, mask = prompts(2, 94)
    R, N = 2, budget + 1
    moe_plan = model.model.plan_pass(R, N, tree=True, compiled=True).layers[1]
    assert moe_plan.route_hint and moe_plan.router == ("gemv_norm" if budget == 0 else "mm")
    drafter = dict(drafter=make_drafter("random_dflash", model, 94, 4).to("cuda", torch.bfloat16),
                   tree_budget=budget) if budget else {}
    with fresh():
        _, codes = inductor_utils.run_and_get_code(
            lambda: model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=6, eos_token_id=None,
                                   compile_step=True, **drafter))
    assert _checked_route_logits_calls(codes, "moe_gemv"), "no compiled moe_gemv call with route_logits"


def _assert_same_context_and_tokens(states, rows, model, ids, mask):
    """Two sessions' (context lengths, context K, context V, tokens) -- deferred and per-step
    appends -- hold the same drafter context (at least ``rows`` rows a request; fp32 rounding: fc
    over other row counts) and tokens, which equal autoregressive decoding's."""
    (n0, k0, v0, t0), (n1, k1, v1, t1) = states
    assert torch.equal(n0, n1) and int(n0.min()) >= rows
    for r, n in enumerate(n0.tolist()):
        torch.testing.assert_close(k0[:, r, :n], k1[:, r, :n], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v0[:, r, :n], v1[:, r, :n], rtol=1e-5, atol=1e-6)
    assert torch.equal(t0[0], t1[0]) and t0[1] == t1[1]
    n = min(t0[1])
    ar = model.generate(ids, attention_mask=mask, max_new_tokens=n, eos_token_id=None)
    assert torch.equal(t0[0][:, :n], ar[:, ids.shape[1]:])


@pytest.mark.parametrize("defer_rows", [None, 5])
def test_autoregressive_steps_defer_the_drafters_context_until_a_tree_needs_it(monkeypatch, defer_rows):
    """In a session with a drafter, an AR step stores its taps; they reach the drafter's context in
    one append before the next tree step, or when ``defer_rows`` (default DEFER_ROWS) are stored.
    The context is then what one append per AR step gives (fp32 rounding: rows of one fc call
    instead of one each), with the same lengths, and the generated tokens equal autoregressive
    decoding's.  A bad ``defer_rows`` is refused by name."""
    import copy

    from torch_kdtree.models.generation import GenerationSession
    from torch_kdtree.models.generation.session import DEFER_ROWS

    rows = defer_rows or DEFER_ROWS
    model = target(53)
    ids, mask = prompts(2, 53, left=False)
    base = make_drafter("random_dflash", model, 3, 4)
    calls = []
    states = []
    for defer in (True, False):
        drafter = copy.deepcopy(base)
        append = drafter.append_context
        monkeypatch.setattr(drafter, "append_context", lambda taps, *a, **k: calls.append((defer, taps.shape[1])) or
                            append(taps, *a, **k))
        session = GenerationSession(model, drafter, batch_size=2, max_prompt=16, max_new=rows + 12, budgets=(0, 4),
                                    defer_rows=defer_rows)
        assert session.defer == rows
        if not defer:
            session.defer = 0  # the AR step then appends each step's row itself
        session.prefill(ids, mask.sum(1), max_new=rows + 12, eos=[])
        for _ in range(rows + 3):
            session.step(0)
        session.step(4)
        states.append((drafter.context_lengths.clone(), drafter.context_k.clone(), drafter.context_v.clone(),
                       session.tokens()))
    # deferred: the prompt, one flush when the store filled, one of the 3 rows stored since before
    # the tree step (an eager session flushes exactly the stored rows), the tree's commit (taps of
    # its B + 1 = 5 nodes, the accepted ones gathered inside)
    assert [a for d, a in calls if d] == [ids.shape[1], rows, 3, 5]
    assert sum(1 for d, _ in calls if not d) == 1 + rows + 3 + 1
    _assert_same_context_and_tokens(states, rows + 3, model, ids, mask)
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match="defer_rows must be an int >= 1"):
            GenerationSession(model, base, batch_size=2, max_prompt=16, max_new=40, budgets=(0, 4), defer_rows=bad)


def test_a_compiled_session_flushes_a_short_run_of_ar_steps_through_the_short_flush():
    """Compiled (fixed shapes, as captured on a GPU): a tree step after at most SHORT_FLUSH stored
    AR steps runs the short flush (the store's first SHORT_FLUSH rows), after more the whole
    store's; a full store flushes before the AR step that would overfill it.  The drafter's
    context then equals a session's that appends every AR step's row itself (fp32 rounding: fc
    over other row counts), and the tokens equal autoregressive decoding's."""
    import copy

    from torch_kdtree.models.generation import GenerationSession
    from torch_kdtree.models.generation.session import SHORT_FLUSH

    model = target(54)
    ids, mask = prompts(2, 54, left=False)
    base = make_drafter("random_dflash", model, 3, 4)
    store = SHORT_FLUSH + 8
    runs = (3, SHORT_FLUSH, SHORT_FLUSH + 1, store + 2)  # AR steps before each tree step
    steps = sum(runs) + len(runs)
    states, keys = [], []
    for defer in (True, False):
        drafter = copy.deepcopy(base)
        session = GenerationSession(model, drafter, batch_size=2, max_prompt=16, max_new=steps * 5 + 8,
                                    budgets=(0, 4), compile_step="aot_eager", defer_rows=store)
        assert set(session._fns) >= {"flush", "flush_short"}
        if defer:
            run = session._run
            session._run = lambda key, fn: (keys.append(key) if isinstance(key, str) else None) or run(key, fn)
        else:
            session.defer = 0  # the AR step appends its own row
        session.prefill(ids, mask.sum(1), max_new=steps * 5 + 8, eos=[])
        for n in runs:
            for _ in range(n):
                session.step(0)
            session.step(4)
        states.append((drafter.context_lengths.clone(), drafter.context_k.clone(), drafter.context_v.clone(),
                       session.tokens()))
    # 3 and SHORT_FLUSH stored: short; SHORT_FLUSH + 1: the store's; store + 2: the full store's
    # flush before the AR step that would overfill it, then the 2 rows since: short
    assert keys == ["flush_short", "flush_short", "flush", "flush", "flush_short"], keys
    _assert_same_context_and_tokens(states, sum(runs), model, ids, mask)
