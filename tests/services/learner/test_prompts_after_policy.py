"""The next step's prompts leave right after the policy record, before the step's bookkeeping,
and the state saved at the end of the step records them (issue 22: at max_staleness 0 the actor
waits for them; on SmolLM2 they left 0.68 s after the record, behind the audit line, the
rollout cache, the history and the drift gauges)."""

import json

from steadyrl.services.learner import loop
from tests.services.learner.conftest import Msg, scored


def test_the_next_prompts_follow_the_policy_record_and_the_saved_state_has_them(make_learner, monkeypatch):
    lrn = make_learner(steps=3, prompts_per_step=4, max_staleness=0)
    lrn.store.publish(lrn.model, lrn.state)
    lrn.feeder.top_up()
    first = sorted(lrn.state.in_flight)
    for i, pid in enumerate(first):
        lrn.intake.accept(Msg(scored(lrn.state, pid), pid, offset=i))
    sent_at_audit: list[int] = []  # records produced when the step's audit line is written
    real_audit = loop.append_audit
    monkeypatch.setattr(loop, "append_audit", lambda *a: (sent_at_audit.append(len(lrn.outbox.sent)), real_audit(*a)))
    sent_before = len(lrn.outbox.sent)

    assert lrn.train_step() is not None

    after = [(t, v) for t, _, v in lrn.outbox.sent[sent_before:]]
    assert [t for t, _ in after] == ["rl.policy"] + ["rl.prompts"] * 4  # the next B prompts, at once
    assert all(v.min_policy_version == 1 for _, v in after[1:])        # for the version just announced
    assert sent_at_audit == [sent_before + 5]                         # they left before the bookkeeping
    saved = json.loads((lrn.run_dir / "state.json").read_text())
    nxt = sorted(v.prompt_id for _, v in after[1:])
    assert saved["step"] == 1 and sorted(saved["in_flight"]) == nxt and not set(nxt) & set(first)
    assert saved["fed"] == 8
