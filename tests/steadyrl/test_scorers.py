"""Reward server scorers: a tiny reward model built here, the real all-MiniLM-L6-v2, batching,
/readyz and /score over HTTP, and `steadyrl score`."""

import hashlib
import json

import httpx
import pytest
import torch

from steadyrl.cli import main as cli
from steadyrl.model.models import tiny_config, tiny_tokenizer
from steadyrl.model.scorers import EmbeddingScorer, RewardModelScorer, build_scorer
from steadyrl.services.reward.server import RewardServer, RewardServerSection, ScoreItem, add_routes


def _save_tiny_rm(path, seed=0, head_shift=0.0):
    """A 2-layer Llama reward model (num_labels=1) and the tiny tokenizer, saved to `path`."""
    from transformers import LlamaForSequenceClassification

    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(tiny_config(len(tok), num_labels=1)).eval()
    with torch.no_grad():
        model.score.weight += head_shift
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, tok


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("rm") / "tiny-rm"
    model, tok = _save_tiny_rm(path)
    return path, model, tok


@pytest.fixture(scope="module")
def minilm():
    scorer = EmbeddingScorer(batch_size=4)
    scorer.load()
    return scorer


def _items(n, prompt="what is 2+2?"):
    return [ScoreItem(prompt=prompt, response=f"the answer is {i}", ground_truth=str(i)) for i in range(n)]


def _count_forwards(scorer):
    """A list that grows by one per forward pass of the scorer's model, and the hook's handle."""
    calls = []
    return calls, scorer.model.register_forward_hook(lambda mod, args, out: calls.append(1))


def test_tiny_reward_model_scores_a_batch_as_the_model_reads_prompt_and_response(rm_dir):
    path, model, tok = rm_dir
    scorer = RewardModelScorer(path, batch_size=8)
    scorer.load()
    sha = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    assert scorer.id == f"rm:tiny-rm@{sha[:12]}" and scorer.source.value == "model"
    items = _items(3)
    got = [r["reward"] for r in scorer.score(items)]
    # What the model itself says: the chat template's text, the logit of label 0.
    for it, reward in zip(items, got, strict=True):
        ids = tok(tok.apply_chat_template([{"role": "user", "content": it.prompt},
                                           {"role": "assistant", "content": it.response}], tokenize=False),
                  add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            assert reward == pytest.approx(model(**ids).logits[0, 0].item(), abs=1e-5)
    assert len(set(got)) == 3  # the response matters
    assert [r["reward"] for r in scorer.score(items)] == got  # deterministic


def test_other_weights_give_other_scores_and_another_id(rm_dir, tmp_path):
    path, _, _ = rm_dir
    _save_tiny_rm(tmp_path / "tiny-rm", head_shift=0.05)
    a, b = RewardModelScorer(path), RewardModelScorer(tmp_path / "tiny-rm")
    a.load()
    b.load()
    items = _items(2)
    assert a.id != b.id and a.id.startswith("rm:tiny-rm@") and b.id.startswith("rm:tiny-rm@")
    for ra, rb in zip(a.score(items), b.score(items), strict=True):
        assert abs(ra["reward"] - rb["reward"]) > 1e-3


def test_a_request_is_scored_in_batches_equal_to_item_by_item(rm_dir, minilm):
    path, _, _ = rm_dir
    rm = RewardModelScorer(path, batch_size=2)
    rm.load()
    # Items of different lengths, so batches are padded.
    items = [ScoreItem(prompt="what is 1+1?" * (i % 3 + 1), response="2" * (i + 1), ground_truth="2")
             for i in range(5)]
    for scorer in (rm, minilm):
        alone = [scorer.score([it])[0]["reward"] for it in items]
        calls, hook = _count_forwards(scorer)
        batched = [r["reward"] for r in scorer.score(items)]
        hook.remove()
        assert len(calls) == -(-5 // scorer.batch_size)  # one forward per batch: 3 for rm, 2 for minilm
        assert batched == pytest.approx(alone, abs=1e-5)


def test_minilm_rates_a_paraphrase_above_an_unrelated_sentence(minilm):
    assert minilm.id == "embedding:all-minilm-l6-v2@0.1.0" and minilm.source.value == "model"
    truth = "A man is eating food."
    out = minilm.score([ScoreItem(response="A man is eating a piece of bread.", ground_truth=truth),
                        ScoreItem(response="The stock market fell sharply today.", ground_truth=truth),
                        ScoreItem(response=truth, ground_truth=truth)])
    para, unrelated, same = (r["reward"] for r in out)
    assert para == pytest.approx(0.7553, abs=1e-3)  # sentence-transformers' value for this pair
    assert para > unrelated + 0.5 and same == pytest.approx(1.0, abs=1e-5)


def test_an_item_without_ground_truth_fails_alone(minilm):
    out = minilm.score([ScoreItem(response="a"), ScoreItem(response="a", ground_truth="a")])
    assert out[0]["reward"] is None and "ground_truth" in out[0]["error"]
    assert out[1]["reward"] == pytest.approx(1.0, abs=1e-5)


def test_bad_specs_are_refused_at_start(tmp_path):
    with pytest.raises(ValueError, match="not a directory with"):
        build_scorer(f"rm:{tmp_path}")
    with pytest.raises(ValueError, match="unknown embedding model"):
        build_scorer("embedding:bge")
    with pytest.raises(ValueError, match="unknown scorer 'nope'"):
        build_scorer("nope")
    with pytest.raises(ValueError, match="default_scorer 'format'"):
        RewardServer(RewardServerSection(scorers=["tiny_copy"], default_scorer="format"))


@pytest.fixture
def served(rm_dir):
    """A reward server's app on 127.0.0.1 (real HTTP), its model scorer not loaded yet."""
    from steadyrl.http import Health, HealthServer, make_app

    path, _, _ = rm_dir
    rm = f"rm:{path}"
    server = RewardServer(RewardServerSection(scorers=["tiny_copy", "tests.helpers:failing_scorer", rm],
                                              default_scorer="tiny_copy", batch_size=2))
    health = Health()
    health.add_check("scorers", server.ready)
    app = make_app("reward-server", health)
    add_routes(app, server)
    http = HealthServer(app).start()
    yield server, http.url, rm
    http.stop()


def _metric(url, name, labels):
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_readyz_waits_for_model_scorers_and_score_serves_them(served):
    server, url, rm = served
    body = {"scorer": rm, "items": [{"prompt": "1+1?", "response": "2"}, {"prompt": "1+1?", "response": "3"},
                                    {"prompt": "1+1?", "response": "22"}]}
    r = httpx.get(f"{url}/readyz")
    assert r.status_code == 503 and "loading" in r.json()["checks"]["scorers"]["detail"]
    assert httpx.post(f"{url}/score", json=body).status_code == 503
    server.load()
    assert httpx.get(f"{url}/readyz").status_code == 200

    r = httpx.post(f"{url}/score", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["reward_source"] == "model" and out["scorer"] == server.scorers[rm].id
    want = [x["reward"] for x in server.scorers[rm].score([ScoreItem(**it) for it in body["items"]])]
    assert [s["reward"] for s in out["scores"]] == want

    # An old request (no prompt field) to a rule scorer, one item failing alone.
    r = httpx.post(f"{url}/score", json={"scorer": "tests.helpers:failing_scorer", "items": [
        {"response": "4", "ground_truth": "4"}, {"response": "boom", "ground_truth": "4"}]}).json()
    assert r["reward_source"] == "rule" and r["scorer"] == "rule:tests.helpers:failing_scorer@1"
    assert r["scores"][0] == {"reward": 1.0, "extra": {"pred": "4"}} and r["scores"][1]["reward"] is None
    assert httpx.post(f"{url}/score", json={"items": [{"response": "aaab", "ground_truth": "a"}]}).json()[
        "scores"] == [{"reward": 0.75, "extra": {}}]
    assert httpx.post(f"{url}/score", json={"scorer": "nope", "items": [{"response": "x"}]}).status_code == 404

    assert _metric(url, "steadyrl_reward_server_score_seconds_count", {"scorer": rm}) >= 1
    assert _metric(url, "steadyrl_reward_server_items_total", {"scorer": rm}) >= 3
    for kind in ("not_ready", "scorer_error", "unknown_scorer"):
        assert _metric(url, "steadyrl_reward_server_errors_total", {"kind": kind}) >= 1, kind


def test_a_model_failing_on_a_batch_is_a_500_counted_as_model_error(served):
    server, url, rm = served
    server.load()
    before = _metric(url, "steadyrl_reward_server_errors_total", {"kind": "model_error"})
    # A decoder reward model cannot find each row's last token without a pad id: transformers raises.
    server.scorers[rm].model.config.pad_token_id = None
    r = httpx.post(f"{url}/score", json={"scorer": rm, "items": [{"response": "1"}, {"response": "22"}]})
    assert r.status_code == 500 and "failed on a batch of 2" in r.json()["detail"]
    assert _metric(url, "steadyrl_reward_server_errors_total", {"kind": "model_error"}) == before + 1


def test_the_service_process_loads_an_rm_then_serves_it(rm_dir, tmp_path):
    from tests.helpers import ServiceProc

    path, _, _ = rm_dir
    rm = f"rm:{path}"
    svc = ServiceProc("reward.server", ["--reward-server.scorers", json.dumps(["tiny_copy", rm]),
                                        "--reward-server.default-scorer", "tiny_copy"], tmp_path / "server.log")
    try:
        svc.wait_ready()
        out = httpx.post(f"{svc.url}/score", json={"scorer": rm, "items": [{"prompt": "1+1?", "response": "2"}]}).json()
        assert out["reward_source"] == "model" and out["scorer"].startswith("rm:tiny-rm@")
        assert isinstance(out["scores"][0]["reward"], float)
    finally:
        assert svc.stop() == 0


def test_cli_score_prints_reward_and_scorer_id(rm_dir, capsys):
    path, _, _ = rm_dir
    assert cli(["score", "--scorer", "tiny_copy", "--prompt", "x", "--response", "aaab", "--ground-truth", "a"]) == 0
    assert capsys.readouterr().out == "0.75  rule:tiny_copy@1\n"
    assert cli(["score", "--scorer", "numeric_match", "--response", "it is 4", "--ground-truth", "4"]) == 0
    assert capsys.readouterr().out == '1.0  rule:numeric_match@1  {"pred": "4"}\n'

    assert cli(["score", "--scorer", f"rm:{path}", "--prompt", "1+1?", "--response", "2"]) == 0
    reward, scorer = capsys.readouterr().out.split()
    scored = RewardModelScorer(path)
    scored.load()
    assert scorer == scored.id and float(reward) == pytest.approx(
        scored.score([ScoreItem(prompt="1+1?", response="2")])[0]["reward"], abs=1e-5)

    assert cli(["score", "--scorer", "nope", "--response", "x"]) == 2
    assert "unknown scorer 'nope'" in capsys.readouterr().err
    assert cli(["score", "--scorer", "tests.helpers:failing_scorer", "--response", "boom", "--ground-truth", "1"]) == 1
    assert "scorer exploded" in capsys.readouterr().err
