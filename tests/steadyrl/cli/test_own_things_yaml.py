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
