"""Localising a divergence: the smallest set of offload groups, then of layers, whose offloading
still makes the run differ from the plain baseline.

``RoutedOffloader`` wraps any backend: the groups a predicate selects go to the backend, every
other group gets the pass-through group a backend returns for unselected names (no autograd op,
no hook, no copy). The backend's configuration stays the validated one (``attn_proj`` alone would
be refused), only what reaches it is narrowed. Narrowing changes what the backend's policies see
(with one layer left, the margin policy may keep its group on the device after the warmup), so
a probe that matches proves only that this narrowed run is clean.

Search: the full selection first (it must diverge); then each group name alone, and if none
diverges alone, names are dropped one at a time while the run still diverges; then the same over
the layers that open those names. ``localise(case, env)`` is the one-call form for failure
messages: one baseline run plus one run per probe (about 1 + names + layers trainings).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from harness.cases import Case
from harness.execute.environment import Environment
from harness.models.train import TrainResult, train
from harness.offload.config import OffloadConfig
from harness.offload.passthrough import NoOffload, PassThroughGroup
from harness.offload.protocol import Group, Offloader, Wrapper
from harness.util import distributed
from harness.util.compare import Divergence, first_divergence, first_tensor_difference
from harness.vocab.spec import ModelSpec, RunSpec

Select = Callable[[str, int], bool]
"""``select(name, layer)``: whether a group occurrence goes to the backend."""


class RoutedOffloader(Wrapper):
    """``inner`` for the groups ``select`` picks, a pass-through group for all others."""

    def __init__(self, inner: Offloader, select: Select) -> None:
        super().__init__(inner, f"{inner.name}(routed)")
        self.select = select

    def group(self, name: str, x: torch.Tensor, *, layer: int) -> Group:
        if self.select(name, layer):
            return self.inner.group(name, x, layer=layer)
        return PassThroughGroup(x)


@dataclass(frozen=True, kw_only=True, slots=True)
class Probe:
    """One narrowed run and whether it still differs from the baseline."""

    names: tuple[str, ...]
    layers: tuple[int, ...] | None
    """None: every layer."""
    divergence: Divergence | None
    """First (step, microbatch) whose loss differs."""
    weights: tuple[str, float] | None
    """First final weight that differs (name, max |diff|), for bugs the losses do not show."""

    elsewhere: bool = False
    """Another rank's copy of this run diverged (multi-rank runs decide together)."""

    @property
    def diverged(self) -> bool:
        return self.divergence is not None or self.weights is not None or self.elsewhere

    def describe(self) -> str:
        if self.divergence is not None:
            d = self.divergence
            return f"diverges (step {d.step} microbatch {d.microbatch})"
        if self.weights is not None:
            return f"diverges (losses equal; final weight {self.weights[0]} differs)"
        if self.elsewhere:
            return "diverges on another rank"
        return "matches"


@dataclass(kw_only=True)
class Bisection:
    """What the search found; ``lines()`` is its report."""

    names: tuple[str, ...] = ()
    """Smallest diverging set of group names (empty: the full selection does not diverge)."""
    layers: tuple[int, ...] = ()
    """Smallest diverging set of layers with those names."""
    probes: list[Probe] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        if not self.names:
            return [*self.notes, f"bisect: {len(self.probes)} runs; nothing diverges to localise"]
        return [
            *self.notes,
            f"smallest diverging set: group{'s' if len(self.names) > 1 else ''} "
            f"{'+'.join(self.names)} on layer{'s' if len(self.layers) > 1 else ''} "
            f"{', '.join(map(str, self.layers))} ({len(self.probes)} runs)",
        ]


@dataclass(kw_only=True)
class Bisector:
    """Runs narrowed copies of one offload run and compares each with the baseline."""

    spec: ModelSpec
    run: RunSpec
    config: OffloadConfig
    make_offloader: Callable[[OffloadConfig], Offloader]
    device: torch.device
    baseline: TrainResult
    """The plain run, with ``final_state`` kept."""
    tolerance: float = 0.0
    sharding: str = "none"
    on_probe: Callable[[Probe], None] | None = None

    def probe(self, names: Sequence[str], layers: Sequence[int] | None = None) -> Probe:
        chosen, where = set(names), None if layers is None else set(layers)

        def select(name: str, layer: int) -> bool:
            return name in chosen and (where is None or layer in where)

        offloader = RoutedOffloader(self.make_offloader(self.config), select)
        try:
            result = train(
                self.spec,
                self.run,
                offloader,
                self.device,
                keep_final_state=True,
                sharding=self.sharding,
            )
        finally:
            offloader.close()
        divergence = first_divergence(self.baseline.losses, result.losses, self.tolerance)
        weights = first_tensor_difference(self.baseline.final_state, result.final_state)
        # Every rank must take the same path through the search (the runs hold collectives).
        local = divergence is not None or weights is not None
        probe = Probe(
            names=tuple(names),
            layers=None if layers is None else tuple(layers),
            divergence=divergence,
            weights=weights,
            elsewhere=any(distributed.all_gather_object(local)) and not local,
        )
        if self.on_probe is not None:
            self.on_probe(probe)
        return probe

    def layers_of(self, names: Sequence[str]) -> list[int]:
        return sorted({layer for layer, _ in self.spec.group_sequence(tuple(names))})

    def search(self) -> Bisection:
        names = [n for n in self.spec.group_names if n in self.config.offload_modules]
        out = Bisection()
        full = self.probe(names)
        out.probes.append(full)
        out.notes.append(f"all selected groups ({'+'.join(names)}): {full.describe()}")
        if not full.diverged:
            return out
        out.names = tuple(self._smallest(names, None, out, "group"))
        layers = self.layers_of(out.names)
        out.layers = tuple(self._smallest(layers, out.names, out, "layer"))
        return out

    def _smallest(
        self, items: list, names: tuple[str, ...] | None, out: Bisection, kind: str
    ) -> list:
        """Items (names, or layers with ``names``) alone; the first that diverges alone wins,
        else drop items one at a time while the run still diverges."""

        def run(subset: list) -> Probe:
            probe = self.probe(subset, None) if names is None else self.probe(names, subset)
            out.probes.append(probe)
            return probe

        if len(items) == 1:
            return items
        alone = [(item, run([item])) for item in items]
        label = "" if names is None else f" ({'+'.join(names)})"
        out.notes.append(
            f"{kind}s alone{label}: "
            + ", ".join(f"{kind} {item} {p.describe()}" for item, p in alone)
        )
        diverging = [item for item, p in alone if p.diverged]
        if diverging:
            return [diverging[0]]
        current = list(items)
        index = 0
        while index < len(current) and len(current) > 1:
            trial = current[:index] + current[index + 1 :]
            if run(trial).diverged:
                current = trial
            else:
                index += 1
        out.notes.append(
            f"no {kind} diverges alone; together these still diverge: "
            + ", ".join(map(str, current))
        )
        return current


def baseline_run(
    spec: ModelSpec, run: RunSpec, device: torch.device, sharding: str = "none"
) -> TrainResult:
    """The plain run a bisection compares with (final weights kept)."""
    return train(spec, run, NoOffload(), device, keep_final_state=True, sharding=sharding)


def localise(case: Case, env: Environment, baseline: TrainResult | None = None) -> list[str]:
    """Report lines naming the smallest diverging set of groups and layers of ``case`` under
    ``env``'s backend (pass ``baseline``, the plain run with ``final_state``, to save a run)."""
    spec, run = env.spec(case), case.run_spec()
    sharding = getattr(case, "sharding", "none")
    bisector = Bisector(
        spec=spec,
        run=run,
        config=case.offload_config(),
        make_offloader=env.offloader,
        device=env.device,
        baseline=baseline or baseline_run(spec, run, env.device, sharding),
        tolerance=case.tolerance,
        sharding=sharding,
    )
    return bisector.search().lines()
