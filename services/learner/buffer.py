"""The learner's train buffer: scored groups waiting for an update, bounded.

Groups read from rl.scored wait in the buffer until B of them make a step. It holds at most
`max_buffer_size` groups (default 64; the feeder keeps (max_staleness + 1) x B prompts in
flight, so it fills past that only when released quarantine batches or duplicates arrive at
once). When a new group would make it larger, one waiting group is evicted:

    fifo       the first to arrive: the group that waited longest goes first
    priority   the one with the least learning signal, mean |r_i - mean(r)| over its samples
               (the group-relative advantage before scaling, Dr. GRPO eq. 4 of Liu et al.
               2025); a group whose samples all got the same reward has none. Ties: oldest.

An evicted group's prompt is published again (a new seed), so it is still trained exactly
once: eviction costs generation time, never a prompt. Released groups are never evicted
(they cannot be generated again as they were), nor a prompt's group after MAX_EVICTIONS (2)
evictions: a prompt whose groups never carry signal (always all right or all wrong) is
trained as it is rather than generated forever. Exempt groups can hold the buffer above its
bound, by at most the prompts in flight.

`fifo` means arrival order (not the feeder's): a group generated again after an eviction
arrives last, so it is not the next one out.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Literal

Eviction = Literal["fifo", "priority"]
MAX_EVICTIONS = 2


def mean_abs_advantage(rewards: list[float]) -> float:
    """mean_i |r_i - mean(r)| of one group's rewards, (G,) -> scalar, reward units."""
    mean = sum(rewards) / len(rewards)
    return sum(abs(r - mean) for r in rewards) / len(rewards)


def evictions(waiting: dict[str, tuple[int, list[float], bool]], max_size: int, policy: Eviction) -> list[str]:
    """Prompt ids to evict so that at most `max_size` groups remain.

    Args:
        waiting: prompt_id -> (arrival order, rewards (G,), exempt) of every group in the buffer;
            exempt groups (released, or evicted MAX_EVICTIONS times) are never chosen.
        max_size: the bound (>= 1).
        policy: fifo or priority (see the module doc).
    Returns the ids to evict (empty when len(waiting) <= max_size), in eviction order.
    Raises ValueError for an unknown policy.
    """
    if policy not in ("fifo", "priority"):
        raise ValueError(f"buffer eviction must be fifo or priority, got {policy!r}")
    over = len(waiting) - max_size
    if over <= 0:
        return []
    candidates = [pid for pid, (_, _, exempt) in waiting.items() if not exempt]
    if policy == "fifo":
        order = sorted(candidates, key=lambda pid: waiting[pid][0])
    else:
        order = sorted(candidates, key=lambda pid: (mean_abs_advantage(waiting[pid][1]), waiting[pid][0]))
    return order[:over]


def next_batch(ready: Collection[str], in_flight: Mapping[str, tuple[int, float]], size: int,
               not_coming: Collection[str], straggler_s: float) -> list[str] | None:
    """The prompt ids of the next update, in feed order, or None while one of them is still coming.

    The update takes the `size` oldest prompts in flight (by feed order), not the first groups
    to arrive: which groups arrive first depends on timing (partitions, workers, polls), and a
    step that trained on them made two runs of one seed part at their first step. A prompt
    whose group is not coming for now (`not_coming`: sent back by rl.dlq and waiting to go
    out again) is passed over, and so is a straggler, in flight for `straggler_s` or longer
    since its last publish: a slow prompt costs the order, never the step.

    Args:
        ready: ids whose scored group waits in the train buffer.
        in_flight: id -> (feed order, seconds since its last publish) of every prompt in flight;
            every id of `ready` is among them.
        size: B, groups per update (>= 1).
        not_coming: ids queued to be published again.
        straggler_s: the age past which a missing prompt is passed over, seconds.
    Returns `size` ids, all in `ready`, oldest first; None when fewer are ready or an older
    prompt, not passed over, has no group yet.
    """
    if len(ready) < size:
        return None
    take: list[str] = []
    for pid in sorted(in_flight, key=lambda p: in_flight[p][0]):
        if pid in ready:
            take.append(pid)
            if len(take) == size:
                return take
        elif pid not in not_coming and in_flight[pid][1] < straggler_s:
            return None  # an older prompt's group is still on its way: wait for it
    return None
