"""What to change when a deployment does not fit, and the what-if grid (KV dtype x DCP x context)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from .memory import Deployment, fits, largest, max_concurrency
from .shapes import DrafterShape, TargetShape

GRID_CONTEXTS = (32_768, 65_536, 131_072, 200_000, 262_144)


@dataclass(frozen=True)
class Fix:
    """One change of the command line that makes the deployment fit."""

    flags: str
    why: str


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _fits(t: TargetShape, d: DrafterShape | None, dep: Deployment) -> bool:
    try:
        return fits(t, d, dep)
    except ValueError:  # a change that makes some weight unsplittable is no fix
        return False


def fixes(t: TargetShape, d: DrafterShape | None, dep: Deployment) -> list[Fix]:
    """The smallest single changes that make ``dep`` fit, cheapest first (fp8 KV, DCP, memory
    fraction, concurrency, context), then fp8 + DCP together, then more GPUs when even the
    weights do not fit.  Empty when it fits already."""
    if _fits(t, d, dep):
        return []
    out = []
    if dep.kv_dtype == "bf16" and _fits(t, d, replace(dep, kv_dtype="fp8")):
        out.append(Fix("--kv-dtype fp8", "halves the latent cache (one byte per value, an fp32 scale per token and layer)"))
    dcp = next((n for n in _divisors(dep.tp) if n > dep.dcp and _fits(t, d, replace(dep, dcp=n))), None)
    if dcp:
        out.append(Fix(f"--dcp {dcp}", f"each of {dcp} TP ranks keeps 1/{dcp} of every request's latent rows"))
    percent = largest(lambda p: not _fits(t, d, replace(dep, mem_fraction=p / 100)), round(dep.mem_fraction * 100), 100)
    if percent < 100:
        out.append(Fix(f"--mem-fraction {(percent + 1) / 100:.2f}", "more of the card for weights and KV"))
    if dep.concurrency > 1:
        n = max_concurrency(t, d, dep)
        if n >= 1:
            out.append(Fix(f"--concurrency {n}", "fewer requests at this context"))
    if dep.context > 1:
        c = largest(lambda c: _fits(t, d, replace(dep, context=c)), 1, dep.context - 1)
        if c >= 1:
            out.append(Fix(f"--context {c}", "the longest context that fits at this concurrency"))
    if not out and dep.kv_dtype == "bf16":
        dcp = next((n for n in _divisors(dep.tp) if n > dep.dcp and _fits(t, d, replace(dep, kv_dtype="fp8", dcp=n))),
                   None)
        if dcp:
            out.append(Fix(f"--kv-dtype fp8 --dcp {dcp}", "both together"))
    if not out:
        for scale in (2, 4, 8):
            more = replace(dep, num_gpus=dep.num_gpus * scale, tp=dep.tp * scale)
            if _fits(t, d, more):
                out.append(Fix(f"--num-gpus {more.num_gpus} --tp {more.tp}", "weights and KV over more GPUs"))
                break
    return out


def what_if(t: TargetShape, d: DrafterShape | None, dep: Deployment, contexts=GRID_CONTEXTS) -> dict:
    """Most concurrent requests at each context for KV dtype x DCP (the divisors of TP); None where
    the context is beyond the model's positions."""
    contexts = sorted(set(contexts) | {dep.context})
    rows = []
    for kv_dtype in ("bf16", "fp8"):
        for dcp in _divisors(dep.tp):
            cells = []
            for c in contexts:
                if t.max_positions and c > t.max_positions:
                    cells.append(None)
                else:
                    cells.append(max_concurrency(t, d, replace(dep, kv_dtype=kv_dtype, dcp=dcp, context=c)))
            rows.append({"kv_dtype": kv_dtype, "dcp": dcp, "max_concurrency": cells})
    return {"contexts": contexts, "rows": rows}


__all__ = ["Fix", "fixes", "what_if", "GRID_CONTEXTS"]
