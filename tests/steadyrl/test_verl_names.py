"""A verl config, as verl's users have one: translated by `steadyrl up --from-verl`, and a
steadyrl config that uses a verl name gets a hint naming steadyrl's key (issue 38: a verl YAML
got "Extra inputs are not permitted" with no hint)."""

import subprocess
import sys

import pytest
import yaml

from steadyrl import verl
from steadyrl.config import ConfigError, load
from steadyrl.services.learner.config import LearnerConfig
from tests.helpers import ROOT

VERL = {
    "data": {"train_files": ["data/arithmetic/train.parquet"], "val_files": "data/arithmetic/test.parquet",
             "train_batch_size": 4, "max_response_length": 16},
    "actor_rollout_ref": {"model": {"path": "tiny"},
                          "rollout": {"name": "hf", "n": 4, "temperature": 1.0, "top_p": 1.0},
                          "actor": {"optim": {"lr": 1e-5}, "ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 4,
                                    "clip_ratio_high": 0.28, "kl_loss_type": "mse", "use_dynamic_bsz": True}},
    "algorithm": {"adv_estimator": "gae", "gamma": 1.0},
    "trainer": {"total_training_steps": 3, "logger": ["console"], "n_gpus_per_node": 8},
    "custom_reward_function": {"path": "my_reward.py", "name": "compute_score"},
}


def test_a_verl_config_translates_into_steadyrls_sections():
    cfg, notes = verl.translate(VERL)
    assert cfg["actor"] == {"model": "tiny", "backend": "torch"}          # hf is the torch actor
    lrn = cfg["learner"]
    assert (lrn["model"], lrn["data"], lrn["eval_data"]) == ("tiny", "data/arithmetic/train.parquet",
                                                             "data/arithmetic/test.parquet")
    assert (lrn["prompts_per_step"], lrn["group_size"], lrn["max_new_tokens"], lrn["steps"]) == (4, 4, 16, 3)
    assert lrn["train"]["algorithm"] == "ppo" and lrn["train"]["kl_estimator"] == "k2"
    assert lrn["train"]["mini_batch_size"] == 8        # verl's 2 prompts x rollout.n 4 = 8 sequences
    assert lrn["eval_scorer"] == cfg["reward_server"]["default_scorer"] == "my_reward.py:compute_score"
    assert cfg["reward_server"]["scorers"] == ["my_reward.py:compute_score"]
    assert lrn["eval_splits"] == {}   # not steadyrl's arithmetic harder splits, scored by their reward
    assert "left out: actor_rollout_ref.actor.use_dynamic_bsz (no steadyrl equal; docs/verl.md)" in notes
    assert any(n.startswith("left out: trainer.n_gpus_per_node") for n in notes)
    several, _ = verl.translate({"data": {"train_files": ["a.parquet", "b.parquet"]}})
    assert several["learner"]["data"] == ["a.parquet", "b.parquet"]   # read as one dataset, in this order


def test_the_translated_learner_section_loads(tmp_path):
    cfg, _ = verl.translate({k: v for k, v in VERL.items() if k != "custom_reward_function"})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    lc = load(LearnerConfig, ["--config", str(path)]).learner
    assert (lc.model, lc.group_size, lc.train.clip_high, lc.train.algorithm) == ("tiny", 4, 0.28, "ppo")


def test_a_verl_name_in_a_steadyrl_config_gets_a_hint(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"learner": {"n": 8, "train": {"clip_ratio_low": 0.2}},
                                    "actor_rollout_ref": {"model": {"path": "x"}}}))
    with pytest.raises(ConfigError) as e:
        load(LearnerConfig, ["--config", str(path)])
    text = str(e.value)
    assert "learner.n: Extra inputs are not permitted (verl's `n`: steadyrl's is `learner.group_size`" in text
    assert "(verl's `clip_ratio_low`: steadyrl's is `learner.train.clip_low`" in text
    assert "actor_rollout_ref: Extra inputs are not permitted (a verl section: `steadyrl up --from-verl" in text
    assert verl.hint(("learner", "typo_here")) == "" and verl.hint(("learner", "name")) == ""


def test_up_from_verl_writes_and_prints_the_translation(tmp_path):
    src = tmp_path / "verl.yaml"
    src.write_text(yaml.safe_dump(VERL))
    state = tmp_path / "state"
    r = subprocess.run([sys.executable, "-m", "steadyrl.cli", "up", "--from-verl", str(src), "--bootstrap",
                        "127.0.0.1:1", "--state-dir", str(state), "--port-offset", "31000"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "actor_rollout_ref.rollout.n -> learner.group_size = 4" in r.stdout, r.stdout + r.stderr
    assert yaml.safe_load((state / "from-verl.yaml").read_text())["learner"]["group_size"] == 4
    assert r.returncode == 1 and "cannot reach the Kafka broker at 127.0.0.1:1" in r.stderr   # then up goes on
    both = subprocess.run([sys.executable, "-m", "steadyrl.cli", "up", "--from-verl", str(src), "--config",
                           str(src), "--state-dir", str(state)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert both.returncode == 2 and "--from-verl and --config: give one" in both.stderr


def test_the_docs_table_names_every_mapped_key():
    doc = (ROOT / "docs/verl.md").read_text()
    missing = [k for k in verl.VERL_KEYS if f"`{k}`" not in doc and not k.startswith("custom_reward_function")]
    assert not missing, missing
