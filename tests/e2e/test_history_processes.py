"""The history under two writers at once and under a writer killed mid-transaction: separate
processes (``python -c``, importing only ``harness.reporting``: no torch), each appending runs
with ``harness.reporting.history.append`` as ``offload-harness run --history`` and
``scripts/nightly --history`` do."""

from __future__ import annotations

import itertools
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from harness.reporting import history as db

REPO = Path(__file__).resolve().parents[2]

CASES = 25
"""Cases per appended run: a run is whole when it has all of them (and their checks)."""

WRITER = f"""
import sys, time
from harness.reporting import history as db

path, label, runs, start = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])

def record(i):
    cases = [{{"case_name": f"case-{{c}}", "verdict": "pass", "seconds": 0.5}}
             for c in range({CASES})]
    checks = [{{"case_name": f"case-{{c}}", "check_name": k, "status": "pass"}}
              for c in range({CASES}) for k in ("equivalence", "leaks")]
    run = {{"fingerprint": "fp/tiny", "backend": label, "commit_sha": f"{{label}}-{{i}}"}}
    return db.RunRecord(run=run, rows={{"cases": cases, "checks": checks}})

conn = db.open_history(path, create=True)
while time.time() < start:  # both begin together
    time.sleep(0.001)
if runs > 0:
    for i in range(runs):
        db.append(conn, record(i))
        time.sleep(0.002)  # the other writer takes its turns meanwhile
    print("done", flush=True)
else:  # the killed writer: a transaction larger than its page cache, never committed
    conn.execute("PRAGMA cache_size = 2")  # pages spill into the WAL before the commit
    conn.execute("BEGIN IMMEDIATE")
    for i in range(40):
        db.insert_run(conn, record(i))
    print("inside", flush=True)
    time.sleep(600)
"""


def _writer(path: Path, label: str, runs: int, start: float) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    argv = [sys.executable, "-c", WRITER, str(path), label, str(runs), str(start)]
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def _whole(path: Path) -> tuple[list[str], str]:
    """The runs' commits, each checked whole (every case and check row), and the integrity."""
    conn = db.open_history(path, create=False)
    try:
        integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
        found = db.runs(conn)
        ids = [r["id"] for r in found]
        cases, checks = db.rows(conn, "cases", ids), db.rows(conn, "checks", ids)
    finally:
        conn.close()
    for run in found:
        assert sum(c["run_id"] == run["id"] for c in cases) == CASES, run
        assert sum(c["run_id"] == run["id"] for c in checks) == 2 * CASES, run
    return [r["commit_sha"] for r in found], integrity


def test_two_writers_at_once_append_every_run_whole(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite"  # created by whichever writer opens it first
    start = time.time() + 1.0
    writers = [_writer(path, label, 40, start) for label in ("a", "b")]
    for writer in writers:
        out, err = writer.communicate(timeout=120)
        assert writer.returncode == 0 and out.strip() == "done", err
    commits, integrity = _whole(path)
    assert integrity == "ok" and len(commits) == 80
    for label in ("a", "b"):  # each writer's runs, all of them, in its own order
        assert [c for c in commits if c.startswith(f"{label}-")] == [
            f"{label}-{i}" for i in range(40)
        ]
    turns = sum(a[0] != b[0] for a, b in itertools.pairwise(commits))
    assert turns >= 2, f"the two writers did not run at once: {commits}"


def test_a_writer_killed_mid_transaction_leaves_the_earlier_runs(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite"
    first = _writer(path, "early", 3, 0.0)
    assert first.communicate(timeout=120)[0].strip() == "done"
    killed = _writer(path, "killed", 0, 0.0)
    assert killed.stdout is not None and killed.stdout.readline().strip() == "inside"
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait(timeout=30)
    killed.communicate()
    assert killed.returncode == -signal.SIGKILL
    assert path.with_name("h.sqlite-wal").stat().st_size > 0  # its pages reached the WAL

    commits, integrity = _whole(path)
    assert integrity == "ok" and commits == ["early-0", "early-1", "early-2"]
    # the lock died with it: the next writer appends at once
    later = _writer(path, "later", 2, 0.0)
    assert later.communicate(timeout=120)[0].strip() == "done"
    commits, integrity = _whole(path)
    assert integrity == "ok" and commits[3:] == ["later-0", "later-1"]
    raw = sqlite3.connect(path)  # a plain reader sees the same file
    assert raw.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 5
    raw.close()
