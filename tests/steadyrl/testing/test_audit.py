"""steadyrl.testing.audit: the exactly-once audit passes a clean run and names every way one
can go wrong (trained twice, lost, never published, unfinished, out of order; a stage that
duplicates or drops)."""

from __future__ import annotations

from steadyrl.testing import RunDir, audit_run, explain, stage_audit
from tests.steadyrl.testing.rundirs import published_ids, write_run

RUN = "r20260101T000000-abcd"


def line(step: int, k: int) -> dict:
    return {"step": step, "prompt_id": f"{RUN}/e0-i{k}", "partition": 0, "offset": k, "policy_version": 0,
            "reward_mean": 0.0}


def test_a_clean_run_passes_every_check(tmp_path):
    write_run(tmp_path)
    other_run = ["r20250101T000000-0000/e0-i0"]   # another run's prompts on the same topic: not ours
    rep = audit_run(RunDir(tmp_path), 3, 2, published=published_ids() + other_run)
    assert rep["ok"], explain(rep)
    assert set(rep["checks"]) == {"final_step_reached", "trained_count_is_steps_x_batch", "no_prompt_trained_twice",
                                  "every_trained_prompt_was_published", "no_published_prompt_lost",
                                  "audit_log_in_step_order", "no_abandoned_prompt_trained"}
    assert rep["trained"] == 6 and rep["published_ids"] == 6 and rep["lost_count"] == 0
    assert explain(rep) == "all checks passed"


def test_an_abandoned_prompt_is_accounted_for_and_never_also_trained(tmp_path):
    # i6 was published, refused past its budget and abandoned: not lost; i7 was published and
    # is neither trained nor abandoned: lost
    write_run(tmp_path, abandoned={f"{RUN}/e0-i6": "refused 5 times"})
    rep = audit_run(RunDir(tmp_path), 3, 2, published=published_ids() + [f"{RUN}/e0-i6"])
    assert rep["ok"], explain(rep)
    assert rep["abandoned"] == 1 and rep["lost_count"] == 0
    rep = audit_run(RunDir(tmp_path), 3, 2, published=published_ids() + [f"{RUN}/e0-i6", f"{RUN}/e0-i7"])
    assert not rep["ok"] and rep["lost"] == [f"{RUN}/e0-i7"]
    # a prompt both abandoned and trained breaks "trained once, or abandoned once"
    other = tmp_path / "other"
    write_run(other, abandoned={f"{RUN}/e0-i0": "refused 5 times"})
    rep = audit_run(RunDir(other), 3, 2, published=published_ids())
    assert not rep["ok"] and not rep["checks"]["no_abandoned_prompt_trained"]


def test_a_prompt_trained_twice_and_one_never_trained_are_reported(tmp_path):
    consumed = [line(1, 0), line(1, 1), line(2, 2), line(2, 3), line(3, 4), line(3, 0)]   # i0 twice, i5 never
    write_run(tmp_path, consumed=consumed)
    rep = audit_run(RunDir(tmp_path), 3, 2, published=published_ids())
    assert not rep["ok"]
    assert not rep["checks"]["no_prompt_trained_twice"] and rep["trained_twice"] == [f"{RUN}/e0-i0"]
    assert not rep["checks"]["no_published_prompt_lost"] and rep["lost"] == [f"{RUN}/e0-i5"]
    assert rep["lost_count"] == 1
    assert rep["checks"]["trained_count_is_steps_x_batch"]   # 6 lines: the count alone would not tell
    msg = explain(rep)
    assert "no_prompt_trained_twice" in msg and "no_published_prompt_lost" in msg and "e0-i5" in msg


def test_a_missing_prompt_is_lost_unless_excused(tmp_path):
    write_run(tmp_path, consumed=[line(1, 0), line(1, 1), line(2, 2), line(2, 3), line(3, 4)])
    run = RunDir(tmp_path)
    rep = audit_run(run, 3, 2, published=published_ids())
    assert not rep["checks"]["no_published_prompt_lost"] and not rep["checks"]["trained_count_is_steps_x_batch"]
    excused = audit_run(run, 3, 2, published=published_ids(), excused=[f"{RUN}/e0-i5"])   # e.g. on rl.dlq
    assert excused["checks"]["no_published_prompt_lost"] and excused["lost_count"] == 0


def test_a_trained_prompt_never_published_is_reported(tmp_path):
    write_run(tmp_path)
    rep = audit_run(RunDir(tmp_path), 3, 2, published=published_ids()[:5])
    assert not rep["checks"]["every_trained_prompt_was_published"] and rep["not_published"] == [f"{RUN}/e0-i5"]


def test_an_unfinished_run_or_a_missing_step_fails_final_step_reached(tmp_path):
    write_run(tmp_path / "a", finished=False)
    assert not audit_run(RunDir(tmp_path / "a"), 3, 2)["checks"]["final_step_reached"]
    write_run(tmp_path / "b")
    rep = audit_run(RunDir(tmp_path / "b"), 4, 2)             # asked for 4 steps, the run made 3
    assert not rep["checks"]["final_step_reached"] and not rep["ok"]
    assert "every_trained_prompt_was_published" not in rep["checks"]   # no published ids given


def test_an_audit_log_that_goes_back_a_step_is_reported(tmp_path):
    write_run(tmp_path, consumed=[line(1, 0), line(2, 2), line(1, 1), line(2, 3), line(3, 4), line(3, 5)])
    rep = audit_run(RunDir(tmp_path), 3, 2, published=published_ids())
    assert not rep["checks"]["audit_log_in_step_order"] and not rep["ok"]


class Msg:
    """What stage_audit reads of a consumed message."""

    def __init__(self, topic: str, partition: int, offset: int, key: str):
        self._t, self._p, self._o, self.key = topic, partition, offset, key

    def topic(self):
        return self._t

    def partition(self):
        return self._p

    def offset(self):
        return self._o


def test_a_stage_that_duplicates_or_drops_an_output_is_reported():
    inputs = [Msg("rl.prompts", 0, o, f"p{o}") for o in range(4)] + [Msg("rl.prompts", 1, 0, "q0")]
    committed = {0: 3, 1: 1}     # p3 not committed yet: no output expected for it
    in_key, out_key = (lambda m: (m.key, 0)), (lambda g: g)   # noqa: E731  (prompt id, seed)
    outs = lambda *ids: [(i, 0) for i in ids]   # noqa: E731
    ok = stage_audit("rollout", inputs, in_key, outs("p0", "p1", "p2", "q0"), out_key, committed, set())
    assert ok["ok"] and ok["inputs_committed"] == 4 and ok["outputs"] == 4

    dup = stage_audit("rollout", inputs, in_key, outs("p0", "p1", "p1", "p2", "q0"), out_key, committed, set())
    assert not dup["ok"] and dup["duplicated_outputs"] == 1 and dup["examples"]["duplicated"] == [["p1", 0]]

    lost = stage_audit("rollout", inputs, in_key, outs("p0", "p2", "q0"), out_key, committed, set())
    assert not lost["ok"] and lost["missing_outputs"] == 1 and lost["examples"]["missing"] == [["p1", 0]]

    to_dlq = stage_audit("rollout", inputs, in_key, outs("p0", "p2", "q0"), out_key, committed,
                         {("rl.prompts", 0, 1)})
    assert to_dlq["ok"] and to_dlq["inputs_to_dlq"] == 1   # the input went to rl.dlq instead
