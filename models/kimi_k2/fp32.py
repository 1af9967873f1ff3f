"""Tensors that must stay fp32 whatever dtype the model is cast to."""
from __future__ import annotations

import torch
from torch import nn


class KeepFp32(nn.Module):
    """A module whose tensors named in ``fp32_names`` follow ``.to(device)`` moves but not
    ``.to(dtype)`` / ``.half()`` casts: the routing weight and bias (a bf16 bias flips near-tied
    expert choices) and RoPE's inverse frequencies (bf16 would shift every angle)."""

    fp32_names: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        kept = {name: getattr(self, name).data for name in self.fp32_names}
        super()._apply(fn, recurse)
        for name, old in kept.items():
            new = getattr(self, name)
            if old.dtype == torch.float32 and new.dtype != torch.float32 and new.is_floating_point():
                restored = old.to(device=new.device)  # follow the move, undo the cast
                if name in self._parameters:
                    self._parameters[name].data = restored
                else:
                    self._buffers[name] = restored
        return self
