"""The learner's disk at start: what it writes where, the room a run needs, the temporaries of
ended processes, and the free-space report (steadyrl/run/diskspace.py).

    <state_dir>                      CURRENT, the run folders
    <state_dir>/<run>/checkpoints    step_NNNNNN/ (weights + optimizer), LATEST
    <state_dir>/<run>/rollout-cache  the Arrow parts
    <policy_root>/<run>/vNNNNNN/     the policy versions
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from steadyrl.run import diskspace
from steadyrl.run.policy_files import RUN_ID
from steadyrl.run.tensors import unique_tensors

if TYPE_CHECKING:
    import torch

    from steadyrl.http import Health

    from .config import LearnerSection

log = logging.getLogger("steadyrl.learner")

#: a checkpoint holds the weights and the optimizer's state: AdamW's two moments, each the
#: size of the weights (fp32 like them)
CHECKPOINT_FACTOR = 3


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights (its state dict, each storage once): one policy version."""
    return sum(t.numel() * t.element_size() for t in unique_tensors(model.state_dict()).values())


def volumes(lc: LearnerSection, run_dir: Path) -> dict[str, Path]:
    """The folders the learner writes, by the setting (or part) that names them."""
    return {"state_dir": lc.state_dir, "policy_root": lc.policy_root, "checkpoints": run_dir / "checkpoints",
            "rollout_cache": run_dir / "rollout-cache"}


def needs(lc: LearnerSection, run_dir: Path, run_id: str, weights: int) -> list[tuple[str, Path, int, int]]:
    """What the run needs to hold (diskspace.refuse_small's rows): two checkpoints under the
    run's folder and two policy versions under the policy root, each less what this run already
    holds there (a resumed run's checkpoints and versions, which its writers replace)."""
    return [("learner.state_dir", lc.state_dir, 2 * CHECKPOINT_FACTOR * weights,
             diskspace.tree_bytes(run_dir / "checkpoints")),
            ("learner.policy_root", lc.policy_root, 2 * weights, diskspace.tree_bytes(lc.policy_root / run_id))]


def clean(lc: LearnerSection, run_dir: Path) -> list[Path]:
    """Remove the write temporaries of this pid and of dead pids (diskspace.clean_temporaries)
    in every folder the learner writes them: the state dir, each run folder and its
    checkpoints, the policy root and each run's folder there. Returns what was removed."""
    folders = [lc.state_dir, run_dir, run_dir / "checkpoints", lc.policy_root]
    for parent in (lc.state_dir, lc.policy_root):
        if parent.is_dir():
            folders += [p for p in parent.iterdir() if p.is_dir() and RUN_ID.fullmatch(p.name)]
            folders += [p / "checkpoints" for p in parent.iterdir() if p.is_dir() and RUN_ID.fullmatch(p.name)]
    gone: list[Path] = []
    for folder in dict.fromkeys(folders):
        gone += diskspace.clean_temporaries(folder)
    return gone


def prepare(lc: LearnerSection, model: torch.nn.Module, health: Health, run_dir: Path, run_id: str) -> None:
    """At start, before the run's first version or checkpoint is written: the heartbeat for
    the disk waits (`health.beat`; /readyz's `disk` check is services/learner/main.py's), the
    free-space gauges of every volume written (steadyrl_disk_free_bytes{volume}), the
    temporaries of ended processes removed, and the room check. Raises
    steadyrl.config.ConfigError (exit 2, naming the folder) when a volume cannot hold two
    checkpoints and two policy versions of `model`."""
    diskspace.set_beat(health.beat)
    for name, path in volumes(lc, run_dir).items():
        diskspace.watch(name, path)
    clean(lc, run_dir)
    weights = param_bytes(model)
    diskspace.refuse_small(needs(lc, run_dir, run_id, weights))
    log.info("disk space", extra={"weights_bytes": weights, **{
        f"{name}_free_bytes": diskspace.usage(path)[0] for name, path in volumes(lc, run_dir).items()}})
