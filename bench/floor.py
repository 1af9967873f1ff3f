"""The bytes a decode or tree-verify step must read from HBM at least: the numerator of every step
floor in bench/ (floor seconds = these bytes / the HBM ceiling of bench/conftest.py).

:func:`step_bytes` counts, for one step of R requests with T = budget + 1 tokens each (budget 0 is
the autoregressive step, one token):

- ``weights``: every parameter and buffer of the target except the routed experts and the token
  embedding table (the step gathers T of its rows): attention, norms, routers, the dense MLPs, the
  final norm and the lm_head, read once;
- ``shared_experts``: the MoE layers' shared experts, read once;
- ``routed_experts``: per MoE layer, the distinct routed experts the step's tokens were routed to
  (counted on the device by :class:`RoutedExperts`) x that layer's bytes per expert (its expert
  storage / E: INT4 nibbles + group scales, or the dense weights);
- ``kv``: the latent cache rows attention reads, (context + T) per request and layer, each
  kv_lora_rank + qk_rope_head_dim wide in the model's dtype;
- with a drafter and budget > 0: ``drafter_weights`` (all of its own weights), ``drafter_lm_head``
  (a second pass over the target's lm_head, which the drafter borrows for its logits) and
  ``drafter_kv`` (its context K/V, context + block_size rows per request and layer); with budget 0
  only the AR step's share of the context append that keeps the drafter's context whole (``fc``,
  ``hidden_norm``, each layer's k/v projections and ``k_norm``): the session stores AR steps' taps
  and appends them in one batch per ``DEFER_ROWS`` steps (models/generation/session.py), so an AR
  step's share is those weights / DEFER_ROWS.

Reads only: the KV rows, logits and activations a step writes are not counted, so the floor is a
lower bound.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from torch_kdtree.models.generation.session import DEFER_ROWS

class StepBytes(NamedTuple):
    weights: int
    shared_experts: int
    routed_experts: int
    kv: int
    drafter_weights: int
    drafter_lm_head: int
    drafter_kv: int

    @property
    def total(self) -> int:
        return sum(self)

    def seconds(self, ceiling_gbs: float) -> float:
        return self.total / (ceiling_gbs * 1e9)

    def fields(self) -> dict:
        """For record(): each part in MB."""
        return {f"{name}_MB": value / 1e6 for name, value in self._asdict().items()}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def moe_blocks(target) -> list:
    """The target's MoE blocks (:class:`KimiK2MoE`), in layer order."""
    from torch_kdtree.models.kimi_k2 import KimiK2MoE

    return [layer.mlp for layer in target.model.layers if isinstance(layer.mlp, KimiK2MoE)]


def expert_bytes(experts) -> int:
    """Bytes of one routed expert as stored: the experts module's storage / E."""
    storage = list(experts.parameters(recurse=False)) + list(experts.buffers(recurse=False))
    return _nbytes(storage) // experts.num_experts


def step_bytes(target, routed: Sequence[int], context_lengths: Sequence[int], budget: int,
               drafter=None) -> StepBytes:
    """Bytes one step must read (module docstring).

    Args:
        target: a KimiK2ForCausalLM.
        routed: distinct routed experts the step's tokens were routed to, per MoE layer in layer
            order (:meth:`RoutedExperts.counts`; k per layer for one request's autoregressive step).
        context_lengths: each request's committed context before the step.
        budget: the tree budget B (T = B + 1 tokens per request); 0 for the autoregressive step.
        drafter: the DFlash drafter running with the step, or None.
    """
    blocks = moe_blocks(target)
    if len(routed) != len(blocks):
        raise ValueError(f"step_bytes: {len(blocks)} MoE layers, got {len(routed)} routed-expert counts")
    for n, block in zip(routed, blocks):
        if not 0 <= n <= block.experts.num_experts:
            raise ValueError(f"step_bytes: {n} routed experts of a layer with {block.experts.num_experts}")
    T = budget + 1
    embed, head = target.model.embed_tokens.weight, target.lm_head.weight
    skip = {id(t) for b in blocks for t in (*b.experts.parameters(recurse=False), *b.experts.buffers(recurse=False))}
    shared = [t for b in blocks if b.shared_experts is not None for t in b.shared_experts.parameters()]
    skip |= {id(t) for t in shared}
    if embed is not head:  # a tied table is the lm_head, read whole
        skip.add(id(embed))
    weights = _nbytes(t for t in (*target.parameters(), *target.buffers()) if id(t) not in skip)
    routed_experts = sum(n * expert_bytes(b.experts) for n, b in zip(routed, blocks))
    c = target.config
    row = (c.kv_lora_rank + c.qk_rope_head_dim) * target.dtype.itemsize
    kv = sum(ctx + T for ctx in context_lengths) * c.num_hidden_layers * row
    drafter_weights = drafter_lm_head = drafter_kv = 0
    if drafter is not None and budget > 0:
        d = drafter.config
        drafter_weights = _nbytes(drafter.parameters())
        drafter_lm_head = _nbytes([head])
        kv_row = 2 * d.num_key_value_heads * d.head_dim * drafter.dtype.itemsize  # K and V
        drafter_kv = sum(ctx + d.block_size for ctx in context_lengths) * d.num_hidden_layers * kv_row
    elif drafter is not None:  # what DFlashDraftModel.append_context reads
        parts = [drafter.fc, drafter.hidden_norm]
        parts += [m for layer in drafter.layers for m in (layer.self_attn.k_proj, layer.self_attn.v_proj,
                                                         layer.self_attn.k_norm)]
        drafter_weights = _nbytes(p for m in parts for p in m.parameters()) // DEFER_ROWS
    return StepBytes(weights, _nbytes(shared), routed_experts, kv, drafter_weights, drafter_lm_head, drafter_kv)


class RoutedExperts:
    """Counts, on the device, the distinct experts each MoE layer's router sent tokens to while
    this context is open: a forward hook on every router ORs ``bincount(ids) > 0`` into a per-layer
    mask; :meth:`counts` reads them once.  A plan made while the hooks exist calls the routers as
    modules, so the model takes its unfused routing path meanwhile (the same choice rule); steps
    replayed from CUDA graphs call no hooks, so count on an eager session.  Every pass inside the context counts (one step's
    verify pass: open it around that step only)."""

    def __init__(self, target):
        self.routers = [b.gate for b in moe_blocks(target)]
        self.hit: list[torch.Tensor] = []
        self.calls: list[int] = []
        self._handles: list = []

    def _hook(self, i: int):
        def hook(router, args, out):
            ids = out[0].reshape(-1).long()
            self.hit[i] |= torch.bincount(ids, minlength=self.hit[i].numel()) > 0
            self.calls[i] += 1
        return hook

    def __enter__(self) -> "RoutedExperts":
        self.hit = [torch.zeros(r.weight.shape[0], dtype=torch.bool, device=r.weight.device) for r in self.routers]
        self.calls = [0] * len(self.routers)
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def counts(self) -> list[int]:
        """Distinct routed experts per MoE layer, in layer order."""
        if not all(self.calls):
            raise RuntimeError(f"RoutedExperts: routers called {self.calls} times; a router ran outside its module "
                               "(a fused routing op, or a CUDA graph replay): nothing was counted")
        return torch.stack([h.sum() for h in self.hit]).tolist()


def routed_experts_of_step(session, budget: int) -> list[int]:
    """One step of an eager (graph-free) GenerationSession at ``budget``, its routing counted:
    distinct routed experts per MoE layer (the session's drafter must have no ``prepare`` pass,
    which would run the target too)."""
    with RoutedExperts(session.target) as routed:
        # the session planned its steps before the hooks existed: plan this one again, so that the
        # hooked routers are called as modules (plan.py), and put the session's plan back after
        planned = session.plan[budget]
        session.plan[budget] = session.target.model.plan_pass(planned.rows // planned.tokens, planned.tokens, tree=True,
                                                              cache=session.cache, dtype=planned.dtype)
        try:
            session.step(budget)
        finally:
            session.plan[budget] = planned
    return routed.counts()
