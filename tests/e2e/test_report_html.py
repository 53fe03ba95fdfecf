"""Reports: index.html and its plots rendered from a summary.json, the CLI's JUnit XML, and the
pytest session report (folder, pytest's own JUnit XML pointed into it, summary counts, per-case
entries from ``record_result``) in nested sessions (``pytester``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest
from child_pytest import CHILD_OPTIONS

from harness.cases import default_matrix
from harness.reporting.html import render_index
from harness.reporting.plots import ulp_matrix
from harness.reporting.report import write_junit, write_summary

pytest_plugins = ["pytester"]

pytestmark = pytest.mark.usefixtures("plots_on")  # the suite's reports skip them elsewhere

# In-process sessions start as the child sessions do (``child_pytest.CHILD_OPTIONS``):
# without Hypothesis's plugin, which pytester's restored sys.modules made import (and
# assert-rewrite) all of Hypothesis again in every session's terminal summary (~1 s).
PLUGINS = ("-p", "harness.plugin", *CHILD_OPTIONS)
PNG = b"\x89PNG\r\n\x1a\n"


def _case(name: str, offset: float, verdict: str) -> dict[str, Any]:
    plain = [[4.0 - 0.1 * s, 4.05 - 0.1 * s] for s in range(3)]
    offload = [[v + (offset if s >= 1 else 0.0) for v in row] for s, row in enumerate(plain)]
    per_name = {
        f"{d}:{n}": {"copies": c, "bytes": c * 4096}
        for d in ("d2h", "h2d")
        for n, c in (("core_attn", 4), ("attn_proj", 2))
    }
    return {
        "name": name,
        "verdict": verdict,
        "equivalence": "pass" if verdict == "pass" else "transport",
        "losses": {"plain": plain, "hooks": plain, "offload": offload},
        "transfers": {
            "names_moved": ["attn_proj", "core_attn"],
            "d2h_copies": 6,
            "h2d_copies": 6,
            "d2h_bytes": 6 * 4096,
            "per_name": per_name,
        },
        "golden": {"status": "match" if verdict == "pass" else "mismatch", "message": "drift!"},
        "problems": [] if verdict == "pass" else ["transport corruption: <first divergence>"],
        "duration": 1.5,
    }


def _summary_folder(tmp_path: Path, cases: list[dict[str, Any]]) -> Path:
    folder = tmp_path / "run"
    folder.mkdir()
    write_summary(folder, cases, backend="reference", device="cpu", seconds=3.0)
    return folder


def test_index_and_plots_render_from_the_summary(tmp_path: Path) -> None:
    cases = [_case("case-a", 0.0, "pass"), _case("case-<b>", 1e-3, "fail")]
    folder = _summary_folder(tmp_path, cases)
    began = time.perf_counter()
    index = render_index(folder)
    seconds = time.perf_counter() - began
    text = index.read_text()
    assert "case-a" in text and "case-&lt;b&gt;" in text, "names are escaped"
    assert "1/2 cases passed" in text and "1 drifted" in text
    assert "transport corruption: &lt;first divergence&gt;" in text and "drift!" in text
    assert '<a href="summary.json">' in text
    pngs = sorted(p.name for p in (folder / "plots").iterdir())
    assert pngs == ["bytes.png", "copies.png", "loss_diff.png", "losses-1.png"]
    for name in pngs:
        assert (folder / "plots" / name).read_bytes()[:8] == PNG
        assert f'src="plots/{name}"' in text
    assert seconds < 30, f"rendering two cases took {seconds:.1f}s"


def test_ulp_matrix() -> None:
    cases = [_case("a", 0.0, "pass"), _case("b", 2**-21, "fail"), {"name": "c"}]
    rows = ulp_matrix(cases)
    assert rows[0] == [0.0] * 6
    assert rows[1][:2] == [0.0, 0.0] and all(v > 0 for v in rows[1][2:])
    assert all(v != v for v in rows[2]), "a case without losses is NaN"


def test_cli_junit(tmp_path: Path) -> None:
    folder = _summary_folder(tmp_path, [_case("case-a", 0.0, "pass"), _case("b", 1.0, "fail")])
    summary = json.loads((folder / "summary.json").read_text())
    root = ElementTree.parse(write_junit(folder, summary)).getroot()
    (suite,) = root
    assert suite.get("tests") == "2" and suite.get("failures") == "1"
    passed, failed = suite.findall("testcase")
    assert passed.get("name") == "case-a" and passed.find("failure") is None
    failure = failed.find("failure")
    assert failure is not None and "transport corruption" in (failure.text or "")


# ----------------------------------------------------------------- the pytest session report

CASE_ID = default_matrix()[0].name
INNER = f"""
import pytest

@pytest.mark.parametrize("n", [1], ids=["{CASE_ID}"])
def test_case_like(n, record_result):
    record_result("{CASE_ID}", {{"losses": {{"plain": [[1.0]], "offload": [[1.0]]}}}})

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "one is not two"

@pytest.mark.skip(reason="not today")
def test_skipped():
    pass
"""


def _one_folder(parent: Path) -> Path:
    folders = [p for p in parent.iterdir() if p.is_dir()]
    assert len(folders) == 1, folders
    return folders[0]


def test_session_writes_the_report(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest(*PLUGINS, "--device", "cpu", "--report-dir", "out")
    result.assert_outcomes(passed=2, failed=1, skipped=1)
    folder = _one_folder(pytester.path / "out")
    assert sorted(p.name for p in folder.iterdir()) == [
        "index.html",
        "junit.xml",
        "plots",
        "summary.json",
    ]
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["tests"] == {"collected": 4, "passed": 2, "failed": 1, "skipped": 1}
    assert summary["failed_tests"] == ["test_inner.py::test_fails"]
    assert summary["exit_status"] == 1
    (case,) = summary["cases"]
    assert case["name"] == CASE_ID and case["verdict"] == "pass"
    assert case["tests"] == {"test_case_like": "passed"}
    suites = ElementTree.parse(folder / "junit.xml").getroot()
    assert len(suites.findall(".//testcase")) == 4, "pytest's own JUnit XML"
    assert f"offload-harness report: {folder / 'index.html'}" in result.stdout.str()


def test_session_report_options(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner="def test_ok():\n    pass\n")
    result = pytester.runpytest(*PLUGINS, "--device", "cpu", "--report-dir", "")
    result.assert_outcomes(passed=1)
    assert not [p for p in pytester.path.iterdir() if p.is_dir() and p.name[0] not in "_."]

    result = pytester.runpytest(
        *PLUGINS, "--device", "cpu", "--report-dir", "r", "--report-name", "night"
    )
    result.assert_outcomes(passed=1)
    assert (pytester.path / "r" / "night" / "summary.json").is_file()
    assert (pytester.path / "r" / "night" / "junit.xml").is_file()

    result = pytester.runpytest(
        *PLUGINS, "--device", "cpu", "--report-dir", "j", "--junitxml", "mine.xml"
    )
    assert (pytester.path / "mine.xml").is_file(), "a user's --junitxml is left where asked"
    assert not (_one_folder(pytester.path / "j") / "junit.xml").exists()

    result = pytester.runpytest(*PLUGINS, "--device", "cpu", "--report-dir", "c", "--co")
    assert not (pytester.path / "c").exists(), "--collect-only writes no report"

    result = pytester.runpytest(*PLUGINS, "--report-name", "a/b")
    assert result.ret == pytest.ExitCode.USAGE_ERROR


def test_plotting_preloads_off_the_main_thread_with_the_file_backend() -> None:
    """``run`` imports matplotlib on a daemon thread while its cases run; the rendering then
    finds pyplot loaded, on the Agg backend (files only, never a display)."""
    import sys

    from harness.reporting.plots import preload_plotting

    thread = preload_plotting()
    assert thread.daemon and thread.name == "preload-plotting"
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert "matplotlib.pyplot" in sys.modules and "matplotlib.ticker" in sys.modules
    assert sys.modules["matplotlib"].get_backend().lower() == "agg"


def test_plots_off_leave_the_index_without_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``OFFLOAD_HARNESS_PLOTS=0``: the index says why it has no plots and none is drawn."""
    monkeypatch.setenv("OFFLOAD_HARNESS_PLOTS", "0")
    folder = _summary_folder(tmp_path, [_case("a", 0.0, "pass")])
    text = render_index(folder).read_text()
    assert "No plots: OFFLOAD_HARNESS_PLOTS=0." in text and "<img" not in text
    assert not (folder / "plots").exists()


def test_a_bad_plots_value_is_one_line_before_any_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OFFLOAD_HARNESS_PLOTS", "no")
    pytester.makepyfile(test_inner="def test_ok():\n    pass\n")
    result = pytester.runpytest(*PLUGINS, "--device", "cpu", "--report-dir", "r")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "OFFLOAD_HARNESS_PLOTS must be 0 or 1; the environment has 'no'" in result.stderr.str()
    from harness.cli import main

    capsys.readouterr()
    argv = ["run", "--device", "cpu", "--case", default_matrix()[0].name, "--report-dir", "r"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("OFFLOAD_HARNESS_PLOTS must be 0 or 1; the environment has 'no'"), err
    assert "\n" not in err
