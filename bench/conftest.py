"""Shared benchmark helpers: CUDA-graph timing and the ceilings measured in the same run."""
import functools

import pytest
import torch

import torch_kdtree  # noqa: F401

HAS_CUDA = torch.cuda.is_available() and torch_kdtree.build_info()["cuda_kernels"]
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="benchmarks need a CUDA device and the compiled kernels")


def cuda_time_us(fn, *, calls_per_graph: int = 20, replays: int = 10) -> float:
    """Median microseconds per call of `fn`, captured `calls_per_graph` times in one CUDA graph
    (so launch overhead is the GPU's, not Python's) and replayed `replays` times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls_per_graph):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls_per_graph)
    times.sort()
    return times[len(times) // 2]


@functools.lru_cache(maxsize=1)
def hbm_bandwidth_gbs() -> float:
    """Device-copy bandwidth (read + write bytes / time) of a 2 GiB copy, measured now."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = cuda_time_us(lambda: dst.copy_(src), calls_per_graph=5, replays=5)
    del src, dst
    return 2 * n / (us * 1e-6) / 1e9


@functools.lru_cache(maxsize=1)
def hbm_read_gbs() -> float:
    """Read-only bandwidth: bytes / time of a sum over 2 GiB of bf16, measured now."""
    x = torch.ones(1 << 30, dtype=torch.bfloat16, device="cuda")
    us = cuda_time_us(lambda: x.sum(dtype=torch.float32), calls_per_graph=5, replays=5)
    del x
    return 2 * (1 << 30) / (us * 1e-6) / 1e9


@functools.lru_cache(maxsize=1)
def bf16_matmul_tflops() -> float:
    """bf16 GEMM rate of an 8192^3 matmul, measured now."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    us = cuda_time_us(lambda: torch.mm(a, b, out=c), calls_per_graph=5, replays=5)
    return 2 * n**3 / (us * 1e-6) / 1e12


def record(benchmark, **info):
    """Attach numbers to pytest-benchmark's JSON and print one line for the log."""
    benchmark.extra_info.update(info)
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in info.items()))
