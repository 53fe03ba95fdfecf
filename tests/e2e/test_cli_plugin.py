"""The pytest plugin's options (the ``offload-harness`` CLI's are in ``test_cli.py``): checked
in a nested pytest (``pytester``), and the matrix parametrization by collecting ``cases/`` in a
child process."""

from __future__ import annotations

from pathlib import Path

import pytest
import warm
from child_pytest import CHILD_OPTIONS, pytest_command

from harness.cases import MATRICES, PP_ROWS

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[2]
# In-process sessions start as the child sessions do (``child_pytest.CHILD_OPTIONS``):
# without Hypothesis's plugin, which pytester's restored sys.modules made import (and
# assert-rewrite) all of Hypothesis again in every session's terminal summary (~1 s).
PLUGINS = ("-p", "harness.plugin", *CHILD_OPTIONS)


# ------------------------------------------------------------------------ pytest plugin options

INNER_TEST = """
def test_options_resolved(settings):
    assert settings.matrix == "full"
    assert settings.model_size == "tiny"
    assert settings.device.type == "cpu"
    assert settings.backend.spelling == "hooks"
"""


def test_plugin_options_resolve(pytester: pytest.Pytester) -> None:
    """Positive control: valid options reach the ``settings`` fixture."""
    pytester.makepyfile(test_inner=INNER_TEST)
    result = pytester.runpytest(
        *PLUGINS, "--device", "cpu", "--matrix", "full", "--backend", "hooks"
    )
    result.assert_outcomes(passed=1)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--device", "bogus"),
        ("--matrix", "huge"),
        ("--backend", "nope"),
        ("--model-size", "xl"),
    ],
)
def test_plugin_rejects_bad_option(pytester: pytest.Pytester, option: str, value: str) -> None:
    pytester.makepyfile(test_inner=INNER_TEST)
    result = pytester.runpytest(*PLUGINS, option, value)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = [line for line in result.errlines if line.strip()]
    assert len(errors) == 1, result.errlines
    assert option in errors[0] and repr(value) in errors[0], errors[0]


def _collected_case_ids(*options: str) -> list[str]:
    """Test ids ``pytest --collect-only`` finds in cases/test_equivalence.py (repo root)."""
    command = pytest_command("--collect-only", "-q", "cases/test_equivalence.py")
    command += ["--device", "cpu", *options]
    done = warm.run(command, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    prefix = "cases/test_equivalence.py::test_loss_equivalence["
    return [line[len(prefix) : -1] for line in done.stdout.splitlines() if line.startswith(prefix)]


@pytest.mark.heavy
@pytest.mark.parametrize("matrix", ["default", "full"])
def test_matrix_option_parametrizes_case_tests(matrix: str) -> None:
    ids = _collected_case_ids("--matrix", matrix)
    # the matrix's rows, and the pipeline rows every session of our models adds (they skip
    # where the world size does not fit: harness.plugin.cases.skip_reason)
    expected = [*MATRICES[matrix](), *PP_ROWS]
    assert sorted(ids) == sorted(c.name for c in expected)  # longest groups first
