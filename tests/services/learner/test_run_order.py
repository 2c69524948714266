"""A new run's id sorts after the runs the learner's state dir and policy root hold, with the
process's clock behind them (issue 33; the whole stack: tests/integration/test_run_order.py)."""

import time

from steadyrl.run import policy_files
from steadyrl.services.learner.resume import open_run
from tests.services.learner.test_resume_identity import NoWeights, fingerprint

NOON = 1796299200.0   # 2026-12-03T12:00:00Z


def test_a_new_run_sorts_after_the_runs_in_the_state_dir_and_the_policy_root(tmp_path, monkeypatch):
    state, policies = tmp_path / "learner", tmp_path / "policies"
    (state / "r20261203T120500-ffff").mkdir(parents=True)      # the previous run, 5 min after "now"
    (state / "CURRENT").write_text("r20261203T120500-ffff\n")  # no state.json: not continued
    (policies / "r20261203T121000-0000" / "v000000").mkdir(parents=True)   # a run of another state dir
    monkeypatch.setattr(time, "time", lambda: NOON)
    st = open_run(state, "never", fingerprint("a.", "c"), NoWeights(), policies)
    assert st.run_id[:16] == "r20261203T121001" and policy_files.RUN_ID.fullmatch(st.run_id)
    assert (state / "CURRENT").read_text().strip() == st.run_id
    # without the policy root (callers before it was passed) the state dir alone still orders
    st = open_run(state, "never", fingerprint("a.", "c"), NoWeights())
    assert st.run_id[:16] == "r20261203T120501"


def test_with_the_clock_ahead_a_new_run_is_named_by_the_clock(tmp_path, monkeypatch):
    (tmp_path / "r20261201T075848-5c73").mkdir()   # a run of main at 4bba081
    monkeypatch.setattr(time, "time", lambda: NOON + 0.7)
    assert open_run(tmp_path, "auto", fingerprint("a.", "c"), NoWeights(), tmp_path / "absent").run_id[:16] == \
        "r20261203T120000"
