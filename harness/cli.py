"""``offload-harness``: run the case matrix (or one case) and report; list cases and backends.

    offload-harness run                       # default matrix on the best device, report
    offload-harness run --case ID [--case ID]  # cases of the table
    offload-harness run --pattern +E-- --offload core_attn,moe_act --schedule 1f1b
    offload-harness run --update-golden       # rewrite the golden baseline traces
    offload-harness repro --case ID [--bisect]   # reproduce one case, localise a divergence
    offload-harness cases [--matrix full]     # the case ids
    offload-harness backends                  # backend names and descriptions
    offload-harness bench | mutation-score | nightly | host-profile ...   # the tools

A run writes ``<--report-dir>/<UTC time>_<sha>[_dirty]/``: summary.json, junit.xml, index.html
and plots. Bad input is one line on stderr and exit code 2; a failing case (or a divergence
under ``repro``) is exit code 1; a report folder that cannot be written, 6
(``REPORT_INCOMPLETE``); Ctrl-C 130, SIGTERM 143, SIGHUP 129 (docs/reports.md).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import signal
import sqlite3
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from harness.cases import (
    MATRICES,
    Case,
    find_case,
    matrix,
)
from harness.cli_output import Progress as _Progress
from harness.cli_output import ReportWriter as _ReportWriter
from harness.cli_output import print_outcome as _print_outcome
from harness.cli_output import write_report as _write_report
from harness.diagnose.repro import ReproSpec, reproduce
from harness.execute.environment import Environment
from harness.models.mcore import features as mcore_features
from harness.offload.backends import backend_names, describe
from harness.overrides import FLAGS as OVERRIDE_FLAGS
from harness.overrides import add_flags as add_override_flags
from harness.overrides import overrides
from harness.reporting.plots import preload_plotting
from harness.reporting.report import (
    REPORT_INCOMPLETE,
    claim_run_folder,
    summary_text,
)
from harness.run import budget, settings
from harness.run.peaks import PeakStore
from harness.run.session import run_cases
from harness.tools import TOOLS
from harness.tools import trend as trend_tool
from harness.util.bytecode import missing_bytecode
from harness.verify.judge import judge
from harness.vocab.fits import check_fits
from harness.vocab.impls import IMPLS, impl_unavailable, models_impl
from harness.vocab.spec import PRESETS, parse_pattern, preset


class UsageError(Exception):
    """Bad command-line input (exit code 2)."""


class Stopped(BaseException):
    """A stop signal (SIGTERM, SIGHUP) arrived while cases ran: the run ends as Ctrl-C ends it,
    with a report whose status is ``terminated`` and the exit code 128 + the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """While the cases run, SIGTERM and SIGHUP raise ``Stopped`` (SIGINT raises
    ``KeyboardInterrupt``), so the workers are killed and the summary says how the run ended."""

    def stop(signum: int, frame: object) -> None:
        raise Stopped(signum)

    previous = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class _StoreOnce(argparse._StoreAction):
    """Store an option's value, refusing a second one: a repeated flag is never dropped
    silently (the repeatable ones, ``run --case``, append instead)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given = namespace.__dict__.setdefault("_given", set())
        if self.dest in given:
            raise UsageError(f"{option_string} was given twice; it takes one value")
        given.add(self.dest)
        super().__call__(parser, namespace, values, option_string)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


RUN_SETTINGS = (
    "backend",
    "race_delays",
    "device",
    "model_size",
    "report_dir",
    "cuda_sanitizer",
    "nvte_cpu_offload_v1",
)
"""Settings of every subcommand that runs cases (``harness.run.settings``, as in pytest)."""


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="offload-harness", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser("run", help="run cases and write a report")
    settings.add_arguments(
        run, (*RUN_SETTINGS, "matrix", "models", "jobs", "case_timeout", "update_golden")
    )
    run.add_argument(
        "--history",
        type=Path,
        help="append the run to this SQLite history when it ends (created if missing; "
        "compare with `offload-harness trend`)",
    )
    run.add_argument(
        "--case",
        action="append",
        help="run this case id (see `offload-harness cases`); repeat it to run several",
    )
    _case_flags(run.add_argument_group("one custom case (instead of the matrix) or overrides"))
    repro = sub.add_parser("repro", help="reproduce one case: loss table, first divergence")
    settings.add_arguments(repro, (*RUN_SETTINGS, "models"))
    repro.add_argument("--case", help="a case id; the flags below override its fields")
    _case_flags(repro.add_argument_group("a custom case (or overrides of --case)"))
    repro.add_argument("--preset", choices=tuple(PRESETS), help="model preset of a custom case")
    repro.add_argument("--seed", type=int, help="seed of model and data (default: 1234)")
    repro.add_argument(
        "--bisect", action="store_true", help="on divergence, find the smallest groups/layers"
    )
    listing = sub.add_parser("cases", help="list case ids")
    settings.add_arguments(listing, ("matrix", "models"))
    sub.add_parser("backends", help="list backend names, one line each with a description")
    for name, module in TOOLS.items():  # their own parsers take the rest of the line
        sub.add_parser(name, help=f"the {name} tool ({module}; --help for its options)")
    return parser


def _case_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--pattern", help="layer pattern, e.g. +-+-+-")
    group.add_argument("--offload", help="comma-separated group names, e.g. core_attn,attn_proj")
    add_override_flags(group)


def _row_with_overrides(args: argparse.Namespace, name: str | None = None) -> Case:
    """The ``--case`` row (``name``, one of several under ``run``) with the fields the flags
    set (``run`` and ``repro`` alike)."""
    return find_case(name or args.case).replace(**overrides(args))


def _case_ids(args: argparse.Namespace) -> list[str]:
    """Every ``--case`` given (``run`` repeats it; ``repro`` takes one), each once."""
    names = args.case if isinstance(args.case, list) else [args.case] if args.case else []
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise UsageError(f"--case {twice[0]} was given twice")
    return names


def _family(pattern: str, names: tuple[str, ...]) -> str:
    if "fused_group_mlp" in names:
        return "moe-fused"
    return "hybrid-moe" if "E" in pattern else "hybrid"


def _custom_case(args: argparse.Namespace, pattern: str | None = None) -> Case:
    pattern = pattern or args.pattern
    if not pattern or not args.offload:
        raise UsageError("a custom case needs both --pattern and --offload")
    parse_pattern(pattern)
    names = tuple(n.strip() for n in args.offload.split(",") if n.strip())
    models = args.settings.models
    impl = models_impl(models if models != "all" else "harness").name
    try:
        return Case(
            family=_family(pattern, names),
            offload=names,
            custom_pattern=pattern,
            impl=impl,
            **overrides(args),
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _select(args: argparse.Namespace) -> list[Case]:
    if args.pattern or args.offload:
        if args.case:
            raise UsageError("--case and --pattern/--offload are exclusive")
        return [_custom_case(args)]
    if args.case:
        try:
            return [_row_with_overrides(args, name) for name in _case_ids(args)]
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if overrides(args):
        raise UsageError(
            f"{OVERRIDE_FLAGS} apply to one case "
            "(--case, or --pattern with --offload), not to the whole matrix"
        )
    return matrix(args.settings.matrix, args.settings.models)


def _run_one(case: Case, env: Environment, update_golden: bool = False) -> dict[str, Any]:
    """Every check of the judge on one case (the same checks pytest's case files run)."""
    return judge(case, env, update_golden=update_golden).record()


def _environment(args: argparse.Namespace) -> Environment:
    """The run's settings (``harness.run.settings``, as pytest resolves them) as an environment.
    With ``--case``, megatron-core's rows default to megatron-core's offloader."""
    impl = None
    custom = [f for f in ("pattern", "offload", "preset") if getattr(args, f, None)]
    if getattr(args, "case", None) and custom:
        flags = "/".join(f"--{f}" for f in ("pattern", "preset", "offload") if hasattr(args, f))
        raise UsageError(f"--case and {flags} are exclusive")
    if getattr(args, "case", None):
        try:
            impls = {find_case(name).impl for name in _case_ids(args)}
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        impl = impls.pop() if len(impls) == 1 else None
    names = (*settings.OPTIONS, *settings.DEPRECATED)
    values = {name: getattr(args, name) for name in names if hasattr(args, name)}
    resolved = settings.checked(lambda: settings.resolve(values, impl=impl), UsageError)
    settings.apply(resolved)
    args.settings = resolved
    return Environment(
        device=resolved.device, backend=resolved.backend, model_size=resolved.model_size
    )


def _unavailable(cases: list[Case], env: Environment) -> str | None:
    """Why the backend or a case's model implementation cannot run here (None if they can)."""
    reason = env.record.unavailable(env.device)
    return reason or impl_unavailable([case.impl for case in cases], env.device)


def _checked_cases(args: argparse.Namespace, env: Environment) -> list[Case]:
    """The selected cases, each applying to its model and fitting, before any run; refused
    when the backend or a model implementation cannot run here, or when golden traces would
    be written for a case that is not a table row."""
    try:
        cases = _select(args)
        for case in cases:
            check_fits(env.spec(case), case.run_spec())
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    reason = _unavailable(cases, env)
    if reason is not None:
        raise UsageError(reason)
    table = {c.name for name in MATRICES for c in matrix(name, "all")}
    if args.update_golden and any(c.name not in table for c in cases):
        raise UsageError("--update-golden: golden traces are kept for case-table rows only")
    return cases


def _summary_fields(
    args: argparse.Namespace, env: Environment, cases: list[Case]
) -> dict[str, Any]:
    """The run's own fields of summary.json (status and seconds are added as it ends); which
    megatron-core ran, where a case runs its models."""
    fields: dict[str, Any] = dict(
        backend=env.record.spelling,
        device=str(env.device),
        matrix=args.matrix if not (args.case or args.pattern or args.offload) else None,
        model_size=env.model_size,
        nvte_cpu_offload_v1=args.settings.nvte_cpu_offload_v1,
        cuda_sanitizer=args.settings.cuda_sanitizer,
    )
    if any(IMPLS[case.impl].models == "mcore" for case in cases):
        fields["megatron_core"] = mcore_features.summary_record()
    return fields


def _run_stoppably(
    args: argparse.Namespace, env: Environment, jobs: int, progress: _Progress
) -> tuple[str, int]:
    """Run the cases; the run's status and, when a signal stopped it, the exit code (else 0)."""
    try:
        with _stopped_by_signals():
            status = run_cases(
                progress.cases,
                env,
                jobs=jobs,
                timeout=args.settings.case_timeout,
                folder=progress.report.folder,
                on_record=progress.on_record,
                update_golden=args.update_golden,
                on_start=progress.on_start,
                memory=progress.memory,
            )
    except KeyboardInterrupt:
        return "interrupted", 128 + signal.SIGINT
    except Stopped as stop:
        return "terminated", 128 + stop.signum
    return status, 0


def _memory_plan(
    cases: list[Case], env: Environment, jobs: int | None
) -> tuple[budget.Plan | None, PeakStore | None]:
    """On CUDA, how the run shares the card (``harness.run.budget``), its warning printed,
    and where its peaks are kept; (None, None) on the CPU."""
    if env.device.type != "cuda":
        return None, None
    plan, store = budget.cuda_plan(cases, env, jobs)
    if plan.warning is not None:
        print(plan.warning, file=sys.stderr, flush=True)
    return plan, store


def command_run(args: argparse.Namespace) -> int:
    """Check the selection, claim the report folder, run the cases with progress lines,
    write the report and print the outcome; the exit code."""
    env = _environment(args)
    cases = _checked_cases(args, env)
    jobs = settings.checked(
        lambda: settings.resolve_jobs(args.settings.jobs, env.device, len(cases)), UsageError
    )
    plots = settings.checked(settings.resolve_plots, UsageError)
    plan, store = _memory_plan(cases, env, args.settings.jobs)
    if plan is not None:
        jobs = plan.workers
    _check_history(args)
    folder = _claim_folder(args.settings.report_dir)
    fields = _summary_fields(args, env, cases)
    if plan is not None:
        fields["device_memory"] = plan.record()
    report = _ReportWriter(folder)
    progress = _Progress(cases, env, report, fields, plan)
    if folder is not None and plots:
        preload_plotting()
    note = missing_bytecode(sys.modules["torch"])
    if note:
        print(f"note: {note}")
    status, stopped = _run_stoppably(args, env, jobs, progress)
    if store is not None:  # the next run on this card budgets with what this one measured
        store.update(env.model_size, progress.finished())
        store.save()
    fields.update(status=status, seconds=round(time.perf_counter() - progress.start, 2))
    summary = json.loads(summary_text(progress.finished(), **fields))
    where = _write_report(report, summary, fields, progress.finished(), stopped=bool(stopped))
    if stopped:
        print(f"\n{status} after {len(progress.finished())} of {len(cases)} cases; {where}")
        return stopped
    failed = _print_outcome(summary, len(cases), where)
    recorded = _record_history(args, report, status)
    if (report.failed or not recorded) and not stopped:
        return REPORT_INCOMPLETE
    return 1 if failed or status != "complete" else 0


def _check_history(args: argparse.Namespace) -> None:
    """``--history``: usable (created and migrated where missing) before any training, and a
    report folder to read the run from."""
    if args.history is None:
        return
    if args.settings.report_dir is None:
        raise UsageError("--history reads the run's summary.json: --report-dir '' writes none")
    try:
        trend_tool.check_history(args.history, create=True)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _record_history(args: argparse.Namespace, report: _ReportWriter, status: str) -> bool:
    """Append the finished run (its summary.json) to ``--history``; False where it could not
    be (one line on stderr). A run that did not complete, or whose report is incomplete, is
    not recorded (said on the console)."""
    if args.history is None or report.folder is None:
        return True
    if status != "complete" or report.failed:
        print(f"history: run not recorded in {args.history} (status {status})")
        return True
    try:
        summary = trend_tool.read_json(report.folder, "summary")
        run_id = trend_tool.record(args.history, summary, source="run", report=report.folder)
    except (ValueError, OSError, sqlite3.Error) as exc:
        why = " ".join(str(exc).split())
        print(f"offload-harness: history not recorded: {why}", file=sys.stderr, flush=True)
        return False
    print(f"history: recorded run #{run_id} in {args.history}")
    return True


def _claim_folder(root: Path | None) -> Path | None:
    """The run's report folder, created and write-tested before any training (None: no
    report)."""
    if root is None:
        return None
    try:
        return claim_run_folder(root)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _repro_spec(args: argparse.Namespace) -> ReproSpec:
    env = _environment(args)
    try:
        if args.case:
            if args.pattern or args.offload or args.preset:
                raise UsageError("--case and --pattern/--preset/--offload are exclusive")
            case = _row_with_overrides(args)
            model = env.spec(case)
        elif args.preset:
            model = preset(args.preset)
            if args.pattern:
                model = model.replace(pattern=args.pattern)
            case = _custom_case(args, model.pattern).replace(family=_preset_family(args.preset))
            case.offload_config().check_applies_to(model)
        else:
            case = _custom_case(args)
            model = env.spec(case)
            args.preset = _preset_name(case.family, env.model_size)
        run = case.run_spec() if args.seed is None else case.run_spec(seed=args.seed)
        check_fits(model, run)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    reason = _unavailable([case], env)
    if reason is not None:
        raise UsageError(reason)
    return ReproSpec(
        case=case,
        model=model,
        run=run,
        backend=env.record,
        device=env.device,
        model_size=env.model_size,
        preset=args.preset or None,
        from_case=args.case or None,
    )


def _preset_name(family: str, size: str) -> str:
    return next(name for name, p in PRESETS.items() if (p.family, p.size) == (family, size))


def _preset_family(name: str) -> str:
    return PRESETS[name].family


def command_repro(args: argparse.Namespace) -> int:
    spec = _repro_spec(args)
    folder = _claim_folder(args.settings.report_dir)  # created and write-tested before the runs
    result = reproduce(
        spec, bisect=args.bisect, report_root=args.settings.report_dir, folder=folder
    )
    return 1 if result.diverged else 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in TOOLS:
        return importlib.import_module(TOOLS[argv[0]]).main(argv[1:])
    try:
        args = _parser().parse_args(argv)
        if args.command == "cases":
            chosen = settings.checked(
                lambda: settings.resolve(
                    {
                        "matrix": args.matrix,
                        "models": args.models,
                        "family": args.family,
                        "device": "cpu",
                    }
                ),
                UsageError,
            )
            print("\n".join(c.name for c in matrix(chosen.matrix, chosen.models)))
            return 0
        if args.command == "backends":
            names = backend_names()
            width = max(map(len, names))
            print("\n".join(f"{name:<{width}}  {describe(name)}" for name in names))
            return 0
        if args.command == "repro":
            return command_repro(args)
        return command_run(args)
    except UsageError as exc:
        print(f"offload-harness: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
