"""A run resumes only onto the topics its offsets point into: another topic prefix or another
Kafka cluster starts a new run (regression: the fingerprint held only the learner section, so
`up --prefix b.` resumed a run of `a.` with a.'s offsets into b.'s topics)."""

import json
import logging
from types import SimpleNamespace

import pytest

from services.learner.learner import Learner, RunState
from steadyrl.checkpoint import write_atomic


def fingerprint(prefix: str, cluster: str) -> dict:
    return {"model": "tiny", "data": "tiny_copy:10", "prompts_per_step": 8, "group_size": 8, "seed": 0,
            "algorithm": "grpo", "topic_prefix": prefix, "kafka_cluster_id": cluster}


def learner(tmp_path, prefix: str, cluster: str) -> Learner:
    lrn = Learner.__new__(Learner)  # only what _open_run reads
    lrn.lc = SimpleNamespace(state_dir=tmp_path, resume="auto")
    lrn.fingerprint = fingerprint(prefix, cluster)
    lrn._restore_weights = lambda st: None  # no checkpoint yet: the weights of the policy store
    return lrn


@pytest.fixture
def unfinished_run(tmp_path):
    st = RunState(run_id="r-a", config=fingerprint("a.", "cluster-1"), step=7)
    (tmp_path / "r-a").mkdir()
    write_atomic(tmp_path / "r-a" / "state.json", json.dumps(st.__dict__))
    write_atomic(tmp_path / "CURRENT", "r-a\n")
    return st


def test_same_prefix_and_cluster_resumes_the_run(tmp_path, unfinished_run):
    st = learner(tmp_path, "a.", "cluster-1")._open_run()
    assert st.run_id == "r-a" and st.step == 7


@pytest.mark.parametrize("prefix, cluster, changed", [("b.", "cluster-1", "topic_prefix"),
                                                      ("a.", "cluster-2", "kafka_cluster_id")])
def test_other_topics_start_a_new_run_and_say_why(tmp_path, unfinished_run, caplog, prefix, cluster, changed):
    with caplog.at_level(logging.WARNING):
        st = learner(tmp_path, prefix, cluster)._open_run()
    assert st.run_id != "r-a" and st.step == 0
    assert (tmp_path / "CURRENT").read_text().strip() == st.run_id
    why = [r for r in caplog.records if "configuration differs" in r.getMessage()]
    assert why and list(why[0].changed) == [changed]
