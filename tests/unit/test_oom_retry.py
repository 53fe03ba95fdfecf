"""What a CUDA run does about memory while its cases run (``harness.run.session`` with
``harness.run.workermemory``), on the CPU: a worker marks a case whose runs ran out of memory
and reads the case's whole peak across the memory check's resets; the session starts a case
only when the memory budget holds it, runs a case that ran out of memory beside others again
alone, and, out of memory alone too, gives it an error record that fails no check of the
offloader. The pool is a thread pool here and the cases are fakes that say how much runs
beside them."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from harness.cases import Case, matrix
from harness.execute.environment import Environment
from harness.run import budget, session, workermemory
from harness.verify.judge import raised

GiB = 1 << 30
OOM = (
    "CUDA out of memory. Tried to allocate 128.00 MiB. GPU 0 has a total capacity of 79.18 GiB "
    "of which 70.75 MiB is free."
)


# --- the worker ---------------------------------------------------------------------------


def _env() -> Environment:
    return Environment(device=torch.device("cpu"), backend="reference")


def test_a_case_whose_runs_ran_out_of_memory_is_marked(monkeypatch: pytest.MonkeyPatch) -> None:
    def judge(*args: Any, **kwargs: Any) -> Any:
        raise torch.OutOfMemoryError(OOM)

    monkeypatch.setattr(session, "judge", judge)
    case = Case(family="hybrid", offload=("core_attn",), steps=1)
    record, _ = session.run_case(case, _env(), False, 0, None)
    assert record["problems"] == [f"error: OutOfMemoryError: {OOM}"]
    assert record["out_of_memory"] == f"error: OutOfMemoryError: {OOM}"


@pytest.mark.parametrize(
    ("problem", "marked"),
    [
        (f"equivalence: {raised(torch.OutOfMemoryError(OOM))}", True),  # as the judge says it
        ("memory: the case's runs raised AcceleratorError: CUDA error: out of memory", True),
        ("sync: the case's runs raised RuntimeError: CUBLAS_STATUS_ALLOC_FAILED when ...", True),
        ("equivalence: step 2, microbatch 0: losses differ", False),
        ("leaks: the host memory the offloader holds grows after the warmup", False),
    ],
)
def test_only_an_allocation_failure_counts_as_out_of_memory(problem: str, marked: bool) -> None:
    found = workermemory.out_of_memory(["transfers: counted as predicted", problem])
    assert found == (problem if marked else None)


def test_the_peak_survives_the_memory_checks_resets(monkeypatch: pytest.MonkeyPatch) -> None:
    allocator = {"peak": 0}

    def reset(device: int) -> None:
        allocator["peak"] = 0

    monkeypatch.setattr(torch._C, "_cuda_resetPeakMemoryStats", reset, raising=False)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: allocator["peak"])
    monkeypatch.setattr(workermemory, "_FOLD", {})
    fold = workermemory.install()
    assert workermemory.install() is fold  # once per worker
    fold.clear(0)
    allocator["peak"] = 7 * GiB  # the case's runs before the memory check's last step
    torch._C._cuda_resetPeakMemoryStats(0)  # type: ignore[attr-defined] # the check's reset
    assert allocator["peak"] == 0  # the allocator's statistics are reset all the same
    allocator["peak"] = 3 * GiB  # the last step
    assert fold.peak(0) == 7 * GiB
    fold.clear(0)  # the next case
    allocator["peak"] = 2 * GiB
    assert fold.peak(0) == 2 * GiB


# --- the session ------------------------------------------------------------------------


class _Bundles:
    """A fake ``run_bundle``: each case takes 50 ms and passes, except the ones named in
    ``short``, which run out of memory while another bundle runs (``always``: every time).
    It writes down what ran together."""

    def __init__(self, plan: budget.Plan | None, short: set[str], always: bool = False) -> None:
        self.plan, self.short, self.always = plan, short, always
        self.lock = threading.Lock()
        self.running: dict[int, int] = {}  # call -> its cost
        self.most_cost = 0
        self.calls: list[tuple[list[str], int]] = []  # (names, bundles running beside it)

    def __call__(self, cases: list[Case], env: Any, *args: Any) -> list[Any]:
        names = [case.name for case in cases]
        cost = max(self.plan.costs[self.index[n]] for n in names) if self.plan else 0
        with self.lock:
            key = len(self.calls)
            self.running[key] = cost
            self.calls.append((names, 0))
            self.most_cost = max(self.most_cost, sum(self.running.values()))
        time.sleep(0.05)
        with self.lock:  # the most bundles that ran beside it, at its start or since
            beside = max(len(self.running) - 1, self.calls[key][1])
            self.calls[key] = (names, beside)
            for other in self.running:
                self.calls[other] = (self.calls[other][0], max(self.calls[other][1], beside))
            del self.running[key]
        return [(self._record(name, beside), 0.05) for name in names]

    def _record(self, name: str, beside: int) -> dict[str, Any]:
        record: dict[str, Any] = {"name": name, "verdict": "pass", "problems": [], "checks": {}}
        if name in self.short and (beside or self.always):
            problem = f"equivalence: {raised(torch.OutOfMemoryError(OOM))}"
            record.update(verdict="fail", problems=[problem], out_of_memory=problem)
        record["device_memory"] = {"peak_reserved": GiB}
        return record


def _run(
    monkeypatch: pytest.MonkeyPatch,
    cases: list[Case],
    fake: _Bundles,
    *,
    jobs: int,
    plan: budget.Plan | None,
) -> dict[str, dict[str, Any]]:
    fake.index = {case.name: i for i, case in enumerate(cases)}  # type: ignore[attr-defined]
    monkeypatch.setattr(session, "worker_pool", lambda workers, device: ThreadPoolExecutor(workers))
    monkeypatch.setattr(session, "kill_pool", lambda pool: pool.shutdown(wait=True))
    monkeypatch.setattr(session, "run_bundle", fake)
    records: dict[str, dict[str, Any]] = {}
    env = Environment(device=torch.device("cuda", 0), backend="reference", model_size="small")
    status = session.run_cases(
        cases,
        env,
        jobs=jobs,
        timeout=0,
        folder=None,
        on_record=lambda index, record, seconds: records.update({cases[index].name: record}),
        memory=plan,
    )
    assert status == "complete"
    assert set(records) == {case.name for case in cases}
    return records


def _plan(cases: list[Case], limit: int, costs: list[int]) -> budget.Plan:
    card = budget.Card(free=80 * GiB, total=80 * GiB, name="card", fingerprint="x")
    return budget.Plan(
        workers=4,
        card=card,
        limit=limit,
        costs=tuple(costs),
        estimates=tuple(costs),
        recorded=0,
    )


def _cases() -> list[Case]:
    """Default-matrix rows of distinct plain baselines (one bundle each)."""
    env = Environment(device=torch.device("cuda", 0), backend="reference")
    from harness.execute.baselines import plain_key

    seen: dict[str, Case] = {}
    for case in matrix("default"):
        seen.setdefault(plain_key(case, env), case)
    cases = list(seen.values())[:6]
    assert len(cases) == 6
    return cases


def test_the_budget_holds_the_running_cases(monkeypatch: pytest.MonkeyPatch) -> None:
    cases = _cases()
    # 10 GiB of budget: the three 6 GiB cases never run two at a time, the 3 GiB ones beside
    plan = _plan(cases, 10 * GiB, [6 * GiB] * 3 + [3 * GiB] * 3)
    fake = _Bundles(plan, short=set())
    records = _run(monkeypatch, cases, fake, jobs=4, plan=plan)
    assert fake.most_cost <= 10 * GiB
    assert max(beside for _, beside in fake.calls) >= 1  # the small ones did share
    assert all(
        r["device_memory"]["budgeted"] == c
        for r, c in zip((records[case.name] for case in cases), plan.costs, strict=True)
    )


def test_out_of_memory_beside_others_runs_again_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    cases = _cases()
    plan = _plan(cases, 80 * GiB, [GiB] * 6)  # everything fits: all run together
    greedy = cases[0].name
    fake = _Bundles(plan, short={greedy})
    records = _run(monkeypatch, cases, fake, jobs=4, plan=plan)
    runs = [(names, beside) for names, beside in fake.calls if greedy in names]
    assert len(runs) == 2 and runs[0][1] > 0 and runs[1][1] == 0  # again, with nothing beside
    assert fake.calls[-1][0] == [greedy]  # once every other case had ended
    record = records[greedy]
    assert record["verdict"] == "pass" and record["problems"] == []
    said = f"equivalence: {raised(torch.OutOfMemoryError(OOM))}"
    assert record["notes"] == [
        f"ran out of memory while other cases ran ({said}); run again alone, this is that "
        "run's verdict"
    ]


def test_out_of_memory_alone_is_an_error_of_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    cases = _cases()
    plan = _plan(cases, 80 * GiB, [GiB] * 6)
    greedy = cases[1].name
    records = _run(monkeypatch, cases, _Bundles(plan, {greedy}, always=True), jobs=4, plan=plan)
    record = records[greedy]
    assert record["verdict"] == "fail" and record["checks"] == {}  # no check failed
    (problem,) = record["problems"]
    assert problem == (
        "error: out of memory on cuda:0 with no other case running, so the case was not "
        "judged (the machine's limit, not a check of the offloader; a backend that keeps "
        "device memory does this too); budgeted 1.0 GiB, 80.0 GiB free: equivalence: "
        f"{raised(torch.OutOfMemoryError(OOM))}"
    )
    assert all(records[c.name]["verdict"] == "pass" for c in cases if c.name != greedy)


def test_a_single_worker_runs_alone_already(monkeypatch: pytest.MonkeyPatch) -> None:
    cases = _cases()[:2]
    fake = _Bundles(None, {cases[0].name}, always=True)
    records = _run(monkeypatch, cases, fake, jobs=1, plan=None)
    assert len(fake.calls) == 2  # no second run: the first had nothing beside it
    assert records[cases[0].name]["problems"][0].startswith(
        "error: out of memory on cuda:0 with no other case running"
    )
