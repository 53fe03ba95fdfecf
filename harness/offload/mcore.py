"""Backend ``mcore``: megatron-core's own fine-grained activation offloader driving our models.

The adapter maps the harness protocol one to one onto megatron-core's public interface
(``megatron/core/pipeline_parallel/fine_grained_activation_offload.py``), so the manager, its
streams, its pinned pool and its policies (margin, delta, fraction, max in-flight) run
unchanged:

    begin_microbatch(m)   -> FineGrainedActivationOffloadingInterface.init_chunk_handler(...)
    model_chunk(c, n)     -> that call's vp_stage c and vp_size n (the interleaved schedule)
    group(name, x, layer) -> fine_grained_offloading_group_start(x, name)
    with group:           -> PipelineOffloadManager.__enter__/__exit__ (saved-tensor hooks)
    group.commit(y, rel)  -> fine_grained_offloading_group_offload(y, name, rel)
    mark_not_offloadable  -> FineGrainedActivationOffloadingInterface.mark_not_offload
    end_iteration()       -> FineGrainedActivationOffloadingInterface.reset()
    set_enabled(False)    -> disable_offload(), and no chunk handler while disabled (what a
                             model with the config flag off does)

Three things megatron-core expects from its surroundings are provided here:

* **TransformerEngine's CPU-offload flag.** Entering a group sets
  ``megatron.core.extensions.transformer_engine.cpu_offload.CPUOffloadEnabled`` (TE uses it to
  stay out of the way). Without TransformerEngine that module attribute is None and entering a
  group raises; the shim is a namespace holding just that flag (it is only ever assigned).
* **A process group.** The first reset after warmup prints a per-rank summary table with one
  ``all_gather_object`` and one ``barrier`` on the world group. Under torchrun the session's
  group is used; a single process gets a one-rank NCCL group on an in-memory store (no port),
  the group megatron-core's own models train on too (``harness.models.mcore``).
* **Attribution for the transfer counter.** megatron-core emits NVTX ranges, not profiler
  ranges. Each chunk handler's offload, bulk-reload and pop methods are wrapped (per instance,
  semantics untouched) to open the harness's ``record_function`` range for the group being
  copied, and to count copies and bytes for the iteration log. The ranges are only opened while
  a profiler runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import sys
import types
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, ClassVar

import torch

from harness.offload.config import OffloadConfig
from harness.offload.passthrough import PassThroughGroup
from harness.offload.protocol import Capabilities, GroupRecord, IterationLog, Output, declare
from harness.offload.ranges import profiler_range
from harness.offload.reference import RaceDelays
from harness.offload.semantics import COVERAGE, Semantics
from harness.util import distributed
from harness.util.installed import megatron_core_source

MODULE = "megatron.core.pipeline_parallel.fine_grained_activation_offload"
TE_EXTENSION = "megatron.core.extensions.transformer_engine"

GroupKey = tuple[int, int, str]


def unavailable_reason(device: torch.device | str) -> str | None:
    """Why the backend cannot run here (None when it can)."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return "backend 'mcore' needs a CUDA device (megatron-core's offloader uses CUDA streams)"
    try:
        importlib.import_module(MODULE)
    except ImportError as exc:
        return f"backend 'mcore' needs megatron-core (pip install -e '.[mcore]'): {exc}"
    return None


SEMANTICS_0_19 = Semantics(view_copy="gather", skip="object", label="megatron-core 0.19's rules")
"""megatron-core 0.19's copy rules: non-contiguous tensors are gathered (no whole-storage copy
of covering views), and only ``Parameter`` objects and tensors carrying the not-offload
attribute themselves are skipped (a ``W.t()`` saved by a matmul is moved)."""


@functools.cache
def installed_semantics() -> Semantics:
    """The copy rules of the installed megatron-core, read from its code: a chunk handler with
    ``BASE_OFFLOAD_MIN_COVERAGE`` copies a non-contiguous view covering at least that fraction
    of its storage as the whole storage (``coverage``, upstream main), one without gathers every
    view (``gather``, 0.19). The skip rule is the not-offload attribute on the tensor object in
    every version seen (``object``). Without an importable megatron-core (nothing to read; the
    backend cannot run then anyway), 0.19's rules."""
    try:
        handler = importlib.import_module(MODULE).ChunkOffloadHandler
    except (ImportError, AttributeError):
        return SEMANTICS_0_19
    version = megatron_core_source()["version"]
    coverage = getattr(handler, "BASE_OFFLOAD_MIN_COVERAGE", None)
    if coverage is None:
        return dataclasses.replace(SEMANTICS_0_19, label=f"megatron-core {version}'s rules")
    if coverage != COVERAGE:
        raise ValueError(
            f"megatron-core {version} copies views covering >= {coverage} of their storage "
            f"whole; the harness's prediction knows the {COVERAGE} rule only"
        )
    return Semantics(view_copy="coverage", skip="object", label=f"megatron-core {version}'s rules")


def provide_te_flag() -> str:
    """Make sure megatron-core finds TransformerEngine's CPU-offload flag object; returns what
    provides it (TransformerEngine's own module, or ``shim``)."""
    try:
        extension = importlib.import_module(TE_EXTENSION)
    except ImportError:
        extension = types.ModuleType(TE_EXTENSION)
        extension.cpu_offload = None  # type: ignore[attr-defined]
        sys.modules[TE_EXTENSION] = extension
    flag = getattr(extension, "cpu_offload", None)
    if flag is None:
        extension.cpu_offload = types.SimpleNamespace(CPUOffloadEnabled=False)  # type: ignore[attr-defined]
        return "shim"
    return getattr(flag, "__name__", type(flag).__name__)


def _where(keys: dict[int, GroupKey], group: Any) -> tuple[str, int, int]:
    """(name, microbatch, layer) of a megatron group for its profiler range (-1s when the
    adapter never saw it start: such copies stay unattributed)."""
    microbatch, layer, name = keys.get(id(group), (-1, -1, group._name))
    return name, microbatch, layer


def _sleep_on(stream: torch.cuda.Stream, cycles: int) -> None:
    if cycles:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class McoreOffloader:
    """megatron-core's ``PipelineOffloadManager`` behind the harness protocol (one live instance
    at a time: megatron-core's manager is a process-wide singleton, reset on construction)."""

    name = "mcore"
    semantics = SEMANTICS_0_19
    """megatron-core 0.19's copy rules (``SEMANTICS_0_19``); the backend record declares the
    installed megatron-core's (``installed_semantics``)."""
    capabilities: ClassVar[Capabilities] = Capabilities(
        description="megatron-core's own fine-grained offloader (CUDA, the mcore extra)",
        semantics=installed_semantics,
        race_delays=True,
        unavailable=unavailable_reason,
    )
    """Its backend record: the copy rules above, ``delays=``, CUDA and megatron-core only."""

    def __init__(
        self,
        config: OffloadConfig,
        device: torch.device | str,
        *,
        delays: RaceDelays | None = None,
        inline_reload_waits: bool = False,
    ) -> None:
        reason = unavailable_reason(device)
        if reason is not None:
            raise ValueError(reason)
        self.config = config
        self.delays = delays or RaceDelays()
        """GPU sleeps widening race windows: on megatron-core's D2H stream before each group's
        copies, on its H2D stream before each bulk reload, on the compute stream after each
        commit (the same places as the reference offloader's)."""
        self.inline_reload_waits = inline_reload_waits
        """Diagnostic, off by default: make the compute stream wait for a group's D2H event
        before an inline reload reads its host buffer (the ordering megatron-core 0.19 lacks,
        Megatron-LM #7398). A mismatch that disappears with it is that race."""
        self.device = torch.device(device)
        self.te_flag = provide_te_flag()
        self._mcore = importlib.import_module(MODULE)
        self._interface = self._mcore.FineGrainedActivationOffloadingInterface
        self._interface.reset_instance()
        self._manager = self._mcore.PipelineOffloadManager.get_instance()
        self._enabled = True
        self._microbatch = 0
        self._vp: tuple[int, int] | None = None
        """(vp_stage, vp_size) of the next chunk handler (``model_chunk``); None: no stages."""
        self._keys: dict[int, GroupKey] = {}
        """id(megatron OffloadTensorGroup) -> (microbatch, layer, name) of its occurrence."""
        self._wrapped: set[int] = set()
        self._counts: dict[GroupKey, Counter[str]] = {}
        self._logs: list[IterationLog] = []
        self._native = False
        self._windows: Any = None
        """The ``Windowed`` wrapper told of saved tensors while ``native`` (None: none)."""

    @property
    def enabled(self) -> bool:
        return self._enabled

    @contextlib.contextmanager
    def native(self, layer: Callable[[], int], windows: Any = None) -> Iterator[None]:
        """Watch megatron-core's own modules drive the manager (``harness.models.mcore``):
        its model forward opens the chunks, its layers the groups, its schedule resets. Inside,
        ``begin_microbatch`` only notes the microbatch and ``end_iteration`` does nothing; each
        group start is keyed by (microbatch, ``layer()``, name) and its chunk instrumented, a
        commit adds the compute-stream delay, and megatron-core's reset logs the iteration
        first. ``windows`` (a ``harness.measure.observe.Windowed`` around this offloader) is told
        each group start, commit and saved tensor, so its windows bracket the groups
        megatron-core's layers open as they bracket the ones the protocol opens."""
        mcore, interface = self._mcore, self._interface
        start = mcore.fine_grained_offloading_group_start
        commit = mcore.fine_grained_offloading_group_offload
        reset = inspect.getattr_static(interface, "reset")

        def group_start(tensor: torch.Tensor, name: str | None = None) -> Any:
            key = windows.window_started(layer(), str(name)) if windows is not None else None
            out = start(tensor, name)
            if key is not None:
                windows.window_input(key, out)
            self._started(str(name), layer())
            return out

        def group_offload(tensor: Any, name: str, *args: Any, **kwargs: Any) -> Any:
            out = None
            try:
                out = commit(tensor, name, *args, **kwargs)
            finally:
                if windows is not None:
                    windows.window_committed(str(name), out)
            if self.delays.compute:
                torch.cuda._sleep(self.delays.compute)
            return out

        def logged_reset(*args: Any, **kwargs: Any) -> None:
            # megatron-core's own signature: main's schedules pass reset(process_group=...)
            self._log_iteration()
            reset.__func__(*args, **kwargs)

        mcore.fine_grained_offloading_group_start = group_start
        mcore.fine_grained_offloading_group_offload = group_offload
        interface.reset = staticmethod(logged_reset)
        self._native, self._windows = True, windows
        try:
            yield
        finally:
            self._native, self._windows = False, None
            interface.reset = reset
            mcore.fine_grained_offloading_group_offload = commit
            mcore.fine_grained_offloading_group_start = start

    # -- protocol --------------------------------------------------------------------------

    def model_chunk(self, chunk: int, chunks: int) -> None:
        """The next pass runs virtual pipeline stage ``chunk`` of ``chunks``: megatron-core's
        manager orders its chunk handlers for backward by stage (it pushes the last stage's at
        once and the earlier stages' when a round of stages is complete), so it must be told."""
        self._vp = (chunk, chunks)

    def begin_microbatch(self, microbatch: int) -> None:
        self._microbatch = microbatch
        vp, self._vp = self._vp, None
        if not self._enabled or self._native:
            return
        c = self.config
        vp_stage, vp_size = vp if vp is not None else (None, None)
        self._interface.init_chunk_handler(
            c.pp_rank,
            vp_size,
            vp_stage,
            c.min_offloaded_tensor_size,
            c.delta_offload_bytes_across_pp_ranks,
            c.activation_offload_fraction,
            max_inflight_offloads=c.max_inflight_offloads,
        )

    def group(self, name: str, x: torch.Tensor, *, layer: int) -> McoreGroup | PassThroughGroup:
        if not self._enabled or name not in self.config.offload_modules:
            return PassThroughGroup(x)
        return McoreGroup(self, name, x, layer)

    def mark_not_offloadable(self, *tensors: torch.Tensor) -> None:
        for tensor in tensors:
            self._interface.mark_not_offload(tensor)

    def end_iteration(self) -> None:
        if self._native:  # megatron-core's schedule has reset (and logged) already
            return
        self._log_iteration()
        # First needed here: the post-warmup summary's collectives.
        distributed.ensure_process_group(self.device)
        self._interface.reset()

    def _log_iteration(self) -> None:
        if self._manager._cached_chunks_forward or self._logs:
            self._logs.append(self._iteration_log())
        self._counts = {}

    def set_enabled(self, enabled: bool) -> None:
        self._enabled = enabled
        if enabled:
            self._interface.enable_offload()
        else:
            self._interface.disable_offload()

    def iteration_logs(self) -> list[IterationLog]:
        return list(self._logs)

    def close(self) -> None:
        # Drop the singleton (and with it the streams and the pinned pool) instead of leaving a
        # manager with this run's chunks behind for the next backend instance.
        self._mcore.PipelineOffloadManager.OFFLOAD_MGR = None
        self._manager = None
        self._keys.clear()

    # -- bookkeeping -------------------------------------------------------------------------

    def _started(self, name: str, layer: int) -> None:
        """After a group start: remember which megatron group this occurrence is, and
        instrument its chunk once."""
        chunk = self._manager.cur_forward_chunk()
        if chunk is None or not chunk.do_offload:
            return
        group = chunk.offload_groups[chunk._offloaded_group_index - 1]
        self._keys[id(group)] = (self._microbatch, layer, name)
        if id(chunk) not in self._wrapped:
            self._wrapped.add(id(chunk))
            self._instrument(chunk)

    def _count(self, group: Any, field: str, amount: int = 1) -> None:
        key = self._keys.get(id(group))
        if key is not None:
            self._counts.setdefault(key, Counter())[field] += amount

    def _instrument(self, chunk: Any) -> None:
        """Wrap the chunk's copy paths: profiler ranges and counters, same calls underneath."""
        keys, count, delays = self._keys, self._count, self.delays
        inline_waits = self.inline_reload_waits
        offload_group: Callable[[Any], None] = chunk.bulk_offload_group
        reload_group: Callable[[], None] = chunk.bulk_reload_group
        tensor_push: Callable[[Any], Any] = chunk.tensor_push
        tensor_pop: Callable[[Any], Any] = chunk.tensor_pop

        def bulk_offload_group(group: Any) -> None:
            before = {tag for tag, v in group._tensors.items() if isinstance(v, tuple)}
            _sleep_on(chunk.d2h_stream, delays.d2h)
            with profiler_range("d2h", *_where(keys, group)):
                offload_group(group)
            for tag, state in group._tensors.items():
                if isinstance(state, tuple) and tag not in before:
                    count(group, "d2h_copies")
                    count(group, "d2h_bytes", _nbytes(state[1]))

        def bulk_reload_group() -> None:
            group = chunk._groups_to_reload[-1]
            states = [v for v in group._tensors.values() if isinstance(v, tuple)]
            _sleep_on(chunk.h2d_stream, delays.h2d)
            with profiler_range("h2d", *_where(keys, group)):
                reload_group()
            for state in states:
                count(group, "h2d_copies")
                count(group, "h2d_bytes", _nbytes(state[1]))

        def push(tensor: Any) -> Any:
            tag = tensor_push(tensor)
            if isinstance(tag, tuple):
                group = chunk.offload_groups[tag[0] - 1]
                count(group, "tracked")
                key = keys.get(id(group))
                if self._windows is not None and key is not None:
                    self._windows.window_saved(tensor, key)
            return tag

        def pop(tag: Any) -> Any:
            if not isinstance(tag, tuple):
                return tensor_pop(tag)
            group = chunk.offload_groups[tag[0] - 1]
            state = group._tensors.get(tag)
            if not isinstance(state, tuple):  # on the GPU: kept, or reloaded in bulk already
                return tensor_pop(tag)
            # Inline reload on the compute stream (no bulk reload reached this tensor).
            count(group, "h2d_copies")
            count(group, "h2d_bytes", _nbytes(state[1]))
            count(group, "inline_reloads")
            if inline_waits:
                torch.cuda.current_stream().wait_event(group._offload_event)
            with profiler_range("h2d", *_where(keys, group)):
                return tensor_pop(tag)

        chunk.bulk_offload_group = bulk_offload_group
        chunk.bulk_reload_group = bulk_reload_group
        chunk.tensor_push = push
        chunk.tensor_pop = pop

    def _iteration_log(self) -> IterationLog:
        manager = self._manager
        warmup = bool(manager._is_warmup)
        records = []
        leaked = 0
        for chunk in manager._cached_chunks_forward:
            for group in chunk.offload_groups:
                leaked += len(group._tensors)
                key = self._keys.get(id(group))
                if key is None:
                    continue
                c = self._counts.get(key, Counter())
                records.append(
                    GroupRecord(
                        microbatch=key[0],
                        layer=key[1],
                        name=key[2],
                        decision="offloaded" if c["d2h_copies"] else "kept",
                        tracked=c["tracked"],
                        d2h_copies=c["d2h_copies"],
                        d2h_bytes=c["d2h_bytes"],
                        h2d_copies=c["h2d_copies"],
                        h2d_bytes=c["h2d_bytes"],
                    )
                )
        stats = manager.cpu_tensor_pool._stats
        return IterationLog(
            iteration=len(self._logs),
            warmup=warmup,
            groups=tuple(records),
            leaked_tensors=leaked,
            pool_in_use=int(stats["current_in_use"]),
            pool_allocated=int(stats["total_allocated"]),
        )


@declare(
    McoreOffloader.capabilities,
    description="megatron-core's offloader plus the D2H wait its inline reload lacks (#7398)",
)
def with_inline_reload_wait(
    config: OffloadConfig, device: torch.device | str, *, delays: RaceDelays | None = None
) -> McoreOffloader:
    """Backend ``mcore.inline-wait``: megatron-core's offloader plus the one stream edge its
    inline reload path lacks (see ``McoreOffloader.inline_reload_waits``)."""
    return McoreOffloader(config, device, delays=delays, inline_reload_waits=True)


class McoreGroup:
    """One group occurrence driven through megatron-core's start / hooks / commit calls."""

    def __init__(self, owner: McoreOffloader, name: str, x: torch.Tensor, layer: int) -> None:
        self._owner = owner
        self.name = name
        self.input = owner._mcore.fine_grained_offloading_group_start(x, name)
        owner._started(name, layer)

    def __enter__(self) -> McoreGroup:
        self._owner._manager.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._owner._manager.__exit__(exc_type, exc, tb)

    def commit(self, output: Output, release: Sequence[torch.Tensor] = ()) -> Output:
        out = self._owner._mcore.fine_grained_offloading_group_offload(
            output, self.name, list(release), False
        )
        if self._owner.delays.compute:
            torch.cuda._sleep(self._owner.delays.compute)
        return out  # type: ignore[no-any-return]
