"""``--jobs`` of ``offload-harness run`` and ``mutation-score``, also on one GPU (faked: the
parent process must never initialise CUDA), and the workers' threads and devices."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_lines import one_error_line

from harness.cases import default_matrix
from harness.cli import main
from harness.offload import backends

# ------------------------------------------------------------------ --jobs, also on one GPU


class _Stop(Exception):
    """Raised by a stand-in to end a run before it would touch a device."""


def _fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, torch.device]]:
    """A visible GPU whose use in this (parent) process fails the test: picking the device,
    counting jobs and spawning must not initialise CUDA here. The backend's probe, which a
    process without CUDA hands to a child interpreter (``backends._probe_in_child``, tested in
    ``test_faults_input.py``), is recorded instead of started: the returned list gets each
    ``(backend, device)`` handed over, and the answer is None, what a child that sees no GPU
    gives (it proves nothing, the run goes ahead)."""

    def initialises(*args: object) -> int:
        raise AssertionError("CUDA initialised in the parent process")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", initialises)
    monkeypatch.setattr(torch.cuda, "set_device", initialises)
    probes: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(
        backends, "_probe_in_child", lambda spec, device: probes.append((spec, device))
    )
    return probes


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
    a worker: ``harness.run.budget.probe_card``, stubbed here; the backend is probed in a child
    process, recorded here: ``_fake_cuda``)."""
    import harness.cli
    from harness.run import budget
    from harness.vocab.spec import preset

    # the estimate's meta forward imports torch's decompositions (and dynamo's rule table, which
    # refuses the one stub _fake_cuda puts in two places) once: before the stubs
    budget.model_bytes(preset("hybrid-tiny"), "fp32")
    probes = _fake_cuda(monkeypatch)
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
    # the backend was probed once, handed to a child process (not built in this one)
    assert probes == [("reference", torch.device("cuda", 0))]


def test_jobs_zero_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    _fake_cuda(monkeypatch)
    assert main(["run", "--device", "cuda", "--jobs", "0"]) == 2
    assert "--jobs must be an int >= 1; got '0'" in one_error_line(capsys)


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
