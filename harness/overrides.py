"""The per-case overrides, declared once: each a case field that ``run`` and ``repro`` take as
a flag (``--steps 3``) to change one ``--case`` row or a custom case.

``OVERRIDES`` generates everything that names them: the flags (``add_flags``), the case fields
a parsed command line sets (``overrides``), the ``repro`` command line that spells a case's
values back (``spelled``, used by ``harness.verify.commands.repro_command``) and the fields a row
may
differ in and still be that row (``FIELDS``, ``harness.verify.commands.table_row``). Adding one is a
row here (its field must be a ``Case`` field).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harness.cases import Case
from harness.vocab.spec import PRECISIONS, SCHEDULES


def _int_or_none(text: str) -> int | None:
    """``none`` -> None, else an int (a ``ValueError`` naming the flag)."""
    if text == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--max-inflight must be an int or none, got {text!r}") from None


@dataclass(frozen=True, kw_only=True)
class Override:
    """One case field the command line overrides."""

    field: str
    """The ``Case`` field; the flag is ``--<field with dashes>``."""
    help: str = "default {default}"
    """The flag's help; ``{default}`` is the case table's own default."""
    type: Callable[[str], Any] | None = None
    """argparse's ``type`` (its own error on bad input), or None: the value stays a string."""
    choices: tuple[str, ...] | None = None
    convert: Callable[[str], Any] | None = None
    """Turns the typed string into the field's value after parsing (a ``ValueError`` is a
    usage error); None: argparse's value is the field's."""

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")

    @property
    def default(self) -> Any:
        """The case table's default for the field (``Case``)."""
        return Case.__dataclass_fields__[self.field].default

    def value(self, given: Any) -> Any:
        """The field's value for what the flag was given."""
        return given if self.convert is None else self.convert(given)

    def spell(self, value: Any) -> str:
        """``value`` as typed on the command line (None is ``none``)."""
        return "none" if value is None else str(value)


OVERRIDES: tuple[Override, ...] = (
    Override(field="steps", type=int),
    Override(field="microbatches", type=int),
    Override(field="schedule", choices=SCHEDULES),
    Override(field="precision", choices=PRECISIONS),
    Override(
        field="max_inflight", help="int >= 0, or none (default {default})", convert=_int_or_none
    ),
)
"""Every per-case override, in the order the help lists them and the command line spells
them."""

FIELDS: tuple[str, ...] = tuple(o.field for o in OVERRIDES)
"""The case fields the flags override."""

FLAGS: str = "/".join(o.flag for o in OVERRIDES)
"""``--steps/--microbatches/...``, for the messages that name them all."""


def add_flags(group: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add one flag per override (values checked as ``type`` / ``choices`` say)."""
    for o in OVERRIDES:
        kwargs: dict[str, Any] = {"help": o.help.format(default=o.default)}
        if o.type is not None:
            kwargs["type"] = o.type
        if o.choices is not None:
            kwargs["choices"] = o.choices
        group.add_argument(o.flag, **kwargs)


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The case fields the flags set explicitly (a bad value is a ``ValueError``)."""
    return {
        o.field: o.value(getattr(args, o.field))
        for o in OVERRIDES
        if getattr(args, o.field) is not None
    }


def spelled(case: Case) -> list[str]:
    """Every override flag with ``case``'s value, as ``repro`` takes them."""
    return [part for o in OVERRIDES for part in (o.flag, o.spell(getattr(case, o.field)))]
