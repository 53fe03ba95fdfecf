"""Deliberately broken offloaders: one real bug class each, for measuring detection power.

Each class is the reference offloader (``harness.offload.reference.OffloadContext``) with one
step overridden. On CUDA the fault is the genuine one (a missing event edge, a missing
``record_stream``, a pool buffer returned without its event), widened by the reference's race
delays (``RaceDelays``; backend spelling ``broken.<name>+delays``). On CPU the reference copies
synchronously, so a stream race cannot happen by itself; where the class allows, a deterministic
stand-in shows the same effect: a copy that is *deferred* until something waits for it plays a
copy still in flight. ``broken.reload_before_d2h`` defers its D2H on CUDA too (its missing
edge is genuine, the copy still queued when the H2D reads is the stand-in): its window is host
time that a fixed GPU sleep does not reliably outlast (``races.ReloadBeforeD2H``).

``OFFLOADERS`` lists every broken backend with its bug class, the real-world report it
reproduces (a public bug report or a peer test's blind spot), whether CPU can show it, and its
CUDA race delays. The default-matrix cases and checks that catch each are the verify side's
(``harness.verify.detection.CATALOGUE``), which ``scripts/mutation_score`` and
``tests/detection/test_detection.py`` read.

The classes live by bug class: ``races`` (a copy still in flight: reload before D2H, source
reuse, early pool reuse), ``identity`` (the wrong tensor back: microbatch, chunk, view),
``selection`` (the wrong groups moved, or at the wrong time) and ``transport`` (how the bytes
travel and are logged: extra round trip, pageable, host sync, bit flip, lying log), ``cadence``
(when reloads run) and ``pipeline`` (pipeline stages: VPP chunks, the next stage's gradient). This
package re-exports each (``harness.offload.broken.NoOp``); a new one is its class in one of
them (or a module of its own) and its record in ``OFFLOADERS`` below.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from harness.offload.broken.cadence import EagerReload, TwoAhead
from harness.offload.broken.identity import ChunkOrder, ViewDedup, WrongMicrobatch
from harness.offload.broken.pipeline import MicrobatchKeyed, ReloadBeforeGradient
from harness.offload.broken.races import PoolEarlyReuse, ReloadBeforeD2H, SourceReuse
from harness.offload.broken.selection import (
    FractionCount,
    MiddleStepSkip,
    NoGradWarmup,
    NoOp,
    OffloadsWeights,
    StructureRemap,
    UnselectedGroups,
)
from harness.offload.broken.transport import (
    CorruptReload,
    ExtraRoundTrip,
    HostSync,
    LyingLog,
    Pageable,
)
from harness.offload.copies import LONG_DELAY
from harness.offload.reference import OffloadContext, RaceDelays

NO_DELAYS = RaceDelays()


@dataclass(frozen=True, kw_only=True, slots=True)
class BrokenOffloader:
    """One broken offloader: its class and what the backend resolver and a report say of it. Which
    cases and checks catch it is the verify side's (``harness.verify.detection``)."""

    factory: type[OffloadContext]
    bug_class: str
    """One line: what goes wrong."""
    reference: str
    """The real-world report(s) it reproduces."""
    cpu: bool
    """Whether the class can show on CPU at all (False: CUDA only)."""
    cuda_delays: RaceDelays = NO_DELAYS
    """Race delays that widen its window on CUDA (``scripts/mutation_score --device cuda``);
    none for a class that shows without them (a deterministic stand-in, or no race)."""

    @property
    def name(self) -> str:
        return self.factory.name

    @property
    def description(self) -> str:
        return f"{self.bug_class} - {self.reference}"


OFFLOADERS: tuple[BrokenOffloader, ...] = (
    BrokenOffloader(
        factory=ReloadBeforeD2H,
        bug_class="inline reload reads a host buffer before its D2H finished",
        reference="Megatron-LM #7398",
        cpu=True,  # and on CUDA without delays: its D2H is deferred there too (races.py)
    ),
    BrokenOffloader(
        factory=SourceReuse,
        bug_class="source freed or reused before its D2H finished",
        reference="torchtune #1867",
        cpu=True,
        cuda_delays=RaceDelays(d2h=LONG_DELAY),
    ),
    BrokenOffloader(
        factory=WrongMicrobatch,
        bug_class="tensor returned from the wrong microbatch (tags without chunk identity)",
        reference="Megatron-LM tensor_pop, bugs list #22, PR #6783",
        cpu=True,
    ),
    BrokenOffloader(
        factory=ChunkOrder,
        bug_class="backward served from the wrong model chunk (chunks assumed to run backward "
        "in forward order)",
        reference="Megatron-Core chunk handlers with virtual pipeline stages (issue 25)",
        cpu=True,
    ),
    BrokenOffloader(
        factory=UnselectedGroups,
        bug_class="unselected groups moved (moe_act selected, fc1's input moved too)",
        reference="TE fused grouped MLP #3047/#3108, Megatron-LM #5082",
        cpu=True,
    ),
    BrokenOffloader(
        factory=NoOp,
        bug_class="nothing moved at all (offloading a silent no-op)",
        reference="Megatron-LM 92d5c1f4d1 (#4173), DeepSpeed #522",
        cpu=True,
    ),
    BrokenOffloader(
        factory=ViewDedup,
        bug_class="views deduplicated by storage ignoring layout (wrong view reloaded)",
        reference="ms-swift PR #10157",
        cpu=True,
    ),
    BrokenOffloader(
        factory=PoolEarlyReuse,
        bug_class="pooled host buffer reused while its H2D is pending",
        reference="Megatron pinned-pool hazard (bugs list #19), TE #2341",
        cpu=True,
        cuda_delays=RaceDelays(h2d=LONG_DELAY),
    ),
    BrokenOffloader(
        factory=FractionCount,
        bug_class="wrong group count from the fraction policy (keeps >= 1 group per chunk)",
        reference="bugs list #20 (float floor), Megatron-LM PR #7575",
        cpu=True,
    ),
    BrokenOffloader(
        factory=ExtraRoundTrip,
        bug_class="an extra round trip per tensor (values right, only counts show it)",
        reference="STYLE rule 14; save_on_cpu double copies",
        cpu=True,
    ),
    BrokenOffloader(
        factory=OffloadsWeights,
        bug_class="weights offloaded with the activations (parameter marks ignored)",
        reference="TE CPU offload before do-not-offload weight tags; megatron-core 0.19",
        cpu=True,
    ),
    BrokenOffloader(
        factory=Pageable,
        bug_class="pageable host buffers",
        reference="Megatron/TE pin every host buffer",
        cpu=False,
    ),
    BrokenOffloader(
        factory=NoGradWarmup,
        bug_class="a no-grad pass taken as the warmup",
        reference="NeMo-RL PR #2279 review",
        cpu=True,
    ),
    BrokenOffloader(
        factory=StructureRemap,
        bug_class="group structure change between warmup and steady state mapped silently",
        reference="Megatron-LM a976754b40 (#3043), PR #6783",
        cpu=True,
    ),
    BrokenOffloader(
        factory=HostSync,
        bug_class="host synchronisation per group in the commit path",
        reference="PyTorch CudaSyncGuard test; issue 9 sync guard",
        cpu=False,
    ),
    BrokenOffloader(
        factory=MiddleStepSkip,
        bug_class="a group left on the device in one middle step (moves only on some steps)",
        reference="issue 23: bugs confined to the steps between the warmup and the final one",
        cpu=True,
    ),
    BrokenOffloader(
        factory=LyingLog,
        bug_class="the offloader's log lies in one middle step",
        reference="issue 23: a log checked only in the final step",
        cpu=True,
    ),
    BrokenOffloader(
        factory=CorruptReload,
        bug_class="transport corruption: one bit flipped on the way back",
        reference="STYLE rule 14",
        cpu=True,
    ),
    BrokenOffloader(
        factory=EagerReload,
        bug_class="every offloaded group reloaded at the start of its pass's backward",
        reference="Megatron-LM #7575 (reload cadence, backward peak); issue 50",
        cpu=True,
    ),
    BrokenOffloader(
        factory=TwoAhead,
        bug_class="reloads prefetched two groups ahead of their backward",
        reference="Megatron-LM #7575 / dev #5101 (reloads run ahead of their backward)",
        cpu=True,
    ),
    BrokenOffloader(
        factory=MicrobatchKeyed,
        bug_class="state keyed by microbatch, not by model chunk (a rank's VPP chunks of one "
        "microbatch mixed up)",
        reference="Megatron-Core keys offload state by virtual stage (issue 59)",
        cpu=True,
    ),
    BrokenOffloader(
        factory=ReloadBeforeGradient,
        bug_class="a stage's activations reloaded before the gradient from the next stage "
        "arrived (at the start of a forward)",
        reference="Megatron-LM #7575's class across pipeline stages (issue 59)",
        cpu=True,
    ),
)
"""Every broken offloader, in the catalogue's order (``harness.verify.detection.CATALOGUE``)."""

for _record in OFFLOADERS:  # each backend's record: the reference's, with its own description
    _record.factory.capabilities = dataclasses.replace(
        OffloadContext.capabilities, description=f"broken: {_record.description}"
    )
del _record

BROKEN: dict[str, type[OffloadContext]] = {record.name: record.factory for record in OFFLOADERS}
"""Backend name -> factory of every broken offloader."""
