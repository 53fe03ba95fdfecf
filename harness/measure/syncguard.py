"""A guard against host synchronisation on an offloader's hot path (CUDA).

An offloader that makes the host wait for the device (``.item()``, a blocking copy,
``torch.cuda.synchronize()``, ``Event.synchronize()``) stalls the launch queue at every group
and costs most of the overlap it exists for, without changing a single loss. The guard fails
such a sync and names where it happened.

It is armed only inside *windows*: the stretches of host time in which the offloader under test
runs. ``GuardedOffloader`` wraps any backend and opens a window around each of its entry points:

    begin_microbatch, group start, group enter/exit, commit, mark_not_offloadable, end_iteration
    the saved-tensor pack/unpack hooks the backend pushes when a group is entered
    the backward of the autograd nodes the backend adds at group start and commit

Everything else - model compute, the loss, clipping, the optimizer and the bf16 master copy -
runs outside every window, so the runner's own synchronisations (were there any) are excluded by
construction, not caught and ignored. Inside a window two detectors are live:

* ``torch.cuda.set_sync_debug_mode("error")`` makes ATen's implicit syncs (``.item()``,
  ``.cpu()``, blocking copies, ``nonzero``, stream synchronisation) raise at once;
* GPU-trace callbacks record explicit device, stream and event synchronisation (the debug mode
  does not flag ``torch.cuda.synchronize()`` or ``Event.synchronize()``); the window raises when
  it closes. Activating the trace is process-wide and cannot be undone: afterwards every CUDA
  allocation and event calls into Python (a small host cost, no change in behaviour).

A sync becomes a ``HostSyncError`` naming the window: step, microbatch, group, layer and phase.
On CPU there is nothing to detect; windows still open and close (and are counted), which is
how the wrapper's coverage is tested without a GPU.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

import torch

from harness.measure.observe import Observed, Windowed, observe
from harness.models.train import RunHooks, train
from harness.offload.protocol import Group, IterationLog, Offloader, Output, Wrapper
from harness.vocab.spec import ModelSpec, RunSpec

GUARDED_STEP = 2
"""The steady step the host-sync check guards: the first is the offloader's warmup (its pinned
pool is allocated there, and the optimizer's state), the next lets every allocator settle."""

SYNC_MESSAGE = "synchronizing CUDA operation"
"""What ATen's sync debug mode puts into the error it raises."""

_LIVE: list[SyncGuard] = []
"""Guards with an open window. The GPU-trace callback registry is process-wide and has no way
to unregister, so the callbacks are installed once and dispatch to whichever guard is live."""
_TRACE_INSTALLED = False


class HostSyncError(RuntimeError):
    """The offloader synchronised the host with the device inside a guarded window."""


def _record_explicit(what: str) -> None:
    for guard in _LIVE:
        guard._explicit.append(what)


def _install_trace() -> None:
    global _TRACE_INSTALLED
    if _TRACE_INSTALLED:
        return
    from torch.cuda import _gpu_trace

    torch._C._activate_gpu_trace()
    _gpu_trace.register_callback_for_device_synchronization(
        lambda: _record_explicit("device synchronize (torch.cuda.synchronize)")
    )
    _gpu_trace.register_callback_for_stream_synchronization(
        lambda stream: _record_explicit(f"stream synchronize (stream {stream:#x})")
    )
    _gpu_trace.register_callback_for_event_synchronization(
        lambda event: _record_explicit(f"event synchronize (event {event:#x})")
    )
    _TRACE_INSTALLED = True


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
    """Windows in which any host synchronisation fails; inert unless ``armed``."""

    def __init__(self, device: torch.device | str, *, armed: bool = False) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.armed = armed
        self.step: int | None = None
        """The runner's current step (labels only)."""
        self.windows: Counter[str] = Counter()
        """Armed windows opened, per kind (``commit``, ``unpack``, ...)."""
        self._stack: list[str] = []
        self._explicit: list[str] = []
        self._previous_mode = 0
        self.last_error: HostSyncError | None = None
        """The last sync a window detected (until ``reset``), for ``explain``."""
        if self.cuda:
            _install_trace()

    @property
    def current(self) -> str | None:
        """The innermost open window's label (None outside every window)."""
        return self._stack[-1] if self._stack else None

    def open(self, kind: str, where: str) -> bool:
        """Open a window; False (and nothing opened) while disarmed."""
        if not self.armed:
            return False
        self.windows[kind] += 1
        if not self._stack:
            self._explicit.clear()
            if self.cuda:
                self._previous_mode = torch.cuda.get_sync_debug_mode()
                _set_sync_debug_mode("error")
            _LIVE.append(self)
        self._stack.append(where)
        return True

    def close(self) -> None:
        """Close the innermost window; the outermost raises for recorded explicit syncs."""
        where = self._stack.pop()
        if self._stack:
            return
        self._disarm_detectors()
        if self._explicit:
            found, self._explicit = self._explicit, []
            self.last_error = HostSyncError(f"{where}: host synchronisation: {'; '.join(found)}")
            raise self.last_error

    @contextlib.contextmanager
    def window(self, kind: str, where: str) -> Iterator[None]:
        """``open``/``close`` around a block; a sync error inside names ``where``."""
        if not self.open(kind, where):
            yield
            return
        try:
            yield
        except HostSyncError:
            raise
        except RuntimeError as exc:
            if SYNC_MESSAGE in str(exc):
                self.last_error = HostSyncError(f"{where}: {_first_line(exc)}")
                raise self.last_error from exc
            raise
        finally:
            if self._stack and self._stack[-1] == where:
                self.close()

    def explain(self, exc: BaseException) -> BaseException:
        """A sync error raised where no window could catch it (inside an autograd node whose
        post-hook never ran) as a ``HostSyncError`` naming the innermost open window."""
        if isinstance(exc, RuntimeError) and not isinstance(exc, HostSyncError):
            if SYNC_MESSAGE in str(exc):
                return HostSyncError(f"{self.current or 'outside any window'}: {_first_line(exc)}")
        if isinstance(exc, Exception) and not isinstance(exc, HostSyncError) and self.last_error:
            # A sync detected inside a saved-tensor hook that autograd called from C++ can reach
            # the runner as another error (``SystemError: ... returned NULL without setting an
            # exception``): PyTorch loses it on the way out. The detection itself is recorded.
            return HostSyncError(
                f"{self.last_error} (it reached the runner as {type(exc).__name__}: "
                f"{_first_line(exc)})"
            )
        return exc

    def reset(self) -> None:
        """Close every window without checking (after an exception), disarm the detectors."""
        if self._stack:
            self._stack.clear()
            self._disarm_detectors()
        self._explicit.clear()
        self.last_error = None

    def _disarm_detectors(self) -> None:
        if self.cuda:
            _set_sync_debug_mode(self._previous_mode)
        if self in _LIVE:
            _LIVE.remove(self)


def _set_sync_debug_mode(mode: int | str) -> None:
    """``torch.cuda.set_sync_debug_mode`` without its warning that the mode is a prototype: the
    guard chose it knowingly, and the warning printed once per worker says nothing to a user."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="Synchronization debug mode is a prototype", category=UserWarning
        )
        torch.cuda.set_sync_debug_mode(mode)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


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
    logs: list[IterationLog] = field(default_factory=list)
    """The backend's own per-iteration log ([] if it keeps none)."""
    losses: torch.Tensor | None = None
    """[steps, microbatches] losses of the run."""
    observed_d2h: int | None = None
    """D2H copies the harness's copy observer saw in the guarded steps (None: not observed)."""

    def problems(self) -> list[str]:
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

    @classmethod
    def of(
        cls, guard: SyncGuard, steps: set[int], result: Any, seen: Sequence[Observed]
    ) -> GuardedRun:
        """What ``guard`` saw over ``steps`` of a run that produced ``result`` (a
        ``TrainResult``), ``seen`` being the copy observer's records of those steps."""
        return cls(
            guarded_steps=tuple(sorted(steps)),
            windows=Counter(guard.windows),
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
        except BaseException as exc:
            explained = guard.explain(exc)
            if explained is not exc:
                raise explained from exc
            raise
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
