"""A row of the case table (``Case``), the axes and offload sets the matrix is made of, the
preset a row's family names at a size (``model_spec``), and the seed's row (``SEED_CASE``).

A row names a model family, an offload set, a schedule, a precision and a max-inflight cap; its
``name`` is the pytest id and the report key, e.g. ``hybrid-+-+-+-_core_attn+attn_proj_1f1b_bf16``.
The model's size comes from the device (``-tiny`` presets on CPU, ``-small`` on CUDA) unless the
run asks for one.
"""

from __future__ import annotations

import dataclasses
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
    pipeline: int = 1
    """Pipeline stages across ranks (PP, ``harness.models.pipeline``): above 1 the case runs as a
    pipeline of one stage per rank (VPP model chunks per rank under ``interleaved``) and needs
    exactly that many ranks (``min_ranks`` follows it); its id ends ``_pp<PP>`` (``_pp<PP>x<VPP>``
    under VPP)."""
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
        self._check_pipeline()
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

    def _check_pipeline(self) -> None:
        """A pipeline row's own rules (``pipeline`` > 1); it sets ``min_ranks`` to the stages."""
        if isinstance(self.pipeline, bool) or not isinstance(self.pipeline, int):
            raise ValueError(f"pipeline must be an int >= 1, got {self.pipeline!r}")
        if self.pipeline < 1:
            raise ValueError(f"pipeline must be an int >= 1, got {self.pipeline!r}")
        if self.pipeline == 1:
            return
        if not IMPLS[self.impl].ours or self.sharding != "none" or self.eval_first:
            raise ValueError(
                "a pipeline across ranks runs the harness's own models, unsharded, with no "
                f"evaluation pass first (impl {self.impl!r}, sharding {self.sharding!r})"
            )
        if self.schedule not in ("gpipe", "1f1b", "interleaved"):
            raise ValueError(
                f"a pipeline row runs gpipe, 1f1b or interleaved, not {self.schedule!r}"
            )
        object.__setattr__(self, "min_ranks", self.pipeline)

    @property
    def vpp(self) -> int:
        """Model chunks per pipeline rank (2 under ``interleaved``, else 1)."""
        return INTERLEAVED_CHUNKS if self.schedule == "interleaved" else 1

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
        if self.min_ranks != 1 and self.pipeline == 1:
            parts.append(f"ranks-{self.min_ranks}")
        if self.eval_first:
            parts.append("evalfirst")
        if self.pipeline > 1:
            parts.append(f"pp{self.pipeline}" + (f"x{self.vpp}" if self.vpp > 1 else ""))
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
"""The seed's row, first in the default matrix; the other families' rows derive from it."""
