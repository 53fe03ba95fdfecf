"""What the host-sync guard records, and how (CUDA): each synchronisation made inside one of
``harness.measure.syncguard``'s windows becomes a ``SyncHit``; nothing is raised.

Two kinds of synchronisation, one detector each:

* implicit ones - ``.item()``, ``.cpu()``, ``.tolist()``, a blocking copy, ``nonzero``,
  ``Stream.synchronize()`` - pass ATen's sync check (``c10::cuda::warn_or_error_on_sync``). While
  a window is open the guard sets ``torch.cuda.set_sync_debug_mode("warn")``: the check issues a
  C++ warning, ``called a synchronizing CUDA operation``, which the Python binding that ran the op
  turns into a ``UserWarning`` as it returns (``torch::PyWarningHandler``), on the thread that
  called it - inside the window, the hooks autograd runs on its device thread included.
  ``Listener`` catches it there: a filter ``always`` for that message alone, placed first (no
  ``-W error`` turns it into an exception, and no once-per-location registry drops a repeat), and
  ``warnings.showwarning`` replaced; every other warning goes on to the ``showwarning`` it
  replaced.
* explicit ones ATen's check does not see - ``torch.cuda.synchronize()``,
  ``torch.accelerator.synchronize()``, ``torch.cuda.Event.synchronize()`` - by wrapping their
  Python entry points (``torch._C._cuda_synchronize``, which ``torch.cuda.synchronize`` looks up at
  every call, ``torch._C._accelerator_synchronizeDevice`` and ``torch.cuda.Event.synchronize``).
  ``Stream.synchronize()`` is not wrapped: ATen's check flags it, so one call is one hit.

Why nothing raises: in the debug mode ``error`` a sync raises inside the offloader's code, i.e.
inside C++ autograd when it is a saved-tensor hook or a node's backward; the offloader's state is
left half-updated, and an offloader that catches the error hides it. Why no GPU trace
(``torch._C._activate_gpu_trace``): it cannot be turned off, and its Python callbacks then run on
every CUDA allocation and free of the process; one that runs while an exception unwinds through
C++ fails, and the exception is lost: any error an offloader raised reached the runner as
``SystemError: ... returned NULL without setting an exception``.

A warning autograd holds back: C++ code run on a device thread outside any Python binding (a C++
autograd node inside a backward window) has its warnings buffered by the engine and replayed on
the calling thread when the backward ends, after every window closed. The debug mode is on only
while a window is open, so such a warning still comes from inside one: it is recorded against the
step's backward, the node unknown (``LATE``) - unless the debug mode was already on when the
guard started, and then it is ignored (it may be anyone's).

What is not seen: a sync inside a window whose code installs a warning capture of its own
(``catch_warnings(record=True)``, an ``ignore`` filter),
``torch.Event.synchronize()`` (the device-generic event, a C type that cannot be wrapped), a
device synchronisation a C++ extension makes itself, and a sync on a thread with no window open.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

SYNC_MESSAGE = "called a synchronizing CUDA operation"
"""What ATen's sync check says (and raises, in the debug mode ``error``)."""

FOREIGN = "foreign"
"""``SyncHit.thread`` of a thread Python did not start: on CUDA, autograd's device thread, which
runs the backward's saved-tensor hooks and node hooks."""

LATE = "late"
"""``SyncHit.kind`` of a sync autograd reported only when the backward ended (module docstring)."""

EXPLICIT: tuple[tuple[str, str, str], ...] = (
    ("torch._C", "_cuda_synchronize", "torch.cuda.synchronize()"),
    ("torch._C", "_accelerator_synchronizeDevice", "torch.accelerator.synchronize()"),
    ("torch.cuda.Event", "synchronize", "torch.cuda.Event.synchronize()"),
)
"""(owner, attribute, the call a hit names): the explicit syncs ATen's check does not flag."""


@dataclass(frozen=True, kw_only=True)
class SyncHit:
    """One host synchronisation made inside a window."""

    window: str
    """The innermost open window's label: ``step 2, microbatch 0, group core_attn (layer 0):
    commit``."""
    kind: str
    """Its kind: ``commit``, ``pack``, ``unpack``, ``backward``, ... (``LATE``: see the module
    docstring)."""
    call: str
    """What synchronised: ATen's ``SYNC_MESSAGE`` or one of ``EXPLICIT``'s calls."""
    source: str = ""
    """``file.py:line in function`` of the first caller outside torch and the guard ('' if
    unknown)."""
    thread: str = "main"
    """``main``, ``FOREIGN`` or the Python thread's name."""

    def describe(self) -> str:
        """``window: call (source)``."""
        at = f" ({self.source})" if self.source else ""
        return f"{self.window}: {self.call}{at}"

    def record(self) -> dict[str, str]:
        """The hit as JSON fields (``from_record`` reads them back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> SyncHit:
        """A hit from ``record``'s fields; ValueError naming what is wrong."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(record) - names)
        missing = sorted({"window", "kind", "call"} - set(record))
        if unknown or missing:
            raise ValueError(
                f"a sync hit has the fields {sorted(names)}: unknown {unknown}, missing {missing}"
            )
        if not all(isinstance(value, str) for value in record.values()):
            raise ValueError(f"every field of a sync hit is a string: {dict(record)}")
        return cls(**record)


def thread_label() -> str:
    """``SyncHit.thread`` of the calling thread. Never ``threading.current_thread()``: on a
    thread Python did not start it registers a dummy thread, which the case's leftover check
    would then report as left running."""
    ident = threading.get_ident()
    if ident == threading.main_thread().ident:
        return "main"
    named = [t.name for t in threading.enumerate() if t.ident == ident]
    return named[0] if named else FOREIGN


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _warnings_files() -> set[str]:
    """The files of the warnings machinery between a warning and ``showwarning`` (Python 3.14
    moved ``_showwarnmsg`` out of warnings.py)."""
    shown = getattr(warnings, "_showwarnmsg", None)
    code = getattr(shown, "__code__", None)
    return {warnings.__file__} | ({code.co_filename} if code is not None else set())


_SKIPPED = {os.path.abspath(path) for path in (__file__, *_warnings_files())}


def skip_frames_of(path: str) -> None:
    """Never name a frame of ``path`` as a hit's source (the guard's own modules)."""
    _SKIPPED.add(os.path.abspath(path))


def caller(frame: FrameType | None) -> str:
    """``file.py:line in function`` of the first frame from ``frame`` outward that is neither
    torch's nor the guard's ('' if none)."""
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_TORCH_DIR) and os.path.abspath(path) not in _SKIPPED:
            return f"{os.path.basename(path)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return ""


Record = Callable[[str, str, bool], None]
"""``record(call, source, explicit)``: the guard's handler of one detected sync."""


class Listener:
    """The warning capture and the explicit-sync wrappers of one guard, live from ``start`` to
    ``stop`` (the guard's first window of a step to the step's end)."""

    def __init__(self, record: Record) -> None:
        self._record = record
        self._catcher: warnings.catch_warnings[None] | None = None
        self._shown: Callable[..., Any] | None = None
        self._patched: list[tuple[Any, str, Any]] = []

    @property
    def active(self) -> bool:
        return self._catcher is not None

    def start(self) -> None:
        """Capture ATen's sync warnings and wrap the explicit syncs (a no-op when active)."""
        if self._catcher is not None:
            return
        self._catcher = warnings.catch_warnings()
        self._catcher.__enter__()
        warnings.filterwarnings("always", message=SYNC_MESSAGE, category=UserWarning)
        self._shown = warnings.showwarning
        warnings.showwarning = self._show
        for owner, name, call in _owners():
            original = getattr(owner, name)
            setattr(owner, name, self._wrap(original, call))
            self._patched.append((owner, name, original))

    def stop(self) -> None:
        """Undo ``start`` (a no-op when not active)."""
        while self._patched:
            owner, name, original = self._patched.pop()
            setattr(owner, name, original)
        if self._catcher is not None:
            catcher, self._catcher = self._catcher, None
            catcher.__exit__(None, None, None)  # restores the filters and showwarning

    def _show(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        if issubclass(category, UserWarning) and str(message).startswith(SYNC_MESSAGE):
            self._record(SYNC_MESSAGE, caller(sys._getframe(1)), False)
            return
        if self._shown is not None:
            self._shown(message, category, filename, lineno, file, line)

    def _wrap(self, original: Callable[..., Any], call: str) -> Callable[..., Any]:
        record = self._record

        def synchronising(*args: Any, **kwargs: Any) -> Any:
            record(call, caller(sys._getframe(1)), True)
            return original(*args, **kwargs)

        synchronising.__wrapped__ = original  # type: ignore[attr-defined]
        return synchronising


def _owners() -> Iterator[tuple[Any, str, str]]:
    """``EXPLICIT``'s owners that this torch has, with the attribute and the call."""
    owners = {"torch._C": torch._C, "torch.cuda.Event": getattr(torch.cuda, "Event", None)}
    for owner_name, name, call in EXPLICIT:
        owner = owners[owner_name]
        if owner is not None and hasattr(owner, name):
            yield owner, name, call


_PROTOTYPE_NOTED = False


def set_debug_mode(mode: int | str) -> None:
    """``torch.cuda.set_sync_debug_mode`` without its warning, once per process, that the mode is
    a prototype: the guard chose it knowingly, and the warning says nothing to a user."""
    global _PROTOTYPE_NOTED
    if _PROTOTYPE_NOTED and not torch.is_warn_always_enabled():  # TORCH_WARN_ONCE said it
        torch.cuda.set_sync_debug_mode(mode)
        return
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="Synchronization debug mode is a prototype", category=UserWarning
        )
        torch.cuda.set_sync_debug_mode(mode)
    _PROTOTYPE_NOTED = True


# ------------------------------------------------------------------- the GPU fixture of hits
# What the guard records on a GPU, kept as JSON under tests/fixtures/gpu/ so CPU tests replay it
# (tests/unit/test_syncguard_replay.py); scripts/gpu_probe_sync.py writes a fresh one.

FIXTURE_FORMAT = "offload-harness sync-guard hits, version 1"
OUTCOMES = ("pass", "fail", "n-a")


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """One offloader's guarded run in a fixture: what the guard recorded, and the verdict."""

    name: str
    expected: str
    """The sync check's status that offloader must get (one of ``OUTCOMES``)."""
    verdict: str = ""
    """The sync check's line on that machine ('' without a sync)."""
    windows: dict[str, int] = dataclasses.field(default_factory=dict)
    """Windows opened per kind (what the guard looked at)."""
    observed_d2h: int | None = None
    """D2H copies the harness's copy observer saw in the guarded step (None: not known)."""
    inert: str = ""
    """Why the row moves nothing by design (``harness.execute.predict.inert_reason``), if so."""
    note: str = ""
    hits: tuple[SyncHit, ...] = ()

    def record(self) -> dict[str, Any]:
        """The scenario as JSON fields."""
        fields = dataclasses.asdict(self)
        fields["hits"] = [hit.record() for hit in self.hits]
        return fields

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Scenario:
        """A scenario from its JSON fields; ValueError naming what is wrong."""
        name = record.get("name")
        if not isinstance(name, str) or record.get("expected") not in OUTCOMES:
            raise ValueError(f"a scenario needs a name and expected in {OUTCOMES}: {record!r}")
        unknown = sorted(set(record) - {f.name for f in dataclasses.fields(cls)})
        hits, windows = record.get("hits", []), record.get("windows", {})
        if unknown or not isinstance(hits, list) or not isinstance(windows, dict):
            raise ValueError(f"scenario {name}: unknown fields {unknown}, or hits not a list")
        d2h = record.get("observed_d2h")
        return cls(
            name=name,
            expected=record["expected"],
            verdict=str(record.get("verdict", "")),
            windows={str(kind): int(count) for kind, count in windows.items()},
            observed_d2h=None if d2h is None else int(d2h),
            inert=str(record.get("inert", "")),
            note=str(record.get("note", "")),
            hits=tuple(SyncHit.from_record(hit) for hit in hits),
        )


def fixture(scenarios: Sequence[Scenario], *, machine: str, provenance: str) -> dict[str, Any]:
    """The fixture document of ``scenarios`` (``read_fixture`` reads it back)."""
    return {
        "format": FIXTURE_FORMAT,
        "provenance": provenance,
        "machine": machine,
        "scenarios": [scenario.record() for scenario in scenarios],
    }


def read_fixture(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[Scenario]]:
    """The fixture at ``path``: its header fields and its scenarios; ValueError in one line
    naming the file when it is not one."""
    try:
        with open(path, encoding="utf-8") as handle:
            document = json.load(handle)
        if not isinstance(document, dict) or document.get("format") != FIXTURE_FORMAT:
            raise ValueError(f"not a {FIXTURE_FORMAT!r} document")
        scenarios = [Scenario.from_record(s) for s in document.get("scenarios", [])]
    except (OSError, ValueError, TypeError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"{path}: {exc}") from exc
    header = {key: value for key, value in document.items() if key != "scenarios"}
    return header, scenarios
