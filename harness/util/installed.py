"""Which megatron-core is installed, and from what source: read from package metadata and git,
never from an import (so the offloader, the models and the fingerprint can all ask before
megatron-core, or TransformerEngine behind it, is imported)."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import subprocess
from pathlib import Path


@functools.cache
def megatron_core_source() -> dict[str, str]:
    """The installed megatron-core's distribution ``version``, ``commit`` (where one is known)
    and ``path`` (its ``megatron/core`` folder), read from package metadata and git, never
    from an import; ``version`` ``-`` and the rest empty when none is installed. Imported from
    an installed folder, megatron-core's own ``__version__`` appends the commit of whatever git
    work tree that folder is in, so it is not read."""
    try:
        spec = importlib.util.find_spec("megatron.core")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return {"version": "-", "commit": "", "path": ""}
    folder = Path(next(iter(spec.submodule_search_locations)))
    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        version = "(no distribution metadata)"
    return {"version": version, "commit": _megatron_commit(version, folder), "path": str(folder)}


def _megatron_commit(version: str, folder: Path) -> str:
    """A build of ``scripts/mcore_main`` carries its commit as the version's local label
    (``+g<sha>``); an editable Megatron-LM checkout is a git work tree whose ``megatron/core``
    is ``folder`` (``-dirty`` when its ``megatron/`` has changes); a release has none."""
    _, _, local = version.partition("+")
    if local.startswith("g") and len(local) > 7:
        return local[1:]
    try:
        top = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "--show-toplevel", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return ""
    if len(top) != 2 or (Path(top[0]) / "megatron" / "core").resolve() != folder.resolve():
        return ""  # a folder inside some other work tree (the harness's own, say)
    dirty = subprocess.run(
        ["git", "-C", top[0], "status", "--porcelain", "--", "megatron"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return top[1] + ("-dirty" if dirty else "")
