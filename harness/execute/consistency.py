"""An undeclared offloader that no rule of the family explains is held to its own first steady step.

The family of ``harness.execute.learn`` (skip rule, threshold, view copy, hand-back, layer subset,
batched copies, occurrence policy) explains what most offloaders do; it is not the oracle. Where
no rule of it predicts the learning steps exactly, the case holds the offloader to what it did
itself, plus the absolute invariants that no design choice may break:

* **its own tables**: what each group occurrence copied in the warmup (step 0) and in the first
  steady step (step 1), both directions, copies and bytes (``OwnRule``); every later step must
  copy, per group occurrence, exactly what step 1 did (the transfer check's step comparisons
  read these tables where a rule's prediction would stand);
* **consistency within the learning steps** (``learning_inconsistencies``): every pass of the
  warmup moves what the first pass with the same layers moved (one rule for every microbatch);
  an occurrence moved in both learning steps moves the same copies and bytes in both (a warmup
  may choose *which* occurrences move differently, never *how* one moves); a reload brings back
  every byte its occurrence offloaded or, on a CPU device, none (the host copy handed back);
* **the offload happened in every step** (``steady_proof``): each selected name moves bytes out
  (and back, unless its reloads hand back the host copy) in every steady step, not only in the
  warmup - an offloader that stops moving after step 0 has empty tables to be consistent with.

A difference names the step, the pass, the layer, the group and, by size, the saved tensor whose
copy appeared or went missing (``size_difference``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from harness.execute.attribution import _ZERO
from harness.execute.predict import Expected
from harness.measure.copyobserver import Observed
from harness.measure.transfers import TransferCounts
from harness.offload.recorder import GroupObservation, SavedInfo
from harness.offload.semantics import GroupKey
from harness.vocab.spec import pass_label

Table = dict[GroupKey, dict[str, int]]
Sizes = dict[GroupKey, dict[str, tuple[int, ...]]]
"""Per group occurrence and direction (``d2h``, ``h2d``): the bytes of each copy, sorted."""

HELD = "held to its own first steady step"


@dataclass(frozen=True, kw_only=True, slots=True)
class OwnRule:
    """What an undeclared offloader copied in its learning steps, per group occurrence."""

    warmup: Table
    steady: Table
    sizes: tuple[Sizes, Sizes]
    """The copies' sizes of the warmup and of the first steady step."""

    def table(self, step: int) -> Table:
        return self.warmup if step == 0 else self.steady

    def why(self, step: int) -> str:
        return "as in its warmup (step 0)" if step == 0 else "as in its first steady step (step 1)"


def copy_sizes(observed: Observed) -> Sizes:
    """The sizes of every attributed copy of a step, per group occurrence and direction."""
    found: dict[GroupKey, dict[str, list[int]]] = {}
    for copy in observed.copies:
        if copy.group is not None:
            found.setdefault(copy.group, {"d2h": [], "h2d": []})[copy.direction].append(copy.nbytes)
    return {k: {d: tuple(sorted(v)) for d, v in by.items()} for k, by in found.items()}


def own_rule(
    learning: Sequence[Mapping[GroupKey, Mapping[str, int]]], sizes: Sequence[Sizes]
) -> OwnRule:
    """The tables of the learning steps (``learning[0]``: the warmup's counts per group
    occurrence; a one-step run's warmup stands for the steady state too)."""
    tables = [{k: dict(v) for k, v in counts.items() if any(v.values())} for counts in learning]
    steady = tables[1] if len(tables) > 1 else tables[0]
    return OwnRule(
        warmup=tables[0],
        steady=steady,
        sizes=(sizes[0], sizes[1] if len(sizes) > 1 else sizes[0]),
    )


def own_expected(
    own: OwnRule, observations: Sequence[GroupObservation], closest: Mapping[GroupKey, Expected]
) -> tuple[dict[GroupKey, Expected], dict[GroupKey, Expected]]:
    """The (warmup, steady) expectations the other checks read (fidelity, cadence, memory):
    each occurrence moves what its table says; which device storages a move frees is the
    closest rule's guess for that occurrence (the tables know bytes, not tensors)."""

    def one(table: Table, step: int) -> dict[GroupKey, Expected]:
        out = {}
        for o in observations:
            key = (o.microbatch, o.layer, o.name)
            fields = table.get(key, _ZERO)
            guess = closest.get(key)
            out[key] = Expected(
                decision="offloaded" if fields["d2h_copies"] else "kept:own",
                copies=fields["d2h_copies"],
                bytes=fields["d2h_bytes"],
                freed_storages=guess.freed_storages
                if guess is not None and fields["d2h_copies"]
                else frozenset(),
                why=own.why(step),
            )
        return out

    return one(own.warmup, 0), one(own.steady, 1)


def describe_own(
    own: OwnRule, observations: Sequence[GroupObservation], selected: Iterable[str], device: str
) -> str:
    """``observed: offloads core_attn and attn_proj of layers 0-1, every step; one copy per
    group occurrence; ...; held to its own first steady step``."""
    names = [n for n in dict.fromkeys(o.name for o in observations) if n in set(selected)]
    layers_of = {n: sorted({o.layer for o in observations if o.name == n}) for n in names}

    def what(table: Table) -> str:
        moved = {
            n: sorted({k[1] for k, f in table.items() if f["d2h_copies"] and k[2] == n})
            for n in names
        }
        moved = {n: ls for n, ls in moved.items() if ls}
        if not moved:
            return "nothing"
        groups: dict[tuple[int, ...], list[str]] = {}
        for n, ls in moved.items():
            groups.setdefault(tuple(ls) if ls != layers_of[n] else (), []).append(n)
        parts = []
        for ls, ns in groups.items():
            listed = _and(ns)
            parts.append(
                f"every {listed} occurrence" if not ls else f"{listed} of layers {layer_words(ls)}"
            )
        return _and(parts)

    warm, steady = what(own.warmup), what(own.steady)
    when = (
        f"offloads {steady}, every step"
        if warm == steady
        else f"offloads {warm} in the warmup, {steady} after"
    )
    moved = [f for t in (own.warmup, own.steady) for f in t.values() if f["d2h_copies"]]
    per = sorted({f["d2h_copies"] for f in moved})
    if not per:
        copies = "no copy"
    elif per == [1]:
        copies = "one copy per group occurrence"
    elif len(per) == 1:
        copies = f"{per[0]} copies per group occurrence"
    else:
        copies = f"{per[0]} to {per[-1]} copies per group occurrence"
    if all(f["h2d_bytes"] == f["d2h_bytes"] and f["h2d_copies"] for f in moved):
        back = "reloads copy back"
    elif device != "cuda" and all(not f["h2d_copies"] for f in moved):
        back = "CPU reload hands back the host copy"
    else:
        back = "reloads bring back part of what went out"
    return f"observed: {when}; {copies}; {back}; {HELD}"


def learning_inconsistencies(
    own: OwnRule, observations: Sequence[GroupObservation], schedule: str, device: str
) -> list[str]:
    """What breaks consistency inside the learning steps (the module docstring's second point)."""

    def where(step: int, key: GroupKey) -> str:
        return f"step {step}, {pass_label(key[0], schedule)}, layer {key[1]}, group {key[2]}"

    def sizes(step: int, key: GroupKey, other_step: int, other: GroupKey) -> str:
        mine, theirs = own.sizes[step].get(key, {}), own.sizes[other_step].get(other, {})
        return size_difference(key, mine, theirs, observations)

    problems = []
    # every pass of the warmup moves what the first pass with the same layers moved
    passes: dict[int, list[tuple[int, str]]] = {}
    for o in observations:
        passes.setdefault(o.microbatch, []).append((o.layer, o.name))
    first: dict[tuple[tuple[int, str], ...], int] = {}
    for p, keys in sorted(passes.items()):
        ref = first.setdefault(tuple(sorted(keys)), p)
        for layer, name in keys if ref != p else ():
            key, other = (p, layer, name), (ref, layer, name)
            mine, theirs = own.warmup.get(key, _ZERO), own.warmup.get(other, _ZERO)
            if mine != theirs:
                problems.append(
                    f"{where(0, key)}: copied {_short(mine)}, {pass_label(ref, schedule)} of "
                    f"the same warmup {_short(theirs)}: every pass of the warmup is held to one "
                    f"rule{sizes(0, key, 0, other)}"
                )
    # an occurrence moved in both learning steps moves alike in both
    for key in sorted(set(own.warmup) & set(own.steady)):
        a, b = own.warmup[key], own.steady[key]
        if a["d2h_copies"] and b["d2h_copies"] and a != b:
            problems.append(
                f"{where(1, key)}: copied {_short(b)}, in the warmup {_short(a)}: an occurrence "
                f"offloaded in both moves the same tensors{sizes(1, key, 0, key)}"
            )
    # a reload brings back all its occurrence offloaded, or (CPU) nothing
    nothing = "" if device == "cuda" else " or, handing back the host copies, nothing"
    for step, table in enumerate((own.warmup, own.steady)):
        for key, f in sorted(table.items()):
            whole = (f["h2d_copies"], f["h2d_bytes"]) == (f["d2h_copies"], f["d2h_bytes"])
            if not whole and (device == "cuda" or f["h2d_copies"]):
                problems.append(
                    f"{where(step, key)}: {_short(f)}: a reload brings back everything its "
                    f"occurrence offloaded{nothing}"
                )
    return problems


def steady_proof(
    per_step: Sequence[TransferCounts], names: Iterable[str], hands_back: bool
) -> list[str]:
    """Each selected name moves bytes out (and back unless ``hands_back``) in every step after
    the warmup: the first step that breaks it, per name."""
    problems = []
    wanted = sorted(set(names))
    way = "out" if hands_back else "both ways"
    for step, counts in enumerate(per_step[1:], start=1):
        by_group = counts.by_group()
        for name in wanted:
            fields = [f for (_, _, n), f in by_group.items() if n == name]
            out = any(f["d2h_bytes"] for f in fields)
            back = hands_back or any(f["h2d_bytes"] for f in fields)
            if not (out and back):
                problems.append(f"step {step}: no {name} group moved bytes {way}")
        if len(problems) >= 3:
            break
    return problems


def size_difference(
    key: GroupKey,
    mine: Mapping[str, tuple[int, ...]],
    reference: Mapping[str, tuple[int, ...]],
    observations: Sequence[GroupObservation],
) -> str:
    """``; missing out: 1 copy of 8192 B (saved tensor 2 of 4, (2, 16, 64) float32)``: the
    copies one side has and the other has not, by size, each named by the saved tensors of
    that size (empty: the same sizes)."""
    saved = next((o.saved for o in observations if (o.microbatch, o.layer, o.name) == key), ())
    parts = []
    for direction, word in (("d2h", "out"), ("h2d", "back")):
        have, want = Counter(mine.get(direction, ())), Counter(reference.get(direction, ()))
        missing, extra = want - have, have - want
        if sum(missing.values()) == sum(extra.values()) == 1:  # one copy of another size
            (due,), (made,) = missing, extra
            short = abs(due - made)
            what = "short" if made < due else "over"
            parts.append(
                f"{word}: a copy of {made} B where {due} B was due, {short} B {what} "
                f"({_tensor_named(short, saved)})"
            )
            continue
        for label, diff in (("missing", missing), ("extra", extra)):
            for nbytes, count in sorted(diff.items()):
                copies = "1 copy" if count == 1 else f"{count} copies"
                named = _tensor_named(nbytes, saved)
                parts.append(f"{label} {word}: {copies} of {nbytes} B ({named})")
    return "; " + "; ".join(parts) if parts else ""


def _tensor_named(nbytes: int, saved: Sequence[SavedInfo]) -> str:
    matches = [
        f"saved tensor {i + 1} of {len(saved)}, {s.shape} {str(s.dtype).removeprefix('torch.')}"
        for i, s in enumerate(saved)
        if nbytes in (s.numel * s.itemsize, s.storage_nbytes)
    ]
    if not matches:
        return "no saved tensor of the group has that size: a batched or partial copy"
    return (
        matches[0]
        if len(matches) == 1
        else f"{matches[0]}, or {len(matches) - 1} more of that size"
    )


def _short(f: Mapping[str, int]) -> str:
    return (
        f"{f['d2h_copies']} / {f['d2h_bytes']} B out, {f['h2d_copies']} / {f['h2d_bytes']} B back"
    )


def _and(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + f" and {items[-1]}"


def layer_words(layers: Iterable[int]) -> str:
    """``0-1``, ``0 and 2``, ``0, 2 and 5``: a set of layers in words."""
    ordered = sorted(layers)
    if len(ordered) > 1 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}-{ordered[-1]}"
    return _and([str(x) for x in ordered])
