"""`steadyrl.Run(model=, data=, eval_data=, reward=, steps=)` passes up's own-things flags, so a
notebook names the model, data and reward once, as the command line does (issue 38)."""

from pathlib import Path

import steadyrl


def test_own_things_become_ups_flags_in_order(tmp_path):
    run = steadyrl.Run(state_dir=tmp_path, model="./my-model", data=["a.jsonl", Path("b.parquet")],
                       eval_data="held.jsonl", reward="my_reward.py:compute_score", steps=7)
    assert run.own == ["--model", "./my-model", "--data", "a.jsonl", "b.parquet", "--eval-data", "held.jsonl",
                       "--reward", "my_reward.py:compute_score", "--steps", "7"]


def test_without_them_no_flag_is_added(tmp_path):
    assert steadyrl.Run(state_dir=tmp_path, learner={"steps": 2}).own == []
