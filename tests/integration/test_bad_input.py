"""What a user brings costs one prompt, never the run (issue 33), under `steadyrl up` on the tiny
model against the real broker: a dataset with rows of every bad kind and rows the reward server
can never score. The bad rows are reported and never published; each unscorable prompt is
abandoned once with its reason and replaced by the next row; the run reaches its last step at
max_staleness 0 and 1, the exactly-once audit passes, and nothing restarts."""

from __future__ import annotations

import json
import math
import time

import pytest
import yaml

from steadyrl.bus.kafka import read_topic
from steadyrl.testing import audit_pipeline, audit_run, explain
from tests.integration.test_pipeline import TINY, Up

GOOD = 40
#: the bad kinds the issue names, at these indices after the good rows
BAD = {GOOD + 0: ("extra_info.x", {"prompt": [{"role": "user", "content": "3"}], "extra_info": {"x": math.nan}}),
       GOOD + 1: ("prompt[0].role", {"prompt": [{"role": "tool", "content": "3"}]}),
       GOOD + 2: ("prompt[0].content", {"prompt": [{"role": "user", "content": None}]}),
       GOOD + 3: ("prompt", {"prompt": [{"role": "user", "content": "3" * 200}]}),   # > the context (128)
       GOOD + 4: ("prompt", {"prompt": "3"})}
REFUSED = [GOOD + 5, GOOD + 6, GOOD + 7]   # tests.scorers:refusing_tiny_copy raises on them


def _dataset(path) -> str:
    rows = [{"prompt": [{"role": "user", "content": str(i % 10)}], "reward_model": {"ground_truth": str(i % 10)}}
            for i in range(GOOD)]
    rows += [{"reward_model": {"ground_truth": "3"}} | rec for _, rec in BAD.values()]
    rows += [{"prompt": [{"role": "user", "content": "5"}], "reward_model": {"ground_truth": "refuse"}}
             for _ in REFUSED]
    path.write_text("".join(json.dumps({"data_source": "tiny_copy", **r}) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_bad_rows_and_unscorable_prompts_cost_one_prompt_each_never_the_run(bootstrap, tmp_path, max_staleness):
    steps = 12
    cfg = yaml.safe_load(TINY.read_text())
    cfg["learner"].update(data=_dataset(tmp_path / "rows.jsonl"), eval_data=None, steps=steps,
                          max_staleness=max_staleness, prompt_max_refusals=2, prompt_min_refusal_s=1.0)
    cfg["reward_server"].update(scorers=["tests.scorers:refusing_tiny_copy"],
                                default_scorer="tests.scorers:refusing_tiny_copy")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    t0 = time.monotonic()
    up = Up(bootstrap, tmp_path, tmp_path / "config.yaml")
    assert up.wait(300) == 0, up.log()[-4000:]
    seconds = time.monotonic() - t0
    out = up.log()
    assert "exited with" not in out and "restart #" not in out, out[-4000:]
    run = up.run()
    st = run.state
    # every bad row reported, with its field; none published
    report = [json.loads(x) for x in (run.path / "bad_rows.jsonl").read_text().splitlines()]
    assert {r["index"]: r["field"] for r in report} == {i: f for i, (f, _) in BAD.items()}
    assert st["counts"]["bad_rows"] == len(BAD) and "dataset rows left out" in out
    # each unscorable prompt abandoned once, with the scorer's reason; replaced, so the run finished
    abandoned = [json.loads(x) for x in (run.path / "abandoned.jsonl").read_text().splitlines()]
    ids = [a["prompt_id"] for a in abandoned]
    assert abandoned and len(ids) == len(set(ids)) == len(st["abandoned"]) == st["counts"]["abandoned"]
    assert {a["index"] for a in abandoned} <= set(REFUSED), abandoned
    assert all("this row cannot be scored" in a["why"] for a in abandoned), abandoned[0]
    report = audit_pipeline(bootstrap, up.prefix, run, steps, 8, excuse_dlq=False)
    assert report["ok"], explain(report)
    assert report["abandoned"] == len(ids)
    published = {m.key().decode() for m in read_topic(bootstrap, f"{up.prefix}rl.prompts", "test-bad-input")}
    assert published and not {int(p.rsplit("-i", 1)[1]) for p in published} & set(BAD)
    print(f"max_staleness {max_staleness}: {steps} steps in {seconds:.1f} s, {len(ids)} abandoned")  # noqa: T201


def test_prompts_whose_records_were_deleted_are_published_again_and_trained_once(bootstrap, tmp_path):
    """rl.prompts truncated under a stopped rollout worker (the admin API's delete-records, as a
    retention that passed while the stack was paused): the restarted worker finds its committed
    offset out of range and says so (log, steadyrl_consumer_offset_resets_total); the learner
    publishes the prompts lost with it again, same id, once they are in flight past its bound;
    each is trained once and the run finishes."""
    import os
    import signal

    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient

    from tests.integration.test_pipeline import _config

    steps = 40
    up = Up(bootstrap, tmp_path, _config(tmp_path, steps=steps, eval_data=None, republish_min_s=10.0,
                                         republish_factor=1.0))
    try:
        up.wait_step(5)
        pid = up.child_pid("rollout-0")
        os.kill(pid, signal.SIGSTOP)       # nothing more consumed or committed
        time.sleep(2.0)
        topic = f"{up.prefix}rl.prompts"
        admin = AdminClient({"bootstrap.servers": bootstrap})
        from confluent_kafka import Consumer

        c = Consumer({"bootstrap.servers": bootstrap, "group.id": "t-" + up.prefix})
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        ends = [TopicPartition(topic, p, c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1])
                for p in parts]
        c.close()
        for fut in admin.delete_records(ends).values():
            fut.result(30)
        os.kill(pid, signal.SIGKILL)       # `up` restarts it; it resumes from the group's offsets
        assert up.wait(300) == 0, up.log()[-4000:]
    finally:
        up.close()
    out = up.log()
    assert "consumer offset out of range" in out, out[-4000:]
    run = up.run()
    assert run.state["counts"].get("republished", 0) >= 1, run.state["counts"]
    # the topics no longer hold what was deleted, so the audit is the learner's own: every step,
    # steps x B trained, none twice; and every prompt published again was trained once
    report = audit_run(run, steps, 8)
    assert report["ok"], explain(report)
    again = [p for line in out.splitlines() if "prompts in flight too long" in line
             for p in json.loads(line.split("| ", 1)[1])["prompts"]]
    trained = [c["prompt_id"] for c in run.consumed()]
    assert again and all(trained.count(p) == 1 for p in again), (again, len(trained))
