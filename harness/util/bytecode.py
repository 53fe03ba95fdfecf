"""Whether this interpreter compiles torch from source at every start.

An environment whose torch was installed without bytecode (``uv`` installs that way unless told
``--compile-bytecode``) and whose interpreter writes none (``PYTHONDONTWRITEBYTECODE=1`` or
``-B``) compiles torch's Python sources in every new process: on the H200 box ``import torch``
and TorchDynamo took 9.5 s per process that way and 4.1-4.9 s once compiled. Every pytest-xdist
worker and every forkserver of ``offload-harness run`` pays it, so the harness says so at the
start of a session with the one command that removes it, instead of leaving a slow start
unexplained.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType


def missing_bytecode(module: ModuleType) -> str | None:
    """A one-line note when ``module`` (an imported package) has no cached bytecode for its
    ``__init__`` and this interpreter did not write one; None otherwise (also for a module
    without a source file). Read after the import: an interpreter that may write bytecode has
    written it by then, so a missing file means it cannot."""
    source = getattr(module, "__file__", None)
    if not source or not source.endswith(".py"):
        return None
    cached = importlib.util.cache_from_source(source)
    if os.path.exists(cached):
        return None
    if sys.dont_write_bytecode:
        why = "this interpreter writes none (PYTHONDONTWRITEBYTECODE or -B)"
    else:
        why = f"it could not be written to {os.path.dirname(cached)}"
    packages = os.path.dirname(os.path.dirname(source))
    return (
        f"{module.__name__} has no bytecode cache and {why}: every new process compiles it "
        f"from source (seconds per pytest-xdist or run worker); compile it once with "
        f"`{os.path.basename(sys.executable)} -m compileall -q -j 0 {packages}`"
    )
