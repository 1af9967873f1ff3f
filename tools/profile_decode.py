"""Where a decode / verify step's GPU time goes: a kernel table per step (torch.profiler) and
graph-replay step times, of steps compiled by ``torch.compile`` or (``--no-compile``) eager ones;
or (``--timeline``) the launches of one compiled, graph-replayed step in order, with their start,
duration and the gap to the previous launch's end (negative: the launch was resident before its
predecessor ended, as programmatic-dependent-launch kernels are).

Run (GPU):  python -m tools.profile_decode [2p2b|k2_slice ...]   (kernel tables and replay times)
            python -m tools.profile_decode --timeline [2p2b|k2_slice ...]   (AR and B = 16 steps)
            python -m tools.profile_decode --budgets 0,4,8,16 [...]   (issue 44: AR and B = 4, 8, 16)
Options: --out DIR (default /tmp: where kernels.txt and timeline_*.txt are written), --no-compile
(the kernel tables and replay times of eager steps, without CUDA graphs for the tables; default:
steps compiled by inductor, replayed in graphs).  The configurations and random models are
bench/bench_generate.py's.
"""
import argparse
import json
import os
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from torch_kdtree.models.generation import GenerationSession

from bench.bench_generate import CONFIGS, PROMPT, drafter, prompt, target

STEPS = 6


def _session(name, budgets, **kw):
    s = GenerationSession(target(name), drafter(name), batch_size=1, max_prompt=PROMPT, max_new=512,
                          budgets=budgets, **kw)
    s.prefill(prompt(name), torch.tensor([PROMPT]), max_new=512, eos=[])
    return s


def _profiled_steps(s, budget: int):
    """Two warm-up steps at ``budget``, then the device activity of STEPS steps (torch.profiler)."""
    for _ in range(2):
        s.step(budget)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            s.step(budget)
        torch.cuda.synchronize()
    return prof


def kernel_table(name: str, budget: int, compiled: bool = False, out: str = "/tmp") -> None:
    """Kernels of STEPS steps: eager ops, or (compiled) inductor's code replayed in the graphs;
    printed and appended to ``out``/kernels.txt."""
    prof = _profiled_steps(_session(name, (0, budget), cuda_graphs=compiled, compile_step=compiled), budget)
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events)
    launches = sum(e.count for e in events)
    lines = [f"{name} B={budget} compiled={compiled}: {total / STEPS / 1e3:.3f} ms of kernels per step, "
             f"{launches / STEPS:.0f} kernels per step"]
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:45]:
        lines.append(f"{e.self_device_time_total / STEPS:9.1f} us/step {e.count / STEPS:6.1f}x  {e.key[:150]}")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(out, "kernels.txt"), "a") as f:
        f.write(text + "\n")


def replay_times(name: str, compile_step, budgets=(0, 16)) -> None:
    """Graph-replay ms of the steps at ``budgets`` (0: AR) of one session; each tree step also as a
    multiple of the AR step.  The line's form with the default budgets is what scripts/ab_heads.sh
    greps (``compile_step=``)."""
    budgets = tuple(sorted(set(budgets) | {0}))
    t0 = time.perf_counter()
    s = _session(name, budgets, compile_step=compile_step)
    setup = time.perf_counter() - t0
    ms = {}
    for b in budgets:
        s.step(b)
        ms[b] = s.time_steps(b, 16) * 1e3
    trees = ", ".join(f"B={b} {ms[b]:.3f} ms" for b in budgets if b)
    ratios = ", ".join(f"{ms[b] / ms[0]:.2f}" for b in budgets if b)
    print(f"{name} compile_step={compile_step}: AR {ms[0]:.3f} ms, {trees}, ratio {ratios} (setup {setup:.0f} s)",
          flush=True)


DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def step_timeline(events: list, steps: int) -> list[str]:
    """The last of ``steps`` profiled steps from a Chrome trace's ``traceEvents``: its device
    launches (kernels, copies, memsets) in start order, one line each -- start and duration in us
    from the step's first launch, the gap after the latest end so far (negative: it overlapped),
    the name -- after a header with the step's span.  Every step must have launched the same
    number of times (replays of one graph do)."""
    launches = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES and "dur" in e),
                      key=lambda e: e["ts"])
    if steps < 1 or not launches or len(launches) % steps:
        raise ValueError(f"step_timeline: {len(launches)} device launches do not split into {steps} equal steps")
    step = launches[-len(launches) // steps:]
    t0 = step[0]["ts"]
    end = max(e["ts"] + e["dur"] for e in step)
    lines = [f"{len(step)} launches, {end - t0:.1f} us from the first start to the last end"]
    prev_end = t0
    for e in step:
        lines.append(f"{e['ts'] - t0:8.2f} {e['dur']:7.2f} gap {e['ts'] - prev_end:6.2f}  {e['name'][:120]}")
        prev_end = max(prev_end, e["ts"] + e["dur"])
    return lines


def timeline(name: str, budget: int, out: str = "/tmp") -> None:
    """The launches of one compiled (combo), graph-replayed step at ``budget`` (step_timeline), to
    ``out``/timeline_<name>_B<budget>.txt.  The profiler lengthens the step by a few percent."""
    prof = _profiled_steps(_session(name, (budget,), cuda_graphs=True, compile_step="combo"), budget)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    lines = step_timeline(events, STEPS)
    lines[0] = f"{name} B={budget}: {lines[0]}"
    print(lines[0], flush=True)
    with open(os.path.join(out, f"timeline_{name}_B{budget}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


def _budgets(text: str) -> tuple:
    try:
        budgets = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, got {text!r}") from None
    if not budgets or min(budgets) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, got {text!r}")
    return budgets


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.profile_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"bench_generate's configurations ({', '.join(CONFIGS)}; default: all)")
    p.add_argument("--timeline", action="store_true",
                   help="one compiled, graph-replayed step's launches in order (AR and B = 16) instead of the tables")
    p.add_argument("--out", default="/tmp", metavar="DIR",
                   help="where kernels.txt and timeline_*.txt are written (default /tmp; created if missing)")
    p.add_argument("--budgets", type=_budgets, default=(0, 16), metavar="B,B,...",
                   help="tree budgets to profile, 0 = the AR step (default 0,16; issue 44 asks for 0,4,8,16)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="kernel tables and replay times of steps compiled by inductor and replayed in CUDA graphs "
                        "(default); --no-compile: eager steps")
    args = p.parse_args(argv)
    unknown = [n for n in args.names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown configuration {', '.join(unknown)} (choose from {', '.join(CONFIGS)})")
    args.names = args.names or list(CONFIGS)
    return args


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.timeline:
        for name in args.names:
            for b in args.budgets:
                timeline(name, b, args.out)
        return
    for name in args.names:
        for b in args.budgets:
            kernel_table(name, b, args.compile, args.out)
        replay_times(name, args.compile, args.budgets)


if __name__ == "__main__":
    main()
