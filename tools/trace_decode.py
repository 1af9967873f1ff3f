"""Phase timeline of one greedy decode step's kernels (a diagnostic; needs a KDTREE_TRACE=1 build).

The traced kernels (csrc/trace.cuh: gemv, mla_decode, moe_route, moe_gemv's two and int4_moe's
two decode kernels) stamp
%globaltimer at their phases, per block; this script replays bench_kimi_decode's CUDA-graph step
(its model, prompt and compile_step={"combo_kernels": True}) and prints, for each traced launch of
the last step in launch order, the first / median / last block's time of every phase in
microseconds from the step's first stamp.  Untraced kernels (inductor's, int4_moe's align) run
between the rows.

  gemv:        0 entry, 1 pre-wait loads issued, 2 wait returned, 3 prologue done, 5 / 8 / 9 warp 0's
               first / second / third weight item landed (ring kernel; an item is one row's 2 KB
               slice, and items 0-2 are copied before the wait), 6 first row summed, 7 first row
               stored, 4 rows done (warp 0)
  mla_decode:  0 entry, 1 pre-wait loads issued, 2 wait returned, 3 q_abs summed, 4 query whole
               (its mbarrier: the pushed columns arrived), 8 first key tile landed,
               9 first tile done, 10 last tile landed, 11 new key done (its split), 5 keys done (and
               pushed), 6 every split's partial here, 7 W_UV done (warp 0)
  moe_route:   0 entry, 2 wait returned, 4 choice written
  moe_gate_up / moe_down:  0 entry, 1 pre-wait prefetches / loads issued, 2 wait returned, 3 warp 0's
               sums done, 4 its output stored
  int4_up:     0 entry, 1 pre-wait copies issued (shared-expert blocks; routed blocks have none),
               2 wait returned, 3 x landed (and the first tile copies issued), 4 warp 0's tiles done,
               5 gate / up written (the first K split's blocks only)
  int4_down:   0 entry, 1 routing read and first tile copies issued, 2 wait returned, 3 activations
               in shared memory, 4 warp 0's tiles done, 5 output stored
A second table gives, per launch, the median block's time between consecutive phases by the block's
own clock64 (cycle-exact; %globaltimer ticks every 0.256 us on the H200).

Build and run (GPU):  KDTREE_TRACE=1 TORCH_CUDA_ARCH_LIST=9.0 python setup.py build_ext --inplace
                      PYTHONPATH=. python tools/trace_decode.py 2p2b [k2_slice]
"""
import sys

import torch

KINDS = {1: "gemv", 2: "mla_decode", 3: "moe_route", 4: "moe_gate_up", 5: "moe_down", 6: "int4_up", 7: "int4_down"}
ORDER = {1: [0, 1, 2, 3, 5, 8, 9, 6, 7, 4], 2: [0, 1, 2, 3, 4, 8, 9, 10, 11, 5, 6, 7], 3: [0, 2, 4],
         4: [0, 1, 2, 3, 4], 5: [0, 1, 2, 3, 4], 6: [0, 1, 2, 3, 4, 5],
         7: [0, 1, 2, 3, 4, 5]}  # each kind's phases in program order


def _start(g: torch.Tensor) -> int:
    """A launch's first stamp (its earliest block's entry, ns)."""
    return int(g[:, 0][g[:, 0] > 0].min())


def last_step(stamps: torch.Tensor, meta: torch.Tensor, layers: int):
    """stamped()'s launches of the last step: from the first layer's q_a / kv_a projection on."""
    rows = stamped(stamps, meta)
    mla = [j for j, r in enumerate(rows) if r[1] == 2]
    if len(mla) < layers:
        raise SystemExit(f"trace: {len(mla)} mla_decode launches stamped, expected >= {layers} (is mla_decode used?)")
    return rows[max(mla[-layers] - 2, 0):]  # the first layer's q_a / kv_a and q_b projections


def print_rows(rows) -> None:
    """One line per traced launch: its grid, the last block's end and, per phase, the first / median /
    last block's time (us from the first stamp of `rows`)."""
    t0 = min(_start(r[3]) for r in rows)
    prev_end = None
    for i, kind, grid, g in rows:
        us = (g.double() - t0) / 1e3
        cols = []
        for j, p in enumerate(ORDER[kind]):
            v = us[:, j][g[:, j] > 0]
            if v.numel():
                cols.append(f"{p}:{v.min():7.2f}/{v.median():7.2f}/{v.max():7.2f}")
        end = float(us[:, -1][g[:, -1] > 0].max())
        gap = "" if prev_end is None else f" (+{end - prev_end:5.2f})"
        prev_end = end
        print(f"{KINDS.get(kind, kind):>11} {grid[0]:4d}x{grid[1]:<2d} end {end:8.2f}{gap}  " + "  ".join(cols))


def stamped(stamps: torch.Tensor, meta: torch.Tensor):
    """(record index, kind, grid, [blocks, phases in ORDER] ns) of every stamped launch, by start time."""
    rows = []
    for i in range(meta.shape[0]):
        kind, gx, gy = (int(v) for v in meta[i])
        nb = min(gx * gy, stamps.shape[1])
        g = stamps[i, :nb, 0::2][:, ORDER[kind]]
        if nb == 0 or bool((g == 0).all()):
            continue
        rows.append((i, kind, (gx, gy), g))
    rows.sort(key=lambda r: _start(r[3]))
    return rows


def _clocks(stamps: torch.Tensor, row) -> torch.Tensor:
    """A launch's clock64 stamps, [blocks, phases in ORDER] (float64), beside stamped()'s globaltimer ones."""
    i, kind, _, g = row
    return stamps[i, : g.shape[0], 1::2][:, ORDER[kind]].double()


def wait_to_end(stamps: torch.Tensor, row, clock_ghz: float = 1.98) -> tuple[float, float]:
    """A launch's median block time from "wait returned" (phase 2) to its last phase, in us, by
    %globaltimer and by clock64 (the resolution check: the two should agree)."""
    _, kind, _, g = row
    c = _clocks(stamps, row)
    w = ORDER[kind].index(2)
    return float((g[:, -1] - g[:, w]).double().median() / 1e3), float((c[:, -1] - c[:, w]).median() / (clock_ghz * 1e3))


def phase_steps(stamps: torch.Tensor, row, clock_ghz: float = 1.98) -> list[tuple[int, int, float]]:
    """A launch's time between consecutive phases (in program order), by each block's own clock64:
    [(phase, next phase, median over the blocks that stamped both, us)].  Cycle-exact within a block
    (%globaltimer ticks every 0.256 us on the H200); clock64 is per SM, so only differences inside
    one block are read."""
    _, kind, _, g = row
    c = _clocks(stamps, row)
    out = []
    for j in range(1, len(ORDER[kind])):
        both = (g[:, j - 1] > 0) & (g[:, j] > 0)
        if bool(both.any()):
            d = (c[both, j] - c[both, j - 1]).median() / (clock_ghz * 1e3)
            out.append((ORDER[kind][j - 1], ORDER[kind][j], float(d)))
    return out


def print_steps(stamps: torch.Tensor, rows, clock_ghz: float = 1.98) -> None:
    """One line per traced launch: phase_steps' medians (us, clock64 at clock_ghz)."""
    for row in rows:
        _, kind, grid, _ = row
        steps = "  ".join(f"{a}>{b}:{d:6.3f}" for a, b, d in phase_steps(stamps, row, clock_ghz))
        print(f"{KINDS.get(kind, kind):>11} {grid[0]:4d}x{grid[1]:<2d}  {steps}")


def main(name: str) -> None:
    from bench.bench_generate import target
    from bench.bench_kimi_decode import _prompt

    if not hasattr(torch.ops.kdtree, "_trace"):
        raise SystemExit("trace: this build has no kernel stamps; rebuild with KDTREE_TRACE=1")
    model = target(name)
    ids = _prompt(model.config.vocab_size)
    kw = dict(eos_token_id=None, compile_step={"combo_kernels": True}, max_new_tokens=16)
    model.generate(ids, **kw)  # compile and capture
    torch.ops.kdtree._trace(1)
    model.generate(ids, **kw)  # the same session: graph replays overwrite the captured launches' records
    stamps, meta = torch.ops.kdtree._trace(0)
    rows = last_step(stamps, meta, model.config.num_hidden_layers)
    print(f"trace {name}: {len(rows)} traced launches in the last step; us from its first stamp, "
          f"phase: first / median / last block")
    print_rows(rows)
    i = rows[len(rows) // 2][0]
    gt, ck = wait_to_end(stamps, rows[len(rows) // 2])
    print(f"check: record {i} median block, wait->end {gt:.3f} us (globaltimer), {ck:.3f} us (clock64 at 1.98 GHz)")
    print("per-block time between consecutive phases (median block, us by its clock64 at 1.98 GHz):")
    print_steps(stamps, rows)


if __name__ == "__main__":
    for n in sys.argv[1:] or ["2p2b"]:
        main(n)
