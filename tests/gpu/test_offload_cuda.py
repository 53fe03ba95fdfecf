"""CUDA-only behaviour of the reference offloader: pinned host buffers, side streams, event
ordering under provoked races, and no host synchronisation on the offload path.

These tests skip without a GPU (collection-time marker) and must pass on the GPU box.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from harness.measure.syncguard import SyncGuard
from harness.models.train import train
from harness.offload.config import OffloadConfig
from harness.offload.passthrough import NoOffload
from harness.offload.reference import OffloadContext, RaceDelays
from harness.vocab.spec import RunSpec, preset

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SEED_MODULES = ("core_attn", "attn_proj")
# ~10 ms of GPU sleep per group (H200 clocks ~2 GHz): far longer than any copy here, so a
# missing event edge would let the consumer read a half-filled buffer.
LONG = 20_000_000


class _Save(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (saved,) = ctx.saved_tensors
        return grad * saved


def _toy_iteration(off: OffloadContext, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Groups over ``inputs`` (one per layer), backward, end of iteration; returns the grads."""
    off.begin_microbatch(0)
    outs = []
    for layer, x in enumerate(inputs):
        group = off.group("core_attn", x, layer=layer)
        with group:
            y = _Save.apply(group.input)
        outs.append(group.commit(y))
    torch.stack([o.sum() for o in outs]).sum().backward()
    off.end_iteration()
    grads = [x.grad.clone() for x in inputs]
    for x in inputs:
        x.grad = None
    return grads


def _inputs(count: int, numel: int) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(7)
    return [
        torch.randn(numel, device="cuda", generator=gen).requires_grad_(True) for _ in range(count)
    ]


def test_host_buffers_are_pinned_and_copies_are_exact() -> None:
    off = OffloadContext(
        OffloadConfig(offload_modules=("core_attn",), min_offloaded_tensor_size=1), "cuda"
    )
    inputs = _inputs(4, 1 << 20)
    for _ in range(3):
        grads = _toy_iteration(off, inputs)
        for x, g in zip(inputs, grads, strict=True):
            # d/dx sum(2 * x) through the saved x: grad = 1 * x (the backward multiplies by saved)
            assert torch.equal(g, x.detach())
    buffers = [buf for free in off.pool._free.values() for buf, _ in free]
    assert buffers and all(buf.is_pinned() for buf in buffers)
    assert off.iteration_logs()[-1].d2h_bytes == 3 * (1 << 20) * 4  # 3 of 4 (margin keeps one)


def test_a_side_compute_stream_is_the_one_the_copies_order_against() -> None:
    """Training under ``torch.cuda.stream(side)``: the offloader's cached compute stream follows
    the current one (its side streams wait for ``side``, not the default stream), and a delayed
    ``side`` stream still gets exact gradients (a copy ordered against the idle default stream
    would read the inputs before ``side`` wrote them)."""
    off = OffloadContext(
        OffloadConfig(offload_modules=("core_attn",), min_offloaded_tensor_size=1), "cuda"
    )
    side = torch.cuda.Stream()
    assert off._compute_stream() == torch.cuda.current_stream()
    with torch.cuda.stream(side):
        assert off._compute_stream() == side
        for _ in range(3):
            inputs = [torch.empty(1 << 20, device="cuda") for _ in range(4)]
            torch.cuda._sleep(LONG)  # on side: the fills below land ~10 ms late
            for value, x in enumerate(inputs):
                x.fill_(float(value + 1)).requires_grad_(True)
            grads = _toy_iteration(off, inputs)
            for value, g in enumerate(grads):
                assert torch.equal(g, torch.full_like(g, float(value + 1)))
    assert off._compute_stream() == torch.cuda.current_stream() != side
    assert off.iteration_logs()[-1].d2h_bytes == 3 * (1 << 20) * 4


def test_no_host_sync_in_steady_iterations() -> None:
    off = OffloadContext(
        OffloadConfig(
            offload_modules=("core_attn",), min_offloaded_tensor_size=1, max_inflight_offloads=1
        ),
        "cuda",
    )
    inputs = _inputs(6, 1 << 18)
    _toy_iteration(off, inputs)  # warmup: pinned allocations happen here
    torch.cuda.synchronize()
    # The toy iteration has no sync of its own, so the whole of it is one guarded window.
    guard = SyncGuard("cuda", armed=True)
    for iteration in range(1, 4):
        with guard.window("iteration", f"steady iteration {iteration}"):
            _toy_iteration(off, inputs)
    guard.reset()
    assert guard.hits == [] and guard.windows["iteration"] == 3
    assert off.iteration_logs()[-1].d2h_bytes > 0


@pytest.mark.parametrize(
    "delays",
    [
        RaceDelays(d2h=LONG),
        RaceDelays(h2d=LONG),
        RaceDelays(compute=LONG),
        RaceDelays(d2h=LONG, h2d=LONG),
    ],
    ids=["slow-d2h", "slow-h2d", "slow-compute", "slow-both"],
)
@pytest.mark.parametrize("schedule", ["sequential", "1f1b"])
def test_delayed_streams_keep_losses_bitwise(delays: RaceDelays, schedule: str) -> None:
    """Slow copy streams widen every race window (a reload reading a buffer its D2H has not
    filled - Megatron #7398 - included, in the warmup step); losses must stay bitwise equal."""
    spec = preset("hybrid-tiny")
    run = RunSpec(steps=3, microbatches=2, schedule=schedule, precision="bf16")
    config = OffloadConfig(
        offload_modules=SEED_MODULES, min_offloaded_tensor_size=1024, max_inflight_offloads=1
    )
    plain = train(spec, run, NoOffload(), "cuda")
    off = OffloadContext(config, "cuda", delays=delays)
    offload = train(spec, run, off, "cuda")
    off.close()
    assert sum(log.d2h_bytes for log in offload.logs) > 0
    assert torch.equal(plain.losses, offload.losses), (plain.losses, offload.losses)


@pytest.mark.parametrize("backend", ["reference", "broken.host_sync"])
def test_the_case_runs_offload_run_is_the_sync_checks_guarded_run(backend: str) -> None:
    """On CUDA the offload run arms the guard for its step ``GUARDED_STEP``: the reference
    passes it; ``broken.host_sync``'s syncs are recorded there by ATen's debug mode, nothing is
    raised, and the loss check reads the same run."""
    from harness.execute.environment import Environment
    from harness.execute.steps import guards_in_offload_run, run_case
    from harness.measure.syncguard import GUARDED_STEP, SYNC_MESSAGE, GuardedRun
    from harness.verify.detection import SEED

    env = Environment(device=torch.device("cuda", torch.cuda.current_device()), backend=backend)
    assert guards_in_offload_run(SEED, env)
    res = run_case(SEED, env)
    assert not res.proof_problems and res.d2h_watched > 0  # the offload happened
    assert torch.equal(res.offload.losses, res.plain.losses) and res.verdict.ok
    assert isinstance(res.guarded, GuardedRun) and res.guarded.guarded_steps == (GUARDED_STEP,)
    assert res.guarded.windows["commit"] and not res.guarded.evidence_problems()
    if backend == "reference":
        assert res.guarded.hits == (), res.guarded.hits
    else:
        first = res.guarded.hits[0]
        assert first.window.startswith(f"step {GUARDED_STEP}, microbatch 0, group ")
        assert first.window.endswith(": commit") and first.call == SYNC_MESSAGE, first
        assert first.source.endswith(" in _commit_forward") and first.thread == "main", first
