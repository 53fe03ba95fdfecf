"""Independent prediction of what an offloader must move, per group occurrence.

The oracle for the transfer cases. Its inputs are what the ``hooks`` backend recorded (every
tensor autograd saved inside each group, with shape, strides and storage size), the offload
configuration and the schedule. It never reads an offloader's own log, and it restates Megatron's
rules (Megatron-Core's fine-grained activation offloading: which tensors a group tracks, the
margin, last-of-name and fraction policies) in its own words:

    tracked    on the model's device, not a parameter (or a storage marked not-offloadable)
    eligible   tracked, numel > 0 and numel >= min_offloaded_tensor_size
    bytes      contiguous: numel * itemsize; non-contiguous: the whole storage when the view
               covers >= 50% of it (and the storage is a whole number of elements), otherwise
               numel * itemsize (a gather)
    copies     one D2H and one H2D per eligible tensor of an offloaded group (no dedup)
    warmup     every selected group is offloaded
    afterwards margin, delta and fraction policies, then at run time a chunk's last group of a
               name stays if that chunk is the next to run backward when the group commits
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from harness.offload.config import OffloadConfig
from harness.offload.recorder import GroupObservation, SavedInfo

# The copy rules live with the offloaders (harness.offload.semantics); imported from here too.
from harness.offload.semantics import (
    MEGATRON_MAIN,
    GroupKey,
    Semantics,
    copy_bytes,
    eligible,
    skip_reason,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Expected:
    """What one group occurrence must do in one iteration."""

    decision: str
    copies: int
    """D2H copies, equal to H2D copies."""
    bytes: int
    """D2H bytes, equal to H2D bytes."""
    freed_storages: frozenset[int]
    """Storage ids (per microbatch) whose device memory the offload frees."""
    why: str = ""
    """The rule behind the prediction, for messages (``offloaded: 5 of 6 saved tensors; ...``,
    ``kept: last group of its name (Megatron's margin rule)``)."""

    @property
    def offloaded(self) -> bool:
        return self.decision == "offloaded"


def group_copies(
    obs: GroupObservation, config: OffloadConfig, semantics: Semantics
) -> tuple[int, int]:
    """(copies, bytes) one offload of the group makes, out and (where it reloads) back."""
    moved = _copied(obs, config, semantics)
    nbytes = sum(copy_bytes(s, semantics) for s in moved)
    if semantics.batched:
        return (1 if nbytes else 0), nbytes
    return len(moved), nbytes


def copy_sizes_of(
    obs: GroupObservation, config: OffloadConfig, semantics: Semantics
) -> tuple[int, ...]:
    """The bytes of each copy one offload of the group makes (one way), sorted: one per moved
    saved tensor, or one for them all where the rule batches them."""
    sizes = reload_sizes(obs, config, semantics)
    if semantics.batched:
        return (sum(sizes),) if sum(sizes) else ()
    return tuple(sorted(sizes))


def _copied(obs: GroupObservation, config: OffloadConfig, semantics: Semantics) -> list[SavedInfo]:
    """The saved tensors an offload of the group copies, one copy each (under ``base``, one
    per storage)."""
    moved = [s for s in obs.saved if eligible(s, config, semantics)]
    if semantics.view_copy != "base":
        return moved
    return list({s.storage_id: s for s in reversed(moved)}.values())[::-1]


def _freed(obs: GroupObservation, config: OffloadConfig, semantics: Semantics) -> frozenset[int]:
    """Storages whose memory an offload frees compared with no offload: those the group's moved
    saved tensors held, unless a saved tensor that stays on the device (too small) still uses
    the storage. A forced release frees only what autograd would otherwise keep, i.e. these
    same storages (a released tensor that nothing saves is freed with or without offloading)."""
    kept = {s.storage_id for s in obs.saved if s.on_device and not eligible(s, config, semantics)}
    # A parameter's storage outlives any offload of a view of it.
    moved = {s.storage_id for s in obs.saved if eligible(s, config, semantics) and not s.parameter}
    return frozenset(moved - kept)


def reload_sizes(
    obs: GroupObservation, config: OffloadConfig, semantics: Semantics = MEGATRON_MAIN
) -> list[int]:
    """The device allocations (bytes each) a reload of this group makes: one per moved saved
    tensor, of what its offload copied - a tensor saved twice (one input of two matmuls) comes
    back as two allocations where the run without offload holds one storage."""
    return [copy_bytes(s, semantics) for s in _copied(obs, config, semantics)]


def redundant_reload_bytes(
    obs: GroupObservation, config: OffloadConfig, semantics: Semantics = MEGATRON_MAIN
) -> int:
    """Device bytes a reload of this group holds beyond the original tensors: every whole-storage
    copy of a storage that the group copies more than once comes back as its own storage
    (Megatron copies each saved tensor separately; it warns about such duplicates)."""
    return sum(redundant_reload_sizes(obs, config, semantics))


def redundant_reload_sizes(
    obs: GroupObservation, config: OffloadConfig, semantics: Semantics = MEGATRON_MAIN
) -> list[int]:
    """The storages (bytes each) behind ``redundant_reload_bytes``: one per whole-storage copy
    beyond the first of a storage the group copies more than once."""
    whole: dict[int, list[int]] = {}
    for info in _copied(obs, config, semantics):
        if not info.contiguous and copy_bytes(info, semantics) == info.storage_nbytes:
            whole.setdefault(info.storage_id, []).append(info.storage_nbytes)
    return [size for sizes in whole.values() for size in sizes[1:]]


def predict(
    observations: Sequence[GroupObservation],
    config: OffloadConfig,
    order: Sequence[tuple[str, int]],
    semantics: Semantics = MEGATRON_MAIN,
) -> tuple[dict[GroupKey, Expected], dict[GroupKey, Expected]]:
    """(warmup, steady) expectations per group occurrence for one iteration's observations.

    ``order`` is the schedule's ("F"|"B", microbatch) sequence
    (``harness.models.train.schedule_order``);
    ``semantics`` the version-dependent copy rules of the backend under test.
    """
    keys = [(o.microbatch, o.layer, o.name) for o in observations]
    by_key = dict(zip(keys, observations, strict=True))
    moved = {k: group_copies(o, config, semantics) for k, o in by_key.items()}
    warmup = {
        k: Expected(
            decision="offloaded",
            copies=c,
            bytes=b,
            freed_storages=_freed(by_key[k], config, semantics),
            why=_moved_why(by_key[k], config, semantics),
        )
        for k, (c, b) in moved.items()
    }
    first, then = kept_decisions(
        keys, {k: b for k, (_, b) in moved.items()}, config, order, semantics
    )
    warmup = {k: _kept(first[k], semantics) if k in first else e for k, e in warmup.items()}
    steady = {k: _kept(then[k], semantics) if k in then else e for k, e in warmup.items()}
    return warmup, steady


def kept_decisions(
    keys: list[GroupKey],
    group_bytes: dict[GroupKey, int],
    config: OffloadConfig,
    order: Sequence[tuple[str, int]],
    semantics: Semantics,
) -> tuple[dict[GroupKey, str], dict[GroupKey, str]]:
    """(warmup, steady) group occurrence -> ``kept:<why>`` for every occurrence the policies
    keep on the device (``group_bytes``: what each would copy)."""
    if semantics.policies == "every":
        kept = _kept_last(keys, semantics.keep_last)
        if semantics.layers is not None:
            kept |= {k: "kept:layers" for k in keys if k[1] not in semantics.layers}
        return kept, kept
    return {}, _steady_decisions(keys, group_bytes, config, order)


def _kept(decision: str, semantics: Semantics) -> Expected:
    return Expected(
        decision=decision,
        copies=0,
        bytes=0,
        freed_storages=frozenset(),
        why=f"{KEPT_RULES[decision]} ({semantics.label})",
    )


def _kept_last(keys: list[GroupKey], count: int) -> dict[GroupKey, str]:
    """The last ``count`` occurrences of each pass (in forward start order) -> kept:last."""
    if not count:
        return {}
    by_pass: dict[int, list[GroupKey]] = {}
    for key in keys:
        by_pass.setdefault(key[0], []).append(key)
    return {k: "kept:last" for ks in by_pass.values() for k in ks[-count:]}


KEPT_RULES = {
    "kept:margin": "kept: last group of its name in the first chunk to run backward (Megatron's "
    "margin rule)",
    "kept:delta": "kept: within pp_rank * delta_offload_bytes_across_pp_ranks (Megatron's delta "
    "rule)",
    "kept:fraction": "kept: beyond activation_offload_fraction of the chunk's groups (Megatron's "
    "fraction rule)",
    "kept:last_of_name": "kept: its chunk's last group of the name, and that chunk runs backward "
    "next (Megatron's last-of-name rule)",
    "kept:last": "kept: among the last selected groups of its pass's forward",
    "kept:layers": "kept: its layer is not among the layers the rule offloads",
    "kept:own": "kept: the offloader moved nothing here in the learning step it is held to",
}


def _moved_why(obs: GroupObservation, config: OffloadConfig, semantics: Semantics) -> str:
    reasons: dict[str, int] = {}
    for info in obs.saved:
        why = skip_reason(info, config, semantics)
        if why is not None:
            reasons[why] = reasons.get(why, 0) + 1
    moved = len(obs.saved) - sum(reasons.values())
    skipped = "; ".join(f"{n} skipped: {why}" for why, n in reasons.items())
    return (
        f"offloaded: {moved} of {len(obs.saved)} saved tensors"
        + (f"; {skipped}" if skipped else "")
        + f" ({semantics.label})"
    )


def _steady_decisions(
    keys: list[GroupKey],
    group_bytes: dict[GroupKey, int],
    config: OffloadConfig,
    order: Sequence[tuple[str, int]],
) -> dict[GroupKey, str]:
    """Group occurrence -> "kept:<why>" for every group that stays on the device."""
    backward_mbs = list(dict.fromkeys(mb for kind, mb in order if kind == "B"))
    chunks = {mb: [k for k in keys if k[0] == mb] for mb in backward_mbs}
    kept: dict[GroupKey, str] = {}

    # margin: the first-backward chunk's last group of each name, as many as the largest number
    # of distinct names in one chunk, taking names in first-seen order over reversed chunks.
    margin = max((len({k[2] for k in chunk}) for chunk in chunks.values()), default=0)
    last_of: dict[str, GroupKey] = {}
    for mb in reversed(backward_mbs):
        for key in chunks[mb]:
            last_of[key[2]] = key
    for key in list(last_of.values())[:margin]:
        kept[key] = "kept:margin"

    # delta: earliest groups (backward-chunk order) until pp_rank * delta bytes stay.
    budget = config.pp_rank * config.delta_offload_bytes_across_pp_ranks
    for mb in backward_mbs:
        for key in chunks[mb]:
            if key not in kept and budget > 0:
                budget -= group_bytes[key]
                kept[key] = "kept:delta"

    # fraction: per chunk, the trailing int(n * (1 - f)) of the n still-offloaded groups with
    # bytes; Python float arithmetic, floor artefacts included.
    for mb in backward_mbs:
        candidates = [k for k in chunks[mb] if k not in kept and group_bytes[k] > 0]
        count = int(len(candidates) * (1 - config.activation_offload_fraction))
        for key in candidates[len(candidates) - count :]:
            kept[key] = "kept:fraction"

    # run time: a chunk's last group of a name stays when, at its commit (during the chunk's
    # forward), that chunk is the next one to start backward among chunks holding the name.
    for key in keys:
        mb, _, name = key
        if key in kept or not _last_of_name(chunks.get(mb, []), key):
            continue
        started = _backwards_started_before_forward(order, mb)
        holders = [
            m for m in backward_mbs if m not in started and any(k[2] == name for k in chunks[m])
        ]
        if holders and holders[0] == mb:
            kept[key] = "kept:last_of_name"
    return kept


def _last_of_name(chunk: list[GroupKey], key: GroupKey) -> bool:
    return [k for k in chunk if k[2] == key[2]][-1] == key


def _backwards_started_before_forward(order: Sequence[tuple[str, int]], mb: int) -> set[int]:
    started: set[int] = set()
    for kind, m in order:
        if kind == "F" and m == mb:
            return started
        if kind == "B":
            started.add(m)
    raise ValueError(f"microbatch {mb} has no forward in the schedule")


def in_flight_after_forward(order: Sequence[tuple[str, int]], index: int) -> list[int]:
    """Microbatches whose forward is done and backward not started after ``order[index]``."""
    done = [m for kind, m in order[: index + 1] if kind == "F"]
    started = {m for kind, m in order[: index + 1] if kind == "B"}
    return [m for m in done if m not in started]


def prefetched_before(
    observations: Sequence[GroupObservation],
    expected: dict[GroupKey, Expected],
    order: Sequence[tuple[str, int]],
    index: int,
) -> set[GroupKey]:
    """Offloaded group occurrences already reloaded, ahead of their own backward, when
    ``order[index]`` ends.

    Megatron-Core's rule, at each group's start of backward: every group start-backward reloads
    the chunk's most recently committed offloaded group still on the host; once the chunk has
    none left, it instead pre-reloads the top one of the next chunk to run backward, if that
    chunk's forward is done. So a backward of a chunk with n groups, k of them offloaded,
    prefetches n - k groups of the next chunk (1F1B with 3 or more microbatches runs a forward
    after such a backward). Commit order is taken as the recorded start order (exact for groups
    that do not nest)."""
    keys: dict[int, list[GroupKey]] = {}
    for obs in observations:
        keys.setdefault(obs.microbatch, []).append((obs.microbatch, obs.layer, obs.name))
    on_host = {mb: [k for k in ks if expected[k].offloaded] for mb, ks in keys.items()}
    forward_done: set[int] = set()
    prefetched: set[GroupKey] = set()
    for i, (kind, mb) in enumerate(order[: index + 1]):
        if kind == "F":
            forward_done.add(mb)
            continue
        later = [m for k, m in order[i + 1 :] if k == "B"]
        nxt = later[0] if later else None
        for _ in keys.get(mb, []):
            if on_host.get(mb):
                on_host[mb].pop()
            elif nxt is not None and nxt in forward_done and on_host.get(nxt):
                prefetched.add(on_host[nxt].pop())
    return prefetched


def prefetched_at_depth(
    observations: Sequence[GroupObservation],
    expected: dict[GroupKey, Expected],
    order: Sequence[tuple[str, int]],
    index: int,
    depth: int,
) -> set[GroupKey]:
    """``prefetched_before`` for a prefetch depth (``Semantics.prefetch_depth``): offloaded
    occurrences already reloaded when ``order[index]`` ends, each reloaded as soon as the rule
    allows - once the backward of the occurrence ``depth`` places before it in the step's
    backward order has ended (each pass's occurrences in reverse start order, the passes in the
    schedule's backward order). Depth 0 reloads at the group's own backward: never ahead."""
    if depth <= 0:
        return set()
    keys: dict[int, list[GroupKey]] = {}
    for obs in observations:
        keys.setdefault(obs.microbatch, []).append((obs.microbatch, obs.layer, obs.name))
    backward = [key for kind, mb in order if kind == "B" for key in reversed(keys.get(mb, []))]
    done = {mb for kind, mb in order[: index + 1] if kind == "B"}  # passes whose backward ended
    ahead = set()
    for i, key in enumerate(backward):
        if key[0] in done or not expected[key].offloaded or i < depth:
            continue
        if backward[i - depth][0] in done:
            ahead.add(key)
    return ahead


def freed_storages(
    observations: Sequence[GroupObservation],
    expected: dict[GroupKey, Expected],
    microbatches: Sequence[int],
) -> dict[tuple[int, int], int]:
    """(microbatch, storage id) -> bytes of every device storage that the offloaded groups of
    ``microbatches`` free."""
    sizes: dict[tuple[int, int], int] = {}
    for obs in observations:
        key = (obs.microbatch, obs.layer, obs.name)
        if obs.microbatch not in microbatches or not expected[key].offloaded:
            continue
        for info in (*obs.saved, *obs.released):
            if info.storage_id in expected[key].freed_storages:
                sizes[(obs.microbatch, info.storage_id)] = info.storage_nbytes
    return sizes


def inert_reason(
    observations: Sequence[GroupObservation],
    config: OffloadConfig,
    expected: Sequence[dict[GroupKey, Expected]],
) -> str:
    """Why the configuration offloads nothing by design (empty: it moves something): the
    prediction moves nothing in any step (``expected``: warmup, steady) and the configuration's
    ``min_offloaded_tensor_size`` exceeds every activation the selected groups save on the
    device. Such a case is *inert*: it must move nothing, and no proof of offload applies."""
    if any(e.copies for step in expected for e in step.values()):
        return ""
    sizes = [s.numel for o in observations for s in o.saved if s.on_device and not s.parameter]
    threshold = config.min_offloaded_tensor_size
    if not sizes or max(sizes) >= threshold:
        return ""
    return (
        f"inert: nothing eligible (each of the {len(sizes)} activations the selected groups save "
        f"has fewer than min_offloaded_tensor_size {threshold} elements; the largest "
        f"{max(sizes)})"
    )
