"""Replaying episodes: an agent's turns in order, from `rl.episodes` (docs/replay.md, docs/agents.md).

A multi-turn group's state is written to `rl.episodes` after each turn (key: prompt_id, so a
group's states keep their order in one partition): its messages so far, token counts, the
policy version of each turn. `read_episodes` reads a time window of them (read_committed: a
turn a killed worker left uncommitted is never seen; the turn run again is), optionally with
the finished groups' last answers and rewards from `rl.scored`, and `format_episodes` prints
each group's conversation turn by turn: what each state added, with the versions and whether
each episode was done.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from steadyrl.replay.window import format_ms, read_contracts
from steadyrl.wire.contracts import EpisodeState, ScoredGroup

#: Longest message shown, characters (the rest is cut, and says so).
SHOWN_CHARS = 400


@dataclass
class EpisodeRecord:
    """One state of a group on the topic."""

    partition: int
    offset: int
    timestamp_ms: int
    state: EpisodeState


@dataclass
class Episodes:
    """What `read_episodes` read: each group's states in turn order, the groups in the order of
    their first state's time; `finals`: prompt_id -> the scored group, when it was in the window."""

    topic: str
    groups: dict[str, list[EpisodeRecord]]
    finals: dict[str, ScoredGroup] = field(default_factory=dict)
    undecodable: dict[str, int] = field(default_factory=dict)
    outside: int = 0


def read_episodes(bootstrap: str, topic: str, t_from_ms: int, t_to_ms: int, prompt_id: str | None = None,
                  scored_topic: str | None = None, timeout_s: float = 30.0) -> Episodes:
    """The `EpisodeState`s of `topic` with timestamps in [t_from_ms, t_to_ms] (only `prompt_id`'s
    when given), and, with `scored_topic`, the same window's scored groups of those prompts (their
    last answers and rewards; a scored topic that does not exist is left out). Raises as
    `read_range`: RuntimeError (no such topic, not read in time), ValueError (from > to)."""
    read = read_contracts(bootstrap, topic, t_from_ms, t_to_ms, EpisodeState, timeout_s)
    groups: dict[str, list[EpisodeRecord]] = {}
    for part, off, ts, value in read.records:
        s = cast(EpisodeState, value)
        if prompt_id is None or s.prompt_id == prompt_id:
            groups.setdefault(s.prompt_id, []).append(EpisodeRecord(part, off, ts, s))
    for states in groups.values():
        states.sort(key=lambda r: (r.state.turn, r.partition, r.offset))
    out = Episodes(topic, groups, undecodable=read.undecodable, outside=read.outside)
    if scored_topic is not None and groups:
        try:
            scored = read_contracts(bootstrap, scored_topic, t_from_ms, t_to_ms, ScoredGroup, timeout_s)
        except RuntimeError:
            return out
        for _, _, _, value in scored.records:
            g = cast(ScoredGroup, value)
            if g.prompt_id in groups:
                out.finals[g.prompt_id] = g
    return out


def _shown(text: str) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + f" [... {len(text) - SHOWN_CHARS} more]"


def format_episodes(eps: Episodes) -> str:
    """Each group's conversation in turn order: per state, per episode, the messages it added
    since the group's previous state in the window (all of them for the first), then the
    episode's turns' policy versions, tokens and whether it was done; then the last answer and
    reward from the scored group, when read."""
    lines = [f"{eps.topic}: {len(eps.groups)} groups, {sum(len(v) for v in eps.groups.values())} states"
             + (f"; skipped {sum(eps.undecodable.values())} undecodable" if eps.undecodable else "")
             + (f", {eps.outside} outside the window" if eps.outside else "")]
    for pid, states in eps.groups.items():
        first = states[0].state
        lines.append("")
        lines.append(f"== {pid}  ({len(first.episodes)} episodes, run {first.prompt.run_id or '-'})")
        seen = [0] * len(first.episodes)
        for r in states:
            s = r.state
            lines.append(f"-- turn {s.turn}  {format_ms(r.timestamp_ms)}  partition {r.partition} offset {r.offset}"
                         + (f"  actor {s.actor}" if s.actor else ""))
            for j, ep in enumerate(s.episodes):
                if j >= len(seen):
                    seen.append(0)
                model = sum(ep.loss_mask)
                lines.append(f"   episode {j}: versions {ep.turn_versions}, {len(ep.token_ids)} tokens "
                             f"({model} the policy's), {'done' if ep.done else 'going on'}"
                             + (f", environment reward {ep.reward:g}" if ep.reward is not None else ""))
                for m in ep.messages[seen[j]:]:
                    lines.append(f"     {m.role}: {_shown(m.content)}")
                seen[j] = len(ep.messages)
        final = eps.finals.get(pid)
        if final is not None:
            lines.append(f"-- finished (on rl.scored, version {final.group.policy_version})")
            for j, (sample, reward) in enumerate(zip(final.group.samples, final.rewards, strict=False)):
                lines.append(f"   episode {j}: reward {reward:g}, versions {sample.turn_versions}; last answer: "
                             f"{_shown(sample.text)}")
    return "\n".join(lines)
