"""steadyrl.testing.run: the one reader of a learner run's folder, and what the throughput
bench reports from it."""

from __future__ import annotations

import enum
import json
import subprocess
import sys

import pytest

from steadyrl.testing import COUNT_KEYS, Counts, RunDir, current, run_finished, run_ids
from tests.helpers import ROOT
from tests.steadyrl.testing.rundirs import published_ids, write_run

RUN = "r20260101T000000-abcd"


def test_the_run_current_names_is_read_with_its_state_log_and_summary(tmp_path):
    write_run(tmp_path, counts={"stale_dropped": 3, "dlq": 1}, summary={"reward_per_step": [0.1, 0.2, 0.3]})
    run = RunDir(tmp_path)
    assert run.run_id == RUN == current(tmp_path) and run.path == tmp_path / RUN
    assert run.step == 3 and run.finished and run.policy_uri == f"{RUN}/v3.safetensors"
    assert [h["step"] for h in run.history] == [1, 2, 3] and run.quarantined == {}
    assert len(run.consumed()) == 6 and run.trained_ids() == published_ids()
    assert run.consumed()[0] == {"step": 1, "prompt_id": f"{RUN}/e0-i0", "partition": 0, "offset": 1,
                                 "policy_version": 0, "reward_mean": 0.5}
    assert run.summary() == {"reward_per_step": [0.1, 0.2, 0.3]}
    assert run.state["feeder_position"] == 6   # every RunState field as written
    assert (run.curve, run.checkpoints, run.rollout_cache) == (
        tmp_path / RUN / "curve.png", tmp_path / RUN / "checkpoints", tmp_path / RUN / "rollout-cache")


def test_counts_have_the_learners_names_and_a_wrong_name_raises_instead_of_reading_0(tmp_path):
    write_run(tmp_path, counts={"stale_dropped": 3, "evicted": 2})
    counts = RunDir(tmp_path).counts
    assert counts["stale_dropped"] == 3 and counts["evicted"] == 2
    assert counts["future_dropped"] == 0 and counts.get("dlq") == 0     # known, never counted
    with pytest.raises(KeyError, match="'stale' is not a learner count"):
        counts["stale"]   # what bench/throughput.py read: every committed run said 0 stale drops
    with pytest.raises(KeyError):
        counts.get("stale", 0)
    assert dict(counts) == counts.as_dict() == {"stale_dropped": 3, "evicted": 2}
    assert len(counts) == 2 and "stale_dropped" in counts


def test_counts_take_an_enum_with_the_same_values():
    Count = enum.Enum("Count", {"STALE_DROPPED": "stale_dropped", "DLQ": "dlq"})
    counts = Counts({"stale_dropped": 4})
    assert counts[Count.STALE_DROPPED] == 4 and counts[Count.DLQ] == 0
    assert {"stale_dropped", "future_dropped", "dlq", "evicted", "cache_scored", "released"} <= set(COUNT_KEYS)


def test_the_learners_counts_are_the_run_folders_names():
    """One list: the learner counts under steadyrl.run.runfolder's Count, which the reader knows."""
    from steadyrl.run.runfolder import Count
    from steadyrl.services.learner.state import RunState

    st = RunState(run_id="r")
    for c in Count:
        st.count(c)
    assert Counts(st.counts).as_dict() == {c.value: 1 for c in Count} and set(COUNT_KEYS) == set(st.counts)
    assert Counts({"dlq": 2})[Count.dlq] == 2 and Counts({})[Count.stale_dropped] == 0


def test_a_named_run_an_up_state_dir_and_a_run_still_going(tmp_path):
    learner = tmp_path / "learner"
    write_run(learner, "r1", current=False)
    write_run(learner, "r2", finished=False)
    assert run_ids(learner) == ["r1", "r2"] and run_ids(tmp_path / "nothing") == []
    assert RunDir(learner, "r1").finished and not RunDir.of_up(tmp_path).finished
    assert RunDir.of_up(tmp_path).run_id == "r2"
    run = RunDir(learner)
    assert run.step == 3
    state = json.loads((learner / "r2" / "state.json").read_text())
    (learner / "r2" / "state.json").write_text(json.dumps({**state, "step": 4}))
    assert run.step == 3 and run.reload().step == 4     # kept until reload()


def test_no_run_yet(tmp_path):
    assert current(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="CURRENT"):
        RunDir(tmp_path)
    (tmp_path / "r1").mkdir()
    assert RunDir(tmp_path, "r1").consumed() == []


def test_run_finished_is_what_up_asks_when_the_learner_exits_0(tmp_path):
    assert not run_finished(tmp_path)                       # no CURRENT
    (tmp_path / "CURRENT").write_text("r9\n")
    assert not run_finished(tmp_path)                       # no state.json yet
    (tmp_path / "r9").mkdir()
    (tmp_path / "r9" / "state.json").write_text('{"run_id": "r9", "fini')
    assert not run_finished(tmp_path)                       # torn
    (tmp_path / "r9" / "state.json").write_text('{"run_id": "r9"}')
    assert not run_finished(tmp_path)                       # no such key
    write_run(tmp_path, "r10", finished=False)
    assert not run_finished(tmp_path)
    write_run(tmp_path, "r11")
    assert run_finished(tmp_path)


def test_the_run_reader_imports_neither_services_nor_tests_and_nothing_heavy():
    code = ("import sys, steadyrl.testing.run; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('services', 'tests', 'httpx', 'confluent_kafka')"
            " or m.startswith('steadyrl.services')]; "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---- bench/throughput.py's figures from a run (issue 17: it read counts["stale"]) -----------

def test_the_throughput_bench_reports_the_learners_stale_drops(tmp_path):
    from bench.throughput import learner_figures

    steps, batch = 10, 2
    write_run(tmp_path / "learner", RUN, steps=steps, batch=batch, counts={"stale_dropped": 3})
    lc = {"steps": steps, "prompts_per_step": batch, "group_size": 4, "checkpoint_every": 5}
    got = learner_figures(RunDir.of_up(tmp_path), lc, e2e_s=12.0, published=published_ids(RUN, steps * batch))
    assert got["stale_drops"] == 3
    assert got["counts"] == {"stale_dropped": 3}
    assert got["audit"]["ok"] and got["audit"]["trained"] == got["audit"]["unique"] == got["audit"]["expected"] == 20
    assert got["figures"]["steps"] == steps and got["figures"]["warm_steps"] == 5
    assert got["figures"]["samples_per_s"] == pytest.approx(5 * batch * 4 / (5 * 0.5))
    assert got["policy_versions_trained"] == {"0": steps}
