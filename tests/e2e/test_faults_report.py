"""A run that survives its own failures, report side: report folders are claimed atomically
(concurrent claims never share one) and proven writable before anything runs (a bad
``--report-dir`` is one line, in pytest a usage error); the commit recorded is the harness's
own, not the current directory's; ``summary.json`` carries a ``status`` and is replaced
atomically; the ``reproduce:`` hint of a failed equivalence check is the fully explicit
``repro`` command. No training: the judge's wiring is checked with its runs stubbed."""

from __future__ import annotations

import json
import multiprocessing
import os
import shlex
import shutil
import subprocess
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from child_pytest import CHILD_OPTIONS

import harness.reporting.report as report
from harness.cases import Case, default_matrix
from harness.cli import _parser, _repro_spec
from harness.execute.environment import Environment
from harness.reporting.report import (
    ReportDirError,
    claim_run_folder,
    commit_info,
    folder_name,
    run_folder,
    summary_text,
    write_summary,
)
from harness.verify.checks import repro_hint
from harness.verify.commands import table_row

pytest_plugins = ["pytester"]

# In-process sessions start as the child sessions do (``child_pytest.CHILD_OPTIONS``):
# without Hypothesis's plugin, which pytester's restored sys.modules made import (and
# assert-rewrite) all of Hypothesis again in every session's terminal summary (~1 s).
PLUGINS = ("-p", "harness.plugin", *CHILD_OPTIONS)
CLAIMS = 8


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, check=True
    ).stdout.strip()


# ------------------------------------------------------------------------ atomic folders


@pytest.mark.parametrize("claim", [run_folder, claim_run_folder])
def test_concurrent_claims_get_distinct_folders(tmp_path: Path, claim: Any) -> None:
    """8 threads claiming one name under one (not yet existing) root at once: 8 folders, the
    name and its -2..-8 suffixes, each created by exactly one claimant."""
    root = tmp_path / "reports"
    barrier = threading.Barrier(CLAIMS)
    got: list[Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            barrier.wait()
            got.append(claim(root, "20250101T000000Z_abc"))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(CLAIMS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(set(got)) == CLAIMS
    names = {"20250101T000000Z_abc", *(f"20250101T000000Z_abc-{i}" for i in range(2, 9))}
    assert {p.name for p in got} == names == {p.name for p in root.iterdir()}
    assert all(not any(p.iterdir()) for p in got), "the write probe is gone"


def _claim_in_child(root: str, barrier: Any, out: Any) -> None:
    barrier.wait()
    out.put(str(claim_run_folder(Path(root), "same")))


def test_concurrent_processes_get_distinct_folders(tmp_path: Path) -> None:
    """The same across processes (forked, released together by a barrier): 4 folders."""
    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(4), ctx.Queue()
    procs = [
        ctx.Process(target=_claim_in_child, args=(str(tmp_path), barrier, out)) for _ in "abcd"
    ]
    for proc in procs:
        proc.start()
    got = [out.get(timeout=60) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
    assert all(proc.exitcode == 0 for proc in procs)
    assert {Path(g).name for g in got} == {"same", "same-2", "same-3", "same-4"}


def test_claim_exact_name_never_reuses(tmp_path: Path) -> None:
    first = claim_run_folder(tmp_path, "night", exact=True)
    assert first == tmp_path / "night"
    with pytest.raises(ReportDirError, match=r"^--report-name night: .* already exists"):
        claim_run_folder(tmp_path, "night", exact=True)


def _one_line(exc: pytest.ExceptionInfo[ReportDirError], root: Path) -> str:
    message = str(exc.value)
    assert "\n" not in message
    assert message.startswith(f"--report-dir {root}: ")
    assert isinstance(exc.value, ValueError)
    return message


def test_claim_on_a_file(tmp_path: Path) -> None:
    file = tmp_path / "f"
    file.write_text("")
    with pytest.raises(ReportDirError) as exc:
        claim_run_folder(file)
    assert "not a folder" in _one_line(exc, file)
    with pytest.raises(ReportDirError) as exc:  # a file as a parent
        claim_run_folder(file / "sub")
    assert "Not a directory" in _one_line(exc, file / "sub")
    assert file.read_text() == ""


def test_claim_under_proc() -> None:
    """/proc takes no folders (as root too: the read-only case that cannot be bypassed)."""
    for root in (Path("/proc/x"), Path("/proc")):
        with pytest.raises(ReportDirError) as exc:
            claim_run_folder(root)
        _one_line(exc, root)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a mode-0555 folder anyway")
def test_claim_in_a_read_only_folder(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        with pytest.raises(ReportDirError) as exc:
            claim_run_folder(locked)
        assert "Permission denied" in _one_line(exc, locked)
    finally:
        locked.chmod(0o755)


def test_claim_that_cannot_write_removes_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folder is made but the probe file cannot be written (here: its folder is missing,
    as root cannot be kept out by permissions): one line, and the empty folder is gone."""
    monkeypatch.setattr(report, "_PROBE", "missing/probe")
    with pytest.raises(ReportDirError) as exc:
        claim_run_folder(tmp_path, "x")
    assert "cannot write into" in _one_line(exc, tmp_path)
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------- pytest plugin


def test_pytest_report_dir_on_a_file_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner="def test_ok():\n    pass\n")
    file = pytester.path / "taken"
    file.write_text("")
    result = pytester.runpytest(*PLUGINS, "--device", "cpu", "--report-dir", str(file))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    lines = [*result.outlines, *result.errlines]
    errors = [line for line in lines if line.startswith("ERROR:")]
    assert errors == [f"ERROR: --report-dir {file}: not a folder (a file is in the way)"], lines
    assert not any("INTERNALERROR" in line for line in lines)
    assert file.read_text() == ""


def test_pytest_report_dir_under_proc_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner="def test_ok():\n    pass\n")
    result = pytester.runpytest(*PLUGINS, "--device", "cpu", "--report-dir", "/proc/x")
    assert result.ret == pytest.ExitCode.USAGE_ERROR


def test_pytest_report_name_that_exists_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner="def test_ok():\n    pass\n")
    argv = (*PLUGINS, "--device", "cpu", "--report-dir", "r", "--report-name", "night")
    pytester.runpytest(*argv).assert_outcomes(passed=1)
    summary = json.loads((pytester.path / "r" / "night" / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["exit_status"] == 0
    before = (pytester.path / "r" / "night" / "summary.json").read_text()
    result = pytester.runpytest(*argv)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert (pytester.path / "r" / "night" / "summary.json").read_text() == before


def test_pytest_claims_its_folder_at_configure(pytester: pytest.Pytester) -> None:
    """The folder exists as soon as the plugin's configure has run (not later, at session
    start, when a session started in the same second could have taken the same name)."""
    pytester.makeconftest(
        """
import pytest
from harness.plugin.report import report_folder

@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    folder = report_folder(config)
    (config.invocation_params.dir / "seen.txt").write_text(f"{folder} {folder.is_dir()}")
"""
    )
    pytester.makepyfile(test_inner="def test_ok():\n    pass\n")
    pytester.runpytest(*PLUGINS, "--device", "cpu", "--report-dir", "c").assert_outcomes(passed=1)
    folder, is_dir = (pytester.path / "seen.txt").read_text().split()
    assert is_dir == "True" and Path(folder).parent == pytester.path / "c"
    assert json.loads((Path(folder) / "summary.json").read_text())["status"] == "complete"


def test_pytest_help_claims_no_folder(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest(*PLUGINS, "--report-dir", "h", "--help")
    assert result.ret == 0
    assert not (pytester.path / "h").exists()


def test_pytest_usage_error_elsewhere_leaves_no_empty_folder(pytester: pytest.Pytester) -> None:
    """Claimed at configure, but another option is refused: the empty folder goes again."""
    pytester.makepyfile(test_inner="def test_ok():\n    pass\n")
    result = pytester.runpytest(*PLUGINS, "--report-dir", "u", "--backend", "no-such-backend")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    root = pytester.path / "u"
    assert not root.exists() or not list(root.iterdir())


def test_judge_gives_the_hint_its_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``judge._equivalence`` passes the run's environment to ``equivalence_problems`` (runs
    stubbed: no training)."""
    import harness.verify.judge as judge

    seen: list[Any] = []
    monkeypatch.setattr(judge, "equivalence_problems", lambda *args: seen.append(args) or [])
    monkeypatch.setattr(judge, "case_record", lambda res: {})
    monkeypatch.setattr(judge, "checksum_coverage", lambda res: {"compared": 1})
    env = Environment(device=torch.device("cpu"), backend="reference", model_size="tiny")
    runs = judge.CaseRuns(default_matrix()[0], env)
    case_run = SimpleNamespace(inert=None)  # a configured offload (not inert)
    monkeypatch.setattr(runs, "case_run", lambda: case_run)
    assert judge._equivalence(runs).status == "pass"
    assert seen == [(runs.case, case_run, env)]


# -------------------------------------------------------------------------------- commit


def _harness_sha() -> str:
    if report._harness_checkout() is None:
        pytest.skip("the harness is installed, not in a checkout")
    return _git("rev-parse", "HEAD", cwd=report.PACKAGE_DIR)


def test_commit_is_the_harness_s_from_another_repository(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sha = _harness_sha()
    other = tmp_path / "project"
    other.mkdir()
    _git("init", "-q", cwd=other)
    ident = ["-c", "user.name=t", "-c", "user.email=t@example.com"]
    _git(*ident, "commit", "-q", "--allow-empty", "-m", "other", cwd=other)
    other_sha = _git("rev-parse", "HEAD", cwd=other)
    monkeypatch.chdir(other)
    commit = commit_info()
    assert commit["sha"] == sha != other_sha
    assert commit["source"] == "git" and commit["version"] == report.HARNESS_VERSION
    assert folder_name().split("_")[1] == sha[:10]
    summary = json.loads(summary_text([]))
    assert summary["commit"]["sha"] == sha
    assert summary["cwd_commit"] == {"path": str(other), "sha": other_sha, "dirty": False}


def test_commit_from_a_plain_folder_and_from_the_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sha = _harness_sha()
    monkeypatch.chdir(tmp_path)  # in no git checkout: the harness's sha, no cwd_commit
    summary = json.loads(summary_text([]))
    assert summary["commit"]["sha"] == sha and "cwd_commit" not in summary
    monkeypatch.chdir(report.PACKAGE_DIR)  # the harness's own checkout: no cwd_commit either
    assert "cwd_commit" not in json.loads(summary_text([]))


def test_commit_of_an_installed_copy_is_its_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A package folder no checkout tracks records the installed version instead (without
    ``OFFLOAD_HARNESS_COMMIT``)."""
    monkeypatch.setattr(report, "PACKAGE_DIR", tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(report.COMMIT_VARIABLE, raising=False)
    commit = commit_info()
    assert commit == {
        "sha": None,
        "dirty": None,
        "source": "package",
        "version": report.HARNESS_VERSION,
    }
    expected = f"v{report.HARNESS_VERSION}" if report.HARNESS_VERSION != "unknown" else "nogit"
    assert folder_name().split("_")[1] == expected


def test_commit_where_git_cannot_tell_is_the_variable_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A package folder no checkout tracks (a copy of the tree without ``.git``) records the
    sha ``OFFLOAD_HARNESS_COMMIT`` names, lowercased, its dirty flag unknown: in the commit, the
    folder name and the summary. Empty, the variable is unset."""
    monkeypatch.setattr(report, "PACKAGE_DIR", tmp_path)
    monkeypatch.chdir(tmp_path)
    given = "0123456789ABCDEF0123456789abcdef01234567"
    monkeypatch.setenv(report.COMMIT_VARIABLE, f" {given}\n")
    sha = given.lower()
    expected = {"sha": sha, "dirty": None, "source": "environment"}
    assert commit_info() == {**expected, "version": report.HARNESS_VERSION}
    assert folder_name().split("_")[1:] == [sha[:10]]  # no _dirty: unknown is not dirty
    assert json.loads(summary_text([]))["commit"]["sha"] == sha
    monkeypatch.setenv(report.COMMIT_VARIABLE, "")
    assert commit_info()["sha"] is None and commit_info()["source"] == "package"


def test_git_wins_over_the_commit_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkout that tracks the package folder: git's sha, whatever the variable says."""
    if shutil.which("git") is None:
        pytest.skip("needs git (builds a checkout)")
    package = tmp_path / "harness"
    package.mkdir()
    (package / "__init__.py").write_text("")
    _git("init", "-q", cwd=tmp_path)
    _git("add", ".", cwd=tmp_path)
    ident = ["-c", "user.name=t", "-c", "user.email=t@example.com"]
    _git(*ident, "commit", "-q", "-m", "package", cwd=tmp_path)
    monkeypatch.setattr(report, "PACKAGE_DIR", package)
    monkeypatch.setenv(report.COMMIT_VARIABLE, "f" * 40)
    sha = _git("rev-parse", "HEAD", cwd=tmp_path)
    assert sha != "f" * 40
    assert commit_info() == {
        "sha": sha,
        "dirty": False,
        "source": "git",
        "version": report.HARNESS_VERSION,
    }


@pytest.mark.parametrize("value", ["main", "123456", "g" * 40, "0" * 65, "abc def0"])
def test_malformed_commit_variable_is_one_line_before_any_folder(
    value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not 7 to 64 hex digits: one line naming the variable and the value, before the report
    folder is made (``run`` turns it into a usage error, exit 2)."""
    monkeypatch.setenv(report.COMMIT_VARIABLE, value)
    with pytest.raises(ValueError) as exc:
        claim_run_folder(tmp_path / "reports")
    message = str(exc.value)
    assert "\n" not in message and message.startswith(f"{report.COMMIT_VARIABLE} must be a git")
    assert repr(value) in message
    assert not (tmp_path / "reports").exists()


def test_pytest_malformed_commit_variable_is_a_usage_error(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_inner="def test_ok():\n    pass\n")
    monkeypatch.setenv(report.COMMIT_VARIABLE, "HEAD")
    result = pytester.runpytest(*PLUGINS, "--device", "cpu", "--report-dir", "m")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    lines = [*result.outlines, *result.errlines]
    errors = [line for line in lines if line.startswith("ERROR:")]
    assert errors == [
        f"ERROR: {report.COMMIT_VARIABLE} must be a git commit sha (7 to 64 hex digits); "
        "the environment has 'HEAD'"
    ], lines
    assert not (pytester.path / "m").exists()


# ------------------------------------------------------------------------------- summary


def test_summary_status(tmp_path: Path) -> None:
    path = write_summary(tmp_path, [], backend="reference")
    assert json.loads(path.read_text())["status"] == "complete"
    for status in ("running", "interrupted", "timed-out"):
        write_summary(tmp_path, [{"name": "a"}], status=status)
        assert json.loads(path.read_text())["status"] == status
    with pytest.raises(ValueError, match="status"):
        write_summary(tmp_path, [], status="done")
    assert json.loads(path.read_text())["status"] == "timed-out", "a refused write changes nothing"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_write_summary_replaces_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The text goes to a temporary file in the same folder, then ``os.replace``; a failed
    replace leaves the previous summary whole and no temporary file."""
    path = write_summary(tmp_path, [{"name": "old"}])
    replaced: list[tuple[Path, Path]] = []
    real_replace = os.replace

    def spy(src: Any, dst: Any) -> None:
        replaced.append((Path(src), Path(dst)))
        assert json.loads(Path(src).read_text())["cases"] == [{"name": "new"}]
        real_replace(src, dst)

    monkeypatch.setattr(report.os, "replace", spy)
    write_summary(tmp_path, [{"name": "new"}])
    ((src, dst),) = replaced
    assert src.parent == tmp_path and dst == path and not src.exists()

    def broken(src: Any, dst: Any) -> None:
        raise OSError("disk went away")

    monkeypatch.setattr(report.os, "replace", broken)
    with pytest.raises(OSError, match="disk went away"):
        write_summary(tmp_path, [{"name": "newer"}])
    assert json.loads(path.read_text())["cases"] == [{"name": "new"}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_reader_never_sees_a_half_written_summary(tmp_path: Path) -> None:
    cases = [{"name": f"case-{i}", "losses": list(range(2000))} for i in range(20)]
    path = write_summary(tmp_path, cases, status="running")
    done = threading.Event()

    def writer() -> None:
        for _ in range(8):
            write_summary(tmp_path, cases, status="running")
        done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    reads = 0
    while not done.is_set():
        assert len(json.loads(path.read_text())["cases"]) == 20
        reads += 1
    thread.join()
    assert reads > 0


# ------------------------------------------------------------------------- reproduce hint

ENV = Environment(device=torch.device("cpu"), backend="broken.corrupt_reload", model_size="tiny")


def _reparsed(hint: str) -> Any:
    assert hint.startswith("reproduce: ")
    argv = shlex.split(hint.removeprefix("reproduce: "))
    assert argv[:2] == ["offload-harness", "repro"] and argv[-1] == "--bisect"
    return argv, _repro_spec(_parser().parse_args(argv[1:]))


def test_reproduce_hint_is_fully_explicit() -> None:
    row = default_matrix()[0]
    case = row.replace(steps=2, max_inflight=None)
    assert table_row(case) == row
    argv, spec = _reparsed(repro_hint(case, ENV))
    flags = dict(zip(argv[2::2], argv[3::2], strict=False))
    assert flags["--case"] == row.name
    assert flags["--backend"] == "broken.corrupt_reload"
    assert flags["--device"] == "cpu" and flags["--model-size"] == "tiny"
    assert flags["--steps"] == "2" and flags["--max-inflight"] == "none"
    assert "--steps 2" in repro_hint(case, ENV)
    assert spec.case == case, "the command reruns exactly the case that failed"
    assert (spec.backend.spelling, str(spec.device), spec.model_size) == (
        "broken.corrupt_reload",
        "cpu",
        "tiny",
    )


def test_reproduce_hint_of_a_row_and_of_a_custom_case() -> None:
    row = default_matrix()[1]
    argv, spec = _reparsed(repro_hint(row, ENV))
    assert spec.case == row and argv[argv.index("--case") + 1] == row.name
    custom = Case(family="hybrid", offload=("core_attn",), custom_pattern="+-+-", steps=2)
    assert table_row(custom) is None
    argv, spec = _reparsed(repro_hint(custom, ENV))
    assert "--case" not in argv and argv[argv.index("--pattern") + 1] == "+-+-"
    assert spec.case.offload == custom.offload and spec.run == custom.run_spec()
    assert spec.model == custom.model_spec("tiny")


def test_command_txt_keeps_a_max_inflight_override() -> None:
    """``repro --case ID --max-inflight none``: command.txt (the same builder) says so."""
    row = default_matrix()[0]
    argv = ["repro", "--device", "cpu", "--case", row.name, "--max-inflight", "none"]
    spec = _repro_spec(_parser().parse_args(argv))
    command = spec.command()
    assert command[command.index("--max-inflight") + 1] == "none"
    assert _repro_spec(_parser().parse_args(command[1:])).case == spec.case
