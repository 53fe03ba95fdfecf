"""The pytest cases: offload vs baseline, transfer counts per group, name fidelity, memory and
validation. Parametrized from ``harness.cases`` by ``harness.plugin.cases``.

Every check asserts on ``harness.util.distributed.collective_problems(...)``: under torchrun all
ranks raise the same assertion, naming each failing rank and its first divergence."""
