"""One settings model (``harness.run.settings``): every entry point takes a setting with the same
flag, default, help and error - the CLI's subcommands, the tools and the pytest plugin. The
checks that start a pytest session beside the CLI: ``tests/e2e/test_settings_processes.py``."""

from __future__ import annotations

import argparse

import pytest
import torch

from harness import cli
from harness.plugin.options import PYTEST_OPTIONS
from harness.run import settings
from harness.tools import mutation_score, nightly


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings}


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_cli_and_pytest_options_come_from_one_table(pytestconfig: pytest.Config) -> None:
    run = _actions(_subparser("run"))
    shared = [name for name in PYTEST_OPTIONS if name in run]
    assert set(shared) >= {"backend", "device", "model_size", "report_dir", "matrix", "models"}
    for name in shared:
        option = settings.OPTIONS[name]
        assert run[name].option_strings == [option.flag]
        assert run[name].help == option.help
        assert run[name].default == (False if option.switch else option.default), name
    group = pytestconfig._parser.getgroup("offload-harness")
    registered = {arg.names()[0]: arg.attrs() for arg in group.options}
    for name in PYTEST_OPTIONS:
        option = settings.OPTIONS[name]
        assert registered[option.flag]["help"] == option.help, name
        assert registered[option.flag].get("default", False) == (
            False if option.switch else option.default
        ), name


def test_device_resolver_accepts_the_same_spellings_everywhere() -> None:
    assert settings.resolve_device("cpu") == torch.device("cpu")
    auto = settings.resolve_device("auto")
    assert auto.type == ("cuda" if torch.cuda.is_available() else "cpu")
    for bad in ("cuda:x", "cpu:0", "tpu", "cuda:"):
        with pytest.raises(settings.SettingError, match="--device must be auto, cpu, cuda or"):
            settings.resolve_device(bad)
    if not torch.cuda.is_available():
        for text in ("cuda", "cuda:0"):
            with pytest.raises(settings.SettingError, match="no CUDA device is visible"):
                settings.resolve_device(text)
    else:
        count = torch.cuda.device_count()
        assert settings.resolve_device(f"cuda:{count - 1}") == torch.device("cuda", count - 1)
        with pytest.raises(settings.SettingError, match="CUDA device"):
            settings.resolve_device(f"cuda:{count}")


def test_model_size_and_jobs_rules() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert settings.resolve_model_size("auto", cpu) == "tiny"
    assert settings.resolve_model_size("auto", cuda) == "small"
    assert settings.resolve_model_size("small", cpu) == "small"
    assert settings.resolve_jobs(None, cuda, tasks=1) == 1
    assert settings.resolve_jobs(None, cpu, tasks=1) == 1
    assert settings.resolve_jobs("3", cpu, tasks=2) == 2
    for bad in ("0", "-1", "x", "1.5"):
        with pytest.raises(settings.SettingError, match="--jobs must be an int >= 1"):
            settings.resolve_jobs(bad, cpu, tasks=4)


def test_tools_take_the_shared_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        mutation_score.main(["--device", "gpu"])
    assert exit_info.value.code == 2
    assert "--device must be auto, cpu, cuda or cuda:N; got 'gpu'" in capsys.readouterr().err
    assert nightly.main(["--jobs", "0", "--dry-run"]) == 2
    assert "--jobs must be an int >= 1; got '0'" in capsys.readouterr().err
    assert nightly.main(["--backend", "nope", "--dry-run"]) == 2
    assert "--backend: unknown backend 'nope'" in capsys.readouterr().err


def test_nvte_cpu_offload_v1_defaults_to_the_environment_then_1(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("NVTE_CPU_OFFLOAD_V1", raising=False)
    assert settings.resolve({"device": "cpu"}).nvte_cpu_offload_v1 == "1"
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "0")
    resolved = settings.resolve({"device": "cpu"})
    assert resolved.nvte_cpu_offload_v1 == "0"
    assert (
        settings.resolve({"device": "cpu", "nvte_cpu_offload_v1": "1"}).nvte_cpu_offload_v1 == "1"
    )
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "yes")
    with pytest.raises(settings.SettingError, match="NVTE_CPU_OFFLOAD_V1 in the environment"):
        settings.resolve({"device": "cpu"})
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    settings.apply(resolved)  # exported for TransformerEngine's first import
    import os

    assert os.environ["NVTE_CPU_OFFLOAD_V1"] == "0"


def test_a_sanitizer_race_is_one_line_naming_streams_ops_and_frames() -> None:
    import traceback

    from torch.cuda import _sanitizer as csan

    from harness.verify.judge import raised

    def access(kind: csan.AccessType, stream: int, op: str, where: str) -> csan.Access:
        frame = traceback.FrameSummary(where, 12, "reload")
        stack = traceback.StackSummary.from_list([frame])
        return csan.Access(kind, 1, stream, op, ["self"], False, stack)

    error = csan.UnsynchronizedAccessError(
        1234,
        None,
        access(csan.AccessType.READ, 7, "aten::mm", "/repo/harness/models/layers.py"),
        access(csan.AccessType.WRITE, 9, "aten::copy_", "/repo/harness/offload/reference.py"),
    )
    line = raised(csan.CUDASanitizerErrors([error, error]))
    assert "\n" not in line
    assert line == (
        "the CUDA stream sanitizer found 2 possible data race(s); the first, on the device "
        "tensor at data pointer 1234: stream 7 reads it in aten::mm "
        "(/repo/harness/models/layers.py:12 reload) without waiting for stream 9's write in "
        "aten::copy_ (/repo/harness/offload/reference.py:12 reload)"
    )


def test_unknown_setting_is_refused() -> None:
    with pytest.raises(settings.SettingError, match="unknown settings: colour"):
        settings.resolve({"colour": "red"})


def test_every_setting_is_documented() -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "options.md").read_text()
    for option in settings.OPTIONS.values():
        assert f"| `{option.flag}` |" in text, option.flag
