"""The run history: every recorded run's figures in one SQLite file (stdlib ``sqlite3``), what
``offload-harness trend`` compares the newest run with.

One table per kind of figure, keyed by the run (``runs.id``, the order runs were recorded in):

* ``runs`` - commit, numerics fingerprint, dates, device, model size, matrix, backend, status;
* ``cases`` - per case its verdict and seconds (the case's runs; the offload run's; the plain
  run's where this case trained it, and their ratio, ``overhead``);
* ``checks`` - per case and check its status (``pass``, ``fail``, ``skip``, ``n-a``...);
* ``memory`` - the device memory readings where the memory check ran (CUDA): after the last
  forward and peak, both runs, and the backward's peaks;
* ``transfers`` - copies and bytes per direction of the final step;
* ``host`` - the host footprint: the bytes of the host copies the harness saw still held at a
  step's end (``leaks.host_held_bytes``, its largest step), and at the final step's group
  boundaries the peak held, the peak in flight and their ratio (``leaks.host_footprint``,
  ``harness.measure.footprint``);
* ``bench`` - per bench model and variant: step seconds, step ratio to the baseline, copy rate,
  offloader host time, peak bytes (``offload-harness bench``'s ``bench.json``).

``schema_version`` holds one row per migration applied. The schema is built by ``MIGRATIONS``, in
order, from an empty file; a file of an older version is brought up to date when it is opened
(every step in one transaction), a newer one is refused.

Writers append a whole run in one ``BEGIN IMMEDIATE`` transaction on a connection in WAL mode
with a busy timeout: two writers at once queue on the lock, and a writer killed mid-transaction
leaves the file as it was before it began (SQLite rolls the unfinished transaction back).

Bad input (a missing file where one must exist, a file that is not a history, a history newer
than this harness) is a ``HistoryError`` with one line.
"""

from __future__ import annotations

import datetime as dt
import random
import sqlite3
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUSY_TIMEOUT_S = 60.0
"""How long a writer waits for another writer's transaction before giving up."""


class HistoryError(ValueError):
    """A history that cannot be used: the message is one line naming the file."""


@dataclass(frozen=True)
class Migration:
    """One step of the schema: its version, what it adds, its statements (run in order, in the
    transaction that records the version)."""

    version: int
    description: str
    statements: tuple[str, ...]


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "runs, per-case verdicts and seconds, per-check statuses",
        (
            "CREATE TABLE schema_version (version INTEGER PRIMARY KEY, description TEXT NOT NULL,"
            " applied_utc TEXT NOT NULL)",
            "CREATE TABLE runs (id INTEGER PRIMARY KEY AUTOINCREMENT, recorded_utc TEXT NOT NULL,"
            " created_utc TEXT, commit_sha TEXT, dirty INTEGER, fingerprint TEXT NOT NULL,"
            " device TEXT, model_size TEXT, matrix TEXT, backend TEXT, status TEXT,"
            " seconds REAL, source TEXT, report TEXT)",
            "CREATE INDEX runs_by_fingerprint ON runs (fingerprint, id)",
            "CREATE TABLE cases (run_id INTEGER NOT NULL REFERENCES runs (id), case_name TEXT"
            " NOT NULL, verdict TEXT, seconds REAL, PRIMARY KEY (run_id, case_name))",
            "CREATE TABLE checks (run_id INTEGER NOT NULL REFERENCES runs (id), case_name TEXT"
            " NOT NULL, check_name TEXT NOT NULL, status TEXT,"
            " PRIMARY KEY (run_id, case_name, check_name))",
        ),
    ),
    Migration(
        2,
        "run seconds and overhead per case; memory readings; transfers per step",
        (
            "ALTER TABLE cases ADD COLUMN offload_seconds REAL",
            "ALTER TABLE cases ADD COLUMN plain_seconds REAL",
            "ALTER TABLE cases ADD COLUMN overhead REAL",
            "CREATE TABLE memory (run_id INTEGER NOT NULL REFERENCES runs (id), case_name TEXT"
            " NOT NULL, baseline_after_forward INTEGER, offload_after_forward INTEGER,"
            " baseline_peak INTEGER, offload_peak INTEGER, baseline_backward_peak INTEGER,"
            " offload_backward_peak INTEGER, predicted_drop INTEGER,"
            " PRIMARY KEY (run_id, case_name))",
            "CREATE TABLE transfers (run_id INTEGER NOT NULL REFERENCES runs (id), case_name"
            " TEXT NOT NULL, d2h_copies INTEGER, d2h_bytes INTEGER, h2d_copies INTEGER,"
            " h2d_bytes INTEGER, PRIMARY KEY (run_id, case_name))",
        ),
    ),
    Migration(
        3,
        "host footprint per case; bench variants",
        (
            "CREATE TABLE host (run_id INTEGER NOT NULL REFERENCES runs (id), case_name TEXT"
            " NOT NULL, held_bytes INTEGER, held_bytes_final INTEGER, source TEXT,"
            " PRIMARY KEY (run_id, case_name))",
            "CREATE TABLE bench (run_id INTEGER NOT NULL REFERENCES runs (id), model TEXT NOT"
            " NULL, variant TEXT NOT NULL, status TEXT, step_s REAL, ratio REAL, copy_gbs REAL,"
            " host_s REAL, peak_bytes INTEGER, PRIMARY KEY (run_id, model, variant))",
        ),
    ),
    Migration(
        4,
        "host footprint at group boundaries: peak held, peak in flight, their ratio; the same "
        "per bench variant",
        (
            "ALTER TABLE host ADD COLUMN peak_held INTEGER",
            "ALTER TABLE host ADD COLUMN peak_in_flight INTEGER",
            "ALTER TABLE host ADD COLUMN ratio REAL",
            "ALTER TABLE bench ADD COLUMN host_held INTEGER",
            "ALTER TABLE bench ADD COLUMN host_in_flight INTEGER",
            "ALTER TABLE bench ADD COLUMN host_ratio REAL",
        ),
    ),
)
"""The schema's steps, oldest first; ``MIGRATIONS[i].version == i + 1``."""

SCHEMA_VERSION = MIGRATIONS[-1].version
"""The version this harness writes."""

RUN_COLUMNS = (
    "created_utc",
    "commit_sha",
    "dirty",
    "fingerprint",
    "device",
    "model_size",
    "matrix",
    "backend",
    "status",
    "seconds",
    "source",
    "report",
)
"""``runs``' columns a record fills (``id`` and ``recorded_utc`` are the history's)."""

FIGURE_TABLES: dict[str, tuple[str, ...]] = {
    "cases": ("verdict", "seconds", "offload_seconds", "plain_seconds", "overhead"),
    "checks": ("check_name", "status"),
    "memory": (
        "baseline_after_forward",
        "offload_after_forward",
        "baseline_peak",
        "offload_peak",
        "baseline_backward_peak",
        "offload_backward_peak",
        "predicted_drop",
    ),
    "transfers": ("d2h_copies", "d2h_bytes", "h2d_copies", "h2d_bytes"),
    "host": ("held_bytes", "held_bytes_final", "source", "peak_held", "peak_in_flight", "ratio"),
    "bench": (
        "model",
        "variant",
        "status",
        "step_s",
        "ratio",
        "copy_gbs",
        "host_s",
        "peak_bytes",
        "host_held",
        "host_in_flight",
        "host_ratio",
    ),
}
"""Per table, the columns of its rows beside ``run_id`` (and ``case_name``, except bench's)."""


@dataclass
class RunRecord:
    """One run as the history stores it: the ``runs`` row and, per table, its rows."""

    run: dict[str, Any]
    rows: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


# ------------------------------------------------------------------------- opening, migrating


def open_history(path: Path | str, *, create: bool) -> sqlite3.Connection:
    """A connection to the history at ``path``, migrated to ``SCHEMA_VERSION``: WAL mode, a
    busy timeout, autocommit (transactions are explicit). ``create``: a missing file is made
    (its folder must exist); otherwise it is a ``HistoryError``, as is a file that is not a
    history or one of a newer schema."""
    path = Path(path)
    if path.is_dir():
        raise HistoryError(f"--history {path}: a folder, not a history file")
    if not path.exists():
        if not create:
            raise HistoryError(f"--history {path}: no such file (record a run into it first)")
        if not path.parent.is_dir():
            raise HistoryError(f"--history {path}: its folder {path.parent} does not exist")
    try:
        conn = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_S, isolation_level=None)
    except sqlite3.Error as exc:
        raise HistoryError(f"--history {path}: cannot open it: {exc}") from None
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        conn.execute("PRAGMA foreign_keys = ON")
        _when_unlocked(lambda: conn.execute("PRAGMA journal_mode = WAL"))
        _when_unlocked(lambda: migrate(conn))
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise HistoryError(f"--history {path}: not a readable history: {exc}") from None
    except HistoryError as exc:
        conn.close()
        raise HistoryError(f"--history {path}: {exc}") from None
    return conn


def _when_unlocked(action: Callable[[], Any]) -> Any:
    """``action()``, retried while another connection holds the lock it needs: switching a new
    file to WAL mode is refused at once (SQLite calls no busy handler there) while another
    process does the same, and a read lock taken before ``BEGIN IMMEDIATE`` cannot wait."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            return action()
        except sqlite3.OperationalError as exc:
            locked = "locked" in str(exc) or "busy" in str(exc)
            if not locked or time.monotonic() > deadline:
                raise
            time.sleep(0.01 + random.random() * 0.05)


def schema_version(conn: sqlite3.Connection) -> int:
    """The highest migration applied (0: none, an empty file)."""
    found = conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'"
    ).fetchone()
    if found is None:
        return 0
    return int(conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone()[0])


def migrate(conn: sqlite3.Connection, upto: int = SCHEMA_VERSION) -> int:
    """Apply the migrations after the file's version up to ``upto``, all in one write
    transaction (so two processes opening a new file migrate it once); the version now. A
    file of a newer version, or a database that holds other tables and no version, is a
    ``HistoryError``."""
    if schema_version(conn) >= upto:  # the common case: no write lock taken
        return _refuse_newer(schema_version(conn))
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = schema_version(conn)  # again, under the lock: another writer may have run
        _refuse_newer(version)
        if version == 0:
            others = [
                row[0]
                for row in conn.execute(
                    "SELECT name FROM sqlite_master WHERE type = 'table' "
                    "AND name NOT LIKE 'sqlite_%'"
                )
            ]
            if others:
                raise HistoryError(
                    f"an SQLite database of something else (tables {', '.join(sorted(others))}), "
                    "not an offload-harness history"
                )
        now = _now()
        for step in MIGRATIONS[version:upto]:
            for statement in step.statements:
                conn.execute(statement)
            conn.execute(
                "INSERT INTO schema_version (version, description, applied_utc) VALUES (?, ?, ?)",
                (step.version, step.description, now),
            )
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return max(version, upto)


def _refuse_newer(version: int) -> int:
    if version > SCHEMA_VERSION:
        raise HistoryError(
            f"schema version {version} is newer than this harness's ({SCHEMA_VERSION}); "
            "upgrade offload-harness to read it"
        )
    return version


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


# ----------------------------------------------------------------------------------- writing


def append(conn: sqlite3.Connection, record: RunRecord) -> int:
    """Append ``record`` in one transaction (all of it or nothing); the new run's id."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        run_id = insert_run(conn, record)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return run_id


def insert_run(conn: sqlite3.Connection, record: RunRecord) -> int:
    """The inserts of ``append``, inside the caller's transaction; the new run's id."""
    unknown = set(record.run) - set(RUN_COLUMNS)
    if unknown:
        raise ValueError(f"not run columns: {', '.join(sorted(unknown))}")
    columns = ["recorded_utc", *record.run]
    cursor = conn.execute(
        f"INSERT INTO runs ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
        (_now(), *record.run.values()),
    )
    run_id = int(cursor.lastrowid or 0)
    for table, rows in record.rows.items():
        allowed = {"case_name", *FIGURE_TABLES[table]}
        for row in rows:
            unknown = set(row) - allowed
            if unknown:
                raise ValueError(f"not {table} columns: {', '.join(sorted(unknown))}")
            names = ["run_id", *row]
            conn.execute(
                f"INSERT INTO {table} ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
                (run_id, *row.values()),
            )
    return run_id


# ----------------------------------------------------------------------------------- reading


def runs(conn: sqlite3.Connection, fingerprint: str | None = None) -> list[dict[str, Any]]:
    """Every run (of ``fingerprint``, if given), oldest first, as dicts of ``runs``' columns."""
    query = "SELECT * FROM runs"
    params: tuple[Any, ...] = ()
    if fingerprint is not None:
        query, params = query + " WHERE fingerprint = ?", (fingerprint,)
    cursor = conn.execute(query + " ORDER BY id", params)
    names = [d[0] for d in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor]


def fingerprints(conn: sqlite3.Connection) -> list[str]:
    """The fingerprints recorded, in the order first seen."""
    return [
        row[0]
        for row in conn.execute(
            "SELECT fingerprint FROM runs GROUP BY fingerprint ORDER BY MIN(id)"
        )
    ]


def rows(conn: sqlite3.Connection, table: str, run_ids: Iterable[int]) -> list[dict[str, Any]]:
    """``table``'s rows of the given runs, as dicts (``run_id`` included)."""
    if table not in FIGURE_TABLES:
        raise ValueError(f"no figure table {table!r}")
    ids = sorted(set(run_ids))
    if not ids:
        return []
    cursor = conn.execute(
        f"SELECT * FROM {table} WHERE run_id IN ({', '.join('?' * len(ids))})", ids
    )
    names = [d[0] for d in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor]


def count_runs(conn: sqlite3.Connection) -> int:
    return int(conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0])
