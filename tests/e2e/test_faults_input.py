"""Bad input is refused before any training, as one line: a backend module that raises at import
(any exception, a ``SyntaxError`` too), a factory that raises or returns something other than an
``Offloader`` (``harness.offload.backends.probe_backend``, called by ``harness.run.settings``),
``+delays`` without CUDA, and step/microbatch counts beyond ``harness.vocab.spec``'s ceilings or the
machine's memory (``check_fits``).

Each probe runs through ``offload-harness run`` (exit 2, one stderr line, nothing trained) and,
where pytest takes the setting, through the plugin in a nested pytest (usage error, exit 4, an
``ERROR:`` line, no ``INTERNALERROR``). The fake backend modules are written into the test's
folder, which goes on ``sys.path`` (in process) or ``PYTHONPATH`` (the nested pytest).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from child_pytest import CHILD_OPTIONS

from harness import cli
from harness.cases import Case
from harness.models.hybrid import make_batches
from harness.offload import backends
from harness.run import settings
from harness.util import globalstate
from harness.vocab.fits import available_memory, check_fits, run_bytes
from harness.vocab.spec import MAX_MICROBATCHES, MAX_STEPS, RunSpec, preset

pytest_plugins = ["pytester"]

CPU = torch.device("cpu")

MODULES = {
    "faultmod_import": 'raise RuntimeError("boom at import\\nsecond line of the message")\n',
    "faultmod_syntax": "import os\n\nx = = 1\n",
    "faultmod_missing_dep": "import faultmod_no_such_dependency  # noqa: F401\n",
    "faultmod_factories": """
from harness.offload.passthrough import NoOffload
from harness.offload.protocol import declare

CLOSED = []


def raises(config, device):
    raise RuntimeError("boom")


def returns_none(config, device):
    return None


def returns_object(config, device):
    return object()


class Partial:
    name = "partial"

    def group(self, name, x, *, layer):
        return None

    def mark_not_offloadable(self, *tensors):
        return None

    def set_enabled(self, enabled):
        return None

    def iteration_logs(self):
        return []

    def close(self):
        CLOSED.append(self)


def partial(config, device):
    return Partial()


class Counted(NoOffload):
    name = "counted"

    def close(self):
        CLOSED.append(self)


class CloseRaises(NoOffload):
    def close(self):
        raise OSError("stream busy")


@declare(unavailable=lambda device: "faultmod_factories.unavailable never runs here")
def unavailable(config, device):
    raise AssertionError("an unavailable backend must not be probed")
""",
}

ERRORS = {
    "import-raises": (
        "faultmod_import:make",
        "--backend: backend 'faultmod_import:make': importing faultmod_import raised "
        "RuntimeError: boom at import",
    ),
    "syntax-error": (
        "faultmod_syntax:make",
        "--backend: backend 'faultmod_syntax:make': importing faultmod_syntax raised "
        "SyntaxError: invalid syntax (faultmod_syntax.py, line 3)",
    ),
    "factory-raises": (
        "faultmod_factories:raises",
        "--backend: backend 'faultmod_factories:raises': the factory raised RuntimeError: boom",
    ),
    "returns-none": (
        "faultmod_factories:returns_none",
        "--backend: backend 'faultmod_factories:returns_none': the factory returned None, not "
        "an Offloader",
    ),
    "returns-object": (
        "faultmod_factories:returns_object",
        "--backend: backend 'faultmod_factories:returns_object': the factory returned object "
        "without name, begin_microbatch, group, mark_not_offloadable, end_iteration, "
        "set_enabled, iteration_logs, close, not an Offloader (harness.offload.protocol)",
    ),
}
"""Backend probes: spelling -> the error line both entry points print (after their prefix)."""

DELAYS_ON_CPU = "--race-delays / <backend>+delays need a CUDA device (GPU sleep kernels); " + (
    "this run is on cpu"
)


def _write_modules(folder: Path) -> None:
    for name, text in MODULES.items():
        (folder / f"{name}.py").write_text(text)


@pytest.fixture
def fault_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The fake backend modules, importable in this process; forgotten afterwards."""
    folder = tmp_path / "fault_modules"
    folder.mkdir()
    _write_modules(folder)
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    for name in MODULES:
        sys.modules.pop(name, None)


@pytest.fixture
def trained(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every training the run started (each one is refused; the list must stay empty)."""
    calls: list[Any] = []

    def refuse(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        raise AssertionError("trained although the input is bad")

    monkeypatch.setattr("harness.models.train.train_harness", refuse)
    return calls


def _custom_run(tmp_path: Path, *flags: str) -> list[str]:
    return [
        *("run", "--device", "cpu", "--pattern", "+-", "--offload", "core_attn"),
        *("--report-dir", str(tmp_path / "reports"), *flags),
    ]


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err, err
    assert "Traceback" not in captured.err + captured.out
    prefix = "offload-harness: error: "
    assert err.startswith(prefix), err
    return err[len(prefix) :]


def _nested_pytest(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, *args: str) -> Any:
    _write_modules(pytester.path)
    pytester.syspathinsert()  # in-process: sys.path and sys.modules are restored afterwards
    pytester.makepyfile("def test_nothing():\n    pass\n")
    # as a child session starts (``child_pytest.CHILD_OPTIONS``): without Hypothesis's plugin,
    # which imported all of Hypothesis again in each in-process session's summary
    return pytester.runpytest("-p", "harness.plugin", *CHILD_OPTIONS, "--device", "cpu", *args)


def _assert_usage_error(result: Any, message: str) -> None:
    output = result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.USAGE_ERROR, output
    assert f"ERROR: {message}" in result.stderr.str(), output
    assert "INTERNALERROR" not in output, output
    assert "Traceback" not in output, output


# ------------------------------------------------------------------------ importing a backend


def test_a_module_raising_at_import_is_one_line(fault_modules: Path) -> None:
    for spec, message in (ERRORS["import-raises"], ERRORS["syntax-error"]):
        with pytest.raises(ValueError) as info:
            backends.resolve_backend(spec)
        assert f"--backend: {info.value}" == message
    # Twice: a failed import leaves nothing in sys.modules, so it fails the same way again.
    with pytest.raises(ValueError, match="importing faultmod_import raised RuntimeError"):
        backends.resolve_backend("faultmod_import:make")


def test_an_import_error_inside_the_module_still_says_cannot_import(fault_modules: Path) -> None:
    with pytest.raises(ValueError) as info:
        backends.resolve_backend("faultmod_missing_dep:make")
    assert str(info.value) == (
        "backend 'faultmod_missing_dep:make': cannot import 'faultmod_missing_dep' "
        "(No module named 'faultmod_no_such_dependency')"
    )


def test_exception_line_is_type_and_first_line() -> None:
    assert backends.exception_line(RuntimeError("a\nb")) == "RuntimeError: a"
    assert backends.exception_line(KeyError()) == "KeyError"
    error = SyntaxError("invalid syntax")
    error.filename, error.lineno = "/somewhere/mod.py", 7
    assert backends.exception_line(error) == "SyntaxError: invalid syntax (mod.py, line 7)"


# ---------------------------------------------------------------------------- probing a factory


@pytest.mark.parametrize("probe", ["factory-raises", "returns-none", "returns-object"])
def test_the_probe_refuses_what_is_not_an_offloader(fault_modules: Path, probe: str) -> None:
    spec, message = ERRORS[probe]
    backends.resolve_backend(spec)  # resolution alone accepts it: the factory is callable
    with pytest.raises(ValueError) as info:
        backends.probe_backend(spec, CPU)
    assert f"--backend: {info.value}" == message


def test_the_probe_names_the_missing_methods_and_closes(fault_modules: Path) -> None:
    module = sys.modules.get("faultmod_factories") or __import__("faultmod_factories")
    with pytest.raises(ValueError) as info:
        backends.probe_backend("faultmod_factories:partial", CPU)
    assert str(info.value) == (
        "backend 'faultmod_factories:partial': the factory returned faultmod_factories.Partial "
        "without begin_microbatch, end_iteration, not an Offloader (harness.offload.protocol)"
    )
    assert len(module.CLOSED) == 1  # what it built is still closed
    backends.probe_backend("faultmod_factories:Counted", CPU)
    assert len(module.CLOSED) == 2
    with pytest.raises(ValueError) as info:
        backends.probe_backend("faultmod_factories:CloseRaises", CPU)
    assert str(info.value) == (
        "backend 'faultmod_factories:CloseRaises': close() of a fresh offloader raised "
        "OSError: stream busy"
    )


def test_an_unavailable_backend_is_not_probed(fault_modules: Path) -> None:
    spec = "faultmod_factories:unavailable"
    backends.probe_backend(spec, CPU)  # the factory would raise AssertionError
    assert backends.backend_unavailable(spec, CPU) == (
        "faultmod_factories.unavailable never runs here"
    )
    assert settings.resolve({"backend": spec, "device": "cpu"}).backend.spelling == spec


def test_every_named_backend_passes_the_probe_on_cpu() -> None:
    for name in backends.backend_names():
        backends.probe_backend(name, CPU)  # mcore*: unavailable on CPU, so not called
        assert settings.resolve({"backend": name, "device": "cpu"}).backend.spelling == name
    assert backends.backend_unavailable("mcore", CPU) is not None


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, *, initialized: bool) -> None:
    """A visible GPU in this process; using it here (a current device) fails the test."""

    def initialises(*args: object) -> int:
        raise AssertionError("CUDA initialised in this process")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
    monkeypatch.setattr(torch.cuda, "current_device", initialises)


def test_on_cuda_the_probe_runs_in_a_child_until_cuda_is_initialised(
    fault_modules: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec, message = ERRORS["returns-none"]
    cuda = torch.device("cuda", 0)
    real_gpu = torch.cuda.is_available()
    _fake_cuda(monkeypatch, initialized=False)
    # A real child process (the factory is never called in this one): on a machine without a
    # GPU it proves nothing and the run goes ahead; on one with a GPU it probes there.
    if real_gpu:
        with pytest.raises(ValueError) as info:
            backends.probe_backend(spec, cuda)
        assert f"--backend: {info.value}" == message
    else:
        backends.probe_backend(spec, cuda)
    children: list[tuple[str, torch.device]] = []

    def child(spec: str, device: torch.device) -> str:
        children.append((spec, device))
        return message.removeprefix("--backend: ")

    monkeypatch.setattr(backends, "_probe_in_child", child)
    with pytest.raises(settings.SettingError) as info:
        settings.resolve_backend(spec, cuda)
    assert (str(info.value), children) == (message, [(spec, cuda)])
    _fake_cuda(monkeypatch, initialized=True)  # initialised already: probed here
    # (the global-state guard around the factory would read the fake GPU's stream and RNG)
    monkeypatch.setattr(globalstate, "_cuda", lambda: False)
    with pytest.raises(ValueError, match="returned None, not an Offloader"):
        backends.probe_backend(spec, cuda)
    assert len(children) == 1


def test_the_child_probe_prints_the_error_line(
    fault_modules: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    spec, message = ERRORS["returns-object"]
    for cuda_visible, expected in ((True, message.removeprefix("--backend: ")), (False, None)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda visible=cuda_visible: visible)
        backends._child_probe(spec, "cpu")  # the child's side, in this process
        assert capsys.readouterr().out == f"offload-harness-probe:{json.dumps(expected)}\n"


def test_settings_probe_the_backend(fault_modules: Path) -> None:
    spec, message = ERRORS["returns-none"]
    with pytest.raises(settings.SettingError) as info:
        settings.resolve({"backend": spec, "device": "cpu"})
    assert str(info.value) == message


# ------------------------------------------------------------ the CLI and pytest refuse up front


@pytest.mark.parametrize("probe", list(ERRORS))
def test_cli_refuses_a_bad_backend_before_training(
    fault_modules: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    trained: list[Any],
    probe: str,
) -> None:
    spec, message = ERRORS[probe]
    assert cli.main(_custom_run(tmp_path, "--steps", "1", "--backend", spec)) == 2
    assert _one_error_line(capsys) == message
    assert trained == []
    assert not (tmp_path / "reports").exists()


@pytest.mark.parametrize("probe", list(ERRORS))
def test_pytest_refuses_a_bad_backend_as_a_usage_error(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, probe: str
) -> None:
    spec, message = ERRORS[probe]
    _assert_usage_error(_nested_pytest(pytester, monkeypatch, "--backend", spec), message)


def test_delays_need_cuda_in_cli_and_pytest(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    trained: list[Any],
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if torch.cuda.is_available():
        pytest.skip("the refusal is for a session without CUDA")
    for argv in (["--backend", "reference+delays"], ["--race-delays", "d2h=1"]):
        assert cli.main(_custom_run(tmp_path, "--steps", "1", *argv)) == 2
        assert _one_error_line(capsys) == DELAYS_ON_CPU
    assert trained == []
    with pytest.raises(settings.SettingError, match="need a CUDA device"):
        settings.resolve_backend("broken.noop+delays:d2h=5", CPU)
    result = _nested_pytest(pytester, monkeypatch, "--backend", "reference+delays")
    _assert_usage_error(result, DELAYS_ON_CPU)


# ----------------------------------------------------------------------- steps and microbatches

HUGE = {
    "steps-1e9": (
        ("--steps", "1000000000"),
        "RunSpec.steps must be an int from 1 to 1_000_000, got 1000000000",
    ),
    "steps-beyond-int64": (
        ("--steps", "99999999999999999999999"),
        "RunSpec.steps must be an int from 1 to 1_000_000, got 99999999999999999999999",
    ),
    "microbatches-1e8": (
        ("--microbatches", "100000000"),
        "RunSpec.microbatches must be an int from 1 to 1_000, got 100000000",
    ),
}


@pytest.mark.parametrize("probe", list(HUGE))
@pytest.mark.parametrize("command", ["run", "repro"])
def test_cli_refuses_absurd_counts_before_training(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    trained: list[Any],
    probe: str,
    command: str,
) -> None:
    flags, message = HUGE[probe]
    argv = _custom_run(tmp_path, *flags)
    argv[0] = command
    assert cli.main(argv) == 2
    assert _one_error_line(capsys) == message
    assert trained == []


def test_run_spec_bounds() -> None:
    assert RunSpec(steps=MAX_STEPS, microbatches=MAX_MICROBATCHES).steps == MAX_STEPS
    for field, value in (
        ("steps", MAX_STEPS + 1),
        ("microbatches", MAX_MICROBATCHES + 1),
        ("steps", 2**63),
        ("steps", 0),
        ("microbatches", True),
        ("steps", 1.0),
    ):
        with pytest.raises(ValueError, match=rf"RunSpec\.{field} must be"):
            RunSpec(**{field: value})
    # Every (step, microbatch) of the largest run still gets its own data generator
    # (harness.models.hybrid.make_batches seeds it with step * 1_009 + microbatch).
    assert MAX_MICROBATCHES < 1_009


def test_case_refuses_absurd_counts_through_its_run_spec() -> None:
    row = dict(family="hybrid", offload=("core_attn", "attn_proj"))
    with pytest.raises(ValueError, match=r"RunSpec\.steps must be an int from 1 to 1_000_000"):
        Case(**row, steps=10**9)
    with pytest.raises(ValueError, match=r"RunSpec\.microbatches must be an int from 1 to 1_000"):
        Case(**row, microbatches=10**8)
    assert Case(**row, steps=MAX_STEPS).run_spec().steps == MAX_STEPS


# --------------------------------------------------------------------------- memory: check_fits


def test_run_bytes_is_what_the_runner_allocates() -> None:
    model, run = preset("hybrid-tiny"), RunSpec(steps=3, microbatches=2)
    batches = make_batches(model, seed=run.seed, steps=run.steps, microbatches=run.microbatches)
    losses = torch.zeros(run.steps, run.microbatches)
    expected = batches.element_size() * batches.numel() + losses.element_size() * losses.numel()
    assert run_bytes(model, run) == expected


def test_check_fits_refuses_what_the_machine_cannot_hold() -> None:
    tiny, small = preset("hybrid-tiny"), preset("hybrid-small")
    check_fits(tiny, RunSpec(), available_bytes=10**9)
    run = RunSpec(steps=MAX_STEPS, microbatches=MAX_MICROBATCHES)
    with pytest.raises(ValueError) as info:
        check_fits(tiny, run, available_bytes=22 * 10**9)
    assert str(info.value) == (
        "--steps 1000000 x --microbatches 1000 needs 532 GB of token batches (2000000000 "
        "sequences of 33 int64 tokens, and the losses); this machine has 22 GB available"
    )
    with pytest.raises(ValueError, match=r"needs 33 GB of token batches .* has 8\.0 GB available"):
        check_fits(small, RunSpec(steps=MAX_STEPS), available_bytes=8 * 10**9)
    need = run_bytes(small, RunSpec(steps=1000))
    check_fits(small, RunSpec(steps=1000), available_bytes=need)  # exactly enough passes
    with pytest.raises(ValueError, match=r"needs 33 MB .* this machine has 16 MB available"):
        check_fits(small, RunSpec(steps=1000), available_bytes=need // 2)
    with pytest.raises(ValueError):
        check_fits(small, RunSpec(steps=1000), available_bytes=need - 1)


def test_check_fits_reads_the_machine_and_skips_when_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    available = available_memory()
    if Path("/proc/meminfo").is_file():
        assert available is not None and available > 0
    monkeypatch.setattr("harness.vocab.fits.available_memory", lambda: 1000)
    with pytest.raises(ValueError, match=r"this machine has 1\.0 kB available"):
        check_fits(preset("hybrid-tiny"), RunSpec())
    monkeypatch.setattr("harness.vocab.fits.available_memory", lambda: None)
    check_fits(preset("hybrid-tiny"), RunSpec(steps=MAX_STEPS, microbatches=MAX_MICROBATCHES))


def test_cli_refuses_a_run_that_cannot_fit_before_training(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from harness import cli
    from harness.vocab.fits import available_memory

    free = available_memory()
    if free is None or free > 500e9:
        pytest.skip("needs a machine with less than 500 GB available to refuse 532 GB")
    argv = ["--device", "cpu", "--pattern", "+-", "--offload", "core_attn"]
    argv += ["--steps", "1000000", "--microbatches", "1000"]
    for command in ("run", "repro"):
        assert cli.main([command, *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert "needs 532 GB of token batches" in err and "\n" not in err, err


def test_repro_checks_its_report_dir_before_the_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from harness import cli

    taken = tmp_path / "taken"
    taken.write_text("")

    def reproduce(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("repro trained before refusing its --report-dir")

    monkeypatch.setattr(cli, "reproduce", reproduce)
    argv = ["repro", "--device", "cpu", "--pattern", "+-", "--offload", "core_attn"]
    assert cli.main([*argv, "--report-dir", str(taken)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"offload-harness: error: --report-dir {taken}: "), err
