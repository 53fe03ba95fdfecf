"""Measuring: the instruments that watch a run without the offloader's cooperation. The harness
windows and copy observer (`observe`, `copyobserver`, `checksums`), the profiler transfer counter
(`transfers`), the compute timeline (`timeline`), host time (`hostclock`), the host-sync guard
(`syncguard`, `syncdetect`), the numerics fingerprint (`fingerprint`)."""
