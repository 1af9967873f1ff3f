"""kdtree::int4_repack / int4_moe: the CPU reference against an independent float64 oracle,
the repack layout and round trip, bad inputs, opcheck and torch.compile; on CUDA the kernels
against the reference (fresh random weights and routings every run)."""
import math

import numpy as np
import pytest
import torch

from .conftest import rel_err, requires_cuda
from torch_kdtree.ops import (Int4MoEWeights, int4_dequantize, int4_moe, int4_moe_out, int4_moe_plan,
                              int4_moe_reference, int4_moe_weights, int4_moe_workspace, int4_repack, int4_unpack,
                              pdl)
from torch_kdtree.ops.moe import DECODE_MAX_SLOTS, int4_decode_path_fits


# --------------------------------------------------------------------------------------------
# inputs and the oracle
# --------------------------------------------------------------------------------------------

def pack_oracle(nib: np.ndarray) -> np.ndarray:
    """uint [..., K] nibbles -> int32 [..., K/8], written independently of the library (numpy)."""
    n = nib.reshape(*nib.shape[:-1], -1, 8).astype(np.uint64)
    v = np.zeros(n.shape[:-1], dtype=np.uint64)
    for i in range(8):
        v |= n[..., i] << np.uint64(4 * i)
    return v.astype(np.uint32).view(np.int32)


def make_projection(gen, E, N, K, group):
    """Random compressed-tensors projection: (stored nibbles int64 [E, N, K], packed, scale)."""
    nib = torch.randint(0, 16, (E, N, K), generator=gen, dtype=torch.int64)
    packed = torch.from_numpy(pack_oracle(nib.numpy()))
    spread = torch.rand((E, N, K // group), generator=gen) + 0.5
    scale = (spread / (4.6 * math.sqrt(K))).to(torch.bfloat16)
    return nib, packed, scale


def make_experts(gen, E, H, I, group=32):
    gate, up, down = make_projection(gen, E, I, H, group), make_projection(gen, E, I, H, group), \
        make_projection(gen, E, H, I, group)
    return gate, up, down


def oracle_weight(proj, group):
    nib, _, scale = proj
    return (nib.double() - 8.0) * scale.double().repeat_interleave(group, dim=-1)


def make_routing(gen, T, k, num_global, device="cpu"):
    ids = torch.rand((T, num_global), generator=gen).argsort(dim=1)[:, :k].to(torch.int32)
    w = torch.rand((T, k), generator=gen) + 0.1
    w = (w / w.sum(-1, keepdim=True) * 2.827).to(torch.float32)
    return ids.to(device), w.to(device)


def moe_oracle(x, gate, up, down, ids, w, group, expert_map=None):
    """float64, one token and one expert at a time."""
    Wg, Wu, Wd = oracle_weight(gate, group), oracle_weight(up, group), oracle_weight(down, group)
    x = x.double().cpu()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if expert_map is not None:
                e = int(expert_map[e])
            if e < 0:
                continue
            g = Wg[e] @ x[t]
            u = Wu[e] @ x[t]
            out[t] += float(w[t, j]) * (Wd[e] @ (g * torch.sigmoid(g) * u))
    return out


def weights_of(gate, up, down, group, device="cpu"):
    return int4_moe_weights(gate[1].to(device), gate[2].to(device), up[1].to(device), up[2].to(device),
                            down[1].to(device), down[2].to(device), group_size=group)


# --------------------------------------------------------------------------------------------
# format: dequantisation and the repack layout
# --------------------------------------------------------------------------------------------

def test_dequantize_follows_compressed_tensors_formula(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    for group in (32, 64, 128):
        proj = make_projection(gen, 2, 16, 256, group)
        got = int4_dequantize(proj[1], proj[2], group)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), oracle_weight(proj, group), rtol=0, atol=0)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_repack_round_trips_to_compressed_tensors_values(fresh_seed, group):
    gen = torch.Generator().manual_seed(fresh_seed)
    _, packed, scale = make_projection(gen, 3, 48, 384, group)
    q, s = int4_repack(packed, scale, group)
    assert q.shape == (3, 3, 6, 128) and q.dtype == torch.int32
    assert s.shape == (3, 3, 384 // group, 16) and s.dtype == torch.bfloat16
    p2, s2 = int4_unpack(q, s)
    assert torch.equal(p2, packed) and torch.equal(s2, scale)


def test_repack_puts_each_lanes_mma_a_fragment_in_one_int32(fresh_seed):
    """Pins the documented layout nibble by nibble with plain loops: entry lane*4+s of tile
    (e, m, c), slot j holds channel 16m + g + 8(j&1) at k = 64c + 16s + 2t + 8((j>>1)&1) + (j>>2)."""
    gen = torch.Generator().manual_seed(fresh_seed)
    nib, packed, scale = make_projection(gen, 2, 32, 128, 32)
    q, s = int4_repack(packed, scale, 32)
    qn = q.numpy().view(np.uint32)
    nibn = nib.numpy()
    for e in range(2):
        for m in range(2):
            for c in range(2):
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    for step in range(4):
                        word = int(qn[e, m, c, lane * 4 + step])
                        for j in range(8):
                            n = 16 * m + g + 8 * (j & 1)
                            k = 64 * c + 16 * step + 2 * t + 8 * ((j >> 1) & 1) + (j >> 2)
                            assert (word >> (4 * j)) & 0xF == nibn[e, n, k]
    for e in range(2):
        for m in range(2):
            for grp in range(4):
                for g in range(8):
                    for h in range(2):
                        assert s[e, m, grp, 2 * g + h] == scale[e, 16 * m + g + 8 * h, grp]


def test_moe_weights_interleave_gate_and_up_and_give_back_the_inputs(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    E, H, I = 3, 128, 64
    gate, up, down = make_experts(gen, E, H, I)
    w = weights_of(gate, up, down, 32)
    assert (w.num_experts, w.hidden_size, w.intermediate_size, w.group_size) == (E, H, I, 32)
    back = w.compressed()
    for got, want in zip(back, (gate[1], gate[2], up[1], up[2], down[1], down[2])):
        assert torch.equal(got, want)
    g, u, d = w.dequantize()
    torch.testing.assert_close(g.double(), oracle_weight(gate, 32), rtol=0, atol=0)
    torch.testing.assert_close(u.double(), oracle_weight(up, 32), rtol=0, atol=0)
    torch.testing.assert_close(d.double(), oracle_weight(down, 32), rtol=0, atol=0)
    # Buffers survive a module round trip.
    mod = torch.nn.Module()
    for name, t in w.tensors().items():
        mod.register_buffer(name, t)
    again = Int4MoEWeights(mod.w13_qweight, mod.w13_scales, mod.w2_qweight, mod.w2_scales, 32)
    assert all(torch.equal(a, b) for a, b in zip(again[:4], w[:4]))


# --------------------------------------------------------------------------------------------
# the reference against the oracle
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("T,k,group", [(1, 1, 32), (5, 2, 32), (7, 4, 64), (9, 8, 128)])
def test_reference_matches_float64_oracle_in_float32(fresh_seed, T, k, group):
    gen = torch.Generator().manual_seed(fresh_seed)
    E, H, I = 9, 128, 128
    gate, up, down = make_experts(gen, E, H, I, group)
    w = weights_of(gate, up, down, group)
    x = torch.randn((T, H), generator=gen)
    ids, tw = make_routing(gen, T, k, E)
    got = int4_moe(x, w, ids, tw)
    assert got.dtype == torch.float32 and got.shape == (T, H)
    want = moe_oracle(x, gate, up, down, ids, tw, group)
    assert rel_err(got, want) < 1e-5


def test_reference_in_bfloat16_rounds_only_at_the_end(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    E, H, I = 6, 128, 64
    gate, up, down = make_experts(gen, E, H, I)
    w = weights_of(gate, up, down, 32)
    x = torch.randn((4, H), generator=gen).to(torch.bfloat16)
    ids, tw = make_routing(gen, 4, 3, E)
    got = int4_moe(x, w, ids.long(), tw)
    assert got.dtype == torch.bfloat16
    want = moe_oracle(x, gate, up, down, ids, tw, 32)
    torch.testing.assert_close(got.double(), want.to(torch.bfloat16).double(), rtol=1e-2, atol=1e-2 * float(want.abs().max()))
    assert rel_err(got, want) < 5e-3


def shared_oracle(x, sg, su, sd):
    """float64 shared expert, one token at a time."""
    x, sg, su, sd = x.double().cpu(), sg.double().cpu(), su.double().cpu(), sd.double().cpu()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        g, u = sg @ x[t], su @ x[t]
        out[t] = sd @ (g * torch.sigmoid(g) * u)
    return out


def make_shared(gen, H, Is, dtype=torch.float32, device="cpu"):
    scale = 1 / math.sqrt(H)
    sg, su = (torch.randn((Is, H), generator=gen, device=device) * scale for _ in range(2))
    sd = torch.randn((H, Is), generator=gen, device=device) / math.sqrt(Is)
    return sg.to(dtype), su.to(dtype), sd.to(dtype)


@pytest.mark.parametrize("with_residual", [False, True])
def test_reference_with_shared_expert_and_residual_matches_oracle(fresh_seed, with_residual):
    gen = torch.Generator().manual_seed(fresh_seed)
    E, H, I, Is, T, k = 7, 128, 64, 48, 5, 3
    gate, up, down = make_experts(gen, E, H, I)
    w = weights_of(gate, up, down, 32)
    x = torch.randn((T, H), generator=gen)
    ids, tw = make_routing(gen, T, k, E)
    sg, su, sd = make_shared(gen, H, Is)
    res = torch.randn((T, H), generator=gen) if with_residual else None
    got = int4_moe(x, w, ids, tw, shared=(sg, su, sd), residual=res)
    want = moe_oracle(x, gate, up, down, ids, tw, 32) + shared_oracle(x, sg, su, sd)
    if res is not None:
        want = want + res.double()
    assert rel_err(got, want) < 1e-5
    # the residual alone, and rounding in bf16: out = bf16(residual + bf16(sum))
    xb, rb = x.to(torch.bfloat16), torch.randn((T, H), generator=gen).to(torch.bfloat16)
    plain = int4_moe(xb, w, ids, tw)
    assert torch.equal(int4_moe(xb, w, ids, tw, residual=rb), (rb.float() + plain.float()).to(torch.bfloat16))


def test_shared_expert_and_residual_bad_inputs_raise(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    gate, up, down = make_experts(gen, 4, 128, 64)
    w = weights_of(gate, up, down, 32)
    x = torch.randn((3, 128), generator=gen)
    ids, tw = make_routing(gen, 3, 2, 4)
    sg, su, sd = make_shared(gen, 128, 32)
    with pytest.raises(ValueError, match="come together"):
        torch.ops.kdtree.int4_moe(x, *w[:4], ids, tw, None, 32, 8, 1, sg, su, None, None)
    with pytest.raises(ValueError, match=r"shared must be a \(gate, up, down\) tuple"):
        int4_moe(x, w, ids, tw, shared=(sg, su))
    with pytest.raises(ValueError, match=r"shared_gate / shared_up must be \[Is, H = 128\]"):
        int4_moe(x, w, ids, tw, shared=(sg, su, sd[:, :16].contiguous()))
    with pytest.raises(ValueError, match="positive multiple of 8"):
        int4_moe(x, w, ids, tw, shared=(sg[:12], su[:12], sd[:, :12].contiguous()))
    with pytest.raises(TypeError, match="shared_up must be"):
        int4_moe(x, w, ids, tw, shared=(sg, su.double(), sd))
    with pytest.raises(ValueError, match=r"residual must be \[T, H\]"):
        int4_moe(x, w, ids, tw, residual=x[:2])
    with pytest.raises(TypeError, match="residual must be"):
        int4_moe(x, w, ids, tw, residual=x.to(torch.bfloat16))


def test_reference_with_expert_map_skips_experts_of_other_ranks(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    E_global, E, H, I = 12, 5, 128, 64
    gate, up, down = make_experts(gen, E, H, I)
    w = weights_of(gate, up, down, 32)
    local = torch.randperm(E_global, generator=gen)[:E]
    expert_map = torch.full((E_global,), -1, dtype=torch.int32)
    expert_map[local] = torch.arange(E, dtype=torch.int32)
    x = torch.randn((6, H), generator=gen)
    ids, tw = make_routing(gen, 6, 4, E_global)
    got = int4_moe(x, w, ids, tw, expert_map=expert_map)
    want = moe_oracle(x, gate, up, down, ids, tw, 32, expert_map)
    assert rel_err(got, want) < 1e-5
    # A token whose experts all live elsewhere gets zeros.
    remote = torch.nonzero(expert_map < 0).flatten()[:2].to(torch.int32)
    out = int4_moe(x[:1], w, remote[None], tw[:1, :2], expert_map=expert_map)
    assert torch.equal(out, torch.zeros_like(out))


def test_out_variant_writes_every_element_of_out(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    E, H, I = 4, 128, 64
    gate, up, down = make_experts(gen, E, H, I)
    w = weights_of(gate, up, down, 32)
    x = torch.randn((3, H), generator=gen).to(torch.bfloat16)
    ids, tw = make_routing(gen, 3, 2, E)
    out = torch.full((3, H), float("nan"), dtype=torch.bfloat16)
    ws = int4_moe_workspace(3, 2, w)
    assert int4_moe_out(x, w, ids, tw, out, ws) is out
    assert torch.equal(out, int4_moe(x, w, ids, tw))


def test_decode_path_shape_rule():
    """int4_decode_path_fits mirrors csrc/moe_decode.cu's int4_decode_applies: T * k <= 32 slots,
    k <= 16, H and k * I at most 16384 bf16 values."""
    from torch_kdtree.ops.moe import int4_decode_path_fits
    assert int4_decode_path_fits(1, 8, 7168, 256) and int4_decode_path_fits(4, 8, 7168, 256)
    assert not int4_decode_path_fits(5, 8, 7168, 256)           # 40 slots
    assert int4_decode_path_fits(1, 8, 7168, 2048)              # K2 TP-1: k * I = 16384
    assert not int4_decode_path_fits(1, 8, 7168, 2112)
    assert int4_decode_path_fits(2, 4, 16384, 256) and not int4_decode_path_fits(2, 4, 16512, 256)
    assert int4_decode_path_fits(2, 16, 1024, 512) and not int4_decode_path_fits(1, 17, 1024, 64)


def _cpp_constant(text: str, name: str) -> int:
    """The value of `constexpr <type> name = a [* b ...];` in C++ source text."""
    import re
    m = re.search(rf"constexpr\s+\w+\s+{name}\s*=\s*([0-9][0-9 *]*);", text)
    assert m is not None, f"{name} not found"
    return math.prod(int(t) for t in m.group(1).split("*"))


def test_decode_path_limits_match_the_cuda_sources():
    """ops/moe.py restates csrc's decode-path limits (the model plans with them, int4_decode_applies
    decides with them): read both sides' values from the sources, so that they cannot drift apart."""
    from pathlib import Path

    from torch_kdtree.ops import moe
    csrc = Path(moe.__file__).resolve().parents[1] / "csrc"
    if not (csrc / "moe_decode.h").is_file():
        pytest.skip("the CUDA sources are not next to this copy of the package")
    header = (csrc / "moe_decode.h").read_text()
    assert _cpp_constant(header, "kInt4DecodeMaxSlots") == moe.DECODE_MAX_SLOTS
    assert _cpp_constant(header, "kInt4DecodeMaxBytes") == moe.DECODE_MAX_BYTES
    for source in ("moe_decode.cu", "moe.cu"):
        assert _cpp_constant((csrc / source).read_text(), "kMaxTopk") == moe.MAX_TOPK, source


def test_plan_is_a_function_of_shapes_only():
    small = int4_moe_plan(1, 8, 384, 7168, 256, "cpu")
    assert small.block_size == 8 and small.k_splits > 1
    big = int4_moe_plan(8192, 8, 384, 7168, 256, "cpu")
    assert big.block_size == 64 and big.k_splits == 1
    assert big.workspace_bytes > small.workspace_bytes > 0


# --------------------------------------------------------------------------------------------
# bad inputs
# --------------------------------------------------------------------------------------------

@pytest.fixture
def small_moe():
    gen = torch.Generator().manual_seed(0)
    gate, up, down = make_experts(gen, 4, 128, 64)
    w = weights_of(gate, up, down, 32)
    x = torch.randn((3, 128), generator=gen).to(torch.bfloat16)
    ids, tw = make_routing(gen, 3, 2, 4)
    return w, x, ids, tw, (gate, up, down)


def test_bad_dtypes_raise_clear_errors(small_moe):
    w, x, ids, tw, (gate, up, down) = small_moe
    with pytest.raises(TypeError, match="x must be"):
        int4_moe(x.to(torch.float16), w, ids, tw)
    with pytest.raises(TypeError, match="topk_ids must be"):
        int4_moe(x, w, ids.float(), tw)
    with pytest.raises(TypeError, match="topk_weights must be"):
        int4_moe(x, w, ids, tw.to(torch.bfloat16))
    with pytest.raises(TypeError, match="gate_packed must be"):
        int4_moe_weights(gate[1].to(torch.int64), gate[2], up[1], up[2], down[1], down[2])
    with pytest.raises(TypeError, match="down_scale must be"):
        int4_moe_weights(gate[1], gate[2], up[1], up[2], down[1], down[2].float())
    with pytest.raises(TypeError, match="packed must be"):
        int4_repack(gate[1].float(), gate[2], 32)


def test_k_not_a_multiple_of_the_group_raises():
    gen = torch.Generator().manual_seed(1)
    _, packed, _ = make_projection(gen, 2, 16, 192, 64)   # K = 192: not a multiple of 128
    scale = torch.ones((2, 16, 1), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 64 and of the group size 128"):
        int4_repack(packed, scale, 128)
    _, packed, scale = make_projection(gen, 2, 16, 96, 32)  # K = 96: not a multiple of the 64-k tile
    with pytest.raises(ValueError, match="multiple of 64"):
        int4_repack(packed, scale, 32)
    with pytest.raises(ValueError, match="group_size must be one of"):
        int4_repack(packed, scale, 16)


def test_shapes_that_disagree_raise(small_moe):
    w, x, ids, tw, (gate, up, down) = small_moe
    with pytest.raises(ValueError, match=r"w13_qweight must be"):
        int4_moe(x.repeat(1, 2), w, ids, tw)
    with pytest.raises(ValueError, match=r"must both be \[T = 3, k\]"):
        int4_moe(x, w, ids, tw[:, :1].contiguous())
    with pytest.raises(ValueError, match=r"must both be \[T = 3, k\]"):
        int4_moe(x, w, ids[:2], tw[:2])
    with pytest.raises(ValueError, match="top-k must be in"):
        int4_moe(x, w, ids.repeat(1, 9), tw.repeat(1, 9))
    with pytest.raises(ValueError, match="up .* must match gate"):
        int4_moe_weights(gate[1], gate[2], up[1][:, :32].contiguous(), up[2][:, :32].contiguous(), down[1], down[2])
    with pytest.raises(ValueError, match="down_packed must be"):
        int4_moe_weights(gate[1], gate[2], up[1], up[2], down[1][:, :64].contiguous(), down[2])
    with pytest.raises(ValueError, match="scale must be"):
        int4_repack(gate[1], gate[2][:, :, :1].contiguous(), 32)
    with pytest.raises(ValueError, match="out must be"):
        int4_moe_out(x, w, ids, tw, torch.empty((2, 128), dtype=torch.bfloat16), int4_moe_workspace(3, 2, w))


def test_expert_ids_out_of_range_raise(small_moe):
    w, x, ids, tw, _ = small_moe
    bad = ids.clone()
    bad[1, 0] = 4
    with pytest.raises(ValueError, match=r"expert ids in \[0, 4\)"):
        int4_moe(x, w, bad, tw)
    bad[1, 0] = -1
    with pytest.raises(ValueError, match=r"expert ids in \[0, 4\)"):
        int4_moe(x, w, bad, tw)
    emap = torch.tensor([0, 1, -1, 5, 2, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="expert_map values"):
        int4_moe(x, w, ids, tw, expert_map=emap)


def test_duplicate_expert_ids_within_a_token_raise(small_moe):
    w, x, ids, tw, _ = small_moe
    dup = ids.clone()
    dup[2, 1] = dup[2, 0]
    with pytest.raises(ValueError, match="duplicate expert id"):
        int4_moe(x, w, dup, tw)


# --------------------------------------------------------------------------------------------
# opcheck and torch.compile (CPU)
# --------------------------------------------------------------------------------------------

def _op_args(w, x, ids, tw, emap=None):
    plan = int4_moe_plan(x.shape[0], ids.shape[1], w.num_experts, w.hidden_size, w.intermediate_size, x.device)
    return (x, *w[:4], ids, tw, emap, w.group_size, plan.block_size, plan.k_splits), plan


def test_opcheck_cpu(small_moe):
    w, x, ids, tw, (gate, _, _) = small_moe
    torch.library.opcheck(torch.ops.kdtree.int4_repack.default, (gate[1], gate[2], 32))
    args, plan = _op_args(w, x, ids, tw)
    torch.library.opcheck(torch.ops.kdtree.int4_moe.default, args)
    emap = torch.tensor([1, -1, 0, 3, 2], dtype=torch.int32)
    args_map, _ = _op_args(w, x, ids, tw, emap)
    torch.library.opcheck(torch.ops.kdtree.int4_moe.default, args_map)
    out = torch.empty_like(x)
    ws = torch.empty(plan.workspace_bytes, dtype=torch.uint8)
    torch.library.opcheck(torch.ops.kdtree.int4_moe_out.default, (*args, ws, out))
    gen = torch.Generator().manual_seed(0)
    shared = make_shared(gen, x.shape[1], 16, x.dtype)
    torch.library.opcheck(torch.ops.kdtree.int4_moe.default, (*args, *shared, torch.randn_like(x)))


def test_compiles_with_fullgraph_on_cpu(small_moe):
    w, x, ids, tw, _ = small_moe
    torch._dynamo.reset()

    def step(x, ids, tw, out, ws):
        y = int4_moe(x, w, ids, tw)
        int4_moe_out(x, w, ids, tw, out, ws)
        return y + out

    compiled = torch.compile(step, fullgraph=True)
    out = torch.empty_like(x)
    ws = int4_moe_workspace(3, 2, w)
    want = 2 * int4_moe(x, w, ids, tw).float()
    got = compiled(x, ids, tw, out, ws)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    assert torch.equal(out, int4_moe(x, w, ids, tw))
    shared = make_shared(torch.Generator().manual_seed(1), x.shape[1], 16, x.dtype)
    res = torch.randn_like(x)
    fused = torch.compile(lambda x, ids, tw, r: int4_moe(x, w, ids, tw, shared=shared, residual=r), fullgraph=True)
    assert torch.equal(fused(x, ids, tw, res), int4_moe(x, w, ids, tw, shared=shared, residual=res))


def test_cpu_kernel_remembers_dequantised_experts_until_the_weights_change(fresh_seed):
    """The CPU kernel (the reference's arithmetic over float32 experts kept per weight tensor, the
    experts' matmuls grouped by expert) equals the reference on every call, dequantises each weight
    tensor once while it is unchanged, and again after an in-place change of its packed weights or
    of its scales; expert_map's -1 (another rank's expert), the shared expert and the residual
    included."""
    from torch_kdtree.ops import moe as moe_ops

    gen = torch.Generator().manual_seed(fresh_seed)
    E, H, I = 4, 128, 64
    parts = [(torch.randint(-2**31, 2**31, (E, n, k // 8), generator=gen, dtype=torch.int32),
              (torch.rand((E, n, k // 32), generator=gen) * 0.02 + 0.01).to(torch.bfloat16))
             for n, k in ((I, H), (I, H), (H, I))]
    w = int4_moe_weights(*parts[0], *parts[1], *parts[2], group_size=32)
    x = torch.randn(5, H, generator=gen)
    ids = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(5)]).to(torch.int32)
    tw = torch.rand(5, 2, generator=gen)
    emap = torch.tensor([2, -1, 0, 3, -1, 1], dtype=torch.int32)  # 6 global experts, 4 here
    shared = make_shared(gen, H, 32)
    res = torch.randn(5, H, generator=gen)
    calls = []
    real = moe_ops._dequant_all

    def counted(qweight, *args):
        calls.append(qweight.shape)
        return real(qweight, *args)

    moe_ops._dequant_all = counted
    try:
        for change, want in ((None, 2), (None, 0), ("qweight", 1), ("scales", 1)):
            if change == "qweight":
                w.w13_qweight[0].bitwise_xor_(0x11111111)  # in place: the version counter moves
            elif change == "scales":
                w.w2_scales.mul_(2)
            calls.clear()
            for xx in (x, x.to(torch.bfloat16)):
                out = int4_moe(xx, w, ids, tw, expert_map=emap, shared=tuple(t.to(xx.dtype) for t in shared),
                               residual=res.to(xx.dtype))
                ref = int4_moe_reference(xx, *w[:4], ids, tw, emap, w.group_size, 8, 1,
                                         *(t.to(xx.dtype) for t in shared), res.to(xx.dtype))
                tol = {"rtol": 1e-5, "atol": 1e-5} if xx.dtype == torch.float32 else {}
                torch.testing.assert_close(out, ref, **tol)
            # first call: w13 and w2; unchanged: none; after a change: that tensor's
            assert len(calls) == want, (change, calls)
    finally:
        moe_ops._dequant_all = real


def test_cpu_kernel_grouped_matmul_equals_its_segment_loop(fresh_seed):
    """The CPU kernel's grouped matmul (torch._grouped_mm where it runs on the CPU) and its
    fallback loop over expert segments give the same rows, empty segments included."""
    from torch_kdtree.ops import moe as moe_ops

    gen = torch.Generator().manual_seed(fresh_seed)
    w = torch.randn(7, 48, 32, generator=gen)
    experts = torch.sort(torch.randint(0, 7, (19,), generator=gen)).values
    experts[experts == 3] = 4  # an empty segment in the middle
    a = torch.randn(19, 32, generator=gen)
    want = torch.stack([w[e] @ a[s] for s, e in enumerate(experts.tolist())])
    grouped = moe_ops._grouped_matmul(a, w, experts)
    looped = moe_ops._grouped_matmul(a, w, experts, grouped=False)
    torch.testing.assert_close(grouped, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(looped, want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# CUDA: kernels against the reference (fresh random weights and routings every run)
# --------------------------------------------------------------------------------------------

def random_compressed_cuda(gen, E, N, K, group):
    """Random packed nibbles and scales made on the GPU (large shapes)."""
    packed = torch.randint(-2**31, 2**31, (E, N, K // 8), generator=gen, dtype=torch.int32, device="cuda")
    spread = torch.rand((E, N, K // group), generator=gen, device="cuda") + 0.5
    return packed, (spread / (4.6 * math.sqrt(K))).to(torch.bfloat16)


def cuda_weights(gen, E, H, I, group=32):
    g, u, d = (random_compressed_cuda(gen, E, I, H, group), random_compressed_cuda(gen, E, I, H, group),
               random_compressed_cuda(gen, E, H, I, group))
    return int4_moe_weights(g[0], g[1], u[0], u[1], d[0], d[1], group_size=group)


def cuda_routing(gen, T, k, num_global):
    ids = torch.rand((T, num_global), generator=gen, device="cuda").argsort(dim=1)[:, :k].to(torch.int32)
    w = torch.rand((T, k), generator=gen, device="cuda") + 0.1
    return ids.contiguous(), (w / w.sum(-1, keepdim=True) * 2.827).contiguous()


def run_out_poisoned(x, w, ids, tw, expert_map=None, block_size=None, k_splits=None):
    """The out-variant with out poisoned (NaN) and the workspace filled with garbage."""
    plan = int4_moe_plan(x.shape[0], ids.shape[1], w.num_experts, w.hidden_size, w.intermediate_size, x.device)
    bs = plan.block_size if block_size is None else block_size
    ks = plan.k_splits if k_splits is None else k_splits
    from torch_kdtree.ops.moe import int4_moe_workspace_bytes
    nbytes = int4_moe_workspace_bytes(x.shape[0], ids.shape[1], w.num_experts, w.hidden_size, w.intermediate_size,
                                      bs, ks)
    ws = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=x.device)
    out = torch.full_like(x, float("nan"))
    torch.ops.kdtree.int4_moe_out(x, *w[:4], ids, tw, expert_map, w.group_size, bs, ks, ws, out)
    return out


def check_against_reference(x, w, ids, tw, expert_map=None, **plan):
    out = run_out_poisoned(x, w, ids, tw, expert_map, **plan)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "the kernel left elements of out unwritten"
    ref = int4_moe_reference(x, *w[:4], ids, tw, expert_map, w.group_size)
    err = rel_err(out, ref)
    assert err <= 1e-2, f"relative error {err:.3e}"
    return out, ref


@requires_cuda
@pytest.mark.parametrize("group", [32, 64, 128])
def test_cuda_repack_matches_cpu_bit_for_bit(fresh_seed, group):
    gen = torch.Generator().manual_seed(fresh_seed)
    _, packed, scale = make_projection(gen, 3, 80, 512, group)
    q_cpu, s_cpu = int4_repack(packed, scale, group)
    q_gpu, s_gpu = int4_repack(packed.cuda(), scale.cuda(), group)
    assert torch.equal(q_gpu.cpu(), q_cpu) and torch.equal(s_gpu.cpu(), s_cpu)
    p2, s2 = int4_unpack(q_gpu, s_gpu)
    assert torch.equal(p2.cpu(), packed) and torch.equal(s2.cpu(), scale)


@requires_cuda
@pytest.mark.parametrize("E,H,I,T,k,group", [
    (8, 256, 128, 1, 1, 32),       # T = 1, k = 1
    (16, 512, 256, 1, 8, 32),      # T = 1, k = 8
    (16, 384, 192, 37, 8, 32),     # T not a multiple of any tile, I / 64 odd
    (40, 256, 64, 3, 16, 32),      # k = 16
    (12, 512, 128, 29, 4, 64),     # group 64
    (12, 512, 256, 11, 2, 128),    # group 128
    (16, 256, 128, 200, 8, 32),    # large blocks (block_size 64 by the plan)
])
def test_cuda_kernel_matches_reference(fresh_seed, E, H, I, T, k, group):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    w = cuda_weights(gen, E, H, I, group)
    x = torch.randn((T, H), generator=gen, device="cuda").to(torch.bfloat16)
    ids, tw = cuda_routing(gen, T, k, E)
    check_against_reference(x, w, ids, tw)
    check_against_reference(x, w, ids.long(), tw)


@requires_cuda
@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
@pytest.mark.parametrize("k_splits", [1, 3])
def test_cuda_every_block_size_and_split(fresh_seed, block_size, k_splits):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    w = cuda_weights(gen, 10, 384, 128)
    x = torch.randn((53, 384), generator=gen, device="cuda").to(torch.bfloat16)
    ids, tw = cuda_routing(gen, 53, 6, 10)
    check_against_reference(x, w, ids, tw, block_size=block_size, k_splits=k_splits)


@requires_cuda
@pytest.mark.parametrize("T", [1, 16, 64])
def test_cuda_kimi_k2_tp8_shapes(fresh_seed, T):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    w = cuda_weights(gen, 384, 7168, 256)
    x = torch.randn((T, 7168), generator=gen, device="cuda").to(torch.bfloat16)
    ids, tw = cuda_routing(gen, T, 8, 384)
    check_against_reference(x, w, ids, tw)


@requires_cuda
def test_cuda_kimi_k2_tp1_intermediate(fresh_seed):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    w = cuda_weights(gen, 24, 7168, 2048)
    x = torch.randn((5, 7168), generator=gen, device="cuda").to(torch.bfloat16)
    ids, tw = cuda_routing(gen, 5, 8, 24)
    check_against_reference(x, w, ids, tw)


@requires_cuda
def test_cuda_all_tokens_to_one_expert(fresh_seed):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    w = cuda_weights(gen, 12, 256, 128)
    T = 300  # several blocks of the same expert whatever the block size
    x = torch.randn((T, 256), generator=gen, device="cuda").to(torch.bfloat16)
    ids = torch.full((T, 1), 7, dtype=torch.int32, device="cuda")
    tw = torch.rand((T, 1), generator=gen, device="cuda")
    check_against_reference(x, w, ids, tw)
    # and with k = 4 where every token's first choice is expert 7
    ids4, tw4 = cuda_routing(gen, T, 4, 12)
    ids4 = torch.where(ids4 == 7, ids4[:, :1], ids4)
    ids4[:, 0] = 7
    check_against_reference(x, w, ids4.contiguous(), tw4)


@requires_cuda
def test_cuda_experts_without_tokens(fresh_seed):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    w = cuda_weights(gen, 64, 256, 128)
    x = torch.randn((6, 256), generator=gen, device="cuda").to(torch.bfloat16)
    ids, tw = cuda_routing(gen, 6, 3, 5)   # only experts 0..4 of 64 are used
    check_against_reference(x, w, (ids * 13).to(torch.int32), tw)


@requires_cuda
def test_cuda_expert_map(fresh_seed):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    E_global, E = 48, 16
    w = cuda_weights(gen, E, 256, 128)
    local = torch.randperm(E_global, generator=gen, device="cuda")[:E]
    emap = torch.full((E_global,), -1, dtype=torch.int32, device="cuda")
    emap[local] = torch.arange(E, dtype=torch.int32, device="cuda")
    T = 33
    x = torch.randn((T, 256), generator=gen, device="cuda").to(torch.bfloat16)
    ids, tw = cuda_routing(gen, T, 8, E_global)
    remote = torch.nonzero(emap < 0).flatten()[:8].to(torch.int32)
    ids[0] = remote  # token 0 has no expert on this rank
    out, _ = check_against_reference(x, w, ids, tw, expert_map=emap)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    # the Python wrapper path
    torch.testing.assert_close(int4_moe(x, w, ids, tw, expert_map=emap), out, rtol=0, atol=0)


@requires_cuda
def test_cuda_results_are_deterministic(fresh_seed):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    w = cuda_weights(gen, 32, 512, 256)
    x = torch.randn((9, 512), generator=gen, device="cuda").to(torch.bfloat16)
    ids, tw = cuda_routing(gen, 9, 8, 32)
    a = run_out_poisoned(x, w, ids, tw, k_splits=5)
    b = run_out_poisoned(x, w, ids, tw, k_splits=5)
    assert torch.equal(a, b)


@requires_cuda
def test_cuda_workspace_too_small_raises(fresh_seed):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    w = cuda_weights(gen, 8, 256, 128)
    x = torch.randn((4, 256), generator=gen, device="cuda").to(torch.bfloat16)
    ids, tw = cuda_routing(gen, 4, 2, 8)
    ws = int4_moe_workspace(4, 2, w)
    with pytest.raises(ValueError, match="workspace has"):
        int4_moe_out(x, w, ids, tw, torch.empty_like(x), ws[:-1])
    plan = int4_moe_plan(4, 2, 8, 256, 128, "cuda")
    with pytest.raises(RuntimeError, match="workspace has"):
        torch.ops.kdtree.int4_moe_out(x, *w[:4], ids, tw, None, 32, plan.block_size, plan.k_splits, ws[:-1],
                                      torch.empty_like(x))


@requires_cuda
def test_opcheck_cuda(fresh_seed):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    w = cuda_weights(gen, 8, 256, 128)
    x = torch.randn((5, 256), generator=gen, device="cuda").to(torch.bfloat16)
    ids, tw = cuda_routing(gen, 5, 3, 8)
    _, packed, scale = make_projection(torch.Generator().manual_seed(fresh_seed), 2, 32, 128, 32)
    torch.library.opcheck(torch.ops.kdtree.int4_repack.default, (packed.cuda(), scale.cuda(), 32))
    args, plan = _op_args(w, x, ids, tw)
    torch.library.opcheck(torch.ops.kdtree.int4_moe.default, args)
    ws = torch.empty(plan.workspace_bytes, dtype=torch.uint8, device="cuda")
    torch.library.opcheck(torch.ops.kdtree.int4_moe_out.default, (*args, ws, torch.empty_like(x)))
    shared = make_shared(torch.Generator(device="cuda").manual_seed(fresh_seed), 256, 64, torch.bfloat16, "cuda")
    # the decode path with its shared expert and residual
    torch.library.opcheck(torch.ops.kdtree.int4_moe.default, (*args, *shared, torch.randn_like(x)))


@requires_cuda
def test_cuda_compiles_with_fullgraph(fresh_seed):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    w = cuda_weights(gen, 8, 256, 128)
    x = torch.randn((7, 256), generator=gen, device="cuda").to(torch.bfloat16)
    ids, tw = cuda_routing(gen, 7, 2, 8)
    torch._dynamo.reset()

    def step(x, ids, tw, out, ws):
        y = int4_moe(x, w, ids, tw)
        int4_moe_out(x, w, ids, tw, out, ws)
        return y, out

    compiled = torch.compile(step, fullgraph=True)
    out = torch.full_like(x, float("nan"))
    y, out2 = compiled(x, ids, tw, out, int4_moe_workspace(7, 2, w))
    ref = int4_moe_reference(x, *w[:4], ids, tw, None, 32)
    assert rel_err(y, ref) <= 1e-2 and rel_err(out, ref) <= 1e-2
    assert torch.equal(y, out)


@requires_cuda
@pytest.mark.parametrize("E,H,I,T,k", [(32, 512, 128, 12, 8),  # the grouped GEMMs
                                       (64, 1024, 256, 2, 8)])  # the decode path (T * k <= 32)
def test_cuda_graph_replays_with_new_routings(fresh_seed, E, H, I, T, k):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    w = cuda_weights(gen, E, H, I)
    x = torch.randn((T, H), generator=gen, device="cuda").to(torch.bfloat16)
    ids, tw = cuda_routing(gen, T, k, E)
    out = torch.full_like(x, float("nan"))
    ws = int4_moe_workspace(T, k, w)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        int4_moe_out(x, w, ids, tw, out, ws)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        int4_moe_out(x, w, ids, tw, out, ws)
    for step in range(3):
        new_ids, new_tw = cuda_routing(gen, T, k, E)
        if step == 2:  # every token shares expert 3: a different block structure, same graph
            order = torch.rand((T, E), generator=gen, device="cuda").argsort(dim=1)
            others = order[order != 3].view(T, E - 1)[:, : k - 1]
            new_ids = torch.cat([torch.full((T, 1), 3, device="cuda"), others], dim=1).to(torch.int32)
        ids.copy_(new_ids)
        tw.copy_(new_tw)
        x.copy_(torch.randn((T, H), generator=gen, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = int4_moe_reference(x, *w[:4], ids, tw, None, 32)
        assert not torch.isnan(out).any()
        assert rel_err(out, ref) <= 1e-2


@requires_cuda
@pytest.mark.parametrize("E,H,I,T,k,k_splits", [(24, 512, 128, 21, 8, 4),     # grouped GEMMs, split K
                                                (64, 2048, 256, 2, 8, None)])  # the decode path
def test_cuda_same_bits_with_and_without_programmatic_dependent_launch(fresh_seed, E, H, I, T, k, k_splits):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    w = cuda_weights(gen, E, H, I)
    x = torch.randn((T, H), generator=gen, device="cuda").to(torch.bfloat16)
    ids, tw = cuda_routing(gen, T, k, E)
    with pdl(False):
        a = run_out_poisoned(x, w, ids, tw, k_splits=k_splits)
    with pdl(True):
        b = run_out_poisoned(x, w, ids, tw, k_splits=k_splits)
    c = run_out_poisoned(x, w, ids, tw, k_splits=k_splits)
    assert torch.equal(a, b) and torch.equal(b, c)
    check_against_reference(x, w, ids, tw)


# --------------------------------------------------------------------------------------------
# the decode path (T · k <= 32: two GEMV launches, csrc/moe_decode.cu)
# --------------------------------------------------------------------------------------------

def past_decode_slots(T, k):
    """How many copies of T tokens take more than the decode path's 32 (token, expert) slots."""
    return DECODE_MAX_SLOTS // (T * k) + 1


def run_both_paths(x, w, ids, tw, expert_map=None):
    """(decode path, grouped-GEMM path, reference) for the same tokens, each path checked against the
    reference: the call itself (T · k <= 32 slots: the decode path) and its tokens repeated past 32
    slots (the grouped GEMMs), of which the first T rows are compared."""
    (T, k), (H, I) = ids.shape, (w.hidden_size, w.intermediate_size)
    n = past_decode_slots(T, k)
    assert int4_decode_path_fits(T, k, H, I) and not int4_decode_path_fits(n * T, k, H, I)
    dec, ref = check_against_reference(x, w, ids, tw, expert_map)
    gemm, _ = check_against_reference(x.repeat(n, 1), w, ids.repeat(n, 1), tw.repeat(n, 1), expert_map)
    return dec, gemm[:T], ref


@requires_cuda
@pytest.mark.parametrize("E,H,I,T,k,group", [
    (8, 256, 128, 1, 1, 32),
    (384, 7168, 256, 1, 8, 32),    # a K2 TP-8 rank, one token
    (384, 7168, 256, 4, 8, 32),    # four tokens: 32 slots, the largest decode call
    (24, 1024, 512, 2, 16, 64),    # k = 16, group 64
    (16, 512, 192, 3, 6, 64),      # I / 64 odd
    (16, 640, 256, 2, 4, 128),     # group 128, H / 64 odd
    (32, 4096, 128, 1, 4, 64),     # gate/up split over K (a cluster of 5 on an H200's 132 SMs)
    (16, 2048, 128, 1, 2, 128),    # K split in 4, group 128
])
def test_cuda_decode_path_matches_reference_and_grouped_gemm(fresh_seed, E, H, I, T, k, group):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    w = cuda_weights(gen, E, H, I, group)
    x = torch.randn((T, H), generator=gen, device="cuda").to(torch.bfloat16)
    ids, tw = cuda_routing(gen, T, k, E)
    for id_t in (ids, ids.long()):
        dec, gemm, ref = run_both_paths(x, w, id_t, tw)
        # both paths round the dequantised weights and the activations to bf16 the same way;
        # only their fp32 summation orders differ
        assert rel_err(dec, gemm) <= 4e-3, f"decode vs grouped GEMM {rel_err(dec, gemm):.3e}"


@requires_cuda
@pytest.mark.parametrize("E,H,I,Is,T,k", [
    (384, 7168, 256, 256, 1, 8),   # a K2 TP-8 rank: 4 shared block rows per token
    (384, 7168, 256, 256, 4, 8),   # four tokens
    (16, 1024, 128, 200, 3, 4),    # Is not a multiple of 4 * I / 16: idle shared blocks
    (16, 2816, 128, 64, 1, 2),     # gate/up split over K (5 splits of 44 k64 tiles, the last short)
    (24, 512, 64, 1024, 2, 6),     # Is > I: shared rows longer than a routed slot's
])
@pytest.mark.parametrize("parts", ["shared+residual", "shared", "residual"])
def test_cuda_decode_path_shared_expert_and_residual(fresh_seed, E, H, I, Is, T, k, parts):
    """The shared expert inside the decode path's two launches (and the residual add in down's):
    against the reference, and against the grouped path (the same tokens repeated past the decode
    path's 32 slots; it adds them with ATen ops)."""
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    w = cuda_weights(gen, E, H, I, 32)
    x = torch.randn((T, H), generator=gen, device="cuda").to(torch.bfloat16)
    ids, tw = cuda_routing(gen, T, k, E)
    shared = make_shared(gen, H, Is, torch.bfloat16, "cuda") if "shared" in parts else None
    res = torch.randn((T, H), generator=gen, device="cuda").to(torch.bfloat16) if "residual" in parts else None
    ref = int4_moe_reference(x, *w[:4], ids, tw, None, 32, 8, 1, *(shared or (None,) * 3), res)
    outs = {}
    for path, n in (("decode", 1), ("grouped", past_decode_slots(T, k))):
        for id_t in (ids, ids.long()):
            out = int4_moe(x.repeat(n, 1), w, id_t.repeat(n, 1), tw.repeat(n, 1), shared=shared,
                           residual=None if res is None else res.repeat(n, 1))[:T]
            assert rel_err(out, ref) <= 1e-2, f"{path}: relative error {rel_err(out, ref):.3e}"
            outs[path, id_t.dtype] = out
    assert torch.equal(outs["decode", torch.int32], outs["decode", torch.int64])
    # without the residual the sums are compared directly (with it, it dominates the norm)
    if res is None:
        assert rel_err(outs["decode", torch.int32], outs["grouped", torch.int32]) <= 4e-3
    else:
        diff = (outs["decode", torch.int32].float() - outs["grouped", torch.int32].float()).abs().max()
        assert float(diff) <= 0.05 * float(res.float().abs().max())
    # the unfused sum: the fused output is the plain call plus the shared expert plus the residual
    plain = int4_moe(x, w, ids, tw).float()
    if shared is not None:
        sg, su, sd = (t.float() for t in shared)
        xf = x.float()
        plain = plain + (torch.nn.functional.silu(xf @ sg.T) * (xf @ su.T)) @ sd.T
    if res is not None:
        plain = plain + res.float()
    assert rel_err(outs["decode", torch.int32], plain) <= 1e-2


@requires_cuda
def test_cuda_decode_path_shared_expert_in_a_graph_and_without_pdl(fresh_seed):
    """The fused call replays in a CUDA graph with new inputs, and PDL changes no bit."""
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    E, H, I, Is, T, k = 64, 2048, 256, 256, 2, 8
    w = cuda_weights(gen, E, H, I, 32)
    shared = make_shared(gen, H, Is, torch.bfloat16, "cuda")
    x = torch.randn((T, H), generator=gen, device="cuda").to(torch.bfloat16)
    res = torch.randn((T, H), generator=gen, device="cuda").to(torch.bfloat16)
    ids, tw = cuda_routing(gen, T, k, E)
    eager = int4_moe(x, w, ids, tw, shared=shared, residual=res)
    with pdl(False):
        assert torch.equal(int4_moe(x, w, ids, tw, shared=shared, residual=res), eager)
    from torch_kdtree.ops._checks import value_checks
    with value_checks(False):
        int4_moe(x, w, ids, tw, shared=shared, residual=res)  # warm
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = int4_moe(x, w, ids, tw, shared=shared, residual=res)
    for _ in range(2):
        x.copy_(torch.randn((T, H), generator=gen, device="cuda"))
        res.copy_(torch.randn((T, H), generator=gen, device="cuda"))
        new_ids, new_tw = cuda_routing(gen, T, k, E)
        ids.copy_(new_ids)
        tw.copy_(new_tw)
        graph.replay()
        assert torch.equal(out, int4_moe(x, w, ids, tw, shared=shared, residual=res))


@requires_cuda
def test_cuda_decode_path_with_expert_map_skips_other_ranks(fresh_seed):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    E_global, E, T, k = 48, 16, 3, 8
    w = cuda_weights(gen, E, 512, 128)
    local = torch.randperm(E_global, generator=gen, device="cuda")[:E]
    emap = torch.full((E_global,), -1, dtype=torch.int32, device="cuda")
    emap[local] = torch.arange(E, dtype=torch.int32, device="cuda")
    x = torch.randn((T, 512), generator=gen, device="cuda").to(torch.bfloat16)
    ids, tw = cuda_routing(gen, T, k, E_global)
    ids[0] = torch.nonzero(emap < 0).flatten()[:k].to(torch.int32)  # token 0: no expert on this rank
    dec, gemm, _ = run_both_paths(x, w, ids, tw, expert_map=emap)
    assert torch.equal(dec[0], torch.zeros_like(dec[0]))
    assert rel_err(dec, gemm) <= 4e-3
