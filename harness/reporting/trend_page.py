"""The trend page: ``trend.html`` and ``trend-plots/*.png``, drawn from the analysis of
``harness.reporting.trend`` (matplotlib, Agg).

One image, ``trend.png``: a small plot per figure over the nights. Each case (or bench variant)
is a line of its value's place in its own band, ``(value - median) / half-width``, so every
band is the same shaded strip from -1 to 1 whatever the unit; values beyond +-``CLIP`` are drawn
at the edge. The newest run is the last night; a flagged value is marked with a red cross and
named. Above it on the page: the trend's console text (every flag with its band and nights)
and the nights compared; below it, the newest run's bands in the figures' units.
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

from harness.reporting.trend import FIGURES, Figure, Trend, render_text

COLUMNS = 4
"""Small plots a row."""
CLIP = 4.0
"""Band positions beyond +-CLIP are drawn at the edge."""
DPI = 80
FOLDER = "trend-plots"

_STYLE = """
body { font-family: sans-serif; font-size: 13px; margin: 1.5em; }
table { border-collapse: collapse; }
td, th { border: 1px solid #ccc; padding: 2px 6px; text-align: left; vertical-align: top; }
th { background: #eee; } .flag { color: #b00; }
.plots img { max-width: 100%; border: 1px solid #ddd; margin: 3px; }
pre { background: #f6f6f6; padding: 6px; white-space: pre-wrap; font-size: 11px; }
"""


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def positions(trend: Trend, figure: Figure) -> dict[str, list[tuple[int, float]]]:
    """Per series with a band for ``figure``: (night index, place in the band) of every night
    that recorded it (the window and the newest run)."""
    nights = [*trend.window, trend.newest]
    out: dict[str, list[tuple[int, float]]] = {}
    for (series, key), band in sorted(trend.bands.items()):
        if key != figure.key:
            continue
        points = []
        for index, night in enumerate(nights):
            value = trend.history.value(night.run_id, series, key)
            if value is not None:
                points.append((index, (value - band.median) / band.half))
        out[series] = points
    return out


def draw_figure(ax: Any, trend: Trend, figure: Figure) -> None:
    """``figure``'s small plot on ``ax``: each series' place in its band over the nights."""
    flagged = {f.series for f in trend.flags if f.kind == "band" and f.what == figure.key}
    nights = [*trend.window, trend.newest]
    ax.axhspan(-1, 1, color="tab:green", alpha=0.15)
    ax.axhline(0, color="0.5", linewidth=0.6)
    named = 0
    for series, points in positions(trend, figure).items():
        xs = [i for i, _ in points]
        ys = [max(-CLIP, min(CLIP, y)) for _, y in points]
        bad = series in flagged
        style = (
            {"linewidth": 1.4, "color": "tab:red"} if bad else {"linewidth": 0.8, "color": "0.5"}
        )
        ax.plot(xs, ys, marker=".", markersize=3, **style)
        if bad:
            ax.plot(xs[-1], ys[-1], "x", color="red", markersize=8, markeredgewidth=2)
            ax.annotate(
                _short(series),
                (xs[-1], ys[-1]),
                fontsize=5,
                color="red",
                xytext=(-6, (-9 if ys[-1] > 0 else 4) + (-7 if ys[-1] > 0 else 7) * named),
                textcoords="offset points",
                ha="right",
            )
            named += 1
    ax.set_ylim(-CLIP - 0.3, CLIP + 0.3)
    ax.set_xticks(range(len(nights)), [f"#{n.run_id}" for n in nights], fontsize=6)
    ax.tick_params(axis="y", labelsize=6)
    worse = {1: "up is worse", -1: "down is worse", 0: "tracked"}[figure.bad]
    ax.set_title(f"{figure.label}\n({figure.kind}; {worse})", fontsize=7)


def _short(series: str, width: int = 28) -> str:
    return series if len(series) <= width else series[: width - 3] + "..."


def plotted(trend: Trend) -> list[Figure]:
    """The figures with a band, flagged ones first."""
    flagged = {f.what for f in trend.flags if f.kind == "band"}
    keys = {key for _, key in trend.bands}
    found = [f for f in FIGURES if f.key in keys]
    return sorted(found, key=lambda f: (f.key not in flagged, FIGURES.index(f)))


def render_plots(trend: Trend, folder: Path) -> list[Path]:
    """``trend.png``: one small plot per figure with a band (``COLUMNS`` a row), flagged ones
    first; [] where none has a band."""
    figures = plotted(trend)
    if not figures:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    rows = math.ceil(len(figures) / COLUMNS)
    fig, axes = plt.subplots(rows, COLUMNS, figsize=(COLUMNS * 3.2, rows * 2.3), squeeze=False)
    for ax, figure in zip(axes.flat, figures, strict=False):
        draw_figure(ax, trend, figure)
    for ax in list(axes.flat)[len(figures) :]:
        ax.set_visible(False)
    for row in axes:
        row[0].set_ylabel("(value - median)\n/ half-width", fontsize=6)
    fig.suptitle(
        f"run #{trend.newest.run_id} against runs "
        + ", ".join(f"#{n.run_id}" for n in trend.window)
        + f" ({trend.history.fingerprint}): each line a case, band shaded, flagged night x",
        fontsize=8,
    )
    fig.tight_layout()
    path = folder / "trend.png"
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return [path]


def _e(value: Any) -> str:
    return html.escape(str(value))


def _band_rows(trend: Trend) -> list[str]:
    rows = []
    by_key = {f.key: f for f in FIGURES}
    flagged = {(f.series, f.what) for f in trend.flags if f.kind == "band"}
    for (series, key), band in sorted(trend.bands.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        now = trend.history.value(trend.newest.run_id, series, key)
        css = ' class="flag"' if (series, key) in flagged else ""
        rows.append(
            f"<tr{css}><td>{_e(series)}</td><td>{_e(by_key[key].label)}</td>"
            f"<td>{_e(f'{band.median:.6g}')}</td><td>{_e(f'{band.low:.6g} .. {band.high:.6g}')}"
            f"</td><td>{_e(f'{now:.6g}' if now is not None else '-')}</td>"
            f"<td>{len(band.values)}</td></tr>"
        )
    return rows


def write_trend_page(trend: Trend, folder: Path, *, plots: bool = True) -> Path:
    """``folder/trend.html`` and (with ``plots``) its plots; returns the page's path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    drawn: list[Path] = []
    note = "" if plots else "<p>No plots: OFFLOAD_HARNESS_PLOTS=0.</p>"
    try:
        drawn = render_plots(trend, folder / FOLDER) if plots else []
    except ImportError as exc:  # matplotlib is optional
        note = f"<p>No plots: {_e(exc)} (pip install matplotlib).</p>"
    nights = [*trend.window, trend.newest]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>offload-harness trend {_e(trend.history.fingerprint)}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>Trend of run #{trend.newest.run_id} ({_e(trend.history.fingerprint)})</h1>",
        f"<pre>{_e(render_text(trend))}</pre>",
        "<h2>Nights</h2><table><tr><th>run</th><th>date</th><th>commit</th><th>backend</th></tr>",
        *(
            f"<tr><td>#{n.run_id}</td><td>{_e(n.date)}</td><td>{_e(n.commit or '-')}</td>"
            f"<td>{_e(n.backend or '-')}</td></tr>"
            for n in nights
        ),
        "</table><h2>Figures</h2>",
        "<p>Each line is a case's value in its own band: 0 the median of the earlier runs, "
        "+-1 the band's edges (shaded); a red cross marks a flagged night.</p>",
        note,
        '<div class="plots">',
        *(f'<img src="{FOLDER}/{p.name}" alt="the figures over the nights">' for p in drawn),
        "</div><h2>Bands of the newest run</h2><table><tr><th>case</th><th>figure</th>"
        "<th>median</th><th>band</th><th>newest</th><th>runs</th></tr>",
        *_band_rows(trend),
        "</table></body></html>",
    ]
    path = folder / "trend.html"
    path.write_text("\n".join(parts) + "\n")
    return path
