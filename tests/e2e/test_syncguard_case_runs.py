"""The host-sync guard inside a case's offload run, on CPU (moved from
``tests/unit/test_syncguard_replay.py``, whose tests train nothing): with the guard's CUDA paths
faked, a sync in the guarded step is recorded there, the offload run is made once, and every
other check reads it as any other run; a case run that raised is read by the sync check as
raised; without the guard on CPU there is no guarded run.

On CUDA the case runner arms the guard for step GUARDED_STEP of the offload run itself
(``harness.execute.steps.guards_in_offload_run``). Here it guards on CPU, with a guard whose CUDA
paths run against the fake (``tests/helpers/fake_cuda.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from fake_cuda import FakeCuda

from harness.execute import steps as execute
from harness.execute.environment import Environment
from harness.execute.steps import run_case
from harness.measure.syncdetect import SYNC_MESSAGE
from harness.measure.syncguard import GUARDED_STEP, GuardedRun, SyncGuard
from harness.offload.config import OffloadConfig
from harness.offload.protocol import Offloader
from harness.offload.reference import OffloadContext
from harness.verify.detection import SEED
from harness.verify.judge import CaseRuns


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    return FakeCuda().install(monkeypatch)


class _SyncsWhenGuarded(OffloadContext):
    """The reference, making ATen's implicit sync after every offloaded commit (as
    ``broken.host_sync``'s ``.item()`` does on CUDA; the fake warns only inside a window)."""

    fake: FakeCuda

    def _commit_forward(self, group: Any, release: tuple[torch.Tensor, ...]) -> None:
        super()._commit_forward(group, release)
        if group.iter_decision == "offloaded":
            self.fake.implicit()


@dataclass(frozen=True, kw_only=True)
class _CountingEnvironment(Environment):
    syncing: FakeCuda | None = None
    built: list[str] = field(default_factory=list)

    def offloader(self, config: OffloadConfig) -> Offloader:
        self.built.append("offloader")
        if self.syncing is None:
            return OffloadContext(config, self.device)
        off = _SyncsWhenGuarded(config, self.device)
        off.fake = self.syncing
        return off


def test_a_sync_in_the_case_runs_guarded_step_is_recorded_and_the_run_made_once(
    fake: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(execute, "guards_in_offload_run", lambda case, env: True)
    monkeypatch.setattr(execute, "SyncGuard", lambda device: SyncGuard("cuda"))
    built: list[str] = []
    env = _CountingEnvironment(device=torch.device("cpu"), syncing=fake, built=built)
    res = run_case(SEED, env)
    assert isinstance(res.guarded, GuardedRun) and res.guarded.guarded_steps == (GUARDED_STEP,)
    first = res.guarded.hits[0]
    assert first.window.startswith(f"step {GUARDED_STEP}, microbatch 0, group ")
    assert first.window.endswith(": commit") and first.call == SYNC_MESSAGE
    assert first.source.endswith(" in _commit_forward")
    assert {hit.window.split(",")[0] for hit in res.guarded.hits} == {f"step {GUARDED_STEP}"}
    # The offload run and the disabled run build one offloader each (the hooks run records
    # with its own): the offload run was not made a second time without the guard.
    assert built == ["offloader", "offloader"]
    assert not res.proof_problems and res.d2h_watched > 0  # the offload happened
    assert torch.equal(res.offload.losses, res.plain.losses) and res.verdict.ok
    assert fake.mode == 0


class _Broken(OffloadContext):
    def _pack(self, group: Any, tensor: torch.Tensor) -> Any:
        raise RuntimeError("the offloader's own bug")


@dataclass(frozen=True, kw_only=True)
class _BrokenEnvironment(Environment):
    def offloader(self, config: OffloadConfig) -> Offloader:
        return _Broken(config, self.device)


def test_when_the_case_run_that_held_the_guarded_step_raised_the_sync_check_reads_that(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Said once, by the check that read the run first; no run of its own after it."""
    monkeypatch.setattr(execute, "guards_in_offload_run", lambda case, env: True)
    runs = CaseRuns(SEED, _BrokenEnvironment(device=torch.device("cpu")))
    with pytest.raises(RuntimeError, match="own bug") as first:
        runs.case_run()
    with pytest.raises(RuntimeError) as again:
        runs.guarded()
    assert again.value is first.value and "sync" not in runs.seconds


def test_the_guard_is_not_in_the_offload_run_on_cpu() -> None:
    res = run_case(SEED, Environment(device=torch.device("cpu")))
    assert res.guarded is None  # the sync check is n-a on CPU and makes no run
