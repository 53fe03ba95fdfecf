"""One settings model (``harness.run.settings``) in the CLI and in a pytest session (moved from
``tests/unit/test_settings.py`` and ``tests/unit/test_declarations.py``: a pytest session started
here starts processes of its own, its plugins' ``git`` and ``file`` calls): a bad value, a
CUDA-only setting on the CPU, an empty ``--report-dir``, and the deprecated ``--family``."""

from __future__ import annotations

import pytest
import torch

from harness import cli

pytest_plugins = ["pytester"]

NOTICE = "offload-harness: --family is deprecated; use --models (the same values)"
"""As ``tests/unit/test_declarations.py`` writes it out."""


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--device", "gpu", "--device must be auto, cpu, cuda or cuda:N; got 'gpu'"),
        ("--model-size", "huge", "--model-size must be one of auto, tiny, small; got 'huge'"),
        ("--models", "theirs", "--models must be one of harness, mcore, all; got 'theirs'"),
        ("--matrix", "nightly", "--matrix must be one of default, full; got 'nightly'"),
        ("--backend", "nope", "--backend: unknown backend 'nope'"),
        ("--nvte-cpu-offload-v1", "2", "--nvte-cpu-offload-v1 must be 0 or 1; it is '2'"),
    ],
)
def test_bad_value_is_the_same_one_line_error_in_cli_and_pytest(
    pytester: pytest.Pytester,
    capsys: pytest.CaptureFixture[str],
    flag: str,
    value: str,
    message: str,
) -> None:
    assert cli.main(["run", flag, value]) == 2
    cli_error = capsys.readouterr().err.strip()
    assert cli_error.startswith(f"offload-harness: error: {message}"), cli_error
    assert "\n" not in cli_error
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest("-p", "harness.plugin", flag, value)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert f"ERROR: {message}" in result.stderr.str(), result.stderr.str()


def test_race_delays_need_cuda_in_cli_and_pytest(
    pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    if torch.cuda.is_available():
        pytest.skip("the refusal is for a session without CUDA")
    message = "--race-delays / <backend>+delays need a CUDA device"
    for argv in (["--race-delays", "d2h=1"], ["--backend", "reference+delays"]):
        assert cli.main(["run", "--device", "cpu", *argv]) == 2
        assert message in capsys.readouterr().err
        pytester.makepyfile("def test_nothing():\n    pass\n")
        result = pytester.runpytest("-p", "harness.plugin", "--device", "cpu", *argv)
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        assert message in result.stderr.str()


def test_cuda_sanitizer_needs_cuda_in_cli_and_pytest(
    pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    message = "--cuda-sanitizer needs a CUDA device"
    assert cli.main(["run", "--device", "cpu", "--cuda-sanitizer"]) == 2
    assert message in capsys.readouterr().err
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest("-p", "harness.plugin", "--device", "cpu", "--cuda-sanitizer")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert message in result.stderr.str()


def test_empty_report_dir_writes_nothing_in_run_and_pytest(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(pytester.path)
    case = "hybrid-+-+-+-_core_attn+attn_proj_sequential_bf16"
    code = cli.main(["run", "--device", "cpu", "--case", case, "--steps", "2", "--report-dir", ""])
    assert code in (0, 1)
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest("-p", "harness.plugin", "--report-dir", "")
    assert result.ret == 0
    leftovers = sorted(p.name for p in pytester.path.iterdir() if p.is_dir())
    assert "reports" not in leftovers, leftovers


def test_the_family_alias_works_in_pytest(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        "def test_models(settings):\n    assert settings.models == 'mcore', settings.models\n"
    )
    result = pytester.runpytest("-p", "harness.plugin", "--family", "mcore", "--report-dir", "")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    assert result.stderr.str().count(NOTICE) == 1, result.stderr.str()
    result = pytester.runpytest("-p", "harness.plugin", "--models", "mcore", "--report-dir", "")
    assert result.ret == pytest.ExitCode.OK and NOTICE not in result.stderr.str()
