"""Decode A/B (a diagnostic, not a benchmark): bench_kimi_decode's model and prompt (512 tokens),
compile_step={"combo_kernels": True}; after a warm-up generate, AB_REPS (default 5) greedy generates of
bench_kimi_decode's 256 new tokens; prints the best and median ms / step and a hash of the tokens, so
that two settings (environment switches, or swapped builds) can be compared one process each:

    AB_LABEL=A PYTHONPATH=. python tools/ab_decode.py k2_slice
    AB_LABEL=B KDTREE_MLA_DECODE_STAGES=2 PYTHONPATH=. python tools/ab_decode.py k2_slice

AB_OPTS (JSON) adds inductor options to the step's compile, e.g. AB_OPTS='{"split_reductions": false}'.
The A/B runs of bench/RESULTS.md from run 133 on used this script (as `.gpu/s26/ab.py`).
"""
import hashlib
import json
import os
import sys

from bench.bench_generate import target
from bench.bench_kimi_decode import NEW, _prompt


def timed_generates(model, ids, reps: int, new: int = NEW, **kw) -> tuple[list[float], list[str]]:
    """A warm-up generate, then ``reps`` greedy generates of ``new`` tokens: their ms / step, sorted,
    and the distinct 12-hex-digit hashes of their tokens, sorted."""
    kw = dict(eos_token_id=None, **kw)
    model.generate(ids, max_new_tokens=new, **kw)
    times, hashes = [], set()
    for _ in range(reps):
        out = model.generate(ids, max_new_tokens=new, return_dict_in_generate=True, **kw)
        times.append(out.step_seconds / new * 1e3)
        hashes.add(hashlib.sha1(out.sequences.cpu().numpy().tobytes()).hexdigest()[:12])
    return sorted(times), sorted(hashes)


def main(name: str) -> None:
    model = target(name)
    ids = _prompt(model.config.vocab_size)
    opts = {"combo_kernels": True, **json.loads(os.environ.get("AB_OPTS", "{}"))}
    times, hashes = timed_generates(model, ids, int(os.environ.get("AB_REPS", "5")), compile_step=opts)
    print(f"AB {name} {os.environ.get('AB_LABEL', '-')} {times[0]:.4f} ms/step median {times[len(times) // 2]:.4f} "
          f"hashes={hashes}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "2p2b")
