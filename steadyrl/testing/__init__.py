"""What tests and benchmarks share to drive and judge a pipeline run, in one place:

- `steadyrl.testing.run`: steadyrl.run.runfolder's `RunDir`, the one reader of a learner run's
  files (state.json, consumed.jsonl, summary.json), `Counts` with the learner's own key names
  (`Count`), `current`, `run_finished`, `run_ids`;
- `steadyrl.testing.audit`: the one exactly-once audit (`audit_run` from the run's files and
  the published ids, `audit_pipeline` from the topics as well, `stage_audit`);
- `steadyrl.testing.procs`: `ServiceProc` (`python -m steadyrl.services.<name>`), `produce_all`,
  `read_all`, `decode_all`, `unique_prefix`, `REPO`;
- `steadyrl.testing.stack`: `Pipeline` (a broker of its own plus `steadyrl up` on it),
  `up_child_pid`, `parse_metrics`, `KINDS`.

Benchmarks import from here, never from `tests`; nothing here imports `services` or `tests`.
The names below are loaded on first use, so `steadyrl.testing.run` stays import-light.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "run": ("COUNT_KEYS", "Count", "Counts", "RunDir", "current", "run_finished", "run_ids"),
    "audit": ("audit_run", "audit_pipeline", "stage_audit", "committed_offsets", "explain"),
    "procs": ("REPO", "ServiceProc", "decode_all", "produce_all", "producer", "read_all", "unique_prefix"),
    "stack": ("KINDS", "Pipeline", "alive", "kind_of", "parse_metrics", "proc_start_epoch", "up_child_pid"),
}
_WHERE = {name: mod for mod, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'steadyrl.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"steadyrl.testing.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
