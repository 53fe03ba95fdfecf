"""The GPU memory budget of a CUDA run (``harness.run.budget``), on simulated cards: the
estimate of a case's peak, the workers and the budget on an 80 GB H100, a 141 GB H200 and a
16 GB card (``torch.cuda.mem_get_info`` and the device name stubbed), the gate that starts a
case only when it fits, the run's first line, the ``--jobs`` warning, ``-n auto``'s count,
the recorded peaks and the replay of the 2026-12-06 H100 run
(``tests/fixtures/gpu/h100-peaks.json``). No GPU: every card here is a stub."""

from __future__ import annotations

import heapq
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from harness.cases import MCORE_FAMILY, Case, default_matrix, full_matrix, matrix
from harness.execute.environment import Environment
from harness.models.hybrid import HybridModel, loss_fn, seeded_model
from harness.models.train import DTYPES
from harness.offload.passthrough import NoOffload
from harness.run import budget, peaks
from harness.vocab.fits import case_peak_bytes
from harness.vocab.spec import PRESETS, ModelSpec, RunSpec

GiB = 1 << 30
CUDA = torch.device("cuda", 0)
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "gpu" / "h100-peaks.json"

# The cards: the H100 of the 2026-12-06 run (torch's "total capacity of 79.18 GiB"), an H200
# (143771 MiB) and a 16 GB card (16160 MiB); each with one probe context (0.5 GiB) in use.
H100_TOTAL = int(79.18 * GiB)
H200_TOTAL = 143771 << 20
SMALL_TOTAL = 16160 << 20


def _card(total: int, name: str) -> budget.Card:
    return budget.Card(free=total - GiB // 2, total=total, name=name, fingerprint="cuda-test")


H100 = _card(H100_TOTAL, "NVIDIA H100 80GB HBM3")
H200 = _card(H200_TOTAL, "NVIDIA H200")
SMALL = _card(SMALL_TOTAL, "Tesla V100-PCIE-16GB")


def test_the_peak_arithmetic() -> None:
    model = ModelSpec(pattern="+-")  # seq_length 32, micro_batch_size 2
    fp32 = RunSpec(steps=6, microbatches=2)
    data = 6 * 2 * 2 * 33 * 8 + 6 * 2 * 4  # the token batches (int64) and the fp32 losses
    common = dict(parameters=1000, pass_activations=400, passes_in_flight=2, model=model)
    # kept: 2 runs x 6 steps x 1000 x 4 B; state 16 B each; 2 passes of 400 B; a quarter pass
    assert case_peak_bytes(**common, run=fp32, kept_runs=2) == 48000 + 16000 + 800 + 100 + data
    bf16 = fp32.replace(precision="bf16")  # 2-byte gradients kept, 20 B of state each
    assert case_peak_bytes(**common, run=bf16, kept_runs=2) == 24000 + 20000 + 800 + 100 + data
    # ZeRO-3 in bf16: fp32 gradients kept (2 runs x 6 steps x 1000 x 4 B), 16 B of fp32 state
    # each, FSDP2's buffers of its largest unit (300 parameters x 10 B: two bf16 gathered
    # copies, a bf16 gradient, its fp32 cast) and two earlier runs' fp32 weights (2 x 4000 B)
    zero3 = dict(run=bf16, kept_runs=2, sharding="zero3", largest_unit=300)
    assert case_peak_bytes(**common, **zero3) == (48000 + 16000 + 3000 + 8000 + 800 + 100 + data)


def test_the_largest_fsdp2_unit_is_a_layer_or_the_root() -> None:
    """``fully_shard`` wraps every layer, then the root with what is left: the embedding, the
    final norm and the head. Counted by hand for one MLP layer (``-``: norm D, fc1 2F x D,
    fc2 D x F) at D 64, F 128."""
    layer = 64 + 2 * 128 * 64 + 64 * 128
    assert budget.largest_shard_unit(ModelSpec(pattern="-", vocab_size=128)) == layer
    root = 2 * 1024 * 64 + 64  # embedding and head V x D, the final norm D
    assert budget.largest_shard_unit(ModelSpec(pattern="-", vocab_size=1024)) == root


def _saved_on_cpu(spec: ModelSpec, precision: str, chunks: int) -> tuple[int, int]:
    """(parameters, bytes saved by the largest chunk's real forward on the CPU, parameters
    excluded)."""
    model = seeded_model(spec, 1234).to(DTYPES[precision])
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    tokens = torch.randint(0, spec.vocab_size, (spec.micro_batch_size, spec.seq_length + 1))
    x, largest = tokens[:, :-1], 0
    for chunk in range(chunks):
        saved: dict[int, int] = {}

        def pack(tensor: torch.Tensor, saved: dict[int, int] = saved) -> torch.Tensor:
            storage = tensor.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = model.forward_chunk(x, NoOffload(), chunk, chunks)
            if chunk == chunks - 1:
                loss_fn(out, tokens[:, 1:])
        x = out.detach().requires_grad_(True)
        largest = max(largest, sum(n for at, n in saved.items() if at not in weights))
    return sum(p.numel() for p in model.parameters()), largest


@pytest.mark.parametrize("name", [name for name, p in PRESETS.items() if p.size == "tiny"])
@pytest.mark.parametrize(("precision", "chunks"), [("fp32", 1), ("bf16", 1), ("fp32", 2)])
def test_the_meta_forward_saves_what_a_real_forward_saves(
    name: str, precision: str, chunks: int
) -> None:
    spec = PRESETS[name].build()
    expected = _saved_on_cpu(spec, precision, chunks)
    assert expected[1] > 0
    assert budget.model_bytes(spec, precision, chunks) == expected


def test_passes_in_flight() -> None:
    assert budget.passes_in_flight("sequential", 4) == 1  # F0 B0 F1 B1 ...
    assert budget.passes_in_flight("gpipe", 4) == 4  # every forward, then every backward
    assert budget.passes_in_flight("1f1b", 4) == 2  # F0 F1 B0 F2 B1 F3 B2 B3


def test_read_card_reads_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (H100.free, H100.total))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: H100.name)
    monkeypatch.setattr(
        "harness.measure.fingerprint.of", lambda device: SimpleNamespace(id="cuda-h100-x")
    )
    card = budget.read_card(CUDA)
    assert card == budget.Card(
        free=H100.free, total=H100.total, name=H100.name, fingerprint="cuda-h100-x"
    )
    assert card.usable == H100.free - int(0.05 * H100.total)


LARGE, SMALL_CASE = 8 * GiB, int(3.5 * GiB)
"""The estimates the synthetic plans give: 12 large cases, 12 small ones."""


@pytest.fixture
def synthetic(monkeypatch: pytest.MonkeyPatch) -> list[Case]:
    """24 rows of the full matrix, the first 12 estimated at 8 GiB, the others at 3.5 GiB."""
    cases = matrix("full")[:24]
    sizes = {case.name: LARGE if i < 12 else SMALL_CASE for i, case in enumerate(cases)}
    monkeypatch.setattr(budget, "case_estimate", lambda case, size, kept: sizes[case.name])
    return cases


def _plan(cases: list[Case], card: budget.Card, **kw: Any) -> budget.Plan:
    env = Environment(device=CUDA, backend="reference", model_size="small")
    kw.setdefault("jobs", None)
    kw.setdefault("recorded", {})
    return budget.plan_run(cases, env, card, cpu_default=12, **kw)


def _at_once(plan: budget.Plan, cost: int) -> int:
    """How many cases of ``cost`` the gate lets run together."""
    gate = budget.MemoryGate(plan.limit)
    return len(gate.pick([cost] * 24, lambda c: c, plan.workers))


@pytest.mark.parametrize(
    ("card", "workers", "large_at_once"),
    [
        # usable 78.68 - 3.96 = 74.72 GiB: 12 small (4.2 GiB budgeted + 1 GiB context) take
        # 62.4; the limit is 74.72 - 12 = 62.72 GiB, 6 large (9.6 GiB budgeted) at once
        (H100, 12, 6),
        # usable 139.90 - 7.02 = 132.88 GiB; limit 120.88: all 12 large at once (115.2)
        (H200, 12, 12),
        # usable 15.28 - 0.79 = 14.49 GiB: 2 small take 10.4, 3 take 15.6; limit 12.49: one
        # large at a time
        (SMALL, 2, 1),
    ],
)
def test_the_workers_and_the_budget_follow_the_card(
    synthetic: list[Case], card: budget.Card, workers: int, large_at_once: int
) -> None:
    plan = _plan(synthetic, card)
    assert plan.workers == workers
    assert plan.limit == card.free - int(0.05 * card.total) - workers * GiB
    assert plan.costs == tuple([math.ceil(LARGE * 1.2)] * 12 + [math.ceil(SMALL_CASE * 1.2)] * 12)
    assert _at_once(plan, plan.costs[0]) == large_at_once
    assert _at_once(plan, plan.costs[-1]) == workers  # the small ones fill every worker
    assert plan.warning is None


def test_the_first_line_says_the_decision(
    synthetic: list[Case], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from harness.cli import _Progress, _ReportWriter

    monkeypatch.setattr("harness.run.settings.usable_cores", lambda: 16)
    plan = _plan(synthetic, H100)
    env = Environment(device=CUDA, backend="reference", model_size="small")
    _Progress(synthetic, env, _ReportWriter(None), {}, plan).on_start(plan.workers)
    assert capsys.readouterr().out == (
        "running 24 case(s) on cuda:0 (small models): 12 worker(s) x 1 thread(s), memory "
        "budget 62.7 GiB (free 78.7 GiB of 79.2 GiB, 12 x 1.0 GiB worker contexts, case "
        "peaks 4.2-9.6 GiB, 0 of 24 recorded)\n"
    )


def test_one_case_says_its_one_peak(synthetic: list[Case]) -> None:
    plan = _plan(synthetic[:1], H100)
    # one worker: usable 74.72 GiB less one context
    assert plan.describe() == (
        "memory budget 73.7 GiB (free 78.7 GiB of 79.2 GiB, 1 x 1.0 GiB worker contexts, "
        "case peak 9.6 GiB, 0 of 1 recorded)"
    )


def test_an_explicit_jobs_wins_and_warns_when_it_cannot_fit(synthetic: list[Case]) -> None:
    plan = _plan(synthetic, H100, jobs=16)
    assert plan.workers == 16  # as asked (there are 24 cases)
    # 12 large at 9.6 GiB, 4 small at 4.2, 16 contexts: 148 GiB against 74.7; the limit is
    # 74.72 - 16 = 58.72 GiB: 6 large at once
    assert plan.warning == (
        "offload-harness: warning: --jobs 16: 16 workers running the largest cases need "
        "148.0 GiB, the card has 74.7 GiB for them (78.7 GiB free, 5% headroom); the memory "
        "budget starts a case only when it fits (about 6 of the largest at once)"
    )
    assert _plan(synthetic, H200, jobs=4).warning is None  # 4 x 10.6 GiB fit


def test_a_recorded_peak_replaces_the_estimate(synthetic: list[Case]) -> None:
    recorded = {synthetic[0].name: 5 * GiB}
    plan = _plan(synthetic, H100, recorded=recorded)
    assert plan.costs[0] == math.ceil(5 * GiB * 1.1)  # the recorded peak, 10 % more
    assert plan.estimates[0] == LARGE and plan.recorded == 1


def test_a_model_the_meta_device_cannot_run_takes_a_quarter_of_the_card(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(budget, "case_estimate", lambda case, size, kept: None)
    plan = _plan(matrix("default")[:3], H100)
    assert plan.costs == (math.ceil(H100_TOTAL * 0.25),) * 3


def test_the_gate_starts_what_fits_and_a_too_large_case_alone() -> None:
    gate = budget.MemoryGate(limit=10)
    queue = [("a", 6), ("b", 5), ("c", 4), ("d", 3)]

    def cost(item: tuple[str, int]) -> int:
        return item[1]

    assert gate.pick(queue, cost, slots=4) == [("a", 6), ("c", 4)]  # b (11) and d (13) wait
    gate.give(6)  # a ends: 4 of 10 used
    assert gate.pick(queue, cost, slots=4) == [("b", 5)]  # 9; d would make 12
    assert gate.pick(queue, cost, slots=0) == []  # no free worker
    gate.give(4)
    gate.give(5)
    huge = [("h", 25)]
    assert gate.pick(huge, cost, slots=2) == [("h", 25)]  # nothing runs: it runs alone
    assert gate.pick([("e", 1)], cost, slots=2) == []  # and nothing joins it


@pytest.mark.parametrize(("card", "expected"), [(H100, 7), (H200, 12), (SMALL, 1)])
def test_n_auto_on_cuda_starts_as_many_as_fit_at_the_largest_peak(
    card: budget.Card, expected: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from harness.plugin import workers
    from harness.run import settings

    class _Config:
        def getoption(self, name: str, default: object = None) -> object:
            return "cuda" if name == "device" else default

    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    monkeypatch.setattr(settings, "usable_cores", lambda: 16)
    monkeypatch.setattr(settings, "resolve_device", lambda text: CUDA)
    monkeypatch.setattr(budget, "probe_card", lambda device: card)
    monkeypatch.setattr(budget, "case_estimate", lambda case, size, kept: LARGE)
    # every worker at 9.6 GiB budgeted + 1 GiB context: 74.72 // 10.6 = 7 on the H100,
    # 132.88 // 10.6 = 12 (the CPU default's cap) on the H200, 14.49 // 10.6 = 1 on 16 GB
    assert workers.pytest_xdist_auto_num_workers(_Config()) == expected  # type: ignore[arg-type]


# --- the recorded peaks -------------------------------------------------------------------


def _record(name: str, peak: int | None, problems: list[str] | None = None) -> dict[str, Any]:
    record: dict[str, Any] = {"name": name, "verdict": "pass", "problems": problems or []}
    if peak is not None:
        record["device_memory"] = {"peak_reserved": peak}
    return record


def test_the_store_keeps_the_latest_peaks_per_fingerprint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    store = peaks.PeakStore("cuda-h100-x")
    assert store.of("small") == {}
    oom = ["equivalence: the case's runs raised OutOfMemoryError: CUDA out of memory."]
    taken = store.update("small", [_record("a", 5), _record("b", None), _record("c", 9, oom)])
    assert taken == 1  # no reading, and a case out of memory, record nothing
    assert store.save()
    assert store.path == tmp_path / "offload-harness" / "gpu-peaks" / "cuda-h100-x.json"
    again = peaks.PeakStore("cuda-h100-x")
    assert again.of("small") == {"a": 5}
    again.update("small", [_record("a", 7)])
    assert again.of("small") == {"a": 7}  # the latest reading replaces the one before
    assert peaks.PeakStore("cuda-h200-y").of("small") == {}  # another fingerprint's
    store.path.write_text("{not json")
    assert peaks.PeakStore("cuda-h100-x").of("small") == {}  # a broken cache: estimates


def test_record_writes_the_fixture_from_summaries(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    oom = (
        "memory: the case's runs raised OutOfMemoryError: CUDA out of memory. Tried to allocate "
        "128.00 MiB. GPU 0 has a total capacity of 79.18 GiB of which 70.75 MiB is free. Process "
        "805 has 5.46 GiB memory in use. Including non-PyTorch memory, this process has 4.18 GiB "
        "memory in use."
    )
    summary = {
        "device": "cuda:0",
        "model_size": "small",
        "machine": {"gpus": ["NVIDIA H100 80GB HBM3"]},
        "created_utc": "2026-12-06T04:51:53+00:00",
        "cases": [
            {"name": "a", "problems": [], "device_memory": {"peak_reserved": 3, "estimate": 4}},
            {"name": "b", "problems": [oom], "memory": {"baseline_peak": 2}, "duration": 1.5},
        ],
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    out = tmp_path / "fixture.json"
    assert peaks.main(["--record", str(out), str(tmp_path / "summary.json")]) == 0
    written = json.loads(out.read_text())
    assert written["card_total"] == int(79.18 * GiB)
    assert written["workers_at_oom"] == [[int(5.46 * GiB), int(4.18 * GiB)]]
    assert written["cases"]["a"]["peak_reserved"] == 3 and written["cases"]["a"]["estimate"] == 4
    assert written["cases"]["b"]["memory_baseline_peak"] == 2
    assert written["cases"]["b"]["out_of_memory"] and not written["cases"]["a"]["out_of_memory"]
    assert written["note"].startswith("recorded by python -m harness.run.peaks from a NVIDIA H100")
    summary["device"] = "cpu"
    (tmp_path / "cpu.json").write_text(json.dumps(summary))
    assert peaks.main(["--record", str(out), str(tmp_path / "cpu.json")]) == 2
    assert peaks.main(["--record", str(out), str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


# --- the replay of the H100 run -----------------------------------------------------------

CONTEXT_SEEN = 0.74 * GiB
"""The non-PyTorch memory of each worker in that run's out-of-memory reports."""


def _rows_by_name() -> dict[str, Case]:
    """The rows ``find_case`` looks through (the default matrix, the full one, megatron-core's
    family), by name, the first of each name as ``find_case`` takes it: the matrices built once
    for all the fixture's cases, not once per case (about 5 s of the CPU machine per replay)."""
    rows: dict[str, Case] = {}
    for row in [*default_matrix(), *full_matrix(), *MCORE_FAMILY]:
        rows.setdefault(row.name, row)
    return rows


def _replay() -> tuple[dict[str, Any], list[Case], budget.Plan]:
    data = json.loads(FIXTURE.read_text())
    rows = _rows_by_name()
    cases = [rows[name] for name in data["cases"]]
    card = budget.Card(
        free=data["card_total"] - GiB // 2, total=data["card_total"], name="H100", fingerprint="x"
    )
    env = Environment(device=CUDA, backend=data["backend"], model_size=data["model_size"])
    plan = budget.plan_run(cases, env, card, jobs=None, cpu_default=12, recorded={})
    return data, cases, plan


def _held(entry: dict[str, Any], case: Case) -> int:
    """What the worker of ``entry`` held at least: its recorded peak and context, else the
    memory check's peak (above what the run found allocated) plus what was found allocated
    for certain - the shared plain baseline's kept per-step gradients (parameters counted on
    the meta device) - and the context seen."""
    if entry["peak_reserved"] is not None:
        return int(entry["peak_reserved"] + budget.CONTEXT_BYTES)
    run = case.run_spec()
    model = HybridModel(case.model_spec("small")).to("meta")
    parameters = sum(p.numel() for p in model.parameters())
    kept = run.steps * parameters * (4 if run.precision == "fp32" else 2)
    return int(entry["memory_baseline_peak"] + kept + CONTEXT_SEEN)


def _held_by_index(data: dict[str, Any], cases: list[Case]) -> dict[int, int]:
    """``_held`` of each case; a case without a reading (it ran out of memory, or moved
    nothing to measure) takes the largest of the rows training the same model the same
    way."""

    def like(case: Case) -> tuple[Any, ...]:
        return (
            case.family,
            case.schedule,
            case.precision,
            case.steps,
            case.microbatches,
            case.sharding,
        )

    measured = {
        i: _held(data["cases"][c.name], c)
        for i, c in enumerate(cases)
        if data["cases"][c.name]["memory_baseline_peak"] is not None
    }
    siblings: dict[tuple[Any, ...], int] = {}
    for i, n in measured.items():
        siblings[like(cases[i])] = max(n, siblings.get(like(cases[i]), 0))
    return {i: measured.get(i, siblings[like(c)]) for i, c in enumerate(cases)}


def test_replay_every_worker_of_the_h100_run_fits_its_budget() -> None:
    data, cases, plan = _replay()
    readings = [(c, data["cases"][c.name]) for c in cases]
    measured = [(c, e) for c, e in readings if e["memory_baseline_peak"] is not None]
    assert len(measured) >= 80  # the fixture holds the run's readings
    for index, (case, entry) in enumerate(readings):
        estimate = plan.estimates[index]
        assert estimate is not None, case.name
        if entry["peak_reserved"] is not None:  # a worker's reading: within its budget
            assert entry["peak_reserved"] <= plan.costs[index], case.name
        elif entry["memory_baseline_peak"] is not None:  # allocated, for certain: within the
            assert _held(entry, case) <= estimate + budget.CONTEXT_BYTES, case.name  # estimate
    # the largest worker any out-of-memory report listed (9.93 GiB in the 2026-12-06 run; a
    # refreshed fixture of a run without one lists none) fits the largest budgeted worker
    for workers in data["workers_at_oom"]:
        assert max(workers) <= max(plan.costs) + budget.CONTEXT_BYTES


def test_replay_the_budget_keeps_the_h100_run_under_the_card() -> None:
    """The run's cases through the gate, each for the seconds it took: at every start the
    running cases' budgeted peaks stay within the limit, what they held (``_held``) plus
    every worker's context within the card; the 12 workers the run started, every one at
    its largest budgeted case, would not have fit."""
    data, cases, plan = _replay()
    total = data["card_total"]
    costs = dict(enumerate(plan.costs))
    held = _held_by_index(data, cases)
    seconds = {i: data["cases"][c.name]["seconds"] or 10.0 for i, c in enumerate(cases)}
    queue, gate, clock, ends = (
        sorted(costs, key=lambda i: -costs[i]),
        budget.MemoryGate(plan.limit),
        0.0,
        [],
    )
    most = 0
    while queue or ends:
        for i in gate.pick(queue, costs.__getitem__, plan.workers - len(ends)):
            heapq.heappush(ends, (clock + seconds[i], i))
        running = [i for _, i in ends]
        assert sum(costs[i] for i in running) <= plan.limit or len(running) == 1
        # what the budget reserves for them and every worker's context: within the card
        assert sum(costs[i] for i in running) + plan.workers * budget.CONTEXT_BYTES <= total
        idle = plan.workers - len(running)
        assert sum(held[i] for i in running) + idle * CONTEXT_SEEN <= total
        most = max(most, len(running))
        clock, done = heapq.heappop(ends)
        gate.give(costs[done])
    assert plan.workers == 12 and most <= 12
    assert 12 * (max(plan.costs) + budget.CONTEXT_BYTES) > total  # the old 12, all large


def test_a_cuda_run_plans_with_the_peaks_recorded_for_its_card(
    synthetic: list[Case],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from harness import cli
    from harness.run import settings

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(settings, "usable_cores", lambda: 16)
    card = budget.Card(free=H100.free, total=H100.total, name="H100", fingerprint="cuda-h100-x")
    monkeypatch.setattr(budget, "probe_card", lambda device: card)
    store = peaks.PeakStore("cuda-h100-x")
    store.update("small", [_record(synthetic[0].name, 2 * GiB)])
    assert store.save()
    env = Environment(device=CUDA, backend="reference", model_size="small")
    plan, kept = cli._memory_plan(synthetic, env, 16)
    assert plan is not None and kept is not None and kept.path == store.path
    assert plan.recorded == 1 and plan.costs[0] == math.ceil(2 * GiB * 1.1)
    assert plan.workers == 16  # --jobs 16, and its warning on stderr
    assert capsys.readouterr().err.startswith("offload-harness: warning: --jobs 16: ")
    cpu = Environment(device=torch.device("cpu"), backend="reference")
    assert cli._memory_plan(synthetic, cpu, None) == (None, None)
