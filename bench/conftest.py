"""Shared benchmark helpers: CUDA-graph timing, the ceilings measured in the same run, and the
benchmarks' command-line options (pytest_addoption: --bench-tokens, --bench-compile, ...)."""
import argparse
import functools
from typing import NamedTuple

import pytest
import torch

import torch_kdtree  # noqa: F401

HAS_CUDA = torch.cuda.is_available() and torch_kdtree.build_info()["cuda_kernels"]
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="benchmarks need a CUDA device and the compiled kernels")


def _has_cuda_kernel(op: str) -> bool:
    return torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")


requires_mla = pytest.mark.skipif(not _has_cuda_kernel("kdtree::mla_tree_attention"),
                                  reason="needs the kdtree::mla_tree_attention CUDA kernel")
needs_int4 = pytest.mark.skipif(not (_has_cuda_kernel("kdtree::int4_moe") and _has_cuda_kernel("kdtree::int4_repack")),
                                reason="needs the kdtree::int4_moe / int4_repack CUDA kernels")


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


def _copy_gbs() -> float:
    """Device-copy rate (read + write bytes / time) of a 2 GiB uint8 copy."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = cuda_time_us(lambda: dst.copy_(src), calls_per_graph=5, replays=5)
    return 2 * n / (us * 1e-6) / 1e9


def _read_gbs() -> float:
    """Read-only rate: bytes / time of an fp32-accumulated sum over 2 GiB of bf16."""
    x = torch.ones(1 << 30, dtype=torch.bfloat16, device="cuda")
    us = cuda_time_us(lambda: x.sum(dtype=torch.float32), calls_per_graph=5, replays=5)
    return 2 * (1 << 30) / (us * 1e-6) / 1e9


class HbmCeiling(NamedTuple):
    """The one HBM ceiling every bandwidth ratio in bench/ divides by: the larger of a read-only
    stream and a device copy, both measured in this run (a copy alone, ~2.75 TB/s on the H200
    against a ~4.2 TB/s read, would flatter every ratio by ~1.5x)."""

    gbs: float
    read_gbs: float
    copy_gbs: float

    @property
    def source(self) -> str:
        return "read" if self.read_gbs >= self.copy_gbs else "copy"

    def fields(self) -> dict:
        """For record(): the ceiling used, which measurement it is, and both measurements."""
        return {"ceiling_gbs": self.gbs, "ceiling": f"max(read,copy)={self.source}", "read_gbs": self.read_gbs,
                "copy_gbs": self.copy_gbs}


@functools.lru_cache(maxsize=1)
def hbm_ceiling() -> HbmCeiling:
    """Measured once per process: max(read-only stream, device copy) GB/s, and both."""
    read, copy = _read_gbs(), _copy_gbs()
    return HbmCeiling(max(read, copy), read, copy)


@functools.lru_cache(maxsize=1)
def bf16_matmul_tflops() -> float:
    """bf16 GEMM rate of an 8192^3 matmul, measured now."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    us = cuda_time_us(lambda: torch.mm(a, b, out=c), calls_per_graph=5, replays=5)
    return 2 * n**3 / (us * 1e-6) / 1e12


def positive_int(raw: str) -> int:
    """An argparse / pytest option type: a positive integer, else a usage error."""
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {raw!r}")
    return n


def _non_negative_int(raw: str) -> int:
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {raw!r}")
    return n


def _budgets(raw: str) -> tuple[int, ...]:
    try:
        budgets = tuple(int(b) for b in raw.split(","))
    except ValueError:
        budgets = ()
    if not {0, 16} <= set(budgets) or min(budgets) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated budgets >= 0 including 0 (autoregressive) "
                                         f"and 16 (the target's budget), got {raw!r}")
    return budgets


def compile_step_option(raw, default):
    """``--bench-compile``'s value as GenerationSession's ``compile_step``: 0 -> False (eager ops in
    the graphs), 1 -> True (inductor), another word as it is (``combo`` / ``tuned``: inductor with
    those options; another: a torch.compile backend), unset -> ``default``."""
    if raw is None:
        return default
    return {"0": False, "1": True}.get(raw, raw)


def pytest_addoption(parser):
    """The benchmarks' run parameters (each bench_*.py file's docstring says which it reads)."""
    group = parser.getgroup("bench", "torch_kdtree benchmarks (bench/)")
    group.addoption("--bench-tokens", type=positive_int, default=2000, metavar="N",
                    help="tokens per sustained generation (bench_generate; default 2000)")
    group.addoption("--bench-hf-tokens", type=positive_int, default=128, metavar="N",
                    help="tokens of transformers' eager generate (bench_generate; default 128)")
    group.addoption("--bench-assisted-tokens", type=positive_int, default=64, metavar="N",
                    help="tokens of transformers' assisted generate (bench_generate; default 64)")
    group.addoption("--bench-compile", default=None, metavar="0|1|combo|tuned",
                    help="how the generation steps are compiled: 0 eager ops in the graphs, 1 inductor, "
                         "combo / tuned inductor with those options, another word a torch.compile backend "
                         "(default: each benchmark's own)")
    group.addoption("--bench-step-budgets", type=_budgets, default=(0, 8, 16, 32, 64, 128, 256), metavar="B,B,...",
                    help="the step-time table's tree budgets, including 0 and 16 (bench_generate; "
                         "default 0,8,16,32,64,128,256)")
    from .long_context import CACHE_DTYPES, CONTEXTS, parse_cache_dtypes, parse_configs, parse_context, parse_contexts

    group.addoption("--long-contexts", type=parse_contexts, default=CONTEXTS, metavar="C,C,...",
                    help="contexts of the long-context table, k = 1024 (bench_long_context; default "
                         "1k,4k,16k,64k,128k,200k,256k; 'all' the same)")
    group.addoption("--long-cache-dtypes", type=parse_cache_dtypes, default=CACHE_DTYPES, metavar="bf16,fp8",
                    help="latent cache dtypes of the long-context table (bench_long_context; default bf16,fp8)")
    group.addoption("--long-configs", type=parse_configs, default=("k2_slice",), metavar="NAME,...",
                    help="configurations of bench_long_context: k2_slice and / or 2p2b (default k2_slice)")
    group.addoption("--long-drift-tokens", type=_non_negative_int, default=20000, metavar="N",
                    help="tokens of sustained B = 16 generation before the drift check (bench_long_context; "
                         "default 20000, 0 skips it)")
    group.addoption("--long-drift-prompt", type=parse_context, default=16 * 1024, metavar="C",
                    help="prompt before the drift check's generation (bench_long_context; default 16k)")
    group.addoption("--long-steps", type=positive_int, default=16, metavar="N",
                    help="steps per timing of bench_long_context (default 16)")
    group.addoption("--long-prefill-chunk", type=positive_int, default=8192, metavar="N",
                    help="prefill_chunk_size of bench_long_context's prefills (default 8192)")


def pytest_collect_file(parent, file_path):
    """``pytest bench`` collects the bench_*.py files too (the project's python_files is test_*.py);
    a file named on the command line is collected by pytest itself."""
    if file_path.suffix == ".py" and file_path.name.startswith("bench_") and not parent.session.isinitpath(file_path):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def record(benchmark, **info):
    """Attach numbers to pytest-benchmark's JSON and print one line for the log."""
    benchmark.extra_info.update(info)
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in info.items()))
