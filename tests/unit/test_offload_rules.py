"""Rules of the reference offloader: skip rules, forced release, config and backend validation,
chunk identity under interleaved schedules, warmup source, enable/disable, structure checks and
pop-once semantics, as Megatron-Core has them (docs/backends.md, "The reference offloader").

Shape suffixes: B batch rows, D hidden width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from harness.offload.backends import resolve_backend
from harness.offload.config import OffloadConfig
from harness.offload.passthrough import NoOffload, PassThroughGroup
from harness.offload.protocol import GroupRecord, IterationLog, Offloader
from harness.offload.recorder import RecordingOffloader
from harness.offload.reference import OffloadContext, StructureChangedError
from harness.testing.autograd import SaveAndHandBack
from harness.testing.strategies import normal
from harness.vocab.spec import ModelSpec

MIN_NUMEL = 16
"""min_offloaded_tensor_size of these tests."""
BATCH, WIDTH = 4, 8
"""B x D = 32 elements per activation: above MIN_NUMEL."""
BOTH = ("core_attn", "attn_proj")


def make_offloader(names: tuple[str, ...] = ("core_attn",), **knobs: Any) -> OffloadContext:
    config = OffloadConfig(offload_modules=names, min_offloaded_tensor_size=MIN_NUMEL, **knobs)
    return OffloadContext(config, "cpu")


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


# ---------------------------------------------------------- a tiny attention-like model


@dataclass(frozen=True)
class TinyNet:
    """Per layer: core_attn = softmax(h W_q), attn_proj = tanh(a W_o), then a residual add."""

    w_q: tuple[torch.nn.Parameter, ...]
    w_o: tuple[torch.nn.Parameter, ...]

    def forward(self, off: Offloader, x_BD: torch.Tensor) -> torch.Tensor:
        h_BD = x_BD
        for layer, (w_q, w_o) in enumerate(zip(self.w_q, self.w_o, strict=True)):
            core = off.group("core_attn", h_BD, layer=layer)
            with core:
                a_BD = torch.softmax(core.input @ w_q, dim=-1)
            a_BD = core.commit(a_BD)
            proj = off.group("attn_proj", a_BD, layer=layer)
            with proj:
                o_BD = torch.tanh(proj.input @ w_o)
            h_BD = h_BD + proj.commit(o_BD)
        return (h_BD * h_BD).mean()

    def parameters(self) -> list[torch.nn.Parameter]:
        return [*self.w_q, *self.w_o]


def build_net(num_layers: int = 2) -> TinyNet:
    def weight(seed: int) -> torch.nn.Parameter:
        return torch.nn.Parameter(normal((WIDTH, WIDTH), seed) / WIDTH**0.5)

    w_q = tuple(weight(10 + layer) for layer in range(num_layers))
    w_o = tuple(weight(20 + layer) for layer in range(num_layers))
    return TinyNet(w_q, w_o)


def run_schedule(off: Offloader, net: TinyNet, order: str, iteration: int) -> None:
    """Run steps like "F0 F1 B1 B0" (each microbatch's data depends on it), then end_iteration."""
    losses: dict[int, torch.Tensor] = {}
    for step in order.split():
        microbatch = int(step[1:])
        if step[0] == "F":
            x_BD = normal((BATCH, WIDTH), seed=1000 * iteration + microbatch)
            off.begin_microbatch(microbatch)  # the runner's call, as in harness.models.train
            losses[microbatch] = net.forward(off, x_BD.requires_grad_())
        else:
            losses.pop(microbatch).backward()
    off.end_iteration()


def train(off: Offloader, orders: list[str]) -> list[list[torch.Tensor]]:
    """One iteration per entry of ``orders``, an SGD step after each; the gradients of each."""
    net = build_net()
    grads = []
    for iteration, order in enumerate(orders):
        run_schedule(off, net, order, iteration)
        grads.append([p.grad.clone() for p in net.parameters()])
        with torch.no_grad():
            for p in net.parameters():
                p -= 0.5 * p.grad
                p.grad = None
    return grads


def assert_same_grads(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> None:
    assert len(got) == len(want)
    for iteration, (g_iter, w_iter) in enumerate(zip(got, want, strict=True)):
        for g, w in zip(g_iter, w_iter, strict=True):
            assert torch.equal(g, w), f"gradients differ in iteration {iteration}"


def assert_no_leaks(logs: list[IterationLog]) -> None:
    for log in logs:
        assert log.leaked_tensors == 0 and log.pool_in_use == 0, log


# ------------------------------------------------------------------- chunk identity


@pytest.mark.parametrize(
    "order",
    [
        pytest.param("F0 F1 B0 B1", id="backward-in-forward-order"),
        pytest.param("F0 F1 B1 B0", id="backward-mb1-first"),
        pytest.param("F0 F1 B0 F2 B1 B2", id="1f1b"),
    ],
)
def test_chunk_identity_gives_baseline_gradients(order: str) -> None:
    orders = [order] * 4  # warmup + 3 steady iterations
    baseline = train(NoOffload(), orders)
    off = make_offloader(BOTH)
    assert_same_grads(train(off, orders), baseline)
    logs = off.iteration_logs()
    assert [log.warmup for log in logs] == [True, False, False, False]
    assert all(log.d2h_bytes > 0 for log in logs), "nothing was offloaded: the test proves nothing"
    assert_no_leaks(logs)
    assert_steady_state_stable(logs[1:])
    assert {log.pool_allocated for log in logs} == {logs[0].pool_allocated}  # no growth


def assert_steady_state_stable(steady: list[IterationLog]) -> None:
    """Same decisions and bytes per group in every steady iteration (invariant 33)."""
    first = [(g.key, g.decision, g.d2h_bytes) for g in steady[0].groups]
    for log in steady[1:]:
        assert [(g.key, g.decision, g.d2h_bytes) for g in log.groups] == first


def test_backward_order_may_change_after_warmup() -> None:
    orders = ["F0 F1 B0 B1", "F0 F1 B1 B0", "F0 F1 B0 B1", "F0 F1 B1 B0"]
    off = make_offloader(BOTH)
    assert_same_grads(train(off, orders), train(NoOffload(), orders))
    assert_no_leaks(off.iteration_logs())


def test_leak_counter_sees_a_forward_without_backward() -> None:
    """Negative control for the leaked_tensors == 0 / pool_in_use == 0 assertions above."""
    off, net = make_offloader(BOTH), build_net()
    off.begin_microbatch(0)
    net.forward(off, normal((BATCH, WIDTH), seed=8).requires_grad_())  # backward never runs
    off.end_iteration()
    (log,) = off.iteration_logs()
    assert log.leaked_tensors == sum(g.tracked for g in log.groups) > 0
    assert log.pool_in_use == sum(g.d2h_copies for g in log.groups) > 0


# ----------------------------------------------------------------- warmup source, enable


def _no_grad_pass(off: Offloader, net: TinyNet, *, begin_under_no_grad: bool) -> None:
    """An evaluation forward of microbatch 0 that never runs backward."""
    x_BD = normal((BATCH, WIDTH), seed=99)
    if not begin_under_no_grad:
        off.begin_microbatch(0)
    with torch.no_grad():
        if begin_under_no_grad:
            off.begin_microbatch(0)
        net.forward(off, x_BD)
    off.end_iteration()


def _assert_warmup_is_first_training_iteration(off: OffloadContext) -> None:
    eval_log, first, second = off.iteration_logs()
    assert eval_log.groups == () and not eval_log.warmup
    assert first.warmup and len(first.groups) == 4
    assert not second.warmup and second.d2h_bytes > 0


@pytest.mark.parametrize(
    "begin_under_no_grad", [True, False], ids=["begin-under-no-grad", "begin-under-grad"]
)
def test_no_grad_forward_does_not_become_the_warmup(begin_under_no_grad: bool) -> None:
    off, net = make_offloader(BOTH), build_net()
    _no_grad_pass(off, net, begin_under_no_grad=begin_under_no_grad)
    run_schedule(off, net, "F0 B0", iteration=0)
    run_schedule(off, net, "F0 B0", iteration=1)
    _assert_warmup_is_first_training_iteration(off)


def test_disabled_offloader_moves_nothing_and_warmup_waits() -> None:
    off, orders = make_offloader(BOTH), ["F0 F1 B0 B1"] * 3
    off.set_enabled(False)
    off.begin_microbatch(0)
    x = torch.ones(2)
    group = off.group("core_attn", x, layer=0)
    assert isinstance(group, PassThroughGroup) and group.input is x
    off.end_iteration()
    grads = train(off, orders[:1])
    off.set_enabled(True)
    grads += train(off, orders[1:])
    assert_same_grads(grads, train(NoOffload(), orders[:1]) + train(NoOffload(), orders[1:]))
    logs = off.iteration_logs()
    assert [log.groups == () for log in logs] == [True, True, False, False]
    assert [log.warmup for log in logs] == [False, False, True, False]
    assert logs[-1].d2h_bytes > 0


def test_disable_after_warmup_then_reenable_restores_the_plan() -> None:
    off, net = make_offloader(BOTH), build_net()
    for iteration in range(2):
        run_schedule(off, net, "F0 B0 F1 B1", iteration)
    off.set_enabled(False)
    run_schedule(off, net, "F0 B0 F1 B1", iteration=2)
    off.set_enabled(True)
    run_schedule(off, net, "F0 B0 F1 B1", iteration=3)
    _, steady, disabled, reenabled = off.iteration_logs()
    assert disabled.groups == () and disabled.d2h_bytes == 0
    assert [(g.key, g.decision) for g in reenabled.groups] == [
        (g.key, g.decision) for g in steady.groups
    ]
    assert reenabled.d2h_bytes == steady.d2h_bytes > 0


# ---------------------------------------------------------------------- structure checks


def open_groups(off: Offloader, microbatch: int, groups: list[tuple[str, int]]) -> None:
    """One iteration of ``microbatch`` opening ``(name, layer)`` groups in order (sin saves the
    group's input)."""
    off.begin_microbatch(microbatch)
    h = normal((BATCH, WIDTH), seed=5).requires_grad_()
    for name, layer in groups:
        group = off.group(name, h, layer=layer)
        with group:
            y = torch.sin(group.input)
        h = group.commit(y)
    h.sum().backward()
    off.end_iteration()


WARMUP_GROUPS = [("core_attn", 0), ("attn_proj", 0)]


@pytest.mark.parametrize(
    "steady_groups",
    [
        pytest.param([("attn_proj", 0), ("core_attn", 0)], id="other-name-first"),
        pytest.param([("core_attn", 1), ("attn_proj", 1)], id="other-layer"),
        pytest.param([("core_attn", 0)], id="group-missing"),
        pytest.param([*WARMUP_GROUPS, ("core_attn", 1)], id="extra-group"),
    ],
)
def test_structure_change_after_warmup_raises(steady_groups: list[tuple[str, int]]) -> None:
    off = make_offloader(BOTH)
    open_groups(off, 0, WARMUP_GROUPS)
    open_groups(off, 0, WARMUP_GROUPS)  # the same structure is fine
    with pytest.raises(StructureChangedError):
        open_groups(off, 0, steady_groups)


def test_microbatch_not_seen_in_warmup_raises() -> None:
    off = make_offloader(BOTH)
    open_groups(off, 0, WARMUP_GROUPS)
    off.begin_microbatch(1)  # a microbatch is checked when it opens its first group
    x = torch.ones(BATCH, WIDTH, requires_grad=True)
    with pytest.raises(StructureChangedError, match="microbatch 1"):
        off.group("core_attn", x, layer=0)


# ---------------------------------------------------------------------- pop-once semantics


class _ReadSavedTwice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x.detach().clone())
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        ctx.saved_tensors  # noqa: B018 - the first unpack
        ctx.saved_tensors  # noqa: B018 - the second unpack must raise
        return grad


def test_reading_saved_tensors_twice_raises() -> None:
    off = make_offloader()
    off.begin_microbatch(0)
    x = normal((BATCH, WIDTH), seed=6).requires_grad_()
    group = off.group("core_attn", x, layer=0)
    with group:
        y = _ReadSavedTwice.apply(group.input)
    y = group.commit(y)
    with pytest.raises(RuntimeError, match="unpacked twice"):
        y.sum().backward()


def test_second_backward_with_retain_graph_raises() -> None:
    off = make_offloader()
    off.begin_microbatch(0)
    x = normal((BATCH, WIDTH), seed=7).requires_grad_()
    group = off.group("core_attn", x, layer=0)
    with group:
        y = torch.sin(group.input)
    loss = group.commit(y).sum()
    loss.backward(retain_graph=True)
    assert torch.equal(x.grad, torch.cos(x.detach()))  # the first unpack got the offloaded copy
    with pytest.raises(RuntimeError, match="unpacked twice"):
        loss.backward()


def _fills(make: Callable[[], torch.Tensor]) -> int:
    """``aten::fill_`` calls while ``make`` runs under deterministic algorithms."""
    from harness.models.train import deterministic

    with deterministic(torch.device("cpu")), torch.profiler.profile() as prof:
        make()
    return sum(event.name == "aten::fill_" for event in prof.events())


def test_staging_buffers_skip_the_deterministic_fill() -> None:
    """Deterministic mode fills every new ``torch.empty`` with NaN (a host memset per pool miss
    on the H200's MoE groups); a staging buffer, overwritten by its copy, is not filled, and the
    flag is back afterwards."""
    import torch.utils.deterministic as det

    from harness.offload.pool import HostBufferPool, staging_buffer

    shape = (64, 1024)
    assert _fills(lambda: torch.empty(shape)) == 1  # the fill this avoids
    assert _fills(lambda: staging_buffer(shape, torch.float32)) == 0
    assert _fills(lambda: HostBufferPool(pin_memory=False).acquire(shape, torch.float32, None)) == 0
    assert det.fill_uninitialized_memory is True
