"""A run resumes only onto the topics its offsets point into: another topic prefix, or another
rl.scored (other cluster, topic re-created: another topic id) starts a new run (regression: the
fingerprint held only the learner section, so `up --prefix b.` resumed a run of `a.` with a.'s
offsets into b.'s topics). A run saved before these keys existed still resumes."""

import logging
from types import SimpleNamespace

import pytest

from steadyrl.config import ConfigError
from steadyrl.run import checkpoint as ck
from steadyrl.services.learner.resume import open_run
from steadyrl.services.learner.state import RunState


def fingerprint(prefix: str, cluster: str) -> dict:
    return {"model": "tiny", "data": "tiny_copy:10", "prompts_per_step": 8, "group_size": 8, "seed": 0,
            "algorithm": "grpo", "topic_prefix": prefix, "scored_topic_id": cluster}


class NoWeights:
    """resume.Restorer for runs without a checkpoint yet: the policy store's weights (none here)."""

    def from_checkpoint(self, path):
        raise AssertionError("no checkpoint in these runs")

    def from_policy(self, st):
        pass


class Opener:
    """open_run as the learner calls it, with `lc.resume` settable as in the config."""

    def __init__(self, tmp_path, prefix: str, cluster: str):
        self.lc = SimpleNamespace(state_dir=tmp_path, resume="auto")
        self.fingerprint = fingerprint(prefix, cluster)

    def _open_run(self) -> RunState:
        return open_run(self.lc.state_dir, self.lc.resume, self.fingerprint, NoWeights())


def learner(tmp_path, prefix: str, cluster: str) -> Opener:
    return Opener(tmp_path, prefix, cluster)


@pytest.fixture
def unfinished_run(tmp_path):
    st = RunState(run_id="r-a", config=fingerprint("a.", "cluster-1"), step=7)
    (tmp_path / "r-a").mkdir()
    ck.write_atomic(tmp_path / "r-a" / "state.json", st.model_dump_json())
    ck.write_atomic(tmp_path / "CURRENT", "r-a\n")
    return st


def test_same_prefix_and_cluster_resumes_the_run(tmp_path, unfinished_run):
    st = learner(tmp_path, "a.", "cluster-1")._open_run()
    assert st.run_id == "r-a" and st.step == 7


@pytest.mark.parametrize("prefix, cluster, changed", [("b.", "cluster-1", "topic_prefix"),
                                                      ("a.", "cluster-2", "scored_topic_id")])
def test_other_topics_start_a_new_run_and_say_why(tmp_path, unfinished_run, caplog, prefix, cluster, changed):
    with caplog.at_level(logging.WARNING):
        st = learner(tmp_path, prefix, cluster)._open_run()
    assert st.run_id != "r-a" and st.step == 0
    assert (tmp_path / "CURRENT").read_text().strip() == st.run_id
    why = [r for r in caplog.records if "configuration differs" in r.getMessage()]
    assert why and list(why[0].changed) == [changed]


def test_a_run_saved_before_the_topic_keys_existed_resumes_and_records_them(tmp_path, caplog):
    old = {k: v for k, v in fingerprint("a.", "id-1").items() if k not in ("topic_prefix", "scored_topic_id")}
    st = RunState(run_id="r-old", config=old, step=4)
    (tmp_path / "r-old").mkdir()
    ck.write_atomic(tmp_path / "r-old" / "state.json", st.model_dump_json())
    ck.write_atomic(tmp_path / "CURRENT", "r-old\n")
    with caplog.at_level(logging.WARNING):
        got = learner(tmp_path, "a.", "id-1")._open_run()
    assert got.run_id == "r-old" and got.step == 4
    assert got.config == fingerprint("a.", "id-1")  # recorded from now on
    assert any(getattr(r, "not_recorded", None) == ["scored_topic_id", "topic_prefix"] for r in caplog.records)


def test_an_explicit_checkpoint_of_other_topics_is_a_config_error_naming_the_key(tmp_path, monkeypatch):
    monkeypatch.setattr(ck, "verify", lambda path, expect=None, key=None: {"config": fingerprint("a.", "id-1")})
    lrn = learner(tmp_path, "b.", "id-1")
    lrn.lc.resume = str(tmp_path / "step-00000010")
    with pytest.raises(ConfigError, match=r"learner.resume: .*topic_prefix mismatch: expected 'b.', got 'a.'"):
        lrn._open_run()


def test_an_explicit_checkpoint_that_does_not_verify_is_a_config_error(tmp_path):
    lrn = learner(tmp_path, "a.", "id-1")
    lrn.lc.resume = str(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=r"learner.resume: .*no manifest.json"):
        lrn._open_run()
