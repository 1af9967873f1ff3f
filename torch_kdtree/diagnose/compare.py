"""``--compare A.json B.json``: what changed from run A to run B, with the sustained change split
between acceptance and step time as within a run."""
from __future__ import annotations

import json

from .analysis import Rate, split, split_text
from .report import SCHEMA


META_KEYS = ("pair", "device", "dtype", "torch", "tree_budget", "block_size", "cuda_graphs", "compile", "prompt")


def load(path: str) -> dict:
    """A result written by ``diagnose``; ValueError naming the file when it is not one."""
    try:
        with open(path) as f:
            result = json.load(f)
    except OSError as e:
        raise ValueError(f"--compare: cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--compare: {path} is not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(result, dict) or result.get("schema") != SCHEMA:
        raise ValueError(f"--compare: {path} is not a diagnose result (schema {SCHEMA!r})")
    return result


def _change(a, b) -> dict:
    pct = 100 * (b / a - 1) if a and b is not None else None
    return {"a": a, "b": b, "change_pct": pct}


def _rate(s: dict) -> Rate | None:
    if not s.get("accept") or not s.get("step_ms"):
        return None
    return Rate(s["accept"], s["step_ms"] / 1e3)


def compare(a: dict, b: dict, names: tuple[str, str] = ("A", "B")) -> dict:
    sa, sb = a["sustained"], b["sustained"]
    ra, rb = _rate(sa), _rate(sb)
    out = {
        "a": {"file": names[0], "pair": a["meta"]["pair"], "device": a["meta"]["device"]},
        "b": {"file": names[1], "pair": b["meta"]["pair"], "device": b["meta"]["device"]},
        "meta_differ": {k: [a["meta"].get(k), b["meta"].get(k)] for k in META_KEYS
                        if a["meta"].get(k) != b["meta"].get(k)},
        "settings_differ": sorted(k for k in set(a["meta"]["settings"]) | set(b["meta"]["settings"])
                                  if a["meta"]["settings"].get(k) != b["meta"]["settings"].get(k)),
        "sustained": {k: _change(sa.get(k), sb.get(k)) for k in ("tokens_per_s", "accept", "step_ms")},
        "sustained_split": split(ra, rb, label="sustained, A -> B") if ra and rb else None,
        "burst_vs_sustained": {n: (r["split"]["burst_vs_sustained"] or {}).get("change_pct")
                               for n, r in zip("ab", (a, b))},
        "contexts": [],
        "fits": {k: {"a": a["fits"].get(k), "b": b["fits"].get(k)} for k in ("ar", "tree", "tree_sustained")},
    }
    by_context = {r["context"]: r for r in b["contexts"]}
    for r in a["contexts"]:
        other = by_context.get(r["context"])
        if other is not None:
            out["contexts"].append({"context": r["context"], **{
                k: _change(r.get(k), other.get(k)) for k in ("burst_tokens_per_s", "sustained_tokens_per_s",
                                                             "tree_step_ms", "ar_step_ms", "tree_accept")}})
    return out


def _f(v, fmt=".4g") -> str:
    return "-" if v is None else format(v, fmt)


def _pct(v) -> str:
    return "-" if v is None else f"{v:+.1f} %"


def text(c: dict) -> str:
    lines = [f"A: {c['a']['file']}: {c['a']['pair']} on {c['a']['device']}",
             f"B: {c['b']['file']}: {c['b']['pair']} on {c['b']['device']}"]
    for key, (x, y) in c["meta_differ"].items():
        if key not in ("pair", "device"):
            lines.append(f"{key}: A {x}, B {y}")
    if c["settings_differ"]:
        lines.append(f"settings that differ: {', '.join(c['settings_differ'])}")
    lines += ["", f"{'sustained':24s}{'A':>12s}{'B':>12s}{'change':>10s}"]
    for key, label in (("tokens_per_s", "tokens/s"), ("accept", "tokens/step"), ("step_ms", "ms/step")):
        v = c["sustained"][key]
        lines.append(f"  {label:22s}{_f(v['a']):>12s}{_f(v['b']):>12s}{_pct(v['change_pct']):>10s}")
    if c["sustained_split"] is not None:
        lines.append(f"  {split_text(c['sustained_split'])}")
    g = c["burst_vs_sustained"]
    lines.append(f"  burst -> sustained within each run: A {_pct(g['a'])}, B {_pct(g['b'])}")
    lines += ["", f"{'context':>9s}{'burst A':>11s}{'burst B':>11s}{'change':>10s}{'tree ms A':>11s}"
                  f"{'tree ms B':>11s}{'AR ms A':>10s}{'AR ms B':>10s}"]
    for r in c["contexts"]:
        bt, tr, ar = r["burst_tokens_per_s"], r["tree_step_ms"], r["ar_step_ms"]
        lines.append(f"{r['context']:>9d}{_f(bt['a']):>11s}{_f(bt['b']):>11s}{_pct(bt['change_pct']):>10s}"
                     f"{_f(tr['a']):>11s}{_f(tr['b']):>11s}{_f(ar['a']):>10s}{_f(ar['b']):>10s}")
    lines.append("")
    for key, fits in c["fits"].items():
        parts = [f"{n} {_f(f['a_ms'])} ms + {_f(f['b_ms_per_1k_tokens'])} ms/1k" if f else f"{n} -"
                 for n, f in zip("AB", (fits["a"], fits["b"]))]
        lines.append(f"fit {key:15s} " + "   ".join(parts))
    return "\n".join(lines)


__all__ = ["load", "compare", "text"]
