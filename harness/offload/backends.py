"""Backend selection: a name (``reference``, ``none``, ``hooks``, ``broken.<name>``) or
``package.module:factory``, optionally with race delays.

A factory is any callable ``(config: OffloadConfig, device: torch.device) -> Offloader``
(``harness.offload.protocol``). Resolution happens once, up front, so a bad name is a one-line
``ValueError`` before any model is built. What the harness knows about a backend beyond that
comes from the ``Capabilities`` record its factory declares (``capabilities(spec)``).

Race provocation (CUDA only): ``<backend>+delays`` runs the reference offloader or a broken one
with ``DEFAULT_RACE_DELAYS``; ``<backend>+delays:d2h=N,h2d=N,compute=N`` chooses the sleep
cycles (``harness.offload.reference.RaceDelays``; about 2000 cycles per microsecond on an H200).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import torch

from harness.offload.broken import BROKEN, LONG_DELAY
from harness.offload.config import OffloadConfig
from harness.offload.passthrough import NoOffload
from harness.offload.protocol import Capabilities, Offloader
from harness.offload.recorder import RecordingOffloader
from harness.offload.reference import OffloadContext, RaceDelays
from harness.predict import Semantics

Factory = Callable[[OffloadConfig, torch.device], Offloader]

BUILTIN: dict[str, Factory] = {
    "reference": OffloadContext,
    "none": NoOffload,
    "hooks": RecordingOffloader,
}
"""Built-in backends. ``none`` and ``hooks`` are the two baselines."""

EXTRA: dict[str, str] = {
    "mcore": "harness.offload.mcore:McoreOffloader",
    "mcore.inline-wait": "harness.offload.mcore:with_inline_reload_wait",
}
"""Further named backends provided by optional modules: name -> ``module:factory``. ``mcore``
drives megatron-core's own offloader (CUDA and the ``mcore`` extra); ``mcore.inline-wait`` adds
the D2H wait its inline reload lacks, to localise Megatron-LM #7398."""

UNDECLARED = Capabilities()
"""The record of a factory that declares none: no description, Megatron-Core main's semantics,
no race delays, runs anywhere."""

DELAYS = "+delays"
DEFAULT_RACE_DELAYS = RaceDelays(d2h=LONG_DELAY, h2d=LONG_DELAY)
"""``<backend>+delays`` without values: both copy streams slowed by about 10 ms per group."""


def backend_names() -> list[str]:
    """Every name ``resolve_backend`` accepts without an import path."""
    return [*BUILTIN, *BROKEN, *EXTRA]


def describe(name: str) -> str:
    """A short description of a named backend (its record's, else where it comes from)."""
    try:
        text = capabilities(name).description
    except ValueError:
        if name not in EXTRA:
            raise
        text = ""  # its optional module does not import here
    return text or f"optional backend ({EXTRA.get(name, name)})"


def capabilities(spec: str) -> Capabilities:
    """The ``Capabilities`` record a backend's factory declares (``harness.offload.protocol``),
    or ``UNDECLARED`` for a factory that declares none."""
    return _declared(resolve_backend(spec), spec)


def parse_race_delays(text: str) -> RaceDelays:
    """``d2h=N,h2d=N,compute=N`` (any subset; missing ones are 0) -> ``RaceDelays``."""
    values: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in ("d2h", "h2d", "compute") or key in values:
            raise ValueError(
                f"race delays {text!r}: expected d2h=N,h2d=N,compute=N (sleep cycles), each once"
            )
        try:
            values[key] = int(value)
        except ValueError:
            raise ValueError(f"race delays {text!r}: {key}={value!r} is not an int") from None
    if not values:
        raise ValueError(f"race delays {text!r}: name at least one of d2h, h2d, compute")
    return RaceDelays(**values)


def with_delays(backend: str, delays: RaceDelays) -> str:
    """The backend spelling that runs ``backend`` with ``delays``."""
    return f"{backend}{DELAYS}:d2h={delays.d2h},h2d={delays.h2d},compute={delays.compute}"


def resolve_backend(spec: str) -> Factory:
    """The factory for a backend name or ``package.module:factory`` path (with ``+delays``)."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"backend must be a name ({', '.join(backend_names())}) or module:factory")
    base, plus, tail = spec.partition(DELAYS)
    if plus:
        return _delayed(base, tail, spec)
    if spec in BUILTIN:
        return BUILTIN[spec]
    if spec in BROKEN:
        return BROKEN[spec]
    if spec in EXTRA:
        return _import_factory(EXTRA[spec], shown=spec)
    if ":" in spec:
        return _import_factory(spec, shown=spec)
    raise ValueError(
        f"unknown backend {spec!r}; known: {', '.join(backend_names())}, or package.module:factory"
    )


def _delayed(base: str, tail: str, shown: str) -> Factory:
    if tail and not tail.startswith(":"):
        raise ValueError(f"backend {shown!r}: write {base}+delays or {base}+delays:d2h=N,h2d=N")
    delays = parse_race_delays(tail[1:]) if tail else DEFAULT_RACE_DELAYS
    factory = resolve_backend(base)
    record = _declared(factory, base)
    if not record.race_delays:
        raise ValueError(
            f"backend {shown!r}: race delays apply to the reference offloader, broken.* and "
            "mcore only (a factory taking delays= declares Capabilities(race_delays=True))"
        )
    delayed = functools.partial(factory, delays=delays)
    delayed.capabilities = record  # type: ignore[attr-defined]
    return delayed


def backend_unavailable(spec: str, device: torch.device) -> str | None:
    """Why a (resolvable) backend cannot run on ``device`` (its record's ``unavailable``), or
    None."""
    check = capabilities(spec).unavailable
    return None if check is None else check(device)


def _declared(factory: Factory, shown: str) -> Capabilities:
    record = getattr(factory, "capabilities", UNDECLARED)
    if not isinstance(record, Capabilities):
        raise ValueError(
            f"backend {shown!r}: its factory's capabilities is a {type(record).__name__}, not a "
            "harness.offload.protocol.Capabilities"
        )
    if record.semantics is not None and not isinstance(record.semantics, Semantics):
        raise ValueError(
            f"backend {shown!r}: its capabilities' semantics is a "
            f"{type(record.semantics).__name__}, not a harness.predict.Semantics"
        )
    return record


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
    _declared(factory, shown)  # a malformed record is a resolution error too
    return factory  # type: ignore[no-any-return]
