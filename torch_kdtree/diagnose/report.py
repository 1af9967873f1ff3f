"""From measurements to the result: rates, the burst/sustained comparison, the splits, the
acceptance statistics, the fits; the JSON object, the two CSV files and the printed summary.

The JSON object (``diagnose.json``):

- ``schema``: ``"torch_kdtree.diagnose/1"``; ``meta``: target, drafter, device, dtype, torch, tree
  budget, block size, batch size, prompt, settings, timestamps, notes;
- ``contexts``: one row per context (also ``contexts.csv``): ``context``, ``burst_tokens_per_s``
  (new tokens between the two points / step time between them, pooled over the repeats) with
  ``burst_tokens_per_s_min`` / ``_max`` over the repeats, ``burst_wall_tokens_per_s`` (the same on
  the wall clock: prefill cancels, host gaps and any oracle look-ahead count), ``burst_accept``,
  ``burst_step_ms``, ``sustained_tokens_per_s`` (the sustained run's windows interpolated at this
  context; null outside their range), ``burst_over_sustained``, ``disagree`` (they differ by more
  than the tolerance), ``ar_step_ms``, ``tree_step_ms``, ``tree_accept``, ``ar_tokens_per_s``,
  ``tree_tokens_per_s``, ``phases_ms`` and ``ar_phases_ms`` (``draft_ms`` ... ``commit_ms``,
  ``total_ms`` of eager steps), ``burst_repeats``;
- ``sustained``: ``prompt_length``, ``tokens``, ``steps``, ``seconds``, ``tokens_per_s``, ``accept``,
  ``step_ms``, ``accept_lengths`` (every step), ``accept_histogram`` (counts of lengths 1..L+1),
  ``accept_by_depth`` (``depth``, ``reached``, ``conditional``), ``accept_by_position``
  (``position_start``, ``position_end``, ``steps``, ``accept``), ``windows`` (also ``windows.csv``:
  ``index``, ``position_start``, ``position_end``, ``context_start``, ``context_end``,
  ``context_mean``, ``steps``, ``tokens``, ``seconds``, ``accept``, ``step_ms``, ``tokens_per_s``,
  ``oracle_accuracy``, ``from_first``: the split against the first window);
- ``split``: ``burst_vs_sustained`` and ``first_vs_last_window``, each with ``change_pct``,
  ``dlog_tokens_per_s`` = ``dlog_accept`` − ``dlog_step_time``, ``from_acceptance_pct`` +
  ``from_step_time_pct`` = 100, ``before`` / ``after`` and ``text``;
- ``fits``: step time (ms) = ``a_ms`` + ``b_ms_per_1k_tokens`` · context / 1000 with ``r2``, ``n``,
  for ``ar`` and ``tree`` (the per-context timings) and ``tree_sustained`` (the windows);
- ``disagreements``: the contexts where burst and sustained differ; ``files``: what was written.
"""
from __future__ import annotations

import csv
import math

from .analysis import SMALL_DLOG, Rate, by_depth, by_position, histogram, interpolate, split, split_text, step_fit

SCHEMA = "torch_kdtree.diagnose/1"
PHASE_KEYS = ("draft_ms", "topk_ms", "build_ms", "verify_ms", "accept_ms", "commit_ms")
CONTEXT_COLUMNS = ("context", "burst_tokens_per_s", "burst_tokens_per_s_min", "burst_tokens_per_s_max",
                   "burst_wall_tokens_per_s", "burst_accept", "burst_step_ms", "sustained_tokens_per_s",
                   "burst_over_sustained", "disagree", "ar_step_ms", "tree_step_ms", "tree_accept", "ar_tokens_per_s",
                   "tree_tokens_per_s")
WINDOW_COLUMNS = ("index", "position_start", "position_end", "context_start", "context_end", "context_mean", "steps",
                  "tokens", "seconds", "accept", "step_ms", "tokens_per_s", "oracle_accuracy")
SPLIT_COLUMNS = ("change_pct", "from_acceptance_pct", "from_step_time_pct")


def _burst_row(context: int, pairs: list[dict], span: int) -> dict:
    """The burst at one context, pooled over the repeats whose long run took longer (and more
    steps) than the short one; a repeat where noise reversed them is kept in ``burst_repeats``
    with null rates and left out of the pooled rate."""
    repeats = []
    for p in pairs:
        seconds = p["long"]["seconds"] - p["short"]["seconds"]
        steps = p["long"]["steps"] - p["short"]["steps"]
        wall = p["long"]["wall_seconds"] - p["short"]["wall_seconds"]
        valid = seconds > 0 and steps > 0
        repeats.append({"seconds": seconds, "steps": steps, "wall_seconds": wall,
                        "tokens_per_s": span / seconds if valid else None,
                        "wall_tokens_per_s": span / wall if wall > 0 else None})
    valid = [r for r in repeats if r["tokens_per_s"] is not None]
    seconds, steps = sum(r["seconds"] for r in valid), sum(r["steps"] for r in valid)
    rate = Rate.of(span * len(valid), steps, seconds) if valid else None
    walls = [r for r in repeats if r["wall_tokens_per_s"] is not None]
    wall = sum(r["wall_seconds"] for r in walls)
    each = [r["tokens_per_s"] for r in valid]
    return {"context": context, "burst_tokens_per_s": rate.tokens_per_s if rate else None,
            "burst_tokens_per_s_min": min(each) if each else None, "burst_tokens_per_s_max": max(each) if each else None,
            "burst_wall_tokens_per_s": span * len(walls) / wall if walls else None,
            "burst_accept": rate.accept if rate else None, "burst_step_ms": rate.step_seconds * 1e3 if rate else None,
            "burst_repeats": repeats, "_rate": rate}


def _windows(raw: list[dict]) -> list[dict]:
    rows = []
    for i, w in enumerate(raw):
        rate = Rate.of(w["tokens"], w["steps"], w["seconds"]) if w["tokens"] > 0 and w["seconds"] > 0 else None
        rows.append({"index": i, "position_start": w["position_start"], "position_end": w["position_end"],
                     "context_start": w["context_start"], "context_end": w["context_end"],
                     "context_mean": (w["context_start"] + w["context_end"]) / 2, "steps": w["steps"],
                     "tokens": w["tokens"], "seconds": w["seconds"], "accept": rate.accept if rate else None,
                     "step_ms": rate.step_seconds * 1e3 if rate else None,
                     "tokens_per_s": rate.tokens_per_s if rate else None, "oracle_accuracy": w["oracle_accuracy"],
                     "_rate": rate})
    first = next((r["_rate"] for r in rows if r["_rate"] is not None), None)
    for r in rows:
        r["from_first"] = split(first, r["_rate"], label=f"window {r['index']} vs window 0") \
            if first is not None and r["_rate"] is not None else None
    return rows


def _sustained_at(context: int, live: list[dict], xs: list[float], ys: list[float]) -> float | None:
    """The sustained run's tokens/s at ``context``: interpolated between window centres, the
    first / last window's own value in its outer half; None outside the run's contexts."""
    if not live:
        return None
    if live[0]["context_start"] <= context < xs[0]:
        return ys[0]
    if xs[-1] < context <= live[-1]["context_end"]:
        return ys[-1]
    return interpolate(context, xs, ys)


def build(meta: dict, settings, bursts: dict, timings: dict, sustained: dict, *, depths: int,
          tolerance: float, position_bins: int) -> dict:
    """The result object (module docstring) from :class:`~.measure.Measurer`'s raw numbers."""
    span = settings.burst_long - settings.burst_short
    windows = _windows(sustained["windows"])
    live = [w for w in windows if w["_rate"] is not None]
    accepts, positions = [], []
    for w in sustained["windows"]:
        position = w["position_start"]
        for a in w["accepts"]:
            if a > 0:  # 0: a step run after the request finished
                accepts.append(a)
                positions.append(position)
                position += a
    tokens, steps = sum(w["tokens"] for w in windows), sum(w["steps"] for w in windows)
    seconds = sum(w["seconds"] for w in windows)
    overall = Rate.of(tokens, steps, seconds) if tokens > 0 and seconds > 0 else None
    xs, ys = [w["context_mean"] for w in live], [w["tokens_per_s"] for w in live]

    rows = []
    for context in settings.contexts:
        row = _burst_row(context, bursts[context], span)
        t = timings[context]
        tree_accepts = [a for a in t["tree_accepts"] if a > 0]
        tree_accept = sum(tree_accepts) / len(tree_accepts) if tree_accepts else None
        sustained_tps = _sustained_at(context, live, xs, ys)
        ratio = row["burst_tokens_per_s"] / sustained_tps if sustained_tps and row["burst_tokens_per_s"] else None
        row.update({
            "sustained_tokens_per_s": sustained_tps, "burst_over_sustained": ratio,
            "disagree": ratio is not None and abs(math.log(ratio)) > math.log1p(tolerance),
            "ar_step_ms": t["ar_seconds"] * 1e3, "tree_step_ms": t["tree_seconds"] * 1e3, "tree_accept": tree_accept,
            "ar_tokens_per_s": 1 / t["ar_seconds"],
            "tree_tokens_per_s": tree_accept / t["tree_seconds"] if tree_accept else None,
            "phases_ms": t["tree_phases"], "ar_phases_ms": t["ar_phases"],
        })
        rows.append(row)

    P = settings.prompt_length
    at_prompt = next(r for r in rows if r["context"] == P)
    splits = {"burst_vs_sustained": None, "first_vs_last_window": None}
    if at_prompt["_rate"] is not None and overall is not None:
        splits["burst_vs_sustained"] = split(
            at_prompt["_rate"], overall,
            label=f"burst ({span} new tokens after a {P}-token prompt) -> sustained ({tokens} new tokens after it)")
    if len(live) >= 2:
        splits["first_vs_last_window"] = split(live[0]["_rate"], live[-1]["_rate"],
                                               label=f"window 0 -> window {live[-1]['index']}")
    fits = {"ar": step_fit([r["context"] for r in rows], [r["ar_step_ms"] for r in rows]),
            "tree": step_fit([r["context"] for r in rows], [r["tree_step_ms"] for r in rows]),
            "tree_sustained": step_fit([w["context_mean"] for w in live], [w["step_ms"] for w in live])}
    unmeasured = [r["context"] for r in rows if r["_rate"] is None or any(
        x["tokens_per_s"] is None for x in r["burst_repeats"])]
    if unmeasured:
        meta = {**meta, "notes": meta["notes"] + [
            f"Burst at contexts {unmeasured}: a long run took no longer than its short one in some repeats, so the "
            "two-point difference is noise there (left out, or null); raise --burst-long or --repeats."]}
    for r in rows + windows:
        r.pop("_rate")
    return {
        "schema": SCHEMA,
        "meta": meta,
        "contexts": rows,
        "sustained": {
            "prompt_length": P, "tokens": tokens, "steps": steps, "seconds": seconds,
            "tokens_per_s": overall.tokens_per_s if overall else None, "accept": overall.accept if overall else None,
            "step_ms": overall.step_seconds * 1e3 if overall else None,
            "accept_lengths": accepts, "accept_histogram": histogram(accepts, depths + 1),
            "accept_by_depth": by_depth(accepts, depths),
            "accept_by_position": by_position(positions, accepts, position_bins),
            "windows": windows,
        },
        "split": splits,
        "fits": fits,
        "disagreements": [{"context": r["context"], "burst_tokens_per_s": r["burst_tokens_per_s"],
                           "sustained_tokens_per_s": r["sustained_tokens_per_s"],
                           "burst_over_sustained": r["burst_over_sustained"]} for r in rows if r["disagree"]],
        "files": [],
    }


# ---------------------------------------------------------------------------- CSV


def _cell(v):
    if v is None:
        return ""
    return f"{v:.6g}" if isinstance(v, float) else v


def write_csv(result: dict, contexts_path: str, windows_path: str) -> None:
    with open(contexts_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CONTEXT_COLUMNS + tuple(f"tree_{k}" for k in PHASE_KEYS) + ("ar_verify_ms", "ar_commit_ms"))
        for r in result["contexts"]:
            w.writerow([_cell(r[c]) for c in CONTEXT_COLUMNS] + [_cell(r["phases_ms"].get(k)) for k in PHASE_KEYS]
                       + [_cell(r["ar_phases_ms"].get(k)) for k in ("verify_ms", "commit_ms")])
    with open(windows_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(WINDOW_COLUMNS + tuple(f"{c}_from_first" for c in SPLIT_COLUMNS))
        for r in result["sustained"]["windows"]:
            s = r["from_first"] or {}
            w.writerow([_cell(r[c]) for c in WINDOW_COLUMNS] + [_cell(s.get(c)) for c in SPLIT_COLUMNS])


# ---------------------------------------------------------------------------- summary


def _f(v, fmt: str = ".4g", none: str = "-") -> str:
    return none if v is None else format(v, fmt)


def summary(result: dict) -> str:
    m, s = result["meta"], result["sustained"]
    lines = [
        f"diagnose: {m['pair']}",
        f"  {m['device']} {m['dtype']}, batch 1, tree budget {m['tree_budget']}, block size {m['block_size']} "
        f"(L = {m['block_size'] - 1}); steps {'in CUDA graphs' if m['cuda_graphs'] else 'eager'}, "
        f"compile {m['compile']}; prompt: {m['prompt']}",
        "",
        "throughput against context (tokens/s inside the decoding steps; * where burst and sustained disagree by "
        f"more than {100 * m['settings']['tolerance']:.0f} %)",
        f"  {'context':>8s} {'burst':>9s} {'[min - max]':>21s} {'wall':>9s} {'sustained':>10s} {'b/s':>6s} "
        f"{'AR':>9s} {'tree ms':>9s} {'AR ms':>9s} {'accept':>7s}",
    ]
    for r in result["contexts"]:
        interval = f"[{_f(r['burst_tokens_per_s_min'])} - {_f(r['burst_tokens_per_s_max'])}]"
        lines.append(
            f"  {r['context']:>8d} {_f(r['burst_tokens_per_s']):>9s} {interval:>21s} "
            f"{_f(r['burst_wall_tokens_per_s']):>9s} {_f(r['sustained_tokens_per_s']):>10s} "
            f"{_f(r['burst_over_sustained'], '.2f'):>5s}{'*' if r['disagree'] else ' '} "
            f"{_f(r['ar_tokens_per_s']):>9s} {_f(r['tree_step_ms']):>9s} {_f(r['ar_step_ms']):>9s} "
            f"{_f(r['tree_accept'], '.2f'):>7s}")
    lines += ["", f"sustained: {s['tokens']} tokens after a {s['prompt_length']}-token prompt in {s['steps']} steps, "
                  f"{_f(s['tokens_per_s'])} tokens/s, {_f(s['accept'], '.3f')} tokens/step, "
                  f"{_f(s['step_ms'])} ms/step"]
    for key in ("burst_vs_sustained", "first_vs_last_window"):
        if result["split"][key] is not None:
            lines.append(f"  {split_text(result['split'][key])}")
    lines += ["", "per window (split against window 0):",
              f"  {'window':>6s} {'positions':>13s} {'context':>8s} {'accept':>7s} {'step ms':>9s} {'tokens/s':>9s}  "
              "split"]
    windows = s["windows"]
    stride = max(1, len(windows) // 12)
    for w in windows[::stride] + ([windows[-1]] if (len(windows) - 1) % stride else []):
        sp = w["from_first"]
        text = "" if sp is None or sp["from_acceptance_pct"] is None else \
            f"{sp['change_pct']:+.1f} %: {round(sp['from_acceptance_pct'])} % from acceptance, " \
            f"{round(sp['from_step_time_pct'])} % from step time" + \
            (" (small change: shares unstable)" if abs(sp["dlog_tokens_per_s"]) < SMALL_DLOG else "")
        lines.append(f"  {w['index']:>6d} {w['position_start']:>6d}-{w['position_end']:<6d} "
                     f"{w['context_mean']:>8.0f} {_f(w['accept'], '.3f'):>7s} {_f(w['step_ms']):>9s} "
                     f"{_f(w['tokens_per_s']):>9s}  {text}")
    hist = s["accept_histogram"]
    total = sum(hist) or 1
    lines += ["", "accept lengths: " + "  ".join(f"{i + 1}: {100 * n / total:.1f} %" for i, n in enumerate(hist)),
              "accepted by depth: " + "  ".join(f"d{d['depth']} {_f(d['reached'], '.2f')}" for d in
                                                s["accept_by_depth"]),
              "  given the depth before: " + "  ".join(f"d{d['depth']} {_f(d['conditional'], '.2f')}" for d in
                                                      s["accept_by_depth"]),
              "accept over the response: " + "  ".join(f"{p['position_start']}-{p['position_end']}: "
                                                       f"{p['accept']:.2f}" for p in s["accept_by_position"])]
    lines.append("")
    for name, label in (("ar", "AR step"), ("tree", "tree step"), ("tree_sustained", "tree step (sustained)")):
        fit = result["fits"][name]
        if fit is not None:
            lines.append(f"{label:22s} = {fit['a_ms']:.4g} ms + {fit['b_ms_per_1k_tokens']:.4g} ms per 1k tokens "
                         f"of context (r2 {fit['r2']:.3f}, {fit['n']} points)")
    lines += ["", "phases of an eager tree step (ms; CUDA graphs and compile are off here, so the total exceeds the "
                  "captured step):",
              f"  {'context':>8s}" + "".join(f"{k[:-3]:>9s}" for k in PHASE_KEYS) + f"{'total':>9s}"]
    for r in result["contexts"]:
        p = r["phases_ms"]
        lines.append(f"  {r['context']:>8d}" + "".join(f"{_f(p.get(k)):>9s}" for k in PHASE_KEYS)
                     + f"{_f(p.get('total_ms')):>9s}")
    if result["disagreements"]:
        lines += ["", "burst and sustained disagree at contexts " +
                  ", ".join(f"{d['context']} ({d['burst_over_sustained']:.2f}x)" for d in result["disagreements"])]
    if m["notes"]:
        lines += ["", "notes:"] + [f"  - {n}" for n in m["notes"]]
    return "\n".join(lines)


__all__ = ["SCHEMA", "PHASE_KEYS", "CONTEXT_COLUMNS", "WINDOW_COLUMNS", "build", "write_csv", "summary"]
