"""Budgets of multi-turn episodes (issue 48, item 4): every call into the user's code runs in a
pool process (ScoringPool.call), so a tool or an environment that raises, hangs, exits its
process or returns megabytes costs that call or that group, never the rollout worker; a
truncated episode is trained or dropped as configured and counted. The actor is an
httpx.MockTransport (unit level; the real broker is tests/integration/test_tool_faults.py)."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest
from pydantic import ValidationError

from steadyrl.model import agent_metrics, agents
from steadyrl.model.models import tiny_tokenizer
from steadyrl.services.rollout import episodes
from steadyrl.services.rollout.episodes import AgentSection, EpisodeRunner, make_episode_handler
from steadyrl.testing.audit import audit_episodes
from steadyrl.wire.codec import Rejected
from steadyrl.wire.contracts import DLQReason, Prompt, RolloutGroup

TOOLS = '''
import os, time

def _doc():
    pass

def ok(x: int) -> int:
    """Echo.

    Args:
        x: A number.
    """
    return x

def hang(x: int) -> str:
    """Sleep for ever.

    Args:
        x: A number.
    """
    time.sleep(10_000)

def die(x: int) -> str:
    """Exit the process.

    Args:
        x: A number.
    """
    os._exit(7)

def huge(x: int) -> str:
    """10 MB.

    Args:
        x: A number.
    """
    return "y" * (10 * 2**20)

def boom(x: int) -> str:
    """Raise.

    Args:
        x: A number.
    """
    raise RuntimeError("tool broke")
'''

ENVS = '''
import os, time

class Fine:
    def reset(self, row):
        return row["messages"]

    def step(self, messages):
        return [{"role": "user", "content": "again"}], 0.0, False

class Raises(Fine):
    def step(self, messages):
        raise KeyError("boom")

class Hangs(Fine):
    def step(self, messages):
        time.sleep(10_000)

class Exits(Fine):
    def step(self, messages):
        os._exit(9)

class Huge(Fine):
    def step(self, messages):
        return [{"role": "user", "content": "z" * (3 * 2**20)}], 0.0, False

class ExitsOnReset(Fine):
    def reset(self, row):
        os._exit(4)

class DoneAtTwo(Fine):
    """Says done at its second step (after the model's second answer)."""
    def step(self, messages):
        turns = sum(m["role"] == "assistant" for m in messages)
        return [{"role": "user", "content": "again"}], float(turns), turns >= 2


class Counts(Fine):
    """State through the pool: get_state/set_state round-trip across steps."""
    def reset(self, row):
        self.n = 0
        return row["messages"]

    def get_state(self):
        return {"n": self.n, "pid": os.getpid()}

    def set_state(self, s):
        self.n = s["n"]

    def step(self, messages):
        self.n += 1
        return [{"role": "user", "content": str(self.n)}], float(self.n), False
'''


def _actor(text: str, ids: list[int]):
    def actor(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        comp = {"token_ids": ids, "logprobs": [-0.5] * len(ids), "finish_reason": "stop", "text": text}
        return httpx.Response(200, json={"policy_version": 3, "engine": "torch", "prompt_ids": [],
                                         "completions": [[comp] for _ in body["prompts"]]})
    return actor


def _prompt(i: int = 0, n: int = 2) -> Prompt:
    return Prompt(prompt_id=f"r/e0-i{i}", epoch=0, index=i, n_samples=n, messages=[{"role": "user", "content": "7"}],
                  ground_truth="7", seed=11, max_new_tokens=4)


@pytest.fixture
def files(tmp_path, monkeypatch):
    (tmp_path / "tools.py").write_text(TOOLS)
    (tmp_path / "envs.py").write_text(ENVS)
    monkeypatch.chdir(tmp_path)
    runners: list[EpisodeRunner] = []

    def runner(text: str = "a", **agent) -> EpisodeRunner:
        a = AgentSection(model="tiny", **agent)
        r = EpisodeRunner(a, "http://actor", httpx.Client(transport=httpx.MockTransport(_actor(text, [5, 2]))),
                          5.0, 0.1, tok=tiny_tokenizer())
        runners.append(r)
        return r

    yield runner
    for r in runners:
        r.close()


def _count(counter, *labels):
    return counter.labels(*labels)._value.get()


def _call(name: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {{"x": 1}}}}</tool_call>'


def test_tools_that_hang_exit_return_10_mb_or_raise_cost_their_call_only(files):
    outcomes = {"ok": "ok", "hang": "timeout", "die": "crash", "huge": "cut", "boom": "error"}   # tool: outcome
    before = {o: _count(agent_metrics.TOOL_CALLS, t, o) for t, o in outcomes.items()}
    text = _call("ok") + _call("hang") + _call("die") + _call("huge") + _call("boom")
    runner = files(text, tools="tools.py:ok,hang,die,huge,boom", tool_timeout_s=1.0, max_tool_calls=5,
                   tool_turn_timeout_s=8.0, env_timeout_s=10.0, max_turns=3, max_episode_tokens=100_000)
    pool = runner.pool
    assert pool is not None
    t0 = time.monotonic()
    [[o]] = make_episode_handler(runner)([(_prompt(n=1), None)])
    took = time.monotonic() - t0
    assert o.topic == "rl.episodes" and took < 8
    results = [(m.name, m.content) for m in o.value.episodes[0].messages if m.role == "tool"]
    assert results[0] == ("ok", "1")
    assert results[1] == ("hang", "error: the tool did not answer within 1 s")
    assert results[2][0] == "die" and results[2][1].startswith("error: the tool crashed: crashed its process "
                                                               "(exited with code 7)")
    assert results[3][0] == "huge" and len(results[3][1]) < agents.MAX_TOOL_RESULT_CHARS + 100
    assert results[3][1].endswith(f"[... {10 * 2**20 - agents.MAX_TOOL_RESULT_CHARS} characters cut]")
    assert results[4] == ("boom", "error: RuntimeError: tool broke")
    after = {o: _count(agent_metrics.TOOL_CALLS, t, o) for t, o in outcomes.items()}
    assert {o: after[o] - before[o] for o in outcomes.values()} == dict.fromkeys(outcomes.values(), 1)
    assert pool.restarts == {"scorer_timeout": 1, "scorer_crash": 1}
    # the next turn runs its calls in fresh processes: the worker goes on
    [[o2]] = make_episode_handler(runner)([(o.value, None)])
    assert [m.content for m in o2.value.episodes[0].messages if m.role == "tool"][5] == "1"


@pytest.mark.parametrize(("cls", "detail"), [
    ("Raises", "step at turn 1 raised KeyError: 'boom'"),
    ("Hangs", "step at turn 1 did not answer within 1 s (its process was killed and replaced)"),
    ("Exits", "step at turn 1 crashed its process (exited with code 9) on this call"),
    ("Huge", "step at turn 1 returned 3145"),
    ("ExitsOnReset", "reset crashed its process (exited with code 4) on this call"),
])
def test_an_environment_that_raises_hangs_exits_or_answers_megabytes_sends_its_group_to_the_dlq(files, cls, detail):
    runner = files(env=f"envs.py:{cls}", env_timeout_s=1.0, tool_turn_timeout_s=0.5)
    t0 = time.monotonic()
    for bad in make_episode_handler(runner)([(_prompt(0), None), (_prompt(1), None)]):   # each group alone
        assert isinstance(bad, Rejected) and bad.reason == DLQReason.handler_error
        assert bad.detail.startswith(f"environment envs.py:{cls}: {detail}"), bad.detail
        if cls == "Huge":
            assert bad.detail.endswith(f"characters, more than the {agents.MAX_ENV_RESULT_CHARS} allowed")
    assert time.monotonic() - t0 < 6
    # the worker goes on: a fine environment steps in the (replaced) processes
    ok = files(env="envs.py:Fine")
    [[o]] = make_episode_handler(ok)([(_prompt(2), None)])
    assert o.topic == "rl.episodes" and o.value.episodes[0].messages[-1].content == "again"


def test_an_environments_state_travels_through_the_pool(files):
    runner = files(env="envs.py:Counts", max_turns=3)
    handle = make_episode_handler(runner)
    [[o]] = handle([(_prompt(n=1), None)])
    [[o]] = handle([(o.value, None)])
    ep = o.value.episodes[0]
    assert ep.env_state["n"] == 2 and ep.reward == 2.0 and ep.env_state["pid"] != os.getpid()
    assert [m.content for m in ep.messages if m.role == "user"][1:] == ["1", "2"]


def _to_the_end(handle, record):
    while True:
        [out] = handle([(record, None)])
        if isinstance(out, Rejected):
            return out
        [o] = out
        if o.topic == "rl.rollouts":
            return o.value
        record = o.value


def test_truncated_episodes_are_trained_by_default_and_counted(files):
    before = _count(episodes.EPISODES, "turns")
    g = _to_the_end(make_episode_handler(files(env="envs.py:Fine", max_turns=2)), _prompt(n=2))
    assert isinstance(g, RolloutGroup) and len(g.samples) == 2 and g.rejected == {}
    assert _count(episodes.EPISODES, "turns") - before == 2


def test_truncated_episodes_dropped_leave_no_group_waiting(files):
    """truncated: drop. A group whose episodes were all truncated goes to rl.dlq (rejected): the
    learner counts a refusal of its prompt and publishes it again within its budget; it is never
    trained, and the prompt never waits for ever."""
    before = _count(episodes.DROPPED, "turns")
    r = _to_the_end(make_episode_handler(files(env="envs.py:Fine", max_turns=2, truncated="drop")), _prompt(n=2))
    assert isinstance(r, Rejected) and r.reason == DLQReason.rejected
    assert r.detail == "all 2 episodes were truncated (turns x2) and rollout.agent.truncated is drop"
    assert _count(episodes.DROPPED, "turns") - before == 2


def test_a_dropped_truncated_episode_leaves_the_rest_of_its_group(files):
    """One episode ends by itself (no tool call), the other is cut by max_turns: the group goes
    on with one sample, `rejected` saying why."""
    runner = files(tools="tools.py:ok", max_turns=1, truncated="drop")
    state = runner.start(_prompt(n=2))
    assert not isinstance(state, Rejected)
    answers = [["7", _call("ok")], [_call("ok")]]   # per /generate: one text per episode asked

    def actor(request):
        comps = [[{"token_ids": [5], "logprobs": [-0.5], "finish_reason": "stop", "text": t}] for t in answers.pop(0)]
        return httpx.Response(200, json={"policy_version": 1, "engine": "torch", "completions": comps})

    runner.client = httpx.Client(transport=httpx.MockTransport(actor))
    runner.a = runner.a.model_copy(update={"max_turns": 2})
    [[o]] = make_episode_handler(runner)([(state, None)])   # turn 1: "7" ends; the call gets its result
    turn1 = o.value
    [[o]] = make_episode_handler(runner)([(turn1, None)])  # turn 2: max_turns
    g = o.value
    assert isinstance(g, RolloutGroup) and len(g.samples) == 1 and g.rejected == {"truncated_turns": 1}
    assert g.samples[0].text == "7"
    # the audit of episodes matches the sample left to its episode
    assert audit_episodes([turn1], [g], [g.prompt_id])["ok"]
    lost = g.model_copy(update={"rejected": {}})   # a sample missing without a reason is a lost episode
    assert not audit_episodes([turn1], [lost], [g.prompt_id])["checks"]["trajectories_extend_their_states"]


def test_an_episode_past_its_wall_clock_budget_ends_with_the_turn_in_flight(files):
    before = _count(episodes.EPISODES, "time")
    runner = files(env="envs.py:Fine", max_turns=10, episode_timeout_s=60)
    handle = make_episode_handler(runner)
    [[o]] = handle([(_prompt(n=2), None)])
    assert o.topic == "rl.episodes"
    state = o.value.model_copy(update={"started_ms": o.value.started_ms - 61_000})   # a minute in the topic
    [[o]] = handle([(state, None)])
    assert o.topic == "rl.rollouts"
    s = o.value.samples[0]
    assert len(s.turn_versions) == 2 and s.loss_mask[-1] == 1   # ends with the model's tokens
    assert _count(episodes.EPISODES, "time") - before == 2


@pytest.mark.parametrize(("field", "value"), [("processes", 0), ("memory_limit_mb", -1), ("episode_timeout_s", 0),
                                              ("truncated", "keep")])
def test_a_bad_budget_setting_is_refused_naming_it(field, value):
    with pytest.raises(ValidationError, match=field):
        AgentSection(env="tests.steadyrl.test_agents:Never", model="tiny", **{field: value})


def test_an_episode_its_last_allowed_answer_finishes_is_done_not_truncated(files, tmp_path):
    """Found in review: the max_turns check ran before the environment's step, so an episode
    whose last allowed answer finished it (no tool call; the environment said done) was marked
    truncated, and with truncated: drop the ideal trajectory was dropped and its prompt refused."""
    answers = [_call("ok"), "7"]   # turn 1 calls a tool, turn 2 answers

    def actor(request: httpx.Request) -> httpx.Response:
        body, text = json.loads(request.content), answers.pop(0)
        comp = {"token_ids": [5], "logprobs": [-0.5], "finish_reason": "stop", "text": text}
        return httpx.Response(200, json={"policy_version": 3, "engine": "torch", "prompt_ids": [],
                                         "completions": [[comp] for _ in body["prompts"]]})

    r = EpisodeRunner(AgentSection(model="tiny", tools="tools.py:ok", max_turns=2, truncated="drop"), "http://actor",
                      httpx.Client(transport=httpx.MockTransport(actor)), 5.0, 0.1, tok=tiny_tokenizer())
    try:
        g = _to_the_end(make_episode_handler(r), _prompt(n=2))
    finally:
        r.close()
    assert isinstance(g, RolloutGroup) and len(g.samples) == 2 and g.rejected == {}
    assert [s.text for s in g.samples] == ["7", "7"]

    env = _to_the_end(make_episode_handler(files(env="envs.py:DoneAtTwo", max_turns=2, truncated="drop")),
                      _prompt(n=2))
    assert isinstance(env, RolloutGroup) and len(env.samples) == 2 and env.rejected == {}
    # and one that does not finish at its last allowed turn is still truncated, with nothing appended
    cut = _to_the_end(make_episode_handler(files(env="envs.py:Fine", max_turns=2)), _prompt(n=2))
    assert isinstance(cut, RolloutGroup) and all(s.loss_mask[-1] == 1 for s in cut.samples)
