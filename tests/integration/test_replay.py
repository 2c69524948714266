"""`steadyrl replay` against a real broker: the time window through offsets_for_times (both
bounds inclusive, to the millisecond), read_committed, undecodable records skipped and
counted, re-scoring with a rule scorer (KS, mean/std against scipy/numpy), `--to-topic`
re-publishing in a transaction, and the CLI's text report, JSON and PNG.

The topic holds two windows one minute apart: A scored with tiny_copy, B with the stricter
tests.scorers:strict_tiny_copy (a scorer changed mid-run), produced in time order per
partition with explicit timestamps, all in one committed transaction."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from scipy.stats import ks_2samp

from steadyrl import replay as rp
from steadyrl.bus.topics import create_topics
from steadyrl.cli import main
from steadyrl.model.rewards import tiny_copy
from steadyrl.wire import codec
from steadyrl.wire.contracts import Prompt, RolloutGroup, Sample, ScoredGroup
from tests.helpers import decode_all, read_all, unique_prefix
from tests.scorers import strict_tiny_copy

TEXTS = ["3333", "3333 done", "33a3", "3x33", "a3b3", "xxxx", "3", "333 "]
STRICT = "rule:tests.scorers:strict_tiny_copy@1"
N = 20            # groups per window
GAP_MS = 60_000   # window B starts this long after window A


def _group(name: str, i: int, strict: bool) -> ScoredGroup:
    texts = [TEXTS[(i + k) % len(TEXTS)] for k in range(4)]
    p = Prompt(prompt_id=name, epoch=0, index=i, n_samples=4, data_source="tiny_copy", ground_truth="3",
               messages=[{"role": "user", "content": "3"}])
    g = RolloutGroup(prompt=p, samples=[Sample(text=t, token_ids=[1], logprobs=[-0.5]) for t in texts],
                     policy_version=i)
    fn = strict_tiny_copy if strict else tiny_copy
    return ScoredGroup(group=g, rewards=[fn("tiny_copy", t, "3") for t in texts], reward_source="rule",
                       scorer=STRICT if strict else "rule:tiny_copy@1")


@pytest.fixture(scope="module")
def data(bootstrap):
    """Topic `{prefix}rl.scored` with window A: a0..a19 every 100 ms from `base`, `a-edge-before`
    at T1 - 1 and `a-edge-after` at T2 + 1 around T1 = base + 500, T2 = base + 1500, and right
    after a10 in its partition an undecodable record and `skewed`, stamped base - 1 (a producer
    whose clock lagged: inside the offset range, outside the time range); and window B: b0..b19
    every 100 ms from base + GAP_MS, then b-late0/1. Returns prefix, topic, base, t1, t2 and
    the groups by prompt id."""
    from confluent_kafka import Producer

    prefix = unique_prefix()
    create_topics(bootstrap, prefix)
    topic = f"{prefix}rl.scored"
    base = int(time.time() * 1000) - 20 * 60_000
    t1, t2 = base + 500, base + 1500
    rows = [(base + i * 100, _group(f"a{i}", i, strict=False)) for i in range(N)]
    rows += [(t1 - 1, _group("a-edge-before", 100, strict=False)), (t2 + 1, _group("a-edge-after", 101, strict=False))]
    rows += [(base + GAP_MS + i * 100, _group(f"b{i}", i, strict=True)) for i in range(N)]
    rows += [(base + GAP_MS + 2000 + k * 100, _group(f"b-late{k}", 102 + k, strict=True)) for k in range(2)]
    rows.sort(key=lambda r: r[0])
    plan = [(ts, g, k % 8) for k, (ts, g) in enumerate(rows)]   # time order within each partition
    i10 = next(k for k, (_, g, _) in enumerate(plan) if g.prompt_id == "a10")
    p10 = plan[i10][2]
    plan[i10 + 1:i10 + 1] = [(base + 1000, None, p10), (base - 1, _group("skewed", 103, strict=False), p10)]
    p = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"replay-test-{prefix}"})
    p.init_transactions(30)
    p.begin_transaction()
    for ts, g, part in plan:
        if g is None:  # undecodable: not JSON
            value, headers, key = b"\xff not json", [("schema", b"scored_group/v1.1")], "bad"
        else:
            (value, headers), key = codec.encode(g), g.prompt_id
        p.produce(topic, value, key=key, headers=headers, partition=part, timestamp=ts)
    p.commit_transaction(30)
    # commit_transaction returns before the broker has written every partition's commit marker;
    # until then read_committed readers (and offsets_for_times) do not see that partition's records
    deadline = time.monotonic() + 30
    while len(rp.read_range(bootstrap, topic, base, base + GAP_MS + 2100).records) < len(rows):
        assert time.monotonic() < deadline, "the committed records never became visible"
        time.sleep(0.2)
    return {"prefix": prefix, "topic": topic, "base": base, "t1": t1, "t2": t2,
            "groups": {g.prompt_id: g for _, g in rows}, "ts": {g.prompt_id: ts for ts, g in rows}}


def test_window_bounds_are_inclusive_to_the_millisecond(bootstrap, data):
    w = rp.read_range(bootstrap, data["topic"], data["t1"], data["t2"])
    got = [r.group.prompt_id for r in w.records]
    assert got == [f"a{i}" for i in range(5, 16)]      # a5 at exactly T1 ... a15 at exactly T2, time order
    assert [r.timestamp_ms for r in w.records] == [data["base"] + i * 100 for i in range(5, 16)]
    assert "a-edge-before" not in got and "a-edge-after" not in got   # T1 - 1 ms and T2 + 1 ms
    assert w.undecodable == {"undecodable": 1} and w.outside == 1   # `skewed`
    assert all(r.group == data["groups"][r.group.prompt_id] for r in w.records)

    whole = rp.read_range(bootstrap, data["topic"], data["base"], data["base"] + GAP_MS + 2100)
    assert len(whole.records) == 2 * N + 4 and whole.skipped == 1 and whole.outside == 1
    assert rp.read_range(bootstrap, data["topic"], data["base"] + 2000, data["base"] + GAP_MS - 1).records == []
    one = rp.read_range(bootstrap, data["topic"], data["t1"], data["t1"])
    assert [r.group.prompt_id for r in one.records] == ["a5"]


def test_aborted_and_open_transactions_are_not_read(bootstrap):
    from confluent_kafka import Producer

    prefix = unique_prefix()
    create_topics(bootstrap, prefix)
    topic = f"{prefix}rl.scored"
    t0 = int(time.time() * 1000) - 1
    p = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"replay-abort-{prefix}"})
    p.init_transactions(30)
    for name, commit in (("kept-1", True), ("aborted", False), ("kept-2", True)):
        p.begin_transaction()
        value, headers = codec.encode(_group(name, 0, strict=False))
        p.produce(topic, value, key=name, headers=headers, partition=0)
        p.flush(10)
        p.commit_transaction(30) if commit else p.abort_transaction(30)
    w = rp.read_range(bootstrap, topic, t0, int(time.time() * 1000) + 1000, timeout_s=20)
    assert [r.group.prompt_id for r in w.records] == ["kept-1", "kept-2"]
    assert w.ranges[0] == (0, 6)  # 3 records + 3 markers: read to the end offset past the last marker


def test_rescore_with_a_rule_gives_scipy_ks_and_deltas(bootstrap, data):
    w = rp.read_range(bootstrap, data["topic"], data["base"], data["base"] + 1900)
    assert len(w.records) == N + 2
    rescored = rp.rescore([r.group for r in w.records], "tests.scorers:strict_tiny_copy")
    assert rescored.scorer_id == STRICT and rescored.errors == []
    rep = rp.build_report(w, rescored, top=5)
    before = [r for rec in w.records for r in rec.group.rewards]
    after = [strict_tiny_copy("", s.text, "3") for rec in w.records for s in rec.group.group.samples]
    assert [r for g in rescored.groups for r in g.rewards] == after
    ks = ks_2samp(before, after)
    sh = rep["shift"]
    assert rep["mode"] == "rescore" and sh["n"] == [len(before), len(after)]
    assert sh["ks_statistic"] == pytest.approx(ks.statistic, rel=1e-12)
    assert sh["ks_pvalue"] == pytest.approx(ks.pvalue, rel=1e-12)
    assert sh["mean"] == pytest.approx([np.mean(before), np.mean(after)])
    assert sh["delta_mean"] == pytest.approx(np.mean(after) - np.mean(before))
    assert sh["delta_std"] == pytest.approx(np.std(after) - np.std(before))
    deltas = [a - b for a, b in zip(after, before, strict=True)]
    assert sh["changed"] == sum(d != 0 for d in deltas)
    # largest |delta| is 0.75 ("33a3", "3x33": 0.75 -> 0)
    assert len(sh["largest_changes"]) == 5
    assert all(c["delta"] == -0.75 and c["response"] in ("33a3", "3x33") for c in sh["largest_changes"])


def test_halves_across_the_scorer_switch(bootstrap, data):
    w = rp.read_range(bootstrap, data["topic"], data["base"], data["base"] + GAP_MS + 2100)
    rep = rp.build_report(w)
    first, second = rp.halves(w.records)
    assert {r.group.scorer for r in first} == {"rule:tiny_copy@1"}       # 22 groups of A, 22 of B
    assert {r.group.scorer for r in second} == {STRICT}
    ks = ks_2samp([x for r in first for x in r.group.rewards], [x for r in second for x in r.group.rewards])
    assert rep["shift"]["ks_statistic"] == pytest.approx(ks.statistic)
    assert rep["shift"]["ks_pvalue"] == pytest.approx(ks.pvalue)
    timeline = [(s["scorer"], s["groups"]) for s in rep["scorer_timeline"]]
    assert timeline == [("rule:tiny_copy@1", N + 2), (STRICT, N + 2)]
    assert rep["scorer_timeline"][1]["first_ms"] == data["base"] + GAP_MS


def test_cli_rescores_republishes_and_writes_png_and_json(bootstrap, data, tmp_path, capsys):
    png, js = tmp_path / "shift.png", tmp_path / "shift.json"
    argv = ["replay", "--bootstrap", bootstrap, "--prefix", data["prefix"], "--topic", "rl.scored",
            "--from", rp.format_ms(data["base"]), "--to", str((data["base"] + 1900) / 1000),
            "--rescore", "tests.scorers:strict_tiny_copy", "--to-topic", "rl.scored.replay", "--top", "3",
            "--png", str(png), "--json", str(js)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"replay of {data['topic']} from {rp.format_ms(data['base'])}" in out
    assert f"rescored with {STRICT} (rule)" in out and "KS statistic" in out and "largest changes (3):" in out
    assert f"republished {N + 2} groups to {data['prefix']}rl.scored.replay (created) in one transaction" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    rep = json.loads(js.read_text())
    assert rep["groups"] == N + 2 and rep["undecodable"] == {"undecodable": 1} and rep["mode"] == "rescore"

    msgs = read_all(bootstrap, f"{data['prefix']}rl.scored.replay", expect=N + 2)
    out_groups = decode_all(msgs, ScoredGroup)
    want = [f"a{i}" for i in range(N)] + ["a-edge-before", "a-edge-after"]
    assert sorted(g.prompt_id for g in out_groups) == sorted(want)
    for g in out_groups:
        orig = data["groups"][g.prompt_id]
        assert g.scorer == STRICT and g.reward_source.value == "rule" and g.group == orig.group
        assert g.rewards == [strict_tiny_copy("", s.text, "3") for s in orig.group.samples]
    src = {m.key().decode(): dict(m.headers())["replay_of"].decode() for m in msgs}
    assert all(v.startswith(f"{data['topic']}:") for v in src.values())
    # original timestamps: the same window replays from the new topic
    assert {m.key().decode(): m.timestamp()[1] for m in msgs} == {k: data["ts"][k] for k in src}
    again = rp.read_range(bootstrap, f"{data['prefix']}rl.scored.replay", data["base"], data["base"] + 1900)
    assert [r.group.prompt_id for r in again.records] == [r.group.prompt_id for r in
                                                          rp.read_range(bootstrap, data["topic"], data["base"],
                                                                        data["base"] + 1900).records]


def test_cli_halves_report_and_empty_window(bootstrap, data, tmp_path, capsys):
    png = tmp_path / "halves.png"
    argv = ["replay", "--bootstrap", bootstrap, "--prefix", data["prefix"],
            "--from", rp.format_ms(data["base"]), "--to", rp.format_ms(data["base"] + GAP_MS + 2100), "--png", str(png)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "shift: first half of the window -> second half" in out
    assert "rule:tiny_copy@1 (rule)" in out and f"{STRICT} (rule)" in out
    assert f"histogram: {png}" in out and png.exists()

    empty = ["replay", "--bootstrap", bootstrap, "--prefix", data["prefix"],
             "--from", rp.format_ms(data["base"] + 5000), "--to", rp.format_ms(data["base"] + 6000)]
    assert main(empty) == 1
    assert "no scored groups" in capsys.readouterr().err
    assert main(["replay", "--bootstrap", bootstrap, "--prefix", data["prefix"], "--topic", "rl.nope",
                 "--from", "-1h", "--timeout", "5"]) == 1
    assert "topic " in capsys.readouterr().err
