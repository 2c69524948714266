"""Replay a time range of a scored topic: read it, optionally re-score it, report the reward shift.

    steadyrl replay --topic rl.scored --from -30m --to now [--rescore SPEC] [--to-topic T]

`read_range` finds the window's offsets per partition with `offsets_for_times` (start: the
first offset whose timestamp is >= T1; end: the first offset whose timestamp is > T2, else
the end offset) and reads them read_committed: aborted transactions are never seen, and the
window is what is committed at the call (a read_committed client's end offset is the last
stable offset, so a transaction still open is not waited for). Records that do not decode
as `ScoredGroup` are skipped and counted; so are records inside the offset range whose own
timestamp lies outside [T1, T2] (a producer's clock out of order). Both bounds are
inclusive, in milliseconds.

Then one of two comparisons (`shift_report`), each with the two-sample Kolmogorov-Smirnov
statistic and p-value (scipy `ks_2samp`, two-sided), mean, std (population) and their
changes:

- `--rescore SPEC`: the recorded rewards against the same samples scored again in-process by
  `steadyrl.model.scorers.build_scorer(SPEC)` (a rule, `module:function`, `rm:<dir>`,
  `embedding:all-minilm-l6-v2`), with the N largest per-sample changes and the mean change
  per recorded scorer. Answers "would another scorer have given these samples other rewards?".
- no `--rescore`: the window's first half against its second half, in time order (split at
  the median record), so drift inside the window is visible.

Every report also lists which scorers produced the window's rewards, in time order
(`scorer_timeline`): a scorer change shows there as a new segment. `plot` draws the two
distributions (histogram and empirical CDFs, the KS distance marked) to a PNG; `republish`
writes the (re-scored) groups to another topic in one Kafka transaction, for reprocessing,
each with its original timestamp.

Modules: window.py (time parsing, `read_range`), report.py (`rescore`, `shift_report`, the
report), plot.py (the PNG), republish.py (`ensure_topic`, `republish`). Every public name is
importable from here.
"""

from steadyrl.replay.plot import _bin_edges, plot, plot_report  # noqa: F401 (_bin_edges: tests)
from steadyrl.replay.report import (
    Rescored,
    build_report,
    flat_rewards,
    format_report,
    halves,
    report_json,
    rescore,
    scorer_timeline,
    shift_report,
)
from steadyrl.replay.republish import ensure_topic, republish
from steadyrl.replay.window import TIME_FORMS, Record, Window, format_ms, parse_time, read_range

__all__ = ["TIME_FORMS", "Record", "Rescored", "Window", "build_report", "ensure_topic", "flat_rewards", "format_ms",
           "format_report", "halves", "parse_time", "plot", "plot_report", "read_range", "report_json", "republish",
           "rescore", "scorer_timeline", "shift_report"]
