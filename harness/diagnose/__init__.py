"""Diagnosing a failure: `offload-harness repro` (`repro`) and the group/layer bisection
(`bisect`)."""
