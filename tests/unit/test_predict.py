"""The prediction (``harness.execute.predict``) pinned by hand: every rule on hand-built
observations, each
expected value a literal derived in the comment beside it, never by the code under test.

Rules covered: the copy size (contiguous, a covering view's whole storage, a gather, a storage
that is no whole number of elements), the skip rules (storage, object, none; off the device;
empty; the size threshold), the warmup, margin, last-of-name, delta (``pp_rank > 0``, the
``kept:delta`` branch no default row reaches) and fraction (``< 1``, floor artefact included)
policies, and ``policies="every"``. ``max_inflight_offloads`` is not modelled: it changes when
a copy waits, never what moves (``OffloadConfig``), so no rule here reads it.
"""

from __future__ import annotations

import dataclasses

import torch

from harness.execute.predict import predict
from harness.offload.config import OffloadConfig
from harness.offload.recorder import GroupObservation, SavedInfo
from harness.offload.semantics import MEGATRON_MAIN, Semantics, copy_bytes, skip_reason

GATHER = Semantics(view_copy="gather")
A, B = "core_attn", "attn_proj"  # two selected names (any two the config knows)
SEQUENTIAL_2 = (("F", 0), ("B", 0), ("F", 1), ("B", 1))
ONE_F_ONE_B_2 = (("F", 0), ("F", 1), ("B", 0), ("B", 1))
ONE = (("F", 0), ("B", 0))

_ids = iter(range(1, 1_000_000))


def saved(
    shape: tuple[int, ...] = (16, 16),
    *,
    storage_nbytes: int | None = None,
    contiguous: bool = True,
    on_device: bool = True,
    parameter: bool = False,
    marked_itself: bool = False,
) -> SavedInfo:
    """An fp32 saved tensor (itemsize 4), its own storage unless told otherwise."""
    numel = 1
    for size in shape:
        numel *= size
    return SavedInfo(
        shape=shape,
        stride=(1,) * len(shape),
        storage_offset=0,
        dtype=torch.float32,
        itemsize=4,
        storage_nbytes=numel * 4 if storage_nbytes is None else storage_nbytes,
        storage_id=next(_ids),
        contiguous=contiguous,
        on_device=on_device,
        parameter=parameter,
        marked_itself=marked_itself,
    )


def group(mb: int, layer: int, name: str, *tensors: SavedInfo) -> GroupObservation:
    return GroupObservation(
        microbatch=mb, layer=layer, name=name, saved=tensors or (saved(),), released=()
    )


def config(**fields: object) -> OffloadConfig:
    return OffloadConfig(**{"offload_modules": (A, B), "min_offloaded_tensor_size": 0, **fields})


def decisions(expected: dict) -> dict:
    return {key: e.decision for key, e in expected.items()}


# ------------------------------------------------------------------------------ copy sizes


def test_copy_bytes_by_hand() -> None:
    assert copy_bytes(saved((8, 16))) == 512  # contiguous: 8 * 16 elements * 4 B
    # a view of 60 of a 100-element storage (400 B): 2 * 240 >= 400, coverage copies it whole
    view60 = saved((6, 10), storage_nbytes=400, contiguous=False)
    assert copy_bytes(view60) == 400
    assert copy_bytes(view60, GATHER) == 240  # gather: its own 60 * 4 B
    # exactly half (50 of 100 elements, 200 B): 2 * 200 >= 400 still covers
    assert copy_bytes(saved((5, 10), storage_nbytes=400, contiguous=False)) == 400
    # 40 of 100 elements: 2 * 160 < 400, gathered alone: 160 B
    assert copy_bytes(saved((4, 10), storage_nbytes=400, contiguous=False)) == 160
    # 402 B is no whole number of 4-byte elements: never copied whole, 240 B
    assert copy_bytes(saved((6, 10), storage_nbytes=402, contiguous=False)) == 240


# ------------------------------------------------------------------------------ skip rules


def test_skip_rules_by_semantics() -> None:
    cfg = config()
    view_of_param = saved(parameter=True)  # shares a parameter's storage, not one itself
    param = saved(parameter=True, marked_itself=True)
    storage, obj, none = MEGATRON_MAIN, Semantics(skip="object"), Semantics(skip="none")
    shares = "shares its storage with a parameter or a marked tensor"
    assert skip_reason(view_of_param, cfg, storage) == shares
    assert skip_reason(param, cfg, storage) == shares
    assert skip_reason(view_of_param, cfg, obj) is None  # only the object itself stays
    assert skip_reason(param, cfg, obj) == "is a parameter or a marked tensor itself"
    assert skip_reason(param, cfg, none) is None  # everything on the device moves
    for semantics in (storage, obj, none):
        off = saved(on_device=False)
        assert skip_reason(off, cfg, semantics) == "not on the model's device"
        assert skip_reason(saved((0, 4)), cfg, semantics) == "is empty"


def test_size_threshold() -> None:
    cfg = config(min_offloaded_tensor_size=100)
    reason = "99 elements < min_offloaded_tensor_size 100"
    assert skip_reason(saved((9, 11)), cfg) == reason  # 9 * 11 = 99 elements
    assert skip_reason(saved((10, 10)), cfg) is None  # 100: not below the threshold
    assert skip_reason(saved((9, 11)), cfg, Semantics(size_threshold=False)) is None


# ------------------------------------------------------------------------------ policies


def test_warmup_moves_every_selected_group_with_its_eligible_tensors() -> None:
    # a: a 16x16 (1024 B) tensor and an empty one; b: a 40%-view (160 B gathered alone)
    observations = [
        group(0, 0, A, saved(), saved((0,))),
        group(0, 0, B, saved((4, 10), storage_nbytes=400, contiguous=False)),
    ]
    warmup, _ = predict(observations, config(), ONE)
    a, b = warmup[(0, 0, A)], warmup[(0, 0, B)]
    assert (a.decision, a.copies, a.bytes) == ("offloaded", 1, 1024)
    assert a.why == (
        "offloaded: 1 of 2 saved tensors; 1 skipped: is empty (Megatron-Core main's rules)"
    )
    assert (b.decision, b.copies, b.bytes) == ("offloaded", 1, 160)


def _two_names_two_layers(mb: int = 0) -> list[GroupObservation]:
    return [group(mb, layer, name) for layer in (0, 1) for name in (A, B)]


def test_margin_keeps_the_first_backward_chunks_last_group_of_each_name() -> None:
    # One chunk [a0, b0, a1, b1]: 2 distinct names, so the margin keeps 2 groups: the last of
    # each name, a1 and b1. Delta budget 0, fraction 1.0 (int(2 * 0) = 0 kept), and a0/b0 are
    # not their chunk's last of a name: they move.
    _, steady = predict(_two_names_two_layers(), config(), ONE)
    assert decisions(steady) == {
        (0, 0, A): "offloaded",
        (0, 0, B): "offloaded",
        (0, 1, A): "kept:margin",
        (0, 1, B): "kept:margin",
    }
    assert steady[(0, 1, A)].copies == steady[(0, 1, A)].bytes == 0


def test_last_of_name_depends_on_the_schedule() -> None:
    # Two chunks of one name a, layers 0 and 1. Margin: 1 name, so 1 group - over the chunks
    # in reversed backward order (1, then 0) the last a seen is (0, 1, a). Sequential (F0 B0
    # F1 B1): when chunk 1 commits (1, 1, a), chunk 0's backward has started, so chunk 1 is
    # the next holder of a to run backward: kept:last_of_name. 1F1B (F0 F1 B0 B1): no backward
    # started before F1, chunk 0 runs backward first, so (1, 1, a) moves.
    observations = [group(mb, layer, A) for mb in (0, 1) for layer in (0, 1)]
    _, sequential = predict(observations, config(), SEQUENTIAL_2)
    assert decisions(sequential) == {
        (0, 0, A): "offloaded",
        (0, 1, A): "kept:margin",
        (1, 0, A): "offloaded",
        (1, 1, A): "kept:last_of_name",
    }
    _, one_f_one_b = predict(observations, config(), ONE_F_ONE_B_2)
    assert decisions(one_f_one_b) == {
        (0, 0, A): "offloaded",
        (0, 1, A): "kept:margin",
        (1, 0, A): "offloaded",
        (1, 1, A): "offloaded",
    }


def test_delta_keeps_the_earliest_groups_within_pp_rank_times_delta() -> None:
    # pp_rank 1 x 1000 B: a0 (1024 B) is taken while the budget is still positive (1000 > 0,
    # leaving -24), b0 is not; a1/b1 were kept by the margin first.
    cfg = config(pp_rank=1, delta_offload_bytes_across_pp_ranks=1000)
    _, steady = predict(_two_names_two_layers(), cfg, ONE)
    assert decisions(steady) == {
        (0, 0, A): "kept:delta",
        (0, 0, B): "offloaded",
        (0, 1, A): "kept:margin",
        (0, 1, B): "kept:margin",
    }
    assert "Megatron's delta rule" in steady[(0, 0, A)].why
    # pp_rank 0: no budget whatever the delta
    _, rank0 = predict(
        _two_names_two_layers(), config(delta_offload_bytes_across_pp_ranks=1000), ONE
    )
    assert decisions(rank0)[(0, 0, A)] == "offloaded"


def test_fraction_keeps_the_trailing_groups_with_python_float_floor() -> None:
    # Layers 0..2 of a and b: margin keeps a2, b2; 4 candidates a0 b0 a1 b1 remain.
    observations = [group(0, layer, name) for layer in (0, 1, 2) for name in (A, B)]
    # f = 0.5: int(4 * 0.5) = 2 trailing candidates stay: a1, b1
    _, half = predict(observations, config(activation_offload_fraction=0.5), ONE)
    assert [k for k, d in decisions(half).items() if d == "kept:fraction"] == [
        (0, 1, A),
        (0, 1, B),
    ]
    # f = 0.8: 1 - 0.8 is 0.19999999999999996 in floats, 4 * that = 0.7999999999999998,
    # int() = 0: none stay (Megatron's floor artefact, restated, not fixed)
    _, most = predict(observations, config(activation_offload_fraction=0.8), ONE)
    assert "kept:fraction" not in decisions(most).values()
    # a group that moves no bytes is no candidate: with a0 empty, f = 0.5 keeps int(3 * 0.5) = 1
    emptied = [group(0, 0, A, saved((0,))), *observations[1:]]
    _, fewer = predict(emptied, config(activation_offload_fraction=0.5), ONE)
    assert [k for k, d in decisions(fewer).items() if d == "kept:fraction"] == [(0, 1, B)]


def test_every_policy_moves_every_selected_group_in_every_iteration() -> None:
    every = dataclasses.replace(MEGATRON_MAIN, policies="every")
    warmup, steady = predict(_two_names_two_layers(), config(), ONE, every)
    assert steady == warmup
    assert set(decisions(steady).values()) == {"offloaded"}


def test_view_copy_rule_reaches_the_group_bytes() -> None:
    # one 60%-view of a 400 B storage and one contiguous 1024 B tensor
    tensors = (saved((6, 10), storage_nbytes=400, contiguous=False), saved())
    warmup, _ = predict([group(0, 0, A, *tensors)], config(), ONE)
    assert warmup[(0, 0, A)].bytes == 400 + 1024  # coverage: the view's whole storage
    gathered, _ = predict([group(0, 0, A, *tensors)], config(), ONE, GATHER)
    assert gathered[(0, 0, A)].bytes == 240 + 1024  # gather: 60 * 4 B
