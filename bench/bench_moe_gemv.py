"""bf16 routed experts at decode sizes (issue 3's decode step): kdtree::moe_gemv against HBM
bandwidth and the two torch paths it replaces, in the same run.

Run: pytest bench/bench_moe_gemv.py --benchmark-only -s       (one `op=moe_gemv` line per point)

Shapes: "2p2b" (the issue's config (a): E = 64, H = 2048, I = 512, k = 8) and "k2_tp8" (K2's
hidden size with a TP-8 expert slice, bf16: E = 384, H = 7168, I = 256, k = 8); T in {1, 2, 4}.
Times are per call inside a CUDA graph of 16 calls (bench/conftest.py); consecutive calls cycle
over ROUTINGS random routings and LAYERS weight copies, so the touched experts are not
L2-resident.  bytes = the distinct touched experts' bf16 weights (3·H·I·2 each) per call; gbs =
bytes / time; ceiling_ratio = gbs / the HBM ceiling (bench/conftest.py: max of a read-only stream
and a device copy, both measured in the same run).
Baselines, same run, same cycling: "rowsum" = the per-(token, slot) multiply + sum that the
model compiled with inductor before this op (torch.compile of the same formula: reduction
kernels with indirect weight loads); "grouped" = sort by expert + three grouped_mm (the eager
bf16 path; skipped where grouped_mm is missing).
"""
import pytest
import torch
import torch.nn.functional as F

from torch_kdtree.ops import moe_gemv

from .conftest import cuda_time_us, hbm_ceiling, record, requires_cuda

SHAPES = {"2p2b": dict(E=64, H=2048, I=512, k=8), "k2_tp8": dict(E=384, H=7168, I=256, k=8)}
TOKENS = [1, 2, 4]
LAYERS = 2
ROUTINGS = 8
_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def rowsum(x, gate, up, down, ids, w):
    """The model's former compiled-decode formula (KimiK2Experts._row_gemv)."""
    i = ids.long()
    xf = x.float()[:, None, None, :]
    g = (xf * gate[i].float()).sum(-1).to(x.dtype)
    u = (xf * up[i].float()).sum(-1).to(x.dtype)
    h = (F.silu(g) * u).float()[:, :, None, :]
    y = (h * down[i].float()).sum(-1).to(x.dtype)
    return (y.float() * w[..., None]).sum(1).to(x.dtype)


def grouped(x, gate, up, down, ids, w):
    T, k = ids.shape
    flat = ids.reshape(-1).long()
    order = flat.argsort(stable=True)
    counts = torch.zeros(gate.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    rows = x[order // k]
    h = F.silu(_grouped_mm(rows, gate.transpose(1, 2), offs=offs)) * _grouped_mm(rows, up.transpose(1, 2), offs=offs)
    y = torch.empty((T * k, x.shape[1]), dtype=x.dtype, device=x.device)
    y.index_copy_(0, order, _grouped_mm(h, down.transpose(1, 2), offs=offs))
    return (y.view(T, k, -1).float() * w[..., None]).sum(1).to(x.dtype)


def _cycle(fn, calls):
    state = {"i": 0}

    def run():
        c = calls[state["i"] % len(calls)]
        state["i"] += 1
        return fn(*c)

    return run


@requires_cuda
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_moe_gemv(benchmark, shape, T):
    E, H, I, k = (SHAPES[shape][n] for n in ("E", "H", "I", "k"))
    layers = [tuple((torch.randn(s, device="cuda") / s[-1] ** 0.5).to(torch.bfloat16)
                    for s in ((E, I, H), (E, I, H), (E, H, I))) for _ in range(LAYERS)]
    calls, distinct = [], []
    for n in range(ROUTINGS):
        ids = torch.rand((T, E), device="cuda").argsort(dim=1)[:, :k].to(torch.int32)
        w = torch.rand((T, k), device="cuda")
        x = torch.randn((T, H), device="cuda").to(torch.bfloat16)
        calls.append((x, *layers[n % LAYERS], ids, w))
        distinct.append(len(torch.unique(ids)))
    nbytes = sum(distinct) / len(distinct) * 3 * H * I * 2
    # calls_per_graph = ROUTINGS * 2 so that every capture walks the same cycle
    us = cuda_time_us(_cycle(moe_gemv, calls), calls_per_graph=2 * ROUTINGS)
    torch._dynamo.reset()
    compiled = torch.compile(rowsum, fullgraph=True, dynamic=False)
    rowsum_us = cuda_time_us(_cycle(compiled, calls), calls_per_graph=2 * ROUTINGS)
    grouped_us = float("nan")
    if _grouped_mm is not None:
        try:
            grouped_us = cuda_time_us(_cycle(grouped, calls), calls_per_graph=2 * ROUTINGS)
        except RuntimeError:
            pass
    ref = rowsum(*calls[0])
    got = moe_gemv(*calls[0])
    err = float((got.float() - ref.float()).norm() / ref.float().norm())
    ceiling = hbm_ceiling()
    gbs = nbytes / (us * 1e-6) / 1e9
    benchmark.pedantic(lambda: moe_gemv(*calls[0]), rounds=5, iterations=1)
    record(benchmark, op="moe_gemv", shape=shape, T=T, k=k, us=us, MB=nbytes / 1e6, gbs=gbs,
           ceiling_ratio=gbs / ceiling.gbs, rowsum_us=rowsum_us, speedup_vs_rowsum=rowsum_us / us,
           grouped_us=grouped_us, speedup_vs_grouped=grouped_us / us, rel_err_vs_rowsum=err, **ceiling.fields())
