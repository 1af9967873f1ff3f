"""kdtree::gemm_rows against cuBLAS (F.linear) on the linear layers of a tree verify, one run.

Run (H200, ~1 min): pytest bench/bench_gemm_rows.py --benchmark-only -s  (test_gemm_rows_weight_pairs: two
weights sharing x in one launch, against two calls and two cuBLAS calls)
Shapes: K2's TP-8 rank (k2_slice) and 2p2b projections -- q_a + kv_a as two calls (7168 -> 1536,
576), q_b (1536 -> 8 x 192), o_proj (1024 -> 7168), the dense MLP (7168 -> 2304, 2304 -> 7168), the
shared expert slice (7168 -> 256), 2p2b's q_a (2048 -> 1536) and MLP down (6144 -> 2048) -- at
M = 5 / 9 / 17 / 32 rows (B = 4 / 8 / 16 / 31 trees of one request).  Times are per call inside a
CUDA graph (bench/conftest.py), each call on another copy of the weight (copies totalling >= 512 MB,
ten L2s: inside a decode step every layer's weights come from HBM; run 181 timed one weight, which
stayed in the H100's 50 MB L2, and read "1.2-1.4x the HBM ceiling"); bytes = the weight + x + y;
ceiling = max(read, copy) measured in this run; speedup = cuBLAS time / gemm_rows time.  Each call
is also checked against the fp32 product (relative error).
"""
import pytest
import torch
import torch.nn.functional as F

from torch_kdtree.ops import gemm_rows

from .conftest import cuda_time_us, hbm_ceiling, record, requires_cuda

COLD_BYTES = 512 << 20  # weight copies cycled through per graph: ten times the H100's / H200's L2
SHAPES = {  # name: (K, N)
    "k2_q_a": (7168, 1536), "k2_kv_a": (7168, 576), "k2_q_b": (1536, 1536), "k2_o_proj": (1024, 7168),
    "k2_mlp_up": (7168, 2304), "k2_mlp_down": (2304, 7168), "k2_shared_up": (7168, 256),
    "2p2b_q_a": (2048, 1536), "2p2b_mlp_down": (6144, 2048),
}


@requires_cuda
@pytest.mark.parametrize("M", [5, 9, 17, 32])
@pytest.mark.parametrize("name", list(SHAPES))
def test_gemm_rows_against_cublas(benchmark, name, M):
    if not torch._C._dispatch_has_kernel_for_dispatch_key("kdtree::gemm_rows", "CUDA"):
        pytest.skip("needs the kdtree::gemm_rows CUDA kernel")
    K, N = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
    copies = [w] + [w.clone() for _ in range(max(1, -(-COLD_BYTES // (2 * N * K))) - 1)]
    turn = iter(range(1 << 30))
    ours = cuda_time_us(lambda: gemm_rows(x, copies[next(turn) % len(copies)]), calls_per_graph=len(copies))
    cublas = cuda_time_us(lambda: F.linear(x, copies[next(turn) % len(copies)]), calls_per_graph=len(copies))
    want = x.float() @ w.float().T
    err = ((gemm_rows(x, w).float() - want).norm() / want.norm()).item()
    ceiling = hbm_ceiling()
    nbytes = 2 * (N * K + M * K + M * N)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    record(benchmark, op="gemm_rows", shape=name, M=M, K=K, N=N, us=ours, cublas_us=cublas, speedup=cublas / ours,
           ceiling_ratio=nbytes / (ours * 1e-6) / 1e9 / ceiling.gbs,
           cublas_ceiling_ratio=nbytes / (cublas * 1e-6) / 1e9 / ceiling.gbs, rel_err=err, **ceiling.fields())


PAIRS = {  # name: (K, (N_1, N_2)): linears that read the same x
    "k2_q_a+kv_a": (7168, (1536, 576)), "k2_shared_gate+up": (7168, (256, 256)), "k2_mlp_gate+up": (7168, (2304, 2304)),
}


@requires_cuda
@pytest.mark.parametrize("M", [5, 9, 17])
@pytest.mark.parametrize("name", list(PAIRS))
def test_gemm_rows_weight_pairs(benchmark, name, M):
    """Two weights that read the same x in one gemm_rows launch (the plan's q_a + kv_a and gate + up)
    against two gemm_rows calls and two cuBLAS calls, cold weights as above."""
    if not torch._C._dispatch_has_kernel_for_dispatch_key("kdtree::gemm_rows", "CUDA"):
        pytest.skip("needs the kdtree::gemm_rows CUDA kernel")
    K, Ns = PAIRS[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    ws = [(torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16() for N in Ns]
    per = 2 * K * sum(Ns)
    copies = [ws] + [[w.clone() for w in ws] for _ in range(max(1, -(-COLD_BYTES // per)) - 1)]
    turn = iter(range(1 << 30))
    one = cuda_time_us(lambda: gemm_rows(x, copies[next(turn) % len(copies)]), calls_per_graph=len(copies))
    two = cuda_time_us(lambda: [gemm_rows(x, w) for w in copies[next(turn) % len(copies)]],
                       calls_per_graph=len(copies))
    cublas = cuda_time_us(lambda: [F.linear(x, w) for w in copies[next(turn) % len(copies)]],
                          calls_per_graph=len(copies))
    ceiling = hbm_ceiling()
    nbytes = per + 2 * (M * K + M * sum(Ns))
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    record(benchmark, op="gemm_rows_pair", shape=name, M=M, K=K, N="+".join(map(str, Ns)), us=one, two_calls_us=two,
           cublas_us=cublas, speedup_vs_two_calls=two / one, speedup_vs_cublas=cublas / one,
           ceiling_ratio=nbytes / (one * 1e-6) / 1e9 / ceiling.gbs, **ceiling.fields())
