"""Offloaders that fail the way real ones do, as small test backends (``--backend
offloaders:Name``): each provokes one row of ``tests/e2e/test_faults_run.py``'s fault table."""

from __future__ import annotations

import os
import signal
import threading
import time

import torch

from harness.offload.reference import GroupState, HostCopy, OffloadContext


class Keep(OffloadContext):
    """A correct offloader that keeps Python references to every activation it offloaded (a
    debugging list, say): on the ZeRO-3 rows a forced release frees their memory, and the
    addresses are reused by FSDP2's own copies."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.kept: list[torch.Tensor] = []

    def _copy_out(self, group: GroupState, tensor: torch.Tensor) -> HostCopy:
        self.kept.append(tensor)
        return super()._copy_out(group, tensor)

    def end_iteration(self) -> None:
        super().end_iteration()
        del self.kept[:-64]  # bounded, and still holding the last steps' activations


class Prefetch(OffloadContext):
    """Starts a non-daemon prefetch thread that it never joins (nor stops)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._stop = threading.Event()
        threading.Thread(target=self._stop.wait, name="prefetch", daemon=False).start()


class Float64(OffloadContext):
    """Changes torch's default dtype when built (process-global state that decides numerics)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        torch.set_default_dtype(torch.float64)


class _InSecondStep(OffloadContext):
    """Raises ``RuntimeError("boom in <call>")`` in its second step's first call of
    ``BOOM``."""

    BOOM = ""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.ended = 0

    def _boom(self, call: str) -> None:
        if call == self.BOOM and self.ended == 1 and self.enabled:
            raise RuntimeError(f"boom in {call}")

    def end_iteration(self) -> None:
        self._boom("end_iteration")
        super().end_iteration()
        self.ended += 1

    def begin_microbatch(self, microbatch: int) -> None:
        self._boom("begin_microbatch")
        super().begin_microbatch(microbatch)

    def _pack(self, group: GroupState, tensor: torch.Tensor) -> object:
        self._boom("pack")
        return super()._pack(group, tensor)

    def _unpack(self, packed: object) -> torch.Tensor:
        self._boom("unpack")
        return super()._unpack(packed)

    def _commit_forward(self, group: GroupState, release: tuple[torch.Tensor, ...]) -> None:
        self._boom("commit")
        super()._commit_forward(group, release)


class BoomPack(_InSecondStep):
    BOOM = "pack"


class BoomUnpack(_InSecondStep):
    BOOM = "unpack"


class BoomCommit(_InSecondStep):
    BOOM = "commit"


class BoomBegin(_InSecondStep):
    BOOM = "begin_microbatch"


class BoomEnd(_InSecondStep):
    BOOM = "end_iteration"


class Segfault(OffloadContext):
    """Dies of SIGSEGV in its first step's second microbatch (a crash in native code would)."""

    def begin_microbatch(self, microbatch: int) -> None:
        if microbatch == 1:
            os.kill(os.getpid(), signal.SIGSEGV)
        super().begin_microbatch(microbatch)


class Threads(OffloadContext):
    """Changes torch's intra-op threads at the end of its first step (a tuning knob)."""

    changed = False

    def end_iteration(self) -> None:
        super().end_iteration()
        if self.enabled and not self.changed:
            self.changed = True
            torch.set_num_threads(torch.get_num_threads() + 1)


class WaitForGo(OffloadContext):
    """The reference offloader, held at its first microbatch until a file named ``go`` exists
    in the working directory (at most 120 s): a test acts while the case is surely running
    (removes the report folder, say), then lets it go on."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._waited = False

    def begin_microbatch(self, microbatch: int) -> None:
        if not self._waited:
            self._waited = True
            deadline = time.monotonic() + 120
            while not os.path.exists("go") and time.monotonic() < deadline:
                time.sleep(0.01)
        super().begin_microbatch(microbatch)
