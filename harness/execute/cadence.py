"""When reloads happen in backward: the cadence check's order, its prediction and its verdict.

The transfer checks say *what* moved; this module says *when* each reload was issued against
the group backwards around it. No cooperation from the offloader is needed:

* the harness's windows (``harness.measure.observe``) hang an autograd hook on each group
occurrence's
  output (its gradient arrives: the group's backward **starts**) and on its input (its gradient
  is complete: the group's backward **ends**); the copy observer numbers those marks and every
  copy in one sequence (``Observed.marks``, ``Copy.seq``);
* a **reload** is an H2D copy the observer attributes to a group occurrence (the group whose
  D2H wrote the host memory it reads); one whose group's backward already started is no
  prefetch (an unpack-time reload) and is never ahead.

The rule the order is held to is the backend's declared ``Semantics.prefetch_depth`` or, for an
undeclared backend, the depth learned from steps 0 and 1 (``harness.execute.learn``):

* ``None``, Megatron-Core's rule (what ``harness.execute.predict.prefetched_before`` models for the
  memory reading): every group occurrence's backward end issues one reload - the most recently
  committed offloaded group of its pass still on the host and not yet in backward, else the top
  one of the next pass to run backward if that pass's forward is done. Walked over the step's
  own marks, it gives for each offloaded group the mark after which its reload may be issued.
  The pile-up of #7575 (groups kept on the device still spend a reload slot) is part of the
  rule, so it is predicted, and the record shows how many groups were ahead at once;
* ``d``: a group occurrence's reload comes after the end of the backward of the occurrence
  ``d`` places before it in the step's backward order (0: after its own backward starts).

Two things are checked per step: no reload is issued before the rule allows it, and at no point
do the bytes reloaded but not yet consumed (their group's backward not started) exceed what the
rule has in flight there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from harness.execute.predict import Expected
from harness.measure.copyobserver import Observed
from harness.offload.recorder import GroupObservation
from harness.offload.semantics import GroupKey, Semantics

START, END, RELOAD = "start", "end", "reload"


@dataclass(frozen=True, kw_only=True, slots=True)
class Event:
    """One entry of a step's backward order: a group occurrence's backward start or end, or a
    reload copy of it (``nbytes``)."""

    kind: str
    key: GroupKey
    nbytes: int = 0


def step_events(observed: Observed, selected: Iterable[str]) -> list[Event]:
    """The step's backward marks and reload copies of the selected names, in issue order."""
    names = set(selected)
    merged = [(seq, Event(kind=kind, key=key)) for seq, kind, key in observed.marks]
    merged += [
        (c.seq, Event(kind=RELOAD, key=c.group, nbytes=c.nbytes))
        for c in observed.copies
        if c.direction == "h2d" and c.group is not None
    ]
    merged.sort(key=lambda pair: pair[0])
    return [e for _, e in merged if e.key[2] in names]


def _first(events: Sequence[Event], kind: str) -> dict[GroupKey, int]:
    at: dict[GroupKey, int] = {}
    for index, event in enumerate(events):
        if event.kind == kind:
            at.setdefault(event.key, index)
    return at


def megatron_allowed(
    events: Sequence[Event],
    passes: Mapping[int, Sequence[GroupKey]],
    order: Sequence[tuple[str, int]],
    holding: Collection[int] | None = None,
) -> dict[GroupKey, int | None]:
    """Offloaded group occurrence -> the index of the event after which Megatron-Core's rule
    may reload it (``passes``: each pass's offloaded occurrences in commit order; ``order``:
    the schedule's ("F"|"B", pass) sequence). A group no backward end prefetches is reloaded at
    its own backward (its start mark; None without one).

    A stack entry whose backward already started is passed over (it was reloaded at its first
    unpack, or will be): the reference skips the ones reloaded so far, Megatron pops them
    without a reload; skipping every started one reaches the next group no later than either,
    so the bound it gives is never tighter than theirs.

    ``holding``: the passes with a group of the selected names in the step (None: every
    pass). The next chunk to run backward is the next one holding a group: Megatron-Core's
    ``front_backward_chunk`` passes over empty chunks (a pipeline stage's model chunk without
    a selected layer, ``harness.execute.pipeline_case``)."""
    stacks = {p: list(keys) for p, keys in passes.items()}
    started: set[GroupKey] = set()
    allowed: dict[GroupKey, int | None] = {}

    def pop(p: int) -> GroupKey | None:
        stack = stacks.get(p, [])
        while stack:
            key = stack.pop()
            if key not in started:  # one already in backward was reloaded there
                return key
        return None

    for index, event in enumerate(events):
        if event.kind == START:
            started.add(event.key)
        elif event.kind == END:
            key = pop(event.key[0])
            following = _next_backward(order, event.key[0], holding)
            if key is None and following is not None:
                key = pop(following)
            if key is not None:
                allowed[key] = index
    starts = _first(events, START)
    for keys in passes.values():
        for key in keys:
            allowed.setdefault(key, starts.get(key))
    return allowed


def _next_backward(
    order: Sequence[tuple[str, int]], current: int, holding: Collection[int] | None = None
) -> int | None:
    """The pass whose backward follows ``current``'s (of those in ``holding``, when given), if
    its forward ran before ``current``'s backward (Megatron pre-reloads only a chunk whose
    forward is done)."""
    try:
        at = order.index(("B", current))
    except ValueError:
        return None
    following = next(
        (p for kind, p in order[at + 1 :] if kind == "B" and (holding is None or p in holding)),
        None,
    )
    if following is None or order.index(("F", following)) > at:
        return None
    return following


def depth_allowed(
    events: Sequence[Event], offloaded: Iterable[GroupKey], depth: int
) -> dict[GroupKey, int | None]:
    """Offloaded group occurrence -> the index of the event after which a prefetch ``depth``
    groups ahead may reload it: the end of the backward of the occurrence ``depth`` places
    before it in backward order (0: its own start; -1: anywhere, fewer than ``depth`` before).
    Where groups nest (an attn_norm's backward ends after the groups inside it), the earliest
    end among the ``depth`` occurrences before it, so a deeper prefetch never allows less."""
    order = _BackwardOrder(events)
    return {key: order.allowed(key, depth) for key in offloaded}


class _BackwardOrder:
    """A step's group occurrences in backward order (by their first start mark), with where
    each one's backward starts and ends."""

    def __init__(self, events: Sequence[Event]) -> None:
        self.starts, self.ends = _first(events, START), _first(events, END)
        self.backward = sorted(self.starts, key=self.starts.__getitem__)
        self.place = {key: i for i, key in enumerate(self.backward)}

    def allowed(self, key: GroupKey, depth: int) -> int | None:
        if key not in self.place:
            return None
        at = self.place[key]
        if depth > at:
            return -1
        limit = self.starts[key]
        for before in self.backward[at - depth : at]:
            limit = min(limit, self.ends.get(before, self.starts[before]))
        return limit


def measured_depth(events: Sequence[Event]) -> int:
    """The least prefetch depth that allows every reload of the step (0 without a reload
    ahead of its group's backward): what an undeclared backend is held to afterwards."""
    order = _BackwardOrder(events)
    deepest = 0
    for index, event in enumerate(events):
        if event.kind != RELOAD or event.key not in order.starts:
            continue
        if index > order.starts[event.key]:
            continue
        depth = 1  # the least d whose allowed point (depth_allowed's) lies before the reload
        while index <= (order.allowed(event.key, depth) or 0) and depth <= order.place[event.key]:
            depth += 1
        deepest = max(deepest, depth)
    return deepest


@dataclass(frozen=True, kw_only=True, slots=True)
class StepCadence:
    """What one step's order showed."""

    step: int
    problems: tuple[str, ...] = ()
    reloads: int = 0
    """Reload copies ordered against the marks (of groups whose backward start was seen)."""
    unordered: int = 0
    """Reload copies of groups whose backward start was never seen (no gradient reached the
    window's output), which cannot be ordered."""
    ahead_groups: int = 0
    """The most group occurrences reloaded ahead of their backward at once."""
    ahead_bytes: int = 0
    """The most bytes reloaded ahead of their backward at once."""
    allowed_bytes: int = 0
    """The most bytes the rule has reloaded ahead at once."""
    where: str = ""
    """Where the step's most groups were ahead (``microbatch 0, after the end of ...``)."""


Namer = Callable[[int], str]
"""How messages name a pass (``harness.vocab.spec.pass_label`` of the case's schedule)."""


def judge_step(
    step: int,
    events: Sequence[Event],
    allowed: Mapping[GroupKey, int | None],
    sizes: Mapping[GroupKey, int],
    rule: str,
    name_pass: Namer,
) -> StepCadence:
    """Walk the step's order: every reload ahead of its group's backward must come after the
    event ``allowed`` names for it, and the bytes ahead at once never exceed the rule's
    (``sizes``: each offloaded occurrence's predicted reload bytes)."""
    starts = _first(events, START)
    ahead: dict[GroupKey, int] = {}
    problems: list[str] = []
    reloads = unordered = most = most_bytes = most_allowed = 0
    where = ""
    running: Event | None = None
    for index, event in enumerate(events):
        if event.kind != RELOAD:
            running = event
            if event.kind == START:
                ahead.pop(event.key, None)
            continue
        if event.key not in starts:
            unordered += 1
            continue
        reloads += 1
        if index > starts[event.key]:
            continue  # in its own backward: no prefetch
        ahead[event.key] = ahead.get(event.key, 0) + event.nbytes
        limit = allowed.get(event.key)
        in_rule = _in_flight(allowed, starts, sizes, index)
        budget = sum(in_rule.values())
        measured = sum(ahead.values())
        if len(ahead) > most:
            most, where = len(ahead), _at(running, name_pass)
        most_bytes, most_allowed = max(most_bytes, measured), max(most_allowed, budget)
        if problems:
            continue
        early = limit is None or index <= limit
        if early or measured > budget:
            problems.append(
                _problem(step, event, running, ahead, in_rule, rule, name_pass)
                + (
                    f"; first too early: {_occurrence(event.key, name_pass)}, which "
                    f"{_limit(limit, events, name_pass)}"
                    if early
                    else ""
                )
            )
    if problems:
        problems[0] += f" (in the step, at most {most} group(s), {most_bytes} B, ahead at once)"
    return StepCadence(
        step=step,
        problems=tuple(problems),
        reloads=reloads,
        unordered=unordered,
        ahead_groups=most,
        ahead_bytes=most_bytes,
        allowed_bytes=most_allowed,
        where=where,
    )


def _in_flight(
    allowed: Mapping[GroupKey, int | None],
    starts: Mapping[GroupKey, int],
    sizes: Mapping[GroupKey, int],
    index: int,
) -> dict[GroupKey, int]:
    """What the rule has reloaded ahead when event ``index`` is issued: bytes per group."""
    return {
        key: sizes.get(key, 0)
        for key, limit in allowed.items()
        if limit is not None and limit < index <= starts.get(key, -1)
    }


def _problem(
    step: int,
    event: Event,
    running: Event | None,
    ahead: Mapping[GroupKey, int],
    in_rule: Mapping[GroupKey, int],
    rule: str,
    name_pass: Namer,
) -> str:
    listed = ", ".join(f"{_occurrence(k, name_pass)} {b} B" for k, b in ahead.items())
    return (
        f"step {step}, {_at(running, name_pass)}: {len(ahead)} group(s) reloaded ahead of "
        f"their backward, {sum(ahead.values())} B ({listed}); {rule} allowed {len(in_rule)} "
        f"there ({sum(in_rule.values())} B)"
    )


def rule_peak(
    events: Sequence[Event], allowed: Mapping[GroupKey, int | None], sizes: Mapping[GroupKey, int]
) -> int:
    """The most bytes a rule has reloaded ahead of their backward at once anywhere in the step
    (every reload issued as early as ``allowed`` lets it)."""
    starts = _first(events, START)
    return max(
        (sum(_in_flight(allowed, starts, sizes, i).values()) for i in range(len(events))),
        default=0,
    )


def _at(running: Event | None, name_pass: Namer) -> str:
    """Where in backward an event falls: the pass, and the group whose backward runs or just
    ended."""
    if running is None:
        return "before any group's backward of the step"
    mb, layer, name = running.key
    what = "during the backward of" if running.kind == START else "after the backward of"
    return f"{name_pass(mb)}, {what} {name} (layer {layer})"


def _occurrence(key: GroupKey, name_pass: Namer) -> str:
    mb, layer, name = key
    return f"{name} ({name_pass(mb)}, layer {layer})"


def _limit(limit: int | None, events: Sequence[Event], name_pass: Namer) -> str:
    if limit is None:
        return "the rule never reloads ahead of its backward"
    if limit < 0:
        return "may come anywhere"
    mark = events[limit]
    if mark.kind == START:
        return "the rule reloads at its own backward"
    return f"may come no earlier than the end of {_occurrence(mark.key, name_pass)}'s backward"


@dataclass(frozen=True, kw_only=True, slots=True)
class Cadence:
    """The cadence of every step of an offload run."""

    rule: str
    """The rule the order was held to, as messages name it."""
    steps: tuple[StepCadence, ...]
    marks: int
    """Backward marks seen over the run (0: the harness could not order the backward)."""
    megatron_bytes: tuple[int, ...] = ()
    """For a prefetch depth learned from an undeclared offloader: per step, the most bytes
    Megatron-Core's rule has reloaded ahead of their backward at once anywhere in the step
    (``rule_peak``; empty otherwise): what the learned cadence costs against Megatron's."""

    def cost_note(self) -> str:
        """Where a learned prefetch depth reloads more ahead than Megatron-Core's rule would:
        how much more, at the backward's worst point (empty: not more, or not learned)."""
        if not self.megatron_bytes:
            return ""
        top = max(self.steps, key=lambda s: s.ahead_bytes, default=None)
        megatron = max(self.megatron_bytes)
        if top is None or top.ahead_bytes <= megatron:
            return ""
        return (
            f"note: its learned cadence reloads up to {top.ahead_bytes} B ahead of their "
            f"backward at once (step {top.step}, {top.where}); Megatron-Core's rule has at most "
            f"{megatron} B ahead at any point of a step: {top.ahead_bytes - megatron} B more "
            "device memory held early"
        )

    def problems(self, limit: int = 3) -> list[str]:
        """The first problem of each step that has one, the first ``limit`` steps."""
        return [p for s in self.steps if s.problems for p in s.problems][:limit]

    def summary(self) -> str:
        """One line: the most groups and bytes reloaded ahead at once, where, and the rule's
        most (the #7575 class shows as more than one group ahead)."""
        reloads = sum(s.reloads for s in self.steps)
        top = max(self.steps, key=lambda s: (s.ahead_groups, s.ahead_bytes), default=None)
        if top is None or not top.ahead_groups:
            return f"{reloads} reloads, none issued ahead of its group's backward ({self.rule})"
        allowed = max(s.allowed_bytes for s in self.steps)
        return (
            f"{reloads} reloads; at most {top.ahead_groups} group(s), {top.ahead_bytes} B, "
            f"reloaded ahead of their backward at once (step {top.step}, {top.where}); "
            f"{self.rule} allowed up to {allowed} B"
        )

    def record(self) -> dict[str, object]:
        """The report's ``cadence`` field."""
        return {
            "rule": self.rule,
            "marks": self.marks,
            "summary": self.summary(),
            "reloads": [s.reloads for s in self.steps],
            "unordered": [s.unordered for s in self.steps],
            "ahead_groups": [s.ahead_groups for s in self.steps],
            "ahead_bytes": [s.ahead_bytes for s in self.steps],
            "allowed_bytes": [s.allowed_bytes for s in self.steps],
            "megatron_bytes": list(self.megatron_bytes),
            "cost_note": self.cost_note(),
        }


def commit_order(observed: Observed, observations: Sequence[GroupObservation]) -> list[GroupKey]:
    """The step's group occurrences in commit order (``Observed.commits``); where the harness
    saw no commit (a backend driving its own groups without reporting them), the hooks run's
    start order, exact for groups that do not nest."""
    if observed.commits:
        return list(dict.fromkeys(observed.commits))
    return [(o.microbatch, o.layer, o.name) for o in observations]


def rule_label(semantics: Semantics) -> str:
    """How messages name the cadence rule of ``semantics``."""
    if semantics.prefetch_depth is None:
        return f"{semantics.label} (one reload per group backward end)"
    return f"{semantics.label} (prefetch depth {semantics.prefetch_depth})"


def allowed_for(
    events: Sequence[Event],
    passes: Mapping[int, Sequence[GroupKey]],
    order: Sequence[tuple[str, int]],
    semantics: Semantics,
    holding: Collection[int] | None = None,
) -> dict[GroupKey, int | None]:
    """Where the rule of ``semantics`` may reload each offloaded occurrence of the step
    (``holding``: ``megatron_allowed``'s)."""
    if semantics.prefetch_depth is None:
        return megatron_allowed(events, passes, order, holding)
    offloaded = [key for keys in passes.values() for key in keys]
    return depth_allowed(events, offloaded, semantics.prefetch_depth)


def run_cadence(
    observations: Sequence[GroupObservation],
    order: Sequence[tuple[str, int]],
    steps: Sequence[Observed],
    expected: Sequence[Mapping[GroupKey, Expected]],
    semantics: Semantics,
    selected: Iterable[str],
    name_pass: Namer,
) -> Cadence:
    """Every observed step's order held to the rule of ``semantics`` (``expected``: the
    warmup's prediction, then the steady state's; the last one stands for later steps)."""
    names = tuple(selected)
    rule = rule_label(semantics)
    judged = []
    marks = 0
    # a learned depth: what Megatron-Core's rule would have ahead at the same points
    learned = semantics.observed and semantics.prefetch_depth is not None
    megatron = dataclasses.replace(semantics, prefetch_depth=None)
    theirs: list[int] = []
    for step, observed in enumerate(steps):
        events = step_events(observed, names)
        marks += len(observed.marks)
        predicted = expected[min(step, len(expected) - 1)]
        passes: dict[int, list[GroupKey]] = {}
        committed = commit_order(observed, observations)
        for key in committed:
            if key in predicted and predicted[key].offloaded:
                passes.setdefault(key[0], []).append(key)
        sizes = {k: e.bytes for k, e in predicted.items() if e.offloaded}
        holding = {key[0] for key in committed if key[2] in names}
        allowed = allowed_for(events, passes, order, semantics, holding)
        judged.append(judge_step(step, events, allowed, sizes, rule, name_pass))
        if learned:
            theirs.append(rule_peak(events, allowed_for(events, passes, order, megatron), sizes))
    return Cadence(rule=rule, steps=tuple(judged), marks=marks, megatron_bytes=tuple(theirs))
