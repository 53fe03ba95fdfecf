"""The harness's own tests: each starts without a shared plain baseline, so a test that patches
how a run trains never reuses another test's (``harness.execute.baselines.plain_baseline``).

Each test also runs with ``OFFLOAD_HARNESS_PLOTS=0``, and so do the CLI runs and inner pytest
sessions it starts: their reports are read through ``summary.json`` and ``junit.xml``, and
matplotlib's import and drawing cost 2-3 s of the 2-core CPU per report. The tests of the plots
themselves (``tests/e2e/test_report_html.py``, the CLI's report test) turn them back on
(``plots_on``).

Tests marked ``heavy`` (each starts interpreters of its own that import torch: 4-27 s on the
2-core CPU machine) and the ``torchrun`` ones run first, so that under ``-n`` none of them is
the last test a worker takes while the other worker has nothing left.

The ``torchrun`` drills (each a torchrun job of 2 gloo ranks that fails, hangs, hangs in a
collective or is killed, and waits out its timeouts: 60-80 s of one worker on the 2-core CPU
machine) run when asked for: with ``-m`` naming them (``-m torchrun``, as CI's torchrun step
does) or by node id. A run without ``-m`` deselects them and says so in its summary."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.execute.baselines import forget_plain_baselines
from harness.run.settings import PLOTS_VARIABLE

HELPERS = Path(__file__).resolve().parent / "helpers"
"""Offloaders written for the tests and the end-to-end plumbing (``tests/README.md``): importable
by their bare names (``--backend offloaders:Name``), here and in every process a test starts
from this one's ``sys.path``."""
if str(HELPERS) not in sys.path:
    sys.path.insert(0, str(HELPERS))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "heavy: starts interpreters of its own (seconds each); the suite runs it first"
    )


def _without_drills(config: pytest.Config) -> bool:
    """Whether this session leaves the torchrun drills out: no ``-m``, no node id."""
    return not config.option.markexpr and not any("::" in arg for arg in config.args)


def _drills_in_scope(config: pytest.Config) -> bool:
    """Whether this session's paths hold the drills (``tests/`` or their file): the xdist
    controller collects nothing itself, so it reads the paths, not the items."""
    here = Path(__file__).parent
    drills = here / "e2e" / "test_distributed.py"
    return not hasattr(config, "workerinput") and any(
        Path(arg).resolve() in (here, drills.parent, drills) for arg in config.args
    )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The torchrun drills deselected unless asked for; then heavy and torchrun tests first,
    everything else in the order it had (the plugin's: the case groups with the most work
    first); the sort is stable, so each xdist group's tests stay together."""
    if _without_drills(config):
        drills = [item for item in items if item.get_closest_marker("torchrun") is not None]
        if drills:
            config.hook.pytest_deselected(items=drills)
            items[:] = [item for item in items if item.get_closest_marker("torchrun") is None]

    def light(item: pytest.Item) -> bool:
        return item.get_closest_marker("heavy") is None and (
            item.get_closest_marker("torchrun") is None
        )

    items.sort(key=light)


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    if _without_drills(config) and _drills_in_scope(config):
        terminalreporter.write_line(
            "the torchrun drills (multi-rank fault injection, about a minute) were left out: "
            "run them with `python3 -m pytest -m torchrun tests/`"
        )


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
