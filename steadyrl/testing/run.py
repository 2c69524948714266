"""The reader of a learner run's files, for the harnesses: it lives in steadyrl.run.runfolder
(production code reads run folders too), and is named here as well so tests and benchmarks
keep one import path for everything they use to judge a run (steadyrl.testing)."""

from __future__ import annotations

from steadyrl.run.runfolder import COUNT_KEYS, Count, Counts, RunDir, current, run_finished, run_ids

__all__ = ["COUNT_KEYS", "Count", "Counts", "RunDir", "current", "run_finished", "run_ids"]
