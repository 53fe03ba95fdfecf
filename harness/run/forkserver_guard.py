"""Imported by the worker pool's forkserver alone, as the first module of its preload
(``harness.run.forkserver.PRELOAD``): the server dies with the process that started it
(``harness.run.lifeline.die_with_parent``), so a run killed with SIGKILL leaves no server behind.
Anywhere else (the variable unset, or naming a process that is not this one's parent) it does
nothing."""

from __future__ import annotations

import os

from harness.run.forkserver import OWNER_VARIABLE
from harness.run.lifeline import die_with_parent

_owner = os.environ.get(OWNER_VARIABLE, "")
if _owner.isdigit() and int(_owner) == os.getppid():
    die_with_parent(int(_owner))
