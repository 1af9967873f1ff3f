"""Greedy decode steps of bench_kimi_decode's model (CUDA graph, compile_step combo) between
cudaProfilerStart / Stop, for Nsight Compute: the warm-up (compile, capture) runs outside the
profiled range.  A diagnostic, not a benchmark (ncu serialises the kernels, so no PDL overlap).

Run (GPU), e.g. the warp-stall reasons of every decode kernel of one 2p2b step (bench/RESULTS.md
run 121; --launch-skip 7 skips the prefill's moe_route launches):

    PYTHONPATH=. ncu --profile-from-start off --cache-control none --clock-control none \\
      -k 'regex:gemv_ring_kernel|mla_decode_kernel|moe_route_kernel|moe_gate_up_kernel|moe_down_kernel' \\
      --launch-skip 7 --launch-count 70 --section WarpStateStats --section LaunchStats --csv --page raw \\
      python tools/ncu_step.py 2p2b > ncu_2p2b.csv
"""
import sys

import torch

from bench.bench_generate import target
from bench.bench_kimi_decode import _prompt


def main(name: str, new_tokens: int = 3) -> None:
    model = target(name)
    ids = _prompt(model.config.vocab_size)
    kw = dict(eos_token_id=None, compile_step={"combo_kernels": True})
    model.generate(ids, max_new_tokens=8, **kw)  # compile and capture
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    model.generate(ids, max_new_tokens=new_tokens, **kw)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"ncu_step {name}: done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "2p2b")
