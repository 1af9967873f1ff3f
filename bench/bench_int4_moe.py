"""INT4 MoE timings (issue 4): kdtree::int4_moe_out on the K2 rank shapes, against HBM bandwidth
and two torch baselines.

Run: pytest bench/bench_int4_moe.py --benchmark-only -s       (one `op=int4_moe` line per point)
     python -m bench.bench_int4_moe                           (the same as a markdown table)

Shapes: TP-8 (E = 384, H = 7168, I = 256, k = 8) and TP-1 (I = 2048 with E = 128, so that the
bf16 baseline's weights fit twice), T in {1, 2, 4, 5, 8, ..., 256}, group 32.  Times are per call
inside a CUDA graph of 20 calls (bench/conftest.py); consecutive calls cycle over ROUTINGS random routings
and LAYERS distinct weight copies, so the touched experts are not L2-resident (60 MiB on the
H200).  bytes = the touched experts' INT4 weights + bf16 scales (3.10 MB per TP-8 expert) + x
read + out written; gbs = bytes / time; ceiling_ratio = gbs / the HBM ceiling (bench/conftest.py:
max of a read-only stream and a device copy, both measured in the same run).  Baselines in the same run: bf16 = the same MoE with bf16 weights
through grouped_mm (torch.nn.functional.grouped_mm or torch._grouped_mm; a per-expert loop
where neither runs), dequant = the touched experts' compressed-tensors weights dequantised to
bf16 with torch ops, then the same grouped matmuls (graphs of 4 calls, it is slow).  The
baselines get the routing's sort and expert list precomputed on the host (not timed).
eager_us is pytest-benchmark's eager call + synchronisation (Python and launches included).
gpu_us is the default path, chosen from shapes only and recorded as ``path``: ``decode`` (the
two-launch csrc/moe_decode.cu) for T · k <= 32 (ops.moe.int4_decode_path_fits), ``grouped`` (the
four-launch grouped GEMMs of csrc/moe.cu) above.  No switch selects the grouped path for a
decode-sized call any more, so the grouped path is timed where the default takes it: T = 5
(40 slots, its smallest call at k = 8) next to T = 4 (32 slots, the decode path's largest), and
T >= 8.  shared_fused_us (decode-sized calls) times
int4_moe with a bf16 shared expert (Is = I, two cycled weight copies) and a residual computed inside
the same two launches, as the Kimi model's INT4 decode step calls it (its extra bytes are not in
``bytes``).
"""
import math

import pytest
import torch

from torch_kdtree.ops import int4_moe, int4_moe_out, int4_moe_weights, int4_moe_workspace
from torch_kdtree.ops.moe import int4_decode_path_fits

from .conftest import cuda_time_us, hbm_ceiling, record, requires_cuda

TOKENS = [1, 2, 4, 5, 8, 16, 32, 64, 128, 256]  # 4 | 5: the decode | grouped boundary at k = 8
SHAPES = {"tp8": dict(E=384, H=7168, I=256, k=8), "tp1": dict(E=128, H=7168, I=2048, k=8)}
GROUP = 32
LAYERS = 2
ROUTINGS = 8


def random_compressed(E, N, K):
    packed = torch.randint(-2**31, 2**31, (E, N, K // 8), dtype=torch.int32, device="cuda")
    scale = ((torch.rand((E, N, K // GROUP), device="cuda") + 0.5) / (4.6 * math.sqrt(K))).to(torch.bfloat16)
    return packed, scale


class Layer:
    """One MoE layer's experts: compressed-tensors INT4, repacked INT4, and bf16."""

    def __init__(self, E, H, I):
        self.gate, self.up, self.down = random_compressed(E, I, H), random_compressed(E, I, H), random_compressed(E, H, I)
        self.int4 = int4_moe_weights(*self.gate, *self.up, *self.down, group_size=GROUP)
        self.w13 = (torch.randn((E, 2 * I, H), device="cuda") / math.sqrt(H)).to(torch.bfloat16)
        self.w2 = (torch.randn((E, H, I), device="cuda") / math.sqrt(I)).to(torch.bfloat16)


def expert_bytes(H, I) -> int:
    """INT4 weights + bf16 group scales of one expert (gate, up, down)."""
    weights = 3 * H * I
    return weights // 2 + 2 * (weights // GROUP)


class Call:
    """One routed call: its inputs, plus what the baselines precompute on the host."""

    def __init__(self, T, E, H, k, layer, gen):
        self.layer = layer
        self.x = torch.randn((T, H), device="cuda", generator=gen).to(torch.bfloat16)
        self.ids = torch.rand((T, E), device="cuda", generator=gen).argsort(dim=1)[:, :k].to(torch.int32).contiguous()
        w = torch.rand((T, k), device="cuda", generator=gen) + 0.1
        self.tw = (w / w.sum(-1, keepdim=True)).contiguous()
        self.out = torch.empty_like(self.x)
        flat = self.ids.flatten().long()
        self.order = flat.argsort(stable=True)
        self.offs = torch.bincount(flat, minlength=E).cumsum(0).to(torch.int32)
        self.uniq = torch.unique(flat)
        self.touched = int(self.uniq.numel())
        compact = torch.searchsorted(self.uniq, flat)
        self.offs_compact = torch.bincount(compact, minlength=self.touched).cumsum(0).to(torch.int32)
        sorted_ids = flat[self.order]
        self.loop = [(i, int(e), torch.nonzero(sorted_ids == e).flatten()) for i, e in enumerate(self.uniq.tolist())]


def _grouped_mm():
    if hasattr(torch.nn.functional, "grouped_mm"):
        return torch.nn.functional.grouped_mm
    return getattr(torch, "_grouped_mm", None)


def bf16_moe(call: Call, w13, w2, compact: bool, use_grouped: bool):
    """Sort by expert, grouped matmuls (w13 [n, 2I, H], w2 [n, H, I]), weighted sum over k.
    compact: the weights hold only the call's touched experts, in ``call.uniq`` order."""
    T, k = call.ids.shape
    I = w2.shape[2]
    xs = call.x[call.order // k]
    gmm = _grouped_mm() if use_grouped else None
    if gmm is not None:
        offs = call.offs_compact if compact else call.offs
        h = gmm(xs, w13.transpose(-2, -1), offs=offs)
        y = gmm(torch.nn.functional.silu(h[:, :I]) * h[:, I:], w2.transpose(-2, -1), offs=offs)
    else:
        y = torch.empty((xs.shape[0], w2.shape[1]), dtype=xs.dtype, device=xs.device)
        for i, e, rows in call.loop:
            j = i if compact else e
            h = xs[rows] @ w13[j].T
            y[rows] = (torch.nn.functional.silu(h[:, :I]) * h[:, I:]) @ w2[j].T
    y = y.float() * call.tw.flatten()[call.order, None]
    unsorted = torch.empty_like(y)
    unsorted[call.order] = y
    call.out.copy_(unsorted.view(T, k, -1).sum(1))


def dequant_bf16(packed, scale):
    """Compressed-tensors dequantisation with bf16 torch ops: [n, N, K/8] -> [n, N, K]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    q = ((packed.unsqueeze(-1) >> shifts) & 0xF).to(torch.bfloat16) - 8
    n, N, K8 = packed.shape
    return (q.view(n, N, -1, GROUP) * scale.unsqueeze(-1)).view(n, N, K8 * 8)


def dequant_moe(call: Call, use_grouped: bool):
    u, layer = call.uniq, call.layer
    gate = dequant_bf16(layer.gate[0][u], layer.gate[1][u])
    up = dequant_bf16(layer.up[0][u], layer.up[1][u])
    down = dequant_bf16(layer.down[0][u], layer.down[1][u])
    bf16_moe(call, torch.cat([gate, up], dim=1), down, True, use_grouped)


def cycling(fn, calls):
    """A no-argument callable that runs fn on the next call each time (captured 20 times)."""
    state = [0]

    def step():
        c = calls[state[0] % len(calls)]
        state[0] += 1
        fn(c)

    return step


_LAYERS: dict = {}


def layers_for(shape):
    if shape not in _LAYERS:
        _LAYERS.clear()
        torch.cuda.empty_cache()
        s = SHAPES[shape]
        _LAYERS[shape] = [Layer(s["E"], s["H"], s["I"]) for _ in range(LAYERS)]
    return _LAYERS[shape]


def measure(shape: str, T: int) -> dict:
    s = SHAPES[shape]
    E, H, I, k = s["E"], s["H"], s["I"], s["k"]
    ceiling = hbm_ceiling()
    layers = layers_for(shape)
    gen = torch.Generator(device="cuda").manual_seed(T)
    calls = [Call(T, E, H, k, layers[c % LAYERS], gen) for c in range(ROUTINGS)]
    ws = int4_moe_workspace(T, k, layers[0].int4)
    use_grouped = _grouped_mm() is not None
    if use_grouped:
        try:
            bf16_moe(calls[0], layers[0].w13, layers[0].w2, False, True)
        except Exception:  # grouped_mm present but not for this device / dtype
            use_grouped = False
    decode = int4_decode_path_fits(T, k, H, I)  # the path the op takes (csrc/moe_decode.cu: int4_decode_applies)
    us = cuda_time_us(cycling(lambda c: int4_moe_out(c.x, c.layer.int4, c.ids, c.tw, c.out, ws), calls))
    shared_us = None  # decode-sized calls: with a bf16 shared expert (Is = I) and a residual fused in
    if decode:
        gen_s = torch.Generator(device="cuda").manual_seed(T + 1)
        shared = [tuple((torch.randn(sh, generator=gen_s, device="cuda") / math.sqrt(sh[1])).to(torch.bfloat16)
                        for sh in ((I, H), (I, H), (H, I))) for _ in range(LAYERS)]
        res = torch.randn((T, H), generator=gen_s, device="cuda").to(torch.bfloat16)
        idx = {id(layer): i for i, layer in enumerate(layers)}
        shared_us = cuda_time_us(cycling(lambda c: int4_moe(c.x, c.layer.int4, c.ids, c.tw,
                                                            shared=shared[idx[id(c.layer)]], residual=res), calls))
    bf16_us = cuda_time_us(cycling(lambda c: bf16_moe(c, c.layer.w13, c.layer.w2, False, use_grouped), calls))
    torch.cuda.empty_cache()
    dequant_us = cuda_time_us(cycling(lambda c: dequant_moe(c, use_grouped), calls), calls_per_graph=4, replays=3)
    torch.cuda.empty_cache()
    touched = sum(c.touched for c in calls) / len(calls)
    nbytes = touched * expert_bytes(H, I) + 2 * T * H * 2
    gbs = nbytes / (us * 1e-6) / 1e9
    return dict(shape=shape, E=E, H=H, I=I, k=k, T=T, path="decode" if decode else "grouped",
                experts_touched=touched, mbytes=nbytes / 1e6, gpu_us=us, gbs=gbs, ceiling_ratio=gbs / ceiling.gbs,
                shared_fused_us=shared_us,
                bf16_us=bf16_us, speedup_vs_bf16=bf16_us / us, dequant_us=dequant_us,
                speedup_vs_dequant=dequant_us / us, bf16_path="grouped_mm" if use_grouped else "per-expert loop",
                **ceiling.fields()), calls, ws


POINTS = [(shape, T) for shape in SHAPES for T in TOKENS]


@requires_cuda
@pytest.mark.parametrize("shape,T", POINTS, ids=[f"{s}-T{t}" for s, t in POINTS])
def test_int4_moe(benchmark, shape, T):
    res, calls, ws = measure(shape, T)
    c = calls[0]

    def eager():
        int4_moe_out(c.x, c.layer.int4, c.ids, c.tw, c.out, ws)
        torch.cuda.synchronize()

    benchmark.pedantic(eager, rounds=30, iterations=1, warmup_rounds=3)
    record(benchmark, op="int4_moe", **res, eager_us=benchmark.stats.stats.median * 1e6)


SWEEP_TOKENS = [5, 9, 17, 33]  # tree-verify passes of one request at B = 4, 8, 16, 32 (the grouped path)


def _sweep() -> list[tuple[int, int, int]]:
    """(T, block_size, k_splits): block sizes 8 and 16, split-K 1 ... 16 and the plan's own."""
    from torch_kdtree.ops.moe import int4_moe_plan

    s = SHAPES["tp8"]
    points = []
    for T in SWEEP_TOKENS:
        plan = int4_moe_plan(T, s["k"], s["E"], s["H"], s["I"])
        for bs in (8, 16):
            points += [(T, bs, ks) for ks in sorted({1, 2, 4, 8, 16, plan.k_splits})]
    return points


SWEEP = _sweep()


@requires_cuda
@pytest.mark.parametrize("T,block_size,k_splits", SWEEP, ids=[f"T{t}-bs{b}-ks{k}" for t, b, k in SWEEP])
def test_int4_moe_plan_sweep(benchmark, T, block_size, k_splits):
    """Is int4_moe_plan's (block_size, k_splits) the fastest at tree-verify sizes?  The TP-8 shape
    (the k2_slice B = 16 step's experts stream at ~0.63 of the read rate, run 189), every block size
    and split-K pair around the plan's, the same cycled routings and weight copies as test_int4_moe;
    ``is_plan`` marks the plan's own choice.  The bits do not depend on the split (fixed-order sums)."""
    from torch_kdtree.ops.moe import int4_moe_plan, int4_moe_workspace_bytes

    s = SHAPES["tp8"]
    E, H, I, k = s["E"], s["H"], s["I"], s["k"]
    ceiling = hbm_ceiling()
    layers = layers_for("tp8")
    gen = torch.Generator(device="cuda").manual_seed(T)
    calls = [Call(T, E, H, k, layers[c % LAYERS], gen) for c in range(ROUTINGS)]
    ws = torch.empty(int4_moe_workspace_bytes(T, k, E, H, I, block_size, k_splits), dtype=torch.uint8, device="cuda")
    op = torch.ops.kdtree.int4_moe_out

    def run(c):
        w = c.layer.int4
        op(c.x, *w[:4], c.ids, c.tw, None, w.group_size, block_size, k_splits, ws, c.out)

    us = cuda_time_us(cycling(run, calls))
    plan = int4_moe_plan(T, k, E, H, I)
    touched = sum(c.touched for c in calls) / len(calls)
    nbytes = touched * expert_bytes(H, I) + 2 * T * H * 2
    benchmark.pedantic(lambda: (run(calls[0]), torch.cuda.synchronize()), rounds=3, iterations=1)
    record(benchmark, op="int4_moe_sweep", T=T, block_size=block_size, k_splits=k_splits, gpu_us=us,
           experts_touched=touched, ceiling_ratio=nbytes / (us * 1e-6) / 1e9 / ceiling.gbs,
           is_plan=(plan.block_size, plan.k_splits) == (block_size, k_splits),
           plan=f"bs{plan.block_size}-ks{plan.k_splits}", **ceiling.fields())


def main():
    props = torch.cuda.get_device_properties(0)
    ceiling = hbm_ceiling()
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}; HBM ceiling "
          f"{ceiling.gbs:.0f} GB/s = max(read {ceiling.read_gbs:.0f}, copy {ceiling.copy_gbs:.0f})\n")
    for shape, s in SHAPES.items():
        print(f"{shape}: E={s['E']} H={s['H']} I={s['I']} k={s['k']} group {GROUP}\n")
        print("| T | path | experts | MB | int4 µs | GB/s | of ceiling | bf16 µs | vs bf16 | dequant+mm µs | vs dequant |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for T in TOKENS:
            r = measure(shape, T)[0]
            print(f"| {T} | {r['path']} | {r['experts_touched']:.1f} | {r['mbytes']:.1f} | {r['gpu_us']:.1f} | {r['gbs']:.0f} | "
                  f"{100 * r['ceiling_ratio']:.0f}% | {r['bf16_us']:.1f} | {r['speedup_vs_bf16']:.2f}x | "
                  f"{r['dequant_us']:.0f} | {r['speedup_vs_dequant']:.1f}x |", flush=True)
        print(f"\nbf16 path: {r['bf16_path']}\n")


if __name__ == "__main__":
    main()
