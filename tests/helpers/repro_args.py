"""The custom reproduction the ``offload-harness repro`` tests start from
(``tests/unit/test_repro.py``, ``tests/e2e/test_repro_runs.py``): the CPU, pattern ``+-+-``,
``core_attn`` and ``attn_proj`` offloaded, two steps."""

from __future__ import annotations

CUSTOM = ["repro", "--device", "cpu", "--pattern", "+-+-", "--offload", "core_attn,attn_proj"]
CUSTOM += ["--steps", "2"]
