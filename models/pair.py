"""The default target / drafter pair that ``python -m training.run`` trains (issue 48).

``models/default_pair/`` holds ``target/`` (a small Kimi K2-architecture checkpoint with INT4
routed experts and its tokenizer), ``drafter/`` (its DFlash drafter) and the model card; both
load through the same ``from_pretrained`` as real K2.x and DFlash checkpoints.
"""
from __future__ import annotations

from pathlib import Path

import torch

DEFAULT_PAIR_DIR = Path(__file__).resolve().parent / "default_pair"
CREATE_COMMAND = "python -m training.run --out models/default_pair --device cuda"


def load_default_pair(device=None, dtype: torch.dtype | None = None, *, path: str | Path | None = None):
    """(target, drafter, tokenizer) of the trained default pair.

    ``device``: where both models go (default: the CPU).  ``dtype``: their dtype (default: fp32 on
    the CPU, where DDTree equals autoregressive decoding token for token, and bf16, the stored
    dtype, elsewhere).  ``path``: another directory written by ``python -m training.run``.
    Raises ``FileNotFoundError`` naming the command that creates the pair when it is missing.
    """
    from transformers import AutoTokenizer

    from .dflash import DFlashDraftModel
    from .kimi_k2 import KimiK2ForCausalLM

    root = Path(path) if path is not None else DEFAULT_PAIR_DIR
    missing = _missing(root)
    if missing:
        raise FileNotFoundError(f"no trained default pair at {root} (missing {', '.join(missing)}); "
                                f"create it with: {CREATE_COMMAND}  (python -m training.run --toy --out DIR makes a "
                                f"toy pair in seconds on a CPU: load_default_pair(path=DIR))")
    device = torch.device(device) if device is not None else torch.device("cpu")
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    target = KimiK2ForCausalLM.from_pretrained(root / "target", dtype=dtype, device=device, progress=False)
    drafter = DFlashDraftModel.from_pretrained(root / "drafter", dtype=dtype, device=device)
    tokenizer = AutoTokenizer.from_pretrained(str(root / "target"))
    return target, drafter, tokenizer


def default_prompts(path: str | Path | None = None) -> list[str]:
    """The held-out code prompts ``python -m training.run`` wrote beside the pair (``prompts.json``:
    a ``def`` of a held-out standard-library file and the lines after it); [] when there are none."""
    import json

    root = Path(path) if path is not None else DEFAULT_PAIR_DIR
    file = root / "prompts.json"
    if not file.is_file():
        return []
    return [p["text"] for p in json.loads(file.read_text(encoding="utf-8"))["prompts"]]


def prompt_ids(tokenizer, text: str) -> list[int]:
    """``text``'s token ids as the pair saw its files in training: ``<bos>`` (where the tokenizer
    has one), then the text, no other special tokens."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return bos + tokenizer(text, add_special_tokens=False)["input_ids"]


def has_default_pair(path: str | Path | None = None) -> bool:
    root = Path(path) if path is not None else DEFAULT_PAIR_DIR
    return not _missing(root)


def _missing(root: Path) -> list[str]:
    """The config.json files of ``root``'s target/ and drafter/ that are not there."""
    return [str(root / part / "config.json") for part in ("target", "drafter")
            if not (root / part / "config.json").is_file()]


__all__ = ["load_default_pair", "default_prompts", "has_default_pair", "DEFAULT_PAIR_DIR", "CREATE_COMMAND"]
