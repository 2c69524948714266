"""The learner's start-time check of its dataset (services/learner/rows.py) and of its settings:
a row the actor or the prompt contract cannot take is reported (index, field, reason) and left
out, never published; too few rows left, or a setting past the prompt contract's bounds, stops
the learner at start with exit 2 naming the file or the field."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from steadyrl.local.limits import GenerationLimits
from steadyrl.model.models import load_policy
from steadyrl.services.learner.config import LearnerConfig, LearnerSection, load_dataset
from steadyrl.services.learner.rows import check_rows
from tests.helpers import ROOT


def _verl(content, role="user", truth="3", extra=None, prompt=None) -> dict:
    chat = prompt if prompt is not None else [{"role": role, "content": content}]
    return {"data_source": "tiny_copy", "prompt": chat,
            "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": extra or {"index": 0}}


#: one good row, then one of each bad kind the issue names, then good rows
ROWS = [_verl("3"),
        _verl("4", extra={"score": math.nan}),             # 1: NaN in extra_info
        _verl("5", role="tool"),                           # 2: a role the chat contract does not take
        _verl(None),                                       # 3: null content
        _verl("6" * 200),                                  # 4: longer than the tiny model's context (128)
        _verl(None, prompt="7"),                           # 5: the prompt as a string
        *[_verl(str(d)) for d in range(8)]]
BAD = {1: "extra_info.score", 2: "prompt[0].role", 3: "prompt[0].content", 4: "prompt", 5: "prompt"}


def _write(tmp_path, rows) -> str:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))   # NaN written as the literal NaN
    return str(path)


@pytest.fixture(scope="module")
def tiny():
    return load_policy("tiny")


def test_every_bad_kind_of_row_is_named_and_the_good_ones_kept(tmp_path, tiny):
    model, tok = tiny
    path = _write(tmp_path, ROWS)
    lc = LearnerSection(model="tiny", data=str(path), eval_data=None, max_new_tokens=4)
    rows = load_dataset(lc.data, lenient=True)
    bad = check_rows(lc, rows, tok, 128, GenerationLimits())
    assert {b.index: b.field for b in bad} == BAD, bad
    by = {b.index: b.reason for b in bad}
    assert "finite" in by[1] and "201 tokens + learner.max_new_tokens 4 = 205 > the model's context 128" in by[4]
    assert "list" in by[5]


def test_a_parquet_file_with_string_prompts_names_each_row(tmp_path):
    """verl's parquet with `prompt` as text, not a chat list: every row is named, nothing raised."""
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([_verl(None, prompt=f"what is {i}?") for i in range(3)]), path)
    rows = load_dataset(str(path), lenient=True)
    assert [(r.field, "got str" in r.reason) for r in rows] == [("prompt", True)] * 3
    with pytest.raises(ValueError, match=r"d\.parquet row 1: prompt"):   # counted as a user counts rows
        load_dataset(str(path))


def test_a_row_over_the_actors_prompt_limit_is_named(tmp_path, tiny):
    model, tok = tiny
    path = _write(tmp_path, [_verl("3" * 20), _verl("3")])
    lc = LearnerSection(model="tiny", data=str(path), eval_data=None, max_new_tokens=4, prompts_per_step=1)
    bad = check_rows(lc, load_dataset(lc.data, lenient=True), tok, 128, GenerationLimits(max_prompt_tokens=10))
    assert [(b.index, b.reason) for b in bad] == [(0, "21 tokens > actor.max_prompt_tokens 10")]


def _learner(tmp_path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m steadyrl.services.learner` with no broker reachable: what it says before it needs one."""
    import os

    return subprocess.run([sys.executable, "-m", "steadyrl.services.learner", "--bootstrap", "127.0.0.1:9", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "STEADYRL_LEARNER__STATE_DIR": str(tmp_path / "learner"), **(env or {})})


@pytest.mark.parametrize(("flag", "value", "named"), [
    ("--learner.group-size", "1025", "learner.group_size"),
    ("--learner.max-new-tokens", "32769", "learner.max_new_tokens"),
    ("--learner.seed", "-1", "learner.seed"),
    ("--learner.train.temperature", "10.5", "learner.train"),
    ("--learner.model", "no-such-model", "learner.model"),
    ("--learner.max-new-tokens", "2000", "actor.max_new_tokens_limit"),
    ("--learner.group-size", "600", "settings: Value error, learner.group_size 600 > 256"),
])
def test_a_setting_past_its_bound_exits_2_naming_the_field(tmp_path, flag, value, named):
    r = _learner(tmp_path, flag, value)
    assert r.returncode == 2, r.stderr[-2000:]
    assert named in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_fewer_rows_than_a_step_exits_2_naming_the_file(tmp_path):
    path = _write(tmp_path, ROWS[:3])
    r = _learner(tmp_path, "--learner.data", path, "--learner.prompts-per-step", "4")
    assert r.returncode == 2 and f"learner.data {path} has 3 rows < learner.prompts_per_step 4" in r.stderr, r.stderr


def test_the_config_bounds_match_the_prompt_contract():
    from steadyrl.wire.contracts import Prompt

    for field, contract in (("group_size", "n_samples"), ("max_new_tokens", "max_new_tokens")):
        bound = [m.le for m in Prompt.model_fields[contract].metadata if hasattr(m, "le")]
        assert bound and LearnerSection(**{field: bound[0]}) and bound[0] == [
            m.le for m in LearnerSection.model_fields[field].metadata if hasattr(m, "le")][0]
        with pytest.raises(ValidationError):
            LearnerSection(**{field: bound[0] + 1})
    with pytest.raises(ValidationError, match="outside"):
        LearnerSection(train={"temperature": 11})
    LearnerConfig(learner={"max_new_tokens": 64}, actor={"max_new_tokens_limit": 64, "backend": "vllm"})


def test_a_file_that_is_not_a_dataset_exits_2_naming_it(tmp_path):
    """Regression (review): a parquet file without `reward_model` exited 1 (KeyError) and
    was restarted without end."""
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "3"}]}] * 8), path)
    r = _learner(tmp_path, "--learner.data", str(path))
    assert r.returncode == 2 and "cannot be read as a dataset" in r.stderr and "reward_model" in r.stderr, r.stderr


def test_a_row_within_a_few_bytes_of_the_record_limit_is_left_out(tmp_path, tiny):
    """Regression (review): the check's record has placeholder ids; a real one is a few bytes
    longer, so a row just under the limit passed and failed at publish."""
    from steadyrl.services.learner.rows import RECORD_MARGIN, check_row, prompt_record
    from steadyrl.wire import codec

    model, tok = tiny
    lc = LearnerSection(model="tiny", data="tiny_copy:8", eval_data=None, max_new_tokens=4)
    row = load_dataset("tiny_copy:8")[0]
    row.extra_info = {"pad": "a" * 2000}
    record = prompt_record(lc, row, "r00000000T000000-0000/e0-i0", 0, 0, 0, "r00000000T000000-0000", 0)
    size = len(codec.encode(record)[0])
    bad = check_row(lc, row, 0, tok, 128, GenerationLimits(), size + RECORD_MARGIN // 2)
    assert bad is not None and "less 1024 for its ids" in bad.reason
    assert check_row(lc, row, 0, tok, 128, GenerationLimits(), size + RECORD_MARGIN) is None


def test_a_group_too_large_for_one_record_is_refused_at_start_naming_both_fields():
    """Regression (issue 36): 64 answers of 8 192 tokens are ~16 MiB of JSON (29.4 bytes a token
    measured), above rl.rollouts' 8 MiB: every full-length group would have gone to the DLQ."""
    from steadyrl.local.limits import RECORD_BYTES_PER_TOKEN, group_record_refusal

    actor = {"max_new_tokens_limit": 8192, "max_sequences": 512}
    with pytest.raises(ValidationError, match=r"learner.group_size 64 x learner.max_new_tokens 8192: .* about "
                                              r"16.0 MiB .* above rl.rollouts' max_message_bytes of 8.0 MiB"):
        LearnerConfig(learner={"group_size": 64, "max_new_tokens": 8192}, actor=actor)
    LearnerConfig(learner={"group_size": 32, "max_new_tokens": 8192}, actor=actor)   # 8.0 MiB: fits
    assert group_record_refusal(32, 8192, 8 << 20) is None and RECORD_BYTES_PER_TOKEN == 32
    assert group_record_refusal(33, 8192, 8 << 20) is not None


def test_a_group_too_large_for_one_record_exits_2(tmp_path):
    r = _learner(tmp_path, "--learner.group-size", "64", "--learner.max-new-tokens", "8192",
                 env={"STEADYRL_ACTOR__MAX_NEW_TOKENS_LIMIT": "8192"})
    assert r.returncode == 2 and "rl.rollouts' max_message_bytes" in r.stderr and "Traceback" not in r.stderr, \
        r.stderr[-2000:]
