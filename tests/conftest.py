"""The harness's own tests: each starts without a shared plain baseline, so a test that patches
how a run trains never reuses another test's (``harness.execute.plain_baseline``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness.execute import forget_plain_baselines


@pytest.fixture(autouse=True)
def _own_plain_baseline() -> Iterator[None]:
    forget_plain_baselines()
    yield
    forget_plain_baselines()
