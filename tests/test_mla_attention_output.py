"""kdtree::mla_tree_attention_output: ``mla_output(mla_tree_attention(...))`` as one op (the decode
step's attention and W_UV).  The reference against a float64 oracle (attention over each node's
logical key sequence, then W_UV per head), bad inputs, opcheck and torch.compile on CPU; on CUDA the
merge-output kernel bit for bit against the two CUDA ops one after the other (one split and
several, empty splits, decode and trees, dv not a multiple of 32), against the reference, opcheck,
and a compiled CUDA graph replayed with changing lengths."""
import pytest
import torch

from .conftest import poison_cuda_allocator, requires_cuda_kernel
from .test_mla_absorb import _compiled_graph
from .test_mla_tree_attention import SCALE, _cuda_case, make_case, oracle, rel_err
from torch_kdtree.ops import (mla_output, mla_tree_attention, mla_tree_attention_output,
                              mla_tree_attention_output_reference)

requires_kernel = requires_cuda_kernel("kdtree::mla_tree_attention_output")


def _w(H, dn, dv, gen, dtype=torch.bfloat16, device="cpu"):
    return (torch.randn(H * (dn + dv), 512, generator=gen) / 512 ** 0.5).to(dtype).to(device)


def _oracle(q, visible, logical, lens, w, dn):
    o, _ = oracle(q, visible, logical, lens, SCALE)  # float64 [R, N, H, 512]
    w_uv = w.double().cpu().view(q.shape[2], -1, 512)[:, dn:]  # [H, dv, 512]
    return torch.einsum("rnhc,hdc->rnhd", o, w_uv)


# ---------------------------------------------------------------------------------------------
# CPU: the reference
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("R,N,H,lens,dn,dv", [(1, 1, 16, [37], 128, 128), (2, 5, 4, [10, 0], 64, 40),
                                              (2, 3, 8, [70, 3], 128, 128)])
def test_reference_matches_float64_oracle(fresh_seed, dtype, tol, R, N, H, lens, dn, dv):
    gen = torch.Generator().manual_seed(fresh_seed)
    q, kv, bt, cl, vis, logical = make_case(R, N, H, 16, lens, gen, dtype=dtype)
    w = _w(H, dn, dv, gen, dtype)
    got = mla_tree_attention_output(q, kv, bt, cl, vis, SCALE, w, dn)
    assert got.shape == (R, N, H, dv) and got.dtype == dtype
    assert rel_err(got, _oracle(q, vis, logical, lens, w, dn)) <= tol


def test_bad_inputs_raise():
    gen = torch.Generator().manual_seed(0)
    q, kv, bt, cl, vis, _ = make_case(1, 2, 4, 16, [5], gen)
    w = _w(4, 128, 128, gen)

    def bad(exc, match, **kw):
        a = dict(q=q, kv=kv, w=w, dn=128)
        a.update(kw)
        with pytest.raises(exc, match=match):
            mla_tree_attention_output(a["q"], a["kv"], bt, cl, vis, SCALE, a["w"], a["dn"])

    bad(ValueError, r"w_kv_b must be \[H \* \(dn \+ dv\), 512\]", w=w[:, :256].contiguous())
    bad(ValueError, r"w_kv_b must be \[H \* \(dn \+ dv\), 512\]", w=w[:4 * 128].contiguous())  # dv = 0
    bad(ValueError, r"w_kv_b must be \[H \* \(dn \+ dv\), 512\]", w=w[:7].contiguous())  # not H rows each
    bad(ValueError, "qk_nope_head_dim must be a non-negative int", dn=-1)
    bad(ValueError, "qk_nope_head_dim must be a non-negative int", dn=1.5)
    bad(TypeError, "w_kv_b", w=w.to(torch.int32))
    bad(ValueError, "q head dim must be 576", q=q[..., :575].contiguous())


def test_opcheck_and_compile_cpu(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    q, kv, bt, cl, vis, _ = make_case(2, 3, 4, 16, [9, 20], gen, dtype=torch.float32)
    w = _w(4, 64, 32, gen, torch.float32)
    torch.library.opcheck(torch.ops.kdtree.mla_tree_attention_output.default, (q, kv, bt, cl, vis, SCALE, w, 64, True))
    want = mla_tree_attention_output_reference(q, kv, bt, cl, vis, SCALE, w, 64)
    step = torch.compile(lambda q: mla_tree_attention_output(q, kv, bt, cl, vis, SCALE, w, 64, prefix_ready=True),
                         fullgraph=True)
    assert torch.equal(step(q), want)


# ---------------------------------------------------------------------------------------------
# CUDA: the merge-output kernel
# ---------------------------------------------------------------------------------------------

def _two_ops(q, kv, bt, cl, vis, w, dn):
    R, N, H, _ = q.shape
    o = mla_tree_attention(q, kv, bt, cl, vis, SCALE)
    return mla_output(o.reshape(R * N, H, 512), w, dn).view(R, N, H, -1)


@requires_kernel
@pytest.mark.parametrize("R,N,H,lens,page_size,dn,dv", [
    (1, 1, 16, [767], 16, 128, 128),    # the 2p2b decode step: several splits
    (1, 1, 8, [40], 16, 128, 128),      # 64 keys of capacity: one split, the attention writes the row
    (2, 1, 16, [1000, 5], 64, 128, 128),  # request 1 fills one split: the others are empty
    (1, 4, 8, [300], 16, 128, 128),     # a small tree
    (3, 2, 16, [0, 17, 129], 32, 64, 40),  # dv = 40: a block's last warps own no W_UV row
])
def test_cuda_kernel_equals_the_two_ops_bit_for_bit(fresh_seed, R, N, H, lens, page_size, dn, dv):
    q, kv, bt, cl, vis, logical = _cuda_case(R, N, H, page_size, lens, fresh_seed)
    w = _w(H, dn, dv, torch.Generator().manual_seed(fresh_seed + 1), device="cuda")
    want = _two_ops(q, kv, bt, cl, vis, w, dn)
    poison_cuda_allocator()
    for prefix_ready in (False, True):
        got = mla_tree_attention_output(q, kv, bt, cl, vis, SCALE, w, dn, prefix_ready=prefix_ready)
        assert got.shape == (R, N, H, dv) and got.dtype == torch.bfloat16
        assert torch.equal(got, want)
    assert rel_err(got, _oracle(q, vis, logical, lens, w, dn)) <= 2e-2


@requires_kernel
def test_cuda_opcheck(fresh_seed):
    q, kv, bt, cl, vis, _ = _cuda_case(1, 2, 8, 16, [100], fresh_seed)
    w = _w(8, 128, 128, torch.Generator().manual_seed(fresh_seed), device="cuda")
    torch.library.opcheck(torch.ops.kdtree.mla_tree_attention_output.default, (q, kv, bt, cl, vis, SCALE, w, 128, True))


@requires_kernel
def test_cuda_compiled_graph_replays_with_changing_lengths(fresh_seed):
    """One captured graph (compiled, fullgraph) serves every committed length: each replay equals the
    two ops run eagerly on the same state."""
    q, kv, bt, cl, vis, _ = _cuda_case(1, 1, 16, 16, [700], fresh_seed)
    w = _w(16, 128, 128, torch.Generator().manual_seed(fresh_seed), device="cuda")
    lens = cl.clone()
    graph, out = _compiled_graph(lambda: mla_tree_attention_output(q, kv, bt, lens, vis, SCALE, w, 128,
                                                                   prefix_ready=True))
    for L in (700, 63, 1, 0, 450):
        lens.fill_(L)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, _two_ops(q, kv, bt, lens, vis, w, 128)), L


@requires_kernel
def test_cuda_bad_inputs_raise():
    q, kv, bt, cl, vis, _ = _cuda_case(1, 1, 4, 16, [10], 0)
    w = _w(4, 128, 128, torch.Generator().manual_seed(0), device="cuda")
    with pytest.raises(RuntimeError, match="must be BFloat16"):
        mla_tree_attention_output(q, kv, bt, cl, vis, SCALE, w.float(), 128)
    with pytest.raises(ValueError, match="must be on one device|same device"):
        mla_tree_attention_output(q, kv, bt, cl, vis, SCALE, w.cpu(), 128)
