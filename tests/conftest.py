"""The harness's own tests: each starts without a shared plain baseline, so a test that patches
how a run trains never reuses another test's (``harness.execute.plain_baseline``).

Each test also runs with ``OFFLOAD_HARNESS_PLOTS=0``, and so do the CLI runs and inner pytest
sessions it starts: their reports are read through ``summary.json`` and ``junit.xml``, and
matplotlib's import and drawing cost 2-3 s of the 2-core CPU per report. The tests of the plots
themselves (``tests/test_report_html.py``, the CLI's report test) turn them back on
(``plots_on``).

Tests marked ``heavy`` (each starts interpreters of its own that import torch: 4-27 s on the
2-core CPU machine) and the ``torchrun`` ones run first, so that under ``-n`` none of them is
the last test a worker takes while the other worker has nothing left."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness.execute import forget_plain_baselines
from harness.settings import PLOTS_VARIABLE


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "heavy: starts interpreters of its own (seconds each); the suite runs it first"
    )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Heavy and torchrun tests first, everything else in the order it had (the plugin's:
    the case groups with the most work first); the sort is stable, so each xdist group's
    tests stay together."""

    def light(item: pytest.Item) -> bool:
        return item.get_closest_marker("heavy") is None and (
            item.get_closest_marker("torchrun") is None
        )

    items.sort(key=light)


@pytest.fixture(autouse=True)
def _reports_without_plots(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PLOTS_VARIABLE, "0")


@pytest.fixture
def plots_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """This test's reports draw their plots (the suite's default is without)."""
    monkeypatch.delenv(PLOTS_VARIABLE, raising=False)


@pytest.fixture(autouse=True)
def _own_plain_baseline() -> Iterator[None]:
    forget_plain_baselines()
    yield
    forget_plain_baselines()
