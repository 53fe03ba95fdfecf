"""The memory case's reading - CUDA only: memory right after the last forward and at the final
step's peak, baseline vs offload, in requested bytes read from the allocator's live blocks, with
where each unexplained block was allocated."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from harness.cases import Case
from harness.execute.backwardpeak import (
    NESTING,
    BackwardReading,
    BackwardSampler,
    Sample,
    backward_problems,
    boundary_mismatch,
    predicted_drops,
)
from harness.execute.baselines import BASELINES, Baselines, plain_key
from harness.execute.environment import Environment, closing
from harness.execute.predict import (
    freed_storages,
    in_flight_after_forward,
    predict,
    prefetched_at_depth,
    prefetched_before,
    redundant_reload_bytes,
    reload_sizes,
)
from harness.execute.steps import record_observations
from harness.models.runs import RunHooks
from harness.models.train import last_forward_index, schedule_order, train
from harness.offload.passthrough import NoOffload
from harness.offload.protocol import Offloader
from harness.offload.recorder import GroupObservation
from harness.offload.semantics import Semantics
from harness.util import distributed
from harness.vocab.spec import ModelSpec, RunSpec


@dataclass(kw_only=True)
class MemoryResult:
    """Memory right after the last forward of the final step, and that step's peak; every
    figure is relative to what was allocated before the run started."""

    case: Case
    predicted_drop: int
    """Bytes of the storages the in-flight offloaded groups free (``harness.execute.predict``)."""
    baseline_requested: int
    """Bytes requested by the live allocations of the baseline after the last forward."""
    offload_requested: int
    baseline_allocated: int
    """``torch.cuda.memory_allocated`` of the baseline after the last forward."""
    offload_allocated: int
    rounding: int
    """Allocator rounding measured on the live blocks of both runs (block size - request)."""
    baseline_peak: int
    offload_peak: int
    peak_allowance: int
    """Duplicate whole-storage reloads of the two largest offloaded groups (see
    ``harness.execute.predict.redundant_reload_bytes``): what Megatron's per-tensor copies may
    add."""
    predicted_sizes: Counter[int]
    """Bytes of each storage predicted to be freed."""
    predicted_extra: Counter[int] = dataclasses.field(default_factory=Counter)
    """Blocks predicted live only in the offload run: reloads of groups reloaded ahead of their
    backward beyond the storages they freed (``harness.execute.predict.reload_sizes``)."""
    freed_sizes: Counter[int]
    """Requested bytes of live blocks the baseline holds and the offload run does not."""
    extra_sizes: Counter[int]
    """Requested bytes of live blocks only the offload run holds."""
    floor_freed: tuple[int, int] = (0, 0)
    """Blocks (count, bytes) live before a run started that it freed before its reading (both
    runs together): memory of earlier runs or process caches released meanwhile, counted in
    neither reading (reported with any memory problem)."""
    replaced_sizes: Counter[int] = dataclasses.field(default_factory=Counter)
    """Requested bytes of the blocks that replaced such freed blocks with the same sizes (a
    process cache re-created during a run; both runs), also counted in neither reading."""
    baseline_sites: dict[int, str] = dataclasses.field(default_factory=dict)
    """Requested size -> where the baseline allocated one of its counted blocks of that size
    (innermost Python frames outside torch; from the allocator's history, recorded during the
    memory runs), to name the owner of a block the prediction does not explain."""
    offload_sites: dict[int, str] = dataclasses.field(default_factory=dict)
    """The same for the offload run."""
    baseline_key: str = ""
    """The ``plain_key`` the baseline reading was read for (rows with one key share it)."""
    baseline_made_by: str = ""
    """The case whose memory check read it."""
    backward: BackwardReading | None = None
    """The final step's backward at the group boundaries (``harness.execute.backwardpeak``)."""

    @property
    def requested_drop(self) -> int:
        return self.baseline_requested - self.offload_requested

    @property
    def allocated_drop(self) -> int:
        return self.baseline_allocated - self.offload_allocated


def run_memory(
    case: Case,
    env: Environment,
    observations: list[GroupObservation] | None = None,
    semantics: Semantics | None = None,
    baselines: Baselines | None = None,
) -> MemoryResult:
    """Baseline vs offload memory after the last forward and at the final step's peak, in runs
    of the case's first ``MEMORY_STEPS`` steps (``memory_run_spec``).

    The drop is compared in requested bytes (the sum of the sizes the live allocations asked
    for), which the caching allocator's rounding does not touch, so it must equal the
    prediction exactly; ``memory_allocated`` counts rounded blocks, so its drop may differ by
    the rounding the snapshot shows on the live blocks of the two runs.

    ``observations`` are the hooks baseline's records of the case's first training iteration
    (``CaseRun.observations``; recorded here when not given); ``semantics`` the rule the case run
    predicted with (``CaseRun.semantics``: needed for a backend that declares none, whose rule
    is learned there). The baseline reading (no offload)
    depends only on the case's ``plain_key``: rows sharing it, which run one after another, read
    it once (``memory_baseline``; kept in ``baselines``, default ``BASELINES``).
    """
    if env.device.type != "cuda":
        raise ValueError("the memory case needs a CUDA device")
    spec, run, config = env.spec(case), memory_run_spec(case), case.offload_config()
    if observations is None:
        observations = record_observations(case, env)
    semantics = semantics or env.declared
    if semantics is None:
        raise ValueError("an undeclared backend's memory reading needs its case run's rule")
    predicted = _memory_prediction(case, run, observations, semantics)
    with _allocation_sites(env.device):
        shared = memory_baseline(case, env, baselines)
        with closing(env.offloader(config)) as offloader:
            off = _memory_run(spec, run, offloader, env.device, predicted.last_mb, case.sharding)
    result = _memory_result(case, predicted, shared, off)
    result.backward = _backward_reading(case, run, observations, semantics, shared.reading, off)
    return result


def _backward_reading(
    case: Case,
    run: RunSpec,
    observations: list[GroupObservation],
    semantics: Semantics,
    base: _MemoryReading,
    off: _MemoryReading,
) -> BackwardReading:
    """The two runs' backward boundaries against the predicted drops (none for rows whose
    selected groups nest, see ``harness.execute.backwardpeak``)."""
    reading = BackwardReading(baseline=base.samples, offload=off.samples, predicted=None)
    nesting = sorted(NESTING & set(case.offload))
    if not off.samples:
        reading.why_not = "no group boundary was marked (the model drives its groups itself)"
    elif nesting:
        reading.why_not = f"{', '.join(nesting)} span other groups: not predicted"
    else:
        reading.unmatched = boundary_mismatch(base.samples, off.samples)
    if not (reading.why_not or reading.unmatched):
        config = case.offload_config()
        order = schedule_order(run.schedule, run.microbatches)
        warmup, steady = predict(observations, config, order, semantics)
        expected = warmup if run.steps == 1 else steady
        reading.predicted = predicted_drops(
            off.samples, observations, expected, order, config, semantics
        )
    reading.problems = backward_problems(reading)
    return reading


@dataclass(frozen=True)
class _MemoryPrediction:
    """What the prediction says the offload run's reading holds less (and more) than the
    baseline's after the last forward (``_memory_prediction``)."""

    last_mb: int
    """The microbatch whose last forward is read."""
    freed: Counter[int]
    """Requested sizes of the storages the offloaded groups freed."""
    reloaded: Counter[int]
    """Requested sizes of the reloads of groups reloaded ahead of their backward."""
    redundant: list[int]
    """Redundant reload bytes of each offloaded group, ascending."""


def _memory_prediction(
    case: Case, run: RunSpec, observations: list[GroupObservation], semantics: Semantics
) -> _MemoryPrediction:
    """The predicted difference of ``case``'s memory runs (spec ``run``)."""
    config = case.offload_config()
    order = schedule_order(run.schedule, run.microbatches)
    last_forward = last_forward_index(order)
    warmup, steady = predict(observations, config, order, semantics)
    if run.steps == 1:  # the final step is the warmup
        steady = warmup
    # the cadence the case is held to: Megatron-Core's, or the depth declared or learned
    early = (
        prefetched_before(observations, steady, order, last_forward)
        if semantics.prefetch_depth is None
        else prefetched_at_depth(
            observations, steady, order, last_forward, semantics.prefetch_depth
        )
    )
    in_flight = in_flight_after_forward(order, last_forward)
    # A group reloaded ahead of its backward (``early``) freed its storages like any offloaded
    # one and holds its reloads instead: one allocation per copied tensor, so a tensor saved
    # twice or a storage copied whole for two views comes back as more blocks than it was.
    freed = freed_storages(observations, steady, in_flight)
    reloaded = Counter(
        size
        for o in observations
        if (o.microbatch, o.layer, o.name) in early and o.microbatch in in_flight
        for size in reload_sizes(o, config, semantics)
    )
    redundant = sorted(
        redundant_reload_bytes(o, config, semantics)
        for o in observations
        if steady[(o.microbatch, o.layer, o.name)].offloaded
    )
    return _MemoryPrediction(
        last_mb=order[last_forward][1],
        freed=Counter(freed.values()),
        reloaded=reloaded,
        redundant=redundant,
    )


def _memory_result(
    case: Case, predicted: _MemoryPrediction, shared: SharedMemoryBaseline, off: _MemoryReading
) -> MemoryResult:
    """The two readings against the prediction."""
    base = shared.reading
    freed, reloaded = predicted.freed, predicted.reloaded
    return MemoryResult(
        case=case,
        predicted_drop=sum(size * n for size, n in freed.items())
        - sum(size * n for size, n in reloaded.items()),
        baseline_requested=base.requested,
        offload_requested=off.requested,
        baseline_allocated=base.allocated,
        offload_allocated=off.allocated,
        rounding=base.rounding + off.rounding,
        baseline_peak=base.peak,
        offload_peak=off.peak,
        peak_allowance=sum(predicted.redundant[-2:]),
        predicted_sizes=freed - reloaded,
        predicted_extra=reloaded - freed,
        freed_sizes=base.blocks - off.blocks,
        extra_sizes=off.blocks - base.blocks,
        floor_freed=(
            base.floor_freed[0] + off.floor_freed[0],
            base.floor_freed[1] + off.floor_freed[1],
        ),
        replaced_sizes=base.replaced + off.replaced,
        baseline_sites=base.sites,
        offload_sites=off.sites,
        baseline_key=shared.key,
        baseline_made_by=shared.made_by,
    )


MEMORY_STEPS = 2
"""Steps a memory run trains: the warmup and one steady step, whose last forward is read.
Every later steady step opens, offloads and frees the same storages (the policies are decided
once, at the end of the warmup), so a longer run reads the same bytes, each further step adding
only cost; the case run's every-step transfer checks are what watch the steps in between."""


def memory_run_spec(case: Case) -> RunSpec:
    """The run spec of ``case``'s memory runs: its own, cut to ``MEMORY_STEPS`` steps."""
    run = case.run_spec()
    return run.replace(steps=min(run.steps, MEMORY_STEPS))


@dataclass(frozen=True)
class SharedMemoryBaseline:
    """A no-offload memory reading and what identifies it, like ``SharedPlain``."""

    key: str
    made_by: str
    reading: _MemoryReading


def memory_baseline(
    case: Case, env: Environment, baselines: Baselines | None = None
) -> SharedMemoryBaseline:
    """The no-offload memory reading of ``case``: the one ``baselines`` (default
    ``BASELINES``: this process's) kept if its ``plain_key`` is the same (the reading depends on
    nothing else: the run has no offloader, and the microbatch read after is the schedule's),
    else read now (and kept in its place: one entry, like the plain baseline)."""
    kept = BASELINES if baselines is None else baselines
    key = plain_key(case, env)
    found: SharedMemoryBaseline | None = kept.memory_for(key)
    if found is not None:
        return found
    kept.memory = None
    run = memory_run_spec(case)
    order = schedule_order(run.schedule, run.microbatches)
    last_mb = order[last_forward_index(order)][1]
    reading = _memory_run(env.spec(case), run, NoOffload(), env.device, last_mb, case.sharding)
    shared = kept.memory = SharedMemoryBaseline(key, case.name, reading)
    return shared


@dataclass(frozen=True)
class _MemoryReading:
    allocated: int
    requested: int
    rounding: int
    peak: int
    blocks: Counter[int]
    floor_freed: tuple[int, int]
    replaced: Counter[int]
    sites: dict[int, str]
    samples: list[Sample] = dataclasses.field(default_factory=list)
    """The requested bytes at each group boundary of the final step's backward, above what was
    live before the run started."""


Block = tuple[int, int]
"""A live allocator block: (size, requested size) in bytes."""


def _live_blocks(device: torch.device, sites: dict[int, str] | None = None) -> dict[int, Block]:
    """The allocator's live blocks on ``device`` by address: (block size, requested size).

    With ``sites``, also fills it with each block's allocation site (``allocation_site``) where
    the allocator recorded one (``_allocation_sites``)."""
    live: dict[int, Block] = {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    for segment in torch.cuda.memory_snapshot():
        if segment.get("device", index) != index:
            continue
        address = int(segment["address"])  # blocks tile their segment in address order
        for block in segment.get("blocks", []):
            size = int(block["size"])
            address = int(block.get("address", address))
            if block.get("state") == "active_allocated":
                live[address] = (size, int(block.get("requested_size", size)))
                if sites is not None and block.get("frames"):
                    sites[address] = allocation_site(block["frames"])
            address += size
    return live


def allocation_site(frames: list[dict[str, Any]], depth: int = 2) -> str:
    """The innermost ``depth`` Python frames of an allocator stack (innermost first, as the
    snapshot lists them) outside torch's own package: ``file:line (function) < caller``."""
    own = [
        f
        for f in frames
        if f.get("filename", "").endswith(".py")
        and "/torch/" not in f["filename"].replace("\\", "/")
    ]
    shown = own[:depth] or frames[:depth]
    return " < ".join(
        f"{_short_path(f.get('filename', '?'))}:{f.get('line', '?')} ({f.get('name', '?')})"
        for f in shown
    )


def _short_path(filename: str) -> str:
    """A site's file from its package root (``megatron/core/...``, ``harness/...``)."""
    parts = filename.replace("\\", "/").split("/")
    for root in ("megatron", "transformer_engine", "harness", "torch"):
        if root in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(root) :])
    return "/".join(parts[-2:])


@contextlib.contextmanager
def _allocation_sites(device: torch.device) -> Iterator[None]:
    """Record the Python stack of every CUDA allocation on ``device`` meanwhile (the
    allocator's history, state only: no event trace), so a reading can name where an
    unexplained block came from; off again afterwards."""
    record = torch.cuda.memory._record_memory_history
    record(enabled="state", context="alloc", stacks="python", device=device)
    try:
        yield
    finally:
        record(enabled=None, device=device)


@dataclass(frozen=True)
class _BlockChange:
    """How the live blocks changed since a run started (see ``_block_change``)."""

    new: Counter[Block]
    """What the run allocated and still holds."""
    replaced: Counter[Block]
    """Blocks gone since the start, each matched by a new one of the same sizes."""
    gone: Counter[Block]
    """Blocks live at the start and not now (``replaced`` among them)."""


def _block_change(now: dict[int, Block], before: dict[int, Block]) -> _BlockChange:
    """Blocks live ``now`` and not ``before`` (same address and sizes), less one block of the
    same sizes for each block of ``before`` that is gone: what the run allocated, whatever else
    was freed meanwhile.

    Memory a run frees without having allocated it: on the H200 megatron-core kept a finished
    run reachable until the next one replaced its globals (937 MB, before ``mcore_models``
    emptied a run's storages at its end), and megatron-core and TransformerEngine replace
    process caches during a run (128 KiB and 512-B blocks, up to 1.4 MB, on every mcore row;
    the 128 KiB ones were earlier models' rotary tables in ``RotaryEmbedding.forward``'s
    ``lru_cache``, which ``mcore_models`` now empties at a run's end), freeing the old block
    and allocating one of the same sizes at the same address or not. The readings count
    neither."""
    added = Counter(block for address, block in now.items() if before.get(address) != block)
    gone = Counter(block for address, block in before.items() if now.get(address) != block)
    return _BlockChange(new=added - gone, replaced=added & gone, gone=gone)


def _requested(blocks: Counter[Block]) -> Counter[int]:
    """The requested sizes of ``blocks``."""
    sizes: Counter[int] = Counter()
    for (_, requested), n in blocks.items():
        sizes[requested] += n
    return sizes


def _settled(device: torch.device) -> None:
    """Let everything pending be freed (collect cycles, finish the streams, let the process
    group drop finished collectives' tensors, free blocks whose record_stream events
    completed)."""
    gc.collect()
    torch.cuda.synchronize(device)
    distributed.collectives_released()  # finished collectives' tensors (NCCL keeps them)
    torch.cuda.empty_cache()


def _memory_run(
    spec: ModelSpec,
    run: RunSpec,
    offloader: Offloader,
    device: torch.device,
    last_mb: int,
    sharding: str,
) -> _MemoryReading:
    seen: dict[str, Any] = {}
    last = run.steps - 1
    sampler = BackwardSampler(offloader, device)
    _settled(device)
    floor = _live_blocks(device)

    def after_forward(step: int, mb: int) -> None:
        if step == last and mb == last_mb:
            _settled(device)
            sites: dict[int, str] = {}
            now = _live_blocks(device, sites)
            change = _block_change(now, floor)
            gone = change.gone.items()
            seen["floor_freed"] = (sum(n for _, n in gone), sum(b[0] * n for b, n in gone))
            seen["replaced"] = _requested(change.replaced)
            seen["blocks"] = _requested(change.new)
            seen["allocated"] = sum(size * n for (size, _), n in change.new.items())
            seen["requested"] = sum(size * n for size, n in seen["blocks"].items())
            seen["rounding"] = seen["allocated"] - seen["requested"]
            new = set(change.new)
            seen["sites"] = {}
            for address, block in now.items():
                if block in new and address in sites and floor.get(address) != block:
                    seen["sites"].setdefault(block[1], sites[address])

    @contextlib.contextmanager
    def step_context(step: int) -> Iterator[None]:
        if step == last:
            _settled(device)
            # the floor's blocks that are still live: the step's peak counts above them
            live = _live_blocks(device)
            kept = [block for address, block in floor.items() if live.get(address) == block]
            seen["kept"] = sum(size for size, _ in kept), sum(asked for _, asked in kept)
            torch.cuda.reset_peak_memory_stats(device)
            sampler.armed = True
        yield
        if step == last:
            torch.cuda.synchronize(device)
            kept, asked = seen.pop("kept")
            seen["peak"] = torch.cuda.max_memory_allocated(device) - kept
            sampler.armed = False
            seen["samples"] = [(kind, key, n - asked) for kind, key, n in sampler.samples]

    hooks = RunHooks(step_context=step_context, after_forward=after_forward)
    train(spec, run, sampler, device, hooks=hooks, sharding=sharding)
    return _MemoryReading(**seen)
