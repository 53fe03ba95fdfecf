"""How long the ways to a verdict take on this machine, against their budgets, in units of a fixed
yardstick run in the same job, so a figure means the same on a slow and a fast machine:

    offload-harness time-budget                          # yardstick, then suite, unit, run
    offload-harness time-budget --figures run,unit       # some of them
    offload-harness time-budget --given suite=112.4      # a figure the job already timed
    offload-harness time-budget pairs OLD NEW --figures run --pairs 3

The budgets (issue 57) hold on the 2-core CPU machine: the README's test command's pytest 120 s,
``pytest tests/unit -n 2`` 60 s, ``offload-harness run`` (default matrix) 15 s. The yardstick is
a fixed single-thread workload (torch matmuls and a pure-Python loop, the two things the suite
spends its time in), the best of three; a figure's budget on another machine is the budget times
that machine's yardstick over the reference machine's (``YARDSTICK_REFERENCE_S``). Over budget is
a loud ``WARNING`` line, never an exit status: timings vary with the machine's load, so CI prints
them and fails on tests alone. A timed command that fails is named and its time not judged.

``pairs`` runs a figure's command in two checkouts (commits become ``git worktree``\\ s under the
temporary folder; a path is taken as it is) alternately, OLD then NEW, N times, and prints each
side's median with its spread (min-max) and the ratio of the medians: the same machine, the same
load on both sides as far as alternation can make it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

YARDSTICK_REFERENCE_S = 0.61
"""The yardstick's best-of-three on the 2-core CPU machine the budgets hold on (AMD EPYC with
AVX-512, fingerprint ``cpu-avx512-8a073967``, quiet: 0.610-0.622 s on 2026-12-06;
docs/measurements.md)."""


@dataclass(frozen=True)
class Figure:
    """One way to a verdict: its command (run in the checkout) and its budget in seconds."""

    name: str
    command: tuple[str, ...]
    budget_s: float
    what: str


FIGURES = {
    f.name: f
    for f in (
        Figure(
            "suite",
            (),  # read from README.md (readme_pytest)
            120.0,
            "the README's test command's pytest",
        ),
        Figure(
            "unit",
            (
                sys.executable,
                "-m",
                "pytest",
                "tests/unit",
                "-n",
                "2",
                "-q",
                "-p",
                "no:cacheprovider",
            ),
            60.0,
            "pytest tests/unit -n 2",
        ),
        Figure(
            "run",
            (sys.executable, "-m", "harness", "run"),
            15.0,
            "offload-harness run (default matrix)",
        ),
    )
}


def yardstick() -> float:
    """Seconds of the fixed workload, the best of three runs in a fresh interpreter each (the
    interpreter's start and torch's import are not in it)."""
    code = (
        "import time, torch\n"
        "torch.manual_seed(0); torch.set_num_threads(1)\n"
        "a = torch.randn(192, 192); b = torch.randn(192, 192)\n"
        "t = time.perf_counter()\n"
        "for _ in range(1200): a = torch.tanh(a @ b)\n"
        "s = 0\n"
        "for i in range(4_500_000): s += i % 7\n"
        "print(time.perf_counter() - t)\n"
    )
    runs = []
    for _ in range(3):
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
        runs.append(float(out.strip()))
    return min(runs)


def timed(command: Sequence[str], cwd: Path, env: dict[str, str], log: Path) -> tuple[float, int]:
    """(wall seconds, exit status) of ``command`` in ``cwd``, its output in ``log``."""
    start = time.perf_counter()
    with log.open("w") as out:
        rc = subprocess.run(
            command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT
        ).returncode
    return time.perf_counter() - start, rc


def _env(checkout: Path) -> dict[str, str]:
    """The checkout's code first on the path; everything else as the user has it (``run``
    renders its plots, as it does for a user)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(checkout), str(checkout / "tests" / "helpers")])
    return env


def readme_pytest(checkout: Path) -> list[str]:
    """The pytest part of the README's test command in ``checkout`` (the line after the
    ``test-command`` marker, after its install step), as ``.ci/run`` reads it."""
    lines = (checkout / "README.md").read_text().splitlines()
    marker = next(i for i, line in enumerate(lines) if "<!-- test-command -->" in line)
    command = lines[marker + 2].split("&&")[-1].split()
    if command[:3] != ["python3", "-m", "pytest"]:
        raise ValueError(f"README's test command is not a pytest command: {lines[marker + 2]!r}")
    return [sys.executable, *command[1:], "-q", "-p", "no:cacheprovider"]


def _command(figure: Figure, report_dir: Path, checkout: Path = REPO) -> list[str]:
    base = readme_pytest(checkout) if figure.name == "suite" else list(figure.command)
    return [*base, "--report-dir", str(report_dir)]


def judge(name: str, seconds: float, rc: int, scale: float) -> str:
    """One line: the figure, its budget on this machine, the ratio, OK or WARNING."""
    figure = FIGURES[name]
    budget = figure.budget_s * scale
    if rc != 0:
        return f"WARNING {name:<5} {seconds:7.1f} s  exit {rc}: the command failed, time not judged"
    ratio = seconds / budget
    verdict = "OK     " if ratio <= 1.0 else "WARNING"
    return (
        f"{verdict} {name:<5} {seconds:7.1f} s  budget {budget:6.1f} s "
        f"({figure.budget_s:.0f} s x {scale:.2f} machine)  {ratio:4.2f} of budget  "
        f"({figure.what})"
    )


def budget_main(args: argparse.Namespace) -> int:
    given = dict(_given(item) for item in args.given)
    stick = yardstick()
    scale = stick / YARDSTICK_REFERENCE_S
    print(
        f"yardstick {stick:.3f} s (reference machine {YARDSTICK_REFERENCE_S:.3f} s): x{scale:.2f}"
    )
    logs = Path(tempfile.mkdtemp(prefix="time-budget-"))
    for name in [*args.figures, *(g for g in given if g not in args.figures)]:
        if name in given:
            print(judge(name, given[name], 0, scale))
            continue
        report_dir = logs / f"{name}-reports"
        seconds, rc = timed(
            _command(FIGURES[name], report_dir), REPO, _env(REPO), logs / f"{name}.log"
        )
        print(judge(name, seconds, rc, scale), flush=True)
    print(f"logs: {logs}")
    return 0


def _given(item: str) -> tuple[str, float]:
    name, _, value = item.partition("=")
    if name not in FIGURES:
        raise SystemExit(
            f"time-budget: --given {item!r}: no figure {name!r} ({', '.join(FIGURES)})"
        )
    try:
        return name, float(value)
    except ValueError:
        raise SystemExit(f"time-budget: --given {item!r}: seconds must be a number") from None


def _checkout(spec: str, into: Path) -> Path:
    """A path as it is; a commit as a detached worktree under ``into``."""
    path = Path(spec)
    if path.is_dir():
        return path.resolve()
    target = into / spec.replace("/", "_")
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "-f", "--detach", str(target), spec],
        check=True,
        capture_output=True,
    )
    return target


def spread(values: Sequence[float]) -> str:
    """``median (min-max)`` in seconds."""
    return f"{statistics.median(values):6.1f} s ({min(values):.1f}-{max(values):.1f})"


def pairs_main(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="time-pairs-"))
    sides = {"old": _checkout(args.old, tmp), "new": _checkout(args.new, tmp)}
    try:
        for name in args.figures:
            figure = FIGURES[name]
            seconds: dict[str, list[float]] = {"old": [], "new": []}
            for i in range(args.pairs):
                for side, checkout in sides.items():
                    report_dir = tmp / f"{name}-{side}-{i}"
                    took, rc = timed(
                        _command(figure, report_dir, checkout),
                        checkout,
                        _env(checkout),
                        tmp / f"{name}-{side}-{i}.log",
                    )
                    seconds[side].append(took)
                    tail = (tmp / f"{name}-{side}-{i}.log").read_text().strip().splitlines()[-1:]
                    last = tail[0] if tail else ""
                    print(f"  {name} {side} #{i + 1}: {took:.1f} s exit {rc} {last}", flush=True)
            old, new = (statistics.median(seconds[s]) for s in ("old", "new"))
            print(
                f"{name}: old {args.old} {spread(seconds['old'])}, new {args.new} "
                f"{spread(seconds['new'])}: new/old {new / old:.2f}",
                flush=True,
            )
    finally:
        for checkout in sides.values():
            if checkout.is_relative_to(tmp):
                subprocess.run(
                    ["git", "-C", str(REPO), "worktree", "remove", "--force", str(checkout)],
                    capture_output=True,
                )
        print(f"logs: {tmp}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="offload-harness time-budget", description=__doc__)
    parser.add_argument(
        "--figures",
        type=lambda s: s.split(","),
        default=list(FIGURES),
        help=f"comma-separated, of {', '.join(FIGURES)} (default: all)",
    )
    parser.add_argument("--given", action="append", default=[], metavar="NAME=SECONDS")
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("pairs", help="one figure in two checkouts, alternately")
    p.add_argument("old", help="a commit or a checkout's path")
    p.add_argument("new", help="a commit or a checkout's path")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--figures", type=lambda s: s.split(","), default=["run"])
    args = parser.parse_args(argv)
    unknown = [f for f in args.figures if f not in FIGURES]
    if unknown:
        print(f"time-budget: no figure {unknown[0]!r} ({', '.join(FIGURES)})", file=sys.stderr)
        return 2
    if args.command == "pairs":
        if shutil.which("git") is None:
            print("time-budget pairs: needs git", file=sys.stderr)
            return 2
        return pairs_main(args)
    return budget_main(args)


if __name__ == "__main__":
    sys.exit(main())
