"""Reports: ``summary.json`` first (machine, commit, per-case results); everything printed is
rendered from it.

Folder names: ``reports/<UTC time>_<git sha>[_dirty]/``.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import platform
import subprocess
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import torch


def _version() -> str:
    try:
        return importlib.metadata.version("offload-harness")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown"


HARNESS_VERSION = _version()


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], capture_output=True, text=True, check=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip()


def commit_info() -> dict[str, Any]:
    """Current commit sha and whether the work tree has uncommitted changes."""
    sha = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"sha": sha, "dirty": bool(status) if status is not None else None}


def machine_info() -> dict[str, Any]:
    """Host, torch, CUDA and GPU facts."""
    info: dict[str, Any] = {
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": [],
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        info["driver"] = driver.splitlines()[0] if driver else None
    return info


def folder_name() -> str:
    """``<UTC time>_<sha>[_dirty]`` for a new report folder."""
    commit = commit_info()
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return f"{stamp}_{(commit['sha'] or 'nogit')[:10]}{'_dirty' if commit['dirty'] else ''}"


def free_folder(root: Path, name: str) -> Path:
    """``root/name``, or ``name-2``, ``name-3``... when taken (two runs in one second); not
    created."""
    for attempt in range(1, 1000):
        folder = root / (name if attempt == 1 else f"{name}-{attempt}")
        if not folder.exists():
            return folder
    raise FileExistsError(f"no free report folder name under {root} for {name}")


def run_folder(root: Path, name: str | None = None) -> Path:
    """Create a new report folder ``root/name`` (default ``folder_name()``, made unique)."""
    while True:
        folder = free_folder(root, name or folder_name())
        try:
            folder.mkdir(parents=True)
        except FileExistsError:  # taken between the check and the mkdir
            continue
        return folder


def summary_text(cases: list[dict[str, Any]], **extra: Any) -> str:
    """The JSON text of a session summary: version, time, machine, commit, ``extra``, cases."""
    summary = {
        "harness_version": HARNESS_VERSION,
        "created_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "commit": commit_info(),
        **extra,
        "cases": cases,
    }
    return json.dumps(summary, indent=2, sort_keys=False, default=str) + "\n"


def write_summary(folder: Path, cases: list[dict[str, Any]], **extra: Any) -> Path:
    """Write ``summary.json`` into ``folder``; returns its path."""
    path = folder / "summary.json"
    path.write_text(summary_text(cases, **extra))
    return path


def write_junit(folder: Path, summary: dict[str, Any]) -> Path:
    """``junit.xml`` of a CLI run: one testcase per case, its problems as the failure text
    (pytest sessions get pytest's own JUnit XML instead)."""
    cases = summary["cases"]
    failures = sum(c["verdict"] != "pass" for c in cases)
    suite = ElementTree.Element(
        "testsuite",
        name="offload-harness",
        tests=str(len(cases)),
        failures=str(failures),
        errors="0",
        skipped="0",
        time=str(summary.get("seconds", 0)),
        timestamp=summary.get("created_utc", ""),
        hostname=summary.get("machine", {}).get("host", ""),
    )
    for case in cases:
        element = ElementTree.SubElement(
            suite,
            "testcase",
            classname=f"offload-harness.{summary.get('backend', 'run')}",
            name=case["name"],
            time=str(case.get("duration", case.get("seconds", 0))),
        )
        if case["verdict"] != "pass":
            problems = case.get("problems") or ["failed"]
            failure = ElementTree.SubElement(element, "failure", message=problems[0][:500])
            failure.text = "\n".join(problems)
    path = folder / "junit.xml"
    tree = ElementTree.ElementTree(ElementTree.Element("testsuites"))
    tree.getroot().append(suite)
    tree.write(path, encoding="utf-8", xml_declaration=True)
    return path


CHECK_COLUMNS = (
    ("equivalence", "equiv"),
    ("leaks", "leaks"),
    ("transfers", "transfers"),
    ("disabled", "disabled"),
    ("fidelity", "fidelity"),
    ("memory", "memory"),
    ("sync", "sync"),
    ("golden", "golden"),
)
"""The judge's checks (``harness.judge.CHECKS``) and their console column headers."""


def verdict_table(summary: dict[str, Any]) -> str:
    """Console table of a summary: case, verdict, one column per check (pass / fail / skip /
    n-a), groups moved, DtoH/HtoD copies and bytes."""
    header = ("case", "verdict", *(h for _, h in CHECK_COLUMNS))
    rows = [(*header, "groups moved", "DtoH", "HtoD", "bytes each way")]
    for case in summary["cases"]:
        t = case.get("transfers", {})
        checks = case.get("checks", {})
        rows.append(
            (
                case["name"],
                case["verdict"],
                *(checks.get(name, {}).get("status", "-") for name, _ in CHECK_COLUMNS),
                ",".join(t.get("names_moved", [])) or "-",
                str(t.get("d2h_copies", "-")),
                str(t.get("h2d_copies", "-")),
                _mib(t.get("d2h_bytes")),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def _mib(value: int | None) -> str:
    if value is None:
        return "-"
    return f"{value} ({value / 2**20:.2f} MiB)"


def case_record(res: Any) -> dict[str, Any]:
    """Report fields of a ``CaseRun``: losses of the three runs, verdict, transfers."""
    return {
        "losses": {
            "plain": res.plain.losses.tolist(),
            "hooks": res.hooks.losses.tolist(),
            "offload": res.offload.losses.tolist(),
        },
        "equivalence": res.verdict.kind,
        "warmup_transfers": {
            d: {"copies": c.copies, "bytes": c.bytes}
            for d, c in res.warmup_transfers.totals().items()
        },
        "seconds": round(res.seconds, 3),
        **_transfer_fields(res),
    }


def _transfer_fields(res: Any) -> dict[str, Any]:
    totals = res.counts.totals()
    per_name = {
        f"{direction}:{name}": {"copies": c.copies, "bytes": c.bytes}
        for (direction, name), c in sorted(res.counts.by_name().items())
    }
    return {
        "transfers": {
            "names_moved": sorted(res.moved_names()),
            "d2h_copies": totals["d2h"].copies,
            "d2h_bytes": totals["d2h"].bytes,
            "h2d_copies": totals["h2d"].copies,
            "h2d_bytes": totals["h2d"].bytes,
            "per_name": per_name,
            "pageable": res.counts.pageable,
            "unattributed": {d: c.copies for d, c in res.counts.unattributed.items()},
            "mode": res.counts.mode,
        },
    }


def memory_record(res: Any) -> dict[str, Any]:
    """Report fields of a ``MemoryResult``."""
    return {
        "memory": {
            "predicted_drop": res.predicted_drop,
            "requested_drop": res.requested_drop,
            "allocated_drop": res.allocated_drop,
            "rounding": res.rounding,
            "baseline_allocated_after_forward": res.baseline_allocated,
            "offload_allocated_after_forward": res.offload_allocated,
            "baseline_peak": res.baseline_peak,
            "offload_peak": res.offload_peak,
            "peak_allowance": res.peak_allowance,
            "floor_freed_blocks": res.floor_freed[0],
            "floor_freed_bytes": res.floor_freed[1],
        }
    }
