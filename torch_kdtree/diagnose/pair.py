"""The target and drafter that ``diagnose`` runs, and the prompt it feeds them."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

TINY_SEED = 0


class InputError(ValueError):
    """A checkpoint or prompt that cannot be used (the command line reports it as a usage error)."""


@dataclass
class Pair:
    target: object
    drafter: object
    tokenizer: object | None
    name: str           # for the report: where the pair came from
    notes: list[str]
    texts: tuple[str, ...] = ()  # the pair's own held-out prompts (the shipped pair's prompts.json)


def default_pair(device: torch.device, dtype: torch.dtype, *, block_size: int = 8) -> Pair:
    """The pair ``diagnose`` runs when no ``--target`` is given.

    Hook for issue 48: ``torch_kdtree.models.load_default_pair(device=, dtype=)`` (the shipped,
    trained pair: target, drafter, tokenizer) is the default wherever it exists and finds its
    files.  Otherwise the tiny random pair of ``models/generation/tiny.py`` stands in, with a
    printed note: its acceptance is ~1 (a random drafter), so use ``--oracle`` for a meaningful
    acceptance."""
    import torch_kdtree.models as models

    load = getattr(models, "load_default_pair", None)
    why = "no torch_kdtree.models.load_default_pair (issue 48)"
    if load is not None:
        try:
            loaded = load(device=device, dtype=dtype)
        except FileNotFoundError as e:  # the function exists, the trained files do not (yet)
            why = f"load_default_pair: {e}"
        else:
            target, drafter = loaded[0], loaded[1]
            tokenizer = loaded[2] if len(loaded) > 2 else None
            from torch_kdtree.models.pair import default_prompts

            return Pair(target, drafter, tokenizer, "the shipped pair (torch_kdtree.models.load_default_pair)", [],
                        tuple(default_prompts()) if tokenizer is not None else ())
    note = (f"no shipped pair ({why}): running the tiny random pair (models/generation/tiny.py); its random "
            "drafter accepts ~1 token per step, add --oracle for a meaningful acceptance")
    print(f"note: {note}", file=sys.stderr)
    pair = tiny_pair(device, dtype, block_size=block_size)
    pair.notes.append(note)
    return pair


def tiny_pair(device: torch.device, dtype: torch.dtype, *, block_size: int = 8) -> Pair:
    """The tiny random target and drafter of ``models/generation/tiny.py`` (seed 0)."""
    from torch_kdtree.models.generation.tiny import tiny_drafter, tiny_target

    target = tiny_target(TINY_SEED)
    drafter = tiny_drafter(target, seed=TINY_SEED, block_size=block_size)
    return Pair(target.to(device, dtype), drafter.to(device, dtype), None,
                f"tiny random pair (models/generation/tiny.py, seed {TINY_SEED}, block size {block_size})", [])


def checkpoint_pair(target_dir: str, drafter_dir: str | None, device: torch.device, dtype: torch.dtype) -> Pair:
    """A K2.x target directory (``KimiK2ForCausalLM.from_pretrained``) and a DFlash drafter
    directory (``DFlashDraftModel.from_pretrained``), or no drafter (``--oracle`` then drafts)."""
    from torch_kdtree.models import DFlashDraftModel, KimiK2ForCausalLM

    try:
        target = KimiK2ForCausalLM.from_pretrained(target_dir, dtype=dtype, device=device)
    except (OSError, ValueError, KeyError) as e:
        raise InputError(f"--target {target_dir}: {e}") from e
    drafter = None
    if drafter_dir is not None:
        try:
            drafter = DFlashDraftModel.from_pretrained(drafter_dir, dtype=dtype, device=device)
        except (OSError, ValueError, KeyError) as e:
            raise InputError(f"--drafter {drafter_dir}: {e}") from e
    tokenizer = None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(target_dir)
    except Exception:  # a checkpoint without a tokenizer: prompts are token ids (random or --prompt FILE.json)
        tokenizer = None
    name = f"{target_dir} + {drafter_dir}" if drafter_dir else f"{target_dir}"
    return Pair(target, drafter, tokenizer, name, [])


def with_oracle(pair: Pair, accuracy: float, *, block_size: int, seed: int) -> Pair:
    """The pair's drafter replaced by an :class:`OracleDrafter` at ``accuracy``; the drafter (if
    any) runs inside it as ``inner``, so each step still pays for a real draft.  The oracle's
    look-ahead runs outside the timed steps."""
    from torch_kdtree.models.generation import OracleDrafter

    oracle = OracleDrafter(pair.target, block_size, accuracy=accuracy, seed=seed, inner=pair.drafter)
    inner = " (inner: the drafter, so its cost is in every step)" if pair.drafter is not None else ""
    return Pair(pair.target, oracle, pair.tokenizer, f"{pair.name}, oracle drafter at accuracy {accuracy:g}{inner}",
                pair.notes)


def prompt_ids(path: str | None, tokenizer, vocab_size: int, length: int, special: set[int], seed: int,
               texts: tuple[str, ...] = ()) -> tuple:
    """``length`` prompt token ids (int64) and a description.  ``path``: a ``.json`` list of
    token ids, or text tokenized with the target's tokenizer; repeated to ``length``.  None: the
    pair's held-out ``texts`` one after another, each as ``<bos> text`` as the pair was trained
    (repeated to ``length``), or without texts random ids from ``seed`` avoiding the special tokens."""
    if path is None and texts:
        from torch_kdtree.models.pair import prompt_ids as pair_prompt_ids

        ids = torch.tensor([i for t in texts for i in pair_prompt_ids(tokenizer, t)], dtype=torch.int64)
        source = f"the pair's {len(texts)} held-out code prompts (prompts.json)"
        if ids.numel() < length:
            source += f" ({ids.numel()} tokens, repeated to {length}: a repeated text is easier to draft)"
            ids = ids.repeat(-(-length // ids.numel()))
        return ids[:length].clone(), source
    if path is None:
        g = torch.Generator().manual_seed(seed)
        allowed = torch.tensor([i for i in range(vocab_size) if i not in special], dtype=torch.int64)
        ids = allowed[torch.randint(0, len(allowed), (length,), generator=g)]
        return ids, f"random token ids (seed {seed}); acceptance on real text differs"
    file = Path(path)
    if file.suffix == ".json":
        try:
            ids = torch.tensor(json.loads(file.read_text()), dtype=torch.int64).flatten()
        except (ValueError, TypeError) as e:
            raise InputError(f"--prompt {path}: not a JSON list of token ids ({e})") from None
        source = f"token ids from {path}"
    else:
        if tokenizer is None:
            raise InputError(f"--prompt {path}: text needs the target's tokenizer (none found); give a .json list "
                             "of token ids instead")
        ids = torch.tensor(tokenizer(file.read_text())["input_ids"], dtype=torch.int64)
        source = f"text of {path}"
    if ids.numel() == 0:
        raise InputError(f"--prompt {path}: no tokens")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise InputError(f"--prompt {path}: token ids outside the vocabulary [0, {vocab_size})")
    if ids.numel() < length:
        source += f" ({ids.numel()} tokens, repeated to {length}: a repeated text is easier to draft)"
        ids = ids.repeat(-(-length // ids.numel()))
    return ids[:length].clone(), source


def check_pair(target, drafter) -> None:
    """The drafter must fit the target (hidden size, vocabulary, tapped layers, dtype, device),
    checked as ``generate`` checks it."""
    from torch_kdtree.models.generation.generate import _check_drafter

    try:
        _check_drafter(target, drafter)
    except ValueError as e:
        raise InputError(str(e).removeprefix("generate: ")) from None


def special_ids(target, drafter) -> set[int]:
    config = target.config
    ids = {getattr(config, n, None) for n in ("bos_token_id", "eos_token_id", "pad_token_id")}
    for d in (drafter, getattr(drafter, "inner", None)):
        ids.add(getattr(getattr(d, "config", None), "mask_token_id", None))
    flat = set()
    for i in ids:
        flat.update(i if isinstance(i, (list, tuple)) else [i])
    return {int(i) for i in flat if i is not None}


__all__ = ["InputError", "Pair", "default_pair", "tiny_pair", "checkpoint_pair", "with_oracle", "check_pair", "prompt_ids", "special_ids"]
