"""Every run setting in one table: flag, default, help and validation, shared by all entry points.

``offload-harness run``/``repro``/``cases``, the tools (``mutation-score``, ``nightly``,
``bench``, ``host-profile``) and the pytest plugin generate their options from ``OPTIONS``
(``add_arguments`` for argparse, ``add_pytest_options`` for pytest) and turn what they parsed
into one frozen ``Settings`` through ``resolve``. So a flag has one meaning everywhere: the same
values, the same default, the same one-line error (``SettingError``; exit 2 in the CLI,
``pytest.UsageError`` in pytest).

Values arrive as the strings typed on the command line (``None`` for an option not given) and are
converted here, not by argparse or pytest, so both report bad input in the same words. This
module imports torch only inside the resolvers that need a device.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.cases import MATRICES, MODEL_SIZES, MODELS_CHOICES

if TYPE_CHECKING:  # the table imports without torch
    import torch

    from harness.offload.backends import Backend


class SettingError(ValueError):
    """A bad setting: one line that names the flag, what is allowed and what was given."""


MATRIX_CHOICES: tuple[str, ...] = tuple(MATRICES)

CUDA_JOBS_CAP = 12
"""The most workers ``--jobs`` defaults to on CUDA (each holds a CUDA context on the one GPU);
the card's memory may allow fewer (``harness.run.budget``)."""


@dataclass(frozen=True, kw_only=True)
class Option:
    """One setting as a command-line flag."""

    dest: str
    """Attribute name (``model_size``); the flag is ``--model-size``."""
    help: str
    default: str | None = None
    """The value when the flag is not given, as typed (``None``: decided by ``resolve``)."""
    switch: bool = False
    """A flag without a value (``store_true``)."""
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")


_OPTIONS: tuple[Option, ...] = (
    Option(
        dest="backend",
        metavar="NAME",
        help="offloader under test: a name from `offload-harness backends` or "
        "package.module:factory; <name>+delays[:d2h=N,h2d=N,compute=N] adds race delays "
        "(default: reference; mcore for megatron-core's models)",
    ),
    Option(
        dest="models",
        default="harness",
        help="whose models the rows build: harness (ours), mcore (megatron-core's HybridModel "
        "and GPTModel with TransformerEngine; needs CUDA, TransformerEngine and megatron-core: "
        "pytest skips the rows without them, run refuses) or all (default: harness)",
    ),
    Option(
        dest="device",
        default="auto",
        help="auto (cuda when one is visible), cpu, cuda or cuda:N (default: auto)",
    ),
    Option(
        dest="model_size",
        default="auto",
        help="tiny (CPU sized), small (GPU sized) or auto (small on cuda, tiny on cpu; "
        "default: auto)",
    ),
    Option(
        dest="matrix", default="default", help="case matrix: default or full (default: default)"
    ),
    Option(
        dest="report_dir",
        default="reports",
        metavar="DIR",
        help="parent folder of the report <UTC time>_<sha>[_dirty]/ (summary.json, junit.xml, "
        "index.html; under torchrun also rank-logs/); '' writes none (default: reports)",
    ),
    Option(
        dest="update_golden",
        switch=True,
        help="rewrite the golden baseline loss traces of the cases run "
        "(cases/golden/<fingerprint>/<variant>/)",
    ),
    Option(
        dest="race_delays",
        default="",
        metavar="SPEC",
        help="CUDA only: widen race windows with GPU sleeps on the offloader's streams, "
        "d2h=N,h2d=N,compute=N cycles per group (same as --backend <name>+delays:...), or "
        "none (default: none)",
    ),
    Option(
        dest="jobs",
        metavar="N",
        help="worker processes (default: one per usable core on cpu; on cuda as many as the "
        f"GPU's free memory holds at the cases' peaks, at most three per four cores and "
        f"{CUDA_JOBS_CAP}: the N workers share the GPU, each with its own context, and a case "
        "starts only when its peak fits beside the running ones; every worker gets "
        "cores // N intra-op threads)",
    ),
    Option(
        dest="cuda_sanitizer",
        switch=True,
        help="CUDA only: run every case under PyTorch's CUDA stream sanitizer "
        "(TORCH_CUDA_SANITIZER): an access to a device tensor from one stream while another "
        "stream's access is not waited for fails the case; it cannot see a pinned host buffer "
        "read too early (race delays are the tool for that) and makes each op slower",
    ),
    Option(
        dest="nvte_cpu_offload_v1",
        metavar="0|1",
        help="TransformerEngine's CPU-offload implementation for megatron-core's models and the "
        "te backend, exported as NVTE_CPU_OFFLOAD_V1 before TransformerEngine is imported: 1 "
        "the older one (what megatron's training scripts require with TE >= 2.10), 0 the newer "
        "one (default: the environment's NVTE_CPU_OFFLOAD_V1, else 1)",
    ),
    Option(
        dest="case_timeout",
        metavar="SECONDS",
        help="seconds per case before every thread's stack is dumped and the case fails "
        "(default: 600 on cuda, 300 on cpu; 0: no timeout)",
    ),
)
OPTIONS: dict[str, Option] = {option.dest: option for option in _OPTIONS}
"""Every setting by ``dest``."""

DEPRECATED: dict[str, str] = {"family": "models"}
"""Old flag ``dest`` -> the setting it still sets: ``--family`` was renamed ``--models``
("family" is the model family of a case row, ``Case.family``). A deprecated flag takes the same
values, and using it prints a one-line notice on stderr (``resolve``)."""


def _deprecated_for(name: str) -> list[str]:
    return [old for old, new in DEPRECATED.items() if new == name]


def deprecation_notice(old: str) -> str:
    """The one line printed when the deprecated flag ``old`` (a ``dest``) is used."""
    new = OPTIONS[DEPRECATED[old]].flag
    return f"offload-harness: --{old.replace('_', '-')} is deprecated; use {new} (the same values)"


DEFAULT_CASE_TIMEOUT_S: dict[str, float] = {"cuda": 600.0, "cpu": 300.0}


def add_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    names: Iterable[str],
    **defaults: str,
) -> None:
    """Add the named settings to an argparse parser (values stay strings; ``resolve`` checks
    them). ``defaults`` overrides a default where a tool's job differs (e.g. nightly's full
    matrix); the help then says so."""
    for name in names:
        option = OPTIONS[name]
        default = defaults.get(name, option.default)
        help_text = option.help if name not in defaults else f"{option.help}; here: {default!r}"
        if option.switch:
            parser.add_argument(option.flag, action="store_true", help=help_text)
        else:
            parser.add_argument(
                option.flag, default=default, metavar=option.metavar, help=help_text
            )
        for old in _deprecated_for(name):
            parser.add_argument(
                f"--{old.replace('_', '-')}",
                metavar=option.metavar or old.upper(),
                help=f"deprecated alias of {option.flag}",
            )


def add_pytest_options(group: Any, names: Iterable[str] | None = None) -> None:
    """Add the named settings (all by default) to a pytest option group."""
    for name in names if names is not None else OPTIONS:
        option = OPTIONS[name]
        if option.switch:
            group.addoption(option.flag, action="store_true", help=option.help)
        else:
            group.addoption(
                option.flag, default=option.default, metavar=option.metavar, help=option.help
            )
        for old in _deprecated_for(name):
            group.addoption(
                f"--{old.replace('_', '-')}",
                dest=old,
                default=None,
                metavar=option.metavar or old.upper(),
                help=f"deprecated alias of {option.flag}",
            )


# --- resolvers: one per setting, each the only place its rule lives ---------------------------


def _choice(name: str, value: str, allowed: Iterable[str]) -> str:
    allowed = tuple(allowed)
    if value not in allowed:
        raise SettingError(f"--{name} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def resolve_device(text: str) -> torch.device:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` -> a device with an index on CUDA.

    Does not initialise CUDA in this process (its workers come from a forkserver, and a parent
    that only names the device keeps every CUDA use in them): ``cuda`` is the current device,
    which is 0 until something initialises CUDA."""
    import torch

    value = text.strip() if isinstance(text, str) else text
    if value == "auto":
        value = "cuda" if torch.cuda.is_available() else "cpu"
    kind, colon, index = str(value).partition(":")
    if kind not in ("cpu", "cuda") or (colon and (kind != "cuda" or not index.isdigit())):
        raise SettingError(f"--device must be auto, cpu, cuda or cuda:N; got {text!r}")
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SettingError(f"--device {text}: no CUDA device is visible on this machine")
    if not colon:
        current = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
        return torch.device("cuda", current)
    count = torch.cuda.device_count()
    if int(index) >= count:
        raise SettingError(f"--device {text}: this machine has {count} CUDA device(s)")
    return torch.device("cuda", int(index))


def resolve_model_size(text: str, device: torch.device) -> str:
    """``auto`` -> ``small`` on CUDA, ``tiny`` on CPU; else one of ``MODEL_SIZES``."""
    if text == "auto":
        return "small" if device.type == "cuda" else "tiny"
    return _choice("model-size", text, ("auto", *MODEL_SIZES))


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity where the platform has one (a
    ``taskset``, a container's or a batch scheduler's cpuset), else ``os.cpu_count()``. Worker
    counts and thread shares are taken from it, so a run confined to 4 of 64 cores spins 4
    threads, not 64."""
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is not None:
        return max(1, len(affinity(0)))
    return os.cpu_count() or 1


def default_jobs(device: torch.device) -> int:
    """Worker processes the cores allow when none are asked for: one per core on CPU; on CUDA
    three per four cores, up to ``CUDA_JOBS_CAP``. The cases are host-bound there (a small
    model's step is mostly Python launching kernels), but the workers share one GPU: on the
    16-core H200 box 12 workers beat 8 and 16 on the full matrix (189 s, against 200 s with
    16), the default case files (39 s, against 41 and 43 s) and ``run`` (28 s, against 30 s).
    On CUDA it is a ceiling: ``offload-harness run`` and pytest's ``-n auto`` start fewer
    where the card's memory holds fewer (``harness.run.budget``; 12 workers of 6-10 GiB
    each ran an 80 GB H100 out of memory)."""
    cores = usable_cores()
    return max(1, min(CUDA_JOBS_CAP, cores * 3 // 4)) if device.type == "cuda" else cores


def resolve_jobs(text: str | int | None, device: torch.device, tasks: int) -> int:
    """Worker processes: the value given (an int >= 1), else ``default_jobs``; never more than
    ``tasks`` (and at least 1)."""
    if text is None or text == "":
        value = default_jobs(device)
    else:
        value = _positive_int("jobs", text)
    return max(1, min(value, tasks))


def _positive_int(name: str, text: str | int) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise SettingError(f"--{name} must be an int >= 1; got {text!r}") from None
    if value < 1:
        raise SettingError(f"--{name} must be an int >= 1; got {text!r}")
    return value


def resolve_cuda_sanitizer(wanted: bool, device: torch.device) -> bool:
    """The sanitizer watches CUDA streams: refused on any other device."""
    if wanted and device.type != "cuda":
        raise SettingError(
            f"--cuda-sanitizer needs a CUDA device (PyTorch's CUDA stream sanitizer watches CUDA "
            f"streams); the device is {device}"
        )
    return wanted


def resolve_nvte_cpu_offload_v1(text: str | None) -> str:
    """0 or 1; unset: the environment's ``NVTE_CPU_OFFLOAD_V1``, else 1."""
    value = os.environ.get("NVTE_CPU_OFFLOAD_V1", "1") if text in (None, "") else str(text)
    if value not in ("0", "1"):
        where = "NVTE_CPU_OFFLOAD_V1 in the environment" if text in (None, "") else "it"
        raise SettingError(f"--nvte-cpu-offload-v1 must be 0 or 1; {where} is {value!r}")
    return value


def apply(resolved: Settings) -> None:
    """Make this process, and the workers of the pools it makes from now on, run as
    ``resolved`` says: export ``NVTE_CPU_OFFLOAD_V1`` (TransformerEngine reads it at its first
    import) and, with the sanitizer, ``TORCH_CUDA_SANITIZER`` (a worker takes the variables
    and enables the sanitizer on start, ``harness.run.parallel.use_share``; this process enables it
    now)."""
    os.environ["NVTE_CPU_OFFLOAD_V1"] = resolved.nvte_cpu_offload_v1
    if resolved.cuda_sanitizer:
        os.environ["TORCH_CUDA_SANITIZER"] = "1"
        from harness.util import sanitizer

        sanitizer.enable()


def resolve_case_timeout(text: str | None, device: torch.device) -> float:
    """Seconds per case (0: none); the default depends on the device."""
    if text is None or text == "":
        return DEFAULT_CASE_TIMEOUT_S["cuda" if device.type == "cuda" else "cpu"]
    try:
        seconds = float(text)
    except ValueError:
        raise SettingError(f"--case-timeout must be seconds >= 0; got {text!r}") from None
    if not seconds >= 0 or seconds == float("inf"):
        raise SettingError(f"--case-timeout must be seconds >= 0; got {text!r}")
    return seconds


PLOTS_VARIABLE = "OFFLOAD_HARNESS_PLOTS"
"""Environment variable: ``0`` writes a report's ``index.html`` without its plots."""


def resolve_plots() -> bool:
    """Whether a report draws its plots: ``OFFLOAD_HARNESS_PLOTS`` unset or ``1`` yes, ``0``
    no (a CI gate that reads only ``summary.json`` and ``junit.xml`` saves matplotlib's import
    and the drawing, 2-3 s on the 2-core CPU); anything else is a ``SettingError``."""
    value = os.environ.get(PLOTS_VARIABLE, "1")
    if value not in ("0", "1"):
        raise SettingError(f"{PLOTS_VARIABLE} must be 0 or 1; the environment has {value!r}")
    return value == "1"


def resolve_report_dir(text: str | Path | None) -> Path | None:
    """The report parent folder; ``''`` (or None) writes no report, in every entry point."""
    return Path(text) if text not in (None, "") else None


def resolve_backend(
    text: str | None, device: torch.device, *, models: str = "harness", race_delays: str = ""
) -> Backend:
    """The backend to run, as the record the run passes on (``backends.Backend``): the name
    given (else ``models``' default), resolved once up front, with ``race_delays`` folded in
    (CUDA only), then probed on ``device``
    (``backends.probe_backend``: the factory is called once and must return an ``Offloader``;
    not for a backend unavailable on ``device``, whose reason the run reports). It does not
    initialise CUDA in this process either: on CUDA it runs in a spawned child unless this
    process has initialised CUDA already."""
    from harness.offload import backends
    from harness.vocab.impls import default_backend

    backend = text or default_backend(models)
    race_delays = "" if race_delays == "none" else race_delays
    try:
        backends.resolve_backend(backend)
    except ValueError as exc:
        raise SettingError(f"--backend: {exc}") from None
    if (race_delays or backends.DELAYS in backend) and device.type != "cuda":
        raise SettingError(
            "--race-delays / <backend>+delays need a CUDA device (GPU sleep kernels); "
            f"this run is on {device.type}"
        )
    if not race_delays:
        return _probed(backend, device)
    if backends.DELAYS in backend:
        raise SettingError(f"--race-delays and --backend {backend}: give the delays once")
    try:
        spelled = backends.with_delays(backend, backends.parse_race_delays(race_delays))
        backends.resolve_backend(spelled)
    except ValueError as exc:
        raise SettingError(f"--race-delays: {exc}") from None
    return _probed(spelled, device)


def _probed(backend: str, device: torch.device) -> Backend:
    """``backend``'s record once ``backends.probe_backend`` accepted it on ``device``."""
    from harness.offload import backends

    try:
        backends.probe_backend(backend, device)
        return backends.backend_record(backend)
    except ValueError as exc:
        raise SettingError(f"--backend: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What one session's options resolved to (the same for the CLI and pytest)."""

    backend: Backend
    """The backend resolved once (``harness.offload.backends.Backend``; its ``spelling``
    includes the race delays)."""
    device: torch.device
    models: str
    """Whose models the rows build: ``harness``, ``mcore`` or ``all`` (``Case.impl``)."""
    matrix: str
    model_size: str
    report_dir: Path | None
    """Parent of the report folder; None writes no report."""
    update_golden: bool = False
    cuda_sanitizer: bool = False
    """Cases run under PyTorch's CUDA stream sanitizer (``apply``)."""
    nvte_cpu_offload_v1: str = "1"
    """``NVTE_CPU_OFFLOAD_V1`` for TransformerEngine (``apply`` exports it)."""
    jobs: int | None = None
    """As given (None: the device's default); ``resolve_jobs`` caps it by the number of cases."""
    case_timeout: float = 0.0


def resolve(values: Mapping[str, Any], *, impl: str | None = None) -> Settings:
    """Check every setting in ``values`` (``dest`` -> value as typed; missing ones take their
    defaults) and return them resolved. ``impl`` is the model implementation of a single case
    being run, whose default backend applies when none is named (megatron-core's models run
    megatron-core's offloader)."""
    unknown = set(values) - set(OPTIONS) - set(DEPRECATED)
    if unknown:
        raise SettingError(f"unknown settings: {', '.join(sorted(unknown))}")
    values, named = _undeprecated(values)

    def get(name: str) -> Any:
        value = values.get(name)
        return OPTIONS[name].default if value is None else value

    models = _choice(named.get("models", "models"), get("models"), MODELS_CHOICES)
    device = resolve_device(get("device"))
    backend_models = models
    if impl is not None:
        from harness.vocab.impls import IMPLS

        backend_models = IMPLS[impl].models
    return Settings(
        backend=resolve_backend(
            get("backend"), device, models=backend_models, race_delays=get("race_delays") or ""
        ),
        device=device,
        models=models,
        matrix=_choice("matrix", get("matrix"), MATRIX_CHOICES),
        model_size=resolve_model_size(get("model_size"), device),
        report_dir=resolve_report_dir(get("report_dir")),
        update_golden=bool(get("update_golden")),
        cuda_sanitizer=resolve_cuda_sanitizer(bool(get("cuda_sanitizer")), device),
        nvte_cpu_offload_v1=resolve_nvte_cpu_offload_v1(get("nvte_cpu_offload_v1")),
        jobs=None if values.get("jobs") in (None, "") else _positive_int("jobs", values["jobs"]),
        case_timeout=resolve_case_timeout(values.get("case_timeout"), device),
    )


def _undeprecated(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """``values`` with each deprecated flag given moved to its new name (its notice printed on
    stderr, once per flag), and new name -> the old flag's name where one was used, so an
    error names the flag that was typed. Both given with different values is an error."""
    out = {name: value for name, value in values.items() if name not in DEPRECATED}
    named: dict[str, str] = {}
    for old, new in DEPRECATED.items():
        value = values.get(old)
        if value is None:
            continue
        given = out.get(new)
        if given not in (None, OPTIONS[new].default) and given != value:
            raise SettingError(
                f"{OPTIONS[new].flag} {given} and --{old.replace('_', '-')} {value}: "
                f"--{old.replace('_', '-')} is a deprecated alias of {OPTIONS[new].flag}; "
                "give one"
            )
        print(deprecation_notice(old), file=sys.stderr, flush=True)
        out[new] = value
        named[new] = old.replace("_", "-")
    return out, named


def checked(fn: Callable[[], Any], error: Callable[[str], BaseException]) -> Any:
    """``fn()``, with a ``SettingError`` re-raised as ``error(message)`` (the entry point's own
    usage error), without a chained traceback."""
    try:
        return fn()
    except SettingError as exc:
        raise error(str(exc)) from None
