"""Where and with what a case runs (``Environment``), and an offloader closed after its run."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from harness.cases import Case
from harness.measure.threads import watch_threads
from harness.offload.backends import Backend, backend_record
from harness.offload.config import OffloadConfig
from harness.offload.protocol import Offloader
from harness.offload.semantics import Semantics
from harness.util import globalstate
from harness.vocab.spec import ModelSpec


@dataclass(frozen=True, kw_only=True)
class Environment:
    """Where and with what a case runs."""

    device: torch.device
    backend: Backend | str = "reference"
    """Backend under test: its record (``harness.offload.backends.Backend``); a spelling (a
    name or ``module:factory``) given here is resolved into one."""
    model_size: str = "tiny"
    """``tiny`` (CPU sized) or ``small`` (GPU sized) presets."""
    undeclared: bool = False
    """Judge the backend as if it declared no semantics: its rule is learned from its copies
    (``harness.execute.learn``) even where its factory declares one (``mutation-score
    --undeclared``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", backend_record(self.backend))

    @property
    def record(self) -> Backend:
        """The backend's record (``backend``, typed as resolved)."""
        assert isinstance(self.backend, Backend)
        return self.backend

    def offloader(self, config: OffloadConfig) -> Offloader:
        """The backend, built under ``harness.util.globalstate``'s guard: a change it makes to
        process-global torch state is a ``GlobalStateChanged``, and undone."""
        watch_threads()  # before the backend starts a thread of its own
        with globalstate.guarded("when built"):
            return self.record.build(config, self.device)

    @property
    def declared(self) -> Semantics | None:
        """The copy rules the backend's factory declares (the reference's and megatron-core's
        adapters declare theirs), or None: its rule is then learned from what it does."""
        return None if self.undeclared else self.record.semantics

    def spec(self, case: Case) -> ModelSpec:
        spec = case.model_spec(self.model_size)
        case.offload_config().check_applies_to(spec)
        return spec


@contextlib.contextmanager
def closing(offloader: Offloader) -> Iterator[Offloader]:
    try:
        yield offloader
    finally:
        offloader.close()
