"""The ``mcore`` family under two megatron-core installs, side by side.

    scripts/mcore_versions run PREFIX_A PREFIX_B [-- ARGS...]
    scripts/mcore_versions table SUMMARY_A SUMMARY_B

``run`` runs ``offload-harness run --models mcore ARGS`` (default ``--device cuda``) once with
each prefix first on ``PYTHONPATH`` (a folder megatron-core was installed into with
``pip install --target``, e.g. by ``scripts/mcore_main --install``), each into its own report
folder under ``--out`` (default ``reports/mcore-versions``), then prints the table of the two
``summary.json`` files. ``table`` prints the table of two existing ``summary.json`` files.

The table has one row per case and one column per install, headed by the megatron-core
version and commit each summary recorded (``summary.json``'s ``megatron_core``); a ``*`` marks
a row whose verdicts differ, and every such row's reasons (a skip's reason, a failure's first
problem) follow the table. Exit status: 0 when every row has the same verdict under both, 1
when any differs, 2 for bad arguments.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

MISSING = "-"
"""The cell of a case one summary does not have."""


def column_label(summary: dict[str, Any], fallback: str) -> str:
    """``<version> (<commit>)`` of the megatron-core a summary ran, ``<version>`` without a
    known commit, ``fallback`` when the summary recorded none."""
    found = summary.get("megatron_core") or {}
    version = found.get("version") or fallback
    commit = found.get("commit") or ""
    return f"{version} ({commit[:10]})" if commit else version


def _verdicts(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {case["name"]: case for case in summary.get("cases", [])}


def _reason(case: dict[str, Any] | None) -> str:
    """Why a case had its verdict: a skip's reason, a failure's first problem."""
    if case is None:
        return "not run"
    if case.get("verdict") == "skip":
        skipped = [c for c in case.get("checks", {}).values() if c.get("status") == "skip"]
        return next((c.get("reason", "") for c in skipped if c.get("reason")), "skipped")
    problems = case.get("problems") or []
    return problems[0] if problems else str(case.get("verdict", "?"))


def rows(first: dict[str, Any], second: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(case, verdict under the first, verdict under the second) for every case of either
    summary: the first's order, then the second's cases the first lacks."""
    a, b = _verdicts(first), _verdicts(second)
    names = list(a) + [name for name in b if name not in a]
    return [
        (name, a.get(name, {}).get("verdict", MISSING), b.get(name, {}).get("verdict", MISSING))
        for name in names
    ]


def table(first: dict[str, Any], second: dict[str, Any]) -> tuple[str, bool]:
    """The side-by-side text and whether any verdict differs."""
    labels = (column_label(first, "first"), column_label(second, "second"))
    found = rows(first, second)
    width = max([len("case"), *(len(name) for name, _, _ in found)])
    widths = [max(len(labels[i]), *(len(r[i + 1]) for r in found), 7) for i in (0, 1)]
    lines = [
        f"{'case':<{width}} | {labels[0]:<{widths[0]}} | {labels[1]:<{widths[1]}}",
        f"{'-' * width}-+-{'-' * widths[0]}-+-{'-' * widths[1]}",
    ]
    differing = [r for r in found if r[1] != r[2]]
    for name, one, two in found:
        mark = " *" if one != two else ""
        lines.append(f"{name:<{width}} | {one:<{widths[0]}} | {two:<{widths[1]}}{mark}")
    same = len(found) - len(differing)
    lines.append(f"{len(found)} cases: {same} with the same verdict, {len(differing)} differ")
    a, b = _verdicts(first), _verdicts(second)
    for name, one, two in differing:
        lines.append(f"* {name}")
        lines.append(f"    {labels[0]}: {one}: {_reason(a.get(name))}")
        lines.append(f"    {labels[1]}: {two}: {_reason(b.get(name))}")
    return "\n".join(lines), bool(differing)


def _load(path: str) -> dict[str, Any]:
    return json.loads(Path(path).read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def _run_one(prefix: str, report_dir: Path, args: list[str]) -> Path:
    """One ``offload-harness run --models mcore`` with ``prefix`` first on PYTHONPATH; the
    ``summary.json`` it wrote."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (prefix, str(Path.cwd()), env.get("PYTHONPATH", "")) if p
    )
    command = [sys.executable, "-m", "harness", "run", "--models", "mcore"]
    command += [*args, "--report-dir", str(report_dir)]
    print("$", f"PYTHONPATH={prefix}:...", " ".join(command[1:]), flush=True)
    subprocess.run(command, env=env, check=False)
    summaries = sorted(report_dir.glob("*/summary.json"), key=lambda p: p.stat().st_mtime)
    if not summaries:
        raise SystemExit(f"no summary.json under {report_dir}: the run under {prefix} wrote none")
    return summaries[-1]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) >= 3 and args[0] == "table" and len(args) == 3:
        text, differs = table(_load(args[1]), _load(args[2]))
        print(text)
        return 1 if differs else 0
    if len(args) >= 3 and args[0] == "run" and (len(args) == 3 or args[3] == "--"):
        out = Path(os.environ.get("MCORE_VERSIONS_OUT", "reports/mcore-versions"))
        extra = args[4:] or ["--device", "cuda"]
        summaries = [
            _run_one(prefix, out / f"install-{index}", extra)
            for index, prefix in enumerate(args[1:3], start=1)
        ]
        text, differs = table(_load(str(summaries[0])), _load(str(summaries[1])))
        print(text)
        (out / "table.txt").write_text(text + "\n", encoding="utf-8")
        return 1 if differs else 0
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2
