"""Decode diagnostics (issue 49 part 2): the split and fit arithmetic on hand-made numbers, and
``python -m torch_kdtree.diagnose`` on the tiny pair on the CPU as a test of its outputs (plots,
JSON, CSV, --compare, usage errors).  Nothing here asserts on speed: the values are only checked
for sanity and internal consistency."""
import copy
import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_kdtree.diagnose import Rate, by_depth, by_position, fit_line, histogram, main, split, step_fit
from torch_kdtree.diagnose.analysis import interpolate, log_spaced
from torch_kdtree.diagnose.compare import compare
from torch_kdtree.diagnose.pair import default_pair
from torch_kdtree.diagnose.plots import PLOTS
from torch_kdtree.diagnose.report import CONTEXT_COLUMNS, WINDOW_COLUMNS

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"
BLOCK = 4  # L = 3 draft depths: a short oracle look-ahead keeps the CPU runs quick
SMALL = ["--block-size", str(BLOCK), "--max-context", "128", "--points", "2", "--repeats", "2", "--burst-short", "2",
         "--burst-long", "18", "--sustained-tokens", "96", "--window-steps", "4", "--timing-steps", "4",
         "--profile-steps", "1", "--position-bins", "4", "--device", "cpu", "--quiet", "--tiny-pair",
         "--threads", "1"]  # the tiny pair gains nothing from more, and a second thread stalls on a busy CPU


# ---------------------------------------------------------------------------- the arithmetic


def test_split_of_a_slowdown_into_acceptance_and_step_time():
    # 4 tokens/step at 10 ms -> 3 tokens/step at 12.5 ms: 400 -> 240 tokens/s (-40 %)
    s = split(Rate(4.0, 0.010), Rate(3.0, 0.0125))
    assert s["before"]["tokens_per_s"] == pytest.approx(400) and s["after"]["tokens_per_s"] == pytest.approx(240)
    assert s["change_pct"] == pytest.approx(-40.0)
    assert s["dlog_tokens_per_s"] == pytest.approx(math.log(0.6))
    assert s["dlog_accept"] == pytest.approx(math.log(0.75)) and s["dlog_step_time"] == pytest.approx(math.log(1.25))
    # ln 0.75 / ln 0.6 = 56.32 %, -ln 1.25 / ln 0.6 = 43.68 %
    assert s["from_acceptance_pct"] == pytest.approx(100 * math.log(0.75) / math.log(0.6))
    assert s["from_acceptance_pct"] == pytest.approx(56.32, abs=0.01)
    assert s["from_step_time_pct"] == pytest.approx(43.68, abs=0.01)
    assert s["from_acceptance_pct"] + s["from_step_time_pct"] == pytest.approx(100)
    assert "56 % from acceptance, 44 % from step time" in s["text"]


def test_split_all_from_step_time_when_acceptance_holds():
    s = split(Rate(3.0, 0.010), Rate(3.0, 0.020))
    assert s["change_pct"] == pytest.approx(-50.0)
    assert s["from_acceptance_pct"] == pytest.approx(0.0) and s["from_step_time_pct"] == pytest.approx(100.0)


def test_split_shares_beyond_100_when_the_factors_move_apart():
    # acceptance rises 2 -> 3 but the step triples: 200 -> 100 tokens/s
    s = split(Rate(2.0, 0.010), Rate(3.0, 0.030))
    assert s["from_acceptance_pct"] == pytest.approx(100 * math.log(1.5) / math.log(0.5))  # -58.5 %
    assert s["from_step_time_pct"] == pytest.approx(100 * -math.log(3) / math.log(0.5))  # 158.5 %
    assert s["from_acceptance_pct"] + s["from_step_time_pct"] == pytest.approx(100)


def test_split_without_a_change_has_no_shares():
    s = split(Rate(2.0, 0.010), Rate(2.0, 0.010))
    assert s["from_acceptance_pct"] is None and s["from_step_time_pct"] is None
    assert "unchanged" in s["text"]
    # a change of tokens/s that cancels out exactly (acceptance and step time both doubled)
    s = split(Rate(2.0, 0.010), Rate(4.0, 0.020))
    assert s["change_pct"] == pytest.approx(0.0, abs=1e-9) and s["from_acceptance_pct"] is None


def test_rate_of_counts():
    r = Rate.of(tokens=300, steps=100, seconds=0.5)
    assert r.accept == 3.0 and r.step_seconds == 0.005 and r.tokens_per_s == pytest.approx(600)
    with pytest.raises(ValueError):
        Rate.of(0, 10, 1.0)


def test_fit_line_recovers_a_line_and_names_its_units():
    xs = [64, 128, 256, 512, 1024]
    fit = fit_line(xs, [2.0 + 0.5 * x for x in xs])
    assert fit["a"] == pytest.approx(2.0) and fit["b"] == pytest.approx(0.5) and fit["r2"] == pytest.approx(1.0)
    # step ms = 1.5 + 0.004 ms per token of context = 4 ms per 1k tokens
    fit = step_fit(xs, [1.5 + 0.004 * x for x in xs])
    assert fit["a_ms"] == pytest.approx(1.5) and fit["b_ms_per_1k_tokens"] == pytest.approx(4.0)
    assert fit["n"] == 5
    # least squares of three points off a line: y = 0, 1, 1 at x = 0, 1, 2 -> a = 1/6, b = 1/2
    fit = fit_line([0, 1, 2], [0, 1, 1])
    assert fit["a"] == pytest.approx(1 / 6) and fit["b"] == pytest.approx(0.5)
    assert fit["r2"] == pytest.approx(0.75)
    assert fit_line([64, 64], [1.0, 2.0]) is None and step_fit([64], [1.0]) is None


def test_acceptance_statistics_on_hand_made_lengths():
    lengths = [1, 2, 4, 4, 3]  # L = 3
    assert histogram(lengths, 4) == [1, 1, 1, 2]
    depth = by_depth(lengths, 3)
    assert [d["reached"] for d in depth] == pytest.approx([4 / 5, 3 / 5, 2 / 5])
    assert [d["conditional"] for d in depth] == pytest.approx([4 / 5, 3 / 4, 2 / 3])
    rows = by_position([0, 1, 3, 7, 11], lengths, 2)  # positions 0..11 in two bins of 6
    assert [(r["position_start"], r["steps"], r["accept"]) for r in rows] == [(0, 3, 7 / 3), (6, 2, 3.5)]
    with pytest.raises(ValueError):
        histogram([5], 4)


def test_interpolate_and_log_spacing():
    assert interpolate(150, [100, 200], [10.0, 20.0]) == pytest.approx(15.0)
    assert interpolate(50, [100, 200], [10.0, 20.0]) is None
    assert log_spaced(64, 8192, 8) == [64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert log_spaced(64, 64, 5) == [64]


def test_burst_pools_the_repeats_and_leaves_out_one_reversed_by_noise():
    from torch_kdtree.diagnose.report import _burst_row

    def run(steps, seconds, wall):
        return {"steps": steps, "seconds": seconds, "wall_seconds": wall}

    pairs = [{"short": run(3, 0.03, 0.5), "long": run(67, 0.67, 1.2)},   # 256 tokens in 64 steps, 0.64 s
             {"short": run(3, 0.03, 0.5), "long": run(131, 1.31, 2.0)},  # 256 tokens in 128 steps, 1.28 s
             {"short": run(3, 0.90, 0.5), "long": run(67, 0.60, 1.0)}]   # reversed: noise
    row = _burst_row(64, pairs, 256)
    assert [x["tokens_per_s"] for x in row["burst_repeats"]] == pytest.approx([400, 200, None])
    # pooled: 512 tokens in 192 steps and 1.92 s
    assert row["burst_tokens_per_s"] == pytest.approx(512 / 1.92)
    assert row["burst_accept"] == pytest.approx(512 / 192) and row["burst_step_ms"] == pytest.approx(10.0)
    assert (row["burst_tokens_per_s_min"], row["burst_tokens_per_s_max"]) == pytest.approx((200, 400))
    assert row["burst_wall_tokens_per_s"] == pytest.approx(768 / (0.7 + 1.5 + 0.5))


# ---------------------------------------------------------------------------- the default pair


def test_default_pair_is_the_tiny_pair_until_a_shipped_pair_exists(monkeypatch, capsys):
    import torch_kdtree.models as models

    monkeypatch.delattr(models, "load_default_pair", raising=False)
    pair = default_pair(torch.device("cpu"), torch.float32, block_size=BLOCK)
    assert "tiny random pair" in pair.name and pair.drafter.block_size == BLOCK
    assert "load_default_pair" in capsys.readouterr().err

    def untrained(device=None, dtype=None):
        raise FileNotFoundError("no trained default pair at models/default_pair")

    monkeypatch.setattr(models, "load_default_pair", untrained, raising=False)
    assert "tiny random pair" in default_pair(torch.device("cpu"), torch.float32).name
    assert "no trained default pair" in capsys.readouterr().err

    calls = []

    def shipped(device=None, dtype=None):
        calls.append((device, dtype))
        return pair.target, pair.drafter, "tokenizer"

    monkeypatch.setattr(models, "load_default_pair", shipped, raising=False)
    chosen = default_pair(torch.device("cpu"), torch.float32)
    assert calls == [(torch.device("cpu"), torch.float32)]
    assert "shipped pair" in chosen.name and chosen.tokenizer == "tokenizer"
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------------------- the tool on the CPU


def _run(directory: Path, *extra: str) -> dict:
    threads = torch.get_num_threads()
    assert main([*SMALL, "--out", str(directory), *extra]) == 0
    assert torch.get_num_threads() == threads  # --threads holds only while it runs
    return json.loads((directory / "diagnose.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs: an oracle whose accuracy drifts down over the sustained generation, and the tiny
    pair's own random drafter at another budget."""
    a = tmp_path_factory.mktemp("oracle")
    b = tmp_path_factory.mktemp("random")
    return {"oracle": (a, _run(a, "--oracle", "0.95", "--oracle-accuracy-end", "0.05")),
            "random": (b, _run(b, "--tree-budget", "8"))}


@pytest.mark.parametrize("name", ["oracle", "random"])
def test_diagnose_writes_png_plots(runs, name):
    directory, result = runs[name]
    for plot in PLOTS:
        data = (directory / plot).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, plot
        assert str(directory / plot) in result["files"]


def _close(a, b, rel=1e-6):
    return a == pytest.approx(b, rel=rel, abs=1e-9)


def _check_split(s):
    assert _close(s["dlog_tokens_per_s"], s["dlog_accept"] - s["dlog_step_time"])
    if s["from_acceptance_pct"] is not None:
        assert _close(s["from_acceptance_pct"] + s["from_step_time_pct"], 100.0)
    assert _close(s["change_pct"], 100 * (s["after"]["tokens_per_s"] / s["before"]["tokens_per_s"] - 1))


@pytest.mark.parametrize("name", ["oracle", "random"])
def test_diagnose_json_has_the_documented_keys_and_sane_values(runs, name):
    _, r = runs[name]
    assert set(r) == {"schema", "meta", "contexts", "sustained", "split", "fits", "disagreements", "files"}
    assert r["schema"] == "torch_kdtree.diagnose/1"
    meta = r["meta"]
    assert meta["pair"].startswith("tiny random pair") and meta["block_size"] == BLOCK
    assert meta["device"] == "cpu" and meta["batch_size"] == 1
    assert meta["settings"]["contexts"] == [64, 128]
    L = BLOCK - 1

    assert [row["context"] for row in r["contexts"]] == [64, 128]
    for row in r["contexts"]:
        assert set(CONTEXT_COLUMNS) <= set(row) and {"phases_ms", "ar_phases_ms", "burst_repeats"} <= set(row)
        assert len(row["burst_repeats"]) == 2
        # a repeat whose long run was not slower than its short one (a busy CPU) has null rates
        # and stays out of the pooled burst, which then lies within the other repeats' range
        each = [x["tokens_per_s"] for x in row["burst_repeats"] if x["tokens_per_s"] is not None]
        assert all(x > 0 for x in each)
        if each:
            assert row["burst_tokens_per_s_min"] == min(each) and row["burst_tokens_per_s_max"] == max(each)
            assert min(each) * (1 - 1e-9) <= row["burst_tokens_per_s"] <= max(each) * (1 + 1e-9)
            assert 1 <= row["burst_accept"] <= L + 1 and row["burst_step_ms"] > 0
            assert _close(row["burst_tokens_per_s"], row["burst_accept"] / row["burst_step_ms"] * 1e3)
        else:
            assert row["burst_tokens_per_s"] is None and any("Burst at contexts" in n for n in meta["notes"])
        assert 1 <= row["tree_accept"] <= L + 1
        assert row["ar_step_ms"] > 0 and row["tree_step_ms"] > 0
        assert _close(row["ar_tokens_per_s"], 1e3 / row["ar_step_ms"])
        phases = row["phases_ms"]
        assert set(phases) == {"draft_ms", "topk_ms", "build_ms", "verify_ms", "accept_ms", "commit_ms", "total_ms"}
        assert all(phases[k] > 0 for k in phases)
        assert _close(phases["total_ms"], sum(v for k, v in phases.items() if k != "total_ms"))
        assert row["ar_phases_ms"]["verify_ms"] > 0 and row["ar_phases_ms"]["draft_ms"] == 0
        if row["sustained_tokens_per_s"] is not None:
            assert _close(row["burst_over_sustained"], row["burst_tokens_per_s"] / row["sustained_tokens_per_s"])

    s = r["sustained"]
    assert s["prompt_length"] == 64 and s["tokens"] == 95  # the first of the 96 comes from the prefill
    assert 1 <= s["accept"] <= L + 1 and s["step_ms"] > 0 and s["tokens_per_s"] > 0
    assert _close(s["tokens_per_s"], s["accept"] / s["step_ms"] * 1e3)
    assert all(1 <= a <= L + 1 for a in s["accept_lengths"]) and sum(s["accept_lengths"]) >= s["tokens"]
    assert sum(s["accept_histogram"]) == len(s["accept_lengths"]) and len(s["accept_histogram"]) == L + 1
    assert [d["depth"] for d in s["accept_by_depth"]] == [1, 2, 3]
    reached = [d["reached"] for d in s["accept_by_depth"]]
    assert all(0 <= x <= 1 for x in reached) and reached == sorted(reached, reverse=True)
    assert all(1 <= p["accept"] <= L + 1 for p in s["accept_by_position"])
    windows = s["windows"]
    assert sum(w["tokens"] for w in windows) == s["tokens"] and sum(w["steps"] for w in windows) == s["steps"]
    assert windows[0]["context_start"] == 64 and windows[-1]["position_end"] == 96
    for w, following in zip(windows, windows[1:]):
        assert w["context_end"] == following["context_start"] and w["position_end"] == following["position_start"]
    for w in windows:
        assert set(WINDOW_COLUMNS) | {"from_first"} <= set(w)
        assert 1 <= w["accept"] <= L + 1 and w["step_ms"] > 0 and w["tokens_per_s"] > 0
        assert _close(w["tokens_per_s"], w["accept"] / w["step_ms"] * 1e3)
        _check_split(w["from_first"])

    _check_split(r["split"]["first_vs_last_window"])
    if r["contexts"][0]["burst_tokens_per_s"] is not None:
        _check_split(r["split"]["burst_vs_sustained"])
    for key in ("ar", "tree", "tree_sustained"):
        assert set(r["fits"][key]) == {"a_ms", "b_ms_per_1k_tokens", "r2", "n"}
    assert r["fits"]["ar"]["n"] == 2 and r["fits"]["tree_sustained"]["n"] == len(windows)


def test_sizes_left_out_fit_the_targets_positions():
    """--sustained-tokens and --max-context, left out, default to 4096 and 8192 where they fit and
    otherwise to what does (half the positions for the sustained run, the rest less a tree's slack);
    given sizes that do not fit are refused, naming the positions."""
    from torch_kdtree.diagnose.cli import _fit_to_positions, build_parser
    from torch_kdtree.diagnose.pair import InputError

    def fitted(limit, *argv):
        args = build_parser().parse_args(list(argv))
        _fit_to_positions(args, limit, 8)
        return args.sustained_tokens, args.max_context

    assert fitted(None) == (4096, 8192) and fitted(163840) == (4096, 8192)
    assert fitted(2048) == (1024, 2048 - 1024 - 16)  # the shipped pair
    assert fitted(2048, "--sustained-tokens", "512") == (512, 2048 - 512 - 16)
    assert fitted(2048, "--max-context", "256") == (1024, 256)
    for argv in (["--max-context", "1500"], ["--sustained-tokens", "2000"]):
        with pytest.raises(InputError, match="exceed the target's 2048 positions"):
            fitted(2048, *argv)


def test_diagnose_runs_on_the_shipped_pair_with_its_held_out_prompts(tmp_path):
    """Without --tiny-pair the tool runs the shipped pair (models/default_pair), its prompt made of
    the pair's held-out code prompts; sizes left out fit the pair's 2,048 positions."""
    small = [a for a in SMALL if a != "--tiny-pair"]
    small = small[:small.index("--block-size")] + small[small.index("--block-size") + 2:]  # the drafter's own
    assert main([*small, "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "diagnose.json").read_text())
    meta = r["meta"]
    assert meta["pair"].startswith("the shipped pair") and meta["block_size"] == 8
    assert meta["prompt"].startswith("the pair's 8 held-out code prompts")
    assert 1 <= r["sustained"]["accept"] <= 8 and r["sustained"]["tokens"] == 95
    assert r["sustained"]["accept"] > 1.5  # the trained drafter is right most of the time at the start


def test_diagnose_oracle_drift_shows_in_acceptance_over_the_response(runs):
    s = runs["oracle"][1]["sustained"]
    accuracy = [w["oracle_accuracy"] for w in s["windows"]]
    assert accuracy[0] == pytest.approx(0.95) and accuracy == sorted(accuracy, reverse=True)
    assert s["accept_by_position"][0]["accept"] > s["accept_by_position"][-1]["accept"]
    # the random drafter of the tiny pair: its tree hardly ever matches the target
    assert runs["random"][1]["sustained"]["accept"] < s["accept"]


@pytest.mark.parametrize("name", ["oracle", "random"])
def test_diagnose_csv_files_hold_the_json_rows(runs, name):
    directory, r = runs[name]
    with open(directory / "contexts.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(row["context"]) for row in rows] == [row["context"] for row in r["contexts"]]
    assert set(CONTEXT_COLUMNS) | {"tree_verify_ms", "ar_verify_ms"} <= set(rows[0])
    for row, expected in zip(rows, r["contexts"]):
        assert float(row["tree_step_ms"]) == pytest.approx(expected["tree_step_ms"], rel=1e-5)
        if expected["burst_tokens_per_s"] is None:
            assert row["burst_tokens_per_s"] == ""
        else:
            assert float(row["burst_tokens_per_s"]) == pytest.approx(expected["burst_tokens_per_s"], rel=1e-5)
    with open(directory / "windows.csv", newline="") as f:
        windows = list(csv.DictReader(f))
    assert len(windows) == len(r["sustained"]["windows"])
    assert set(WINDOW_COLUMNS) | {"from_acceptance_pct_from_first", "from_step_time_pct_from_first"} <= set(windows[0])
    for w in windows[1:]:
        if w["from_acceptance_pct_from_first"]:
            a, b = float(w["from_acceptance_pct_from_first"]), float(w["from_step_time_pct_from_first"])
            # the CSV rounds each to 6 significant digits: when the window's change is small, the two
            # shares are large with opposite signs, and their rounding errors scale with them
            assert a + b == pytest.approx(100.0, abs=1e-3 + 1e-5 * (abs(a) + abs(b))), (a, b)


def test_compare_two_runs(runs, capsys):
    (a_dir, _), (b_dir, _) = runs["oracle"], runs["random"]
    capsys.readouterr()
    assert main(["--compare", str(a_dir / "diagnose.json"), str(b_dir / "diagnose.json")]) == 0
    out = capsys.readouterr().out
    assert "sustained, A -> B" in out and "from acceptance" in out and "tree_budget: A 16, B 8" in out
    assert main(["--compare", str(a_dir / "diagnose.json"), str(b_dir / "diagnose.json"), "--json"]) == 0
    c = json.loads(capsys.readouterr().out)
    assert [row["context"] for row in c["contexts"]] == [64, 128] and c["meta_differ"]["tree_budget"] == [16, 8]
    _check_split(c["sustained_split"])


def test_compare_splits_a_pure_step_time_change(runs, tmp_path, capsys):
    """B = A with every sustained step twice as long: tokens/s halves, all of it from step time."""
    a = runs["oracle"][1]
    b = copy.deepcopy(a)
    b["sustained"]["step_ms"] *= 2
    b["sustained"]["tokens_per_s"] /= 2
    c = compare(a, b)
    assert c["sustained"]["tokens_per_s"]["change_pct"] == pytest.approx(-50.0)
    assert c["sustained_split"]["from_acceptance_pct"] == pytest.approx(0.0, abs=1e-9)
    assert c["sustained_split"]["from_step_time_pct"] == pytest.approx(100.0)
    path = tmp_path / "b.json"
    path.write_text(json.dumps(b))
    capsys.readouterr()
    assert main(["--compare", str(runs["oracle"][0] / "diagnose.json"), str(path)]) == 0
    assert "0 % from acceptance, 100 % from step time" in capsys.readouterr().out


def test_compare_refuses_a_file_that_is_not_a_result(tmp_path, capsys):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"kv_bytes_per_token": 70272}))
    with pytest.raises(SystemExit) as e:
        main(["--compare", str(other), str(other)])
    assert e.value.code == 2 and "not a diagnose result" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--compare", str(tmp_path / "missing.json"), str(other)])
    assert e.value.code == 2 and "cannot read" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--max-context", "32"], "--max-context 32 is below --min-context 64"),
    (["--burst-short", "8", "--burst-long", "8"], "must exceed --burst-short"),
    (["--oracle", "1.5"], "--oracle"),
    (["--oracle-accuracy-end", "0.5"], "--oracle-accuracy-end needs --oracle"),
    (["--drafter", "somewhere"], "--drafter needs --target"),
    (["--target", "/nonexistent/k2", "--oracle", "0.5"], "not a directory"),
    (["--tree-budget", "0"], "--tree-budget"),
    (["--points", "many"], "--points"),
    (["--dtype", "fp16"], "--dtype"),
    (["--tiny-pair", "--target", "/tmp"], "--tiny-pair and --target"),
    (["--compare", "only-one.json"], "--compare"),
    (["--prompt", "/nonexistent/prompt.txt"], "no such file"),
])
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and message in err


def test_bad_prompt_file_is_a_usage_error(tmp_path, capsys):
    prompt = tmp_path / "ids.json"
    prompt.write_text(json.dumps([5, 6, 100000]))
    with pytest.raises(SystemExit) as e:
        main([*SMALL, "--prompt", str(prompt), "--out", str(tmp_path)])
    assert e.value.code == 2 and "outside the vocabulary" in capsys.readouterr().err


def test_module_entry_point_reports_bad_arguments_with_exit_2():
    out = subprocess.run([sys.executable, "-m", "torch_kdtree.diagnose", "--repeats", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "usage:" in out.stderr and "--repeats" in out.stderr
