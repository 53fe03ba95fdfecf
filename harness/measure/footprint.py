"""The host footprint of an offloader: the host memory it holds at every group boundary of a step
beside the bytes it has in flight there.

An offloader needs host memory for what it has copied out and not yet brought back; anything
beyond that is its overhead: pool buffers idle between uses, a pinned allocator's rounding
(PyTorch's caching host allocator hands out whole power-of-two blocks, so an 81920 B buffer
pins 131072 B), copies kept after their reload. At each boundary of an observed step - a group
occurrence's commit returned, its backward started, its backward ended
(``harness.measure.copyobserver.Boundary``) - the harness reads:

* **held, found through the copies**: the bytes of every host storage an observed D2H of the
  run wrote that something other than the harness still holds (the offloader's host copies and
  its pool buffers, whatever allocator they came from, at their own size);
* **held, by the allocator** (CUDA): the caching host allocator's bytes in use, whole blocks,
  less its reading when the run's first observed step began (any caller's pinned tensors);
* **in flight**: per group occurrence, the bytes its D2H copies wrote less what its H2D copies
  have brought back, until its backward ends (with no reload copy - a CPU device, where the
  host copy itself is handed back - its bytes stay in flight until then).

``held`` is the larger of the two readings (a backend mixing the allocator's blocks with memory
of its own reads as the larger part: an underestimate, never an overestimate). The ratio is the
step's peak held over its peak in flight: what the offloader pins for each byte it must keep.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from harness.measure.copyobserver import Boundary, Copy, Observed
from harness.offload.semantics import GroupKey


@dataclass(frozen=True, slots=True)
class Point:
    """One boundary: what was held and what was in flight."""

    kind: str
    group: GroupKey
    held: int
    in_flight: int
    held_copies: int
    held_allocator: int | None


@dataclass(frozen=True, slots=True)
class Footprint:
    """A step's host footprint (module docstring)."""

    points: tuple[Point, ...]

    @property
    def peak_held(self) -> int:
        return max((p.held for p in self.points), default=0)

    @property
    def peak_in_flight(self) -> int:
        return max((p.in_flight for p in self.points), default=0)

    @property
    def ratio(self) -> float | None:
        """Peak held over peak in flight (None where nothing was in flight)."""
        flight = self.peak_in_flight
        return round(self.peak_held / flight, 4) if flight else None

    @property
    def source(self) -> str:
        """Which reading gave the peak held: ``allocator`` or ``copies``."""
        top = max(self.points, key=lambda p: p.held, default=None)
        if top is None or top.held_allocator is None or top.held_allocator <= top.held_copies:
            return "copies"
        return "allocator"

    def worst(self) -> Point | None:
        """The boundary holding the most."""
        return max(self.points, key=lambda p: p.held, default=None)

    def as_record(self) -> dict[str, Any]:
        """The report's ``host_footprint`` fields."""
        allocator = [p.held_allocator for p in self.points if p.held_allocator is not None]
        return {
            "peak_held_bytes": self.peak_held,
            "peak_in_flight_bytes": self.peak_in_flight,
            "ratio": self.ratio,
            "source": self.source,
            "peak_held_copies_bytes": max((p.held_copies for p in self.points), default=0),
            "peak_held_allocator_bytes": max(allocator) if allocator else None,
            "boundaries": len(self.points),
        }


def footprint(observed: Observed) -> Footprint:
    """The host footprint of one observed step, at each of its group boundaries."""
    events: list[tuple[int, int, Any]] = []  # (seq, order at equal seq, event)
    for copy in observed.copies:
        if copy.group is not None and copy.weight is None:
            events.append((copy.seq, 0, copy))
    for seq, kind, key in observed.marks:
        if kind == "end":
            events.append((seq, 1, key))
    for boundary in observed.boundaries:
        events.append((boundary.seq, 2, boundary))
    events.sort(key=lambda e: (e[0], e[1]))
    out: dict[GroupKey, int] = defaultdict(int)
    points = []
    for _, order, event in events:
        if order == 0:
            if event.direction == "d2h":
                out[event.group] += event.nbytes
            else:
                out[event.group] = max(0, out[event.group] - event.nbytes)
        elif order == 1:
            out.pop(event, None)
        else:
            held = max(event.held, event.allocated or 0)
            points.append(
                Point(
                    event.kind,
                    event.group,
                    held,
                    sum(out.values()),
                    event.held,
                    event.allocated,
                )
            )
    return Footprint(tuple(points))


def host_fields(seen: list[Observed]) -> dict[str, Any]:
    """The final step's footprint; per observed step the host memory new to its copies and the
    allocator's new pinned blocks; and the final step itself (``harness.execute.caserun.CaseRun``'s
    fields of those names)."""
    return {
        "footprint": footprint(seen[-1]) if seen else None,
        "new_host": tuple(tuple(o.new_host) for o in seen),
        "host_allocs": tuple(o.host_allocs for o in seen),
        "final_observed": seen[-1] if seen else None,
    }


def bound_problem(final: Footprint, bound: float, step: int) -> str | None:
    """The line saying the final step's footprint exceeds a declared ``bound``, or None."""
    ratio = final.ratio
    if ratio is None or ratio <= bound:
        return None
    worst = final.worst()
    assert worst is not None
    mb, layer, name = worst.group
    how = (
        "the caching host allocator's blocks in use"
        if final.source == "allocator"
        else "the host storages its D2H copies wrote, still held"
    )
    return (
        f"step {step}: the offloader held {final.peak_held} B of host memory ({how}) for at "
        f"most {final.peak_in_flight} B in flight: {ratio:.2f}x, above the {bound:.2f}x it "
        f"declares; the most at the {worst.kind} of {name} (microbatch {mb}, layer {layer})"
    )


def step_record(observed: Observed) -> dict[str, Any]:
    """What ``footprint`` reads of one observed step, as JSON (a replay fixture: recorded on a
    GPU, replayed by a CPU test)."""
    return {
        "copies": [
            [c.direction, c.nbytes, list(c.group), c.seq]
            for c in observed.copies
            if c.group is not None and c.weight is None
        ],
        "marks": [[seq, kind, list(key)] for seq, kind, key in observed.marks],
        "boundaries": [
            [b.seq, b.kind, list(b.group), b.held, b.allocated] for b in observed.boundaries
        ],
    }


def step_from(record: dict[str, Any]) -> Observed:
    """The step ``step_record`` wrote, for ``footprint``."""
    copies = [
        Copy(direction, "copy_", nbytes, tuple(group), False, 0, None, seq)  # type: ignore[arg-type]
        for direction, nbytes, group, seq in record["copies"]
    ]
    marks = [(seq, kind, tuple(key)) for seq, kind, key in record["marks"]]
    boundaries = [
        Boundary(seq, kind, tuple(group), held, allocated)  # type: ignore[arg-type]
        for seq, kind, group, held, allocated in record["boundaries"]
    ]
    return Observed(copies=copies, marks=marks, boundaries=boundaries)  # type: ignore[arg-type]
