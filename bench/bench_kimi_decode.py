"""Kimi K2 greedy autoregressive decode on the GPU (issue 3): our model (paged latent cache,
absorbed MLA kernel, CUDA-graph step) against its bandwidth floor and against transformers'
``DeepseekV3ForCausalLM.generate`` (eager) on the same configuration, in the same run.

Run (H200, ~2 min):  pytest bench/bench_kimi_decode.py --benchmark-only -s
Configurations (bench_generate.py's random models, bf16, batch 1, 512-token random prompt, 256
new tokens): (a) "2p2b" = hidden 2048, 8 layers, 64 experts top-8 + 1 shared, moe_intermediate
512, dense 6144, K2's MLA dims with 16 heads, vocab 163840; (b) "k2_slice" = one TP-8 rank of K2
(8 heads, 384 INT4 experts with intermediate 256, 4 layers).

Floor = bytes one decode step must read (bench/floor.py's step_bytes at budget 0: every weight but
the routed experts and the embedding table, the k routed experts of each MoE layer -- exactly k for
one token -- and the latent KV of the context) / the HBM ceiling of bench/conftest.py: max of a
read-only stream and a device copy, both measured in this run.
Targets: (a) >= 15x transformers' tokens/s and >= 60 % of the floor; (b) within 1.5x of the floor.
"""
import time

import pytest
import torch

from .bench_generate import MARKS, hf_deepseek_v3, target
from .conftest import hbm_ceiling, record
from .floor import moe_blocks, step_bytes

PROMPT, NEW = 512, 256
RATES: dict = {}


def _prompt(vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, vocab - 2, (1, PROMPT), generator=g).cuda()


@pytest.mark.parametrize("compiled", [False, True, {"combo_kernels": True}, {"coordinate_descent_tuning": True},
                                      {"combo_kernels": True, "coordinate_descent_tuning": True}],
                         ids=["eager_ops", "inductor", "combo", "coordinate_descent", "tuned"])
@pytest.mark.parametrize("name", [pytest.param(n, marks=MARKS[n]) for n in ("2p2b", "k2_slice")])
def test_kimi_greedy_decode(benchmark, name, compiled):
    """generate(speculative=None): the step captured in a CUDA graph, its ops eager
    (compile_step=False) or compiled by inductor first (compile_step=True; or with inductor's
    combo kernels, which launch independent kernels together)."""
    model = target(name)
    ids = _prompt(model.config.vocab_size)
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=NEW, eos_token_id=None, compile_step=compiled)  # capture, warm-up
    setup_s = time.perf_counter() - t0

    def run():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=NEW, eos_token_id=None, return_dict_in_generate=True,
                             compile_step=compiled)
        torch.cuda.synchronize()
        return out, time.perf_counter() - t0

    out, wall = benchmark.pedantic(run, rounds=3, iterations=1)
    step_ms = out.step_seconds / NEW * 1e3
    ceiling = hbm_ceiling()
    k = model.config.num_experts_per_tok
    need = step_bytes(model, [k] * len(moe_blocks(model)), [PROMPT + NEW // 2], 0)
    floor_ms = need.seconds(ceiling.gbs) * 1e3
    RATES[name] = max(RATES.get(name, 0.0), NEW / wall)  # wall clock, prefill included, as transformers is timed
    info = dict(op="kimi_decode", config=name, compile_step=str(compiled), setup_s=setup_s, prompt=PROMPT, new_tokens=NEW, ms_per_step=step_ms,
                tokens_per_s=1e3 / step_ms, wall_tokens_per_s=NEW / wall, floor_ms=floor_ms,
                floor_ratio=floor_ms / step_ms,
                target="floor_ratio >= 0.6" if name == "2p2b" else "floor_ratio >= 0.667 (within 1.5x)",
                **need.fields(), **ceiling.fields())
    record(benchmark, **info)


@pytest.mark.parametrize("name", [pytest.param("2p2b", marks=MARKS["2p2b"])])
def test_transformers_deepseek_v3_generate(benchmark, name):
    """transformers' own DeepseekV3ForCausalLM (random weights, same configuration, bf16, its own
    cache, eager), greedy, 512-token prompt, 256 new tokens."""
    hf = hf_deepseek_v3(name)
    ids = _prompt(hf.config.vocab_size)
    common = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=4, **common)

        def run(model=hf):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=NEW, **common)
            torch.cuda.synchronize()
            return (out.shape[1] - PROMPT) / (time.perf_counter() - t0)

        rate = benchmark.pedantic(run, rounds=1, iterations=1)
    info = dict(op="transformers_generate", config=name, prompt=PROMPT, new_tokens=NEW, tokens_per_s=rate)
    ours = RATES.get(name)
    if ours is not None:
        info.update(ours_tokens_per_s=ours, speedup=ours / rate, target="speedup >= 15")
    record(benchmark, **info)
    del hf, run  # free the transformers model (run's default holds it too) before the next benchmark
    torch.cuda.empty_cache()
