"""The harness's own tests: each starts without a shared plain baseline, so a test that patches
how a run trains never reuses another test's (``harness.execute.plain_baseline``).

Each test also runs with ``OFFLOAD_HARNESS_PLOTS=0``, and so do the CLI runs and inner pytest
sessions it starts: their reports are read through ``summary.json`` and ``junit.xml``, and
matplotlib's import and drawing cost 2-3 s of the 2-core CPU per report. The tests of the plots
themselves (``tests/test_report_html.py``, the CLI's report test) turn them back on
(``plots_on``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness.execute import forget_plain_baselines
from harness.settings import PLOTS_VARIABLE


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
