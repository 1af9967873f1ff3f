"""Decode-sized linear layers (issue 3's decode step): kdtree::gemv against HBM bandwidth and the two
torch forms it replaces, in the same run.

Run: pytest bench/bench_gemv.py --benchmark-only -s       (one `op=gemv` line per point)

Layers: the projections a decode step runs through ``kdtree::gemv`` in the "2p2b" config (issue
3 (a): hidden 2048, 16 heads, dense intermediate 6144) and in one TP-8 rank of K2 ("k2": hidden
7168, 8 heads, dense intermediate 2304): q_a + kv_a with the input RMSNorm, q_b with q_a_layernorm,
o_proj + residual, the dense MLP's gate + up with the post-attention RMSNorm and its down with
SwiGLU + residual.  M (rows) in {1, 4}.
Times are per call inside a CUDA graph (bench/conftest.py); consecutive calls cycle over enough
weight copies (>= 160 MB) that no weight is L2-resident.  bytes = the weights' bf16 bytes; gbs =
bytes / time; ceiling_ratio = gbs / the HBM ceiling (bench/conftest.py: max of a read-only stream
and a device copy, both measured in the same run).
Baselines, same run, same cycling: "cublas" = the eager module formula (RMSNorm / SwiGLU / the
residual add as torch ops, F.linear on cuBLAS); "inductor" = the multiply + sum form the model
compiled before this op (models/kimi_k2/gemv.py: matvec), torch.compile'd with the norm.
"""
import pytest
import torch
import torch.nn.functional as F

from torch_kdtree.ops import gemv

from .conftest import cuda_time_us, hbm_ceiling, record, requires_cuda

# name: (K, [N_i], prologue, residual)
LAYERS = {
    "2p2b": {"qa_kva": (2048, [1536, 576], "norm", False), "q_b": (1536, [3072], "norm", False),
             "o_proj": (2048, [2048], None, True), "mlp_gate_up": (2048, [6144, 6144], "norm", False),
             "mlp_down": (6144, [2048], "swiglu", True)},
    "k2": {"qa_kva": (7168, [1536, 576], "norm", False), "q_b": (1536, [1536], "norm", False),
           "o_proj": (1024, [7168], None, True), "mlp_gate_up": (7168, [2304, 2304], "norm", False),
           "mlp_down": (2304, [7168], "swiglu", True)},
}
ROWS = [1, 4]
MIN_BYTES = 160e6


def _prologue(x, norm_weight, eps, up):
    if norm_weight is not None:
        h = x.float()
        return norm_weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    if up is not None:
        return F.silu(x) * up
    return x


def cublas(x, weights, norm_weight=None, eps=1e-6, up=None, residual=None):
    xn = _prologue(x, norm_weight, eps, up)
    outs = [F.linear(xn, w) for w in weights]
    return [residual + outs[0]] if residual is not None else outs


def rowsum(x, weights, norm_weight=None, eps=1e-6, up=None, residual=None):
    xn = _prologue(x, norm_weight, eps, up)
    outs = [(xn.float()[..., None, :] * w.float()).sum(-1).to(x.dtype) for w in weights]
    return [residual + outs[0]] if residual is not None else outs


def _cycle(fn, calls):
    state = {"i": 0}

    def run():
        args, kw = calls[state["i"] % len(calls)]
        state["i"] += 1
        return fn(*args, **kw)

    return run


@requires_cuda
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("layer", ["qa_kva", "q_b", "o_proj", "mlp_gate_up", "mlp_down"])
@pytest.mark.parametrize("config", list(LAYERS))
def test_gemv(benchmark, config, layer, M):
    K, Ns, prologue, residual = LAYERS[config][layer]
    nbytes = sum(Ns) * K * 2
    copies = max(2, int(-(-MIN_BYTES // nbytes)))
    calls = []
    for _ in range(copies):
        weights = [(torch.randn((N, K), device="cuda") / K**0.5).to(torch.bfloat16) for N in Ns]
        kw = {}
        if prologue == "norm":
            kw = dict(norm_weight=(1 + 0.1 * torch.randn(K, device="cuda")).to(torch.bfloat16), eps=1e-6)
        elif prologue == "swiglu":
            kw = dict(up=torch.randn((M, K), device="cuda").to(torch.bfloat16))
        if residual:
            kw["residual"] = torch.randn((M, Ns[0]), device="cuda").to(torch.bfloat16)
        calls.append(((torch.randn((M, K), device="cuda").to(torch.bfloat16), weights), kw))
    n = copies * (2 if copies < 8 else 1)
    us = cuda_time_us(_cycle(gemv, calls), calls_per_graph=n)
    cublas_us = cuda_time_us(_cycle(cublas, calls), calls_per_graph=n)
    torch._dynamo.reset()
    compiled = torch.compile(rowsum, fullgraph=True, dynamic=False)
    inductor_us = cuda_time_us(_cycle(compiled, calls), calls_per_graph=n)
    (args, kw) = calls[0]
    err = max(float((g.float() - r.float()).norm() / r.float().norm())
              for g, r in zip(gemv(*args, **kw), cublas(*args, **kw)))
    ceiling = hbm_ceiling()
    gbs = nbytes / (us * 1e-6) / 1e9
    benchmark.pedantic(lambda: gemv(*args, **kw), rounds=5, iterations=1)
    record(benchmark, op="gemv", config=config, layer=layer, M=M, K=K, N="+".join(map(str, Ns)), us=us,
           MB=nbytes / 1e6, gbs=gbs, ceiling_ratio=gbs / ceiling.gbs, cublas_us=cublas_us,
           speedup_vs_cublas=cublas_us / us, inductor_us=inductor_us, speedup_vs_inductor=inductor_us / us,
           rel_err_vs_cublas=err, **ceiling.fields())
