"""The host-sync guard on guarded CPU runs (moved from ``tests/unit/test_syncguard.py``, whose
tests train nothing): every entry point of a backend runs inside a window labelled with step,
microbatch and group, nothing else does, and the wrapper changes no loss. With the CUDA pieces
faked (``tests/helpers/fake_cuda.py``: ATen's debug mode and the explicit syncs), a sync made
inside a window is recorded against that window - whatever the offloader does with an error,
whatever ``-W`` says - and nothing is raised: the run goes on and its losses are the plain
run's."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from fake_cuda import FakeCuda
from undeclared_offloaders import StorageSkip

from harness.measure.syncdetect import SYNC_MESSAGE
from harness.measure.syncguard import GuardedRun, SyncGuard, run_guarded
from harness.models.train import train
from harness.offload.config import OffloadConfig
from harness.offload.passthrough import NoOffload, apply_to_first
from harness.offload.reference import OffloadContext
from harness.vocab.spec import RunSpec, preset

SPEC = preset("hybrid-tiny")


RUN = RunSpec(steps=2, microbatches=2, schedule="1f1b", precision="fp32")


CONFIG = OffloadConfig(offload_modules=("core_attn", "attn_proj"), min_offloaded_tensor_size=64)


PROBED = ("_pack", "_unpack", "_commit_forward", "_commit_backward", "_start_backward")


@pytest.fixture(scope="module")
def plain_losses() -> torch.Tensor:
    return train(SPEC, RUN, NoOffload(), "cpu").losses


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    return FakeCuda().install(monkeypatch)


class _Probe(OffloadContext):
    """The reference, noting the guard's open window at each internal entry point; ``fault``
    names one that calls ``sync`` in the guarded step."""

    def __init__(
        self, guard: SyncGuard, fault: str | None = None, sync: Callable[[], Any] | None = None
    ) -> None:
        super().__init__(CONFIG, "cpu")
        self.seen: list[tuple[str, int | None, str | None]] = []
        for name in PROBED:
            setattr(self, name, self._probe(name, getattr(self, name), guard, fault, sync))

    def _probe(self, name: str, fn: Any, guard: SyncGuard, fault: str | None, sync: Any) -> Any:
        def probed(*args: Any) -> Any:
            self.seen.append((name, guard.step, guard.current))
            if name == fault and guard.armed:
                sync()
            return fn(*args)

        return probed


def _guarded(probe: _Probe, guard: SyncGuard) -> GuardedRun:
    return run_guarded(SPEC, RUN, probe, "cpu", guarded={1}, guard=guard)


def test_every_entry_point_is_inside_a_labelled_window(plain_losses: torch.Tensor) -> None:
    guard = SyncGuard("cpu")
    probe = _Probe(guard)
    result = _guarded(probe, guard)
    assert not result.problems()
    steady = [(name, where) for name, step, where in probe.seen if step == 1]
    assert {name for name, _ in steady} == set(PROBED)
    for name, where in steady:
        assert where is not None and where.startswith("step 1, microbatch "), (name, where)
        assert "group core_attn" in where or "group attn_proj" in where, (name, where)
    assert all(where is None for _, step, where in probe.seen if step != 1)
    for kind in ("start", "enter", "pack", "exit", "commit", "backward", "unpack", "end_iteration"):
        assert result.windows[kind] > 0, kind
    assert result.losses is not None and torch.equal(plain_losses, result.losses)


PHASES = [
    ("_commit_forward", "commit"),
    ("_pack", "pack"),
    ("_unpack", "unpack"),
    ("_commit_backward", "backward of the commit"),
    ("_start_backward", "backward of the group start"),
]


@pytest.mark.parametrize(("fault", "phase"), PHASES)
def test_a_sync_is_recorded_against_its_window_and_nothing_is_raised(
    fault: str, phase: str, fake: FakeCuda, plain_losses: torch.Tensor
) -> None:
    guard = SyncGuard("cuda")
    probe = _Probe(guard, fault, fake.implicit)
    result = _guarded(probe, guard)  # raises nothing: the run goes on
    calls = [where for name, step, where in probe.seen if name == fault and step == 1]
    assert [hit.window for hit in result.hits] == calls  # one hit per call, in its own window
    for hit in result.hits:
        assert hit.window.startswith("step 1, microbatch ") and hit.window.endswith(f": {phase}")
        assert (hit.call, hit.thread) == (SYNC_MESSAGE, "main"), hit
        assert hit.source.startswith("test_syncguard_runs.py:") and hit.source.endswith(
            " in probed"
        )
    assert result.losses is not None and torch.equal(plain_losses, result.losses)
    assert fake.mode == 0 and guard.current is None and not guard.armed  # all put back


@pytest.mark.parametrize(
    ("sync", "call", "reached"),
    [
        (torch.cuda.synchronize, "torch.cuda.synchronize()", "device"),
        (lambda: torch.accelerator.synchronize(), "torch.accelerator.synchronize()", "accelerator"),
        (lambda: torch.cuda.Event.synchronize(None), "torch.cuda.Event.synchronize()", "event"),
    ],
    ids=["device", "accelerator", "event"],
)
def test_an_explicit_sync_is_recorded_and_still_made(
    sync: Callable[[], None], call: str, reached: str, fake: FakeCuda
) -> None:
    guard = SyncGuard("cuda")
    probe = _Probe(guard, "_pack", sync)
    result = _guarded(probe, guard)
    packs = [where for name, step, where in probe.seen if name == "_pack" and step == 1]
    assert [(hit.window, hit.call) for hit in result.hits] == [(where, call) for where in packs]
    assert fake.synchronized == [reached] * len(packs)  # the wrapper forwards every call


def test_a_sync_the_offloader_swallows_is_recorded_all_the_same(fake: FakeCuda) -> None:
    def swallowing() -> None:
        try:  # an offloader that hides its own errors: in the debug mode "error" this hides
            fake.implicit()  # the sync, and the old guard saw nothing
        except RuntimeError:
            pass

    fake.mode = 2
    with pytest.raises(RuntimeError, match=SYNC_MESSAGE):
        fake.implicit()  # what "error" would have raised into the offloader
    fake.mode = 0
    guard = SyncGuard("cuda")
    result = _guarded(_Probe(guard, "_commit_forward", swallowing), guard)
    assert result.hits and all(hit.window.endswith(": commit") for hit in result.hits)
    assert result.sync_problems()[0].startswith(
        "the offloader synchronised the host with the device at step 1, microbatch "
    )


def test_every_repeat_counts_and_no_filter_raises_or_hides_a_sync(fake: FakeCuda) -> None:
    """A user's ``-W error`` makes no exception of a sync, ``once`` drops no repeat, and a
    warning that is not a sync reaches the user's filters and list unchanged."""

    def thrice() -> None:
        for _ in range(3):
            fake.implicit()  # the same line each time: one registry key
        warnings.warn("the offloader's own note", UserWarning, stacklevel=1)

    guard = SyncGuard("cuda")
    probe = _Probe(guard, "_commit_forward", thrice)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("once")
        warnings.filterwarnings("error", message=".*synchroniz")
        result = _guarded(probe, guard)
    commits = [w for name, step, w in probe.seen if name == "_commit_forward" and step == 1]
    assert len(result.hits) == 3 * len(commits) > 0
    notes = [str(w.message) for w in shown if "own note" in str(w.message)]
    assert notes == ["the offloader's own note"]  # "once" held; it came through the guard
    assert not any(SYNC_MESSAGE in str(w.message) for w in shown)  # recorded, not shown


class _SyncOnBackward(torch.autograd.Function):
    """An identity whose backward synchronises: a backend's own autograd node."""

    sync: Callable[[], None] = staticmethod(lambda: None)

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _SyncOnBackward.sync()
        return grad


class _OwnFunction(StorageSkip):
    """A corpus offloader that adds its own autograd node at the group's start or commit."""

    def __init__(self, where: str) -> None:
        super().__init__(CONFIG, "cpu")
        self.where = where

    def group(self, name: str, x: torch.Tensor, *, layer: int) -> Any:
        inner = super().group(name, x, layer=layer)
        if name not in self.selected:
            return inner
        if self.where == "start":
            inner.input = _SyncOnBackward.apply(x)
        else:
            inner.commit = lambda output, release=(): apply_to_first(output, _SyncOnBackward.apply)
        return inner


@pytest.mark.parametrize("where", ["start", "commit"])
def test_a_sync_in_the_backward_of_the_backends_own_function(
    where: str, fake: FakeCuda, monkeypatch: pytest.MonkeyPatch, plain_losses: torch.Tensor
) -> None:
    monkeypatch.setattr(_SyncOnBackward, "sync", staticmethod(fake.implicit))
    guard = SyncGuard("cuda")
    result = run_guarded(SPEC, RUN, _OwnFunction(where), "cpu", guarded={1}, guard=guard)
    phase = "backward of the group start" if where == "start" else "backward of the commit"
    # Two groups a layer, every layer, both microbatches: each backward of the node syncs once.
    assert len(result.hits) == result.windows["backward"] > 0
    assert all(hit.window.endswith(f": {phase}") and hit.kind == "backward" for hit in result.hits)
    assert result.hits[0].source.endswith(" in backward")
    assert result.losses is not None and torch.equal(plain_losses, result.losses)
