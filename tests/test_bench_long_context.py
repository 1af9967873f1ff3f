"""bench/long_context.py and bench/bench_long_context.py on the CPU: the options' parsers, the
memory arithmetic against the real caches and weights, the wall-time estimate's budget, the table,
and the benchmark's own functions (sessions, chunked prefills, step timings, attention's share,
the drift loop, the table) run end to end on a tiny model."""
import argparse

import pytest
import torch

from bench import bench_long_context as blc
from bench.bench_generate import config_dict, random_int4_experts
from bench.long_context import (CACHE_DTYPES, CONTEXTS, H200_BYTES, WINDOW, cache_bytes_per_token, context_label,
                                drift_line, memory, parse_cache_dtypes, parse_configs, parse_context, parse_contexts,
                                prompt_length, session_capacity, step_table, wall_seconds, weight_bytes)
from torch_kdtree.models import KimiK2Cache, KimiK2Config
from torch_kdtree.models.generation.tiny import tiny_drafter, tiny_target
from torch_kdtree.models.kimi_k2 import KimiK2Experts


def test_contexts_and_options_parse_and_refuse_by_name():
    assert CONTEXTS == (1024, 4096, 16384, 65536, 131072, 204800, 262144)
    assert [context_label(c) for c in CONTEXTS] == ["1k", "4k", "16k", "64k", "128k", "200k", "256k"]
    assert parse_contexts("200k, 1k,64k") == (1024, 65536, 204800) and parse_contexts("all") == CONTEXTS
    assert parse_context("4096") == 4096 and context_label(1000) == "1000"
    for bad in ("300k", "0", "k", "", "1k,x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_contexts(bad)
    assert parse_cache_dtypes("fp8,bf16") == ("bf16", "fp8") and parse_cache_dtypes("fp8") == ("fp8",)
    assert parse_configs("2p2b,k2_slice") == ("k2_slice", "2p2b")
    for parse, bad in ((parse_cache_dtypes, "fp4"), (parse_cache_dtypes, ""), (parse_configs, "k2")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)
    assert prompt_length(WINDOW) == WINDOW - 256 and prompt_length(200 * 1024) == 204800


def test_cache_bytes_are_the_caches_bytes_per_token():
    """k2_slice: 4 layers x 576 x 2 = 4,608 B per token in bf16, 4 x 644 = 2,576 B in fp8, as
    KimiK2Cache counts them; a session's capacity as GenerationSession allocates it."""
    d = config_dict("k2_slice")
    config = KimiK2Config.from_dict(d)
    assert cache_bytes_per_token(d, "bf16") == 4608 and cache_bytes_per_token(d, "fp8") == 2576
    for kv, name in (("bf16", "bfloat16"), ("fp8", "fp8")):
        cache = KimiK2Cache.for_model(config, 1, 64, dtype=torch.bfloat16, kv_cache_dtype=name)
        assert cache.bytes_per_token == cache_bytes_per_token(d, kv)
    from torch_kdtree.models.generation import GenerationSession

    model = tiny_target(1)
    s = GenerationSession(model, tiny_drafter(model, block_size=4), batch_size=1, max_prompt=40, max_new=24,
                          budgets=(0, 16), cuda_graphs=False)
    assert s.capacity == session_capacity(40, 24, 4, 16)


@pytest.mark.parametrize("int4", [False, True])
def test_weight_bytes_count_the_models_tensors(int4):
    """weight_bytes from the config alone equals the bytes of a bf16 model's parameters and buffers
    (RoPE's inverse frequencies aside), dense or INT4 routed experts (int4_moe's tiles: H % 128, I % 64)."""
    model = tiny_target(2, n_shared_experts=1, hidden_size=128, moe_intermediate_size=64).to(torch.bfloat16)
    if int4:
        for layer in model.model.layers:
            if isinstance(getattr(layer.mlp, "experts", None), KimiK2Experts):
                random_int4_experts(layer.mlp.experts, "cpu")
    tensors = [t for n, t in list(model.named_parameters()) + list(model.named_buffers()) if not n.endswith("inv_freq")]
    assert weight_bytes(model.config.to_dict(), int4_experts=int4) == sum(t.numel() * t.element_size() for t in tensors)


def test_a_full_run_fits_one_h200_and_one_device_call():
    """The default run (k2_slice, 1k ... 256k, bf16 and fp8, a 20,000-token drift after a 16k prompt):
    peak memory far below the H200's 141 GB, the sdpa prefill's K/V 7,168 B per key (modeling.py's
    arithmetic), and the estimated wall time inside one 10-minute device call with room for the build."""
    d = config_dict("k2_slice")
    max_prompt = prompt_length(max(CONTEXTS))
    caps = {"bf16": session_capacity(max_prompt, 20000 + 2048, 8, 16), "fp8": session_capacity(max_prompt, 1024, 8, 16)}
    mem = memory(d, int4_experts=True, max_context=max_prompt, capacities=caps, drafter_kv_per_token=1 * 1 * 128 * 4)
    assert mem.caches == {"bf16": 4608 * caps["bf16"], "fp8": 2576 * caps["fp8"]}
    assert 1.2e9 < mem.caches["bf16"] < 1.4e9 and 0.62e9 < mem.caches["fp8"] < 0.72e9
    assert mem.prefill_kv == max_prompt * 7168
    assert 4e9 < mem.weights < 5e9 and mem.peak < 0.2 * H200_BYTES
    est = wall_seconds(d, CONTEXTS, CACHE_DTYPES, drift_tokens=20000, drift_prompt=16 * 1024)
    assert est["total"] == pytest.approx(sum(v for k, v in est.items() if k != "total"))
    assert est["total"] < 8 * 60
    part = wall_seconds(d, (1024, 65536), ("bf16",), drift_tokens=0, drift_prompt=0)
    assert part["total"] < est["total"] and part["drift"] == 0


def test_step_table_and_drift_line():
    rows = [dict(context=1024, cache="bf16", length=1030, prefill_s=0.05, ar_ms=0.4, tree_ms=1.2, ar_attention=0.1,
                 tree_attention=0.2),
            dict(context=1024, cache="fp8", length=1031, prefill_s=0.06, ar_ms=3.0, tree_ms=5.0, ar_attention=0.8,
                 tree_attention=0.9),
            dict(context=204800, cache="bf16", length=204812, prefill_s=3.2, ar_ms=1.1, tree_ms=2.5, ar_attention=0.6,
                 tree_attention=None)]
    text = step_table(rows).splitlines()
    assert len(text) == 4 and text[0].split("|")[0].strip() == "context"
    assert [c.strip() for c in text[0].split("|")][2:6] == ["prefill s bf16", "prefill s fp8", "AR ms bf16", "AR ms fp8"]
    first = [c.strip() for c in text[2].split("|")]
    assert first[:8] == ["1k", "1031", "0.05", "0.06", "0.400", "3.000", "1.200", "5.000"]
    last = [c.strip() for c in text[3].split("|")]
    assert last[0] == "200k" and last[3] == "—" and last[5] == "—" and last[-2:] == ["—", "—"]
    assert "ratio 1.0200 (within 3%)" in drift_line(1.02, 1.0, 40000, 20000)
    assert "NOT within" in drift_line(1.05, 1.0, 40000, 20000)


class _Benchmark:
    """pytest-benchmark's fixture as the bench uses it: extra_info, pedantic."""

    def __init__(self):
        self.extra_info = {}

    def pedantic(self, fn, rounds=1, iterations=1):
        return fn()


class _Options(blc.Options):
    def __init__(self, **values):
        self.__dict__.update(values)


def test_the_benchmark_runs_end_to_end_on_a_tiny_model(monkeypatch, capsys):
    """bench_long_context's test functions on the CPU with a tiny target (fp32) and an oracle over a tiny
    DFlash drafter: two contexts prefilled in chunks of 16 over bf16 and fp8 caches, AR and B = 16
    steps timed, attention's share, the drift loop and the table."""
    model = tiny_target(4)
    name = "k2_slice"
    monkeypatch.setattr(blc, "DEVICE", "cpu")
    monkeypatch.setattr(blc, "RESULTS", {})
    monkeypatch.setattr(blc, "_SESSIONS", {})
    monkeypatch.setattr(blc, "target", lambda n: model)
    monkeypatch.setattr(blc, "fresh_drafter", lambda n: tiny_drafter(model, seed=1, block_size=4))
    monkeypatch.setattr(blc, "config_dict", lambda n: model.config.to_dict())
    monkeypatch.setitem(blc.CONFIGS, name, {**blc.CONFIGS[name], "vocab_size": model.config.vocab_size})
    monkeypatch.setitem(blc.DRAFTERS, name, {**blc.DRAFTERS[name], "num_key_value_heads": 2, "head_dim": 16})
    monkeypatch.setattr(blc, "REPEATS", 1)
    blc.prompt_tokens.cache_clear()
    opts = _Options(contexts=(40, 70), cache_dtypes=CACHE_DTYPES, configs=(name,), drift_tokens=20, drift_prompt=24,
                    steps=2, chunk=16, compile_step=False)
    try:
        for kv in CACHE_DTYPES:
            bench = _Benchmark()
            blc.test_long_context_steps(bench, name, kv, opts)
            assert bench.extra_info["op"] == "long_context" and bench.extra_info["context"] == "70"
            assert bench.extra_info["cache_tokens"] >= 70 and bench.extra_info["tree_ms"] > 0
        sessions = blc._SESSIONS
        assert sessions[(name, "fp8")].cache.quantized and not sessions[(name, "bf16")].cache.quantized
        assert sessions[(name, "bf16")].cache.kv.dtype == torch.bfloat16
        bench = _Benchmark()
        blc.test_long_context_drift(bench, name, opts)
        info = bench.extra_info
        assert info["generated"] >= 20 and info["context"] == 24 + info["generated"] - 1 and info["tree_ratio"] > 0
        blc.test_long_context_table(_Benchmark(), opts)
    finally:
        blc.prompt_tokens.cache_clear()
    out = capsys.readouterr().out
    assert "long context, k2_slice" in out and "drift: B=16 step at" in out
    table = out[out.index("context | tokens"):].splitlines()
    assert table[2].split("|")[0].strip() == "40" and table[3].split("|")[0].strip() == "70"
    assert "—" not in "\n".join(table[:4])  # every cell measured
