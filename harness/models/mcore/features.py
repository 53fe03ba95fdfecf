"""What the installed megatron-core offers, found by feature rather than by version string.

Each thing the bridge, the ``mcore`` backend or a row needs is one ``Feature`` record: an
attribute, a config field or a function signature, probed in the installed code. A feature the
harness cannot run without (``required``) that is missing is one line naming it and the
version that has it (``missing_line``), raised before any training: exit 2 in the CLI,
``pytest.UsageError`` in pytest (``required_missing``). A row that needs an optional feature
(Megatron-FSDP v2, the pinned activation buffer) is refused with the same line where the
installed megatron-core lacks it (``refusal``), so it skips instead of failing mid-run.

The backend's rules are read from the installed code too (``installed_rules``): how a
non-contiguous view is copied, the skip rule, the pinned pool or arena, and the offload module
names megatron-core accepts (parsed from ``TransformerConfig.__post_init__``, not run).

A probe says a feature is missing only on purpose: it raises ``Absent`` (its helpers do when a
module, attribute, field or parameter they look up is not there). A module that exists but
does not import here (a dependency missing: TransformerEngine, triton) leaves the feature
``Unprobed``: neither found nor missing, and its line says which import failed. Anything else a
probe raises is a bug in the probe (or in how it reads this megatron-core), never a missing
feature: it propagates as a ``ProbeError`` naming the probe, so it fails a run instead of
refusing a row.

``python -m harness.models.mcore.features`` prints what it found, one line per feature.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import re
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harness.models.mcore.environment import apply_environment
from harness.util.installed import megatron_core_source
from harness.vocab.groups import GROUPS

OFFLOAD = "megatron.core.pipeline_parallel.fine_grained_activation_offload"
CONFIG = "megatron.core.transformer.transformer_config"
DDP_CONFIG = "megatron.core.distributed.distributed_data_parallel_config"
FSDP_ADAPTER = "megatron.core.distributed.fsdp.mcore_fsdp_adapter"
FSDP_EXPERIMENTAL = "megatron.core.distributed.fsdp.src.megatron_fsdp.experimental"

MAIN_SNAPSHOT = "Megatron-LM main at d98e8a64dd (0.20.0, 2026-08-22)"
"""The newest upstream code the harness was checked against (docs/megatron-core.md)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Feature:
    """One thing the harness needs from megatron-core, and how to find it."""

    name: str
    what: str
    """The attribute, field or signature, as the missing line names it."""
    since: str
    """Which megatron-core has it (the missing line's "which ... has")."""
    needed_by: str
    """What in the harness uses it."""
    probe: Callable[[], str]
    """Returns what it found (one short phrase); raises ``Absent`` when the feature is not
    there, ``Unprobed`` when a module it reads does not import here."""
    required: bool = False
    """The bridge or the backend cannot run at all without it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Finding:
    """A feature probed in the installed megatron-core."""

    feature: Feature
    present: bool
    detail: str
    probed: bool = True
    """False when a module the probe reads does not import here (``Unprobed``): not present,
    and not known to be missing either."""


class Absent(Exception):
    """Raised by a probe, on purpose, when what it looks for is not in the installed
    megatron-core: the feature is missing."""


class Unprobed(Exception):
    """A module a probe reads is installed but does not import here (a dependency of it is
    missing): the feature can be neither found nor called missing."""


class ProbeError(RuntimeError):
    """A probe raised what no probe raises on purpose: a bug in the probe, or in how it reads
    this megatron-core - never a missing feature."""


def _module(name: str) -> Any:
    """Module ``name``: ``Absent`` where it (or a package above it) does not exist,
    ``Unprobed`` where it exists but its import fails for want of another module."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and f"{name}.".startswith(f"{exc.name}."):
            raise Absent(f"no module {name}") from exc
        raise Unprobed(f"import {name} failed: {exc}") from exc
    except ImportError as exc:
        raise Unprobed(f"import {name} failed: {exc}") from exc


def _attr(owner: Any, name: str) -> Any:
    """``owner.name``, ``Absent`` where it has none."""
    _has(owner, name)
    return getattr(owner, name)


def _has(owner: Any, *names: str) -> None:
    missing = [n for n in names if not hasattr(owner, n)]
    if missing:
        raise Absent(f"{getattr(owner, '__name__', owner)} has no {', '.join(missing)}")


def _fields(cls: Any, *names: str) -> None:
    if not dataclasses.is_dataclass(cls):
        raise Absent(f"{cls.__name__} is no dataclass (its fields are not declared)")
    fields = {f.name for f in dataclasses.fields(cls)}
    missing = [n for n in names if n not in fields]
    if missing:
        raise Absent(f"{cls.__name__} has no field {', '.join(missing)}")


def _takes(function: Any, parameter: str) -> None:
    if parameter not in inspect.signature(function).parameters:
        raise Absent(f"{function.__qualname__} takes no {parameter!r}")


OFFLOAD_FIELDS = (
    "fine_grained_activation_offloading",
    "offload_modules",
    "min_offloaded_tensor_size",
    "activation_offload_fraction",
    "fine_grained_offloading_max_inflight_offloads",
    "delta_offload_bytes_across_pp_ranks",
)
"""``TransformerConfig`` fields ``transformer_config`` sets from a case's ``OffloadConfig``."""


def _offload_fields() -> str:
    _fields(_attr(_module(CONFIG), "TransformerConfig"), *OFFLOAD_FIELDS)
    return "TransformerConfig has the six offloading fields"


def _interface() -> str:
    offload = _module(OFFLOAD)
    _has(offload, "fine_grained_offloading_group_start", "fine_grained_offloading_group_offload")
    _has(offload, "PipelineOffloadManager", "FineGrainedActivationOffloadingInterface")
    _has(offload.PipelineOffloadManager, "get_instance")  # both checked just above
    interface = offload.FineGrainedActivationOffloadingInterface
    _has(interface, "init_chunk_handler", "reset", "reset_instance", "mark_not_offload")
    _has(interface, "enable_offload", "disable_offload", "get_context")
    _takes(interface.init_chunk_handler, "max_inflight_offloads")
    return "FineGrainedActivationOffloadingInterface with max_inflight_offloads"


def _copy_paths() -> str:
    handler = _attr(_module(OFFLOAD), "ChunkOffloadHandler")
    _has(handler, "bulk_offload_group", "bulk_reload_group", "tensor_push", "tensor_pop")
    return "ChunkOffloadHandler's bulk offload/reload, push and pop"


MANAGER_STATE = (
    "cpu_tensor_pool",
    "_cached_chunks_forward",
    "_is_warmup",
    "offload_groups",
    "_offloaded_group_index",
    "_groups_to_reload",
    "_tensors",
    "_offload_event",
    "d2h_stream",
    "h2d_stream",
    "OFFLOAD_MGR",
)
"""Instance attributes of megatron-core's manager, chunk handlers and groups the backend reads
for its iteration log and counters (``harness.offload.mcore``): made on CUDA only, so they are
looked for as assignments in the module's source."""


def _manager_state() -> str:
    source = inspect.getsource(_module(OFFLOAD))
    missing = [n for n in MANAGER_STATE if not re.search(rf"\.{n}\b[^\n=]*=(?!=)", source)]
    if missing:
        raise Absent(f"no assignment of {', '.join(missing)} in {OFFLOAD}")
    return f"the {len(MANAGER_STATE)} manager, chunk and group attributes the log reads"


def _hybrid_model() -> str:
    for name in ("megatron.core.models.hybrid.hybrid_model", "megatron.core.models.gpt.gpt_model"):
        _module_exists(name)
    return "HybridModel and GPTModel modules"


def _module_exists(name: str) -> None:
    """``Absent`` where module ``name`` does not exist (its package is imported to look,
    not the module itself: ``Unprobed`` where the package does not import here)."""
    package, _, _ = name.rpartition(".")
    if package:
        _module(package)
    if importlib.util.find_spec(name) is None:
        raise Absent(f"no module {name}")


def _reset_group() -> str:
    interface = _attr(_module(OFFLOAD), "FineGrainedActivationOffloadingInterface")
    _takes(_attr(interface, "reset"), "process_group")
    return "reset(process_group=...): the post-warmup summary runs on the schedule's group"


def _coverage() -> str:
    handler = _attr(_module(OFFLOAD), "ChunkOffloadHandler")
    coverage = _attr(handler, "BASE_OFFLOAD_MIN_COVERAGE")
    return f"views covering >= {coverage:g} of their storage copied whole"


def _mfsdp_v1() -> str:
    _fields(_attr(_module(DDP_CONFIG), "DistributedDataParallelConfig"), "use_megatron_fsdp")
    _has(_module("megatron.core.distributed.fsdp"), "FullyShardedDataParallel")
    return "DistributedDataParallelConfig.use_megatron_fsdp"


def _mfsdp2_blocks() -> str:
    _has(_module(FSDP_EXPERIMENTAL), "Flat", "Placements", "fully_shard", "fully_shard_optimizer")
    return "experimental fully_shard with Flat placements and fully_shard_optimizer"


def _mfsdp_v2() -> str:
    _fields(_attr(_module(DDP_CONFIG), "DistributedDataParallelConfig"), "megatron_fsdp_version")
    _has(_module(FSDP_ADAPTER), "FullyShardedDataParallelV2")
    return "megatron_fsdp_version=2 builds FullyShardedDataParallelV2"


def _pinned_buffer() -> str:
    config = _attr(_module(CONFIG), "TransformerConfig")
    _fields(config, "fine_grained_offloading_buffer_size_gib")
    _has(_module(OFFLOAD), "PinnedActivationBuffer")
    return "PinnedActivationBuffer, fine_grained_offloading_buffer_size_gib"


def _module_names() -> str:
    return ", ".join(offered_modules())


_FEATURES = (
    Feature(
        name="offload_config_fields",
        what="TransformerConfig's fine-grained offloading fields ("
        + ", ".join(OFFLOAD_FIELDS)
        + ")",
        since="megatron-core 0.19",
        needed_by="every mcore row (the case's offload knobs)",
        probe=_offload_fields,
        required=True,
    ),
    Feature(
        name="offload_interface",
        what="FineGrainedActivationOffloadingInterface (init_chunk_handler with "
        "max_inflight_offloads, reset, mark_not_offload, enable/disable_offload), "
        "PipelineOffloadManager and the group start/offload functions",
        since="megatron-core 0.19",
        needed_by="the mcore backend and the bridge",
        probe=_interface,
        required=True,
    ),
    Feature(
        name="chunk_copy_paths",
        what="ChunkOffloadHandler.bulk_offload_group/bulk_reload_group/tensor_push/tensor_pop",
        since="megatron-core 0.19",
        needed_by="the mcore backend's attribution and race delays",
        probe=_copy_paths,
        required=True,
    ),
    Feature(
        name="manager_state",
        what="the offload manager's, chunk handlers' and groups' state the backend's log reads "
        f"({', '.join(MANAGER_STATE)})",
        since="megatron-core 0.19",
        needed_by="the mcore backend's iteration log",
        probe=_manager_state,
        required=True,
    ),
    Feature(
        name="models",
        what="megatron.core.models.hybrid.hybrid_model and megatron.core.models.gpt.gpt_model",
        since="megatron-core 0.19",
        needed_by="--family mcore",
        probe=_hybrid_model,
        required=True,
    ),
    Feature(
        name="reset_process_group",
        what="FineGrainedActivationOffloadingInterface.reset(process_group)",
        since=MAIN_SNAPSHOT,
        needed_by="the backend's reset watch (passed through where taken)",
        probe=_reset_group,
    ),
    Feature(
        name="coverage_view_copy",
        what="ChunkOffloadHandler.BASE_OFFLOAD_MIN_COVERAGE (whole-storage copy of covering views)",
        since=MAIN_SNAPSHOT,
        needed_by="the backend's declared view rule (gather without it)",
        probe=_coverage,
    ),
    Feature(
        name="megatron_fsdp_v1",
        what="DistributedDataParallelConfig.use_megatron_fsdp and FullyShardedDataParallel",
        since="megatron-core 0.19",
        needed_by="sharding mfsdp",
        probe=_mfsdp_v1,
    ),
    Feature(
        name="mfsdp2_building_blocks",
        what="Megatron-FSDP's experimental Flat placement, fully_shard and fully_shard_optimizer",
        since="megatron-core 0.19 (main at d98e8a64dd has Placements over torch's Shard instead)",
        needed_by="sharding mfsdp2",
        probe=_mfsdp2_blocks,
    ),
    Feature(
        name="megatron_fsdp_v2",
        what="DistributedDataParallelConfig.megatron_fsdp_version and "
        "FullyShardedDataParallelV2 (Megatron-FSDP v2)",
        since=MAIN_SNAPSHOT,
        needed_by="sharding mfsdp-v2",
        probe=_mfsdp_v2,
    ),
    Feature(
        name="pinned_activation_buffer",
        what="PinnedActivationBuffer and TransformerConfig.fine_grained_offloading_buffer_size_gib",
        since="no megatron-core the harness has seen (absent from Megatron-LM main d98e8a64dd "
        "and dev d48bd6be0a)",
        needed_by="rows with Case.offload_buffer_kib",
        probe=_pinned_buffer,
    ),
    Feature(
        name="offload_module_names",
        what="the offload_modules names TransformerConfig.__post_init__ accepts",
        since="megatron-core 0.19",
        needed_by="the backend's module list and the group-name registry",
        probe=_module_names,
    ),
)
FEATURES: dict[str, Feature] = {feature.name: feature for feature in _FEATURES}
"""Every feature by name, in report order."""


def _probe(feature: Feature) -> Finding:
    """Run ``feature``'s probe: present, ``Absent``, ``Unprobed``; anything else it raises is a
    ``ProbeError`` naming the probe."""
    try:
        return Finding(feature=feature, present=True, detail=feature.probe())
    except Absent as exc:
        return Finding(feature=feature, present=False, detail=_first_line(exc))
    except Unprobed as exc:
        return Finding(feature=feature, present=False, detail=_first_line(exc), probed=False)
    except Exception as exc:
        raise ProbeError(
            f"megatron-core feature probe {feature.name} ({feature.probe.__qualname__}) raised "
            f"{type(exc).__name__}: {_first_line(exc)} - a bug in the probe or in how it reads "
            "this megatron-core, not a missing feature"
        ) from exc


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def installed() -> bool:
    """Whether a megatron-core is importable at all (nothing imported)."""
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def findings() -> dict[str, Finding]:
    """Every feature probed in the installed megatron-core (once per process)."""
    apply_environment()  # before anything imports TransformerEngine
    return {name: _probe(feature) for name, feature in FEATURES.items()}


def has(name: str) -> bool:
    return findings()[name].present


def missing_line(name: str) -> str:
    """The one line of a missing feature: what, which version has it, what needs it (for one
    not probed here: which import failed)."""
    feature, identity = FEATURES[name], source()
    found = findings()[name]
    if not found.probed:
        return (
            f"megatron-core {identity['version']}: feature {name} ({feature.what}, needed by "
            f"{feature.needed_by}) could not be probed: {found.detail}"
        )
    return (
        f"megatron-core {identity['version']} lacks {feature.what} (feature {name}, needed by "
        f"{feature.needed_by}); {feature.since} has it"
    )


def required_missing() -> str | None:
    """The line of the first required feature the installed megatron-core lacks (None: all
    there, or no megatron-core installed: that is ``unavailable_reason``'s line)."""
    if not installed():
        return None
    for name, found in findings().items():
        if found.feature.required and not found.present:
            return missing_line(name)
    return None


def refusal(needs: tuple[str, ...]) -> str | None:
    """The line of the first of ``needs`` the installed megatron-core lacks, or None."""
    for name in needs:
        if not has(name):
            return missing_line(name)
    return None


def offered_modules() -> tuple[str, ...]:
    """The ``offload_modules`` names the installed ``TransformerConfig`` accepts: the string set
    assigned to ``allowed_modules`` in its ``__post_init__``, read from the source (not run)."""
    config = _attr(_module(CONFIG), "TransformerConfig")
    tree = ast.parse(textwrap.dedent(inspect.getsource(_attr(config, "__post_init__"))))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Set):
            continue
        if any(isinstance(t, ast.Name) and t.id == "allowed_modules" for t in node.targets):
            names = [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
            return tuple(sorted(str(name) for name in names))
    raise Absent("TransformerConfig.__post_init__ assigns no allowed_modules set")


def names_line(offered: tuple[str, ...], version: str) -> str | None:
    """One line for offload names megatron-core offers that the harness's group registry
    (``harness.vocab.groups.GROUPS``) does not know, and for known names it lacks (None: the
    same)."""
    new = [name for name in offered if name not in GROUPS]
    absent = [name for name in GROUPS if name not in offered]
    parts = []
    if new:
        parts.append(
            f"offers offload module names new to the harness: {', '.join(new)} (accepted by "
            "megatron-core; no layer of the harness opens them, so no row selects them)"
        )
    if absent:
        parts.append(f"lacks the harness's offload names {', '.join(absent)}")
    return f"megatron-core {version} " + "; ".join(parts) if parts else None


def source() -> dict[str, str]:
    """The installed megatron-core's version, commit and folder
    (``harness.util.installed.megatron_core_source``: metadata and git, no import)."""
    return megatron_core_source()


@dataclass(frozen=True, kw_only=True, slots=True)
class Rules:
    """What the installed megatron-core's offloader does, as the ``mcore`` backend declares it."""

    view_copy: str
    """``coverage`` (a view covering enough of its storage is copied whole) or ``gather``."""
    skip: str
    """``object``: only tensors themselves marked (or ``Parameter`` objects) stay."""
    pool: str
    """The host memory offloaded tensors go to."""
    modules: tuple[str, ...]
    """The offload module names it accepts."""
    label: str


def installed_rules() -> Rules:
    """The rules read from the installed code (the view rule from ``coverage_view_copy``, the
    arena from ``pinned_activation_buffer``, the names from ``TransformerConfig``)."""
    version = source()["version"]
    found = findings()
    coverage = found["coverage_view_copy"].present
    arena = found["pinned_activation_buffer"].present
    names = found["offload_module_names"]
    return Rules(
        view_copy="coverage" if coverage else "gather",
        # Every version seen checks the not-offload marks on the tensor object itself (a view
        # of a marked parameter is moved); no storage-sharing check exists to read.
        skip="object",
        pool=(
            "a fixed PinnedActivationBuffer arena when fine_grained_offloading_buffer_size_gib "
            "is set, else pinned tensors pooled per (shape, dtype)"
            if arena
            else "pinned tensors pooled per (shape, dtype) (OffloadTensorPool)"
        ),
        modules=tuple(names.detail.split(", ")) if names.present else (),
        label=f"megatron-core {version}'s rules",
    )


def report_lines() -> list[str]:
    """What ``python -m harness.models.mcore.features`` prints."""
    if not installed():
        return ["megatron-core: not installed (pip install -e '.[mcore]'; docs/megatron-core.md)"]
    where = source()
    lines = [f"megatron-core {where['version']} commit {where['commit'] or '-'} at {where['path']}"]
    for name, found in findings().items():
        mark = "yes" if found.present else "NO " if found.probed else "-- "
        detail = found.detail if found.probed else f"not probed here: {found.detail}"
        lines.append(f"  {mark} {name}: {detail}")
    rules = installed_rules()
    lines.append(f"  rules: view copy {rules.view_copy}, skip {rules.skip}, pool: {rules.pool}")
    if rules.modules:
        line = names_line(rules.modules, where["version"])
        lines.append(f"  names: {line or 'the same offload names as the harness'}")
    missing = required_missing()
    lines.append(f"  {missing}" if missing else "  every required feature is there")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Print the findings (``--json``: as one JSON object); exit 2 when a required feature
    is missing."""
    args = sys.argv[1:] if argv is None else argv
    if args == ["--json"]:
        record = {
            **source(),
            "features": {n: [f.present, f.detail] for n, f in findings().items()}
            if installed()
            else {},
        }
        print(json.dumps(record, indent=2))
    elif args:
        print("usage: python -m harness.models.mcore.features [--json]", file=sys.stderr)
        return 2
    else:
        print("\n".join(report_lines()))
    return 2 if required_missing() else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.exit(main())


def summary_record() -> dict[str, Any]:
    """``summary.json``'s ``megatron_core`` of a run with megatron-core's rows: version,
    commit and folder, and which feature was found (none probed without an install)."""
    found = {n: f.present for n, f in findings().items()} if installed() else {}
    return {**source(), "features": found}
