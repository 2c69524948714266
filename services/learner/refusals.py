"""What the learner makes of the refusals rl.dlq sends back: which reasons came since the last
step (named in its warning), and the rule that stops a run whose reward scorer fails on
everything.

The reward server reports per item what the user's scorer did wrong, and the reward worker
sends the group to rl.dlq with the first such item's kind as the reason: `scorer_error` (it
raised, or returned what is not a number: "0.7", True), `scorer_timeout` (it ran past
reward_server.item_timeout_s, or past the call's deadline), `scorer_crash` (it killed its
process: os._exit, a segfault) or `non_finite` (NaN, infinity); the error is `prompt <id>: <k>
of <n> items unscored: <the first item's error>`, which names the scorer, e.g. `scorer <spec>
raised <Type>: <message> (at <file>:<line> in <function>: <code>)` (services/reward/client.py
`scorer_error_detail`, steadyrl/model/scorepool.py). The learner publishes the prompt again
(intake.py), as for any refusal.

The stop rule (`Refusals.failing`): `limit` groups in a row on whose every sample the scorer
failed (any of those four kinds, mixed or not), with no group scored in between (any group of
this run read from rl.scored resets the count; so does a group the scorer failed on only in
part: it can score some responses). Counted since the last group scored, not over the whole
run: a run that trained for hours and then reaches rows the scorer cannot take (a second data
source, another answer format) gets the same clear stop, with its last checkpoint, instead of
abandoning every row from there on, which loses them; and a scorer that fails on some items
only never stops the run, since the groups it scores reset the count (the groups it failed on
are refused and published again, and abandoned after learner.prompt_max_refusals, as before).
An open breaker or a reward server down never send a group to rl.dlq (the reward worker holds
it), and `retries_exhausted` or any other reason neither counts nor resets: only what the
scorer itself did. Only records that name a prompt in flight count (intake.py filters them):
one record per publish.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from steadyrl.wire.contracts import DLQReason

#: The error a reward worker writes for reason scorer_error (client.scorer_error_detail).
SCORER_ERROR = re.compile(r"prompt \S+: (\d+) of (\d+) items unscored: (.*)", re.S)
#: Characters of an example error kept in a summary.
EXAMPLE_CHARS = 300


def default_limit(prompts_per_step: int) -> int:
    """learner.scorer_failure_limit when unset: max(16, 2 x prompts_per_step) groups."""
    return max(16, 2 * prompts_per_step)


#: The reasons that are the scorer's own failure on items, each counted by the stop rule.
SCORER_FAILURES = frozenset(r.value for r in (DLQReason.scorer_error, DLQReason.scorer_timeout,
                                              DLQReason.scorer_crash, DLQReason.non_finite))


def scorer_items(reason: str, error: str) -> tuple[int, int, str] | None:
    """(items the scorer failed on, items of the group, the first item's error) of a refusal for
    one of SCORER_FAILURES; None for another reason or an error not in the reward worker's form
    (a non_finite record of a worker before 1.4's kinds)."""
    if reason not in SCORER_FAILURES:
        return None
    m = SCORER_ERROR.match(error)
    if m is None:
        return None
    return int(m[1]), int(m[2]), m[3]


@dataclass
class Tally:
    """Refusals of one (service, reason) since the last step: groups, items the scorer raised
    on and items of those groups (scorer_error only), the first error seen."""

    groups: int = 0
    failed: int = 0
    items: int = 0
    first: str = ""


class Refusals:
    """The refusals since the last step and the scorer's run of failures (module doc).

    Args:
        limit: groups in a row the scorer raised on entirely that stop the run.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.since_step: dict[tuple[str, str], Tally] = {}
        self.streak = 0          # groups in a row the scorer failed on entirely, none scored since
        self.streak_items = 0    # their samples
        self.streak_first = ""   # the first item's error of the first of them
        self.streak_kinds: dict[str, int] = {}   # their reasons (scorer_error, scorer_timeout, ...): groups

    def refused(self, stage: str, reason: str, error: str) -> None:
        """A refusal of a prompt in flight: `stage` the DLQ record's (`reward/reward-0`), its reason
        and error."""
        service = stage.split("/", 1)[0] or "?"
        t = self.since_step.setdefault((service, reason), Tally())
        t.groups += 1
        parsed = scorer_items(reason, error)
        if parsed is None:
            t.first = t.first or error[:EXAMPLE_CHARS]
            return
        failed, items, first = parsed
        t.failed, t.items = t.failed + failed, t.items + items
        t.first = t.first or first[:EXAMPLE_CHARS]
        if failed < items:   # it scored some of them: a scorer that works on part of the responses
            self.scored()
            return
        if self.streak == 0:
            self.streak_first = first[:EXAMPLE_CHARS]
        self.streak += 1
        self.streak_items += items
        self.streak_kinds[reason] = self.streak_kinds.get(reason, 0) + 1

    def scored(self) -> None:
        """A group of this run was scored: the scorer works."""
        self.streak, self.streak_items, self.streak_first = 0, 0, ""
        self.streak_kinds = {}

    def stepped(self) -> None:
        """A step was made: the next summary starts anew."""
        self.since_step.clear()

    def summary(self) -> str:
        """The refusals since the last step, most first: `reward: scorer x raised ValueError: ...
        (64 of the last 64 items)`, `rollout: validation_failed x4 (first: ...)`."""
        parts = []
        for (service, reason), t in sorted(self.since_step.items(), key=lambda kv: -kv[1].groups):
            if t.items:
                parts.append(f"{service}: {t.first} ({t.failed} of the last {t.items} items)")
            else:
                parts.append(f"{service}: {reason} x{t.groups} (first: {t.first})")
        return "; ".join(parts) or "none"

    def failing(self) -> str | None:
        """Why the run must stop (the scorer failed on every sample of `limit` groups in a row,
        none scored in between: raised, timed out, crashed or returned what is not a finite
        number), or None. Names the kinds (most first) and the first item's error, which names
        the scorer."""
        if self.streak < self.limit:
            return None
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(self.streak_kinds.items(), key=lambda kv: -kv[1]))
        return (f"the reward scorer failed on every sample of {self.streak} groups in a row ({self.streak_items} "
                f"items; {kinds}) and scored none: {self.streak_first}. Make it return a finite number for every "
                f"response, within reward_server.item_timeout_s (e.g. 0.0 for one it cannot read), try it with "
                f"`steadyrl score --scorer SPEC --response TEXT`, and run again (the run resumes); "
                f"learner.scorer_failure_limit ({self.limit}) sets how many")
