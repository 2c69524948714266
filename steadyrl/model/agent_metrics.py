"""The rollout worker's metrics of multi-turn episodes (docs/agents.md "Seen from outside",
docs/metrics.md), in one place: the tools (steadyrl/model/agents.py) and the episode loop
(services/rollout/episodes.py) count through the functions here, never through the metric
objects, so a label's values stay bounded and each figure is counted the same way everywhere.

- `tool_call(tool, outcome, seconds)`: one tool call of an answer, once per call.
- `env_call(call, seconds)`: one environment (or tools) reset or step.
- `episode_finished(turns, tokens, how)`: one episode, once its group's state is written.

A tool label is the name of a tool the worker offers, or `unknown` (a call the model made to a
name it was not offered, or that named none): the model writes whatever name it likes, and
a label per made-up name would grow without bound.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from prometheus_client import Counter, Histogram

log = logging.getLogger(__name__)

#: Outcomes of a tool call. ok: the tool answered; cut: it answered past MAX_TOOL_RESULT_CHARS
#: and the model got the start (cut in the tool's process); invalid: the model's call was not JSON, named
#: no or an unknown tool, or had arguments that do not fit (not run); error: the tool raised;
#: timeout: it did not answer within tool_timeout_s, or the answer's calls had used
#: tool_turn_timeout_s (not run); over_limit: past max_tool_calls (not run); crash: the process
#: running it died; too_large: its result was too large to take.
OUTCOMES = ("ok", "cut", "invalid", "error", "timeout", "over_limit", "crash", "too_large")
#: Why an episode ended before the environment said done.
TRUNCATED_REASONS = ("turns", "tokens", "time")
UNKNOWN_TOOL = "unknown"

TOOL_CALLS = Counter("steadyrl_rollout_tool_calls", "Tool calls answers made, by tool and outcome (ok, cut, invalid, "
                     "error, timeout, over_limit, crash, too_large); a turn run again counts again",
                     ["tool", "outcome"])
TOOL_SECONDS = Histogram("steadyrl_rollout_tool_call_seconds", "Time of one tool call that ran, by tool",
                         ["tool"], buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60))
ENV_SECONDS = Histogram("steadyrl_rollout_env_step_seconds", "Time of one environment or tools call of an "
                        "episode, by call (reset, step)", ["call"],
                        buckets=(0.001, 0.01, 0.1, 0.5, 1, 5, 10, 30, 60))
TURNS_PER_EPISODE = Histogram("steadyrl_rollout_turns_per_episode", "Assistant turns of each finished episode",
                              buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64))
EPISODE_TOKENS = Histogram("steadyrl_rollout_episode_tokens", "Tokens of each finished episode: prompt and "
                           "trajectory (what max_episode_tokens bounds)",
                           buckets=(64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768))
TRUNCATED = Counter("steadyrl_rollout_episodes_truncated", "Episodes ended before the environment said done, by "
                    "reason (turns: max_turns, tokens: max_episode_tokens, time: the wall-clock budget)",
                    ["reason"])

for _reason in TRUNCATED_REASONS:   # present at 0: a rate over them reads 0, not "no data"
    TRUNCATED.labels(_reason)
for _call in ("reset", "step"):
    ENV_SECONDS.labels(_call)


def tool_label(name: str, offered: Iterable[str]) -> str:
    """The `tool` label of a call to `name`: itself when the worker offers it, else `unknown`."""
    return name if name and name in set(offered) else UNKNOWN_TOOL


def offered(tools: Iterable[str]) -> None:
    """Make the series of each offered tool and outcome that ran (or was invalid) exist at 0, so
    the alerts' and the dashboard's increases see the first crash or error too (an increase()
    over a series that appears with 1 reads 0), and read 0 before the first call (call once at
    the worker's start)."""
    for t in [*tools, UNKNOWN_TOOL]:
        for outcome in ("ok", "cut", "invalid", "error", "timeout", "crash", "too_large"):
            TOOL_CALLS.labels(t, outcome)


def tool_call(tool: str, outcome: str, seconds: float | None = None) -> None:
    """Count one tool call of an answer. `tool`: `tool_label(...)`; `outcome`: one of OUTCOMES
    (a new outcome is added there first: another is counted as `error`, with a warning, rather
    than cost the episode its turn); `seconds`: how long it ran, for a call that ran (ok, error,
    timeout, crash, too_large), None for one that did not."""
    if outcome not in OUTCOMES:
        log.warning("tool call outcome %r is not one of %s: counted as error", outcome, ", ".join(OUTCOMES))
        outcome = "error"
    TOOL_CALLS.labels(tool, outcome).inc()
    if seconds is not None:
        TOOL_SECONDS.labels(tool).observe(seconds)


def env_call(call: str, seconds: float) -> None:
    """Time one environment call: `reset` or `step` (with its rebuild and get_state)."""
    ENV_SECONDS.labels(call).observe(seconds)


def episode_finished(turns: int, tokens: int, how: str) -> None:
    """One finished episode: its assistant turns, its tokens (prompt + trajectory) and how it
    ended (`done`, or a TRUNCATED_REASONS reason, counted as truncated)."""
    TURNS_PER_EPISODE.observe(turns)
    EPISODE_TOKENS.observe(tokens)
    if how != "done":
        TRUNCATED.labels(how).inc()
