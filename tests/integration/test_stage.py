"""The reward worker as a real transactional stage against the real broker."""

import json
import time

import httpx

from steadyrl.wire import codec
from steadyrl.wire.contracts import DLQReason, DLQRecord, ScoredGroup
from tests.helpers import ServiceProc, decode_all, produce_all, read_all, rollout_group


def test_round_trip_and_every_bad_record_lands_in_dlq(bootstrap, reward_server, prefix, tmp_path):
    good = [rollout_group(i, answer="4" if i % 2 else "5") for i in range(6)]
    boom = rollout_group(99, answer="boom")
    v = codec.encode(good[0])[0]
    ok_header = [("schema", b"rollout_group/v1.0")]
    records = [(g.prompt_id, *codec.encode(g)) for g in good]
    bad = [
        ("undecodable", b"\xff\xfe\x00", ok_header, DLQReason.undecodable),
        ("v2", v, [("schema", b"rollout_group/v2.0")], DLQReason.major_version_mismatch),
        ("invalid", json.dumps({"prompt": {"prompt_id": ""}}).encode(), ok_header, DLQReason.validation_failed),
        ("oversize", b"x" * 300_000, ok_header, DLQReason.oversize),
        ("noheader", v, None, DLQReason.missing_schema_header),
        ("wrongschema", v, [("schema", b"prompt/v1.0")], DLQReason.wrong_schema),
        ("boom", *codec.encode(boom), DLQReason.scorer_error),  # the scorer raises (ed1d4a4)
    ]
    records += [(k, val, h) for k, val, h, _ in bad]
    produce_all(bootstrap, f"{prefix}rl.rollouts", records)

    svc = ServiceProc("reward", ["--bootstrap", bootstrap, "--topic-prefix", prefix, "--instance-id", "rt0",
                                 "--reward.server-url", reward_server,
                                 "--reward.scorer", "tests.helpers:failing_scorer", "--metrics-interval", "1",
                                 "--reward.max-record-bytes", "200000"],
                      tmp_path / "reward.log")
    try:
        svc.wait_ready()
        scored = decode_all(read_all(bootstrap, f"{prefix}rl.scored", expect=6), ScoredGroup)
        assert sorted(s.prompt_id for s in scored) == sorted(g.prompt_id for g in good)
        for s in scored:
            want = 1.0 if s.group.prompt.index % 2 else 0.0
            assert s.rewards == [want] and s.reward_source.value == "rule"
            assert s.scorer == "rule:tests.helpers:failing_scorer@1"

        dlq_msgs = read_all(bootstrap, f"{prefix}rl.dlq", expect=len(bad))
        assert all(codec.header_value(m.headers()) == DLQRecord.schema_header() for m in dlq_msgs)
        dlq = {m.key().decode(): codec.decode(m.value(), m.headers(), DLQRecord) for m in dlq_msgs}
        assert {k: r.reason for k, r in dlq.items()} == {k: reason for k, _, _, reason in bad}
        for key, _, _, reason in bad:
            rec = dlq[key]
            assert rec.reason == reason, (key, rec)
            assert rec.topic == f"{prefix}rl.rollouts" and rec.offset >= 0 and rec.stage == "reward/rt0"
        assert dlq["v2"].error == "expected rollout_group v1.x, got rollout_group/v2.0"
        assert dlq["oversize"].payload_size == 300_000 and not dlq["oversize"].payload_truncated
        assert "scorer exploded" in dlq["boom"].error

        # the stage survived all of it
        assert svc.proc.poll() is None
        assert httpx.get(f"{svc.url}/readyz").status_code == 200
        assert svc.metric("steadyrl_stage_dlq_records_total", {"reason": "oversize"}) == 1
        assert svc.metric("steadyrl_stage_records_total", {"outcome": "ok"}) == 6
        # consumer lag of a transactional stage: its producer commits the offsets, the stage
        # stores them, so librdkafka's statistics see the progress (regression: no series at all)
        deadline = time.monotonic() + 20
        while True:
            lag = [line for line in httpx.get(f"{svc.url}/metrics").text.splitlines()
                   if line.startswith("steadyrl_kafka_consumer_lag{") and f'topic="{prefix}rl.rollouts"' in line]
            if lag and sum(float(line.split()[-1]) for line in lag) == 0:
                break
            assert time.monotonic() < deadline, lag
            time.sleep(0.5)
    finally:
        assert svc.stop() == 0


def test_breaker_open_cache_scores_seen_prompts_and_holds_novel_ones_in_order(bootstrap, prefix, tmp_path):
    """Server healthy, then hanging: with the breaker open, groups whose prompt was scored
    before come out from the cache; a novel prompt is held, and so is everything after it in
    its partition (offsets are committed only up to it). When the server is back, the held
    groups are scored by the server. Every group comes out exactly once."""
    from confluent_kafka import Producer

    from tests.helpers import FakeRewardServer

    def produce(groups_by_partition):
        p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
        for part, groups in groups_by_partition.items():
            for g in groups:
                value, headers = codec.encode(g)
                p.produce(f"{prefix}rl.rollouts", value, key=g.prompt_id, headers=headers, partition=part)
        assert p.flush(30) == 0

    def g(pid, i, answer="4"):
        out = rollout_group(i, answer=answer, truth="4")
        out.prompt.prompt_id = pid
        return out

    server = FakeRewardServer("numeric_match")
    svc = ServiceProc("reward", ["--bootstrap", bootstrap, "--topic-prefix", prefix, "--instance-id", "hold0",
                                 "--reward.server-url", server.url, "--reward.scorer", "numeric_match",
                                 "--reward.timeout-s", "0.3", "--reward.retry-backoff-s", "0.2",
                                 "--reward.probe-interval-s", "0.2", "--reward.reset-timeout-s", "600",
                                 "--reward.failure-threshold", "1", "--reward.batch-size", "16"],
                      tmp_path / "reward.log")
    try:
        svc.wait_ready()
        produce({0: [g("seen-1", 1), g("seen-2", 2, answer="5")]})
        assert len(read_all(bootstrap, f"{prefix}rl.scored", expect=2)) == 2

        server.set("hang")
        novel = rollout_group(0)
        novel.prompt.prompt_id = "novel"
        novel.prompt.messages[0].content = "Quelle heure est-il a Montreal, en ce moment precis ?"
        produce({1: [g("again-1", 1)], 2: [novel, g("again-2-behind-novel", 2, answer="5")]})
        while_down = decode_all(read_all(bootstrap, f"{prefix}rl.scored", expect=3, settle_s=3), ScoredGroup)
        got = {s.prompt_id: s for s in while_down}
        assert set(got) == {"seen-1", "seen-2", "again-1"}, sorted(got)
        assert got["again-1"].reward_source.value == "cache" and got["again-1"].rewards == [1.0]
        assert got["again-1"].cache_similarity == 1.0
        assert svc.metric("steadyrl_stage_records_total", {"outcome": "held"}) >= 2

        server.set("ok")  # the probe half-opens the breaker; the trial call closes it
        final = decode_all(read_all(bootstrap, f"{prefix}rl.scored", expect=5, settle_s=3), ScoredGroup)
        ids = [s.prompt_id for s in final]
        assert sorted(ids) == sorted(["seen-1", "seen-2", "again-1", "novel", "again-2-behind-novel"])
        last = {s.prompt_id: s for s in final}
        assert last["novel"].reward_source.value == "rule" and last["novel"].rewards == [1.0]
        assert last["again-2-behind-novel"].reward_source.value == "rule"
        assert last["again-2-behind-novel"].rewards == [0.0]
        assert svc.metric("steadyrl_reward_breaker_state", {"state": "closed"}) == 1
    finally:
        assert svc.stop() == 0
        server.stop()


def test_a_stage_closed_with_its_transaction_open_aborts_it(bootstrap, prefix):
    """Regression: close() said it aborted an open transaction and did not. A stage that stops
    mid-transaction (found with a handler whose output could not be encoded, after one that was
    produced; such an output now goes to rl.dlq before the transaction, so here an error after
    the produce escapes instead) left that transaction open on the broker until
    transaction.timeout.ms (30 s): read_committed readers saw nothing of its output partition
    past it meanwhile. Now close() aborts it: its record is never visible, later records are at
    once, no offset is committed, and the next producer with its transactional.id starts at
    once."""
    import threading

    from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

    from steadyrl.bus.stage import Output, Stage
    from steadyrl.wire.contracts import RewardSource, RolloutGroup

    def handle(g, meta):
        scored = ScoredGroup(group=g, rewards=[1.0], reward_source=RewardSource.rule, scorer="test")
        return [Output("rl.scored", g.prompt_id, scored)]

    produce_all(bootstrap, f"{prefix}rl.rollouts", [(g.prompt_id, *codec.encode(g)) for g in [rollout_group(1)]])
    st = Stage(name="closing", bootstrap=bootstrap, topic_prefix=prefix, instance_id="c0", input_topic="rl.rollouts",
               input_contract=RolloutGroup, group_id=f"{prefix}closing", handle=handle)

    def bug(*a, **kw):  # after the produce, inside the transaction
        raise AttributeError("a bug between produce and commit")

    st.producer.send_offsets_to_transaction = bug
    failure: list[BaseException] = []

    def run():
        try:
            st.run(threading.Event())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            failure.append(e)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(60)
    assert not worker.is_alive() and failure and isinstance(failure[0], AttributeError), failure

    out = f"{prefix}rl.scored"
    plain = Producer({"bootstrap.servers": bootstrap})
    parts = list(plain.list_topics(out, timeout=10).topics[out].partitions)
    for p in parts:
        plain.produce(out, b"after", key=f"after-{p}", partition=p)
    assert plain.flush(30) == 0
    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{prefix}audit",
                       "isolation.level": "read_committed", "enable.auto.commit": False})
    reader.assign([TopicPartition(out, p, 0) for p in parts])
    seen, t0 = [], time.monotonic()
    try:
        while len(seen) < len(parts) and time.monotonic() - t0 < 10:
            seen += [m.key().decode() for m in reader.consume(100, timeout=0.2) if m.error() is None]
    finally:
        reader.close()
    # an open transaction holds back every read_committed reader of its partition (LSO)
    assert sorted(seen) == sorted(f"after-{p}" for p in parts), f"{seen} within {time.monotonic() - t0:.1f} s"

    group = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{prefix}closing"})
    try:
        inp = f"{prefix}rl.rollouts"
        in_parts = group.list_topics(inp, timeout=10).topics[inp].partitions
        committed = group.committed([TopicPartition(inp, p) for p in in_parts], timeout=10)
    finally:
        group.close()
    assert all(tp.offset < 0 for tp in committed), committed  # the input's offsets were never committed

    successor = Producer({"bootstrap.servers": bootstrap, "transactional.id": "steadyrl-closing-c0"})
    t0 = time.monotonic()
    try:
        successor.init_transactions(10)
    except KafkaException as e:
        raise AssertionError(f"the successor could not start: {e}") from e
    assert time.monotonic() - t0 < 5
