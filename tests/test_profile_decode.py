"""tools/profile_decode.py's step timeline (step_timeline): which trace events it keeps, the last
of equal steps, starts, durations and gaps (overlaps negative).  The events are made up in the
Chrome-trace layout torch.profiler exports (cat, name, ts and dur in us)."""
import pytest

from tools.profile_decode import step_timeline


def ev(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def steps(n, t0=1000.0, period=100.0):
    """n steps of: a kernel, a copy overlapping its end, a kernel resident 2 us before the copy ends
    (a programmatic launch), a memset after a 3 us gap; plus host-side events to ignore."""
    out = []
    for i in range(n):
        t = t0 + i * period
        out += [ev("kernel", "gemv", t, 10.0), ev("gpu_memcpy", "Memcpy DtoD", t + 9.0, 4.0),
                ev("kernel", "mla_decode", t + 11.0, 5.0), ev("gpu_memset", "Memset", t + 19.0, 1.0),
                ev("cpu_op", "aten::mm", t, 50.0), ev("cuda_runtime", "cudaGraphLaunch", t - 5, 2.0)]
    return out


def test_step_timeline_reads_the_last_step():
    lines = step_timeline(steps(3), 3)
    assert lines[0] == "4 launches, 20.0 us from the first start to the last end"
    rows = [line.split() for line in lines[1:]]
    assert [r[-1] for r in rows] == ["gemv", "DtoD", "mla_decode", "Memset"]
    assert [float(r[0]) for r in rows] == [0.0, 9.0, 11.0, 19.0]  # from the last step's first start
    assert [float(r[1]) for r in rows] == [10.0, 4.0, 5.0, 1.0]
    # gaps after the latest end so far: the copy starts 1 us before the kernel ends, mla_decode 2 us
    # before the copy ends (13), the memset 3 us after mla_decode's end (16)
    assert [float(r[3]) for r in rows] == [0.0, -1.0, -2.0, 3.0]


def test_step_timeline_orders_by_start():
    shuffled = list(reversed(steps(2)))
    assert step_timeline(shuffled, 2) == step_timeline(steps(2), 2)


@pytest.mark.parametrize("events, n", [(steps(3)[:-3], 3), (steps(2), 3), ([], 1), (steps(1), 0)])
def test_step_timeline_needs_equal_steps(events, n):
    with pytest.raises(ValueError, match="equal steps"):
        step_timeline(events, n)


def test_budgets_option():
    from tools.profile_decode import parse_args

    assert parse_args(["k2_slice"]).budgets == (0, 16)
    assert parse_args(["--budgets", "0,4,8,16", "2p2b"]).budgets == (0, 4, 8, 16)
    for bad in ("", "a,b", "-1"):
        with pytest.raises(SystemExit):
            parse_args(["--budgets", bad])
