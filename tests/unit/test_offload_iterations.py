"""Rules of the reference offloader across iterations: chunk identity under interleaved
schedules, the warmup's source, enable/disable, structure checks and pop-once semantics, as
Megatron-Core has them (docs/backends.md, "The reference offloader"), on a tiny attention-like
model driven by hand (its forwards and backwards, a plain SGD update between iterations). The
rules within one group (skip rules, forced release, config and backend validation) are in
``test_offload_rules.py``.

Shape suffixes: B batch rows, D hidden width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from offload_rules_setup import BATCH, BOTH, WIDTH, make_offloader

from harness.offload.passthrough import NoOffload, PassThroughGroup
from harness.offload.protocol import IterationLog, Offloader
from harness.offload.reference import OffloadContext, StructureChangedError
from harness.testing.strategies import normal

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
