"""A run's rows for the history (``harness.reporting.history``), read from the ``summary.json``
it wrote (``offload-harness run``'s or a pytest session's) and, where the bench ran, its
``bench.json``. Pure: reads dicts, imports nothing of the stack.

What each case gives, where its summary has it:

* ``cases``: ``verdict``; ``seconds`` (the case's own runs, ``seconds``; a pytest entry without
  it, its tests' ``duration``); ``offload_seconds`` and ``plain_seconds`` from ``run_seconds``
  (``plain`` only where this case trained the plain baseline: a shared one is near 0), and
  ``overhead``, their ratio;
* ``checks``: every check's status;
* ``memory``: the memory check's readings (CUDA);
* ``transfers``: the final step's copies and bytes each way;
* ``host``: the largest of ``leaks.host_held_bytes`` over the steps and the last step's (the
  harness's records of the host copies still alive at a step's end: the CPU stand-in for the
  pinned host footprint).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from harness.reporting.history import RunRecord


def fingerprint_of(summary: Mapping[str, Any]) -> str | None:
    """The numerics fingerprint the summary's golden check used (its cases agree on it), or
    None where no case recorded one."""
    found = {
        str(case.get("golden", {}).get("fingerprint"))
        for case in summary.get("cases", [])
        if isinstance(case.get("golden"), dict) and case["golden"].get("fingerprint")
    }
    if len(found) > 1:
        raise ValueError(f"the summary's cases name several fingerprints: {sorted(found)}")
    return found.pop() if found else None


def run_record(
    summary: Mapping[str, Any],
    *,
    fingerprint: str,
    source: str,
    report: Path | str | None = None,
    bench: Mapping[str, Any] | None = None,
) -> RunRecord:
    """The history's record of one run: its ``runs`` row and every figure table's rows."""
    commit = summary.get("commit") or {}
    dirty = commit.get("dirty")
    run = {
        "created_utc": summary.get("created_utc"),
        "commit_sha": commit.get("sha")
        or (f"v{commit['version']}" if commit.get("version") else None),
        "dirty": None if dirty is None else int(bool(dirty)),
        "fingerprint": fingerprint,
        "device": summary.get("device"),
        "model_size": summary.get("model_size"),
        "matrix": summary.get("matrix"),
        "backend": summary.get("backend"),
        "status": summary.get("status", "complete"),
        "seconds": summary.get("seconds"),
        "source": source,
        "report": None if report is None else str(report),
    }
    tables: dict[str, list[dict[str, Any]]] = {
        "cases": [],
        "checks": [],
        "memory": [],
        "transfers": [],
        "host": [],
    }
    for case in summary.get("cases", []):
        name = str(case["name"])
        tables["cases"].append({"case_name": name, **case_figures(case)})
        tables["checks"] += [
            {"case_name": name, "check_name": check, "status": status}
            for check, status in check_statuses(case).items()
        ]
        for table, read in (
            ("memory", memory_row),
            ("transfers", transfer_row),
            ("host", host_row),
        ):
            row = read(case)
            if row is not None:
                tables[table].append({"case_name": name, **row})
    if bench is not None:
        tables["bench"] = bench_rows(bench)
    return RunRecord(run=run, rows=tables)


def bench_only_record(
    bench: Mapping[str, Any], *, fingerprint: str, report: Path | str | None = None
) -> RunRecord:
    """The record of a bench run recorded alone: the run's facts from ``bench.json``."""
    summary = {
        "created_utc": bench.get("created_utc"),
        "commit": bench.get("commit") or {},
        "device": bench.get("device"),
        "status": "complete",
        "backend": "bench",
    }
    return run_record(summary, fingerprint=fingerprint, source="bench", report=report, bench=bench)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def case_figures(case: Mapping[str, Any]) -> dict[str, Any]:
    """``cases``' columns of one case entry."""
    seconds = _number(case.get("seconds"))
    if seconds is None:
        seconds = _number(case.get("duration"))
    run_seconds = case.get("run_seconds") or {}
    offload = _number(run_seconds.get("offload"))
    plain = _number(run_seconds.get("plain"))
    made_by = (case.get("plain_baseline") or {}).get("made_by")
    if made_by is not None and made_by != case.get("name"):
        plain = None  # another row trained it: this case's plain time is near 0
    overhead = offload / plain if offload is not None and plain else None
    return {
        "verdict": case.get("verdict"),
        "seconds": seconds,
        "offload_seconds": offload,
        "plain_seconds": plain,
        "overhead": overhead,
    }


def check_statuses(case: Mapping[str, Any]) -> dict[str, str]:
    """Every check's status (``pass``, ``fail``, ``skip``, ``n-a``, ``updated``...)."""
    checks = case.get("checks") or {}
    return {
        str(name): str(record.get("status"))
        for name, record in checks.items()
        if isinstance(record, Mapping) and record.get("status") is not None
    }


def memory_row(case: Mapping[str, Any]) -> dict[str, Any] | None:
    """The memory check's readings (None where it did not read any: CPU)."""
    memory = case.get("memory")
    if not isinstance(memory, Mapping):
        return None
    backward = memory.get("backward") if isinstance(memory.get("backward"), Mapping) else {}
    row = {
        "baseline_after_forward": memory.get("baseline_allocated_after_forward"),
        "offload_after_forward": memory.get("offload_allocated_after_forward"),
        "baseline_peak": memory.get("baseline_peak"),
        "offload_peak": memory.get("offload_peak"),
        "baseline_backward_peak": backward.get("baseline_peak"),
        "offload_backward_peak": backward.get("offload_peak"),
        "predicted_drop": memory.get("predicted_drop"),
    }
    return row if any(v is not None for v in row.values()) else None


def transfer_row(case: Mapping[str, Any]) -> dict[str, Any] | None:
    """The final step's copies and bytes each way (None where the case has none)."""
    transfers = case.get("transfers")
    if not isinstance(transfers, Mapping):
        return None
    row = {k: transfers.get(k) for k in ("d2h_copies", "d2h_bytes", "h2d_copies", "h2d_bytes")}
    return row if any(v is not None for v in row.values()) else None


def host_row(case: Mapping[str, Any]) -> dict[str, Any] | None:
    """The host footprint the harness saw: the most host bytes its observed D2H copies wrote
    that were still alive at a step's end, and the last step's (None without the records)."""
    leaks = case.get("leaks") or {}
    held = leaks.get("host_held_bytes")
    if not isinstance(held, list) or not held:
        return None
    row: dict[str, Any] = {
        "held_bytes": max(held),
        "held_bytes_final": held[-1],
        "source": "harness-held",
    }
    footprint = leaks.get("host_footprint")
    if isinstance(footprint, Mapping):
        row["source"] = f"boundaries-{footprint.get('source')}"
        row["peak_held"] = footprint.get("peak_held_bytes")
        row["peak_in_flight"] = footprint.get("peak_in_flight_bytes")
        row["ratio"] = footprint.get("ratio")
    return row


def bench_rows(bench: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``bench``'s rows from a ``bench.json``: per model and variant its step seconds, step
    ratio to the baseline, copy rate (GB/s both ways over the step), the offloader's host
    seconds per step (``--host-time``) and peak bytes."""
    out = []
    for entry in bench.get("models", []):
        for variant, result in (entry.get("variants") or {}).items():
            host = result.get("host_time")
            footprint = result.get("host_footprint")
            footprint = footprint if isinstance(footprint, dict) else {}
            out.append(
                {
                    "model": str(entry.get("model")),
                    "variant": str(variant),
                    "status": result.get("status"),
                    "step_s": result.get("step_s"),
                    "ratio": result.get("ratio"),
                    "copy_gbs": result.get("effective_gbs"),
                    "host_s": host.get("total_s") if isinstance(host, dict) else None,
                    "peak_bytes": result.get("peak_bytes"),
                    "host_held": footprint.get("peak_held_bytes"),
                    "host_in_flight": footprint.get("peak_in_flight_bytes"),
                    "host_ratio": footprint.get("ratio"),
                }
            )
    return out
