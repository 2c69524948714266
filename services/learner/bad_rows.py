"""The reports of the rows a run leaves out (rows.py decides which): `<run>/bad_rows.jsonl` and
`bad_eval_rows.jsonl`, the first few logged, and the counts `bad_rows` and `bad_eval_rows`."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from steadyrl.run.runfolder import Count

from .config import data_label
from .rows import LOGGED, BadRow, EvalSplit, RowCheck

if TYPE_CHECKING:
    from .state import RunState

log = logging.getLogger("steadyrl.learner")


def report_eval(splits: dict[str, EvalSplit], run_dir: Path) -> int:
    """Write `<run_dir>/bad_eval_rows.jsonl` (split, index, field, reason, where; none: no file)
    and log the first few. Returns how many."""
    bad = [(name, b) for name, sp in splits.items() for b in sp.bad]
    path = run_dir / "bad_eval_rows.jsonl"
    if not bad:
        path.unlink(missing_ok=True)
        return 0
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"split": name, **asdict(b)}) + "\n" for name, b in bad))
    log.warning("evaluation rows left out: the evaluation cannot take them",
                extra={"bad": len(bad), "report": str(path),
                       "first": [f"{name}: {b}" for name, b in bad[:LOGGED]],
                       "evaluated": {name: len(sp.good) for name, sp in splits.items()}})
    return len(bad)


def report(st: RunState, check: RowCheck, evals: dict[str, EvalSplit], run_dir: Path, data: str | list[str],
           n_rows: int) -> None:
    """The run's bad_rows.jsonl (and bad_eval_rows.jsonl), counted; the training rows' report
    and count grow as the feeder meets more (RowCheck.on_bad)."""
    path = check.report_to(run_dir / "bad_rows.jsonl")
    st.counts[Count.bad_rows.value] = check.bad

    def found(bad: BadRow) -> None:
        st.count(Count.bad_rows)
        if st.counts[Count.bad_rows.value] <= LOGGED:
            log.warning("dataset rows left out: one more the actor or the prompt contract cannot take",
                        extra={"data": data_label(data), "row": str(bad), "report": str(path)})

    check.on_bad = found
    if check.bad:
        log.warning("dataset rows left out: the actor or the prompt contract cannot take them",
                    extra={"data": data_label(data), "bad": check.bad, "rows": n_rows,
                           "report": str(path), "first": [str(b) for b in check.first[:LOGGED]]})
    n = report_eval(evals, run_dir)
    if n or Count.bad_eval_rows.value in st.counts:
        st.counts[Count.bad_eval_rows.value] = n
