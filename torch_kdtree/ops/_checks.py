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
