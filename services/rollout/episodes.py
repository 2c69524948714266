"""The rollout worker's episode path: multi-turn episodes with tools or an environment, one turn
per exactly-once step on the log (steadyrl/model/agents.py, docs/agents.md).

With `rollout.agent.tools` or `rollout.agent.env` set, the worker's Stage reads `rl.prompts`
(turn 0) and `rl.episodes` (later turns) in one consumer group. For each record it takes the
group's state (a Prompt starts n episodes: the environment's first messages, tokenized once),
asks the actor for one assistant turn of every unfinished episode -- one POST /generate per
sampling setting for the whole batch, continuing from each episode's stored token ids
(`prompt_ids`), so many groups' episodes interleave at the actor -- runs one environment step
of each, tokenizes only the appended messages, and writes either the next EpisodeState to
rl.episodes or, once every episode is done, the RolloutGroup to rl.rollouts: in the
transaction that commits the input's offset. A worker killed mid-turn loses that turn only;
the next reader of the state runs it again (with the same seed).

An episode ends when the environment says done, after `max_turns` assistant turns, when its
tokens reach `max_episode_tokens` (prompt + trajectory: the last turn is cut to fit), or once
`episode_timeout_s` has passed since its group started (checked after each turn, before the
environment's step: the episode ends with the turn in flight, so a trajectory always ends with
the model's tokens). The last three are truncations (`Episode.truncated`): trained, or dropped
from the group (`truncated: drop`; a group left with none goes to rl.dlq, `rejected`).

Every call into the user's code runs in a pool process (steadyrl/model/scorepool.py,
`ScoringPool.call`; `processes`, `memory_limit_mb`): each tool call within `tool_timeout_s`,
the environment's reset and each step (rebuilt there from the row, its state and the messages)
within `env_timeout_s`. A tool that raises, hangs, exits its process or returns megabytes costs
that call (an `error: ...` tool result; a result past MAX_TOOL_RESULT_CHARS is cut in the tool's
process); an environment that does costs its group (rl.dlq, handler_error).
"""

from __future__ import annotations

import collections
import json
import logging
import math
import numbers
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import httpx
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from steadyrl.bus.stage import Output, RetryLater, refusal_reason
from steadyrl.http import response_detail
from steadyrl.model import agent_metrics, agents
from steadyrl.model.scorepool import Call, CallResult, ScoringPool, absolute_spec
from steadyrl.wire.codec import Rejected
from steadyrl.wire.contracts import DLQReason, EpisodeState, Prompt, now_ms

if TYPE_CHECKING:
    from steadyrl.bus.stage import BatchHandler, Meta
    from steadyrl.wire.contracts import Contract

log = logging.getLogger(__name__)

TURNS = Counter("steadyrl_rollout_episode_turns", "Assistant turns of episodes written (in the next state or "
                                                  "the finished group); a turn held or refused is not counted")
EPISODES = Counter("steadyrl_rollout_episodes_finished", "Episodes finished in a state or group written, by how "
                                                         "(done; truncated by turns, tokens, time)", ["how"])
DROPPED = Counter("steadyrl_rollout_episodes_dropped", "Truncated episodes left out of their group "
                                                       "(rollout.agent.truncated: drop), by how (turns, tokens, "
                                                       "time)", ["how"])


class AgentSection(BaseModel):
    """Multi-turn episodes (docs/agents.md): set `tools` or `env` to turn them on."""

    model_config = ConfigDict(extra="forbid")

    tools: str | None = Field(None, description="Tools as typed Python functions: `my_tools.py:calc,search`.")
    env: str | None = Field(None, description="An environment class: `my_env.py:Class` (reset/step).")
    model: str | None = Field(None, description="The actor's model (name or folder), for its tokenizer and chat "
                                                "template; `steadyrl up` sets it from --model.")
    max_turns: int = Field(4, ge=1, le=1000, description="Assistant turns an episode has at most.")
    max_episode_tokens: int = Field(4096, ge=2, description="Prompt + trajectory tokens an episode has at most.")
    tool_timeout_s: float = Field(10.0, gt=0, description="Longest a tool call may take; past it the model "
                                                          "gets an error as the tool's result.")
    max_tool_calls: int = Field(4, ge=1, description="Tool calls one answer may make; the others get an error "
                                                     "as their result, not run.")
    tool_turn_timeout_s: float = Field(20.0, gt=0, description="Longest all tool calls of one answer may take "
                                                               "together; a call past it gets an error, not run. "
                                                               "Below env_timeout_s.")
    env_timeout_s: float = Field(30.0, gt=0, description="Longest an environment's reset or one step (rebuilt, "
                                                         "stepped, get_state) may take; past it, or when it "
                                                         "raises, the group goes to rl.dlq (handler_error) and the "
                                                         "learner republishes its prompt within its refusal budget.")

    turn_timeout_s: float = Field(120.0, gt=0, description="Longest the environment steps of one worker call (a "
                                                         "batch's turn) take before no other step starts: the "
                                                         "groups not stepped by then are held and tried alone "
                                                         "(each step still within env_timeout_s).")
    episode_timeout_s: float = Field(600.0, gt=0, description="Wall-clock budget of an episode from its group's "
                                                              "start, checked after each turn: past it the episode "
                                                              "ends with that turn (truncated: time).")
    truncated: Literal["train", "drop"] = Field("train", description="An episode ended by max_turns, "
                                                "max_episode_tokens or episode_timeout_s: train it (its last answer "
                                                "scored as any), or drop it from its group (counted in the group's "
                                                "`rejected`; a group left with none goes to rl.dlq, rejected, and "
                                                "the learner publishes the prompt again within its refusal budget).")
    processes: int = Field(2, ge=1, le=64, description="Worker processes that run the tool calls and the "
                                                       "environment's reset/step (a hang, os._exit or a huge result "
                                                       "costs a call, never the worker).")
    memory_limit_mb: int = Field(2048, ge=0, description="Memory each of those processes may allocate "
                                                         "(RLIMIT_DATA), MiB; past it the call raises MemoryError. "
                                                         "0: no limit.")

    @field_validator("tools")
    @classmethod
    def _tools_load(cls, v: str | None) -> str | None:
        if v is not None:
            agents.load_tools(v)   # at start, exit 2 naming the field: not a crash loop later
        return v

    @field_validator("env")
    @classmethod
    def _env_loads(cls, v: str | None) -> str | None:
        if v is not None:
            agents.load_env(v)
        return v

    @model_validator(mode="after")
    def _one_shape(self) -> AgentSection:
        if self.tools and self.env:
            raise ValueError("give tools or env, not both")
        if (self.tools or self.env) and not self.model:
            raise ValueError("tools/env need model (the actor's model, for its tokenizer)")
        if self.tools and self.tool_turn_timeout_s >= self.env_timeout_s:
            raise ValueError(f"tool_turn_timeout_s ({self.tool_turn_timeout_s:g}) must be below env_timeout_s "
                             f"({self.env_timeout_s:g}): a tools step runs under env_timeout_s")
        return self

    @property
    def on(self) -> bool:
        return bool(self.tools or self.env)

    def pool(self) -> ScoringPool:
        """The processes that run the user's tools or environment (ScoringPool.call)."""
        return ScoringPool(self.processes, self.env_timeout_s, self.memory_limit_mb)


def _tokenizer(model: str) -> Any:
    from steadyrl.model.models import TINY, hf_folder, load_tokenizer, tiny_tokenizer  # lazy: heavy (transformers)

    return tiny_tokenizer() if model == TINY else load_tokenizer(hf_folder(model))


class EpisodeRunner:
    """One turn of groups of episodes: the environment, the tokenizer and the actor calls."""

    def __init__(self, a: AgentSection, actor_url: str, client: httpx.Client, request_timeout_s: float,
                 retry_backoff_s: float, tok: Any = None,
                 factory: Callable[[], agents.Environment] | None = None):
        self.a, self.url, self.client = a, actor_url, client
        self.request_timeout_s, self.retry_backoff_s = request_timeout_s, retry_backoff_s
        self.tok = tok if tok is not None else _tokenizer(a.model or "")
        self.schemas: list[dict[str, Any]] | None = None
        self.pool: ScoringPool | None = None
        self.env_spec: str | None = None   # the environment class, run in the pool
        self.factory: Callable[[], agents.Environment] | None = None   # in this process (tests; ToolEnv)
        if factory is not None:
            self.factory = factory
        elif a.tools:
            tools = agents.load_tools(a.tools)
            in_template = "tools" in str(getattr(self.tok, "chat_template", "") or "")
            self.pool = a.pool()
            env = agents.ToolEnv(tools, a.tool_timeout_s, in_template, a.max_tool_calls, a.tool_turn_timeout_s,
                                 pool=self.pool, specs=agents.tool_specs(a.tools))
            self.schemas = env.schemas if in_template else None
            self.factory = lambda: env
            agent_metrics.offered(tools)
        else:
            agents.load_env(a.env or "")   # found, with reset and step (AgentSection checked it too)
            self.env_spec = absolute_spec(a.env or "")
            self.pool = a.pool()
        self.turns_of: dict[int, int] = {}        # id(state) -> turns this call, counted once written
        self.ends_of: dict[int, list[tuple[str, int, int]]] = {}   # id(state) -> (how, turns, tokens) of its
        #                                                            episodes ended this call
        self.name = f"environment {a.env}" if a.env else f"tools {a.tools}" if a.tools else "environment"

    def close(self) -> None:
        """Stop the pool's processes."""
        if self.pool is not None:
            self.pool.close()

    def _in_pool(self, via: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The environment's reset or step (agents.env_reset / env_step) in a pool process,
        within env_timeout_s: its answer, or EnvFailed saying how it failed."""
        assert self.pool is not None and self.env_spec is not None
        [r] = self.pool.call([Call(self.env_spec, kwargs, self.a.env_timeout_s, agents.MAX_ENV_RESULT_CHARS,
                                   name=self.name, cut=False, via=f"steadyrl.model.agents:{via}")])
        if r.outcome != "ok":
            raise EnvFailed(r, self.name, self.a.env_timeout_s)
        answer: dict[str, Any] = json.loads(r.text)
        return answer

    # ---- turn 0 -----------------------------------------------------------------------
    def start(self, p: Prompt) -> EpisodeState | Rejected:
        """The group's n episodes at turn 0 (reset once: they start alike, as GRPO's group), or
        Rejected (handler_error) when the environment raises or takes past `env_timeout_s`."""
        def reset() -> tuple[list[dict[str, str]], Any]:
            assert self.factory is not None
            env = self.factory()
            messages = env.reset(agents.row_of(p))
            return messages, agents.env_state(env)

        t0 = time.perf_counter()
        try:
            if self.env_spec is not None:
                answer = self._in_pool("env_reset", {"row": agents.row_of(p)})
                messages, state = answer["messages"], answer["state"]
            else:
                messages, state = agents.within(reset, self.a.env_timeout_s, "env-reset")
        except Exception as e:  # noqa: BLE001 - the user's environment: its record goes to rl.dlq
            return self._refused("reset", e)
        finally:
            agent_metrics.env_call("reset", time.perf_counter() - t0)
        try:
            return agents.start(p, messages, agents.prompt_ids(self.tok, messages, self.schemas), state)
        except Exception as e:  # noqa: BLE001 - not a list of {role, content} messages the template renders
            return self._refused("reset returned messages the worker cannot use:", e, bad=True)

    def _refused(self, what: str, e: Exception, bad: bool = False) -> Rejected:
        how = str(e) if isinstance(e, agents.Deadline | EnvFailed) else \
            f"{'' if bad else 'raised '}{type(e).__name__}: {e}"
        return Rejected(DLQReason.handler_error, f"{self.name}: {what} {how}")

    # ---- one turn ---------------------------------------------------------------------
    def turn(self, states: list[EpisodeState]) -> list[EpisodeState | RetryLater | Rejected]:
        """Run one assistant turn and one environment step of every unfinished episode of
        `states` (changed in place); per state: itself, or what holds or refuses it."""
        out: list[EpisodeState | RetryLater | Rejected] = list(states)
        self.turns_of = {id(s): 0 for s in states}
        self.ends_of = {id(s): [] for s in states}
        wants: dict[tuple[Any, ...], list[tuple[int, int, int]]] = {}   # key -> [(state, episode, max_new)]
        for i, s in enumerate(states):
            for j, ep in enumerate(s.episodes):
                if ep.done:
                    continue
                left = self.a.max_episode_tokens - len(ep.prompt_ids) - len(ep.token_ids)
                p = s.prompt
                key = (p.temperature, p.top_p, min(p.max_new_tokens, left), p.run_id, p.min_policy_version)
                wants.setdefault(key, []).append((i, j, min(p.max_new_tokens, left)))
        for key, which in wants.items():
            live = [(i, j, m) for i, j, m in which if isinstance(out[i], EpisodeState)]
            if not live:
                continue
            answer = self._generate(key, [(states[i], j) for i, j, _ in live])
            groups = list(dict.fromkeys(i for i, _, _ in live))
            if isinstance(answer, Rejected) and len(groups) > 1:   # which group does the actor refuse?
                for g in groups:
                    mine = [w for w in live if w[0] == g]
                    self._apply(states, out, mine, self._generate(key, [(states[g], j) for _, j, _ in mine]))
                continue
            self._apply(states, out, live, answer)
        deadline = time.monotonic() + self.a.turn_timeout_s
        for i, s in enumerate(states):
            if isinstance(out[i], EpisodeState):
                s.turn += 1
                for ep in s.episodes:
                    if ep.done:
                        continue
                    if time.monotonic() > deadline:   # held: tried alone next, with the whole time
                        out[i] = RetryLater(f"the environment steps of this call took past turn_timeout_s "
                                            f"({self.a.turn_timeout_s:g} s)", self.retry_backoff_s, own=True)
                        break
                    if (bad := self._step(s, ep)) is not None:
                        out[i] = bad   # the group to rl.dlq; its other episodes are not stepped
                        break
        return out

    def count(self, s: EpisodeState) -> None:
        """Count the turns and ended episodes of `s` in this call: once its output is written."""
        TURNS.inc(self.turns_of.pop(id(s), 0))
        for how, turns, tokens in self.ends_of.pop(id(s), []):
            EPISODES.labels(how).inc()
            agent_metrics.episode_finished(turns, tokens, how)

    def _ended(self, s: EpisodeState, ep: Any, how: str) -> None:
        """`ep` of `s` ended this call (`how`: done, or truncated by turns, tokens, time): counted
        once `s` is written."""
        ep.done = True
        if how != "done":
            ep.truncated = how
        self.ends_of[id(s)].append((how, len(ep.turn_versions), len(ep.prompt_ids) + len(ep.token_ids)))

    def _apply(self, states: list[EpisodeState], out: list[EpisodeState | RetryLater | Rejected],
               live: list[tuple[int, int, int]], answer: dict[str, Any] | RetryLater | Rejected) -> None:
        """One /generate answer to the (state, episode, max_new) `live`: a turn appended to each
        episode, or what holds or refuses each of their states."""
        if not isinstance(answer, dict):
            for i, _, _ in live:
                out[i] = answer
            return
        for (i, j, _), comp in zip(live, answer["completions"], strict=True):
            c = comp[0]
            agents.add_turn(states[i].episodes[j], c["token_ids"], c["logprobs"], c["text"], c["finish_reason"],
                            answer["policy_version"])
            states[i].engine = answer.get("engine", "") if isinstance(answer.get("engine"), str) else ""
            states[i].actor = self.url
            self.turns_of[id(states[i])] += 1

    def _reward(self, reward: Any, s: EpisodeState) -> float | None:
        """An environment's reward as a finite float, or None (with a warning) for anything else:
        a NaN or a string would make the record unencodable and dead-letter the group."""
        if isinstance(reward, numbers.Real) and not isinstance(reward, bool) and math.isfinite(float(reward)):
            return float(reward)
        log.warning("%s returned reward %r at turn %d of %s: not a finite number, kept as None",
                    self.name, reward, s.turn, s.prompt_id)
        return None

    def _generate(self, key: tuple[Any, ...],
                  eps: list[tuple[EpisodeState, int]]) -> dict[str, Any] | RetryLater | Rejected:
        """One POST /generate: one assistant turn of each (state, episode) `eps`, from its stored ids."""
        temperature, top_p, max_new, run_id, min_version = key
        body = {"prompts": [{"prompt_ids": s.episodes[j].prompt_ids + s.episodes[j].token_ids,
                             "seed": None if s.prompt.seed is None else s.prompt.seed + 1_000_003 * j + 7919 * s.turn}
                            for s, j in eps],
                "n": 1, "temperature": temperature, "top_p": top_p, "max_new_tokens": max_new,
                "run_id": run_id, "min_policy_version": min_version}
        try:
            resp = self.client.post(f"{self.url}/generate", json=body, timeout=self.request_timeout_s)
        except httpx.HTTPError as e:
            return RetryLater(f"actor unreachable: {type(e).__name__}: {e}", self.retry_backoff_s)
        if resp.status_code >= 500 or resp.status_code in (401, 403):
            return RetryLater(f"actor answered {resp.status_code}: {response_detail(resp)}", self.retry_backoff_s,
                              counts=True)
        if resp.status_code >= 400:
            detail = response_detail(resp)
            return Rejected(refusal_reason(detail), f"actor refused an episode's turn ({resp.status_code}): {detail}")
        answer: dict[str, Any] = resp.json()
        return answer

    def _step(self, s: EpisodeState, ep: Any) -> Rejected | None:
        """The environment's answer to the episode's last turn, appended; or the episode ends.
        Rejected (handler_error) when the environment raises or takes past `env_timeout_s`.

        At a budget (max_turns, max_episode_tokens, episode_timeout_s) the episode ends either
        way: done when its last answer finished it (no tool call; the environment says done),
        else truncated by that budget, with nothing appended (a trajectory ends with the
        model's tokens). With tools, the calls of such a last answer are not run."""
        used = len(ep.prompt_ids) + len(ep.token_ids)
        limit = ("turns" if s.turn >= self.a.max_turns else "tokens" if used >= self.a.max_episode_tokens
                 else "time" if self._past_time(s) else None)
        if limit is not None and self.a.tools:
            self._ended(s, ep, limit if agents.TOOL_CALL.search(ep.messages[-1].content) else "done")
            return None
        conversation = [agents._msg(m) for m in ep.messages]

        def step() -> tuple[Any, Any, Any, Any]:
            assert self.factory is not None
            env = agents.rebuilt(self.factory, s.prompt, ep.env_state)
            new, reward, done = env.step(conversation)
            return new, reward, done, agents.env_state(env)

        t0 = time.perf_counter()
        try:
            if self.env_spec is not None:
                answer = self._in_pool("env_step", {"row": agents.row_of(s.prompt), "state": ep.env_state,
                                                    "messages": conversation})
                new, reward, done, ep.env_state = answer["messages"], answer["reward"], answer["done"], \
                    answer["state"]
            elif self.pool is not None:   # tools: our ToolEnv here, each call in the pool
                assert self.factory is not None
                new, reward, done = self.factory().step(conversation)
            else:
                new, reward, done, ep.env_state = agents.within(step, self.a.env_timeout_s, "env-step")
        except Exception as e:  # noqa: BLE001 - the user's environment: its group goes to rl.dlq
            return self._refused(f"step at turn {s.turn}", e)
        finally:
            agent_metrics.env_call("step", time.perf_counter() - t0)
        if reward is not None:
            ep.reward = self._reward(reward, s)
        if done or not new:
            self._ended(s, ep, "done")
            return None
        if limit is not None:
            self._ended(s, ep, limit)
            return None
        try:
            ids = agents.delta_ids(self.tok, new)
            if used + len(ids) >= self.a.max_episode_tokens:   # no room for another turn
                self._ended(s, ep, "tokens")
                return None
            agents.add_observation(ep, new, ids)
        except Exception as e:  # noqa: BLE001 - not a list of {role, content} messages the template renders
            return self._refused(f"step at turn {s.turn} returned messages the worker cannot use:", e, bad=True)
        return None


    def _past_time(self, s: EpisodeState) -> bool:
        """Whether `s`'s episodes have used their wall-clock budget (from the group's start)."""
        return now_ms() - s.started_ms >= self.a.episode_timeout_s * 1000

    def group(self, s: EpisodeState) -> list[Output] | Rejected:
        """The finished group of `s` to rl.rollouts, less its truncated episodes with
        `truncated: drop` (counted); Rejected (rejected) when that leaves none."""
        drop = self.a.truncated == "drop"
        g = agents.finished(s, drop_truncated=drop)
        if drop:
            for ep in s.episodes:
                if ep.truncated:
                    DROPPED.labels(ep.truncated).inc()
        if g is None:
            hows = ", ".join(f"{h} x{n}" for h, n in sorted(collections.Counter(e.truncated or "" for e in
                                                                                s.episodes).items()))
            return Rejected(DLQReason.rejected, f"all {len(s.episodes)} episodes were truncated ({hows}) and "
                                                "rollout.agent.truncated is drop")
        return [Output("rl.rollouts", s.prompt_id, g)]


class EnvFailed(Exception):
    """The environment's reset or step failed in its pool process: raised, timed out, crashed its
    process, or answered past MAX_ENV_RESULT_CHARS (`outcome`)."""

    def __init__(self, r: CallResult, name: str, timeout_s: float):
        self.outcome = r.outcome
        text = r.text.removeprefix(f"{name} ")   # the pool's text names it: the detail names it once
        how = {"error": f"raised {text}",
               "timeout": f"did not answer within {timeout_s:g} s (its process was killed and replaced)"}
        super().__init__(how.get(r.outcome, text))


def make_episode_handler(runner: EpisodeRunner) -> BatchHandler:
    """[(Prompt | EpisodeState, meta)] -> per record [Output(rl.episodes) | Output(rl.rollouts)],
    a RetryLater (the actor) or a Rejected (the actor refused a turn, the environment raised or
    took past env_timeout_s)."""

    def handle_batch(items: list[tuple[Contract, Meta]]) -> list[list[Output] | RetryLater | Rejected]:
        states: list[EpisodeState | Rejected] = []
        for v, _ in items:   # copies: a call the stage repeats (alone) starts from the record again
            states.append(runner.start(v) if isinstance(v, Prompt)
                          else v.model_copy(deep=True))  # type: ignore[arg-type]
        live = [s for s in states if isinstance(s, EpisodeState)]
        try:
            done = dict(zip((id(s) for s in live), runner.turn(live), strict=True))
        except RetryLater:
            raise
        except Exception as e:  # noqa: BLE001 - the tokenizer, not the environment: the stage retries each alone
            raise RuntimeError(f"episode turn failed: {type(e).__name__}: {e}") from e
        results: list[list[Output] | RetryLater | Rejected] = []
        for s in states:
            r = s if isinstance(s, Rejected) else done[id(s)]
            if not isinstance(r, EpisodeState):
                results.append(r)
                continue
            runner.count(r)
            if all(ep.done for ep in r.episodes):
                results.append(runner.group(r))
            else:
                results.append([Output("rl.episodes", r.prompt_id, r)])
        return results

    return handle_batch
