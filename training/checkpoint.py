"""Pre-training split over several processes: what one call leaves for the next.

A lent GPU runs commands of at most ten minutes, and a warm machine keeps its files between calls,
so a longer pre-training runs as several calls of ``python -m training.run`` with one checkpoint
directory (scripts/train_pair_calls.sh): the first builds the corpus and the tokenizer and trains
for ``--call-minutes``, each call resumes, and the call in which the schedule (``--minutes`` in
all) ends goes on to QAT, the drafter and the export.  The directory holds, in safetensors and JSON
only (nothing is unpickled):

- ``tokenizer.json`` (the byte-level BPE), ``streams.safetensors`` (the encoded training and
  held-out token streams), ``manifest.json`` and ``prompts.json`` (the corpus split and the main
  job's prompts), so a resumed call repeats neither the corpus nor the tokenizer;
- ``model.safetensors`` (the fp32 target), ``optimizer.safetensors`` (AdamW's moments and step
  counts) and ``state.json`` (the schedule, the recipe's name, the steps, tokens, seconds and losses
  so far, the optimizer's hyper-parameters).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, load_model, save_file, save_model

FILES = ("tokenizer.json", "streams.safetensors", "manifest.json", "prompts.json", "model.safetensors",
         "optimizer.safetensors", "state.json")


def save(directory: str | Path, *, raw_tokenizer, train_stream: torch.Tensor, heldout_stream: torch.Tensor,
         manifest: str, prompts: str, model, state: dict, recipe) -> None:
    """Write the checkpoint (``state``: :func:`training.target.train`'s returned state), replacing
    the directory's previous one only once every file is written."""
    directory = Path(directory)
    tmp = directory.parent / f".{directory.name}.partial"
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "tokenizer.json").write_text(raw_tokenizer.to_str(), encoding="utf-8")
    save_file({"train": train_stream.to(torch.int32).contiguous().cpu(),  # token ids < 2^31: half the bytes
               "heldout": heldout_stream.to(torch.int32).contiguous().cpu()}, str(tmp / "streams.safetensors"))
    (tmp / "manifest.json").write_text(manifest, encoding="utf-8")
    (tmp / "prompts.json").write_text(prompts, encoding="utf-8")
    save_model(model, str(tmp / "model.safetensors"))
    opt = state["optimizer"]
    tensors = {f"{i}.{name}": v.detach().cpu().contiguous() for i, per in opt["state"].items()
               for name, v in per.items() if isinstance(v, torch.Tensor)}
    tensors["load_total"] = state["load_total"].cpu()
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    meta = {"recipe": recipe.name, "schedule": {"steps": recipe.steps, "minutes": recipe.minutes},
            "steps": state["steps"], "tokens": state["tokens"], "seconds": state["seconds"], "calls": state["calls"],
            "losses": state["losses"], "param_groups": opt["param_groups"]}
    (tmp / "state.json").write_text(json.dumps(meta) + "\n", encoding="utf-8")
    if directory.exists():
        for name in FILES:
            (directory / name).unlink(missing_ok=True)
        directory.rmdir()
    tmp.rename(directory)


def schedule(directory: str | Path) -> dict:
    """The checkpoint's recipe name and schedule (``{"recipe", "steps", "minutes"}``); a clear error
    where the directory is not a complete checkpoint."""
    directory = Path(directory)
    missing = [name for name in FILES if not (directory / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{directory} is not a pre-training checkpoint (missing {', '.join(missing)}); the "
                                "first call writes it: python -m training.run --call-minutes M --checkpoint DIR")
    meta = json.loads((directory / "state.json").read_text(encoding="utf-8"))
    return {"recipe": meta["recipe"], **meta["schedule"]}


def load(directory: str | Path) -> dict:
    """What the next call needs: the raw tokenizer, the two streams, the manifest and prompts texts,
    and ``state`` for ``train(resume=...)`` (its tensors on the CPU; the optimizer moves them)."""
    from tokenizers import Tokenizer

    directory = Path(directory)
    schedule(directory)
    meta = json.loads((directory / "state.json").read_text(encoding="utf-8"))
    streams = load_file(str(directory / "streams.safetensors"))
    tensors = load_file(str(directory / "optimizer.safetensors"))
    per_param: dict[int, dict] = {}
    for key, value in tensors.items():
        if key == "load_total":
            continue
        index, name = key.split(".", 1)
        per_param.setdefault(int(index), {})[name] = value
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in meta["param_groups"]]
    state = {"steps": meta["steps"], "tokens": meta["tokens"], "seconds": meta["seconds"], "calls": meta["calls"],
             "losses": meta["losses"], "optimizer": {"state": per_param, "param_groups": groups},
             "load_total": tensors["load_total"]}
    return {"raw_tokenizer": Tokenizer.from_str((directory / "tokenizer.json").read_text(encoding="utf-8")),
            "train_stream": streams["train"].long(), "heldout_stream": streams["heldout"].long(),
            "manifest": (directory / "manifest.json").read_text(encoding="utf-8"),
            "prompts": (directory / "prompts.json").read_text(encoding="utf-8"), "state": state}


def load_weights(directory: str | Path, model, device) -> None:
    """The checkpoint's target weights into ``model`` (built by ``build_target`` as in the first call)."""
    load_model(model, str(Path(directory) / "model.safetensors"), device=str(device))


__all__ = ["FILES", "save", "load", "load_weights", "schedule"]
