"""The rollout worker's episode metrics (steadyrl/model/agent_metrics.py, docs/metrics.md): tool
calls by tool and outcome with bounded labels, tool and environment latency, turns and tokens
per finished episode, truncated episodes by reason; each counted once, when its state is
written. The actor is an httpx.MockTransport (unit level), as in test_agents.py."""

from __future__ import annotations

from prometheus_client import REGISTRY

from steadyrl.model import agent_metrics, agents
from steadyrl.model.models import tiny_tokenizer
from steadyrl.services.rollout.episodes import make_episode_handler
from tests.steadyrl.test_agents import FakeActor, Never, _prompt, _runner, add


def _v(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def boom(x: int) -> int:
    """Raise.

    Args:
        x: anything.
    """
    raise RuntimeError("no")


def test_tool_calls_count_by_tool_and_outcome_with_the_model_made_names_bounded():
    env = agents.ToolEnv({"add": add, "boom": boom}, timeout_s=2.0, max_calls=10)
    agent_metrics.offered(env.tools)
    keys = [("add", "ok"), ("boom", "error"), ("unknown", "invalid"), ("add", "invalid")]
    before = {k: _v("steadyrl_rollout_tool_calls_total", tool=k[0], outcome=k[1]) for k in keys}
    ran = {t: _v("steadyrl_rollout_tool_call_seconds_count", tool=t) for t in ("add", "boom", "unknown")}
    answer = ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
              '<tool_call>{"name": "boom", "arguments": {"x": 1}}</tool_call>'
              '<tool_call>{"name": "made_up_by_the_model_1", "arguments": {}}</tool_call>'
              '<tool_call>{"name": "made_up_by_the_model_2", "arguments": {}}</tool_call>'
              '<tool_call>not json</tool_call>'
              '<tool_call>{"name": "add", "arguments": {"c": 1}}</tool_call>')
    new, _, _ = env.step([{"role": "assistant", "content": answer}])
    assert [m["content"][:6] for m in new] == ["3", "error:", "error:", "error:", "error:", "error:"]
    got = {k: _v("steadyrl_rollout_tool_calls_total", tool=k[0], outcome=k[1]) - before[k] for k in keys}
    assert got == {("add", "ok"): 1, ("boom", "error"): 1, ("unknown", "invalid"): 3, ("add", "invalid"): 1}
    # latency of the calls that ran, none for those not run; no series per made-up name
    assert [_v("steadyrl_rollout_tool_call_seconds_count", tool=t) - ran[t] for t in ran] == [1, 1, 0]
    names = {s.labels.get("tool") for m in REGISTRY.collect() if m.name == "steadyrl_rollout_tool_calls"
             for s in m.samples}
    assert not any(n and n.startswith("made_up") for n in names)


def test_offered_tools_start_at_zero_and_an_unknown_outcome_counts_as_error_with_a_warning(caplog):
    agent_metrics.offered(["fresh_tool"])
    assert REGISTRY.get_sample_value("steadyrl_rollout_tool_calls_total",
                                     {"tool": "fresh_tool", "outcome": "timeout"}) == 0.0
    agent_metrics.tool_call("fresh_tool", "exploded")
    assert _v("steadyrl_rollout_tool_calls_total", tool="fresh_tool", outcome="error") == 1
    assert _v("steadyrl_rollout_tool_calls_total", tool="fresh_tool", outcome="exploded") == 0
    assert "'exploded' is not one of" in caplog.text
    assert agent_metrics.tool_label("", ["a"]) == "unknown" and agent_metrics.tool_label("a", ["a"]) == "a"


def test_a_finished_episode_counts_its_turns_tokens_and_truncation_once_written():
    tok = tiny_tokenizer()
    reply = tok.encode("ab", add_special_tokens=False) + [tok.eos_token_id]
    handle = make_episode_handler(_runner(tok, FakeActor(tok, reply, [-0.5] * 3), Never, max_turns=2))
    names = ("steadyrl_rollout_turns_per_episode_count", "steadyrl_rollout_turns_per_episode_sum",
             "steadyrl_rollout_episode_tokens_count", "steadyrl_rollout_episode_tokens_sum")
    before = {n: _v(n) for n in names}
    turns_trunc = _v("steadyrl_rollout_episodes_truncated_total", reason="turns")
    resets, steps = (_v("steadyrl_rollout_env_step_seconds_count", call=c) for c in ("reset", "step"))
    [[o]] = handle([(_prompt(n=2), None)])
    assert o.topic == "rl.episodes" and _v(names[0]) == before[names[0]]   # nothing finished yet
    [[o]] = handle([(o.value, None)])
    assert o.topic == "rl.rollouts"
    s = o.value.samples[0]
    tokens = len(o.value.prompt_token_ids) + len(s.token_ids)
    got = {n: _v(n) - before[n] for n in names}
    assert got == {names[0]: 2, names[1]: 2 * 2, names[2]: 2, names[3]: 2 * tokens}
    assert _v("steadyrl_rollout_episodes_truncated_total", reason="turns") - turns_trunc == 2   # max_turns 2
    assert _v("steadyrl_rollout_env_step_seconds_count", call="reset") - resets == 1           # once per group
    assert _v("steadyrl_rollout_env_step_seconds_count", call="step") - steps == 4             # 2 turns, 2 episodes
    # (the last allowed turn's step too: it says whether the answer finished the episode)


def test_truncated_reasons_exist_at_zero():
    for reason in ("turns", "tokens", "time"):
        assert REGISTRY.get_sample_value("steadyrl_rollout_episodes_truncated_total", {"reason": reason}) is not None
