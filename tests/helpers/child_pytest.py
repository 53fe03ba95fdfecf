"""How the harness's tests start pytest in a child interpreter (``subprocess``, torchrun,
``pytester.runpytest_subprocess``): without the cache provider, and without Hypothesis's own
pytest plugin, which imports all of Hypothesis (about 1 s of the 2-core CPU) in every session's
terminal summary. No child session runs a Hypothesis test (``cases/`` has none; only
``tests/unit/test_offload_roundtrip.py`` uses Hypothesis, in the parent session)."""

from __future__ import annotations

import sys

HYPOTHESIS_PLUGIN = "hypothesispytest"
"""The name Hypothesis registers its pytest plugin under (its ``pytest11`` entry point)."""

CHILD_OPTIONS = ("-p", "no:cacheprovider", "-p", f"no:{HYPOTHESIS_PLUGIN}")
"""The options every child pytest session starts with."""


def pytest_command(*args: str) -> list[str]:
    """``python -m pytest`` in this interpreter, with ``CHILD_OPTIONS`` and then ``args``."""
    return [sys.executable, "-m", "pytest", *CHILD_OPTIONS, *args]


def torchrun_pytest_command(*args: str, ranks: int = 2) -> list[str]:
    """``pytest`` under a standalone torchrun job of ``ranks`` ranks, as ``pytest_command``."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*launcher, f"--nproc-per-node={ranks}", "-m", "pytest", *CHILD_OPTIONS, *args]
