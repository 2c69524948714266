"""The learner's run state: what `state.json` holds, typed.

`state.json` (and the `learner_state` of every checkpoint's meta) is `RunState.model_dump()`,
without the per-step history (history.jsonl beside it, services/learner/resume.py trim_history):
the same JSON the learner wrote before these models existed (dataclasses then), so a run
written by an earlier version reads back here; a key this version does not know is refused by
name (`StateError`) rather than dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from steadyrl.run.runfolder import Count
from steadyrl.wire.contracts import ScoredGroup


class StateError(ValueError):
    """A saved run state this version cannot read; the message names the file and the field."""


#: refusal reasons an in-flight prompt keeps (the newest)
REASONS_KEPT = 3


class _Saved(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a key from a newer version: refused, not dropped


class InFlight(_Saved):
    """A published prompt not yet trained on."""

    seq: int                 # feeder order (batches are sorted by it)
    epoch: int
    index: int
    attempt: int = 0         # > 0: published again (stale, evicted): a new seed
    released: bool = False   # its group came back from rl.quarantine: trained as-is, however stale
    evicted: int = 0         # times its group was evicted from the full train buffer
    refused: int = 0         # times rl.dlq sent it back (its budget: learner.prompt_max_refusals)
    first_refused_ms: int = 0  # wall time of its first refusal (0: never refused)
    reasons: list[str] = Field(default_factory=list)  # the last refusals' reasons (at most REASONS_KEPT)
    published_ms: int = 0    # wall time of its last publish (0: not recorded, a state of before)
    overdue: int = 0         # times published again as overdue (the bound doubles each time)


class Held(InFlight):
    """A prompt whose group the reward watch held on rl.quarantine."""

    batch_id: str


class RunState(_Saved):
    """What `state.json` holds: enough to continue the run after a restart."""

    run_id: str
    config: dict[str, Any] = Field(default_factory=dict)        # the run's fingerprint (resume.fingerprint)
    # the learner.train settings in effect at the last save: what a resume may change (autocast,
    # clip, ...; lr and weight_decay stay the checkpoint optimizer's), logged when it does
    # (resume.settings_changed); {}: a state written before this field
    train: dict[str, Any] = Field(default_factory=dict)
    step: int = 0
    policy_uri: str = ""
    policy_sha256: str = ""
    offsets: dict[str, int] = Field(default_factory=dict)       # partition -> next offset of rl.scored
    # partition -> next offset of rl.releases ({}: a new run's, set to the ends; a state written
    # before rl.releases, read from each partition's start)
    release_offsets: dict[str, int] = Field(default_factory=dict)
    dlq_offset: int = -1                                         # next offset of rl.dlq (-1: not set)
    feeder_position: int = 0                                     # prompts pulled from the dataset order
    fed: int = -1                                                # new prompts published (-1: = feeder_position)
    # Prompts lost to rl.dlq that a new prompt replaced: how the learner handled a DLQ record
    # before issue 18 (now the same prompt is published again). -1: = counts["dlq"] (a state of then).
    dlq_replaced: int = -1
    gate: dict[str, Any] = Field(default_factory=dict)           # the prompt gate (PromptGate.state)
    in_flight: dict[str, InFlight] = Field(default_factory=dict)
    requeue: list[str] = Field(default_factory=list)             # prompt ids to publish again
    quarantined: dict[str, Held] = Field(default_factory=dict)
    # prompt id -> its last refusal's reason: refused past its budget, never trained, its slot
    # given to the next row (services/learner/intake.py abandon; <run>/abandoned.jsonl)
    abandoned: dict[str, str] = Field(default_factory=dict)
    watch: dict[str, Any] = Field(default_factory=dict)          # the reward watch (RewardWatch.state)
    # Read from states written before history.jsonl, never written: a list that grew with every
    # step made each step's save O(steps) (5.5 MB of JSON, 131 ms a save, at step 10 000:
    # bench/state_save.py). What was trained is the audit log, consumed.jsonl.
    trained: list[str] = Field(default_factory=list, exclude=True)
    counts: dict[str, int] = Field(default_factory=dict)         # Count -> n
    # per step: reward mean/std, tokens, seconds; kept in history.jsonl, one line appended per
    # step (services/learner/parts.py append_history), not in state.json (see `trained`)
    history: list[dict[str, Any]] = Field(default_factory=list, exclude=True)
    eval_before: dict[str, Any] | None = None
    eval_after: dict[str, Any] | None = None
    finished: bool = False

    @classmethod
    def parse(cls, text: str, where: str) -> RunState:
        """The state saved as `text` (JSON). Raises StateError naming `where` and the field."""
        try:
            st = cls.model_validate_json(text)
        except ValidationError as e:
            fields = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()[:5])
            raise StateError(f"{where}: not a run state this version can read ({fields})") from None
        return st

    def model_post_init(self, context: Any) -> None:
        if self.fed < 0:  # a new run, or one written before the prompt gate: = prompts pulled
            self.fed = self.feeder_position
        if self.dlq_replaced < 0:  # a new run (0), or one written when each DLQ loss got a new prompt
            self.dlq_replaced = self.counts.get(Count.dlq.value, 0)

    def count(self, what: Count, n: int = 1) -> None:
        self.counts[what.value] = self.counts.get(what.value, 0) + n


@dataclass
class Ready:
    """A scored group read from rl.scored (or rl.releases), waiting in the train buffer for an update."""

    group: ScoredGroup
    partition: int
    offset: int
    arrival: int = 0           # arrival number (fifo eviction: services/learner/buffer.py)
    topic: str = "rl.scored"   # where it was read (catalogue name): rl.scored or rl.releases
