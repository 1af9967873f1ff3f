"""Issue 47 in one program: tensor parallelism over a real NCCL group of N GPUs (TP-8 on eight).

Run (eight GPUs, repository root, after the build; rank 0 prints, every rank works):

    torchrun --standalone --nproc-per-node 8 bench/tp8_run.py --out /tmp/tp8

or, with the build and the run split in two device calls of < 10 min each (scripts/tp8_run.sh):

    bash scripts/tp8_run.sh 1      # build, equality, layers at 4 decoder layers
    bash scripts/tp8_run.sh 2      # layers at 8, the oracle runs, the no-op comparison, the projection

CPU smoke run (gloo, tiny configs: what tests/test_tp8_run.py runs; its times mean nothing):

    torchrun --standalone --nproc-per-node 2 bench/tp8_run.py --backend gloo --device cpu --tiny --out /tmp/tp8

Output: ``<out>/tp8_run.json`` (every figure; merged with the file already there, so parts and depths
may come from separate invocations) and ``<out>/tp8_run.txt`` (the printed table).  ``--out``
defaults to ``$OUT/tp8`` where ``$OUT`` is set, else ``./tp8_out``.

Parts (``--parts``, comma-separated, run in this order).  Minutes on 8x H200 after the build are
ESTIMATES, not measurements: no eight-GPU machine has run this yet.  Compile times dominate and are
guessed from RESULTS.md run 31 (an 8-layer 2p2b AR step compiled with combo kernels in ~15-17 s):
a K2-width step ~10-15 s at 4 layers, ~15-25 s at 8, tree steps more (the 6-layer drafter is in
them).  Total ~7 min, plus ~0.5 min of start-up (imports, NCCL) per torchrun invocation:

- ``equality`` (~1.5 min): the tensor-parallel equality checks at TP-2, TP-4 and TP-8 on SUB-MESHES
  of one process group (one invocation; :func:`equality_rounds`: at world 8, round 1 runs TP-8 on
  all ranks, round 2 TP-4 on ranks 0-3 and TP-2 on ranks 4-5 and 6-7 at once).  Every rank first
  runs the TP-1 reference itself: a tiny INT4 target (3 layers, hidden 128, 8 heads per rank at
  the largest TP, expert width 512 = 64 per rank at TP-8: :data:`EQ_TARGET`) and a 1-layer DFlash
  drafter, bf16 on CUDA (fp32 on the CPU), greedy AR and DDTree (budget 8) through ``generate``
  with its CUDA defaults (CUDA graphs, steps compiled with combo kernels).  Each TP-n group then
  parallelises the same models and checks: prefill and tree-pass logits gathered over the
  vocabulary shards against TP-1 (relative error <= 3e-2 in bf16, 1e-5 in fp32; argmax
  disagreements outside 4-ulp ties counted); greedy AR and DDTree tokens against TP-1's with
  tests/test_generate.assert_equal_up_to_bf16_ties (the sacred tests' rule: a divergence passes
  only at a bf16 tie -- logits, single-token decoding or an expert choice -- and decoding is
  checked on from the tie's other side); every session's steps are CUDA graphs (captured, then
  replayed by the generation) on every rank; the TP plan runs the TP-1 plan's kernels (its string
  with " all_reduce" removed is TP-1's); hidden states and tokens are bitwise equal across the
  ranks of a group (tokens across groups of one size are reported, not required: other GPUs,
  other NCCL rings).
- ``layers`` (~4.5 min: per depth the model build, 1 AR and 5 tree step compiles and the timing,
  ~1.5 min at 4 layers, ~2.5 at 8; the deepest depth adds the AR step with the drafter, for the
  oracle runs, and the two no-op compiles, ~0.7 min): the
  full-width K2 layers at TP = world (bench/tp_rank.py's rank program, now over the REAL group:
  hidden 7168, 64 heads = 8 a rank, 384 INT4 routed experts of width 2048 = 256 a rank + the shared
  expert, dense layer 0 of width 18432, vocabulary 163840 = 20480 a rank; random weights, each rank
  materialising only its shard) and the K2.6-shaped DFlash drafter (6 layers, 64 / 8 heads,
  intermediate 18432, block size 8, taps [0, 1]), at 4 and 8 decoder layers (``--depths``).  Per
  depth: the autoregressive step (a session without drafter) and the tree step of each budget B in
  4, 8, 16, 32, 64 (one session; at the deepest depth the drafter is wrapped in models/generation/
  oracle.py's OracleDrafter at 80 % -- its look-ahead runs eagerly before each step, outside the
  CUDA events -- and the session also holds the AR step with the drafter's context appended, row
  "AR+d", which the oracle runs' budget planner may choose; elsewhere the DFlash drafter alone), all
  compiled (``--compile``, default combo) and replayed as CUDA graphs; ms per step = median over
  ``--rounds`` rounds of ``--steps`` replays (CUDA events around each replay, as bench_generate's
  GenerationSession.time_steps), each budget from a fresh prefill of a 128-token prompt.  The
  all-reduce share of each step: NCCL kernel time per replayed step (torch.profiler, CUDA
  activity, kernels whose name holds "nccl", over ``--profile-steps`` graph replays) / the median
  step; it includes a rank's wait for the slowest peer.  At the deepest depth the same steps are
  also built with no-op collectives (TensorParallel.all_reduce -> a copy, all_gather -> copies;
  ``--noop-budgets``, default AR and B = 16: 2 more compiles) and timed in the same run: share =
  1 - no-op step / real step.  On the CPU the share is gloo's self CPU time over all ops'.
- ``oracle`` (~0.3 min, inside the deepest depth's sessions): DDTree / AR tokens/s with the oracle
  drafter at 80 % and 95 % (tree_budget "auto" through the budget planner fed this run's step
  times, and a fixed B = 16), ``--oracle-tokens`` tokens after the prompt, tokens/s inside the
  steps (the oracle's look-ahead excluded, as bench_generate).  The sessions are generate()'s own
  (GenerationSession.prefill + run), except that the look-ahead runs eagerly instead of compiled
  (:class:`_Session`), through each budget's verify pass uncompiled: compiling it per budget would
  add a K2-width compile each.
  OracleDrafter runs under tensor parallelism (its look-ahead's greedy token by the sharded argmax,
  its draft this rank's vocabulary shard); should this part raise, it records the error and the
  tree steps use the DFlash drafter.
- ``projection`` (instant; reads ``layers`` from this run or the JSON in ``--out``): full 61-layer
  K2.6 at TP-8, per budget, for mean acceptance 3, 5 and 8 tokens per step (and the oracle runs
  carried over), on the measured 8-GPU box and on 8x RTX PRO 6000 (bench/tp_projection.py's
  second half: depth scaling from the two depths, per-layer = difference / 4; the RTX step = the
  non-collective part x bandwidth ratio + PCIe collectives by count, latency and size).

Failures inside a part are recorded in the JSON (``error`` per rank), not raised, and the ranks
agree after each stage so that one rank's exception stops the part on all of them; a rank stuck in
a collective is ended by the process group's ``--timeout`` (NCCL's watchdog).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import gc
import hashlib
import io
import json
import re
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "tests"):  # bench.* as a package; tests/ for the sacred tie rule and tp_worker
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

PARTS = ("equality", "layers", "oracle", "projection")
JSON_NAME, TEXT_NAME = "tp8_run.json", "tp8_run.txt"

# equality: the tiny target of the CUDA tests (models/generation/tiny.py, hidden 128 as
# tests/test_generate.int4_model) with INT4 experts and every sharded width divisible by 8 in the
# kernels' units (INT4 scale groups of 32, 16-channel tiles: expert width 512 = 64 a rank at TP-8;
# gemv's K % 8 == 0: dense width 128 = 16 a rank); heads set per run (8 a rank at the largest TP)
EQ_TARGET = {"hidden_size": 128, "intermediate_size": 128, "moe_intermediate_size": 512, "num_hidden_layers": 3}
EQ_DRAFTER = {"num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 16,
              "intermediate_size": 64, "block_size": 4}
# layers: the K2.6 DFlash drafter at K2 width (bench/tp_rank.K26_DFLASH) tapping target layers 0, 1
# (bench_tensor_parallel's choice at both depths); the tiny run's drafter (tests/test_tp_projection)
TINY_DRAFTER = {"num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 16,
                "intermediate_size": 64, "block_size": 4, "target_layer_ids": [0, 1]}
COMM_OPS = re.compile(r"nccl|gloo|all_reduce|allreduce|all_gather|allgather|wait_tensor|broadcast", re.IGNORECASE)


# --------------------------------------------------------------------------------------------
# settings
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Settings:
    """One run's parameters (the full run's defaults; ``--tiny`` scales them down for the CPU)."""

    tiny: bool = False
    depths: tuple = (4, 8)
    budgets: tuple = (0, 4, 8, 16, 32, 64)   # generate's AUTO_BUDGETS: the tree step of each, and AR
    fixed_budget: int = 16                  # the oracle's fixed-budget run (0: none)
    prompt: int = 128
    max_new: int = 512                      # session buffers: prompt + max_new + tree <= 1024 keys (mla_decode)
    steps: int = 16
    rounds: int = 5
    profile_steps: int = 8
    oracle_tokens: int = 256
    accuracies: tuple = (0.8, 0.95)
    noop_budgets: tuple = (0, 16)
    deepest: int = 8                        # the depth of the oracle runs and the no-op comparison
    compile_step: object = "combo"
    tp_sizes: tuple = (2, 4, 8)
    eq_new_tokens: int = 32
    eq_budget: int = 8
    eq_requests: int = 3


TINY = dict(tiny=True, depths=(2, 3), budgets=(0, 2, 4), fixed_budget=0, prompt=12, max_new=40, steps=1, rounds=2,
            profile_steps=1, oracle_tokens=8, noop_budgets=(0, 4), deepest=3, compile_step=False, eq_new_tokens=8,
            eq_budget=4, eq_requests=2)


def _ints(raw: str) -> tuple:
    return tuple(int(x) for x in raw.split(",") if x.strip())


def parse_args(argv=None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--out", default="tp8_out", help="output directory (default ./tp8_out; scripts/tp8_run.sh passes "
                                                     "its own)")
    p.add_argument("--previous", default=None, help="a tp8_run.json of an earlier invocation to merge first")
    p.add_argument("--backend", default="nccl" if cuda else "gloo", choices=("nccl", "gloo"))
    p.add_argument("--device", default="cuda" if cuda else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny configurations (CPU smoke run)")
    p.add_argument("--depths", type=_ints, default=None, help="decoder layers of the K2 layers runs (default 4,8)")
    p.add_argument("--deepest", type=int, default=None, help="depth of the oracle runs and no-op comparison (default 8)")
    p.add_argument("--budgets", type=_ints, default=None, help="tree budgets, 0 = AR (default 0,4,8,16,32,64)")
    p.add_argument("--tp-sizes", type=_ints, default=None, help="equality's TP sizes (default 2,4,8; those <= world)")
    p.add_argument("--noop-budgets", type=_ints, default=None, help="no-op collective comparison (default 0,16; '' none)")
    p.add_argument("--oracle-tokens", type=int, default=None, help="tokens per oracle / AR generation (default 256)")
    p.add_argument("--steps", type=int, default=None, help="replays per timing round (default 16)")
    p.add_argument("--rounds", type=int, default=None, help="timing rounds, median taken (default 5)")
    p.add_argument("--compile", default=None, help="compile_step of the layers' sessions: combo (default on CUDA), "
                                                    "tuned, 1 (inductor), 0 (eager ops in the graphs), or a backend")
    p.add_argument("--timeout", type=int, default=300, help="process-group timeout, seconds (default 300)")
    args = p.parse_args(argv)
    asked = {y.strip() for y in args.parts.split(",")} - {""}
    if asked - set(PARTS) or not asked:
        p.error(f"--parts: unknown or empty {sorted(asked - set(PARTS))}; choose from {','.join(PARTS)}")
    args.parts = [x for x in PARTS if x in asked]
    return args


def settings_of(args, device: torch.device) -> Settings:
    s = Settings(**TINY) if args.tiny else Settings()
    if device.type != "cuda":
        s.compile_step = False  # the CPU runs steps eagerly (generate's default there)
    for field, value in (("depths", args.depths), ("deepest", args.deepest), ("budgets", args.budgets),
                         ("tp_sizes", args.tp_sizes), ("noop_budgets", args.noop_budgets),
                         ("oracle_tokens", args.oracle_tokens), ("steps", args.steps), ("rounds", args.rounds)):
        if value is not None:
            setattr(s, field, value)
    if args.compile is not None:
        s.compile_step = {"0": False, "1": True}.get(args.compile, args.compile)
    if s.fixed_budget and s.fixed_budget not in s.budgets:
        s.fixed_budget = max(s.budgets)
    return s


@dataclasses.dataclass
class Ctx:
    rank: int
    world: int
    device: torch.device
    mesh: object
    settings: Settings

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def init_distributed(args) -> Ctx:
    """The default process group (torchrun's environment; a single process without it) and a 1-D
    mesh over every rank.  NCCL is initialised eagerly (``device_id``) before anything is captured."""
    timeout = datetime.timedelta(seconds=args.timeout)
    if dist.is_torchelastic_launched():  # torchrun: the group from its environment (torch reads it)
        dist.init_process_group(args.backend, timeout=timeout)
    else:  # one process, no launcher
        dist.init_process_group(args.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        local = rank % torch.cuda.device_count()  # one node (torchrun --standalone): ranks in GPU order
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.barrier(device_ids=[local])  # NCCL's communicator made now, before anything is captured
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    import torch_kdtree  # noqa: F401  (the kdtree ops)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,))
    return Ctx(rank, world, device, mesh, settings_of(args, device))


# --------------------------------------------------------------------------------------------
# cross-rank helpers
# --------------------------------------------------------------------------------------------

def gather(obj) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank (the world group)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class Stopped(Exception):
    """A stage failed on some rank: every rank stops the part there."""


def stage(name: str, fn, *args, **kw):
    """``fn(*args, **kw)`` on every rank, then agree: if it raised anywhere, every rank raises
    :class:`Stopped` naming the ranks and their errors (the same on every rank)."""
    error, out = None, None
    try:
        out = fn(*args, **kw)
    except Exception:  # recorded and shared, not raised alone (another rank would wait in a collective)
        error = traceback.format_exc()
    errors = gather(error)
    failed = {r: e for r, e in enumerate(errors) if e}
    if failed:
        first = min(failed)
        raise Stopped(f"{name} failed on rank(s) {sorted(failed)}; rank {first}:\n{failed[first]}")
    return out


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def _free(*models) -> None:
    for m in models:
        if m is not None:
            m.__dict__.pop("_ddtree_sessions", None)
            m.__dict__.pop("_ddtree_step_seconds", None)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def equality_rounds(world: int, sizes) -> list:
    """Rounds of disjoint rank groups (lists of global ranks) that run every TP size in ``sizes``
    once or more: each round takes the sizes still to run, largest first, while they fit in the
    ranks left, then fills the ranks still left with more groups of the round's smallest size."""
    pending = sorted({int(n) for n in sizes if 1 <= int(n) <= world}, reverse=True)
    rounds = []
    while pending:
        free, chosen = world, []
        for n in list(pending):
            if n <= free:
                chosen.append(n)
                free -= n
                pending.remove(n)
        while chosen and free >= chosen[-1]:
            chosen.append(chosen[-1])
            free -= chosen[-1]
        start, groups = 0, []
        for n in chosen:
            groups.append(list(range(start, start + n)))
            start += n
        rounds.append(groups)
    return rounds


# --------------------------------------------------------------------------------------------
# part 1: equality at TP-2, TP-4, TP-8
# --------------------------------------------------------------------------------------------

def eq_pair(seed: int, heads: int, device, dtype):
    """The equality check's target (INT4 experts) and DFlash drafter, built the same on every rank."""
    from torch_kdtree.models.dflash import random_drafter
    from torch_kdtree.models.generation.tiny import quantize_experts_int4, tiny_target

    target = tiny_target(seed, **EQ_TARGET, num_attention_heads=heads, num_key_value_heads=heads)
    quantize_experts_int4(target)
    c = target.config
    drafter = random_drafter(seed=seed + 1, hidden_size=c.hidden_size, vocab_size=c.vocab_size,
                             mask_token_id=c.vocab_size - 1, num_target_layers=c.num_hidden_layers,
                             target_layer_ids=list(range(c.num_hidden_layers)), **EQ_DRAFTER)
    return target.to(device, dtype).eval(), drafter.to(device, dtype).eval()


def forward_logits(model, ids: torch.Tensor) -> dict:
    """A prefill's logits and a tree pass's (4 branching nodes over the prefilled cache), gathered
    over the vocabulary shards, in fp32; and a digest of the prefill's hidden states."""
    from torch_kdtree.models import KimiK2Cache

    tp = getattr(model, "tp", None)
    whole = (lambda x: tp.all_gather(x, -1)) if tp is not None else (lambda x: x)
    dev, R, N = ids.device, ids.shape[0], 4
    with torch.no_grad():
        out = model(ids)
        prefill = whole(out.logits).float()
        visible = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool, device=dev)
        visible = visible.expand(R, N, N).contiguous()
        depth = visible.sum(-1) - 1
        tokens = torch.randint(3, model.config.vocab_size, (R, N), generator=torch.Generator().manual_seed(5)).to(dev)
        cache = KimiK2Cache.for_model(model.config, R, 64, dtype=model.dtype, device=dev)
        model(ids, cache=cache)
        cache.advance(ids.shape[1])
        tree = whole(model(tokens, cache.lengths.long()[:, None] + depth, cache, visible).logits).float()
    return {"prefill": prefill, "tree": tree, "hidden": digest(out.last_hidden_state)}


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp(min=1e-30))) - 7)


def argmax_disagreements(got: torch.Tensor, want: torch.Tensor) -> tuple[int, int]:
    """(positions whose argmax differs, those of them whose two tokens are more than 4 bf16 ulps
    apart in ``want``: not a tie)."""
    a, b = got.argmax(-1), want.argmax(-1)
    differ = a != b
    if not differ.any():
        return 0, 0
    wa, wb = want.gather(-1, a[..., None])[..., 0], want.gather(-1, b[..., None])[..., 0]
    ulp = _bf16_ulp(want.abs().amax(-1))
    beyond = differ & ((wb - wa).abs() > 4 * ulp)
    return int(differ.sum()), int(beyond.sum())


def _generate(model, ids, mask, s: Settings, **kw):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=s.eq_new_tokens, eos_token_id=None,
                         return_dict_in_generate=True, **kw)
    return out.sequences, len(out.budgets or [])


def _sessions(model) -> list:
    return list(model.__dict__.get("_ddtree_sessions", {}).values())


def _ar_plan(model) -> str | None:
    plans = [str(x.plan) for x in _sessions(model) if x.budgets == (0,)]
    return plans[0] if plans else None


def _sacred():
    """tests/test_generate (the sacred tests' prompts and bf16-tie rule).  Importing it imports
    tests/conftest, which sets torch's CPU threads to 2: put back this process's count."""
    threads = torch.get_num_threads()
    import test_generate

    torch.set_num_threads(threads)
    return test_generate


def equality_reference(ctx: Ctx, heads: int) -> dict:
    """TP-1 on this rank: greedy AR and DDTree tokens, logits, the AR plan."""
    prompts = _sacred().prompts
    s = ctx.settings
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    target, drafter = eq_pair(5, heads, ctx.device, dtype)
    ids, mask = prompts(s.eq_requests, 5)
    ids, mask = ids.to(ctx.device), mask.to(ctx.device)
    ar, _ = _generate(target, ids, mask, s)
    dd, _ = _generate(target, ids, mask, s, drafter=drafter, tree_budget=s.eq_budget)
    return {"target": target, "ids": ids, "mask": mask, "ar": ar, "dd": dd, "logits": forward_logits(target, ids),
            "plan": _ar_plan(target), "dtype": dtype}


def _tie_check(ref, ids, mask, got, want) -> tuple[str, list]:
    """tests/test_generate.assert_equal_up_to_bf16_ties against the TP-1 model: ("equal" | "ties" |
    "FAIL: ...", the lines it printed)."""
    sacred = _sacred()
    if torch.equal(got, want):
        return "equal", []
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            sacred.assert_equal_up_to_bf16_ties(ref, ids, mask, got, want, resume=sacred._greedy(ref, "auto"))
        verdict = "ties"
    except AssertionError as e:
        verdict = f"FAIL: {e}"
    return verdict, buf.getvalue().splitlines()


def equality_check(ctx: Ctx, ref: dict, mesh, heads: int) -> dict:
    """One TP group's checks against the reference (module docstring); errors recorded, not raised."""
    from torch_kdtree.models.parallel import parallelize

    s, report = ctx.settings, {"rank": ctx.rank, "group": mesh.mesh.tolist(), "size": mesh.size()}
    target = None
    try:
        target, drafter = eq_pair(5, heads, ctx.device, ref["dtype"])
        parallelize(target, mesh)
        parallelize(drafter, mesh)
        ids, mask = ref["ids"], ref["mask"]
        got = forward_logits(target, ids)
        tol = 3e-2 if ref["dtype"] == torch.bfloat16 else 1e-5
        for key in ("prefill", "tree"):
            report[f"{key}_rel_err"] = rel_err(got[key], ref["logits"][key])
            report[f"{key}_argmax_differ"], report[f"{key}_argmax_beyond_ties"] = \
                argmax_disagreements(got[key], ref["logits"][key])
        report["logits_ok"] = report["prefill_rel_err"] <= tol and report["tree_rel_err"] <= tol
        report["logits_tol"] = tol
        report["hidden"] = got["hidden"]
        ar, ar_steps = _generate(target, ids, mask, s)
        dd, dd_steps = _generate(target, ids, mask, s, drafter=drafter, tree_budget=s.eq_budget)
        report["steps"] = {"ar": ar_steps, "dd": dd_steps}
        report["tokens"] = {"ar": digest(ar), "dd": digest(dd)}
        report["ar"], report["ar_log"] = _tie_check(ref["target"], ids, mask, ar, ref["ar"])
        report["dd"], report["dd_log"] = _tie_check(ref["target"], ids, mask, dd, ref["dd"])
        report["dd_vs_tp1_ar"], _ = _tie_check(ref["target"], ids, mask, dd, ref["ar"])
        sessions = _sessions(target)
        report["graphs"] = (all(x.use_graphs and set(x.budgets) <= set(x.graphs) for x in sessions) and bool(sessions)
                            if ctx.cuda else None)
        report["all_reduce_in_plan"] = bool(sessions) and all("all_reduce" in str(x.plan) for x in sessions)
        plan = _ar_plan(target)
        report["same_kernels"] = plan is not None and plan.replace(" all_reduce", "") == ref["plan"]
        if not report["same_kernels"]:
            report["plans"] = {"tp": plan, "tp1": ref["plan"]}
        report["ok"] = bool(report["logits_ok"] and not report["ar"].startswith("FAIL")
                            and not report["dd"].startswith("FAIL") and report["graphs"] is not False
                            and report["all_reduce_in_plan"] and report["same_kernels"]
                            and ar_steps > 0 and dd_steps > 0)
    except Exception:
        report["error"] = traceback.format_exc()
        report["ok"] = False
    finally:
        _free(target)
    return report


def part_equality(ctx: Ctx) -> dict:
    from torch.distributed.device_mesh import DeviceMesh

    s = ctx.settings
    sizes = sorted({n for n in s.tp_sizes if 1 < n <= ctx.world})
    heads = 8 * max(sizes or [1])
    out = {"sizes": sizes, "heads": heads, "dtype": "bfloat16" if ctx.cuda else "float32",
           "compile_step": "combo (generate's CUDA default)" if ctx.cuda else "eager (generate's CPU default)",
           "rounds": equality_rounds(ctx.world, sizes), "by_size": {}}
    if not sizes:
        out["skipped"] = f"no TP size > 1 among {list(s.tp_sizes)} fits world {ctx.world}"
        return out
    ref = stage("equality reference (TP-1)", equality_reference, ctx, heads)
    out["tp1_tokens"] = {"ar": digest(ref["ar"]), "dd": digest(ref["dd"])}
    out["tp1_tokens_same_on_all_ranks"] = len(set(gather((digest(ref["ar"]), digest(ref["dd"]))))) == 1
    for groups in out["rounds"]:
        handles = [dist.new_group(g) for g in groups]  # every rank creates every group, in the same order
        mine = [(g, h) for g, h in zip(groups, handles) if ctx.rank in g]
        report = None
        if mine:
            g, h = mine[0]
            mesh = DeviceMesh.from_group(h, ctx.device.type)
            report = equality_check(ctx, ref, mesh, heads)
        reports = [r for r in gather(report) if r is not None]
        for size in sorted({r["size"] for r in reports}):
            rs = [r for r in reports if r["size"] == size]
            summary = {"groups": sorted({tuple(r["group"]) for r in rs}), "ranks": rs}
            same = lambda key: len({json.dumps(r.get(key), sort_keys=True) for r in rs}) == 1  # noqa: E731
            within = lambda key: all(  # noqa: E731
                len({json.dumps(r.get(key), sort_keys=True) for r in rs if r["group"] == list(grp)}) == 1
                for grp in summary["groups"])
            summary["tokens_equal_within_groups"] = within("tokens")
            summary["hidden_equal_within_groups"] = within("hidden")
            summary["tokens_equal_across_groups"] = same("tokens")  # reported: other GPUs, other NCCL rings
            summary["ok"] = (all(r["ok"] for r in rs) and summary["tokens_equal_within_groups"]
                             and summary["hidden_equal_within_groups"])
            for key in ("prefill_rel_err", "tree_rel_err"):
                values = [r[key] for r in rs if key in r]
                summary[key] = max(values) if values else None
            for key in ("ar", "dd", "dd_vs_tp1_ar"):
                verdicts = [r.get(key, "error") for r in rs]
                summary[key] = next((v for v in verdicts if v != "equal"), "equal")
            summary["graphs"] = (None if not ctx.cuda else all(r.get("graphs") for r in rs))
            summary["same_kernels"] = all(r.get("same_kernels") for r in rs)
            out["by_size"][str(size)] = summary
        _free(None)
    out["ok"] = bool(out["by_size"]) and all(v["ok"] for v in out["by_size"].values())
    _free(ref["target"])
    return out


# --------------------------------------------------------------------------------------------
# parts 2 and 3: the full-width K2 layers at TP = world; the oracle runs
# --------------------------------------------------------------------------------------------

def global_config(layers: int, tiny: bool) -> dict:
    """The GLOBAL K2 config of ``layers`` decoder layers (bench/tp_rank.k2_global_config); tiny:
    tests/tp_worker.INT4_TARGET (hidden 128, expert width 512, vocabulary 128) at that depth."""
    from bench.tp_rank import k2_global_config
    from torch_kdtree.models.kimi_k2.writer import k2_config_dict

    if tiny:
        from tp_worker import INT4_TARGET

        return k2_config_dict({**INT4_TARGET, "num_hidden_layers": layers}, int4=True, small=False)
    return k2_global_config(layers)


def _is_look_ahead(key) -> bool:
    return key == "prepare" or (isinstance(key, tuple) and key[0] == "prepare")


def _session_class():
    from torch_kdtree.models.generation import GenerationSession
    from torch_kdtree.ops import value_checks

    class _Session(GenerationSession):
        """generate()'s GenerationSession, except that the drafter's look-ahead (the oracle's
        ``prepare``) runs eagerly, neither captured nor compiled: it runs outside the timed steps,
        and compiling each budget's look-ahead pass would add a K2-width compile per budget.  It
        still decodes through each budget's verify pass (the same kernels and plan; only
        inductor's fusions differ)."""

        def _capture(self, key, fn, before=None) -> None:
            if not _is_look_ahead(key):
                super()._capture(key, fn, before)

        def _run(self, key, fn) -> None:
            if _is_look_ahead(key):
                with torch.no_grad(), value_checks(False) if self.device.type == "cuda" else contextlib.nullcontext():
                    if isinstance(key, tuple):
                        b = key[1]
                        self._prepare(self.root, lambda *a: self._lookahead_pass(b, *a), b + 1)
                    else:
                        self._prepare(self.root)
                return
            super()._run(key, fn)

    return _Session


@contextlib.contextmanager
def noop_collectives(*tps):
    """Each TensorParallel's collectives replaced by what they allocate and copy without the
    transfer (as functional collectives do: a new tensor): all_reduce -> a copy of this rank's
    partial sums, all_gather -> this rank's tensor in every rank's slot.  Restored on exit."""
    for tp in tps:
        tp.all_reduce = lambda x: x.clone()
        tp.all_gather = lambda x, dim=0, _tp=tp: torch.cat([x.contiguous()] * _tp.world, dim)
    try:
        yield
    finally:
        for tp in tps:
            tp.__dict__.pop("all_reduce", None)
            tp.__dict__.pop("all_gather", None)


def comm_profile(session, budget: int, steps: int, cuda: bool) -> dict:
    """Collectives' time in ``steps`` runs of ``budget``'s step proper (graph replays on CUDA: no
    oracle look-ahead), per step: NCCL kernels' device time (CUDA) or gloo / collective ops' self
    CPU time (CPU), with the total it is a part of."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if session.use_graphs:
        run = session.graphs[budget].replay
    else:
        def run():
            session._run(budget, session._fns[budget])
    run()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            run()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    if cuda:
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        total = sum(e.self_device_time_total for e in kernels)
        comm = [e for e in kernels if "nccl" in e.key.lower()]
        method = "NCCL kernel time per replayed step (torch.profiler) / median step"
    else:
        kernels = [e for e in events if e.device_type == DeviceType.CPU]
        total = sum(e.self_cpu_time_total for e in kernels)
        comm = [e for e in kernels if COMM_OPS.search(e.key)]
        method = "collective ops' self CPU time / all ops' self CPU time (profiled eager steps)"
    return {"comm_us": sum(e.self_device_time_total if cuda else e.self_cpu_time_total for e in comm) / steps,
            "profiled_us": total / steps, "comm_calls": sum(e.count for e in comm) / steps, "share_method": method}


def time_budget(session, budget: int, prompt: torch.Tensor, s: Settings, cuda: bool) -> dict:
    """Median seconds per step of ``budget`` from a fresh prefill (module docstring) and its
    collectives' share."""
    session.prefill(prompt, torch.tensor([prompt.shape[1]]), max_new=s.max_new, eos=[])
    session.step(budget)  # warm
    rounds = sorted(session.time_steps(budget, s.steps) for _ in range(s.rounds))
    median = rounds[len(rounds) // 2]
    prof = comm_profile(session, budget, s.profile_steps, cuda)
    if cuda:
        share = prof["comm_us"] / (median * 1e6)
    else:
        share = prof["comm_us"] / prof["profiled_us"] if prof["profiled_us"] > 0 else 0.0
    return {"ms": median * 1e3, "ms_min": rounds[0] * 1e3, "ms_max": rounds[-1] * 1e3, "comm_share": min(1.0, share),
            "comm_share_raw": share, **prof}


def _mean_accept(session, steps: int) -> float:
    log = session.accept_log[:steps].cpu()
    running = log[log > 0]
    return float(running.float().mean()) if running.numel() else 0.0


def oracle_runs(ctx: Ctx, ar_session, tree_session, oracle, step_seconds: dict, prompt) -> dict:
    """DDTree / AR tokens/s (module docstring, part ``oracle``)."""
    from torch_kdtree.models.generation.budget import BudgetPlanner, FixedBudget

    s, n = ctx.settings, ctx.settings.oracle_tokens
    lengths = torch.tensor([prompt.shape[1]])
    ar_session.prefill(prompt, lengths, max_new=n, eos=[])
    run = ar_session.run(FixedBudget(0))
    ar_tokens = ar_session.tokens()[0][0, :n]
    ar_rate = n / run["step_seconds"]
    out = {"tokens": n, "ar": {"tokens_per_s": ar_rate, "steps": len(run["budgets"]),
                               "step_seconds": run["step_seconds"]}, "runs": {}}
    for accuracy in s.accuracies:
        oracle.set_accuracy(accuracy)
        policies = [("auto", BudgetPlanner(tree_session.budgets, step_seconds))]
        if s.fixed_budget:
            policies.append((f"B{s.fixed_budget}", FixedBudget(s.fixed_budget)))
        for name, policy in policies:
            tree_session.prefill(prompt, lengths, max_new=n, eos=[])
            run = tree_session.run(policy)
            tokens = tree_session.tokens()[0][0, :n]
            same = (tokens == ar_tokens).long().cumprod(0).sum()
            rate = n / run["step_seconds"]
            out["runs"].setdefault(str(accuracy), {})[name] = {
                "tokens_per_s": rate, "speedup_vs_ar": rate / ar_rate, "mean_accept": _mean_accept(tree_session,
                                                                                                   len(run["budgets"])),
                "steps": len(run["budgets"]), "step_seconds": run["step_seconds"],
                "budget_steps": {str(b): c for b, c in sorted(Counter(run["budgets"]).items())},
                "equal_to_ar_tokens": int(same)}  # greedy: bf16 ties may end the run of equal tokens early
    return out


def run_depth(ctx: Ctx, depth: int, *, table: bool, oracle: bool, noop: bool) -> dict:
    """One depth's model, sessions, timings (module docstring, parts ``layers`` and ``oracle``)."""
    from bench.tp_rank import K26_DFLASH, rank_drafter, rank_target
    from torch_kdtree.models.generation import OracleDrafter

    s, dev, cuda = ctx.settings, ctx.device, ctx.cuda
    Session = _session_class()
    res = {"layers": depth}
    t0 = time.perf_counter()
    config = global_config(depth, s.tiny)
    target = stage("build target", rank_target, config, ctx.mesh, dev)
    fields = TINY_DRAFTER if s.tiny else {**K26_DFLASH, "target_layer_ids": [0, 1]}
    dflash = stage("build drafter", rank_drafter, target, ctx.mesh, dev, **fields)
    res["build_s"] = time.perf_counter() - t0
    res["target_gb"] = sum(t.numel() * t.element_size() for t in (*target.parameters(), *target.buffers())) / 1e9
    res["drafter_gb"] = sum(p.numel() * p.element_size() for p in dflash.parameters()) / 1e9
    res["drafter"] = {k: v for k, v in fields.items()}
    vocab = target.config.vocab_size
    prompt = torch.randint(0, vocab - 2, (1, s.prompt), generator=torch.Generator().manual_seed(7)).to(dev)
    kw = dict(batch_size=1, max_prompt=s.prompt, max_new=s.max_new, compile_step=s.compile_step)

    t0 = time.perf_counter()
    ar = stage("AR session", Session, target, None, budgets=(0,), **kw)
    res["setup_ar_s"] = time.perf_counter() - t0
    res["plan_ar"] = str(ar.plan)
    res["ar"] = stage("AR timing", time_budget, ar, 0, prompt, s, cuda)

    drafter, oracle_obj = dflash, None
    if oracle:
        try:
            oracle_obj = OracleDrafter(target, accuracy=s.accuracies[0], second_choice=0.5, seed=3, inner=dflash)
        except Exception as e:  # the API the oracle part is written against
            res["oracle_unavailable"] = f"OracleDrafter(target, ...): {type(e).__name__}: {e}"
    budgets = s.budgets if oracle_obj is not None else tuple(b for b in s.budgets if b)
    t0 = time.perf_counter()
    tree = None
    if oracle_obj is not None:
        try:
            tree = stage("tree session (oracle)", Session, target, oracle_obj, budgets=budgets, **kw)
            drafter = oracle_obj
        except Stopped as e:
            res["oracle_unavailable"] = str(e)[-2000:]
            oracle_obj = None
            _free(None)
    if tree is None:
        budgets = tuple(b for b in s.budgets if b)
        tree = stage("tree session", Session, target, dflash, budgets=budgets, **kw)
    res["setup_tree_s"] = time.perf_counter() - t0
    res["tree_drafter"] = "OracleDrafter(80 %) around the DFlash drafter" if oracle_obj is not None else "DFlash"
    res["plan_tree"] = str(tree.plan)
    res["tree"] = {}
    for b in budgets:
        res["tree"][str(b)] = stage(f"tree timing B={b}", time_budget, tree, b, prompt, s, cuda)
    if oracle and oracle_obj is not None:
        seconds = {b: res["tree"][str(b)]["ms"] / 1e3 for b in budgets}
        res["oracle"] = stage("oracle runs", oracle_runs, ctx, ar, tree, oracle_obj, seconds, prompt)
    if noop and s.noop_budgets:
        res["noop"] = {}
        tps = [target.tp, dflash.tp]
        with noop_collectives(*tps):
            for b in s.noop_budgets:
                if b and b not in budgets:
                    continue
                real = res["ar"] if b == 0 else res["tree"][str(b)]
                sess = stage(f"no-op session B={b}", Session, target, None if b == 0 else drafter, budgets=(b,), **kw)
                timed = stage(f"no-op timing B={b}", time_budget, sess, b, prompt, s, cuda)
                res["noop"][str(b)] = {"noop_ms": timed["ms"], "real_ms": real["ms"],
                                       "share": max(0.0, min(1.0, 1 - timed["ms"] / real["ms"])),
                                       "share_raw": 1 - timed["ms"] / real["ms"], "noop_comm_calls": timed["comm_calls"]}
                del sess
                _free(None)
    del ar, tree, drafter, oracle_obj
    _free(target, dflash)
    del target, dflash
    _free(None)
    return res


def part_layers(ctx: Ctx, *, table: bool, oracle: bool, keep=None) -> dict:
    """The layers (and oracle) part; ``keep(partial)`` after each depth (the JSON is written then, so
    a run ended by its time limit keeps the depths it finished)."""
    s = ctx.settings
    out = {"world": ctx.world, "compile_step": str(s.compile_step), "prompt": s.prompt, "steps": s.steps,
           "rounds": s.rounds, "profile_steps": s.profile_steps, "budgets": list(s.budgets),
           "config": "tiny (tests/tp_worker.INT4_TARGET)" if s.tiny else "K2 global (bench/tp_rank.k2_global_config)",
           "depths": {}}
    if ctx.cuda:
        from bench.conftest import hbm_ceiling

        out["device_name"] = torch.cuda.get_device_name(ctx.device)
        out["hbm"] = stage("HBM ceiling", lambda: hbm_ceiling().fields())
    depths = sorted(set(s.depths) | ({s.deepest} if oracle else set()))
    for depth in depths:
        in_table = table and depth in s.depths
        res = run_depth(ctx, depth, table=in_table, oracle=oracle and depth == s.deepest,
                        noop=in_table and depth == s.deepest)
        ranks = gather({"ar": res["ar"]["ms"], **{b: v["ms"] for b, v in res["tree"].items()}})
        res["ms_max_over_ranks"] = {k: max(r[k] for r in ranks) for k in ranks[0]}
        if in_table:
            out["depths"][str(depth)] = {k: v for k, v in res.items() if k != "oracle"}
        if "oracle" in res:
            out["oracle"] = {"depth": depth, **res["oracle"]}
        elif oracle and depth == s.deepest:
            out["oracle"] = {"depth": depth, "error": res.get("oracle_unavailable", "not run")}
        if keep is not None:
            keep(out)
    return out


# --------------------------------------------------------------------------------------------
# part 4: the projection (bench/tp_projection.py)
# --------------------------------------------------------------------------------------------

def part_projection(results: dict) -> dict:
    from bench import tp_projection as P

    layers = results.get("layers") or {}
    depths = layers.get("depths") or {}
    if len(depths) < 2:
        return {"error": f"needs the layers part at two depths (have {sorted(depths)}); run it, or merge an earlier "
                         f"run's JSON (--previous)"}
    pair = lambda t: (t["ms"] / 1e3, t["ms"] / 1e3 * t["comm_share"])  # noqa: E731  (step, collectives) s
    measured, with_drafter = {}, {}
    for d, v in depths.items():
        measured[int(d)] = {0: pair(v["ar"]), **{int(b): pair(t) for b, t in v["tree"].items() if int(b)}}
        if "0" in v["tree"]:  # the tree session's AR step: the drafter's context appended too
            with_drafter[int(d)] = (pair(v["tree"]["0"]), pair(v["ar"]))
    short, long = sorted(measured)[:2]
    steps = P.project_depth(measured)
    skipped = {b: v for b, v in steps.items() if v[0] <= 0}
    steps = {b: v for b, v in steps.items() if v[0] > 0}
    hbm = layers.get("hbm") or {}
    h200_gbs = hbm.get("read_gbs") or P.H200_SPEC_GBS
    label = "8x " + layers.get("device_name", "cpu (tiny: meaningless)")
    drafter = next(iter(depths.values())).get("drafter", {})
    shape = {"block_size": drafter.get("block_size", P.BLOCK_SIZE),
             "drafter_layers": drafter.get("num_hidden_layers", P.DRAFTER_LAYERS),
             "hidden": 128 if layers.get("config", "").startswith("tiny") else P.K2_HIDDEN}
    rows = P.card_rows(steps, h200_gbs=h200_gbs, measured_card=label, **shape)
    out = {"layers": P.K2_LAYERS, "from_depths": [short, long], "per_layer_ms": {}, "rows": rows,
           "bandwidth_gbs": {"measured_card": h200_gbs, "measured_card_source": "read rate measured in this run"
                             if hbm.get("read_gbs") else "H200 spec", "rtx_pro_6000": list(P.RTX_PRO_6000_GBS)},
           "assumptions": {"pcie_latency_us": list(P.LINKS["pcie_gen5"]), "pcie_bus_gbs": list(P.PCIE_BUS_GBS),
                           "acceptances": list(P.ACCEPTANCES), **shape,
                           "method": "bench/tp_projection.py (second half): 61-layer step = 8-layer step + 53 x "
                                     "per-layer time (difference of the two depths / their layer difference); the "
                                     "collectives' time scaled alike; RTX PRO 6000 = non-collective part x bandwidth "
                                     "ratio + PCIe collectives (count x (latency + ring bytes / bus bandwidth))"},
           "skipped_budgets": {str(b): "projected step not positive (per-layer time negative: noise)" for b in skipped}}
    for b in sorted(set(measured[short]) & set(measured[long])):
        out["per_layer_ms"][str(b)] = (measured[long][b][0] - measured[short][b][0]) / (long - short) * 1e3
    oracle = layers.get("oracle") or {}
    if oracle.get("runs") and with_drafter and 0 in steps:
        # every step of an oracle run has the drafter in it: its budget-0 steps are the tree session's AR
        # step, the AR step plus the drafter's context append (a cost that does not grow with depth: the
        # difference measured at the deepest depth that has it, added to the projected AR step)
        (dd_step, dd_comm), (ar_step, ar_comm) = with_drafter[max(with_drafter)]
        step0, comm0 = steps[0]
        mix_steps = {**steps, 0: (step0 + dd_step - ar_step, max(0.0, comm0 + dd_comm - ar_comm))}
        out["oracle"] = []
        for card, case, other in P.cases(label):
            per = {b: P.card_step(st, min(cm, st), b, other, h200_gbs=h200_gbs, drafter_layers=shape["drafter_layers"],
                                  hidden=shape["hidden"], block_size=shape["block_size"])
                   for b, (st, cm) in mix_steps.items() if st > 0}
            ar_row = next(r for r in rows if r["card"] == card and r["case"] == case and r["budget"] == 0)
            ar_rate = 1e3 / ar_row["step_ms"]
            for acc, runs in oracle["runs"].items():
                for name, run in runs.items():
                    counts = {int(b): n for b, n in run["budget_steps"].items()}
                    if not set(counts) <= set(per):
                        continue
                    rate = P.mix_tokens_per_s(oracle["tokens"], counts, {b: v[0] for b, v in per.items()})
                    out["oracle"].append({"card": card, "case": case, "accuracy": float(acc), "policy": name,
                                          "tokens_per_s": rate, "speedup_vs_ar": rate / ar_rate})
        out["oracle"].sort(key=lambda r: (r["card"], r["case"], r["accuracy"], r["policy"]))
    return out


# --------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------

def _fmt(x, spec=".3g") -> str:
    return "-" if x is None else format(x, spec)


def table(results: dict) -> str:
    lines = []
    meta = results.get("meta", {})
    lines.append(f"tp8_run: world {meta.get('world')}, {meta.get('backend')}, {meta.get('device_name')}, torch "
                 f"{meta.get('torch')}, nccl {meta.get('nccl')}")
    eq = results.get("equality")
    if eq:
        lines.append(f"\n== equality: TP-n vs TP-1 ({eq.get('dtype')}, {eq.get('compile_step')}, heads {eq.get('heads')}) ==")
        if "error" in eq or "skipped" in eq:
            lines.append(str(eq.get("error") or eq.get("skipped"))[-3000:])
        lines.append(f"{'TP':>3} {'groups':<28} {'prefill err':>11} {'tree err':>9} {'AR':<6} {'DDTree':<6} "
                     f"{'graphs':<6} {'kernels':<7} ok")
        for size, v in sorted(eq.get("by_size", {}).items(), key=lambda kv: int(kv[0])):
            lines.append(f"{size:>3} {' '.join(map(str, v['groups'])):<28.28} {_fmt(v['prefill_rel_err']):>11} "
                         f"{_fmt(v['tree_rel_err']):>9} {v['ar'][:6]:<6} {v['dd'][:6]:<6} {str(v['graphs']):<6} "
                         f"{str(v['same_kernels']):<7} {'PASS' if v['ok'] else 'FAIL'}")
            for r in v["ranks"]:
                if "error" in r or not r["ok"]:
                    lines.append(f"    rank {r['rank']}: {(r.get('error') or r.get('ar') + ' / ' + r.get('dd', ''))[-1500:]}")
    layers = results.get("layers")
    if layers:
        lines.append(f"\n== layers: K2 at TP-{layers.get('world')} ({layers.get('config')}; compile "
                     f"{layers.get('compile_step')}, R = 1, {layers.get('prompt')}-token prompt, median of "
                     f"{layers.get('rounds')} x {layers.get('steps')} replays) ==")
        if "error" in layers:
            lines.append(str(layers["error"])[-3000:])
        lines.append(f"{'depth':>5} {'step':<6} {'ms':>9} {'[min':>8} {'max]':>8} {'comm us':>9} {'share':>6} "
                     f"{'calls':>6}")
        for d, v in sorted(layers.get("depths", {}).items(), key=lambda kv: int(kv[0])):
            for name, t in [("AR", v["ar"]), *((f"B={b}" if int(b) else "AR+d", t) for b, t in
                                               sorted(v["tree"].items(), key=lambda kv: int(kv[0])))]:
                lines.append(f"{d:>5} {name:<6} {t['ms']:9.4f} {t['ms_min']:8.4f} {t['ms_max']:8.4f} "
                             f"{t['comm_us']:9.1f} {t['comm_share']:6.3f} {t['comm_calls']:6.1f}")
            for b, n in v.get("noop", {}).items():
                lines.append(f"{d:>5} {'B=' + b if int(b) else 'AR':<6} no-op collectives {n['noop_ms']:.4f} ms vs "
                             f"{n['real_ms']:.4f} ms: share {n['share']:.3f}")
            lines.append(f"      build {v['build_s']:.0f} s, AR session {v['setup_ar_s']:.0f} s, tree session "
                         f"{v['setup_tree_s']:.0f} s; {v['tree_drafter']}")
            if v.get("oracle_unavailable"):
                lines.append(f"      oracle unavailable: {v['oracle_unavailable'][-300:]}")
    oracle = (layers or {}).get("oracle")
    if oracle:
        lines.append(f"\n== oracle drafter at depth {oracle.get('depth')} ==")
        if "error" in oracle:
            lines.append(str(oracle["error"])[-1500:])
        else:
            lines.append(f"AR: {oracle['ar']['tokens_per_s']:.1f} tokens/s ({oracle['tokens']} tokens)")
            for acc, runs in oracle["runs"].items():
                for name, r in runs.items():
                    lines.append(f"{float(acc):.0%} {name:<5} {r['tokens_per_s']:9.1f} tokens/s  x{r['speedup_vs_ar']:.2f} "
                                 f"AR  mean accept {r['mean_accept']:.2f}  budgets {r['budget_steps']}")
    proj = results.get("projection")
    if proj:
        lines.append("\n== projection: 61-layer K2.6 at TP-8 ==")
        if "error" in proj:
            lines.append(proj["error"])
        else:
            lines.append(f"per-layer ms (from depths {proj['from_depths']}): "
                         + ", ".join(f"B={b}: {v:.4f}" for b, v in proj["per_layer_ms"].items()))
            lines.append(f"{'card':<22} {'case':<8} {'B':>3} {'step ms':>8} {'comm':>5}  tokens/s at accept "
                         + " / ".join(str(a) for a in proj["assumptions"]["acceptances"]) + "  (x AR)")
            for r in proj["rows"]:
                rates = "  ".join(f"{_fmt(v, '.0f')} (x{_fmt(r['speedup_vs_ar'][a], '.2f')})"
                                  for a, v in r["tokens_per_s"].items())
                lines.append(f"{r['card'][:22]:<22} {r['case']:<8} {r['budget']:>3} {r['step_ms']:8.3f} "
                             f"{r['comm_share']:5.2f}  {rates}")
            for r in proj.get("oracle", []):
                lines.append(f"{r['card'][:22]:<22} {r['case']:<8} oracle {r['accuracy']:.0%} {r['policy']}: "
                             f"{r['tokens_per_s']:.0f} tokens/s, x{r['speedup_vs_ar']:.2f} AR")
    return "\n".join(lines)


def merge(results: dict, part: str, new: dict) -> None:
    """``new`` into ``results``: the layers part by depth (an earlier invocation's depths and oracle
    runs kept unless this one has them again), every other part replaced."""
    old = results.get(part)
    if part == "layers" and isinstance(old, dict):
        depths = {**old.get("depths", {}), **new.get("depths", {})}
        kept = {k: v for k, v in old.items() if k in ("oracle", "hbm", "device_name")}
        results[part] = {**kept, **new, "depths": depths}
        if "unfinished" not in new:
            results[part].pop("unfinished", None)
    else:
        results[part] = new


def load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def main(argv=None) -> int:
    args = parse_args(argv)
    ctx = init_distributed(args)
    out_dir = Path(args.out)
    results: dict = {}
    if ctx.rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        if args.previous:
            results = load(Path(args.previous))
        for part, value in load(out_dir / JSON_NAME).items():
            merge(results, part, value)
    s = ctx.settings
    results["meta"] = {"world": ctx.world, "backend": args.backend, "device": ctx.device.type,
                       "device_name": torch.cuda.get_device_name(ctx.device) if ctx.cuda else "cpu",
                       "torch": torch.__version__,
                       "nccl": ".".join(map(str, torch.cuda.nccl.version())) if ctx.cuda else None,
                       "settings": {k: (list(v) if isinstance(v, tuple) else str(v) if k == "compile_step" else v)
                                    for k, v in dataclasses.asdict(s).items()},
                       "parts_run": args.parts, "finished": False}

    def save():
        if ctx.rank == 0:
            (out_dir / JSON_NAME).write_text(json.dumps(results, indent=1, default=str))

    def attempt(part, fn):
        t0 = time.perf_counter()
        before = copy.deepcopy(results.get(part))

        def keep(partial):  # a part's finished pieces, saved before the rest runs
            results[part] = copy.deepcopy(before)
            merge(results, part, {**partial, "unfinished": True})
            save()
        try:
            with torch.no_grad():
                value = fn(keep)
        except Exception:
            value = {"error": traceback.format_exc()}
        value["seconds"] = time.perf_counter() - t0
        results[part] = before
        merge(results, part, value)
        if ctx.rank == 0:
            print(f"tp8_run: {part} done in {value['seconds']:.0f} s", flush=True)
        save()

    if "equality" in args.parts:
        attempt("equality", lambda keep: part_equality(ctx))
    if "layers" in args.parts or "oracle" in args.parts:
        attempt("layers", lambda keep: part_layers(ctx, table="layers" in args.parts, oracle="oracle" in args.parts,
                                                   keep=keep))
    if "projection" in args.parts:
        attempt("projection", lambda keep: part_projection(results))
    results["meta"]["finished"] = True
    save()
    if ctx.rank == 0:
        text = table(results)
        (out_dir / TEXT_NAME).write_text(text + "\n")
        print(text, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
