"""The case table: frozen rows, generated in a fixed order, shared by pytest and the CLI.

A row names a model family, an offload set, a schedule, a precision and a max-inflight cap; its
``name`` is the pytest id and the report key, e.g. ``hybrid-+-+-+-_core_attn+attn_proj_1f1b_bf16``.
The model's size comes from the device (``-tiny`` presets on CPU, ``-small`` on CUDA) unless the
run asks for one.

Matrix: families x applicable offload sets x schedules x max-inflight x precisions. ``full`` is
all of it; ``default`` keeps one row per (family, offload set), cycling the other axes so every
value appears, plus the seed's own case first.

Sharding ``zero3`` rows (flat ZeRO-3 through FSDP2, bf16) follow the unsharded ones: ``default``
has the seed's and one MoE row; ``full`` has one per (family, offload set) cycling schedule and
max-inflight, plus the seed's and the MoE row again with ``min_ranks=2`` (real sharding only:
they skip at world size 1).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

from harness.offload.config import OffloadConfig
from harness.vocab.impls import IMPLS
from harness.vocab.spec import INTERLEAVED_CHUNKS, PRESETS, SHARDINGS, ModelSpec, RunSpec, preset

_PRESETS = {(p.family, p.size): name for name, p in PRESETS.items()}
"""(family, size) -> preset name (``harness.vocab.spec.PRESETS``)."""
FAMILIES: tuple[str, ...] = tuple(dict.fromkeys(family for family, _ in _PRESETS))
"""Case families, in table order."""
MODEL_SIZES: tuple[str, ...] = tuple(dict.fromkeys(size for _, size in _PRESETS))

ATTENTION_NAMES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj")
OFFLOAD_SETS: dict[str, tuple[str, ...] | None] = {
    "core_attn+attn_proj": ("core_attn", "attn_proj"),
    "attention": ATTENTION_NAMES,
    "expert_fc1+moe_act": ("expert_fc1", "moe_act"),
    "moe_act": ("moe_act",),
    "fused_group_mlp": ("fused_group_mlp",),
    "everything": None,
}
"""Named offload sets of the matrix; ``attention`` and ``everything`` are narrowed to the names
the model can open (None: every applicable name)."""

INFLIGHT_VALUES: tuple[int | None, ...] = (1, None, 0)
SCHEDULES_IN_MATRIX = ("sequential", "1f1b")
PRECISION_VALUES = ("fp32", "bf16")


def model_spec(family: str, size: str) -> ModelSpec:
    """The preset for a case family at a size."""
    try:
        return preset(_PRESETS[(family, size)])
    except KeyError:
        raise ValueError(
            f"unknown model family/size {family!r}/{size!r}; families: {', '.join(FAMILIES)}; "
            f"sizes: {', '.join(MODEL_SIZES)}"
        ) from None


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """One row of the case table."""

    family: str
    """Model family (one of ``FAMILIES``)."""
    offload: tuple[str, ...]
    """Selected group names (already narrowed to what the model opens)."""
    schedule: str = "sequential"
    precision: str = "fp32"
    max_inflight: int | None = 1
    steps: int = 6
    microbatches: int = 2
    min_tensor_size: int = 1024
    """``min_offloaded_tensor_size`` (elements)."""
    fraction: float = 1.0
    tolerance: float = 0.0
    """Allowed absolute loss difference; 0 means bitwise equality."""
    tolerance_reason: str = ""
    """Why a non-zero tolerance is needed, with its measured noise floor."""
    memory_slack: int = 0
    """Largest block (bytes) the memory case lets differ between the runs beyond the predicted
    storages; 0: the drop must equal the prediction exactly."""
    memory_slack_reason: str = ""
    """Why a non-zero memory slack is needed, with what was measured."""
    sharding: str = "none"
    """``none`` (every rank trains the whole model on the same data), ``zero3`` (flat ZeRO-3
    through FSDP2), ``mfsdp`` or ``mfsdp2`` (Megatron-FSDP as megatron-core ships it, or built
    from its bundled v2 building blocks; megatron-core's models only); sharded, each rank trains
    its own data shard, and a one-rank world runs the sharding's whole code path."""
    recompute: str = ""
    """megatron-core's activation recompute (``ModelSpec.recompute``): ``full`` or
    ``+``-joined selective modules."""
    cuda_graph: str = ""
    """megatron-core's CUDA-graph capture (``ModelSpec.cuda_graph``)."""
    mtp: str = ""
    """Multi-token-prediction layers after the pattern (``ModelSpec.mtp``)."""
    offload_buffer_kib: int = 0
    """megatron-core's fixed pinned activation buffer in KiB (``ModelSpec.offload_buffer_kib``);
    0: none."""
    delta_bytes: int = 0
    """``delta_offload_bytes_across_pp_ranks``: bytes per pipeline rank kept on the device."""
    pool_cap: int | None = None
    """``pinned_pool_buffers``: the most host buffers the pinned pool holds (None: no cap). A
    row with a cap below what a step needs must see the pool exhausted, and handled (the
    offloader's log counts it), every loss still bitwise."""
    min_ranks: int = 1
    """Fewest ranks (torchrun ``WORLD_SIZE``) the case needs; below it, it skips at collection."""
    custom_pattern: str | None = None
    """Replace the family preset's layer pattern (custom cases from the command line)."""
    eval_first: bool = False
    """A no-grad forward pass of every microbatch before the first step (``RunSpec``)."""
    impl: str = "harness"
    """Who builds the model: ``harness`` (ours), ``mcore`` (megatron-core's ``HybridModel``
    with TransformerEngine layers, trained through its own schedule, DDP and distributed
    optimizer; ``harness.models.mcore``) or ``mcore-gpt`` (megatron-core's ``GPTModel``, the
    same way). megatron-core's rows run the sequential schedule only (one pipeline stage),
    unsharded, with no evaluation pass first."""
    description: str = ""
    marks: tuple[Any, ...] = ()
    """pytest marks for this row."""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown family {self.family!r}; known: {', '.join(FAMILIES)}")
        if self.sharding not in SHARDINGS:
            raise ValueError(f"unknown sharding {self.sharding!r}; known: {', '.join(SHARDINGS)}")
        if isinstance(self.min_ranks, bool) or not isinstance(self.min_ranks, int):
            raise ValueError(f"min_ranks must be an int >= 1, got {self.min_ranks!r}")
        if self.min_ranks < 1:
            raise ValueError(f"min_ranks must be an int >= 1, got {self.min_ranks!r}")
        if self.impl not in IMPLS:
            raise ValueError(f"unknown impl {self.impl!r}; known: {', '.join(IMPLS)}")
        refused = IMPLS[self.impl].refuse(
            schedule=self.schedule, sharding=self.sharding, eval_first=self.eval_first
        )
        if refused is not None:
            raise ValueError(refused)
        if self.schedule == "interleaved" and self.sharding != "none":
            raise ValueError(
                f"the interleaved schedule runs unsharded models only, not sharding "
                f"{self.sharding!r} (FSDP2's root would not gather around a chunk's forward)"
            )
        if self.memory_slack and not self.memory_slack_reason:
            raise ValueError(f"case {self.name}: a memory slack needs a memory_slack_reason")
        if self.tolerance and not self.tolerance_reason:
            raise ValueError(f"case {self.name}: a non-zero tolerance needs a tolerance_reason")
        self.offload_config()  # validates names and rules
        self.run_spec()
        spec = self.model_spec("tiny")  # the megatron-core knobs against the impl
        if self.schedule == "interleaved" and len(spec.layers) < INTERLEAVED_CHUNKS:
            raise ValueError(
                f"the interleaved schedule splits the model into {INTERLEAVED_CHUNKS} chunks of "
                f"at least one layer; pattern {spec.pattern!r} has {len(spec.layers)}"
            )

    @property
    def pattern(self) -> str:
        return self.model_spec("tiny").pattern

    @property
    def name(self) -> str:
        prefix = IMPLS[self.impl].case_prefix
        parts = [f"{prefix}{self.family}-{self.pattern}", "+".join(self.offload), self.schedule]
        parts.append(self.precision)
        if self.max_inflight != 1:
            parts.append(f"inflight-{'none' if self.max_inflight is None else self.max_inflight}")
        if (self.steps, self.microbatches) != (6, 2):
            parts.append(f"{self.steps}x{self.microbatches}")
        if self.fraction != 1.0:
            parts.append(f"fraction-{self.fraction:g}")
        if self.min_tensor_size != 1024:
            parts.append(f"min-{self.min_tensor_size}")
        if self.delta_bytes:
            parts.append(f"delta-{self.delta_bytes}")
        if self.pool_cap is not None:
            parts.append(f"pool-{self.pool_cap}")
        if self.recompute:
            parts.append(f"recompute-{self.recompute}")
        if self.cuda_graph:
            parts.append(f"graph-{self.cuda_graph}")
        if self.mtp:
            parts.append(f"mtp-{self.mtp}")
        if self.offload_buffer_kib:
            parts.append(f"buffer-{self.offload_buffer_kib}KiB")
        if self.sharding != "none":
            parts.append(self.sharding)
        if self.min_ranks != 1:
            parts.append(f"ranks-{self.min_ranks}")
        if self.eval_first:
            parts.append("evalfirst")
        return "_".join(parts)

    @property
    def work(self) -> float:
        """A rough relative cost of the case's trainings, for scheduling only (longest first):
        layers x steps x microbatches, three times that under sharding (FSDP2's gathers and
        reduce-scatters are a layer's compute again on the 2-core CPU machine and on one GPU)."""
        work = len(self.pattern) * self.steps * self.microbatches
        return work * (3.0 if self.sharding != "none" else 1.0)

    def model_spec(self, size: str) -> ModelSpec:
        spec = model_spec(self.family, size).replace(
            impl=self.impl,
            recompute=self.recompute,
            cuda_graph=self.cuda_graph,
            mtp=self.mtp,
            offload_buffer_kib=self.offload_buffer_kib,
        )
        return spec.replace(pattern=self.custom_pattern) if self.custom_pattern else spec

    def run_spec(self, seed: int = 1234) -> RunSpec:
        return RunSpec(
            steps=self.steps,
            microbatches=self.microbatches,
            schedule=self.schedule,  # type: ignore[arg-type]
            precision=self.precision,  # type: ignore[arg-type]
            grad_clip=1.0,
            seed=seed,
            eval_first=self.eval_first,
        )

    def offload_config(self) -> OffloadConfig:
        return OffloadConfig(
            offload_modules=self.offload,
            min_offloaded_tensor_size=self.min_tensor_size,
            activation_offload_fraction=self.fraction,
            max_inflight_offloads=self.max_inflight,
            delta_offload_bytes_across_pp_ranks=self.delta_bytes,
            pinned_pool_buffers=self.pool_cap,
        )

    def replace(self, **changes: Any) -> Case:
        return dataclasses.replace(self, **changes)


def applicable_sets(family: str) -> list[tuple[str, tuple[str, ...]]]:
    """The matrix's offload sets narrowed to ``family``'s groups, empty and duplicate sets
    dropped, in ``OFFLOAD_SETS`` order."""
    available = model_spec(family, "tiny").group_names
    seen: set[tuple[str, ...]] = set()
    out = []
    for label, names in OFFLOAD_SETS.items():
        if names is None:
            narrowed = available
        elif label == "attention":
            narrowed = tuple(n for n in available if n in names)
        elif all(n in available for n in names):
            narrowed = names
        else:
            continue  # the set needs groups this model does not open
        if narrowed and narrowed not in seen and _valid(narrowed):
            seen.add(narrowed)
            out.append((label, narrowed))
    return out


def _valid(names: tuple[str, ...]) -> bool:
    try:
        OffloadConfig(offload_modules=names)
    except ValueError:
        return False
    return True


SEED_CASE = Case(
    family="hybrid",
    offload=("core_attn", "attn_proj"),
    schedule="sequential",
    precision="bf16",
    max_inflight=1,
    description="the seed: +-+-+-, core_attn+attn_proj, 6 steps x 2 microbatches, bf16",
)


SEED_ZERO3_CASE = SEED_CASE.replace(
    sharding="zero3", description="the seed under flat ZeRO-3 (FSDP2), each rank its own data"
)
MOE_ZERO3_CASE = Case(
    family="hybrid-moe",
    offload=("expert_fc1", "moe_act"),
    schedule="1f1b",
    precision="bf16",
    max_inflight=None,
    sharding="zero3",
    description="MoE experts offloaded under flat ZeRO-3 (FSDP2)",
)


def _cycled_rows(**fixed: Any) -> list[Case]:
    """One row per (family, offload set), cycling schedule, precision and max-inflight so every
    value appears; ``fixed`` fields override the cycled ones."""
    rows = []
    sets = [(family, names) for family in FAMILIES for _, names in applicable_sets(family)]
    for index, (family, names) in enumerate(sets):
        cycled = {
            "schedule": SCHEDULES_IN_MATRIX[index % 2],
            "precision": PRECISION_VALUES[(index // 2) % 2],
            "max_inflight": INFLIGHT_VALUES[index % 3],
        }
        rows.append(Case(family=family, offload=names, **{**cycled, **fixed}))
    return rows


def zero3_rows(full: bool) -> list[Case]:
    """The ZeRO-3 rows of a matrix (see the module docstring)."""
    rows = [SEED_ZERO3_CASE, MOE_ZERO3_CASE]
    if not full:
        return rows
    taken = {r.name for r in rows}
    rows += [r for r in _cycled_rows(precision="bf16", sharding="zero3") if r.name not in taken]
    return rows + [row.replace(min_ranks=2) for row in (SEED_ZERO3_CASE, MOE_ZERO3_CASE)]


DETECTION_ROWS: tuple[Case, ...] = (
    Case(
        family="hybrid",
        offload=("core_attn", "attn_proj"),
        schedule="1f1b",
        microbatches=3,
        precision="bf16",
        description="1F1B with 3 microbatches: a forward runs between a reload and its use",
    ),
    Case(
        family="hybrid",
        offload=("core_attn", "attn_proj"),
        precision="bf16",
        eval_first=True,
        description="a no-grad evaluation pass before the first step must not become the warmup",
    ),
)
"""Rows the default matrix carries for bug classes the family rows cannot show (a pooled
buffer reused while its reload is pending; a no-grad pass taken as the warmup)."""


PIPELINE_ROWS: tuple[Case, ...] = (
    Case(
        family="hybrid",
        offload=("core_attn", "attn_proj"),
        schedule="interleaved",
        microbatches=4,
        precision="bf16",
        description="the seed's model and groups under the interleaved pipeline schedule (rank 0 "
        "of 2, 2 model chunks): chunks run backward in another order than forward",
    ),
    Case(
        family="hybrid-moe",
        offload=("expert_fc1", "moe_act"),
        schedule="interleaved",
        microbatches=4,
        max_inflight=None,
        description="MoE experts under the interleaved pipeline schedule",
    ),
    Case(
        family="hybrid",
        offload=("attn_norm", "qkv_linear", "core_attn", "attn_proj"),
        schedule="interleaved",
        microbatches=6,
        precision="bf16",
        max_inflight=0,
        description="every attention group under the interleaved schedule, 3 microbatch groups",
    ),
)
"""Rows of the ``interleaved`` schedule (``harness.models.train.interleaved_order``): the default
matrix has the first, the full one all."""


CADENCE_ROWS: tuple[Case, ...] = (
    Case(
        family="hybrid",
        offload=ATTENTION_NAMES,
        schedule="1f1b",
        microbatches=3,
        precision="bf16",
        fraction=0.5,
        description="activation_offload_fraction 0.5 under 1F1B with 3 microbatches: groups kept "
        "on the device still take a reload slot in Megatron's rule, so reloads run ahead of "
        "their backward (Megatron-LM #7575); the cadence check holds every step to the rule",
    ),
    SEED_CASE.replace(
        pool_cap=2,
        description="the pinned pool capped at 2 buffers, below what a step needs: exhausted, "
        "handled with buffers outside the pool, every loss bitwise (PaddleFleet #1877)",
    ),
    SEED_CASE.replace(
        min_tensor_size=1 << 30,
        description="min_offloaded_tensor_size above every saved activation: inert, nothing "
        "eligible, and nothing may move (PaddleFleet #1877)",
    ),
)
"""Rows of when reloads happen and of the configurations that bound or disable the offload:
partial offload under 1F1B, a pinned pool too small for the step, a threshold that makes the
configuration inert. The default matrix has these; the full one also ``FULL_CADENCE_ROWS``."""

FULL_CADENCE_ROWS: tuple[Case, ...] = (
    Case(
        family="hybrid",
        offload=("core_attn", "attn_proj"),
        precision="bf16",
        fraction=0.5,
        description="activation_offload_fraction 0.5, sequential schedule",
    ),
    Case(
        family="hybrid",
        offload=ATTENTION_NAMES,
        schedule="interleaved",
        microbatches=4,
        precision="bf16",
        fraction=0.5,
        description="activation_offload_fraction 0.5 under the interleaved schedule",
    ),
    Case(
        family="moe",
        offload=("qkv_linear", "core_attn", "attn_proj"),
        schedule="1f1b",
        microbatches=3,
        pool_cap=4,
        description="the pinned pool capped at 4 buffers under 1F1B with 3 microbatches",
    ),
)
"""The full matrix's further cadence, fraction and pool rows."""


_MCORE_SLACK = dict(
    memory_slack=64,
    memory_slack_reason=(
        "megatron-core's layers built with offloading on and off keep a few different scalar "
        "tensors (H200: a 1-byte block only in the seed's offload run, a 64-byte one only in "
        "the hybrid-moe baseline); every predicted storage must still be freed"
    ),
)
MCORE_ROWS: tuple[Case, ...] = (
    SEED_CASE.replace(
        impl="mcore", description="the seed on megatron-core's own HybridModel", **_MCORE_SLACK
    ),
    Case(
        **_MCORE_SLACK,
        impl="mcore",
        family="hybrid",
        offload=ATTENTION_NAMES,
        precision="bf16",
        max_inflight=None,
        description="every attention group of the MLA layers",
    ),
    Case(
        **_MCORE_SLACK,
        impl="mcore",
        family="moe",
        offload=("expert_fc1", "moe_act"),
        precision="bf16",
        description="TransformerEngine's grouped MLP, selective expert names",
    ),
    Case(
        **_MCORE_SLACK,
        impl="mcore",
        family="moe-fused",
        offload=("fused_group_mlp",),
        precision="bf16",
        max_inflight=0,
        description="TransformerEngine's op-fuser grouped MLP as one group",
    ),
    Case(
        **_MCORE_SLACK,
        impl="mcore",
        family="hybrid-moe",
        offload=(*ATTENTION_NAMES, "mlp_norm", "expert_fc1", "moe_act"),
        precision="bf16",
        description="every name of MLA and MoE layers",
    ),
    Case(
        **_MCORE_SLACK,
        impl="mcore-gpt",
        family="moe",
        offload=("core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act"),
        precision="bf16",
        description="megatron-core's GPTModel with MoE layers, TransformerEngine's grouped MLP",
    ),
    Case(
        **_MCORE_SLACK,
        impl="mcore-gpt",
        family="moe-fused",
        offload=("core_attn", "fused_group_mlp"),
        precision="bf16",
        description="megatron-core's GPTModel with MoE layers, the op-fuser grouped MLP",
    ),
)
"""Rows on megatron-core's own models (``Case.impl`` ``mcore``: ``HybridModel``, ``mcore-gpt``:
``GPTModel``): the seed, then one per model family, then the GPT-style MoE model on both expert
paths; bf16 as the seed runs it. Selected by ``--family mcore`` (or ``all``), with the
``MCORE_SHARDED_ROWS`` and ``MCORE_KNOB_ROWS``."""

_SEED_MCORE = MCORE_ROWS[0]
_MOE_MCORE = MCORE_ROWS[2]  # *E*E, expert_fc1 + moe_act, bf16
MCORE_SHARDED_ROWS: tuple[Case, ...] = (
    _SEED_MCORE.replace(
        sharding="mfsdp",
        description="the seed under Megatron-FSDP as megatron-core 0.19 ships it "
        "(optim_grads_params, distributed optimizer)",
    ),
    _SEED_MCORE.replace(
        sharding="mfsdp2",
        description='the seed under Megatron-FSDP built from its bundled "v2 building blocks" '
        "(flat fully_shard, fully_shard_optimizer; not the upstream v2 adapter)",
    ),
)
"""The seed's own scenario: megatron-core's ``HybridModel`` ``+-+-+-`` sharded flat ZeRO-3 by
Megatron-FSDP, core_attn + attn_proj offloaded, against the same model under the same sharding
without offloading. One rank is a one-rank mesh; under torchrun each rank has its shard."""

MCORE_KNOB_ROWS: tuple[Case, ...] = (
    _SEED_MCORE.replace(recompute="core_attn", description="selective recompute of core_attn"),
    _SEED_MCORE.replace(
        recompute="mla_up_proj", description="selective recompute of MLA's up-projections"
    ),
    _SEED_MCORE.replace(
        offload=ATTENTION_NAMES,
        recompute="layernorm",
        description="selective recompute of the norms, every attention group offloaded",
    ),
    _SEED_MCORE.replace(recompute="mlp", description="selective recompute of the dense MLPs"),
    _SEED_MCORE.replace(recompute="full", description="full recompute of every layer"),
    _MOE_MCORE.replace(
        recompute="moe_act",
        description="selective recompute of the expert activation, experts offloaded",
    ),
    _MOE_MCORE.replace(
        recompute="moe",
        description="the whole MoE layer recomputed while its experts offload",
    ),
    _SEED_MCORE.replace(cuda_graph="te", description="TransformerEngine CUDA graphs per layer"),
    _MOE_MCORE.replace(
        cuda_graph="local-moe",
        description="local CUDA graphs of the MoE router and preprocessing, experts offloaded",
    ),
    _SEED_MCORE.replace(fraction=0.5, description="activation_offload_fraction 0.5"),
    _SEED_MCORE.replace(
        delta_bytes=1 << 20,
        description="delta_offload_bytes_across_pp_ranks 1 MiB (one pipeline stage: rank 0)",
    ),
    _SEED_MCORE.replace(
        min_tensor_size=1 << 20,
        description="megatron-core's default min_offloaded_tensor_size (1 Mi elements)",
    ),
    _SEED_MCORE.replace(mtp="+-", description="one multi-token-prediction depth (+-)"),
)
"""Every megatron-core knob that meets offloading, one row each on the seed (or the MoE model
for the expert knobs): what megatron-core does - passes, moves less than configured, refuses -
is the row's verdict (a configuration 0.19 refuses skips with its message)."""

MCORE_MAIN_ROWS: tuple[Case, ...] = (
    _SEED_MCORE.replace(
        sharding="mfsdp-v2",
        description="the seed under the upstream Megatron-FSDP v2 adapter "
        "(megatron_fsdp_version=2, FullyShardedOptimizer), the seed's settings",
    ),
    _SEED_MCORE.replace(
        offload_buffer_kib=1 << 20,
        description="megatron-core's fixed pinned activation buffer at 1 GiB (fits the seed)",
    ),
    _SEED_MCORE.replace(
        offload_buffer_kib=1,
        description="megatron-core's fixed pinned activation buffer at 1 KiB, smaller than any "
        "offloaded tensor: megatron-core's own error is the verdict",
    ),
)
"""Rows for what upstream main adds (``harness.models.mcore.features``): each skips with the
feature's one line where the installed megatron-core lacks it (the sharding's or the buffer's
feature). No row selects ``gdp_qkv``: no model the harness builds opens it."""

MCORE_FAMILY: tuple[Case, ...] = MCORE_ROWS + MCORE_SHARDED_ROWS + MCORE_KNOB_ROWS + MCORE_MAIN_ROWS
"""Every row of ``--family mcore``."""

MODELS_CHOICES = ("harness", "mcore", "all")
"""``--models``: whose models the rows build (ours, megatron-core's, or both)."""
"""``--family``: whose models the session's rows build (``Case.impl``), or both."""


def full_matrix() -> list[Case]:
    """Every family x applicable set x schedule x max-inflight x precision, then the ZeRO-3
    rows."""
    rows = []
    for family in FAMILIES:
        for _, names in applicable_sets(family):
            for schedule, inflight, precision in itertools.product(
                SCHEDULES_IN_MATRIX, INFLIGHT_VALUES, PRECISION_VALUES
            ):
                rows.append(
                    Case(
                        family=family,
                        offload=names,
                        schedule=schedule,
                        precision=precision,
                        max_inflight=inflight,
                    )
                )
    return (
        rows
        + list(DETECTION_ROWS)
        + list(PIPELINE_ROWS)
        + list(CADENCE_ROWS + FULL_CADENCE_ROWS)
        + zero3_rows(full=True)
    )


def default_matrix() -> list[Case]:
    """The seed case, then one row per (family, offload set) cycling the other axes, then the
    detection rows, the seed's row under the interleaved schedule, the cadence rows (fraction,
    pool cap, inert), then the seed's and one MoE row under ZeRO-3."""
    rows = [SEED_CASE, *(r for r in _cycled_rows() if r.name != SEED_CASE.name)]
    return (
        rows
        + list(DETECTION_ROWS)
        + list(PIPELINE_ROWS[:1])
        + list(CADENCE_ROWS)
        + zero3_rows(full=False)
    )


MATRICES = {"default": default_matrix, "full": full_matrix}


def matrix(name: str, models: str = "harness") -> list[Case]:
    """A matrix by name (``default`` or ``full``): its rows on our models (``models``
    ``harness``), the ``MCORE_ROWS`` (``mcore``) or both (``all``)."""
    try:
        rows = MATRICES[name]()
    except KeyError:
        raise ValueError(f"unknown matrix {name!r}; known: {', '.join(MATRICES)}") from None
    if models not in MODELS_CHOICES:
        raise ValueError(f"unknown models {models!r}; known: {', '.join(MODELS_CHOICES)}")
    return {"harness": rows, "mcore": list(MCORE_FAMILY), "all": rows + list(MCORE_FAMILY)}[models]


def find_case(case_id: str) -> Case:
    """The row of the full matrix (or the default one) whose name is ``case_id``."""
    for row in [*default_matrix(), *full_matrix(), *MCORE_FAMILY]:
        if row.name == case_id:
            return row
    raise ValueError(
        f"unknown case id {case_id!r}; list them with `offload-harness cases --matrix full`"
    )
