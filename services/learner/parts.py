"""Small pieces of the learner that the loop composes: the restorer of saved weights, the
rollout cache of the run, and the history row of one step."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from steadyrl.config import ConfigError
from steadyrl.files import append_lines
from steadyrl.run import checkpoint as ck
from steadyrl.run import diskspace, tensors
from steadyrl.run.rollout_cache import CacheSchemaError, RolloutCache
from steadyrl.wire.contracts import ScoredGroup

from .metrics import EXPORTED
from .state import Ready, RunState

if TYPE_CHECKING:
    import torch

    from steadyrl.rl.trainer import Trainer

    from .policy_store import PolicyStore

log = logging.getLogger("steadyrl.learner")


class Weights:
    """resume.Restorer over the learner's model, trainer (optimizer, LR schedule) and policy store."""

    def __init__(self, model: torch.nn.Module, trainer: Trainer, store: PolicyStore) -> None:
        self.model, self.trainer, self.store = model, trainer, store
        self.checkpoint_step: int | None = None  # the step of the checkpoint restored (verified by resume)

    def from_checkpoint(self, path: Path) -> RunState:
        tr = self.trainer  # sharded: its optimizer holds shards; the whole state goes to them at the sync
        meta = ck.load(path, self.model, None if tr.sharded else tr.opt, tr.sched)
        tr.pending_optimizer = meta.pop("optimizer_state", None)
        self.trainer.global_step = meta["global_step"]
        tensors.set_rng_state(meta["rng"])
        st = RunState.parse(json.dumps(meta["learner_state"]), f"{path}/meta.json learner_state")
        self.checkpoint_step = st.step
        log.warning("resuming run from checkpoint", extra={"run_id": st.run_id, "step": st.step,
                                                           "checkpoint": str(path)})
        return st

    def from_policy(self, st: RunState) -> None:
        self.store.load(self.model, st)
        self.trainer.global_step = st.step
        for _ in range(st.step):
            self.trainer.sched.step()


def open_cache(run_dir: Path, st: RunState, max_file_bytes: int, max_total_bytes: int | None = None,
               retention_h: float | None = None) -> RolloutCache:
    """The run's Arrow rollout cache, without rows of steps after the resumed one, with its
    total cap and retention (learner.rollout_cache_max_bytes, rollout_cache_retention_h).
    Raises ConfigError (exit 2) when the cache was written with another schema."""
    try:
        cache = RolloutCache(run_dir / "rollout-cache", max_file_bytes, max_total_bytes,
                             None if retention_h is None else retention_h * 3600)
    except CacheSchemaError as e:  # cannot resume onto it: say so and stop
        raise ConfigError(f"cannot resume run {st.run_id}: {e}") from None
    if cache.truncate_after(st.step):
        log.warning("rollout cache rows after the resumed step dropped", extra={"step": st.step})
    return cache


#: Trainer metrics kept in the history beside EXPORTED (/metrics'): what the experiment
#: trackers show (services/learner/tracker_kinds.py), under verl's names.
TRACKED = ("critic/advantages/mean", "actor/kl_loss", "actor/pg_clipfrac_lower", "critic/vf_clipfrac",
           "perf/train_tokens_per_s", "perf/oom_fallback")


def history_row(step: int, metrics: dict[str, float], groups: list[ScoredGroup], seconds: float,
                phases: dict[str, float] | None = None) -> dict[str, Any]:
    """One step of `state.json`'s history: reward mean/std, response tokens (and prompt +
    response tokens), wall seconds since the last step, tokens/s, the policy versions trained
    on, cache-scored groups, the unix time, the trainer metrics under verl's names (EXPORTED,
    TRACKED, timing_s/*) and the loop's `phases` (timing_s/wait, timing_s/publish_policy)."""
    lengths = [len(s.token_ids) for sg in groups for s in sg.group.samples]
    prompts = [len(sg.group.prompt_token_ids) for sg in groups for _ in sg.group.samples]
    rewards = [r for sg in groups for r in sg.rewards]
    tokens, total = sum(lengths), sum(lengths) + sum(prompts)
    spread = {"critic/score/max": max(rewards), "critic/score/min": min(rewards),   # verl's, per sample
              "response_length/max": max(lengths), "response_length/min": min(lengths),
              "prompt_length/mean": sum(prompts) / len(prompts), "prompt_length/max": max(prompts),
              "prompt_length/min": min(prompts)} if lengths else {}
    return {"step": step, "reward_mean": metrics["critic/score/mean"], "reward_std": metrics["critic/score/std"],
            "tokens": tokens, "total_tokens": total, "seconds": round(seconds, 3),
            "tokens_per_s": tokens / max(seconds, 1e-9),
            "policy_versions": sorted({sg.group.oldest_version for sg in groups}),   # an episode: its first turn's
            "cache_scored": sum(1 for sg in groups if sg.reward_source.value == "cache"),
            "time": round(time.time(), 3),
            **{k: v for k, v in metrics.items() if k in EXPORTED or k in TRACKED or k.startswith("timing_s/")},
            **spread, **{k: round(v, 6) for k, v in (phases or {}).items()}}


def append_history(run_dir: Path, row: dict[str, Any]) -> None:
    """Append one step's history row to history.jsonl, before the step's state.json is saved
    (so the file holds at least the saved steps; `trim_history` drops any beyond them on resume).
    Written, not fsynced: a row lost to a power cut is one point of a curve, not a prompt. On a
    full disk the row is retried until space returns (steadyrl.run.diskspace.retry); a refused
    write leaves no part of the line."""
    path = run_dir / "history.jsonl"
    diskspace.retry(lambda: append_lines(path, [json.dumps(row)], fsync=False), "history", path)


def append_audit(run_dir: Path, step: int, batch: list[Ready]) -> None:
    """Append the groups trained by `step` to consumed.jsonl (the audit log of exactly-once:
    step, prompt_id, topic (where the trained copy was read: rl.scored, or rl.releases for a
    released group), partition, offset, policy_version, reward_mean), fsynced, all the step's
    lines or none: on a full disk they are retried until space returns (steadyrl.run.diskspace.retry)."""
    path = run_dir / "consumed.jsonl"
    lines = [json.dumps({"step": step, "prompt_id": r.group.prompt_id, "topic": r.topic,
                         "partition": r.partition, "offset": r.offset,
                         "policy_version": r.group.group.policy_version,
                         "reward_mean": sum(r.group.rewards) / len(r.group.rewards)}) for r in batch]
    diskspace.retry(lambda: append_lines(path, lines), "audit", path)
