"""``offload-harness trend``: the newest run of a history against its last N runs of the same
fingerprint (``harness.reporting.trend``); and the recording every writer of the history uses.

    offload-harness trend --history nights.sqlite                 # compare; exit 1 on a flag
    offload-harness trend --history nights.sqlite --last 20 --trend warn --html out/
    offload-harness trend --history nights.sqlite --run 4        # run #4 against its own past
    offload-harness trend --history nights.sqlite --record reports/<run>/ [--bench bench.json]

``--record`` appends a run's ``summary.json`` (a file or its report folder) first, ``--bench``
a ``bench.json`` (with ``--record``: to that run; alone: a run of its own). ``offload-harness run
--history`` and ``scripts/nightly --history`` record their run the same way.

Exit codes: 0 no flag (or ``--trend warn``), 1 a flag, 2 bad input (a missing or unreadable
history, summary or bench file, an unknown fingerprint), one line before anything is written.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from harness.reporting import history as db
from harness.reporting import trend as trends
from harness.reporting.history_rows import bench_only_record, fingerprint_of, run_record

PROG = "offload-harness trend"


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON file (a report folder: its ``summary.json``) as a dict; a ``ValueError`` with one
    line where it is missing or unreadable."""
    path = Path(path)
    if path.is_dir() and what == "summary":
        path = path / "summary.json"
    try:
        found = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{what} {path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{what} {path}: not readable JSON: {exc}") from None
    if not isinstance(found, dict):
        raise ValueError(f"{what} {path}: not a JSON object")
    return found


def machine_fingerprint(device: str | None) -> str:
    """This machine's numerics fingerprint for ``device`` (where a summary names none: no case
    compared a golden trace)."""
    import torch

    from harness.measure import fingerprint

    return fingerprint.of(torch.device(device or "cpu")).id


def history_key(summary: Mapping[str, Any], size: str | None = None) -> str:
    """The history's fingerprint of a run: the numerics fingerprint its golden check used (or
    this machine's) and the model size, as the golden traces are keyed: ``<fingerprint>/<size>``."""
    found = fingerprint_of(summary) or machine_fingerprint(summary.get("device"))
    return f"{found}/{size or summary.get('model_size') or 'unknown'}"


def record(
    path: Path,
    summary: Mapping[str, Any] | None,
    *,
    source: str,
    report: Path | None = None,
    bench: Mapping[str, Any] | None = None,
) -> int:
    """Append one run (its summary, and a bench's variants) to the history at ``path``
    (created if missing); the new run's id."""
    if summary is not None:
        entry = run_record(
            summary, fingerprint=history_key(summary), source=source, report=report, bench=bench
        )
    elif bench is not None:
        key = history_key({"device": bench.get("device"), "cases": []}, "bench")
        entry = bench_only_record(bench, fingerprint=key, report=report)
    else:
        raise ValueError("nothing to record: no summary and no bench")
    conn = db.open_history(path, create=True)
    try:
        return db.append(conn, entry)
    finally:
        conn.close()


def check_history(path: Path, *, create: bool, dry: bool = False) -> None:
    """Open (and create, migrate) the history once, before a run: a ``HistoryError`` with one
    line where it cannot be used. ``dry``: a missing file is not created (its folder must
    exist), an existing one is read as it is."""
    path = Path(path)
    if dry and not path.exists():
        if not path.parent.is_dir():
            raise db.HistoryError(f"--history {path}: its folder {path.parent} does not exist")
        return
    db.open_history(path, create=create).close()


def compare(
    path: Path,
    *,
    last: int = trends.DEFAULT_LAST,
    streak: int = trends.DEFAULT_STREAK,
    fingerprint: str | None = None,
    html: Path | None = None,
    run: int | None = None,
) -> trends.Trend:
    """The newest run of ``fingerprint`` (default: the newest run's; ``run``: that run) against
    its last runs; with ``html``, the trend page written there."""
    conn = db.open_history(path, create=False)
    try:
        history = trends.load(conn, fingerprint, upto=run)
    finally:
        conn.close()
    found = trends.analyse(history, last=last, streak=streak)
    if html is not None:
        from harness.reporting.trend_page import write_trend_page
        from harness.run.settings import resolve_plots

        print(f"trend page: {write_trend_page(found, html, plots=resolve_plots())}")
    return found


def add_trend_arguments(parser: argparse.ArgumentParser) -> None:
    """``--last``, ``--streak``, ``--trend`` (shared with ``scripts/nightly``)."""
    parser.add_argument(
        "--last",
        type=_positive,
        default=trends.DEFAULT_LAST,
        help="compare with this many earlier runs of the fingerprint "
        f"(default {trends.DEFAULT_LAST})",
    )
    parser.add_argument(
        "--streak",
        type=_positive,
        default=trends.DEFAULT_STREAK,
        help="a check failing now after passing on this many runs is a regression "
        f"(default {trends.DEFAULT_STREAK})",
    )
    parser.add_argument(
        "--trend",
        choices=("fail", "warn"),
        default="fail",
        help="fail (default): a flag is exit status 1; warn: print it, exit 0",
    )


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:
        raise ValueError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--history", type=Path, required=True, help="the SQLite history file")
    add_trend_arguments(parser)
    parser.add_argument("--fingerprint", help="compare this fingerprint's newest run instead")
    parser.add_argument(
        "--run", type=_positive, help="compare this run (its id) with the runs before it"
    )
    parser.add_argument("--html", type=Path, help="write the trend page (trend.html) here")
    parser.add_argument("--record", type=Path, help="append this summary.json (or report folder)")
    parser.add_argument("--bench", type=Path, help="append this bench.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        if args.html is not None and args.html.exists() and not args.html.is_dir():
            raise ValueError(f"--html {args.html}: not a folder (a file is in the way)")
        summary = read_json(args.record, "summary") if args.record else None
        bench = read_json(args.bench, "bench") if args.bench else None
        if summary is not None or bench is not None:
            check_history(args.history, create=True)
            folder = args.record if args.record and args.record.is_dir() else None
            run_id = record(args.history, summary, source="record", report=folder, bench=bench)
            print(f"history: recorded run #{run_id} in {args.history}")
        else:
            check_history(args.history, create=False)
        found = compare(
            args.history,
            last=args.last,
            streak=args.streak,
            fingerprint=args.fingerprint,
            html=args.html,
            run=args.run,
        )
    except ValueError as exc:  # HistoryError included
        print(f"{PROG}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(trends.render_text(found))
    if found.flags and args.trend == "fail":
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
