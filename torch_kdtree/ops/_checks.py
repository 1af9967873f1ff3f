"""Input validation shared by the op wrappers and the CPU reference kernels.

Structural checks (dtype, device, rank, shape, ranges of scalar arguments) never touch tensor
data and always run.  Value checks (NaN, sortedness, index ranges) read tensor data, which on a
GPU means a host synchronisation: they run in eager mode only, never while ``torch.compile``
traces or a CUDA graph is being captured, and can be switched off for a hot loop with
:func:`set_value_checks`.  The CUDA kernels never read or write out of bounds on bad values.
"""
from __future__ import annotations

import contextlib

import torch

_VALUE_CHECKS = True


def set_value_checks(enabled: bool) -> None:
    """Turn the eager value checks (which synchronise with the GPU) on or off globally."""
    global _VALUE_CHECKS
    _VALUE_CHECKS = bool(enabled)


@contextlib.contextmanager
def value_checks(enabled: bool):
    """Context manager form of :func:`set_value_checks`."""
    global _VALUE_CHECKS
    old = _VALUE_CHECKS
    _VALUE_CHECKS = bool(enabled)
    try:
        yield
    finally:
        _VALUE_CHECKS = old


def value_checks_active(t: torch.Tensor) -> bool:
    if not _VALUE_CHECKS or torch.compiler.is_compiling():
        return False
    if t.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    if isinstance(t, torch._subclasses.fake_tensor.FakeTensor) or t.device.type == "meta":
        return False
    return True


def check_tensor(op: str, name: str, t, dtypes, dim: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if isinstance(dtypes, torch.dtype):
        dtypes = (dtypes,)
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{op}: {name} must be {want}, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{op}: {name} must have {dim} dimensions, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous")


def check_same_device(op: str, **tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"{op}: all inputs must be on one device, got {listing}")


def check_routing(op: str, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_tokens: int, max_topk: int) -> int:
    """Shapes of a MoE routing: ids and weights both [T, k] with 1 <= k <= max_topk; returns k."""
    if topk_ids.shape[0] != num_tokens or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"{op}: topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [T = {num_tokens}, k]")
    k = topk_ids.shape[1]
    if not 1 <= k <= max_topk:
        raise ValueError(f"{op}: top-k must be in [1, {max_topk}], got {k}")
    return k


def check_shared_expert(op: str, x: torch.Tensor, shared_gate, shared_up, shared_down, residual) -> int:
    """The optional shared expert of ``moe_gemv`` / ``int4_moe`` (all three or none: gate / up
    [Is, H], down [H, Is] in x's dtype, Is a positive multiple of 8, on x's device) and the optional
    residual ([T, H], x's dtype).  Returns Is (0 without a shared expert)."""
    T, H = x.shape
    shared = (shared_gate, shared_up, shared_down)
    Is = 0
    if any(t is not None for t in shared):
        if any(t is None for t in shared):
            raise ValueError(f"{op}: shared_gate, shared_up and shared_down come together")
        for name, t in zip(("shared_gate", "shared_up", "shared_down"), shared):
            check_tensor(op, name, t, x.dtype, 2)
        check_same_device(op, x=x, shared_gate=shared_gate, shared_up=shared_up, shared_down=shared_down)
        Is = shared_gate.shape[0]
        if (tuple(shared_gate.shape) != (Is, H) or tuple(shared_up.shape) != (Is, H)
                or tuple(shared_down.shape) != (H, Is) or Is == 0 or Is % 8):
            raise ValueError(f"{op}: shared_gate / shared_up must be [Is, H = {H}] and shared_down [H, Is] with Is a "
                             f"positive multiple of 8, got {tuple(shared_gate.shape)}, {tuple(shared_up.shape)}, "
                             f"{tuple(shared_down.shape)}")
    if residual is not None:
        check_tensor(op, "residual", residual, x.dtype, 2)
        check_same_device(op, x=x, residual=residual)
        if tuple(residual.shape) != (T, H):
            raise ValueError(f"{op}: residual must be [T, H] = {(T, H)}, got {tuple(residual.shape)}")
    return Is


def check_route_logits(op: str, route_logits, x: torch.Tensor, topk_ids: torch.Tensor) -> None:
    """The optional ``route_logits`` of ``moe_gemv`` (a launch-order hint): the fp32
    logits [T, E] that ``kdtree::moe_route`` chose ``topk_ids`` from, on x's device."""
    if route_logits is None:
        return
    if not isinstance(route_logits, torch.Tensor):
        raise TypeError(f"{op}: route_logits must be a tensor or None, got {type(route_logits).__name__}")
    check_same_device(op, x=x, route_logits=route_logits)
    if route_logits.dtype != torch.float32 or route_logits.dim() != 2 or route_logits.shape[0] != topk_ids.shape[0]:
        raise ValueError(f"{op}: route_logits must be float32 [T = {topk_ids.shape[0]}, E] (moe_route's logits), got "
                         f"{route_logits.dtype} {tuple(route_logits.shape)}")
