"""Tensors whose dtype is part of their meaning: they follow device moves, not dtype casts."""
from __future__ import annotations

from torch import nn


class FixedDtype(nn.Module):
    """A module whose tensors named by :meth:`fixed_dtype_names` follow ``.to(device)`` moves but
    not ``.to(dtype)`` / ``.half()`` / ``.float()`` casts of the model: the routing weight and bias
    (fp32; a bf16 bias flips near-tied expert choices), RoPE's inverse frequencies (fp32; bf16
    would shift every angle) and INT4 expert scales (bf16, as the kernel reads them)."""

    fixed_dtype: tuple[str, ...] = ()

    def fixed_dtype_names(self) -> tuple[str, ...]:
        return self.fixed_dtype

    def _apply(self, fn, recurse=True):
        kept = {name: getattr(self, name).data for name in self.fixed_dtype_names()}
        super()._apply(fn, recurse)
        for name, old in kept.items():
            new = getattr(self, name)
            if new.dtype != old.dtype:
                restored = old.to(device=new.device)  # follow the move, undo the cast
                if name in self._parameters:
                    self._parameters[name].data = restored
                else:
                    self._buffers[name] = restored
        return self
