"""Probe (a diagnostic, not a benchmark): pin the first part of the lm_head weight in L2 with a
persisting access-policy window (driver API through ctypes: cuCtxSetLimit(PERSISTING_L2_CACHE_SIZE),
cuStreamSetAttribute(ACCESS_POLICY_WINDOW)) and time the lm_head GEMV alone (eager, and as a CUDA graph
captured on the window's stream) and bench_kimi_decode's k2_slice decode with the window on the
CUDA-graph capture stream, against no window, in one process:

    PYTHONPATH=. python bench/l2_persist_probe.py

The lm_head is the decode step's one bandwidth-bound kernel and reads the same rows every step, so
rows held in L2 would skip HBM.  bench/RESULTS.md run 163 (H200, 60 MiB L2, 37.5 MiB persisting at
most): no gain at 24 MiB, 3.7 % slower at 37.5 MiB -- not used.  Worth re-running where L2 is larger
(sm_120's RTX PRO 6000: 128 MB).
"""
import ctypes

import torch

from bench.bench_generate import target
from bench.ab_decode import timed_generates
from bench.bench_kimi_decode import _prompt

cu = ctypes.CDLL("libcuda.so.1")


class Win(ctypes.Structure):
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hitRatio", ctypes.c_float),
                ("hitProp", ctypes.c_int), ("missProp", ctypes.c_int)]


class Val(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("win", Win)]


def ok(rc, what):
    assert rc == 0, f"{what}: CUresult {rc}"


def attr(a):
    v = ctypes.c_int()
    ok(cu.cuDeviceGetAttribute(ctypes.byref(v), a, torch.cuda.current_device()), "cuDeviceGetAttribute")
    return v.value


def limit(n):
    ok(cu.cuCtxSetLimit(6, ctypes.c_size_t(n)), "cuCtxSetLimit")
    v = ctypes.c_size_t()
    ok(cu.cuCtxGetLimit(ctypes.byref(v), 6), "cuCtxGetLimit")
    return v.value


def window(stream, ptr, nbytes, ratio=1.0):
    v = Val()
    v.win.base_ptr, v.win.num_bytes, v.win.hitRatio = ptr, nbytes, ratio
    v.win.hitProp, v.win.missProp = (2 if nbytes else 0), 0
    ok(cu.cuStreamSetAttribute(ctypes.c_void_p(stream.cuda_stream), 1, ctypes.byref(v)), "cuStreamSetAttribute")


def time_us(fn, stream, reps=100):
    with torch.cuda.stream(stream):
        for _ in range(5):
            fn()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps * 1e3


def decode(model, ids, tag):
    times, hashes = timed_generates(model, ids, 3, compile_step={"combo_kernels": True})
    print(f"DECODE {tag}: best {times[0]:.4f} ms/step, median {times[len(times) // 2]:.4f}, hashes {hashes}",
          flush=True)


torch.cuda.init()
model = target("k2_slice")
ids = _prompt(model.config.vocab_size)
W = model.lm_head.weight
maxp, maxw = attr(108), attr(109)
print(f"lm_head {tuple(W.shape)} {W.numel() * 2 / 1e6:.1f} MB; max persisting L2 {maxp / 2**20:.1f} MiB, "
      f"max window {maxw / 2**20:.1f} MiB, L2 {torch.cuda.get_device_properties(0).L2_cache_size / 2**20:.1f} MiB",
      flush=True)
x = torch.randn(1, W.shape[1], device="cuda", dtype=W.dtype)
fn = lambda: torch.nn.functional.linear(x, W)
plain, pinned = torch.cuda.Stream(), torch.cuda.Stream()
print(f"GEMV eager, no window: {time_us(fn, plain):.2f} us", flush=True)
decode(model, ids, "A (no window)")
for mb in (24, 1000):
    n = min(mb << 20, maxp, maxw)
    got = limit(n)
    window(pinned, W.data_ptr(), n)
    print(f"--- window {n / 2**20:.1f} MiB, persisting limit {got / 2**20:.1f} MiB", flush=True)
    print(f"GEMV eager, window: {time_us(fn, pinned):.2f} us; no window: {time_us(fn, plain):.2f} us", flush=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=pinned):
        fn()
    print(f"GEMV graph captured on the window's stream, replayed elsewhere: {time_us(g.replay, plain):.2f} us", flush=True)
    torch.cuda.graph.default_capture_stream = pinned
    decode(model, ids, f"B (window {n / 2**20:.0f} MiB on the capture stream)")
    torch.cuda.graph.default_capture_stream = plain
    ok(cu.cuCtxResetPersistingL2Cache(), "reset")
limit(0)
decode(model, ids, "A2 (no window again)")
