"""Writing the trained pair in the formats real checkpoints use.

Target: a K2-Thinking-style directory — ``config.json`` (the K2 fields, ``model_type: kimi_k2``,
compressed-tensors ``quantization_config``), one ``model.safetensors`` with DeepSeek-V3 tensor
names, routed experts per expert as ``weight_packed`` / ``weight_scale`` / ``weight_shape``
(packed by models/kimi_k2/writer.py's helpers), everything else bf16 and
``e_score_correction_bias`` fp32 — plus ``generation_config.json`` and the tokenizer.
Drafter: the public DFlash format (``DFlashDraftModel.save_pretrained``: config.json with
``dflash_config``, model.safetensors in bf16).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import GenerationConfig

from torch_kdtree.models.dflash import DFlashDraftModel
from torch_kdtree.models.kimi_k2.checkpoint_files import CONFIG_NAME, EXPERT_PROJECTIONS, SINGLE_FILE
from torch_kdtree.models.kimi_k2.writer import k2_config_dict

from .quant import compressed_tensors

_EXPERT_STACK = ".mlp.experts."


def target_tensors(model) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of a trained dense-expert target: experts unstacked and INT4-packed."""
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu()
        stem, _, proj = name.rpartition(".")
        if _EXPERT_STACK in name + "." and proj in EXPERT_PROJECTIONS:  # "...mlp.experts.gate_proj" [E, out, in]
            for e in range(t.shape[0]):
                for key, value in compressed_tensors(t[e]).items():
                    out[f"{stem}.{e}.{proj}.{key}"] = value
        elif name.endswith("e_score_correction_bias"):
            out[name] = t.float()
        else:
            out[name] = t.to(torch.bfloat16)
    return {k: v.contiguous() for k, v in out.items()}


def target_config_json(recipe, vocab_size: int) -> dict:
    """The target's config.json: K2-Thinking's fields and quantization_config at the recipe's sizes
    (no auto_map: the directory ships no remote code; torch_kdtree registers ``kimi_k2``)."""
    config = k2_config_dict({**recipe.target, "vocab_size": vocab_size, "torch_dtype": "bfloat16"}, int4=True,
                            small=False)
    config.pop("auto_map", None)
    config["transformers_version"] = transformers.__version__
    return config


def write_target(model, recipe, tokenizer, directory: str | Path) -> dict:
    """Write the INT4 target checkpoint and tokenizer to ``directory``; returns its config.json."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = target_config_json(recipe, len(tokenizer))
    (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file(target_tensors(model), str(directory / SINGLE_FILE), metadata={"format": "pt"})
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return config


def write_drafter(drafter, directory: str | Path) -> None:
    """Write the drafter in the public DFlash format, in bf16 (a copy: the trained module keeps its dtype)."""
    out = DFlashDraftModel(copy.deepcopy(drafter.config), dtype=torch.bfloat16, device="cpu")
    out.load_state_dict({k: v.detach().to("cpu", torch.bfloat16) for k, v in drafter.state_dict().items()})
    out.save_pretrained(directory)


def directory_bytes(directory: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())


__all__ = ["target_tensors", "target_config_json", "write_target", "write_drafter", "directory_bytes"]
