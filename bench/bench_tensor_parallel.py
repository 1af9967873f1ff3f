"""Tensor parallelism on one GPU (issue 46): what one GPU can measure of K2.6 at TP-8, and the
per-step model that turns it into projected TP-8 tokens/s.

Run (one H200 or H100, ~3-4 min):  pytest bench/bench_tensor_parallel.py --benchmark-only -s

(a) ``test_nccl_all_reduce_world_1``: NCCL at world size 1 (a process group in this process), the
    all-reduce the model's hooks run (``TensorParallel.all_reduce``: a copy, NCCL's call, the wait)
    captured 20 times in a CUDA graph, for the decode message (1 token x 7168 bf16 = 14 KB) and a
    B = 16 verify (17 tokens, 244 KB); and the copy alone.  World 1 crosses no link: NCCL's one-rank
    path of an in-place sum moves nothing, so ``overhead_us`` = all-reduce - copy is what NCCL adds
    to the graph (launch, stream fork / join), not a transfer.
(b) ``test_tp8_rank_step``: the TP-8 rank program of full K2 shapes.  The GLOBAL K2 config (hidden
    7168, 64 heads, 384 INT4 routed experts of width 2048 top-8 + a shared expert, dense layer 0,
    vocabulary 163840) with 4 decoder layers as bench_generate's k2_slice (and with 2: the
    difference is the per-layer time), built on the meta device, parallelised over a FAKE process
    group of world 8 as rank 0 (bench/tp_rank.py), materialised with random weights (random INT4
    experts as k2_slice's) -- so the rank holds 8 heads, expert width 256, a 20480-token vocabulary
    shard, exactly one TP-8 rank's shapes -- and a random K2.6-shaped DFlash drafter (6 layers,
    64 / 8 heads of 128, intermediate 18432, block size 8) parallelised the same way, tapping target
    layers [0, 1] at both depths (2 taps of K2.6's 6: its fc is a third of its width; ~51 MB of fc
    weight a rank does not read, ~12 us at 4.2 TB/s).  The all-reduces are in the compiled, captured
    graphs as no-ops (the fake group returns at once), the vocabulary gathers too (or copies where
    this torch's fake group leaves them unwritten: ``gathers=emulated``).  Timed: the autoregressive
    step (no drafter) and the B = 16 tree step (GenerationSession, CUDA graphs, compiled steps;
    CUDA events around each replay, median of rounds of 16 steps after a 128-token prompt).  The
    tokens mean nothing under fake collectives; only time counts.
(c) ``test_projected_tp8_tokens_per_second``: bench/tp_projection.py's model.  The rank step is
    scaled to K2.6's 61 layers from the two depths (per-layer time = their difference / 2, the rest
    fixed); collectives per step = 2 x 61 all-reduces + the vocabulary gathers (AR: 2; the tree
    step: + the drafter's 2 x 6 + 1 all-reduces and the draft top-K's 3 gathers); each collective
    costs an ASSUMED link latency (NVLink 6-9 us, PCIe Gen5 16-26 us: docs/parallel.md's
    estimates, not measurements) plus the measured world-1 overhead (the 1-token figure for AR,
    the 17-token one for the tree step), serially; tokens/s = tokens per step / projected step,
    with 1 token per AR step and an ASSUMED mean acceptance for DDTree (2.74 and 4.83 tokens per
    step: the 80 % and 95 % oracle runs on k2_slice in bench/STATUS.md, not K2.6's own).
"""
import gc
import time

import pytest
import torch
import torch.distributed as dist

from .conftest import cuda_time_us, needs_int4, record, requires_cuda, requires_mla
from .tp_projection import ASSUMED_ACCEPT, DRAFTER_LAYERS, K2_LAYERS, LINKS, collectives_per_step, project, \
    scale_to_layers
from .tp_rank import K26_DFLASH, fake_gathers, fake_world, k2_global_config, rank_drafter, rank_target

COMPILE = "combo"  # steps compiled as generate() compiles them on CUDA
HIDDEN = 7168
BUDGET = 16
DEPTHS = (2, 4)  # decoder layers: k2_slice's 4, and 2 (dense layer 0 + one MoE layer)
TAPS = [0, 1]
PROMPT, MAX_NEW = 128, 512  # as bench_generate (cache reach <= 1024 keys: mla_decode)
STEPS, ROUNDS = 16, 5
WORLD = 8
RESULTS: dict = {}


@pytest.fixture
def nccl_world_1():
    """The default process group: NCCL, world size 1, this process; initialised eagerly
    (``device_id``) before anything is captured."""
    dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore(), device_id=torch.device("cuda", 0))
    try:
        yield
    finally:
        torch.cuda.synchronize()
        dist.destroy_process_group()


@pytest.fixture
def fake_world_8():
    # the mesh's device type is a label here (the collectives resolve the group by name and run on
    # the tensors' device); "cpu" keeps DeviceMesh from matching 8 ranks to this host's one GPU
    mesh = fake_world(WORLD, 0, "cpu")
    try:
        yield mesh
    finally:
        dist.destroy_process_group()


@requires_cuda
@pytest.mark.parametrize("tokens", [1, BUDGET + 1], ids=["decode_14KB", "verify_B16_244KB"])
def test_nccl_all_reduce_world_1(benchmark, tokens, nccl_world_1):
    from torch.distributed.device_mesh import init_device_mesh

    from torch_kdtree.models.parallel import TensorParallel

    tp = TensorParallel(init_device_mesh("cuda", (1,)))
    x = torch.ones(1, tokens, HIDDEN, dtype=torch.bfloat16, device="cuda")
    copy_us = cuda_time_us(lambda: x.clone())
    reduce_us = benchmark.pedantic(lambda: cuda_time_us(lambda: tp.all_reduce(x)), rounds=3, iterations=1)
    assert torch.equal(tp.all_reduce(x), x)  # world 1: the sum of one rank
    overhead = reduce_us - copy_us
    RESULTS[("world1", tokens)] = overhead
    record(benchmark, op="nccl_all_reduce_world1", tokens=tokens, bytes=x.numel() * x.element_size(),
           all_reduce_us=reduce_us, copy_us=copy_us, overhead_us=overhead, calls_per_graph=20,
           what="TensorParallel.all_reduce (copy + NCCL + wait) in a CUDA graph; world 1 crosses no link: "
                "overhead = launch and graph bookkeeping, not a transfer",
           nccl=".".join(map(str, torch.cuda.nccl.version())))


def _median_step(session, budget: int) -> float:
    session.step(budget)  # warm
    times = sorted(session.time_steps(budget, STEPS) for _ in range(ROUNDS))
    return times[len(times) // 2]


@requires_cuda
@requires_mla
@needs_int4
@pytest.mark.parametrize("layers", DEPTHS)
def test_tp8_rank_step(benchmark, layers, fake_world_8):
    from torch_kdtree.models.generation import GenerationSession

    mesh = fake_world_8
    t0 = time.perf_counter()
    target = rank_target(k2_global_config(layers), mesh, "cuda")
    drafter = rank_drafter(target, mesh, "cuda", **K26_DFLASH, target_layer_ids=TAPS)
    gathers = fake_gathers(target.tp, "cuda")
    build_s = time.perf_counter() - t0
    weights_gb = sum(t.numel() * t.element_size() for t in (*target.parameters(), *target.buffers())) / 1e9
    drafter_gb = sum(p.numel() * p.element_size() for p in drafter.parameters()) / 1e9
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, target.config.vocab_size - 2, (1, PROMPT), generator=g).cuda()
    seconds, setup, plans = {}, {}, {}
    for budget, d in ((0, None), (BUDGET, drafter)):
        t0 = time.perf_counter()
        session = GenerationSession(target, d, batch_size=1, max_prompt=PROMPT, max_new=MAX_NEW, budgets=(budget,),
                                    compile_step=COMPILE)
        setup[budget] = time.perf_counter() - t0
        plans[budget] = str(session.plan)
        assert "all_reduce" in plans[budget], plans[budget]
        session.prefill(prompt, torch.tensor([PROMPT]), max_new=MAX_NEW, eos=[])
        seconds[budget] = _median_step(session, budget)
        if budget:
            benchmark.pedantic(session.time_steps, args=(budget, 4), rounds=3, iterations=1)
        del session
        gc.collect()
    print(plans[BUDGET])
    RESULTS[("rank", layers)] = seconds
    ar_r, ar_g = collectives_per_step(layers, 0)
    dd_r, dd_g = collectives_per_step(layers, BUDGET, len(drafter.layers))
    record(benchmark, op="tp8_rank_step", layers=layers, world=WORLD, rank=0, compile_step=str(COMPILE),
           ar_ms=seconds[0] * 1e3, tree_ms=seconds[BUDGET] * 1e3, budget=BUDGET, ratio=seconds[BUDGET] / seconds[0],
           collectives=f"AR {ar_r}+{ar_g}, tree {dd_r}+{dd_g} (all-reduces + gathers; the all-reduces no-ops in the "
                       f"graph, the gathers {'too' if gathers == 'fake_pg' else 'emulated by copies'})",
           gathers=gathers, target_gb=weights_gb, drafter_gb=drafter_gb, build_s=build_s,
           setup_ar_s=setup[0], setup_tree_s=setup[BUDGET], drafter_taps=f"{len(TAPS)} of 6",
           note="fake process group: collectives are no-ops, tokens meaningless, only time counts")
    del target, drafter
    gc.collect()
    torch.cuda.empty_cache()


def test_projected_tp8_tokens_per_second(benchmark):
    """bench/tp_projection.py's model on this file's measurements (module docstring, part c)."""
    need = [("world1", 1), ("world1", BUDGET + 1), *(("rank", n) for n in DEPTHS)]
    missing = [k for k in need if k not in RESULTS]
    if missing:
        pytest.skip(f"needs this file's other benchmarks, in the same run: missing {missing}")
    short, long = DEPTHS
    step = {b: scale_to_layers(RESULTS[("rank", short)][b], RESULTS[("rank", long)][b], short, long, K2_LAYERS)
            for b in (0, BUDGET)}
    ar_counts = collectives_per_step(K2_LAYERS, 0)
    dd_counts = collectives_per_step(K2_LAYERS, BUDGET, DRAFTER_LAYERS)
    rows = []
    for link, latencies in LINKS.items():
        for latency in latencies:
            ar = project(step[0], *ar_counts, latency, RESULTS[("world1", 1)])
            rows.append(dict(link=link, latency_us=latency, mode="ar", tokens_per_step=1.0, rank_step_ms=step[0] * 1e3,
                             collectives=ar.collectives, comm_ms=ar.communication_s * 1e3, step_ms=ar.step_s * 1e3,
                             comm_share=ar.communication_share, tokens_per_s=ar.tokens_per_s))
            for name, accept in ASSUMED_ACCEPT.items():
                dd = project(step[BUDGET], *dd_counts, latency, RESULTS[("world1", BUDGET + 1)], accept)
                rows.append(dict(link=link, latency_us=latency, mode=f"ddtree_B{BUDGET}_{name}", tokens_per_step=accept,
                                 rank_step_ms=step[BUDGET] * 1e3, collectives=dd.collectives,
                                 comm_ms=dd.communication_s * 1e3, step_ms=dd.step_s * 1e3,
                                 comm_share=dd.communication_share, tokens_per_s=dd.tokens_per_s,
                                 speedup_vs_ar=dd.tokens_per_s / ar.tokens_per_s))
    benchmark.pedantic(lambda: rows, rounds=1, iterations=1)
    for row in rows:
        print("op=tp8_projection_row " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                   for k, v in row.items()))
    benchmark.extra_info["projection"] = rows
    record(benchmark, op="tp8_projection", layers=K2_LAYERS, drafter_layers=DRAFTER_LAYERS,
           rank_ar_ms_61=step[0] * 1e3, rank_tree_ms_61=step[BUDGET] * 1e3,
           overhead_us_decode=RESULTS[("world1", 1)], overhead_us_verify=RESULTS[("world1", BUDGET + 1)],
           assumptions="link latency per collective ASSUMED (NVLink 6-9 us, PCIe Gen5 16-26 us, docs/parallel.md); "
                       "DDTree acceptance ASSUMED (k2_slice oracle 80 %/95 %: 2.74/4.83 tokens a step, "
                       "bench/STATUS.md); rank step scaled to 61 layers from 2 and 4 measured; collectives serial, "
                       "gathers charged as all-reduces")
