"""Exact group counts of Megatron-Core's post-warmup policies (docs/backends.md, reference).

A tiny fake model opens, per layer, one group per selected name around an op that saves exactly
one offloadable tensor of ``reps[layer] * WIDTH`` fp32 elements (plus a Parameter, which is never
tracked). Its group bytes are therefore known here without asking the offloader, and the
expected decision of every (microbatch, layer, name) is written out per test from the policy
rules, then compared with ``GroupRecord.decision`` of the logged iterations.

Schedules are strings of steps: ``"F0 B0 F1 B1"`` (sequential), ``"F0 F1 B0 B1"`` (GPipe),
``"F0 F1 B1 B0"`` (last microbatch's backward first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from harness.offload.config import OffloadConfig
from harness.offload.passthrough import NoOffload
from harness.offload.policy import fraction_disabled_count
from harness.offload.protocol import IterationLog, Offloader
from harness.offload.reference import OffloadContext
from harness.testing.strategies import normal

WIDTH = 32
"""Hidden width D of the fake model."""
MIN_NUMEL = 16
"""min_offloaded_tensor_size for these tests; every saved activation has >= WIDTH elements."""
BYTES_PER_REP = WIDTH * 4
"""fp32 bytes of one repetition of the hidden state."""
BOTH = ("core_attn", "attn_proj")

Key = tuple[int, int, str]
"""(microbatch, layer, name)."""


class _MulSaved(torch.autograd.Function):
    """``x * w`` saving exactly ``x`` and ``w`` for backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return grad * w, grad * x


@dataclass(frozen=True)
class TinyModel:
    """Layer ``l`` opens each of ``names``; its group saves the input repeated ``reps[l]`` times."""

    reps: tuple[int, ...]
    names: tuple[str, ...]
    weights: dict[tuple[int, str], torch.nn.Parameter]

    def forward(self, off: Offloader, x_D: torch.Tensor) -> torch.Tensor:
        h_D = x_D
        for layer, reps in enumerate(self.reps):
            for name in self.names:
                group = off.group(name, h_D, layer=layer)
                with group:
                    y_RD = _MulSaved.apply(group.input.repeat(reps), self.weights[layer, name])
                h_D = group.commit(y_RD.reshape(reps, WIDTH).sum(0))
        return (h_D * h_D).sum()

    def group_bytes(self, layer: int) -> int:
        return self.reps[layer] * BYTES_PER_REP

    def grads(self) -> list[torch.Tensor]:
        """Current gradients (cloned), then zeroed for the next iteration."""
        out = [w.grad.clone() for w in self.weights.values()]
        for w in self.weights.values():
            w.grad = None
        return out


def build_model(reps: tuple[int, ...], names: tuple[str, ...], seed: int = 0) -> TinyModel:
    weights = {
        (layer, name): torch.nn.Parameter(normal((n * WIDTH,), seed + 100 * layer + index))
        for layer, n in enumerate(reps)
        for index, name in enumerate(names)
    }
    return TinyModel(reps, names, weights)


def microbatch_inputs(num: int, iteration: int) -> list[torch.Tensor]:
    return [normal((WIDTH,), 1000 * iteration + m).requires_grad_() for m in range(num)]


def run_iteration(off: Offloader, model: TinyModel, order: str, iteration: int = 0) -> None:
    """Forwards and backwards in ``order``, then ``end_iteration``."""
    steps = order.split()
    inputs = microbatch_inputs(sum(s[0] == "F" for s in steps), iteration)
    losses: dict[int, torch.Tensor] = {}
    for step in steps:
        microbatch = int(step[1:])
        if step[0] == "F":
            off.begin_microbatch(microbatch)  # the runner's call, as in harness.models.train
            losses[microbatch] = model.forward(off, inputs[microbatch])
        else:
            losses.pop(microbatch).backward()
    off.end_iteration()


def train(model: TinyModel, order: str, iterations: int, **policy: Any) -> OffloadContext:
    config = OffloadConfig(
        offload_modules=model.names, min_offloaded_tensor_size=MIN_NUMEL, **policy
    )
    off = OffloadContext(config, "cpu")
    for iteration in range(iterations):
        run_iteration(off, model, order, iteration)
    return off


def decisions(log: IterationLog) -> dict[Key, str]:
    return {g.key: g.decision for g in log.groups}


def all_keys(model: TinyModel, microbatches: int) -> list[Key]:
    return [
        (m, layer, name)
        for m in range(microbatches)
        for layer in range(len(model.reps))
        for name in model.names
    ]


def expected(model: TinyModel, microbatches: int, kept: dict[Key, str]) -> dict[Key, str]:
    """Every group offloaded except ``kept`` (key -> "kept:<policy>")."""
    return {key: kept.get(key, "offloaded") for key in all_keys(model, microbatches)}


def assert_steady(off: OffloadContext, model: TinyModel, want: dict[Key, str]) -> None:
    """Every logged iteration after the warmup has decisions ``want`` and moves exactly the
    bytes of its offloaded groups, with nothing leaked."""
    warmup, *steady = off.iteration_logs()
    assert warmup.warmup and set(decisions(warmup).values()) == {"offloaded"}
    assert steady, "no steady iteration ran"
    offloaded_bytes = sum(model.group_bytes(k[1]) for k, d in want.items() if d == "offloaded")
    for log in steady:
        assert not log.warmup
        assert decisions(log) == want
        assert log.d2h_bytes == log.h2d_bytes == offloaded_bytes
        assert log.leaked_tensors == 0 and log.pool_in_use == 0


def test_warmup_offloads_every_group_with_its_bytes() -> None:
    model = build_model((1, 2, 3), BOTH)
    off = train(model, "F0 B0 F1 B1", iterations=1)
    (log,) = off.iteration_logs()
    assert log.warmup
    assert decisions(log) == expected(model, 2, kept={})
    for record in log.groups:
        assert record.d2h_bytes == record.h2d_bytes == model.group_bytes(record.layer)
        assert record.tracked == 1  # the repeated input; the Parameter is not tracked


@pytest.mark.parametrize(
    ("order", "kept"),
    [
        pytest.param(
            "F0 B0 F1 B1",
            {
                (0, 2, "core_attn"): "kept:margin",
                (0, 2, "attn_proj"): "kept:margin",
                # F1 runs after B0, so microbatch 1's backward is the next one: its last groups
                # would be reloaded right after their offload.
                (1, 2, "core_attn"): "kept:last_of_name",
                (1, 2, "attn_proj"): "kept:last_of_name",
            },
            id="sequential",
        ),
        pytest.param(
            "F0 F1 B0 B1",
            {(0, 2, "core_attn"): "kept:margin", (0, 2, "attn_proj"): "kept:margin"},
            id="gpipe",
        ),
        pytest.param(
            "F0 F1 B1 B0",
            {(1, 2, "core_attn"): "kept:margin", (1, 2, "attn_proj"): "kept:margin"},
            id="last-backward-first",
        ),
    ],
)
def test_margin_and_last_of_name(order: str, kept: dict[Key, str]) -> None:
    model = build_model((1, 1, 1), BOTH)
    off = train(model, order, iterations=3)
    assert_steady(off, model, expected(model, 2, kept))


@pytest.mark.parametrize(
    ("order", "last_of_name_microbatches"),
    [
        pytest.param("F0 B0 F1 B1 F2 B2", (1, 2), id="sequential"),
        # 1F1B: F1 and F2 each run while an earlier microbatch's backward is still pending.
        pytest.param("F0 F1 B0 F2 B1 B2", (), id="1f1b"),
    ],
)
def test_runtime_last_of_name_only_when_own_backward_is_next(
    order: str, last_of_name_microbatches: tuple[int, ...]
) -> None:
    model = build_model((1, 1), ("core_attn",))
    off = train(model, order, iterations=2)
    kept = {(0, 1, "core_attn"): "kept:margin"}
    kept |= {(m, 1, "core_attn"): "kept:last_of_name" for m in last_of_name_microbatches}
    assert_steady(off, model, expected(model, 3, kept))


@pytest.mark.parametrize(
    ("num_layers", "fraction", "kept_mb0", "kept_mb1"),
    [
        # Microbatch 0 is the first backward chunk: margin keeps its last layer first, so it has
        # num_layers - 1 eligible groups; microbatch 1 has num_layers.
        # 9 * (1 - 0.8) = 1.7999999999999998 -> 1; 10 * (1 - 0.8) = 1.9999999999999996 -> 1,
        # i.e. 9 of 10 (90%) offloaded.
        pytest.param(10, 0.8, 1, 1, id="n10-f0.8-floor"),
        # 4 * 0.19999999999999996 -> 0; 5 * 0.19999999999999996 = 0.9999999999999998 -> 0.
        pytest.param(5, 0.8, 0, 0, id="n5-f0.8-floor"),
        pytest.param(10, 0.0, 9, 10, id="f0-keeps-all"),
        pytest.param(10, 1.0, 0, 0, id="f1-keeps-none"),
        pytest.param(4, 0.5, 1, 2, id="n4-f0.5"),
    ],
)
def test_fraction_keeps_trailing_groups_per_chunk(
    num_layers: int, fraction: float, kept_mb0: int, kept_mb1: int
) -> None:
    model = build_model((1,) * num_layers, ("core_attn",))
    off = train(model, "F0 F1 B0 B1", iterations=2, activation_offload_fraction=fraction)
    last = num_layers - 1
    kept = {(0, last, "core_attn"): "kept:margin"}
    kept |= {(0, layer, "core_attn"): "kept:fraction" for layer in range(last - kept_mb0, last)}
    first_kept_mb1 = num_layers - kept_mb1
    kept |= {
        (1, layer, "core_attn"): "kept:fraction" for layer in range(first_kept_mb1, num_layers)
    }
    assert_steady(off, model, expected(model, 2, kept))


@pytest.mark.parametrize(
    ("eligible", "fraction", "disabled"),
    [
        (10, 0.8, 1),  # 10 * 0.19999999999999996 = 1.9999999999999996
        (5, 0.8, 0),  # 0.9999999999999998
        (9, 0.8, 1),  # 1.7999999999999998
        (10, 0.9, 0),  # 10 * 0.09999999999999998 = 0.9999999999999998
        (3, 0.5, 1),  # 1.5
        (4, 0.5, 2),
        (7, 0.0, 7),
        (7, 1.0, 0),
        (0, 0.3, 0),
    ],
)
def test_fraction_disabled_count_floors_python_floats(
    eligible: int, fraction: float, disabled: int
) -> None:
    assert fraction_disabled_count(eligible, fraction) == disabled


# Group bytes of reps (1, 2, 3, 1): 128, 256, 384, 128. Delta walks microbatch 0 then 1 (the
# backward order of "F0 B0 F1 B1") in forward order, skipping margin-kept (0, 3).
@pytest.mark.parametrize(
    ("pp_rank", "delta", "delta_kept"),
    [
        pytest.param(0, 10_000, [], id="rank0-keeps-nothing"),
        pytest.param(1, 128, [(0, 0)], id="exact-fit"),
        pytest.param(2, 150, [(0, 0), (0, 1)], id="300-overshoots-to-384"),
        pytest.param(2, 400, [(0, 0), (0, 1), (0, 2), (1, 0)], id="800-spills-into-mb1"),
    ],
)
def test_delta_keeps_earliest_groups_until_rank_times_delta(
    pp_rank: int, delta: int, delta_kept: list[tuple[int, int]]
) -> None:
    model = build_model((1, 2, 3, 1), ("core_attn",))
    off = train(
        model,
        "F0 B0 F1 B1",
        iterations=2,
        pp_rank=pp_rank,
        delta_offload_bytes_across_pp_ranks=delta,
    )
    kept = {(0, 3, "core_attn"): "kept:margin", (1, 3, "core_attn"): "kept:last_of_name"}
    kept |= {(m, layer, "core_attn"): "kept:delta" for m, layer in delta_kept}
    assert_steady(off, model, expected(model, 2, kept))
    kept_bytes = sum(model.group_bytes(layer) for _, layer in delta_kept)
    assert kept_bytes >= pp_rank * delta
    if delta_kept:  # overshoot by at most the last group
        assert kept_bytes - model.group_bytes(delta_kept[-1][1]) < pp_rank * delta


def train_with_grads(off: Offloader, order: str, iterations: int) -> list[list[torch.Tensor]]:
    model = build_model((1, 2, 1), BOTH, seed=7)
    grads = []
    for iteration in range(iterations):
        run_iteration(off, model, order, iteration)
        grads.append(model.grads())
    return grads


@pytest.mark.parametrize("cap", [0, 1, None])
def test_max_inflight_offloads_changes_no_numerics(cap: int | None) -> None:
    order, iterations = "F0 F1 B0 B1", 3
    baseline = train_with_grads(NoOffload(), order, iterations)
    config = OffloadConfig(
        offload_modules=BOTH, min_offloaded_tensor_size=MIN_NUMEL, max_inflight_offloads=cap
    )
    off = OffloadContext(config, "cpu")
    grads = train_with_grads(off, order, iterations)
    for got, want in zip(grads, baseline, strict=True):
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    uncapped = OffloadContext(config.replace(max_inflight_offloads=None), "cpu")
    train_with_grads(uncapped, order, iterations)
    assert off.iteration_logs() == uncapped.iteration_logs()
    assert all(log.d2h_bytes > 0 for log in off.iteration_logs())


@pytest.mark.parametrize(
    ("order", "per_name"),
    [
        # First backward chunk is microbatch 0: only its groups count, minus margin-kept layer 1.
        pytest.param("F0 B0 F1 B1", 128, id="first-backward-is-mb0"),
        # First backward chunk is microbatch 1: microbatch 0 (128 + 256) and microbatch 1 up to
        # its margin-kept layer 1 (128) count.
        pytest.param("F0 F1 B1 B0", 128 + 256 + 128, id="first-backward-is-mb1"),
    ],
)
def test_summary_bytes_sum_offloaded_groups_up_to_first_backward_chunk(
    order: str, per_name: int
) -> None:
    model = build_model((1, 2), BOTH)
    off = train(model, order, iterations=2)
    warmup, steady = off.iteration_logs()
    assert warmup.summary_bytes == {"core_attn": per_name, "attn_proj": per_name}
    assert off.summary_bytes == warmup.summary_bytes
    assert steady.summary_bytes == {}
