"""steadyrl.local.stack: the settings more than one process reads, defined once (up's placement and
the actor's interpreter; the learner's section extends LearnerStack)."""

from __future__ import annotations

import pytest

from steadyrl.local.stack import SMOLLM2, ActorStack, LearnerStack, PolicyModel, StackError, VLLMStack, load_stack


@pytest.fixture(autouse=True)
def _no_stack_env(monkeypatch):
    for name in ("STEADYRL_ACTOR__BACKEND", "STEADYRL_LEARNER__MAX_STALENESS", "STEADYRL_LEARNER__WORLD_SIZE",
                 "STEADYRL_ACTOR__MODEL", "STEADYRL_LEARNER__MODEL"):
        monkeypatch.delenv(name, raising=False)


def test_without_a_file_the_defaults():
    s = load_stack(None)
    assert (s.actor.backend, s.learner.max_staleness, s.learner.world_size) == ("torch", 0, 1)
    assert s.placement.learner.threads is None


def test_a_stack_file_the_services_read_loads_leaving_their_own_keys_to_them(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("bootstrap: 127.0.0.1:9\nlearner:\n  max_staleness: 2\n  steps: 5\n  train: {lr: 1.0e-5}\n"
                   "actor:\n  backend: vllm\n  vllm: {dtype: auto}\nrollout: {batch_size: 4}\n"
                   "placement:\n  learner: {threads: 2}\n")
    s = load_stack(cfg)
    assert (s.actor.backend, s.learner.max_staleness, s.learner.world_size) == ("vllm", 2, 1)
    assert s.placement.learner.threads == 2


def test_the_environment_wins_over_the_file(tmp_path, monkeypatch):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("learner:\n  world_size: 2\n")
    monkeypatch.setenv("STEADYRL_LEARNER__WORLD_SIZE", "4")
    monkeypatch.setenv("STEADYRL_LEARNER__MAX_STALENESS", "1")
    s = load_stack(cfg)
    assert (s.learner.world_size, s.learner.max_staleness) == (4, 1)


@pytest.mark.parametrize("text, field", [
    ("learner:\n  world_size: two\n", "learner.world_size"),
    ("learner:\n  max_staleness: -1\n", "learner.max_staleness"),
    ("placement:\n  learner:\n    threads: 0\n", "placement.learner.threads"),
    ("placement:\n  learnr: {threads: 1}\n", "placement.learnr"),
])
def test_a_bad_field_is_named(tmp_path, text, field):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(StackError, match=field.replace(".", r"\.")):
        load_stack(cfg)


def test_a_missing_or_broken_file_is_refused(tmp_path):
    with pytest.raises(StackError, match="not found"):
        load_stack(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("learner: [\n")
    with pytest.raises(StackError, match="not valid YAML"):
        load_stack(tmp_path / "bad.yaml")


def test_the_learner_reads_the_same_fields():
    """One definition: the learner's section is a LearnerStack, so its defaults and bounds are
    the ones `up` places the stack by."""
    from steadyrl.services.learner.config import LearnerSection

    assert issubclass(LearnerSection, LearnerStack)
    for name, field in LearnerStack.model_fields.items():
        assert repr(LearnerSection.model_fields[name]) == repr(field), name
    with pytest.raises(ValueError, match="world_size"):
        LearnerSection(world_size=0)


def test_every_committed_config_loads():
    """Configs written for the last main (configs/, compose/) still load."""
    from tests.helpers import ROOT

    files = sorted((ROOT / "configs").glob("*.yaml")) + [ROOT / "compose" / "steadyrl.yaml"]
    assert files
    for f in files:
        load_stack(f)


def test_the_actor_reads_the_same_fields_and_both_the_same_model():
    """The actor's section is an ActorStack: `backend` and `model` have one definition, and
    `model` the same one as the learner's (PolicyModel)."""
    from steadyrl.services.actor.config import ActorSection
    from steadyrl.services.learner.config import LearnerSection

    assert issubclass(ActorSection, ActorStack) and issubclass(ActorStack, PolicyModel)
    for name, field in ActorStack.model_fields.items():
        if name != "vllm":   # the actor's own VLLMSection extends the VLLMStack `up` reads
            assert repr(ActorSection.model_fields[name]) == repr(field), name
    assert issubclass(ActorSection.model_fields["vllm"].annotation, VLLMStack)
    vllm_section = type(ActorSection().vllm)
    assert repr(vllm_section.model_fields["max_model_len"]) == repr(VLLMStack.model_fields["max_model_len"])
    assert repr(ActorSection.model_fields["model"]) == repr(LearnerSection.model_fields["model"])
    assert ActorSection().model == LearnerSection().model == SMOLLM2
    with pytest.raises(ValueError, match="'no-such-model'"):
        ActorSection(model="no-such-model")


def test_a_stack_whose_actor_and_learner_name_different_models_is_refused(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("actor: {model: tiny}\nlearner: {model: smollm2-135m-instruct}\n")
    with pytest.raises(StackError, match=r"actor\.model 'tiny' and learner\.model 'smollm2-135m-instruct' differ"):
        load_stack(cfg)
    cfg.write_text("actor: {model: tiny}\nlearner: {model: tiny}\n")
    assert load_stack(cfg).actor.model == "tiny"


def test_an_answer_length_the_vllm_engine_cannot_hold_is_refused_at_start(tmp_path):
    """One length setting, learner.max_new_tokens, checked against what the engine plans for:
    at or past actor.vllm.max_model_len every prompt would be refused by the actor."""
    cfg = tmp_path / "c.yaml"
    learner = "learner: {max_new_tokens: 4096}\n"   # the actor's limit raised to let it through
    cfg.write_text("actor: {max_new_tokens_limit: 8192, backend: vllm, vllm: {max_model_len: 2048}}\n" + learner)
    with pytest.raises(StackError, match=r"learner\.max_new_tokens 4096 >= actor\.vllm\.max_model_len 2048"):
        load_stack(cfg)
    cfg.write_text("actor: {max_new_tokens_limit: 8192, backend: vllm, vllm: {max_model_len: 8192}}\n" + learner)
    assert load_stack(cfg).learner.max_new_tokens == 4096
    cfg.write_text("actor: {max_new_tokens_limit: 8192, backend: torch}\n" + learner)   # torch: the model's context
    assert load_stack(cfg).actor.vllm.max_model_len == 2048


def test_an_answer_length_the_actor_refuses_is_refused_before_anything_starts(tmp_path):
    """Regression (newcomer walk-through): learner.max_new_tokens past actor.max_new_tokens_limit
    was refused only by the learner, after `up` had started the broker and every service."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("learner: {max_new_tokens: 5000}\n")
    with pytest.raises(StackError, match=r"learner\.max_new_tokens 5000 > actor\.max_new_tokens_limit 1024"):
        load_stack(cfg)
    cfg.write_text("actor: {max_new_tokens_limit: 8192}\nlearner: {max_new_tokens: 5000}\n")
    assert load_stack(cfg).actor.max_new_tokens_limit == 8192
