"""Regression tests for what the codec fuzzer (test_codec_fuzz.py) found in `codec.decode` and
`codec.encode` before issue 18: one plain test per bug, with the input that showed it (cut
to the part that matters). Before, each either escaped decode as another exception (a
stage, the actor's policy follower or the learner's intake crash-looped on the record) or
was accepted and then broke a consumer (NaN weights, a tensor overflow, an output a stage
could not write)."""

from __future__ import annotations

import json

import pytest

from steadyrl.wire import codec
from steadyrl.wire.contracts import (
    LOGPROB_MAX,
    LOGPROB_MIN,
    DLQReason,
    PolicyUpdate,
    Prompt,
    QuarantinedGroup,
    RolloutGroup,
    Sample,
    ScoredGroup,
)
from tests.helpers import rollout_group

RG = [("schema", b"rollout_group/v1.2")]
SG = [("schema", b"scored_group/v1.2")]
PU = [("schema", b"policy_update/v1.2")]


def _group_json(**changes) -> dict:
    obj = json.loads(rollout_group(1).model_dump_json())
    obj.update(changes)
    return obj


def _scored_json() -> dict:
    return json.loads(ScoredGroup(group=rollout_group(1), rewards=[1.0], reward_source="rule", scorer="x")
                      .model_dump_json())


def _policy_json() -> bytes:
    return PolicyUpdate(version=1, step=1, uri="r/v000001", sha256="0" * 64).model_dump_json().encode()


def _rejects(value, headers, contract=RolloutGroup) -> codec.Rejected:
    with pytest.raises(codec.Rejected) as exc:
        codec.decode(value, headers, contract)
    return exc.value


# ---------------------------------------------------------------- escaped decode before


@pytest.mark.parametrize("value", [
    b"[" * 5000 + b"]" * 5000,                                   # RecursionError (array)
    b'{"a":' * 5000 + b"1" + b"}" * 5000,                        # RecursionError (object)
    b"[" * 5000 + rollout_group(1).model_dump_json().encode() + b"]" * 5000,
])
def test_deep_nesting_is_undecodable_not_recursion_error(value):
    rej = _rejects(value, RG)
    assert rej.reason == DLQReason.undecodable and "recursion limit" in rej.detail


@pytest.mark.parametrize("value", [
    b'{"epoch": ' + b"9" * 5000 + b"}",                          # ValueError: Exceeds the limit (4300 digits)
    json.dumps(_group_json(policy_version=0)).replace('"policy_version": 0', '"policy_version": ' + "9" * 5000)
    .encode(),
])
def test_integer_past_4300_digits_is_undecodable_not_value_error(value):
    rej = _rejects(value, RG)
    assert rej.reason == DLQReason.undecodable and "number out of range" in rej.detail


def test_schema_major_of_5000_digits_is_malformed_not_value_error():
    rej = _rejects(b"{}", [("schema", b"rollout_group/v" + b"9" * 5000 + b".0")])
    assert rej.reason == DLQReason.missing_schema_header and "malformed" in rej.detail


@pytest.mark.parametrize("value,needle", [
    ("{}", "got str"),                                           # AttributeError: no attribute "decode"
    (7, "got int"),                                              # TypeError: object of type 'int' has no len()
    (1.5, "got float"),
    ([b"{}"], "got list"),
])
def test_value_that_is_not_bytes_is_undecodable(value, needle):
    rej = _rejects(value, RG)
    assert rej.reason == DLQReason.undecodable and needle in rej.detail


@pytest.mark.parametrize("view", [bytearray, memoryview])    # memoryview: AttributeError before
def test_bytes_like_values_decode(view):
    g = rollout_group(1)
    assert codec.decode(view(codec.encode(g)[0]), RG, RolloutGroup) == g


@pytest.mark.parametrize("headers", [
    {"schema": b"rollout_group/v1.2"},                           # ValueError: too many values to unpack
    [("schema",)],                                               # ValueError: not enough values to unpack
    [None],                                                      # TypeError: cannot unpack non-iterable NoneType
    5,                                                           # TypeError: 'int' object is not reversible
    object(),
    [("schema", 5)],                                             # AttributeError: no attribute "decode"
    [("schema", [b"rollout_group/v1.2"])],                       # AttributeError: 'list' object ...
])
def test_headers_of_the_wrong_shape_are_a_missing_header(headers):
    rej = _rejects(codec.encode(rollout_group(1))[0], headers)
    assert rej.reason == DLQReason.missing_schema_header


def test_a_str_header_value_is_read_as_text():
    g = rollout_group(1)   # AttributeError: 'str' object has no attribute 'decode' before
    assert codec.decode(codec.encode(g)[0], [("schema", "rollout_group/v1.2")], RolloutGroup) == g
    rej = _rejects(b"{}", [("schema", "rollout_group/v1.2\udc80")])
    assert rej.reason == DLQReason.missing_schema_header
    rej.detail.encode("utf-8")   # the lone surrogate is escaped: the DLQ record can be written


# ---------------------------------------------------------------- accepted before, and then broke a consumer


@pytest.mark.parametrize("value", [
    json.dumps(_group_json(samples=[{"text": "x", "token_ids": [1], "logprobs": [float("nan")]}])).encode(),
    json.dumps(_group_json(samples=[{"text": "x", "token_ids": [1], "logprobs": [float("-inf")]}])).encode(),
    json.dumps(_group_json(samples=[{"text": "x", "token_ids": [1], "logprobs": [0.0]}])).replace("0.0", "1e999")
    .encode(),                                                   # a literal that overflows to inf
    json.dumps(_group_json(samples=[{"text": "x", "token_ids": [1], "logprobs": ["nan"]}])).encode(),
    json.dumps(_group_json(prompt={**_group_json()["prompt"], "extra_info": {"w": float("nan")}})).encode(),
    json.dumps(_group_json(prompt={**_group_json()["prompt"], "extra_info": {"w": [0.0]}})).replace("[0.0]", "[1e999]")
    .encode(),
    json.dumps({**_group_json(), "added_in_1_7": float("nan")}).encode(),   # even in a field this reader ignores
])
def test_non_finite_log_probs_and_extras_are_refused(value):
    assert _rejects(value, RG).reason == DLQReason.non_finite


@pytest.mark.parametrize("change", [
    {"rewards": [float("nan")]}, {"rewards": [float("inf")]}, {"rewards": ["Infinity"]},
    {"reward_extra": [{"score": float("nan")}]}, {"cache_similarity": float("nan")},
])
def test_non_finite_rewards_are_refused(change):
    assert _rejects(json.dumps({**_scored_json(), **change}).encode(), SG, ScoredGroup).reason == DLQReason.non_finite


def test_non_finite_watch_figure_is_refused():
    qg = json.loads(QuarantinedGroup(batch_id="b", run_id="r", step=1, index=0, count=1, rules=["variance"],
                                     group=ScoredGroup.model_validate(_scored_json())).model_dump_json())
    rej = _rejects(json.dumps({**qg, "ks_pvalue": float("inf")}).encode(), [("schema", b"quarantined_group/v1.0")],
                   QuarantinedGroup)
    assert rej.reason == DLQReason.non_finite


# ---------------------------------------------------------------- issue 33: log-probs a model cannot produce


@pytest.mark.parametrize("logprob", [-1e30, -1.0000001e5, -1.7976931348623157e308, 0.0100001, 1.0, 1e30])
@pytest.mark.parametrize("contract", [RolloutGroup, ScoredGroup, QuarantinedGroup])
def test_a_logprob_out_of_range_is_a_dlq_record_naming_it(logprob, contract):
    """Finite, so it passed rollout_group 1.3; as a stale group's behaviour log-prob, -1e30
    made exp(logp - old_logp) inf and the learner's step NaN."""
    samples = [{"text": "x", "token_ids": [1, 2, 3], "logprobs": [-0.5, logprob, -0.1]}]
    value = json.dumps(_wrapped(contract, samples)).encode()
    rej = _rejects(value, [("schema", contract.schema_header().encode())], contract)
    assert rej.reason == DLQReason.validation_failed
    assert "samples.0.logprobs.1" in rej.detail
    rec = codec.dlq_record(rej, stage="learner", topic="rl.scored", partition=0, offset=7, key=b"k", value=value)
    assert rec.reason == DLQReason.validation_failed and "logprobs" in rec.error


@pytest.mark.parametrize("logprob", [-1e4, LOGPROB_MIN, -103.9, -5e-324, 0.0, 1.2e-7, 0.0078, LOGPROB_MAX])
@pytest.mark.parametrize("contract", [RolloutGroup, ScoredGroup, QuarantinedGroup])
@pytest.mark.parametrize("minor", ["1.2", "1.3", "current"])
def test_a_logprob_a_model_can_produce_decodes_in_every_minor(logprob, contract, minor):
    """-1e4 and rounding just above 0 pass, in records of this minor and of earlier ones."""
    samples = [{"text": "x", "token_ids": [1, 2], "logprobs": [logprob, -0.2]}]
    obj = _wrapped(contract, samples)
    header = contract.schema_header() if minor == "current" else f"{contract.SCHEMA_NAME}/v{minor}"
    got = codec.decode(json.dumps(obj).encode(), [("schema", header.encode())], contract)
    group = got if isinstance(got, RolloutGroup) else got.group if isinstance(got, ScoredGroup) else got.group.group
    assert group.samples[0].logprobs == [logprob, -0.2]


def _wrapped(contract, samples: list[dict]) -> dict:
    """A record of `contract` (rollout, scored or quarantined group) whose group has `samples`."""
    sg = _scored_json()
    sg["group"]["samples"] = samples
    sg["rewards"] = [1.0] * len(samples)
    if contract is RolloutGroup:
        return sg["group"]
    if contract is ScoredGroup:
        return sg
    return {"batch_id": "b", "run_id": "r", "step": 1, "index": 0, "count": 1, "rules": ["variance"], "group": sg}


@pytest.mark.parametrize("samples,prompt_ids", [
    ([{"text": "x", "token_ids": [-1], "logprobs": [0.0]}], []),
    ([{"text": "x", "token_ids": [-(2**31)], "logprobs": [0.0]}], []),
    ([{"text": "x", "token_ids": [2**63], "logprobs": [0.0]}], []),   # overflows torch.tensor (int64)
    ([{"text": "x", "token_ids": [1], "logprobs": [0.0]}], [-1]),
    ([{"text": "x", "token_ids": [1], "logprobs": [0.0]}], [2**31]),
])
def test_token_ids_out_of_range_are_refused(samples, prompt_ids):
    value = json.dumps(_group_json(samples=samples, prompt_token_ids=prompt_ids)).encode()
    rej = _rejects(value, RG)
    assert rej.reason == DLQReason.validation_failed and "token_ids" in rej.detail


@pytest.mark.parametrize("escape", [r'"\ud800"', r'"x\udfff"'])
def test_lone_surrogate_is_undecodable(escape):
    # Accepted before in a str field without constraints (a sample's text, a message); a stage
    # then failed to write its output (PydanticSerializationError: surrogates not allowed).
    value = json.dumps(_group_json()).replace('"The answer is 4"', escape).encode()
    rej = _rejects(value, RG)
    assert rej.reason == DLQReason.undecodable


def test_extra_info_nested_past_the_serializer_limit_is_refused():
    # 300 levels: accepted before, then the stage's encode of its output raised
    # "Maximum serialization depth exceeded".
    value = json.dumps(_group_json()).replace('"extra_info": {}', '"extra_info": {"a": ' + "[" * 300 + "]" * 300 + "}")
    rej = _rejects(value.encode(), RG)
    assert rej.reason == DLQReason.undecodable and "recursion limit" in rej.detail   # the parser's 200
    value = json.dumps(_group_json()).replace('"extra_info": {}', '"extra_info": {"a": ' + "[" * 70 + "]" * 70 + "}")
    rej = _rejects(value.encode(), RG)   # our MAX_DEPTH, 64, names the place
    assert rej.reason == DLQReason.undecodable
    assert rej.detail == "rollout_group/v1.6: nested deeper than 64 levels at prompt.extra_info.a" + "[0]" * 61


def test_policy_version_too_big_for_a_metric_is_refused():
    # 10**400 was accepted, and the actor's POLICY_VERSION.set(version) raised OverflowError.
    rej = _rejects(_policy_json().replace(b'"version":1', b'"version":1' + b"0" * 400), PU, PolicyUpdate)
    assert rej.reason == DLQReason.validation_failed and "version" in rej.detail


def test_policy_uri_with_nul_is_refused():
    # Accepted before; policy_files.resolve then raised ValueError (embedded null byte), which
    # the actor's follower does not catch (it catches PolicyRefused).
    rej = _rejects(_policy_json().replace(b'"r/v000001"', b'"r/v\\u0000"'), PU, PolicyUpdate)
    assert rej.reason == DLQReason.validation_failed and "uri" in rej.detail


@pytest.mark.parametrize("header", ["rollout_group/v\u0661.2".encode(), b"rollout_group/v1.2\n"])
def test_header_with_arabic_digit_or_newline_is_malformed(header):
    # \d took "١" (int("١") == 1) and "$" let a "\n" follow: both were accepted.
    assert _rejects(codec.encode(rollout_group(1))[0], [("schema", header)]).reason == \
        DLQReason.missing_schema_header


def test_dlq_record_of_a_huge_header_fits_rl_dlq():
    # The whole header went into detail and schema_seen: a 2 MiB header made a 4 MiB DLQ record,
    # which rl.dlq (1 MiB) refuses.
    rej = _rejects(b"{}", [("schema", b"v" * (2 * 1024 * 1024))])
    rec = codec.dlq_record(rej, stage="s", topic="t", partition=0, offset=0, key=b"k", value=b"{}")
    assert len(codec.encode(rec)[0]) < 10_000


# ---------------------------------------------------------------- encode


def test_encode_refuses_nan_and_names_the_field():
    g = rollout_group(1)
    g.samples[0].logprobs[1] = float("nan")   # wrote "logprobs":[-0.1,null] before
    with pytest.raises(ValueError, match=r"rollout_group/v1.6: cannot encode a non-finite number: "
                                         r"samples\[0\]\.logprobs\[1\] = nan"):
        codec.encode(g)


def test_encode_refuses_infinity_in_a_free_form_field():
    s = ScoredGroup(group=rollout_group(1), rewards=[1.0], reward_source="rule", scorer="x",
                    reward_extra=[{"sim": [0.5, float("inf")]}])
    with pytest.raises(ValueError, match=r"reward_extra\[0\]\.sim\[1\] = inf"):
        codec.encode(s)


def test_encode_refuses_a_model_built_without_validation():
    s = ScoredGroup.model_construct(group=rollout_group(1), rewards=[float("-inf")], reward_source="rule", scorer="x")
    with pytest.raises(ValueError, match=r"rewards\[0\] = -inf"):
        codec.encode(s)


def test_constructing_a_contract_with_nan_raises_naming_the_field():
    with pytest.raises(ValueError, match=r"logprobs\.0\s+Input should be a finite number"):
        Sample(text="x", token_ids=[1], logprobs=[float("nan")])


def test_encode_of_a_lone_surrogate_is_a_value_error():
    g = rollout_group(1)
    g.samples[0].text = "\ud800"
    with pytest.raises(ValueError, match="rollout_group/v1.6: cannot encode"):
        codec.encode(g)


# ---------------------------------------------------------------- what stays accepted


def test_nan_as_text_is_not_a_number():
    g = rollout_group(1)
    g.samples[0].text = "NaN or Infinity"
    g.prompt.extra_info = {"note": "NaN", "Infinity": 1}
    assert codec.decode(*codec.encode(g), RolloutGroup) == g


def test_largest_allowed_values_round_trip():
    p = Prompt(prompt_id="p", epoch=2**63 - 1, index=0, messages=[{"role": "user", "content": "x"}], n_samples=1024,
               seed=2**80, created_ms=-(2**63))
    g = RolloutGroup(prompt=p, prompt_token_ids=[0, 2**31 - 1],
                     samples=[Sample(text="", token_ids=[2**31 - 1, 0], logprobs=[LOGPROB_MIN, LOGPROB_MAX])],
                     policy_version=2**63 - 1)
    assert codec.decode(*codec.encode(g), RolloutGroup) == g


def test_quarantined_group_index_must_be_below_count():
    with pytest.raises(ValueError, match="index 2 is not below count 2"):
        QuarantinedGroup(batch_id="b", run_id="r", step=1, index=2, count=2, rules=["variance"],
                         group=ScoredGroup.model_validate(_scored_json()))
