"""Where and with what a case runs (``Environment``), and an offloader closed after its run."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from harness.cases import Case
from harness.offload.backends import capabilities, resolve_backend
from harness.offload.config import OffloadConfig
from harness.offload.protocol import Offloader
from harness.offload.semantics import Semantics
from harness.util import globalstate
from harness.vocab.spec import ModelSpec


@dataclass(frozen=True, kw_only=True)
class Environment:
    """Where and with what a case runs."""

    device: torch.device
    backend: str = "reference"
    """Backend under test: a name or ``module:factory``."""
    model_size: str = "tiny"
    """``tiny`` (CPU sized) or ``small`` (GPU sized) presets."""
    undeclared: bool = False
    """Judge the backend as if it declared no semantics: its rule is learned from its copies
    (``harness.execute.learn``) even where its factory declares one (``mutation-score
    --undeclared``)."""

    def offloader(self, config: OffloadConfig) -> Offloader:
        """The backend, built under ``harness.util.globalstate``'s guard: a change it makes to
        process-global torch state is a ``GlobalStateChanged``, and undone."""
        with globalstate.guarded("when built"):
            return resolve_backend(self.backend)(config, self.device)

    @property
    def declared(self) -> Semantics | None:
        """The copy rules the backend's factory declares (the reference's and megatron-core's
        adapters declare theirs), or None: its rule is then learned from what it does."""
        return None if self.undeclared else capabilities(self.backend).semantics

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
