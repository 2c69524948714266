"""The prompt feeder: publishes the run's prompts on rl.prompts, never more than the
staleness rule allows in flight.

Prompts get deterministic ids `{run_id}/e{epoch}-i{index}` in the order of
`steadyrl.rl.loop.prompt_batches` (the in-process loop's order; `prompt_order` draws it
without the rows), each with its sampling
settings, seed and `min_policy_version` = the newest version at publish time. At most
(max_staleness + 1) x B prompts are in flight (published, not yet trained), and never more
than steps x B new prompts in all (plus one for each prompt held on rl.quarantine, less those
released, and one for each prompt an older learner lost to rl.dlq: `RunState.dlq_replaced`),
so a finished run leaves none untrained. Prompts whose group was dropped (stale, evicted) or
named on rl.dlq are published again with the same id and a new seed (`requeue`). The prompt
gate (services/learner/prompt_gate.py) keeps near-duplicates of recent prompts waiting.

Rows are read when published (the dataset is an index: steadyrl.model.data.Rows), and checked the
first time the order reaches them (services/learner/rows.py RowCheck): a bad row is skipped in
the dataset order, never published (recorded and counted by the check). A prompt abandoned
(refused past its budget: intake.py) is replaced like one lost to rl.dlq once was: one more
new prompt each (`counts.abandoned`). A prompt in flight past a bound with no group and no
refusal is published again, same id and seed (`overdue`): its records were lost; a duplicate
group, if the first publish still yields one, is dropped as any duplicate is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence

from prometheus_client import Counter, Gauge

from steadyrl.config import ConfigError
from steadyrl.model.data import PromptRow, RowError
from steadyrl.rl.loop import prompt_order
from steadyrl.run.runfolder import Count
from steadyrl.wire.contracts import Prompt, now_ms

from .config import LearnerSection, data_label
from .outbox import Outbox
from .prompt_gate import PromptGate
from .rows import RowCheck, prompt_record
from .state import InFlight, RunState

IN_FLIGHT = Gauge("steadyrl_learner_prompts_in_flight", "Prompts published and not yet trained")
PUBLISHED = Counter("steadyrl_learner_prompts_published", "Prompts published to rl.prompts", ["kind"])
REPUBLISHED = Counter("steadyrl_learner_prompts_republished", "Prompts in flight longer than the bound "
                      "(learner.republish_factor, republish_min_s) without a group or a refusal: published again, "
                      "same id (their records were lost)")
log = logging.getLogger("steadyrl.learner")


class Feeder:
    """Tops up rl.prompts from the dataset `rows` for the run in `st`. Rows in `skip` are never
    published; with `check` (RowCheck), nor is a row it finds bad when the order reaches it."""

    def __init__(self, lc: LearnerSection, rows: Sequence[PromptRow | RowError], st: RunState, outbox: Outbox,
                 retry_at: dict[str, float] | None = None, skip: frozenset[int] = frozenset(),
                 check: RowCheck | None = None):
        self.lc, self.rows, self.st, self.outbox = lc, rows, st, outbox
        self.skip = skip  # rows left out before the order reaches them: never published
        self.check = check
        self.retry_at = retry_at if retry_at is not None else {}  # prompt id -> monotonic time: wait until
        self.gate = PromptGate(lambda i: "\n".join(m["content"] for m in self._row(i).messages),
                               **lc.prompt_gate.model_dump())
        now = now_ms()
        for f in st.in_flight.values():  # a state of before published_ms: its age counts from now
            f.published_ms = f.published_ms or now
        if st.gate:
            self.gate.restore(st.gate)
        # resume: on from the position taken (whole epochs skipped without drawing them)
        self._order = prompt_order(len(rows), lc.prompts_per_step, lc.seed, st.feeder_position)

    def _row(self, index: int) -> PromptRow:
        row = self.rows[index]
        if not isinstance(row, PromptRow):  # never: only rows the check passed are taken
            raise RuntimeError(f"dataset row {index} is not a prompt: {row}")
        return row

    def _pull(self) -> tuple[int, int]:
        """The next (epoch, index) of the dataset order (the prompt gate may keep it waiting).
        Raises ConfigError (exit 2) once every row is checked and fewer than prompts_per_step
        are good (never after a start_check passed: its rows stay good)."""
        # The position counts the unfiltered order: a resume whose left-out rows differ (a limit
        # raised, a newer check) continues at the same place, never repeating a prompt id.
        check = self.check
        while True:
            epoch, index = next(self._order)
            self.st.feeder_position += 1
            if index in self.skip:
                continue
            if check is None or check.ok(index):
                return epoch, index
            if check.known and check.good < self.lc.prompts_per_step:
                raise ConfigError(f"learner.data {data_label(self.lc.data)}: {check.good} usable rows of "
                                  f"{len(self.rows)} < learner.prompts_per_step {self.lc.prompts_per_step}")

    def prompt(self, pid: str, f: InFlight) -> Prompt:
        """The record of prompt `pid` (attempt n > 0: seed + 7919 n, a new sample)."""
        return prompt_record(self.lc, self._row(f.index), pid, f.epoch, f.index, f.attempt, self.st.run_id,
                             self.st.step)

    def top_up(self) -> int:
        """Publish (and flush) prompts until (max_staleness + 1) x B are in flight and no prompt
        of the requeue is due (`retry_at`: one sent back by rl.dlq waits its backoff); returns
        how many. The caller saves the state when > 0: the gate's
        wall-clock decisions are not repeatable."""
        st, lc = self.st, self.lc
        cap = (lc.max_staleness + 1) * lc.prompts_per_step
        # Prompts held on rl.quarantine are replaced (less those released), and so were prompts lost
        # to rl.dlq before they were published again instead (dlq_replaced: a run of then resumed).
        c = st.counts
        # Abandoned prompts (refused past their budget) are replaced the same way.
        total = (lc.steps * lc.prompts_per_step + st.dlq_replaced + c.get(Count.quarantined.value, 0)
                 - c.get(Count.released.value, 0) + c.get(Count.abandoned.value, 0))
        n, now = 0, time.monotonic()
        due = [pid for pid in st.requeue if self.retry_at.get(pid, 0.0) <= now]
        while (len(st.in_flight) < cap and st.fed < total) or due:
            if due:
                pid = due.pop(0)
                st.requeue.remove(pid)
                self.retry_at.pop(pid, None)
                f = st.in_flight[pid]
                PUBLISHED.labels("again").inc()
            else:
                epoch, index = self.gate.take(self._pull)  # near-duplicates of recent prompts wait
                st.fed += 1
                pid = f"{st.run_id}/e{epoch}-i{index}"
                f = st.in_flight[pid] = InFlight(seq=st.fed, epoch=epoch, index=index)
                PUBLISHED.labels("new").inc()
            self.outbox.produce("rl.prompts", pid, self.prompt(pid, f))
            f.published_ms = now_ms()
            n += 1
        if n:
            self.outbox.flush()
        IN_FLIGHT.set(len(st.in_flight))
        return n

    def overdue(self, waiting: Collection[str], bound_s: float) -> list[str]:
        """Prompts in flight for longer than `bound_s` since their last publish, neither waiting
        in the train buffer (`waiting`), nor queued to go out again, nor held: their records were
        lost (a topic's retention passed while the stack was paused, a consumer group reset, a
        worker that consumed without producing). Each is queued to be published again at once,
        same id and seed (a group that still comes from the first publish is a duplicate,
        dropped), counted and logged. Returns their ids."""
        st, now = self.st, now_ms()
        late = [pid for pid, f in st.in_flight.items()
                if pid not in waiting and pid not in st.requeue and not f.released
                and now - f.published_ms > bound_s * 1000 * 2 ** min(f.overdue, 6)]
        for pid in late:  # each time again, the bound doubles: an outage does not flood rl.prompts
            st.in_flight[pid].overdue += 1
            st.requeue.append(pid)
            self.retry_at.pop(pid, None)
            st.count(Count.republished)
            REPUBLISHED.inc()
        if late:
            log.warning("prompts in flight too long: published again (their records were lost?)",
                        extra={"prompts": late[:10], "count": len(late), "bound_s": round(bound_s, 1)})
        return late
