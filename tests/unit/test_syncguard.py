"""The host-sync guard's plumbing, on CPU: every entry point of a backend runs inside a window
labelled with step, microbatch and group, nothing else does, the wrapper changes no loss, and a
sync reported inside a window (simulated here; real ones need CUDA) becomes a HostSyncError
naming it. The detection itself is exercised on GPU by ``cases/test_sync.py``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from harness.execute import steps as execute
from harness.execute.environment import Environment
from harness.execute.steps import run_case
from harness.measure import syncguard
from harness.measure.syncguard import (
    GUARDED_STEP,
    SYNC_MESSAGE,
    GuardedGroup,
    GuardedOffloader,
    GuardedRun,
    HostSyncError,
    SyncGuard,
    _record_explicit,
    run_guarded,
)
from harness.models.train import train
from harness.offload.config import OffloadConfig
from harness.offload.passthrough import NoOffload
from harness.offload.protocol import Offloader
from harness.offload.reference import OffloadContext
from harness.verify.detection import SEED
from harness.verify.judge import CaseRuns
from harness.vocab.spec import RunSpec, preset

SPEC = preset("hybrid-tiny")
RUN = RunSpec(steps=2, microbatches=2, schedule="1f1b", precision="fp32")
CONFIG = OffloadConfig(offload_modules=("core_attn", "attn_proj"), min_offloaded_tensor_size=64)
PROBED = ("_pack", "_unpack", "_commit_forward", "_commit_backward", "_start_backward")


class _Probe(OffloadContext):
    """The reference, noting the guard's open window at each internal entry point; ``fault``
    names one to raise from (with ``error``) or to report an explicit sync from."""

    def __init__(self, guard: SyncGuard, fault: str | None = None, error: bool = True) -> None:
        super().__init__(CONFIG, "cpu")
        self.seen: list[tuple[str, int | None, str | None]] = []
        for name in PROBED:
            setattr(self, name, self._probe(name, getattr(self, name), guard, fault, error))

    def _probe(self, name: str, fn: Any, guard: SyncGuard, fault: str | None, error: bool) -> Any:
        def probed(*args: Any) -> Any:
            self.seen.append((name, guard.step, guard.current))
            if name == fault and guard.armed:
                if error:
                    raise RuntimeError(f"called a {SYNC_MESSAGE}")
                _record_explicit("event synchronize (simulated)")
            return fn(*args)

        return probed


def test_every_entry_point_is_inside_a_labelled_window() -> None:
    guard = SyncGuard("cpu")
    probe = _Probe(guard)
    result = run_guarded(SPEC, RUN, probe, "cpu", guarded={1}, guard=guard)
    assert not result.problems()
    steady = [(name, where) for name, step, where in probe.seen if step == 1]
    assert {name for name, _ in steady} == set(PROBED)
    for name, where in steady:
        assert where is not None and where.startswith("step 1, microbatch "), (name, where)
        assert "group core_attn" in where or "group attn_proj" in where, (name, where)
    assert all(where is None for _, step, where in probe.seen if step != 1)
    for kind in ("start", "enter", "pack", "exit", "commit", "backward", "unpack", "end_iteration"):
        assert result.windows[kind] > 0, kind
    plain = train(SPEC, RUN, NoOffload(), "cpu")
    assert result.losses is not None and torch.equal(plain.losses, result.losses)


@pytest.mark.parametrize(
    ("fault", "phase"),
    [
        ("_commit_forward", "commit"),
        ("_pack", "pack"),
        ("_unpack", "unpack"),
        ("_commit_backward", "backward of the commit"),
        ("_start_backward", "backward of the group start"),
    ],
)
def test_a_sync_is_named_by_its_window(fault: str, phase: str) -> None:
    _expect_named(fault, phase, error=True)


@pytest.mark.parametrize(
    ("fault", "phase"), [("_pack", "pack"), ("_commit_backward", "backward of the commit")]
)
def test_an_explicit_sync_is_named_by_its_window(fault: str, phase: str) -> None:
    _expect_named(fault, phase, error=False)


def _expect_named(fault: str, phase: str, *, error: bool) -> None:
    guard = SyncGuard("cpu")
    with pytest.raises(HostSyncError) as raised:
        run_guarded(SPEC, RUN, _Probe(guard, fault, error), "cpu", guarded={1}, guard=guard)
    message = str(raised.value)
    assert message.startswith("step 1, microbatch "), message
    assert f"): {phase}:" in message, message
    assert guard.current is None and not guard.armed


def test_a_guarded_run_of_a_logless_backend_that_moved_nothing_proves_nothing() -> None:
    """Without a log, the copy observer must have seen a D2H in the guarded steps."""
    from collections import Counter

    windows = Counter(start=3, commit=3)
    idle = GuardedRun(guarded_steps=(2,), windows=windows, observed_d2h=0)
    assert any("copy observer saw no D2H copy" in p for p in idle.problems()), idle.problems()
    assert GuardedRun(guarded_steps=(2,), windows=windows, observed_d2h=4).problems() == []


# ------------------------------------------------- the guard inside a case's offload run
# On CUDA the case runner arms the guard for step GUARDED_STEP of the offload run itself
# (``harness.execute.steps.guards_in_offload_run``). On CPU nothing can synchronise, so these tests
# let it guard there and simulate what ATen's debug mode raises.


class _SyncsWhenGuarded(OffloadContext):
    """The reference, raising what ATen's sync debug mode raises from every offloaded commit
    made inside an armed window (as ``broken.HostSync`` does on CUDA)."""

    def _commit_forward(self, group: Any, release: tuple[torch.Tensor, ...]) -> None:
        super()._commit_forward(group, release)
        if syncguard._LIVE and group.iter_decision == "offloaded":
            raise RuntimeError(f"called a {SYNC_MESSAGE}")


@dataclass(frozen=True, kw_only=True)
class _SyncingEnvironment(Environment):
    def offloader(self, config: OffloadConfig) -> Offloader:
        return _SyncsWhenGuarded(config, self.device)


def _guarding_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(execute, "guards_in_offload_run", lambda case, env: True)


def test_the_sync_check_reads_the_guarded_step_of_the_case_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _guarding_on_cpu(monkeypatch)
    runs = CaseRuns(SEED, Environment(device=torch.device("cpu")))
    res = runs.case_run()
    assert isinstance(res.guarded, GuardedRun), res.guarded
    assert res.guarded.guarded_steps == (GUARDED_STEP,) and not res.guarded.problems()
    assert res.guarded.windows["start"] > 0 and res.guarded.windows["unpack"] > 0
    assert runs.guarded() is res.guarded and "sync" not in runs.seconds  # no run of its own
    assert not res.proof_problems and res.d2h_watched > 0  # the offload happened
    assert torch.equal(res.offload.losses, res.plain.losses)  # the guard changes no loss


def test_a_sync_in_the_guarded_step_is_the_sync_verdict_and_the_run_is_made_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _guarding_on_cpu(monkeypatch)
    res = run_case(SEED, _SyncingEnvironment(device=torch.device("cpu")))
    assert isinstance(res.guarded, HostSyncError), res.guarded
    message = str(res.guarded)
    assert message.startswith(f"step {GUARDED_STEP}, microbatch 0, group "), message
    assert "): commit: called a synchronizing CUDA operation" in message, message
    # Kept without the traceback: its frames would hold the aborted run's model and tensors.
    assert res.guarded.__traceback__ is None and res.guarded.__cause__ is None
    # The other checks read the offload run made again without the guard: every step trained.
    assert res.offload.losses.shape == res.plain.losses.shape
    assert not res.proof_problems and res.d2h_watched > 0  # the offload happened
    assert torch.equal(res.offload.losses, res.plain.losses) and res.verdict.ok


def test_the_guard_is_not_in_the_offload_run_on_cpu() -> None:
    res = run_case(SEED, Environment(device=torch.device("cpu")))
    assert res.guarded is None  # the sync check is n-a on CPU and makes no run


def test_a_disarmed_guard_hands_out_the_backends_own_group() -> None:
    """Only the armed step pays for the wrapper's windows and node hooks."""
    guard = SyncGuard("cpu")
    wrapped = GuardedOffloader(OffloadContext(CONFIG, "cpu"), guard)
    wrapped.begin_microbatch(0)
    x = torch.ones(4, requires_grad=True)
    assert not isinstance(wrapped.group("core_attn", x, layer=0), GuardedGroup)
    guard.armed = True
    assert isinstance(wrapped.group("attn_proj", x, layer=0), GuardedGroup)
