"""The default matrix's rows grouped by their plain key, for the memory case's tests of the
shared baseline (``tests/unit/test_memory_reading.py``, ``tests/e2e/test_memory_runs.py``)."""

from __future__ import annotations

from harness.cases import Case, default_matrix
from harness.execute import baselines, environment


def rows_by_plain_key(env: environment.Environment) -> dict[str, list[Case]]:
    """The default matrix's rows by their plain key, in matrix order."""
    keys: dict[str, list[Case]] = {}
    for row in default_matrix():
        keys.setdefault(baselines.plain_key(row, env), []).append(row)
    return keys
