"""The own-things flags as top-level keys of a config file (`model: ./my-model`), issue 38:
"and the same keys in YAML". Each is set everywhere it is read, as the flag is; a flag wins."""

import yaml

from steadyrl.cli import build_parser
from steadyrl.cli.up import _own_things, _own_things_in


def _up(tmp_path, cfg: dict, *flags: str):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(cfg))
    args = build_parser().parse_args(["up", "--config", str(path), "--state-dir", str(tmp_path / "st"),
                                      *flags])
    return args, path


def test_top_level_keys_are_the_flags(tmp_path):
    args, path = _up(tmp_path, {"model": "./m", "data": ["a.jsonl", "b.jsonl"], "reward": "r.py:f", "steps": 4,
                                "learner": {"group_size": 4}})
    assert _own_things_in(str(path))
    written = yaml.safe_load(_own_things(args).read_text())
    assert not {"model", "data", "reward", "steps"} & written.keys()          # sections only, for the services
    learner = written["learner"]
    assert written["actor"]["model"] == learner["model"] == "./m" and learner["group_size"] == 4
    assert learner["data"] == ["a.jsonl", "b.jsonl"] and learner["eval_data"] is None and learner["steps"] == 4
    assert written["reward_server"]["scorers"] == ["r.py:f"] and learner["eval_scorer"] == "r.py:f"


def test_a_flag_wins_over_the_key(tmp_path):
    args, _ = _up(tmp_path, {"model": "./m", "data": "a.jsonl"}, "--model", "./other")
    learner = yaml.safe_load(_own_things(args).read_text())["learner"]
    assert learner["model"] == "./other" and learner["data"] == "a.jsonl"


def test_a_config_without_them_is_not_rewritten(tmp_path):
    _, path = _up(tmp_path, {"learner": {"steps": 3}})
    assert not _own_things_in(str(path)) and not _own_things_in(None)
    path.write_text("model: [unclosed")
    assert not _own_things_in(str(path))   # unreadable: the config check names it


def test_a_config_error_names_the_users_file_not_the_one_up_wrote(tmp_path):
    """The walk-through's typo in its own file was reported in `<state>/up-config.yaml`."""
    import os
    import subprocess
    import sys

    from steadyrl.local.ports import free_port_pair

    bad = tmp_path / "typo_key.yaml"
    bad.write_text(yaml.safe_dump({"learner": {"max_new_token": 8}}))
    r = subprocess.run([sys.executable, "-m", "steadyrl.cli", "up", "--config", str(bad), "--model", "tiny",
                        "--state-dir", str(tmp_path / "st"), "--port", str(free_port_pair()),
                        "--port-offset", str(2900 + os.getpid() % 300)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"config file {bad} and up's own-things flags, as {tmp_path / 'st' / 'up-config.yaml'}" in r.stderr
    assert "did you mean `max_new_tokens`?" in r.stderr


def test_the_reward_workers_section_is_not_the_reward(tmp_path):
    """`reward:` as a mapping is the reward workers' own section (test_pipeline's configs have
    one); only a name (`reward: my_reward.py:fn`) is the own thing."""
    _, path = _up(tmp_path, {"reward": {"batch_timeout_s": 0.1}, "learner": {"steps": 3}})
    assert not _own_things_in(str(path))
    args, path = _up(tmp_path, {"reward": {"batch_timeout_s": 0.1}, "model": "./m"})
    written = yaml.safe_load(_own_things(args).read_text())
    assert written["reward"] == {"batch_timeout_s": 0.1} and written["learner"]["model"] == "./m"
    assert "reward_server" not in written


def test_an_empty_own_thing_key_is_dropped_not_passed_on(tmp_path):
    """`model:` left empty is no own thing, and is not left in the services' config either (where
    it would be an unknown section), as before 3135db0."""
    args, path = _up(tmp_path, {"model": None, "steps": 3})
    written = yaml.safe_load(_own_things(args).read_text())
    assert "model" not in written and written["learner"]["steps"] == 3


def test_tools_and_env_go_to_the_rollout_workers_with_the_actors_model(tmp_path):
    """--tools / --env (docs/agents.md), as flags and as top-level keys."""
    args, _ = _up(tmp_path, {"model": "tiny"}, "--env", "my_env.py:TryAgain")
    agent = yaml.safe_load(_own_things(args).read_text())["rollout"]["agent"]
    assert agent == {"env": "my_env.py:TryAgain", "model": "tiny"}
    args, _ = _up(tmp_path, {"tools": "t.py:calc", "rollout": {"agent": {"max_turns": 2}}})
    agent = yaml.safe_load(_own_things(args).read_text())["rollout"]["agent"]
    assert agent == {"tools": "t.py:calc", "max_turns": 2, "model": "smollm2-135m-instruct"}


def test_a_tools_or_env_flag_replaces_the_configs_other_shape_and_model_follows_the_actor(tmp_path):
    """An episode has tools or an environment class: a flag replaces the config's other one, and
    --model sets the tokenizer the rollout workers build episodes with, as the actor's."""
    args, _ = _up(tmp_path, {"rollout": {"agent": {"env": "e.py:C", "model": "old-model"}}},
                  "--tools", "t.py:f", "--model", "tiny")
    agent = yaml.safe_load(_own_things(args).read_text())["rollout"]["agent"]
    assert agent == {"tools": "t.py:f", "model": "tiny"}


def test_tools_and_env_flags_together_are_refused(capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["up", "--tools", "t.py:f", "--env", "e.py:C"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
