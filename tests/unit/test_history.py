"""The history file (``harness.reporting.history``) and what a summary gives it
(``harness.reporting.history_rows``): the schema built by its migrations, a version-1 file
migrated to the current one with its runs kept, one transaction per run, and bad files refused
in one line. Two writers at once and a killed writer are in
``tests/e2e/test_history_processes.py`` (they start processes)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from harness.reporting import history as db
from harness.reporting import trend
from harness.reporting.history_rows import (
    bench_rows,
    fingerprint_of,
    host_row,
    memory_row,
    run_record,
)


def _case(name: str, **changes: Any) -> dict[str, Any]:
    case = {
        "name": name,
        "verdict": "pass",
        "seconds": 0.75,
        "duration": 0.8,
        "run_seconds": {"plain": 0.2, "hooks": 0.08, "offload": 0.43, "disabled": 0.03},
        "plain_baseline": {"key": "k", "made_by": name},
        "checks": {"equivalence": {"status": "pass"}, "memory": {"status": "n-a", "reason": "x"}},
        "transfers": {"d2h_copies": 36, "d2h_bytes": 884736, "h2d_copies": 36, "h2d_bytes": 1},
        "leaks": {"host_held_bytes": [0, 4096, 4096, 2048]},
        "golden": {"status": "match", "fingerprint": "cpu-avx512-0000"},
    }
    case.update(changes)
    return case


def _summary(*cases: dict[str, Any], **changes: Any) -> dict[str, Any]:
    summary = {
        "created_utc": "2026-12-06T20:37:13+00:00",
        "status": "complete",
        "commit": {"sha": "cbc19f7fdb4d", "dirty": True, "source": "git", "version": "0.1.0"},
        "backend": "reference",
        "device": "cpu",
        "matrix": "default",
        "model_size": "tiny",
        "seconds": 1.9,
        "cases": list(cases) or [_case("a")],
    }
    summary.update(changes)
    return summary


def _record(summary: dict[str, Any] | None = None) -> db.RunRecord:
    return run_record(summary or _summary(), fingerprint="cpu-avx512-0000/tiny", source="run")


def test_a_new_file_gets_every_migration_in_wal_mode(tmp_path: Path) -> None:
    assert [m.version for m in db.MIGRATIONS] == list(range(1, db.SCHEMA_VERSION + 1))
    conn = db.open_history(tmp_path / "h.sqlite", create=True)
    try:
        assert db.schema_version(conn) == db.SCHEMA_VERSION
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA busy_timeout").fetchone()[0] >= 10_000
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert {"schema_version", "runs", *db.FIGURE_TABLES} <= tables
        versions = [r[0] for r in conn.execute("SELECT version FROM schema_version")]
        assert versions == list(range(1, db.SCHEMA_VERSION + 1))
    finally:
        conn.close()


def test_a_version_1_file_is_migrated_with_its_runs_kept(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    conn = sqlite3.connect(path, isolation_level=None)
    assert db.migrate(conn, upto=1) == 1
    conn.execute(
        "INSERT INTO runs (recorded_utc, created_utc, commit_sha, fingerprint, backend) "
        "VALUES ('2026-01-01', '2026-01-01T03:00', 'aaaa', 'fp/tiny', 'reference')"
    )
    conn.execute(
        "INSERT INTO cases (run_id, case_name, verdict, seconds) VALUES (1, 'a', 'pass', 2.0)"
    )
    conn.execute("INSERT INTO checks VALUES (1, 'a', 'leaks', 'pass')")
    conn.close()

    conn = db.open_history(path, create=False)  # brought up to date when opened
    try:
        assert db.schema_version(conn) == db.SCHEMA_VERSION
        (old,) = db.rows(conn, "cases", [1])
        assert old["seconds"] == 2.0 and old["offload_seconds"] is None  # a column added by 2
        record = run_record(_summary(_case("a")), fingerprint="fp/tiny", source="run")
        assert db.append(conn, record) == 2
        history = trend.load(conn)
    finally:
        conn.close()
    assert [n.run_id for n in history.nights] == [1, 2]
    assert history.checks[1] == {("a", "leaks"): "pass"}
    assert (
        history.value(1, "a", "seconds") == 2.0 and history.value(1, "a", "host_held_bytes") is None
    )
    assert history.value(2, "a", "host_held_bytes") == 4096


def test_a_run_and_its_figures_round_trip(tmp_path: Path) -> None:
    shared = _case("b", plain_baseline={"key": "k", "made_by": "a"}, verdict="fail")
    conn = db.open_history(tmp_path / "h.sqlite", create=True)
    try:
        run_id = db.append(conn, _record(_summary(_case("a"), shared)))
        (run,) = db.runs(conn)
        cases = {r["case_name"]: r for r in db.rows(conn, "cases", [run_id])}
        host = {r["case_name"]: r for r in db.rows(conn, "host", [run_id])}
        checks = db.rows(conn, "checks", [run_id])
        transfers = db.rows(conn, "transfers", [run_id])
    finally:
        conn.close()
    assert run["commit_sha"] == "cbc19f7fdb4d" and run["dirty"] == 1 and run["matrix"] == "default"
    assert run["fingerprint"] == "cpu-avx512-0000/tiny" and run["source"] == "run"
    assert cases["a"]["overhead"] == pytest.approx(0.43 / 0.2)
    # another row trained b's plain baseline: its plain time is no figure, nor its overhead
    assert cases["b"]["plain_seconds"] is None and cases["b"]["overhead"] is None
    assert cases["b"]["verdict"] == "fail" and cases["b"]["seconds"] == 0.75
    assert host["a"] == {**host["a"], "held_bytes": 4096, "held_bytes_final": 2048}
    assert len(checks) == 4 and {c["status"] for c in checks} == {"pass", "n-a"}
    assert transfers[0]["d2h_bytes"] == 884736


def test_memory_readings_and_their_absence() -> None:
    reading = {
        "baseline_allocated_after_forward": 100,
        "offload_allocated_after_forward": 60,
        "baseline_peak": 200,
        "offload_peak": 150,
        "predicted_drop": 40,
        "backward": {"baseline_peak": 190, "offload_peak": 140, "samples": {}},
    }
    row = memory_row(_case("a", memory=reading))
    assert row is not None and row["offload_backward_peak"] == 140 and row["offload_peak"] == 150
    assert memory_row(_case("a")) is None  # CPU: no reading
    assert host_row(_case("a", leaks={})) is None


def test_host_footprint_rows_of_a_case_and_a_bench_variant() -> None:
    footprint = {"peak_held_bytes": 300, "peak_in_flight_bytes": 200, "ratio": 1.5}
    leaks = {"host_held_bytes": [0, 300, 300], "host_footprint": {**footprint, "source": "copies"}}
    row = host_row(_case("a", leaks=leaks))
    assert row == {
        "held_bytes": 300,
        "held_bytes_final": 300,
        "source": "boundaries-copies",
        "peak_held": 300,
        "peak_in_flight": 200,
        "ratio": 1.5,
    }
    older = host_row(_case("a", leaks={"host_held_bytes": [0, 4]}))  # before the footprint
    assert older == {"held_bytes": 4, "held_bytes_final": 4, "source": "harness-held"}
    bench = {"models": [{"model": "m", "variants": {"reference": {"host_footprint": footprint}}}]}
    [variant] = bench_rows(bench)
    found = (variant["host_held"], variant["host_in_flight"], variant["host_ratio"])
    assert found == (300, 200, 1.5)


def test_fingerprint_of_a_summary() -> None:
    assert fingerprint_of(_summary()) == "cpu-avx512-0000"
    assert fingerprint_of(_summary(_case("a", golden={"status": "n-a"}))) is None
    mixed = _summary(_case("a"), _case("b", golden={"fingerprint": "other"}))
    with pytest.raises(ValueError, match="several fingerprints"):
        fingerprint_of(mixed)


def test_bench_variants_are_recorded() -> None:
    bench = {
        "models": [
            {
                "model": "small",
                "variants": {
                    "baseline": {"status": "ok", "step_s": 0.1, "ratio": 1.0},
                    "reference": {
                        "status": "ok",
                        "step_s": 0.11,
                        "ratio": 1.1,
                        "effective_gbs": 12.5,
                        "peak_bytes": 4096,
                        "host_time": {"total_s": 0.002},
                    },
                },
            }
        ]
    }
    record = run_record(_summary(), fingerprint="f", source="nightly", bench=bench)
    rows = {r["variant"]: r for r in record.rows["bench"]}
    assert rows["reference"]["copy_gbs"] == 12.5 and rows["reference"]["host_s"] == 0.002
    assert rows["baseline"]["copy_gbs"] is None


def test_a_failed_append_leaves_nothing(tmp_path: Path) -> None:
    conn = db.open_history(tmp_path / "h.sqlite", create=True)
    try:
        db.append(conn, _record())
        broken = _record()
        broken.rows["host"].append({"case_name": "a", "no_such_column": 1})
        with pytest.raises(ValueError, match="not host columns"):
            db.append(conn, broken)
        duplicate = _record()
        duplicate.rows["cases"].append(dict(duplicate.rows["cases"][0]))
        with pytest.raises(sqlite3.IntegrityError):
            db.append(conn, duplicate)
        assert db.count_runs(conn) == 1 and len(db.rows(conn, "cases", [1, 2, 3])) == 1
        assert db.append(conn, _record()) > 1  # and the file takes the next one
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b"this is not a database" * 50, "not a readable history: file is not a database"),
        (None, "no such file"),
        ("other", "an SQLite database of something else (tables notes)"),
        ("newer", "schema version 99 is newer than this harness's"),
        ("folder", "a folder, not a history file"),
    ],
)
def test_bad_files_are_one_line(tmp_path: Path, content: Any, fragment: str) -> None:
    path = tmp_path / "h.sqlite"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content == "other":
        sqlite3.connect(path).execute("CREATE TABLE notes (x)").connection.close()
    elif content == "newer":
        db.open_history(path, create=True).close()
        conn = sqlite3.connect(path)
        conn.execute("INSERT INTO schema_version VALUES (99, 'future', 'now')")
        conn.commit()
        conn.close()
    elif content == "folder":
        path.mkdir()
    with pytest.raises(db.HistoryError) as raised:
        db.open_history(path, create=False)
    message = str(raised.value)
    assert fragment in message and "\n" not in message and message.startswith(f"--history {path}")


def test_a_missing_folder_is_refused_even_when_creating(tmp_path: Path) -> None:
    with pytest.raises(db.HistoryError, match=r"its folder .* does not exist"):
        db.open_history(tmp_path / "no" / "h.sqlite", create=True)


def test_load_refuses_an_unknown_fingerprint(tmp_path: Path) -> None:
    conn = db.open_history(tmp_path / "h.sqlite", create=True)
    try:
        with pytest.raises(ValueError, match="holds no run"):
            trend.load(conn)
        db.append(conn, _record())
        with pytest.raises(ValueError, match=r"no run of fingerprint zz .*it has: cpu-avx512"):
            trend.load(conn, "zz")
    finally:
        conn.close()
