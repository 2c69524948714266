"""Several data files read as one dataset (issue 38: `--data a.jsonl b.parquet`, and a list in
YAML): rows concatenated in the order given, a bad row named by its file and its row number
counting from 1, as a user counts lines, and a duplicate across files met by the prompt gate
as any duplicate is."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from steadyrl.config import ConfigError, load
from steadyrl.local.limits import GenerationLimits
from steadyrl.model.data import load_rows, where
from steadyrl.model.models import load_policy
from steadyrl.services.learner.config import LearnerConfig, LearnerSection, load_dataset
from steadyrl.services.learner.prompt_gate import PromptGate
from steadyrl.services.learner.rows import check_rows, refuse_too_few


def _verl(content, truth="3"):
    return {"data_source": "mine", "prompt": [{"role": "user", "content": content}],
            "reward_model": {"style": "rule", "ground_truth": truth}}


@pytest.fixture
def files(tmp_path):
    """a.jsonl: two good rows, a blank line, then a row with no prompt nor question (line 4);
    b.parquet: a good row, then a message without content (row 2), then the same prompt as
    a.jsonl's first row."""
    a = tmp_path / "a.jsonl"
    a.write_text(json.dumps(_verl("1")) + "\n" + json.dumps({"question": "2", "answer": "2"}) + "\n\n"
                 + json.dumps({"answer": "4"}) + "\n")
    b = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist([_verl("5"), _verl(None), _verl("1")]), b)
    return a, b


def test_rows_of_several_files_are_concatenated_in_the_order_given(files):
    a, b = files
    rows = load_rows([a, b], lenient=True)
    assert [(r.source, r.row) for r in rows] == [(str(a), 1), (str(a), 2), (str(a), 4),
                                                 (str(b), 1), (str(b), 2), (str(b), 3)]
    assert [where(r, i) for i, r in enumerate(rows)][2::3] == [f"{a} row 4", f"{b} row 3"]
    assert rows[0].messages == rows[5].messages and rows[3].messages[0]["content"] == "5"
    flipped = load_rows([b, a], lenient=True)
    assert [r.source for r in flipped] == [str(b)] * 3 + [str(a)] * 3


def test_a_bad_row_is_named_by_its_file_and_row_counting_from_1(files, tmp_path):
    a, b = files
    with pytest.raises(ValueError, match=rf"^{a}:4: not a verl record nor question/answer: question: missing"):
        load_rows([a, b])
    with pytest.raises(ValueError, match=rf"^{b} row 2: prompt\[0\]\.content: expected text"):
        load_rows([b, a])
    tok = load_policy("tiny")[1]
    lc = LearnerSection(model="tiny", data=[str(a), str(b)], eval_data=None, max_new_tokens=4, prompts_per_step=8)
    rows = load_dataset(lc.data, lenient=True)
    bad = check_rows(lc, rows, tok, 128, GenerationLimits())
    assert [(b_.index, b_.where, b_.field) for b_ in bad] == [(2, f"{a} row 4", "question"),
                                                             (4, f"{b} row 2", "prompt[0].content")]
    with pytest.raises(ConfigError) as e:   # 4 good rows < 8: the learner's exit 2 names them so
        refuse_too_few(lc, rows, bad, tmp_path / "run")
    assert f"learner.data {a}, {b}: 4 usable rows of 6" in str(e.value)
    said = str(e.value)
    assert f"first: {a} row 4: question: missing" in said and f"{b} row 2: prompt[0].content: expected" in said
    report = [json.loads(x) for x in (tmp_path / "run" / "bad_rows.jsonl").read_text().splitlines()]
    assert [(r["index"], r["where"]) for r in report] == [(2, f"{a} row 4"), (4, f"{b} row 2")]


def test_a_list_in_yaml_is_several_files_and_a_list_of_one_is_that_file(files, tmp_path):
    a, b = files
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"learner": {"data": [str(a), str(b)], "eval_data": [str(b)]}}))
    lc = load(LearnerConfig, ["--config", str(cfg)]).learner
    assert lc.data == [str(a), str(b)] and lc.eval_data == str(b)   # one file: as written before lists
    assert lc.fingerprint()["data"] == [str(a), str(b)]
    cfg.write_text(yaml.safe_dump({"learner": {"data": [str(a), str(tmp_path / "nope.jsonl")]}}))
    with pytest.raises(ConfigError, match=r"learner\.data.*nope\.jsonl: no such file"):
        load(LearnerConfig, ["--config", str(cfg)])
    cfg.write_text(yaml.safe_dump({"learner": {"data": []}}))
    with pytest.raises(ConfigError, match="an empty list"):
        load(LearnerConfig, ["--config", str(cfg)])


def test_up_data_takes_several_files_into_one_list(files, tmp_path):
    from steadyrl.cli import build_parser
    from steadyrl.cli.up import _own_things

    a, b = files
    args = build_parser().parse_args(["up", "--data", str(a), str(b), "--eval-data", str(a),
                                      "--state-dir", str(tmp_path / "st")])
    written = yaml.safe_load(_own_things(args).read_text())["learner"]
    assert written["data"] == [str(a), str(b)] and written["eval_data"] == str(a)


def test_a_duplicate_across_files_is_one_cluster_of_the_prompt_gate(files):
    a, b = files
    rows = load_rows([a, b], lenient=True)
    text = {i: r.messages[0]["content"] for i, r in enumerate(rows) if hasattr(r, "messages")}
    gate = PromptGate(text.__getitem__, cooldown_s=60, clock=lambda: 0.0)
    keys = [gate.cluster_of(i) for i in sorted(text)]   # in dataset order, as the feeder meets them
    assert keys[0] == keys[-1] == 0 and len(set(keys)) == len(keys) - 1   # b.parquet row 3 joins a.jsonl row 1
