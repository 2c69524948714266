"""The update's algorithm, by name: advantage estimators, policy losses and the minibatch loss.

As verl's `core_algos.py` (`register_adv_est` / `get_adv_estimator_fn`, `register_policy_loss`
/ `get_policy_loss_fn`): each estimator and each policy loss is a function registered under a
name, and `TrainConfig.algorithm` picks one of each through `ALGORITHMS`. The formulas
themselves are `steadyrl.rl.core`'s; this module only composes them.

To add an algorithm: register its estimator and/or its loss below (`@register_adv_estimator`,
`@register_policy_loss`), add an `Algorithm` to `ALGORITHMS`, and a hand-computed test to
tests/steadyrl/rl/test_algos.py. Nothing in the trainer changes.

Shapes: n sequences of a micro-batch (N in the whole batch), T response tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from steadyrl.rl import core


class Settings(Protocol):
    """The hyperparameters estimators and losses read (TrainConfig has them all)."""

    norm_adv_by_std: bool
    gamma: float
    lam: float
    kl_in_reward: bool
    kl_coef: float
    use_kl_loss: bool
    kl_estimator: core.KLEstimator
    clip_low: float
    clip_high: float
    clip_ratio_c: float | None
    loss_agg: core.LossAgg
    entropy_coeff: float
    vf_coef: float
    vf_clip: float


# ---------------------------------------------------------------- advantage estimators

@dataclass
class AdvantageInputs:
    """What an estimator may read about the batch (all on the trainer's device)."""

    rewards: torch.Tensor                  # (N,) one score per sequence
    group_sizes: list[int]                 # sizes of the B groups, sum N (rows in order)
    mask: torch.Tensor                     # (N, T) response tokens
    old_logp: torch.Tensor | None = None   # (N, T) behaviour log-probs (critic estimators only)
    old_values: torch.Tensor | None = None  # (N, T) the critic's values before the update
    ref_logp: torch.Tensor | None = None   # (N, T) the frozen reference (when one is kept)


#: (inputs, settings) -> (advantages (N, T), returns (N, T) for the critic, or None)
AdvantageFn = Callable[[AdvantageInputs, Settings], tuple[torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class AdvantageEstimator:
    fn: AdvantageFn
    critic: bool   # needs the value head: old values before the update, the value loss in it


ADV_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_adv_estimator(name: str, critic: bool = False) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register an advantage estimator under `name` (a ValueError when the name is taken)."""
    def deco(fn: AdvantageFn) -> AdvantageFn:
        if name in ADV_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADV_ESTIMATORS[name] = AdvantageEstimator(fn, critic)
        return fn
    return deco


@register_adv_estimator("grpo")
def grpo_advantages(x: AdvantageInputs, s: Settings) -> tuple[torch.Tensor, None]:
    """GRPO, outcome supervision: A_{i,t} = (r_i - mean(r_group)) / (std(r_group) + eps) on
    every response token (without std when `s.norm_adv_by_std` is False).

    Shao et al. 2024, DeepSeekMath, §4.1.2; `core.grpo_advantages`, `core.outcome_advantages`.
    """
    seq = core.grpo_advantages_by_group(x.rewards, x.group_sizes, s.norm_adv_by_std)   # (N,)
    return core.outcome_advantages(seq, x.mask), None                                 # (N, T)


@register_adv_estimator("dr_grpo")
def dr_grpo_advantages(x: AdvantageInputs, s: Settings) -> tuple[torch.Tensor, None]:
    """Dr. GRPO: A_{i,t} = r_i - mean(r_group), no division by the group's std.

    Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective", §3.2 and
    Figure 1: std(r_group) weighs questions by their difficulty (a group that is almost all
    right or all wrong has a small std, so a large weight); Dr. GRPO removes it. Independent
    of `s.norm_adv_by_std` (the config refuses True with this algorithm).
    """
    seq = core.grpo_advantages_by_group(x.rewards, x.group_sizes, norm_by_std=False)   # (N,)
    return core.outcome_advantages(seq, x.mask), None                                  # (N, T)


@register_adv_estimator("gae", critic=True)
def gae_advantages(x: AdvantageInputs, s: Settings) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's: the score on the last token (minus beta * k1 per token with `kl_in_reward`),
    GAE over the critic's values, then whitened over the whole batch.

    r_t = score [t = T_i - 1] - beta * (log pi_old - log pi_ref)_t     Ziegler et al. 2019, eq. 2
    A, R = GAE(r, V_old; gamma, lambda)                                 Schulman et al. 2016, eq. 16
    A = (A - mean(A)) / std(A)          over every valid token of the batch, as verl (not per minibatch)
    Returns (advantages, returns), (N, T) each.
    """
    assert x.old_values is not None, "gae needs the critic's values (a no-grad pass before the update)"
    rewards = core.last_token_rewards(x.rewards, x.mask)                              # (N, T)
    if s.kl_in_reward:
        assert x.old_logp is not None and x.ref_logp is not None, "kl_in_reward needs old and ref log-probs"
        rewards = core.kl_penalized_rewards(rewards, x.old_logp, x.ref_logp, x.mask, s.kl_coef)
    advantages, returns = core.gae(rewards, x.old_values, x.mask, s.gamma, s.lam)     # (N, T) each
    return core.masked_whiten(advantages, x.mask), returns


# ---------------------------------------------------------------- policy losses

#: (logp, old_logp, advantages, mask, settings, is_weights) -> (scalar loss, metrics); all (n, T).
#: metrics: clip_frac, dual_clip_frac, approx_kl (scalars, no gradient).
PolicyLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Settings, torch.Tensor | None],
                        tuple[torch.Tensor, dict[str, torch.Tensor]]]

POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register a policy loss under `name` (a ValueError when the name is taken)."""
    def deco(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn
    return deco


@register_policy_loss("ppo")
def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  s: Settings, is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate, aggregated as `s.loss_agg` says (verl's "vanilla"; GRPO's too).

    l_t  = max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high)),  r_t = pi / pi_old
           Schulman et al. 2017, eq. 7 (negated: minimised); GRPO: Shao et al. 2024, eq. 3
    A_t < 0: l_t = min(l_t, -A_t c)                                  dual clip, Ye et al. 2020, eq. 5
    l_t  = w_t l_t with TIS weights w (`is_weights`), then aggregate(l, mask, s.loss_agg)
    (`core.policy_loss`).
    """
    return core.policy_loss(logp, old_logp, advantages, mask, s.clip_low, s.clip_high, s.clip_ratio_c,
                            s.loss_agg, is_weights=is_weights)


@register_policy_loss("dr_grpo")
def dr_grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                 s: Settings, is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Dr. GRPO: the clipped surrogate summed over each response's tokens, averaged over the
    responses, with no 1/|o_i| length normalisation:

    L = 1/G sum_i sum_t l_{i,t}                           (GRPO: 1/G sum_i 1/|o_i| sum_t l_{i,t})

    Liu et al. 2025, "Understanding R1-Zero-Like Training", §3.2 and Figure 1: 1/|o_i| makes a
    long wrong answer's tokens cost less each, so GRPO drifts towards long wrong answers. The
    aggregation is "seq-mean-token-sum" whatever `s.loss_agg` says (TrainConfig sets it).
    l_{i,t} is `ppo_clip_loss`'s, dual clip and TIS weights included.
    """
    return core.policy_loss(logp, old_logp, advantages, mask, s.clip_low, s.clip_high, s.clip_ratio_c,
                            "seq-mean-token-sum", is_weights=is_weights)


@register_policy_loss("dapo")
def dapo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              s: Settings, is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DAPO's token-level loss with clip-higher:

    L = 1 / sum_i |o_i| * sum_i sum_t max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))

    Yu et al. 2025, "DAPO", eq. 8 (the objective, negated), §3.1 (clip-higher: eps_high >
    eps_low lets low-probability tokens grow; the paper's eps_low 0.2, eps_high 0.28, which
    TrainConfig makes clip_low / clip_high's defaults for this algorithm) and §3.3 (token-level
    policy-gradient loss: every token of the batch weighs the same, "token-mean" whatever
    `s.loss_agg` says). DAPO's dynamic sampling and overlong reward shaping are not part of
    the loss and are not done here. The dual clip (`s.clip_ratio_c`) and TIS weights apply as
    in `ppo_clip_loss` (verl's DAPO recipe keeps the dual clip too).
    """
    return core.policy_loss(logp, old_logp, advantages, mask, s.clip_low, s.clip_high, s.clip_ratio_c,
                            "token-mean", is_weights=is_weights)


# ---------------------------------------------------------------- algorithms

@dataclass(frozen=True)
class Algorithm:
    """A named pair of estimator and policy loss, and the settings its paper fixes."""

    estimator: str   # a key of ADV_ESTIMATORS
    loss: str        # a key of POLICY_LOSSES
    fixed: Mapping[str, Any] = field(default_factory=dict)      # TrainConfig refuses another value
    defaults: Mapping[str, Any] = field(default_factory=dict)   # unless the config sets them


ALGORITHMS: dict[str, Algorithm] = {
    "grpo": Algorithm("grpo", "ppo"),
    "ppo": Algorithm("gae", "ppo"),
    "dr_grpo": Algorithm("dr_grpo", "dr_grpo", fixed={"loss_agg": "seq-mean-token-sum", "norm_adv_by_std": False}),
    "dapo": Algorithm("grpo", "dapo", fixed={"loss_agg": "token-mean"}, defaults={"clip_high": 0.28}),
}


def estimator_of(algorithm: str) -> AdvantageEstimator:
    return ADV_ESTIMATORS[ALGORITHMS[algorithm].estimator]


def policy_loss_of(algorithm: str) -> PolicyLossFn:
    return POLICY_LOSSES[ALGORITHMS[algorithm].loss]


# ---------------------------------------------------------------- the minibatch loss

@dataclass
class MicroBatch:
    """One micro-batch's rows of everything the loss reads; all (n, T)."""

    logp: torch.Tensor                  # current policy, with gradient
    entropy: torch.Tensor               # current policy's entropy
    old_logp: torch.Tensor              # behaviour policy (the ratio's denominator), no gradient
    advantages: torch.Tensor
    mask: torch.Tensor
    values: torch.Tensor | None = None      # critic, with gradient (critic estimators)
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None    # frozen reference
    is_weights: torch.Tensor | None = None  # TIS weights (steadyrl.rl.tis)


def minibatch_loss(mb: MicroBatch, s: Settings,
                   policy_loss: PolicyLossFn) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of a micro-batch, and its metrics (verl's names, scalars without gradient).

    loss = L_pg - c_ent * H + beta * KL(pi || ref) + c_vf * L_VF          minimised
    The negated PPO objective (Schulman et al. 2017, eq. 9) with GRPO's KL term (Shao et al.
    2024, eq. 3): L_pg is `policy_loss`, H the entropy and KL `s.kl_estimator` aggregated as
    `s.loss_agg`, L_VF the clipped value loss (`core.value_loss`, only with a critic).
    actor/kl_ref is KL(pi || ref) as the update sees it (k3, token mean), for people, whether
    or not it is in the loss. Pure: no optimizer, no model, nothing stored.
    """
    pg_loss, pg = policy_loss(mb.logp, mb.old_logp, mb.advantages, mb.mask, s, mb.is_weights)
    entropy = core.aggregate(mb.entropy, mb.mask, s.loss_agg)
    metrics = {"actor/pg_loss": pg_loss, "actor/entropy": entropy, "actor/pg_clipfrac": pg["clip_frac"],
               "actor/ppo_kl": pg["approx_kl"], "actor/pg_clipfrac_lower": pg["dual_clip_frac"]}
    loss = pg_loss
    if s.entropy_coeff:
        loss = loss - s.entropy_coeff * entropy
    if mb.ref_logp is not None:
        metrics["actor/kl_ref"] = core.masked_mean(core.kl_estimate(mb.logp.detach(), mb.ref_logp, "k3"), mb.mask)
    if s.use_kl_loss:
        assert mb.ref_logp is not None, "use_kl_loss needs the reference's log-probs"
        kl = core.aggregate(core.kl_estimate(mb.logp, mb.ref_logp, s.kl_estimator), mb.mask, s.loss_agg)
        loss = loss + s.kl_coef * kl
        metrics["actor/kl_loss"] = kl
    if mb.values is not None:
        assert mb.old_values is not None and mb.returns is not None, "the value loss needs old values and returns"
        vf_loss, vf_clipfrac = core.value_loss(mb.values, mb.old_values, mb.returns, mb.mask, s.vf_clip, s.loss_agg)
        loss = loss + s.vf_coef * vf_loss
        metrics["critic/vf_loss"], metrics["critic/vf_clipfrac"] = vf_loss, vf_clipfrac
    return loss, {k: v.detach() for k, v in metrics.items()}


class MetricSums:
    """Weighted sums of per-micro-batch metrics: over a minibatch (each weighted by its share,
    `core.microbatch_weight`), over the ranks (`merge`), over the step's optimizer steps
    (`merge`, then `means`)."""

    def __init__(self, sums: Mapping[str, float] | None = None):
        self.sums: dict[str, float] = dict(sums or {})

    def add(self, metrics: Mapping[str, torch.Tensor | float], weight: torch.Tensor | float) -> None:
        """sums[k] += metrics[k] * weight."""
        w = float(weight)
        for k, v in metrics.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v) * w

    def merge(self, other: MetricSums | Mapping[str, float]) -> None:
        """sums[k] += other[k] (another rank's, another minibatch's)."""
        for k, v in (other.sums if isinstance(other, MetricSums) else other).items():
            self.sums[k] = self.sums.get(k, 0.0) + v

    def means(self, n: int) -> dict[str, float]:
        """Each sum / n (the step's metrics: the mean over its n optimizer steps)."""
        return {k: v / n for k, v in self.sums.items()}
