"""INT4 routed experts: the group-32 symmetric quantiser, its fake-quantised form for training,
and the compressed-tensors tensors the checkpoint stores.

One quantiser serves both: ``scale = bf16(absmax(group) / 7)``, ``q = clamp(round(w / scale),
-8, 7)`` per 32 consecutive inputs of each output row.  The scale is rounded to bf16 *before* q is
computed, as the checkpoint stores it, so the fake-quantised weights seen in training are exactly
the weights ``int4_dequantize`` rebuilds from the exported checkpoint (checked in the tests).

Quantisation-aware training uses the straight-through estimator by swapping weights: inside
:func:`fake_quantized` the experts' weights hold their quantised values for the forward *and* the
backward, so the gradient is taken at the quantised point and applied, unchanged, to the latent
full-precision weights restored on exit.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from torch_kdtree.models.kimi_k2.checkpoint_files import INT4_GROUP_SIZE
from torch_kdtree.models.kimi_k2.writer import compressed_tensors_layout

QMIN, QMAX = -8, 7


def quantize_int4(w: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., out, in] -> (q int8 [..., out, in] in [-8, 7], scale bf16 [..., out, in / group_size])."""
    if w.shape[-1] % group_size:
        raise ValueError(f"quantize_int4: the input dimension {w.shape[-1]} is not a multiple of {group_size}")
    groups = w.detach().float().unflatten(-1, (-1, group_size))
    scale = (groups.abs().amax(-1) / QMAX).clamp_min(torch.finfo(torch.bfloat16).tiny).to(torch.bfloat16)
    q = torch.round(groups / scale.float()[..., None]).clamp(QMIN, QMAX)
    return q.flatten(-2).to(torch.int8), scale


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    group = q.shape[-1] // scale.shape[-1]
    return (q.float().unflatten(-1, (-1, group)) * scale.float()[..., None]).flatten(-2).to(dtype)


def fake_quantize(w: torch.Tensor) -> torch.Tensor:
    """The weights the INT4 checkpoint will hold, in ``w``'s dtype."""
    return dequantize_int4(*quantize_int4(w), dtype=w.dtype)


def expert_weights(model) -> list[torch.nn.Parameter]:
    """The dense routed-expert stacks (gate / up [E, I, H], down [E, H, I]) of every MoE layer."""
    out = []
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            out += [experts.gate_proj, experts.up_proj, experts.down_proj]
    return out


@contextmanager
def fake_quantized(params):
    """Within the block ``params`` hold their fake-quantised values; on exit the latent weights
    come back.  Run the forward and the backward inside (straight-through estimator)."""
    latent = [p.data.clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.data.copy_(fake_quantize(p.data))
    try:
        yield
    finally:
        with torch.no_grad():
            for p, w in zip(params, latent):
                p.data.copy_(w)


def compressed_tensors(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The three tensors compressed-tensors stores for one projection w [out, in]
    (``weight_packed``, ``weight_scale``, ``weight_shape``), packed by the checkpoint writer."""
    return compressed_tensors_layout(*quantize_int4(w))


__all__ = ["quantize_int4", "dequantize_int4", "fake_quantize", "fake_quantized", "expert_weights",
           "compressed_tensors", "QMIN", "QMAX"]
