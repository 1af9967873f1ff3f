"""Draft top-K timings (issue 7): kdtree::draft_topk vs the torch path (float + log_softmax + topk).

Shapes: R in {1, 8}, L = 15, V = 163840 (the K2 vocabulary), k in {16, 64, 256, 1024}, bf16
logits.  Device time per call comes from CUDA graphs of REPS back-to-back calls, replayed and
timed with CUDA events (what the call costs inside the captured DDTree step); pytest-benchmark
records the wall time of one replay (REPS calls plus one synchronisation).  Each row reports the
ratio to the 25 us target, the speedup over the torch path timed in the same run, and the
achieved logits-read bandwidth against a device copy measured in the same run.

    pytest bench/bench_draft_topk.py -q -s --benchmark-columns=mean,stddev,rounds

Set KDTREE_BENCH_MD=path to append the summary table (markdown) to a file.
"""
import os

import pytest
import torch

import torch_kdtree
from torch_kdtree.ops import draft_topk_partial

HAS_CUDA = torch.cuda.is_available() and torch_kdtree.build_info()["cuda_kernels"]
pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and the compiled CUDA kernels")

L, V = 15, 163840
TARGET_US = 25.0
REPS = 20          # calls per captured graph
TIMED_REPLAYS = 50


def capture(fn, reps: int = REPS) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return graph


def events_us(run, calls_per_run: int, runs: int = TIMED_REPLAYS) -> float:
    """Mean device time of one call: `runs` runs of `run` between two events."""
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(runs):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (runs * calls_per_run)


@pytest.fixture(scope="module")
def copy_bandwidth() -> float:
    """Device copy rate, bytes/s counting read + write (1 GiB buffers)."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = events_us(lambda: dst.copy_(src), 1, runs=20)
    return 2 * n / (us * 1e-6)


@pytest.fixture(scope="module")
def table():
    rows = []
    yield rows
    if not rows:
        return
    head = ("| op | R | k | kdtree us (graph) | kdtree us (eager) | torch us (graph) | speedup | vs 25 us target "
            "| logits GB/s | of copy BW |\n|---|---|---|---|---|---|---|---|---|---|\n")
    text = head + "".join(
        f"| {r['op']} | {r['R']} | {r['k']} | {r['us']:.1f} | {r['eager_us']:.1f} | {r['torch_us']:.1f} "
        f"| {r['speedup']:.1f}x | {r['ratio_to_target']:.2f} | {r['GBps']:.0f} | {r['of_copy_bw']:.0%} |\n"
        for r in rows)
    text += f"\ncopy bandwidth (read + write): {rows[0]['copy_GBps']:.0f} GB/s; {torch.cuda.get_device_name()}, " \
            f"torch {torch.__version__}\n"
    print("\n" + text)
    path = os.environ.get("KDTREE_BENCH_MD")
    if path:
        with open(path, "a") as f:
            f.write("\n" + text)


def torch_path(logits: torch.Tensor, k: int):
    return torch.topk(torch.log_softmax(logits.float(), dim=-1), k, dim=-1)


def make_logits(R: int) -> torch.Tensor:
    # drafter-like logits: most of the vocabulary in a narrow band, a few tokens well above it
    x = torch.randn(R, L, V, device="cuda") * 2
    x[..., torch.randint(V, (64,), device="cuda")] += 12
    return x.bfloat16()


def record(benchmark, table, op, R, k, graph, torch_graph, eager, copy_bw, nbytes):
    us = events_us(graph.replay, REPS)
    torch_us = events_us(torch_graph.replay, REPS)
    eager_us = events_us(eager, 1, runs=200)
    row = dict(op=op, R=R, k=k, us=us, eager_us=eager_us, torch_us=torch_us, speedup=torch_us / us,
               ratio_to_target=us / TARGET_US, GBps=nbytes / (us * 1e-6) / 1e9,
               of_copy_bw=(nbytes / (us * 1e-6)) / copy_bw, copy_GBps=copy_bw / 1e9)
    benchmark.extra_info.update(row)
    table.append(row)

    def replay():
        graph.replay()
        torch.cuda.synchronize()

    benchmark.pedantic(replay, rounds=30, warmup_rounds=3)


@pytest.mark.parametrize("k", [16, 64, 256, 1024])
@pytest.mark.parametrize("R", [1, 8])
def test_draft_topk(benchmark, table, copy_bandwidth, R, k):
    logits = make_logits(R)
    graph = capture(lambda: torch.ops.kdtree.draft_topk(logits, k))
    torch_graph = capture(lambda: torch_path(logits, k))
    record(benchmark, table, "draft_topk", R, k, graph, torch_graph,
           lambda: torch.ops.kdtree.draft_topk(logits, k), copy_bandwidth, R * L * V * 2)


@pytest.mark.parametrize("k", [16, 1024])
@pytest.mark.parametrize("R", [1, 8])
def test_torch_path(benchmark, R, k):
    """The baseline alone, so it has its own pytest-benchmark entry."""
    logits = make_logits(R)
    graph = capture(lambda: torch_path(logits, k))
    benchmark.extra_info["us"] = events_us(graph.replay, REPS)

    def replay():
        graph.replay()
        torch.cuda.synchronize()

    benchmark.pedantic(replay, rounds=30, warmup_rounds=3)


@pytest.mark.parametrize("k", [64, 1024])
@pytest.mark.parametrize("R", [1, 8])
def test_draft_topk_tp8_partial_and_merge(benchmark, table, copy_bandwidth, R, k):
    """One TP-8 rank's share: partial top-K over V/8 plus the merge of 8 gathered parts (the
    all-gather between them is not timed); compared with the unsplit torch path."""
    P = 8
    logits = make_logits(R)
    shard = logits[..., : V // P].contiguous()
    gathered = draft_topk_partial(shard, k, 0)
    vals = gathered.values.expand(P, -1, -1, -1).contiguous()
    ids = (gathered.token_ids[None] + torch.arange(P, device="cuda")[:, None, None, None] * (V // P)).contiguous()
    lse = gathered.lse.expand(P, -1, -1).contiguous()

    def step():
        torch.ops.kdtree.draft_topk_partial(shard, k, 0)
        return torch.ops.kdtree.draft_topk_merge(vals, ids, lse, k)

    graph = capture(step)
    torch_graph = capture(lambda: torch_path(logits, k))
    record(benchmark, table, "tp8 partial+merge (per rank)", R, k, graph, torch_graph, step, copy_bandwidth,
           shard.numel() * 2)
