"""Releases on a real broker (issue 21): only rl.releases, which `steadyrl quarantine release`
alone writes, releases a held group to the learner. The same group with the release header on
rl.scored (what the command wrote before, and what anyone who may write rl.scored could forge)
stays held. The learner's saved offsets re-read a release not yet trained, and a run saved
before rl.releases existed reads it from the start."""

from __future__ import annotations

import getpass
import json
import socket
import time
from types import SimpleNamespace

from confluent_kafka import Producer

from steadyrl.bus.kafka import read_topic
from steadyrl.run.quarantine import RELEASE_HEADER, batch_id, decide, read_quarantine
from steadyrl.services.learner import loop
from steadyrl.services.learner.config import LearnerConfig
from steadyrl.services.learner.intake import open_consumer
from steadyrl.services.learner.state import Held, RunState
from steadyrl.wire import codec
from steadyrl.wire.contracts import QuarantineAction, QuarantinedGroup
from tests.services.learner.conftest import FakeOutbox, scored


def _learner(bootstrap: str, prefix: str, tmp_path, monkeypatch) -> loop.Learner:
    """The real learner on the tiny model, its topics under `prefix` (what it produces kept)."""
    monkeypatch.setattr(loop, "Outbox", FakeOutbox)
    lc = {"model": "tiny", "data": "tiny_copy:64", "eval_data": None, "steps": 3, "prompts_per_step": 4,
          "group_size": 4, "max_new_tokens": 4, "prompt_gate": {"cooldown_s": 0}, "reward_watch": {"action": "off"},
          "state_dir": tmp_path / "learner", "policy_root": tmp_path / "policies"}
    cfg = LearnerConfig(instance_id="0", bootstrap=bootstrap, topic_prefix=prefix, learner=lc)
    learner = loop.Learner(cfg, SimpleNamespace(beat=lambda: None, expect=lambda seconds: None))
    learner.intake.published = None  # `scored` makes up its prompts (the check: test_intake_prompt.py)
    return learner


def _poll_until(lrn: loop.Learner, done, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"not read within {timeout_s:g} s: counts {lrn.state.counts}"
        lrn.poll()


def _until(read, ok, timeout_s: float = 30.0):
    """read() until ok(what it returned); that value."""
    deadline = time.monotonic() + timeout_s
    while not ok(got := read()):
        assert time.monotonic() < deadline, got
        time.sleep(0.2)
    return got


def _produce(bootstrap: str, topic: str, key: str, value: bytes, headers: list) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    p.produce(topic, value, key.encode(), headers=headers)
    assert p.flush(30) == 0


def test_only_rl_releases_releases_a_held_group(bootstrap, prefix, tmp_path, monkeypatch):
    lrn = _learner(bootstrap, prefix, tmp_path, monkeypatch)
    st = lrn.state
    lrn.feeder.top_up()
    pid = min(st.in_flight, key=lambda p: st.in_flight[p].seq)
    sg = scored(st, pid)
    # the reward watch held this prompt's group: out of the run, on rl.quarantine
    bid = batch_id(st.run_id, 1, [pid])
    st.quarantined[pid] = Held(**st.in_flight.pop(pid).model_dump(), batch_id=bid)
    value, headers = codec.encode(QuarantinedGroup(batch_id=bid, run_id=st.run_id, step=1, index=0, count=1,
                                                   rules=["variance"], group=sg))
    _produce(bootstrap, f"{prefix}rl.quarantine", bid, value, headers)
    lrn.consumer = open_consumer(bootstrap, "learner-test", lrn.topics, st, 5.0)
    try:
        assert st.release_offsets == {"0": 0}  # a new run: rl.releases' end

        # the release header on rl.scored: counted, read as any group, the prompt stays held
        value, headers = codec.encode(sg)
        _produce(bootstrap, f"{prefix}rl.scored", pid, value, headers + [(RELEASE_HEADER, bid.encode())])
        _poll_until(lrn, lambda: st.counts.get("release_on_scored", 0) == 1)
        assert pid in st.quarantined and pid not in st.in_flight and lrn.intake.ready == {}
        assert st.counts.get("released", 0) == 0 and st.counts["duplicate"] == 1

        # the command: the group on rl.releases, the decision (who made it) on rl.quarantine
        entry = decide(bootstrap, bid, QuarantineAction.release, note="looked fine", prefix=prefix)
        assert entry.decision.by == f"{getpass.getuser()}@{socket.gethostname()}"
        # committed; read_committed readers see it once the commit markers are written
        decided = _until(lambda: read_quarantine(bootstrap, prefix)[bid], lambda e: e.status == "released")
        assert decided.decision.by == entry.decision.by and decided.decision.note == "looked fine"
        on_releases = _until(lambda: read_topic(bootstrap, f"{prefix}rl.releases", "test-releases"), bool)
        assert [(m.key().decode(), codec.header_value(m.headers(), RELEASE_HEADER)) for m in on_releases] == [
            (pid, bid)]
        assert len(read_topic(bootstrap, f"{prefix}rl.scored", "test-releases")) == 1  # only the forged one

        _poll_until(lrn, lambda: st.counts.get("released", 0) == 1)
        assert pid not in st.quarantined and st.in_flight[pid].released is True
        waiting = lrn.intake.ready[pid]
        assert (waiting.topic, waiting.offset) == ("rl.releases", on_releases[0].offset())
        assert st.release_offsets == {"0": on_releases[0].offset() + 1}  # read past it, ...
        saved = json.loads(lrn._state_json())  # ... but what is saved re-reads it until it is trained
        assert saved["release_offsets"] == {"0": on_releases[0].offset()}
    finally:
        lrn.consumer.close()

    # a resumed learner reads it again from rl.releases, from the saved offset
    again = RunState.parse(json.dumps(saved), "saved")
    c = open_consumer(bootstrap, "learner-test-resumed", lrn.topics, again, 5.0)
    try:
        deadline, got = time.monotonic() + 30, []
        while not got and time.monotonic() < deadline:
            got = [m for m in c.consume(16, timeout=0.5) if m.error() is None and m.topic() == f"{prefix}rl.releases"]
        assert [(m.key().decode(), m.offset()) for m in got] == [(pid, on_releases[0].offset())]
    finally:
        c.close()

    # a run saved before rl.releases existed (offsets, no release_offsets) reads it from the start;
    # a new run from its end (past the release and its transaction's commit marker)
    old = RunState(run_id=st.run_id, offsets=dict(st.offsets))
    new = RunState(run_id=st.run_id)
    for s in (old, new):
        open_consumer(bootstrap, "learner-test-old", lrn.topics, s, 5.0).close()
    assert old.release_offsets == {"0": 0} and new.release_offsets["0"] > on_releases[0].offset()
