"""The host footprint (``harness.measure.footprint``): bytes held beside bytes in flight at each
group boundary, the ratio of their peaks, and the ``leaks`` rules built on it
(``harness.verify.checks.footprint_problems``): a declared bound, and no host memory new to a
pooled offloader's copies after the warmup."""

from __future__ import annotations

from types import SimpleNamespace

from harness.cases import SEED_CASE
from harness.measure.copyobserver import Boundary, Copy, Observed
from harness.measure.footprint import footprint
from harness.offload.protocol import Capabilities, IterationLog
from harness.verify.hostchecks import footprint_problems

A, B = (0, 0, "core_attn"), (0, 0, "attn_proj")
ROUTED = (0, 1, "expert_fc1")
CASE = SEED_CASE.replace(steps=4)


def _copy(direction: str, group: tuple, nbytes: int, seq: int) -> Copy:
    return Copy(direction, "copy_", nbytes, group, False, 0, None, seq)  # type: ignore[arg-type]


def test_in_flight_follows_the_copies_and_ends_with_the_backward() -> None:
    observed = Observed(
        copies=[
            _copy("d2h", A, 100, 0),
            _copy("d2h", B, 50, 2),
            _copy("h2d", B, 50, 5),
            _copy("h2d", A, 100, 7),
        ],
        marks=[(4, "start", B), (6, "end", B), (8, "end", A)],
        boundaries=[
            Boundary(1, "commit", A, 128),
            Boundary(3, "commit", B, 200),
            Boundary(4, "start", B, 200),
            Boundary(6, "end", B, 200),
            Boundary(8, "end", A, 200),
        ],
    )
    found = footprint(observed)
    assert [p.in_flight for p in found.points] == [100, 150, 150, 100, 0]
    assert (found.peak_held, found.peak_in_flight, found.ratio) == (200, 150, 1.3333)
    assert found.source == "copies"


def test_without_a_reload_copy_the_bytes_stay_in_flight_until_the_backward_ends() -> None:
    observed = Observed(  # a CPU device: the host copy itself is handed back at unpack
        copies=[_copy("d2h", A, 100, 0)],
        marks=[(2, "start", A), (3, "end", A)],
        boundaries=[
            Boundary(1, "commit", A, 100),
            Boundary(2, "start", A, 100),
            Boundary(3, "end", A, 0),
        ],
    )
    assert [p.in_flight for p in footprint(observed).points] == [100, 100, 0]


def test_the_allocator_reading_counts_where_it_is_the_larger() -> None:
    observed = Observed(  # an 81920 B copy in a caching-allocator block of 131072 B
        copies=[_copy("d2h", A, 81920, 0)],
        boundaries=[Boundary(1, "commit", A, 81920, allocated=131072)],
    )
    found = footprint(observed)
    assert (found.peak_held, found.ratio, found.source) == (131072, 1.6, "allocator")
    assert found.as_record()["peak_held_copies_bytes"] == 81920


def _res(new_host: tuple, logs: list[IterationLog] | None = None, final: object = None) -> object:
    return SimpleNamespace(
        new_host=new_host,
        host_allocs=(None,) * len(new_host),
        footprint=final,
        offload=SimpleNamespace(logs=logs or []),
    )


POOLED = Capabilities(host_pool=True)


def test_a_pool_writing_new_host_memory_after_the_warmup_fails_leaks() -> None:
    new = ((), (), ((A, 4096),), ())
    assert footprint_problems(CASE, _res(new), POOLED) == [
        "step 2: the offloader keeps a host pool, yet its D2H copies wrote 1 host buffers no "
        "earlier step had used (4096 B for core_attn (microbatch 0, layer 0)): host memory "
        "allocated after the warmup"
    ]
    # the same copies from a backend without a pool: reported nowhere
    assert footprint_problems(CASE, _res(new), Capabilities()) == []
    # a log reporting pool buffers makes it a pool
    logs = [IterationLog(iteration=i, warmup=i == 0, groups=(), pool_allocated=3) for i in range(4)]
    assert footprint_problems(CASE, _res(new, logs), Capabilities())


def test_routing_shaped_groups_and_an_exhausted_cap_are_exempt() -> None:
    assert footprint_problems(CASE, _res(((), ((ROUTED, 512),), (), ())), POOLED) == []
    logs = [
        IterationLog(iteration=i, warmup=i == 0, groups=(), pool_allocated=2, pool_exhausted=e)
        for i, e in enumerate([3, 6, 9, 12])
    ]
    assert footprint_problems(CASE, _res(((), ((A, 512),), (), ()), logs), POOLED) == []


def test_a_declared_bound_is_held_at_the_final_step() -> None:
    over = Observed(
        copies=[_copy("d2h", A, 100, 0)],
        boundaries=[Boundary(1, "commit", A, 160)],
    )
    res = _res(((),) * 3, final=footprint(over))
    [line] = footprint_problems(CASE, res, Capabilities(host_bound=1.05))
    assert line.startswith("step 2: the offloader held 160 B of host memory")
    assert "1.60x, above the 1.05x it declares" in line
    assert footprint_problems(CASE, res, Capabilities(host_bound=1.6)) == []
    # two steps: the first steady step may still hold the warmup's buffers; reported only
    two = _res(((),) * 2, final=footprint(over))
    assert footprint_problems(CASE, two, Capabilities(host_bound=1.05)) == []
