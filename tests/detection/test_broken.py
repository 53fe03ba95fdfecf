"""The broken-offloader catalogue (``harness.offload.broken``): each broken backend deviates
from the reference offloader in its intended way on a tiny model, and only there; the catalogue
is consistent with the backend registry and the default matrix; race-delay spellings resolve.

Runs are 2-3 steps of ``-tiny`` presets on CPU. What a class needs to show (1F1B, a third
microbatch, a no-grad pass first, a spanning group) is built here directly.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import pytest
import torch
from shared_runs import SharedRuns

from harness.cases import default_matrix
from harness.models.hybrid import build_model, make_batches
from harness.models.train import TrainResult, train
from harness.offload import broken
from harness.offload.backends import (
    DEFAULT_RACE_DELAYS,
    UNDECLARED,
    backend_names,
    backend_unavailable,
    capabilities,
    describe,
    parse_race_delays,
    resolve_backend,
    with_delays,
)
from harness.offload.config import OffloadConfig
from harness.offload.passthrough import NoOffload
from harness.offload.protocol import Capabilities, IterationLog, declare
from harness.offload.reference import HOST_BOUND, GroupState, OffloadContext, RaceDelays
from harness.offload.semantics import MEGATRON_MAIN
from harness.verify import detection
from harness.vocab.spec import RunSpec, preset

CPU = torch.device("cpu")
SEED_NAMES = ("core_attn", "attn_proj")
ATTENTION = ("attn_norm", "qkv_linear", "core_attn", "attn_proj")


def _config(names: tuple[str, ...], inflight: int | None = 1) -> OffloadConfig:
    return OffloadConfig(
        offload_modules=names, min_offloaded_tensor_size=1024, max_inflight_offloads=inflight
    )


@functools.cache
def _plain(family: str, steps: int, microbatches: int, schedule: str) -> torch.Tensor:
    run = RunSpec(steps=steps, microbatches=microbatches, schedule=schedule, precision="fp32")
    return train(preset(family), run, NoOffload(), CPU).losses


@functools.cache
def _run(
    factory: Callable[[OffloadConfig, torch.device], OffloadContext],
    config: OffloadConfig,
    *,
    family: str = "hybrid-tiny",
    steps: int = 2,
    microbatches: int = 2,
    schedule: str = "sequential",
) -> tuple[TrainResult, torch.Tensor]:
    """(offload run, plain baseline losses) of the same spec and seed (cached: the reference's
    runs serve several tests; results are only read)."""
    run = RunSpec(steps=steps, microbatches=microbatches, schedule=schedule, precision="fp32")
    offloader = factory(config, CPU)
    try:
        result = train(preset(family), run, offloader, CPU)
    finally:
        offloader.close()
    return result, _plain(family, steps, microbatches, schedule)


def _moved(log: IterationLog) -> dict[tuple[int, int, str], int]:
    return {r.key: r.d2h_copies for r in log.groups if r.d2h_copies}


# ------------------------------------------------------------------------------ the catalogue


def test_catalogue_is_registered_and_consistent() -> None:
    names = [entry.name for entry in detection.CATALOGUE]
    assert len(names) >= 12 and len(set(names)) == len(names)
    # every broken offloader has its catalogue entry, in the same order
    assert names == [record.name for record in broken.OFFLOADERS] == list(broken.BROKEN)
    default_ids = {case.name for case in default_matrix()}
    for entry in detection.CATALOGUE:
        assert entry.name.startswith("broken.") and entry.name in backend_names()
        assert resolve_backend(entry.name) is entry.factory
        assert describe(entry.name).startswith("broken: ")
        assert entry.factory.__doc__ and entry.bug_class and entry.reference
        assert entry.catchers or entry.needs, f"{entry.name}: no catcher and no stated need"
        for check, case in entry.catchers:
            assert check in detection.CHECKS, (entry.name, check)
            assert case.name in default_ids, f"{entry.name}: {case.name} is not a default case"
    assert detection.entry("broken.noop").factory is broken.NoOp
    with pytest.raises(ValueError, match="unknown broken backend"):
        detection.entry("broken.nothing")


def test_race_delay_spellings() -> None:
    assert parse_race_delays("d2h=5, compute=7") == RaceDelays(d2h=5, compute=7)
    spelled = with_delays("broken.noop", RaceDelays(h2d=3))
    assert spelled == "broken.noop+delays:d2h=0,h2d=3,compute=0"
    delayed = resolve_backend(spelled)
    assert isinstance(delayed, functools.partial) and delayed.func is broken.NoOp
    assert delayed.keywords == {"delays": RaceDelays(h2d=3)}
    assert resolve_backend("reference+delays").keywords == {"delays": DEFAULT_RACE_DELAYS}
    for bad, fragment in [
        ("hooks+delays", "apply to the reference"),
        ("reference+delays:d2h=x", "not an int"),
        ("reference+delays:warp=1", "d2h=N,h2d=N,compute=N"),
        ("reference+delays:d2h=1,d2h=2", "each once"),
        ("reference+delaysd2h=1", "write reference+delays"),
    ]:
        with pytest.raises(ValueError, match=re.escape(fragment)):
            resolve_backend(bad)
    with pytest.raises(ValueError, match="CUDA"):  # sleep kernels need a GPU
        resolve_backend("broken.noop+delays")(_config(SEED_NAMES), CPU)


def _undeclared(config: OffloadConfig, device: torch.device) -> NoOffload:
    return NoOffload(config, device)


@declare(race_delays=True, unavailable=lambda device: f"not on {device.type}")
def _declared(config: OffloadConfig, device: torch.device, *, delays: RaceDelays) -> NoOffload:
    return NoOffload(config, device)


def _malformed(config: OffloadConfig, device: torch.device) -> NoOffload:
    return NoOffload(config, device)


@declare(semantics="gather")
def _wrong_semantics(config: OffloadConfig, device: torch.device) -> NoOffload:
    return NoOffload(config, device)


_malformed.capabilities = {"race_delays": True}  # type: ignore[attr-defined]


def test_capability_records() -> None:
    reference = capabilities("reference")
    assert reference is OffloadContext.capabilities and reference.race_delays
    assert reference.semantics is MEGATRON_MAIN and reference.unavailable is None
    assert not capabilities("none").race_delays and not capabilities("hooks").race_delays
    for entry in broken.OFFLOADERS:  # the reference's record with the catalogue's description
        record = capabilities(entry.name)
        assert record == Capabilities(
            description=describe(entry.name),
            semantics=MEGATRON_MAIN,
            race_delays=True,
            host_pool=True,
            host_bound=HOST_BOUND,
        )
        assert capabilities(f"{entry.name}+delays") == record  # +delays keeps the record
    assert capabilities(f"{__name__}:_undeclared") is UNDECLARED == Capabilities()
    with pytest.raises(ValueError, match="apply to the reference"):
        resolve_backend(f"{__name__}:_undeclared+delays")
    assert backend_unavailable(f"{__name__}:_undeclared", CPU) is None
    assert capabilities(f"{__name__}:_declared+delays:d2h=1").race_delays
    assert backend_unavailable(f"{__name__}:_declared+delays", CPU) == "not on cpu"
    with pytest.raises(ValueError, match=r"not a harness\.offload\.protocol\.Capabilities"):
        resolve_backend(f"{__name__}:_malformed")
    with pytest.raises(ValueError, match=r"not a harness\.offload\.semantics\.Semantics"):
        resolve_backend(f"{__name__}:_wrong_semantics")


# ------------------------------------------------------------- each class deviates as intended


@pytest.mark.parametrize(
    "factory",
    [broken.ReloadBeforeD2H, broken.SourceReuse, broken.CorruptReload],
    ids=["reload_before_d2h", "source_reuse", "corrupt_reload"],
)
def test_transport_faults_corrupt_the_first_backward(factory: type[OffloadContext]) -> None:
    """Step 0's forward is untouched, its backward reads wrong data: step 1's losses differ."""
    result, plain = _run(factory, _config(SEED_NAMES))
    assert torch.equal(result.losses[0], plain[0])
    assert not torch.equal(result.losses[1], plain[1])
    reference, _ = _run(OffloadContext, _config(SEED_NAMES))
    assert [_moved(log) for log in result.logs] == [_moved(log) for log in reference.logs]


def test_reload_before_d2h_needs_an_open_window() -> None:
    """A cap of 0 in-flight offloads makes every D2H land at its commit: nothing to race."""
    result, plain = _run(broken.ReloadBeforeD2H, _config(SEED_NAMES, inflight=0))
    assert torch.equal(result.losses, plain)


GroupKey = tuple[int, int, int, str]
"""(iteration, microbatch, layer, name): one group occurrence."""


class _LandingOrder(broken.ReloadBeforeD2H):
    """``ReloadBeforeD2H`` recording, in order, each group occurrence's commit, its reload
    (inline or prefetched, and whether its D2H copies were still queued then), its H2D copies
    and the landing of its D2H copies."""

    def __init__(self, config: OffloadConfig, device: torch.device) -> None:
        super().__init__(config, device)
        self.events: list[tuple[str, GroupKey]] = []
        self.queued_at_reload: dict[GroupKey, bool] = {}

    def _key(self, group: GroupState) -> GroupKey:
        return (len(self._logs), group.chunk.microbatch, group.layer, group.name)

    def _commit_forward(self, group: GroupState, release: tuple[torch.Tensor, ...]) -> None:
        super()._commit_forward(group, release)
        self.events.append(("commit", self._key(group)))

    def _reload(self, group: GroupState, *, inline: bool = False) -> None:
        self.events.append(("inline" if inline else "prefetch", self._key(group)))
        self.queued_at_reload[self._key(group)] = group in self._in_flight
        super()._reload(group, inline=inline)

    def _h2d_copy(self, group: GroupState, restored: torch.Tensor, buffer: torch.Tensor) -> None:
        self.events.append(("h2d", self._key(group)))
        super()._h2d_copy(group, restored, buffer)

    def _issue_landing(
        self, group: GroupState, copies: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        self.events.append(("land", self._key(group)))
        super()._issue_landing(group, copies)


def _landing_order(inflight: int | None) -> tuple[_LandingOrder, TrainResult, torch.Tensor]:
    """1F1B (F0, F1 B0, B1) over two steps of the attention groups, recorded."""
    off = _LandingOrder(_config(ATTENTION, inflight=inflight), CPU)
    run = RunSpec(steps=2, microbatches=2, schedule="1f1b", precision="fp32")
    try:
        result = train(preset("hybrid-tiny"), run, off, CPU)
    finally:
        off.close()
    return off, result, _plain("hybrid-tiny", 2, 2, "1f1b")


def test_reload_before_d2h_reads_before_the_landing_on_the_inline_path_only() -> None:
    """The order CUDA's streams are made to follow too (there the landing D2H waits for the
    H2D's reload event): an inline reload's H2D copies come before its D2H lands, a prefetched
    reload's after. Without a cap every D2H is still queued at its reload. In the warmup
    iteration the first reload of each chunk's backward is inline: no group of the chunk has
    ended its backward yet (a group's end prefetches the next) and the warmup has no backward
    order to prefetch across chunks with."""
    off, result, plain = _landing_order(None)
    events = off.events
    reloads = [(kind, key) for kind, key in events if kind in ("inline", "prefetch")]
    for microbatch in (0, 1):
        first = next(kind for kind, key in reloads if key[:2] == (0, microbatch))
        assert first == "inline", f"microbatch {microbatch}'s first reload is {first}"
    for kind, key in reloads:
        assert off.queued_at_reload[key], f"{key}: no D2H left queued without a cap"
        h2d = [i for i, event in enumerate(events) if event == ("h2d", key)]
        (land,) = [i for i, event in enumerate(events) if event == ("land", key)]
        assert h2d and (max(h2d) < land if kind == "inline" else land < min(h2d)), (kind, key)
    assert torch.equal(result.losses[0], plain[0])  # the forward of step 0 is untouched
    assert not torch.equal(result.losses[1], plain[1])


def test_reload_before_d2h_lands_every_d2h_at_its_commit_under_a_cap_of_0() -> None:
    """The window closes with the cap, on the inline path too: nothing queued at any reload."""
    off, result, plain = _landing_order(0)
    assert off.queued_at_reload and not any(off.queued_at_reload.values())
    assert any(kind == "inline" for kind, _ in off.events)
    assert torch.equal(result.losses, plain)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("inflight", [None, 0], ids=["no-cap", "cap-0"])
def test_reload_before_d2h_on_cuda_without_race_delays(inflight: int | None) -> None:
    """On CUDA, with no race delays, the 1F1B run of ``_landing_order``: step 1's losses
    differ (step 0's backward read zeroed host buffers) on every card, however long the host
    takes between a commit and its inline reload; a cap of 0 closes the window there too."""
    cuda = torch.device("cuda")
    run = RunSpec(steps=2, microbatches=2, schedule="1f1b", precision="fp32")
    plain = train(preset("hybrid-tiny"), run, NoOffload(), cuda).losses
    off = broken.ReloadBeforeD2H(_config(ATTENTION, inflight=inflight), cuda)
    try:
        losses = train(preset("hybrid-tiny"), run, off, cuda).losses
    finally:
        off.close()
    assert torch.equal(losses[0], plain[0])
    assert torch.equal(losses[1], plain[1]) == (inflight == 0), (losses, plain)


def test_wrong_microbatch_shows_under_1f1b_only() -> None:
    sequential, plain = _run(broken.WrongMicrobatch, _config(ATTENTION))
    assert torch.equal(sequential.losses, plain)
    interleaved, plain = _run(broken.WrongMicrobatch, _config(ATTENTION), schedule="1f1b")
    assert torch.equal(interleaved.losses[0], plain[0])
    assert not torch.equal(interleaved.losses[1], plain[1])
    assert interleaved.logs[0].leaked_tensors > 0  # microbatch 0's own tensors stay behind


def test_unselected_groups_move_fc1_with_moe_act() -> None:
    result, plain = _run(broken.UnselectedGroups, _config(("moe_act",)), family="moe-tiny")
    assert torch.equal(result.losses, plain)
    names = {name for _, _, name in _moved(result.logs[-1])}
    assert names == {"expert_fc1", "moe_act"}
    reference, _ = _run(OffloadContext, _config(("moe_act",)), family="moe-tiny")
    assert {name for _, _, name in _moved(reference.logs[-1])} == {"moe_act"}


def test_noop_moves_nothing() -> None:
    result, plain = _run(broken.NoOp, _config(SEED_NAMES))
    assert torch.equal(result.losses, plain)
    assert all(not log.groups and not log.warmup for log in result.logs)


def test_view_dedup_returns_the_first_view() -> None:
    """moe_act saves the two SwiGLU halves of one storage; deduplicated, both come back as the
    gate half, with one copy fewer each way."""
    config = _config(("moe_act",))
    result, plain = _run(broken.ViewDedup, config, family="moe-tiny")
    reference, _ = _run(OffloadContext, config, family="moe-tiny")
    assert not torch.equal(result.losses[1], plain[1])
    for mine, theirs in zip(result.logs[0].groups, reference.logs[0].groups, strict=True):
        assert mine.d2h_copies == theirs.d2h_copies - 1 and mine.h2d_copies == mine.d2h_copies


def test_pool_early_reuse_needs_a_forward_between_prefetch_and_use() -> None:
    two, plain = _run(broken.PoolEarlyReuse, _config(SEED_NAMES), schedule="1f1b", steps=3)
    assert torch.equal(two.losses, plain)  # 2 microbatches: no D2H inside the window
    three, plain = _run(
        broken.PoolEarlyReuse, _config(SEED_NAMES), schedule="1f1b", steps=3, microbatches=3
    )
    assert not torch.equal(three.losses, plain)


def test_fraction_count_keeps_one_group_too_many_per_chunk() -> None:
    result, plain = _run(broken.FractionCount, _config(SEED_NAMES))
    assert torch.equal(result.losses, plain)
    steady = result.logs[-1].groups
    kept = [r.key for r in steady if r.decision == "kept:fraction"]
    assert sorted(mb for mb, _, _ in kept) == [0, 1]  # one per chunk at fraction 1.0
    reference, _ = _run(OffloadContext, _config(SEED_NAMES))
    assert not any(r.decision == "kept:fraction" for r in reference.logs[-1].groups)


def test_extra_round_trip_doubles_the_counts_only() -> None:
    result, plain = _run(broken.ExtraRoundTrip, _config(SEED_NAMES))
    reference, _ = _run(OffloadContext, _config(SEED_NAMES))
    assert torch.equal(result.losses, plain)
    mine, theirs = result.logs[-1].groups, reference.logs[-1].groups
    for a, b in zip(mine, theirs, strict=True):
        assert (a.d2h_copies, a.h2d_bytes) == (2 * b.d2h_copies, 2 * b.h2d_bytes)


def test_nograd_pass_becomes_the_warmup() -> None:
    """A no-grad forward first: the broken backend ends its warmup there (zero bytes); the
    reference's warmup is still the first training step."""
    flags = {}
    for factory in (broken.NoGradWarmup, OffloadContext):
        offloader = factory(_config(SEED_NAMES), CPU)
        spec, run = preset("hybrid-tiny"), RunSpec(steps=2, microbatches=2, precision="fp32")
        model = build_model(spec, torch.Generator().manual_seed(run.seed))
        batches = make_batches(spec, seed=run.seed, steps=1, microbatches=2)[0]
        for mb, tokens in enumerate(batches):  # an evaluation pass over both microbatches
            offloader.begin_microbatch(mb)
            with torch.no_grad():
                model(tokens[:, :-1], offloader)
        offloader.end_iteration()
        logs = train(spec, run, offloader, CPU).logs
        flags[factory] = [log.warmup for log in logs]
        if factory is broken.NoGradWarmup:
            assert logs[0].groups and logs[0].d2h_bytes == 0
    assert flags[broken.NoGradWarmup] == [True, False, False]
    assert flags[OffloadContext] == [False, True, False]


def _mapping(factory: type[OffloadContext], names: tuple[str, ...]) -> list[tuple[int, int | None]]:
    """(start layer, layer of the group record it got; None: pass-through) of every selected
    group start in the second (steady) step of a 1-microbatch run."""
    offloader = factory(_config(names), CPU)
    seen: list[tuple[int, int | None]] = []
    opened = offloader.group

    def group(name: str, x: torch.Tensor, *, layer: int) -> object:
        handle = opened(name, x, layer=layer)
        record = getattr(handle, "_group", None)
        if name in names:
            seen.append((layer, None if record is None else record.layer))
        return handle

    offloader.group = group  # type: ignore[method-assign]
    result = train(preset("hybrid-tiny"), RunSpec(steps=2, microbatches=1), offloader, CPU)
    assert torch.equal(result.losses, _plain("hybrid-tiny", 2, 1, "sequential"))
    return seen[len(seen) // 2 :]


def test_structure_remap_maps_groups_to_other_layers() -> None:
    """With attn_norm spanning the attention groups, warmup (commit order) and steady state
    (start order) differ; starts land on other layers' records or pass through, silently."""
    remapped = _mapping(broken.StructureRemap, ATTENTION)
    assert (0, 2) in remapped and (4, None) in remapped
    assert all(start == got for start, got in _mapping(OffloadContext, ATTENTION))
    assert all(start == got for start, got in _mapping(broken.StructureRemap, SEED_NAMES))


@pytest.mark.parametrize(
    "factory", [broken.Pageable, broken.HostSync], ids=["pageable", "host_sync"]
)
def test_cuda_only_classes_are_the_reference_on_cpu(factory: type[OffloadContext]) -> None:
    """No pinned memory and no device to wait for: on CPU they behave like the reference."""
    result, plain = _run(factory, _config(SEED_NAMES))
    reference, _ = _run(OffloadContext, _config(SEED_NAMES))
    assert torch.equal(result.losses, plain)
    assert [_moved(log) for log in result.logs] == [_moved(log) for log in reference.logs]


@pytest.mark.judges_row(detection.SEED)
@pytest.mark.parametrize(
    ("backend", "seen_by", "step"),
    [
        ("broken.middle_step_skip", "step_mismatches", "step 2,"),
        ("broken.lying_log", "step_log_mismatches", "step 3,"),
    ],
)
def test_middle_step_bugs_are_seen_only_by_the_every_step_checks(
    backend: str, seen_by: str, step: str, shared_runs: SharedRuns
) -> None:
    """The final step and the warmup are right, so the final-step counts, the final-step log
    and the offload proof see nothing; only the checks of every step name the step. The seed
    row's runs of the broken backend are those its catalogue test judges (``shared_runs``)."""
    from harness.execute.environment import Environment

    env = Environment(device=torch.device("cpu"), backend=backend)
    res = shared_runs.case_run(detection.SEED, env)
    assert res.mismatches() == [] and res.log_mismatches() == [] and not res.proof_problems
    found = getattr(res, seen_by)()
    assert found and all(line.startswith(step) for line in found), found
