"""Detection power, end to end through pytest (``pytester``): the correct offloader passes the
default matrix, and every broken offloader of the catalogue (``harness.offload.broken``) makes
at least one default case fail with a message naming the step, the microbatch and the group.

To keep the cost down, a broken offloader runs only the case tests its catalogue entry names as
catchers, with ``-x``; the correct one runs every catcher of every entry once (the control: each
test a broken offloader must fail passes with the reference; the outer session's own ``cases/``
run covers the rest of the matrix). The inner sessions run in subprocesses (an in-process
session would re-import torch modules that register operator libraries) on this session's
device, with this process's share of the cores: an inner session with all the cores' threads
spins against the other xdist workers and runs many times slower. Classes CPU cannot show
(pinned memory, host syncs) run on CUDA only; classes the default matrix cannot show (see each
entry's ``needs``) are skipped with that reason.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from harness.judge import CASE_TESTS
from harness.offload.broken import CATALOGUE, NO_DELAYS, BrokenBackend
from harness.offload.reference import RaceDelays
from harness.plugin.options import Settings
from harness.spec import ALL_GROUP_NAMES

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[1]

NAMES_A_GROUP = re.compile(r"\b(" + "|".join(ALL_GROUP_NAMES) + r")\b")


@pytest.fixture
def threads_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inner sessions start with this process's intra-op thread count (``OMP_NUM_THREADS``)."""
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))


def _inner(pytester: pytest.Pytester, settings: Settings, *args: str) -> pytest.RunResult:
    """An inner pytest session over this repository's cases, on this session's device."""
    return pytester.runpytest_subprocess(
        *("--rootdir", str(REPO), "-c", str(REPO / "pyproject.toml"), "-o", "addopts="),
        *("-p", "no:cacheprovider", "--tb=short", "--report-dir", ""),
        *("--device", settings.device.type),
        *args,
    )


def _delays(delays: RaceDelays) -> tuple[str, ...]:
    if delays == NO_DELAYS:
        return ()
    return ("--race-delays", f"d2h={delays.d2h},h2d={delays.h2d},compute={delays.compute}")


def _param(entry: BrokenBackend) -> object:
    marks = []
    if not entry.cpu:
        marks.append(pytest.mark.gpu)
    if not entry.catchers:
        marks.append(pytest.mark.skip(reason=f"the default matrix cannot show it: {entry.needs}"))
    return pytest.param(entry, id=entry.name, marks=marks)


def _catcher_nodes(entry: BrokenBackend, device: torch.device) -> list[str]:
    """The pytest node ids of the case tests that must catch ``entry`` on ``device``."""
    return [
        f"{REPO}/{CASE_TESTS[check]}[{case.name}]"
        for check, case in entry.catchers
        if device.type == "cuda" or check not in ("memory", "sync")
    ]


@pytest.mark.slow
@pytest.mark.usefixtures("threads_share")
def test_correct_offloader_passes_every_catcher(
    pytester: pytest.Pytester, settings: Settings
) -> None:
    nodes = sorted({n for entry in CATALOGUE for n in _catcher_nodes(entry, settings.device)})
    result = _inner(pytester, settings, "--backend", "reference", *nodes)
    outcomes = result.parseoutcomes()
    assert result.ret == pytest.ExitCode.OK, "\n".join(result.outlines[-40:])
    assert outcomes.get("passed", 0) == len(nodes) and not outcomes.get("failed"), outcomes


@pytest.mark.parametrize("entry", [_param(entry) for entry in CATALOGUE])
@pytest.mark.usefixtures("threads_share")
def test_broken_offloader_is_caught(
    entry: BrokenBackend, pytester: pytest.Pytester, settings: Settings
) -> None:
    nodes = _catcher_nodes(entry, settings.device)
    delays = _delays(entry.cuda_delays) if settings.device.type == "cuda" else ()
    result = _inner(pytester, settings, "-x", "--backend", entry.name, *delays, *nodes)
    text = "\n".join(result.outlines)
    assert result.ret == pytest.ExitCode.TESTS_FAILED, f"{entry.name} was not caught:\n{text}"
    failure = text[text.index("FAILURES") :] if "FAILURES" in text else text
    for what, pattern in [
        ("step", re.compile(r"\bstep \d+")),
        ("microbatch", re.compile(r"\bmicrobatch \d+")),
        ("group", NAMES_A_GROUP),
    ]:
        assert pattern.search(failure), f"{entry.name}: the failure names no {what}:\n{failure}"
