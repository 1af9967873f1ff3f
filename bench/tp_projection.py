"""The per-step model of tensor parallelism: K2.6 TP-8 tokens/s projected from one GPU's numbers.

One GPU cannot run TP-8.  What it can measure (bench/bench_tensor_parallel.py) is the rank
program -- one rank's shard of the full-shape model, its collectives present in the captured graph
but doing nothing (a fake process group) -- and NCCL's own cost at world size 1 (the launch and the
graph node; world 1 crosses no link).  The rest is arithmetic, here, in plain functions (tests/
test_tp_projection.py pins them to hand-computed numbers):

    step(61 layers)   = the measured rank step, scaled in depth (:func:`scale_to_layers`)
    collectives       = :func:`collectives_per_step` (counted in the compiled step on the CPU)
    projected step    = step(61) + collectives x (assumed link latency + measured world-1 overhead)
    tokens / s        = tokens per step / projected step (1 for AR; an assumed mean acceptance for DDTree)

The link latencies are ASSUMPTIONS (docs/parallel.md's estimates for all-reduces of 14 KB -- one
decode token of hidden 7168 in bf16 -- to 244 KB -- a B = 16 verify, 17 tokens): NVLink 6-9 us,
PCIe Gen5 16-26 us per collective.  The vocabulary gathers (each shard's best value and id,
the draft top-K's values, ids and log-sum-exps) are a few hundred bytes to a few KB and are charged
the same latency as an all-reduce: small collectives are latency-bound.  The world-1 overhead is
added on top, which counts a launch the link figures may already hold (so the projection leans
slow).  Nothing here overlaps communication with compute: collectives are serial in the step.
"""
from __future__ import annotations

from dataclasses import dataclass

# Assumed per-collective latency (us), (low, high), for the message sizes above (docs/parallel.md).
LINKS = {"nvlink": (6.0, 9.0), "pcie_gen5": (16.0, 26.0)}
# K2 / K2.6: decoder layers; the K2.5 / K2.6 DFlash drafter's layers (docs/dflash.md).
K2_LAYERS = 61
DRAFTER_LAYERS = 6
# Assumed mean tokens per DDTree step: the k2_slice oracle runs of issue 44 (bench/STATUS.md: 80 % and
# 95 % per-token oracle accuracy, tree_budget="auto", 1,000 sustained tokens).  Not K2.6's own acceptance.
ASSUMED_ACCEPT = {"oracle_80": 2.74, "oracle_95": 4.83}


def collectives_per_step(target_layers: int, budget: int, drafter_layers: int | None = None,
                         world: int = 8) -> tuple[int, int]:
    """(all-reduces, all-gathers) in one compiled generation step of a tensor-parallel target over
    ``world`` ranks (budget 0: the autoregressive step; with ``drafter_layers`` a DFlash drafter,
    sharded too, runs in the step).

    - the target: two all-reduces per layer (after the attention, after the MLP / MoE block);
    - a drafter: its fc (the taps' context, appended in every step, the autoregressive one too)
      one all-reduce; in a tree step its layers two each, and the draft top-K three all-gathers
      (each shard's top-K values, ids and log-sum-exp, then merged: session._draft_topk);
    - greedy token choice over the vocabulary shards: two all-gathers (each shard's best value and
      its id), only where the vocabulary is split (``world > 1``: sampling.select_tokens).
    """
    if target_layers < 1 or budget < 0 or world < 1 or (drafter_layers is not None and drafter_layers < 1):
        raise ValueError(f"collectives_per_step: target_layers {target_layers}, budget {budget}, "
                         f"drafter_layers {drafter_layers}, world {world}")
    if budget and drafter_layers is None:
        raise ValueError("collectives_per_step: a tree step (budget > 0) has a drafter")
    reduces, gathers = 2 * target_layers, 2 if world > 1 else 0
    if drafter_layers is not None:
        reduces += 1
        if budget:
            reduces += 2 * drafter_layers
            gathers += 3
    return reduces, gathers


def scale_to_layers(short_s: float, long_s: float, short_layers: int, long_layers: int, layers: int) -> float:
    """Step seconds at ``layers`` decoder layers from steps measured at two depths of the same model
    (``short_layers`` < ``long_layers``, both with the dense layer 0, the rest MoE layers): the
    difference is the per-layer time, the rest (embedding, lm_head shard, token choice, drafter,
    tree build and accept, bookkeeping) the fixed part, so step(L) = long + (L - long_layers) x
    per-layer.  Attention's cost grows with the context; both depths run at the same context."""
    if not 0 < short_layers < long_layers <= layers:
        raise ValueError(f"scale_to_layers: need 0 < short ({short_layers}) < long ({long_layers}) <= layers "
                         f"({layers})")
    per_layer = (long_s - short_s) / (long_layers - short_layers)
    return long_s + (layers - long_layers) * per_layer


@dataclass(frozen=True)
class Projection:
    """One projected configuration (seconds, microseconds as named)."""

    rank_step_s: float      # the rank program's step at the target depth, collectives free
    collectives: int        # all-reduces + all-gathers per step
    latency_us: float       # assumed link latency per collective
    overhead_us: float      # measured world-1 cost per collective (launch + graph node)
    tokens_per_step: float  # 1 (AR) or the assumed mean DDTree acceptance

    @property
    def communication_s(self) -> float:
        return self.collectives * (self.latency_us + self.overhead_us) * 1e-6

    @property
    def step_s(self) -> float:
        return self.rank_step_s + self.communication_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def communication_share(self) -> float:
        return self.communication_s / self.step_s


def project(rank_step_s: float, reduces: int, gathers: int, latency_us: float, overhead_us: float,
            tokens_per_step: float = 1.0) -> Projection:
    """The projected step of one configuration (module docstring): the rank step plus every
    collective at ``latency_us + overhead_us``, serial."""
    if rank_step_s <= 0 or reduces < 0 or gathers < 0 or latency_us < 0 or tokens_per_step <= 0:
        raise ValueError(f"project: rank_step_s {rank_step_s}, reduces {reduces}, gathers {gathers}, "
                         f"latency_us {latency_us}, tokens_per_step {tokens_per_step}")
    return Projection(rank_step_s, reduces + gathers, latency_us, max(0.0, overhead_us), tokens_per_step)


__all__ = ["LINKS", "K2_LAYERS", "DRAFTER_LAYERS", "ASSUMED_ACCEPT", "collectives_per_step", "scale_to_layers",
           "Projection", "project"]
