"""The extension axes are registries, checked from outside this interpreter (moved from
``tests/unit/test_registries.py``, whose tests start no process): no module but the registry
names an implementation (``git grep``), and the case table and the settings import without
torch."""

from __future__ import annotations

import subprocess
import sys


def test_no_module_names_an_implementation_but_the_registry() -> None:
    """'is this a megatron-core row' is asked of the registry, never by name."""
    found = subprocess.run(
        [
            "git",
            "grep",
            "-nE",
            r"impl (==|!=|in) |startswith\(\"mcore|MCORE_IMPLS",
            "--",
            "harness",
            "cases",
            ":!harness/vocab/impls.py",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert found.stdout == "", found.stdout


def test_case_table_imports_without_torch() -> None:
    code = "import sys; sys.modules['torch'] = None; import harness.cases, harness.run.settings"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
