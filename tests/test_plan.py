"""The KV-capacity planner (issue 49): its arithmetic against hand-computed K2.6 values, against
vLLM's published K2-Thinking log, against what this engine's caches allocate, and its CLI."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_kdtree import envs
from torch_kdtree.plan import (DRAFTERS, GPUS, MODELS, Deployment, DrafterShape, GiB, TargetShape,
                               cache_tokens_per_request, drafter_cache_bytes, engine_cache_bytes, evaluate, fixes,
                               kv_bytes_per_token, kv_bytes_per_token_per_layer, main, plan, tokens_for_memory,
                               weights_per_gpu)
from torch_kdtree.plan.presets import preset_config

ROOT = Path(__file__).resolve().parents[1]


def k26() -> TargetShape:
    return TargetShape.from_config(preset_config(MODELS, "kimi-k2.6"))


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch_kdtree.plan", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


# ---------------------------------------------------------------------------- hand-computed K2.6


def test_k26_kv_bytes_per_token_bf16_and_fp8():
    t = k26()
    # (kv_lora_rank 512 + qk_rope_head_dim 64) values per token and layer, 61 layers; fp8 (KimiK2Cache's
    # layout) adds one fp32 scale per token and layer.
    assert kv_bytes_per_token_per_layer(t, "bf16") == 576 * 2 == 1152
    assert kv_bytes_per_token(t, "bf16") == 61 * 1152 == 70_272
    assert kv_bytes_per_token_per_layer(t, "fp8") == 512 + 2 * 64 + 4 == 644  # e4m3 latent, bf16 rope, scale
    assert kv_bytes_per_token(t, "fp8") == 61 * 644 == 39_284


def test_k26_weights_per_gpu_at_tp8_equal_a_hand_count():
    """Counted here from the config numbers, tensor by tensor, without the planner's tensor list."""
    H, L, Lm, V, E, I, Id = 7168, 61, 60, 163840, 384, 2048, 18432
    replicated_bf16 = (L * (1536 * H + 576 * H)           # q_a_proj, kv_a_proj_with_mqa
                       + L * (2 * H + 1536 + 512)         # input/post-attention, q_a and kv_a norms
                       + Lm * E * H                       # routers
                       + V * H + H)                       # embedding (the drafter borrows it), final norm
    replicated_fp32 = Lm * E                              # e_score_correction_bias
    sharded_bf16 = (L * (64 * 192 * 1536 + 64 * 256 * 512 + H * 64 * 128)  # q_b, kv_b by head; o_proj by input
                    + 3 * H * Id                          # layer 0's dense MLP
                    + Lm * 3 * H * I                      # shared expert
                    + V * H)                              # lm_head by vocabulary
    expert_weights = Lm * E * 3 * H * I
    int4 = expert_weights // 2 + expert_weights // 32 * 2  # nibbles + one bf16 scale per 32 inputs
    per_gpu = 2 * replicated_bf16 + 4 * replicated_fp32 + (2 * sharded_bf16 + int4) // 8
    assert per_gpu == 78_237_802_496  # 72.86 GiB
    assert sum(weights_per_gpu(k26(), tp=8).values()) == per_gpu
    out = plan("kimi-k2.6", gpu="h200", tp=8, context=200_000)
    assert out["weights_bytes_per_gpu"] == per_gpu
    # The whole checkpoint: 594.2 GB (the INT4 K2.x checkpoints are ~594 GB, ~554 GiB).
    whole = 2 * (replicated_bf16 + sharded_bf16) + 4 * replicated_fp32 + int4
    assert sum(weights_per_gpu(k26()).values()) == whole == 594_205_351_936


def test_expert_parallel_holds_whole_experts_with_the_same_bytes():
    t = k26()
    by_tp, by_ep = weights_per_gpu(t, tp=8), weights_per_gpu(t, tp=8, ep=8)  # 384 / 8 = 48 experts each
    assert by_tp == by_ep
    assert weights_per_gpu(t, tp=8, ep=5)["routed_experts"] == by_tp["routed_experts"] // 48 * 77  # ceil(384 / 5)


def test_the_vision_tower_counts_only_when_asked():
    without = plan("kimi-k2.6", context=200_000)
    with_vision = plan("kimi-k2.6", context=200_000, vision=True)
    vision = with_vision["fixed_bytes_per_gpu"]["vision"]
    assert 0.8 * GiB < vision < 1.0 * GiB  # ~0.47 B bf16 parameters, replicated
    assert with_vision["weights_bytes_per_gpu"] == without["weights_bytes_per_gpu"] + vision


# ---------------------------------------------------------------------------- the public vLLM log


def test_vllm_log_k2_thinking_8x_h200_tp8_715072_tokens():
    """vLLM on 8x H200, TP-8 (vllm-project/recipes, Kimi-K2-Think.md): "Available KV cache memory:
    46.80 GiB" and "GPU KV cache size: 715,072 tokens", i.e. 70,274 B per token, 2 B more than the
    planner's 70,272.  The 2 B are rounding: the log prints GiB to 0.01, so the true memory lies in
    [46.795, 46.805) GiB, which at 715,072 tokens is 70,266.7 ... 70,281.7 B per token; and vLLM keeps
    whole 64-token FlashMLA blocks.  Taking 46.80 GiB as exact, whole pages of 70,272 B tokens give
    715,072 tokens exactly."""
    t = TargetShape.from_config(preset_config(MODELS, "kimi-k2-thinking"))
    per_token = kv_bytes_per_token(t, "bf16")
    logged_bytes, logged_tokens = 46.80 * GiB, 715_072
    assert abs(logged_bytes / logged_tokens - per_token) / per_token < 1e-4  # 70,274.2 vs 70,272
    assert 46.795 * GiB / logged_tokens <= per_token < 46.805 * GiB / logged_tokens
    assert tokens_for_memory(int(logged_bytes), per_token, page_size=64) == logged_tokens
    # TP8 + DCP8, same memory: "GPU KV cache size: 5,721,088 tokens" (vLLM multiplies by the DCP size);
    # one block more per rank than at TP8, within the 0.01 GiB the log rounds away.
    dcp8 = 8 * tokens_for_memory(int(logged_bytes), per_token, page_size=64)
    assert abs(dcp8 - 5_721_088) <= 8 * 64


def test_planner_lands_near_vllm_on_8x_h200():
    """The planner's own deployment (embedding replicated, 4 GiB overhead) gives 748,160 tokens per
    GPU where vLLM reports 715,072: +4.6 %.  vLLM shards the embedding (1.91 GiB less weights) but
    spends ~8 GiB, not 4, beside weights and KV (125.83 - 70.95 - 46.80 GiB)."""
    out = plan("kimi-k2-thinking", gpu="h200", tp=8, context=200_000)
    assert out["kv_tokens_per_gpu"] == 748_160
    assert abs(out["kv_tokens_per_gpu"] / 715_072 - 1) < 0.10


# ---------------------------------------------------------------------------- 200k context


def test_200k_context_fits_on_8x_h200_tp8_in_bf16():
    out = plan("kimi-k2.6", gpu="h200", num_gpus=8, tp=8, kv_dtype="bf16", context=200_000, concurrency=1)
    assert out["fits"] and out["fixes"] == []
    assert out["kv_bytes_per_token"] == 70_272
    assert out["max_context_per_request"] == 262_144  # the model's limit; memory allows ~748k
    assert out["max_concurrency"] == 3


def test_200k_context_on_8x_rtx_pro_6000_needs_fp8_kv_or_dcp():
    base = dict(gpu="rtx-pro-6000", num_gpus=8, tp=8, context=200_000, concurrency=1)
    bf16 = plan("kimi-k2.6", **base)
    assert not bf16["fits"]
    assert {"--kv-dtype fp8", "--dcp 2"} <= {f["flags"] for f in bf16["fixes"]}
    assert plan("kimi-k2.6", **base, overhead_gib=0)["fits"] is False  # bf16 does not fit at any overhead
    assert plan("kimi-k2.6", **base, kv_dtype="fp8")["fits"]
    assert plan("kimi-k2.6", **base, dcp=2)["fits"]
    grid = bf16["what_if"]
    column = grid["contexts"].index(200_000)
    cells = {(r["kv_dtype"], r["dcp"]): r["max_concurrency"][column] for r in grid["rows"]}
    assert cells[("bf16", 1)] == 0 and cells[("fp8", 1)] >= 1 and cells[("bf16", 2)] >= 1


def test_context_beyond_the_model_does_not_fit_and_says_so():
    out = plan("kimi-k2", gpu="h200", context=200_000)  # K2-Instruct: 131,072 positions, FP8 weights
    assert not out["fits"] and any("131,072 positions" in r for r in out["reasons"])


def test_weights_that_do_not_fit_suggest_more_gpus():
    out = plan("kimi-k2", gpu="h100", context=32_768)  # ~959 GiB of FP8 weights on 8 x 80 GB
    assert out["kv_pool_bytes_per_gpu"] < 0 and not out["fits"]
    assert out["fixes"] and out["fixes"][-1]["flags"].startswith("--num-gpus")


# ---------------------------------------------------------------------------- the engine's own allocation


def _cache_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _scales(cache) -> tuple:
    return (cache.kv_scale,) if cache.kv_scale is not None else ()


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("requests, context, budget, block", [(1, 8192, 0, 1), (2, 8000, 16, 8)])
def test_k2_slice_cache_allocation_within_2_percent(requests, context, budget, block, kv_dtype):
    """KimiK2Cache for bench_kimi_decode's k2_slice config (one TP-8 rank of K2, 4 layers), bf16 and
    fp8 (whose scales the planner counts)."""
    from bench.bench_generate import config_dict
    from torch_kdtree.models.kimi_k2 import KimiK2Cache, KimiK2Config

    config = config_dict("k2_slice")
    capacity = cache_tokens_per_request(context, budget, block)
    cache = KimiK2Cache.for_model(KimiK2Config.from_dict(config), requests, capacity, page_size=64,
                                  dtype=torch.bfloat16, device="cpu", kv_cache_dtype=kv_dtype)
    actual = _cache_bytes(cache.kv, cache.block_table, cache.lengths, *_scales(cache))
    t = TargetShape.from_config(config)
    predicted = engine_cache_bytes(t, requests, context, tree_budget=budget, block_size=block, page_size=64,
                                   kv_dtype=kv_dtype)
    print(f"k2_slice {kv_dtype} R={requests} context={context}: planner {predicted:,} B, KimiK2Cache {actual:,} B")
    assert abs(predicted - actual) <= 0.02 * actual
    assert cache.bytes_per_token == kv_bytes_per_token(t, kv_dtype)  # the planner's bytes are the engine's


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_generation_session_allocation_within_2_percent(kv_dtype):
    """A real GenerationSession (tiny K2 target + DFlash drafter, CPU, bf16; its latent cache bf16 or
    fp8): its target cache and the drafter's context cache against the planner's per-request reservation."""
    from torch_kdtree.models.generation import GenerationSession
    from torch_kdtree.models.generation.tiny import TINY_TARGET, tiny_drafter, tiny_target
    from torch_kdtree.models.kimi_k2.writer import k2_config_dict

    target = tiny_target(0).to(torch.bfloat16)
    drafter = tiny_drafter(target, block_size=4).to(torch.bfloat16)
    R, prompt, new, budgets = 3, 100, 60, (0, 5)
    session = GenerationSession(target, drafter, batch_size=R, max_prompt=prompt, max_new=new, budgets=budgets,
                                page_size=16, cuda_graphs=False, kv_cache_dtype=kv_dtype)
    actual = _cache_bytes(session.cache.kv, session.cache.block_table, session.cache.lengths, *_scales(session.cache),
                          drafter.context_k, drafter.context_v, drafter.context_lengths)
    t = TargetShape.from_config(k2_config_dict(TINY_TARGET, int4=False))
    d = DrafterShape.from_config(drafter.config.to_dict())
    predicted = (engine_cache_bytes(t, R, prompt + new, tree_budget=max(budgets), block_size=d.block_size,
                                    page_size=16, kv_dtype=kv_dtype)
                 + drafter_cache_bytes(d, R, prompt + new))
    print(f"tiny session: planner {predicted:,} B, allocated {actual:,} B")
    assert abs(predicted - actual) <= 0.02 * actual


def test_the_planner_counts_a_drafter_sessions_tap_store():
    """The AR steps' tap store of a session with a drafter and AR + tree budgets (what
    ``tree_budget="auto"`` builds): the planner's rows are the session's DEFER_ROWS and its bytes the
    session's buffer; without a drafter there is none."""
    from torch_kdtree.models.generation import GenerationSession
    from torch_kdtree.models.generation.session import DEFER_ROWS
    from torch_kdtree.models.generation.tiny import TINY_TARGET, tiny_drafter, tiny_target
    from torch_kdtree.models.kimi_k2.writer import k2_config_dict
    from torch_kdtree.plan.memory import TAP_STORE_ROWS, tap_store_bytes

    assert TAP_STORE_ROWS == DEFER_ROWS
    target = tiny_target(0).to(torch.bfloat16)
    drafter = tiny_drafter(target, block_size=4).to(torch.bfloat16)
    session = GenerationSession(target, drafter, batch_size=3, max_prompt=16, max_new=8, budgets=(0, 5),
                                cuda_graphs=False)
    t = TargetShape.from_config(k2_config_dict(TINY_TARGET, int4=False))
    d = DrafterShape.from_config(drafter.config.to_dict())
    assert tap_store_bytes(t, d, 3) == session.pending.numel() * session.pending.element_size() > 0
    assert tap_store_bytes(t, None, 3) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (issue 49's H200 line)")
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("requests, context, budget, block", [(1, 200_000, 0, 1), (2, 131_072, 16, 8)])
def test_k2_slice_cache_on_the_gpu_within_2_percent_of_the_planner(requests, context, budget, block, kv_dtype):
    """What the CUDA caching allocator hands KimiK2Cache for k2_slice at long contexts (device bytes,
    its rounding included), against the planner's prediction."""
    from bench.bench_generate import config_dict
    from torch_kdtree.models.kimi_k2 import KimiK2Cache, KimiK2Config

    config = config_dict("k2_slice")
    capacity = cache_tokens_per_request(context, budget, block)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    cache = KimiK2Cache.for_model(KimiK2Config.from_dict(config), requests, capacity, page_size=64,
                                  dtype=torch.bfloat16, device="cuda", kv_cache_dtype=kv_dtype)
    torch.cuda.synchronize()
    actual = torch.cuda.memory_allocated() - before
    t = TargetShape.from_config(config)
    predicted = engine_cache_bytes(t, requests, context, tree_budget=budget, block_size=block, page_size=64,
                                   kv_dtype=kv_dtype)
    print(f"k2_slice on {torch.cuda.get_device_name()} {kv_dtype} R={requests} context={context}: planner "
          f"{predicted:,} B, allocated {actual:,} B ({100 * (predicted / actual - 1):+.3f} %)")
    assert abs(predicted - actual) <= 0.02 * actual
    del cache


def test_k2_slice_on_an_h200_longest_context_is_the_largest_cache_that_fits():
    """k2_slice alone on one H200: the planner's longest context is a KimiK2Cache that fits the pool
    left after weights and overhead, and one page more would not."""
    from bench.bench_generate import config_dict

    t = TargetShape.from_config(config_dict("k2_slice"))
    p = evaluate(t, None, Deployment(GPUS["h200"].total_bytes, num_gpus=1, tp=1, context=8192))
    longest = p.max_context_by_memory
    assert engine_cache_bytes(t, 1, longest) <= p.kv_pool_bytes_per_gpu < engine_cache_bytes(t, 1, longest + 64)
    # The headline count leaves out the block table (4 B per page of 64 tokens): agrees to 1e-4.
    assert abs(p.kv_tokens_per_gpu - longest) <= 1e-4 * longest


# ---------------------------------------------------------------------------- the command line


def test_cli_json_has_the_issue_keys():
    out = cli("--json", "--model", "kimi-k2.6", "--gpu", "h200", "--tp", "8", "--context", "200000")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    for key in ("kv_bytes_per_token", "weights_bytes_per_gpu", "kv_tokens_per_gpu", "max_context_per_request",
                "fits", "fixes", "what_if", "assumptions"):
        assert key in data
    assert data["kv_bytes_per_token"] == 70_272 and data["fits"] is True


def test_cli_table_on_rtx_pro_6000_lists_the_fixes():
    out = cli("--model", "kimi-k2.6", "--gpu", "rtx-pro-6000", "--context", "200000")
    assert out.returncode == 0, out.stderr
    assert "fits                   NO" in out.stdout
    assert "--kv-dtype fp8" in out.stdout and "--dcp 2" in out.stdout and "what if" in out.stdout


def test_cli_reads_config_files_and_directories(tmp_path, capsys):
    (tmp_path / "k26").mkdir()
    (tmp_path / "k26" / "config.json").write_text(json.dumps(preset_config(MODELS, "kimi-k2.6")))
    drafter = preset_config(DRAFTERS, "kimi-k2.6-dflash")
    del drafter["intermediate_size"]  # the public file lacks it: read from the safetensors header
    (tmp_path / "dflash").mkdir()
    (tmp_path / "dflash" / "config.json").write_text(json.dumps(drafter))
    header = json.dumps({"layers.0.mlp.gate_proj.weight": {"dtype": "BF16", "shape": [18432, 7168],
                                                           "data_offsets": [0, 0]}}).encode()
    (tmp_path / "dflash" / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    settings = dict(context=100_000, concurrency=2)
    by_path = plan(str(tmp_path / "k26"), drafter=str(tmp_path / "dflash"), **settings)
    by_preset = plan("kimi-k2.6", drafter="kimi-k2.6-dflash", **settings)
    for key in ("weights_bytes_per_gpu", "kv_tokens_per_gpu", "max_context_per_request", "fits"):
        assert by_path[key] == by_preset[key]
    assert main(["--model", str(tmp_path / "k26" / "config.json"), "--json", "--context", "1000"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is True


@pytest.mark.parametrize("args, message", [
    (["--mem-fraction", "1.5"], "not in (0, 1]"),
    (["--mem-fraction", "0"], "must be > 0"),
    (["--context", "0"], "must be > 0"),
    (["--concurrency", "-2"], "must be > 0"),
    (["--overhead", "-1"], "must be >= 0"),
    (["--tp", "x"], "not a number"),
    (["--gpu", "a100"], "invalid choice"),
    (["--kv-dtype", "fp16"], "invalid choice"),
    (["--gpu", "h100", "--gpu-memory", "80"], "not allowed with"),
    (["--tp", "3"], "TP 3 does not divide 8 GPUs"),
    (["--num-gpus", "3", "--tp", "3"], "does not split evenly over 3 GPUs"),
    (["--dcp", "3"], "DCP 3 must divide TP 8"),
    (["--ep", "3"], "EP 3 must divide 8 GPUs"),
    (["--tree-budget", "16"], "--tree-budget needs --drafter"),
    (["--model", "no/such/dir"], "neither a preset"),
    (["--drafter", "kimi-k2.6"], "neither a preset"),
])
def test_bad_arguments_are_argparse_errors(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and message in err


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "kv.png"
    if "matplotlib" in sys.modules or __import__("importlib").util.find_spec("matplotlib"):
        assert main(["--context", "200000", "--plot", str(path)]) == 0
        assert path.stat().st_size > 0
        return
    with pytest.raises(SystemExit) as e:
        main(["--context", "200000", "--plot", str(path)])
    assert e.value.code == 2 and "--plot needs matplotlib" in capsys.readouterr().err


def test_cli_bad_argument_exits_2():
    out = cli("--mem-fraction", "2")
    assert out.returncode == 2 and "usage:" in out.stderr


def test_planner_imports_neither_torch_nor_transformers():
    """The plan package alone (its parent package stubbed: torch_kdtree/__init__ imports torch and
    the models) needs the standard library only."""
    code = ("import sys, types; pkg = types.ModuleType('torch_kdtree'); pkg.__path__ = ['torch_kdtree']; "
            "sys.modules['torch_kdtree'] = pkg; from torch_kdtree.plan import plan; "
            "out = plan('kimi-k2.6', context=200000); assert out['fits']; "
            "print(sorted(m for m in ('torch', 'transformers', 'torch_kdtree.models') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env=envs.child_environment(PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_fixes_is_empty_when_it_fits():
    t = k26()
    assert fixes(t, None, Deployment(GPUS["h200"].total_bytes, context=200_000)) == []
