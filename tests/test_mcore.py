"""The ``mcore`` backend: refusal where it cannot run, and (on a GPU with megatron-core) one
training run through megatron-core's real offloader."""

from __future__ import annotations

import pytest
import torch

from harness.offload.backends import backend_names, resolve_backend
from harness.offload.config import OffloadConfig
from harness.offload.mcore import McoreOffloader, provide_te_flag, unavailable_reason
from harness.predict import MEGATRON_MAIN

CONFIG = OffloadConfig(offload_modules=("core_attn", "attn_proj"), min_offloaded_tensor_size=1024)


def test_registered_by_name() -> None:
    assert {"mcore", "mcore.inline-wait"} <= set(backend_names())
    assert resolve_backend("mcore") is McoreOffloader


def test_declares_its_version_semantics() -> None:
    assert McoreOffloader.semantics != MEGATRON_MAIN
    assert resolve_backend("mcore.inline-wait").semantics == McoreOffloader.semantics


def test_refused_on_cpu_with_one_line() -> None:
    with pytest.raises(ValueError) as info:
        McoreOffloader(CONFIG, "cpu")
    message = str(info.value)
    assert "needs a CUDA device" in message and "\n" not in message
    assert unavailable_reason("cpu") == message


needs_mcore = pytest.mark.skipif(
    unavailable_reason("cuda") is not None, reason=str(unavailable_reason("cuda"))
)


@pytest.mark.gpu
@needs_mcore
def test_te_flag_is_provided() -> None:
    import megatron.core.extensions.transformer_engine as te_extension

    provided = provide_te_flag()
    assert te_extension.cpu_offload is not None
    assert hasattr(te_extension.cpu_offload, "CPUOffloadEnabled"), provided


@pytest.mark.gpu
@needs_mcore
def test_seed_model_moves_bytes_and_logs_every_iteration() -> None:
    from harness.spec import RunSpec, preset
    from harness.train import train

    spec = preset("hybrid-tiny")
    run = RunSpec(steps=3, microbatches=2)
    offloader = McoreOffloader(CONFIG, torch.device("cuda"))
    try:
        result = train(spec, run, offloader, "cuda")
    finally:
        offloader.close()
    logs = result.logs
    assert [log.warmup for log in logs] == [True, False, False]
    assert all(log.d2h_bytes > 0 and log.d2h_bytes == log.h2d_bytes for log in logs)
    assert all(log.leaked_tensors == 0 and log.pool_in_use == 0 for log in logs)
    assert torch.isfinite(result.losses).all()
