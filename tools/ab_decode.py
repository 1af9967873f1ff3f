"""Decode A/B (a diagnostic, not a benchmark): bench_kimi_decode's model and prompt (512 tokens),
compile_step={"combo_kernels": True}; after a warm-up generate, --reps (default 5) greedy generates
of bench_kimi_decode's 256 new tokens; prints the best and median ms / step and a hash of the
tokens, so that two settings (a switch of torch_kdtree/envs.py such as KDTREE_PDL, inductor options,
or swapped builds) can be compared one process each:

    PYTHONPATH=. python tools/ab_decode.py k2_slice --label A
    KDTREE_PDL=0 PYTHONPATH=. python tools/ab_decode.py k2_slice --label B

--opts (JSON) adds inductor options to the step's compile, e.g. --opts '{"split_reductions": false}'.
The A/B runs of bench/RESULTS.md from run 133 on used this script (as `.gpu/s26/ab.py`, then with
its parameters in AB_* environment variables).
"""
import argparse
import hashlib
import json

from bench.bench_generate import CONFIGS, target
from bench.bench_kimi_decode import NEW, _prompt
from bench.conftest import positive_int


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


def _options(raw: str) -> dict:
    try:
        opts = json.loads(raw)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {raw!r}") from None
    if not isinstance(opts, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object of inductor options, got {raw!r}")
    return opts


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tools/ab_decode.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", nargs="?", default="2p2b", choices=sorted(CONFIGS),
                   help="bench_generate's configuration (default 2p2b)")
    p.add_argument("--label", default="-", help="a word printed on the result line (A, B, ...)")
    p.add_argument("--reps", type=positive_int, default=5, help="timed generates after the warm-up (default 5)")
    p.add_argument("--opts", type=_options, default={}, metavar="JSON",
                   help="inductor options added to {\"combo_kernels\": true}")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    model = target(args.name)
    ids = _prompt(model.config.vocab_size)
    opts = {"combo_kernels": True, **args.opts}
    times, hashes = timed_generates(model, ids, args.reps, compile_step=opts)
    print(f"AB {args.name} {args.label} {times[0]:.4f} ms/step median {times[len(times) // 2]:.4f} "
          f"hashes={hashes}", flush=True)


if __name__ == "__main__":
    main()
