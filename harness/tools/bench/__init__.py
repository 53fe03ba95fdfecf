"""``offload-harness bench``: step time, copy rates and memory of the offload backends on
realistic models, in one run (``cli``'s docstring describes the tool; ``main`` is its entry
point, also ``python -m harness.tools.bench``).

Modules: ``models`` (bench models and presets, selections, runs), ``peers`` (the variants and
the save_on_cpu peer), ``phases`` (``--breakdown``), ``measure`` (timing and memory of a run,
rounds), ``copies`` (copy-only rates), ``trace`` (``--trace``, baseline compute), ``hosttime``
(``--host-time``), ``targets``, ``output`` (tables, JSON), ``driver`` (one model's variants) and
``cli`` (options and ``main``)."""

from harness.tools.bench.cli import main

__all__ = ["main"]
