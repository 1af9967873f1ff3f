"""Small random DFlash drafters in the public checkpoint format (for tests and demos)."""
from __future__ import annotations

import os

import torch

from .configuration import DFlashConfig, default_target_layer_ids
from .modeling import DFlashDraftModel

# A tiny drafter for a tiny target: every shape distinct so that a transposed weight shows.
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=96, vocab_size=256, mask_token_id=255, num_target_layers=8, block_size=4,
            rms_norm_eps=1e-5, max_position_embeddings=4096)


def random_drafter(config: DFlashConfig | None = None, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                   **fields) -> DFlashDraftModel:
    """A drafter with random weights: linear weights ~ N(0, 1/fan_in), norm weights ~ 1 + N(0, 0.1^2)
    (not all ones, so a norm applied to the wrong tensor changes the output).

    ``config`` or ``fields`` (any :class:`DFlashConfig` field, defaults :data:`TINY`; ``target_layer_ids``
    defaults to DFlash's rule for ``num_target_layers``)."""
    if config is None:
        values = {**TINY, **fields}
        if "target_layer_ids" not in values:
            values["target_layer_ids"] = default_target_layer_ids(values["num_target_layers"],
                                                                   values["num_hidden_layers"])
        config = DFlashConfig(**values)
    elif fields:
        raise ValueError("random_drafter: pass a config or fields, not both")
    gen = torch.Generator().manual_seed(seed)
    model = DFlashDraftModel(config, dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                value = 1 + 0.1 * torch.randn(p.shape, generator=gen)
            else:
                value = torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5
            p.copy_(value.to(dtype))
    return model


def write_random_drafter(path: str | os.PathLike, config: DFlashConfig | None = None, *, seed: int = 0,
                         dtype: torch.dtype = torch.bfloat16, **fields) -> DFlashConfig:
    """Write a random drafter (``config.json`` + ``model.safetensors``) to ``path``; returns its config."""
    model = random_drafter(config, seed=seed, dtype=dtype, **fields)
    model.save_pretrained(path)
    return model.config
