"""What the command-line tests read of ``offload-harness``'s output."""

from __future__ import annotations

import pytest


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The one line on stderr, ``offload-harness: error: ...`` (bad input refused)."""
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {err!r}"
    assert lines[0].startswith("offload-harness: error:"), lines[0]
    return lines[0]
