"""The learner's per-step figures on /metrics (docs/metrics.md): reward, tokens/s, the
trainer's metrics under verl's names (with the train/inference mismatch and TIS figures,
`steadyrl_learner_train{metric="mismatch/kl"}`, ...), phase timings, per-layer drift and the
KL trend."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Gauge, Histogram

from steadyrl.run.runfolder import Count
from steadyrl.wire.contracts import ScoredGroup

from .drift import ParamDrift, kl_trend
from .state import RunState

if TYPE_CHECKING:
    import torch

    from steadyrl.run.ckpt_writer import AsyncCheckpointer

REWARD_MEAN = Gauge("steadyrl_learner_reward_mean", "Mean reward of the last step's batch")
REWARD_STD = Gauge("steadyrl_learner_reward_std", "Reward standard deviation of the last step's batch")
TOKENS_PER_S = Gauge("steadyrl_learner_tokens_per_second", "Response tokens trained per wall second, last step")
STEP_SECONDS = Histogram("steadyrl_learner_step_seconds", "Wall time between steps",
                         buckets=(0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600))
TRAIN_METRIC = Gauge("steadyrl_learner_train", "Last step's trainer metrics (verl names)", ["metric"])
TRAINED_BY_SOURCE = Counter("steadyrl_learner_trained_groups", "Groups trained on, by where their reward came from",
                            ["reward_source"])
SAMPLE_AGE = Histogram("steadyrl_rollout_sample_age_seconds", "Age of a trained group: from generation to the "
                       "update that uses it", buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600))
PARAM_DRIFT = Gauge("steadyrl_learner_param_drift", "||theta_l - theta0_l|| / ||theta0_l|| per layer, from the "
                    "weights as loaded (services/learner/drift.py)", ["layer"])
KL_SLOPE = Gauge("steadyrl_learner_kl_slope", "Theil-Sen slope of actor/kl_ref per step over the last 20 steps")
KL_TREND_P = Gauge("steadyrl_learner_kl_trend_pvalue", "Mann-Kendall p-value of actor/kl_ref over the last 20 steps")
REWARDS = Histogram("steadyrl_learner_reward", "Per-sample rewards of the trained batches (the reward distribution)",
                    buckets=(-1, -0.5, 0, 0.1, 0.25, 0.5, 0.75, 0.9, 1, 2, 5, 10))
PHASE_SECONDS = Gauge("steadyrl_learner_phase_seconds", "Last step's time per phase: waiting for groups (wait), "
                      "the trainer's passes (old_log_prob, ref, update_actor, train_step), publish_policy", ["phase"])
OOM_FALLBACKS = Counter("steadyrl_learner_oom_fallbacks",
                        "Steps that ran out of memory and were retried in the safe mode")
LAST_VERIFIED_CHECKPOINT = Gauge("steadyrl_learner_last_verified_checkpoint_step",
                                 "Step of the newest checkpoint that verified after it was written (or that the "
                                 "resume verified); 0 before the run's first")
CHECKPOINT_EVERY = Gauge("steadyrl_learner_checkpoint_every", "learner.checkpoint_every: steps between checkpoints")
LAST_VERIFIED_CHECKPOINT_TIME = Gauge("steadyrl_learner_last_verified_checkpoint_timestamp_seconds",
                                      "Unix time the newest verified checkpoint was written (its manifest.json's "
                                      "mtime); NaN before the run's first")
PLANNED_STEPS = Gauge("steadyrl_learner_planned_steps", "learner.steps: the step the run ends at (progress, ETA)")
POLICY_LAG = Gauge("steadyrl_learner_policy_lag", "Policy versions between the weights that generated the last "
                   "step's oldest group and the weights that step updated (0: on-policy)")

#: The train/inference mismatch (steadyrl.rl.core.mismatch_metrics, over the step's fresh groups)
#: and the TIS weights (where TrainConfig.rollout_is weighs): a step without them sets NaN, not
#: the last step's figure.
MISMATCH = ("mismatch/mean_abs_logp_diff", "mismatch/kl", "mismatch/ratio_outside_frac",
            "rollout_is/mean_weight", "rollout_is/clipped_frac")
EXPORTED = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm",
            "actor/kl_ref", "actor/lr", "critic/advantages/var", "response_length/mean", "critic/vf_loss",
            "perf/safe_mode", *MISMATCH)


def blank_step_gauges() -> None:
    """Per-step figures that mean nothing before a step or after the run: NaN, so alert rules
    (RewardStdHigh, KLDrift) see no value rather than a stale or a zero one."""
    for g in (REWARD_MEAN, REWARD_STD, KL_SLOPE, KL_TREND_P, TOKENS_PER_S, POLICY_LAG):
        g.set(float("nan"))


def export_step(row: dict[str, Any], metrics: dict[str, float], batch: list[ScoredGroup],
                history: list[dict[str, Any]], drift: ParamDrift, model: torch.nn.Module, wait_s: float,
                publish_s: float) -> None:
    """One step's figures: `row` (the history row), the trainer's `metrics`, the trained
    groups, the run's history (KL trend over the last 20 steps) and the phase seconds."""
    STEP_SECONDS.observe(row["seconds"])
    PHASE_SECONDS.labels("wait").set(wait_s)
    PHASE_SECONDS.labels("publish_policy").set(publish_s)
    for k, v in metrics.items():
        if k.startswith("timing_s/"):
            PHASE_SECONDS.labels(k.removeprefix("timing_s/")).set(v)
    for layer, d in drift.measure(model).items():
        PARAM_DRIFT.labels(layer).set(d)
    trend = kl_trend([h["actor/kl_ref"] for h in history[-20:] if "actor/kl_ref" in h])
    if trend is not None:
        KL_SLOPE.set(trend[0])
        KL_TREND_P.set(trend[1])
    REWARD_MEAN.set(row["reward_mean"])
    for sg in batch:
        for r in sg.rewards:
            REWARDS.observe(r)
    REWARD_STD.set(row["reward_std"])
    TOKENS_PER_S.set(row["tokens_per_s"])
    if row["policy_versions"]:  # the step updated version row["step"] - 1
        POLICY_LAG.set(row["step"] - 1 - min(row["policy_versions"]))
    for k in EXPORTED:
        if k in metrics:
            TRAIN_METRIC.labels(k).set(metrics[k])
        elif k in MISMATCH:  # not measured this step (only stale groups; TIS off): no value
            TRAIN_METRIC.labels(k).set(float("nan"))


def export_checkpoints(saver: AsyncCheckpointer, every: int, steps: int) -> None:
    """The checkpoint gauges: the newest verified step and when it was written, read from
    `saver` (an AsyncCheckpointer) at each scrape, and learner.checkpoint_every; and
    learner.steps (`steps`), the run's planned end."""
    LAST_VERIFIED_CHECKPOINT.set_function(lambda: float(saver.last_verified_step or 0))
    LAST_VERIFIED_CHECKPOINT_TIME.set_function(lambda: verified_at(saver))
    CHECKPOINT_EVERY.set(every)
    PLANNED_STEPS.set(steps)


def verified_at(saver: AsyncCheckpointer) -> float:
    """Unix time the newest verified checkpoint of `saver` was written (the mtime of its
    manifest.json, the last file written before the folder is renamed into place); NaN when
    none verified or the folder is gone."""
    step = saver.last_verified_step
    if step is None:
        return float("nan")
    try:
        return (saver.root / f"step_{step:06d}" / "manifest.json").stat().st_mtime
    except OSError:
        return float("nan")


def count_trained(st: RunState, metrics: dict[str, float], groups: list[ScoredGroup]) -> None:
    """Count the trained groups by reward source (and cache-scored ones in the run), and an
    out-of-memory fallback of the step."""
    sources = [sg.reward_source.value for sg in groups]
    for source in set(sources):
        TRAINED_BY_SOURCE.labels(source).inc(sources.count(source))
    if "cache" in sources:
        st.count(Count.cache_scored, sources.count("cache"))
    if metrics.get("perf/oom_fallback"):
        OOM_FALLBACKS.inc()
        st.count(Count.oom_fallback)
