"""A Hugging Face Hub id as the model (issue 38: `--model HuggingFaceTB/SmolLM2-135M-Instruct`
was refused as "not a local folder"): resolved through the Hugging Face cache where the config
is validated, so `up`, the actor and the learner get one folder; HF_HUB_OFFLINE honoured, and a
model neither local nor cached refused at start with what to do. No network: the cache is a
folder laid out as huggingface_hub lays it out, holding a tiny model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from steadyrl.local.ports import free_port_pair
from steadyrl.local.stack import StackError, hf_cache_dir, load_stack, resolve_model
from steadyrl.model.models import load_policy, tiny_model, tiny_tokenizer
from tests.helpers import ROOT

REPO = "steadyrl-test/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(cache: Path, repo_id: str = REPO) -> Path:
    """`cache` as huggingface_hub lays out a downloaded model (models--owner--name/refs/main naming
    a snapshot folder); returns that snapshot folder, holding a tiny model and its tokenizer."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    tok = tiny_tokenizer()
    tiny_model(len(tok), seed=1).save_pretrained(snapshot, safe_serialization=True)
    tok.save_pretrained(snapshot)
    return snapshot


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE=1 and an empty cache of this test's own (HF_HUB_CACHE); its path."""
    for name in ("STEADYRL_ACTOR__MODEL", "STEADYRL_LEARNER__MODEL", "HF_HOME", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_cached_hub_id_is_its_snapshot_folder_for_actor_and_learner(offline, tmp_path):
    from steadyrl.services.actor.config import ActorSection
    from steadyrl.services.learner.config import LearnerSection

    snapshot = fake_hub_cache(offline)
    assert resolve_model(REPO) == str(snapshot)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"actor: {{model: {REPO}}}\nlearner: {{model: {REPO}}}\n")
    stack = load_stack(cfg)   # what `up` checks before anything starts
    assert stack.actor.model == stack.learner.model == str(snapshot)
    assert ActorSection(model=REPO).model == LearnerSection(model=REPO).model == str(snapshot)
    model, tok = load_policy(REPO)   # `steadyrl eval --model owner/name`, too
    assert model.config.num_hidden_layers == 2 and tok.padding_side == "left"


def test_hf_home_names_the_cache_as_huggingface_hub_reads_it(offline, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    assert hf_cache_dir() == tmp_path / "hf-home" / "hub"
    snapshot = fake_hub_cache(tmp_path / "hf-home" / "hub")
    assert resolve_model(REPO) == str(snapshot)


def test_a_local_folder_and_the_known_names_are_kept_as_given(offline, tmp_path):
    (tmp_path / "m").mkdir()
    assert [resolve_model(n) for n in ("tiny", "smollm2-135m-instruct", str(tmp_path / "m"))] == \
        ["tiny", "smollm2-135m-instruct", str(tmp_path / "m")]
    with pytest.raises(ValueError, match="not 'smollm2-135m-instruct', 'tiny', a local folder .* Hugging Face Hub id"):
        resolve_model("./no-such-folder")


def test_an_uncached_hub_id_offline_is_refused_saying_what_to_do(offline, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"actor: {{model: {REPO}}}\nlearner: {{model: {REPO}}}\n")
    with pytest.raises(StackError) as e:
        load_stack(cfg)
    said = " ".join(str(e.value).split())
    for part in (f"model '{REPO}': not a local folder, and not in the Hugging Face cache ({offline})",
                 "HF_HUB_OFFLINE is set: here only cached or local models can load",
                 f"`hf download {REPO}`", f"`huggingface-cli download {REPO}`"):
        assert part in said, said


def test_up_with_an_uncached_hub_id_offline_exits_2_before_starting_anything(offline, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEADYRL_")}
    r = subprocess.run([sys.executable, "-m", "steadyrl.cli", "up", "--model", REPO, "--state-dir",
                        str(tmp_path / "state"), "--port", str(free_port_pair()), "--port-offset",
                        str(2500 + os.getpid() % 500)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "only cached or local models can load" in r.stderr and f"hf download {REPO}" in r.stderr
    assert "Traceback" not in r.stderr and "starting Kafka broker" not in r.stdout
    assert not (tmp_path / "state" / "broker").exists()
