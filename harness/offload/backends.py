"""Backend selection: a name (``reference``, ``none``, ``hooks``) or ``package.module:factory``.

A factory is any callable ``(config: OffloadConfig, device: torch.device) -> Offloader``
(``harness.offload.protocol``). Resolution happens once, up front, so a bad name is a one-line
``ValueError`` before any model is built.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from harness.offload.config import OffloadConfig
from harness.offload.passthrough import NoOffload
from harness.offload.protocol import Offloader
from harness.offload.recorder import RecordingOffloader
from harness.offload.reference import OffloadContext

Factory = Callable[[OffloadConfig, torch.device], Offloader]

BUILTIN: dict[str, Factory] = {
    "reference": OffloadContext,
    "none": NoOffload,
    "hooks": RecordingOffloader,
}
"""Built-in backends. ``none`` and ``hooks`` are the two baselines."""

EXTRA: dict[str, str] = {}
"""Further named backends provided by optional modules: name -> ``module:factory``."""


def backend_names() -> list[str]:
    """Every name ``resolve_backend`` accepts without an import path."""
    return [*BUILTIN, *EXTRA]


def resolve_backend(spec: str) -> Factory:
    """The factory for a backend name or ``package.module:factory`` path."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"backend must be a name ({', '.join(backend_names())}) or module:factory")
    if spec in BUILTIN:
        return BUILTIN[spec]
    if spec in EXTRA:
        return _import_factory(EXTRA[spec], shown=spec)
    if ":" in spec:
        return _import_factory(spec, shown=spec)
    raise ValueError(
        f"unknown backend {spec!r}; known: {', '.join(backend_names())}, or package.module:factory"
    )


def _import_factory(path: str, *, shown: str) -> Factory:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"backend {shown!r}: an import path looks like package.module:factory")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"backend {shown!r}: cannot import {module_name!r} ({exc})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"backend {shown!r}: {module_name} has no callable {attr!r}")
    return factory  # type: ignore[no-any-return]
