"""The package's structure as a fresh interpreter sees it (moved from
``tests/unit/test_layout.py``, whose tests start no process): the case table imports without
torch, the backends table without the broken catalogue."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_case_table_imports_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None; import harness.cases as c; "
        "print(len(c.default_matrix()))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 0


def test_backends_import_without_the_broken_catalogue() -> None:
    """``import harness.offload.backends`` leaves the broken offloaders unimported (they are
    read when a ``broken.<name>`` is first looked up or the backends listed); a fixed name
    resolves without them, and listing brings every one of them in."""
    code = (
        "import sys; import harness.offload.backends as b; "
        "loaded = lambda: 'harness.offload.broken' in sys.modules; "
        "first = loaded(); b.resolve_backend('reference'); b.describe('save-on-cpu'); "
        "second = loaded(); names = b.backend_names(); "
        "print(first, second, loaded(), sum(n.startswith('broken.') for n in names))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    first, second, third, broken = done.stdout.split()
    assert (first, second, third) == ("False", "False", "True"), done.stdout
    assert int(broken) > 10
