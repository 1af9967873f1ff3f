"""Where a decode / verify step's GPU time goes: a kernel table per step (torch.profiler) and
graph-replay step times with and without ``torch.compile`` of the step.

Run (GPU):  python -m bench.profile_decode [2p2b|k2_slice ...]   (writes tables to $OUT or /tmp)
The configurations and random models are bench/bench_generate.py's.
"""
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from torch_kdtree.models.generation import GenerationSession

from .bench_generate import PROMPT, drafter, prompt, target

OUT = os.environ.get("OUT", "/tmp")
STEPS = 6


def _session(name, budgets, **kw):
    s = GenerationSession(target(name), drafter(name), batch_size=1, max_prompt=PROMPT, max_new=512,
                          budgets=budgets, **kw)
    s.prefill(prompt(name), torch.tensor([PROMPT]), max_new=512, eos=[])
    return s


def kernel_table(name: str, budget: int, compiled: bool = False) -> None:
    """Kernels of STEPS steps: eager ops, or (compiled) inductor's code replayed in the graphs."""
    s = _session(name, (0, budget), cuda_graphs=compiled, compile_step=compiled)
    for _ in range(2):
        s.step(budget)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            s.step(budget)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events)
    launches = sum(e.count for e in events)
    lines = [f"{name} B={budget} compiled={compiled}: {total / STEPS / 1e3:.3f} ms of kernels per step, "
             f"{launches / STEPS:.0f} kernels per step"]
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:45]:
        lines.append(f"{e.self_device_time_total / STEPS:9.1f} us/step {e.count / STEPS:6.1f}x  {e.key[:150]}")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(OUT, "kernels.txt"), "a") as f:
        f.write(text + "\n")


def replay_times(name: str, compile_step) -> None:
    t0 = time.perf_counter()
    s = _session(name, (0, 16), compile_step=compile_step)
    setup = time.perf_counter() - t0
    ms = {}
    for b in (0, 16):
        s.step(b)
        ms[b] = s.time_steps(b, 16) * 1e3
    print(f"{name} compile_step={compile_step}: AR {ms[0]:.3f} ms, B=16 {ms[16]:.3f} ms, "
          f"ratio {ms[16] / ms[0]:.2f} (setup {setup:.0f} s)", flush=True)


def main(names):
    compiled = os.environ.get("PROFILE_COMPILE", "1") == "1"
    for name in names:
        for b in (0, 16):
            kernel_table(name, b, compiled)
        replay_times(name, compiled)


if __name__ == "__main__":
    main(sys.argv[1:] or ["2p2b", "k2_slice"])
