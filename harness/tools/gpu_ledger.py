"""The GPU ledger: each CUDA-only check and each backend, and the commit, card and date it last
passed on a GPU (``docs/status.md``'s "GPU ledger" table).

    python -m harness.tools.gpu_ledger collect RUNS --out ledger.json
    python -m harness.tools.gpu_ledger apply ledger.json [ledger.json...] docs/status.md

``collect`` (run by ``scripts/gpu_verify`` on the GPU box) reads the folder of its sections
(``RUNS``: each section's ``<name>.log``, ``rc`` lines in ``verify.txt``, report folders with
their ``summary.json``) and decides each ledger entry: ``pass``, ``fail`` (with the first reason)
or ``not run``. ``apply`` (on a workstation, afterwards) writes the entries into the table:
a pass moves the entry's "last passed" to this run; a failure keeps the last pass and says what
failed when; an entry not run is left as it was.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BEGIN, END = "<!-- gpu-ledger:begin -->", "<!-- gpu-ledger:end -->"
"""The markers around the table in ``docs/status.md``: ``apply`` rewrites what is between."""


@dataclass(frozen=True)
class Runs:
    """What ``scripts/gpu_verify`` left in its runs folder."""

    root: Path
    rc: dict[str, int]
    """Each section's exit status, from ``verify.txt``'s ``== NAME rc=N`` lines."""

    @classmethod
    def read(cls, root: Path, verify: Path) -> Runs:
        rc = {}
        if verify.exists():
            for m in re.finditer(r"^== (\S+) rc=(\d+)", verify.read_text(), re.MULTILINE):
                rc[m.group(1)] = int(m.group(2))
        return cls(root=root, rc=rc)

    def cases(self, section: str) -> list[dict[str, Any]] | None:
        """The cases of the section's newest report (None: no report)."""
        found = sorted((self.root / section).glob("*/summary.json"))
        if not found:
            return None
        return json.loads(found[-1].read_text()).get("cases", [])

    def log(self, section: str) -> str:
        path = self.root / f"{section}.log"
        return path.read_text(errors="replace") if path.exists() else ""


Verdict = tuple[str, str]
"""(``pass`` | ``fail`` | ``not run``, the detail)."""


def _all_rows(section: str, allowed: frozenset[str] = frozenset({"pass", "inert"})) -> Callable:
    """Every case of the section's report has a verdict in ``allowed``."""

    def decide(runs: Runs) -> Verdict:
        cases = runs.cases(section)
        if cases is None:
            return ("not run", "")
        bad = [c for c in cases if c.get("verdict") not in allowed]
        if not cases:
            return ("fail", "no case ran")
        if bad:
            first = bad[0]
            problem = (first.get("problems") or [first.get("verdict", "?")])[0]
            return ("fail", f"{len(bad)}/{len(cases)} rows: {first['name']}: {problem}"[:300])
        return ("pass", f"{len(cases)} rows pass or inert")

    return decide


def _check_on_rows(section: str, check: str) -> Callable:
    """The check is pass (or n-a) on every case of the section's report, and pass on one."""

    def decide(runs: Runs) -> Verdict:
        cases = runs.cases(section)
        if cases is None:
            return ("not run", "")
        status = [((c.get("checks") or {}).get(check) or {}).get("status") for c in cases]
        bad = [c["name"] for c, s in zip(cases, status, strict=True) if s not in ("pass", "n-a")]
        if bad or "pass" not in status:
            return ("fail", f"{check} not pass on {len(bad)} rows (first: {bad[:1]})")
        return ("pass", f"{status.count('pass')} rows pass {check} ({section})")

    return decide


def _rc(section: str, expected: int = 0, needle: str = "") -> Callable:
    """The section ended with ``expected`` (and its log has ``needle``)."""

    def decide(runs: Runs) -> Verdict:
        if section not in runs.rc:
            return ("not run", "")
        got = runs.rc[section]
        log = runs.log(section)
        tail = next((line for line in reversed(log.splitlines()) if line.strip()), "")
        if got != expected or (needle and needle not in log):
            return ("fail", f"rc={got} (expected {expected}): {tail}"[:300])
        return ("pass", tail[:200])

    return decide


def _no_oom(section: str) -> Callable:
    """The section's report has every row and none ran out of memory."""

    def decide(runs: Runs) -> Verdict:
        cases = runs.cases(section)
        if cases is None:
            return ("not run", "")
        text = json.dumps(cases)
        if "out of memory" in text:
            return ("fail", "a case ran out of device memory")
        return ("pass", f"{len(cases)} rows, none out of memory")

    return decide


ENTRIES: dict[str, Callable[[Runs], Verdict]] = {
    "reference, default matrix (`run --device cuda`)": _all_rows("reference"),
    "reference, full matrix (`run --matrix full --device cuda`)": _all_rows("full"),
    "memory check: after the last forward and at every backward boundary": _check_on_rows(
        "reference", "memory"
    ),
    "sync check: the guard on real syncs (`scripts/gpu_probe_sync.py`)": _rc("sync-probe"),
    "sync check: `broken.host_sync` caught (`cases/test_sync.py`)": _rc(
        "sync-broken", 1, "synchronised the host"
    ),
    "transfers: CUDA attribution (profiler memcpys per group)": _check_on_rows(
        "reference", "transfers"
    ),
    "cadence check on CUDA": _check_on_rows("reference", "cadence"),
    "worker budget: no case out of memory (full matrix)": _no_oom("full"),
    "the harness's tests (`pytest tests/ --device cuda`)": _rc("tests"),
    "mutation score, declared (with its control)": _rc("mscore", 0, "caught"),
    "mutation score, `--undeclared` (with its control)": _rc("mscore-undeclared", 0, "caught"),
    **{
        f"undeclared corpus: `{style}`": _all_rows(f"u-{style}")
        for style in (
            "PinnedStreams",
            "StorageSkip",
            "ObjectSkip",
            "SizeThreshold",
            "WholeStorage",
            "HandBack",
        )
    },
    "backend `mcore`, megatron-core 0.19.2 (`--models mcore`)": _all_rows(
        "mcore-0192", frozenset({"pass", "inert", "skip"})
    ),
    "backend `mcore`, megatron-core main (`--models mcore`)": _all_rows(
        "mcore-main", frozenset({"pass", "inert", "skip"})
    ),
    "megatron-core feature probes, 0.19.2 and main": _rc("features"),
    "backend `te`, `--nvte-cpu-offload-v1 0`": _all_rows("te-v1-0"),
    "backend `te`, `--nvte-cpu-offload-v1 1`": _all_rows("te-v1-1"),
}
"""Ledger entry -> how a run decides it."""


def collect(runs: Runs, machine: dict[str, str]) -> dict[str, Any]:
    """Every entry's verdict, with where and when it was decided."""
    entries = {}
    for name, decide in ENTRIES.items():
        status, detail = decide(runs)
        entries[name] = {"status": status, "detail": detail}
    return {"machine": machine, "entries": entries}


def _machine(text: str) -> dict[str, str]:
    """Commit, card and date from ``machine.txt`` (``scripts/gpu_verify``'s first section)."""
    lines = text.splitlines()
    card = next((line.split(",")[0] for line in lines if "NVIDIA" in line), "unknown card")
    commit = next((line.split()[1] for line in lines if line.startswith("commit ")), "unknown")
    date = next((line.split()[1] for line in lines if line.startswith("date ")), "unknown")
    return {"card": card.strip(), "commit": commit[:10], "date": date}


ROW = re.compile(r"^\| (?P<entry>.+?) \| (?P<passed>.*?) \| (?P<last>.*?) \|$")


def apply(ledgers: Sequence[dict[str, Any]], text: str) -> str:
    """``text`` (``docs/status.md``) with its ledger table updated by ``ledgers``, in order."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"no {BEGIN} ... {END} table to update")
    head, rest = text.split(BEGIN, 1)
    table, tail = rest.split(END, 1)
    rows: dict[str, tuple[str, str]] = {}
    for line in table.splitlines():
        m = ROW.match(line.strip())
        if m and m["entry"] not in ("entry", "---"):
            rows[m["entry"]] = (m["passed"], m["last"])
    for ledger in ledgers:
        where = ledger["machine"]
        at = f"{where['commit']}, {where['card']}, {where['date']}"
        for entry, verdict in ledger["entries"].items():
            passed, last = rows.get(entry, ("never", "not run"))
            if verdict["status"] == "pass":
                rows[entry] = (at, f"pass ({at})")
            elif verdict["status"] == "fail":
                detail = verdict["detail"].replace("|", "/")
                rows[entry] = (passed, f"fail ({at}): {detail}")
            else:
                rows[entry] = (passed, last)
    order = list(ENTRIES) + [e for e in rows if e not in ENTRIES]
    body = ["| entry | last passed (commit, card, date) | last run |", "| --- | --- | --- |"]
    body += [f"| {e} | {rows[e][0]} | {rows[e][1]} |" for e in order if e in rows]
    return head + BEGIN + "\n" + "\n".join(body) + "\n" + END + tail


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.tools.gpu_ledger", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect", help="decide the entries from a gpu_verify runs folder")
    c.add_argument("runs", type=Path)
    c.add_argument("--verify", type=Path, help="verify.txt (default: RUNS/../verify.txt)")
    c.add_argument("--machine", type=Path, help="machine.txt (default: RUNS/machine.log)")
    c.add_argument("--out", type=Path, required=True)
    a = sub.add_parser("apply", help="write ledgers into docs/status.md's table")
    a.add_argument("paths", nargs="+", type=Path, help="ledger.json files, then docs/status.md")
    args = parser.parse_args(argv)
    try:
        if args.command == "collect":
            machine = _machine((args.machine or args.runs / "machine.log").read_text())
            runs = Runs.read(args.runs, args.verify or args.runs.parent / "verify.txt")
            args.out.write_text(json.dumps(collect(runs, machine), indent=1) + "\n")
            print(f"gpu_ledger: {args.out}")
            return 0
        *ledgers, status = args.paths
        if not ledgers:
            parser.error("apply needs at least one ledger.json and the status page")
        loaded = [json.loads(path.read_text()) for path in ledgers]
        status.write_text(apply(loaded, status.read_text()))
        print(f"gpu_ledger: {status} updated from {len(loaded)} ledger(s)")
        return 0
    except (OSError, ValueError, KeyError) as exc:
        print(f"gpu_ledger: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
