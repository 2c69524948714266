"""Model-dependent checks of a group (tokens.TokenLimits): token ids outside the vocabulary,
prompt + response above the context length, an empty prompt. A bad group goes to rl.dlq with
reason invalid_tokens and a message naming the id or length and the limit; reading that
record back publishes the prompt again (same id, a new seed). Nothing a record holds stops
the learner."""

import re

import pytest

from steadyrl.model.models import load_policy
from steadyrl.services.learner.tokens import TokenLimits
from steadyrl.wire.contracts import DLQReason, DLQRecord
from tests.services.learner.conftest import Msg, scored


def test_the_tiny_models_limits_are_its_embedding_rows_and_max_position_embeddings():
    model, tok = load_policy("tiny")
    limits = TokenLimits.of(model, tok)
    assert limits.vocab_size == model.get_input_embeddings().weight.shape[0] == len(tok)
    assert (limits.context, limits.context_from) == (128, "max_position_embeddings")  # the tokenizer names none
    tok.model_max_length = 64
    assert TokenLimits.of(model, tok).context == 64           # the smaller of the two applies


@pytest.mark.parametrize("prompt_ids, responses, message", [
    ([5, 6, 99], None, r"prompt_token_ids\[2\] = 99 is outside the vocabulary \[0, 46\)"),
    ([5, 6], [[7, 8], [9, 46]], r"samples\[1\]\.token_ids\[1\] = 46 is outside the vocabulary \[0, 46\)"),
    ([5] * 100, [[7] * 20, [8] * 29], r"samples\[1\]: prompt 100 \+ response 29 = 129 tokens > context length 128 "
                                       r"\(max_position_embeddings\)"),
    ([], None, r"prompt_token_ids is empty"),
])
def test_a_group_the_model_cannot_take_goes_to_the_dlq_and_its_prompt_goes_out_again(
        make_learner, prompt_ids, responses, message):
    lrn = make_learner()
    st, intake = lrn.state, lrn.intake
    assert lrn.feeder.top_up() == 4
    pid = next(iter(st.in_flight))
    seed0 = lrn.outbox.on("rl.prompts")[0][1].seed
    intake.accept(Msg(scored(st, pid, prompt_ids=prompt_ids, responses=responses), pid, offset=7))
    assert pid not in intake.ready and st.offsets["0"] == 8 and st.counts["rejected"] == 1
    (key, rec), = lrn.outbox.on("rl.dlq")
    assert key == pid and isinstance(rec, DLQRecord) and rec.reason == DLQReason.invalid_tokens
    assert rec.error.startswith(f"{pid}: ") and rec.stage == "learner/0" and rec.offset == 7
    assert re.search(message, rec.error), rec.error
    assert lrn.outbox.flushes >= 2                                # flushed before the offset past it is saved

    # read back from rl.dlq: the same prompt is published again, attempt 1 (a new seed), once
    intake.dead_letter(Msg(rec, pid, offset=0, topic="rl.dlq"))
    intake.dead_letter(Msg(rec, pid, offset=1, topic="rl.dlq"))   # the same record twice: queued already
    assert st.in_flight[pid].attempt == 1 and st.requeue == [pid] and st.counts["dlq"] == 1
    intake.retry_at[pid] = 0.0                                    # its backoff (1 s) has passed
    assert lrn.feeder.top_up() == 1
    again = lrn.outbox.on("rl.prompts")[-1]
    assert again[0] == pid and again[1].seed == seed0 + 7919 and st.fed == 4
    intake.accept(Msg(scored(st, pid), pid, offset=8))            # the new sample is fine: it waits
    assert pid in intake.ready


def test_a_negative_id_is_outside_the_vocabulary_too():
    """The contracts refuse negative ids (TokenId) before the learner sees them; the learner's
    check does not count on it (a group built in-process, or a reader of an older minor)."""
    from steadyrl.wire.contracts import Prompt, RewardSource, RolloutGroup, Sample, ScoredGroup

    p = Prompt(prompt_id="r/e0-i1", epoch=0, index=1, messages=[{"role": "user", "content": "3"}], n_samples=1)
    sample = Sample.model_construct(text="x", token_ids=[4, -1], logprobs=[-1.0, -1.0], finish_reason="stop")
    g = RolloutGroup.model_construct(prompt=p, prompt_token_ids=[5], samples=[sample], policy_version=0)
    sg = ScoredGroup.model_construct(group=g, rewards=[1.0], reward_source=RewardSource.rule, scorer="t")
    assert TokenLimits(46, 128, "max_position_embeddings").violation(sg) == (
        "samples[0].token_ids[1] = -1 is outside the vocabulary [0, 46) (the model's embedding rows)")


def test_a_released_copy_the_model_cannot_take_stays_held(make_learner):
    from steadyrl.run.quarantine import RELEASE_HEADER

    lrn = make_learner()
    st = lrn.state
    lrn.feeder.top_up()
    pid = next(iter(st.in_flight))
    bad = scored(st, pid, prompt_ids=[5, 500])
    lrn.screen.quarantine([pid], {pid: type("R", (), {"group": bad})()}, ["variance"], {})
    msg = Msg(bad, pid, offset=3, topic="rl.releases")
    msg._h = msg._h + [(RELEASE_HEADER, b"r/q1-x")]
    lrn.intake.accept(msg, releases=True)
    assert pid in st.quarantined and pid not in st.in_flight and lrn.intake.ready == {}
    assert "released" not in st.counts and lrn.outbox.on("rl.dlq")[0][1].reason == DLQReason.invalid_tokens
    lrn.intake.dead_letter(Msg(lrn.outbox.on("rl.dlq")[0][1], pid, topic="rl.dlq"))   # not in flight: nothing
    assert st.requeue == [] and "dlq" not in st.counts


def test_valid_groups_of_every_size_within_the_limits_wait(make_learner):
    lrn = make_learner()
    st = lrn.state
    lrn.feeder.top_up()
    a, b = list(st.in_flight)[:2]
    lrn.intake.accept(Msg(scored(st, a, prompt_ids=[45] * 100, responses=[[0] * 28]), a))   # 128: the limit
    lrn.intake.accept(Msg(scored(st, b, responses=[[]]), b, offset=1))                      # an empty response
    assert set(lrn.intake.ready) == {a, b} and lrn.outbox.on("rl.dlq") == []


def test_records_the_codec_refuses_go_to_the_dlq_and_cost_their_key_nothing(make_learner):
    """Issue 46: a record the codec refuses names no attempt (nothing in it can be read), so its
    DLQ record, read back, does not count as a refusal of the prompt its key names: anyone who
    may write rl.scored could otherwise cost any prompt a generation with garbage. The prompt
    still waits for its group (or goes out again once overdue)."""
    lrn = make_learner()
    st = lrn.state
    lrn.feeder.top_up()
    pid = next(iter(st.in_flight))
    lrn.intake.accept(Msg(b'{"not": "a group"', pid, offset=4, headers=[("schema", b"scored_group/v1.1")]))
    (key, rec), = lrn.outbox.on("rl.dlq")
    assert key == pid and rec.reason == DLQReason.undecodable and st.counts["rejected"] == 1 and rec.attempt is None
    lrn.intake.dead_letter(Msg(rec, pid, topic="rl.dlq"))
    assert st.requeue == [] and st.in_flight[pid].attempt == 0 and st.counts["dlq_ignored"] == 1
