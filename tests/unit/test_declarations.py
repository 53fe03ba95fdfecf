"""One declaration per idea: the per-case overrides (``harness.overrides``), the backends table
and the resolved backend record (``harness.offload.backends``), and ``--models`` with its
deprecated alias ``--family`` (in a pytest session: ``tests/e2e/test_settings_processes.py``).

The expected flags, values and command lines are written out here as the CLI had them before
the tables generated them, so a table that drifts fails here rather than agreeing with itself.
"""

from __future__ import annotations

import argparse
import pickle
from typing import Any

import pytest
import torch

from harness import overrides
from harness.cases import Case, default_matrix, matrix
from harness.cli import _parser, main
from harness.execute.environment import Environment
from harness.offload import backends, broken
from harness.offload.protocol import Capabilities
from harness.offload.reference import OffloadContext
from harness.run import settings
from harness.verify.commands import repro_command, table_row
from harness.vocab.spec import PRECISIONS, SCHEDULES

# --------------------------------------------------------------------------- per-case overrides


def _case_default(field: str) -> Any:
    return Case.__dataclass_fields__[field].default


OLD_OVERRIDE_FLAGS: list[tuple[str, Any, Any, str]] = [
    # flag, argparse type, choices, help: as cli._case_flags spelled them before the table
    ("--steps", int, None, f"default {_case_default('steps')}"),
    ("--microbatches", int, None, f"default {_case_default('microbatches')}"),
    ("--schedule", None, SCHEDULES, f"default {_case_default('schedule')}"),
    ("--precision", None, PRECISIONS, f"default {_case_default('precision')}"),
    ("--max-inflight", None, None, "int >= 0, or none (default 1)"),
]


def _subparser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


@pytest.mark.parametrize("command", ["run", "repro"])
def test_the_override_table_generates_the_old_flags(command: str) -> None:
    parser = _subparser(command)
    by_flag = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    flags = [flag for flag, *_ in OLD_OVERRIDE_FLAGS]
    assert [o.flag for o in overrides.OVERRIDES] == flags
    for flag, kind, choices, help_text in OLD_OVERRIDE_FLAGS:
        action = by_flag[flag]
        assert (action.type, action.choices, action.help, action.default) == (
            kind,
            choices,
            help_text,
            None,
        ), flag
    # the custom-case group holds exactly --pattern, --offload and the overrides, in that order
    group = next(
        g for g in parser._action_groups if any(a.dest == "pattern" for a in g._group_actions)
    )
    assert [a.option_strings[0] for a in group._group_actions] == ["--pattern", "--offload", *flags]


def test_overrides_read_from_a_command_line() -> None:
    parser = _subparser("repro")
    args = parser.parse_args(["--steps", "3", "--schedule", "1f1b", "--max-inflight", "none"])
    assert overrides.overrides(args) == {"steps": 3, "schedule": "1f1b", "max_inflight": None}
    args = parser.parse_args(["--max-inflight", "0"])
    assert overrides.overrides(args) == {"max_inflight": 0}
    assert overrides.overrides(parser.parse_args([])) == {}
    args = parser.parse_args(["--max-inflight", "many"])
    with pytest.raises(ValueError, match=r"^--max-inflight must be an int or none, got 'many'$"):
        overrides.overrides(args)


def test_the_repro_command_spells_every_override_as_before() -> None:
    row = next(c for c in default_matrix() if c.max_inflight is None)
    argv = repro_command(
        row, backend="reference", device="cpu", model_size="tiny", from_case=row.name
    )
    old = ["--steps", str(row.steps), "--microbatches", str(row.microbatches)]
    old += ["--schedule", row.schedule, "--precision", row.precision, "--max-inflight", "none"]
    assert argv == [
        "offload-harness",
        "repro",
        "--case",
        row.name,
        *old,
        *("--seed", "1234", "--backend", "reference"),
        *("--device", "cpu", "--model-size", "tiny"),
    ]


def test_a_row_with_overrides_is_still_that_row() -> None:
    row = default_matrix()[0]
    changed = row.replace(steps=row.steps + 1, microbatches=row.microbatches + 1)
    assert table_row(changed) == row
    assert table_row(row.replace(min_tensor_size=row.min_tensor_size + 1)) is None
    assert overrides.FIELDS == ("steps", "microbatches", "schedule", "precision", "max_inflight")


# --------------------------------------------------------------------------- the backends table

OLD_BUILTIN = ("reference", "none", "hooks")
OLD_EXTRA = {  # the three dicts' contents before the table: BUILTIN, broken.BROKEN, EXTRA
    "mcore": "harness.offload.mcore:McoreOffloader",
    "mcore.inline-wait": "harness.offload.mcore:with_inline_reload_wait",
    "save-on-cpu": "harness.offload.adapters:SaveOnCpu",
    "te": "harness.offload.adapters:TeCpuOffload",
}


def test_the_backends_table_is_consistent() -> None:
    entries = backends.BACKENDS
    names = [entry.name for entry in entries]
    assert len(set(names)) == len(names), "a backend name is declared twice"
    assert backends.backend_names() == names == list(backends.NAMED)
    assert names == [*OLD_BUILTIN, *broken.BROKEN, *OLD_EXTRA]
    assert {entry.role for entry in entries} <= set(backends.ROLES)
    assert [e.name for e in entries if e.role == "broken"] == [r.name for r in broken.OFFLOADERS]
    assert {e.name: e.factory for e in entries if e.role == "adapter"} == OLD_EXTRA
    for entry in entries:
        module, colon, attribute = entry.factory.partition(":")
        assert module and colon and attribute, entry
        if entry.extra is not None:  # its module may not import here
            continue
        factory = backends.resolve_backend(entry.name)
        assert callable(factory) and isinstance(backends.capabilities(entry.name), Capabilities)
    for record in broken.OFFLOADERS:  # the same class the catalogue names, not a copy
        assert backends.resolve_backend(record.name) is record.factory
    assert backends.resolve_backend("reference") is OffloadContext


# ------------------------------------------------------------ --models and its alias --family

NOTICE = "offload-harness: --family is deprecated; use --models (the same values)"


@pytest.mark.parametrize("models", ["mcore", "all"])
def test_the_family_alias_lists_the_same_cases_with_one_notice(
    models: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["cases", "--models", models]) == 0
    new = capsys.readouterr()
    assert main(["cases", "--family", models]) == 0
    old = capsys.readouterr()
    assert old.out == new.out and old.out.split() == [c.name for c in matrix("default", models)]
    assert new.err == ""
    assert old.err.splitlines() == [NOTICE]


def test_the_family_alias_resolves_like_models(capsys: pytest.CaptureFixture[str]) -> None:
    new = settings.resolve({"models": "all", "device": "cpu"})
    assert capsys.readouterr().err == ""
    old = settings.resolve({"family": "all", "device": "cpu"})
    assert old == new and old.models == "all"
    assert capsys.readouterr().err.splitlines() == [NOTICE]
    with pytest.raises(settings.SettingError, match=r"^--family must be one of harness, mcore"):
        settings.resolve({"family": "gpt", "device": "cpu"})
    with pytest.raises(settings.SettingError, match="deprecated alias of --models; give one"):
        settings.resolve({"models": "mcore", "family": "all", "device": "cpu"})


# ----------------------------------------------------------------- the resolved backend record


@pytest.mark.parametrize(
    "spelling", ["reference", "hooks", "broken.corrupt_reload", "reference+delays:d2h=5"]
)
def test_a_backend_record_pickles_and_round_trips(spelling: str) -> None:
    record = backends.backend_record(spelling)
    assert str(record) == record.spelling == spelling
    assert record.capabilities == backends.capabilities(spelling)
    again = pickle.loads(pickle.dumps(record))
    assert again == record and again.spelling == spelling
    assert (again.name, again.factory_path, again.role, again.extra, again.delays) == (
        record.name,
        record.factory_path,
        record.role,
        record.extra,
        record.delays,
    )
    assert again.capabilities == record.capabilities
    assert backends.backend_record(record) is record


def test_a_backend_record_carries_the_table_and_the_declaration() -> None:
    reference = backends.backend_record("reference+delays")
    assert (reference.name, reference.role, reference.extra) == ("reference", "offloader", None)
    assert reference.factory_path == "harness.offload.reference:OffloadContext"
    assert reference.delays == backends.DEFAULT_RACE_DELAYS
    assert reference.semantics is OffloadContext.capabilities.semantics is not None
    custom = backends.backend_record("harness.offload.passthrough:NoOffload")
    assert (custom.role, custom.factory_path, custom.delays) == (
        "custom",
        "harness.offload.passthrough:NoOffload",
        None,
    )
    assert custom.unavailable(torch.device("cpu")) is None
    assert backends.backend_record("mcore").unavailable(torch.device("cpu")) is not None


def test_an_environment_resolves_its_backend_once_and_pickles() -> None:
    """The settings hand the record on; an environment made from a spelling (tests, tools)
    resolves it on construction; both pickle for the worker pool with the backend intact."""
    resolved = settings.resolve({"backend": "broken.corrupt_reload", "device": "cpu"}).backend
    assert isinstance(resolved, backends.Backend)
    env = Environment(device=torch.device("cpu"), backend=resolved)
    assert env.backend is resolved
    spelled = Environment(device=torch.device("cpu"), backend="broken.corrupt_reload")
    assert spelled == env and spelled.record.factory is resolved.factory
    again = pickle.loads(pickle.dumps(env))
    assert again == env and again.record.factory is broken.BROKEN["broken.corrupt_reload"]
    assert again.declared == env.declared
