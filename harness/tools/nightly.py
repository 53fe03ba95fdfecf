"""Nightly gate: run the case matrix on this machine, write the report, judge it.

    scripts/nightly                        # --matrix full on every visible GPU (CPU without one)
    scripts/nightly --matrix default       # the small matrix (CPU CI check of the gate itself)
    scripts/nightly --report-dir /ci/out -- -x    # arguments after -- go to pytest

With GPUs (``torch.cuda.device_count()`` > 0) it runs
``torchrun --standalone --nproc-per-node=<GPUs> -m pytest cases/ --matrix <m> --device cuda``;
without, ``python -m pytest cases/ --matrix <m> --device cpu -n <cores>``. The session writes
``<report dir>/<name>/`` (summary.json, junit.xml, index.html, plots), the name chosen here
(``<UTC time>_<sha>[_dirty]``) and passed as ``--report-name``. Then it reads summary.json and
exits non-zero on any of:

* the pytest session failed (any failed test, usage error, internal error) or wrote no summary;
* zero tests collected;
* fewer cases run than the case table lists for this machine (rows whose ``min_ranks`` fit the
  number of ranks); the missing ids are printed;
* a golden baseline trace mismatch or malformed golden file;
* a case with no golden trace for this machine's numerics fingerprint: a gate runs on a fixed
  machine, so a missing trace means the gate would check nothing there (``--allow-missing-golden``
  turns this off). To seed a new machine: ``scripts/nightly --allow-missing-golden --
  --update-golden`` once, review and commit ``cases/golden/<fingerprint>/``.

With ``--history PATH`` the night is appended to that SQLite history (created if missing;
``--bench FILE`` adds a ``bench.json``'s variants to it) and compared with the last ``--last``
nights of its fingerprint (``offload-harness trend``): a flagged regression is red too, unless
``--trend warn``; the trend page is written into the report folder (``trend.html``).

Exit codes: 0 green, 1 red, 2 bad usage (an unusable history included, before anything runs).
The last line printed is the report folder.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from harness.cases import Case, matrix
from harness.reporting.html import render_index
from harness.reporting.report import folder_name, given_commit
from harness.run import settings
from harness.tools import trend as trend_tool

REPO = Path(__file__).resolve().parents[2]
"""The checkout whose ``cases/`` the gate runs."""


def expected_cases(rows: list[Case], ranks: int) -> list[str]:
    """Case ids this machine must run: rows whose ``min_ranks`` fit ``ranks``."""
    return [c.name for c in rows if getattr(c, "min_ranks", 1) <= ranks]


def gate(
    summary: dict[str, Any] | None,
    expected: list[str],
    exit_status: int,
    *,
    require_golden: bool = True,
) -> list[str]:
    """Why the night is red (empty: green)."""
    if summary is None:
        return [f"no summary.json was written (pytest exit status {exit_status})"]
    reasons = []
    tests = summary.get("tests", {})
    if exit_status != 0:
        reasons.append(f"pytest exit status {exit_status}")
    if not tests.get("collected"):
        reasons.append("zero tests collected")
    if tests.get("failed"):
        reasons.append(f"{tests['failed']} tests failed: " + ", ".join(summary["failed_tests"]))
    cases = {c["name"]: c for c in summary.get("cases", [])}
    ran = {name for name, c in cases.items() if c.get("verdict") in ("pass", "fail", "inert")}
    missing = [name for name in expected if name not in ran]
    if missing:
        reasons.append(
            f"{len(expected) - len(missing)} of the {len(expected)} cases the table lists for "
            f"this machine ran; missing: {', '.join(missing)}"
        )
    failed = [name for name, c in cases.items() if c.get("verdict") == "fail"]
    if failed:
        reasons.append(f"{len(failed)} cases failed: {', '.join(failed)}")
    golden = {name: c.get("golden", {}).get("status") for name, c in cases.items()}
    drifted = [name for name, status in golden.items() if status in ("mismatch", "malformed")]
    if drifted:
        reasons.append(f"golden baseline trace mismatch: {', '.join(drifted)}")
    absent = [name for name in expected if golden.get(name) in (None, "missing")]
    if require_golden and absent:
        fingerprints = sorted(
            {c.get("golden", {}).get("fingerprint", "") for c in cases.values()} - {""}
        )
        where = f" (fingerprint {', '.join(fingerprints)})" if fingerprints else ""
        reasons.append(
            f"no golden baseline trace for this machine{where}: {', '.join(absent)}; seed it "
            f"with `scripts/nightly --allow-missing-golden -- --update-golden` and commit "
            f"cases/golden/"
        )
    return reasons


def command(args: argparse.Namespace, gpus: int, name: str) -> list[str]:
    """The pytest (or torchrun) command line of this machine."""
    pytest_args = ["cases/", "--matrix", args.matrix, "--backend", args.backend]
    pytest_args += ["--report-dir", str(args.report_dir), "--report-name", name]
    pytest_args += ["-p", "no:cacheprovider", "-q", *args.pytest_args]
    if gpus:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        launcher += [f"--nproc-per-node={gpus}", "-m", "pytest"]
        return [*launcher, *pytest_args, "--device", "cuda"]
    jobs = args.jobs or settings.usable_cores()
    return [sys.executable, "-m", "pytest", *pytest_args, "--device", "cpu", "-n", str(jobs)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="offload-harness nightly", description=__doc__.split("\n")[0]
    )
    settings.add_arguments(
        parser,
        ("matrix", "backend", "report_dir", "jobs"),
        matrix="full",
        report_dir=str(REPO / "reports"),
    )
    parser.add_argument(
        "--allow-missing-golden",
        action="store_true",
        help="a case with no golden trace for this machine's fingerprint is not red "
        "(for seeding a new machine)",
    )
    parser.add_argument(
        "--history",
        type=Path,
        help="append the night to this SQLite history and compare it with the earlier nights",
    )
    parser.add_argument("--bench", type=Path, help="with --history: record this bench.json too")
    trend_tool.add_trend_arguments(parser)
    parser.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    parser.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments")
    args = parser.parse_args(argv)
    try:
        resolved = settings.resolve(
            {"matrix": args.matrix, "backend": args.backend, "device": "cpu", "jobs": args.jobs}
        )
        if settings.resolve_report_dir(args.report_dir) is None:
            raise settings.SettingError("--report-dir: the gate reads the report; name a folder")
        given_commit()  # the folder name below reads it
        bench = _history_inputs(args)
    except ValueError as exc:  # a SettingError, or a malformed OFFLOAD_HARNESS_COMMIT
        print(f"offload-harness nightly: error: {exc}", file=sys.stderr)
        return 2
    args.backend, args.jobs = resolved.backend.spelling, resolved.jobs
    gpus = torch.cuda.device_count()
    ranks = max(gpus, 1)
    name = folder_name()
    argv_run = command(args, gpus, name)
    print("+ " + " ".join(argv_run), flush=True)
    if args.dry_run:
        return 0
    status = subprocess.run(argv_run, cwd=REPO, check=False).returncode
    folder = (REPO / args.report_dir / name).resolve()
    path = folder / "summary.json"
    summary = json.loads(path.read_text()) if path.is_file() else None
    expected = expected_cases(matrix(args.matrix), ranks)
    reasons = gate(summary, expected, status, require_golden=not args.allow_missing_golden)
    if args.history is not None and summary is not None:
        reasons += _trend(args, summary, folder, bench)
    where = f"{'GPUs: ' + str(gpus) if gpus else 'CPU'}, matrix {args.matrix}"
    print()
    if reasons:
        print(f"nightly: RED ({where})")
        print("\n".join(f"  - {r}" for r in reasons))
    else:
        cases = len(summary["cases"]) if summary else 0
        print(f"nightly: green ({where}): {cases} cases, every expected case ran and passed")
    print(f"report: {folder}")
    return 1 if reasons else 0


def _history_inputs(args: argparse.Namespace) -> dict[str, Any] | None:
    """``--history`` usable (created, migrated) and ``--bench`` read, before anything runs."""
    if args.history is None:
        if args.bench is not None:
            raise settings.SettingError("--bench is recorded into --history: name one")
        return None
    trend_tool.check_history(args.history, create=True, dry=args.dry_run)
    return trend_tool.read_json(args.bench, "bench") if args.bench is not None else None


def _trend(
    args: argparse.Namespace, summary: dict[str, Any], folder: Path, bench: dict[str, Any] | None
) -> list[str]:
    """Record the night and compare it with the earlier ones; why that makes it red (empty:
    it does not, or ``--trend warn``)."""
    print()
    if summary.get("status", "complete") != "complete":
        print(f"history: night not recorded (status {summary.get('status')})")
        return []
    try:
        run_id = trend_tool.record(
            args.history, summary, source="nightly", report=folder, bench=bench
        )
        print(f"history: recorded run #{run_id} in {args.history}")
        found = trend_tool.compare(args.history, last=args.last, streak=args.streak, html=folder)
    except (ValueError, OSError, sqlite3.Error) as exc:
        return [f"history: {' '.join(str(exc).split())}"]
    print(trend_tool.trends.render_text(found))
    try:
        render_index(folder)  # index.html links the trend page now
    except (OSError, ValueError) as exc:
        print(f"nightly: index.html not re-rendered: {exc}")
    if found.flags and args.trend == "fail":
        return [f"trend: {len(found.flags)} flag(s) (see above; --trend warn reports only)"]
    return []


if __name__ == "__main__":
    sys.exit(main())
