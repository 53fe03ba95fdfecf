"""The trend's bands and flags (``harness.reporting.trend``) on histories made by hand: the band
is the history's own spread (scaled MAD) with a floor from the figure's resolution, never a fixed
percentage; regressions, flaky cases and figures outside their band in the bad direction are
flagged with the figure, the band and the nights; tracked figures are noted only."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from harness.reporting import trend as t

CASE = "hybrid-case"


def _history(
    series: dict[str, list[float]] | None = None,
    *,
    case: str = CASE,
    verdicts: list[str] | None = None,
    checks: dict[str, list[str]] | None = None,
) -> t.History:
    """Runs #1..#n (n: the longest list), each with the figures, verdicts and check statuses
    given per run (None: not recorded that night)."""
    series, checks = series or {}, checks or {}
    lengths = [len(v) for v in (*series.values(), *checks.values(), verdicts or [])]
    history = t.History(
        "fp/tiny",
        [
            t.Night(i, f"2026-01-{i:02d}T03:00", f"c{i:09d}", "ref")
            for i in range(1, max(lengths) + 1)
        ],
    )
    for key, values in series.items():
        for run_id, value in enumerate(values, start=1):
            if value is not None:
                history.figures.setdefault(run_id, {})[(case, key)] = value
    for run_id, verdict in enumerate(verdicts or [], start=1):
        history.verdicts.setdefault(run_id, {})[case] = verdict
    for check, statuses in checks.items():
        for run_id, status in enumerate(statuses, start=1):
            if status is not None:
                history.checks.setdefault(run_id, {})[(case, check)] = status
    return history


def _kinds(trend: t.Trend) -> list[tuple[str, str]]:
    return [(f.kind, f.what) for f in trend.flags]


# ------------------------------------------------------------------------------- the band


def test_spread_is_the_scaled_mad_or_the_pairwise_median_where_larger() -> None:
    values = [1.0, 1.1, 0.9, 1.05, 0.95]  # median 1.0, absolute deviations' median 0.05
    assert t.mad_spread(values) == pytest.approx(1.4826 * 0.05 * 5 / 4.2)
    assert t.pairwise_spread(values) == pytest.approx(1.0483 * 0.1)  # median of 10 gaps
    assert t.spread(values) == t.pairwise_spread(values)  # the larger here
    assert t.spread([3.0, 3.0, 3.0]) == 0.0 and t.spread([2.0]) == 0.0
    # one wild value of five widens it to the pairwise median, not to the wild value
    assert t.spread([1.0, 1.1, 0.9, 1.05, 50.0]) == pytest.approx(1.0483 * 0.175)
    # three values, two of them close: the MAD is their small gap, the pairwise median is not
    wild = [2.265, 1.010, 2.254]
    assert t.mad_spread(wild) == pytest.approx(1.4826 * 0.011 * 3 / 2.2)
    assert t.spread(wild) == pytest.approx(1.0483 * 1.244)
    assert not t.band(wild, 0.0).outside(2.6, 1)


def test_identical_history_does_not_flag_the_last_digit() -> None:
    """Identical seconds (rounded to 1 ms), bytes and unrounded floats: the band is the floor,
    two quanta, so one ulp or one quantum of noise passes and three quanta do not."""
    seconds = t.band([0.5, 0.5, 0.5], 1e-3)
    assert seconds.half == pytest.approx(2e-3)
    assert not seconds.outside(math.nextafter(0.5, 1.0), 1)
    assert not seconds.outside(0.501, 1) and seconds.outside(0.503, 1)
    held = t.band([4096.0] * 4, 1.0)
    assert held.half == 2.0 and not held.outside(4097, 1) and held.outside(4099, 1)
    rate = t.band([12.5] * 3, 0.0)  # a bench rate: an ulp of the median is its resolution
    assert rate.half == 2 * math.ulp(12.5)
    assert not rate.outside(math.nextafter(12.5, 0.0), -1)
    assert rate.outside(12.5 - 4 * math.ulp(12.5), -1)


def test_the_band_follows_the_history_spread_not_a_percentage() -> None:
    """The same 20 % slower run: outside the band of a quiet history, inside a noisy one's."""
    quiet = t.band([1.00, 1.01, 0.99, 1.00, 1.01], 1e-3)
    noisy = t.band([1.00, 1.15, 0.85, 1.10, 0.90], 1e-3)
    assert quiet.outside(1.2, 1) and not noisy.outside(1.2, 1)
    assert noisy.half / quiet.half == pytest.approx(t.spread(noisy.values) / t.spread(quiet.values))
    assert noisy.half == pytest.approx(t.K_SPREADS * t.spread(noisy.values))


def test_the_bad_direction() -> None:
    b = t.band([10.0, 10.5, 9.5, 10.0], 1e-3)
    assert b.outside(20.0, 1) and not b.outside(1.0, 1)  # time: only slower is bad
    assert b.outside(1.0, -1) and not b.outside(20.0, -1)  # copy rate: only slower is bad
    assert not b.outside(20.0, 0)  # tracked
    assert b.low >= 0.0


def test_a_quiet_case_gets_its_figures_pooled_relative_spread() -> None:
    noisy = [[1.0, 1.2, 0.8, 1.1], [2.0, 2.4, 1.6, 2.2]]
    relative = t.pooled_relative([*noisy, [5.0, 5.0, 5.0]])
    assert relative == pytest.approx(t.spread(noisy[0]) / 1.05)
    quiet = t.band([5.0, 5.0, 5.0], 1e-3, relative=relative)
    assert quiet.half == pytest.approx(t.K_SPREADS * relative * 5.0)
    assert t.pooled_relative([[0.0, 0.0, 0.0], [1.0, 2.0]]) == 0.0  # no usable series


# ------------------------------------------------------------------------------- the flags


def test_a_slow_night_is_flagged_with_the_figure_the_band_and_the_nights() -> None:
    history = _history({"offload_seconds": [0.40, 0.42, 0.41, 0.39, 1.9]})
    trend = t.analyse(history)
    assert _kinds(trend) == [("band", "offload_seconds")]
    (flag,) = trend.flags
    assert flag.nights == (1, 2, 3, 4, 5)
    assert flag.message.startswith(f"time: {CASE}: offload run seconds 1.900 s on run #5 ")
    assert "is above its band " in flag.message and "(median 0.405 s, spread" in flag.message
    assert "from 4 earlier runs: #1 2026-01-01T03:00 c000000001: 0.400 s" in flag.message
    assert trend.bands[(CASE, "offload_seconds")].median == pytest.approx(0.405)


def test_the_host_footprint_leaving_zero_is_flagged() -> None:
    trend = t.analyse(_history({"host_held_bytes": [0, 0, 0, 884736]}))
    (flag,) = trend.flags
    assert flag.what == "host_held_bytes" and flag.message.startswith("host footprint: ")
    assert "884736 B on run #4" in flag.message and "band 0 B .. 2 B" in flag.message


def test_better_figures_and_tracked_ones_are_not_flagged() -> None:
    history = _history(
        {
            "seconds": [1.0, 1.1, 0.9, 0.2],  # faster
            "d2h_bytes": [100, 100, 100, 200],  # tracked: a note
            "overhead": [1.5, 1.4, 1.6, 1.45],
        }
    )
    trend = t.analyse(history)
    assert trend.flags == []
    assert any("D2H bytes per step 200 B" in n and "not flagged" in n for n in trend.notes)


def test_a_figure_needs_three_earlier_values() -> None:
    trend = t.analyse(_history({"seconds": [1.0, 1.0, 9.0]}))
    assert trend.flags == [] and trend.bands == {}
    assert any("band needs 3" in n for n in trend.notes)
    gaps = t.analyse(_history({"seconds": [1.0, None, 1.0, None, 9.0]}))
    assert gaps.flags == []  # two values in the window


def test_last_limits_the_window() -> None:
    # an old slow era, then a fast one: against the last 3 runs the newest fast run is normal
    history = _history({"seconds": [5.0, 5.1, 4.9, 5.0, 1.0, 1.01, 0.99, 1.0]})
    assert t.analyse(history, last=3).flags == []
    assert [n.run_id for n in t.analyse(history, last=3).window] == [5, 6, 7]
    slow_now = _history({"seconds": [1.0, 1.01, 0.99, 1.0, 5.0]})
    assert _kinds(t.analyse(slow_now, last=3)) == [("band", "seconds")]


def test_a_check_regresses_after_passing_on_the_last_k_runs() -> None:
    history = _history(
        checks={"leaks": ["skip", "pass", "pass", "pass", "fail"]},
        verdicts=["pass", "pass", "pass", "pass", "fail"],
    )
    trend = t.analyse(history, streak=3)
    assert _kinds(trend) == [("regression", "check leaks")]
    assert trend.flags[0].message == (
        f"regression: {CASE}: check leaks on run #5 2026-01-05T03:00 c000000005 after passing "
        "on the last 3 run(s): #2 2026-01-02T03:00 c000000002, #3 2026-01-03T03:00 c000000003, "
        "#4 2026-01-04T03:00 c000000004"
    )
    # with a streak of 4 the skip of run #1 is among the last 4: the check did not pass on 4
    assert t.analyse(history, streak=4).flags == []


def test_a_failing_verdict_without_a_failing_check_regresses_by_its_verdict() -> None:
    history = _history(verdicts=["pass", "pass", "pass", "error: RuntimeError: boom"])
    assert _kinds(t.analyse(history)) == [("regression", "verdict error: RuntimeError: boom")]


def test_a_flaky_case_is_named_with_its_nights() -> None:
    history = _history(verdicts=["pass", "fail", "pass", "pass", "fail", "pass"])
    trend = t.analyse(history)
    assert _kinds(trend) == [("flaky", "verdict")]
    message = trend.flags[0].message
    assert message.startswith(f"flaky: {CASE}: its verdict flipped 4 times over 6 runs; ")
    assert "failed on #2 2026-01-02T03:00 c000000002, #5 2026-01-05T03:00 c000000005;" in message
    # one flip is a regression or a fix, not a flake; skips do not count as flips
    once = _history(verdicts=["pass", "pass", "fail"])
    assert t.flaky(once, once.nights) == []
    steady = _history(verdicts=["pass", "skip", "pass", "skip", "pass"])
    assert t.flaky(steady, steady.nights) == []


def test_a_single_run_has_nothing_to_compare() -> None:
    trend = t.analyse(_history({"seconds": [1.0]}))
    assert trend.window == [] and trend.flags == []
    assert "against no earlier run" in t.render_text(trend)


def test_render_text_names_every_flag() -> None:
    history = _history({"seconds": [1.0, 1.0, 1.0, 3.0]}, verdicts=["pass"] * 4)
    text = t.render_text(t.analyse(history))
    assert "FLAG time: hybrid-case: case seconds 3.000 s on run #4" in text
    assert text.splitlines()[-1] == "trend: 1 flag(s); 1 figure(s) compared with a band"


def test_the_overhead_floor_comes_from_its_seconds_resolution() -> None:
    history = _history(
        {
            "overhead": [2.0, 2.0, 2.0],
            "offload_seconds": [0.4, 0.4, 0.4],
            "plain_seconds": [0.2, 0.2, 0.2],
        }
    )
    # 1 ms of either run changes 0.4 / 0.2 by 2 x (1/400 + 1/200) = 0.015
    assert t.quantum_of(t.BY_KEY["overhead"], history, CASE, [1, 2, 3]) == pytest.approx(0.015)


def test_the_trend_page_without_plots(tmp_path: Path) -> None:
    from harness.reporting.trend_page import plotted, positions, write_trend_page

    history = _history({"host_held_bytes": [0, 0, 0, 4096], "seconds": [1.0, 1.0, 1.0, 1.0]})
    trend = t.analyse(history)
    assert [f.key for f in plotted(trend)] == ["host_held_bytes", "seconds"]  # flagged first
    assert positions(trend, t.BY_KEY["host_held_bytes"]) == {
        CASE: [(0, 0.0), (1, 0.0), (2, 0.0), (3, 2048.0)]  # 4096 B / a 2 B half-width
    }
    page = write_trend_page(trend, tmp_path, plots=False).read_text()
    assert "Trend of run #4 (fp/tiny)" in page and "FLAG host footprint: hybrid-case" in page
    assert '<tr class="flag"><td>hybrid-case</td><td>host bytes held' in page
    assert "No plots" in page and not (tmp_path / "trend-plots").exists()
