"""The bytecode note in a pytest session's console (moved from ``tests/unit/test_bytecode.py``:
a pytest session started here starts processes of its own, its plugins' ``git`` calls)."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]


def test_the_pytest_console_shows_the_note_even_under_q(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        "harness.util.bytecode.missing_bytecode", lambda module: f"NOTE {module.__name__}"
    )
    pytester.makepyfile(test_plain="def test_ok():\n    pass\n")
    done = pytester.runpytest_inprocess(
        "-q", "-p", "no:harness.plugin", "-p", "harness.plugin.workers"
    )
    done.assert_outcomes(passed=1)
    assert "offload-harness: note: NOTE torch" in done.stdout.str()
