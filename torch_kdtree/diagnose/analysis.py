"""The arithmetic of the diagnostics, on plain numbers (no torch, no models).

Speculative decoding's throughput is a product: tokens/s = (tokens per step) / (seconds per step),
so between any two measurements

    Δlog(tokens/s) = Δlog(acceptance) − Δlog(step time)

holds exactly, and a slowdown splits into a share from acceptance and a share from step time that
sum to 100 %.  "Acceptance" here is tokens emitted per step run (the mean accept length when no
step is idle), so the identity holds for every measurement below, bursts included.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

SMALL_DLOG = 0.02  # |Δlog tokens/s| below this (~2 %): the two shares are ratios of near-zero numbers


@dataclass(frozen=True)
class Rate:
    """A throughput as its two factors: ``accept`` tokens per step, ``step_seconds`` per step."""

    accept: float
    step_seconds: float

    @classmethod
    def of(cls, tokens: float, steps: float, seconds: float) -> "Rate":
        if steps <= 0 or seconds <= 0 or tokens <= 0:
            raise ValueError(f"Rate: tokens, steps and seconds must be positive, got {tokens}, {steps}, {seconds}")
        return cls(tokens / steps, seconds / steps)

    @property
    def tokens_per_s(self) -> float:
        return self.accept / self.step_seconds


def split(before: Rate, after: Rate, *, label: str = "") -> dict:
    """How tokens/s changed from ``before`` to ``after``, and how much of it came from acceptance
    and how much from step time.

    ``from_acceptance_pct + from_step_time_pct == 100`` (up to rounding) whenever tokens/s changed;
    a share above 100 % or below 0 % means the other factor moved the opposite way.  When tokens/s
    did not change (|Δlog| < 1e-12) both shares are None."""
    d_tps = math.log(after.tokens_per_s / before.tokens_per_s)
    d_acc = math.log(after.accept / before.accept)
    d_step = math.log(after.step_seconds / before.step_seconds)
    if abs(d_tps) < 1e-12:
        from_acc = from_step = None
    else:
        from_acc, from_step = 100 * d_acc / d_tps, 100 * -d_step / d_tps
    out = {
        "label": label,
        "before": {"tokens_per_s": before.tokens_per_s, "accept": before.accept, "step_ms": before.step_seconds * 1e3},
        "after": {"tokens_per_s": after.tokens_per_s, "accept": after.accept, "step_ms": after.step_seconds * 1e3},
        "change_pct": 100 * math.expm1(d_tps),
        "dlog_tokens_per_s": d_tps, "dlog_accept": d_acc, "dlog_step_time": d_step,
        "from_acceptance_pct": from_acc, "from_step_time_pct": from_step,
    }
    out["text"] = split_text(out)
    return out


def split_text(s: dict) -> str:
    """One line: 'tokens/s −23.1 % (412.0 → 316.7): 62 % from acceptance, 38 % from step time'."""
    b, a = s["before"], s["after"]
    head = (f"{s['label']}: " if s.get("label") else "") + \
        f"tokens/s {s['change_pct']:+.1f} % ({b['tokens_per_s']:.4g} -> {a['tokens_per_s']:.4g})"
    detail = (f"acceptance {b['accept']:.3f} -> {a['accept']:.3f} tokens/step, "
              f"step {b['step_ms']:.4g} -> {a['step_ms']:.4g} ms")
    if s["from_acceptance_pct"] is None:
        return f"{head}: unchanged ({detail})"
    shaky = "; a change this small makes the shares unstable" if abs(s["dlog_tokens_per_s"]) < SMALL_DLOG else ""
    return (f"{head}: {round(s['from_acceptance_pct'])} % from acceptance, {round(s['from_step_time_pct'])} % from "
            f"step time ({detail}{shaky})")


def fit_line(xs: list[float], ys: list[float]) -> dict | None:
    """Least squares ``y = a + b·x``: {"a", "b", "r2", "n"}; None with fewer than two distinct x."""
    n = len(xs)
    if n != len(ys):
        raise ValueError(f"fit_line: {n} x values and {len(ys)} y values")
    if n < 2 or len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    b = sxy / sxx
    a = my - b * mx
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return {"a": a, "b": b, "r2": 1 - ss_res / ss_tot if ss_tot > 0 else 1.0, "n": n}


def step_fit(contexts: list[float], step_ms: list[float]) -> dict | None:
    """:func:`fit_line` of step time (ms) against context (tokens), named for the JSON:
    ``a_ms`` (the step at no context), ``b_ms_per_1k_tokens``, ``r2``, ``n``."""
    fit = fit_line(contexts, step_ms)
    if fit is None:
        return None
    return {"a_ms": fit["a"], "b_ms_per_1k_tokens": fit["b"] * 1e3, "r2": fit["r2"], "n": fit["n"]}


def histogram(lengths: list[int], longest: int) -> list[int]:
    """Counts of accept lengths 1..``longest`` (index 0 holds length 1)."""
    counts = [0] * longest
    for a in lengths:
        if not 1 <= a <= longest:
            raise ValueError(f"histogram: accept length {a} outside 1..{longest}")
        counts[a - 1] += 1
    return counts


def by_depth(lengths: list[int], depths: int) -> list[dict]:
    """Per draft depth d = 1..``depths``: ``reached``, the share of steps that accepted it (accept
    length >= d + 1), and ``conditional``, that share among the steps that accepted depth d − 1
    (None when none did)."""
    n = len(lengths)
    out, previous = [], n
    for d in range(1, depths + 1):
        reached = sum(1 for a in lengths if a >= d + 1)
        out.append({"depth": d, "reached": reached / n if n else None,
                    "conditional": reached / previous if previous else None})
        previous = reached
    return out


def by_position(positions: list[int], lengths: list[int], bins: int) -> list[dict]:
    """Mean accept length of the steps whose first emitted token falls in each of ``bins`` equal
    ranges of response positions."""
    if not positions:
        return []
    top = max(positions) + 1
    width = max(1, -(-top // bins))
    rows = []
    for start in range(0, top, width):
        picked = [a for p, a in zip(positions, lengths) if start <= p < start + width]
        if picked:
            rows.append({"position_start": start, "position_end": start + width, "steps": len(picked),
                         "accept": sum(picked) / len(picked)})
    return rows


def interpolate(x: float, xs: list[float], ys: list[float]) -> float | None:
    """Linear interpolation of (xs, ys) (xs increasing) at x; None outside [xs[0], xs[-1]]."""
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


def log_spaced(low: int, high: int, points: int) -> list[int]:
    """``points`` integers from ``low`` to ``high`` spaced evenly in log (duplicates dropped)."""
    if points == 1 or low == high:
        return sorted({low, high})
    step = math.log(high / low) / (points - 1)
    return sorted({int(round(low * math.exp(i * step))) for i in range(points)})


__all__ = ["Rate", "split", "split_text", "fit_line", "step_fit", "histogram", "by_depth", "by_position",
           "interpolate", "log_spaced"]
