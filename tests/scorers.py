"""Rule scorers for tests, loaded by the reward server as `tests.scorers:<name>`."""

from __future__ import annotations

import os
import threading
import time

from steadyrl.model.rewards import tiny_copy

_lock = threading.Lock()


def inflating_tiny_copy(data_source: str, solution_str: str, ground_truth: str,
                        extra_info: dict | None = None) -> float:
    """tiny_copy's reward, plus 4.0 for the next N items once the file named by
    $STEADYRL_TEST_INFLATE holds N (a reward server that starts inflating mid-run). While a
    file of that name plus `.slow` exists, each item takes 50 ms more (about 3 s a tiny step),
    so the run cannot end before the test has done what it does mid-run."""
    reward = tiny_copy(data_source, solution_str, ground_truth, extra_info)
    path = os.environ.get("STEADYRL_TEST_INFLATE")
    if not path:
        return reward
    if os.path.exists(path + ".slow"):
        time.sleep(0.05)
    with _lock:
        try:
            with open(path) as f:
                left = int(f.read().strip() or 0)
        except (OSError, ValueError):
            return reward
        if left <= 0:
            return reward
        with open(path, "w") as f:
            f.write(str(left - 1))
    return reward + 4.0


def strict_tiny_copy(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """A stricter tiny_copy: 1.0 only when all of the first 4 characters equal `ground_truth`,
    else 0.0 (tiny_copy gives partial credit, 0.25 per matching character). docs/replay.md
    switches the reward server to it mid-run, then replays across the switch."""
    return float(tiny_copy(data_source, solution_str, ground_truth, extra_info) == 1.0)


def refusing_tiny_copy(data_source: str, solution_str: str, ground_truth: str,
                       extra_info: dict | None = None) -> float:
    """tiny_copy, except that it raises on every item whose ground truth is `refuse`: a scorer
    that cannot score some rows, whatever the sample (the reward worker sends their groups to
    rl.dlq every time)."""
    if ground_truth == "refuse":
        raise ValueError("this row cannot be scored")
    return tiny_copy(data_source, solution_str, ground_truth, extra_info)
