"""The learner's reading of rl.scored and rl.releases around quarantine (regressions from review):
a held group read again after a restart stays held; only a copy on rl.releases (which
`steadyrl quarantine release` alone writes) is trained, once; the release header on rl.scored
releases nothing."""

from prometheus_client import REGISTRY

from steadyrl.run.quarantine import RELEASE_HEADER, batch_id
from steadyrl.services.learner.config import LearnerSection
from steadyrl.services.learner.intake import Intake
from steadyrl.services.learner.state import Held, InFlight, RunState
from steadyrl.wire import codec
from steadyrl.wire.contracts import Prompt, RewardSource, RolloutGroup, Sample, ScoredGroup


class Msg:
    def __init__(self, sg: ScoredGroup, offset: int, release: str | None = None, partition: int = 0):
        self._v, self._h = codec.encode(sg)
        if release:
            self._h = self._h + [(RELEASE_HEADER, release.encode())]
        self._o, self._k, self._p = offset, sg.prompt_id.encode(), partition

    def value(self): return self._v
    def headers(self): return self._h
    def offset(self): return self._o
    def partition(self): return self._p
    def key(self): return self._k
    def topic(self): return "rl.scored"


def group(pid: str, reward: float) -> ScoredGroup:
    p = Prompt(prompt_id=pid, epoch=0, index=1, messages=[{"role": "user", "content": "3"}], n_samples=2,
               run_id="r1")
    g = RolloutGroup(prompt=p, samples=[Sample(text="3", token_ids=[5], logprobs=[-0.1])] * 2, policy_version=4)
    return ScoredGroup(group=g, rewards=[reward] * 2, reward_source=RewardSource.rule, scorer="rule:t@1")


def learner(state: RunState) -> Intake:
    """The learner's intake of rl.scored and rl.releases, on `state` (no broker; the defaults of the config)."""
    return Intake(LearnerSection(model="tiny"), state, outbox=None, stage="learner/0")


def held_state() -> RunState:
    st = RunState(run_id="r1")
    st.quarantined["r1/e0-i1"] = Held(seq=3, epoch=0, index=1, attempt=0, released=False,
                                      evicted=0, batch_id=batch_id("r1", 5, ["r1/e0-i1"]))
    return st


def test_a_held_group_read_again_without_the_release_header_stays_held():
    lrn = learner(held_state())
    lrn.accept(Msg(group("r1/e0-i1", 5.0), offset=7))      # the original, re-read after a restart
    assert "r1/e0-i1" in lrn.st.quarantined and lrn.ready == {}
    assert lrn.st.counts == {"duplicate": 1}


def test_the_released_copy_is_trained_once_as_released():
    bid = batch_id("r1", 5, ["r1/e0-i1"])
    lrn = learner(held_state())
    lrn.accept(Msg(group("r1/e0-i1", 5.0), offset=9, release=bid), releases=True)
    assert lrn.st.quarantined == {} and list(lrn.ready) == ["r1/e0-i1"]
    assert lrn.st.in_flight["r1/e0-i1"].released is True
    assert type(lrn.st.in_flight["r1/e0-i1"]) is InFlight  # not Held: no batch id
    assert lrn.ready["r1/e0-i1"].topic == "rl.releases" and lrn.st.release_offsets == {"0": 10}
    assert lrn.st.offsets == {}                                       # rl.scored's offsets untouched
    lrn.accept(Msg(group("r1/e0-i1", 5.0), offset=10, release=bid), releases=True)   # released twice: a duplicate
    assert lrn.st.counts == {"released": 1, "duplicate": 1}


def test_the_release_header_on_rl_scored_releases_nothing():
    """Anyone who may write rl.scored (a reward worker, a forger) cannot release a held group:
    the header there is counted and the group read as any other (a held one stays held)."""
    bid = batch_id("r1", 5, ["r1/e0-i1"])
    lrn = learner(held_state())
    metric = lambda: REGISTRY.get_sample_value("steadyrl_learner_release_on_scored_total") or 0.0
    before = metric()
    lrn.accept(Msg(group("r1/e0-i1", 9.0), offset=11, release=bid))
    assert metric() == before + 1
    assert "r1/e0-i1" in lrn.st.quarantined and lrn.ready == {} and "r1/e0-i1" not in lrn.st.in_flight
    assert lrn.st.counts == {"release_on_scored": 1, "duplicate": 1}
    assert lrn.st.offsets == {"0": 12} and lrn.st.release_offsets == {}
    # nor can it replace a prompt's group once that prompt is in flight again: read as an ordinary group
    st = RunState(run_id="r1")
    st.in_flight["r1/e0-i2"] = InFlight(seq=4, epoch=0, index=2)
    lrn = learner(st)
    lrn.accept(Msg(group("r1/e0-i2", 0.5), offset=3))                 # the genuine group: waits
    lrn.accept(Msg(group("r1/e0-i2", 9.0), offset=4, release="r1/q000005-x"))
    assert lrn.ready["r1/e0-i2"].group.rewards == [0.5, 0.5] and lrn.st.in_flight["r1/e0-i2"].released is False
    assert lrn.st.counts == {"release_on_scored": 1, "duplicate": 1}


def test_saved_offsets_re_read_a_waiting_release_from_rl_releases():
    bid = batch_id("r1", 5, ["r1/e0-i1"])
    st = held_state()
    st.offsets, st.release_offsets = {"0": 40, "1": 41}, {"0": 7}
    st.in_flight["r1/e0-i2"] = InFlight(seq=4, epoch=0, index=2)
    lrn = learner(st)
    lrn.accept(Msg(group("r1/e0-i1", 5.0), offset=7, release=bid), releases=True)
    lrn.accept(Msg(group("r1/e0-i2", 0.5), offset=41, partition=1))
    assert (lrn.st.offsets, lrn.st.release_offsets) == ({"0": 40, "1": 42}, {"0": 8})     # read past both
    assert lrn.saved_offsets() == {"offsets": {"0": 40, "1": 41}, "release_offsets": {"0": 7}}  # both re-read


def test_a_release_reaching_a_learner_resumed_from_before_the_hold_replaces_the_original():
    st = RunState(run_id="r1")   # restored from a checkpoint older than the hold: the prompt is in flight
    st.in_flight["r1/e0-i1"] = InFlight(seq=3, epoch=0, index=1, attempt=0, released=False, evicted=0)
    lrn = learner(st)
    lrn.accept(Msg(group("r1/e0-i1", 5.0), offset=7))                     # original: waits to be judged
    lrn.accept(Msg(group("r1/e0-i1", 5.0), offset=9, release="r1/q000005-x"), releases=True)
    assert lrn.ready["r1/e0-i1"].offset == 9 and lrn.st.in_flight["r1/e0-i1"].released is True
    assert lrn.st.counts == {"released_in_flight": 1}  # not "released": the feeder replaced nothing


def test_batch_ids_name_the_groups_not_the_order():
    assert batch_id("r1", 5, ["b", "a"]) == batch_id("r1", 5, ["a", "b"]) != batch_id("r1", 5, ["a", "c"])
