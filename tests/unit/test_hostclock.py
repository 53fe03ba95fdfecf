"""``harness.measure.hostclock`` without a run: the clock's windows, its summary and the check of
the clocked steps. The clocked runs (every entry point of the reference timed, a host stall and
garbage collections in a step, the allocator counters on CUDA) are in
``tests/e2e/test_hostclock_runs.py``."""

from __future__ import annotations

import time

import pytest
from hostclock_setup import CPU, RUN, SPEC
from hostclock_setup import reference as _reference

from harness.measure.hostclock import (
    ALLOCATOR_COUNTERS,
    HostClock,
    HostTime,
    read_clock,
    run_clocked,
)


def test_disarmed_clock_records_nothing() -> None:
    clock = HostClock()
    with clock.window("commit", "x"):
        pass
    assert not clock.ns and not clock.calls
    assert read_clock(clock).total_s == 0.0


def test_nested_windows_count_in_the_outermost() -> None:
    clock = HostClock()
    clock.step, clock.armed = 0, True
    clock.host_step_ns[0] = 1
    with clock.window("backward", "outer"):
        with clock.window("unpack", "inner"):
            time.sleep(0.001)
    assert clock.calls[0] == {"backward": 1, "unpack": 1}
    assert set(clock.ns[0]) == {"backward"} and clock.ns[0]["backward"] >= 1_000_000


@pytest.mark.parametrize("clocked", [set(), {3}, {-1}])
def test_bad_clocked_steps_are_one_line(clocked: set[int]) -> None:
    with pytest.raises(ValueError, match="not steps of a 3-step run"):
        run_clocked(SPEC, RUN, _reference(), CPU, clocked=clocked)


def test_summary_names_allocator_misses() -> None:
    found = HostTime(steps=(1,), seconds={"commit": 0.002}, calls={"commit": 8}, total_s=0.002)
    found.host_step_s = 0.04
    assert "allocator" not in found.summary()  # CPU: not counted
    found.allocator = dict.fromkeys(ALLOCATOR_COUNTERS, 0)
    assert found.summary().endswith("; allocator per step: no miss")
    found.allocator["pinned allocs"] = 3
    assert found.summary().endswith("; allocator per step: pinned allocs 3")
