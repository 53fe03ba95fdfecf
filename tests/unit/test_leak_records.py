"""The leak check's rules on hand-built records (``harness.verify.checks``): the harness's own pack
and
unpack counts and held host memory, and the offloader's log as a cross-check whose pool must stop
growing from the first steady step on (a pool that grows between the warmup and step 1 fails)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from harness.cases import SEED_CASE
from harness.offload.protocol import IterationLog
from harness.verify.checks import held_problems, leak_evidence, log_leak_problems, unpacked_problems

CASE = SEED_CASE.replace(steps=4)
KEY = (0, 2, "core_attn")


def _logs(allocated: list[int]) -> list[IterationLog]:
    return [
        IterationLog(iteration=i, warmup=i == 0, groups=(), pool_allocated=n)
        for i, n in enumerate(allocated)
    ]


def _run(**fields: object) -> SimpleNamespace:
    defaults = dict(
        packed=({KEY: 3},) * 4,
        unpacked=({KEY: 3},) * 4,
        held=((),) * 4,
        offload=SimpleNamespace(logs=[], losses=torch.zeros(4, 2)),
    )
    return SimpleNamespace(**{**defaults, **fields})


def test_pool_growing_in_the_first_steady_step_fails() -> None:
    grown = _run(offload=SimpleNamespace(logs=_logs([3, 4, 4, 4]), losses=torch.zeros(4, 2)))
    assert log_leak_problems(CASE, grown) == [
        "pinned pool keeps allocating after the warmup (buffers allocated at the end of steps "
        "0..3): [3, 4, 4, 4]"
    ]
    steady = _run(offload=SimpleNamespace(logs=_logs([3, 3, 3, 3]), losses=torch.zeros(4, 2)))
    assert log_leak_problems(CASE, steady) == []


def test_a_tensor_packed_and_never_unpacked_is_named() -> None:
    left = _run(unpacked=({KEY: 3}, {KEY: 2}, {KEY: 3}, {KEY: 3}))
    assert unpacked_problems(CASE, left) == [
        "step 1: 1 of 3 saved tensors packed in the step's groups were never unpacked by its "
        "backward (harness pack/unpack records), in core_attn (microbatch 0, layer 2)"
    ]
    assert unpacked_problems(CASE, _run()) == []


def test_held_host_memory_may_shrink_never_grow_after_the_warmup() -> None:
    pool = (0, KEY, 4096)  # written in the warmup, held for good: a pool
    shrinking = _run(held=((pool, (0, KEY, 512)), (pool,), (pool,), (pool,)))
    assert held_problems(CASE, shrinking) == []
    # one more 512 B copy written in step 1 and still held: 4096 -> 4608
    grows = _run(held=((pool,), (pool, (1, KEY, 512)), (pool, (1, KEY, 512)), (pool,)))
    (problem,) = held_problems(CASE, grows)
    assert problem.startswith(
        "step 1: host memory written by the offload copies and still held at the step's end "
        "grew from 4096 B to 4608 B after the warmup (per step: [4096, 4608, 4608, 4096]); "
        "still alive: written in step 1: 512 B by core_attn (microbatch 0, layer 2)"
    ), problem


def test_blind_only_without_packs_held_memory_or_log() -> None:
    blind = _run(packed=({},) * 4, unpacked=({},) * 4)
    assert "no saved tensor packed in its group windows" in (leak_evidence(blind) or "")
    assert leak_evidence(_run()) is None
    assert leak_evidence(_run(packed=())) == "the offload run observed no step"
