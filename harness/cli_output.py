"""``offload-harness run``'s output while and after the cases run: the console's progress
lines, a valid summary.json after every case, the final report (summary.json, junit.xml,
index.html) and the closing verdict lines.

A report folder that cannot be written is one line on stderr, and the run goes on with the
verdicts on the console only (``ReportWriter``; the exit code is then ``REPORT_INCOMPLETE``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.cases import Case
from harness.execute.environment import Environment
from harness.reporting.html import render_index
from harness.reporting.report import (
    inert_reason,
    is_failure,
    skip_reason,
    verdict_table,
    write_junit,
    write_summary,
)
from harness.run import budget
from harness.run.parallel import threads_per_worker


class ReportWriter:
    """Writes into the run's report folder; the first write that fails is one line on stderr,
    no traceback, and no later write is tried: the run goes on, the console keeps every
    verdict, and the exit code says the report is incomplete (``REPORT_INCOMPLETE``)."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self.failed = False

    def write(self, what: str, write: Callable[[], Any]) -> Any:
        """``write()``'s result, or None when there is no folder or a write failed."""
        if self.folder is None or self.failed:
            return None
        try:
            return write()
        except OSError as exc:
            self.failed = True
            why = exc.strerror or str(exc)
            print(
                f"offload-harness: report incomplete: cannot write {what} in {self.folder}: "
                f"{why}; the verdicts go on on the console only",
                file=sys.stderr,
                flush=True,
            )
            return None


class Progress:
    """The console lines and the running summary.json while the cases run: one line per
    finished case (and the rule it was held to, once), a valid summary after every case."""

    def __init__(
        self,
        cases: list[Case],
        env: Environment,
        report: ReportWriter,
        fields: dict[str, Any],
        memory: budget.Plan | None = None,
    ) -> None:
        self.cases, self.env, self.report, self.fields = cases, env, report, fields
        self.memory = memory
        self.records: list[dict[str, Any] | None] = [None] * len(cases)
        self.start = time.perf_counter()

    def finished(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r is not None]

    def on_record(self, index: int, record: dict[str, Any], seconds: float) -> None:
        record["duration"] = round(seconds, 3)
        self.records[index] = record
        done = len(self.finished())
        name = self.cases[index].name
        print(f"[{done}/{len(self.cases)}] {name} {record['verdict']} ({seconds:.1f}s)")
        rule = record.get("rule", {})
        if rule.get("source") == "observed":  # once per case: what it was held to
            print(f"  {rule['line']}")
        sys.stdout.flush()
        folder = self.report.folder
        if folder is not None:  # a valid summary.json after every case
            seconds_so_far = round(time.perf_counter() - self.start, 2)
            self.report.write(
                "summary.json",
                lambda: write_summary(
                    folder, self.finished(), status="running", seconds=seconds_so_far, **self.fields
                ),
            )

    def on_start(self, workers: int) -> None:
        threads = threads_per_worker(workers)
        shared = f", {self.memory.describe()}" if self.memory is not None else ""
        print(
            f"running {len(self.cases)} case(s) on {self.env.device} ({self.env.model_size} "
            f"models): {workers} worker(s) x {threads} thread(s){shared}",
            flush=True,
        )


def print_outcome(summary: dict[str, Any], total: int, where: str) -> int:
    """The verdict table, each failure's problems, the golden, note and skip lines and the
    closing count; the number of failed cases."""
    print()
    print(verdict_table(summary))
    for case in summary["cases"]:
        if case["problems"]:
            print(f"\nFAIL {case['name']}")
            print("\n".join(case["problems"]))
    missing = [c for c in summary["cases"] if c.get("golden", {}).get("status") == "missing"]
    if missing:
        print(
            f"\ngolden: {len(missing)} of {total} cases not compared - "
            f"{missing[0]['golden']['message']}"
        )
    for case in summary["cases"]:
        for line in case.get("notes", ()):
            print(f"\nNOTE {case['name']}: {line}")
    failed = sum(map(is_failure, summary["cases"]))
    skipped = [c for c in summary["cases"] if c["verdict"] == "skip"]
    for case in skipped:
        print(f"\nSKIP {case['name']}: {skip_reason(case)}")
    inert = [c for c in summary["cases"] if c["verdict"] == "inert"]
    for case in inert:
        print(f"\nINERT {case['name']}: {inert_reason(case)}")
    passed = total - failed - len(skipped) - len(inert)
    also = f", {len(skipped)} skipped" if skipped else ""
    also += f", {len(inert)} inert (configured to move nothing)" if inert else ""
    print(f"\n{passed}/{total} cases passed{also} in {summary['seconds']:.1f}s; {where}")
    return failed


def write_report(
    report: ReportWriter,
    summary: dict[str, Any],
    fields: dict[str, Any],
    records: list[dict[str, Any]],
    *,
    stopped: bool,
) -> str:
    """Write the final summary.json, junit.xml and (unless a signal stopped the run, which
    leaves at once) index.html; the console's line saying where the report is."""
    folder = report.folder
    if folder is None:  # '' writes none, as in pytest
        return "no report (--report-dir '')"
    report.write("summary.json", lambda: write_summary(folder, records, **fields))
    report.write("junit.xml", lambda: write_junit(folder, summary))
    if report.failed:
        return f"report incomplete: {folder} (see the line above)"
    if stopped:  # the summary is valid, plots can wait
        return f"report: {folder / 'summary.json'} ({fields['status']}; no index.html)"
    began = time.perf_counter()
    index = report.write("index.html", lambda: render_index(folder))
    if index is None:
        return f"report incomplete: {folder} (see the line above)"
    return f"report: {index} (rendered in {time.perf_counter() - began:.1f}s)"
