"""PNG plots of a report, drawn from ``summary.json``'s case entries (matplotlib, Agg backend).

Compact multi-case figures, so the cost stays flat with the case count (a few figures, not a
few per case): cases are numbered ``#1..#N`` in report order; ``index.html`` maps the numbers
to case ids.

* ``losses-<page>.png`` - small multiples, one panel per case: the plain baseline's loss per
  microbatch (line) and the offload run's (dots);
* ``loss_diff.png`` - heat map case x (step, microbatch) of |offload - baseline| in fp32 ULPs;
* ``bytes.png`` - bytes each case moved per group (final step, DtoH; HtoD moves the same bytes
  back);
* ``copies.png`` - DtoH and HtoD copies per group (final step).
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import torch

from harness.reporting.report import is_failure
from harness.util.compare import ulps
from harness.vocab.spec import ALL_GROUP_NAMES

PANELS_PER_PAGE = 24
COLUMNS = 6
DPI = 72


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    return plt


def preload_plotting() -> threading.Thread:
    """Import matplotlib's pyplot and ticker on a daemon thread, while the caller waits for its
    cases, so the report's rendering does not pay for them afterwards (about 0.9 s on the 2-core
    CPU machine once the CLI's own imports are done). The rendering's own imports then find them
    loaded, or wait for this thread's."""
    thread = threading.Thread(target=lambda: (_pyplot(), _ticker()), name="preload-plotting")
    thread.daemon = True
    thread.start()
    return thread


def _ticker() -> Any:
    import matplotlib.ticker

    return matplotlib.ticker


def _colors(plt: Any) -> dict[str, Any]:
    cmap = plt.get_cmap("tab10")
    return {name: cmap(i % 10) for i, name in enumerate(ALL_GROUP_NAMES)}


def _losses(case: dict[str, Any], run: str) -> list[float] | None:
    rows = case.get("losses", {}).get(run)
    if not rows:
        return None
    return [float(v) for row in rows for v in row]


def plot_losses(plt: Any, cases: list[dict[str, Any]], folder: Path) -> list[Path]:
    """One page of small multiples per ``PANELS_PER_PAGE`` cases."""
    paths = []
    for page, start in enumerate(range(0, len(cases), PANELS_PER_PAGE), start=1):
        ticker = _ticker()
        chunk = cases[start : start + PANELS_PER_PAGE]
        rows = math.ceil(len(chunk) / COLUMNS)
        height = rows * 1.45 + 0.5
        fig = plt.figure(figsize=(COLUMNS * 1.9, height))
        # Fixed margins: tight_layout costs more than drawing the panels.
        fig.subplots_adjust(
            left=0.05, right=0.99, bottom=0.3 / height, top=1 - 0.6 / height, hspace=0.6
        )
        for index, case in enumerate(chunk):
            ax = fig.add_subplot(rows, COLUMNS, index + 1)
            plain, offload = _losses(case, "plain"), _losses(case, "offload")
            if plain is not None:
                ax.plot(plain, color="0.35", linewidth=1.2, label="baseline")
            if offload is not None:
                ax.plot(offload, ".", color="tab:orange", markersize=3, label="offload")
            failed = is_failure(case)
            ax.set_title(f"#{start + index + 1}", fontsize=8, color="red" if failed else "black")
            ax.tick_params(labelsize=6)
            ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
            if index == 0:
                ax.legend(fontsize=6, loc="upper right")
        fig.suptitle(
            "loss per microbatch (step x microbatches + mb): baseline line, offload dots",
            fontsize=8,
            y=1 - 0.08 / height,
            va="top",
        )
        path = folder / f"losses-{page}.png"
        fig.savefig(path, dpi=DPI)
        plt.close(fig)
        paths.append(path)
    return paths


def ulp_matrix(cases: list[dict[str, Any]]) -> list[list[float]]:
    """Per case, per (step, microbatch): |offload - baseline| in fp32 ULPs (NaN: no losses)."""
    width = max((len(_losses(c, "plain") or []) for c in cases), default=0)
    out = []
    for case in cases:
        plain, offload = _losses(case, "plain"), _losses(case, "offload")
        row = [math.nan] * width
        if plain is not None and offload is not None:
            for i, (e, g) in enumerate(zip(plain, offload, strict=True)):
                row[i] = float(ulps(e, g, torch.float32)) if e == e and g == g else math.inf
        out.append(row)
    return out


def plot_loss_diff(plt: Any, cases: list[dict[str, Any]], folder: Path) -> Path:
    values = ulp_matrix(cases)
    height = max(1.6, 0.22 * len(cases) + 0.9)
    fig, ax = plt.subplots(figsize=(7.0, height))
    data = [[math.log10(1 + min(v, 1e12)) if v == v else math.nan for v in row] for row in values]
    cmap = plt.get_cmap("Reds").with_extremes(bad="0.85")
    image = ax.imshow(data, aspect="auto", cmap=cmap, vmin=0, vmax=max(1.0, _finite_max(data)))
    ax.set_yticks(range(len(cases)), [f"#{i + 1}" for i in range(len(cases))], fontsize=6)
    ax.set_xlabel("microbatch (step x microbatches + mb)", fontsize=7)
    ax.tick_params(axis="x", labelsize=6)
    worst = max((max(row, default=0.0) for row in values if row), default=0.0)
    ax.set_title(f"|offload - baseline| in fp32 ULPs, log10(1 + ulps); worst {worst:g}", fontsize=8)
    fig.colorbar(image, ax=ax).ax.tick_params(labelsize=6)
    fig.tight_layout()
    path = folder / "loss_diff.png"
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _finite_max(data: list[list[float]]) -> float:
    return max((v for row in data for v in row if math.isfinite(v)), default=0.0)


def per_group(case: dict[str, Any], direction: str, field: str) -> dict[str, int]:
    """``transfers.per_name`` of a case entry for one direction: group name -> value."""
    per_name = case.get("transfers", {}).get("per_name", {})
    out = {}
    for key, counts in per_name.items():
        d, _, name = key.partition(":")
        if d == direction:
            out[name] = int(counts[field])
    return out


def _stacked(
    ax: Any,
    cases: list[dict[str, Any]],
    direction: str,
    field: str,
    scale: float,
    colors: dict[str, Any],
) -> None:
    left = [0.0] * len(cases)
    rows = range(len(cases))
    for name in ALL_GROUP_NAMES:
        values = [per_group(c, direction, field).get(name, 0) / scale for c in cases]
        if any(values):
            ax.barh(rows, values, left=left, color=colors[name], label=name, height=0.75)
            left = [a + b for a, b in zip(left, values, strict=True)]
    ax.set_yticks(rows, [f"#{i + 1}" for i in rows], fontsize=6)
    ax.tick_params(axis="x", labelsize=6)


def plot_bytes(plt: Any, cases: list[dict[str, Any]], folder: Path) -> Path:
    height = max(1.8, 0.2 * len(cases) + 1.0)
    fig, ax = plt.subplots(figsize=(7.0, height))
    _stacked(ax, cases, "d2h", "bytes", 2**20, _colors(plt))
    ax.invert_yaxis()  # case #1 on top
    ax.set_xlabel("MiB moved per group, final step (DtoH; HtoD brings the same back)", fontsize=7)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    path = folder / "bytes.png"
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def plot_copies(plt: Any, cases: list[dict[str, Any]], folder: Path) -> Path:
    height = max(1.8, 0.2 * len(cases) + 1.0)
    fig, axes = plt.subplots(1, 2, figsize=(9.0, height), sharey=True)
    colors = _colors(plt)
    for ax, direction, label in zip(axes, ("d2h", "h2d"), ("DtoH", "HtoD"), strict=True):
        _stacked(ax, cases, direction, "copies", 1.0, colors)
        ax.set_xlabel(f"{label} copies per group, final step", fontsize=7)
    axes[0].invert_yaxis()  # shared: once flips both, case #1 on top
    if axes[0].get_legend_handles_labels()[0]:
        axes[1].legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    path = folder / "copies.png"
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def render_plots(cases: list[dict[str, Any]], folder: Path) -> list[Path]:
    """Every figure of the report into ``folder``; returns the PNG paths ([] for no cases)."""
    if not cases:
        return []
    plt = _pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    return [
        *plot_losses(plt, cases, folder),
        plot_loss_diff(plt, cases, folder),
        plot_bytes(plt, cases, folder),
        plot_copies(plt, cases, folder),
    ]
