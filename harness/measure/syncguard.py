"""A guard against host synchronisation on an offloader's hot path (CUDA).

An offloader that makes the host wait for the device (``.item()``, a blocking copy,
``torch.cuda.synchronize()``, ``Event.synchronize()``) stalls the launch queue at every group
and costs most of the overlap it exists for, without changing a single loss. The guard records
every such sync and names where it happened; the ``sync`` check fails on them.

It is armed only inside *windows*: the stretches of host time in which the offloader under test
runs. ``GuardedOffloader`` wraps any backend and opens a window around each of its entry points:

    begin_microbatch, group start, group enter/exit, commit, mark_not_offloadable, end_iteration
    the saved-tensor pack/unpack hooks the backend pushes when a group is entered
    the backward of the autograd nodes the backend adds at group start and commit (its own
    ``torch.autograd.Function`` there included)

Everything else - model compute, the loss, clipping, the optimizer and the bf16 master copy -
runs outside every window, so the runner's own synchronisations (were there any) are excluded by
construction, not caught and ignored. Windows are kept per thread: on CUDA autograd runs the
backward's hooks on its device thread, and a sync is charged to the innermost window open on the
thread that made it.

Inside a window ATen's implicit syncs issue a warning (``torch.cuda.set_sync_debug_mode("warn")``)
and the explicit ones are wrapped; each becomes a ``SyncHit`` (``harness.measure.syncdetect``
says how, and what it does not see). Nothing is raised: an exception inside a saved-tensor hook
or an autograd node unwinds through C++ autograd, and an offloader may catch it itself. So the
run goes on, every other check reads it as any other run, and the verdict is decided afterwards
from the hits (``GuardedRun.sync_problems``: the first named - step, microbatch, group, layer,
window, call, source line - and the others counted), whatever the offloader did with an error.
On CPU there is nothing to detect; windows still open and close (and are counted), which is how
the wrapper's coverage is tested without a GPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

import torch

from harness.measure.observe import Observed, Windowed, observe
from harness.measure.syncdetect import (
    LATE,
    SYNC_MESSAGE,
    Listener,
    Scenario,
    SyncHit,
    set_debug_mode,
    skip_frames_of,
    thread_label,
)
from harness.models.train import RunHooks, train
from harness.offload.protocol import Group, IterationLog, Offloader, Output, Wrapper
from harness.vocab.spec import ModelSpec, RunSpec

__all__ = [
    "GUARDED_STEP",
    "SYNC_MESSAGE",
    "GuardedGroup",
    "GuardedOffloader",
    "GuardedRun",
    "SyncGuard",
    "SyncHit",
    "Windows",
    "guarded_steps_hooks",
    "run_guarded",
]

GUARDED_STEP = 2
"""The steady step the host-sync check guards: the first is the offloader's warmup (its pinned
pool is allocated there, and the optimizer's state), the next lets every allocator settle."""

skip_frames_of(__file__)  # a hit's source is the offloader's line, never the wrapper's


class Windows(Protocol):
    """What ``GuardedOffloader`` opens around each entry point of the backend it wraps."""

    step: int | None
    """The runner's current step (labels only)."""
    armed: bool
    """Whether windows open now (set per step); a disarmed step opens none."""

    def open(self, kind: str, where: str) -> bool:
        """Open a window of ``kind`` (``commit``, ``pack``, ...) at ``where``; False if none
        was opened (and then ``close`` is not called)."""
        ...

    def close(self) -> None:
        """Close the innermost open window."""
        ...

    def window(self, kind: str, where: str) -> contextlib.AbstractContextManager[None]:
        """``open``/``close`` around a block."""
        ...


class SyncGuard:
    """Windows inside which every host synchronisation is recorded in ``hits``; inert unless
    ``armed``. It never raises: the verdict is read from the hits afterwards."""

    def __init__(self, device: torch.device | str, *, armed: bool = False) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.armed = armed
        self.step: int | None = None
        """The runner's current step (labels only)."""
        self.windows: Counter[str] = Counter()
        """Armed windows opened, per kind (``commit``, ``unpack``, ...)."""
        self.hits: list[SyncHit] = []
        """Every sync recorded inside a window, in order (kept over ``reset``)."""
        self._stacks: dict[int, list[tuple[str, str]]] = {}
        """Per thread ident, its open windows (kind, label), innermost last."""
        self._open = 0
        """Windows open over every thread: the debug mode is on while there is one."""
        self._previous_mode = 0
        self._listener = Listener(self._on_sync)

    @property
    def current(self) -> str | None:
        """The calling thread's innermost open window's label (None outside every window)."""
        stack = self._stacks.get(threading.get_ident())
        return stack[-1][1] if stack else None

    def open(self, kind: str, where: str) -> bool:
        """Open a window; False (and nothing opened) while disarmed."""
        if not self.armed:
            return False
        self.windows[kind] += 1
        if not self._open and self.cuda:
            # Listening lasts till the step ends (``reset``): autograd reports a C++ node's
            # warnings only when the backward ends, after the windows closed.
            self._listener.start()
            self._previous_mode = torch.cuda.get_sync_debug_mode()
            set_debug_mode("warn")
        self._open += 1
        self._stacks.setdefault(threading.get_ident(), []).append((kind, where))
        return True

    def close(self) -> None:
        """Close the calling thread's innermost window."""
        stack = self._stacks.get(threading.get_ident())
        if not stack:
            return
        stack.pop()
        self._open -= 1
        if not self._open and self.cuda:
            set_debug_mode(self._previous_mode)

    @contextlib.contextmanager
    def window(self, kind: str, where: str) -> Iterator[None]:
        """``open``/``close`` around a block; whatever the block raises goes on unchanged."""
        if not self.open(kind, where):
            yield
            return
        try:
            yield
        finally:
            # Not when a node's window opened inside is still open (its backward raised before
            # its post-hook): ``reset`` closes both at the step's end.
            if self.current == where:
                self.close()

    def reset(self) -> None:
        """The step ended: close every window (a backward that raised leaves its node's open),
        restore the debug mode, stop listening. The hits stay."""
        if self._open and self.cuda:
            set_debug_mode(self._previous_mode)
        self._stacks.clear()
        self._open = 0
        self._listener.stop()

    def _on_sync(self, call: str, source: str, explicit: bool) -> None:
        """Charge one detected sync to the calling thread's innermost window."""
        stack = self._stacks.get(threading.get_ident())
        if stack:
            kind, where = stack[-1]
        elif explicit or self._previous_mode:
            return  # outside every window of this thread, or anyone's (the mode was on before)
        else:
            kind = LATE
            where = (
                f"step {self.step}, the backward: a C++ autograd node inside one of the "
                "offloader's windows (autograd reports its warnings when the backward ends, so "
                "the node is not known)"
            )
        self.hits.append(
            SyncHit(window=where, kind=kind, call=call, source=source, thread=thread_label())
        )


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, tuple | list) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def _guard_node(guard: Windows, node: Any, where: str) -> None:
    """Open a window for the backward of ``node`` (a backend's own autograd node)."""
    opened: list[bool] = []

    def before(grad_outputs: Any) -> None:
        opened.append(guard.open("backward", where))

    def after(grad_inputs: Any, grad_outputs: Any) -> None:
        if opened.pop():
            guard.close()

    node.register_prehook(before)
    node.register_hook(after)


def _new_node(before: torch.Tensor | None, after: torch.Tensor | None) -> Any:
    """The autograd node a backend put between ``before`` and ``after`` (None if it added none:
    a pass-through returns its input unchanged)."""
    if after is None or after is before or after.grad_fn is None:
        return None
    if before is not None and after.grad_fn is before.grad_fn:
        return None
    return after.grad_fn


class GuardedGroup:
    """A backend's group with every entry point inside a window (see the module docstring)."""

    def __init__(self, inner: Group, guard: Windows, label: str, x: torch.Tensor) -> None:
        self._inner = inner
        self._guard = guard
        self._label = label
        self.input = inner.input
        node = _new_node(x, inner.input)
        if node is not None:
            _guard_node(guard, node, f"{label}: backward of the group start")

    def __enter__(self) -> GuardedGroup:
        hooks = torch._C._autograd
        below = hooks._top_saved_tensors_default_hooks(False)
        with self._guard.window("enter", f"{self._label}: enter"):
            self._inner.__enter__()
        pushed = hooks._top_saved_tensors_default_hooks(False)
        if pushed is not None and (below is None or pushed[0] is not below[0]):
            # Swap the pair the backend pushed for guarded copies; its own __exit__ pops
            # whatever is on top, so the stack stays balanced.
            pack, unpack = pushed
            hooks._pop_saved_tensors_default_hooks()
            hooks._push_saved_tensors_default_hooks(
                self._wrap("pack", pack), self._wrap("unpack", unpack)
            )
        return self

    def _wrap(self, kind: str, hook: Callable[[Any], Any]) -> Callable[[Any], Any]:
        guard, where = self._guard, f"{self._label}: {kind}"

        def guarded(value: Any) -> Any:
            with guard.window(kind, where):
                return hook(value)

        return guarded

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with self._guard.window("exit", f"{self._label}: exit"):
            self._inner.__exit__(exc_type, exc, tb)

    def commit(self, output: Output, release: Sequence[torch.Tensor] = ()) -> Output:
        with self._guard.window("commit", f"{self._label}: commit"):
            out = self._inner.commit(output, release)
        node = _new_node(_first_tensor(output), _first_tensor(out))
        if node is not None:
            _guard_node(self._guard, node, f"{self._label}: backward of the commit")
        return out


class GuardedOffloader(Wrapper):
    """Any backend, with its hot path inside ``guard``'s windows; otherwise unchanged. ``guard``
    is a ``SyncGuard`` or anything else with its windows (``harness.measure.hostclock.HostClock``
    times them)."""

    def __init__(self, inner: Offloader, guard: Windows) -> None:
        super().__init__(inner)
        self._guard = guard
        self._microbatch: int | None = None

    def _where(self, what: str) -> str:
        step = "?" if self._guard.step is None else self._guard.step
        return f"step {step}, microbatch {self._microbatch}, {what}"

    def begin_microbatch(self, microbatch: int) -> None:
        self._microbatch = microbatch
        with self._guard.window("begin_microbatch", self._where("begin_microbatch")):
            self.inner.begin_microbatch(microbatch)

    def group(self, name: str, x: torch.Tensor, *, layer: int) -> Group:
        if not self._guard.armed:
            # A disarmed step opens no window: the backend's own group, without the wrapper's
            # hooks on its autograd nodes and saved-tensor hooks (a guarded case's offload run
            # arms one of its steps; the others pay nothing).
            return self.inner.group(name, x, layer=layer)
        label = self._where(f"group {name} (layer {layer})")
        with self._guard.window("start", f"{label}: start"):
            inner = self.inner.group(name, x, layer=layer)
        return GuardedGroup(inner, self._guard, label, x)

    def mark_not_offloadable(self, *tensors: torch.Tensor) -> None:
        with self._guard.window("mark_not_offloadable", self._where("mark_not_offloadable")):
            self.inner.mark_not_offloadable(*tensors)

    def end_iteration(self) -> None:
        with self._guard.window("end_iteration", self._where("end_iteration")):
            self.inner.end_iteration()


@dataclass(kw_only=True)
class GuardedRun:
    """What a guarded training run showed."""

    guarded_steps: tuple[int, ...]
    windows: Counter[str] = field(default_factory=Counter)
    """Armed windows opened per kind, over the guarded steps."""
    hits: tuple[SyncHit, ...] = ()
    """The host synchronisations recorded inside the windows, in order."""
    logs: list[IterationLog] = field(default_factory=list)
    """The backend's own per-iteration log ([] if it keeps none)."""
    losses: torch.Tensor | None = None
    """[steps, microbatches] losses of the run."""
    observed_d2h: int | None = None
    """D2H copies the harness's copy observer saw in the guarded steps (None: not observed)."""

    def problems(self) -> list[str]:
        """The sync check's problems: the syncs, then why the run proves nothing if it does not."""
        return self.sync_problems() + self.evidence_problems()

    def sync_problems(self) -> list[str]:
        """One line for the recorded syncs: the first named, the others counted per window
        kind ([] without a sync)."""
        if not self.hits:
            return []
        first, others = self.hits[0], self.hits[1:]
        line = f"the offloader synchronised the host with the device at {first.describe()}"
        if others:
            kinds = Counter(hit.kind for hit in others)
            each = ", ".join(f"{kind} {count}" for kind, count in kinds.most_common())
            line += f"; {len(others)} more in the guarded steps {self.guarded_steps} ({each})"
        return [line]

    def evidence_problems(self) -> list[str]:
        """Why the run does not prove anything (the guard never saw the offloader work)."""
        out = []
        for kind in ("start", "commit"):
            if not self.windows[kind]:
                out.append(f"no group {kind} ran inside the guard in steps {self.guarded_steps}")
        logged = [self.logs[s] for s in self.guarded_steps if s < len(self.logs)]
        if logged and not any(log.d2h_bytes for log in logged):
            out.append(
                f"the backend's log shows no D2H bytes in the guarded steps {self.guarded_steps}: "
                "nothing was offloaded, so the guard proved nothing"
            )
        elif not logged and self.observed_d2h == 0:
            out.append(
                f"the harness's copy observer saw no D2H copy in the guarded steps "
                f"{self.guarded_steps} (the backend keeps no log): nothing was offloaded, so the "
                "guard proved nothing"
            )
        return out

    def scenario(self, name: str, expected: str, note: str = "") -> Scenario:
        """This run as a scenario of the GPU fixture (``harness.measure.syncdetect.fixture``),
        ``expected`` being the sync check's status its offloader must get."""
        verdict = self.sync_problems()
        return Scenario(
            name=name,
            expected=expected,
            verdict=verdict[0] if verdict else "",
            windows=dict(sorted(self.windows.items())),
            observed_d2h=self.observed_d2h,
            note=note,
            hits=self.hits,
        )

    @classmethod
    def of(
        cls, guard: SyncGuard, steps: set[int], result: Any, seen: Sequence[Observed]
    ) -> GuardedRun:
        """What ``guard`` saw over ``steps`` of a run that produced ``result`` (a
        ``TrainResult``), ``seen`` being the copy observer's records of those steps."""
        return cls(
            guarded_steps=tuple(sorted(steps)),
            windows=Counter(guard.windows),
            hits=tuple(guard.hits),
            logs=result.logs,
            losses=result.losses,
            observed_d2h=sum(c.direction == "d2h" for o in seen for c in o.copies),
        )


def guarded_steps_hooks(
    guard: SyncGuard, steps: set[int]
) -> Callable[[int], contextlib.AbstractContextManager[object]]:
    """A ``RunHooks.step_context`` that arms ``guard`` for the listed steps only."""

    @contextlib.contextmanager
    def context(step: int) -> Iterator[None]:
        guard.step, guard.armed = step, step in steps
        try:
            yield
        finally:
            guard.armed = False
            guard.reset()

    return context


def run_guarded(
    spec: ModelSpec,
    run: RunSpec,
    offloader: Offloader,
    device: torch.device | str,
    *,
    guarded: set[int],
    guard: SyncGuard | None = None,
) -> GuardedRun:
    """Train ``run`` with ``offloader`` wrapped in a guard armed for the ``guarded`` steps.

    Unguarded steps before them are the warmup: the offloader's own warmup iteration (pinned
    pool allocations), the optimizer's state allocation and the caching allocator's growth all
    happen there, so that a guarded step is a steady-state step.
    """
    guard = guard or SyncGuard(device)
    windowed = Windowed(offloader)
    seen: list[Observed] = []
    arm = guarded_steps_hooks(guard, guarded)

    def context(step: int) -> contextlib.AbstractContextManager[object]:
        stack = contextlib.ExitStack()
        if step in guarded:  # proves the offload happened where the guard looked
            stack.enter_context(observe(windowed, torch.device(device), seen))
        stack.enter_context(arm(step))
        return stack

    try:
        result = train(
            spec,
            run,
            GuardedOffloader(windowed, guard),
            device,
            hooks=RunHooks(step_context=context),
        )
    finally:
        guard.reset()
    return GuardedRun.of(guard, guarded, result, seen)
