"""``harness.measure.transfers``: the profiler-based copy counter agrees with the reference
offloader's own accounting and with bytes derived from the saved tensors' shapes. Its readers
(in memory against the chrome trace, synthetic traces) are in ``test_transfer_traces.py``; a
training run counted in ``tests/e2e/test_transfers_runs.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function
from transfer_traces import NEEDS_IN_MEMORY_ACTIVITIES
from transfer_traces import cuda_check_memory_matches_trace as _cuda_check_memory_matches_trace

from harness.measure.transfers import (
    Counts,
    TraceFormatError,
    count_transfers,
    profile_transfers,
    transfer_profiler,
)
from harness.offload.config import OffloadConfig
from harness.offload.ranges import RangeKey, range_name
from harness.offload.reference import OffloadContext

T, H = 8, 16  # tokens, hidden
WIDE, NARROW = 12, 4  # column slices: 12/16 >= 50% of storage (whole-storage path), 4/16 < 50%
MICROBATCHES, LAYERS = 2, 2
FIELDS = ("d2h_copies", "d2h_bytes", "h2d_copies", "h2d_bytes")


# ---------------------------------------------------------------------------------- scenario
class Scenario:
    """A two-group toy layer stack driven through the reference offloader."""

    def __init__(self, device: str, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(0)

        def param(*shape: int) -> torch.nn.Parameter:
            value = torch.randn(*shape, generator=gen) / shape[0] ** 0.5
            return torch.nn.Parameter(value.to(device=device, dtype=dtype))

        self.w_in, self.u, self.v = param(H, H), param(NARROW, H), param(T, T)
        self.w = [param(H, H) for _ in range(LAYERS)]
        self.w_p = [param(H, H) for _ in range(LAYERS)]
        self.w_o = [param(WIDE, H) for _ in range(LAYERS)]
        self.inputs = [
            torch.randn(T, H, generator=gen).to(device=device, dtype=dtype)
            for _ in range(MICROBATCHES)
        ]
        config = OffloadConfig(
            offload_modules=("core_attn", "attn_proj"), min_offloaded_tensor_size=0
        )
        self.off = OffloadContext(config, device)
        self.off.mark_not_offloadable(self.w_in, self.u, self.v, *self.w, *self.w_p, *self.w_o)

    def layer(self, mb: int, i: int, x: torch.Tensor) -> torch.Tensor:
        g = self.off.group("core_attn", x, layer=i)
        with g:
            y = torch.tanh(g.input @ self.w[i])  # saves g.input (mm) and y (tanh output)
            y = y + y[:, :NARROW] @ self.u  # saves a sparse view of y: gathered
        y = g.commit(y)
        g = self.off.group("attn_proj", y, layer=i)
        with g:
            h = g.input @ self.w_p[i]  # saves g.input
            o = h[:, :WIDE].t() @ self.v  # saves a dense transposed view of h: whole storage
            out = o.t() @ self.w_o[i]  # saves o.t(): a transposed view of all of o
        return g.commit(out)

    def iteration(self) -> None:
        for mb, inp in enumerate(self.inputs):
            self.off.begin_microbatch(mb)
            x = inp @ self.w_in
            for i in range(LAYERS):
                x = self.layer(mb, i, x)
            x.float().square().mean().backward()
        self.off.end_iteration()

    def records(self) -> dict[tuple[int, int, str], dict[str, int]]:
        """The offloader's own counts for the last iteration (groups that copied anything)."""
        groups = self.off.iteration_logs()[-1].groups
        rows = {g.key: {f: getattr(g, f) for f in FIELDS} for g in groups}
        return {key: row for key, row in rows.items() if any(row.values())}


def expected_from_shapes(itemsize: int) -> dict[tuple[int, int, str], dict[str, int]]:
    """Warmup iteration: every group offloaded; each saved tensor goes out and back once."""
    per_group = {
        # g.input, tanh output, y[:, :NARROW] gathered to contiguous
        "core_attn": [T * H, T * H, T * NARROW],
        # g.input, storage of h (under h[:, :WIDE].t()), storage of o (under o.t())
        "attn_proj": [T * H, T * H, WIDE * T],
    }
    out = {}
    for mb in range(MICROBATCHES):
        for layer in range(LAYERS):
            for name, numels in per_group.items():
                copies, nbytes = len(numels), sum(numels) * itemsize
                out[(mb, layer, name)] = dict(
                    zip(FIELDS, (copies, nbytes, copies, nbytes), strict=True)
                )
    return out


def _check_against_offloader(device: str, dtype: torch.dtype) -> None:
    scenario = Scenario(device, dtype)
    counts = profile_transfers(scenario.iteration, device)  # warmup: all groups offloaded
    assert counts.by_group() == scenario.records()
    assert counts.by_group() == expected_from_shapes(torch.empty((), dtype=dtype).element_size())
    counts = profile_transfers(scenario.iteration, device)  # steady state (policies may keep)
    assert counts.by_group() == scenario.records()
    assert counts.pageable == 0
    assert all(c == Counts() for c in counts.unattributed.values())


# ------------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_counts_match_offloader_and_shapes(dtype: torch.dtype) -> None:
    _check_against_offloader("cpu", dtype)


def test_cpu_aggregations() -> None:
    scenario = Scenario("cpu", torch.float32)
    counts = profile_transfers(scenario.iteration, "cpu")
    assert counts.mode == "cpu"
    expected = expected_from_shapes(4)
    d2h_bytes = sum(row["d2h_bytes"] for row in expected.values())
    assert counts.totals()["d2h"] == Counts(6 * MICROBATCHES * LAYERS, d2h_bytes)
    assert counts.totals()["h2d"] == counts.totals()["d2h"]
    core = counts.by_name()[("d2h", "core_attn")]
    assert core == Counts(
        3 * MICROBATCHES * LAYERS, MICROBATCHES * LAYERS * (2 * T * H + T * NARROW) * 4
    )
    key = RangeKey("h2d", "attn_proj", 1, 0)
    assert counts.by_range[key] == Counts(3, (2 * T * H + WIDE * T) * 4)


def test_copies_outside_our_ranges_are_not_attributed() -> None:
    src, dst = torch.ones(3, 5), torch.empty(3, 5)
    ours = range_name("d2h", "core_attn", 0, 1)

    def work() -> None:
        dst.copy_(src)  # no range at all
        with record_function("some_other_range"):
            dst.copy_(src)
        with record_function("offload_harness.d2h|core_attn|mb=x|layer=1"):  # does not parse
            dst.copy_(src)
        with record_function(ours):
            with record_function("inner_foreign_range"):
                dst[:2].copy_(src[:2])  # innermost *parsing* range is ours
            with record_function(range_name("h2d", "attn_proj", 2, 3)):
                dst[:1].copy_(src[:1])  # nested range of ours: the inner one wins
        dst.copy_(src)  # after our range closed

    counts = profile_transfers(work, "cpu")
    assert counts.by_range == {
        RangeKey("d2h", "core_attn", 0, 1): Counts(1, 2 * 5 * 4),
        RangeKey("h2d", "attn_proj", 2, 3): Counts(1, 1 * 5 * 4),
    }


def test_conversion_copy_counts_once_with_destination_bytes() -> None:
    dst, src = torch.empty(4, 6, dtype=torch.bfloat16), torch.ones(6, 4).t()

    def work() -> None:
        with record_function(range_name("d2h", "core_attn", 0, 0)):
            dst.copy_(src)  # dtype change + transposed source

    counts = profile_transfers(work, "cpu")
    assert counts.by_range == {RangeKey("d2h", "core_attn", 0, 0): Counts(1, 4 * 6 * 2)}


@pytest.mark.parametrize(
    "source", [pytest.param("memory", marks=NEEDS_IN_MEMORY_ACTIVITIES), "trace"]
)
def test_missing_shapes_raise_a_clear_error(source: str) -> None:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function(range_name("d2h", "core_attn", 0, 0)):
            torch.empty(3).copy_(torch.ones(3))
    with pytest.raises(TraceFormatError, match="record_shapes=True"):
        count_transfers(prof, mode="cpu", source=source)  # type: ignore[arg-type]


def test_transfer_profiler_records_shapes() -> None:
    with transfer_profiler("cpu") as prof:
        with record_function(range_name("h2d", "attn_proj", 3, 7)):
            torch.empty(2, 3, dtype=torch.float64).copy_(torch.ones(2, 3, dtype=torch.float64))
    counts = count_transfers(prof)
    assert counts.mode == "cpu"
    assert counts.by_range == {RangeKey("h2d", "attn_proj", 3, 7): Counts(1, 6 * 8)}


# -------------------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@NEEDS_IN_MEMORY_ACTIVITIES
def test_cuda_memory_counts_match_chrome_trace(tmp_path: Path) -> None:
    """Proof on the GPU box that device mode read in memory equals the chrome trace's counts:
    attributed pinned copies (forward thread and autograd's device thread), an attributed
    pageable copy, and unattributed copies both ways."""
    scenario = Scenario("cuda", torch.float32)
    host = torch.ones(1 << 12)

    def work() -> None:
        scenario.iteration()
        with record_function(range_name("h2d", "core_attn", 9, 9)):
            host.to("cuda")  # pageable HtoD inside our range
        host.to("cuda").cpu()  # outside our ranges: unattributed HtoD and DtoH

    counts = _cuda_check_memory_matches_trace(work, tmp_path)
    scenario.off.close()
    assert counts.by_range[RangeKey("h2d", "core_attn", 9, 9)] == Counts(1, 4 << 12)
    assert counts.pageable == 1
    assert counts.unattributed["h2d"].copies >= 1 and counts.unattributed["d2h"].copies >= 1
    expected = expected_from_shapes(4)
    assert {k: v for k, v in counts.by_group().items() if k != (9, 9, "core_attn")} == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_counts_match_offloader_and_shapes(dtype: torch.dtype) -> None:
    _check_against_offloader("cuda", dtype)
    scenario = Scenario("cuda", dtype)
    counts = profile_transfers(scenario.iteration, "cuda")
    assert counts.mode == "device"
    assert counts.pageable == 0
    assert counts.unattributed == {"d2h": Counts(), "h2d": Counts()}
    assert counts.by_group() == expected_from_shapes(torch.empty((), dtype=dtype).element_size())
    scenario.off.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_totals_without_ranges_match_the_ranged_count() -> None:
    """``transfer_profiler(ranges=False)`` (the plain and disabled runs' profiler): the same
    copies and bytes per direction as the full profiler, every one unattributed."""
    counted = []
    for ranges in (True, False):  # one fresh scenario each: both count its warmup iteration
        scenario = Scenario("cuda", torch.float32)
        with transfer_profiler("cuda", ranges=ranges) as prof:
            scenario.iteration()
        counted.append(count_transfers(prof, mode="device"))
        scenario.off.close()
    ranged, totals = counted
    assert ranged.totals()["d2h"].copies > 0 and not totals.by_range
    for direction in ("d2h", "h2d"):
        everything = ranged.totals()[direction] + ranged.unattributed[direction]
        assert totals.unattributed[direction] == everything


def test_cpu_transfer_profiler_without_ranges_still_sees_the_copies() -> None:
    """On a CPU device the counter reads CPU ops, so ``ranges=False`` keeps CPU activity."""
    scenario = Scenario("cpu", torch.float32)
    with transfer_profiler("cpu", ranges=False) as prof:
        scenario.iteration()
    scenario.off.close()
    assert count_transfers(prof).by_group() == expected_from_shapes(4)
