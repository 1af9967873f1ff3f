"""The tree step's heaviest kernels at the k2_slice B = 16 shapes, alone, between cudaProfilerStart /
Stop, for Nsight Compute: the INT4 experts' grouped GEMMs (``kdtree::int4_moe`` at T = 17 tokens,
k = 8 of E = 384 TP-8 experts, H = 7168, I = 256: ~105 experts touched, run 183 measured the up GEMM
at ~0.57 and the down GEMM at ~0.68 of the read rate) and ``kdtree::gemm_rows`` at 5 and 17 rows
of q_a (7168 -> 1536).  Each call reads fresh weights (LAYERS copies cycled, beyond the L2).  A
diagnostic, not a benchmark (ncu serialises the kernels).

Run (GPU), e.g. the memory, occupancy and stall sections of the grouped GEMMs and gemm_rows:

    PYTHONPATH=. ncu --profile-from-start off --cache-control all --clock-control base \\
      -k 'regex:moe_gemm_kernel|moe_align_kernel|gemm_rows_kernel|gemm_rows_reduce_kernel' \\
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \\
      --section WarpStateStats --section SchedulerStats --csv --page details \\
      python tools/ncu_tree_kernels.py > $OUT/ncu_tree.csv
"""
import math

import torch

from torch_kdtree.ops import gemm_rows, int4_moe, int4_moe_weights

E, H, I, K_TOP, T = 384, 7168, 256, 8, 17
GROUP = 32
LAYERS = 3  # 3 x 1.2 GB of INT4 experts: every call streams its touched experts from HBM


def _compressed(g, N, K):
    packed = torch.randint(-2**31, 2**31, (E, N, K // 8), dtype=torch.int32, device="cuda", generator=g)
    scale = ((torch.rand((E, N, K // GROUP), device="cuda", generator=g) + 0.5) / (4.6 * math.sqrt(K)))
    return packed, scale.to(torch.bfloat16)


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = [int4_moe_weights(*_compressed(g, I, H), *_compressed(g, I, H), *_compressed(g, H, I), group_size=GROUP)
              for _ in range(LAYERS)]
    x = (torch.randn(T, H, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K_TOP] for _ in range(T)]).int()
    weights = torch.softmax(torch.randn(T, K_TOP, device="cuda", generator=g), -1)
    w_qa = [(torch.randn(1536, H, device="cuda", generator=g) * 0.01).to(torch.bfloat16) for _ in range(LAYERS)]
    touched = ids.unique().numel()
    for _ in range(2):  # warm-up: workspaces, cudaFuncSetAttribute, module loads
        for w in layers:
            int4_moe(x, w, ids, weights)
        for w in w_qa:
            gemm_rows(x[:5], w), gemm_rows(x, w)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for w in layers:
        int4_moe(x, w, ids, weights)
    for w in w_qa:
        gemm_rows(x[:5], w)
        gemm_rows(x, w)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"ncu_tree_kernels: int4_moe T {T} k {K_TOP} of E {E} ({touched} experts touched, "
          f"{touched * 3 * H * I // 2 / 1e6:.0f} MB of INT4 weights), gemm_rows 5 / 17 rows of 1536 x {H}", flush=True)


if __name__ == "__main__":
    main()
