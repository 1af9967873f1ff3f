"""bench/tp8_run.py -- issue 47's eight-GPU program -- on the CPU: gloo, tiny configurations.

Spawned through torchrun as the eight-GPU session will run it: at world 2 every part (equality at
TP-2, the layers at two depths with the no-op comparison, the oracle runs, the projection) must
finish with the equality checks passing and every figure in the JSON present and sane (positive
times, shares in [0, 1], each budget either projected or named as skipped); the times themselves
mean nothing on the CPU and are not asserted.  At world 4 the equality part alone: TP-4 on all ranks,
then TP-2 on two sub-meshes at once (:func:`bench.tp8_run.equality_rounds`).  Plus the script's
pure helpers.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_kdtree import envs

ROOT = Path(__file__).resolve().parents[1]


def _spawn(tmp_path, world: int, *args, timeout: int = 900):
    out = tmp_path / f"world{world}"
    env = envs.child_environment(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", OUT=None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(ROOT / "bench" / "tp8_run.py"), "--backend", "gloo", "--device", "cpu", "--tiny", "--out", str(out),
           *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    return json.loads((out / "tp8_run.json").read_text()), (out / "tp8_run.txt").read_text()


def _timing_sane(t: dict) -> None:
    assert 0 < t["ms_min"] <= t["ms"] <= t["ms_max"], t
    assert 0.0 <= t["comm_share"] <= 1.0 and t["comm_us"] >= 0 and t["profiled_us"] > 0, t
    assert t["comm_calls"] > 0, t  # the step's collectives ran (and were seen by the profiler)


def test_the_tp8_program_runs_every_part_at_world_2(tmp_path):
    results, text = _spawn(tmp_path, 2)
    assert results["meta"]["finished"] and results["meta"]["world"] == 2
    assert results["meta"]["parts_run"] == ["equality", "layers", "oracle", "projection"]
    for part in ("equality", "layers", "projection"):
        assert "error" not in results[part], results[part]["error"]
        assert f"== {part}" in text

    eq = results["equality"]
    assert eq["ok"] and eq["sizes"] == [2] and eq["rounds"] == [[[0, 1]]], eq
    two = eq["by_size"]["2"]
    # fp32 on the CPU: the tokens are the single-process tokens exactly, the logits to rounding
    assert two["ar"] == "equal" and two["dd"] == "equal" and two["dd_vs_tp1_ar"] == "equal", two
    assert two["prefill_rel_err"] <= 1e-5 and two["tree_rel_err"] <= 1e-5, two
    assert two["same_kernels"] and two["tokens_equal_within_groups"] and two["hidden_equal_within_groups"], two
    assert all(r["steps"]["ar"] > 0 and r["steps"]["dd"] > 0 for r in two["ranks"])

    layers = results["layers"]
    assert sorted(layers["depths"], key=int) == ["2", "3"] and layers["world"] == 2
    for depth, d in layers["depths"].items():
        _timing_sane(d["ar"])
        want = {"2", "4"} | ({"0"} if depth == "3" and "OracleDrafter" in d["tree_drafter"] else set())
        assert set(d["tree"]) == want, (depth, sorted(d["tree"]))
        for t in d["tree"].values():
            _timing_sane(t)
        assert d["target_gb"] > 0 and d["drafter_gb"] > 0 and d["build_s"] >= 0
        assert set(d["ms_max_over_ranks"]) == {"ar", *d["tree"]}
    noop = layers["depths"]["3"]["noop"]  # the deepest depth: AR and B = 4 with no-op collectives
    assert set(noop) == {"0", "4"}
    for n in noop.values():
        assert n["noop_ms"] > 0 and n["real_ms"] > 0 and 0.0 <= n["share"] <= 1.0, n

    oracle = layers["oracle"]
    assert "error" not in oracle, oracle["error"]  # OracleDrafter runs under tensor parallelism
    assert oracle["depth"] == 3 and oracle["ar"]["tokens_per_s"] > 0
    assert set(oracle["runs"]) == {"0.8", "0.95"}
    for runs in oracle["runs"].values():
        assert set(runs) == {"auto"}  # (--tiny runs no fixed-budget generation)
        for run in runs.values():
            assert run["tokens_per_s"] > 0 and run["speedup_vs_ar"] > 0 and run["mean_accept"] >= 1.0, run
            assert sum(run["budget_steps"].values()) == run["steps"] > 0
            assert run["equal_to_ar_tokens"] == oracle["tokens"], run  # greedy, fp32: DDTree == AR exactly

    proj = results["projection"]
    assert proj["from_depths"] == [2, 3] and proj["layers"] == 61
    budgets = {"0", "2", "4"}
    projected = {str(r["budget"]) for r in proj["rows"]}
    assert projected | set(proj["skipped_budgets"]) == budgets and not projected & set(proj["skipped_budgets"])
    assert len(proj["rows"]) == 3 * len(projected)  # the measured card and RTX PRO 6000 low / high
    for r in proj["rows"]:
        assert r["step_ms"] > 0 and 0.0 <= r["comm_share"] <= 1.0, r
        assert all(v is None or v > 0 for v in r["tokens_per_s"].values()), r
        if r["budget"]:
            assert r["tokens_per_s"]["8.0"] is None  # block size 4: at most 4 tokens a step
    if "error" not in oracle and "0" in projected:  # each run whose every budget was projected, on each card
        runs = [r for rs in oracle["runs"].values() for r in rs.values() if set(r["budget_steps"]) <= projected]
        assert len(proj["oracle"]) == 3 * len(runs)
        assert all(r["tokens_per_s"] > 0 and r["speedup_vs_ar"] > 0 for r in proj["oracle"])


@pytest.mark.slow  # four processes: ~2x the world-2 run's equality part on two cores
def test_the_equality_part_runs_tp4_and_two_tp2_submeshes_at_world_4(tmp_path):
    results, _ = _spawn(tmp_path, 4, "--parts", "equality")
    eq = results["equality"]
    assert "layers" not in results and eq["ok"], eq
    assert eq["rounds"] == [[[0, 1, 2, 3]], [[0, 1], [2, 3]]]
    assert eq["by_size"]["2"]["groups"] == [[0, 1], [2, 3]] and eq["by_size"]["4"]["groups"] == [[0, 1, 2, 3]]
    for v in eq["by_size"].values():
        assert v["ar"] == "equal" and v["dd"] == "equal" and v["tokens_equal_across_groups"], v


# --------------------------------------------------------------------------------------------
# the helpers
# --------------------------------------------------------------------------------------------

def test_equality_rounds_pack_the_sizes_into_disjoint_groups():
    from bench.tp8_run import equality_rounds

    assert equality_rounds(8, [2, 4, 8]) == [[list(range(8))], [[0, 1, 2, 3], [4, 5], [6, 7]]]
    assert equality_rounds(4, [2, 4, 8]) == [[[0, 1, 2, 3]], [[0, 1], [2, 3]]]  # 8 does not fit: left out
    assert equality_rounds(2, [2]) == [[[0, 1]]]
    assert equality_rounds(6, [4]) == [[[0, 1, 2, 3]]]  # two ranks idle
    assert equality_rounds(8, []) == []


def test_argmax_disagreements_count_only_those_beyond_bf16_ties():
    from bench.tp8_run import argmax_disagreements

    want = torch.tensor([[1.0, 2.0, 0.0], [4.0, 4.0 + 2 ** -6, 0.0], [1.0, 0.0, 3.0]])
    got = torch.tensor([[1.0, 2.0, 0.0], [4.0 + 2 ** -5, 4.0, 0.0], [5.0, 0.0, 3.0]])
    # row 1: a tie (1/64 apart, the bf16 ulp at 4 is 1/32); row 2: 3 against 1, not a tie
    assert argmax_disagreements(got, want) == (2, 1)
    assert argmax_disagreements(want, want) == (0, 0)


def test_merge_keeps_an_earlier_invocations_depths_and_oracle():
    from bench.tp8_run import merge

    results = {"layers": {"depths": {"4": {"a": 1}}, "oracle": {"depth": 8}, "world": 8}}
    merge(results, "layers", {"depths": {"8": {"b": 2}}, "world": 8, "unfinished": True})
    assert results["layers"]["depths"] == {"4": {"a": 1}, "8": {"b": 2}} and results["layers"]["oracle"]
    merge(results, "layers", {"depths": {}, "world": 8})
    assert "unfinished" not in results["layers"] and set(results["layers"]["depths"]) == {"4", "8"}
    merge(results, "equality", {"ok": True})
    merge(results, "equality", {"ok": False})
    assert results["equality"] == {"ok": False}


def test_parts_are_checked_by_name():
    from bench.tp8_run import parse_args

    assert parse_args(["--parts", "projection,equality"]).parts == ["equality", "projection"]
    with pytest.raises(SystemExit):
        parse_args(["--parts", "layerz"])
