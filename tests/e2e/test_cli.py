"""The ``offload-harness`` CLI and the pytest plugin's options.

Bad input: exit code 2 and one line on stderr. Listings: the case ids and backend names. One
real passing run (report on disk) and one failing run whose backend corrupts every reload
(transport corruption must be reported). The pytest options are checked in a nested pytest
(``pytester``) and the matrix parametrization by collecting ``cases/`` in a subprocess.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import warm
from child_pytest import pytest_command

from harness.cases import MATRICES, default_matrix, full_matrix
from harness.cli import main
from harness.offload.config import OffloadConfig
from harness.offload.reference import OffloadContext

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[2]
PLUGINS = ("-p", "harness.plugin")


# ---------------------------------------------------------------------------- a broken backend


class FlipSignOffloader(OffloadContext):
    """The reference offloader with a transport bug: every reloaded floating tensor comes back
    with its first element negated (the hooks and the graph are untouched)."""

    name = "broken.flip_sign"

    def _copy_in(self, group: Any, entry: Any) -> torch.Tensor:
        restored = super()._copy_in(group, entry)
        if not restored.is_floating_point() or restored.numel() == 0:
            return restored
        corrupted = restored.clone()
        first = (0,) * corrupted.dim()
        corrupted[first] = -corrupted[first]
        return corrupted


def flip_sign_offloader(config: OffloadConfig, device: torch.device) -> FlipSignOffloader:
    """Backend factory (``module:flip_sign_offloader``) of the broken offloader."""
    return FlipSignOffloader(config, device)


# This module's import name depends on pytest's import mode ("test_cli" or "tests.test_cli");
# the name it was imported under always resolves to this very module object.
FLIP_SIGN_BACKEND = f"{__name__}:flip_sign_offloader"


# ---------------------------------------------------------------------------------- bad input

CUSTOM = ("run", "--device", "cpu", "--steps", "1")
ONE_LAYER = (*CUSTOM, "--pattern", "+-", "--offload", "core_attn")

BAD_INPUT = {
    "unknown-symbol": [*CUSTOM, "--pattern", "+x-", "--offload", "core_attn"],
    "mixed-attention": [*CUSTOM, "--pattern", "+*", "--offload", "core_attn"],
    "not-applicable": [*CUSTOM, "--pattern", "+-+-+-", "--offload", "mlp_norm"],
    "conflicting": [*CUSTOM, "--pattern", "*E*E", "--offload", "fused_group_mlp,expert_fc1"],
    "attn_proj-alone": [*CUSTOM, "--pattern", "+-", "--offload", "attn_proj"],
    "unknown-module": [*CUSTOM, "--pattern", "+-", "--offload", "core_atn"],
    "pattern-without-offload": [*CUSTOM, "--pattern", "+-"],
    "unknown-backend": [*CUSTOM, "--backend", "nope"],
    "unimportable-backend": [*CUSTOM, "--backend", "no_such_module_xyz:factory"],
    "max-inflight-word": [*ONE_LAYER, "--max-inflight", "many"],
    "max-inflight-negative": [*ONE_LAYER, "--max-inflight", "-1"],
    "unknown-case": ["run", "--device", "cpu", "--case", "no-such-case"],
    "case-and-pattern": [
        *("run", "--device", "cpu", "--case", default_matrix()[0].name),
        *("--pattern", "+-", "--offload", "core_attn"),
    ],
    "unknown-subcommand": ["frobnicate"],
    "no-subcommand": [],
    "unknown-option": ["run", "--frobnicate"],
    "bad-schedule": [*CUSTOM, "--schedule", "zigzag"],
    "bad-steps": [*CUSTOM, "--steps", "two"],
    "bad-matrix": ["cases", "--matrix", "huge"],
    "update-golden-custom": [*ONE_LAYER, "--update-golden"],
    "overrides-on-the-matrix": ["run", "--device", "cpu", "--steps", "2"],
    "bad-override-of-a-row": [
        *("run", "--device", "cpu", "--case", default_matrix()[0].name, "--microbatches", "0")
    ],
}


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {err!r}"
    assert lines[0].startswith("offload-harness: error:"), lines[0]
    return lines[0]


@pytest.mark.parametrize("argv", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = main([*argv, "--report-dir", str(tmp_path)] if argv[:1] == ["run"] else argv)
    line = _one_error_line(capsys)
    assert code == 2, line
    assert not list(tmp_path.iterdir()), "a rejected run must not write a report"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (BAD_INPUT["unknown-symbol"], "'x'"),
        (BAD_INPUT["not-applicable"], "mlp_norm"),
        (BAD_INPUT["conflicting"], "fused_group_mlp"),
        (BAD_INPUT["unknown-backend"], "--backend"),
        (BAD_INPUT["max-inflight-word"], "--max-inflight"),
        (BAD_INPUT["unknown-case"], "no-such-case"),
        (BAD_INPUT["case-and-pattern"], "--case"),
        (BAD_INPUT["unknown-option"], "--frobnicate"),
        (BAD_INPUT["unknown-subcommand"], "frobnicate"),
    ],
)
def test_error_line_names_the_problem(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert needle in _one_error_line(capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is visible: --device cuda is valid")
def test_device_cuda_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--device", "cuda", "--pattern", "+-", "--offload", "core_attn"]) == 2
    assert "cuda" in _one_error_line(capsys)


# ----------------------------------------------------------------------------------- listings


def _stdout_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    out, err = capsys.readouterr()
    assert err == ""
    return out.splitlines()


def test_cases_lists_the_default_matrix(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cases"]) == 0
    ids = _stdout_lines(capsys)
    assert ids == [c.name for c in default_matrix()]
    assert len(ids) >= 17 and len(set(ids)) == len(ids)
    # The seed case comes first.
    assert ids[0] == "hybrid-+-+-+-_core_attn+attn_proj_sequential_bf16"


def test_cases_full_lists_the_full_matrix(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cases", "--matrix", "full"]) == 0
    ids = _stdout_lines(capsys)
    assert ids == [c.name for c in full_matrix()]
    assert len(ids) >= 192 and len(set(ids)) == len(ids)
    assert "hybrid-+-+-+-_core_attn+attn_proj_1f1b_bf16_inflight-none" in ids


def test_backends_lists_the_builtins(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends"]) == 0
    lines = _stdout_lines(capsys)
    assert [line.split()[0] for line in lines[:3]] == ["reference", "none", "hooks"]
    assert all(len(line.split(maxsplit=1)) == 2 for line in lines), "a line lacks a description"


# ----------------------------------------------------------------------------------- real runs

# Two attention layers: after the warmup the last core_attn/attn_proj of each microbatch stays on
# the device (its backward comes right after the forward, the "margin" policy), so with a single
# attention layer ("+-") the steady state would offload nothing and the run is refused as
# proving nothing (test_run_that_offloads_nothing_is_refused). Layer 0 keeps offloading here.
RUN = ["run", "--device", "cpu", "--pattern", "+-+-", "--offload", "core_attn,attn_proj"]
RUN += ["--steps", "3"]
CASE_NAME = "hybrid-+-+-_core_attn+attn_proj_sequential_fp32_3x2"


def _only_summary(report_dir: Path) -> dict[str, Any]:
    summaries = list(report_dir.glob("*/summary.json"))
    assert len(summaries) == 1, summaries
    assert [p.name for p in report_dir.iterdir()] == [summaries[0].parent.name]
    return json.loads(summaries[0].read_text())


@pytest.mark.heavy
@pytest.mark.usefixtures("plots_on")
def test_run_passes_and_writes_a_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main([*RUN, "--report-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    table = out[out.index("case ") :]
    assert CASE_NAME in table and "pass" in table
    assert "1/1 cases passed" in out

    summary = _only_summary(tmp_path)
    (case,) = summary["cases"]
    assert case["name"] == CASE_NAME
    assert case["verdict"] == "pass" and case["problems"] == []
    losses = {k: torch.tensor(v) for k, v in case["losses"].items()}
    assert set(losses) == {"plain", "hooks", "offload"}
    assert losses["plain"].shape == (3, 2)
    assert torch.equal(losses["offload"], losses["plain"])
    # a passing case's hooks baseline trains its first iteration only
    assert torch.equal(losses["hooks"], losses["plain"][:1])
    # where the case's time went, run by run
    assert {"plain", "hooks", "offload", "disabled"} <= set(case["run_seconds"])
    assert all(seconds >= 0 for seconds in case["run_seconds"].values())
    assert case["plain_baseline"] == {"key": case["plain_baseline"]["key"], "made_by": CASE_NAME}
    assert torch.isfinite(losses["plain"]).all()
    transfers = case["transfers"]
    assert transfers["d2h_bytes"] == transfers["h2d_bytes"] > 0
    assert transfers["d2h_copies"] == transfers["h2d_copies"] > 0
    assert set(transfers["names_moved"]) == {"core_attn", "attn_proj"}
    assert case["golden"]["status"] == "missing"  # a custom case has no golden trace
    folder = next(tmp_path.iterdir())
    assert {p.name for p in folder.iterdir()} == {
        "summary.json",
        "junit.xml",
        "index.html",
        "plots",
    }
    assert CASE_NAME in (folder / "index.html").read_text()
    assert "<testcase" in (folder / "junit.xml").read_text()
    assert f"report: {folder / 'index.html'}" in out


def test_run_that_offloads_nothing_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One attention layer: only the warmup offloads; the final step moves nothing, and a case
    that cannot prove anything is a failure, not a pass."""
    argv = ["run", "--device", "cpu", "--pattern", "+-", "--offload", "core_attn,attn_proj"]
    code = main([*argv, "--steps", "3", "--report-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "the prediction moves nothing in the final step" in out
    (case,) = _only_summary(tmp_path)["cases"]
    assert case["verdict"] == "fail"
    assert case["equivalence"] == "pass"  # the numbers themselves are fine


def test_run_reports_transport_corruption(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main([*RUN, "--backend", FLIP_SIGN_BACKEND, "--report-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1, out
    assert f"FAIL {CASE_NAME}" in out
    assert "transport corruption" in out
    assert "first divergence" in out
    (case,) = _only_summary(tmp_path)["cases"]
    assert case["verdict"] == "fail"
    assert case["equivalence"] == "transport"
    # The hooks baseline is untouched by the bug; only the offload run diverges.
    assert case["losses"]["hooks"] == case["losses"]["plain"]
    assert case["losses"]["offload"] != case["losses"]["plain"]


# ------------------------------------------------------------------------ pytest plugin options

INNER_TEST = """
def test_options_resolved(settings):
    assert settings.matrix == "full"
    assert settings.model_size == "tiny"
    assert settings.device.type == "cpu"
    assert settings.backend.spelling == "hooks"
"""


def test_plugin_options_resolve(pytester: pytest.Pytester) -> None:
    """Positive control: valid options reach the ``settings`` fixture."""
    pytester.makepyfile(test_inner=INNER_TEST)
    result = pytester.runpytest(
        *PLUGINS, "--device", "cpu", "--matrix", "full", "--backend", "hooks"
    )
    result.assert_outcomes(passed=1)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--device", "bogus"),
        ("--matrix", "huge"),
        ("--backend", "nope"),
        ("--model-size", "xl"),
    ],
)
def test_plugin_rejects_bad_option(pytester: pytest.Pytester, option: str, value: str) -> None:
    pytester.makepyfile(test_inner=INNER_TEST)
    result = pytester.runpytest(*PLUGINS, option, value)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = [line for line in result.errlines if line.strip()]
    assert len(errors) == 1, result.errlines
    assert option in errors[0] and repr(value) in errors[0], errors[0]


def _collected_case_ids(*options: str) -> list[str]:
    """Test ids ``pytest --collect-only`` finds in cases/test_equivalence.py (repo root)."""
    command = pytest_command("--collect-only", "-q", "cases/test_equivalence.py")
    command += ["--device", "cpu", *options]
    done = warm.run(command, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    prefix = "cases/test_equivalence.py::test_loss_equivalence["
    return [line[len(prefix) : -1] for line in done.stdout.splitlines() if line.startswith(prefix)]


@pytest.mark.heavy
@pytest.mark.parametrize("matrix", ["default", "full"])
def test_matrix_option_parametrizes_case_tests(matrix: str) -> None:
    ids = _collected_case_ids("--matrix", matrix)
    assert sorted(ids) == sorted(c.name for c in MATRICES[matrix]())  # longest groups first


# ------------------------------------------------------------------ --jobs, also on one GPU


class _Stop(Exception):
    """Raised by a stand-in to end a run before it would touch a device."""


def _fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """A visible GPU whose use in this (parent) process fails the test: picking the device,
    counting jobs and spawning must not initialise CUDA here."""

    def initialises(*args: object) -> int:
        raise AssertionError("CUDA initialised in the parent process")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", initialises)
    monkeypatch.setattr(torch.cuda, "set_device", initialises)


@pytest.mark.parametrize(
    ("jobs", "device", "cases", "expected"),
    [
        (4, "cuda", 21, 4),  # asked: workers share the GPU
        (8, "cuda", 3, 3),  # never more workers than cases
        (1, "cuda", 21, 1),
        (3, "cpu", 21, 3),
        (None, "cpu", 1, 1),
    ],
)
def test_jobs(jobs: int | None, device: str, cases: int, expected: int) -> None:
    from harness.run.settings import resolve_jobs

    where = torch.device(device, 0 if device == "cuda" else None)
    assert resolve_jobs(jobs, where, cases) == expected


def test_jobs_default_on_cpu_is_one_per_core(monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.run.settings import resolve_jobs

    monkeypatch.setattr("harness.run.settings.usable_cores", lambda: 16)
    assert resolve_jobs(None, torch.device("cpu"), 21) == 16
    assert resolve_jobs(None, torch.device("cpu"), 5) == 5


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_jobs_and_threads_follow_the_cpu_affinity() -> None:
    """A process confined to one core (``taskset -c N``, a cpuset) gets one worker and one
    thread per worker, however many cores the machine has."""
    from harness.run.parallel import threads_per_worker
    from harness.run.settings import default_jobs, usable_cores

    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        assert usable_cores() == 1
        assert default_jobs(torch.device("cpu")) == 1
        assert threads_per_worker(1) == 1
    finally:
        os.sched_setaffinity(0, before)
    assert usable_cores() == len(before)


@pytest.mark.parametrize(
    ("cores", "cases", "expected"), [(16, 21, 12), (64, 21, 12), (6, 21, 4), (16, 5, 5)]
)
def test_jobs_default_on_cuda_is_three_per_four_cores_up_to_12(
    cores: int, cases: int, expected: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from harness.run.settings import resolve_jobs

    monkeypatch.setattr("harness.run.settings.usable_cores", lambda: cores)
    assert resolve_jobs(None, torch.device("cuda", 0), cases) == expected
    monkeypatch.setattr("harness.run.settings.usable_cores", lambda: 1)
    assert resolve_jobs(None, torch.device("cuda", 0), cases) == 1


@pytest.mark.parametrize("jobs", [None, "4"])
def test_run_on_cuda_takes_jobs_without_initialising_cuda(
    jobs: str | None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``run --device cuda --jobs 4`` is accepted: 4 workers on cuda:0 (without --jobs, three
    per four of the 16 cores this test pretends to have, at most 12, on a card that holds
    them all), and nothing up to the spawn initialises CUDA in the parent (the card is read in
    a worker: ``harness.run.budget.probe_card``, stubbed here)."""
    import harness.cli
    from harness.run import budget
    from harness.vocab.spec import preset

    # the estimate's meta forward imports torch's decompositions (and dynamo's rule table, which
    # refuses the one stub _fake_cuda puts in two places) once: before the stubs
    budget.model_bytes(preset("hybrid-tiny"), "fp32")
    _fake_cuda(monkeypatch)
    monkeypatch.setattr("harness.run.settings.usable_cores", lambda: 16)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    card = budget.Card(free=400 << 30, total=400 << 30, name="card", fingerprint="cuda-x")
    monkeypatch.setattr(budget, "probe_card", lambda device: card)
    seen: dict[str, Any] = {}

    def run_cases(cases: list[Any], env: Any, *, jobs: int, **kwargs: Any) -> None:
        seen.update(cases=len(cases), device=env.device, jobs=jobs, size=env.model_size)
        assert kwargs["memory"].workers == jobs and kwargs["memory"].card is card
        raise _Stop

    monkeypatch.setattr(harness.cli, "run_cases", run_cases)
    argv = ["run", "--device", "cuda", *(["--jobs", jobs] if jobs else [])]
    with pytest.raises(_Stop):
        main(argv)
    assert seen == {
        "cases": len(default_matrix()),
        "device": torch.device("cuda", 0),
        "jobs": 4 if jobs else 12,
        "size": "small",
    }


def test_jobs_zero_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    _fake_cuda(monkeypatch)
    assert main(["run", "--device", "cuda", "--jobs", "0"]) == 2
    assert "--jobs must be an int >= 1; got '0'" in _one_error_line(capsys)


def test_cuda_workers_are_spawned_on_the_parents_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """jobs > 1 on CUDA: a forkserver-context pool (never forked from the parent) whose
    initialiser gets the jobs, the parent's device and what the worker inherits; the initialiser
    gives each worker cpu_count // jobs threads and makes that device current."""
    import harness.cli
    import harness.run.parallel

    _fake_cuda(monkeypatch)
    device = torch.device("cuda", 0)
    pools: list[dict[str, Any]] = []

    class Pool:
        def __init__(self, jobs: int, **kwargs: Any) -> None:
            pools.append({"jobs": jobs, **kwargs})

        def __enter__(self) -> Pool:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def submit(self, fn: Any, *args: Any) -> Any:
            from concurrent.futures import Future

            future: Future[Any] = Future()
            future.set_result(fn(*args))
            return future

    import harness.run.session
    import harness.run.workermemory

    monkeypatch.setattr(harness.run.parallel, "ProcessPoolExecutor", Pool)
    # the bundles run here, not in a CUDA worker: nothing cached to give back
    monkeypatch.setattr(harness.run.workermemory, "release", lambda device: None)
    monkeypatch.setattr(
        harness.run.session,
        "run_case",
        lambda case, env, update, timeout, dump: ({"verdict": case.name}, 0.5),
    )
    Pool.shutdown = lambda self, **kwargs: None  # type: ignore[attr-defined]
    env = harness.cli.Environment(device=device, backend="reference", model_size="small")
    cases = default_matrix()[:5]
    records: dict[int, Any] = {}
    status = harness.run.session.run_cases(
        cases,
        env,
        jobs=4,
        timeout=0,
        folder=None,
        on_record=lambda index, record, seconds: records.__setitem__(index, record),
    )
    assert status == "complete"
    assert [records[i]["verdict"] for i in range(5)] == [c.name for c in cases]
    (pool,) = pools
    assert pool["jobs"] == 4 and pool["mp_context"].get_start_method() == "forkserver"
    assert pool["initializer"] is harness.run.parallel.use_share
    assert pool["initargs"][:2] == (4, device)
    inherited = pool["initargs"][2]
    assert inherited.cwd == os.getcwd() and inherited.path == sys.path
    assert inherited.environ == dict(os.environ)

    threads: list[int] = []
    devices: list[torch.device] = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    monkeypatch.setattr("harness.run.parallel.usable_cores", lambda: 16)
    harness.run.parallel.use_share(*pool["initargs"])
    harness.run.parallel.use_share(4, torch.device("cpu"))
    harness.run.parallel.use_share(32)
    assert threads == [4, 4, 1] and devices == [device]


# ------------------------------------------------------------------- scripts/mutation_score


@pytest.fixture(scope="module")
def mutation_score() -> Any:
    return importlib.import_module("harness.tools.mutation_score")


@pytest.mark.parametrize(
    ("argv", "device", "jobs"),
    [
        (["--device", "cuda"], torch.device("cuda", 0), 12),
        (["--device", "cuda", "--jobs", "8"], torch.device("cuda", 0), 8),
        (["--device", "cuda:0", "--jobs", "4"], torch.device("cuda", 0), 4),
        (["--device", "cpu", "--jobs", "2"], torch.device("cpu"), 2),
    ],
)
def test_mutation_score_jobs_on_cuda(
    mutation_score: Any,
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    device: torch.device,
    jobs: int,
) -> None:
    """``--jobs N`` is accepted on CUDA (default: three per four of the 16 cores this test
    pretends to have, at most 12) and reaches ``repeat_correct`` with the device the workers
    use; the parent never initialises CUDA."""
    _fake_cuda(monkeypatch)
    monkeypatch.setattr("harness.run.settings.usable_cores", lambda: 16)
    seen: list[tuple[Any, ...]] = []
    monkeypatch.setattr(mutation_score, "repeat_correct", lambda *args: seen.append(args) or 0)
    assert mutation_score.main([*argv, "--repeat-correct", "20"]) == 0
    assert seen == [(20, device, "small" if device.type == "cuda" else "tiny", jobs, False)]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device", "cuda:1"], "--device cuda:1: this machine has 1 CUDA device(s)"),
        (["--device", "tpu"], "--device must be auto, cpu, cuda or cuda:N; got 'tpu'"),
        (["--device", "cuda", "--jobs", "0"], "--jobs must be an int >= 1; got '0'"),
    ],
)
def test_mutation_score_bad_device_or_jobs(
    mutation_score: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    _fake_cuda(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        mutation_score.main([*argv, "--repeat-correct", "1"])
    assert message in f"{exit_info.value.code} {capsys.readouterr().err}"


def test_mutation_score_workers_use_the_device(
    mutation_score: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each case call sets its threads and, on CUDA, makes the parent's device current; the
    pool is forkserver-context."""
    threads: list[int] = []
    devices: list[torch.device] = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    mutation_score._use(torch.device("cuda", 0), 2)
    mutation_score._use(torch.device("cpu"), 1)
    assert threads == [2, 1] and devices == [torch.device("cuda", 0)]
    pool = mutation_score.worker_pool(2)
    try:
        assert pool._mp_context.get_start_method() == "forkserver"
    finally:
        pool.shutdown()


@pytest.mark.parametrize("jobs", [1, 2])
def test_mutation_score_repeat_correct_prints_times(
    mutation_score: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    jobs: int,
) -> None:
    """Per pass: clean cases and wall time; last line: alarms, case runs and total wall time.
    With jobs > 1 every pass is queued on one pool (a thread pool stands in for the spawned
    one) and the passes still come back in order."""
    from concurrent.futures import ThreadPoolExecutor

    rows = default_matrix()[:3]
    alarm = rows[1].name
    monkeypatch.setattr(mutation_score, "default_matrix", lambda: rows)
    monkeypatch.setattr(
        mutation_score,
        "run_correct_case",
        lambda case, device, size, threads, undeclared: ["boom"] if case.name == alarm else [],
    )
    pools: list[int] = []

    def pool(n: int) -> ThreadPoolExecutor:
        pools.append(n)
        return ThreadPoolExecutor(n)

    monkeypatch.setattr(mutation_score, "worker_pool", pool)
    assert mutation_score.repeat_correct(2, torch.device("cpu"), "tiny", jobs) == 1
    lines = capsys.readouterr().out.splitlines()
    assert pools == ([] if jobs == 1 else [jobs])
    assert lines[0].startswith(f"2 passes x 3 cases on cpu, {jobs} job(s)")
    passes = [line for line in lines if line.startswith("pass ")]
    assert [line.split(" (")[0] for line in passes] == [
        "pass 1/2: 2/3 cases clean",
        "pass 2/2: 2/3 cases clean",
    ]
    assert all(line.endswith("s total)") and "s wall, " in line for line in passes), passes
    assert sum(f"FALSE ALARM {alarm}: boom" in line for line in lines) == 2
    assert lines[-1].startswith("false alarms: 2 in 2 passes (6 case runs, ")
    assert "s wall: " in lines[-1] and "s per pass" in lines[-1] and "s per case run" in lines[-1]


def test_case_row_takes_the_flags_overrides(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``run --case ID`` applies --steps/--microbatches/--precision/--schedule as repro does
    (they were silently ignored), and a one-step run's final step is judged as the warmup."""
    row = next(c for c in default_matrix() if c.precision == "bf16" and c.sharding == "none")
    flags = ("--steps", "1", "--microbatches", "1", "--precision", "fp32", "--schedule", "1f1b")
    code = main(
        ["run", "--device", "cpu", "--case", row.name, *flags, "--report-dir", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    (case,) = _only_summary(tmp_path)["cases"]
    changed = row.replace(steps=1, microbatches=1, precision="fp32", schedule="1f1b")
    assert case["name"] == changed.name != row.name
    assert torch.tensor(case["losses"]["plain"]).shape == (1, 1)
    assert case["checks"]["transfers"]["status"] == "pass"


@pytest.mark.parametrize("tool", ["bench", "mutation-score", "nightly", "host-profile"])
def test_tools_are_subcommands(tool: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main([tool, "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: offload-harness {tool} ")


WRAPPERS = ("bench", "mutation_score", "nightly", "host_profile")

_RUN_WRAPPERS = """
import runpy, sys
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    print("=== " + path, flush=True)
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as done:
        print("=== exit " + str(done.code), flush=True)
"""


def test_script_wrappers_call_the_tools() -> None:
    """Each ``scripts/`` wrapper run as a program (``__main__``) with ``--help`` prints its
    tool's usage and exits 0; all four in one interpreter (one torch import, not four)."""
    paths = [str(REPO / "scripts" / name) for name in WRAPPERS]
    done = subprocess.run(
        [sys.executable, "-c", _RUN_WRAPPERS, *paths],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    outputs = done.stdout.split("=== ")[1:]
    assert len(outputs) == 2 * len(WRAPPERS), done.stdout
    for name, path, (head, tail) in zip(
        WRAPPERS, paths, zip(outputs[::2], outputs[1::2], strict=True), strict=True
    ):
        first, _, usage = head.partition("\n")
        assert first == path, head
        assert usage.startswith(f"usage: offload-harness {name.replace('_', '-')} "), usage
        assert tail.strip() == "exit 0", (name, tail)


def test_empty_report_dir_writes_no_report(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--report-dir ''`` means no report, as in pytest (it meant the current folder)."""
    monkeypatch.chdir(tmp_path)
    assert main([*ONE_LAYER, "--report-dir", ""]) == 0
    out = capsys.readouterr().out
    assert "1/1 cases passed" in out and "no report (--report-dir '')" in out
    assert list(tmp_path.iterdir()) == []
