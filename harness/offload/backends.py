"""Backend selection: a name (``reference``, ``none``, ``hooks``, ``broken.<name>``) or
``package.module:factory``, optionally with race delays.

A factory is any callable ``(config: OffloadConfig, device: torch.device) -> Offloader``
(``harness.offload.protocol``). Resolution happens once, up front, so a bad name is a one-line
``ValueError`` before any model is built; a module that raises at import (any exception, a
``SyntaxError`` too) is one as well. ``probe_backend`` then calls the factory once and checks
that it returns an ``Offloader`` (the entry points do so through ``harness.run.settings``). What the
harness knows about a backend beyond that comes from the ``Capabilities`` record its factory
declares (``capabilities(spec)``).

Race provocation (CUDA only): ``<backend>+delays`` runs the reference offloader or a broken one
with ``DEFAULT_RACE_DELAYS``; ``<backend>+delays:d2h=N,h2d=N,compute=N`` chooses the sleep
cycles (``harness.offload.reference.RaceDelays``; about 2000 cycles per microsecond on an H200).

The table (``BACKENDS``) holds factory paths, not factories, and registers the broken
offloaders lazily: their entries come from their catalogue (``harness.offload.broken.OFFLOADERS``),
read when a name outside the fixed entries is first looked up or the backends are first listed,
so importing this module does not import them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from harness.offload.config import OffloadConfig
from harness.offload.copies import LONG_DELAY
from harness.offload.protocol import Capabilities, Offloader
from harness.offload.reference import RaceDelays
from harness.offload.semantics import Semantics
from harness.util import globalstate

Factory = Callable[[OffloadConfig, torch.device], Offloader]

PROBE_CONFIG = OffloadConfig(offload_modules=("core_attn",))
"""What ``probe_backend`` builds a backend with: one group name every model with attention
opens, the default policies."""

OFFLOADER_MEMBERS: tuple[str, ...] = (
    *Offloader.__annotations__,
    *(name for name, value in vars(Offloader).items() if callable(value) and name[0] != "_"),
)
"""What an ``Offloader`` must have (``harness.offload.protocol``): ``name``, then its methods in
declaration order."""


@dataclass(frozen=True, kw_only=True)
class BackendEntry:
    """One named backend: its name, where its factory lives, what it is there for, and what
    must be installed beyond torch for it to import."""

    name: str
    factory: str
    """``module:attribute`` of its factory, imported when the name is resolved (so an
    optional module costs nothing until it is named)."""
    role: str
    """One of ``ROLES``: ``offloader`` (the one under test by default), ``baseline`` (the runs
    the offload run is compared with), ``broken`` (a known bug, for the detection power),
    ``adapter`` (another project's offloader)."""
    extra: str | None = None
    """What its module needs beyond torch: an extra of this project (``mcore``) or a package
    (``transformer-engine``); None: nothing."""


ROLES = ("offloader", "baseline", "broken", "adapter")

_BEFORE_BROKEN: tuple[BackendEntry, ...] = (
    BackendEntry(
        name="reference", factory="harness.offload.reference:OffloadContext", role="offloader"
    ),
    BackendEntry(name="none", factory="harness.offload.passthrough:NoOffload", role="baseline"),
    BackendEntry(
        name="hooks", factory="harness.offload.recorder:RecordingOffloader", role="baseline"
    ),
)
_AFTER_BROKEN: tuple[BackendEntry, ...] = (
    BackendEntry(
        name="mcore", factory="harness.offload.mcore:McoreOffloader", role="adapter", extra="mcore"
    ),
    BackendEntry(
        name="mcore.inline-wait",
        factory="harness.offload.mcore:with_inline_reload_wait",
        role="adapter",
        extra="mcore",
    ),
    BackendEntry(name="save-on-cpu", factory="harness.offload.adapters:SaveOnCpu", role="adapter"),
    BackendEntry(
        name="te",
        factory="harness.offload.adapters:TeCpuOffload",
        role="adapter",
        extra="transformer-engine",
    ),
)
_FIXED: dict[str, BackendEntry] = {e.name: e for e in (*_BEFORE_BROKEN, *_AFTER_BROKEN)}
"""The entries that are not the broken catalogue's, by name: looked up without reading it."""


@functools.cache
def _table() -> tuple[BackendEntry, ...]:
    """``BACKENDS``: the fixed entries around the broken catalogue's, read here, once."""
    from harness.offload.broken import OFFLOADERS  # the catalogue, on first listing or lookup

    broken = (
        BackendEntry(
            name=record.name,
            factory=f"{record.factory.__module__}:{record.factory.__qualname__}",
            role="broken",
        )
        for record in OFFLOADERS
    )
    return (*_BEFORE_BROKEN, *broken, *_AFTER_BROKEN)


@functools.cache
def _named() -> dict[str, BackendEntry]:
    return {entry.name: entry for entry in _table()}


if TYPE_CHECKING:
    BACKENDS: tuple[BackendEntry, ...]
    """Every named backend, in the order ``offload-harness backends`` lists them: the
    reference, the two baselines (``none``, ``hooks``), every broken offloader of
    ``harness.offload.broken``, then the adapters. ``mcore`` drives megatron-core's own
    offloader (CUDA and the ``mcore`` extra); ``mcore.inline-wait`` adds the D2H wait its inline
    reload lacks, to localise Megatron-LM #7398. Built on first use (``__getattr__``)."""
    NAMED: dict[str, BackendEntry]
    """Every named backend by name (built on first use)."""


def __getattr__(name: str) -> Any:
    """``BACKENDS`` and ``NAMED``, built when first asked for (PEP 562): the broken catalogue
    is imported then, not with this module."""
    if name == "BACKENDS":
        return _table()
    if name == "NAMED":
        return _named()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def entry_named(name: str) -> BackendEntry | None:
    """The table's entry called ``name``, or None; the broken catalogue is read only for a name
    outside the fixed entries."""
    return _FIXED.get(name) or _named().get(name)


UNDECLARED = Capabilities()
"""The record of a factory that declares none: no description, no semantics (the prediction
learns its rule from what it does, ``harness.execute.learn``, and says so), no race delays, runs
anywhere."""

DELAYS = "+delays"
DEFAULT_RACE_DELAYS = RaceDelays(d2h=LONG_DELAY, h2d=LONG_DELAY)
"""``<backend>+delays`` without values: both copy streams slowed by about 10 ms per group."""


@dataclass(frozen=True, kw_only=True)
class Backend:
    """A ``--backend`` resolved once, at the entry point (``harness.run.settings``), and passed on
    as this record: what it is called, where its factory lives, what it is for and what it
    declares. Everything after the entry point reads these fields instead of parsing the
    spelling again.

    It pickles as its spelling and is resolved again where it is unpickled (a worker process
    imports the factory's module anyway, and a factory's record may hold a function that does
    not pickle, such as a test's lambda); equality is the spelling's."""

    spelling: str
    """As given and reported (``summary.json``, the repro command): a name or
    ``package.module:factory``, with ``+delays[:...]`` where race delays apply."""
    name: str = field(compare=False)
    """The spelling without its race delays."""
    factory_path: str = field(compare=False)
    """``module:attribute`` of the factory."""
    role: str = field(compare=False)
    """The table's (``BackendEntry.role``); ``custom`` for an import path."""
    extra: str | None = field(compare=False, default=None)
    """What its module needs beyond torch (``BackendEntry.extra``)."""
    delays: RaceDelays | None = field(compare=False, default=None)
    """The race delays its spelling adds (None: none)."""
    capabilities: Capabilities = field(compare=False, default=Capabilities())
    """What its factory declares (``UNDECLARED`` when nothing)."""
    factory: Factory = field(compare=False, repr=False, default=None)  # type: ignore[assignment]
    """The factory itself (``(config, device) -> Offloader``)."""

    def __str__(self) -> str:
        return self.spelling

    def __reduce__(self) -> tuple[Callable[[str], Backend], tuple[str]]:
        return backend_record, (self.spelling,)

    def build(self, config: OffloadConfig, device: torch.device) -> Offloader:
        """A fresh offloader of this backend."""
        return self.factory(config, device)

    @property
    def semantics(self) -> Semantics | None:
        """The copy rules its factory declares, or None (learned from what it does); a factory
        that declares a function gets it called here, when first needed (megatron-core's rules
        are read from the installed library)."""
        return _called(self.capabilities.semantics, self.spelling)

    def unavailable(self, device: torch.device) -> str | None:
        """Why it cannot run on ``device`` (its record's ``unavailable``), or None."""
        check = self.capabilities.unavailable
        return None if check is None else check(device)


def backend_record(spec: str | Backend) -> Backend:
    """``spec`` resolved into a ``Backend`` (a ``ValueError`` as ``resolve_backend``'s); a
    record is returned as it is."""
    if isinstance(spec, Backend):
        return spec
    factory = resolve_backend(spec)
    base, plus, tail = spec.partition(DELAYS)
    entry = entry_named(base)
    delays = None
    if plus:
        delays = parse_race_delays(tail[1:]) if tail else DEFAULT_RACE_DELAYS
    return Backend(
        spelling=spec,
        name=base,
        factory_path=entry.factory if entry is not None else base,
        role=entry.role if entry is not None else "custom",
        extra=entry.extra if entry is not None else None,
        delays=delays,
        capabilities=_declared(factory, spec),
        factory=factory,
    )


def backend_names() -> list[str]:
    """Every name ``resolve_backend`` accepts without an import path."""
    return list(_named())


def describe(name: str) -> str:
    """A short description of a named backend (its record's, else where it comes from)."""
    entry = entry_named(name)
    adapter = entry if entry is not None and entry.role == "adapter" else None
    try:
        text = capabilities(name).description
    except ValueError:
        if adapter is None:
            raise
        text = ""  # its optional module does not import here
    return text or f"optional backend ({adapter.factory if adapter is not None else name})"


def capabilities(spec: str) -> Capabilities:
    """The ``Capabilities`` record a backend's factory declares (``harness.offload.protocol``),
    or ``UNDECLARED`` for a factory that declares none."""
    record = _declared(resolve_backend(spec), spec)
    if callable(record.semantics):  # read from the installed library when first asked
        record = dataclasses.replace(record, semantics=_called(record.semantics, spec))
    return record


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
    entry = entry_named(spec)
    if entry is not None:
        return _import_factory(entry.factory, shown=spec)
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


def probe_backend(spec: str, device: torch.device) -> None:
    """Build the backend once with ``PROBE_CONFIG`` on ``device``, check that the factory returned
    an ``Offloader`` and close it again, so a factory that raises or returns something else is a
    one-line ``ValueError`` before any training (instead of a secondary error after the
    baselines have trained).

    No model is built and nothing is run through the offloader: the factory is called once and
    its ``close()`` once. A backend whose record says it is ``unavailable`` on ``device`` is not
    called (megatron-core's needs CUDA and megatron-core; the run reports that reason itself).

    On CPU, and on CUDA in a process that has initialised CUDA already, the factory is called
    here (the built-ins cost microseconds on CPU; on CUDA the reference takes its two copy
    streams from PyTorch's stream pool). A process that has not initialised CUDA must stay
    without it (the CLI's parent only names the device; its cases run in worker processes), so
    on CUDA there the probe runs in one child Python process with this one's ``sys.path`` (a
    few seconds: it imports torch and makes a CUDA context of its own). A child that sees no
    CUDA device, dies or outlasts ``PROBE_TIMEOUT_S`` proves nothing, and the run goes ahead."""
    resolve_backend(spec)
    if backend_unavailable(spec, device) is not None:
        return
    if device.type == "cuda" and not torch.cuda.is_initialized():
        problem = _probe_in_child(spec, device)
        if problem is not None:
            raise ValueError(problem)
        return
    _call_factory(spec, device)


PROBE_TIMEOUT_S = 300.0
"""How long the child probe on CUDA may take (importing megatron-core and TransformerEngine for
``mcore`` is the slowest known) before it counts as inconclusive."""

_ANSWER = "offload-harness-probe:"
"""Prefix of the child probe's answer line on its stdout (a backend module may print too)."""


def _probe_in_child(spec: str, device: torch.device) -> str | None:
    """``probe_backend``'s error line from a fresh Python process with this one's ``sys.path``
    (None: no error, or nothing known). Its output is captured, never shown."""
    code = (
        "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
        "from harness.offload.backends import _child_probe; _child_probe(*sys.argv[2:])"
    )
    argv = [sys.executable, "-c", code, json.dumps(sys.path), spec, str(device)]
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.SubprocessError):  # no interpreter to start, or too slow
        return None
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(_ANSWER):
            try:
                answer = json.loads(line[len(_ANSWER) :])
            except ValueError:
                return None
            return answer if isinstance(answer, str) else None
    return None  # it died before answering


def _child_probe(spec: str, device: str) -> None:
    """In the child: probe on ``device`` and print the answer line (the error line, or null)."""
    answer: str | None = None
    if torch.cuda.is_available():  # else this child cannot tell anything about the device
        try:
            resolve_backend(spec)
            _call_factory(spec, torch.device(device))
        except ValueError as exc:
            answer = str(exc)
    print(_ANSWER + json.dumps(answer), flush=True)


def _call_factory(spec: str, device: torch.device) -> None:
    """The probe itself, in this process (whatever process-global torch state the backend
    changes when built is undone: its cases' runs judge that, ``harness.util.globalstate``)."""
    factory = resolve_backend(spec)
    try:
        with globalstate.restoring():
            offloader = factory(PROBE_CONFIG, device)
    except Exception as exc:
        raise ValueError(f"backend {spec!r}: the factory raised {exception_line(exc)}") from None
    if offloader is None:
        raise ValueError(f"backend {spec!r}: the factory returned None, not an Offloader")
    missing = [member for member in OFFLOADER_MEMBERS if _lacks(offloader, member)]
    if missing or not isinstance(offloader, Offloader):
        kind = type(offloader)
        shown = kind.__qualname__
        if kind.__module__ != "builtins":
            shown = f"{kind.__module__}.{shown}"
        close = getattr(offloader, "close", None)
        if callable(close):  # release whatever it holds; its own error is beside the point
            with contextlib.suppress(Exception):
                close()
        lacking = f" without {', '.join(missing)}" if missing else ""
        raise ValueError(
            f"backend {spec!r}: the factory returned {shown}{lacking}, not an Offloader "
            "(harness.offload.protocol)"
        )
    try:
        offloader.close()
    except Exception as exc:
        raise ValueError(
            f"backend {spec!r}: close() of a fresh offloader raised {exception_line(exc)}"
        ) from None


def _lacks(offloader: object, member: str) -> bool:
    """Whether ``offloader`` has no ``member`` (for a method: nothing callable by that name)."""
    try:
        value = getattr(offloader, member)
    except Exception:  # AttributeError, or a property that raises
        return True
    return member != "name" and not callable(value)


def exception_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (``Type`` alone without one); a ``SyntaxError``
    names its file and line."""
    text = _first_line(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    text = lines[0].strip() if lines else ""
    if isinstance(exc, SyntaxError) and exc.filename and f"line {exc.lineno}" not in text:
        text = f"{exc.msg} ({os.path.basename(exc.filename)}, line {exc.lineno})"
    return text


def _declared(factory: Factory, shown: str) -> Capabilities:
    record = getattr(factory, "capabilities", UNDECLARED)
    if not isinstance(record, Capabilities):
        raise ValueError(
            f"backend {shown!r}: its factory's capabilities is a {type(record).__name__}, not a "
            "harness.offload.protocol.Capabilities"
        )
    if not callable(record.semantics):  # a function returning one is checked when called
        _declared_semantics(record.semantics, shown)
    return record


def _called(semantics: object, shown: str) -> Semantics | None:
    """Declared semantics as a rule: a factory that declares a function (megatron-core's rules,
    read from the installed library) has it called here and its result checked."""
    if callable(semantics):
        semantics = semantics()
        _declared_semantics(semantics, shown)
    return semantics  # type: ignore[return-value]


def _declared_semantics(semantics: object, shown: str) -> None:
    if semantics is not None and not isinstance(semantics, Semantics):
        raise ValueError(
            f"backend {shown!r}: its capabilities' semantics is a "
            f"{type(semantics).__name__}, not a harness.offload.semantics.Semantics"
        )


def _import_here_too(module_name: str) -> object:
    """Import ``module_name``; a top-level module found in the current directory but not on the
    import path (a console script, unlike ``python -m``, does not put the current directory
    there) is imported from the current directory, which is appended to ``sys.path``."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = module_name.partition(".")[0]
        here = os.getcwd()
        if exc.name != top or here in sys.path:
            raise
        if not (os.path.isfile(f"{top}.py") or os.path.isfile(os.path.join(top, "__init__.py"))):
            raise
        sys.path.append(here)
        return importlib.import_module(module_name)


def _import_factory(path: str, *, shown: str) -> Factory:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"backend {shown!r}: an import path looks like package.module:factory")
    try:
        module = _import_here_too(module_name)
    except ImportError as exc:
        missing_itself = (
            isinstance(exc, ModuleNotFoundError) and exc.name == module_name.partition(".")[0]
        )
        where = (
            f"; looked on the import path and in the current directory {os.getcwd()}: put the "
            "folder that holds it on PYTHONPATH"
            if missing_itself
            else ""
        )
        raise ValueError(
            f"backend {shown!r}: cannot import {module_name!r} ({_first_line(exc)}{where})"
        ) from None
    except Exception as exc:  # the module's own code failed: any exception, one line
        raise ValueError(
            f"backend {shown!r}: importing {module_name} raised {exception_line(exc)}"
        ) from None
    try:
        factory = getattr(module, attr, None)
    except Exception as exc:  # a module __getattr__ that raises
        raise ValueError(
            f"backend {shown!r}: looking up {attr!r} in {module_name} raised {exception_line(exc)}"
        ) from None
    if not callable(factory):
        raise ValueError(f"backend {shown!r}: {module_name} has no callable {attr!r}")
    _declared(factory, shown)  # a malformed record is a resolution error too
    return factory  # type: ignore[no-any-return]
