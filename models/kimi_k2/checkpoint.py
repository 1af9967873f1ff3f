"""Streaming loader for Kimi K2.x safetensors checkpoints.

Reads a directory holding ``config.json`` and either ``model.safetensors`` or
``model.safetensors.index.json`` plus shards, in the formats Moonshot ships:

* bf16 DeepSeek-V3 / K2 tensor names (``model.layers.{i}...``, ``lm_head.weight``);
* K2-Thinking / K2.5 / K2.6 INT4 routed experts in compressed-tensors ``pack-quantized`` form
  (``...mlp.experts.{e}.{gate,up,down}_proj.weight_packed`` int32 ``[out, in/8]``,
  ``.weight_scale`` bf16 ``[out, in/32]``, ``.weight_shape`` ``[2]``), everything else bf16,
  ``e_score_correction_bias`` fp32;
* the K2.5 / K2.6 vision-language wrapper: ``config.json`` carries the text model in
  ``text_config`` and tensor names carry a ``language_model.`` prefix; vision tensors are
  reported as unexpected and skipped.

Every header is read and checked against the model before any tensor data is touched, so a
missing shard, a truncated file, a missing / mis-shaped / wrongly typed tensor or an
unsupported quantisation fails in seconds with an error that names it.  Data is then streamed
one shard at a time (peak host memory about one shard plus the stacked experts of the layer
being assembled), each parameter materialised directly from its checkpoint tensor: the model is
built with parameters on the meta device, so nothing is ever randomly initialised, and loading
ends by checking that no parameter or persistent buffer is left unloaded.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from .checkpoint_files import (EXPERT_PROJECTIONS, INT4_PER_INT32, INT4_TENSORS, LIST_LIMIT, CheckpointError,
                               CheckpointFiles, Int4Format, MissingShardError, listing, parse_quantization_config,
                               read_config_json, scan_checkpoint, text_config_of)

__all__ = ["load_checkpoint", "from_pretrained", "empty_weights", "resolve_dtype", "LoadingInfo", "KEEP_FP32",
           "CheckpointError", "MissingShardError", "parse_quantization_config", "scan_checkpoint"]

# Tensors that stay fp32 whatever dtype the rest of the model is loaded in: the routing bias only
# shifts the top-k choice, and in bf16 it would flip near-tied expert selections.
KEEP_FP32 = ("e_score_correction_bias",)
# Checkpoint dtypes a floating-point parameter may be read from (cast to the requested dtype).
FLOAT_SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


@dataclasses.dataclass
class LoadingInfo:
    """What :func:`load_checkpoint` did (also returned by ``from_pretrained(..., output_loading_info=True)``)."""

    loaded: list[str]       # checkpoint tensor names read
    unexpected: list[str]   # checkpoint tensor names the model has no place for (skipped)
    files: list[str]        # weight files opened, in order


# ---------------------------------------------------------------------------- what the model expects


@dataclasses.dataclass
class _ExpertSlot:
    """One routed-experts module and the stacked tensors being assembled for it across shards."""

    module: torch.nn.Module
    name: str
    num_experts: int
    shapes: dict[str, tuple[int, int]]      # projection -> (out, in) of one expert
    missing: set                             # (expert, projection, kind) not read yet
    stacks: dict[str, torch.Tensor] | None = None


def _find_expert_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules()
            if callable(getattr(m, "set_dense", None)) and callable(getattr(m, "set_int4", None))}


def _expert_geometry(model: torch.nn.Module) -> tuple[int, dict[str, tuple[int, int]]]:
    config = model.config
    text = getattr(config, "text_config", None)
    config = text if text is not None and hasattr(text, "n_routed_experts") else config
    num_experts, inter, hidden = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
    gate, up, down = EXPERT_PROJECTIONS
    return num_experts, {gate: (inter, hidden), up: (inter, hidden), down: (hidden, inter)}


def _expected_expert_tensors(name: str, num_experts: int, shapes: dict, quant: Int4Format | None):
    """Checkpoint name -> (expert, projection, kind, dtypes allowed, shape) for one experts module."""
    packed, scale, shape = INT4_TENSORS
    out = {}
    for e in range(num_experts):
        for proj, (n, k) in shapes.items():
            base = f"{name}.{e}.{proj}"
            if quant is None:
                out[f"{base}.weight"] = (e, proj, "weight", FLOAT_SOURCE_DTYPES, (n, k))
            else:
                out[f"{base}.{packed}"] = (e, proj, "packed", (torch.int32,), (n, k // INT4_PER_INT32))
                out[f"{base}.{scale}"] = (e, proj, "scale", (torch.bfloat16,), (n, k // quant.group_size))
                out[f"{base}.{shape}"] = (e, proj, "shape", _INTEGER_DTYPES, (2,))
    return out


def _alias_groups(model: torch.nn.Module) -> dict[str, list[str]]:
    """State-dict name -> every name sharing the same tensor (tied weights), for persistent state."""
    by_id: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        by_id.setdefault(id(t), []).append(name)
    return {name: names for names in by_id.values() for name in names}


def _keep_fp32(model: torch.nn.Module, name: str) -> bool:
    keep = set(KEEP_FP32) | set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    keep |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    return any(re.search(rf"(^|\.){re.escape(k)}($|\.)", name) for k in keep)


# ---------------------------------------------------------------------------- loading


def load_checkpoint(model: torch.nn.Module, path: str | os.PathLike, *, device=None, dtype=None,
                    progress: bool = True) -> LoadingInfo:
    """Load a K2.x checkpoint directory into ``model`` (built by :func:`empty_weights` or on any device).

    ``dtype`` (default: the checkpoint's ``torch_dtype``, else bf16) is what floating parameters
    are cast to, except :data:`KEEP_FP32` tensors; INT4 experts are handed to the experts'
    ``set_int4`` as stored (int32 packed, bf16 scales), bf16 experts to ``set_dense`` in ``dtype``.
    Routed experts are stacked per layer and handed over once all of a layer's experts are read,
    whichever shards they sit in.  Raises :class:`CheckpointError` naming every problem found.
    """
    ckpt = scan_checkpoint(path)
    device = torch.device(device) if device is not None else torch.device("cpu")
    dtype = resolve_dtype(dtype, ckpt.config)
    tp = getattr(model, "tp", None)  # tensor parallel (models/parallel.py): read this rank's slices only
    progress = progress and (tp is None or tp.rank == 0)
    plan = _plan(model, ckpt)
    aliases = _alias_groups(model)
    slots = plan["slots"]

    info = LoadingInfo(loaded=[], unexpected=plan["unexpected"], files=[])
    by_file: dict[str, list[str]] = {}
    for cname in sorted(plan["wanted"], key=lambda c: ckpt.tensors[c].offset):  # sequential reads
        by_file.setdefault(ckpt.tensors[cname].file, []).append(cname)
    files = [str(ckpt.directory / f) for f in ckpt.files if str(ckpt.directory / f) in by_file]
    done: set[str] = set()
    with torch.no_grad():
        for file in tqdm(files, desc="Loading checkpoint shards", unit="shard", disable=not progress):
            info.files.append(file)
            try:
                handle = safe_open(file, framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own type; name the file
                raise CheckpointError(f"{file}: cannot open safetensors file: {e}") from e
            with handle:
                for cname in by_file[file]:
                    index = _rank_slice(tp, plan["wanted"][cname], ckpt.tensors[cname].shape)
                    try:
                        t = handle.get_tensor(cname) if index is None else handle.get_slice(cname)[index]
                    except Exception as e:
                        raise CheckpointError(f"{file}: cannot read tensor {cname!r}: {e}") from e
                    info.loaded.append(cname)
                    target = plan["wanted"][cname]
                    if isinstance(target, tuple):
                        _put_expert(slots[target[0]], cname, target[1:], t, device, dtype, ckpt.quantization, tp)
                    else:
                        if target in done:
                            continue
                        for name in aliases.get(target, [target]):
                            cast = torch.float32 if _keep_fp32(model, name) else dtype
                            _assign(model, name, t.to(device=device, dtype=cast) if t.is_floating_point()
                                    else t.to(device=device))
                            done.add(name)
                    del t
    _check_everything_loaded(model, slots)
    return info


def _plan(model: torch.nn.Module, ckpt: CheckpointFiles) -> dict:
    """Match checkpoint names to the model's state; collect every missing / mis-shaped / mistyped tensor."""
    quant = ckpt.quantization
    tp = getattr(model, "tp", None)
    experts = _find_expert_modules(model)
    slots: dict[str, _ExpertSlot] = {}
    wanted: dict[str, Any] = {}
    expected: dict[str, tuple] = {}      # checkpoint name -> (dtypes allowed, shape)
    if experts:
        num_experts, shapes = _expert_geometry(model)
        for mname, module in experts.items():
            slots[mname] = slot = _ExpertSlot(module, mname, num_experts, shapes, set())
            for tname, (e, proj, kind, dtypes, shape) in _expected_expert_tensors(
                    mname, num_experts, shapes, quant).items():
                cname = ckpt.prefix + tname
                wanted[cname] = (mname, e, proj, kind)
                expected[cname] = (dtypes, shape)
                slot.missing.add((e, proj, kind))
    expert_prefixes = tuple(m + "." for m in experts)
    aliases = _alias_groups(model)
    absent_groups = []
    for name, t in model.state_dict(keep_vars=True).items():
        if name.startswith(expert_prefixes):
            continue
        group = aliases[name]
        present = [n for n in group if ckpt.prefix + n in ckpt.tensors]
        if not present:
            if name == group[0]:
                absent_groups.append(name)
            continue
        if name not in present:
            continue
        cname = ckpt.prefix + name
        wanted[cname] = name
        shape = tp.global_shapes.get(name, tuple(t.shape)) if tp is not None else tuple(t.shape)
        expected[cname] = (FLOAT_SOURCE_DTYPES if t.is_floating_point() else (t.dtype,), shape)

    problems = []
    for name in absent_groups:
        cname = ckpt.prefix + name
        hint = ""
        if cname.endswith(".weight") and cname + "_packed" in ckpt.tensors:
            hint = " (the checkpoint has it quantised as weight_packed, but only routed experts may be INT4)"
        problems.append(f"missing tensor {cname}{hint}")
    missing_experts = [c for c in wanted if isinstance(wanted[c], tuple) and c not in ckpt.tensors]
    for cname in missing_experts[:LIST_LIMIT]:
        hint = ""
        stem = cname.rsplit(".", 1)[0]
        if quant is not None and stem + ".weight" in ckpt.tensors:
            hint = " (the checkpoint holds bf16 .weight here but config.json declares INT4 quantisation)"
        elif quant is None and stem + ".weight_packed" in ckpt.tensors:
            hint = " (the checkpoint holds INT4 weight_packed here but config.json has no quantization_config)"
        problems.append(f"missing tensor {cname}{hint}")
    if len(missing_experts) > LIST_LIMIT:
        problems.append(f"... and {len(missing_experts) - LIST_LIMIT} more missing expert tensors")
    for cname, (dtypes, shape) in expected.items():
        info = ckpt.tensors.get(cname)
        if info is None:
            continue
        where = Path(info.file).name
        if info.dtype not in dtypes:
            allowed = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            problems.append(f"wrong dtype for {cname} in {where}: {str(info.dtype).removeprefix('torch.')}, "
                            f"expected {allowed}")
        if info.shape != shape:
            problems.append(f"wrong shape for {cname} in {where}: {list(info.shape)}, expected {list(shape)}")
    if problems:
        raise CheckpointError(f"{ckpt.directory}: checkpoint does not match the model "
                              f"({len(problems)} problem(s)):\n  " + "\n  ".join(problems[:2 * LIST_LIMIT]))

    unexpected = sorted(c for c in ckpt.tensors if c not in wanted)
    if unexpected:
        outside = [c for c in unexpected if ckpt.prefix and not c.startswith(ckpt.prefix)]
        note = (f" ({len(outside)} outside the {ckpt.prefix!r} text model, e.g. the vision tower)"
                if outside else "")
        warnings.warn(f"{ckpt.directory}: {len(unexpected)} checkpoint tensor(s) not used by the model{note}, "
                      f"skipped: {listing(unexpected)}", stacklevel=3)
    return {"wanted": wanted, "slots": slots, "unexpected": unexpected}


def _put_expert(slot: _ExpertSlot, cname: str, where: tuple, t: torch.Tensor, device, dtype,
                quant: Int4Format | None, tp=None) -> None:
    e, proj, kind = where
    n, k = slot.shapes[proj]
    if kind == "shape":
        if t.tolist() != [n, k]:
            raise CheckpointError(f"wrong value for {cname}: {t.tolist()}, expected [{n}, {k}] (out, in)")
    else:
        if slot.stacks is None:
            slot.stacks = _allocate_stacks(slot, device, dtype, quant, tp)
        slot.stacks[f"{proj}.{kind}"][e].copy_(t)
    slot.missing.discard((e, proj, kind))
    if not slot.missing:
        s = slot.stacks
        if quant is None:
            slot.module.set_dense(s["gate_proj.weight"], s["up_proj.weight"], s["down_proj.weight"])
        else:
            slot.module.set_int4(s["gate_proj.packed"], s["gate_proj.scale"], s["up_proj.packed"],
                                 s["up_proj.scale"], s["down_proj.packed"], s["down_proj.scale"])
        slot.stacks = None  # the module owns them now


def _rank_slice(tp, target, shape) -> tuple | None:
    """The slices of a checkpoint tensor of ``shape`` this tensor-parallel rank reads (None: all of
    it): a model tensor's by its placement, a routed expert's by intermediate size."""
    if tp is None:
        return None
    if isinstance(target, tuple):  # (experts module, expert, projection, kind)
        if target[3] == "shape":
            return None
        from ..parallel import INT4_EXPERT_DIMS

        dim = INT4_EXPERT_DIMS[target[2]]
        n = shape[dim] // tp.world
        return tuple(slice(tp.rank * n, (tp.rank + 1) * n) if d == dim else slice(None) for d in range(len(shape)))
    return tp.index(target, tuple(shape)) if target in tp.shard_dims else None


def _allocate_stacks(slot: _ExpertSlot, device, dtype, quant: Int4Format | None, tp=None) -> dict[str, torch.Tensor]:
    # Only unloaded layers' tensors are allocated, and only once their first expert tensor arrives,
    # so at most the layers that straddle the current shard boundary are held here.
    num_experts = slot.num_experts
    stacks = {}
    for proj, (n, k) in slot.shapes.items():
        if tp is not None:  # this rank's slice: gate / up by output rows, down by input columns
            from ..parallel import INT4_EXPERT_DIMS

            n, k = (n // tp.world, k) if INT4_EXPERT_DIMS[proj] == 0 else (n, k // tp.world)
        if quant is None:
            stacks[f"{proj}.weight"] = torch.empty(num_experts, n, k, dtype=dtype, device=device)
        else:
            stacks[f"{proj}.packed"] = torch.empty(num_experts, n, k // INT4_PER_INT32, dtype=torch.int32,
                                                   device=device)
            stacks[f"{proj}.scale"] = torch.empty(num_experts, n, k // quant.group_size, dtype=torch.bfloat16,
                                                  device=device)
    return stacks


def _assign(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    if leaf in module._parameters:
        old = module._parameters[leaf]
        module._parameters[leaf] = torch.nn.Parameter(value, requires_grad=old.requires_grad)
    elif leaf in module._buffers:
        module._buffers[leaf] = value
    else:
        raise CheckpointError(f"model has no parameter or buffer {name!r}")


def _check_everything_loaded(model: torch.nn.Module, slots: dict[str, _ExpertSlot]) -> None:
    incomplete = [s.name for s in slots.values() if s.missing]
    unloaded = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if incomplete or unloaded:
        raise CheckpointError("model state left uninitialised after loading: "
                              + listing(incomplete + unloaded)
                              + " (a tensor the model needs has no counterpart in the checkpoint)")


# ---------------------------------------------------------------------------- construction


def resolve_dtype(dtype, config: dict) -> torch.dtype:
    """``None`` / ``"auto"``: the ``torch_dtype`` (``dtype`` in newer files) that ``config.json``
    declares for the text model (or the wrapper), else bf16."""
    if dtype is None or dtype == "auto":
        text = text_config_of(config)
        dtype = (text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or config.get("dtype")
                 or "bfloat16")
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}")
        dtype = resolved
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point type, got {dtype}")
    return dtype


@contextlib.contextmanager
def empty_weights(dtype: torch.dtype | None = None) -> Iterator[None]:
    """Build modules with parameters and persistent buffers on the meta device (no memory, no init).

    Non-persistent buffers (RoPE tables and the like, computed in ``__init__`` and never stored in
    a checkpoint) are kept real.  ``dtype`` becomes the default dtype meanwhile, as in
    transformers' ``from_pretrained``.
    """
    module_cls = torch.nn.Module
    register_parameter, register_buffer = module_cls.register_parameter, module_cls.register_buffer

    def to_meta_parameter(self, name, param):
        if param is not None and not param.is_meta:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register_parameter(self, name, param)

    def to_meta_buffer(self, name, tensor, persistent=True):
        if tensor is not None and persistent:
            tensor = tensor.to("meta")
        register_buffer(self, name, tensor, persistent=persistent)

    old_dtype = torch.get_default_dtype()
    module_cls.register_parameter, module_cls.register_buffer = to_meta_parameter, to_meta_buffer
    try:
        if dtype is not None:
            torch.set_default_dtype(dtype)
        yield
    finally:
        module_cls.register_parameter, module_cls.register_buffer = register_parameter, register_buffer
        torch.set_default_dtype(old_dtype)


def tp_mesh(device_mesh, tp_plan, device):
    """The tensor-parallel mesh from_pretrained shards over: ``device_mesh``, or with
    ``tp_plan="auto"`` every process of the default group (on ``device``'s type, default CUDA when
    available); None for a single-device model."""
    if tp_plan is None:
        return device_mesh
    if tp_plan != "auto":
        raise ValueError(f"tp_plan must be 'auto' or None, got {tp_plan!r} (the placement is the model's own)")
    if device_mesh is not None:
        raise ValueError("pass device_mesh or tp_plan='auto', not both")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError("tp_plan='auto' needs an initialised process group (run under torchrun and call "
                           "torch.distributed.init_process_group first)")
    kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    return init_device_mesh(kind, (dist.get_world_size(),))


_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision", "token",
               "_from_auto", "adapter_kwargs", "trust_remote_code", "low_cpu_mem_usage", "use_safetensors")


def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, dtype=None, torch_dtype=None,
                    device=None, device_map=None, output_loading_info: bool = False, progress: bool = True,
                    subfolder: str = "", device_mesh=None, tp_plan=None, **kwargs):
    """``cls.from_pretrained`` for a local K2.x checkpoint directory (see :func:`load_checkpoint`).

    ``device_mesh`` (a 1-D DeviceMesh) loads this rank's tensor-parallel shard, reading only its
    slices (models/parallel.py); ``tp_plan="auto"`` does so over every process of the initialised
    default process group (e.g. under torchrun), as transformers users expect.

    Takes what ``AutoModelForCausalLM.from_pretrained`` passes on (``config``, hub arguments,
    ``trust_remote_code`` — never used: no remote code runs).  ``device_map`` may name one
    device.  Returns the model in eval mode (and a :class:`LoadingInfo` with
    ``output_loading_info=True``).
    """
    directory = Path(pretrained_model_name_or_path) / subfolder
    if not directory.is_dir():
        raise MissingShardError(f"{directory}: not a local checkpoint directory (download it first; "
                                f"this loader reads local safetensors directories only)")
    unknown = {k: v for k, v in kwargs.items() if k not in _HUB_KWARGS and v is not None}
    if unknown:
        raise TypeError(f"{cls.__name__}.from_pretrained: unsupported arguments {sorted(unknown)}")
    if kwargs.get("use_safetensors") is False:
        raise ValueError("only safetensors checkpoints are supported (use_safetensors=False was given)")
    if device_map is not None:
        if device is not None or not isinstance(device_map, (str, torch.device, int)) or device_map == "auto":
            raise ValueError(f"device_map={device_map!r}: give one device (e.g. 'cuda:0'); "
                             "sharding across devices is applied from outside the model")
        device = device_map
    if dtype is None:
        dtype = torch_dtype
    dtype = resolve_dtype(dtype, read_config_json(directory))
    if config is None:
        config = cls.config_class.from_pretrained(directory)
    with empty_weights(dtype):
        model = cls(config, *model_args)
    mesh = tp_mesh(device_mesh, tp_plan, device)
    if mesh is not None:
        from ..parallel import parallelize

        parallelize(model, mesh)
    info = load_checkpoint(model, directory, device=device, dtype=dtype, progress=progress)
    if device is not None:
        model.to(device)  # non-persistent buffers built on the host; loaded tensors are already there
    model.eval()
    if getattr(model, "config", None) is not None:
        model.config._name_or_path = str(directory)
    if (directory / "generation_config.json").is_file() and hasattr(model, "generation_config"):
        from transformers import GenerationConfig
        model.generation_config = GenerationConfig.from_pretrained(directory)
    return (model, info) if output_loading_info else model
