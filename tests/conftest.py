import contextlib
import os
import time

import pytest
import torch

import torch_kdtree  # noqa: F401  (registers the ops)

HAS_CUDA = torch.cuda.is_available() and torch_kdtree.build_info()["cuda_kernels"]
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and the compiled CUDA kernels")


def requires_cuda_kernel(op: str):
    """Skip unless a CUDA device is present and ``op`` (e.g. "kdtree::int4_moe") has a CUDA kernel."""
    has = HAS_CUDA and torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")
    return pytest.mark.skipif(not has, reason=f"needs a CUDA device and the {op} CUDA kernel")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 on the CPU (the ops' tolerance measure)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def devices():
    """CPU always; CUDA when a device and the kernels are present."""
    return ["cpu"] + (["cuda"] if HAS_CUDA else [])


@pytest.fixture
def fresh_seed():
    """A fresh random seed every run (printed on failure through the test's id in the log)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    return seed


def cuda_kernels_run(fn, part: str):
    """``(fn(), names)``: names of the CUDA kernels containing ``part`` that fn launched
    (torch.profiler; synchronised before the trace closes)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    return out, {e.name for e in prof.events() if part in e.name}


def poison_cuda_allocator(nbytes: int = 64 << 20) -> None:
    """Fill a block of the caching allocator with 0x5A and free it, so outputs the kernel under
    test allocates from it show up if left unwritten."""
    junk = torch.full((nbytes,), 0x5A, dtype=torch.uint8, device="cuda")
    del junk


@contextlib.contextmanager
def one_thread():
    """torch on one CPU thread inside the block (small matrices: more threads only add contention
    on a shared 2-core machine); the previous count restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def toy_pipeline(tmp_path_factory):
    """One run of the training pipeline's toy recipe on the CPU (training.run, one thread), shared by
    the tests that need a trained pair: (directory, metrics, seconds, log lines)."""
    from training import recipe
    from training.run import run

    out = tmp_path_factory.mktemp("pair") / "toy_pair"
    lines = []
    with one_thread():
        start = time.perf_counter()
        metrics = run(recipe.TOY, out, "cpu", log=lines.append)
        seconds = time.perf_counter() - start
    return out, metrics, seconds, lines
