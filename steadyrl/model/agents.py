"""Agents: multi-turn episodes with tools or an environment, token in, token out (docs/agents.md).

A user writes an environment in one file, in one of two shapes:

- tools: plain typed Python functions (`--tools my_tools.py:calc,search`). Their JSON schemas
  come from the signature and docstring (transformers' `get_json_schema`); the model sees them
  through its chat template (`apply_chat_template(..., tools=...)`), or, for a template without
  tool support (SmolLM2's, the tiny model's), through a system message in the Hermes/Qwen
  `<tools>` style (`tools_system_message`). Its calls are parsed from
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; each runs in a pool process
  (ScoringPool.call: a hang, os._exit or a huge result costs that call) and its result, cut at
  MAX_TOOL_RESULT_CHARS there, is appended as a `tool` message. An answer without a call ends
  the episode; the reward is the run's reward function on that final answer.
- an environment class (`--env my_env.py:Class`, SkyRL-gym / OpenRLHF shape):
  `reset(row) -> messages` and `step(messages) -> (new messages, reward or None, done)`.

Serialization contract: an environment is rebuilt for every step, in a pool process of the
rollout worker (`env_step`: `Class()`, `reset(row)`, then `set_state(state)` if it defines
`get_state`/`set_state`) and stepped on the whole conversation; one without `get_state` must
be a function of the messages (and the row). A rollout worker can therefore die between any
two turns: the next one rebuilds it.

Token in, token out: the first turn's prompt is tokenized once; later turns continue from the
stored ids, and only each appended tool/environment message is tokenized (`delta_ids`: the
chat template's rendering of that message after a fixed conversation, minus that
conversation's). Model tokens have loss mask 1 and their behaviour log-probs; appended ones
mask 0 and log-prob 0.0.
"""

from __future__ import annotations

import inspect
import json
import math
import numbers
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, cast

from steadyrl.model import agent_metrics
from steadyrl.model.rewards import resolve_scorer
from steadyrl.model.scorepool import Call, ScoringPool
from steadyrl.wire.contracts import ChatMessage, Episode, EpisodeState, Prompt, RolloutGroup, Sample

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
#: Longest tool result kept, characters: more is cut in the tool's process (and says so).
MAX_TOOL_RESULT_CHARS = 8192
#: Longest an environment's reset or step answer may be (its messages, reward, done and state as
#: JSON), characters: more sends the group to rl.dlq (the answer is never read whole here).
MAX_ENV_RESULT_CHARS = 2**20


class Environment(Protocol):
    """The shape of `--env my_env.py:Class` (SkyRL-gym's BaseTextEnv, OpenRLHF's agent)."""

    def reset(self, row: dict[str, Any]) -> list[dict[str, str]]: ...

    def step(self, messages: list[dict[str, str]]) -> tuple[list[dict[str, str]], float | None, bool]: ...


# ---- tools -------------------------------------------------------------------------------
def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI-style JSON schema of a typed function with a Google-style docstring
    (transformers.utils.get_json_schema). Raises ValueError naming what is missing (a type
    hint, a docstring, an argument's description)."""
    from transformers.utils.chat_template_utils import get_json_schema  # lazy: heavy (transformers)

    try:
        return dict(get_json_schema(fn))
    except Exception as e:  # noqa: BLE001 - transformers raises its own TypeHintParsingException, DocstringParsingException
        raise ValueError(f"tool {getattr(fn, '__name__', fn)!r}: {e}") from None


def load_tools(spec: str) -> dict[str, Callable[..., Any]]:
    """`my_tools.py:calc,search` (or `pkg.mod:calc`) -> {name: function}. Raises ValueError:
    no name, a file or function not found, or a function without a usable schema."""
    module, _, names = spec.rpartition(":")
    if not module or not names:
        raise ValueError(f"tools {spec!r}: give file.py:name[,name...]")
    tools = {}
    for name in (n.strip() for n in names.split(",") if n.strip()):
        try:
            fn = resolve_scorer(f"{module}:{name}")
        except ValueError as e:
            raise ValueError(str(e).replace("scorer", "tool")) from None
        tool_schema(fn)  # fails at start, not mid-run
        tools[name] = fn
    return tools


def tools_system_message(schemas: list[dict[str, Any]]) -> str:
    """The Hermes/Qwen system message offering `schemas`, for a chat template without tool
    support (the rendering Qwen2.5's template makes)."""
    listed = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{listed}\n</tools>\n\nFor each function call, return a json object with function name and "
            "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


@dataclass
class ToolCall:
    """One parsed call: name and arguments, or the error the model gets back instead."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None


def parse_tool_calls(text: str, tools: dict[str, Callable[..., Any]]) -> list[ToolCall]:
    """The `<tool_call>{json}</tool_call>` calls in `text`, in order. A call that is not JSON,
    names no or an unknown tool, or whose arguments do not fit the function's signature comes
    back with `error` set (the message the model sees as the tool's result)."""
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", {}, f"error: the tool call is not JSON ({e.msg} at {e.pos})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall("", {}, 'error: a tool call is {"name": ..., "arguments": {...}}'))
            continue
        name, args = obj["name"], obj.get("arguments", {})
        if name not in tools:
            calls.append(ToolCall(name, {}, f"error: no tool {name!r}; the tools are {', '.join(sorted(tools))}"))
            continue
        if not isinstance(args, dict):
            calls.append(ToolCall(name, {}, f"error: the arguments of {name} must be a JSON object"))
            continue
        try:
            inspect.signature(tools[name]).bind(**args)
        except TypeError as e:
            calls.append(ToolCall(name, args, f"error: bad arguments for {name}: {e}"))
            continue
        calls.append(ToolCall(name, args))
    return calls


class Deadline(TimeoutError):
    """A user's function (a tool, an environment's reset/step) did not return within its time."""


def within(fn: Callable[[], Any], timeout_s: float, name: str = "user-call") -> Any:
    """`fn()` in a daemon thread, within `timeout_s` seconds: its result, or the exception it
    raised. Raises Deadline past the time; the thread is abandoned and runs on. For an
    environment given as an object (EpisodeRunner's `factory`: tests); the rollout worker runs
    the user's code in its pool processes (ScoringPool.call)."""
    fut: Future[Any] = Future()

    def call() -> None:
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - the user's code: SystemExit too
            fut.set_exception(e)

    threading.Thread(target=call, daemon=True, name=name).start()
    try:
        return fut.result(timeout=timeout_s)
    except TimeoutError:
        if fut.done():   # the function itself raised TimeoutError
            raise
        raise Deadline(f"did not answer within {timeout_s:g} s") from None
    except Exception:
        raise
    except BaseException as e:  # noqa: BLE001 - SystemExit in the user's code must not stop the caller
        raise RuntimeError(f"{type(e).__name__}: {e}") from e


def run_tool(fn: Callable[..., Any], args: dict[str, Any], timeout_s: float) -> tuple[str, str]:
    """(result text, outcome: ok | error | timeout) of one call in a thread of this process,
    within `timeout_s` seconds (a ToolEnv without a pool: tests). A call that raises gives its
    exception as the result; one past the timeout is abandoned (its daemon thread runs on)."""
    try:
        out = within(lambda: fn(**args), timeout_s, "tool-call")
    except Deadline:
        return f"error: the tool did not answer within {timeout_s:g} s", "timeout"
    except BaseException as e:  # noqa: BLE001
        return f"error: {type(e).__name__}: {e}", "error"
    text = out if isinstance(out, str) else json.dumps(out, ensure_ascii=False, default=str)
    if len(text) > MAX_TOOL_RESULT_CHARS:
        text = text[:MAX_TOOL_RESULT_CHARS] + f" [... {len(text) - MAX_TOOL_RESULT_CHARS} characters cut]"
    return text, "ok"


def tool_specs(spec: str) -> dict[str, str]:
    """`my_tools.py:calc,search` -> {"calc": "my_tools.py:calc", ...}: each tool's own spec, for
    a pool process (ScoringPool.call) to load it by."""
    module, _, names = spec.rpartition(":")
    return {n.strip(): f"{module}:{n.strip()}" for n in names.split(",") if n.strip()}


class ToolEnv:
    """Tools as an Environment: the system message offers them (unless the template does), each
    `<tool_call>` runs and its result comes back as a `tool` message; an answer without a call
    ends the episode (reward None: the run's reward function scores the final answer). One
    answer runs at most `max_calls` calls (the others get an error result, not run), all of them
    within `turn_timeout_s` seconds together (each within `timeout_s`).

    With `pool` (and `specs`, each tool's `file.py:name`), each call runs in a pool process
    (ScoringPool.call): a tool that hangs, exits its process or returns megabytes costs that
    call. Without, in a thread of this process (tests; a hang keeps its thread)."""

    def __init__(self, tools: dict[str, Callable[..., Any]], timeout_s: float = 10.0, in_template: bool = False,
                 max_calls: int = 4, turn_timeout_s: float = 20.0, pool: ScoringPool | None = None,
                 specs: dict[str, str] | None = None):
        self.tools, self.timeout_s, self.in_template = tools, timeout_s, in_template
        self.max_calls, self.turn_timeout_s = max_calls, turn_timeout_s
        self.pool, self.specs = pool, specs or {}
        if pool is not None and set(self.specs) != set(tools):
            raise ValueError(f"specs {sorted(self.specs)} must name the tools {sorted(tools)}")
        self.schemas = [tool_schema(f) for f in tools.values()]

    def reset(self, row: dict[str, Any]) -> list[dict[str, str]]:
        messages: list[dict[str, str]] = list(row["messages"])
        if self.in_template:
            return messages
        system = tools_system_message(self.schemas)
        if messages and messages[0]["role"] == "system":
            return [{"role": "system", "content": messages[0]["content"] + "\n\n" + system}, *messages[1:]]
        return [{"role": "system", "content": system}, *messages]

    def step(self, messages: list[dict[str, str]]) -> tuple[list[dict[str, str]], float | None, bool]:
        calls = parse_tool_calls(messages[-1]["content"], self.tools)
        if not calls:
            return [], None, True
        out = []
        deadline = time.monotonic() + self.turn_timeout_s
        for k, c in enumerate(calls):
            left, seconds = deadline - time.monotonic(), None
            if k >= self.max_calls:
                text, outcome = f"error: at most {self.max_calls} tool calls an answer; this one was not run", \
                    "over_limit"
            elif c.error is not None:   # the model's call, not the tool: not run
                text, outcome = c.error, "invalid"
            elif left <= 0:
                text, outcome = (f"error: this answer's tool calls used their {self.turn_timeout_s:g} s; "
                                 "this one was not run"), "timeout"
            else:
                t0 = time.perf_counter()
                text, outcome = (self._in_pool(c, min(self.timeout_s, left), deadline) if self.pool is not None
                                 else run_tool(self.tools[c.name], c.arguments, min(self.timeout_s, left)))
                seconds = time.perf_counter() - t0
            agent_metrics.tool_call(agent_metrics.tool_label(c.name, self.tools), outcome, seconds)
            out.append({"role": "tool", "name": c.name, "content": text})
        return out, None, False

    def _in_pool(self, c: ToolCall, timeout_s: float, deadline: float) -> tuple[str, str]:
        """(result text, outcome) of one call in a pool process (ScoringPool.call's outcomes)."""
        assert self.pool is not None
        [r] = self.pool.call([Call(self.specs[c.name], c.arguments, timeout_s, MAX_TOOL_RESULT_CHARS,
                                   name=f"tool {c.name}")], deadline=deadline)
        if r.outcome in ("ok", "cut"):
            return r.text, r.outcome
        if r.outcome == "timeout":
            return f"error: the tool did not answer within {timeout_s:g} s", "timeout"
        if r.outcome == "crash":
            return f"error: the tool crashed: {r.text.removeprefix(f'tool {c.name} ')}", "crash"
        return f"error: {r.text}", "error"


# ---- environments --------------------------------------------------------------------------
def load_env(spec: str) -> Callable[[], Environment]:
    """`my_env.py:Class` -> the class (a factory of environments). Raises ValueError when it is
    not found or lacks reset/step."""
    try:
        cls = resolve_scorer(spec)
    except ValueError as e:
        raise ValueError(str(e).replace("scorer", "environment")) from None
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"environment {spec!r} has no {' or '.join(missing)} method")
    return cast("Callable[[], Environment]", cls)


def row_of(prompt: Prompt) -> dict[str, Any]:
    """What `reset` gets: the prompt's messages and verl fields."""
    return {"messages": [_msg(m) for m in prompt.messages], "ground_truth": prompt.ground_truth,
            "data_source": prompt.data_source, "extra_info": prompt.extra_info, "prompt_id": prompt.prompt_id}


def _msg(m: ChatMessage) -> dict[str, str]:
    d = {"role": m.role, "content": m.content}
    if m.name is not None:
        d["name"] = m.name
    return d


def rebuilt(factory: Callable[[], Environment], prompt: Prompt, state: Any) -> Environment:
    """The environment of an episode, rebuilt (the serialization contract, module doc)."""
    env = factory()
    env.reset(row_of(prompt))
    if state is not None and callable(getattr(env, "set_state", None)):
        env.set_state(state)  # type: ignore[attr-defined]
    return env


def env_reset(cls: Callable[[], Environment], row: dict[str, Any]) -> dict[str, Any]:
    """An environment's reset, in a pool process (ScoringPool.call's `via`): {"messages", "state"}."""
    env = cls()
    messages = env.reset(row)
    return {"messages": messages, "state": env_state(env)}


def env_step(cls: Callable[[], Environment], row: dict[str, Any], state: Any,
             messages: list[dict[str, str]]) -> dict[str, Any]:
    """One step of an environment rebuilt from (row, state) (the serialization contract), in a
    pool process (ScoringPool.call's `via`): {"messages", "reward", "done", "state"}."""
    env = cls()
    env.reset(row)
    if state is not None and callable(getattr(env, "set_state", None)):
        env.set_state(state)  # type: ignore[attr-defined]
    new, reward, done = env.step(messages)
    if isinstance(reward, numbers.Real) and not isinstance(reward, bool):
        # a numpy float32 or int64 as a float (JSON's default=str made it the string "0.5");
        # NaN/inf as text, which would not come back as a number either way
        reward = float(reward) if math.isfinite(float(reward)) else str(reward)
    return {"messages": new, "reward": reward, "done": bool(done), "state": env_state(env)}


def env_state(env: Environment) -> Any:
    """The JSON state of `env` (its `get_state()`), or None. Raises ValueError when the state
    does not come back the same through JSON (a set, a tuple, an int key, NaN, an object): the
    next step would get another state than the one `get_state` gave."""
    get = getattr(env, "get_state", None)
    if not callable(get):
        return None
    state = get()
    try:
        same = json.loads(json.dumps(state)) == state
    except (TypeError, ValueError) as e:
        raise ValueError(f"get_state() returned a {type(state).__name__} that is not JSON: {e}") from None
    if not same:
        raise ValueError(f"get_state() returned a value that changes through JSON (a tuple, a set, a "
                         f"non-string key, NaN?): {state!r:.200}")
    return state


# ---- tokens ---------------------------------------------------------------------------------
#: The fixed conversation `delta_ids` renders a message after.
_BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


def _render(tok: Any, messages: list[dict[str, str]], gen: bool, tools: list[dict[str, Any]] | None = None) -> str:
    return str(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=False))


def prompt_ids(tok: Any, messages: list[dict[str, str]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The first turn's token ids: the chat template (with `tools` where it takes them), the
    assistant turn opened. Tokenized once per episode."""
    return list(tok.encode(_render(tok, messages, True, tools), add_special_tokens=False))


def delta_ids(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` appended after an assistant turn, with the next assistant turn
    opened: the template's text of them after a fixed conversation minus that conversation's.
    Earlier turns are never re-tokenized. A `tool` message the template cannot render goes as
    a user message in Hermes' `<tool_response>` wrapping."""
    base = _render(tok, _BASE, False)
    try:
        full = _render(tok, [*_BASE, *messages], True)
    except Exception:  # noqa: BLE001 - jinja2's TemplateError: the template refuses the tool role
        full = _render(tok, [*_BASE, *[m if m["role"] != "tool" else
                                       {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
                                       for m in messages]], True)
    if not full.startswith(base):
        raise ValueError("the chat template renders a conversation differently once a message is appended; "
                         "cannot tokenize the appended message alone")
    return list(tok.encode(full[len(base):], add_special_tokens=False))


# ---- episodes -------------------------------------------------------------------------------
def start(prompt: Prompt, messages: list[dict[str, str]], ids: list[int], state: Any = None) -> EpisodeState:
    """Turn 0 of `prompt`'s group: n episodes from the same first messages and ids."""
    msgs = [ChatMessage(**m) for m in messages]
    return EpisodeState(prompt=prompt, turn=0, episodes=[
        Episode(messages=msgs, prompt_ids=ids, env_state=state) for _ in range(prompt.n_samples)])


def add_turn(ep: Episode, token_ids: list[int], logprobs: list[float], text: str, finish_reason: str,
             version: int) -> None:
    """Append one assistant turn (model tokens: mask 1, their behaviour log-probs)."""
    ep.token_ids += token_ids
    ep.logprobs += logprobs
    ep.loss_mask += [1] * len(token_ids)
    ep.turn_versions.append(version)
    ep.messages.append(ChatMessage(role="assistant", content=text))
    ep.text, ep.finish_reason = text, finish_reason  # type: ignore[assignment]


def add_observation(ep: Episode, messages: list[dict[str, str]], ids: list[int]) -> None:
    """Append the environment's messages and their token ids (mask 0, log-prob 0.0)."""
    ep.messages += [ChatMessage(**m) for m in messages]
    ep.token_ids += ids
    ep.logprobs += [0.0] * len(ids)
    ep.loss_mask += [0] * len(ids)


def final_answer(text: str) -> str:
    """`text` (an episode's last assistant turn) less its tool calls: the `<tool_call>...</tool_call>`
    blocks, and an unclosed `<tool_call>` to the end. What the run's reward function scores: a
    call is not an answer. An episode cut short by max_turns on a call, `<tool_call>{"name":
    "calc", "arguments": {"expression": "38610"}}</tool_call>`, scored 1 on numeric_match
    before (the expression's number was the answer's last); now it is scored on "" (0)."""
    return TOOL_CALL.sub("", text).split("<tool_call>", 1)[0].strip()


def finished(state: EpisodeState, drop_truncated: bool = False) -> RolloutGroup | None:
    """The group of a state whose episodes are all done: one sample per episode (its whole
    trajectory after the prompt, with loss mask and per-turn versions; its text, what the
    reward scores, is the last turn's `final_answer`); policy_version is the
    first turn's, so staleness counts from the episode's start. With `drop_truncated`, the
    truncated episodes are left out and counted in the group's `rejected`
    (`truncated_turns`, `truncated_tokens`, `truncated_time`), as the rollout gate leaves out
    samples; None when none is left."""
    eps = [e for e in state.episodes if not (drop_truncated and e.truncated)]
    if not eps:
        return None
    rejected: dict[str, int] = {}
    for e in state.episodes:
        if drop_truncated and e.truncated:
            rejected[f"truncated_{e.truncated}"] = rejected.get(f"truncated_{e.truncated}", 0) + 1
    first = min((v for e in eps for v in e.turn_versions[:1]), default=0)
    samples = [Sample(text=final_answer(e.text), token_ids=e.token_ids, logprobs=e.logprobs,
                      finish_reason=e.finish_reason, loss_mask=e.loss_mask, turn_versions=e.turn_versions)
               for e in eps]
    return RolloutGroup(prompt=state.prompt, prompt_token_ids=eps[0].prompt_ids, samples=samples,
                        policy_version=first, actor=state.actor, engine=state.engine, rejected=rejected)
