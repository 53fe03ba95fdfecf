"""Detection: which default-matrix rows and checks catch each broken offloader, and how.

The broken offloaders themselves (``harness.offload.broken``) are offloaders and know nothing of
the case table or the checks; this module, on the verify side, pairs each with the rows and
checks that catch it (catchers first, in the order to try them) and the problem pattern a failure
must match to count as its catch. ``scripts/mutation_score`` and
``tests/detection/test_detection.py`` read ``CATALOGUE``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from harness.cases import PP_ROWS, Case
from harness.offload.broken import (
    BROKEN,
    OFFLOADERS,
    BrokenOffloader,
    ChunkOrder,
    CorruptReload,
    EagerReload,
    ExtraRoundTrip,
    FractionCount,
    HostSync,
    LyingLog,
    MicrobatchKeyed,
    MiddleStepSkip,
    NoGradWarmup,
    NoOp,
    OffloadsWeights,
    Pageable,
    PoolEarlyReuse,
    ReloadBeforeD2H,
    ReloadBeforeGradient,
    SourceReuse,
    StructureRemap,
    TwoAhead,
    UnselectedGroups,
    ViewDedup,
    WrongMicrobatch,
)
from harness.offload.reference import OffloadContext, RaceDelays

CHECKS = (
    "equivalence",
    "leaks",
    "transfers",
    "disabled",
    "fidelity",
    "weights",
    "cadence",
    "memory",
    "sync",
)
"""Check names (``harness.verify.checks``) a catalogue entry can name as its catcher."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BrokenBackend:
    """One catalogue entry: a broken offloader with the rows and checks that catch it."""

    factory: type[OffloadContext]
    catchers: tuple[tuple[str, Case], ...] = ()
    """(check, default-matrix row) pairs that catch it, in the order to try them."""
    reasons: tuple[tuple[str, str], ...] = ()
    """(check, regular expression) per catching check: a failure of that check is a catch only
    when one of its problem lines matches, so a check failing for another reason (a drifted
    baseline, a crash) is never counted as catching this bug class."""
    pipeline_catchers: tuple[tuple[str, Case], ...] = ()
    """(check, pipeline row of ``harness.cases.PP_ROWS``) pairs that catch it across ranks,
    each rank judging its stage. The mutation score runs rows in one process, so it judges the
    ``catchers`` only; ``tests/e2e/test_pipeline_broken.py`` shows these catches on forked gloo
    ranks (the same ``reasons``)."""
    needs: str = ""
    """When the default matrix cannot show it: the row or run feature it needs."""
    learnable: str = ""
    """Why no row can catch it with its declaration hidden (``mutation-score --undeclared``):
    its fault is a consistent rule of its own, which learning takes for a design choice
    (``harness.execute.learn``). The score then judges its catchers only (where it must pass,
    so the claim is shown, not assumed) instead of sweeping the whole matrix for a catch that
    cannot come."""

    @property
    def offloader(self) -> BrokenOffloader:
        """The broken offloader's own record (``harness.offload.broken.OFFLOADERS``)."""
        return next(record for record in OFFLOADERS if record.factory is self.factory)

    @property
    def name(self) -> str:
        return self.factory.name

    @property
    def bug_class(self) -> str:
        return self.offloader.bug_class

    @property
    def reference(self) -> str:
        return self.offloader.reference

    @property
    def cpu(self) -> bool:
        return self.offloader.cpu

    @property
    def cuda_delays(self) -> RaceDelays:
        return self.offloader.cuda_delays

    @property
    def description(self) -> str:
        return self.offloader.description

    def reason(self, check: str) -> re.Pattern[str]:
        """The problem pattern a failure of ``check`` must match to count as this entry's catch
        (``reasons``); an entry naming a catcher without a reason is a catalogue error."""
        for name, pattern in self.reasons:
            if name == check:
                return re.compile(pattern)
        raise KeyError(f"{self.name}: catcher {check!r} names no expected problem pattern")

    def matching(self, check: str, problems: Iterable[str]) -> str | None:
        """The first problem line of ``check``'s failure that shows this entry's bug class, with
        the line it heads where it is a header (None: it failed for another reason)."""
        return first_match(self.reason(check), problems)


def first_match(pattern: re.Pattern[str], problems: Iterable[str]) -> str | None:
    """The first problem line ``pattern`` finds, with the line it heads where it is a header
    (ends with ``:``); None where no line matches."""
    lines = [line.strip() for p in problems for line in p.splitlines() if line.strip()]
    for index, line in enumerate(lines):
        if pattern.search(line):
            # a header line ("...:") with the first line it heads, which names the group
            follows = line.endswith(":") and index + 1 < len(lines)
            return f"{line} {lines[index + 1]}" if follows else line
    return None


# The default-matrix rows the catalogue names, by their fields (a row's id is derived from them;
# tests/detection/test_broken.py checks that each is a row of the default matrix).
SEED = Case(family="hybrid", offload=("core_attn", "attn_proj"), precision="bf16")
ATTENTION_1F1B = Case(
    family="hybrid",
    offload=("attn_norm", "qkv_linear", "core_attn", "attn_proj"),
    schedule="1f1b",
    max_inflight=None,
)
MOE_ACT_1F1B = Case(family="moe", offload=("moe_act",), schedule="1f1b", max_inflight=0)
MOE_ACT_SEQ = Case(family="hybrid-moe", offload=("moe_act",), precision="bf16", max_inflight=0)
MOE_EVERYTHING = Case(
    family="moe",
    offload=("qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act"),
    precision="bf16",
)
EXPERTS_SEQ = Case(family="moe", offload=("expert_fc1", "moe_act"), max_inflight=None)
ATTENTION_1F1B_3MB = Case(
    family="hybrid",
    offload=("core_attn", "attn_proj"),
    schedule="1f1b",
    precision="bf16",
    microbatches=3,
)
EVAL_FIRST = Case(
    family="hybrid", offload=("core_attn", "attn_proj"), precision="bf16", eval_first=True
)
INTERLEAVED = Case(
    family="hybrid",
    offload=("core_attn", "attn_proj"),
    schedule="interleaved",
    microbatches=4,
    precision="bf16",
)

# What each bug class's catch reads like (``BrokenBackend.reasons``): the problem lines of
# ``harness.verify.checks`` that name that very fault, not any failure of the check.
RELOADS = r"reloads differ from what was saved \(checksums at pack and unpack"
NOT_OFFLOADED = r"the offload did not happen in step 0"
# (an undeclared offloader no rule of the family explains is held to its own first steady step)
HELD = r"(?:prediction|its own first steady step)"
PREDICTED = rf"^counted \([a-z' ]+\) vs {HELD} in step \d+ \(the final step\):"
EVERY_STEP = rf"^counted \(harness windows\) vs {HELD} in the steps before the final one:"
OVERDRAWN = r"copied out more than the saved storages hold"
LOG_VS_COUNTED = r"^offloader log vs counted \(harness windows\) in the steps before the final"
UNSELECTED = r"unselected groups moved: \['expert_fc1'\]"
WEIGHT_D2H = r"D2H copies of weights \(\d+ B\) in steps"
PAGEABLE = r"offload copies used pageable host memory"
STRAY = r"DtoH/HtoD memcpys outside any offload group"
HOST_SYNC = r"the offloader synchronised the host with the device"
LEFT = r"saved tensors never unpacked|pool buffers not returned"
WARMUP_FLAGS = r"^warmup flags per iteration \[True, False"
EARLY_RELOAD = r"group\(s\) reloaded ahead of their backward.*; first too early: "

# Why a bug is a consistent rule of its own with the declarations hidden (``learnable``).
EARLY_ALWAYS = (
    "it reloads equally early in every step, which is learned as its own prefetch depth "
    "(caught only against a declared rule)"
)

STEADY_POLICY = (
    "it keeps one more group of each chunk on the device in every steady step than Megatron's "
    "fraction rule, the same way every step: a consistent policy of its own, which an "
    "undeclared offloader is free to have (caught only against a declared rule)"
)

CATALOGUE: tuple[BrokenBackend, ...] = (
    BrokenBackend(
        factory=ReloadBeforeD2H,
        catchers=(("equivalence", SEED), ("equivalence", ATTENTION_1F1B)),
        reasons=(("equivalence", RELOADS),),
    ),
    BrokenBackend(
        factory=SourceReuse,
        catchers=(("equivalence", SEED), ("equivalence", ATTENTION_1F1B)),
        reasons=(("equivalence", RELOADS),),
    ),
    BrokenBackend(
        factory=WrongMicrobatch,
        catchers=(("equivalence", ATTENTION_1F1B), ("leaks", ATTENTION_1F1B)),
        reasons=(
            ("equivalence", RELOADS),
            ("leaks", LEFT),
        ),
    ),
    BrokenBackend(
        factory=ChunkOrder,
        catchers=(("equivalence", INTERLEAVED),),
        reasons=(("equivalence", RELOADS),),
    ),
    BrokenBackend(
        factory=UnselectedGroups,
        catchers=(("fidelity", MOE_ACT_1F1B), ("transfers", MOE_ACT_1F1B)),
        reasons=(
            ("fidelity", UNSELECTED),
            ("transfers", PREDICTED),
        ),
    ),
    BrokenBackend(
        factory=NoOp,
        catchers=(("equivalence", SEED), ("transfers", SEED)),
        reasons=(
            ("equivalence", NOT_OFFLOADED),
            ("transfers", PREDICTED),
        ),
    ),
    BrokenBackend(
        factory=ViewDedup,
        catchers=(("equivalence", MOE_ACT_1F1B), ("equivalence", EXPERTS_SEQ)),
        reasons=(("equivalence", RELOADS),),
    ),
    BrokenBackend(
        factory=PoolEarlyReuse,
        catchers=(("equivalence", ATTENTION_1F1B_3MB),),
        reasons=(("equivalence", RELOADS),),
    ),
    BrokenBackend(
        factory=FractionCount,
        catchers=(("transfers", SEED),),
        reasons=(("transfers", PREDICTED),),
        learnable=STEADY_POLICY,
    ),
    BrokenBackend(
        factory=ExtraRoundTrip,
        catchers=(("transfers", SEED),),
        reasons=(("transfers", rf"(?:{PREDICTED})|{OVERDRAWN}"),),
    ),
    BrokenBackend(
        factory=OffloadsWeights,
        catchers=(("weights", SEED), ("transfers", SEED)),
        reasons=(
            ("weights", WEIGHT_D2H),
            ("transfers", PREDICTED),
        ),
    ),
    BrokenBackend(
        factory=Pageable,
        catchers=(("transfers", SEED),),
        reasons=(("transfers", PAGEABLE),),
    ),
    BrokenBackend(
        factory=NoGradWarmup,
        catchers=(("leaks", EVAL_FIRST),),
        reasons=(("leaks", WARMUP_FLAGS),),
    ),
    BrokenBackend(
        factory=StructureRemap,
        catchers=(("transfers", ATTENTION_1F1B), ("transfers", MOE_EVERYTHING)),
        reasons=(("transfers", PREDICTED),),
    ),
    BrokenBackend(
        factory=HostSync,
        catchers=(("sync", SEED), ("transfers", SEED)),
        reasons=(
            ("sync", HOST_SYNC),
            ("transfers", STRAY),
        ),
    ),
    BrokenBackend(
        factory=MiddleStepSkip,
        catchers=(("transfers", SEED),),
        reasons=(("transfers", EVERY_STEP),),
    ),
    BrokenBackend(
        factory=LyingLog,
        catchers=(("transfers", SEED),),
        reasons=(("transfers", LOG_VS_COUNTED),),
    ),
    BrokenBackend(
        factory=CorruptReload,
        catchers=(("equivalence", SEED),),
        reasons=(("equivalence", RELOADS),),
    ),
    BrokenBackend(
        factory=EagerReload,
        catchers=(("cadence", SEED), ("cadence", ATTENTION_1F1B_3MB)),
        reasons=(("cadence", EARLY_RELOAD),),
        learnable=EARLY_ALWAYS,
    ),
    BrokenBackend(
        factory=TwoAhead,
        catchers=(("cadence", SEED), ("cadence", ATTENTION_1F1B_3MB)),
        reasons=(("cadence", EARLY_RELOAD),),
        learnable=EARLY_ALWAYS,
    ),
    BrokenBackend(
        factory=MicrobatchKeyed,
        catchers=(("equivalence", INTERLEAVED),),
        pipeline_catchers=(("equivalence", PP_ROWS[1]),),
        reasons=(("equivalence", RELOADS),),
    ),
    BrokenBackend(
        factory=ReloadBeforeGradient,
        catchers=(("cadence", ATTENTION_1F1B_3MB),),
        pipeline_catchers=(("cadence", PP_ROWS[0]),),
        reasons=(("cadence", EARLY_RELOAD),),
    ),
)
"""Every broken offloader (``harness.offload.broken.OFFLOADERS``, in its order) with its
catchers."""


def entry(name: str) -> BrokenBackend:
    """The catalogue entry of a broken backend name."""
    for candidate in CATALOGUE:
        if candidate.name == name:
            return candidate
    raise ValueError(f"unknown broken backend {name!r}; known: {', '.join(BROKEN)}")
