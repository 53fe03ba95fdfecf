"""The harness's tools beside ``run`` and ``repro``, each a module with ``main(argv)`` and an
``offload-harness`` subcommand: ``bench`` (step time and copy rates), ``mutation-score``
(detection power), ``nightly`` (the gate), ``host-profile`` (cProfile of steady steps) and
``time-budget`` (the ways to a verdict timed against their budgets) and ``trend`` (the
newest run of a history against the earlier ones).
``scripts/`` keeps thin wrappers of the same names."""

TOOLS = {
    "bench": "harness.tools.bench",
    "mutation-score": "harness.tools.mutation_score",
    "nightly": "harness.tools.nightly",
    "host-profile": "harness.tools.host_profile",
    "time-budget": "harness.tools.timebudget",
    "trend": "harness.tools.trend",
}
"""Subcommand -> module."""
