"""Load one of the repository's ``scripts/`` (Python files without a ``.py`` suffix) as a module,
so the harness's unit tests can call its functions."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str) -> ModuleType:
    """``scripts/<name>`` as the module ``<name>_script`` (registered in ``sys.modules``: a
    dataclass looks its module up while the file runs)."""
    module_name = f"{name}_script"
    loader = importlib.machinery.SourceFileLoader(module_name, str(SCRIPTS / name))
    spec = importlib.util.spec_from_loader(module_name, loader)
    if spec is None:
        raise ImportError(f"cannot load scripts/{name}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    loader.exec_module(module)
    return module
