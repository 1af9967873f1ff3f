"""tools/trace_decode.py's reading of kernel phase stamps (csrc/trace.cuh): which launches it keeps,
their order, the last decode step, and the table it prints.  The stamps come from a KDTREE_TRACE=1
build on a GPU; here they are made up in the same layout ([records, blocks, 2 x phases] int64,
globaltimer at even indices, and each record's kind and grid)."""
import pytest
import torch

from tools.trace_decode import (ORDER, last_step, phase_steps, print_rows, print_steps, stamped,
                                wait_to_end)

PHASES = 12


def record(kind: int, blocks: int, start_ns: int, step_ns: int = 100):
    """A launch whose block b stamps its phases in program order, b ns after start."""
    s = torch.zeros(16, 2 * PHASES, dtype=torch.long)
    for b in range(blocks):
        for j, p in enumerate(ORDER[kind]):
            s[b, 2 * p] = start_ns + b + j * step_ns
            s[b, 2 * p + 1] = 7  # clock64 (unused here)
    return s


def trace(launches):
    """(stamps, meta) for [(kind, blocks, start_ns) or None (a record that never ran)]."""
    stamps, meta = [], []
    for item in launches:
        if item is None:
            stamps.append(torch.zeros(16, 2 * PHASES, dtype=torch.long))
            meta.append([1, 4, 1])
        else:
            kind, blocks, start = item
            stamps.append(record(kind, blocks, start))
            meta.append([kind, blocks, 1])
    return torch.stack(stamps), torch.tensor(meta)


def test_stamped_keeps_launches_that_ran_in_start_order():
    stamps, meta = trace([(1, 4, 5000), None, (2, 8, 1000), (1, 2, 3000)])
    rows = stamped(stamps, meta)
    assert [r[0] for r in rows] == [2, 3, 0]  # the empty record 1 is dropped
    assert [r[1] for r in rows] == [2, 1, 1]
    assert rows[0][2] == (8, 1) and rows[0][3].shape == (8, len(ORDER[2]))
    assert rows[2][3].shape == (4, len(ORDER[1]))


def test_last_step_starts_two_launches_before_its_first_attention():
    # two steps of one layer each: q_a, q_b, mla_decode, o_proj
    launches = [(1, 4, 0), (1, 4, 1000), (2, 8, 2000), (1, 4, 3000),
                (1, 4, 10000), (1, 4, 11000), (2, 8, 12000), (1, 4, 13000)]
    stamps, meta = trace(launches)
    rows = last_step(stamps, meta, layers=1)
    assert [r[0] for r in rows] == [4, 5, 6, 7]
    with pytest.raises(SystemExit, match="2 mla_decode launches stamped, expected >= 3"):
        last_step(stamps, meta, layers=3)


def test_print_rows_reports_phases_from_the_first_stamp(capsys):
    stamps, meta = trace([(1, 4, 2000), (2, 8, 4000)])
    print_rows(stamped(stamps, meta))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    gemv, mla = lines
    # gemv: phase 0 of blocks 0..3 at 0..3 ns; its last phase (4, 10th in order) at 900 + 3 ns
    assert gemv.split()[0] == "gemv" and "4x1" in gemv
    assert float(gemv.split("end")[1].split()[0]) == pytest.approx(0.90, abs=0.006)
    assert "0:   0.00/   0.00/   0.00" in gemv
    # mla_decode starts 2 us later; its last phase (7, 12th in order) at 2000 + 1100 + 7 ns
    assert mla.split()[0] == "mla_decode"
    assert float(mla.split("end")[1].split()[0]) == pytest.approx(3.11, abs=0.006)
    assert "(+ 2.20)" in mla


def test_wait_to_end_reads_each_kinds_wait_column():
    """Phase 2 ("wait returned") sits at a different column per kind (moe_route has no phase 1)."""
    stamps, meta = trace([(3, 4, 1000), (1, 4, 5000)])
    stamps[:, :, 1::2] = stamps[:, :, 0::2] * 2  # clock64 at 2 GHz ticking with the globaltimer
    route, gemv = stamped(stamps, meta)
    # moe_route: phases 0, 2, 4 at 0, 100, 200 ns after start; gemv: phase 2 is 3rd of 10 (200 ns), 4 last (900)
    assert wait_to_end(stamps, route, clock_ghz=2.0) == pytest.approx((0.1, 0.1))
    assert wait_to_end(stamps, gemv, clock_ghz=2.0) == pytest.approx((0.7, 0.7))


def test_kinds_and_phases_match_trace_cuh():
    """The script's kinds and phase lists agree with csrc/trace.cuh (the kernels' side)."""
    import re
    from pathlib import Path

    from tools.trace_decode import KINDS

    src = (Path(__file__).resolve().parents[1] / "torch_kdtree" / "csrc" / "trace.cuh").read_text()
    phases = int(re.search(r"kTracePhases = (\d+);", src).group(1))
    enum = dict((int(v), n) for n, v in re.findall(r"kTrace(\w+) = (\d+)", re.search(r"enum TraceKind[^}]*}", src).group(0)))
    assert phases == PHASES
    assert sorted(enum) == sorted(KINDS) == sorted(ORDER)
    for kind, name in enum.items():
        camel = "".join(w.capitalize() for w in KINDS[kind].split("_"))
        assert camel.lower() == name.lower(), (kind, name, KINDS[kind])
        assert len(set(ORDER[kind])) == len(ORDER[kind]) and all(0 <= p < phases for p in ORDER[kind])


def test_phase_steps_are_per_block_clock_differences_in_program_order(capsys):
    """Each step is the median over blocks of clock64[next] - clock64[phase], skipping blocks that
    did not stamp both (a phase a block never reached reads 0)."""
    stamps, meta = trace([(3, 4, 1000)])
    # moe_route: phases 0, 2, 4.  Block b's clock: 0 at phase 0, 1000 (b + 1) cycles at 2, then +500 b at 4
    for b in range(4):
        stamps[0, b, 1] = 10**6 * (b + 1)  # each SM's clock has its own origin
        stamps[0, b, 5] = stamps[0, b, 1] + 1000 * (b + 1)
        stamps[0, b, 9] = stamps[0, b, 5] + 500 * b
    stamps[0, 3, 8] = 0  # block 3 never stamped phase 4
    (row,) = stamped(stamps, meta)
    steps = phase_steps(stamps, row, clock_ghz=1.0)
    assert [(a, b) for a, b, _ in steps] == [(0, 2), (2, 4)]
    # 0 -> 2: 1000, 2000, 3000, 4000 cycles; torch's median of an even count is the lower middle
    assert steps[0][2] == pytest.approx(2.0)
    # 2 -> 4: blocks 0..2 only: 0, 500, 1000 cycles
    assert steps[1][2] == pytest.approx(0.5)
    print_steps(stamps, [row], clock_ghz=1.0)
    line = capsys.readouterr().out.strip()
    assert line.split()[0] == "moe_route" and "0>2: 2.000" in line and "2>4: 0.500" in line
