"""Utilities that import no other harness layer: comparisons (`compare`), rank helpers
(`distributed`), error positions (`progress`), the global-state guard (`globalstate`), leftover
threads and processes (`leftovers`), sanitizer settings (`sanitizer`), bytecode reading
(`bytecode`), the installed megatron-core's version and commit (`installed`)."""
