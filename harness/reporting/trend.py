"""Trends over the history: the newest run against the last N runs of its fingerprint.

Per figure of each case (``FIGURES``) the earlier runs' values give a band:

* centre: their median;
* spread: the median absolute deviation from it, scaled by 1.4826 (a normal distribution's
  standard deviation) and by ``n / (n - 0.8)`` for the small counts a history has, or where
  larger the median pairwise difference scaled by 1.0483 (the MAD of three values is their
  smaller deviation: one quiet pair beside a wild value would make a band too narrow); and,
  where it is larger, the figure's pooled relative spread (the median over the cases of
  spread / median) times this case's median, so a case that happened to be quiet on a few
  nights is not held to a narrower band than its figure shows across the cases;
* half-width: ``K_SPREADS`` spreads, at least ``FLOOR_QUANTA`` quanta of the figure's
  resolution (a millisecond for the seconds a summary rounds to, one byte, an ulp of the median
  for an unrounded float), so identical histories do not flag the last digit.

No fixed percentage: the band is as wide as the history's own spread. A figure needs
``MIN_HISTORY`` earlier values for a band.

The flags:

* ``regression``: a check that passed on each of the last K runs recording it (fewer where the
  history is shorter) and fails now (a case failing with no failing check: its verdict);
* ``flaky``: a case whose verdict flipped between pass and fail twice or more over the window and
  the newest run (the nights of each verdict named);
* ``band``: a figure outside its band in its bad direction (time, overhead, peak memory, host
  footprint up; copy rate down). Figures with no bad direction (copies and bytes per step) are
  tracked and noted, never flagged.
"""

from __future__ import annotations

import itertools
import math
import sqlite3
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from harness.reporting import history as db

K_SPREADS = 5.0
"""Half-width of a band in spreads (scaled MADs)."""
FLOOR_QUANTA = 2.0
"""Least half-width of a band, in quanta of the figure's resolution."""
MIN_HISTORY = 3
"""Earlier values a figure needs for a band."""
MAD_TO_SIGMA = 1.4826
"""MAD times this estimates a normal distribution's standard deviation."""
PAIRS_TO_SIGMA = 1.0483
"""The median pairwise absolute difference times this estimates it too."""
DEFAULT_LAST = 10
DEFAULT_STREAK = 3

PASSING = ("pass",)
NOT_FAILING = ("pass", "skip", "inert")


@dataclass(frozen=True)
class Figure:
    """A figure the trend reads: where it is stored, its unit, which way is worse (+1 up, -1
    down, 0 neither: tracked only) and its resolution (``quantum``; 0: an unrounded float)."""

    key: str
    table: str
    column: str
    label: str
    unit: str
    kind: str
    bad: int
    quantum: float


FIGURES: tuple[Figure, ...] = (
    Figure("seconds", "cases", "seconds", "case seconds", "s", "time", 1, 1e-3),
    Figure(
        "offload_seconds", "cases", "offload_seconds", "offload run seconds", "s", "time", 1, 1e-3
    ),
    Figure("overhead", "cases", "overhead", "offload / plain run seconds", "x", "overhead", 1, 0.0),
    Figure(
        "offload_after_forward",
        "memory",
        "offload_after_forward",
        "device bytes after the last forward",
        "B",
        "peak memory",
        1,
        1.0,
    ),
    Figure(
        "offload_peak", "memory", "offload_peak", "device peak bytes", "B", "peak memory", 1, 1.0
    ),
    Figure(
        "offload_backward_peak",
        "memory",
        "offload_backward_peak",
        "device peak bytes in the backward",
        "B",
        "peak memory",
        1,
        1.0,
    ),
    Figure(
        "host_held_bytes",
        "host",
        "held_bytes",
        "host bytes held at a step's end",
        "B",
        "host footprint",
        1,
        1.0,
    ),
    Figure(
        "host_ratio",
        "host",
        "ratio",
        "host bytes held per byte in flight",
        "x",
        "host footprint",
        1,
        1e-4,
    ),
    Figure("d2h_copies", "transfers", "d2h_copies", "D2H copies per step", "", "transfers", 0, 1.0),
    Figure("d2h_bytes", "transfers", "d2h_bytes", "D2H bytes per step", "B", "transfers", 0, 1.0),
    Figure("h2d_copies", "transfers", "h2d_copies", "H2D copies per step", "", "transfers", 0, 1.0),
    Figure("h2d_bytes", "transfers", "h2d_bytes", "H2D bytes per step", "B", "transfers", 0, 1.0),
    Figure("bench_step_s", "bench", "step_s", "bench step seconds", "s", "time", 1, 0.0),
    Figure(
        "bench_ratio", "bench", "ratio", "bench step ratio to the baseline", "x", "overhead", 1, 0.0
    ),
    Figure("bench_copy_gbs", "bench", "copy_gbs", "bench copy rate", "GB/s", "copy rate", -1, 0.0),
    Figure(
        "bench_host_s",
        "bench",
        "host_s",
        "bench offloader host seconds per step",
        "s",
        "time",
        1,
        0.0,
    ),
    Figure(
        "bench_host_ratio",
        "bench",
        "host_ratio",
        "bench host bytes held per byte in flight",
        "x",
        "host footprint",
        1,
        1e-4,
    ),
    Figure(
        "bench_peak_bytes", "bench", "peak_bytes", "bench peak bytes", "B", "peak memory", 1, 1.0
    ),
)
BY_KEY = {f.key: f for f in FIGURES}


@dataclass(frozen=True)
class Night:
    """One recorded run."""

    run_id: int
    date: str
    commit: str | None = None
    backend: str | None = None

    def label(self) -> str:
        """``#id date commit``."""
        commit = f" {self.commit[:10]}" if self.commit else ""
        return f"#{self.run_id} {self.date[:16]}{commit}"


@dataclass
class History:
    """The runs of one fingerprint, oldest first, with their figures, verdicts and checks."""

    fingerprint: str
    nights: list[Night]
    figures: dict[int, dict[tuple[str, str], float]] = field(default_factory=dict)
    """Run id -> (series: the case, or bench model/variant; figure key) -> value."""
    verdicts: dict[int, dict[str, str]] = field(default_factory=dict)
    checks: dict[int, dict[tuple[str, str], str]] = field(default_factory=dict)

    def value(self, run_id: int, series: str, figure: str) -> float | None:
        return self.figures.get(run_id, {}).get((series, figure))


@dataclass(frozen=True)
class Band:
    """A figure's band from the earlier runs' values."""

    median: float
    spread: float
    half: float
    values: tuple[float, ...]
    nights: tuple[int, ...]

    @property
    def low(self) -> float:
        """The lower edge, never below 0 for a figure of non-negative values (all of them:
        seconds, bytes, ratios, rates)."""
        low = self.median - self.half
        return max(low, 0.0) if min(self.values, default=0.0) >= 0 else low

    @property
    def high(self) -> float:
        return self.median + self.half

    def outside(self, value: float, bad: int) -> bool:
        """Whether ``value`` lies outside the band in the bad direction ``bad``."""
        return (bad > 0 and value > self.high) or (bad < 0 and value < self.low)


@dataclass(frozen=True)
class Flag:
    """One finding: ``kind`` ``regression``, ``flaky`` or ``band``; the case (or bench
    variant), the figure or check, the nights it names, one line."""

    kind: str
    series: str
    what: str
    nights: tuple[int, ...]
    message: str


@dataclass
class Trend:
    """What ``analyse`` found."""

    history: History
    newest: Night
    window: list[Night]
    flags: list[Flag] = field(default_factory=list)
    bands: dict[tuple[str, str], Band] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------- the band


def mad_spread(values: Sequence[float]) -> float:
    """1.4826 x the median absolute deviation from the median, x ``n / (n - 0.8)`` (the
    small-sample correction); 0 for fewer than two values."""
    n = len(values)
    if n < 2:
        return 0.0
    centre = statistics.median(values)
    mad = statistics.median(abs(v - centre) for v in values)
    return MAD_TO_SIGMA * mad * n / (n - 0.8)


def pairwise_spread(values: Sequence[float]) -> float:
    """1.0483 x the median of the absolute differences of all pairs (Shamos' estimator, scaled
    to a normal's standard deviation); 0 for fewer than two values."""
    if len(values) < 2:
        return 0.0
    gaps = [abs(a - b) for a, b in itertools.combinations(values, 2)]
    return PAIRS_TO_SIGMA * statistics.median(gaps)


def spread(values: Sequence[float]) -> float:
    """The larger of ``mad_spread`` and ``pairwise_spread``. At the few values a history has
    the MAD alone understates the spread: of three values it is the smaller of the two
    deviations from the median, so one quiet pair beside a wild value makes a band too narrow
    for the next ordinary run; the pairwise median sees the wild value as the spread it is."""
    return max(mad_spread(values), pairwise_spread(values))


def floor(median: float, quantum: float) -> float:
    """The least half-width: ``FLOOR_QUANTA`` x the larger of the figure's quantum and an ulp
    of the median."""
    return FLOOR_QUANTA * max(quantum, math.ulp(abs(median)))


def band(
    values: Sequence[float],
    quantum: float,
    *,
    relative: float = 0.0,
    nights: Sequence[int] = (),
) -> Band:
    """The band of ``values``: median +- ``K_SPREADS`` x the larger of their own spread and
    ``relative`` x |median|, at least ``floor``."""
    centre = statistics.median(values)
    own = spread(values)
    pooled = relative * abs(centre)
    half = max(K_SPREADS * max(own, pooled), floor(centre, quantum))
    return Band(centre, max(own, pooled), half, tuple(values), tuple(nights))


def pooled_relative(series: Iterable[Sequence[float]]) -> float:
    """The median over the series (each with ``MIN_HISTORY`` values or more and a non-zero
    median) of spread / |median|; 0 where none qualifies."""
    ratios = [
        spread(values) / abs(statistics.median(values))
        for values in series
        if len(values) >= MIN_HISTORY and statistics.median(values) != 0
    ]
    return statistics.median(ratios) if ratios else 0.0


def quantum_of(figure: Figure, history: History, series: str, runs: Sequence[int]) -> float:
    """The resolution of ``figure``'s values: its own, or for the overhead (a ratio of two
    seconds rounded to 1 ms) the change one millisecond of either makes at their medians."""
    if figure.key != "overhead":
        return figure.quantum
    offload = [history.value(r, series, "offload_seconds") for r in runs]
    plain = [history.value(r, series, "plain_seconds") for r in runs]
    a = statistics.median([v for v in offload if v is not None] or [0.0])
    b = statistics.median([v for v in plain if v is not None] or [0.0])
    if a <= 0 or b <= 0:
        return 0.0
    step = BY_KEY["offload_seconds"].quantum
    return (a / b) * (step / a + step / b)


# -------------------------------------------------------------------------------- the flags


def analyse(history: History, *, last: int = DEFAULT_LAST, streak: int = DEFAULT_STREAK) -> Trend:
    """The newest run of ``history`` against its last ``last`` runs before it."""
    if not history.nights:
        raise ValueError(f"no run of fingerprint {history.fingerprint} in the history")
    newest, window = history.nights[-1], history.nights[:-1][-last:] if last > 0 else []
    trend = Trend(history=history, newest=newest, window=window)
    if not window:  # render_text says so
        return trend
    trend.flags += regressions(history, newest, window, streak)
    trend.flags += flaky(history, [*window, newest])
    band_flags(trend)
    if len(window) < MIN_HISTORY:
        trend.notes.append(
            f"{len(window)} earlier run(s): a figure's band needs {MIN_HISTORY}, so no figure "
            "is compared yet"
        )
    return trend


def regressions(
    history: History, newest: Night, window: Sequence[Night], streak: int
) -> list[Flag]:
    """A check that fails now after passing on each of the last ``streak`` runs recording it;
    a failing case with no such check, by its verdict."""
    flags = []
    now = history.checks.get(newest.run_id, {})
    for (case, check), status in sorted(now.items()):
        if status != "fail":
            continue
        before = [
            (n, history.checks[n.run_id][(case, check)])
            for n in window
            if (case, check) in history.checks.get(n.run_id, {})
        ][-streak:]
        if before and all(s in PASSING for _, s in before):
            flags.append(_regression(case, f"check {check}", newest, [n for n, _ in before]))
    failing = {case for (case, _), status in now.items() if status == "fail"}
    for case, verdict in sorted(history.verdicts.get(newest.run_id, {}).items()):
        if verdict in NOT_FAILING or case in failing:  # its checks said it, or did not
            continue
        before = [
            (n, history.verdicts[n.run_id][case])
            for n in window
            if case in history.verdicts.get(n.run_id, {})
        ][-streak:]
        if before and all(v in PASSING for _, v in before):
            flags.append(_regression(case, f"verdict {verdict}", newest, [n for n, _ in before]))
    return flags


def _regression(case: str, what: str, newest: Night, passed: Sequence[Night]) -> Flag:
    names = ", ".join(n.label() for n in passed)
    return Flag(
        "regression",
        case,
        what,
        (*(n.run_id for n in passed), newest.run_id),
        f"regression: {case}: {what} on run {newest.label()} after passing on the last "
        f"{len(passed)} run(s): {names}",
    )


def flaky(history: History, nights: Sequence[Night]) -> list[Flag]:
    """Cases whose verdict flipped between pass and fail at least twice over ``nights``."""
    cases = sorted({c for n in nights for c in history.verdicts.get(n.run_id, {})})
    flags = []
    for case in cases:
        seen = []
        for night in nights:
            verdict = history.verdicts.get(night.run_id, {}).get(case)
            if verdict is None or verdict in ("skip", "inert"):
                continue
            seen.append((night, verdict == "pass"))
        flips = sum(a[1] != b[1] for a, b in itertools.pairwise(seen))
        if flips < 2:
            continue
        failed = [n.label() for n, ok in seen if not ok]
        passed = [n.label() for n, ok in seen if ok]
        flags.append(
            Flag(
                "flaky",
                case,
                "verdict",
                tuple(n.run_id for n, _ in seen),
                f"flaky: {case}: its verdict flipped {flips} times over {len(seen)} runs; "
                f"failed on {', '.join(failed)}; passed on {', '.join(passed)}",
            )
        )
    return flags


def band_flags(trend: Trend) -> None:
    """Every figure of the newest run against its band: flags in the bad direction, notes for
    a tracked figure that moved."""
    history, newest = trend.history, trend.newest
    runs = [n.run_id for n in trend.window]
    for figure in FIGURES:
        series = sorted({s for (s, f) in history.figures.get(newest.run_id, {}) if f == figure.key})
        earlier = {s: _values(history, s, figure.key, runs) for s in series}
        relative = pooled_relative([[v for _, v in vals] for vals in earlier.values()])
        for name in series:
            found = earlier[name]
            now = history.value(newest.run_id, name, figure.key)
            if now is None or len(found) < MIN_HISTORY:
                continue
            quantum = quantum_of(figure, history, name, [r for r, _ in found])
            b = band(
                [v for _, v in found], quantum, relative=relative, nights=[r for r, _ in found]
            )
            trend.bands[(name, figure.key)] = b
            if figure.bad and b.outside(now, figure.bad):
                trend.flags.append(_band_flag(trend, name, figure, now, b))
            elif not figure.bad and not (b.low <= now <= b.high):
                trend.notes.append(
                    f"{name}: {figure.label} {_fmt(now, figure.unit)} on run {newest.label()}, "
                    f"outside {_fmt(b.low, figure.unit)} .. {_fmt(b.high, figure.unit)} "
                    "(tracked, not flagged)"
                )


def _values(
    history: History, series: str, figure: str, runs: Sequence[int]
) -> list[tuple[int, float]]:
    found = [(r, history.value(r, series, figure)) for r in runs]
    return [(r, v) for r, v in found if v is not None]


def _band_flag(trend: Trend, series: str, figure: Figure, now: float, b: Band) -> Flag:
    by_id = {n.run_id: n for n in trend.window}
    side = "above" if figure.bad > 0 else "below"
    least = floor(b.median, quantum_of(figure, trend.history, series, b.nights))
    earlier = ", ".join(
        f"{by_id[r].label()}: {_fmt(v, figure.unit)}"
        for r, v in zip(b.nights, b.values, strict=True)
    )
    return Flag(
        "band",
        series,
        figure.key,
        (*b.nights, trend.newest.run_id),
        f"{figure.kind}: {series}: {figure.label} {_fmt(now, figure.unit)} on run "
        f"{trend.newest.label()} is {side} its band {_fmt(b.low, figure.unit)} .. "
        f"{_fmt(b.high, figure.unit)} (median {_fmt(b.median, figure.unit)}, spread "
        f"{_fmt(b.spread, figure.unit)} x {K_SPREADS:g}, floor "
        f"{_fmt(least, figure.unit)})"
        f" from {len(b.values)} earlier runs: {earlier}",
    )


def _fmt(value: float, unit: str) -> str:
    if unit == "B":
        return f"{value:.0f} B" if abs(value) < 2**20 else f"{value / 2**20:.2f} MiB"
    if unit == "s":
        return f"{value:.3f} s"
    if unit == "x":
        return f"{value:.3f}x"
    return f"{value:.4g}{' ' + unit if unit else ''}"


# ----------------------------------------------------------------------- from the database


def load(
    conn: sqlite3.Connection, fingerprint: str | None = None, *, upto: int | None = None
) -> History:
    """The history of ``fingerprint`` (default: the newest run's, or run ``upto``'s) from an
    open history; with ``upto``, its runs up to that one (which becomes the newest)."""
    if upto is not None:
        row = conn.execute("SELECT fingerprint FROM runs WHERE id = ?", (upto,)).fetchone()
        if row is None:
            raise ValueError(f"no run #{upto} in the history")
        if fingerprint is not None and fingerprint != row[0]:
            raise ValueError(f"run #{upto} is of fingerprint {row[0]}, not {fingerprint}")
        fingerprint = str(row[0])
    if fingerprint is None:
        newest = conn.execute("SELECT fingerprint FROM runs ORDER BY id DESC LIMIT 1").fetchone()
        if newest is None:
            raise ValueError("the history holds no run")
        fingerprint = str(newest[0])
    found = [r for r in db.runs(conn, fingerprint) if upto is None or r["id"] <= upto]
    if not found:
        known = ", ".join(db.fingerprints(conn)) or "none"
        raise ValueError(f"no run of fingerprint {fingerprint} in the history (it has: {known})")
    history = History(
        fingerprint=fingerprint,
        nights=[
            Night(r["id"], r["created_utc"] or r["recorded_utc"], r["commit_sha"], r["backend"])
            for r in found
        ],
    )
    ids = [n.run_id for n in history.nights]
    for row in db.rows(conn, "cases", ids):
        history.verdicts.setdefault(row["run_id"], {})[row["case_name"]] = row["verdict"]
    for row in db.rows(conn, "checks", ids):
        key = (row["case_name"], row["check_name"])
        history.checks.setdefault(row["run_id"], {})[key] = row["status"]
    for table in sorted({f.table for f in FIGURES}):
        for row in db.rows(conn, table, ids):
            series = row.get("case_name") or f"{row.get('model')}/{row.get('variant')}"
            for figure in (f for f in FIGURES if f.table == table):
                value = row.get(figure.column)
                if isinstance(value, int | float):
                    history.figures.setdefault(row["run_id"], {})[(series, figure.key)] = value
    return history


def render_text(trend: Trend) -> str:
    """The console lines: what was compared, each flag, each note, the count."""
    window = trend.window
    against = (
        f"its last {len(window)} run(s) {window[0].label()} .. {window[-1].label()}"
        if window
        else "no earlier run"
    )
    lines = [
        f"trend: run {trend.newest.label()} (backend {trend.newest.backend}) against {against}"
        f" of fingerprint {trend.history.fingerprint}"
    ]
    others = sorted({n.backend or "?" for n in window} - {trend.newest.backend or "?"})
    if others:
        lines.append(f"  note: earlier runs used backend(s) {', '.join(others)}")
    lines += [f"  FLAG {f.message}" for f in trend.flags]
    lines += [f"  note: {n}" for n in trend.notes]
    lines.append(
        f"trend: {len(trend.flags)} flag(s); {len(trend.bands)} figure(s) compared with a band"
        if trend.flags
        else f"trend: no flag; {len(trend.bands)} figure(s) compared with a band"
    )
    return "\n".join(lines)
