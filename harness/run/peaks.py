"""The case peaks a CUDA run measured, kept for the next run on the same card, and written as a
test fixture.

* ``PeakStore``: every CUDA ``offload-harness run`` records each judged case's peak reserved
  bytes (``summary.json``'s ``device_memory.peak_reserved``, ``harness.run.workermemory``) in
  ``<cache>/offload-harness/gpu-peaks/<fingerprint>.json`` (``$XDG_CACHE_HOME``, else
  ``~/.cache``), by model size and case; the next run on a machine of that numerics
  fingerprint (``harness.measure.fingerprint``: the same GPU model, torch, CUDA and cuDNN)
  budgets with them instead of the model's estimate (``harness.run.budget``). The latest
  reading of a case replaces the one before; a case that ran out of memory records nothing.
* ``fixture``: what ``tests/fixtures/gpu/`` holds for the replay test, from one or more
  ``summary.json`` files of a GPU run::

      python -m harness.run.peaks --record tests/fixtures/gpu/h100-peaks.json \\
          reports/<run>/summary.json [more summary.json ...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

FORMAT = 1


def cache_folder() -> Path:
    """``$XDG_CACHE_HOME/offload-harness`` (``~/.cache/offload-harness`` without it)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "offload-harness"


class PeakStore:
    """The recorded peaks of one fingerprint: model size -> case name -> bytes."""

    def __init__(self, fingerprint: str, folder: Path | None = None) -> None:
        self.path = (folder or cache_folder()) / "gpu-peaks" / f"{fingerprint}.json"
        self.fingerprint = fingerprint
        self.peaks: dict[str, dict[str, int]] = self._read()

    def _read(self) -> dict[str, dict[str, int]]:
        """What the file holds; nothing when it is missing, unreadable or of another format
        (a cache: the run estimates instead, and rewrites it)."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            return {}
        peaks = data.get("peaks")
        if not isinstance(peaks, dict):
            return {}
        return {
            size: {name: n for name, n in cases.items() if isinstance(n, int) and n > 0}
            for size, cases in peaks.items()
            if isinstance(cases, dict)
        }

    def of(self, model_size: str) -> dict[str, int]:
        """Case name -> recorded peak at ``model_size``."""
        return dict(self.peaks.get(model_size, {}))

    def update(self, model_size: str, records: Iterable[dict[str, Any]]) -> int:
        """Take the peaks of ``records`` (a run's case records); how many."""
        found = dict(case_peaks(records))
        self.peaks.setdefault(model_size, {}).update(found)
        return len(found)

    def save(self) -> bool:
        """Write the file (atomically); False when it cannot be written (the run goes on)."""
        text = json.dumps(
            {"format": FORMAT, "fingerprint": self.fingerprint, "peaks": self.peaks}, indent=1
        )
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, temporary = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as file:
                file.write(text)
            os.replace(temporary, self.path)
        except OSError:
            return False
        return True


def case_peaks(records: Iterable[dict[str, Any]]) -> Iterable[tuple[str, int]]:
    """(name, peak reserved bytes) of each record that has one and did not run out of
    memory (its peak is then the card's limit, not the case's)."""
    from harness.run.workermemory import out_of_memory

    for record in records:
        peak = (record.get("device_memory") or {}).get("peak_reserved")
        if isinstance(peak, int) and peak > 0 and out_of_memory(record.get("problems", ())) is None:
            yield record["name"], peak


# --- the fixture --------------------------------------------------------------------------

_PROCESS = re.compile(r"(?:Process \d+|this process) has ([\d.]+) GiB memory in use")
_CAPACITY = re.compile(r"total capacity of ([\d.]+) GiB")
GiB = 1 << 30


def _case_entry(record: dict[str, Any]) -> dict[str, Any]:
    """What the fixture keeps of one case record: the worker's peak, the budget's estimate,
    the memory check's readings (its last step's peak and what the last forward left
    allocated, above what the run found allocated) and the seconds."""
    memory = record.get("memory") or {}
    device = record.get("device_memory") or {}
    return {
        "peak_reserved": device.get("peak_reserved"),
        "estimate": device.get("estimate"),
        "memory_baseline_peak": memory.get("baseline_peak"),
        "memory_offload_peak": memory.get("offload_peak"),
        "memory_after_forward": memory.get("baseline_allocated_after_forward"),
        "seconds": record.get("duration"),
        "out_of_memory": any("out of memory" in p for p in record.get("problems", ())),
    }


def fixture(summaries: Sequence[dict[str, Any]], note: str) -> dict[str, Any]:
    """The replay fixture of ``summaries`` (one GPU's runs): the card, every case's entry
    (the last summary's where a case ran twice), and the memory each worker held when a case
    ran out of memory, as torch's message lists it."""
    cases: dict[str, dict[str, Any]] = {}
    at_oom: list[list[int]] = []
    total: int | None = None
    for summary in summaries:
        run = summary.get("device_memory") or {}
        total = run.get("total") or total
        for record in summary.get("cases", ()):
            cases[record["name"]] = _case_entry(record)
            for problem in record.get("problems", ()):
                if "CUDA out of memory" not in problem:
                    continue
                at_oom.append([int(float(g) * GiB) for g in _PROCESS.findall(problem)])
                capacity = _CAPACITY.search(problem)
                if capacity and total is None:
                    total = int(float(capacity.group(1)) * GiB)
    first = summaries[0] if summaries else {}
    return {
        "note": note,
        "machine": first.get("machine"),
        "device": first.get("device"),
        "model_size": first.get("model_size"),
        "backend": first.get("backend"),
        "card_total": total,
        "workers_at_oom": at_oom,
        "cases": cases,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m harness.run.peaks --record OUT SUMMARY...``: write the replay fixture."""
    parser = argparse.ArgumentParser(
        prog="python -m harness.run.peaks", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--record", metavar="OUT", required=True, help="the fixture to write")
    parser.add_argument("summaries", nargs="+", metavar="SUMMARY", help="summary.json files")
    parser.add_argument(
        "--note", default="", help="where the runs came from (default: the machine and date)"
    )
    args = parser.parse_args(argv)
    loaded = []
    for path in args.summaries:
        try:
            loaded.append(json.loads(Path(path).read_text(encoding="utf-8")))
        except (OSError, ValueError) as exc:
            print(f"python -m harness.run.peaks: cannot read {path}: {exc}", file=sys.stderr)
            return 2
    if any(summary.get("device", "").split(":")[0] != "cuda" for summary in loaded):
        print("python -m harness.run.peaks: every summary must be of a CUDA run", file=sys.stderr)
        return 2
    gpus = (loaded[0].get("machine") or {}).get("gpus") or ["?"]
    note = args.note or (
        f"recorded by python -m harness.run.peaks from a {gpus[0]} run of "
        f"{loaded[0].get('created_utc', '?')[:10]}; refresh on a GPU (docs/gpu.md)"
    )
    Path(args.record).write_text(json.dumps(fixture(loaded, note), indent=1) + "\n")
    print(f"wrote {args.record}: {sum(len(s.get('cases', ())) for s in loaded)} case record(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
