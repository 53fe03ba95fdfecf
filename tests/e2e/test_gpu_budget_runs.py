"""The runs behind the ZeRO-3 terms of the GPU memory budget's estimate
(``harness.vocab.fits.case_peak_bytes``), on the CPU: the gradients a ZeRO-3 run keeps and the
weights it leaves to Python's cyclic collector. On the H100 at afb5c10 every ZeRO-3 row reserved
1.49-1.82 times the estimate that counted neither (``tests/unit/test_gpu_budget.py`` replays
that run's peaks against the estimate that does)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch

from harness.models.hybrid import HybridModel
from harness.models.runs import RunHooks
from harness.models.train import train
from harness.offload.passthrough import NoOffload
from harness.vocab import fits
from harness.vocab.spec import RunSpec, preset

SPEC = preset("hybrid-tiny")
BF16 = RunSpec(steps=1, microbatches=1, precision="bf16")


def _parameters() -> int:
    return sum(p.numel() for p in HybridModel(SPEC).to("meta").parameters())


def test_a_zero3_run_keeps_fp32_gradients_in_bf16() -> None:
    """The gradients kept per step are the local shards of FSDP2's fp32 gradients
    (``ZERO3_GRAD_BYTES``), where an unsharded bf16 run keeps bf16 ones (``GRAD_BYTES``)."""
    for sharding, each in (("zero3", fits.ZERO3_GRAD_BYTES), ("none", fits.GRAD_BYTES["bf16"])):
        kept = train(SPEC, BF16, NoOffload(), "cpu", keep_grads=True, sharding=sharding).grads
        assert len(kept) == BF16.steps
        nbytes = sum(g.numel() * g.element_size() for g in kept[0].values())
        assert nbytes == _parameters() * each, sharding
    assert fits.ZERO3_GRAD_BYTES == 4  # fp32: FSDP2 reduces into the fp32 sharded parameters


def test_a_zero3_run_leaves_its_weights_to_the_cyclic_collector() -> None:
    """FSDP2's modules live in reference cycles: when ``train`` returns, the model and its fp32
    sharded weights (4 B per parameter, the estimate's per earlier run) are still alive, and
    only a collection frees them (``ZERO3_EARLIER_RUNS``). A change that frees them at once
    should drop that term of the estimate."""
    refs: dict[str, Any] = {}

    def ready(model: torch.nn.Module) -> None:
        refs["model"] = weakref.ref(model)
        locals_ = [getattr(p, "_local_tensor", p) for p in model.parameters()]
        refs["bytes"] = sum(t.untyped_storage().nbytes() for t in locals_)
        refs["dtypes"] = {t.dtype for t in locals_}

    gc.collect()
    gc.disable()
    try:
        train(SPEC, BF16, NoOffload(), "cpu", hooks=RunHooks(model_ready=ready), sharding="zero3")
        assert refs["model"]() is not None  # alive after the run, in its cycles
    finally:
        gc.enable()
    gc.collect()
    assert refs["model"]() is None  # and a collection frees it
    assert refs["dtypes"] == {torch.float32}
    assert refs["bytes"] == 4 * _parameters()  # at world size 1 the shard is the whole
