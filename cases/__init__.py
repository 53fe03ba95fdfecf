"""The pytest cases: offload vs baseline, transfer counts per group, name fidelity, memory and
validation. Parametrized from ``harness.cases`` by ``fixtures.cases``."""
