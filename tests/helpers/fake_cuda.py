"""What the host-sync guard touches of ``torch.cuda``, faked on CPU, so its CUDA-only paths (the
warn-mode capture, the explicit-sync wrappers) run without a GPU.

``FakeCuda.install(monkeypatch)`` replaces ``torch.cuda.get/set_sync_debug_mode`` with a mode held
here, stubs what ``torch.cuda.synchronize`` and ``torch.accelerator.synchronize`` call before their
binding (``_lazy_init``, ``torch.cuda.device``, the device index), and puts counting stand-ins in
the places the guard wraps: ``torch._C._cuda_synchronize``,
``torch._C._accelerator_synchronizeDevice`` and ``torch.cuda.Event.synchronize``.
``FakeCuda.implicit()`` is ATen's sync check as a Python binding delivers it
(``c10::cuda::warn_or_error_on_sync`` then ``torch::PyWarningHandler``): nothing in the default
mode, a ``UserWarning`` in ``warn``, a ``RuntimeError`` in ``error``. This file's frames are hidden
from a hit's source, as a C binding's would be, so the source names the caller.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import pytest
import torch

from harness.measure import syncdetect

MODES = {"default": 0, "warn": 1, "error": 2}
TRIGGERED = " (Triggered internally at /pytorch/c10/cuda/CUDAFunctions.cpp:202.)"
"""What ``PyWarningHandler`` appends to a C++ warning issued without ``verbatim``."""


class NoDevice(contextlib.nullcontext):  # type: ignore[type-arg]
    """``torch.cuda.device`` as a context that does nothing, and a class as the real one is:
    torch's own code tests ``isinstance(device, torch.cuda.device)``
    (``torch.cuda._utils._get_device_index``, under ``torch.cuda.current_stream``, which
    ``harness.util.globalstate`` reads once CUDA is initialised). A lambda here made that
    ``isinstance`` raise ``TypeError`` on the H100 at afb5c10, in a worker where an earlier test
    had initialised CUDA."""

    def __init__(self, device: Any = None) -> None:
        super().__init__()
        self.idx = 0  # the device index the fake's ``_get_device_index`` gives


class FakeCuda:
    """The sync debug mode and the synchronising calls of a CUDA build, on CPU."""

    def __init__(self) -> None:
        self.mode = 0
        self.modes: list[int] = []
        """Every mode set, in order."""
        self.synchronized: list[str] = []
        """The explicit syncs that reached the (fake) driver."""

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
        monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: self.mode)
        monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", self._set)
        monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
        monkeypatch.setattr(torch.cuda, "device", NoDevice)
        monkeypatch.setattr(
            torch.accelerator, "_get_device_index", lambda *a, **k: 0, raising=False
        )
        monkeypatch.setattr(torch._C, "_cuda_synchronize", self._device_sync, raising=False)
        monkeypatch.setattr(
            torch._C, "_accelerator_synchronizeDevice", self._accelerator_sync, raising=False
        )
        monkeypatch.setattr(torch.cuda.Event, "synchronize", self._event_sync)
        monkeypatch.setattr(syncdetect, "_SKIPPED", {*syncdetect._SKIPPED, __file__})
        return self

    def implicit(self) -> None:
        """What ``.item()``, a blocking copy or ``Stream.synchronize()`` does to the host."""
        if self.mode == 2:
            raise RuntimeError(syncdetect.SYNC_MESSAGE)
        if self.mode == 1:
            warnings.warn(syncdetect.SYNC_MESSAGE + TRIGGERED, UserWarning, stacklevel=2)

    def _set(self, mode: int | str) -> None:
        self.mode = MODES[mode] if isinstance(mode, str) else int(mode)
        self.modes.append(self.mode)

    def _device_sync(self) -> None:
        self.synchronized.append("device")

    def _accelerator_sync(self, index: Any = None) -> None:
        self.synchronized.append("accelerator")

    def _event_sync(self, event: Any = None) -> None:
        self.synchronized.append("event")
