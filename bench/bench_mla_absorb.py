"""The absorbed-MLA steps around the attention in a decode step (issue 3): kdtree::mla_prepare and
kdtree::mla_output against HBM bandwidth and the torch ops they replace, compiled with inductor
(the model's path before the ops), same run.

Run: pytest bench/bench_mla_absorb.py --benchmark-only -s    (`op=mla_prepare` / `op=mla_output` lines)

Shapes: "2p2b" (the issue's config (a): 16 heads) and "k2_tp8" (a K2 TP-8 rank: 8 heads), K2's
head dims (dn 128, dv 128, dc 512, dr 64); M in {1, 4} tokens.  Times are per call inside a CUDA
graph (bench/conftest.py); calls cycle over LAYERS weight copies (and cache layers), so W_UK / W_UV
are not L2-resident.  bytes = the weight slice (h · dn · dc · 2 or h · dv · dc · 2) plus the
activations read and written; gbs = bytes / time; ceiling_ratio = gbs / the HBM ceiling
(bench/conftest.py: max of a read-only stream and a device copy, both measured in the same run; at
1-2 MB a call, launch latency and one DRAM round trip dominate: the ceiling is not reachable at
these sizes).
"""
import pytest
import torch

from torch_kdtree.models.kimi_k2.modeling import apply_rope
from torch_kdtree.ops import mla_output, mla_output_reference, mla_prepare, mla_prepare_reference

from .conftest import cuda_time_us, hbm_ceiling, record, requires_cuda

SHAPES = {"2p2b": 16, "k2_tp8": 8}
TOKENS = [1, 4]
LAYERS = 4
DN, DV, DC, DR = 128, 128, 512, 64


def torch_path(q, ckv, cos, sin, nw, w, kv, layer, slots):
    """The model's former compiled decode formula (KimiK2Attention._rotate, cache.write, the
    gemv-form absorption)."""
    M, heads, _ = q.shape
    q_nope, q_pe = q.split([DN, DR], dim=-1)
    q_rope = apply_rope(q_pe, cos[:, None], sin[:, None], True)
    c, k_pe = ckv.split([DC, DR], dim=-1)
    h = c.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    latent = torch.cat([nw * h.to(c.dtype), apply_rope(k_pe, cos, sin, True)], dim=-1)
    pages = kv.shape[2]
    kv.index_put_((torch.full_like(slots, layer), slots // pages, slots % pages), latent)
    w_uk = w.view(heads, DN + DV, DC)[:, :DN]
    q_abs = (q_nope.float()[..., :, None] * w_uk.float()).sum(-2).to(q.dtype)
    return torch.cat([q_abs, q_rope], dim=-1)


@requires_cuda
@pytest.mark.parametrize("M", TOKENS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_mla_prepare(benchmark, shape, M):
    heads = SHAPES[shape]
    dev = "cuda"
    ws = [(torch.randn(heads * (DN + DV), DC, device=dev) / DN ** 0.5).to(torch.bfloat16) for _ in range(LAYERS)]
    nw = (torch.rand(DC, device=dev) + 0.5).to(torch.bfloat16)
    kv = torch.zeros(LAYERS, 64, 64, DC + DR, device=dev, dtype=torch.bfloat16)
    torch._dynamo.mark_static_address(kv)
    q = torch.randn(M, heads, DN + DR, device=dev).to(torch.bfloat16)
    ckv = torch.randn(M, DC + DR, device=dev).to(torch.bfloat16)
    ang = torch.rand(M, DR // 2, device=dev) * 100
    cos, sin = ang.cos(), ang.sin()
    slots = torch.randperm(64 * 64, device=dev)[:M]
    state = {"i": 0}

    def cycled(fn):
        def run():
            layer = state["i"] % LAYERS
            state["i"] += 1
            return fn(q, ckv, cos, sin, nw, ws[layer], kv, layer, slots)
        return run

    op = lambda q, ckv, cos, sin, nw, w, kv, layer, slots: mla_prepare(  # noqa: E731
        q, ckv, cos, sin, nw, 1e-6, w, kv, layer, slots)
    us = cuda_time_us(cycled(op), calls_per_graph=4 * LAYERS)
    torch._dynamo.reset()
    compiled = torch.compile(torch_path, fullgraph=True, dynamic=False)
    run = cycled(compiled)
    for _ in range(LAYERS):  # one specialisation per layer index, compiled before the capture
        run()
    torch_us = cuda_time_us(run, calls_per_graph=4 * LAYERS)
    want = mla_prepare_reference(q.cpu(), ckv.cpu(), cos.cpu(), sin.cpu(), nw.cpu(), 1e-6, ws[0].cpu(),
                                 kv.cpu(), 0, slots.cpu(), True)
    got = op(q, ckv, cos, sin, nw, ws[0], kv, 0, slots).cpu()
    err = float((got.float() - want.float()).norm() / want.float().norm())
    nbytes = heads * DN * DC * 2 + q.numel() * 2 + ckv.numel() * 2 + M * heads * (DC + DR) * 2 + M * (DC + DR) * 2
    ceiling = hbm_ceiling()
    gbs = nbytes / (us * 1e-6) / 1e9
    benchmark.pedantic(lambda: op(q, ckv, cos, sin, nw, ws[0], kv, 0, slots), rounds=5, iterations=1)
    record(benchmark, op="mla_prepare", shape=shape, M=M, heads=heads, us=us, MB=nbytes / 1e6, gbs=gbs,
           ceiling_ratio=gbs / ceiling.gbs, torch_compiled_us=torch_us,
           speedup_vs_torch_compiled=torch_us / us, rel_err_vs_reference=err, **ceiling.fields())


def torch_output(o_lat, w, heads):
    """The model's former compiled decode formula for o_lat W_UV^T (the gemv form)."""
    w_uv = w.view(heads, DN + DV, DC)[:, DN:]
    return (o_lat.float()[..., None, :] * w_uv.float()).sum(-1).to(o_lat.dtype)


@requires_cuda
@pytest.mark.parametrize("M", TOKENS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_mla_output(benchmark, shape, M):
    heads = SHAPES[shape]
    ws = [(torch.randn(heads * (DN + DV), DC, device="cuda") / DC ** 0.5).to(torch.bfloat16) for _ in range(LAYERS)]
    o = torch.randn(M, heads, DC, device="cuda").to(torch.bfloat16)
    state = {"i": 0}

    def cycled(fn):
        def run():
            w = ws[state["i"] % LAYERS]
            state["i"] += 1
            return fn(o, w)
        return run

    us = cuda_time_us(cycled(lambda o, w: mla_output(o, w, DN)), calls_per_graph=4 * LAYERS)
    torch._dynamo.reset()
    compiled = torch.compile(lambda o, w: torch_output(o, w, heads), fullgraph=True, dynamic=False)
    run = cycled(compiled)
    run()
    torch_us = cuda_time_us(run, calls_per_graph=4 * LAYERS)
    want = mla_output_reference(o.cpu(), ws[0].cpu(), DN)
    got = mla_output(o, ws[0], DN).cpu()
    err = float((got.float() - want.float()).norm() / want.float().norm())
    nbytes = heads * DV * DC * 2 + o.numel() * 2 + M * heads * DV * 2
    ceiling = hbm_ceiling()
    gbs = nbytes / (us * 1e-6) / 1e9
    benchmark.pedantic(lambda: mla_output(o, ws[0], DN), rounds=5, iterations=1)
    record(benchmark, op="mla_output", shape=shape, M=M, heads=heads, us=us, MB=nbytes / 1e6, gbs=gbs,
           ceiling_ratio=gbs / ceiling.gbs, torch_compiled_us=torch_us,
           speedup_vs_torch_compiled=torch_us / us, rel_err_vs_reference=err, **ceiling.fields())
