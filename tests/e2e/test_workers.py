"""The suite's xdist defaults (``harness.plugin.workers``), end to end in subprocesses: a
worker that dies mid-test ends ``pytest -n 2`` with a failure in bounded time instead of hanging
on a replaced worker, and the repository's own configuration runs with ``-p no:xdist``."""

from __future__ import annotations

import importlib.metadata
import subprocess
import time
from pathlib import Path

import pytest
import warm
from child_pytest import HYPOTHESIS_PLUGIN, pytest_command

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[2]

WORKERS_ONLY = ("-p", "no:harness.plugin", "-p", "harness.plugin.workers")
"""The xdist defaults alone: without the rest of the installed plugin (which imports torch,
about 3.4 s of each of the session's three processes on the 2-core CPU)."""

DYING = """
import os, signal, time
import pytest

@pytest.mark.xdist_group("a")
def test_dies():
    time.sleep(1)
    os.kill(os.getpid(), signal.SIGKILL)  # as the case timeout's faulthandler or the OOM killer

@pytest.mark.xdist_group("a")
def test_after_in_group():
    pass

@pytest.mark.parametrize("n", range(6))
def test_other(n):
    time.sleep(0.5)
"""


def _pytest(folder: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m pytest <args>`` in ``folder``, forked warm (``warm.run``); its xdist workers
    are interpreters of their own, as ever."""
    return warm.run(pytest_command(*args), cwd=folder, timeout=timeout)


def test_child_sessions_name_hypothesis_plugin_as_installed() -> None:
    """``child_pytest.CHILD_OPTIONS`` leaves Hypothesis's plugin out by its entry-point name: a
    renamed plugin would silently load again (and cost each child session its import)."""
    names = {entry.name for entry in importlib.metadata.entry_points(group="pytest11")}
    assert HYPOTHESIS_PLUGIN in names, sorted(names)


def test_a_killed_worker_ends_the_session_with_a_failure(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_dying=DYING)
    began = time.monotonic()
    done = _pytest(pytester.path, *WORKERS_ONLY, "-n", "2", timeout=120)
    seconds = time.monotonic() - began
    out = done.stdout
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, out + done.stderr
    assert "crashed while running 'test_dying.py::test_dies@a'" in out, out  # grouped
    assert "restarting disabled" in out, out
    assert "replacing crashed worker" not in out, out
    assert seconds < 60, f"the session took {seconds:.0f} s to end"


def test_loadgroup_is_the_default_under_n(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_groups="""
import os, pytest
@pytest.mark.xdist_group("g")
@pytest.mark.parametrize("n", range(4))
def test_same_worker(n):
    print("WORKER", os.environ["PYTEST_XDIST_WORKER"])
"""
    )
    done = _pytest(pytester.path, *WORKERS_ONLY, "-n", "2", "-rP", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    workers = {line.split()[1] for line in done.stdout.splitlines() if line.startswith("WORKER")}
    assert len(workers) == 1, done.stdout  # one group, one worker


def test_repository_config_runs_without_xdist(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain="def test_ok():\n    pass\n")
    config = ("-c", str(REPO / "pyproject.toml"), "--rootdir", str(pytester.path))
    done = _pytest(
        pytester.path, *config, "-p", "no:xdist", "-p", "harness.plugin.workers", timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


@pytest.mark.heavy
def test_a_case_row_under_n_reaches_its_report_entry(tmp_path: Path) -> None:
    """Under ``-n`` each case test's node id ends in ``@<xdist group>``; the report must still
    file the test under its case (it did not: every case of a ``-n`` session had no tests and
    the verdict ``skipped``, seen in the H200 summary.json of the megatron-core family). The
    suffix is there with any worker count (asserted below through ``-rA``'s node ids)."""
    import json

    root = Path(__file__).resolve().parents[2]
    seed = "hybrid-+-+-+-_core_attn+attn_proj_sequential_bf16"
    out = warm.run(
        pytest_command(
            "-q",
            "-rA",
            "cases/test_equivalence.py::test_no_leaks",
            "-n",
            "1",  # one worker is enough for the suffix, and one interpreter fewer than -n 2
            "-k",
            f"{seed} and not zero3 and not evalfirst and not 6x3 and not pool and not min-",
            "--report-dir",
            str(tmp_path),
        ),
        cwd=root,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    (passed,) = [line for line in out.stdout.splitlines() if line.startswith("PASSED ")]
    assert f"[{seed}]@" in passed, out.stdout  # the node id the report must map back
    (summary,) = tmp_path.glob("*/summary.json")
    (case,) = json.loads(summary.read_text())["cases"]
    assert (case["name"], case["verdict"]) == (seed, "pass")
    assert case["tests"] == {"test_no_leaks": "passed"}
