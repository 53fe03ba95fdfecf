"""The guard of ``tests/unit``'s rule on a pytest session of its own (its plugins start
processes, so it is not a unit test): with ``tests/unit/conftest.py``, a test that steps an
optimizer or starts a process, itself or in a fixture's setup, fails with the guard's one line;
a fixture that trains in its teardown errors there with it; a clean test passes. The watch
itself: ``tests/unit/test_unit_rule.py``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from unit_rule import RULE

pytest_plugins = ["pytester"]

UNIT_CONFTEST = Path(__file__).resolve().parents[1] / "unit" / "conftest.py"

TESTS = """
import subprocess
import sys

import pytest
import torch


def _step() -> None:
    parameter = torch.nn.Parameter(torch.ones(1))
    parameter.grad = torch.ones(1)
    torch.optim.SGD([parameter], lr=1.0).step()


def test_steps():
    _step()
    _step()


def test_starts():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_clean():
    layer = torch.nn.Linear(2, 2)
    layer(torch.ones(1, 2)).sum().backward()


@pytest.fixture
def trained():
    _step()


def test_uses_a_fixture_that_trains(trained):
    pass


@pytest.fixture
def trains_afterwards():
    yield
    _step()


def test_uses_a_fixture_that_trains_in_its_teardown(trains_afterwards):
    pass
"""


def test_the_guard_fails_a_unit_test_that_trains_or_starts_a_process(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeconftest(UNIT_CONFTEST.read_text())
    pytester.makepyfile(test_rule=TESTS)
    # -vv: the short summary's lines whole, not cut to the terminal's width
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:harness.plugin", "-rfE", "-vv")
    result.assert_outcomes(passed=2, failed=3, errors=1)
    result.stdout.fnmatch_lines(
        [
            f"FAILED test_rule.py::test_steps - Failed: test_steps stepped an optimizer "
            f"2 time(s); {RULE}",
            f"FAILED test_rule.py::test_starts - Failed: test_starts started a process "
            f"(1 call(s), the first subprocess.Popen {sys.executable} -c pass); {RULE}",
            f"FAILED test_rule.py::test_uses_a_fixture_that_trains - Failed: "
            f"test_uses_a_fixture_that_trains stepped an optimizer 1 time(s); {RULE}",
            "ERROR test_rule.py::test_uses_a_fixture_that_trains_in_its_teardown - Failed: "
            f"test_uses_a_fixture_that_trains_in_its_teardown stepped an optimizer 1 time(s); "
            f"{RULE}",
        ],
        consecutive=False,
    )
    assert "test_clean" not in result.stdout.str().split("short test summary")[-1]
