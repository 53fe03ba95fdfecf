"""Executing a case: the independent prediction (`predict`) or the learned rule (`learn`), where
and with what it runs (`environment`), the shared baselines (`baselines`), the runs as named steps
(`steps`), which group each copy belongs to (`attribution`), what the runs produced (`caserun`),
the memory reading (`memory`)."""
