"""Whether a run fits the machine's memory before it starts: the bytes a run allocates up front
for its data (``run_bytes``), what this process can still allocate (``available_memory``), the
one-line refusal (``check_fits``) the command line and the plugin give before any training, and
the device bytes a case's trainings hold at their peak (``case_peak_bytes``), from which
``harness.run.budget`` decides how many cases share a GPU at once."""

from __future__ import annotations

import os

from harness.vocab.spec import ModelSpec, RunSpec

TOKEN_BYTES = 8
"""Bytes per token of the batches (int64, ``harness.models.hybrid.make_batches``)."""
LOSS_BYTES = 4
"""Bytes per loss of the runner's per-(step, microbatch) loss tensor (fp32)."""

STATE_BYTES: dict[str, int] = {"fp32": 16, "bf16": 20}
"""Device bytes per parameter a training run of ``harness.models.train`` holds besides its
activations: fp32, the weight, its gradient and Adam's two moments (4 + 4 + 8); bf16, the bf16
weight and gradient (2 + 2), the fp32 main weight and the fp32 gradient the optimizer step
makes of it (4 + 4) and the moments (8)."""
GRAD_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2}
"""Bytes per parameter of one step's gradients a run keeps for the comparison (``keep_grads``:
the model's gradients, in the compute dtype)."""
ZERO3_STATE_BYTES = 16
"""Device bytes per parameter of a ZeRO-3 run (FSDP2, ``harness.models.train``) besides its
activations, in either precision: the fp32 sharded weight and its fp32 gradient (4 + 4) and
Adam's two moments (8); there is no master copy. At world size 1 the shard is the whole."""
ZERO3_GRAD_BYTES = 4
"""Bytes per parameter of one step's gradients a ZeRO-3 run keeps: the local shards of its fp32
gradients (FSDP2 reduce-scatters them in fp32 into the fp32 sharded parameters), in bf16 too."""
ZERO3_UNIT_BYTES: dict[str, int] = {"fp32": 16, "bf16": 10}
"""Device bytes per parameter of FSDP2's largest unit (a layer, or the root's own parameters)
that FSDP2 holds on top, as the design has it: the unit's all-gathered copy in the compute dtype
and the prefetched next unit's (2 x 2 B in bf16), its unsharded gradient in the compute dtype
(2 B) and that gradient cast to fp32 for the reduce-scatter (4 B); in fp32 the copies are 4 B."""
ZERO3_EARLIER_RUNS = 2
"""Earlier trainings of a case still holding their weights while the offload run peaks: a ZeRO-3
model lives in reference cycles (FSDP2's state and its parameters' module infos refer back to the
module), so its sharded fp32 weights (4 B per parameter, measured on the CPU:
``tests/unit/test_gpu_budget.py``) outlive ``train`` until Python's cyclic collector runs, and the
plain baseline and the hooks run come before the offload run (``harness.execute.steps``; the
memory check collects before its own readings)."""
BACKWARD_TRANSIENT = 0.25
"""A pass's backward briefly holds gradients of its activations beside them: a quarter of one
pass's activations. On the H100 (2026-12-06) the memory check's peak of the last step stood
0.06-0.26 GiB above what the last forward left allocated, 5-17 % of a microbatch's
activations."""


def run_bytes(model: ModelSpec, run: RunSpec) -> int:
    """Bytes one training run allocates up front for its data, whatever the model: the token
    batches ``make_batches`` builds (steps x microbatches x micro_batch_size x (seq_length + 1)
    int64) plus the runner's loss tensor (steps x microbatches fp32). Python ints: no overflow."""
    sequences = run.steps * run.microbatches * model.micro_batch_size
    tokens = sequences * (model.seq_length + 1) * TOKEN_BYTES
    return tokens + run.steps * run.microbatches * LOSS_BYTES


def case_peak_bytes(
    *,
    parameters: int,
    pass_activations: int,
    passes_in_flight: int,
    model: ModelSpec,
    run: RunSpec,
    kept_runs: int,
    sharding: str = "none",
    largest_unit: int = 0,
) -> int:
    """Device bytes a case's trainings hold at their peak, from ``parameters`` (the model's
    count) and ``pass_activations`` (what autograd saves in one pass's forward, parameters
    excluded): the running training's state (``STATE_BYTES``), the activations of the
    ``passes_in_flight`` passes whose backward has not run yet plus one backward's transient
    (``BACKWARD_TRANSIENT``), its data (``run_bytes``) and the per-step gradients of the
    ``kept_runs`` runs whose gradients are kept at once (the shared plain baseline's, the
    running one's, and a layout baseline's where one is made: ``harness.execute.steps``).

    Sharding ``zero3`` (FSDP2) keeps fp32 gradients (``ZERO3_GRAD_BYTES``) and fp32 state
    (``ZERO3_STATE_BYTES``), and adds FSDP2's buffers of its ``largest_unit`` (the parameters of
    its largest ``fully_shard`` unit, ``ZERO3_UNIT_BYTES``) and the weights of the earlier
    trainings not yet collected (``ZERO3_EARLIER_RUNS``). Pure arithmetic, Python ints."""
    zero3 = sharding == "zero3"
    grad_bytes = ZERO3_GRAD_BYTES if zero3 else GRAD_BYTES[run.precision]
    kept = kept_runs * run.steps * parameters * grad_bytes
    state = parameters * (ZERO3_STATE_BYTES if zero3 else STATE_BYTES[run.precision])
    if zero3:
        state += largest_unit * ZERO3_UNIT_BYTES[run.precision]
        state += ZERO3_EARLIER_RUNS * parameters * 4
    activations = pass_activations * passes_in_flight
    transient = int(pass_activations * BACKWARD_TRANSIENT)
    return kept + state + activations + transient + run_bytes(model, run)


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
