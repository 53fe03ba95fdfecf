"""The host-sync guard's hits become the ``sync`` verdict, on CPU.

* Replay: each GPU fixture under ``tests/fixtures/gpu/`` (``syncguard-*.json``: what the guard
  recorded on a GPU - window, kind, call, thread - and the verdict that machine printed; format
  in ``harness.measure.syncdetect``) is played back through the guard with the CUDA pieces faked
  (``tests/helpers/fake_cuda.py``): the guard records the same hits, they give the same verdict
  line, and the judge's ``sync`` check decides the status the fixture expects.
* The judge's decisions on hand-built runs: hits fail (an inert row too), an inert row without
  a sync is ``n-a``, a run that moved nothing otherwise fails as proving nothing.

The case run on CPU with the guard's CUDA paths faked (a sync in the guarded step is recorded
there, the offload run is made once, and every other check reads it as any other run) is in
``tests/e2e/test_syncguard_case_runs.py``.
"""

from __future__ import annotations

import _thread
import json
import threading
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fake_cuda import FakeCuda

from harness.measure.syncdetect import (
    FOREIGN,
    LATE,
    SYNC_MESSAGE,
    Scenario,
    SyncHit,
    fixture,
    read_fixture,
)
from harness.measure.syncguard import GUARDED_STEP, GuardedRun, SyncGuard
from harness.verify.judge import check

FIXTURES = Path(__file__).parents[1] / "fixtures" / "gpu"
SCENARIOS = [
    pytest.param(path, scenario, id=f"{path.stem}:{scenario.name}")
    for path in sorted(FIXTURES.glob("syncguard-*.json"))
    for scenario in read_fixture(path)[1]
]
EXPLICIT_CALLS: dict[str, Callable[[], None]] = {
    "torch.cuda.synchronize()": lambda: torch.cuda.synchronize(),
    "torch.accelerator.synchronize()": lambda: torch.accelerator.synchronize(),
    "torch.cuda.Event.synchronize()": lambda: torch.cuda.Event.synchronize(None),
}


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    return FakeCuda().install(monkeypatch)


def test_there_is_a_gpu_fixture_to_replay() -> None:
    header, scenarios = read_fixture(FIXTURES / "syncguard-h100.json")
    assert "H100" in header["machine"] and "scripts/gpu_probe_sync.py" in header["provenance"]
    assert {s.expected for s in scenarios} >= {"fail"} and any(s.hits for s in scenarios)


def _on_thread(label: str, work: Callable[[], None]) -> None:
    """Run ``work`` on a thread labelled as ``label`` would be, and wait for it."""
    if label == "main":
        work()
    elif label == FOREIGN:  # a thread Python did not start, as autograd's device thread
        done = _thread.allocate_lock()
        done.acquire()

        def run() -> None:
            try:
                work()
            finally:
                done.release()

        _thread.start_new_thread(run, ())
        done.acquire()
    else:
        thread = threading.Thread(target=work, name=label)
        thread.start()
        thread.join()


def _replay(guard: SyncGuard, hit: SyncHit, fake: FakeCuda) -> None:
    """Make ``hit``'s sync again, inside its window on its thread."""
    if hit.call == SYNC_MESSAGE:
        sync = fake.implicit
    elif hit.call in EXPLICIT_CALLS:
        sync = EXPLICIT_CALLS[hit.call]
    else:
        pytest.fail(f"the fixture names a call the replay cannot make: {hit.call!r}")

    def late() -> None:  # a window ran and closed; autograd reports the sync afterwards
        with guard.window("backward", "a backward window"):
            pass
        warnings.warn(SYNC_MESSAGE, UserWarning, stacklevel=1)

    def inside() -> None:
        with guard.window(hit.kind, hit.window):
            sync()

    _on_thread(hit.thread, late if hit.kind == LATE else inside)


@pytest.mark.parametrize(("path", "scenario"), SCENARIOS)
def test_the_guard_records_a_fixtures_hits_again(
    path: Path, scenario: Scenario, fake: FakeCuda
) -> None:
    guard = SyncGuard("cuda", armed=True)
    for hit in scenario.hits:
        guard.step = int(hit.window.split(",")[0].removeprefix("step "))
        _replay(guard, hit, fake)
    guard.reset()
    key = [(h.window, h.kind, h.call, h.thread) for h in scenario.hits]
    assert [(h.window, h.kind, h.call, h.thread) for h in guard.hits] == key
    assert all(h.source.startswith("test_syncguard_replay.py:") for h in guard.hits)
    assert fake.mode == 0


def _run_of(scenario: Scenario) -> GuardedRun:
    return GuardedRun(
        guarded_steps=(GUARDED_STEP,),
        windows=Counter(scenario.windows),
        hits=scenario.hits,
        observed_d2h=scenario.observed_d2h,
    )


@pytest.mark.parametrize(("path", "scenario"), SCENARIOS)
def test_a_fixtures_hits_give_the_verdict_that_machine_printed(
    path: Path, scenario: Scenario
) -> None:
    lines = _run_of(scenario).sync_problems()
    assert lines == ([scenario.verdict] if scenario.verdict else [])
    if scenario.hits:  # the first hit named, in the H100's words
        first = scenario.hits[0]
        head = f"the offloader synchronised the host with the device at {first.window}: "
        assert lines[0].startswith(head + first.call), lines


def _stub_runs(run: GuardedRun, inert: str = "") -> Any:
    """What ``judge.check("sync", ...)`` reads of a ``CaseRuns`` on a CUDA device."""
    return SimpleNamespace(
        env=SimpleNamespace(device=torch.device("cuda")),
        case=SimpleNamespace(impl="harness"),
        guarded=lambda: run,
        case_run=lambda: SimpleNamespace(inert=inert),
    )


@pytest.mark.parametrize(("path", "scenario"), SCENARIOS)
def test_the_sync_check_decides_what_a_fixture_expects(path: Path, scenario: Scenario) -> None:
    outcome = check("sync", _stub_runs(_run_of(scenario), scenario.inert))
    assert outcome.status == scenario.expected, outcome
    if scenario.expected == "n-a":
        assert outcome.reason == f"{scenario.inert}: nothing is offloaded to check"
    assert outcome.record["sync_hits"] == len(scenario.hits)


HIT = SyncHit(
    window="step 2, microbatch 1, group attn_proj (layer 4): unpack",
    kind="unpack",
    call=SYNC_MESSAGE,
    source="offloader.py:12 in unpack",
    thread=FOREIGN,
)
MOVED = {"windows": Counter(start=8, commit=8, pack=20, unpack=20), "observed_d2h": 20}


def test_the_first_sync_is_named_and_the_others_counted_by_window() -> None:
    pack = SyncHit(window="step 2, microbatch 0, group core_attn (layer 0): pack", kind="pack",
                   call="torch.cuda.synchronize()")  # fmt: skip
    run = GuardedRun(guarded_steps=(2,), hits=(HIT, HIT, pack, HIT), **MOVED)
    assert run.sync_problems() == [
        "the offloader synchronised the host with the device at step 2, microbatch 1, group "
        "attn_proj (layer 4): unpack: called a synchronizing CUDA operation (offloader.py:12 in "
        "unpack); 3 more in the guarded steps (2,) (unpack 2, pack 1)"
    ]
    assert GuardedRun(guarded_steps=(2,), **MOVED).sync_problems() == []


@dataclass(frozen=True)
class Decision:
    hits: tuple[SyncHit, ...]
    moved: bool
    inert: str
    status: str
    line: str


INERT = "inert: nothing eligible (each activation is under the threshold)"
DECISIONS = [
    Decision((), True, "", "pass", ""),
    Decision((HIT,), True, "", "fail", "the offloader synchronised the host with the device at"),
    Decision((), False, INERT, "n-a", ""),
    Decision((HIT,), False, INERT, "fail", "the offloader synchronised the host with the device"),
    Decision((), False, "", "fail", "the harness's copy observer saw no D2H copy"),
]


@pytest.mark.parametrize(
    "decision", DECISIONS, ids=["clean", "sync", "inert", "inert+sync", "idle"]
)
def test_the_sync_checks_decisions(decision: Decision) -> None:
    """An inert row without a sync is n-a like the other checks that need something moved; a
    sync recorded there still fails (the host waited all the same)."""
    moved = MOVED if decision.moved else {"windows": MOVED["windows"], "observed_d2h": 0}
    run = GuardedRun(guarded_steps=(2,), hits=decision.hits, **moved)
    outcome = check("sync", _stub_runs(run, decision.inert))
    assert outcome.status == decision.status, outcome
    assert decision.line in (outcome.problems[0] if outcome.problems else "")
    assert outcome.record == {
        "host_sync": decision.hits[0].describe() if decision.hits else None,
        "sync_hits": len(decision.hits),
        "guarded_windows": sum(MOVED["windows"].values()),
    }


def test_a_fixture_written_from_a_live_guard_reads_back(tmp_path: Path) -> None:
    scenario = GuardedRun(guarded_steps=(2,), hits=(HIT,), **MOVED).scenario("pack-item", "fail")
    path = tmp_path / "syncguard-test.json"
    document = fixture([scenario], machine="a test", provenance="written by a test")
    path.write_text(json.dumps(document))
    header, scenarios = read_fixture(path)
    assert scenarios == [scenario] and header["machine"] == "a test"
    assert scenario.verdict.startswith("the offloader synchronised") and scenario.observed_d2h
    path.write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match=r"syncguard-test\.json: not a "):
        read_fixture(path)
