import json

import jsonschema
import pytest

from steadyrl.wire import codec
from steadyrl.wire.contracts import ALL_CONTRACTS, DLQReason, DLQRecord, Prompt, RolloutGroup, ScoredGroup
from steadyrl.wire.schemas import check_schemas, json_schema, schema_path
from tests.helpers import rollout_group


def test_checked_in_schemas_match_models():
    assert check_schemas() == []


@pytest.mark.parametrize("contract", ALL_CONTRACTS, ids=lambda c: c.SCHEMA_NAME)
def test_schema_file_is_valid_json_schema(contract):
    schema = json.loads(schema_path(contract).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$id"] == contract.schema_header()


def test_instance_validates_against_checked_in_schema():
    g = rollout_group(3)
    schema = json.loads(schema_path(RolloutGroup).read_text())
    jsonschema.validate(json.loads(g.model_dump_json()), schema)
    bad = json.loads(g.model_dump_json())
    bad["samples"] = []
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_round_trip_sets_schema_header():
    g = rollout_group(7)
    value, headers = codec.encode(g)
    assert headers == [("schema", b"rollout_group/v1.6")]
    assert codec.decode(value, headers, RolloutGroup) == g


def test_minor_version_is_accepted_and_unknown_fields_ignored():
    g = rollout_group(1)
    obj = json.loads(g.model_dump_json())
    obj["added_in_1_7"] = "x"
    got = codec.decode(json.dumps(obj).encode(), [("schema", b"rollout_group/v1.7")], RolloutGroup)
    assert got == g


@pytest.mark.parametrize("value,headers,reason,needle", [
    (b"\xff\xfe not json", [("schema", b"rollout_group/v1.0")], DLQReason.undecodable, "not UTF-8 JSON"),
    (b"{}", None, DLQReason.missing_schema_header, "got none"),
    (b"{}", [("schema", b"garbage")], DLQReason.missing_schema_header, "malformed"),
    (b"{}", [("schema", b"prompt/v1.0")], DLQReason.wrong_schema, "expected rollout_group/v1.6, got prompt/v1.0"),
    (b"{}", [("schema", b"rollout_group/v2.0")], DLQReason.major_version_mismatch,
     "expected rollout_group v1.x, got rollout_group/v2.0"),
    (b'{"prompt": 1}', [("schema", b"rollout_group/v1.0")], DLQReason.validation_failed, "prompt"),
    (b"x" * 2000, [("schema", b"rollout_group/v1.0")], DLQReason.oversize, "2000 bytes, limit is 1024"),
])
def test_each_bad_record_is_rejected_with_its_reason(value, headers, reason, needle):
    with pytest.raises(codec.Rejected) as exc:
        codec.decode(value, headers, RolloutGroup, max_bytes=1024)
    assert exc.value.reason == reason
    assert needle in exc.value.detail


def test_dlq_record_truncates_large_payloads_but_keeps_size_and_hash():
    payload = b"a" * (codec.DLQ_PAYLOAD_LIMIT + 10)
    rej = codec.Rejected(DLQReason.oversize, "too big")
    rec = codec.dlq_record(rej, stage="s", topic="t", partition=2, offset=9, key=b"k", value=payload)
    assert rec.payload_truncated and rec.payload_size == len(payload)
    assert len(codec.encode(rec)[0]) < 1024 * 1024  # fits rl.dlq's max.message.bytes


def test_sample_lengths_must_agree():
    with pytest.raises(ValueError, match="token_ids has 2 entries but logprobs has 1"):
        RolloutGroup.model_validate({**json.loads(rollout_group(1).model_dump_json()),
                                     "samples": [{"text": "x", "token_ids": [1, 2], "logprobs": [0.0]}]})


def test_scored_group_needs_one_reward_per_sample():
    with pytest.raises(ValueError, match="2 rewards for 1 samples"):
        ScoredGroup(group=rollout_group(1), rewards=[1.0, 0.0], reward_source="rule", scorer="x")


def test_prompt_json_schema_has_version():
    assert json_schema(Prompt)["x-schema-version"] == "1.4"


@pytest.mark.parametrize("engine", ["vllm", "torch", ""])
def test_engine_round_trips_through_rollout_and_scored_groups(engine):
    g = rollout_group(2).model_copy(update={"engine": engine})
    value, headers = codec.encode(g)
    assert codec.decode(value, headers, RolloutGroup).engine == engine
    sg = ScoredGroup(group=g, rewards=[1.0], reward_source="rule", scorer="x")
    value, headers = codec.encode(sg)
    assert headers == [("schema", b"scored_group/v1.6")]
    assert codec.decode(value, headers, ScoredGroup).group.engine == engine


def test_a_record_of_an_older_worker_without_engine_reads_as_unknown():
    g = rollout_group(1)
    obj = json.loads(g.model_dump_json())
    del obj["engine"]                                   # rollout_group 1.2 had no engine
    got = codec.decode(json.dumps(obj).encode(), [("schema", b"rollout_group/v1.2")], RolloutGroup)
    assert got.engine == "" and got == g
    sg = json.loads(ScoredGroup(group=g, rewards=[1.0], reward_source="rule", scorer="x").model_dump_json())
    del sg["group"]["engine"]
    assert codec.decode(json.dumps(sg).encode(), [("schema", b"scored_group/v1.2")], ScoredGroup).group.engine == ""


def test_engine_is_bounded():
    with pytest.raises(ValueError, match="at most 64 characters"):
        RolloutGroup.model_validate({**json.loads(rollout_group(1).model_dump_json()), "engine": "x" * 65})


def test_records_of_before_the_attempt_decode_with_none():
    """Issue 46: prompt 1.3 and dlq_record 1.4 add `attempt`, optional: a record of the minors
    before (today's writers, a run in flight during an upgrade) decodes, with attempt None."""
    p = json.loads(rollout_group(1).prompt.model_dump_json(exclude={"attempt"}))
    assert "attempt" not in p
    assert codec.decode(json.dumps(p).encode(), [("schema", b"prompt/v1.2")], Prompt).attempt is None
    rec = codec.dlq_record(codec.Rejected(DLQReason.handler_error, "x"), stage="s", topic="t", partition=0, offset=1,
                           key=b"k", value=b"{}")
    old = json.loads(rec.model_dump_json(exclude={"attempt"}))
    assert codec.decode(json.dumps(old).encode(), [("schema", b"dlq_record/v1.3")], DLQRecord).attempt is None


@pytest.mark.parametrize("wrap", [lambda p: p, lambda p: {"prompt": p}, lambda p: {"group": {"prompt": p}}],
                         ids=["prompt", "rollout_group", "scored_group"])
def test_a_dlq_record_carries_the_attempt_of_the_prompt_it_refuses(wrap):
    p = json.loads(rollout_group(1).prompt.model_copy(update={"attempt": 3}).model_dump_json())
    rec = codec.dlq_record(codec.Rejected(DLQReason.handler_error, "x"), stage="s", topic="t", partition=0, offset=1,
                           key=b"k", value=json.dumps(wrap(p)).encode())
    assert rec.attempt == 3


@pytest.mark.parametrize("value", [None, b"", b"\xff", b"[" * 5000, b'{"attempt": 3}', b'{"prompt": {"attempt": 3}}',
                                   b'{"prompt_id": "a", "messages": [], "attempt": true}',
                                   b'{"prompt_id": "a", "messages": [], "attempt": -1}',
                                   b'{"prompt_id": "a", "messages": [], "attempt": 1e3}'])
def test_a_dlq_record_of_what_holds_no_readable_attempt_has_none(value):
    rec = codec.dlq_record(codec.Rejected(DLQReason.undecodable, "x"), stage="s", topic="t", partition=0, offset=1,
                           key=b"k", value=value)
    assert rec.attempt is None


def test_a_one_turn_sample_is_written_as_before_the_episode_fields():
    """rollout_group 1.6 added loss_mask and turn_versions for agent episodes; a one-turn sample
    (both None) is written byte for byte as 1.5 wrote it, and an episode's sample keeps both."""
    from steadyrl.wire.contracts import Sample

    one = Sample(text="a", token_ids=[3], logprobs=[-0.5])
    assert one.model_dump_json() == '{"text":"a","token_ids":[3],"logprobs":[-0.5],"finish_reason":"stop"}'
    episode = Sample(text="a", token_ids=[3, 4], logprobs=[-0.5, 0.0], loss_mask=[1, 0], turn_versions=[2])
    assert episode.model_dump()["loss_mask"] == [1, 0] and episode.model_dump()["turn_versions"] == [2]
