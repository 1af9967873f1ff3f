"""What a Kimi K2.x checkpoint directory holds, read from ``config.json`` and the safetensors
headers alone (no tensor data): the files, every tensor's dtype / shape / location, the
``language_model.`` prefix of the K2.5 / K2.6 wrapper, and the validated quantisation format.

Format facts (docs/kimi_k2.md): K2-Thinking / K2.5 / K2.6 store the routed
experts in compressed-tensors ``pack-quantized`` form, ``...experts.{e}.{proj}.weight_packed``
int32 ``[out, in/8]`` (eight 4-bit values per int32 along the input, lowest nibble first, each
q + 8), ``.weight_scale`` bf16 ``[out, in/32]`` and ``.weight_shape`` ``[2]`` = ``[out, in]``.
Everything here raises :class:`CheckpointError` (or :class:`MissingShardError`) naming the
file, tensor or config field at fault.
"""
from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path
from typing import Any

import torch

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LANGUAGE_MODEL_PREFIX = "language_model."
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
INT4_TENSORS = ("weight_packed", "weight_scale", "weight_shape")
INT4_BITS = 4
INT4_PER_INT32 = 32 // INT4_BITS
INT4_GROUP_SIZE = 32

SAFETENSORS_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}
_HEADER_LIMIT = 100 * 1024 * 1024  # safetensors' own cap on the JSON header
LIST_LIMIT = 20  # names shown in one error or warning


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be loaded into the model; the message names the problem."""


class MissingShardError(CheckpointError, FileNotFoundError):
    """A file that the checkpoint needs (config, weights, or a shard named by the index) is absent."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor as a safetensors header describes it."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int             # byte offset in the file's data section (reads go in file order)


@dataclasses.dataclass(frozen=True)
class Int4Format:
    """compressed-tensors ``pack-quantized`` weights: symmetric int4, one scale per ``group_size`` inputs."""

    num_bits: int = INT4_BITS
    group_size: int = INT4_GROUP_SIZE


@dataclasses.dataclass
class CheckpointFiles:
    """What a checkpoint directory holds, from its config and the shard headers (no tensor data)."""

    directory: Path
    config: dict            # config.json as written
    prefix: str             # prefix of the text model's tensor names ("" or "language_model.")
    quantization: Int4Format | None
    files: list[str]        # weight files, in load order
    tensors: dict[str, TensorInfo]


def listing(names, limit: int = LIST_LIMIT) -> str:
    names = list(names)
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")

# ---------------------------------------------------------------------------- config.json


def read_config_json(directory: str | os.PathLike) -> dict:
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise MissingShardError(f"{path}: no {CONFIG_NAME} in the checkpoint directory")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e


def text_config_of(config: dict) -> dict:
    """The text model's config: K2.5 / K2.6 nest it in ``text_config``; K2 / K2-Thinking are flat."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def quantization_config_of(config: dict) -> dict | None:
    """K2.5 / K2.6 keep ``quantization_config`` inside ``text_config``; K2-Thinking at the top level."""
    return text_config_of(config).get("quantization_config") or config.get("quantization_config")


def parse_quantization_config(qc: Any) -> Int4Format | None:
    """Validate a ``quantization_config``; ``None`` means an unquantised (bf16) checkpoint.

    Only what the INT4 expert path computes exactly is accepted: compressed-tensors,
    ``pack-quantized``, one weight scheme of 4-bit symmetric integers with group-32 scales,
    no activation / KV-cache quantisation, no sparsity, no activation-order permutation.
    Anything else raises, naming the field and the value found.
    """
    if qc is None:
        return None
    if hasattr(qc, "to_dict"):
        qc = qc.to_dict()
    if not isinstance(qc, dict):
        raise CheckpointError(f"quantization_config must be a JSON object, found {type(qc).__name__}")

    def bad(field, value, wanted):
        return CheckpointError(f"unsupported quantisation: quantization_config.{field} = {value!r} "
                               f"(this loader reads {wanted})")

    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise bad("quant_method", method, "'compressed-tensors' INT4 experts only")
    fmt = qc.get("format")
    if fmt != "pack-quantized":
        raise bad("format", fmt, "'pack-quantized'")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise bad("quantization_status", status, "'compressed' weights")
    if qc.get("kv_cache_scheme") is not None:
        raise bad("kv_cache_scheme", qc["kv_cache_scheme"], "no KV-cache quantisation")
    if qc.get("sparsity_config"):
        raise bad("sparsity_config", qc["sparsity_config"], "no sparsity compression")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise bad("config_groups", groups, "one weight quantisation scheme")
    for gname, group in groups.items():
        where = f"config_groups.{gname}"
        if group.get("format") not in (None, "pack-quantized"):
            raise bad(f"{where}.format", group["format"], "'pack-quantized'")
        for act in ("input_activations", "output_activations"):
            if group.get(act) is not None:
                raise bad(f"{where}.{act}", group[act], "weight-only quantisation (w4a16)")
        w = group.get("weights")
        if not isinstance(w, dict):
            raise bad(f"{where}.weights", w, "a weight quantisation scheme")
        checks = (("num_bits", INT4_BITS, "4-bit weights"), ("type", "int", "integer weights"),
                  ("symmetric", True, "symmetric weights (no zero point)"),
                  ("strategy", "group", "group-wise scales"),
                  ("group_size", INT4_GROUP_SIZE, f"group size {INT4_GROUP_SIZE}"))
        for key, wanted, what in checks:
            if w.get(key) != wanted:
                raise bad(f"{where}.weights.{key}", w.get(key), what)
        if w.get("dynamic") not in (None, False):
            raise bad(f"{where}.weights.dynamic", w["dynamic"], "static weight scales")
        if w.get("actorder") not in (None, "static"):
            raise bad(f"{where}.weights.actorder", w["actorder"], "no activation-order permutation")
        if w.get("block_structure") is not None:
            raise bad(f"{where}.weights.block_structure", w["block_structure"], "group-wise scales")
    return Int4Format()


# ---------------------------------------------------------------------------- safetensors headers


def read_safetensors_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Parse and check one safetensors file's header without reading tensor data.

    Checks what a truncated or corrupted download breaks: the header length, the JSON, each
    tensor's dtype and byte range (dtype size x shape), and that the data section is exactly as
    long as the header says.  Errors name the file.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated or not a safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > _HEADER_LIMIT or 8 + n > size:
            raise CheckpointError(f"{path}: truncated or corrupt safetensors file (header of {n} bytes "
                                  f"announced, file is {size} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - n
    tensors: dict[str, TensorInfo] = {}
    end = 0
    for name, entry in header.items():
        try:
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            shape = tuple(int(s) for s in entry["shape"])
            begin, stop = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: corrupt header entry for tensor {name!r}: {entry!r}") from e
        numel = 1
        for s in shape:
            numel *= s
        if stop - begin != numel * dtype.itemsize or begin < 0:
            raise CheckpointError(f"{path}: corrupt header: tensor {name!r} ({entry['dtype']} {list(shape)}) "
                                  f"has byte range [{begin}, {stop})")
        end = max(end, stop)
        tensors[name] = TensorInfo(str(path), dtype, shape, begin)
    if end != data_bytes:
        raise CheckpointError(f"{path}: truncated or corrupt safetensors file: the header describes {end} "
                              f"bytes of tensor data, the file holds {data_bytes}")
    return tensors


def scan_checkpoint(directory: str | os.PathLike) -> CheckpointFiles:
    """Read ``config.json``, the index and every weight file's header; check that they agree."""
    directory = Path(directory)
    if not directory.is_dir():
        raise MissingShardError(f"{directory}: not a checkpoint directory")
    config = read_config_json(directory)
    quantization = parse_quantization_config(quantization_config_of(config))

    index_path = directory / INDEX_FILE
    weight_map: dict[str, str] | None = None
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: not a safetensors index (need a 'weight_map' object): {e}") from e
        files = sorted(set(weight_map.values()))
    elif (directory / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        present = sorted(p.name for p in directory.iterdir())
        raise MissingShardError(f"{directory}: neither {INDEX_FILE} nor {SINGLE_FILE} found "
                                f"(files present: {listing(present)}); only safetensors checkpoints are read")
    for name in files:
        if not name.endswith(".safetensors") or Path(name).name != name:
            raise CheckpointError(f"{index_path}: weight file {name!r} is not a safetensors file in the directory")
    absent = [name for name in files if not (directory / name).is_file()]
    if absent:
        raise MissingShardError(f"{directory}: missing shard file(s) named by {INDEX_FILE}: {listing(absent)}")

    tensors: dict[str, TensorInfo] = {}
    for name in files:
        for tname, info in read_safetensors_header(directory / name).items():
            if tname in tensors:
                raise CheckpointError(f"tensor {tname!r} appears in both {Path(tensors[tname].file).name} and {name}")
            tensors[tname] = info
    if weight_map is not None:
        wrong = [f"{t} (index: {f})" for t, f in weight_map.items()
                 if t not in tensors or Path(tensors[t].file).name != f]
        if wrong:
            raise CheckpointError(f"{index_path}: tensors not found in the shard the index names: {listing(wrong)}")

    wrapped = "text_config" in config or any(t.startswith(LANGUAGE_MODEL_PREFIX) for t in tensors)
    return CheckpointFiles(directory, config, LANGUAGE_MODEL_PREFIX if wrapped else "", quantization, files, tensors)
