"""The per-step model of tensor parallelism: K2.6 TP-8 tokens/s projected from one GPU's numbers,
and (second half, for bench/tp8_run.py on eight GPUs) from TP-8 steps measured over real NCCL.

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
    - a drafter, in a tree step: its fc (the taps' context) one all-reduce, its layers two each,
      and the draft top-K three all-gathers (each shard's top-K values, ids and log-sum-exp, then
      merged: session._draft_topk).  An autoregressive step only stores its taps; their fc runs
      in the session's flush, its own graph, once per DEFER_ROWS AR steps (session.py);
    - greedy token choice over the vocabulary shards: two all-gathers (each shard's best value and
      its id), only where the vocabulary is split (``world > 1``: sampling.select_tokens).
    """
    if target_layers < 1 or budget < 0 or world < 1 or (drafter_layers is not None and drafter_layers < 1):
        raise ValueError(f"collectives_per_step: target_layers {target_layers}, budget {budget}, "
                         f"drafter_layers {drafter_layers}, world {world}")
    if budget and drafter_layers is None:
        raise ValueError("collectives_per_step: a tree step (budget > 0) has a drafter")
    reduces, gathers = 2 * target_layers, 2 if world > 1 else 0
    if drafter_layers is not None and budget:
        reduces += 1 + 2 * drafter_layers
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


# --------------------------------------------------------------------------------------------
# Eight GPUs (bench/tp8_run.py, issue 47): the TP-8 step MEASURED over real NCCL at two depths,
# scaled to 61 layers, and carried over to another card by bandwidth and link
# --------------------------------------------------------------------------------------------
#
#   step(61), comm(61)  = scale_to_layers of the step and of its collectives' time (NCCL kernel time
#                         per step, torch.profiler) measured at two depths (:func:`project_depth`)
#   8x H200             = step(61) as measured: nothing assumed but the depth scaling
#   another card        = (step(61) - comm(61)) x (H200 bandwidth / its bandwidth)      [memory-bound]
#                         + its collectives: count x (latency + ring bytes / bus bandwidth), serial
#                         (:func:`collective_messages`, :func:`ring_all_reduce_us`, :func:`scale_to_card`)
#   tokens / s          = tokens per step / step; a DDTree step emits at most min(B, L) + 1 tokens
#                         (:func:`max_accept`), so an acceptance above that is left out (None)
#
# Assumptions (each stated where its constant is):
# - Memory-bound: every non-collective microsecond of the H200 step scales with the bandwidth ratio.
#   Launch gaps and small latency-bound kernels scale less (the projection leans slow there); a
#   compute-bound share (large trees) scales with the FLOP ratio instead (sm_120's dense bf16 tensor
#   rate is roughly half the H200's, so such a share would lean fast).
# - Collectives do not overlap compute (true of this code: each all-reduce is waited on at once).
# - The other card runs the same kernels at the same efficiency (no sm_120 tuning measured).

# NVIDIA RTX PRO 6000 Blackwell: 96 GB GDDR7 on a 512-bit bus at 28 Gbps = 1,792 GB/s, PCIe Gen5 x16,
# no NVLink (VideoCardz's spec sheet, summarised at https://gpu.name/posts/nvidia-unveils-rtx-pro-6000-
# blackwell-gpu-with-24-064-cores-and-96gb-memory).  ASSUMED achievable: 1,600 (low) to 1,792 (high) GB/s
# (an H200 reads ~4.24 of its 4.8 TB/s in bench/conftest.hbm_ceiling, ~88 %).
RTX_PRO_6000_GBS = (1600.0, 1792.0)
# NVIDIA H200: 4.8 TB/s HBM3e (spec).  The H200 side of the ratio is the read rate measured in the same
# run (bench/conftest.hbm_ceiling) when there is one; this spec otherwise.
H200_SPEC_GBS = 4800.0
# NCCL all-reduce over PCIe on 8x RTX PRO 6000 (voipmonitor/rtx6kpro, hardware/pcie-bandwidth.md at commit
# 070506f: ~24 us from 256 B to 64 KB, 28 us at 256 KB through PCIe switches; nccl-tests bus bandwidth
# 22.2-41.1 GB/s on 8 GPUs): latency LINKS["pcie_gen5"] (16-26 us, as assumed before) plus the ring's
# 2 (N - 1) / N x bytes at this ASSUMED bus bandwidth, (low, high) GB/s.
PCIE_BUS_GBS = (22.0, 41.0)
# Mean tokens per DDTree step the projection is tabulated at (issue 47).
ACCEPTANCES = (3.0, 5.0, 8.0)
K2_HIDDEN = 7168
BLOCK_SIZE = 8  # the K2.5 / K2.6 DFlash drafter's block (L = 7 draft depths)


def max_accept(budget: int, block_size: int = BLOCK_SIZE) -> int:
    """The most tokens one step emits: the accepted path's drafts (at most min(B, L), L = block_size - 1
    depths) and the target's next token; 1 for the autoregressive step (budget 0)."""
    if budget < 0 or block_size < 2:
        raise ValueError(f"max_accept: budget {budget}, block_size {block_size}")
    return min(budget, block_size - 1) + 1 if budget else 1


def collective_messages(target_layers: int, budget: int, drafter_layers: int | None = None, *, world: int = 8,
                        hidden: int = K2_HIDDEN, block_size: int = BLOCK_SIZE, dtype_bytes: int = 2) -> list:
    """[(count, bytes each rank contributes)] of one step's collectives -- :func:`collectives_per_step`'s,
    with sizes: the target's all-reduces carry the step's tokens (1, or B + 1 tree nodes) x ``hidden``;
    the drafter's fc (tree steps only) its appended context (up to ``block_size`` accepted nodes),
    its layers the block (``block_size`` tokens); the vocabulary gathers
    (a value and an id per token and shard; the draft top-K's K values, ids and log-sum-exps) are
    counted as latency only (0 bytes)."""
    reduces, gathers = collectives_per_step(target_layers, budget, drafter_layers, world)
    row = hidden * dtype_bytes
    out = [(2 * target_layers, (budget + 1 if budget else 1) * row)]
    if drafter_layers is not None and budget:
        out.append((1, block_size * row))
        out.append((2 * drafter_layers, block_size * row))
    if gathers:
        out.append((gathers, 0))
    assert sum(c for c, _ in out) == reduces + gathers
    return out


def ring_all_reduce_us(nbytes: float, world: int, latency_us: float, bus_gbs: float) -> float:
    """One all-reduce of ``nbytes`` per rank: ``latency_us`` plus a ring's 2 (N - 1) / N x nbytes at
    ``bus_gbs`` (nccl-tests' bus bandwidth; world 1 moves nothing)."""
    if nbytes < 0 or world < 1 or latency_us < 0 or bus_gbs <= 0:
        raise ValueError(f"ring_all_reduce_us: nbytes {nbytes}, world {world}, latency_us {latency_us}, "
                         f"bus_gbs {bus_gbs}")
    return latency_us + 2 * (world - 1) / world * nbytes / (bus_gbs * 1e3)


def step_communication_s(messages, world: int, latency_us: float, bus_gbs: float) -> float:
    """Seconds of one step's collectives (:func:`collective_messages`), serial."""
    return sum(count * ring_all_reduce_us(nbytes, world, latency_us, bus_gbs) for count, nbytes in messages) * 1e-6


def scale_to_card(step_s: float, comm_s: float, bandwidth_ratio: float, other_comm_s: float) -> float:
    """A step measured on one card (``comm_s`` of it in collectives) on another: the rest scaled by
    ``bandwidth_ratio`` (this card's bandwidth / the other's; memory-bound), plus the other card's
    collectives ``other_comm_s``."""
    if step_s <= 0 or not 0 <= comm_s <= step_s or bandwidth_ratio <= 0 or other_comm_s < 0:
        raise ValueError(f"scale_to_card: step_s {step_s}, comm_s {comm_s}, bandwidth_ratio {bandwidth_ratio}, "
                         f"other_comm_s {other_comm_s}")
    return (step_s - comm_s) * bandwidth_ratio + other_comm_s


def project_depth(measured: dict, layers: int = K2_LAYERS) -> dict:
    """{budget: (step_s, comm_s)} at ``layers`` decoder layers from the same budgets measured at two
    depths, ``measured`` = {depth: {budget: (step_s, comm_s)}} (the two smallest depths if more):
    each by :func:`scale_to_layers`; the collectives' time is kept within [0, step]."""
    if len(measured) < 2:
        raise ValueError(f"project_depth: two depths needed, got {sorted(measured)}")
    (short, a), (long, b) = sorted(measured.items())[:2]
    out = {}
    for budget in sorted(set(a) & set(b)):
        step = scale_to_layers(a[budget][0], b[budget][0], short, long, layers)
        comm = scale_to_layers(a[budget][1], b[budget][1], short, long, layers)
        out[budget] = (step, min(max(comm, 0.0), step))
    return out


def mix_tokens_per_s(tokens: int, budget_steps: dict, step_s: dict) -> float:
    """Tokens per second of a generation that ran ``budget_steps`` = {budget: steps} with each budget's
    step taking ``step_s[budget]`` seconds (a tree_budget="auto" run carried over to other step times)."""
    seconds = sum(n * step_s[b] for b, n in budget_steps.items())
    if tokens <= 0 or seconds <= 0:
        raise ValueError(f"mix_tokens_per_s: tokens {tokens}, seconds {seconds}")
    return tokens / seconds


def cases(measured_card: str = "8x H200") -> list:
    """(card, case, other) of the projection: the measured card as measured (other None), and 8x RTX PRO
    6000 at the low and the high end of its assumptions, other = (bandwidth GB/s, latency us, bus GB/s):
    low = (:data:`RTX_PRO_6000_GBS` low, ``LINKS["pcie_gen5"]`` high, :data:`PCIE_BUS_GBS` low), high the
    other ends."""
    pcie = LINKS["pcie_gen5"]
    return [(measured_card, "measured", None),
            ("8x RTX PRO 6000", "low", (RTX_PRO_6000_GBS[0], pcie[1], PCIE_BUS_GBS[0])),
            ("8x RTX PRO 6000", "high", (RTX_PRO_6000_GBS[1], pcie[0], PCIE_BUS_GBS[1]))]


def card_step(step_s: float, comm_s: float, budget: int, other, *, h200_gbs: float = H200_SPEC_GBS,
              drafter_layers: int | None = None, world: int = 8, layers: int = K2_LAYERS, hidden: int = K2_HIDDEN,
              block_size: int = BLOCK_SIZE) -> tuple[float, float]:
    """(step, collectives) seconds of a step measured as (``step_s``, ``comm_s``) on the measured card, on
    the card ``other`` describes (:func:`cases`; None: the measured card itself): :func:`scale_to_card`
    with that card's collectives (:func:`collective_messages` of ``layers``, ``budget`` and
    ``drafter_layers`` -- None: no drafter in the step)."""
    if other is None:
        return step_s, comm_s
    gbs, latency, bus = other
    msgs = collective_messages(layers, budget, drafter_layers, world=world, hidden=hidden, block_size=block_size)
    comm = step_communication_s(msgs, world, latency, bus)
    return scale_to_card(step_s, comm_s, h200_gbs / gbs, comm), comm


def card_rows(steps: dict, *, h200_gbs: float = H200_SPEC_GBS, measured_card: str = "8x H200", world: int = 8,
              layers: int = K2_LAYERS, drafter_layers: int = DRAFTER_LAYERS, hidden: int = K2_HIDDEN,
              block_size: int = BLOCK_SIZE, acceptances=ACCEPTANCES) -> list[dict]:
    """The projected steps and tokens/s of every budget in ``steps`` = {budget: (step_s, comm_s)} (the
    measured card's step at ``layers``, :func:`project_depth`; budget 0 without a drafter, the tree
    budgets with one) for each of :func:`cases`.  Each row: card, case, budget, step_ms, comm_ms,
    comm_share, tokens_per_s {acceptance: tokens/s, None where a step cannot emit that many
    (:func:`max_accept`); AR: {1.0: ...}}, speedup_vs_ar {acceptance: tokens/s / the same card and case's
    AR tokens/s}."""
    rows = []
    for card, case, other in cases(measured_card):
        ar_s = None
        for budget, (step, comm) in sorted(steps.items()):
            s, c = card_step(step, comm, budget, other, h200_gbs=h200_gbs, drafter_layers=drafter_layers if budget
                             else None, world=world, layers=layers, hidden=hidden, block_size=block_size)
            if budget == 0:
                ar_s = s
            accepts = (1.0,) if budget == 0 else tuple(acceptances)
            rates = {a: (a / s if a <= max_accept(budget, block_size) else None) for a in accepts}
            rows.append({"card": card, "case": case, "budget": budget, "step_ms": s * 1e3, "comm_ms": c * 1e3,
                         "comm_share": c / s, "tokens_per_s": rates,
                         "speedup_vs_ar": {a: (r * ar_s if r is not None and ar_s else None) for a, r in rates.items()}})
    return rows


__all__ = ["LINKS", "K2_LAYERS", "DRAFTER_LAYERS", "ASSUMED_ACCEPT", "collectives_per_step", "scale_to_layers",
           "Projection", "project", "RTX_PRO_6000_GBS", "H200_SPEC_GBS", "PCIE_BUS_GBS", "ACCEPTANCES", "K2_HIDDEN",
           "BLOCK_SIZE", "max_accept", "collective_messages", "ring_all_reduce_us", "step_communication_s",
           "scale_to_card", "project_depth", "mix_tokens_per_s", "cases", "card_step", "card_rows"]
