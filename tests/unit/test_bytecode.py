"""``harness.util.bytecode``: the note for an interpreter that compiles torch at every start;
``-n auto`` on CUDA. Where the note is shown in a pytest session's console is in
``tests/e2e/test_bytecode_processes.py``."""

from __future__ import annotations

import importlib
import py_compile
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from harness.plugin import workers
from harness.run import budget, settings
from harness.util.bytecode import missing_bytecode


def _package(tmp_path: Path, name: str) -> ModuleType:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "__init__.py").write_text("VALUE = 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)


def test_a_package_without_bytecode_in_an_interpreter_writing_none_gets_the_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    module = _package(tmp_path, "nobytecode_pkg")
    note = missing_bytecode(module)
    assert note is not None and note.startswith("nobytecode_pkg has no bytecode cache"), note
    assert "PYTHONDONTWRITEBYTECODE" in note, note
    assert f"-m compileall -q -j 0 {tmp_path}`" in note, note
    py_compile.compile(module.__file__, cfile=importlib.util.cache_from_source(module.__file__))
    assert missing_bytecode(module) is None  # compiled once: nothing to say


def test_a_cache_that_could_not_be_written_names_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    module = _package(tmp_path, "unwritten_pkg")
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # as if writing had failed
    note = missing_bytecode(module)
    assert note is not None and "it could not be written to" in note, note
    assert str(tmp_path / "unwritten_pkg" / "__pycache__") in note, note


def test_a_module_without_a_python_source_gets_no_note() -> None:
    assert missing_bytecode(torch._C) is None  # an extension module


@pytest.mark.parametrize(("device", "expected"), [("cuda", 12), ("cpu", None)])
def test_n_auto_on_cuda_starts_at_most_runs_default_workers(
    device: str, expected: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    class _Config:
        def getoption(self, name: str, default: object = None) -> object:
            return device if name == "device" else default

    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    monkeypatch.setattr("harness.run.settings.usable_cores", lambda: 16)
    monkeypatch.setattr(
        settings, "resolve_device", lambda text: torch.device(text, 0 if text == "cuda" else None)
    )
    # a card that holds 16 of the largest case: the CPU default (3 of 4 of 16 cores) decides
    # (the memory's share: tests/unit/test_gpu_budget.py)
    huge = budget.Card(free=400 << 30, total=400 << 30, name="card", fingerprint="x")
    monkeypatch.setattr(budget, "probe_card", lambda device: huge)
    assert workers.pytest_xdist_auto_num_workers(_Config()) == expected  # type: ignore[arg-type]
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "3")  # xdist's own variable wins
    assert workers.pytest_xdist_auto_num_workers(_Config()) is None  # type: ignore[arg-type]


def test_n_auto_with_a_bad_device_leaves_the_error_to_the_option_check() -> None:
    class _Config:
        def getoption(self, name: str, default: object = None) -> object:
            return "tpu"

    assert workers.pytest_xdist_auto_num_workers(_Config()) is None  # type: ignore[arg-type]
