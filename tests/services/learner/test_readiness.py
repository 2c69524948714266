"""The learner's /readyz checks real things (regression: its `model` check was `lambda: (True, ...)`,
so a learner that never published a version or lost its consumer reported ready)."""

from types import SimpleNamespace

from confluent_kafka import TopicPartition

from steadyrl.services.learner.main import assignment_check, model_check
from steadyrl.services.learner.state import RunState


class NeverAsk:
    """A consumer whose assignment() must not be called from the probe thread (it blocks while
    the loop polls: regression, /readyz and /metrics hung while the learner was starved)."""

    def assignment(self):
        raise AssertionError("the readiness check asked the consumer")


def learner(assigned=(), policy_uri="", consumer=None):
    st = RunState(run_id="r1", step=3, policy_uri=policy_uri, offsets={"0": 5, "1": 7}, release_offsets={"0": 2})
    return SimpleNamespace(state=st, lc=SimpleNamespace(model="tiny"), model=object(), consumer=consumer,
                           assigned=list(assigned), topics={"rl.scored": "p.rl.scored", "rl.releases": "p.rl.releases"})


def test_model_is_ready_only_once_a_version_is_published():
    assert model_check(learner())[0] is False
    ok, detail = model_check(learner(policy_uri="r1/v000003"))
    assert ok and "step 3" in detail


def test_assignment_needs_every_partition_of_rl_scored_and_rl_releases():
    assert assignment_check(learner())[0] is False                                  # not reading yet
    one = [TopicPartition("p.rl.scored", 0), TopicPartition("p.rl.dlq", 0), TopicPartition("p.rl.releases", 0)]
    assert assignment_check(learner(one, consumer=NeverAsk()))[0] is False          # 1 of 2
    both = one + [TopicPartition("p.rl.scored", 1)]
    assert assignment_check(learner(both, consumer=NeverAsk())) == (
        True, "2 partitions of rl.scored and 1 of rl.releases assigned")
    no_releases = [tp for tp in both if tp.topic != "p.rl.releases"]                # releases would go unread
    assert assignment_check(learner(no_releases, consumer=NeverAsk())) == (
        False, "0 of 1 partitions of rl.releases assigned")
    assert assignment_check(learner([], consumer=NeverAsk()))[0] is False           # the run ended: closed
