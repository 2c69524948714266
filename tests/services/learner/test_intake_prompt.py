"""A group's prompt must be the one the learner published (services/learner/intake.py
prompt_differs): a stage that rewrote it (its ground truth, its question) is refused and sent
to rl.dlq, never trained. Regression from the issue 21 review: the rollout principal may write
rl.rollouts, and the reward workers score against the ground truth the record carries."""

from steadyrl.services.learner.config import LearnerSection
from steadyrl.services.learner.intake import Intake, prompt_differs
from steadyrl.services.learner.state import InFlight, RunState
from tests.services.learner.conftest import FakeOutbox
from tests.services.learner.test_intake_release import Msg, group


def published(pid: str, f: InFlight):
    return group(pid, 0.0).group.prompt


def intake() -> Intake:
    st = RunState(run_id="r1")
    st.in_flight["r1/e0-i1"] = InFlight(seq=1, epoch=0, index=1)
    lrn = Intake(LearnerSection(model="tiny"), st, outbox=FakeOutbox(), stage="learner/0")
    lrn.published = published
    return lrn


def test_a_group_with_its_published_prompt_is_accepted():
    lrn = intake()
    lrn.accept(Msg(group("r1/e0-i1", 1.0), offset=0))
    assert list(lrn.ready) == ["r1/e0-i1"] and lrn.outbox.sent == []


def test_a_rewritten_ground_truth_is_refused_to_the_dlq_and_not_trained():
    lrn = intake()
    forged = group("r1/e0-i1", 1.0)
    forged = forged.model_copy(update={"group": forged.group.model_copy(update={
        "prompt": forged.group.prompt.model_copy(update={"ground_truth": "whatever the forger answered"})})})
    lrn.accept(Msg(forged, offset=0))
    assert lrn.ready == {} and lrn.st.counts == {"rejected": 1}
    (topic, key, record), = lrn.outbox.sent
    assert topic == "rl.dlq" and key == "r1/e0-i1"
    assert "ground_truth" in record.error and record.reason.value == "rejected"
    assert "r1/e0-i1" in lrn.st.in_flight        # still owed: rl.dlq publishes it again


def test_prompt_differs_names_the_field_and_ignores_the_seed():
    p = group("r1/e0-i1", 0.0).group.prompt
    assert prompt_differs(p, p) is None
    assert prompt_differs(p.model_copy(update={"seed": 99}), p) is None      # a republished attempt
    assert prompt_differs(p.model_copy(update={"messages": [{"role": "user", "content": "4"}]}), p) == "messages"
