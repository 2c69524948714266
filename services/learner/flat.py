"""Steps without a learning signal: every group of the step scored alike.

With group-relative advantages (GRPO, Dr. GRPO, DAPO: (r - mean_group) / (std_group + eps)) a
group whose samples all got the same reward has advantage 0 on every token; when every group
of a step is so, the policy loss and its gradient are 0 and the step changes nothing (a random
tiny model scored 0 everywhere: grad_norm 0 and an exported model equal to the base). PPO's
advantages then come only from its critic's error. `FlatSteps.seen` says so once, and again
only when it changes (the rewards seen, or a step with signal came between); the learner
counts such steps (`counts.flat_reward_steps`). See docs/rl.md.
"""

from __future__ import annotations

from collections.abc import Sequence

#: Distinct rewards a warning names at most.
SHOWN = 4


def flat_rewards(groups: Sequence[Sequence[float]]) -> tuple[float, ...] | None:
    """The distinct rewards, sorted, when every group's samples all have the same reward (no
    group has any variance); None when one group has two different rewards."""
    if not groups or any(any(r != g[0] for r in g) for g in groups):
        return None
    return tuple(sorted({float(g[0]) for g in groups if g}))


def _show(values: tuple[float, ...]) -> str:
    shown = ", ".join(str(round(v, 6)) for v in values[:SHOWN])
    return shown + (", ..." if len(values) > SHOWN else "")


class FlatSteps:
    """Warns about steps whose groups all scored alike: once, then only when it changes."""

    def __init__(self) -> None:
        self.last: tuple[float, ...] | None = None   # the rewards of the last warning; None: a step had signal

    def seen(self, groups: Sequence[Sequence[float]]) -> tuple[bool, str | None]:
        """(this step was flat, the warning to log now or None) for one step's groups' rewards."""
        values = flat_rewards(groups)
        if values is None:
            self.last = None
            return False, None
        if values == self.last:
            return True, None
        self.last = values
        n = len(groups)
        if len(values) == 1:
            what = f"all {n} groups scored alike (every reward {_show(values)})"
        else:
            what = f"every one of the {n} groups scored its samples alike (rewards {_show(values)})"
        return True, (f"{what}: no learning signal this step (group-relative advantages are 0); "
                      f"see docs/rl.md#when-every-sample-scores-alike")
