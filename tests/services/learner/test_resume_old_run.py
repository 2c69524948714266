"""A run written by main at 4bba081 (tests/fixtures/run-4bba081: the tiny stack stopped at step 6
of 200) resumes with today's learner parts: its state.json and checkpoint read back typed, the
weights are the checkpoint's, and the legacy one-file policy version still loads."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors.torch import load_file

from steadyrl.config import ConfigError
from steadyrl.model.models import load_policy
from steadyrl.rl.trainer import Trainer
from steadyrl.run import policy_files
from steadyrl.services.learner.config import LearnerSection
from steadyrl.services.learner.parts import Weights
from steadyrl.services.learner.policy_store import PolicyStore
from steadyrl.services.learner.resume import open_run, trim_history
from steadyrl.services.learner.state import InFlight, RunState, StateError

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "run-4bba081"
RUN = "r20261201T075848-5c73"
# Keys of state.json added since 4bba081, with the value an old state reads back as
ADDED = {"dlq_replaced": 0,   # issue 18: the fixture lost no prompt to rl.dlq (counts.dlq absent)
         "release_offsets": {},  # issue 21: rl.releases (open_consumer reads it from the start)
         "train": {},            # the training settings: none recorded, so no change named at resume
         "abandoned": {}}        # issue 33: prompts refused past their budget (none then)
MOVED = {"history", "trained"}   # out of state.json (history.jsonl; consumed.jsonl)
# Keys of each in-flight prompt added since, with the value an old one reads back as (issue 33:
# its refusal budget and its publish time; 0: unknown, the feeder counts its age from its start)
IN_FLIGHT_ADDED = {"refused": 0, "first_refused_ms": 0, "reasons": [], "published_ms": 0, "overdue": 0}


@pytest.fixture
def old_run(tmp_path):
    shutil.copytree(FIXTURE, tmp_path / "state")
    state = tmp_path / "state"
    section = yaml.safe_load((state / "config.yaml").read_text())["learner"]
    lc = LearnerSection(**section, state_dir=state / "learner", policy_root=state / "policies")
    torch.manual_seed(lc.seed)
    model, tok = load_policy(lc.model, seed=lc.seed)
    trainer = Trainer(model, tok.pad_token_id, lc.train)
    store = PolicyStore(lc.policy_root, outbox=None, keep=lc.keep_policies,
                        keep_runs=lc.keep_earlier_runs)
    parts = SimpleNamespace(model=model, trainer=trainer, store=store)
    saved = json.loads((lc.state_dir / RUN / "state.json").read_text())
    return lc, parts, saved


def test_the_old_run_resumes_from_its_checkpoint(old_run):
    lc, parts, saved = old_run
    st = open_run(lc.state_dir, "auto", saved["config"], Weights(parts))
    assert (st.run_id, st.step, st.finished) == (RUN, 6, False)
    assert len(st.in_flight) == 16 and all(isinstance(f, InFlight) for f in st.in_flight.values())
    assert st.offsets == saved["offsets"] and st.feeder_position == saved["feeder_position"]
    assert parts.trainer.global_step == 6
    ckpt = load_file(str(lc.state_dir / RUN / "checkpoints" / "step_000006" / "model" / "model.safetensors"))
    live = parts.model.state_dict()
    assert all(torch.equal(live[k], v) for k, v in ckpt.items())
    # what it writes back is the JSON it read (the same keys, and those added since; typed on the
    # way), less the two that grew with every step: history moves to history.jsonl, trained is
    # the audit log's
    assert set(json.loads(st.model_dump_json())) == (set(saved) - MOVED) | set(ADDED)
    trim_history(lc.state_dir / RUN, st)
    rows = [json.loads(line) for line in (lc.state_dir / RUN / "history.jsonl").read_text().splitlines()]
    assert rows == st.history == saved["history"] and [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]


def test_without_a_checkpoint_the_legacy_policy_file_is_loaded(old_run):
    lc, parts, saved = old_run
    shutil.rmtree(lc.state_dir / RUN / "checkpoints")
    st = open_run(lc.state_dir, "auto", saved["config"], Weights(parts))
    assert st.step == 6 and st.policy_uri == f"{RUN}/v000006.safetensors"
    legacy = load_file(str(lc.policy_root / st.policy_uri))
    live = parts.model.state_dict()
    assert all(torch.equal(live[k], v) for k, v in legacy.items())


def test_a_tampered_legacy_policy_file_is_refused_by_name(old_run):
    lc, parts, saved = old_run
    shutil.rmtree(lc.state_dir / RUN / "checkpoints")
    with open(lc.policy_root / RUN / "v000006.safetensors", "r+b") as f:
        f.seek(-1, 2)
        f.write(b"\x00")
    with pytest.raises(ConfigError, match=rf"cannot continue run {RUN} \(no checkpoint of it can be used\): "
                                          rf"policy version {RUN}/v000006.safetensors of run {RUN}: sha256_mismatch"
                       ) as e:   # exit 2: a restart would fail the same way (issue 46)
        open_run(lc.state_dir, "auto", saved["config"], Weights(parts))
    assert e.value.code == 2 and "learner.resume: never" in str(e.value)


def test_a_state_with_a_key_this_version_does_not_know_is_refused_by_name(old_run):
    lc, parts, saved = old_run
    path = lc.state_dir / RUN / "state.json"
    path.write_text(json.dumps({**saved, "shards": 2}))
    with pytest.raises(ConfigError, match=r"its saved state cannot be read by this version\): .*state.json: "
                                          r".*shards: Extra inputs are not permitted") as e:   # exit 2 (issue 46)
        open_run(lc.state_dir, "auto", saved["config"], Weights(parts))
    assert e.value.code == 2 and isinstance(e.value.__context__, StateError)


def test_the_resumed_run_publishes_in_the_folder_layout_and_both_read_back(old_run, tmp_path):
    lc, parts, saved = old_run
    st = open_run(lc.state_dir, "auto", saved["config"], Weights(parts))
    legacy_uri, legacy_sha = st.policy_uri, st.policy_sha256
    sent = []
    parts.store.outbox = SimpleNamespace(produce=lambda topic, key, value: sent.append((topic, value)),
                                         flush=lambda: None)
    parts.store.publish(parts.model, st)
    assert st.policy_uri == f"{RUN}/v000006" and sent[0][1].uri == st.policy_uri
    assert sent[0][1].sha256 == st.policy_sha256 != legacy_sha
    root = lc.policy_root.resolve()
    new = policy_files.read_version(root, st.policy_uri, st.policy_sha256)
    old = policy_files.read_version(root, legacy_uri, legacy_sha)  # an old record on the compacted topic
    assert new.keys() == old.keys() and all(torch.equal(new[k], old[k]) for k in new)
    with pytest.raises(policy_files.PolicyRefused, match="sha256_mismatch"):
        policy_files.read_version(root, st.policy_uri, legacy_sha)


def test_run_state_round_trips_the_old_json():
    text = (FIXTURE / "learner" / RUN / "state.json").read_text()
    old = {k: v for k, v in json.loads(text).items() if k not in MOVED}
    old["in_flight"] = {pid: f | IN_FLIGHT_ADDED for pid, f in old["in_flight"].items()}
    assert json.loads(RunState.parse(text, "fixture").model_dump_json()) == old | ADDED
    assert len(RunState.parse(text, "fixture").history) == 6        # read, kept in memory


def test_a_new_run_state_counts_no_prompt_fed():
    """Regression: `fed` defaults to -1 (= feeder_position, for states written before the prompt
    gate); a new run's state kept -1, so the feeder published steps x B + 1 prompts and one
    stayed untrained (found by the killed-three-times pipeline test's audit)."""
    assert RunState(run_id="r1").fed == 0
    assert RunState(run_id="r1", feeder_position=7).fed == 7
    assert RunState(run_id="r1", feeder_position=7, fed=5).fed == 5
