"""Agents (steadyrl/model/agents.py, services/rollout/episodes.py): tool schemas, tool-call parsing,
the token ids, masks and log-probs of a multi-turn trajectory, and that earlier turns are never
re-tokenized. The actor is an httpx.MockTransport here (unit level); the real one is in
tests/integration/test_episodes.py."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from steadyrl.model import agent_metrics, agents
from steadyrl.model.models import tiny_tokenizer
from steadyrl.services.rollout.episodes import AgentSection, EpisodeRunner, make_episode_handler
from steadyrl.wire.codec import Rejected
from steadyrl.wire.contracts import DLQReason, Prompt, RolloutGroup


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def sleepy(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


def test_schema_comes_from_the_signature_and_docstring():
    s = agents.tool_schema(add)
    assert s["function"]["name"] == "add" and s["function"]["description"] == "Add two integers."
    assert s["function"]["parameters"] == {"type": "object", "required": ["a", "b"], "properties": {
        "a": {"type": "integer", "description": "The first."}, "b": {"type": "integer", "description": "The second."}}}

    def untyped(x):
        """No types."""
    with pytest.raises(ValueError, match="untyped"):
        agents.tool_schema(untyped)


def test_tool_calls_are_parsed_and_each_bad_one_says_why():
    tools = {"add": add}
    text = ('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
            "<tool_call>{not json}</tool_call>"
            '<tool_call>{"name": "mul", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 1, "c": 2}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>')
    good, malformed, unknown, bad_args, not_object = agents.parse_tool_calls(text, tools)
    assert (good.name, good.arguments, good.error) == ("add", {"a": 2, "b": 3}, None)
    assert malformed.error.startswith("error: the tool call is not JSON")
    assert unknown.error == "error: no tool 'mul'; the tools are add"
    assert bad_args.error.startswith("error: bad arguments for add:") and "'b'" in bad_args.error
    assert not_object.error == "error: the arguments of add must be a JSON object"
    assert agents.parse_tool_calls("the answer is 5", tools) == []


def test_a_tool_that_raises_or_hangs_costs_its_call_only():
    assert agents.run_tool(add, {"a": 2, "b": 3}, 1.0) == ("5", "ok")
    text, outcome = agents.run_tool(add, {"a": 2, "b": "x"}, 1.0)
    assert outcome == "error" and text.startswith("error: TypeError")
    t0 = time.monotonic()
    assert agents.run_tool(sleepy, {"seconds": 30}, 0.2) == ("error: the tool did not answer within 0.2 s", "timeout")
    assert time.monotonic() - t0 < 2


def test_tool_env_offers_the_tools_and_answers_calls_with_tool_messages():
    env = agents.ToolEnv({"add": add})
    first = env.reset({"messages": [{"role": "user", "content": "2+3?"}]})
    assert first[0]["role"] == "system" and "<tools>" in first[0]["content"] and '"name": "add"' in first[0]["content"]
    new, reward, done = env.step([*first, {"role": "assistant",
                                           "content": '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}'
                                                      "</tool_call>"}])
    assert (new, reward, done) == ([{"role": "tool", "name": "add", "content": "5"}], None, False)
    assert env.step([*first, {"role": "assistant", "content": "5"}]) == ([], None, True)


class Never:
    """An environment that never accepts an answer (stateless)."""

    def reset(self, row):
        return row["messages"]

    def step(self, messages):
        return [{"role": "user", "content": "no"}], 0.0, False


class FakeActor:
    """POST /generate: each prompt gets `reply` (ids, log-probs); the policy version goes up by
    one a call. Keeps the prompt ids it was sent."""

    def __init__(self, tok, reply: list[int], logprobs: list[float]):
        self.tok, self.reply, self.logprobs, self.version, self.sent = tok, reply, logprobs, 0, []
        self.max_new: list[int] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.version += 1
        self.sent.append([p["prompt_ids"] for p in body["prompts"]])
        self.max_new.append(body["max_new_tokens"])
        comp = {"token_ids": self.reply, "logprobs": self.logprobs, "finish_reason": "stop",
                "text": self.tok.decode(self.reply, skip_special_tokens=True)}
        return httpx.Response(200, json={"policy_version": self.version, "engine": "torch",
                                         "prompt_ids": [p["prompt_ids"] for p in body["prompts"]],
                                         "completions": [[comp] for _ in body["prompts"]]})


def _runner(tok, actor, factory, max_turns=3, max_episode_tokens=4096, **agent):
    a = AgentSection(env="tests.steadyrl.test_agents:Never", model="tiny", max_turns=max_turns,
                     max_episode_tokens=max_episode_tokens, **agent)
    client = httpx.Client(transport=httpx.MockTransport(actor))
    return EpisodeRunner(a, "http://actor", client, 5.0, 0.1, tok=tok, factory=factory)


def _prompt(n=2):
    return Prompt(prompt_id="r/e0-i0", epoch=0, index=0, n_samples=n, messages=[{"role": "user", "content": "7"}],
                  ground_truth="7", seed=11, max_new_tokens=4)


def test_a_three_turn_trajectory_has_mask_1_and_log_probs_on_model_tokens_only():
    tok = tiny_tokenizer()
    ids = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    reply = ids("ab") + [tok.eos_token_id]
    actor = FakeActor(tok, reply, [-0.5, -0.25, -0.125])
    handle = make_episode_handler(_runner(tok, actor, Never, max_turns=3))
    record = _prompt()
    outs = []
    for _ in range(3):   # one record in, one record out, as the stage does
        [out] = handle([(record, None)])
        [o] = out
        outs.append(o.topic)
        record = o.value
    assert outs == ["rl.episodes", "rl.episodes", "rl.rollouts"]
    g = record
    assert isinstance(g, RolloutGroup) and len(g.samples) == 2
    no = ids("no:")   # the environment's message after an assistant turn, the next turn opened
    assert g.prompt_token_ids == ids("7:")
    s = g.samples[0]
    assert s.token_ids == reply + no + reply + no + reply
    assert s.loss_mask == [1, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1]
    assert s.logprobs == [-0.5, -0.25, -0.125, 0, 0, 0] * 2 + [-0.5, -0.25, -0.125]
    assert s.turn_versions == [1, 2, 3] and g.policy_version == 1 and g.engine == "torch"
    assert s.text == "ab"
    # each turn continued from the stored ids: turn k's prompt is turn k-1's prompt + what came since
    assert actor.sent[1][0] == ids("7:") + reply + no and actor.sent[2][0] == actor.sent[1][0] + reply + no


def test_stored_ids_survive_where_re_tokenizing_the_conversation_would_change_them():
    """A BPE tokenizer merges "a" "b" into "ab": the model sampled "a" then "b" (two tokens);
    the conversation's text tokenized again gives one token. The trajectory keeps the sampled
    two, and the next turn's prompt holds them too."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4, "ab": 5, "7": 6, ":": 7, "n": 8, "o": 9}
    core = Tokenizer(models.BPE(vocab, [("a", "b")], unk_token=None))
    core.pre_tokenizer = pre_tokenizers.Split("7", behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ ':' }}{% endif %}")
    sampled = [3, 4, 2]                                   # "a", "b", </s>
    assert tok.encode("ab", add_special_tokens=False) == [5]   # what re-tokenizing gives
    actor = FakeActor(tok, sampled, [-1.0, -1.0, -0.5])
    handle = make_episode_handler(_runner(tok, actor, Never, max_turns=2))
    [[o]] = handle([(_prompt(n=1), None)])
    [[o]] = handle([(o.value, None)])
    s = o.value.samples[0]
    assert s.token_ids[:3] == sampled and 5 not in s.token_ids
    assert actor.sent[1][0][:len(o.value.prompt_token_ids) + 3] == o.value.prompt_token_ids + sampled
    rendered = tok.apply_chat_template([{"role": "user", "content": "7"}, {"role": "assistant", "content": "ab"}],
                                       tokenize=True)
    rendered = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    assert 5 in rendered   # the drift ours avoids


def test_an_episode_stops_at_its_token_budget():
    tok = tiny_tokenizer()
    reply = tok.encode("abc", add_special_tokens=False)
    actor = FakeActor(tok, reply, [-0.1] * 3)
    handle = make_episode_handler(_runner(tok, actor, Never, max_turns=10, max_episode_tokens=9))
    [[o]] = handle([(_prompt(n=1), None)])   # 2 prompt + 3 + "no:" 3 = 8: room for a turn of 1
    assert o.topic == "rl.episodes"
    [[o]] = handle([(o.value, None)])
    assert o.topic == "rl.rollouts"
    assert actor.max_new == [4, 1]   # the prompt's max_new_tokens, then what the budget leaves


def test_a_handler_call_repeated_on_the_same_record_runs_the_same_turn():
    """The stage calls the handler again (each record alone) when a batch call raises: the
    record must not carry the first call's turn."""
    tok = tiny_tokenizer()
    actor = FakeActor(tok, tok.encode("a", add_special_tokens=False), [-0.1])
    handle = make_episode_handler(_runner(tok, actor, Never, max_turns=5))
    [[o]] = handle([(_prompt(n=1), None)])
    state = o.value
    [[a]] = handle([(state, None)])
    [[b]] = handle([(state, None)])
    assert state.turn == 1 and a.value.turn == b.value.turn == 2
    assert len(a.value.episodes[0].token_ids) == len(b.value.episodes[0].token_ids)


def test_a_bad_tools_or_env_setting_is_refused_at_start_naming_it(tmp_path, monkeypatch):
    from pydantic import ValidationError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("def calc(x):\n    return x\n")
    with pytest.raises(ValidationError, match="tool 'calc'"):
        AgentSection(tools="t.py:calc", model="tiny")
    with pytest.raises(ValidationError, match="environment 't.py:Nope' not found"):
        AgentSection(env="t.py:Nope", model="tiny")
    with pytest.raises(ValidationError, match="has no reset or step method"):
        AgentSection(env="t.py:calc", model="tiny")


class Raises(Never):
    def step(self, messages):
        raise KeyError("boom")


class RaisesOnReset(Never):
    def reset(self, row):
        raise SystemExit(3)


class HangsOnStep(Never):
    def step(self, messages):
        time.sleep(30)


class HangsOnReset(Never):
    def reset(self, row):
        time.sleep(30)


def test_an_environment_that_raises_sends_its_group_to_the_dlq_naming_it():
    tok = tiny_tokenizer()
    actor = FakeActor(tok, tok.encode("a", add_special_tokens=False), [-0.1])
    handle = make_episode_handler(_runner(tok, actor, Raises))
    [r] = handle([(_prompt(n=2), None)])
    assert isinstance(r, Rejected) and r.reason == DLQReason.handler_error
    assert r.detail == ("environment tests.steadyrl.test_agents:Never: step at turn 1 raised KeyError: 'boom'")
    [r] = make_episode_handler(_runner(tok, actor, RaisesOnReset))([(_prompt(n=2), None)])
    assert isinstance(r, Rejected) and "reset raised RuntimeError: SystemExit: 3" in r.detail


@pytest.mark.parametrize("env", [HangsOnStep, HangsOnReset])
def test_an_environment_that_hangs_costs_env_timeout_s_and_its_group_only(env):
    """Regression: reset/step had no deadline; a hanging class stalled the worker for good
    (its handler loop beats /livez while it waits)."""
    tok = tiny_tokenizer()
    actor = FakeActor(tok, tok.encode("a", add_special_tokens=False), [-0.1])
    handle = make_episode_handler(_runner(tok, actor, env, env_timeout_s=0.3))
    t0 = time.monotonic()
    [r] = handle([(_prompt(n=2), None)])
    assert time.monotonic() - t0 < 3
    assert isinstance(r, Rejected) and r.reason == DLQReason.handler_error
    assert r.detail.startswith("environment tests.steadyrl.test_agents:Never: ")
    assert r.detail.endswith("did not answer within 0.3 s")


def test_tools_run_in_an_episode_and_their_results_come_back_as_tool_messages(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text(
        'def add(a: int, b: int) -> int:\n    """Add.\n\n    Args:\n        a: a.\n        b: b.\n    """\n'
        "    return a + b\n")
    tok = tiny_tokenizer()
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'

    def actor(request):
        body = json.loads(request.content)
        comp = {"token_ids": [5, 2], "logprobs": [-0.5, -0.1], "finish_reason": "stop", "text": call}
        return httpx.Response(200, json={"policy_version": 0, "engine": "torch", "prompt_ids": [],
                                         "completions": [[comp] for _ in body["prompts"]]})

    a = AgentSection(tools="t.py:add", model="tiny", max_turns=2)
    runner = EpisodeRunner(a, "http://actor", httpx.Client(transport=httpx.MockTransport(actor)), 5.0, 0.1, tok=tok)
    [[o]] = make_episode_handler(runner)([(_prompt(n=1), None)])
    ep = o.value.episodes[0]
    assert ep.messages[0].role == "system" and "<tools>" in ep.messages[0].content
    assert [(m.role, m.name, m.content) for m in ep.messages[-2:]] == [("assistant", None, call), ("tool", "add", "5")]
    assert ep.token_ids == [5, 2] + tok.encode("5:", add_special_tokens=False) and ep.loss_mask == [1, 1, 0, 0]


def test_a_one_turn_prompt_is_written_as_before_the_tool_role():
    """Regression: ChatMessage.name (prompt 1.4) as `"name": null` in every message made the
    single-turn worker's /generate body invalid (the actor's messages are string maps: 422)."""
    from steadyrl.wire import codec

    value, _ = codec.encode(_prompt())
    assert b'"messages":[{"role":"user","content":"7"}]' in value
    assert _prompt().messages[0].model_dump() == {"role": "user", "content": "7"}


def test_an_actor_refusal_of_one_group_does_not_dead_letter_the_groups_batched_with_it():
    """Regression: the refusal of a /generate call went to every group in it; now the call is
    made again per group, as the one-turn worker does per prompt."""
    tok = tiny_tokenizer()
    good = FakeActor(tok, tok.encode("a", add_special_tokens=False), [-0.1])
    bad_ids = agents.prompt_ids(tok, [{"role": "user", "content": "8"}])

    def actor(request):
        if any(p["prompt_ids"][:len(bad_ids)] == bad_ids for p in json.loads(request.content)["prompts"]):
            return httpx.Response(400, json={"detail": "prompt too long for the model's context"})
        return good(request)

    handle = make_episode_handler(_runner(tok, actor, Never))
    bad = Prompt(**{**_prompt(n=2).model_dump(), "prompt_id": "r/e0-i1",
                    "messages": [{"role": "user", "content": "8"}]})
    ok1, refused, ok2 = handle([(_prompt(n=2), None), (bad, None), (_prompt(n=1), None)])
    assert [o.topic for o in ok1] == ["rl.episodes"] and [o.topic for o in ok2] == ["rl.episodes"]
    assert isinstance(refused, Rejected) and "too long" in refused.detail
    assert len(good.sent) == 2 and [len(s) for s in good.sent] == [2, 1]   # each group alone after the refusal


def test_an_answer_runs_at_most_max_tool_calls_within_one_shared_deadline():
    """Regression: every <tool_call> of an answer ran, one after another, each up to
    tool_timeout_s: an answer of 50 sleeping calls held the worker 50 x tool_timeout_s."""
    def counted(tool, outcome):
        return agent_metrics.TOOL_CALLS.labels(tool, outcome)._value.get()

    before = {k: counted(*k) for k in (("add", "ok"), ("sleepy", "timeout"), ("sleepy", "over_limit"))}
    env = agents.ToolEnv({"add": add, "sleepy": sleepy}, timeout_s=0.3, max_calls=4, turn_timeout_s=0.5)
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'
    nap = '<tool_call>{"name": "sleepy", "arguments": {"seconds": 5}}</tool_call>'
    t0 = time.monotonic()
    new, _, done = env.step([{"role": "assistant", "content": call + nap * 3 + nap * 50}])
    took = time.monotonic() - t0
    assert not done and len(new) == 54 and took < 2
    assert new[0]["content"] == "2"
    assert new[1]["content"] == "error: the tool did not answer within 0.3 s"
    assert new[2]["content"].startswith("error: the tool did not answer within 0.")   # what was left: 0.2 s
    assert new[3]["content"] == "error: this answer's tool calls used their 0.5 s; this one was not run"
    assert {m["content"] for m in new[4:]} == {"error: at most 4 tool calls an answer; this one was not run"}
    after = {k: counted(*k) for k in before}
    assert [after[k] - before[k] for k in before] == [1, 3, 50]


def test_tool_turn_timeout_must_be_below_env_timeout(tmp_path, monkeypatch):
    from pydantic import ValidationError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text('def add(a: int) -> int:\n    """Add.\n\n    Args:\n        a: a.\n    """\n'
                                   "    return a\n")
    with pytest.raises(ValidationError, match=r"tool_turn_timeout_s \(30\) must be below env_timeout_s \(30\)"):
        AgentSection(tools="t.py:add", model="tiny", tool_turn_timeout_s=30)


class OddReward(Never):
    """Rewards an episode by its conversation's length: NaN, inf, a string, True, then 0.5."""

    def step(self, messages):
        odd = [float("nan"), float("inf"), "1.0", True, 0.5][(len(messages) - 2) // 2]
        return [{"role": "user", "content": "no"}], odd, False


def test_a_non_finite_or_non_number_env_reward_is_kept_as_none(caplog):
    """Regression: a NaN reward made the output unencodable and the record was dead-lettered."""
    from steadyrl.wire import codec

    tok = tiny_tokenizer()
    actor = FakeActor(tok, tok.encode("a", add_special_tokens=False), [-0.1])
    handle = make_episode_handler(_runner(tok, actor, OddReward, max_turns=10))
    record, rewards = _prompt(n=1), []
    for _ in range(5):
        [[o]] = handle([(record, None)])
        record = o.value
        rewards.append(record.episodes[0].reward)
        codec.encode(record)   # encodable
    assert rewards == [None, None, None, None, 0.5]
    assert "returned reward nan at turn 1 of r/e0-i0: not a finite number, kept as None" in caplog.text


class SetState(Never):
    """Keeps the answers seen in a set: not JSON."""

    def reset(self, row):
        self.seen = set()
        return row["messages"]

    def step(self, messages):
        self.seen.add(messages[-1]["content"])
        return [{"role": "user", "content": "no"}], 0.0, False

    def get_state(self):
        return self.seen if self.seen else {"seen": []}

    def set_state(self, state):
        self.seen = set(state) if isinstance(state, list) else set()


class TupleState(SetState):
    def get_state(self):
        return {"seen": tuple(sorted(self.seen))}


def test_an_env_state_that_is_not_json_sends_its_group_to_the_dlq_naming_the_env():
    """Regression: get_state's value was stored as the codec turned it (a set became a list,
    a tuple a list): the next step got another state than the one it gave."""
    tok = tiny_tokenizer()
    actor = FakeActor(tok, tok.encode("a", add_special_tokens=False), [-0.1])
    [r] = make_episode_handler(_runner(tok, actor, SetState))([(_prompt(n=1), None)])
    assert isinstance(r, Rejected) and r.reason == DLQReason.handler_error
    assert r.detail.startswith("environment tests.steadyrl.test_agents:Never: step at turn 1 raised ValueError: "
                               "get_state() returned a set that is not JSON")
    [r] = make_episode_handler(_runner(tok, actor, TupleState))([(_prompt(n=1), None)])
    assert isinstance(r, Rejected) and r.detail.startswith(
        "environment tests.steadyrl.test_agents:Never: reset raised ValueError: get_state() returned a value "
        "that changes through JSON") and r.detail.endswith("{'seen': ()}")


class DoneThenRaises(Never):
    """The first step of a group ends its episode; the second raises."""

    calls = 0

    def step(self, messages):
        DoneThenRaises.calls += 1
        if DoneThenRaises.calls % 2:
            return [], 1.0, True
        raise KeyError("boom")


def test_turns_and_episodes_are_counted_only_once_their_state_is_written():
    """Regression: TURNS/EPISODES counted the turns and ends of a group then dead-lettered (or
    held): a turn run again counted twice."""
    from steadyrl.services.rollout.episodes import EPISODES, TURNS

    def counts():
        return TURNS._value.get(), {h: EPISODES.labels(h)._value.get() for h in ("done", "turns", "tokens")}

    tok = tiny_tokenizer()
    actor = FakeActor(tok, tok.encode("a", add_special_tokens=False), [-0.1])
    turns0, ends0 = counts()
    [r] = make_episode_handler(_runner(tok, actor, DoneThenRaises))([(_prompt(n=2), None)])
    assert isinstance(r, Rejected) and counts() == (turns0, ends0)
    [[o]] = make_episode_handler(_runner(tok, actor, Never, max_turns=1))([(_prompt(n=2), None)])
    turns1, ends1 = counts()
    assert o.topic == "rl.rollouts" and turns1 == turns0 + 2 and ends1 == {**ends0, "turns": ends0["turns"] + 2}


class Slow(Never):
    def step(self, messages):
        time.sleep(0.2)
        return [{"role": "user", "content": "no"}], 0.0, False


def test_a_call_whose_environment_steps_take_past_turn_timeout_s_holds_the_groups_left():
    """A batch of groups whose steps are each within env_timeout_s but slow together: once
    turn_timeout_s is spent, the groups not stepped are held (tried alone next), not waited on."""
    from steadyrl.bus.stage import RetryLater

    tok = tiny_tokenizer()
    actor = FakeActor(tok, tok.encode("a", add_special_tokens=False), [-0.1])
    handle = make_episode_handler(_runner(tok, actor, Slow, env_timeout_s=5, turn_timeout_s=0.3))
    first, _, last = handle([(_prompt(n=1), None)] * 3)
    assert [o.topic for o in first] == ["rl.episodes"]
    assert isinstance(last, RetryLater) and last.own and "turn_timeout_s (0.3 s)" in str(last)


class ResetsToNothing(Never):
    def reset(self, row):
        return None


class StepsToNumbers(Never):
    def step(self, messages):
        return [42], 0.0, False


def test_an_environment_returning_messages_that_are_not_messages_sends_its_group_to_the_dlq():
    tok = tiny_tokenizer()
    actor = FakeActor(tok, tok.encode("a", add_special_tokens=False), [-0.1])
    [r] = make_episode_handler(_runner(tok, actor, ResetsToNothing))([(_prompt(n=1), None)])
    assert isinstance(r, Rejected) and r.reason == DLQReason.handler_error
    assert r.detail.startswith("environment tests.steadyrl.test_agents:Never: reset returned messages the worker "
                               "cannot use: TypeError")
    [r] = make_episode_handler(_runner(tok, actor, StepsToNumbers))([(_prompt(n=1), None)])
    assert isinstance(r, Rejected) and r.detail.startswith(
        "environment tests.steadyrl.test_agents:Never: step at turn 1 returned messages the worker cannot use: ")


def test_the_reward_scores_the_final_answer_less_its_tool_calls():
    """Found by the SmolLM2 calculator runs: an episode cut off by max_turns on a call whose
    expression was the answer scored 1 on numeric_match (the last number of the text)."""
    from steadyrl.model.rewards import numeric_match

    call = '<tool_call>{"name": "calc", "arguments": {"expression": "38610"}}</tool_call>'
    assert agents.final_answer(call) == ""
    assert agents.final_answer(f"Let me check. {call}") == "Let me check."
    assert agents.final_answer('It is 12. <tool_call>{"name": "calc", "arguments": {"expression": "38610') \
        == "It is 12."
    assert agents.final_answer("The answer is 38610.") == "The answer is 38610."
    assert numeric_match("arith", agents.final_answer(call), "38610")["score"] == 0.0
    assert numeric_match("arith", call, "38610")["score"] == 1.0   # what it scored before


def test_an_environments_numpy_reward_comes_back_from_its_process_as_a_number():
    """Found in review: a step's answer crosses from the pool process as JSON (default=str), so
    a numpy float32 reward came back as the string "0.5" and was recorded as None."""
    import numpy as np

    class Env:
        def reset(self, row):
            return row["messages"]

        def step(self, messages):
            return [], np.float32(0.5), True

    row = {"messages": [{"role": "user", "content": "7"}]}
    answer = json.loads(json.dumps(agents.env_step(Env, row, None, row["messages"]), default=str))
    assert answer["reward"] == 0.5 and isinstance(answer["reward"], float)
