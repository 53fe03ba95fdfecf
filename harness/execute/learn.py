"""An undeclared offloader's rule, learned from what it does; the checks then hold it to that rule.

A backend that declares no ``Semantics`` (``harness.offload.protocol.Capabilities``) is not
predicted with some fixed default: that would fail every correct offloader whose choices differ
from the default's. Instead the harness reads the choices the protocol leaves an offloader off
its own copies in the learning steps - the warmup (step 0) and the first steady step (step 1),
counted per group occurrence by the harness's windows - and picks the one rule that predicts
both exactly:

* which saved tensors it skips: storages shared with a parameter or a marked tensor
  (``storage``), only ``Parameter`` objects and tensors themselves marked (``object``), or
  nothing (``none``);
* a size threshold, if any, and where it lies (the configuration's, or between two saved sizes);
* non-contiguous views gathered or copied as their whole storage (or every part of a larger
  storage copied as that storage once, as TransformerEngine does);
* on a CPU device, whether a reload copies back or hands the host copy out;
* which occurrences move: every selected one every step, Megatron's warmup and steady-state
  policies with the configuration's parameters, or all but the last few of each pass (as
  TransformerEngine keeps its last layer);
* whether reloads keep the saved strides (read at every unpack by ``harness.measure.observe``);
* how far ahead of their group's backward reloads are issued: the least prefetch depth that
  allows every reload of the learning steps (``harness.execute.cadence``), held on every later step
  by the cadence check.

Every later step, microbatch and pass is then held to that rule exactly as a declared rule is
held (``harness.execute.caserun.CaseRun.step_mismatches``). Where no single rule explains the
learning steps' copies (a tensor copied in pieces, a choice the family does not list), the family
only explains: the offloader is held to its own learning steps instead
(``harness.execute.consistency``; ``ObservedRule.own``), its line says what was observed, and the
closest rule is kept in the report (``ObservedRule.closest``). The family also holds a layer
subset, one batched copy per group occurrence and a threshold in bytes.

What learning may not absorb, and why (each stays an absolute check, whatever was learned):

* **weights**: a learned ``skip="none"`` or ``"object"`` predicts the copies, but the weights
  check still fails every D2H of a parameter's storage - the protocol says marked tensors never
  move; only a backend that *declares* ``skip="none"`` is excused;
* **the offload happened**: every selected name moves bytes out in every pass of the warmup, and
  back unless the learned rule hands the host copy out on a CPU device - a rule learned from an
  offloader that moves nothing would otherwise predict nothing and pass;
* **reloads are bitwise** what was saved (checksums at pack and unpack), and the losses,
  gradients and weights equal the baseline's;
* **nothing moves when disabled, nothing outside the selected names**: the candidate rules only
  ever move selected groups, so a copy elsewhere has no rule that explains it;
* **consistency**: one rule for every step - the warmup and first steady step choose it, the
  rest must follow it;
* **no saved storage copied out more than its saves hold** (``Observed.overdrawn``): doubling
  every copy is a consistent rule of its own, and still wrong.

A bug that is a consistent rule of its own within these freedoms (a wrong fraction applied
every step, a threshold of its own) is indistinguishable from a design choice without a
declaration; the transfer check then passes with that said: "consistent with its observed rule;
declare semantics to check it against Megatron's".
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from harness.execute.attribution import COUNTER_FIELDS
from harness.execute.cadence import measured_depth, step_events
from harness.execute.consistency import (
    OwnRule,
    copy_sizes,
    describe_own,
    layer_words,
    learning_inconsistencies,
    own_rule,
)
from harness.execute.predict import Expected, group_copies, kept_decisions
from harness.measure.copyobserver import Observed
from harness.offload.config import OffloadConfig
from harness.offload.recorder import GroupObservation
from harness.offload.semantics import GroupKey, Semantics

LEARNING_STEPS = (0, 1)
"""The steps a rule is learned from: the warmup and the first steady step."""

UNDECIDED = "not decided by this case"

OBSERVED_LABEL = "its observed rule"

LEARNED_ONLY = (
    "the backend declares no semantics, so its rule is learned from steps 0 and 1, and this "
    "run has no later step to hold it to (run --steps 3 or more): judging the learning steps "
    "by what they taught would prove nothing"
)
"""Why an undeclared backend's transfer and cadence checks skip on a run of two steps or one."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ObservedRule:
    """The rule learned from an undeclared offloader's copies."""

    semantics: Semantics
    """The rule (``observed=True``); where none fits exactly, the closest one."""
    exact: bool
    """Whether it predicts every copy of the learning steps exactly."""
    line: str
    """``observed rule: ...`` in one line (or ``no single rule explains ...``)."""
    steps: tuple[int, ...]
    """The steps it was learned from."""
    misfits: int = 0
    """Group occurrences of the learning steps the closest rule gets wrong (0 when exact)."""
    own: OwnRule | None = None
    """Where no rule fits: what the offloader copied in its learning steps, the tables every
    later step is held to (``harness.execute.consistency``); ``line`` then describes them and
    ``closest`` names the closest rule of the family."""
    closest: str = ""
    """``no single rule explains ...; the closest, ..., misses N group occurrence(s)``."""
    inconsistent: tuple[str, ...] = ()
    """With ``own``: what breaks consistency inside the learning steps
    (``harness.execute.consistency.learning_inconsistencies``)."""

    def record(self) -> dict[str, object]:
        """The report's ``rule`` field."""
        out: dict[str, object] = {
            "source": "observed",
            "line": self.line,
            "exact": self.exact,
            "steps": self.steps,
        }
        if self.own is not None:
            out["held_to"] = "its own first steady step"
            out["closest"] = self.closest
        return out


def expected_fields(
    expected: Mapping[GroupKey, Expected], semantics: Semantics, device_type: str
) -> dict[GroupKey, dict[str, int]]:
    """The counter fields a prediction expects per group occurrence that moves (no reload on
    a CPU device where the rule hands the host copy out)."""
    back = semantics.reloads_on(device_type)
    return {
        k: dict(
            zip(
                COUNTER_FIELDS,
                (e.copies, e.bytes, e.copies if back else 0, e.bytes if back else 0),
                strict=True,
            )
        )
        for k, e in expected.items()
        if e.copies
    }


def learn(
    observations: Sequence[GroupObservation],
    config: OffloadConfig,
    order: Sequence[tuple[str, int]],
    measured: Sequence[Mapping[GroupKey, Mapping[str, int]]],
    device_type: str,
    relaid: bool,
) -> ObservedRule:
    """The rule that predicts ``measured`` (per group occurrence, of the learning steps in
    order: ``measured[0]`` is the warmup's) exactly, the first in ``_scored``'s order of
    preference; else the closest. ``relaid``: a reload came back with other strides than the
    saved tensor's (the layout baseline then applies)."""
    layout = "contiguous" if relaid else "saved"
    scored = [
        (misses, dataclasses.replace(rule, reload_layout=layout))
        for misses, rule in _scored(observations, config, order, measured, device_type)
    ]
    exact = [rule for misses, rule in scored if misses == 0]
    if exact:  # a byte threshold or one batched copy only where the plainer rule does not fit
        first = exact[0]
        exact = [
            r
            for r in exact
            if (r.threshold_unit, r.batched) == (first.threshold_unit, first.batched)
        ]
    steps = LEARNING_STEPS[: len(measured)]
    if exact:
        return ObservedRule(
            semantics=exact[0],
            exact=True,
            line=describe(exact, device_type, config),
            steps=steps,
        )
    misses, closest = min(scored, key=lambda pair: pair[0])  # the first of the closest
    where = " and ".join(str(s) for s in steps)
    words = describe([closest], device_type, config).removeprefix("observed rule: ")
    return ObservedRule(
        semantics=closest,
        exact=False,
        line=(
            f"no single rule explains its copies in step{'s' if len(steps) > 1 else ''} {where}; "
            f"the closest, {words}, "
            f"misses {misses} group occurrence(s)"
        ),
        steps=steps,
        misfits=misses,
    )


def learn_from_steps(
    observations: Sequence[GroupObservation],
    config: OffloadConfig,
    order: Sequence[tuple[str, int]],
    steps: Sequence[Observed],
    device_type: str,
    schedule: str = "sequential",
) -> ObservedRule:
    """``learn`` from an offload run's observed steps (the model's own copies removed, step 0
    first): the learning steps' copies by the harness's windows, and whether any reload of
    them came back with other strides than the saved tensor's. Where no rule of the family
    fits, the offloader is held to its own learning steps (``ObservedRule.own``)."""
    mode = "device" if device_type == "cuda" else "cpu"
    learning = [steps[s].counts(mode).by_group() for s in LEARNING_STEPS if s < len(steps)]
    # the layout is learned like the rest, from the learning steps only: a later step whose
    # reloads change strides is an inconsistency (``relaid_inconsistencies``), not the rule
    relaid = any(steps[s].relaid for s in LEARNING_STEPS if s < len(steps))
    rule = learn(observations, config, order, learning, device_type, relaid)
    if not rule.exact:
        own = own_rule(learning, [copy_sizes(steps[s]) for s in LEARNING_STEPS if s < len(steps)])
        rule = dataclasses.replace(
            rule,
            own=own,
            closest=rule.line,
            line=describe_own(own, observations, config.offload_modules, device_type),
            inconsistent=tuple(learning_inconsistencies(own, observations, schedule, device_type)),
        )
    depth = max(
        (
            measured_depth(step_events(steps[s], config.selected))
            for s in LEARNING_STEPS
            if s < len(steps)
        ),
        default=0,
    )
    return with_prefetch_depth(rule, depth)


def with_prefetch_depth(rule: ObservedRule, depth: int) -> ObservedRule:
    """``rule`` holding later steps to the prefetch depth its learning steps showed: the least
    depth that allows every reload of steps 0 and 1 (``harness.execute.cadence.measured_depth``; 0
    when no reload came ahead of its group's backward)."""
    ahead = (
        "reloads at its group's backward (never ahead)"
        if depth == 0
        else f"reloads at most {depth} group(s) ahead of their backward"
    )
    return dataclasses.replace(
        rule,
        semantics=dataclasses.replace(rule.semantics, prefetch_depth=depth),
        line=f"{rule.line}, {ahead}",
    )


Fields = tuple[int, int, int, int]


def _scored(
    observations: Sequence[GroupObservation],
    config: OffloadConfig,
    order: Sequence[tuple[str, int]],
    measured: Sequence[Mapping[GroupKey, Mapping[str, int]]],
    device_type: str,
) -> Iterator[tuple[int, Semantics]]:
    """(group occurrences of the learning steps it gets wrong, rule) for every candidate, in
    order of preference. What a tensor rule copies per occurrence is worked out once for all
    its policies, and Megatron's decisions once per distinct set of group sizes."""
    keys = [(o.microbatch, o.layer, o.name) for o in observations]
    seen = [
        {k: tuple(v[f] for f in COUNTER_FIELDS) for k, v in counts.items() if any(v.values())}
        for counts in measured
    ]
    batched = bool(seen) and all(f[0] == 1 for counts in seen for f in counts.values() if f[0])
    decided: dict[tuple[object, ...], tuple[dict[GroupKey, str], dict[GroupKey, str]]] = {}
    for tensor_rule in _tensor_rules(observations, batched):
        moved = {
            k: group_copies(o, config, tensor_rule) for k, o in zip(keys, observations, strict=True)
        }
        sizes = {k: b for k, (_, b) in moved.items()}
        for policy, last, layers in _policies(keys, seen):
            rule = dataclasses.replace(tensor_rule, policies=policy, keep_last=last, layers=layers)
            memo = (policy, last, layers, tuple(sizes.values()))
            if memo not in decided:
                decided[memo] = kept_decisions(keys, sizes, config, order, rule)
            first, then = decided[memo]
            for back in (True, False) if device_type != "cuda" else (True,):
                final = dataclasses.replace(rule, host_reload=back)
                returns = final.reloads_on(device_type)
                misses = 0
                for step, counts in enumerate(seen):
                    kept = first if step == 0 else then
                    predicted: dict[GroupKey, Fields] = {
                        k: (c, b, c if returns else 0, b if returns else 0)
                        for k, (c, b) in moved.items()
                        if c and k not in kept
                    }
                    misses += sum(predicted.get(k) != counts.get(k) for k in {*predicted, *counts})
                yield misses, final


POLICIES = (("every", 0), ("megatron", 0), ("every", 1), ("every", 2))
"""The occurrence policies a rule may have, in order of preference: every selected occurrence
every step, Megatron's warmup and steady-state policies, all but the last one or two of each
pass."""


def _policies(
    keys: Sequence[GroupKey], seen: Sequence[Mapping[GroupKey, Fields]]
) -> Iterator[tuple[str, int, frozenset[int] | None]]:
    """``POLICIES``, then a layer subset: only the layers that moved anything in the learning
    steps, where that is some of the selected groups' layers but not all (TransformerEngine's
    ``num_layers``)."""
    for policy, last in POLICIES:
        yield policy, last, None
    every = {layer for _, layer, _ in keys}
    moved = frozenset(k[1] for counts in seen for k, f in counts.items() if f[0])
    if moved and moved < every:
        yield "every", 0, moved


def _tensor_rules(observations: Sequence[GroupObservation], batched: bool) -> Iterator[Semantics]:
    """Every choice of which saved tensors move and how, most expected first: the preference
    decides between rules that predict the learning steps alike. A threshold counts elements,
    or bytes where the saved tensors have more than one element size (else the two are one
    rule); ``batched``: every occurrence that moved made one copy, so one copy per group
    occurrence is a candidate too."""
    on_device = [s for o in observations for s in o.saved if s.on_device and s.numel]
    units: list[tuple[str, list[int | None]]] = []
    elements = sorted({s.numel for s in on_device})
    units.append(("elements", [None, 0, *(n for n in elements if n > 1)]))  # None: the config's
    if len({s.itemsize for s in on_device}) > 1:
        nbytes = sorted({s.numel * s.itemsize for s in on_device})
        units.append(("bytes", [n for n in nbytes if n > 1]))
    batches = (False, True) if batched else (False,)
    for batch, (unit, thresholds) in itertools.product(batches, units):
        for skip, threshold, view in itertools.product(
            ("storage", "object", "none"), thresholds, ("gather", "coverage", "base")
        ):
            yield Semantics(
                view_copy=view,
                skip=skip,
                policies="every",
                size_threshold=threshold != 0,
                min_size=threshold,
                threshold_unit=unit,
                batched=batch,
                observed=True,
                label=OBSERVED_LABEL,
            )


def describe(rules: Sequence[Semantics], device_type: str, config: OffloadConfig) -> str:
    """``observed rule: ...``: what every rule in ``rules`` (the ones that fit alike) says; a
    choice they disagree on is named with its alternatives, as not decided by this case."""

    def one(field: str, what: str, say: Mapping[object, tuple[str, str]]) -> str:
        values = list(dict.fromkeys(getattr(r, field) for r in rules))
        if len(values) == 1:
            return say[values[0]][0]
        return f"{what} {UNDECIDED} ({' or '.join(say[v][1] for v in values)})"

    parts = [
        one(
            "skip",
            "skip rule",
            {
                "storage": ("skips marked and parameter storages", "storages"),
                "object": ("skips Parameter objects and marked tensors only", "objects"),
                "none": ("moves every saved tensor, weights included", "nothing"),
            },
        ),
        _threshold_words(
            {r.threshold(config) for r in rules},
            config.min_offloaded_tensor_size,
            rules[0].threshold_unit,
        ),
        one(
            "view_copy",
            "view copy",
            {
                "gather": ("views gathered", "gathered"),
                "coverage": ("a view over half its storage or more copied whole", "whole storage"),
                "base": ("a part of a larger storage copied as the whole storage, once", "base"),
            },
        ),
    ]
    if device_type != "cuda":
        parts.append(
            one(
                "host_reload",
                "CPU reload",
                {
                    True: ("CPU reload copies back", "copies back"),
                    False: ("CPU reload hands back the host copy", "hands back"),
                },
            )
        )
    parts.append(
        "reloads keep the saved strides"
        if rules[0].reload_layout == "saved"
        else "reloads come back contiguous (judged against the layout baseline)"
    )
    if rules[0].batched:
        parts.append("one copy per group occurrence each way")
    policies = list(dict.fromkeys((r.policies, r.keep_last, r.layers) for r in rules))
    words = {
        ("every", 0, None): "every selected occurrence every step",
        ("megatron", 0, None): "Megatron's warmup and steady-state policies",
    }
    named = [
        words.get(p)
        or (
            f"only layer{'s' if len(p[2]) > 1 else ''} {layer_words(p[2])} offloaded, every step"
            if p[2] is not None
            else f"the last {p[1]} selected occurrence(s) of each pass stay"
        )
        for p in policies
    ]
    parts.append(named[0] if len(named) == 1 else f"occurrences {UNDECIDED} ({' or '.join(named)})")
    return "observed rule: " + ", ".join(parts)


def _threshold_words(fits: set[int], configured: int, unit: str = "elements") -> str:
    """The size threshold, from every threshold that fits alike (0: none), in ``unit``."""
    low, high = min(fits), max(fits)
    if low == high == 0:
        return "no size threshold"
    if low == high:
        configs = low == configured and unit == "elements"
        what = f"min_offloaded_tensor_size ({low})" if configs else str(low)
        return f"tensors under {what} {unit} stay"
    if low == 0:
        return f"no size threshold, or one of at most {high} {unit} ({UNDECIDED})"
    return f"tensors under {low} to {high} {unit} stay ({UNDECIDED} exactly)"
