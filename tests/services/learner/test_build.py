"""The learner assembled in one place (services/learner/loop.py `build`): the configuration it
is given is not rewritten; what is derived from it is in the copy the learner runs."""

from types import SimpleNamespace

from steadyrl.rl.config import resolve_autocast
from steadyrl.services.learner import loop
from steadyrl.services.learner.config import LearnerConfig
from tests.services.learner.conftest import FakeOutbox


def test_build_leaves_the_config_as_given_and_runs_a_resolved_copy(tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "topic_id", lambda *a, **kw: "test-topic-id")
    monkeypatch.setattr(loop, "Outbox", FakeOutbox)
    lc = {"model": "tiny", "data": "tiny_copy:64", "eval_data": None, "steps": 3, "prompts_per_step": 4,
          "group_size": 4, "max_new_tokens": 4, "state_dir": tmp_path / "learner",
          "policy_root": tmp_path / "policies", "train": {"autocast": "auto"}}
    cfg = LearnerConfig(instance_id="0", learner=lc)
    before = cfg.model_dump(mode="json")

    learner = loop.build(cfg, SimpleNamespace(beat=lambda: None, expect=lambda seconds: None))

    assert cfg.model_dump(mode="json") == before and cfg.learner.train.autocast == "auto"
    resolved = resolve_autocast("auto", "cpu")[0]
    assert learner.lc.train.autocast == learner.trainer.cfg.autocast == resolved
    assert learner.state.train["autocast"] == resolved   # the value saved with the run
    # the parts are the learner's own, wired to each other
    assert learner.intake.published == learner.feeder.prompt and learner.store.outbox is learner.outbox
    assert learner.progress["phase"] == "starting" and learner.consumer is None and learner.assigned == []
