"""The PNG plots of one result (matplotlib, Agg backend)."""
from __future__ import annotations

import importlib.util
import os

from .report import PHASE_KEYS

PLOTS = ("throughput_vs_context.png", "acceptance_histogram.png", "acceptance_over_response.png", "phases.png",
         "step_time_vs_context.png")


def have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: str) -> None:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def throughput(result: dict, path: str) -> None:
    plt = _pyplot()
    rows, windows = result["contexts"], result["sustained"]["windows"]
    fig, ax = plt.subplots(figsize=(8, 5))
    burst = [r for r in rows if r["burst_tokens_per_s"] is not None]
    if burst:
        xs = [r["context"] for r in burst]
        ys = [r["burst_tokens_per_s"] for r in burst]
        lo = [max(0.0, y - (r["burst_tokens_per_s_min"] or y)) for y, r in zip(ys, burst)]
        hi = [max(0.0, (r["burst_tokens_per_s_max"] or y) - y) for y, r in zip(ys, burst)]
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3,
                    label=f"burst ({result['meta']['settings']['burst_short']} vs "
                          f"{result['meta']['settings']['burst_long']} new tokens; min-max of repeats)")
        bad = [r for r in burst if r["disagree"]]
        if bad:
            ax.scatter([r["context"] for r in bad], [r["burst_tokens_per_s"] for r in bad], s=160, facecolors="none",
                       edgecolors="red", label="burst and sustained disagree")
    live = [w for w in windows if w["tokens_per_s"] is not None]
    if live:
        ax.plot([w["context_mean"] for w in live], [w["tokens_per_s"] for w in live], marker=".", alpha=0.8,
                label=f"sustained ({result['sustained']['tokens']} tokens, per window)")
    ax.plot([r["context"] for r in rows], [r["ar_tokens_per_s"] for r in rows], linestyle="--", marker="s",
            label="autoregressive (1 / AR step)")
    ax.set_xscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("tokens/s (inside the decoding steps)")
    ax.set_title("Decode throughput against context")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    _save(plt, fig, path)


def acceptance_histogram(result: dict, path: str) -> None:
    plt = _pyplot()
    s = result["sustained"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    hist = s["accept_histogram"]
    total = sum(hist) or 1
    left.bar(range(1, len(hist) + 1), [n / total for n in hist])
    left.axvline(s["accept"] or 0, color="black", linestyle="--", label=f"mean {s['accept'] or 0:.2f} tokens/step")
    left.set_xlabel("accept length (tokens committed by a step)")
    left.set_ylabel("share of steps")
    left.set_title("Accept lengths, sustained generation")
    left.legend()
    depth = s["accept_by_depth"]
    xs = [d["depth"] for d in depth]
    right.plot(xs, [d["reached"] or 0 for d in depth], marker="o", label="accepted")
    right.plot(xs, [d["conditional"] or 0 for d in depth], marker="s", label="accepted | depth before accepted")
    right.set_ylim(0, 1.05)
    right.set_xlabel("draft depth")
    right.set_ylabel("share of steps")
    right.set_title("Acceptance by depth")
    right.legend()
    right.grid(True, alpha=0.3)
    _save(plt, fig, path)


def acceptance_over_response(result: dict, path: str) -> None:
    plt = _pyplot()
    windows = [w for w in result["sustained"]["windows"] if w["tokens_per_s"] is not None]
    xs = [(w["position_start"] + w["position_end"]) / 2 for w in windows]
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    for ax, key, label in zip(axes, ("accept", "step_ms", "tokens_per_s"),
                              ("tokens per step", "step time (ms)", "tokens/s")):
        ax.plot(xs, [w[key] for w in windows], marker=".")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    split = result["split"]["first_vs_last_window"]
    title = "Over the response, per window"
    if split is not None and split["from_acceptance_pct"] is not None:
        title += (f": tokens/s {split['change_pct']:+.1f} % first to last window,\n"
                  f"{round(split['from_acceptance_pct'])} % from acceptance, {round(split['from_step_time_pct'])} % from "
                  "step time")
    axes[0].set_title(title)
    axes[-1].set_xlabel("position in the response (tokens)")
    _save(plt, fig, path)


def phases(result: dict, path: str) -> None:
    plt = _pyplot()
    rows = result["contexts"]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows) + 2), 5))
    labels = [str(r["context"]) for r in rows]
    width = 0.38
    for offset, key, who in ((-width / 2, "ar_phases_ms", "AR"), (width / 2, "phases_ms", "tree")):
        bottom = [0.0] * len(rows)
        for i, phase in enumerate(PHASE_KEYS):
            values = [r[key].get(phase, 0.0) for r in rows]
            if not any(values):
                continue
            ax.bar([j + offset for j in range(len(rows))], values, width, bottom=bottom, color=f"C{i}",
                   edgecolor="black" if who == "AR" else None, hatch="//" if who == "AR" else None,
                   label=f"{phase[:-3]}" if who == "tree" or phase in ("verify_ms", "commit_ms") else None)
            bottom = [b + v for b, v in zip(bottom, values)]
    handles, names = ax.get_legend_handles_labels()
    unique = dict(zip(names, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=8)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_xlabel("context (tokens); left bar AR (hatched), right bar tree step")
    ax.set_ylabel("ms per step (eager, per-phase timers)")
    ax.set_title("Step-time phases")
    _save(plt, fig, path)


def step_time(result: dict, path: str) -> None:
    plt = _pyplot()
    rows, fits = result["contexts"], result["fits"]
    fig, ax = plt.subplots(figsize=(8, 5))
    xs = [r["context"] for r in rows]
    for key, fit_key, label, marker in (("ar_step_ms", "ar", "AR step", "s"), ("tree_step_ms", "tree", "tree step",
                                                                                "o")):
        line = ax.plot(xs, [r[key] for r in rows], marker=marker, linestyle="none", label=label)[0]
        fit = fits[fit_key]
        if fit is not None:
            ax.plot([min(xs), max(xs)], [fit["a_ms"] + fit["b_ms_per_1k_tokens"] * x / 1e3 for x in (min(xs), max(xs))],
                    color=line.get_color(), label=f"{label}: {fit['a_ms']:.3g} ms + {fit['b_ms_per_1k_tokens']:.3g} "
                                                  f"ms/1k tokens")
    live = [w for w in result["sustained"]["windows"] if w["step_ms"] is not None]
    ax.plot([w["context_mean"] for w in live], [w["step_ms"] for w in live], marker=".", alpha=0.6,
            label="tree step, sustained windows")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ms per step")
    ax.set_title("Step time against context (least-squares a + b * context)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    _save(plt, fig, path)


def write_plots(result: dict, directory: str) -> list[str]:
    paths = []
    for name, draw in zip(PLOTS, (throughput, acceptance_histogram, acceptance_over_response, phases, step_time)):
        path = os.path.join(directory, name)
        draw(result, path)
        paths.append(path)
    return paths


__all__ = ["PLOTS", "have_matplotlib", "write_plots"]
