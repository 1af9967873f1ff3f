"""INT4 MoE benchmark: K2 rank shapes against HBM bandwidth and two torch baselines.

    python bench/bench_int4_moe.py                  # markdown table for bench/RESULTS.md
    pytest bench/bench_int4_moe.py --benchmark-only # pytest-benchmark (numbers in extra_info)

Shapes: TP-8 (E = 384, H = 7168, I = 256, k = 8) and TP-1 (I = 2048 with E = 128, so that the
bf16 baseline fits twice in memory).  Every method runs inside one CUDA graph that calls it
CALLS times with different random routings, cycling over LAYERS distinct weight copies, so the
touched experts are not L2-resident (the H200's L2 is 60 MiB) and launch gaps are graph gaps.
time = graph replay / CALLS (CUDA events).  Bytes per call = the touched experts' INT4 weights
and scales + x read + out written; effective bandwidth = bytes / time, reported against a
device-to-device copy measured in the same run ((read + write) bytes / time).
Baselines (same routings, same graph method): bf16 MoE through grouped_mm (torch.nn.functional
.grouped_mm or torch._grouped_mm; else a per-expert loop over the experts known at setup) and
dequantise-then-matmul (the touched experts' compressed-tensors weights dequantised to bf16 with
torch ops, then the same grouped matmuls).
"""
from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch_kdtree.ops import int4_moe_out, int4_moe_weights, int4_moe_workspace  # noqa: E402

TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
SHAPES = {"tp8": dict(E=384, H=7168, I=256, k=8), "tp1": dict(E=128, H=7168, I=2048, k=8)}
GROUP = 32
LAYERS = 2
CALLS = 4
REPS = 10
DEVICE = "cuda"  # the setup helpers also run on the CPU (for a smoke test of the baselines)


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------

def capture(fn) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm up (allocator, lazy init) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_graph(graph: torch.cuda.CUDAGraph, reps: int = REPS) -> float:
    """Median milliseconds per replay."""
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy, bytes/s counting read + write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    graph = capture(lambda: dst.copy_(src))
    ms = time_graph(graph, 20)
    del src, dst
    return 2 * nbytes / (ms * 1e-3)


# --------------------------------------------------------------------------------------------
# setup
# --------------------------------------------------------------------------------------------

def random_compressed(E, N, K):
    packed = torch.randint(-2**31, 2**31, (E, N, K // 8), dtype=torch.int32, device=DEVICE)
    scale = ((torch.rand((E, N, K // GROUP), device=DEVICE) + 0.5) / (4.6 * math.sqrt(K))).to(torch.bfloat16)
    return packed, scale


class Layer:
    def __init__(self, E, H, I):
        self.gate, self.up, self.down = random_compressed(E, I, H), random_compressed(E, I, H), random_compressed(E, H, I)
        self.int4 = int4_moe_weights(*self.gate, *self.up, *self.down, group_size=GROUP)
        self.w13 = (torch.randn((E, 2 * I, H), device=DEVICE) / math.sqrt(H)).to(torch.bfloat16)
        self.w2 = (torch.randn((E, H, I), device=DEVICE) / math.sqrt(I)).to(torch.bfloat16)


def expert_bytes(H, I) -> int:
    """INT4 weights + bf16 group scales of one expert (gate, up, down)."""
    weights = 3 * H * I
    return weights // 2 + 2 * (weights // GROUP)


class Call:
    """One routed call: routing tensors plus what the baselines precompute on the host."""

    def __init__(self, T, E, H, k, layer):
        self.layer = layer
        self.x = torch.randn((T, H), device=DEVICE).to(torch.bfloat16)
        self.ids = torch.rand((T, E), device=DEVICE).argsort(dim=1)[:, :k].to(torch.int32).contiguous()
        w = torch.rand((T, k), device=DEVICE) + 0.1
        self.tw = (w / w.sum(-1, keepdim=True)).contiguous()
        self.out = torch.empty_like(self.x)
        flat = self.ids.flatten().long()
        self.order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=E)
        self.offs = counts.cumsum(0).to(torch.int32)
        self.uniq = torch.unique(flat)
        self.touched = int(self.uniq.numel())
        # compact expert index (position in uniq) per sorted entry, for dequantise-then-matmul
        compact = torch.searchsorted(self.uniq, flat)
        self.offs_compact = torch.bincount(compact, minlength=self.touched).cumsum(0).to(torch.int32)
        self.loop = [(int(e), torch.nonzero(flat[self.order] == e).flatten()) for e in self.uniq.tolist()]


def _grouped_mm():
    if hasattr(torch.nn.functional, "grouped_mm"):
        return torch.nn.functional.grouped_mm
    return getattr(torch, "_grouped_mm", None)


def bf16_moe(call: Call, w13, w2, out, use_grouped=True):
    """Sort by expert, grouped matmuls (w13 [E, 2I, H], w2 [E, H, I]), weighted sum over k."""
    T, k = call.ids.shape
    I = w2.shape[2]
    xs = call.x[call.order // k]
    gmm = _grouped_mm() if use_grouped else None
    if gmm is not None:
        offs = call.offs if w13.shape[0] == call.offs.shape[0] else call.offs_compact
        h = gmm(xs, w13.transpose(-2, -1), offs=offs)
        a = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
        y = gmm(a, w2.transpose(-2, -1), offs=offs)
    else:
        y = torch.empty((xs.shape[0], w2.shape[1]), dtype=xs.dtype, device=xs.device)
        for i, (e, rows) in enumerate(call.loop):
            e = e if w13.shape[0] != call.touched else i
            h = xs[rows] @ w13[e].T
            y[rows] = (torch.nn.functional.silu(h[:, :I]) * h[:, I:]) @ w2[e].T
    y = y.float() * call.tw.flatten()[call.order, None]
    unsorted = torch.empty_like(y)
    unsorted[call.order] = y
    out.copy_(unsorted.view(T, k, -1).sum(1))


def dequant_bf16(packed, scale):
    """Compressed-tensors dequantisation in bf16 torch ops: [n, N, K/8] -> [n, N, K]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nib = ((packed.unsqueeze(-1) >> shifts) & 0xF).to(torch.bfloat16) - 8
    n, N, K8 = packed.shape
    return (nib.view(n, N, -1, GROUP) * scale.unsqueeze(-1)).view(n, N, K8 * 8)


def dequant_moe(call: Call, layer: Layer, out, use_grouped=True):
    u = call.uniq
    gate = dequant_bf16(layer.gate[0][u], layer.gate[1][u])
    up = dequant_bf16(layer.up[0][u], layer.up[1][u])
    down = dequant_bf16(layer.down[0][u], layer.down[1][u])
    bf16_moe(call, torch.cat([gate, up], dim=1), down, out, use_grouped)


# --------------------------------------------------------------------------------------------
# one measurement
# --------------------------------------------------------------------------------------------

_STATE: dict = {}


def _layers(name):
    if _STATE.get("name") != name:
        _STATE.clear()
        torch.cuda.empty_cache()
        s = SHAPES[name]
        _STATE.update(name=name, layers=[Layer(s["E"], s["H"], s["I"]) for _ in range(LAYERS)])
    return _STATE["layers"]


def _copy_bw():
    if "copy_bw" not in _STATE:
        _STATE["copy_bw"] = copy_bandwidth()
    return _STATE["copy_bw"]


def measure(name: str, T: int) -> dict:
    s = SHAPES[name]
    E, H, I, k = s["E"], s["H"], s["I"], s["k"]
    layers = _layers(name)
    copy_bw = _STATE.get("copy_bw") or copy_bandwidth()
    _STATE["copy_bw"] = copy_bw
    calls = [Call(T, E, H, k, layers[c % LAYERS]) for c in range(CALLS)]
    ws = int4_moe_workspace(T, k, layers[0].int4)

    def run_int4():
        for c in calls:
            int4_moe_out(c.x, c.layer.int4, c.ids, c.tw, c.out, ws)

    use_grouped = _grouped_mm() is not None
    try:
        bf16_moe(calls[0], layers[0].w13, layers[0].w2, calls[0].out, True)
    except Exception:  # grouped_mm absent or unsupported here: per-expert loop
        use_grouped = False

    def run_bf16():
        for c in calls:
            bf16_moe(c, c.layer.w13, c.layer.w2, c.out, use_grouped)

    def run_dequant():
        for c in calls:
            dequant_moe(c, c.layer, c.out, use_grouped)

    res = {"shape": name, "T": T, "E": E, "I": I}
    res["int4_us"] = time_graph(capture(run_int4)) * 1e3 / CALLS
    torch.cuda.empty_cache()
    res["bf16_us"] = time_graph(capture(run_bf16)) * 1e3 / CALLS
    torch.cuda.empty_cache()
    res["dequant_us"] = time_graph(capture(run_dequant)) * 1e3 / CALLS
    torch.cuda.empty_cache()
    touched = sum(c.touched for c in calls) / CALLS
    nbytes = touched * expert_bytes(H, I) + 2 * T * H * 2
    res["touched"] = touched
    res["MB"] = nbytes / 1e6
    res["int4_GBps"] = nbytes / (res["int4_us"] * 1e-6) / 1e9
    res["copy_GBps"] = copy_bw / 1e9
    res["hbm_ratio"] = res["int4_GBps"] * 1e9 / copy_bw
    res["vs_bf16"] = res["bf16_us"] / res["int4_us"]
    res["vs_dequant"] = res["dequant_us"] / res["int4_us"]
    res["bf16_path"] = "grouped_mm" if use_grouped else "per-expert loop"
    return res


# --------------------------------------------------------------------------------------------
# pytest-benchmark entry and the table
# --------------------------------------------------------------------------------------------

try:
    import pytest

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    @pytest.mark.parametrize("name", list(SHAPES))
    @pytest.mark.parametrize("T", TOKENS)
    def test_int4_moe_bandwidth(benchmark, name, T):
        res = measure(name, T)
        benchmark.extra_info.update(res)
        layers = _layers(name)
        s = SHAPES[name]
        call = Call(T, s["E"], s["H"], s["k"], layers[0])
        ws = int4_moe_workspace(T, s["k"], layers[0].int4)
        graph = capture(lambda: int4_moe_out(call.x, layers[0].int4, call.ids, call.tw, call.out, ws))
        benchmark.pedantic(lambda: (graph.replay(), torch.cuda.synchronize()), rounds=20, warmup_rounds=2)
except ImportError:  # plain `python bench/bench_int4_moe.py` without pytest
    pass


def main():
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}; "
          f"LAYERS={LAYERS} CALLS={CALLS}")
    print(f"device copy bandwidth (read + write): {_copy_bw() / 1e9:.0f} GB/s\n")
    for name in SHAPES:
        s = SHAPES[name]
        print(f"### {name}: E={s['E']} H={s['H']} I={s['I']} k={s['k']} (group {GROUP})\n")
        print("| T | experts touched | MB | int4 µs | int4 GB/s | of copy BW | bf16 µs | int4 speed-up vs bf16 "
              "| dequant+mm µs | speed-up vs dequant |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for T in TOKENS:
            r = measure(name, T)
            print(f"| {T} | {r['touched']:.1f} | {r['MB']:.1f} | {r['int4_us']:.1f} | {r['int4_GBps']:.0f} | "
                  f"{100 * r['hbm_ratio']:.0f}% | {r['bf16_us']:.1f} | {r['vs_bf16']:.2f}x | "
                  f"{r['dequant_us']:.1f} | {r['vs_dequant']:.2f}x |", flush=True)
        print(f"\nbf16 path: {r['bf16_path']}\n")


if __name__ == "__main__":
    main()
