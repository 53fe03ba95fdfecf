"""``OffloadConfig``: the offloader's knobs, mirroring Megatron-Core's TransformerConfig fields.

| ours                                   | Megatron-Core                                      |
| -------------------------------------- | -------------------------------------------------- |
| offload_modules                        | offload_modules                                    |
| min_offloaded_tensor_size (elements)   | min_offloaded_tensor_size                          |
| activation_offload_fraction            | activation_offload_fraction                        |
| delta_offload_bytes_across_pp_ranks    | delta_offload_bytes_across_pp_ranks                |
| max_inflight_offloads                  | fine_grained_offloading_max_inflight_offloads      |
| pp_rank                                | the pipeline rank passed to init_chunk_handler     |
| pinned_pool_buffers                    | (none: PaddleFleet's pool cap, #1877)              |

Validation mirrors Megatron's rules; every violation is a one-line ``ValueError``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from harness.vocab.groups import GROUPS
from harness.vocab.spec import ALL_GROUP_NAMES, ModelSpec

MOE_EXPERT_NAMES = frozenset(name for name, group in GROUPS.items() if group.routing_dependent)
"""Groups whose saved shapes vary with routing; they never use the pinned pool."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadConfig:
    """What to offload and the policies that switch groups back to GPU-resident."""

    offload_modules: tuple[str, ...]
    """Group names to offload (non-empty subset of ``ALL_GROUP_NAMES``)."""
    min_offloaded_tensor_size: int = 1024 * 1024
    """Tensors with fewer elements stay on the device (``numel == min`` is offloaded)."""
    activation_offload_fraction: float = 1.0
    """Per chunk, offload this fraction of eligible groups; ``int(n * (1 - f))`` trailing groups
    stay (Python float floor: n=10, f=0.8 keeps 1, i.e. offloads 90%)."""
    delta_offload_bytes_across_pp_ranks: int = 0
    """Keep the first ``pp_rank * delta`` bytes (whole groups, earliest first) on the device."""
    max_inflight_offloads: int | None = None
    """Per group name, at most this many D2H copies may be pending after a commit; the compute
    stream waits for the oldest beyond it. None: no cap."""
    pp_rank: int = 0
    """Pipeline rank this offloader serves (drives the delta policy)."""
    pinned_pool_buffers: int | None = None
    """At most this many host buffers in the pinned pool (None: no cap; Megatron has none,
    PaddleFleet's port caps it). An offload that finds the pool exhausted takes a buffer of its
    own outside the pool and counts the exhaustion; the run stays bitwise."""

    def __post_init__(self) -> None:
        modules = self.offload_modules
        if isinstance(modules, str) or not isinstance(modules, tuple | list | frozenset | set):
            raise ValueError(
                f"offload_modules must be a tuple of names from {', '.join(ALL_GROUP_NAMES)}; "
                f"got {modules!r}"
            )
        object.__setattr__(self, "offload_modules", tuple(modules))
        if not self.offload_modules:
            raise ValueError(
                f"offload_modules must not be empty; choose from {', '.join(ALL_GROUP_NAMES)}"
            )
        unknown = [m for m in self.offload_modules if m not in ALL_GROUP_NAMES]
        if unknown:
            raise ValueError(
                f"unknown offload module(s) {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(ALL_GROUP_NAMES)}"
            )
        if len(set(self.offload_modules)) != len(self.offload_modules):
            raise ValueError(f"offload_modules lists a name twice: {self.offload_modules!r}")
        _check_group_rules(self.offload_modules)
        _check_int(self, "min_offloaded_tensor_size", minimum=0)
        _check_int(self, "delta_offload_bytes_across_pp_ranks", minimum=0)
        _check_int(self, "pp_rank", minimum=0)
        if self.max_inflight_offloads is not None:
            _check_int(self, "max_inflight_offloads", minimum=0)
        if self.pinned_pool_buffers is not None:
            _check_int(self, "pinned_pool_buffers", minimum=0)
        fraction = self.activation_offload_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, int | float):
            raise ValueError(f"activation_offload_fraction must be a number, got {fraction!r}")
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"activation_offload_fraction must be in [0, 1], got {fraction!r}")

    @property
    def selected(self) -> frozenset[str]:
        """The selected group names as a set."""
        return frozenset(self.offload_modules)

    def check_applies_to(self, spec: ModelSpec) -> None:
        """Raise if a selected name cannot produce a group in ``spec``'s model.

        Megatron silently ignores such names (e.g. mlp_norm on a model without MoE layers);
        the harness reports them, so a configured name always takes effect.
        """
        available = spec.group_names
        missing = [m for m in self.offload_modules if m not in available]
        if missing:
            offered = ", ".join(available) if available else "no groups at all"
            raise ValueError(
                f"offload module(s) {', '.join(missing)} cannot apply to pattern {spec.pattern!r} "
                f"(moe_path={spec.moe_path}); its layers open: {offered}"
            )

    def replace(self, **changes: object) -> OffloadConfig:
        """A copy with fields changed (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def _check_group_rules(names: tuple[str, ...]) -> None:
    """Each selected name's ``requires`` and ``excludes`` (``harness.vocab.groups.GROUPS``)."""
    selected = set(names)
    for name in names:
        group = GROUPS[name]
        missing = [f"'{other}'" for other in group.requires if other not in selected]
        if missing:
            raise ValueError(
                f"offload module '{name}' requires {' and '.join(missing)} ({group.reason})"
            )
    # The name that excludes the most is named first ('fused_group_mlp' cannot be combined
    # with 'expert_fc1' or 'moe_act'), whichever of them was listed first.
    for name in sorted(selected, key=lambda n: (-len(GROUPS[n].excludes), names.index(n))):
        group = GROUPS[name]
        clash = [f"'{other}'" for other in group.excludes if other in selected]
        if clash:
            allowed = " or ".join(f"'{other}'" for other in group.excludes)
            raise ValueError(
                f"offload module '{name}' cannot be combined with {allowed} ({group.reason})"
            )


def _check_int(obj: object, name: str, *, minimum: int) -> None:
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
