"""End-to-end generation on the GPU: step time against the tree budget, tokens/s with an oracle
drafter at controlled accuracy over sustained generations, and transformers' baselines.

Run (H200, ~3-5 min):  pytest bench/bench_generate.py --benchmark-only -s
Options (pytest's command line, declared in bench/conftest.py): --bench-tokens N (default 2000,
tokens per sustained generation), --bench-hf-tokens N (default 128: transformers' eager generate,
~50 tokens/s, is timed on fewer tokens), --bench-assisted-tokens N (default 64), --bench-compile
0|1|combo|tuned (default 1: steps compiled by inductor; 0: eager ops in the graphs; combo / tuned:
inductor with those options, combo as generate() compiles on CUDA), --bench-step-budgets B,B,...
(default 0,8,16,32,64,128,256, must include 0 and 16: the step-time table's budgets; each
compiles once, ~20-30 s on the H200).  E.g. pytest bench/bench_generate.py --benchmark-only -s
--bench-tokens 500 --bench-step-budgets 0,16.

Configurations (random weights, bf16, batch 1, 128-token random prompt):
- "2p2b": hidden 2048, 8 layers (layer 0 dense, intermediate 6144), 64 routed experts top-8 +
  1 shared (moe_intermediate 512), K2's MLA head dims (q_lora 1536, kv_lora 512, nope 128,
  rope 64, v 128) with 16 heads, vocab 163840 (2.2 B parameters).
- "k2_slice": one TP-8 rank of K2: hidden 7168, 8 heads, 384 INT4 routed experts top-8
  (moe_intermediate 256) + the shared expert's 256-wide slice, dense intermediate 2304, 4 layers,
  vocabulary slice 163840 / 8 = 20480 (a vocabulary-parallel head's shard).
Drafters: random DFlash drafters of the target's hidden size (2p2b: 2 layers, 16/4 heads,
intermediate 6144, taps [1, 5]; k2_slice: 1 layer, 8/1 heads, intermediate 2304, tap [2]),
block size 8 (L = 7, as Kimi-K2.5-DFlash).  The oracle wraps them: the DFlash forward runs
(its cost is in every step) and the oracle overrides its top ranks with the target's greedy
continuation at the given accuracy (models/generation/oracle.py); the oracle's own look-ahead
runs outside the timed steps.

Reported: ms per step (CUDA events around each graph replay), its ratio to the autoregressive
step and its floor: the bytes the step must read (bench/floor.py: the target's non-expert weights,
its shared experts, the routed experts its tokens actually routed to -- counted on the device in
one eager step per budget from the prompt's prefill -- the latent KV read, and the drafter's
weights, its lm_head pass and its context read) over the HBM ceiling of bench/conftest.py (max of
a read-only stream and a device copy, both measured in the same run), floor_ratio = floor / step;
tokens/s inside the decoding steps (2000 tokens / summed step time) and wall-clock, with the oracle
and with the random DFlash drafter alone (issue 44's "never loses" line: tree_budget="auto" must
stay within 3 % of autoregressive decoding); the AR step of a drafter session against that of a
plain session (same run); transformers' DeepseekV3ForCausalLM.generate (eager) and its assisted
generation with a one-layer random assistant, on the 2p2b configuration.
"""
import functools
import time
from typing import NamedTuple, Union

import pytest
import torch

from torch_kdtree.models.dflash import random_drafter
from torch_kdtree.models.generation import GenerationSession, OracleDrafter
from torch_kdtree.models.generation.session import DEFER_ROWS

from .conftest import compile_step_option, hbm_ceiling, needs_int4, record, requires_cuda, requires_mla
from .floor import routed_experts_of_step, step_bytes

PROMPT = 128
BLOCK_SIZE = 8
RESULTS: dict = {}


class RunOptions(NamedTuple):
    """This run's parameters (the module docstring's options)."""

    tokens: int                      # per sustained generation
    compile_step: Union[bool, str]   # GenerationSession's compile_step for the step-time table
    hf_tokens: int                   # transformers' eager generate
    assisted_tokens: int             # transformers' assisted generate
    budgets: tuple                   # the step-time table's budgets (0 and 16 among them)


@pytest.fixture(scope="session")
def run_options(request) -> RunOptions:
    get = request.config.getoption
    return RunOptions(tokens=get("--bench-tokens"), compile_step=compile_step_option(get("--bench-compile"), True),
                      hf_tokens=get("--bench-hf-tokens"), assisted_tokens=get("--bench-assisted-tokens"),
                      budgets=get("--bench-step-budgets"))


CONFIGS = {
    "2p2b": {"hidden_size": 2048, "num_hidden_layers": 8, "first_k_dense_replace": 1, "intermediate_size": 6144,
             "n_routed_experts": 64, "num_experts_per_tok": 8, "n_shared_experts": 1, "moe_intermediate_size": 512,
             "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 163840, "n_group": 1,
             "topk_group": 1},
    "k2_slice": {"hidden_size": 7168, "num_hidden_layers": 4, "first_k_dense_replace": 1, "intermediate_size": 2304,
                 "n_routed_experts": 384, "num_experts_per_tok": 8, "n_shared_experts": 1,
                 "moe_intermediate_size": 256, "num_attention_heads": 8, "num_key_value_heads": 8,
                 "vocab_size": 20480, "n_group": 1, "topk_group": 1, "bos_token_id": 20477, "eos_token_id": 20478},
}
DRAFTERS = {
    "2p2b": {"num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
             "intermediate_size": 6144, "target_layer_ids": [1, 5]},
    "k2_slice": {"num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 128,
                 "intermediate_size": 2304, "target_layer_ids": [2]},
}
MARKS = {"2p2b": [requires_cuda, requires_mla], "k2_slice": [requires_cuda, requires_mla, needs_int4]}


def config_dict(name: str) -> dict:
    from torch_kdtree.models.kimi_k2.writer import k2_config_dict

    return k2_config_dict(CONFIGS[name], int4=False, small=False)  # K2's MLA dims, YaRN, routing


@functools.lru_cache(maxsize=None)
def target(name: str):
    """The random bf16 target on the GPU (INT4 experts for the K2 slice)."""
    from torch_kdtree.models.kimi_k2 import KimiK2Config, KimiK2ForCausalLM, KimiK2MoE

    config = KimiK2Config.from_dict(config_dict(name))
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = KimiK2ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    if name == "k2_slice":
        for layer in model.model.layers:
            if isinstance(layer.mlp, KimiK2MoE):
                random_int4_experts(layer.mlp.experts, "cuda")
        torch.cuda.empty_cache()
    return model


def random_int4_experts(experts, device) -> None:
    """Random INT4 routed experts of ``experts``' shapes (gate / up [E, I, H], down [E, H, I]: dense,
    or meta tensors of a model built without memory), set on ``device``: any nibble is a valid
    weight; group-32 scales give std ~0.02."""
    E, I, H = experts.gate_proj.shape

    def packed(o, i):
        return torch.randint(-2**31, 2**31 - 1, (E, o, i // 8), dtype=torch.int32, device=device)

    def scale(o, i):
        return torch.full((E, o, i // 32), 0.02 / 4.6, dtype=torch.bfloat16, device=device)

    experts.set_int4(packed(I, H), scale(I, H), packed(I, H), scale(I, H), packed(H, I), scale(H, I))


@functools.lru_cache(maxsize=None)
def drafter(name: str):
    c = CONFIGS[name]
    d = random_drafter(seed=1, dtype=torch.float32, hidden_size=c["hidden_size"], vocab_size=c["vocab_size"],
                       mask_token_id=c["vocab_size"] - 1, num_target_layers=c["num_hidden_layers"],
                       block_size=BLOCK_SIZE, rms_norm_eps=1e-5, **DRAFTERS[name])
    return d.to("cuda", torch.bfloat16)


def prompt(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, CONFIGS[name]["vocab_size"] - 1, (1, PROMPT), generator=g).cuda()


def routed_experts(name: str, budgets) -> dict[int, list[int]]:
    """Per budget, the distinct routed experts per MoE layer of one step, counted on the device
    (bench/floor.py) in an eager session, each step fresh from the prompt's prefill.  It sets up
    the drafter's context cache anew: a session built earlier on the same drafter must not step
    afterwards."""
    session = GenerationSession(target(name), drafter(name), batch_size=1, max_prompt=PROMPT, max_new=512,
                                budgets=budgets, cuda_graphs=False)
    counts = {}
    for b in budgets:
        session.prefill(prompt(name), torch.tensor([PROMPT]), max_new=512, eos=[])
        counts[b] = routed_experts_of_step(session, b)
    return counts


def _configs():
    return [pytest.param(name, marks=MARKS[name]) for name in CONFIGS]


@pytest.mark.parametrize("name", _configs())
def test_step_time_against_tree_budget(benchmark, name, run_options):
    """One session, one graph per budget; each timed over 16 replays after a 128-token prompt."""
    model = target(name)
    BUDGETS, COMPILE = run_options.budgets, run_options.compile_step
    session = GenerationSession(model, drafter(name), batch_size=1, max_prompt=PROMPT, max_new=512,
                                budgets=BUDGETS, compile_step=COMPILE)
    session.prefill(prompt(name), torch.tensor([PROMPT]), max_new=512, eos=[])
    ms = {}
    for b in BUDGETS:
        session.step(b)  # warm
        ms[b] = session.time_steps(b, 16) * 1e3
    benchmark.pedantic(lambda: session.time_steps(16, 4), rounds=3, iterations=1)
    context = int(session.cache.lengths.max())
    routed = routed_experts(name, BUDGETS)  # after the timing: it rebuilds the drafter's cache
    ceiling = hbm_ceiling()
    for b in BUDGETS:
        need = step_bytes(model, routed[b], [context], b, drafter(name))
        floor = need.seconds(ceiling.gbs) * 1e3
        record(benchmark, op="step_time", config=name, compiled=COMPILE, budget=b, ms=ms[b], ratio_to_ar=ms[b] / ms[0],
               floor_ms=floor, floor_ratio=floor / ms[b], context=context, experts_touched=sum(routed[b]),
               experts_touched_per_layer="/".join(map(str, routed[b])), **need.fields(), **ceiling.fields())
    RESULTS[(name, "step_ms")] = ms
    # the same AR step in a session without a drafter (what plain greedy decoding runs): the
    # difference is what an AR step of a drafter session pays (its taps stored, and once per
    # DEFER_ROWS steps the flush that appends them to the drafter's context, timed with the step)
    plain = GenerationSession(model, None, batch_size=1, max_prompt=PROMPT, max_new=512, budgets=(0,),
                              compile_step=COMPILE)
    plain.prefill(prompt(name), torch.tensor([PROMPT]), max_new=512, eos=[])
    plain.step(0)
    plain_ms = plain.time_steps(0, 16) * 1e3
    del plain
    record(benchmark, op="ar_step_sessions", config=name, drafter_session_ms=ms[0], plain_session_ms=plain_ms,
           ratio=ms[0] / plain_ms)
    if name == "2p2b":
        record(benchmark, op="target", what="B=16 step / AR step <= 1.5", value=ms[16] / ms[0])


@pytest.mark.parametrize("name", _configs())
def test_ar_step_with_deferred_context_rows(benchmark, name, run_options):
    """What the AR step of a drafter session pays for keeping the drafter's context (its taps stored,
    and once per ``defer_rows`` steps the flush that appends them, timed with the step) at
    defer_rows 16 (run 214's 1.010-1.011x) and DEFER_ROWS (128 since session 49), against a session
    without a drafter: each over the same 128 AR steps after the prompt.  The A/B behind DEFER_ROWS
    (issue 44's random-drafter row: an auto run on a useless drafter is mostly these steps)."""
    model = target(name)
    COMPILE, STEPS = run_options.compile_step, 128
    ms = {}
    for rows in (None, 16, DEFER_ROWS):  # None: no drafter
        session = GenerationSession(model, drafter(name) if rows else None, batch_size=1, max_prompt=PROMPT,
                                    max_new=512, budgets=(0, 16) if rows else (0,), compile_step=COMPILE,
                                    defer_rows=rows)
        session.prefill(prompt(name), torch.tensor([PROMPT]), max_new=512, eos=[])
        session.step(0)
        ms[rows] = session.time_steps(0, STEPS) * 1e3
        del session
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    record(benchmark, op="ar_step_defer_rows", config=name, steps=STEPS, plain_ms=ms[None], defer16_ms=ms[16],
           defer_ms=ms[DEFER_ROWS], defer_rows=DEFER_ROWS, ratio16=ms[16] / ms[None],
           ratio=ms[DEFER_ROWS] / ms[None])


@pytest.mark.parametrize("name", _configs())
def test_step_phase_profile(benchmark, name):
    """profile=True: eager steps (no graph: launch overhead included) with CUDA events between
    the phases; mean ms per phase over 12 steps at B = 16."""
    model = target(name)
    out = benchmark.pedantic(lambda: model.generate(prompt(name), max_new_tokens=12, eos_token_id=None,
                                                    drafter=drafter(name), tree_budget=16, profile=True,
                                                    return_dict_in_generate=True), rounds=1, iterations=1)
    rows = out.profile[1:]  # the first eager step pays lazy initialisation
    means = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0] if k.endswith("_ms")}
    record(benchmark, op="phase_profile", config=name, budget=16, **means)


def _generate(model, ids, tokens, **kwargs):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=tokens, eos_token_id=None, return_dict_in_generate=True, **kwargs)
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0, ids.shape[1]


@pytest.mark.parametrize("name", _configs())
def test_autoregressive_tokens_per_second(benchmark, name, run_options):
    model = target(name)
    TOKENS = run_options.tokens
    model.generate(prompt(name), max_new_tokens=TOKENS, eos_token_id=None)  # session + graph capture
    out, wall, _ = benchmark.pedantic(lambda: _generate(model, prompt(name), TOKENS), rounds=1, iterations=1)
    rate = TOKENS / out.step_seconds
    RESULTS[(name, "ar")] = {"rate": rate, "wall_rate": TOKENS / wall, "sequences": out.sequences}
    record(benchmark, op="autoregressive", config=name, tokens=TOKENS, tokens_per_s=rate,
           wall_tokens_per_s=TOKENS / wall, ms_per_token=1e3 / rate)


@pytest.mark.parametrize("accuracy", [0.6, 0.8, 0.95])
@pytest.mark.parametrize("name", _configs())
def test_oracle_tokens_per_second(benchmark, name, accuracy, run_options):
    """Sustained DDTree generation, tree_budget="auto", an oracle of the given per-token accuracy
    (the true token second in half of its misses).  tokens/s inside the steps (the oracle's
    look-ahead excluded, the inner DFlash drafter's cost included)."""
    model = target(name)
    TOKENS = run_options.tokens
    oracle = _oracle(name)
    oracle.set_accuracy(accuracy)
    out, wall, T = benchmark.pedantic(lambda: _generate(model, prompt(name), TOKENS, drafter=oracle,
                                                        tree_budget="auto"), rounds=1, iterations=1)
    rate = TOKENS / out.step_seconds
    used = {b: out.budgets.count(b) for b in sorted(set(out.budgets))}
    info = dict(op="ddtree_oracle", config=name, accuracy=accuracy, tokens=TOKENS, tokens_per_s=rate,
                mean_accept=out.mean_accept_length, steps=len(out.budgets), budgets_used=str(used),
                wall_with_oracle_s=wall)
    ar = RESULTS.get((name, "ar"))
    if ar is not None:
        same = out.sequences[0, T:] == ar["sequences"][0, T:]
        info.update(speedup_vs_ar=rate / ar["rate"],
                    equal_to_ar_tokens=int(same.long().cumprod(0).sum()))  # bf16 ties may end it early
    RESULTS[(name, "oracle", accuracy)] = rate
    record(benchmark, **info)


class _OneTokenOracle(OracleDrafter):
    """The oracle with the look-ahead it had before session 48: greedy tokens decoded one at a time
    (its ``prepare`` takes the root only, so the session does not hand it the verify pass)."""

    def prepare(self, root_tokens):
        super().prepare(root_tokens)


@pytest.mark.parametrize("lookahead", ["verify_pass", "one_token"])
@pytest.mark.parametrize("name", _configs())
def test_perfect_oracle_acceptance(benchmark, name, lookahead, run_options):
    """How often the oracle's "true token" is the verify's greedy token: a perfect oracle
    (accuracy 1) at a fixed B = 16 accepts L + 1 = 8 tokens a step when every look-ahead token is
    the one the verify chooses.  ``verify_pass``: the look-ahead runs each budget's verify pass
    (the oracle's default in a session); ``one_token``: one-token passes, other kernels -- on a
    random target's flat logits their argmax parts from the verify's (run 188: 4.9 of 8 on the
    H200).  256 tokens; mean accept and the share of full steps."""
    model = target(name)
    cls = OracleDrafter if lookahead == "verify_pass" else _OneTokenOracle
    oracle = cls(model, accuracy=1.0, seed=3, inner=drafter(name))
    kw = dict(drafter=oracle, tree_budget=16)
    model.generate(prompt(name), max_new_tokens=256, eos_token_id=None, **kw)  # the session, compiled
    out, wall, T = benchmark.pedantic(lambda: _generate(model, prompt(name), 256, **kw), rounds=1, iterations=1)
    steps = out.accept_lengths[0][out.accept_lengths[0] > 0]
    full = min(16, BLOCK_SIZE - 1) + 1
    record(benchmark, op="perfect_oracle", config=name, lookahead=lookahead, budget=16, tokens=256,
           mean_accept=out.mean_accept_length, most=full, full_steps=float((steps == full).float().mean()),
           steps=int(steps.numel()))


@pytest.mark.parametrize("name", _configs())
def test_random_drafter_tokens_per_second(benchmark, name, run_options):
    """Issue 44's "never loses" line: sustained DDTree generation, tree_budget="auto", with the
    random DFlash drafter itself (no oracle: almost nothing accepted), tokens/s inside the steps
    against the autoregressive run of test_autoregressive_tokens_per_second (run it first, in the
    same process).  Also the exploring: tree steps of all steps."""
    model = target(name)
    TOKENS = run_options.tokens
    model.generate(prompt(name), max_new_tokens=TOKENS, eos_token_id=None, drafter=drafter(name),
                   tree_budget="auto")  # the timed call's session: every budget compiled and captured
    out, wall, T = benchmark.pedantic(lambda: _generate(model, prompt(name), TOKENS, drafter=drafter(name),
                                                        tree_budget="auto"), rounds=1, iterations=1)
    rate = TOKENS / out.step_seconds
    used = {b: out.budgets.count(b) for b in sorted(set(out.budgets))}
    info = dict(op="ddtree_random_drafter", config=name, tokens=TOKENS, tokens_per_s=rate,
                wall_tokens_per_s=TOKENS / wall, mean_accept=out.mean_accept_length, steps=len(out.budgets),
                tree_steps=sum(n for b, n in used.items() if b), budgets_used=str(used))
    ar = RESULTS.get((name, "ar"))
    if ar is not None:
        same = out.sequences[0, T:] == ar["sequences"][0, T:]
        info.update(speedup_vs_ar=rate / ar["rate"], target_ratio=0.97,
                    equal_to_ar_tokens=int(same.long().cumprod(0).sum()))
    record(benchmark, **info)


@functools.lru_cache(maxsize=None)
def _oracle(name: str) -> OracleDrafter:
    return OracleDrafter(target(name), accuracy=0.8, second_choice=0.5, seed=3, inner=drafter(name))


def hf_deepseek_v3(name: str, **overrides):
    """transformers' own DeepseekV3ForCausalLM on configuration ``name`` (random bf16 weights on
    the GPU, seed 0), with config fields overridden."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    d = {k: v for k, v in config_dict(name).items() if k not in ("model_type", "auto_map", "architectures")}
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            torch.manual_seed(0)
            return DeepseekV3ForCausalLM(DeepseekV3Config(**{**d, **overrides})).eval()
    finally:
        torch.set_default_dtype(default)


def _hf_models():
    return hf_deepseek_v3("2p2b"), hf_deepseek_v3("2p2b", num_hidden_layers=1, first_k_dense_replace=1)


@requires_cuda
@requires_mla
def test_transformers_generate_baselines(benchmark, run_options):
    """transformers' DeepseekV3ForCausalLM.generate (eager, its own cache) and its assisted
    generation (a one-layer random assistant) on the 2p2b configuration."""
    HF_TOKENS, ASSISTED_TOKENS = run_options.hf_tokens, run_options.assisted_tokens
    main, assistant = _hf_models()
    ids = prompt("2p2b")
    common = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        main.generate(ids, max_new_tokens=4, **common)  # warm-up

        def timed(**kwargs):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = main.generate(ids, **common, **kwargs)
            torch.cuda.synchronize()
            return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t0)

        plain = benchmark.pedantic(lambda: timed(max_new_tokens=HF_TOKENS), rounds=1, iterations=1)
        assisted = timed(max_new_tokens=ASSISTED_TOKENS, assistant_model=assistant)
    info = dict(op="transformers", config="2p2b", generate_tokens_per_s=plain, assisted_tokens_per_s=assisted,
                generate_tokens=HF_TOKENS, assisted_tokens=ASSISTED_TOKENS)
    ar = RESULTS.get(("2p2b", "ar"))
    if ar is not None:
        info.update(our_ar_vs_transformers=ar["wall_rate"] / plain)
    oracle80 = RESULTS.get(("2p2b", "oracle", 0.8))
    if oracle80 is not None:
        info.update(ddtree80_vs_transformers=oracle80 / plain, ddtree80_vs_assisted=oracle80 / assisted)
    if ar is not None and oracle80 is not None:
        info.update(ddtree80_vs_our_ar=oracle80 / ar["rate"])
    record(benchmark, **info)
