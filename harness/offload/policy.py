"""Post-warmup policies: which recorded groups stay on the device from the second iteration on.

Run once, at the end of the warmup iteration, over the chunks the warmup recorded. Policies only
ever switch groups off, in Megatron-Core's order:

1. margin   - the last group of each name in the first chunk to run backward stays (its backward
              follows its forward immediately, so an offload would be reloaded at once);
              the number switched off is the largest count of distinct names in any chunk.
2. delta    - on pipeline rank r, the earliest groups (backward-chunk order, then forward order)
              stay until r * delta bytes are kept (the last one may overshoot).
3. fraction - per chunk, of the n groups still offloaded with bytes > 0, the last
              ``int(n * (1 - f))`` in forward order stay. This is Python float arithmetic, floor
              included: n=10, f=0.8 gives int(1.9999999999999996) = 1, so 90% are offloaded;
              n=5, f=0.8 gives int(0.9999999999999998) = 0, so all five are.

Then the summary: per name, the warmup bytes of groups still offloaded, summed over forward
chunks up to and including the first chunk to run backward (the in-flight peak under 1F1B).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class PolicyGroup(Protocol):
    name: str
    offload: bool
    decision: str
    warmup_bytes: int


class PolicyChunk(Protocol):
    @property
    def groups(self) -> Sequence[PolicyGroup]: ...


def _keep(group: PolicyGroup, policy: str) -> None:
    group.offload = False
    group.decision = f"kept:{policy}"


def apply_margin(backward_chunks: Sequence[PolicyChunk]) -> int:
    """Keep the first-backward chunk's last group of each name; returns how many were kept."""
    margin = max((len({g.name for g in c.groups}) for c in backward_chunks), default=0)
    last_by_name: dict[str, PolicyGroup] = {}
    # Later (earlier-in-backward) chunks overwrite the entry but keep its dict position.
    for chunk in reversed(backward_chunks):
        for group in chunk.groups:
            last_by_name[group.name] = group
    kept = 0
    for group in list(last_by_name.values())[:margin]:
        _keep(group, "margin")
        kept += 1
    return kept


def apply_delta(backward_chunks: Sequence[PolicyChunk], keep_bytes: int) -> None:
    """Keep the earliest offloaded groups until ``keep_bytes`` are kept."""
    for chunk in backward_chunks:
        for group in chunk.groups:
            if group.offload and keep_bytes > 0:
                keep_bytes -= group.warmup_bytes
                _keep(group, "delta")


def fraction_disabled_count(eligible: int, fraction: float) -> int:
    """How many of ``eligible`` groups the fraction policy keeps (Megatron's float floor)."""
    return int(eligible * (1 - fraction))


def apply_fraction(backward_chunks: Sequence[PolicyChunk], fraction: float) -> None:
    """Per chunk, keep the trailing groups beyond the offload fraction."""
    for chunk in backward_chunks:
        eligible = [g for g in chunk.groups if g.offload and g.warmup_bytes > 0]
        count = fraction_disabled_count(len(eligible), fraction)
        for group in eligible[len(eligible) - count :]:
            _keep(group, "fraction")


def summarize(
    forward_chunks: Sequence[PolicyChunk], first_backward: PolicyChunk | None
) -> dict[str, int]:
    """Warmup bytes per name of offloaded groups, up to the first chunk to run backward."""
    summary: dict[str, int] = {}
    for chunk in forward_chunks:
        for group in chunk.groups:
            if group.offload:
                summary[group.name] = summary.get(group.name, 0) + group.warmup_bytes
        if chunk is first_backward:
            break
    return summary


def apply_post_warmup(
    forward_chunks: Sequence[PolicyChunk],
    backward_chunks: Sequence[PolicyChunk],
    *,
    pp_rank: int,
    delta_bytes: int,
    fraction: float,
) -> dict[str, int]:
    """Run the three policies in order and return the per-name summary."""
    apply_margin(backward_chunks)
    apply_delta(backward_chunks, pp_rank * delta_bytes)
    apply_fraction(backward_chunks, fraction)
    first = backward_chunks[0] if backward_chunks else None
    return summarize(forward_chunks, first)
