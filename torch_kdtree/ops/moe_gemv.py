"""bf16 routed experts for decode-sized batches: ``kdtree::moe_gemv``.

``out[t] = Σ_j topk_weights[t, j] · down_e(silu(gate_e(x[t])) · up_e(x[t]))`` with
``e = topk_ids[t, j]``, for experts stacked as ``gate_proj`` / ``up_proj`` [E, I, H] and
``down_proj`` [E, H, I] (the model's dense expert storage; transformers' fused ``gate_up_proj``
is their concatenation along dim 1).  Optionally plus a shared expert with weight 1
(``shared_gate`` / ``shared_up`` [Is, H], ``shared_down`` [H, Is]: nn.Linear weights), computed
in the same two launches; optionally plus a ``residual`` [T, H] (the decoder layer's residual add,
after the rounding: ``bf16(residual + out)``).

Rounding points (the CUDA kernel and this reference agree on them; sums are fp32):
``g = bf16(x·gate_e)``, ``u = bf16(x·up_e)``, ``a = bf16(silu(g)·u)`` (the activations a bf16
GEMM path would store), then ``out = bf16(Σ_j w_j · (a_j·down_e_j) [+ a_s·shared_down])`` with the down products and
their weighted sum in fp32 (as ``kdtree::int4_moe``; the shared term added last).  Deterministic: a fixed summation order.
Ids outside [0, E) contribute nothing (eager calls reject them first).

The CUDA kernel (csrc/moe_gemv.cu) is a GEMV per (token, slot) that streams each touched
expert's rows once: made for a few tokens (decode, T·k up to a few dozen); larger batches share
experts and belong to a grouped GEMM.  The CPU kernel is :func:`moe_gemv_reference`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import (check_route_logits, check_routing, check_same_device, check_shared_expert, check_tensor,
                      value_checks_active)

MAX_TOPK = 16
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(x, gate_proj, up_proj, down_proj, topk_ids, topk_weights, shared_gate=None, shared_up=None,
           shared_down=None, residual=None, op="moe_gemv") -> None:
    check_tensor(op, "x", x, _DTYPES, 2)
    for name, t in (("gate_proj", gate_proj), ("up_proj", up_proj), ("down_proj", down_proj)):
        check_tensor(op, name, t, x.dtype, 3)
    if x.device.type != "cpu" and x.dtype != torch.bfloat16:
        raise TypeError(f"{op}: x and the expert weights must be torch.bfloat16 on {x.device.type} "
                        f"(other float dtypes are CPU-only), got {x.dtype}")
    check_tensor(op, "topk_ids", topk_ids, torch.int32, 2)
    check_tensor(op, "topk_weights", topk_weights, torch.float32, 2)
    check_same_device(op, x=x, gate_proj=gate_proj, up_proj=up_proj, down_proj=down_proj, topk_ids=topk_ids,
                      topk_weights=topk_weights)
    T, H = x.shape
    E, I = gate_proj.shape[:2]
    if tuple(gate_proj.shape) != (E, I, H) or tuple(up_proj.shape) != (E, I, H):
        raise ValueError(f"{op}: gate_proj and up_proj must be [E, I, H = {H}], got {tuple(gate_proj.shape)} and "
                         f"{tuple(up_proj.shape)}")
    if tuple(down_proj.shape) != (E, H, I):
        raise ValueError(f"{op}: down_proj must be [E, H, I] = {(E, H, I)}, got {tuple(down_proj.shape)}")
    if E == 0 or I == 0 or H == 0 or H % 8 or I % 8:
        raise ValueError(f"{op}: needs E >= 1 experts and H, I positive multiples of 8, got E = {E}, H = {H}, I = {I}")
    k = check_routing(op, topk_ids, topk_weights, T, MAX_TOPK)
    if T > 65535 or T * k > 65535:
        raise ValueError(f"{op}: at most 65535 tokens and token-slots, got T = {T}, k = {k}")
    if value_checks_active(topk_ids) and topk_ids.numel() and ((topk_ids < 0) | (topk_ids >= E)).any():
        raise ValueError(f"{op}: topk_ids must be expert ids in [0, {E})")
    if check_shared_expert(op, x, shared_gate, shared_up, shared_down, residual) and T * (k + 1) > 65535:
        raise ValueError(f"{op}: at most 65535 token-slots with the shared expert, got T = {T}")


def _activation(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """bf16(silu(bf16(x·gate)) · bf16(x·up)) (in x's dtype), as fp32."""
    dt = x.dtype
    g = (x.float() @ gate.float().T).to(dt).float()
    u = (x.float() @ up.float().T).to(dt).float()
    return (F.silu(g) * u).to(dt).float()


def moe_gemv_reference(x: torch.Tensor, gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor,
                       topk_ids: torch.Tensor, topk_weights: torch.Tensor, shared_gate: torch.Tensor | None = None,
                       shared_up: torch.Tensor | None = None, shared_down: torch.Tensor | None = None,
                       residual: torch.Tensor | None = None,
                       route_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch reference (and CPU kernel) of ``kdtree::moe_gemv``: per used expert, fp32
    matmuls with the rounding points of the module docstring; the top-k terms summed in order,
    then the shared expert's; the residual added to the rounded sum.  ``route_logits`` is a launch
    hint for the CUDA kernel and changes nothing here (it is only checked)."""
    _check(x, gate_proj, up_proj, down_proj, topk_ids, topk_weights, shared_gate, shared_up, shared_down, residual)
    check_route_logits("moe_gemv", route_logits, x, topk_ids)
    T, H = x.shape
    E, k = gate_proj.shape[0], topk_ids.shape[1]
    dt = x.dtype
    ids = topk_ids.long()
    ys = torch.zeros((T, k, H), dtype=torch.float32, device=x.device)
    valid = (ids >= 0) & (ids < E)
    for e in torch.unique(ids[valid]).tolist():
        rows, js = torch.nonzero(ids == e, as_tuple=True)
        ys[rows, js] = _activation(x[rows], gate_proj[e], up_proj[e]) @ down_proj[e].float().T
    w = torch.where(valid, topk_weights, torch.zeros_like(topk_weights))
    out = torch.zeros((T, H), dtype=torch.float32, device=x.device)
    for j in range(k):
        out += w[:, j, None] * ys[:, j]
    if shared_gate is not None:
        out += _activation(x, shared_gate, shared_up) @ shared_down.float().T
    if residual is not None:
        return (residual.float() + out.to(dt).float()).to(dt)
    return out.to(dt)


def moe_gemv(x: torch.Tensor, gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor,
             topk_ids: torch.Tensor, topk_weights: torch.Tensor, shared_gate: torch.Tensor | None = None,
             shared_up: torch.Tensor | None = None, shared_down: torch.Tensor | None = None,
             residual: torch.Tensor | None = None, route_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Routed-expert MLP with dense (bf16 on CUDA) weights, one GEMV per (token, slot).

    Args:
        x: [T, H]; bf16 on CUDA (bf16 / fp16 / fp32 on CPU). out has x's dtype.
        gate_proj, up_proj: [E, I, H] in x's dtype; down_proj: [E, H, I]. H and I multiples of 8.
        topk_ids: int32 [T, k], 1 <= k <= 16, expert ids in [0, E).
        topk_weights: float32 [T, k] router weights (already normalised and scaled).
        shared_gate, shared_up: [Is, H], shared_down: [H, Is] (all three or none): a shared expert
            added with weight 1. Is a multiple of 8.
        residual: [T, H] in x's dtype: returns ``residual + out`` (one rounding after each).
        route_logits: a launch-order hint that lets the CUDA kernel run the shared expert early;
            the result is the same bits either way.  Pass the fp32 logits [T, E] from which the
            ``kdtree::moe_route`` launched *just before* this op chose ``topk_ids``, and only when x
            was complete before that moe_route ran (e.g. x written by the kernel that produced the
            logits; moe_route lets the next kernel launch only after its own programmatic-launch
            wait, so everything before it is then done).  The shared expert's gate/up blocks then
            run whole without waiting for moe_route: they read x and write their activations
            while it runs.  Holding the logits (moe_route's only non-weight input) through the op
            keeps the op's new buffers from taking memory moe_route still reads.  Never pass it
            when another kernel runs between moe_route and this op, or when x comes from moe_route
            or later.
    No host synchronisation on CUDA (CUDA-graph safe); deterministic.
    """
    _check(x, gate_proj, up_proj, down_proj, topk_ids, topk_weights, shared_gate, shared_up, shared_down, residual)
    check_route_logits("moe_gemv", route_logits, x, topk_ids)
    return torch.ops.kdtree.moe_gemv(x, gate_proj, up_proj, down_proj, topk_ids, topk_weights, shared_gate, shared_up,
                                     shared_down, residual, route_logits)


torch.library.register_kernel("kdtree::moe_gemv", "cpu", moe_gemv_reference)


@torch.library.register_fake("kdtree::moe_gemv")
def _(x, gate_proj, up_proj, down_proj, topk_ids, topk_weights, shared_gate=None, shared_up=None, shared_down=None,
      residual=None, route_logits=None):
    return x.new_empty(x.shape)


__all__ = ["moe_gemv", "moe_gemv_reference", "MAX_TOPK"]
