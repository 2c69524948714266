"""A learner without a broker: the real loop parts on the tiny model, with the topic-id lookup
and the producer replaced (what it would send is kept in `learner.outbox.sent`). Tests drive
its parts directly: feeder.top_up(), intake.accept()/dead_letter() with `Msg`, train_step()."""

import random
import zlib
from types import SimpleNamespace

import pytest

from steadyrl.wire import codec
from steadyrl.wire.contracts import Prompt, RewardSource, RolloutGroup, Sample, ScoredGroup


class FakeOutbox:
    """Outbox's interface; keeps (topic, key, value) of every record produced."""

    def __init__(self, *args, **kwargs):
        self.sent: list[tuple[str, str, object]] = []
        self.flushes = 0

    def produce(self, topic, key, value):
        self.sent.append((topic, key.decode() if isinstance(key, bytes) else key, value))

    def flush(self, timeout_s: float = 120):
        self.flushes += 1

    def close(self):
        pass

    def on(self, topic: str) -> list:
        return [(k, v) for t, k, v in self.sent if t == topic]


class Msg:
    """A consumed record: `value` a contract (encoded as a producer would) or raw bytes."""

    def __init__(self, value, key: str, offset: int = 0, topic: str = "rl.scored", partition: int = 0,
                 headers=None):
        if isinstance(value, bytes):
            self._v, self._h = value, headers or []
        else:
            self._v, self._h = codec.encode(value)
        self._k, self._o, self._t, self._p = key.encode(), offset, topic, partition

    def value(self): return self._v
    def headers(self): return self._h
    def key(self): return self._k
    def offset(self): return self._o
    def partition(self): return self._p
    def topic(self): return self._t
    def error(self): return None


def scored(st, pid: str, version: int | None = None, prompt_ids=(5, 6, 7), seed: int = 0,
           responses=None, rewards=None) -> ScoredGroup:
    """A scored group of the in-flight (or held) prompt `pid` of run state `st`: valid tiny-model
    token ids unless `prompt_ids` / `responses` say otherwise."""
    f = st.in_flight.get(pid) or st.quarantined[pid]
    rng = random.Random(zlib.crc32(f"{pid}|{seed}".encode()))
    responses = responses or [[rng.randrange(4, 40) for _ in range(3)] for _ in range(4)]
    rewards = rewards or [float(rng.random() < 0.5) for _ in responses]
    p = Prompt(prompt_id=pid, epoch=f.epoch, index=f.index, messages=[{"role": "user", "content": "3"}],
               n_samples=len(responses), run_id=st.run_id, attempt=f.attempt)
    g = RolloutGroup(prompt=p, prompt_token_ids=list(prompt_ids),
                     policy_version=st.step if version is None else version,
                     samples=[Sample(text="x", token_ids=r, logprobs=[-1.0] * len(r)) for r in responses])
    return ScoredGroup(group=g, rewards=rewards, reward_source=RewardSource.rule, scorer="rule:t@1")


@pytest.fixture
def make_learner(tmp_path, monkeypatch):
    """make_learner(**learner_section) -> a Learner (services/learner/loop.py) on the tiny model."""
    from steadyrl.services.learner import loop
    from steadyrl.services.learner.config import LearnerConfig

    monkeypatch.setattr(loop, "topic_id", lambda *a, **kw: "test-topic-id")
    monkeypatch.setattr(loop, "Outbox", FakeOutbox)

    def make(**section):
        lc = {"model": "tiny", "data": "tiny_copy:64", "eval_data": None, "steps": 3, "prompts_per_step": 4,
              "group_size": 4, "max_new_tokens": 4, "max_staleness": 0, "prompt_gate": {"cooldown_s": 0},
              "reward_watch": {"action": "off"}, "state_dir": tmp_path / "learner",
              "policy_root": tmp_path / "policies", "train": {"lr": 1e-2, "micro_batch_size": 64}, **section}
        cfg = LearnerConfig(instance_id="0", learner=lc)
        learner = loop.Learner(cfg, SimpleNamespace(beat=lambda: None, expect=lambda seconds: None))
        # `scored` makes up its prompts: the published-prompt check (test_intake_prompt.py, and
        # every pipeline test through the real feeder) is off for these
        learner.intake.published = None
        return learner

    return make
