"""Running: every setting and its resolver (`settings`), the session that runs cases (`session`),
the worker pool (`parallel`), the forkserver and the guards that end its processes with the run
(`forkserver`, `forkserver_guard`, `lifeline`)."""
