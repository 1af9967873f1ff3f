"""Tensor parallelism for Kimi K2 and its DFlash drafter, applied from outside (docs/parallel.md).

``parallelize(model, mesh)`` turns a model built on the meta device (before loading: each rank
then reads only its slices) or an already loaded one into this rank's shard of it:

- Every rank holds plain, contiguous local shards: the ``kdtree`` ops and the fused forms read
  them as they are (heads, expert width and vocabulary come from weight shapes).  The sharding
  is recorded in :class:`TensorParallel` (``model.tp``): the placement of every tensor as DTensor
  placements (``Shard(dim)`` / ``Replicate()``), the global shapes, and :meth:`TensorParallel.dtensor`
  to rebuild the global view (``DTensor.from_local``) for saving and checks.
- Placement (K2): q_a / kv_a projections, their norms, the router and its bias, the embedding
  replicated; q_b_proj and kv_b_proj by head (so W_UK / W_UV), o_proj by input; dense MLP and
  shared expert gate / up by output, down by input; routed experts by intermediate size, every
  expert on every rank (INT4 group-32 scales and tiles kept whole); lm_head by vocabulary.
  The latent KV cache is replicated: every rank writes the same rows.
- Two all-reduces per layer (after the attention and after the MLP / MoE block), functional
  collectives registered as forward hooks on ``self_attn`` and ``mlp`` (gpt-fast's way), so the
  reference forward is unchanged and the step compiles with ``fullgraph=True``; the decode plan
  knows those hooks and runs the same reductions in its fused forms, with the residual added
  after the reduction (an epilogue adding it on every rank would add it N times).
- The drafter likewise: q / k / v by head, o_proj and down by input, gate / up by output, fc by
  input (its input slice taken in a pre-hook, the sum reduced after it).

Token choice over the sharded vocabulary lives in :mod:`models.generation.sampling` and the
session (an all-gather of each shard's best, ties to the lower global id; the draft top-K by
``draft_topk_partial`` + all-gather + ``draft_topk_merge``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

__all__ = ["TensorParallel", "parallelize", "tp_of", "vocab_shard", "ParallelConfigError"]


class ParallelConfigError(ValueError):
    """A model or mesh that tensor parallelism cannot split as asked."""


# torch >= 2.14 renames all_gather_tensor (same arguments); 2.11 has only the old name
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def _wait(x):
    return x.wait() if isinstance(x, funcol.AsyncCollectiveTensor) else x


@dataclass
class TensorParallel:
    """One rank's view of a tensor-parallel model (module docstring)."""

    mesh: object
    shard_dims: dict[str, int] = field(default_factory=dict)       # state name -> sharded dim
    global_shapes: dict[str, tuple] = field(default_factory=dict)  # state name -> global shape
    hook_ids: set = field(default_factory=set)                     # the reduction hooks' ids
    int4_experts: set = field(default_factory=set)                 # INT4 expert modules (sliced by width)

    def __post_init__(self):
        # a plain bool, read by compiled steps (the mesh's rank query stays out of the traced code):
        # the rank whose fused epilogues add the residual, which the all-reduce then sums in
        self.first_rank = self.mesh.get_local_rank() == 0

    @property
    def group(self):
        return self.mesh.get_group()

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank()

    @property
    def world(self) -> int:
        return self.mesh.size()

    # collectives (functional: traced into compiled steps and captured in CUDA graphs) -------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return _wait(funcol.all_reduce(x, "sum", self.group))

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """The ranks' ``x`` concatenated along ``dim`` in rank order."""
        return _wait(_all_gather(x.contiguous(), dim % x.dim(), self.group))

    def stack(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` stacked along a new leading dim, in rank order."""
        return self.all_gather(x[None], 0)

    def broadcast_object(self, obj, src: int = 0):
        """A host value decided on rank ``src``, the same on every rank (host decisions of the SPMD loop)."""
        box = [obj]
        dist.broadcast_object_list(box, group_src=src, group=self.group)
        return box[0]

    # placements ---------------------------------------------------------------------------
    def placement(self, name: str):
        from torch.distributed.tensor import Replicate, Shard

        dim = self.shard_dims.get(name)
        return Replicate() if dim is None else Shard(dim)

    def dtensor(self, name: str, local: torch.Tensor):
        """The global view of this rank's ``local`` tensor ``name`` (a DTensor over the mesh)."""
        from torch.distributed.tensor import DTensor

        if name.rpartition(".")[0] in self.int4_experts:
            raise ValueError(f"TensorParallel.dtensor: {name} is in int4_moe's kernel layout, sliced by intermediate "
                             f"size in compressed form (no Shard(dim) of the global tensor)")
        shape = self.global_shapes.get(name, tuple(local.shape))
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, self.mesh, [self.placement(name)], run_check=False, shape=torch.Size(shape),
                                  stride=stride)

    def index(self, name: str, shape: tuple) -> tuple:
        """The slices of a tensor of global ``shape`` that this rank holds as ``name``."""
        dim = self.shard_dims.get(name)
        if dim is None:
            return tuple(slice(None) for _ in shape)
        n = shape[dim] // self.world
        return tuple(slice(self.rank * n, (self.rank + 1) * n) if d == dim else slice(None) for d in range(len(shape)))


def tp_of(module: nn.Module) -> Optional[TensorParallel]:
    """The :class:`TensorParallel` a model was parallelised with (None: a single-device model)."""
    return getattr(module, "tp", None)


# --------------------------------------------------------------------------------------------
# placement rules
# --------------------------------------------------------------------------------------------

# (pattern on the state name, sharded dim)
_K2_RULES = (
    (r"\.self_attn\.(q_b_proj|q_proj|kv_b_proj)\.weight$", 0),  # by head
    (r"\.self_attn\.o_proj\.weight$", 1),                       # by input
    (r"\.mlp\.(shared_experts\.)?(gate_proj|up_proj)\.weight$", 0),
    (r"\.mlp\.(shared_experts\.)?down_proj\.weight$", 1),
    (r"\.mlp\.experts\.(gate_proj|up_proj)$", 1),               # [E, I, H] by intermediate size
    (r"\.mlp\.experts\.down_proj$", 2),                         # [E, H, I]
    (r"^lm_head\.weight$", 0),                                  # by vocabulary
)
_DFLASH_RULES = (
    (r"\.self_attn\.(q_proj|k_proj|v_proj)\.weight$", 0),
    (r"\.self_attn\.o_proj\.weight$", 1),
    (r"\.mlp\.(gate_proj|up_proj)\.weight$", 0),
    (r"\.mlp\.down_proj\.weight$", 1),
    (r"^fc\.weight$", 1),
)
# compressed-tensors INT4 expert tensors (one expert's [out, in/8] packed, [out, in/group] scale):
# gate / up by output rows, down by input columns (whole groups).
INT4_EXPERT_DIMS = {"gate_proj": 0, "up_proj": 0, "down_proj": 1}


def vocab_shard(tp: Optional[TensorParallel], vocab_size: int) -> tuple[int, int]:
    """(first id, size) of the vocabulary a rank's logits cover: all of it without tensor
    parallelism (or at world 1), else the rank's contiguous ``lm_head`` shard."""
    if tp is None or tp.world == 1:
        return 0, vocab_size
    local = vocab_size // tp.world
    return tp.rank * local, local


def _shard_dim(rules, name: str) -> Optional[int]:
    for pattern, dim in rules:
        if re.search(pattern, name):
            return dim
    return None


def _divides(what: str, n: int, world: int, unit: int = 1) -> None:
    if n % (world * unit):
        extra = f" in units of {unit}" if unit > 1 else ""
        raise ParallelConfigError(f"tensor parallelism over {world} ranks: {what} = {n} does not divide by {world}{extra}")


def _check_k2(config, world: int) -> None:
    _divides("num_attention_heads", config.num_attention_heads, world)
    _divides("intermediate_size (dense MLP)", config.intermediate_size, world)
    _divides("moe_intermediate_size", config.moe_intermediate_size, world)
    _divides("vocab_size", config.vocab_size, world)
    if config.attention_bias:
        raise ParallelConfigError("tensor parallelism: attention_bias=True is not supported (o_proj's bias would be "
                                  "added on every rank)")
    quant = getattr(config, "quantization_config", None)
    if quant:  # INT4 experts: each rank's width must hold whole scale groups
        groups = [g.get("weights", {}).get("group_size") for g in (quant.get("config_groups") or {}).values()]
        group = next((g for g in groups if g), 32)
        _divides("moe_intermediate_size (INT4 scale groups)", config.moe_intermediate_size, world, group)


# --------------------------------------------------------------------------------------------
# parallelize
# --------------------------------------------------------------------------------------------

def _narrow(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    n = t.shape[dim] // world
    if t.is_meta:
        shape = list(t.shape)
        shape[dim] = n
        return torch.empty(shape, dtype=t.dtype, device="meta")
    return t.narrow(dim, rank * n, n).contiguous().clone()


def _set(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value


def _shard_tensors(model: nn.Module, tp: TensorParallel, rules) -> None:
    for name, t in list(model.state_dict(keep_vars=True).items()):
        tp.global_shapes[name] = tuple(t.shape)
        dim = _shard_dim(rules, name)
        if dim is None:
            continue
        tp.shard_dims[name] = dim
        _set(model, name, _narrow(t.data if isinstance(t, nn.Parameter) else t, dim, tp.rank, tp.world))


def _shard_int4_experts(name: str, experts, tp: TensorParallel) -> None:
    """Slice loaded INT4 experts in their compressed-tensors form (recovered exactly from the kernel
    layout) by intermediate size and repack the slice.  Their kernel-layout buffers have no plain
    Shard(dim) placement; :meth:`TensorParallel.dtensor` refuses them."""
    gp, gs, up, us, dp, ds = experts.int4_weights().compressed()
    parts = []
    for (p, s), dim in (((gp, gs), 0), ((up, us), 0), ((dp, ds), 1)):
        parts += [_narrow(p, dim + 1, tp.rank, tp.world), _narrow(s, dim + 1, tp.rank, tp.world)]
    experts.set_int4(*parts)
    tp.int4_experts.add(name)


def _reduce_hook(tp: TensorParallel):
    def hook(module, args, out):
        return tp.all_reduce(out)
    return hook


def parallelize(model: nn.Module, device_mesh) -> nn.Module:
    """Shard ``model`` (a :class:`KimiK2ForCausalLM` or a :class:`DFlashDraftModel`, on the meta
    device or loaded) over the 1-D ``device_mesh`` in place; returns it (module docstring)."""
    if tp_of(model) is not None:
        raise ParallelConfigError("parallelize: the model is already parallelised")
    if device_mesh.ndim != 1:
        raise ParallelConfigError(f"parallelize: a 1-D device mesh (tensor parallelism), got {device_mesh.ndim}-D")
    tp = TensorParallel(device_mesh)
    from .dflash import DFlashDraftModel

    if isinstance(model, DFlashDraftModel):
        _parallelize_dflash(model, tp)
    else:
        _parallelize_k2(model, tp)
    return model


def _parallelize_k2(model, tp: TensorParallel) -> None:
    config = model.config
    _check_k2(config, tp.world)
    if not any(p.is_meta for p in model.parameters()):
        _check_k2_loaded(model, tp)
    int4 = {n: m for n, m in model.named_modules() if getattr(m, "is_int4", False)}
    _shard_tensors(model, tp, _K2_RULES)
    for name, experts in int4.items():
        _shard_int4_experts(name, experts, tp)
    inner = model.model
    for layer in inner.layers:
        for module in (layer.self_attn, layer.mlp):
            handle = module.register_forward_hook(_reduce_hook(tp))
            tp.hook_ids.add(handle.id)
    model.tp = inner.tp = tp
    for cached in ("_ddtree_sessions", "_ddtree_step_seconds"):  # generation state built for the whole model
        model.__dict__.pop(cached, None)


def _check_k2_loaded(model, tp: TensorParallel) -> None:
    for m in model.modules():
        if getattr(m, "dequantized", None) is not None:
            raise ParallelConfigError(f"tensor parallelism: {m.dequantized}; shard before loading instead")


def _parallelize_dflash(model, tp: TensorParallel) -> None:
    c = model.config
    _divides("drafter num_attention_heads", c.num_attention_heads, tp.world)
    _divides("drafter num_key_value_heads", c.num_key_value_heads, tp.world)
    _divides("drafter intermediate_size", c.intermediate_size, tp.world)
    _divides("drafter hidden_size (fc input per tap)", c.hidden_size, tp.world)
    _shard_tensors(model, tp, _DFLASH_RULES)
    for layer in model.layers:
        attn = layer.self_attn
        attn.num_heads //= tp.world
        attn.num_kv_heads //= tp.world
        for module in (layer.self_attn, layer.mlp):
            tp.hook_ids.add(module.register_forward_hook(_reduce_hook(tp)).id)
    width = model.fc.weight.shape[1]  # this rank's slice of the concatenated taps

    def take_slice(module, args):
        (x,) = args
        return (x[..., tp.rank * width : (tp.rank + 1) * width],)

    tp.hook_ids.add(model.fc.register_forward_pre_hook(take_slice).id)
    tp.hook_ids.add(model.fc.register_forward_hook(_reduce_hook(tp)).id)
    model.tp = tp
