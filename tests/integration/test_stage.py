"""The reward worker as a real transactional stage against the real broker."""

import json

import httpx

from steadyrl import codec
from steadyrl.contracts import DLQRecord, DLQReason, ScoredGroup
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
        ("boom", *codec.encode(boom), DLQReason.handler_error),  # the scorer raises
    ]
    records += [(k, val, h) for k, val, h, _ in bad]
    produce_all(bootstrap, f"{prefix}rl.rollouts", records)

    svc = ServiceProc("reward", ["--bootstrap", bootstrap, "--topic-prefix", prefix, "--instance-id", "rt0",
                                 "--reward.server-url", reward_server, "--reward.scorer", "tests.helpers:failing_scorer", "--metrics-interval", "1",
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
        assert all(codec.header_value(m.headers()) == "dlq_record/v1.0" for m in dlq_msgs)
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
    finally:
        assert svc.stop() == 0
