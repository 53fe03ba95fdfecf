"""The detection tests' shared runs (``tests/helpers/shared_runs.py``): a test that judges cases
without changing how a run trains takes ``shared_runs``, and identical trainings run once per
process; one that judges a row of the case table joins that row's xdist group
(``pytest.mark.judges_row(case)``) so that it runs on the worker that ran the row's case tests,
after them, and reads their runs.

Every test here ends with this process's intra-op thread count as it found it: the mutation
score run in this process sets its own (``harness.tools.mutation_rows.use``: all the cores
unless told otherwise), and an xdist worker left with both cores' threads spins against the
other worker for the rest of the session (the tiny models' steps took many times the CPU)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from shared_runs import SHARED, SharedRuns, row_group


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "judges_row(case): judges that row of the case table; runs in the xdist group of its "
        "case tests (tests/detection/conftest.py)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``judges_row(case)`` becomes the xdist group of the row's case tests (before xdist's
    worker reads the groups into the node ids)."""
    for item in items:
        marker = item.get_closest_marker("judges_row")
        if marker is not None:
            item.add_marker(pytest.mark.xdist_group(row_group(config, marker.args[0])))


@pytest.fixture(autouse=True)
def _own_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def shared_runs(_case_runs: dict[str, Any]) -> Iterator[SharedRuns]:
    """The process's shared runs, installed for this test (``shared_runs.SharedRuns``)."""
    with SHARED.installed(_case_runs) as shared:
        yield shared
