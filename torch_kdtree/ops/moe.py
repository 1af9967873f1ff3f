"""INT4 (w4a16, symmetric, group 32/64/128) routed-expert MoE: ``kdtree::int4_repack``,
``kdtree::int4_moe_out`` (out-variant, caller-owned workspace) and ``kdtree::int4_moe``.

Input format (compressed-tensors ``pack-quantized``, shared/docs/kimi_k2.md), stacked over E
experts: ``packed`` int32 [E, N, K/8], eight 4-bit values per int32 along K, lowest nibble
first, each stored as q + 8 (q in [-8, 7]); ``scale`` bf16 [E, N, K/group];
``W[n, k] = (((packed[n, k // 8] >> (4 * (k % 8))) & 0xF) - 8) * scale[n, k // group]``.
gate/up are [E, I, H] (N = I, K = H), down is [E, H, I].

Kernel layout (the same on every device, so repacked weights may be moved or saved):
- ``qweight`` int32 [E, N/16, K/64, 128]: one 16-channel x 64-k tile per [e, m, c]; entry
  ``lane * 4 + s`` (lane = 4 g + t, g in 0..7, t in 0..3, s = the k16 step in the tile) holds
  the eight stored nibbles that lane needs as the A operand of an ``mma.m16n8k16`` (weights as
  A: channels are the m side).  Nibble slot j (bits 4j..4j+3) holds channel ``16 m + g + 8 (j & 1)``
  at k ``64 c + 16 s + 2 t + 8 ((j >> 1) & 1) + (j >> 2)``, so ``(v >> 4i) & 0x000f000f`` is the
  bf16 pair of A register i with 128 + nibble in each half (kernel_notes.md section 1b/1c).
- ``scales`` bf16 [E, N/16, K/group, 16]: entry ``2 g + h`` is the scale of channel
  ``16 m + g + 8 h`` (a lane's two rows are one 32-bit load).
- gate and up are fused into one w13 with N = 2I, interleaved by 16 channels: w13 tile
  ``2 i`` is gate channels [16 i, 16 i + 16) and tile ``2 i + 1`` is up's same channels, so one
  warp holds both halves of SiLU(gate) * up in its registers.

The CPU kernels are the pure-torch references below; the CUDA kernels live in csrc/moe.cu
(four launches per call: align, gate/up GEMM, down GEMM, combine).  Decode-sized calls (T · k <=
32, H and k · I at most 16 K values; chosen from shapes only) take csrc/moe_decode.cu instead:
two GEMV launches that read each touched expert once (on the H200, for the K2 TP-8 rank, 15.7 vs
25.1 µs at T = 1 and 45.1 vs 55.5 µs at T = 4; bench/RESULTS.md run 45).  Both paths chain
their launches with programmatic dependent launch unless it is off (``KDTREE_PDL=0``,
:func:`torch_kdtree.ops.set_pdl`).
"""
from __future__ import annotations

import weakref
from typing import NamedTuple, Optional

import torch

from ._checks import check_routing, check_same_device, check_shared_expert, check_tensor, value_checks_active

GROUP_SIZES = (32, 64, 128)
BLOCK_SIZES = (8, 16, 32, 64)  # token rows per expert block (the n side of the swapped GEMM)
MAX_TOPK = 16
MAX_K_SPLITS = 16
TILE_N = 16    # channels per weight tile (the mma m16 side)
TILE_K = 64    # k per weight tile (four k16 steps)
CTA_N = 128    # channels per CTA in both GEMMs (4 warps x 2 tiles)
_ALIGN = 256   # workspace regions start on 256-byte boundaries
_TARGET_CTAS = 2048  # gate/up CTAs the split-K aims for (several waves of ~8 resident per SM)
DECODE_MAX_SLOTS = 32         # csrc/moe_decode.h kInt4DecodeMaxSlots: T * k of a decode-path call
DECODE_MAX_BYTES = 32 * 1024  # kInt4DecodeMaxBytes: a token's x, or its k * I activations, in bf16

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


# --------------------------------------------------------------------------------------------
# nibble packing (compressed-tensors semantics) and the kernel layout permutation
# --------------------------------------------------------------------------------------------

def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., K/8] -> uint8 [..., K] stored values (q + 8), lowest nibble first."""
    v = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF
    return v.to(torch.uint8).flatten(-2)


def _pack_nibbles(nib: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 8 m] stored values -> int32 [..., m]; nibble i at bits 4i (two's-complement wrap)."""
    v = nib.unflatten(-1, (-1, 8)).to(torch.int64) << (4 * torch.arange(8, device=nib.device))
    v = v.sum(-1)
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def _to_kernel_nibbles(nib: torch.Tensor) -> torch.Tensor:
    """uint8 [E, N, K] -> uint8 [E, N/16, K/64, 128 * 8] in (lane, s, slot) order."""
    E, N, K = nib.shape
    # n = 16 m + 8 a + g ; k = 64 c + 16 s + 8 b + 2 t + cc ; slot = 4 cc + 2 b + a
    v = nib.reshape(E, N // 16, 2, 8, K // 64, 4, 2, 4, 2)
    #               E  m     a  g  c       s  b  t  cc
    v = v.permute(0, 1, 4, 3, 7, 5, 8, 6, 2)  # E m c g t s cc b a
    return v.reshape(E, N // 16, K // 64, 128 * 8)


def _from_kernel_nibbles(knib: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_to_kernel_nibbles`: [E, N/16, K/64, 1024] -> [E, N, K]."""
    E, M, C, _ = knib.shape
    v = knib.reshape(E, M, C, 8, 4, 4, 2, 2, 2)  # E m c g t s cc b a
    v = v.permute(0, 1, 8, 3, 2, 5, 7, 4, 6)     # E m a g c s b t cc
    return v.reshape(E, M * 16, C * 64)


def _to_kernel_scales(scale: torch.Tensor) -> torch.Tensor:
    E, N, G = scale.shape
    return scale.reshape(E, N // 16, 2, 8, G).permute(0, 1, 4, 3, 2).reshape(E, N // 16, G, 16)


def _from_kernel_scales(kscale: torch.Tensor) -> torch.Tensor:
    E, M, G, _ = kscale.shape
    return kscale.reshape(E, M, G, 8, 2).permute(0, 1, 4, 3, 2).reshape(E, M * 16, G)


def int4_unpack(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``kdtree::int4_repack``: kernel layout -> compressed-tensors (packed int32
    [E, N, K/8], scale bf16 [E, N, K/group])."""
    return _pack_nibbles(_from_kernel_nibbles(_unpack_nibbles(qweight).reshape(*qweight.shape[:3], 1024))), \
        _from_kernel_scales(scales)


def int4_dequantize(packed: torch.Tensor, scale: torch.Tensor, group_size: int = 32,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Compressed-tensors ``pack-quantized`` dequantisation: packed int32 [..., N, K/8] and
    scale [..., N, K/group] -> W [..., N, K] = (nibble - 8) * scale, computed in float32 (exact)
    and returned in ``dtype``."""
    check_tensor("int4_dequantize", "packed", packed, torch.int32)
    check_tensor("int4_dequantize", "scale", scale, (torch.bfloat16, torch.float16, torch.float32))
    K = packed.shape[-1] * 8
    if group_size <= 0 or K % group_size or scale.shape[-1] * group_size != K or \
            scale.shape[:-1] != packed.shape[:-1]:
        raise ValueError(f"int4_dequantize: scale shape {tuple(scale.shape)} does not match packed "
                         f"{tuple(packed.shape)} (K = {K}) with group_size {group_size}")
    q = _unpack_nibbles(packed).to(torch.float32) - 8.0
    w = q * scale.to(torch.float32).repeat_interleave(group_size, dim=-1)
    return w.to(dtype)


# --------------------------------------------------------------------------------------------
# int4_repack
# --------------------------------------------------------------------------------------------

def _check_repack(packed, scale, group_size) -> None:
    op = "int4_repack"
    check_tensor(op, "packed", packed, torch.int32, 3)
    check_tensor(op, "scale", scale, torch.bfloat16, 3)
    check_same_device(op, packed=packed, scale=scale)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in GROUP_SIZES:
        raise ValueError(f"{op}: group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    E, N, K8 = packed.shape
    K = 8 * K8
    if N % TILE_N:
        raise ValueError(f"{op}: N = {N} output channels must be a multiple of {TILE_N}")
    if K % TILE_K or K % group_size:
        raise ValueError(f"{op}: K = {K} input channels must be a multiple of {TILE_K} and of the "
                         f"group size {group_size}")
    if tuple(scale.shape) != (E, N, K // group_size):
        raise ValueError(f"{op}: scale must be [E, N, K/group] = {(E, N, K // group_size)} for packed "
                         f"{tuple(packed.shape)} and group_size {group_size}, got {tuple(scale.shape)}")


def int4_repack_reference(packed: torch.Tensor, scale: torch.Tensor, group_size: int):
    """Pure-torch reference (and CPU kernel) of ``kdtree::int4_repack``."""
    _check_repack(packed, scale, group_size)
    E, N, K8 = packed.shape
    if packed.numel() == 0:
        return (packed.new_zeros((E, N // 16, K8 // 8, 128)),
                scale.new_zeros((E, N // 16, scale.shape[2], 16)))
    knib = _to_kernel_nibbles(_unpack_nibbles(packed))
    return _pack_nibbles(knib).contiguous(), _to_kernel_scales(scale).contiguous()


def int4_repack(packed: torch.Tensor, scale: torch.Tensor, group_size: int = 32):
    """Repack one stacked projection into the kernel layout (module docstring), on its device.

    Args:
        packed: int32 [E, N, K/8] compressed-tensors nibbles; N % 16 == 0, K % 64 == 0.
        scale: bf16 [E, N, K/group_size].
        group_size: 32, 64 or 128 (K % group_size == 0).
    Returns (qweight int32 [E, N/16, K/64, 128], scales bf16 [E, N/16, K/group_size, 16]).
    """
    _check_repack(packed, scale, group_size)
    return torch.ops.kdtree.int4_repack(packed, scale, group_size)


class Int4MoEWeights(NamedTuple):
    """Repacked expert weights for :func:`int4_moe` (layout: module docstring).

    w13_qweight int32 [E, 2I/16, H/64, 128] and w13_scales bf16 [E, 2I/16, H/group, 16]: gate
    and up, interleaved by 16 channels; w2_qweight int32 [E, H/16, I/64, 128] and w2_scales bf16
    [E, H/16, I/group, 16]: down.  Keep the four tensors as module buffers and rebuild with
    ``Int4MoEWeights(*buffers, group_size)``.
    """

    w13_qweight: torch.Tensor
    w13_scales: torch.Tensor
    w2_qweight: torch.Tensor
    w2_scales: torch.Tensor
    group_size: int = 32

    @property
    def num_experts(self) -> int:
        return self.w13_qweight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13_qweight.shape[2] * TILE_K

    @property
    def intermediate_size(self) -> int:
        return self.w13_qweight.shape[1] * TILE_N // 2

    def tensors(self) -> dict[str, torch.Tensor]:
        """The four tensors by field name (for ``register_buffer``)."""
        return {"w13_qweight": self.w13_qweight, "w13_scales": self.w13_scales,
                "w2_qweight": self.w2_qweight, "w2_scales": self.w2_scales}

    def compressed(self) -> tuple[torch.Tensor, ...]:
        """Back to compressed-tensors form: (gate_packed, gate_scale, up_packed, up_scale,
        down_packed, down_scale), exactly the values :func:`int4_moe_weights` was given."""
        p13, s13 = int4_unpack(self.w13_qweight, self.w13_scales)
        E, N2, K8 = p13.shape
        p13 = p13.reshape(E, N2 // 32, 2, 16, K8)
        s13 = s13.reshape(E, N2 // 32, 2, 16, -1)
        gate_p, up_p = p13[:, :, 0].reshape(E, N2 // 2, K8), p13[:, :, 1].reshape(E, N2 // 2, K8)
        gate_s, up_s = s13[:, :, 0].reshape(E, N2 // 2, -1), s13[:, :, 1].reshape(E, N2 // 2, -1)
        down_p, down_s = int4_unpack(self.w2_qweight, self.w2_scales)
        return gate_p, gate_s, up_p, up_s, down_p, down_s

    def dequantize(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dequantised (gate [E, I, H], up [E, I, H], down [E, H, I]) in ``dtype``."""
        gp, gs, up, us, dp, ds = self.compressed()
        g = self.group_size
        return (int4_dequantize(gp, gs, g, dtype), int4_dequantize(up, us, g, dtype),
                int4_dequantize(dp, ds, g, dtype))


def int4_layout_fits(hidden_size: int, intermediate_size: int, group_size: int) -> bool:
    """Whether :func:`int4_moe_weights` can repack experts of these sizes for :func:`int4_moe`: H a
    multiple of 128, I of 64, both of the group size (one of 32, 64, 128)."""
    return (group_size in GROUP_SIZES and hidden_size % CTA_N == 0 and intermediate_size % TILE_K == 0
            and hidden_size % group_size == 0 and intermediate_size % group_size == 0)


def int4_moe_weights(gate_packed: torch.Tensor, gate_scale: torch.Tensor, up_packed: torch.Tensor,
                     up_scale: torch.Tensor, down_packed: torch.Tensor, down_scale: torch.Tensor, *,
                     group_size: int = 32) -> Int4MoEWeights:
    """Repack compressed-tensors expert weights (stacked over E experts) for :func:`int4_moe`.

    gate/up: packed int32 [E, I, H/8], scale bf16 [E, I, H/group]; down: packed int32
    [E, H, I/8], scale bf16 [E, H, I/group].  H and I must be multiples of 64 and of the group
    size, and H of 128 (K2: H = 7168, I in {256, 512, 1024, 2048}).  Runs on the tensors' device.
    """
    op = "int4_moe_weights"
    for name, t in (("gate_packed", gate_packed), ("up_packed", up_packed), ("down_packed", down_packed)):
        check_tensor(op, name, t, torch.int32, 3)
    for name, t in (("gate_scale", gate_scale), ("up_scale", up_scale), ("down_scale", down_scale)):
        check_tensor(op, name, t, torch.bfloat16, 3)
    check_same_device(op, gate_packed=gate_packed, gate_scale=gate_scale, up_packed=up_packed,
                      up_scale=up_scale, down_packed=down_packed, down_scale=down_scale)
    E, I, H8 = gate_packed.shape
    H = 8 * H8
    if up_packed.shape != gate_packed.shape or up_scale.shape != gate_scale.shape:
        raise ValueError(f"{op}: up ({tuple(up_packed.shape)}, {tuple(up_scale.shape)}) must match gate "
                         f"({tuple(gate_packed.shape)}, {tuple(gate_scale.shape)})")
    if tuple(down_packed.shape) != (E, H, I // 8) or I % 8:
        raise ValueError(f"{op}: down_packed must be [E, H, I/8] = {(E, H, I // 8)} for gate [E, I, H/8] = "
                         f"{tuple(gate_packed.shape)}, got {tuple(down_packed.shape)}")
    if H % CTA_N or I % TILE_K:
        raise ValueError(f"{op}: H = {H} must be a multiple of {CTA_N} and I = {I} of {TILE_K}")
    # gate/up interleaved by 16 channels (module docstring); repack checks group and scale shapes.
    _check_repack(gate_packed, gate_scale, group_size)
    gs = gate_scale.reshape(E, I // 16, 1, 16, H // group_size)
    us = up_scale.reshape(E, I // 16, 1, 16, H // group_size)
    w13_p = torch.cat([gate_packed.reshape(E, I // 16, 1, 16, H8), up_packed.reshape(E, I // 16, 1, 16, H8)],
                      dim=2).reshape(E, 2 * I, H8)
    w13_s = torch.cat([gs, us], dim=2).reshape(E, 2 * I, H // group_size)
    w13_q, w13_sc = int4_repack(w13_p, w13_s, group_size)
    w2_q, w2_sc = int4_repack(down_packed, down_scale, group_size)
    return Int4MoEWeights(w13_q, w13_sc, w2_q, w2_sc, group_size)


# --------------------------------------------------------------------------------------------
# int4_moe: plan and workspace
# --------------------------------------------------------------------------------------------

class Int4MoEPlan(NamedTuple):
    """Launch parameters of the CUDA kernels for one shape (ignored by the CPU kernel).

    block_size: token rows per expert block; k_splits: split-K factor of the gate/up GEMM;
    workspace_bytes: size of the uint8 workspace :func:`int4_moe_out` needs.
    """

    block_size: int
    k_splits: int
    workspace_bytes: int


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def int4_moe_workspace_bytes(num_tokens: int, topk: int, num_experts: int, hidden_size: int,
                             intermediate_size: int, block_size: int, k_splits: int) -> int:
    """Bytes of the workspace; csrc/moe.cu carves the same regions in the same order, each
    starting on a 256-byte boundary:

    meta int32[4] | sorted_ids int32[R] | block_expert int32[B] | tile_counters int32[B * N1]
    (k_splits > 1) | act bf16[R, I] | partials fp32[k_splits, B, N1, 128 * block_size]
    (k_splits > 1) | y bf16[T * topk, H], with M = T * topk, B = ceil(M / block_size) +
    min(E, M) (a bound on the expert blocks), R = B * block_size, N1 = 2 I / 128.
    """
    M = num_tokens * topk
    B = -(-M // block_size) + min(num_experts, M)
    R = B * block_size
    N1 = 2 * intermediate_size // CTA_N
    split = k_splits > 1
    regions = [16, 4 * R, 4 * B, 4 * B * N1 if split else 0, 2 * R * intermediate_size,
               4 * k_splits * B * N1 * CTA_N * block_size if split else 0, 2 * M * hidden_size]
    return sum(_round_up(r, _ALIGN) for r in regions)


def int4_decode_path_fits(num_tokens: int, topk: int, hidden_size: int, intermediate_size: int) -> bool:
    """Whether a CUDA call of this shape takes the two-launch decode path (csrc/moe_decode.cu's
    ``int4_decode_applies``): T * k <= 32 slots,
    k <= 16, and a token's x and its k * I activations fit the kernels' 32 KB of bf16."""
    return (num_tokens * topk <= DECODE_MAX_SLOTS and topk <= MAX_TOPK and 2 * topk * intermediate_size
            <= DECODE_MAX_BYTES and 2 * hidden_size <= DECODE_MAX_BYTES)


def int4_moe_plan(num_tokens: int, topk: int, num_experts: int, hidden_size: int, intermediate_size: int,
                  device: torch.device | str | None = None) -> Int4MoEPlan:
    """Block size and split-K for a shape.  A pure function of the shape (never of the routing
    or the device), so one CUDA graph serves every routing and the plan can be computed while
    ``torch.compile`` traces; ``device`` is accepted for symmetry and ignored."""
    M = num_tokens * topk
    rows_per_expert = M / max(1, num_experts)
    block_size = 8 if rows_per_expert <= 12 else 16 if rows_per_expert <= 24 else 32 if rows_per_expert <= 48 else 64
    # Enough gate/up work units (expert block x 128 channels x K split) to give every SM of an
    # H200 (132) or RTX PRO 6000 (188) several CTAs.
    units = max(1, min(num_experts, M), -(-M // block_size)) * (2 * intermediate_size // CTA_N)
    k_splits = max(1, min(MAX_K_SPLITS, hidden_size // TILE_K, -(-_TARGET_CTAS // units)))
    return Int4MoEPlan(block_size, k_splits,
                       int4_moe_workspace_bytes(num_tokens, topk, num_experts, hidden_size, intermediate_size,
                                                block_size, k_splits))


# --------------------------------------------------------------------------------------------
# int4_moe: checks and the reference
# --------------------------------------------------------------------------------------------

def _check_moe(x, w13_q, w13_s, w2_q, w2_s, topk_ids, topk_weights, expert_map, group_size,
               block_size, k_splits, op="int4_moe") -> None:
    check_tensor(op, "x", x, (torch.bfloat16, torch.float32), 2)
    if x.dtype != torch.bfloat16 and x.device.type != "cpu":
        raise TypeError(f"{op}: x must be torch.bfloat16 on {x.device.type} (float32 is CPU-only), got {x.dtype}")
    check_tensor(op, "w13_qweight", w13_q, torch.int32, 4)
    check_tensor(op, "w13_scales", w13_s, torch.bfloat16, 4)
    check_tensor(op, "w2_qweight", w2_q, torch.int32, 4)
    check_tensor(op, "w2_scales", w2_s, torch.bfloat16, 4)
    check_tensor(op, "topk_ids", topk_ids, (torch.int32, torch.int64), 2)
    check_tensor(op, "topk_weights", topk_weights, torch.float32, 2)
    tensors = dict(x=x, w13_qweight=w13_q, w13_scales=w13_s, w2_qweight=w2_q, w2_scales=w2_s,
                   topk_ids=topk_ids, topk_weights=topk_weights)
    if expert_map is not None:
        check_tensor(op, "expert_map", expert_map, torch.int32, 1)
        tensors["expert_map"] = expert_map
    check_same_device(op, **tensors)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in GROUP_SIZES:
        raise ValueError(f"{op}: group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"{op}: block_size must be one of {BLOCK_SIZES}, got {block_size!r}")
    T, H = x.shape
    E = w13_q.shape[0]
    I = w13_q.shape[1] * TILE_N // 2
    if H % CTA_N or H % group_size:
        raise ValueError(f"{op}: hidden size H = {H} must be a multiple of {CTA_N} and of the group size {group_size}")
    if I % TILE_K or I % group_size or I == 0:
        raise ValueError(f"{op}: intermediate size I = {I} must be a positive multiple of {TILE_K} and of the "
                         f"group size {group_size}")
    want = {"w13_qweight": (E, 2 * I // 16, H // 64, 128), "w13_scales": (E, 2 * I // 16, H // group_size, 16),
            "w2_qweight": (E, H // 16, I // 64, 128), "w2_scales": (E, H // 16, I // group_size, 16)}
    for name, t in (("w13_qweight", w13_q), ("w13_scales", w13_s), ("w2_qweight", w2_q), ("w2_scales", w2_s)):
        if tuple(t.shape) != want[name]:
            raise ValueError(f"{op}: {name} must be {want[name]} for x [T, H = {H}], E = {E}, I = {I}, "
                             f"group_size {group_size}; got {tuple(t.shape)}")
    k = check_routing(op, topk_ids, topk_weights, T, MAX_TOPK)
    if isinstance(k_splits, bool) or not isinstance(k_splits, int) or not 1 <= k_splits <= min(MAX_K_SPLITS, H // 64):
        raise ValueError(f"{op}: k_splits must be in [1, {min(MAX_K_SPLITS, H // 64)}], got {k_splits!r}")
    if E == 0:
        raise ValueError(f"{op}: at least one expert is needed")
    if not value_checks_active(topk_ids) or topk_ids.numel() == 0:
        return
    num_global = expert_map.shape[0] if expert_map is not None else E
    if ((topk_ids < 0) | (topk_ids >= num_global)).any():
        raise ValueError(f"{op}: topk_ids must be expert ids in [0, {num_global})")
    if k > 1:
        s = topk_ids.sort(dim=1).values
        if (s[:, 1:] == s[:, :-1]).any():
            raise ValueError(f"{op}: topk_ids has a duplicate expert id within a token's top-k")
    if expert_map is not None and ((expert_map < -1) | (expert_map >= E)).any():
        raise ValueError(f"{op}: expert_map values must be local expert indices in [0, {E}) or -1 (not on this rank)")


def _dequant_expert(qweight: torch.Tensor, scales: torch.Tensor, e: int, group_size: int) -> torch.Tensor:
    """Float32 [N, K] weight of expert e straight from the kernel layout."""
    nib = _from_kernel_nibbles(_unpack_nibbles(qweight[e : e + 1]).reshape(1, *qweight.shape[1:3], 1024))[0]
    s = _from_kernel_scales(scales[e : e + 1])[0]
    return (nib.to(torch.float32) - 8.0) * s.to(torch.float32).repeat_interleave(group_size, dim=-1)


def _dequant_all(qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """Float32 [E, N, K] weights of every expert (:func:`_dequant_expert` of each, stacked)."""
    nib = _from_kernel_nibbles(_unpack_nibbles(qweight).reshape(*qweight.shape[:3], 1024))
    s = _from_kernel_scales(scales)
    return (nib.to(torch.float32) - 8.0) * s.to(torch.float32).repeat_interleave(group_size, dim=-1)


# The CPU kernel (_int4_moe_cpu, below the reference) does the reference's arithmetic on float32
# copies of all experts made once per weight tensor: unpacking an expert from the kernel layout (a
# 9-dimensional permutation of its nibbles) took ~0.29 ms for 256 x 256 on a CPU core, and a 17-node
# tree of the default pair routes to all 32 experts of its 4 MoE layers (bench/RESULTS.md, CPU notes
# 2026-12-05).  Kept per weight tensor while it lives and is unchanged (its version counter and
# address), only for tensors whose float32 copy is at most DEQUANT_CACHE_BYTES; larger ones (a real
# K2 layer: 384 experts) and traced calls run the reference itself.
DEQUANT_CACHE_BYTES = 256 << 20
_DEQUANT_CACHE: dict[int, tuple] = {}  # id(qweight) -> (weak reference, key, float32 [E, N, K])


def _forget(ref, i: int) -> None:
    if _DEQUANT_CACHE.get(i, (None,))[0] is ref:
        del _DEQUANT_CACHE[i]


def _cached_stack(qweight: torch.Tensor, scales: torch.Tensor, group_size: int, gate_up: bool) -> torch.Tensor | None:
    """:func:`_dequant_all` of a weight tensor, remembered (see DEQUANT_CACHE_BYTES); None where it
    is not kept.  ``gate_up``: w13's rows reordered from the kernel's interleaved 16-row blocks
    (gate, up, gate, ...) to all gate rows then all up rows, [E, 2I, H]."""
    if qweight.numel() * 8 * 4 > DEQUANT_CACHE_BYTES or torch.compiler.is_compiling():
        return None
    key = (qweight._version, qweight.data_ptr(), scales._version, scales.data_ptr(), group_size, gate_up)
    entry = _DEQUANT_CACHE.get(id(qweight))
    if entry is None or entry[0]() is not qweight or entry[1] != key:
        w = _dequant_all(qweight, scales, group_size)
        if gate_up:
            E, N, K = w.shape
            w = w.reshape(E, N // 32, 2, 16, K).transpose(1, 2).reshape(E, N, K).contiguous()
        entry = (weakref.ref(qweight, lambda ref, i=id(qweight): _forget(ref, i)), key, w)
        _DEQUANT_CACHE[id(qweight)] = entry
    return entry[2]


def int4_moe_reference(x: torch.Tensor, w13_qweight: torch.Tensor, w13_scales: torch.Tensor,
                       w2_qweight: torch.Tensor, w2_scales: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor, expert_map: Optional[torch.Tensor], group_size: int,
                       block_size: int = 8, k_splits: int = 1, shared_gate: Optional[torch.Tensor] = None,
                       shared_up: Optional[torch.Tensor] = None, shared_down: Optional[torch.Tensor] = None,
                       residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Pure-torch reference of ``kdtree::int4_moe``: per used expert, dequantise to float32,
    gate/up matmuls, SiLU(gate) * up, down matmul, scale by the router weight; then sum the top-k
    terms in order j = 0..k-1 in float32 [plus the shared expert's ``down(SiLU(gate x) * up x)`` in
    float32] and round to x's dtype [then add the residual and round again].  Ids that are out of
    range or map to -1 contribute nothing (eager calls reject out-of-range ids first)."""
    _check_moe(x, w13_qweight, w13_scales, w2_qweight, w2_scales, topk_ids, topk_weights, expert_map, group_size,
               block_size, k_splits)
    check_shared_expert("int4_moe", x, shared_gate, shared_up, shared_down, residual)
    T, H = x.shape
    k = topk_ids.shape[1]
    I = w13_qweight.shape[1] * TILE_N // 2
    local = _local_ids(topk_ids, expert_map, w13_qweight.shape[0])
    terms = torch.zeros((T, k, H), dtype=torch.float32, device=x.device)
    xf = x.to(torch.float32)
    for e in torch.unique(local[local >= 0]).tolist():
        rows, js = torch.nonzero(local == e, as_tuple=True)
        w13 = _dequant_expert(w13_qweight, w13_scales, e, group_size).reshape(I // 16, 2, 16, H)
        gate, up = w13[:, 0].reshape(I, H), w13[:, 1].reshape(I, H)
        down = _dequant_expert(w2_qweight, w2_scales, e, group_size)
        xe = xf[rows]
        act = torch.nn.functional.silu(xe @ gate.T) * (xe @ up.T)
        terms[rows, js] = (act @ down.T) * topk_weights[rows, js].unsqueeze(-1)
    return _combine(x, terms, shared_gate, shared_up, shared_down, residual)


def _local_ids(topk_ids: torch.Tensor, expert_map: Optional[torch.Tensor], E: int) -> torch.Tensor:
    """int64 [T, k]: each slot's local expert index, -1 where it contributes nothing (an id out of
    range, or one that ``expert_map`` puts on another rank)."""
    ids = topk_ids.long()
    if expert_map is not None:
        num_global = expert_map.shape[0]
        inside = (ids >= 0) & (ids < num_global)
        local = torch.where(inside, expert_map.long()[ids.clamp(0, num_global - 1)], torch.full_like(ids, -1))
    else:
        local = ids
    return torch.where((local >= 0) & (local < E), local, torch.full_like(local, -1))


def _combine(x, terms, shared_gate, shared_up, shared_down, residual) -> torch.Tensor:
    """The routed terms float32 [T, k, H] summed in order j = 0..k-1, plus the shared expert,
    rounded to x's dtype; then the residual added and rounded again."""
    xf = x.to(torch.float32)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for j in range(terms.shape[1]):
        out += terms[:, j]
    if shared_gate is not None:
        act = torch.nn.functional.silu(xf @ shared_gate.float().T) * (xf @ shared_up.float().T)
        out += act @ shared_down.float().T
    out = out.to(x.dtype)
    return out if residual is None else (residual.float() + out.float()).to(x.dtype)


_GROUPED_MM_CPU: list[bool] = [getattr(torch, "_grouped_mm", None) is not None]  # [False] once it fails here


def _grouped_matmul(a: torch.Tensor, w: torch.Tensor, experts: torch.Tensor, grouped: bool = True) -> torch.Tensor:
    """[S, N] = per row s, ``a[s] @ w[experts[s]].T``, for ``experts`` sorted (rows of one expert
    contiguous): one ``torch._grouped_mm`` over the expert segments, or (``grouped=False``, or where
    this torch's grouped_mm does not run on the CPU) a loop over the segments; each segment is one
    matmul either way."""
    E = w.shape[0]
    offs = torch.bincount(experts, minlength=E).cumsum(0).to(torch.int32)
    if grouped and _GROUPED_MM_CPU[0]:
        try:
            return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)
        except (RuntimeError, NotImplementedError):
            _GROUPED_MM_CPU[0] = False
    out = a.new_empty(a.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = a[start:end] @ w[e].T
        start = end
    return out


def _int4_moe_out_reference(x, w13_qweight, w13_scales, w2_qweight, w2_scales, topk_ids, topk_weights, expert_map,
                            group_size, block_size, k_splits, workspace, out) -> None:
    _check_out(x, workspace, out)
    out.copy_(_int4_moe_cpu(x, w13_qweight, w13_scales, w2_qweight, w2_scales, topk_ids, topk_weights, expert_map,
                            group_size, block_size, k_splits))


def _check_out(x, workspace, out, needed: int | None = None) -> None:
    op = "int4_moe_out"
    check_tensor(op, "out", out, x.dtype, 2)
    check_tensor(op, "workspace", workspace, torch.uint8, 1)
    check_same_device(op, x=x, out=out, workspace=workspace)
    if tuple(out.shape) != tuple(x.shape):
        raise ValueError(f"{op}: out must be [T, H] = {tuple(x.shape)}, got {tuple(out.shape)}")
    if needed is not None and workspace.numel() < needed:
        raise ValueError(f"{op}: workspace has {workspace.numel()} bytes, this shape needs {needed} "
                         f"(int4_moe_plan(...).workspace_bytes)")


# --------------------------------------------------------------------------------------------
# int4_moe: public wrappers
# --------------------------------------------------------------------------------------------

def _plan_for(x: torch.Tensor, weights: Int4MoEWeights, topk_ids: torch.Tensor) -> Int4MoEPlan:
    return int4_moe_plan(x.shape[0], topk_ids.shape[1] if topk_ids.dim() == 2 else 1, weights.num_experts,
                         x.shape[1], weights.intermediate_size, x.device)


def int4_moe(x: torch.Tensor, weights: Int4MoEWeights, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
             expert_map: Optional[torch.Tensor] = None,
             shared: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
             residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Routed-expert MLP with INT4 weights: out[t] = sum_j topk_weights[t, j] *
    down_e(SiLU(gate_e(x[t])) * up_e(x[t])) with e = topk_ids[t, j].

    Args:
        x: [T, H] bf16 (float32 also on CPU); out has x's dtype.
        weights: :class:`Int4MoEWeights` from :func:`int4_moe_weights`, E local experts.
        topk_ids: int32 (or int64) [T, k], 1 <= k <= 16, expert ids, distinct within a token;
            global ids in [0, len(expert_map)) when ``expert_map`` is given, else in [0, E).
        topk_weights: float32 [T, k] router weights (already normalised and scaled).
        expert_map: optional int32 [E_global]: global id -> local expert index, or -1 for experts
            not on this rank (they contribute nothing).
        shared: optional shared expert (gate [Is, H], up [Is, H], down [H, Is], x's dtype), added
            with weight 1 before the output is rounded.  On CUDA, decode-sized calls (the two-launch
            decode path) compute it inside their launches.
        residual: optional [T, H] in x's dtype, added after rounding: ``residual + out``, rounded
            again (the decoder layer's residual add).
    Sum over j in a fixed order, so results are deterministic.  Allocates its workspace; use
    :func:`int4_moe_out` with a caller-owned workspace on the hot path.
    """
    plan = _plan_for(x, weights, topk_ids)
    _check_moe(x, *weights[:4], topk_ids, topk_weights, expert_map, weights.group_size, plan.block_size,
               plan.k_splits)
    if shared is not None and (not isinstance(shared, (tuple, list)) or len(shared) != 3):
        raise ValueError("int4_moe: shared must be a (gate, up, down) tuple of tensors")
    sg, su, sd = shared if shared is not None else (None, None, None)
    check_shared_expert("int4_moe", x, sg, su, sd, residual)
    return torch.ops.kdtree.int4_moe(x, *weights[:4], topk_ids, topk_weights, expert_map, weights.group_size,
                                     plan.block_size, plan.k_splits, sg, su, sd, residual)


def int4_moe_workspace(num_tokens: int, topk: int, weights: Int4MoEWeights,
                       device: torch.device | str | None = None) -> torch.Tensor:
    """A uint8 workspace large enough for :func:`int4_moe_out` at (num_tokens, topk)."""
    device = torch.device(device) if device is not None else weights.w13_qweight.device
    plan = int4_moe_plan(num_tokens, topk, weights.num_experts, weights.hidden_size, weights.intermediate_size,
                         device)
    return torch.empty(plan.workspace_bytes, dtype=torch.uint8, device=device)


def int4_moe_out(x: torch.Tensor, weights: Int4MoEWeights, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 out: torch.Tensor, workspace: torch.Tensor, *, expert_map: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`int4_moe` (without the shared expert and residual) writing into ``out`` ([T, H], x's
    dtype) with the caller's uint8 ``workspace`` (from :func:`int4_moe_workspace` for this T and k);
    no allocation, no host synchronisation on CUDA (CUDA-graph safe).  Returns ``out``."""
    plan = _plan_for(x, weights, topk_ids)
    _check_moe(x, *weights[:4], topk_ids, topk_weights, expert_map, weights.group_size, plan.block_size,
               plan.k_splits, op="int4_moe_out")
    _check_out(x, workspace, out, plan.workspace_bytes if x.device.type == "cuda" else None)
    torch.ops.kdtree.int4_moe_out(x, *weights[:4], topk_ids, topk_weights, expert_map, weights.group_size,
                                  plan.block_size, plan.k_splits, workspace, out)
    return out


# --------------------------------------------------------------------------------------------
# registration: CPU kernels (the references) and fake kernels
# --------------------------------------------------------------------------------------------

torch.library.register_kernel("kdtree::int4_repack", "cpu", int4_repack_reference)
def _int4_moe_cpu(x, w13_qweight, w13_scales, w2_qweight, w2_scales, topk_ids, topk_weights, expert_map, group_size,
                  block_size=8, k_splits=1, shared_gate=None, shared_up=None, shared_down=None, residual=None):
    """The CPU kernel: the reference's arithmetic over the remembered float32 experts
    (:func:`_cached_stack`), the slots sorted by expert and each of the three matmuls of the
    reference done as one matmul per used expert segment (gate and up together: the same dot
    products); the reference itself where the weights are not kept."""
    w13 = _cached_stack(w13_qweight, w13_scales, group_size, gate_up=True)
    w2 = _cached_stack(w2_qweight, w2_scales, group_size, gate_up=False) if w13 is not None else None
    if w2 is None:
        return int4_moe_reference(x, w13_qweight, w13_scales, w2_qweight, w2_scales, topk_ids, topk_weights,
                                  expert_map, group_size, block_size, k_splits, shared_gate, shared_up, shared_down,
                                  residual)
    _check_moe(x, w13_qweight, w13_scales, w2_qweight, w2_scales, topk_ids, topk_weights, expert_map, group_size,
               block_size, k_splits)
    check_shared_expert("int4_moe", x, shared_gate, shared_up, shared_down, residual)
    T, H = x.shape
    k, I = topk_ids.shape[1], w2.shape[2]
    flat = _local_ids(topk_ids, expert_map, w13.shape[0]).reshape(-1)
    used = torch.nonzero(flat >= 0).squeeze(1)
    order = used[torch.argsort(flat[used], stable=True)]
    terms = torch.zeros((T * k, H), dtype=torch.float32, device=x.device)
    if order.numel():
        experts = flat[order]
        h = _grouped_matmul(x.to(torch.float32)[order // k], w13, experts)
        act = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
        terms[order] = _grouped_matmul(act, w2, experts) * topk_weights.reshape(-1)[order].unsqueeze(-1)
    return _combine(x, terms.view(T, k, H), shared_gate, shared_up, shared_down, residual)


torch.library.register_kernel("kdtree::int4_moe", "cpu", _int4_moe_cpu)
torch.library.register_kernel("kdtree::int4_moe_out", "cpu", _int4_moe_out_reference)


@torch.library.register_fake("kdtree::int4_repack")
def _(packed, scale, group_size):
    E, N, K8 = packed.shape
    return (packed.new_empty((E, N // 16, K8 // 8, 128)),
            scale.new_empty((E, N // 16, scale.shape[2], 16)))


@torch.library.register_fake("kdtree::int4_moe")
def _(x, w13_qweight, w13_scales, w2_qweight, w2_scales, topk_ids, topk_weights, expert_map, group_size,
      block_size, k_splits, shared_gate=None, shared_up=None, shared_down=None, residual=None):
    return x.new_empty(x.shape)


@torch.library.register_fake("kdtree::int4_moe_out")
def _(x, w13_qweight, w13_scales, w2_qweight, w2_scales, topk_ids, topk_weights, expert_map, group_size,
      block_size, k_splits, workspace, out):
    return None
