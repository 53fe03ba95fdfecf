"""Rules of the reference offloader within one group: skip rules, forced release, config and
backend validation, as Megatron-Core has them (docs/backends.md, "The reference offloader"). The
rules across iterations (chunk identity under interleaved schedules, warmup source,
enable/disable, structure checks and pop-once semantics) are in ``test_offload_iterations.py``.

Shape suffixes: B batch rows, D hidden width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from offload_rules_setup import BATCH, MIN_NUMEL, WIDTH, make_offloader

from harness.offload.backends import resolve_backend
from harness.offload.config import OffloadConfig
from harness.offload.passthrough import NoOffload
from harness.offload.protocol import GroupRecord, Offloader
from harness.offload.recorder import RecordingOffloader
from harness.offload.reference import OffloadContext
from harness.testing.autograd import SaveAndHandBack
from harness.testing.strategies import normal
from harness.vocab.spec import ModelSpec


def one_group(
    off: Offloader,
    saved: tuple[torch.Tensor, ...],
    *,
    release: tuple[torch.Tensor, ...] = (),
    after_commit: Callable[[], None] | None = None,
) -> list[torch.Tensor]:
    """One iteration of microbatch 0 with one ``core_attn`` group saving ``saved``; returns
    what backward unpacked."""
    x = torch.zeros(2, requires_grad=True)
    sink: list[torch.Tensor] = []
    off.begin_microbatch(0)
    group = off.group("core_attn", x, layer=0)
    with group:
        out = SaveAndHandBack.apply(group.input, sink, *saved)
    out = group.commit(out, release=release)
    if after_commit is not None:
        after_commit()
    out.sum().backward()
    off.end_iteration()
    return sink


def only_record(off: OffloadContext) -> GroupRecord:
    (record,) = off.iteration_logs()[-1].groups
    return record


# ------------------------------------------------------------------------------- skip rules


@dataclass(frozen=True)
class SkipCase:
    name: str
    make: Callable[[OffloadContext], torch.Tensor]
    """Builds the saved tensor (and may mark things on the offloader)."""
    tracked: bool
    offloaded: bool


def _marked_parameter_alias(
    off: OffloadContext, view: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    parameter = torch.nn.Parameter(normal((2 * MIN_NUMEL,), seed=1))
    off.mark_not_offloadable(parameter)
    return view(parameter.detach())


def _flagged(attribute: str) -> torch.Tensor:
    tensor = normal((MIN_NUMEL,), seed=2)
    setattr(tensor, attribute, True)
    return tensor


def _parameter(off: OffloadContext) -> torch.Tensor:
    return torch.nn.Parameter(normal((MIN_NUMEL,), seed=3))


def _unmarked_parameter_alias(off: OffloadContext) -> torch.Tensor:
    return torch.nn.Parameter(normal((MIN_NUMEL,), seed=4)).detach()


def _meta(off: OffloadContext) -> torch.Tensor:
    # On a CPU-only machine a meta tensor stands in for "a tensor on another device".
    return torch.empty(MIN_NUMEL, device="meta")


SKIP_CASES = [
    SkipCase("parameter", _parameter, tracked=False, offloaded=False),
    SkipCase(
        "alias-of-marked-parameter",
        lambda off: _marked_parameter_alias(off, lambda t: t),
        tracked=True,
        offloaded=False,
    ),
    SkipCase(
        "view-of-marked-parameter",
        lambda off: _marked_parameter_alias(off, lambda t: t[1:]),
        tracked=True,
        offloaded=False,
    ),
    SkipCase(
        "alias-of-unmarked-parameter", _unmarked_parameter_alias, tracked=True, offloaded=True
    ),
    SkipCase("_do_not_offload", lambda off: _flagged("_do_not_offload"), True, False),
    SkipCase("_TE_do_not_offload", lambda off: _flagged("_TE_do_not_offload"), True, False),
    SkipCase("numel-below-min", lambda off: normal((MIN_NUMEL - 1,), 5), True, False),
    SkipCase("numel-equal-min", lambda off: normal((MIN_NUMEL,), 6), True, True),
    SkipCase("plain-activation", lambda off: normal((BATCH, WIDTH), 7), True, True),
    SkipCase("other-device-meta", _meta, tracked=False, offloaded=False),
]


@pytest.mark.parametrize("skip_case", SKIP_CASES, ids=lambda skip_case: skip_case.name)
def test_skip_rules(skip_case: SkipCase) -> None:
    off = make_offloader()
    tensor = skip_case.make(off)
    (unpacked,) = one_group(off, (tensor,))
    record = only_record(off)
    assert record.tracked == int(skip_case.tracked)
    assert record.d2h_copies == int(skip_case.offloaded)
    assert record.d2h_bytes == (
        tensor.numel() * tensor.element_size() if skip_case.offloaded else 0
    )
    if tensor.device.type == "cpu":
        assert torch.equal(unpacked, tensor)
    # Kept tensors come back as the very same memory, offloaded ones as a fresh reload.
    assert (unpacked.data_ptr() == tensor.data_ptr()) is not skip_case.offloaded


# --------------------------------------------------------------------------- forced release


@dataclass(frozen=True)
class ReleaseResult:
    record: GroupRecord
    nbytes_before: int
    nbytes_after_commit: int
    """Storage bytes of the released tensor around the commit (sizes only: values of a freed
    storage must never be read, not even by a failure report's repr)."""
    unpacked: list[torch.Tensor] = field(repr=False)


def _one_activation(released: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (normal((BATCH, WIDTH), seed=13),)


def release_in_one_group(
    off: OffloadContext,
    make_release: Callable[[OffloadContext], torch.Tensor],
    saved: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] = _one_activation,
) -> ReleaseResult:
    """One group saving ``saved(released)`` whose commit releases ``make_release(off)``. The
    released tensor never leaves this frame, so no failing test's locals can show it."""
    released = make_release(off)
    nbytes_before = released.untyped_storage().nbytes()
    after: list[int] = []
    unpacked = one_group(
        off,
        saved(released),
        release=(released,),
        after_commit=lambda: after.append(released.untyped_storage().nbytes()),
    )
    return ReleaseResult(only_record(off), nbytes_before, after[0], unpacked)


def _activation(off: OffloadContext) -> torch.Tensor:
    return normal((BATCH, WIDTH), seed=10)


def test_marks_follow_a_parameter_whose_storage_moves() -> None:
    """Marking the same parameter again each forward is a no-op while its storage stays put;
    once its storage moves (FSDP2 re-allocating an unsharded parameter) the next mark covers the
    new address and the old address stops counting (an activation may live there now)."""
    off = make_offloader()
    parameter = torch.nn.Parameter(normal((2 * MIN_NUMEL,), seed=1))
    off.mark_not_offloadable(parameter)
    off.mark_not_offloadable(parameter)
    assert off._is_marked(parameter.detach())
    old = parameter.detach()
    parameter.data = normal((2 * MIN_NUMEL,), seed=2)  # same object, new storage
    assert not off._is_marked(old)  # the old address: the stale mark is dropped
    off.mark_not_offloadable(parameter)
    assert off._is_marked(parameter.detach())
    # The parameter goes back to a storage at an address whose mark was dropped meanwhile (as
    # FSDP2's re-allocation may hand out the same address): the next mark must not be skipped.
    moved = parameter.detach()
    parameter.data = normal((2 * MIN_NUMEL,), seed=3)
    assert not off._is_marked(moved)  # drops the mark at moved's address
    parameter.data = moved
    off.mark_not_offloadable(parameter)
    assert off._is_marked(parameter.detach()), "a parameter whose mark was dropped stayed unmarked"


def test_a_mark_replaced_at_the_same_address_is_renewed() -> None:
    """Two parameters at one address (FSDP2 allocating one where another lived): the second
    mark replaces the first. After the second moves on, the first must be marked again by its
    next mark_not_offloadable, not skipped as already marked."""
    off = make_offloader()
    first = torch.nn.Parameter(normal((2 * MIN_NUMEL,), seed=1))
    second = torch.nn.Parameter(first.detach())  # same storage, another object
    off.mark_not_offloadable(first)
    off.mark_not_offloadable(second)
    second.data = normal((2 * MIN_NUMEL,), seed=2)
    assert not off._is_marked(first.detach())  # the address's mark was second's, now stale
    off.mark_not_offloadable(first)
    assert off._is_marked(first.detach()), "a parameter whose mark was replaced stayed unmarked"


def test_forced_release_frees_eligible_tensor_of_offloaded_group() -> None:
    off = make_offloader()
    result = release_in_one_group(off, _activation, saved=lambda q: (q,))
    assert result.record.decision == "offloaded" and result.record.released == 1
    assert (result.nbytes_before, result.nbytes_after_commit) == (BATCH * WIDTH * 4, 0)
    # backward got the offloaded copy of the released tensor
    assert torch.equal(result.unpacked[0], _activation(off))


@pytest.mark.parametrize("skip_case", SKIP_CASES, ids=lambda skip_case: skip_case.name)
def test_forced_release_follows_the_skip_rules(skip_case: SkipCase) -> None:
    result = release_in_one_group(make_offloader(), skip_case.make)
    assert result.record.decision == "offloaded" and result.record.d2h_copies == 1
    assert result.record.released == int(skip_case.offloaded)
    expected_after = 0 if skip_case.offloaded else result.nbytes_before
    assert result.nbytes_after_commit == expected_after


def test_forced_release_skipped_when_group_is_kept() -> None:
    off = make_offloader()
    one_group(off, (normal((BATCH, WIDTH), 14),))  # warmup
    result = release_in_one_group(off, _activation, saved=lambda q: (q,))
    # A single microbatch's only group is the first backward chunk's last of its name.
    assert result.record.decision == "kept:margin"
    assert result.record.released == 0
    assert result.nbytes_after_commit == result.nbytes_before == BATCH * WIDTH * 4
    assert torch.equal(result.unpacked[0], _activation(off))


def test_forced_release_spares_storage_a_kept_saved_tensor_aliases() -> None:
    def q_and_its_head(q_BD: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return q_BD, q_BD.view(-1)[: MIN_NUMEL - 1]  # the head is too small to offload

    result = release_in_one_group(make_offloader(), _activation, saved=q_and_its_head)
    assert result.record.d2h_copies == 1  # q offloaded, its head kept on the device
    assert result.nbytes_after_commit == result.nbytes_before


# ------------------------------------------------------------------------ config validation


@pytest.mark.parametrize(
    "knobs",
    [
        pytest.param({"offload_modules": ("core_atn",)}, id="unknown-name"),
        pytest.param({"offload_modules": ()}, id="empty"),
        pytest.param({"offload_modules": "core_attn"}, id="bare-string"),
        pytest.param({"offload_modules": ("core_attn", "core_attn")}, id="duplicate"),
        pytest.param({"offload_modules": ("attn_proj",)}, id="attn_proj-without-core_attn"),
        pytest.param({"offload_modules": ("fused_group_mlp", "expert_fc1")}, id="fused+fc1"),
        pytest.param({"offload_modules": ("fused_group_mlp", "moe_act")}, id="fused+act"),
        pytest.param({"min_offloaded_tensor_size": -1}, id="negative-min-size"),
        pytest.param({"delta_offload_bytes_across_pp_ranks": -1}, id="negative-delta"),
        pytest.param({"pp_rank": -1}, id="negative-pp-rank"),
        pytest.param({"max_inflight_offloads": -1}, id="negative-inflight"),
        pytest.param({"activation_offload_fraction": -0.1}, id="fraction-below-0"),
        pytest.param({"activation_offload_fraction": 1.5}, id="fraction-above-1"),
        pytest.param({"activation_offload_fraction": float("nan")}, id="fraction-nan"),
        pytest.param({"activation_offload_fraction": True}, id="fraction-bool"),
        pytest.param({"min_offloaded_tensor_size": True}, id="min-size-bool"),
        pytest.param({"delta_offload_bytes_across_pp_ranks": False}, id="delta-bool"),
        pytest.param({"pp_rank": True}, id="pp-rank-bool"),
        pytest.param({"max_inflight_offloads": True}, id="inflight-bool"),
        pytest.param({"min_offloaded_tensor_size": 1.0}, id="min-size-float"),
    ],
)
def test_config_rejects_with_one_line_value_error(knobs: dict[str, Any]) -> None:
    kwargs: dict[str, Any] = {"offload_modules": ("core_attn",), **knobs}
    with pytest.raises(ValueError) as err:
        OffloadConfig(**kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "knobs",
    [
        pytest.param({"offload_modules": ("core_attn", "attn_proj")}, id="attn_proj-with-core"),
        pytest.param({"offload_modules": ("expert_fc1", "moe_act")}, id="unfused-experts"),
        pytest.param({"offload_modules": ["fused_group_mlp"]}, id="list"),
        pytest.param({"max_inflight_offloads": 0}, id="inflight-0"),
        pytest.param({"activation_offload_fraction": 0}, id="fraction-int-0"),
        pytest.param(
            {"activation_offload_fraction": 1.0, "min_offloaded_tensor_size": 0}, id="edges"
        ),
    ],
)
def test_config_accepts_valid_knobs(knobs: dict[str, Any]) -> None:
    kwargs: dict[str, Any] = {"offload_modules": ("core_attn",), **knobs}
    config = OffloadConfig(**kwargs)
    assert isinstance(config.offload_modules, tuple)


def test_check_applies_to_rejects_names_the_pattern_cannot_open() -> None:
    spec = ModelSpec(pattern="+-+-+-")
    OffloadConfig(offload_modules=("attn_norm", "core_attn", "attn_proj")).check_applies_to(spec)
    with pytest.raises(ValueError, match="mlp_norm") as err:
        OffloadConfig(offload_modules=("core_attn", "mlp_norm")).check_applies_to(spec)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------ backend selection


@pytest.mark.parametrize(
    ("spec", "factory"),
    [
        ("reference", OffloadContext),
        ("none", NoOffload),
        ("hooks", RecordingOffloader),
        ("harness.offload.passthrough:NoOffload", NoOffload),
        ("harness.offload.reference:OffloadContext", OffloadContext),
    ],
)
def test_resolve_backend(spec: str, factory: object) -> None:
    assert resolve_backend(spec) is factory


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "Reference",
        "nope",
        "harness.offload.no_such_module:factory",
        "harness.offload.passthrough:no_such_factory",
        "harness.offload.reference:FULL_STORAGE_MIN_COVERAGE",  # exists, not callable
        ":NoOffload",
        "harness.offload.passthrough:",
        None,
    ],
)
def test_resolve_backend_rejects_with_one_line_value_error(spec: Any) -> None:
    with pytest.raises(ValueError) as err:
        resolve_backend(spec)
    assert "\n" not in str(err.value)
