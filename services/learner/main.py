"""`python -m steadyrl.services.learner`: the learner process, its probes and `GET /progress`.

/readyz checks real things: `model` (the weights are loaded and version `step` is in the
policy store), `assignment` (the consumer holds every partition of rl.scored and rl.releases) and `progress`
(not stalled: services/learner/stall.py, the rule behind `steadyrl_learner_stalled`) and `disk`
(no write waits for space: steadyrl/run/diskspace.py). /livez says what the loop is at (`doing`:
its phase, and an evaluation's split and row), so a hang is named where it stopped.
"""

from __future__ import annotations

import logging
import os
import signal
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch

from steadyrl import logs
from steadyrl.config import ConfigError, load
from steadyrl.model.models import load_policy
from steadyrl.rl import distributed
from steadyrl.rl.trainer import Trainer
from steadyrl.run import diskspace
from steadyrl.run.ckpt_writer import ShardWriter
from steadyrl.service import run_service

from .config import LearnerConfig
from .loop import Learner

if TYPE_CHECKING:
    from fastapi import FastAPI

    from steadyrl.http import Health


def main(argv: list[str]) -> int:
    cfg = load(LearnerConfig, argv, prog="steadyrl-learner")
    if cfg.learner.world_size > 1 and "RANK" not in os.environ:
        # one GPU per rank, refused here rather than in N ranks
        if cfg.learner.train.device == "cuda" and torch.cuda.device_count() < cfg.learner.world_size:
            raise ConfigError(f"learner.world_size is {cfg.learner.world_size} with learner.train.device cuda, "
                              f"but {torch.cuda.device_count()} GPUs are visible: one rank per GPU")
        launch = distributed.torchrun_argv(cfg.learner.world_size, "steadyrl.services.learner", argv)
        logging.getLogger(__name__).info("starting the learner's ranks under torchrun",
                                         extra={"world_size": cfg.learner.world_size})
        os.execv(launch[0], launch)  # the same process, now torchrun; it starts the N ranks
    # under torchrun: rank 0 is this service, the others follow it
    rank, world = distributed.init_from_env(device=cfg.learner.train.device)
    try:
        return follower(cfg) if rank > 0 else leader(cfg, world)
    finally:
        distributed.leave()


def leader(cfg: LearnerConfig, world: int) -> int:
    """Rank 0 (the only rank when world is 1): the learner service, its probes and /progress."""
    state: dict[str, Learner] = {}

    def routes(app: FastAPI) -> None:
        @app.get("/progress")
        def progress() -> dict[str, Any]:
            learner = state.get("learner")
            return learner.progress if learner else {"phase": "loading", "done": False}

    def build(health: Health) -> Learner:
        learner = Learner(cfg, health)
        state["learner"] = learner
        health.add_check("model", lambda: model_check(learner))
        health.add_check("assignment", lambda: assignment_check(learner))
        health.add_check("progress", lambda: progress_check(learner))
        health.add_check("disk", diskspace.readiness)   # not ready while a write waits for space
        health.doing = learner.doing   # /livez says where a hung loop stopped (an evaluation's split and row)
        return learner

    try:
        return run_service("learner", cfg, build, extra_routes=routes)
    finally:
        learner = state.get("learner")
        if world > 1 and learner is not None and learner.ranks is not None:
            try:
                learner.ranks.stop()
            except RuntimeError as e:  # a follower is gone (killed): torchrun ends the group anyway
                if (line := distributed.broken_group(e)) is None:
                    raise
                logging.getLogger(__name__).warning("could not tell the other ranks to stop", extra={"error": line})


def follower(cfg: LearnerConfig) -> int:
    """Ranks 1..N-1 (steadyrl/rl/distributed.py): the same model and trainer as rank 0, no
    Kafka, no HTTP; each update's batch comes from rank 0."""
    logs.setup("learner-follower", cfg.log_level, cfg.log_format)
    log = logging.getLogger(__name__)

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        # torchrun passes a stop to every rank at once; rank 0 finishes its step and then
        # sends "stop", which this rank waits for (its step's collectives need it until then)
        log.info("stop requested; waiting for rank 0 to end the run", extra={"signal": signal.Signals(signum).name})

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    lc = cfg.learner
    torch.manual_seed(lc.seed)
    model, tok = load_policy(lc.model, seed=lc.seed)

    try:
        trainer = Trainer(model, tok.pad_token_id, lc.train)
        writer = ShardWriter() if trainer.sharded else None
        return distributed.follow(trainer, writer)
    except RuntimeError as e:
        if (line := distributed.broken_group(e)) is None:
            raise
        # the group broke (another rank died): one line, not a traceback; torchrun restarts it
        log.error("the group broke", extra={"error": line})
        return 1


def model_check(learner: Learner) -> tuple[bool, str]:
    """Ready when the weights are loaded and the version the state names was published."""
    st = learner.state
    if learner.model is None or not st.policy_uri:
        return False, f"{learner.lc.model}: no policy version published yet"
    return True, f"{learner.lc.model} loaded; run {st.run_id} step {st.step} ({st.policy_uri})"


def assignment_check(learner: Learner) -> tuple[bool, str]:
    """Ready when the consumer holds every partition of rl.scored and rl.releases (and rl.dlq): what the loop
    assigned (`learner.assigned`, kept by the loop's thread; empty before run() and once it
    ends). Never asks the consumer: `assignment()` from this thread blocks while the loop
    polls an idle consumer (librdkafka 2.16), which hung /readyz, and /metrics with it, exactly
    while the learner was starved."""
    parts = list(learner.assigned)
    if not parts:
        return False, "not reading rl.scored" + (" yet" if learner.consumer is None else " (consumer closed)")
    scored = sum(1 for tp in parts if tp.topic == learner.topics["rl.scored"])
    if scored == 0 or scored < len(learner.state.offsets):
        return False, f"{scored} of {len(learner.state.offsets)} partitions of rl.scored assigned"
    releases = sum(1 for tp in parts if tp.topic == learner.topics["rl.releases"])
    if releases == 0 or releases < len(learner.state.release_offsets):
        return False, f"{releases} of {len(learner.state.release_offsets)} partitions of rl.releases assigned"
    return True, f"{scored} partitions of rl.scored and {releases} of rl.releases assigned"


def progress_check(learner: Learner) -> tuple[bool, str]:
    """Ready unless stalled: waiting or training with prompts in flight and no step for longer
    than max(stall_factor x median step seconds, stall_min_s) (services/learner/stall.py)."""
    stalled, detail = learner.stall.check(learner.progress["phase"], len(learner.state.in_flight))
    return not stalled, detail
