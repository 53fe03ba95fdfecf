"""The process-global torch state that decides a run's numerics, guarded around the backend.

The harness compares the offload run with baselines it trains in the same process (the plain
baseline, the hooks baseline). A backend that changes process-global state when built or while
it runs - ``torch.set_default_dtype``, grad mode, autocast, deterministic algorithms, matmul
precision, TF32, the random number generators, the intra-op threads, the CUDA device or stream -
would change every later run too, the baselines included, and its offload run would be
misread as ``graph change`` (or pass by luck). ``guarded`` snapshots every such setting before
the backend is built and around its runs, names each one it changed (``the backend changed
torch's default dtype from torch.float32 to torch.float64 when built``) as a
``GlobalStateChanged``, and restores them, so later runs and cases start clean.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch


class GlobalStateChanged(RuntimeError):
    """The backend changed process-global torch state; the message names every setting with
    its value before and after."""


@dataclass(frozen=True, kw_only=True)
class Setting:
    """One process-global setting: what messages call it, how to read and restore it."""

    name: str
    read: Callable[[], Any]
    write: Callable[[Any], None]
    rng: bool = False
    """A random number generator's state: compared where the backend is built only (a run
    draws from it itself)."""


def _cuda() -> bool:
    """Whether CUDA is in use here (never initialised by a snapshot)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _set_deterministic(value: tuple[bool, bool]) -> None:
    # without torch.use_deterministic_algorithms' import of TorchInductor (harness.models.train's)
    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    if setter is None:
        torch.use_deterministic_algorithms(value[0], warn_only=value[1])
    else:
        setter(value[0], warn_only=value[1])


def _autocast(device: str) -> Setting:
    def write(value: tuple[bool, torch.dtype]) -> None:
        torch.set_autocast_enabled(device, value[0])
        torch.set_autocast_dtype(device, value[1])

    return Setting(
        name=f"{device} autocast (enabled, dtype)",
        read=lambda: (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)),
        write=write,
    )


def _cudnn(value: tuple[bool, bool]) -> None:
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = value


def _tf32(value: tuple[bool, bool]) -> None:
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = value


def _rng_digest(state: torch.Tensor) -> str:
    return hashlib.sha1(state.numpy().tobytes()).hexdigest()[:12]


def settings() -> tuple[Setting, ...]:
    """Every guarded setting on this machine (CUDA's only where CUDA is in use)."""
    found = [
        Setting(
            name="torch's default dtype",
            read=torch.get_default_dtype,
            write=torch.set_default_dtype,
        ),
        Setting(name="grad mode", read=torch.is_grad_enabled, write=torch.set_grad_enabled),
        _autocast("cpu"),
        _autocast("cuda"),
        Setting(
            name="deterministic algorithms (enabled, warn only)",
            read=lambda: (
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
            ),
            write=_set_deterministic,
        ),
        Setting(
            name="cudnn (deterministic, benchmark)",
            read=lambda: (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark),
            write=_cudnn,
        ),
        Setting(
            name="float32 matmul precision",
            read=torch.get_float32_matmul_precision,
            write=torch.set_float32_matmul_precision,
        ),
        Setting(name="intra-op threads", read=torch.get_num_threads, write=torch.set_num_threads),
        Setting(
            name="the CPU random number generator's state",
            read=lambda: _rng_digest(torch.get_rng_state()),
            write=lambda value: None,  # restored from the saved state itself (``_restore_rng``)
            rng=True,
        ),
    ]
    if _cuda():
        found += [
            Setting(
                name="TF32 (cuda matmul, cudnn)",
                read=lambda: (
                    torch.backends.cuda.matmul.allow_tf32,
                    torch.backends.cudnn.allow_tf32,
                ),
                write=_tf32,
            ),
            Setting(
                name="the current CUDA device",
                read=torch.cuda.current_device,
                write=torch.cuda.set_device,
            ),
            Setting(
                name="the current CUDA stream",
                read=torch.cuda.current_stream,
                write=torch.cuda.set_stream,
            ),
            Setting(
                name="the CUDA random number generators' state",
                read=lambda: [_rng_digest(s) for s in torch.cuda.get_rng_state_all()],
                write=lambda value: None,
                rng=True,
            ),
        ]
    return tuple(found)


@dataclass(frozen=True)
class Snapshot:
    """Every guarded setting's value at one moment, and the generators' full states."""

    values: dict[str, Any]
    cpu_rng: torch.Tensor | None
    cuda_rng: list[torch.Tensor] | None


def snapshot(*, rng: bool = True) -> Snapshot:
    """The guarded settings now (the generators' states only with ``rng``)."""
    values = {s.name: s.read() for s in settings() if rng or not s.rng}
    cpu = torch.get_rng_state() if rng else None
    cuda = torch.cuda.get_rng_state_all() if rng and _cuda() else None
    return Snapshot(values, cpu, cuda)


def changes(before: Snapshot, after: Snapshot) -> list[str]:
    """``<setting> from <before> to <after>`` for each setting that differs."""
    found = []
    for name, value in before.values.items():
        now = after.values.get(name, value)
        if now != value:
            shown = "" if "random number" in name else f" from {value} to {now}"
            found.append(f"{name}{shown}")
    return found


def restore(before: Snapshot) -> None:
    """Put every setting back as ``before`` saw it."""
    for setting in settings():
        if setting.name in before.values and setting.read() != before.values[setting.name]:
            setting.write(before.values[setting.name])
    if before.cpu_rng is not None:
        torch.set_rng_state(before.cpu_rng)
    if before.cuda_rng is not None:
        torch.cuda.set_rng_state_all(before.cuda_rng)


@contextlib.contextmanager
def guarded(when: str, *, rng: bool = True) -> Iterator[None]:
    """Raise ``GlobalStateChanged`` (``the backend changed <setting> from A to B <when>``) if
    the body changed a guarded setting, after restoring them all; a body that raises leaves
    them restored too."""
    before = snapshot(rng=rng)
    try:
        yield
    except BaseException:
        restore(before)
        raise
    found = changes(before, snapshot(rng=rng))
    if found:
        restore(before)
        raise GlobalStateChanged("; ".join(f"the backend changed {c} {when}" for c in found))


@contextlib.contextmanager
def restoring() -> Iterator[None]:
    """Every guarded setting as it was before the body, whatever the body did (a backend's
    probe in the run's own process, which trains nothing: its case's runs judge it)."""
    before = snapshot()
    try:
        yield
    finally:
        restore(before)
