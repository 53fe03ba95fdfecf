"""Host time an offloader spends in its own entry points, per kind, without a profiler.

On a launch-bound step (the host issues kernels slower than the device runs them) every
microsecond an offloader's Python spends on the host is a microsecond of step time, while a
profiler inflates exactly that host time and so hides it (on the H200 a traced ``hybrid-small``
step took 126 ms against 46 ms untraced, and there the reference's extra time vanished). This
clock measures it the cheap way: ``harness.measure.syncguard.GuardedOffloader`` opens a window
around every entry point of the backend it wraps (group start, enter, the pack/unpack hooks, exit,
commit, the backward of the autograd nodes the backend adds, begin_microbatch,
end_iteration), and ``HostClock`` adds ``time.perf_counter_ns`` from the outermost window's
open to its close to that window's kind. A nested window (none of the harness's backends opens
one) counts in the outermost only.

What the clock does not see: host work a backend does outside its entry points (it has none
by the protocol), and the wrapper's own cost: a closure call and a context-manager object per
window, outside the timed span but for the return from the block into the object's exit (an
empty window records about 0.3 us on the 2-core CPU machine, docs/measurements.md). Use it
in a run of its own (``scripts/bench --host-time`` does), not inside a timed step.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from statistics import median

import torch

from harness.measure.syncguard import GuardedOffloader
from harness.models.train import RunHooks, train
from harness.offload.protocol import Offloader
from harness.vocab.spec import ModelSpec, RunSpec

KINDS = (
    "begin_microbatch",
    "start",
    "enter",
    "pack",
    "exit",
    "commit",
    "unpack",
    "backward",
    "mark_not_offloadable",
    "end_iteration",
)
"""The window kinds ``GuardedOffloader`` opens, in the order a step meets them."""


ALLOCATOR_COUNTERS = {
    "cudaMalloc": ("device", "num_device_alloc"),
    "cudaFree": ("device", "num_device_free"),
    "alloc retries": ("device", "num_alloc_retries"),
    "syncs of all streams": ("device", "num_sync_all_streams"),
    "pinned allocs": ("host", "num_host_alloc"),
    "pinned frees": ("host", "num_host_free"),
}
"""Counters of PyTorch's caching allocators that say an allocation left the cache: the device
allocator's ``cudaMalloc``/``cudaFree`` calls, the retries after a failed one (which free cached
blocks, synchronising) and its syncs of all streams; the pinned host allocator's new blocks and
returned ones (``cudaHostAlloc``/``cudaFreeHost``, both synchronising). In a steady step every one
of them should be 0: a non-zero count is a pool miss, and where it synchronises, a stall."""


def _allocator_counts() -> dict[str, int]:
    device = torch.cuda.memory_stats()
    host = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    found = {"device": device, "host": host}
    return {
        label: int(found[which].get(key, 0)) for label, (which, key) in ALLOCATOR_COUNTERS.items()
    }


class HostClock:
    """``harness.measure.syncguard.Windows`` that time themselves; inert unless ``armed``. With
    ``cuda``, each armed step also counts the caching allocators' misses
    (``ALLOCATOR_COUNTERS``)."""

    def __init__(self, *, cuda: bool = False) -> None:
        self.cuda = cuda
        self.allocator: dict[int, dict[str, int]] = {}
        """Per armed step (CUDA), the allocator counters' increase over the step."""
        self.gc_ns: dict[int, int] = {}
        """Per armed step, nanoseconds the host spent in Python's garbage collector (inside the
        windows or not: a collection runs wherever an allocation trips it)."""
        self.gc_runs: dict[int, Counter[int]] = {}
        """Per armed step, collections per generation."""
        self._gc_began = 0
        self.step: int | None = None
        self.armed = False
        self.ns: dict[int, Counter[str]] = {}
        """Per armed step, nanoseconds per outermost window kind."""
        self.calls: dict[int, Counter[str]] = {}
        """Per armed step, windows opened per kind (nested ones included)."""
        self.host_step_ns: dict[int, int] = {}
        """Per armed step, the host's wall time from the step's start to its end (the runner's
        own work and waits included: the scale the windows' time is read against)."""
        self._stack: list[str] = []
        self._opened_at = 0
        self._bound: int | None = None  # the step whose counters below are bound
        self._step_calls: Counter[str] = Counter()
        self._step_ns: Counter[str] = Counter()

    def open(self, kind: str, where: str) -> bool:
        step = self.step
        if not self.armed or step is None:
            return False
        if step != self._bound:
            self._bound = step
            self._step_calls = self.calls.setdefault(step, Counter())
            self._step_ns = self.ns.setdefault(step, Counter())
        stack = self._stack
        stack.append(kind)
        self._step_calls[kind] += 1
        if len(stack) == 1:
            # Taken last, and first in ``close``: the clock's own bookkeeping stays outside.
            self._opened_at = time.perf_counter_ns()
        return True

    def close(self) -> None:
        now = time.perf_counter_ns()
        kind = self._stack.pop()
        if not self._stack and self.step is not None:
            self._step_ns[kind] += now - self._opened_at

    def window(self, kind: str, where: str) -> contextlib.AbstractContextManager[None]:
        return _Window(self, kind, where)

    def reset(self) -> None:
        """Forget open windows (after an exception or a step whose backward hooks never
        closed theirs)."""
        self._stack.clear()

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if not self.armed or self.step is None:
            return
        if phase == "start":
            self._gc_began = time.perf_counter_ns()
        elif self._gc_began:
            elapsed = time.perf_counter_ns() - self._gc_began
            self.gc_ns[self.step] = self.gc_ns.get(self.step, 0) + elapsed
            self.gc_runs.setdefault(self.step, Counter())[info["generation"]] += 1
            self._gc_began = 0

    def steps_hooks(
        self, steps: set[int]
    ) -> Callable[[int], contextlib.AbstractContextManager[object]]:
        """A ``RunHooks.step_context`` that arms the clock for ``steps`` and times each of
        those steps on the host."""

        @contextlib.contextmanager
        def context(step: int) -> Iterator[None]:
            self.step, self.armed = step, step in steps
            counted = _allocator_counts() if self.cuda and self.armed else None
            began = time.perf_counter_ns()
            try:
                yield
            finally:
                if self.armed:
                    self.host_step_ns[step] = time.perf_counter_ns() - began
                if counted is not None:
                    now = _allocator_counts()
                    self.allocator[step] = {k: now[k] - counted[k] for k in now}
                self.armed = False
                self.reset()

        return context


class _Window:
    """``HostClock.window``: a context manager object, cheaper than a generator's (the part
    of it that runs after ``open`` and before ``close`` counts in the window's time)."""

    __slots__ = ("clock", "kind", "opened", "where")

    def __init__(self, clock: HostClock, kind: str, where: str) -> None:
        self.clock, self.kind, self.where = clock, kind, where
        self.opened = False

    def __enter__(self) -> None:
        self.opened = self.clock.open(self.kind, self.where)

    def __exit__(self, *exc: object) -> None:
        if self.opened:
            self.clock.close()


@dataclass(kw_only=True)
class HostTime:
    """What a clocked run showed: per kind, the median over the clocked steps of the host
    seconds spent in the offloader's windows of that kind."""

    steps: tuple[int, ...]
    seconds: dict[str, float] = field(default_factory=dict)
    """Median seconds per step per window kind (kinds never opened are absent)."""
    calls: dict[str, float] = field(default_factory=dict)
    """Median windows per step per kind."""
    total_s: float = 0.0
    """Median over the steps of each step's summed window time (not the sum of the kinds'
    medians)."""
    host_step_s: float = 0.0
    """Median host wall time of the clocked steps."""
    gc_s: float = 0.0
    """Median seconds per step in Python's garbage collector."""
    gc_runs: dict[int, float] = field(default_factory=dict)
    """Median collections per step, per generation."""
    allocator: dict[str, float] = field(default_factory=dict)
    """CUDA: median per step of each ``ALLOCATOR_COUNTERS`` increase (empty on CPU)."""

    def summary(self) -> str:
        """One line: the total and the kinds, largest first, with calls per step."""
        parts = ", ".join(
            f"{kind} {self.seconds[kind] * 1e3:.2f} ({self.calls.get(kind, 0):g})"
            for kind in sorted(self.seconds, key=self.seconds.__getitem__, reverse=True)
        )
        line = (
            f"offloader host {self.total_s * 1e3:.2f} ms of a {self.host_step_s * 1e3:.2f} ms "
            f"host step ({parts or 'no window opened'}; ms per step, windows per step)"
        )
        runs = ", ".join(f"gen{g} {n:g}" for g, n in sorted(self.gc_runs.items()) if n)
        line += f"; gc {self.gc_s * 1e3:.2f} ms per step ({runs or 'no collection'})"
        if self.allocator:
            misses = ", ".join(f"{k} {v:g}" for k, v in self.allocator.items() if v)
            line += f"; allocator per step: {misses or 'no miss'}"
        return line


def read_clock(clock: HostClock) -> HostTime:
    """The per-step medians of what ``clock`` recorded."""
    steps = tuple(sorted(clock.host_step_ns))
    if not steps:
        return HostTime(steps=steps)

    kinds = sorted({k for c in clock.calls.values() for k in c})
    ns = [clock.ns.get(s, Counter()) for s in steps]
    calls = [clock.calls.get(s, Counter()) for s in steps]
    gc_runs = [clock.gc_runs.get(s, Counter()) for s in steps]
    allocator = list(clock.allocator.values())
    return HostTime(
        steps=steps,
        seconds={k: median(c[k] for c in ns) / 1e9 for k in kinds},
        calls={k: median(c[k] for c in calls) for k in kinds},
        total_s=median(sum(c.values()) for c in ns) / 1e9,
        host_step_s=median(clock.host_step_ns[s] for s in steps) / 1e9,
        gc_s=median(clock.gc_ns.get(s, 0) for s in steps) / 1e9,
        gc_runs={g: median(c[g] for c in gc_runs) for g in range(3)},
        allocator={k: median(a[k] for a in allocator) for k in ALLOCATOR_COUNTERS}
        if allocator
        else {},
    )


def run_clocked(
    spec: ModelSpec,
    run: RunSpec,
    offloader: Offloader,
    device: torch.device | str,
    *,
    clocked: set[int],
) -> HostTime:
    """Train ``run`` with ``offloader``'s entry points timed in the ``clocked`` steps (leave the
    first steps unclocked: the offloader's warmup iteration allocates its buffers there)."""
    if not clocked or max(clocked) >= run.steps or min(clocked) < 0:
        raise ValueError(f"clocked steps {sorted(clocked)} are not steps of a {run.steps}-step run")
    clock = HostClock(cuda=torch.device(device).type == "cuda")
    gc.callbacks.append(clock._on_gc)
    try:
        train(
            spec,
            run,
            GuardedOffloader(offloader, clock),
            device,
            hooks=RunHooks(step_context=clock.steps_hooks(clocked)),
        )
    finally:
        gc.callbacks.remove(clock._on_gc)
        clock.reset()
    return read_clock(clock)
