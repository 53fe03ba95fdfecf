"""The ``mcore`` backend: refusal where it cannot run, and (on a GPU with megatron-core) one
training run through megatron-core's real offloader."""

from __future__ import annotations

import types

import pytest
import torch

from harness.offload.backends import backend_names, capabilities, resolve_backend
from harness.offload.config import OffloadConfig
from harness.offload.mcore import McoreOffloader, provide_te_flag, unavailable_reason
from harness.offload.semantics import MEGATRON_MAIN

CONFIG = OffloadConfig(offload_modules=("core_attn", "attn_proj"), min_offloaded_tensor_size=1024)


def test_registered_by_name() -> None:
    assert {"mcore", "mcore.inline-wait"} <= set(backend_names())
    assert resolve_backend("mcore") is McoreOffloader


def test_declares_its_version_semantics() -> None:
    assert McoreOffloader.semantics != MEGATRON_MAIN
    for name in ("mcore", "mcore.inline-wait", "mcore+delays", "mcore.inline-wait+delays"):
        record = capabilities(name)
        assert record.semantics == McoreOffloader.semantics and record.race_delays, name
        assert record.unavailable is unavailable_reason, name
    assert capabilities("mcore.inline-wait").description != capabilities("mcore").description


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
    from harness.models.train import train
    from harness.vocab.spec import RunSpec, preset

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


def test_native_watch_patches_megatron_and_restores_it() -> None:
    """Inside ``native`` the adapter sees each group start with its layer, logs before
    megatron-core's own reset and leaves chunk starts and resets to megatron-core; afterwards
    megatron-core's functions are its own again (checked on stand-ins: no megatron-core here)."""
    from harness.offload.reference import RaceDelays

    seen: list[object] = []

    def group_start(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
        seen.append(("start", name))
        return tensor

    def group_offload(tensor: torch.Tensor, *args: object) -> torch.Tensor:
        seen.append(("commit",))
        return tensor

    class Interface:
        @staticmethod
        def reset() -> None:
            seen.append(("reset",))

        @staticmethod
        def init_chunk_handler(*args: object, **kwargs: object) -> None:
            seen.append(("init",))

    mcore = types.SimpleNamespace(
        fine_grained_offloading_group_start=group_start,
        fine_grained_offloading_group_offload=group_offload,
    )
    off = object.__new__(McoreOffloader)
    off.__dict__.update(
        _mcore=mcore,
        _interface=Interface,
        delays=RaceDelays(),
        _native=False,
        _enabled=True,
        _vp=None,
    )
    off._started = lambda name, layer: seen.append(("keyed", name, layer))  # type: ignore[method-assign]
    off._log_iteration = lambda: seen.append(("log",))  # type: ignore[method-assign]
    x = torch.ones(2)
    with off.native(lambda: 4):
        off.begin_microbatch(1)
        assert mcore.fine_grained_offloading_group_start(x, "core_attn") is x
        mcore.fine_grained_offloading_group_offload(x, "core_attn", [], False)
        Interface.reset()
        off.end_iteration()
    assert off._microbatch == 1
    assert seen == [
        ("start", "core_attn"),
        ("keyed", "core_attn", 4),
        ("commit",),
        ("log",),
        ("reset",),
    ]
    assert mcore.fine_grained_offloading_group_start is group_start
    assert mcore.fine_grained_offloading_group_offload is group_offload
    seen.clear()
    Interface.reset()
    assert seen == [("reset",)]
