"""Frozen specs: the layer-pattern parser, model and run specs, and the named presets.

A spec is shared by the baseline run and the offload run, so every spec is a frozen,
keyword-only, slotted dataclass validated in ``__post_init__``; bad values raise a
``ValueError`` whose single line says what is allowed.

Layer pattern symbols follow Megatron-Core's hybrid models:

    ``+`` MLA (multi-latent attention)      ``*`` standard attention
    ``-`` dense SwiGLU MLP                  ``E`` mixture of experts

Each symbol also fixes the offload groups its layer opens, in start order; the symbols and the
group names live in one table each, ``harness.vocab.groups``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from harness.vocab.groups import ATTENTION_KINDS_EXCLUSIVE as EXCLUSIVE
from harness.vocab.groups import GROUPS, LAYERS, MoEPath
from harness.vocab.impls import IMPLS

LAYER_SYMBOLS: dict[str, str] = {symbol: layer.kind for symbol, layer in LAYERS.items()}
"""Legal pattern symbols and the layer kind each builds (``harness.vocab.groups.LAYERS``)."""

ALL_GROUP_NAMES: tuple[str, ...] = tuple(GROUPS)
"""Offload group names the harness models can open (``harness.vocab.groups.GROUPS``)."""


def gpt_layers(layers: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """A pattern's symbols as GPT layers: (attention, MLP) pairs, e.g. ``*E*-`` -> ``*E``, ``*-``.

    Raises ValueError for a pattern that is not such pairs."""
    pairs = tuple(zip(layers[::2], layers[1::2], strict=False))
    if len(layers) % 2 or any(
        LAYERS[a].role != "attention" or LAYERS[m].role != "mlp" for a, m in pairs
    ):
        attention = " or ".join(f"'{s}'" for s, x in LAYERS.items() if x.role == "attention")
        mlp = " or ".join(f"'{s}'" for s, x in LAYERS.items() if x.role == "mlp")
        raise ValueError(
            f"pattern {''.join(layers)!r}: a GPT model's layer is attention ({attention}) then "
            f"MLP ({mlp}); write the pattern as such pairs, e.g. '*E*E'"
        )
    return pairs


def group_template(symbol: str, moe_path: MoEPath = "unfused") -> tuple[str, ...]:
    """Offload groups a layer of ``symbol`` opens, in start order (Megatron's templates; each
    symbol's reason is its ``harness.vocab.groups.LAYERS`` note)."""
    try:
        return LAYERS[symbol].template(moe_path)
    except KeyError:
        raise ValueError(f"unknown layer symbol {symbol!r}; legal: {_legal_symbols()}") from None


def _legal_symbols() -> str:
    return ", ".join(f"'{s}' ({kind})" for s, kind in LAYER_SYMBOLS.items())


def parse_pattern(pattern: str) -> tuple[str, ...]:
    """Parse a hybrid layer pattern into a tuple of layer symbols, one per layer.

    Rules (Megatron's, restricted to what one pipeline stage without MTP can run):
    empty is an error; every character must be a layer symbol; ``*`` and ``+`` cannot be mixed
    (standard attention and MLA in one model); ``|`` and ``/`` are rejected with their meaning.
    """
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"layer pattern must be a non-empty string of {_legal_symbols()}")
    if "|" in pattern:
        raise ValueError(
            f"pattern {pattern!r}: '|' marks pipeline-stage boundaries; the harness runs one "
            "pipeline stage, so write the pattern without '|'"
        )
    if "/" in pattern:
        raise ValueError(
            f"pattern {pattern!r}: '/' starts multi-token-prediction layers, which the harness "
            "models do not build; write the main pattern only"
        )
    for index, symbol in enumerate(pattern):
        if symbol not in LAYER_SYMBOLS:
            raise ValueError(
                f"pattern {pattern!r}: unknown symbol {symbol!r} at position {index}; "
                f"legal: {_legal_symbols()}"
            )
    exclusive = {LAYERS[s].kind: s for s in reversed(pattern) if LAYERS[s].kind in EXCLUSIVE}
    if len(exclusive) > 1:
        (a, kind_a), (b, kind_b) = sorted(
            ((s, kind) for kind, s in exclusive.items()), key=lambda item: pattern.index(item[0])
        )[:2]
        raise ValueError(
            f"pattern {pattern!r} mixes {a!r} ({kind_a}) and {b!r} ({kind_b}); use one or the other"
        )
    return tuple(pattern)


def _check_positive(obj: object, *names: str, maximum: int | None = None) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be a positive int, got {value!r}")
        if maximum is not None and value > maximum:
            raise ValueError(
                f"{type(obj).__name__}.{name} must be an int from 1 to {maximum:_}, got {value!r}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """Everything that fixes a model's structure and its input shapes."""

    pattern: str
    """Hybrid layer pattern, e.g. ``"+-+-+-"`` (see module docstring)."""
    hidden_size: int = 64
    """Residual-stream width D."""
    num_heads: int = 4
    """Attention heads H (MLA and standard attention)."""
    ffn_hidden_size: int = 128
    """Dense SwiGLU MLP inner width F."""
    vocab_size: int = 128
    """Vocabulary size V."""
    seq_length: int = 32
    """Tokens per sequence T."""
    micro_batch_size: int = 2
    """Sequences per microbatch B."""
    q_lora_rank: int = 32
    """MLA query compression rank."""
    kv_lora_rank: int = 32
    """MLA key/value compression rank."""
    qk_nope_head_dim: int = 16
    """MLA per-head query/key width without rotary embedding."""
    qk_rope_head_dim: int = 8
    """MLA per-head query/key rotary width (shared key part across heads); even."""
    v_head_dim: int = 16
    """MLA per-head value width."""
    num_experts: int = 4
    """Experts per MoE layer E."""
    moe_topk: int = 2
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int = 64
    """Expert SwiGLU inner width."""
    moe_capacity_factor: float = 2.0
    """Expert capacity = ceil(tokens * topk / experts * factor); extra tokens are dropped."""
    moe_path: MoEPath = "unfused"
    """``unfused``: fc1 -> act -> fc2 (groups expert_fc1, moe_act); ``fused``: one unit
    (group fused_group_mlp)."""
    impl: str = "harness"
    """Who builds the model (``harness.vocab.impls.IMPLS``)."""
    recompute: str = ""
    """megatron-core's activation recompute: ``""`` none, ``full`` (every layer, uniform), or
    ``+``-joined ``RECOMPUTE_MODULES`` for selective recompute. Implementations with
    ``ModelImpl.knobs`` only."""
    cuda_graph: str = ""
    """megatron-core's CUDA-graph capture (``CUDA_GRAPHS``); ``ModelImpl.knobs`` only."""
    mtp: str = ""
    """Multi-token-prediction layers after the main pattern: one depth's pattern, ``/`` between
    depths (``"+-"``: one depth of an MLA and an MLP layer); HybridModel (``ModelImpl.mtp``)
    only. Their layers are numbered after the main pattern's, depth by depth."""
    layers: tuple[str, ...] = field(init=False)
    """The parsed pattern, one symbol per layer."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", parse_pattern(self.pattern))
        _check_positive(
            self,
            "hidden_size",
            "num_heads",
            "ffn_hidden_size",
            "vocab_size",
            "seq_length",
            "micro_batch_size",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "num_experts",
            "moe_topk",
            "moe_ffn_hidden_size",
        )
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"ModelSpec.hidden_size ({self.hidden_size}) must be divisible by num_heads "
                f"({self.num_heads})"
            )
        if (self.hidden_size // self.num_heads) % 2 or self.qk_rope_head_dim % 2:
            raise ValueError("ModelSpec: rotary widths (head dim, qk_rope_head_dim) must be even")
        if self.moe_topk > self.num_experts:
            raise ValueError(
                f"ModelSpec.moe_topk ({self.moe_topk}) must be <= num_experts ({self.num_experts})"
            )
        if not self.moe_capacity_factor > 0:
            raise ValueError(
                f"ModelSpec.moe_capacity_factor must be > 0, got {self.moe_capacity_factor!r}"
            )
        if self.impl not in IMPLS:
            raise ValueError(f"ModelSpec.impl must be one of {', '.join(IMPLS)}, got {self.impl!r}")
        if IMPLS[self.impl].gpt_layers:
            gpt_layers(self.layers)
        if self.moe_path not in ("unfused", "fused"):
            raise ValueError(
                f"ModelSpec.moe_path must be 'unfused' or 'fused', got {self.moe_path!r}"
            )
        self._check_knobs()

    def _check_knobs(self) -> None:
        impl = IMPLS[self.impl]
        for name in ("recompute", "cuda_graph"):
            if getattr(self, name) and not impl.knobs:
                raise ValueError(
                    f"ModelSpec.{name} is a megatron-core setting; impl {self.impl!r} has none"
                )
        if self.recompute not in ("", "full"):
            unknown = [m for m in self.recompute.split("+") if m not in RECOMPUTE_MODULES]
            if unknown:
                raise ValueError(
                    f"ModelSpec.recompute: unknown module {unknown[0]!r}; 'full' or "
                    f"'+'-joined modules of {', '.join(RECOMPUTE_MODULES)}"
                )
        if self.cuda_graph not in CUDA_GRAPHS:
            raise ValueError(
                f"ModelSpec.cuda_graph must be one of {', '.join(map(repr, CUDA_GRAPHS))}, "
                f"got {self.cuda_graph!r}"
            )
        if self.mtp:
            if not impl.mtp:
                raise ValueError(
                    f"ModelSpec.mtp: impl {self.impl!r} builds no multi-token-prediction layers"
                )
            depths = self.mtp.split("/")
            if len(set(depths)) != 1:
                raise ValueError(f"ModelSpec.mtp {self.mtp!r}: every depth must be the same")
            parse_pattern(self.pattern + depths[0])  # symbols, and no attention/MLA mix

    @property
    def mtp_depths(self) -> int:
        """Multi-token-prediction depths (0: none)."""
        return len(self.mtp.split("/")) if self.mtp else 0

    @property
    def all_layers(self) -> tuple[str, ...]:
        """The main pattern's layers, then every multi-token-prediction depth's."""
        if not self.mtp:
            return self.layers
        return self.layers + tuple(self.mtp.split("/")[0]) * self.mtp_depths

    @property
    def group_names(self) -> tuple[str, ...]:
        """Distinct offload group names this model opens, in first-start order."""
        names: dict[str, None] = {}
        for symbol in self.all_layers:
            names.update(dict.fromkeys(group_template(symbol, self.moe_path)))
        return tuple(names)

    def group_sequence(
        self, selected: tuple[str, ...] | frozenset[str]
    ) -> tuple[tuple[int, str], ...]:
        """(layer, name) of every group one microbatch opens, in start order, for a selection."""
        return tuple(
            (layer, name)
            for layer, symbol in enumerate(self.all_layers)
            for name in group_template(symbol, self.moe_path)
            if name in selected
        )

    def replace(self, **changes: object) -> ModelSpec:
        """A copy with fields changed (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


Schedule = Literal["sequential", "gpipe", "1f1b", "interleaved"]
Precision = Literal["fp32", "bf16"]
SCHEDULES: tuple[str, ...] = ("sequential", "gpipe", "1f1b", "interleaved")
INTERLEAVED_CHUNKS = 2
"""Model chunks (virtual pipeline stages) of the ``interleaved`` schedule: the model's layers
split into this many contiguous parts, each a pass of its own (``harness.models.train``)."""
INTERLEAVED_RANKS = 2
"""Pipeline ranks whose interleaved order the ``interleaved`` schedule runs (its microbatch
group size; microbatches must be a multiple of it)."""
INTERLEAVED_RANK = 0
"""The pipeline rank whose order it is: rank 0 has the longest warmup (the most chunks in
flight at once)."""


def model_chunks(schedule: str) -> int:
    """Model chunks one pass runs (``INTERLEAVED_CHUNKS`` for ``interleaved``, else 1)."""
    return INTERLEAVED_CHUNKS if schedule == "interleaved" else 1


def chunk_layers(count: int, chunk: int, chunks: int) -> range:
    """Indices of the layers model chunk ``chunk`` of ``chunks`` runs in a model of ``count``
    layers: contiguous, the first ``count % chunks`` chunks one layer longer."""
    if not 0 <= chunk < chunks <= count:
        raise ValueError(
            f"model chunk {chunk} of {chunks}: the model has {count} layers (a chunk needs at "
            "least one)"
        )
    size, extra = divmod(count, chunks)
    start = chunk * size + min(chunk, extra)
    return range(start, start + size + (chunk < extra))


def pass_label(p: int, schedule: str) -> str:
    """How messages name pass ``p`` of ``schedule``: ``microbatch 3``, or with model chunks
    ``pass 3 (microbatch 1, model chunk 1)``."""
    return label_pass(p, model_chunks(schedule))


def label_pass(p: int, chunks: int) -> str:
    """``pass_label`` by the number of model chunks a pass runs."""
    if chunks == 1:
        return f"microbatch {p}"
    return f"pass {p} (microbatch {p // chunks}, model chunk {p % chunks})"


PRECISIONS: tuple[str, ...] = ("fp32", "bf16")
SHARDINGS: tuple[str, ...] = ("none", "zero3", "mfsdp", "mfsdp2")
"""How the runner shards the model: ``none``; ``zero3``, flat ZeRO-3 through PyTorch's FSDP2
(our models, ``harness.models.train``); ``mfsdp``, Megatron-FSDP as megatron-core 0.19 ships it
(``optim_grads_params`` with the distributed optimizer); ``mfsdp2``, the Megatron-FSDP "v2
building blocks" megatron-core 0.19 bundles (flat-placement ``fully_shard`` and
``fully_shard_optimizer``; not the upstream v2 adapter, which no release has). The last two are
megatron-core's models only (``harness.models.mcore``). Every sharded run gives each rank its
own data shard."""

RECOMPUTE_MODULES: tuple[str, ...] = (
    "core_attn",
    "mla_up_proj",
    "layernorm",
    "mlp",
    "moe_act",
    "moe",
    "shared_experts",
)
"""Modules megatron-core's selective recompute takes (``TransformerConfig.recompute_modules``
of 0.19); ``ModelSpec.recompute`` names some of them, or ``full``."""
CUDA_GRAPHS: tuple[str, ...] = ("", "te", "local-moe")
"""``ModelSpec.cuda_graph``: none; megatron-core's ``cuda_graph_impl="transformer_engine"``
(whole layers captured by TransformerEngine); ``local`` capture of the MoE router and
preprocessing only (the partial-MoE capture megatron-core allows with expert offloading)."""
OPTIMIZERS: tuple[str, ...] = ("adamw", "adam", "sgd")

MAX_STEPS = 1_000_000
"""Most optimizer steps a ``RunSpec`` takes. The data generator seeds each (step, microbatch)
with ``seed * 1_000_003 + step * 1_009 + microbatch + 1`` and a data shard adds multiples of
``DATA_SHARD_STRIDE`` (7_919 * 1_000_003, ``harness.models.hybrid``): up to here the step term
(about 1e9) stays well below that stride, so ranks never share a generator, and every size and
seed built from the counts fits an int64. A harness run of a million steps is days of training
anyway; ``check_fits`` refuses what the machine cannot hold."""
MAX_MICROBATCHES = 1_000
"""Most microbatches per step a ``RunSpec`` takes: below the data generator's step stride of
1_009 (see ``MAX_STEPS``), so every (step, microbatch) draws its own tokens as
``make_batches`` promises (from 1_009 on, microbatch 1_009 of step 0 would repeat microbatch 0
of step 1). A thousand microbatches is far beyond any gradient accumulation the cases need."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSpec:
    """How a model is trained: steps, microbatches, schedule, precision, optimizer."""

    steps: int = 6
    """Optimizer steps (iterations); the first one is the offloader's warmup."""
    microbatches: int = 2
    """Microbatches per step (gradient accumulation)."""
    schedule: Schedule = "sequential"
    """Order of forwards and backwards inside a step: ``sequential`` (F0 B0 F1 B1 ...),
    ``gpipe`` (all forwards, then all backwards), ``1f1b`` (F0, then F(i) B(i-1), then last B),
    ``interleaved`` (Megatron-Core's interleaved 1F1B as pipeline rank 0 of 2 runs it, with the
    model in 2 chunks: ``harness.models.train.interleaved_order``; microbatches a multiple of 2)."""
    precision: Precision = "fp32"
    """``fp32``; or ``bf16``: BF16 compute and gradients, FP32 main weights in the optimizer."""
    grad_clip: float | None = 1.0
    """Global-norm gradient clipping threshold; None disables clipping."""
    optimizer: str = "adamw"
    """``adamw``, ``adam`` or ``sgd``."""
    lr: float = 1e-3
    """Learning rate."""
    seed: int = 1234
    """Seed of the weight generator and of the data generator."""
    eval_first: bool = False
    """Before the first training step, run one no-grad forward of every microbatch (step 0's
    data) through the offloader and end that iteration, as an evaluation pass before training
    would: the warmup must still be the first training iteration (Megatron takes whatever ran
    first)."""

    def __post_init__(self) -> None:
        _check_positive(self, "steps", maximum=MAX_STEPS)
        _check_positive(self, "microbatches", maximum=MAX_MICROBATCHES)
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"RunSpec.schedule must be one of {', '.join(SCHEDULES)}; got {self.schedule!r}"
            )
        if self.schedule == "interleaved" and self.microbatches % INTERLEAVED_RANKS:
            raise ValueError(
                f"RunSpec.microbatches must be a multiple of {INTERLEAVED_RANKS} under the "
                f"interleaved schedule (its microbatch groups); got {self.microbatches}"
            )
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"RunSpec.precision must be one of {', '.join(PRECISIONS)}; got {self.precision!r}"
            )
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"RunSpec.optimizer must be one of {', '.join(OPTIMIZERS)}; got {self.optimizer!r}"
            )
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"RunSpec.grad_clip must be > 0 or None, got {self.grad_clip!r}")
        if not self.lr > 0:
            raise ValueError(f"RunSpec.lr must be > 0, got {self.lr!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"RunSpec.seed must be a non-negative int, got {self.seed!r}")

    def replace(self, **changes: object) -> RunSpec:
        """A copy with fields changed (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


TOKEN_BYTES = 8
"""Bytes per token of the batches (int64, ``harness.models.hybrid.make_batches``)."""
LOSS_BYTES = 4
"""Bytes per loss of the runner's per-(step, microbatch) loss tensor (fp32)."""


def run_bytes(model: ModelSpec, run: RunSpec) -> int:
    """Bytes one training run allocates up front for its data, whatever the model: the token
    batches ``make_batches`` builds (steps x microbatches x micro_batch_size x (seq_length + 1)
    int64) plus the runner's loss tensor (steps x microbatches fp32). Python ints: no overflow."""
    sequences = run.steps * run.microbatches * model.micro_batch_size
    tokens = sequences * (model.seq_length + 1) * TOKEN_BYTES
    return tokens + run.steps * run.microbatches * LOSS_BYTES


def available_memory() -> int | None:
    """Bytes this process can still allocate: ``MemAvailable`` of ``/proc/meminfo`` (else the
    available physical pages of ``os.sysconf``), capped by a cgroup v2 memory limit where one
    is set; None when unknown."""
    available: int | None = None
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024  # kB
                    break
    except (OSError, ValueError, IndexError):
        available = None
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, OSError, ValueError):
            return None
        if available <= 0:
            return None
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as limit_file:
            limit = limit_file.read().strip()
        with open("/sys/fs/cgroup/memory.current", encoding="ascii") as current_file:
            current = int(current_file.read().strip())
        if limit != "max":
            available = min(available, max(0, int(limit) - current))
    except (OSError, ValueError):
        pass
    return available


def check_fits(model: ModelSpec, run: RunSpec, available_bytes: int | None = None) -> None:
    """Refuse a run whose up-front data (``run_bytes``: token batches and losses) exceeds the
    memory available, with a one-line ``ValueError`` saying how much it needs and how much the
    machine has; do nothing when that is unknown.

    ``available_bytes`` defaults to ``available_memory()`` (host memory: the batches are built
    on the host on every device; on CUDA a caller may also check the device's free memory,
    ``torch.cuda.mem_get_info()[0]``, since the runner copies them there). The estimate leaves
    out the model, its optimizer and its activations, so passing it does not promise the run
    fits; failing it promises the run does not. Pure arithmetic: no torch, nothing allocated."""
    need = run_bytes(model, run)
    have = available_memory() if available_bytes is None else available_bytes
    if have is None or need <= have:
        return
    raise ValueError(
        f"--steps {run.steps} x --microbatches {run.microbatches} needs {_size(need)} of token "
        f"batches ({run.steps * run.microbatches * model.micro_batch_size} sequences of "
        f"{model.seq_length + 1} int64 tokens, and the losses); this machine has {_size(have)} "
        "available"
    )


def _size(nbytes: int) -> str:
    """Decimal units, as memory is sold: ``1056 GB``, ``3.4 GB``, ``120 MB``."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{nbytes} bytes"


def _hybrid_tiny() -> ModelSpec:
    return ModelSpec(pattern="+-+-+-")


def _hybrid_small() -> ModelSpec:
    # Several MiB per group on a GPU: core_attn's softmax output alone is
    # B*H*T*T*2 bytes = 2*16*1024*1024*2 = 64 MiB in bf16.
    return ModelSpec(
        pattern="+-+-+-",
        hidden_size=1024,
        num_heads=16,
        ffn_hidden_size=4096,
        vocab_size=4096,
        seq_length=1024,
        micro_batch_size=2,
        q_lora_rank=512,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
    )


def _moe_tiny(moe_path: MoEPath = "unfused") -> ModelSpec:
    return ModelSpec(pattern="*E*E", moe_path=moe_path)


def _moe_small(moe_path: MoEPath = "unfused") -> ModelSpec:
    return ModelSpec(
        pattern="*E*E",
        hidden_size=1024,
        num_heads=16,
        ffn_hidden_size=4096,
        vocab_size=4096,
        seq_length=1024,
        micro_batch_size=2,
        num_experts=8,
        moe_topk=2,
        moe_ffn_hidden_size=1024,
        moe_capacity_factor=1.25,
        moe_path=moe_path,
    )


def _hybrid_moe_tiny() -> ModelSpec:
    return ModelSpec(pattern="+E+-+E")


def _hybrid_moe_small() -> ModelSpec:
    return _hybrid_small().replace(
        pattern="+E+-+E", num_experts=8, moe_ffn_hidden_size=1024, moe_capacity_factor=1.25
    )


@dataclass(frozen=True, kw_only=True)
class Preset:
    """A named model: the case family it serves at a model size, and its builder."""

    name: str
    family: str
    """The case family (``harness.cases.FAMILIES``) whose rows build it at ``size``."""
    size: str
    """``tiny`` (CPU sized) or ``small`` (GPU sized)."""
    build: Callable[[], ModelSpec]


_PRESET_LIST = (
    Preset(name="hybrid-tiny", family="hybrid", size="tiny", build=_hybrid_tiny),
    Preset(name="hybrid-small", family="hybrid", size="small", build=_hybrid_small),
    Preset(name="moe-tiny", family="moe", size="tiny", build=_moe_tiny),
    Preset(name="moe-small", family="moe", size="small", build=_moe_small),
    Preset(
        name="moe-tiny-fused", family="moe-fused", size="tiny", build=lambda: _moe_tiny("fused")
    ),
    Preset(
        name="moe-small-fused", family="moe-fused", size="small", build=lambda: _moe_small("fused")
    ),
    Preset(name="hybrid-moe", family="hybrid-moe", size="tiny", build=_hybrid_moe_tiny),
    Preset(name="hybrid-moe-small", family="hybrid-moe", size="small", build=_hybrid_moe_small),
)
PRESETS: dict[str, Preset] = {p.name: p for p in _PRESET_LIST}
"""Named model presets, the one registry (the case table's families and sizes read it too);
``-tiny`` ones are CPU sized, ``-small`` ones GPU sized."""


def preset(name: str) -> ModelSpec:
    """The named preset (exact name, no fuzzy lookup)."""
    try:
        return PRESETS[name].build()
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}") from None
