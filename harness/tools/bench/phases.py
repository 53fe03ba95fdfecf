"""``--breakdown``: the phases of a step (each microbatch's forward and backward, the
offloader's end_iteration, the optimizer, the drain), their medians over steps and rounds, and
the offloader wrapper that marks the runner's brackets."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from harness.offload.protocol import Offloader


class _Phases:
    """The phases of the steps it is active in: each microbatch's forward and backward, the
    offloader's end_iteration, the optimizer, the drain. Marks are CUDA events on the current
    (compute) stream, so a phase is what the device's compute timeline spent on it, stalls
    included; the host clock on CPU. With ``annotate`` each phase is also a ``bench.*``
    profiler range (for traces)."""

    def __init__(self, device: torch.device, order: list[tuple[str, int]], annotate: bool) -> None:
        self.cuda = device.type == "cuda"
        self.microbatches = 1 + max(mb for _, mb in order)
        self.backward_order = [mb for kind, mb in order if kind == "B"]
        self.annotate = annotate
        self.active = False
        self.steps: list[dict[str, Any]] = []
        self._marks: list[tuple[str, int, Any]] = []
        self._backwards = 0
        self._open: dict[str, Any] = {}

    # marks ---------------------------------------------------------------------------------
    def _mark(self, label: str, mb: int = -1) -> None:
        if self.cuda:
            stamp: Any = torch.cuda.Event(enable_timing=True)
            stamp.record()
        else:
            stamp = time.perf_counter()
        self._marks.append((label, mb, stamp))

    def _range(self, key: str, name: str | None) -> None:
        """Close the open range ``key``, then open ``name`` under that key (annotate only)."""
        if not self.annotate:
            return
        previous = self._open.pop(key, None)
        if previous is not None:
            previous.__exit__(None, None, None)
        if name is not None:
            self._open[key] = torch.profiler.record_function(name)
            self._open[key].__enter__()

    def forward_start(self, mb: int) -> None:
        if self.active:
            self._mark("forward_start", mb)
            self._range("forward", f"bench.forward|mb={mb}")

    def forward_end(self, mb: int) -> None:
        if self.active:
            self._range("forward", None)
            self._mark("forward_end", mb)

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        if not self.active:
            yield
            return
        mb = self.backward_order[self._backwards % len(self.backward_order)]
        self._backwards += 1
        self._mark("backward_start", mb)
        self._range("backward", f"bench.backward|mb={mb}")
        try:
            yield
        finally:
            self._range("backward", None)
            self._mark("backward_end", mb)

    @contextlib.contextmanager
    def end_iteration(self) -> Iterator[None]:
        if not self.active:
            yield
            return
        self._mark("end_iteration_start")
        self._range("end_iteration", "bench.end_iteration")
        try:
            yield
        finally:
            self._range("end_iteration", None)
            self._mark("optimizer_start")
            self._range("optimizer", "bench.optimizer")

    # steps ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def around(
        self,
        outer: contextlib.AbstractContextManager[object],
        step_seconds: Callable[[], float] | None = None,
    ) -> Iterator[None]:
        """Mark the step ``outer`` wraps (a step timer or a profiler); with ``step_seconds``
        (the whole step's time, read once ``outer`` closed) keep its phases."""
        with outer:
            self._marks, self._backwards, self.active = [], 0, True
            self._mark("step_start")
            original = torch.Tensor.backward
            phases = self

            def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
                with phases.backward():
                    original(tensor, *args, **kwargs)

            torch.Tensor.backward = backward  # type: ignore[method-assign]
            try:
                yield
                self._range("optimizer", None)
                self._mark("compute_end")
            finally:
                torch.Tensor.backward = original  # type: ignore[method-assign]
                self.active = False
                for key in list(self._open):
                    self._range(key, None)
        if step_seconds is not None:
            self.steps.append(self._phases(step_seconds()))

    def _phases(self, step_s: float) -> dict[str, Any]:
        """Seconds per phase of the step just marked (its events have completed)."""
        start = self._marks[0][2]

        def at(stamp: Any) -> float:
            return start.elapsed_time(stamp) / 1e3 if self.cuda else stamp - start

        times: dict[tuple[str, int], float] = {}
        for label, mb, stamp in self._marks:
            times[(label, mb)] = at(stamp)
        M = range(self.microbatches)
        out: dict[str, Any] = {
            "step_s": step_s,
            "forward_s": [times[("forward_end", m)] - times[("forward_start", m)] for m in M],
            "backward_s": [times[("backward_end", m)] - times[("backward_start", m)] for m in M],
        }
        last_backward = max(times[("backward_end", m)] for m in M)
        out["end_iteration_s"] = times[("optimizer_start", -1)] - last_backward
        out["optimizer_s"] = times[("compute_end", -1)] - times[("optimizer_start", -1)]
        out["drain_s"] = step_s - times[("compute_end", -1)]
        out["other_s"] = step_s - (
            sum(out["forward_s"])
            + sum(out["backward_s"])
            + out["end_iteration_s"]
            + out["optimizer_s"]
            + out["drain_s"]
        )
        return out

    def summary(self) -> dict[str, Any] | None:
        """Per phase, the median over the kept steps (microbatch phases: per microbatch)."""
        if not self.steps:
            return None
        out = _median_phases(self.steps)
        out["timed_steps"] = len(self.steps)
        out["clock"] = "cuda" if self.cuda else "host"
        out["steps"] = self.steps
        return out


_BREAKDOWN_INFO = ("timed_steps", "clock", "steps", "rounds")
"""Breakdown keys that are not phases."""


def _median_phases(items: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per phase key of ``items`` (steps, or rounds' summaries), the median over them;
    microbatch phases (lists) per microbatch."""
    out: dict[str, Any] = {}
    for key, first in items[0].items():
        if key in _BREAKDOWN_INFO:
            continue
        if isinstance(first, list):
            out[key] = [statistics.median(i[key][m] for i in items) for m in range(len(first))]
        else:
            out[key] = statistics.median(i[key] for i in items)
    return out


def merge_breakdowns(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The rounds' breakdowns as one: per phase, the median over the rounds of each round's
    median; ``steps``: every round's, in order; ``timed_steps``: per round."""
    if len(rounds) == 1:
        return rounds[0]
    out = _median_phases(rounds)
    out["timed_steps"] = rounds[0]["timed_steps"]
    out["clock"] = rounds[0]["clock"]
    out["rounds"] = len(rounds)
    out["steps"] = [step for b in rounds for step in b["steps"]]
    return out


class _Phased:
    """``offloader`` with the runner's brackets marked: begin_microbatch starts a forward,
    end_iteration ends the backward phase (the optimizer follows). Everything else is the
    offloader's own."""

    def __init__(self, offloader: Offloader, phases: _Phases) -> None:
        self._offloader = offloader
        self._phases = phases

    def __getattr__(self, name: str) -> Any:
        return getattr(self._offloader, name)

    def begin_microbatch(self, microbatch: int) -> None:
        self._phases.forward_start(microbatch)
        self._offloader.begin_microbatch(microbatch)

    def end_iteration(self) -> None:
        with self._phases.end_iteration():
            self._offloader.end_iteration()
