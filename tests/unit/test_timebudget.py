"""``offload-harness time-budget``'s judgement of a timed figure (the timing itself runs in CI's
job, never in a test: a timed test would fail on a loaded machine)."""

from __future__ import annotations

import pytest

from harness.tools import timebudget
from harness.tools.timebudget import FIGURES, judge, spread


def test_a_figure_within_its_scaled_budget_is_ok_and_says_the_ratio() -> None:
    # 27 s on a machine half as fast as the reference (x2.00): run's 15 s budget becomes 30 s
    line = judge("run", 27.0, 0, 2.0)
    assert line.startswith("OK      run")
    assert "budget   30.0 s (15 s x 2.00 machine)  0.90 of budget" in line


def test_a_figure_over_its_budget_is_a_warning_line() -> None:
    line = judge("suite", 150.0, 0, 1.0)
    assert line.startswith("WARNING suite")
    assert "1.25 of budget" in line


def test_a_failed_command_is_named_and_its_time_not_judged() -> None:
    line = judge("unit", 5.0, 1, 1.0)
    assert line.startswith("WARNING unit")
    assert "exit 1" in line and "of budget" not in line


def test_the_budgets_are_the_issues() -> None:
    assert {name: f.budget_s for name, f in FIGURES.items()} == {
        "suite": 120.0,
        "unit": 60.0,
        "run": 15.0,
    }


def test_spread_is_the_median_and_the_range() -> None:
    assert spread([12.0, 10.0, 30.0]) == "  12.0 s (10.0-30.0)"


def test_an_unknown_figure_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert timebudget.main(["--figures", "run,lint"]) == 2
    assert capsys.readouterr().err == "time-budget: no figure 'lint' (suite, unit, run)\n"


def test_given_needs_a_known_figure_and_seconds() -> None:
    with pytest.raises(SystemExit, match="no figure 'lint'"):
        timebudget._given("lint=3")
    with pytest.raises(SystemExit, match="seconds must be a number"):
        timebudget._given("run=fast")


def test_the_suite_figure_is_the_readmes_pytest_command(tmp_path) -> None:
    (tmp_path / "README.md").write_text(
        "# x\n<!-- test-command -->\n```\npip install -e . && python3 -m pytest -n 3\n```\n"
    )
    command = timebudget.readme_pytest(tmp_path)
    assert command[1:] == ["-m", "pytest", "-n", "3", "-q", "-p", "no:cacheprovider"]
    (tmp_path / "README.md").write_text("<!-- test-command -->\n```\nmake test\n```\n")
    with pytest.raises(ValueError, match="not a pytest command"):
        timebudget.readme_pytest(tmp_path)
