"""What a group read from rl.scored or rl.releases becomes: a pure decision (no I/O, counters or
logs) over the decoded group's facts, as the actor's version gate (services/actor/gate.py).
`Intake.accept` decodes the record, gathers the `Facts`, calls `decide`, and acts on the
`Decision` in one place (services/learner/intake.py; the outcomes are its module doc's).

Decisions, first that applies:

- FOREIGN: the group's prompt is of another run.
- PROMPT_DIFFERS (to rl.dlq, reason rejected): one the learner takes whose prompt is not the
  one it published (a stage rewrote its question, answer or id); never trained.
- INVALID_TOKENS (to rl.dlq, reason invalid_tokens): one the learner takes whose token ids the
  model cannot take; never trained. A released copy refused so stays held.
- RELEASED: on rl.releases, a held prompt (`steadyrl quarantine release`): trained as it is.
- RELEASED_IN_FLIGHT: on rl.releases, a prompt in flight not yet released (a learner resumed
  from before the hold): the released copy replaces the original.
- DUPLICATE: not in flight, or waiting in the buffer already (a held group read again on
  rl.scored stays held).
- ACCEPTED: one of the prompts in flight: it waits in the buffer for an update.

REJECTED (the codec refused the record: to rl.dlq with the codec's reason) comes before any
decision: there is no decoded group to decide on.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from steadyrl.run.runfolder import Count
from steadyrl.wire.contracts import DLQReason


class Outcome(enum.Enum):
    """What a record read becomes; the value is the label of `steadyrl_learner_groups_total`."""

    ACCEPTED = "accepted"
    RELEASED = "released"
    RELEASED_IN_FLIGHT = "released_in_flight"
    DUPLICATE = "duplicate"
    FOREIGN = "foreign"
    REJECTED = "rejected"
    PROMPT_DIFFERS = "prompt_differs"
    INVALID_TOKENS = "invalid_tokens"


#: The run's count (state.json `counts`) each outcome adds one to; ACCEPTED counts none.
COUNTS = {Outcome.RELEASED: Count.released, Outcome.RELEASED_IN_FLIGHT: Count.released_in_flight,
          Outcome.DUPLICATE: Count.duplicate, Outcome.FOREIGN: Count.foreign, Outcome.REJECTED: Count.rejected,
          Outcome.PROMPT_DIFFERS: Count.rejected, Outcome.INVALID_TOKENS: Count.rejected}
#: The DLQ reason of the outcomes that send the record to rl.dlq (REJECTED: the codec's).
DEAD_LETTERED = {Outcome.PROMPT_DIFFERS: DLQReason.rejected, Outcome.INVALID_TOKENS: DLQReason.invalid_tokens}


@dataclass(frozen=True)
class Facts:
    """What the decision needs about a decoded group and its prompt id, from the run state and
    the train buffer."""

    ours: bool          # its prompt's run_id is this run's
    on_releases: bool   # read on rl.releases (only its records are releases: authorship by topic)
    in_flight: bool     # the prompt is in flight (state.in_flight)
    released: bool      # ... and released already (InFlight.released)
    held: bool          # the prompt is held on rl.quarantine (state.quarantined)
    waiting: bool       # a group of the prompt waits in the train buffer

    @property
    def release(self) -> bool:
        """A release: on rl.releases, of a held prompt or of one in flight not released yet."""
        return self.on_releases and (self.held or (self.in_flight and not self.released))

    @property
    def takes(self) -> bool:
        """The learner would take the group (a release, or ours in flight and not waiting): only
        such a group's prompt and token ids are checked (`decide`'s `differs`, `invalid`)."""
        return self.ours and (self.release or (self.in_flight and not self.waiting))


@dataclass(frozen=True)
class Decision:
    """An outcome and, for one sent to rl.dlq, why (the DLQ record's detail, after the prompt id)."""

    outcome: Outcome
    why: str = ""


def decide(f: Facts, differs: str | None = None, invalid: str | None = None) -> Decision:
    """The decision for a decoded group (the module doc's rules, in order).

    `differs`: the first field where the group's prompt differs from the published one
    (intake.prompt_differs), `invalid`: why the model cannot take its token ids
    (TokenLimits.violation); the caller checks them only where `f.takes` (else None)."""
    if not f.ours:
        return Decision(Outcome.FOREIGN)
    if differs is not None:
        return Decision(Outcome.PROMPT_DIFFERS, f"prompt {differs} differs from the one published")
    if invalid is not None:
        return Decision(Outcome.INVALID_TOKENS, invalid)
    if f.release:
        return Decision(Outcome.RELEASED if f.held else Outcome.RELEASED_IN_FLIGHT)
    if not f.in_flight or f.waiting:
        return Decision(Outcome.DUPLICATE)
    return Decision(Outcome.ACCEPTED)
