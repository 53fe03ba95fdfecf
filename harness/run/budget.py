"""How many workers a CUDA run starts, and when a case may start: the GPU memory budget.

The workers of a run share one GPU, each with its own CUDA context, and a small model's case
holds 4-10 GiB there (the kept gradients of two runs, a run's state and activations). A count
taken from the cores alone (``settings.default_jobs``) started 12 workers on an 80 GB H100
and two rows ran out of memory. So on CUDA:

* each case has a budgeted peak (``Plan.costs``): the peak its worker recorded on this card
  in an earlier run (``harness.run.peaks``, per numerics fingerprint) times
  ``RECORDED_MARGIN``, else the estimate from the model (``estimate_peak``: parameters and
  saved activations measured on the meta device, ``harness.vocab.fits.case_peak_bytes``)
  times ``ESTIMATE_MARGIN``;
* the memory the cases may share (``Plan.limit``) is the card's free memory when the run
  begins, less ``HEADROOM`` of the card and one ``CONTEXT_BYTES`` per worker;
* the workers (``plan_run``) are as many of the smallest cases as fit that at once, never more
  than the CPU default (``settings.default_jobs``) nor the cases; an explicit ``--jobs N`` is
  taken as it is, with one warning line when N of the largest cases would not fit;
* the session starts a case only when its peak and those of the cases running fit the limit
  (``MemoryGate``), so large rows run fewer at a time while small ones fill the workers; one
  that fits nothing runs with nothing else.

pytest-xdist has no such gate: ``-n auto`` on CUDA (``static_workers``) starts as many workers
as fit with every one at the largest case's peak.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from harness.cases import Case
from harness.run.peaks import PeakStore
from harness.vocab.fits import case_peak_bytes
from harness.vocab.spec import ModelSpec, RunSpec, model_chunks

if TYPE_CHECKING:
    import torch

    from harness.execute.environment import Environment
    from harness.offload.semantics import Semantics

GiB = 1 << 30

CONTEXT_BYTES = 1 * GiB
"""Device memory of one worker besides its allocator's: the CUDA context, cuBLAS and cuDNN
handles, the kernels loaded. Every out-of-memory report of the H100 run (torch 2.11+cu130)
showed 0.74 GiB of such "non-PyTorch memory" per worker; 1 GiB leaves room for a driver or
library that loads more."""
HEADROOM = 0.05
"""Fraction of the card left out of the budget: what the margins below miss when many cases
peak together, memory the driver takes, and whatever else starts on the card after the run
began (4 GiB of an 80 GB H100, 7 GiB of a 141 GB H200)."""
ESTIMATE_MARGIN = 1.2
"""An estimated peak is budgeted 20 % higher: the caching allocator reserves more than it
hands out (reserved but unallocated was 5-8 % of allocated in the H100's out-of-memory
reports) and the estimate leaves out small transients (the optimizer step's, the
profiler's, the checksums')."""
RECORDED_MARGIN = 1.1
"""A recorded peak (the worker's reserved memory, fragmentation included) is budgeted 10 %
higher: the same case's peak moves between runs with the order its streams free memory in."""
UNKNOWN_PEAK = 0.25
"""The budgeted peak of a case whose model cannot be estimated (a forward the meta device
cannot run), as a fraction of the card: four such cases at once."""


@dataclass(frozen=True, kw_only=True)
class Card:
    """The run's GPU when the run begins."""

    free: int
    """Bytes free on the card (``torch.cuda.mem_get_info``), other processes' use excluded."""
    total: int
    name: str
    fingerprint: str
    """The numerics fingerprint's id (``harness.measure.fingerprint``): the key of the
    recorded peaks."""

    @property
    def usable(self) -> int:
        """The bytes the workers and their cases may take: the free memory less
        ``HEADROOM`` of the card."""
        return max(0, self.free - int(HEADROOM * self.total))


def read_card(device: torch.device) -> Card:
    """``device``'s memory, name and fingerprint, read in this process (which initialises
    CUDA: ``probe_card`` runs it in a worker)."""
    import torch

    from harness.measure import fingerprint

    free, total = torch.cuda.mem_get_info(device)
    name = torch.cuda.get_device_name(device)
    return Card(free=free, total=total, name=name, fingerprint=fingerprint.of(device).id)


def probe_card(device: torch.device) -> Card:
    """``read_card`` in a worker from the run's forkserver, so this process never initialises
    CUDA (``settings.resolve_device``); the worker's own context counts as used while it
    reads, so the free memory is understated by one context."""
    from harness.run.parallel import kill_pool, worker_pool

    pool = worker_pool(1, device)
    try:
        return pool.submit(read_card, device).result()
    finally:
        kill_pool(pool)


# --- the estimate -------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def model_bytes(spec: ModelSpec, precision: str, chunks: int = 1) -> tuple[int, int]:
    """(parameters, bytes autograd saves in the largest pass's forward, parameters excluded)
    of ``spec``'s model in ``precision`` split into ``chunks`` model chunks (a pass is one
    chunk of one microbatch), measured by forwards of our model on the meta device (shapes
    and dtypes only: nothing allocated, 0.05-0.1 s). On the CPU its saved bytes equal a real
    forward's to the byte for every preset. megatron-core's models are measured as ours of
    the same pattern and widths (their layers hold the same tensors, give or take
    TransformerEngine's fusions)."""
    import torch

    from harness.models.hybrid import HybridModel, loss_fn
    from harness.models.train import DTYPES
    from harness.offload.passthrough import NoOffload

    ours = _as_ours(spec)
    # built on the CPU with its parameters uninitialised (``torch.empty``), then moved: building
    # under the meta device first compiles decompositions (1.6 s on the 2-core machine, once)
    model = HybridModel(ours).to(device="meta", dtype=DTYPES[precision])
    # keyed by the storage objects themselves, held here (an id alone could be reused)
    weights = {id(s): s for s in (p.untyped_storage() for p in model.parameters())}
    tokens = torch.zeros(spec.micro_batch_size, spec.seq_length + 1, dtype=torch.long).to("meta")
    x: torch.Tensor = tokens[:, :-1]
    largest = 0
    for chunk in range(chunks):
        saved: dict[int, torch.UntypedStorage] = {}

        def pack(tensor: torch.Tensor, saved: dict[int, torch.UntypedStorage] = saved) -> Any:
            storage = tensor.untyped_storage()
            saved.setdefault(id(storage), storage)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = model.forward_chunk(x, NoOffload(), chunk, chunks)
            if chunk == chunks - 1:
                loss_fn(out, tokens[:, 1:])
        x = out.detach().requires_grad_(True)  # what the next chunk receives
        pass_bytes = sum(s.nbytes() for key, s in saved.items() if key not in weights)
        largest = max(largest, pass_bytes)
    return sum(p.numel() for p in model.parameters()), largest


@functools.lru_cache(maxsize=64)
def _as_ours(spec: ModelSpec) -> ModelSpec:
    """``spec`` as our own model of the same layers (what the estimates build and count): no
    megatron-core knobs, every layer of the pattern."""
    return spec.replace(
        impl="harness",
        recompute="",
        cuda_graph="",
        mtp="",
        offload_buffer_kib=0,
        pattern="".join(spec.all_layers),
    )


def largest_shard_unit(spec: ModelSpec) -> int:
    """The parameters of ``spec``'s largest FSDP2 unit under sharding ``zero3``: a layer (each
    is ``fully_shard``-ed), or the root's own parameters (embedding, final norm, head), counted
    on the meta device (``harness.models.train.shard_model``)."""
    from harness.models.hybrid import HybridModel

    ours = _as_ours(spec)
    model = HybridModel(ours).to(device="meta")
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.layers]
    root = sum(p.numel() for p in model.parameters()) - sum(layers)
    return max([root, *layers])


def passes_in_flight(schedule: str, microbatches: int) -> int:
    """The most passes whose forward ran and whose backward has not, in one step of
    ``schedule`` (``harness.models.train.schedule_order``)."""
    from harness.models.train import schedule_order

    live = most = 0
    for kind, _ in schedule_order(schedule, microbatches):
        live += 1 if kind == "F" else -1
        most = max(most, live)
    return most


def kept_runs(declared: Semantics | None) -> int:
    """Runs whose per-step gradients a case keeps at once: the shared plain baseline's and
    the offload run's, and a layout baseline's for a backend whose reloads come back
    contiguous or whose rule is learned (``declared`` None: it may be contiguous)."""
    return 3 if declared is None or declared.reload_layout == "contiguous" else 2


def estimate_peak(spec: ModelSpec, run: RunSpec, kept: int, sharding: str = "none") -> int:
    """The device bytes a case of ``spec``, ``run`` and ``sharding`` holds at its peak
    (``harness.vocab.fits.case_peak_bytes``), every pass in flight at the largest pass's
    activations."""
    parameters, activations = model_bytes(spec, run.precision, model_chunks(run.schedule))
    return case_peak_bytes(
        parameters=parameters,
        pass_activations=activations,
        passes_in_flight=passes_in_flight(run.schedule, run.microbatches),
        model=spec,
        run=run,
        kept_runs=kept,
        sharding=sharding,
        largest_unit=largest_shard_unit(spec) if sharding == "zero3" else 0,
    )


def case_estimate(case: Case, model_size: str, kept: int) -> int | None:
    """``estimate_peak`` of ``case`` at ``model_size``; None when the meta device cannot run
    its model's forward."""
    try:
        return estimate_peak(case.model_spec(model_size), case.run_spec(), kept, case.sharding)
    except Exception:  # any model the meta device cannot run: no estimate
        return None


# --- the plan ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How a CUDA run shares its card: the workers, what the cases may take together, and
    each case's budgeted peak."""

    workers: int
    card: Card
    limit: int
    """Bytes the running cases' budgeted peaks may sum to (the card's usable memory less the
    workers' contexts)."""
    costs: tuple[int, ...]
    """Per case (the run's order): its budgeted peak."""
    estimates: tuple[int | None, ...]
    """Per case: the model's estimate, before the margin (None: none could be made)."""
    recorded: int
    """How many costs come from a recorded peak."""
    warning: str | None = None
    """One line for stderr: an explicit ``--jobs`` that the estimate says will not fit."""

    def describe(self) -> str:
        """What the run's first line adds: ``memory budget 62.7 GiB (free 78.7 GiB of
        79.2 GiB, 12 x 1.0 GiB worker contexts, case peaks 4.1-10.0 GiB, 0 of 221 recorded)``."""
        low, high = _gib(min(self.costs), unit=False), _gib(max(self.costs))
        peaks = f"case peak {high}" if high.startswith(low + " ") else f"case peaks {low}-{high}"
        return (
            f"memory budget {_gib(self.limit)} (free {_gib(self.card.free)} of "
            f"{_gib(self.card.total)}, {self.workers} x {_gib(CONTEXT_BYTES)} worker contexts, "
            f"{peaks}, {self.recorded} of {len(self.costs)} recorded)"
        )

    def record(self) -> dict[str, object]:
        """The run's ``device_memory`` field of ``summary.json``."""
        return {
            "card": self.card.name,
            "fingerprint": self.card.fingerprint,
            "total": self.card.total,
            "free": self.card.free,
            "workers": self.workers,
            "limit": self.limit,
            "recorded": self.recorded,
        }

    def bundle_cost(self, bundle: Sequence[int]) -> int:
        """A bundle runs its cases one after another in one worker: its largest peak."""
        return max(self.costs[index] for index in bundle)


def budgeted(estimate: int | None, recorded: int | None, card: Card) -> int:
    """A case's budgeted peak: its recorded peak, else its estimate, each with its margin;
    with neither, ``UNKNOWN_PEAK`` of the card."""
    if recorded is not None:
        return math.ceil(recorded * RECORDED_MARGIN)
    if estimate is not None:
        return math.ceil(estimate * ESTIMATE_MARGIN)
    return math.ceil(card.total * UNKNOWN_PEAK)


def fitting_workers(costs: Sequence[int], usable: int, most: int) -> int:
    """The most workers (at least 1, at most ``most``) that can all run a case at once: the
    smallest cases' peaks and every worker's context within ``usable``."""
    workers, taken = 0, 0
    for cost in sorted(costs)[:most]:
        if taken + cost + (workers + 1) * CONTEXT_BYTES > usable:
            break
        workers, taken = workers + 1, taken + cost
    return max(1, workers)


def plan_run(
    cases: Sequence[Case],
    env: Environment,
    card: Card,
    *,
    jobs: int | None,
    cpu_default: int,
    recorded: dict[str, int],
) -> Plan:
    """The plan of a CUDA run of ``cases`` on ``card``: ``jobs`` workers when given (with a
    warning when the largest cases would not fit that many at once), else
    ``fitting_workers`` up to ``cpu_default``; never more than the cases."""
    kept = kept_runs(env.declared)
    estimates = tuple(case_estimate(case, env.model_size, kept) for case in cases)
    found = [recorded.get(case.name) for case in cases]
    costs = tuple(budgeted(e, r, card) for e, r in zip(estimates, found, strict=True))
    if jobs is None:
        workers = fitting_workers(costs, card.usable, min(cpu_default, len(cases)))
    else:
        workers = min(jobs, len(cases))
    limit = max(0, card.usable - workers * CONTEXT_BYTES)
    warning = None if jobs is None else _jobs_warning(jobs, workers, costs, card, limit)
    return Plan(
        workers=workers,
        card=card,
        limit=limit,
        costs=costs,
        estimates=estimates,
        recorded=sum(r is not None for r in found),
        warning=warning,
    )


def cuda_plan(cases: Sequence[Case], env: Environment, jobs: int | None) -> tuple[Plan, PeakStore]:
    """The plan of a CUDA run (``plan_run`` on the card ``probe_card`` reads, with the peaks
    recorded for its fingerprint) and the store the run's peaks go to."""
    from harness.run.settings import default_jobs

    card = probe_card(env.device)
    store = PeakStore(card.fingerprint)
    plan = plan_run(
        cases,
        env,
        card,
        jobs=jobs,
        cpu_default=default_jobs(env.device),
        recorded=store.of(env.model_size),
    )
    return plan, store


def _jobs_warning(
    jobs: int, workers: int, costs: Sequence[int], card: Card, limit: int
) -> str | None:
    """The line for an explicit ``--jobs`` whose workers would not fit with every one running
    one of the largest cases; None when they would."""
    largest = sorted(costs, reverse=True)[:workers]
    need = sum(largest) + workers * CONTEXT_BYTES
    if need <= card.usable:
        return None
    at_once = max(1, limit // max(costs))
    return (
        f"offload-harness: warning: --jobs {jobs}: {workers} workers running the largest cases "
        f"need {_gib(need)}, the card has {_gib(card.usable)} for them "
        f"({_gib(card.free)} free, {HEADROOM:.0%} headroom); the memory budget starts a case "
        f"only when it fits (about {at_once} of the largest at once)"
    )


def static_workers(costs: Sequence[int], card: Card, most: int) -> int:
    """Workers that never run out of memory without a gate (pytest-xdist): as many as fit
    with every one at the largest peak, at least 1, at most ``most``."""
    if not costs:
        return max(1, most)
    each = max(costs) + CONTEXT_BYTES
    return max(1, min(most, card.usable // each))


# --- the gate ---------------------------------------------------------------------------

T = TypeVar("T")


@dataclass
class MemoryGate:
    """The running cases' budgeted peaks against ``limit``. A case is admitted when its peak
    and theirs fit, or when nothing runs (a case larger than the budget runs alone)."""

    limit: int
    used: int = 0
    running: int = 0

    def admits(self, cost: int) -> bool:
        return self.running == 0 or self.used + cost <= self.limit

    def take(self, cost: int) -> None:
        self.used += cost
        self.running += 1

    def give(self, cost: int) -> None:
        self.used -= cost
        self.running -= 1

    def pick(self, queue: list[T], cost: Callable[[T], int], slots: int) -> list[T]:
        """Take from ``queue``, in its order, every item that fits now (first fit: a small one
        may pass a large one waiting), at most ``slots``; each is taken from the budget."""
        chosen: list[T] = []
        for item in list(queue):
            if len(chosen) >= slots:
                break
            if self.admits(cost(item)):
                self.take(cost(item))
                queue.remove(item)
                chosen.append(item)
        return chosen


def _gib(nbytes: int, *, unit: bool = True) -> str:
    return f"{nbytes / GiB:.1f}" + (" GiB" if unit else "")
