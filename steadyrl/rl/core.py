"""The RL math: one pure function per formula, shapes in comments, sources cited.

Notation (CleanRL / verl): B sequences, T response tokens, G samples per prompt.
`mask` is 1.0 on response tokens that count and 0.0 on padding; every per-token tensor is
(B, T). Log-probabilities are in nats.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Literal

import torch
import torch.nn.functional as F

LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
KLEstimator = Literal["k1", "k2", "k3", "low_var_kl"]


# ---------------------------------------------------------------- per-token rewards (PPO)

def last_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Put each sequence's scalar score on its last response token; 0 elsewhere.

    r_t = score   if t = T_i - 1   (T_i - 1: the last position where mask_t = 1)
    r_t = 0       otherwise

    Outcome reward: the whole response is one episode, scored once at its end, i.e. after
    its last token (Ouyang et al. 2022, InstructGPT, §3.5: the reward model scores prompt and
    response and ends the episode). verl does the same in its
    reward manager (verl/workers/reward_manager/naive.py:
    `reward_tensor[i, valid_response_length - 1] = score`). Responses are right padded, so
    the last response token is at index T_i - 1. An empty response (T_i = 0) gets its score
    at index 0, where its mask is 0: `gae` then gives it advantage 0. A multi-turn episode's
    mask has 0s inside (tool tokens, steadyrl/model/agents.py): its last policy token is still the
    last 1, which `sum_t mask_t - 1` would miss.

    Args:
        scores: (B,) one score per sequence.
        mask: (B, T) 1 on response tokens (right padded).
    Returns:
        (B, T) per-token rewards.
    """
    B, T = mask.shape
    rewards = torch.zeros(B, T, dtype=scores.dtype, device=scores.device)   # (B, T)
    last = (T - 1 - mask.flip(1).argmax(dim=1)) * (mask.sum(dim=1) > 0)     # (B,) last 1, else 0
    rewards[torch.arange(B, device=scores.device), last] = scores
    return rewards


def kl_penalized_rewards(rewards: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                         kl_coef: float) -> torch.Tensor:
    """KL in the reward: subtract beta * k1 from every response token's reward.

    r'_t = r_t - beta * (log pi(y_t) - log pi_ref(y_t))        (k1 per token, see kl_estimate)

    Source: Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", eq. 2,
    R(x, y) = r(x, y) - beta * log(pi(y|x) / rho(y|x)), spread over the tokens (log pi(y|x)
    is the sum of the token log-probs); Ouyang et al. 2022, eq. 2. Per token, with k1 on the
    behaviour log-probs, as verl's
    `apply_kl_penalty` (verl/trainer/ppo/ray_trainer.py, kl_penalty="kl"):
    token_level_rewards = token_level_scores - beta * k1 * response_mask.

    Args:
        rewards: (B, T) per-token rewards (`last_token_rewards`).
        logp: (B, T) log-probs under the policy that sampled the responses.
        ref_logp: (B, T) log-probs under the frozen reference.
        mask: (B, T).
        kl_coef: beta.
    Returns:
        (B, T) rewards with the KL penalty; padding unchanged.
    """
    return rewards - kl_coef * kl_estimate(logp, ref_logp, "k1") * mask       # (B, T)


# ---------------------------------------------------------------- advantages

def grpo_advantages(rewards: torch.Tensor, norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages, one scalar per sample.

    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)         with norm_by_std
    A_i =  r_i - mean(r_group)                                 without (Dr. GRPO)

    Source: Shao et al. 2024, DeepSeekMath, §4.1.2 (outcome supervision); the variant
    without std: Liu et al. 2025, "Understanding R1-Zero-Like Training", §3.1. std is the
    unbiased sample std (torch.std), as in verl and TRL; a group of one has std 0.

    Args:
        rewards: (B, G) one row per prompt.
    Returns:
        (B, G) advantages.
    """
    mean = rewards.mean(dim=1, keepdim=True)                                  # (B, 1)
    centred = rewards - mean                                                  # (B, G)
    if not norm_by_std:
        return centred
    G = rewards.shape[1]
    std = rewards.std(dim=1, keepdim=True) if G > 1 else torch.zeros_like(mean)  # (B, 1)
    return centred / (std + eps)


def grpo_advantages_by_group(rewards: torch.Tensor, sizes: list[int], norm_by_std: bool = True,
                             eps: float = 1e-6) -> torch.Tensor:
    """`grpo_advantages` for groups of different sizes (a data gate removed some samples).

    Args:
        rewards: (N,) the groups' rewards one after another; sizes: each group's size, sum N.
    Returns:
        (N,) advantages; equal to grpo_advantages(rewards.view(B, G)).reshape(N) when every
        group has the same size (that path is taken then).
    """
    if len(set(sizes)) == 1:
        return grpo_advantages(rewards.view(len(sizes), sizes[0]), norm_by_std, eps).reshape(-1)
    return torch.cat([grpo_advantages(r[None], norm_by_std, eps)[0] for r in torch.split(rewards, sizes)])


def outcome_advantages(seq_advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A sequence's advantage on each of its response tokens (outcome supervision).

    A_{i,t} = A_i      for every response token t of sequence i; 0 on padding

    Source: Shao et al. 2024, DeepSeekMath, §4.1.2 ("sets the advantages of all tokens in the
    output as the normalized reward"); verl `compute_grpo_outcome_advantage`
    (`scores.unsqueeze(-1) * response_mask`).

    Args:
        seq_advantages: (B,) one advantage per sequence (`grpo_advantages_by_group`).
        mask: (B, T).
    Returns:
        (B, T).
    """
    return seq_advantages[:, None] * mask                                     # (B, 1) * (B, T)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation over response tokens.

    delta_t = r_t + gamma * V_{t+1} - V_t                   (V after the last token is 0)
    A_t     = sum_l (gamma * lam)^l * delta_{t+l}
    returns = A + V

    Source: Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE", eq. 11-16.
    Masked positions are skipped: the next value of a token is that of the next unmasked one.

    Args:
        rewards: (B, T) per-token rewards (typically the score on the last token, minus KL).
        values: (B, T) value estimates V_t.
        mask: (B, T) 1 on response tokens.
    Returns:
        advantages (B, T), returns (B, T); both 0 where mask is 0.
    """
    B, T = rewards.shape
    adv = torch.zeros_like(rewards)                                           # (B, T)
    last_gae = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)     # (B,)
    next_value = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)   # (B,)
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        adv[:, t] = gae_t * m
        # carry through padding unchanged
        last_gae = torch.where(m > 0, gae_t, last_gae)
        next_value = torch.where(m > 0, values[:, t], next_value)
    returns = (adv + values) * mask
    return adv, returns


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Advantage whitening over every valid token of the batch: zero mean, unit variance.

    mu  = sum(x * m) / sum(m)
    var = sum((x - mu)^2 * m) / sum(m)          population variance: no Bessel correction
    out = (x - mu) * rsqrt(var + eps) * m       0 on padding

    Source: verl `masked_whiten` (verl/utils/torch_functional.py), which verl's
    `compute_gae_advantage_return` (verl/trainer/ppo/core_algos.py) applies to the whole
    batch after GAE; before it, OpenAI's lm-human-preferences `whiten` (utils/core.py,
    the code of Ziegler et al. 2019): the same formula, unmasked, with tf.nn.moments. The
    practice is "Normalization of Advantages", detail 7 of Huang et al. 2022, "The 37
    Implementation Details of Proximal Policy Optimization" (ICLR blog track).

    What differs from those sources (kept as the trainer has always computed it):
    - variance: the population one (divide by sum(m)), as tf.nn.moments. verl's `masked_var`
      defaults to unbiased=True and multiplies by n / (n - 1), n = sum(m), so verl's output
      is this one times sqrt((n - 1) / n) when eps is negligible (0.5 % smaller at n = 100);
    - scope: once per step over the whole batch, before it is split into minibatches.
      CleanRL `ppo.py` (norm_adv) normalises each minibatch instead, with the unbiased
      `.std()` and eps added to the std: (A - mean) / (std + 1e-8);
    - padding: multiplied by the mask, so padded positions are 0 (verl leaves them at
      -mu / sigma and masks them in the loss). With fewer than two valid tokens the output
      is 0 (`masked_mean` counts at least one token); verl raises there.

    Args:
        values: (B, T) advantages (`gae`).
        mask: (B, T).
    Returns:
        (B, T) whitened advantages.
    """
    mu, var = masked_mean(values, mask), masked_var(values, mask)            # scalars
    return (values - mu) * torch.rsqrt(var + eps) * mask                      # (B, T)


# ---------------------------------------------------------------- aggregation

def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: LossAgg = "token-mean") -> torch.Tensor:
    """Reduce a per-token loss (B, T) to a scalar.

    token-mean:           sum(loss * mask) / sum(mask)           (DAPO, Yu et al. 2025, eq. 8)
    seq-mean-token-sum:   mean_b sum_t loss * mask               (Dr. GRPO, Liu et al. 2025)
    seq-mean-token-mean:  mean_b (sum_t loss * mask / sum_t mask) (GRPO, Shao et al. 2024, eq. 3)
    """
    if mode == "token-mean":
        return (loss * mask).sum() / mask.sum().clamp(min=1.0)
    per_seq = (loss * mask).sum(dim=1)                                        # (B,)
    if mode == "seq-mean-token-sum":
        return per_seq.mean()
    if mode == "seq-mean-token-mean":
        return (per_seq / mask.sum(dim=1).clamp(min=1.0)).mean()
    raise ValueError(f"unknown loss aggregation {mode!r}")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(x * m) / max(sum(m), 1), a scalar (0 when no entry is valid)."""
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Population variance of the masked entries: sum((x - mu)^2 * m) / sum(m).

    No Bessel correction (verl's `masked_var` has it by default: times n / (n - 1)).
    """
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask)


def microbatch_weight(micro_mask: torch.Tensor, mini_mask: torch.Tensor, mode: LossAgg = "token-mean") -> torch.Tensor:
    """Share of a micro-batch in its minibatch's loss, so that the micro-batch losses, each
    times its weight, add up to the minibatch loss (gradient accumulation).

    token-mean:  w_k = sum(m_k) / sum(m)      tokens of micro-batch k / tokens of the minibatch
    seq-mean-*:  w_k = B_k / B                sequences of micro-batch k / of the minibatch

    Why: a token mean over the minibatch is sum_k (n_k / n) * (token mean over k), a mean over
    sequences is sum_k (B_k / B) * (mean over k). nanoGPT `train.py` divides each micro-step's
    loss by gradient_accumulation_steps: the equal-size case of the second line.

    Args:
        micro_mask: (B_k, T) the micro-batch's rows of the mask.
        mini_mask: (B, T) the minibatch's rows.
    Returns:
        scalar weight.
    """
    if mode == "token-mean":
        return micro_mask.sum() / mini_mask.sum().clamp(min=1.0)
    return torch.tensor(micro_mask.shape[0] / mini_mask.shape[0])


# ---------------------------------------------------------------- policy loss

#: Bound of the log-ratio log pi_theta - log pi_behaviour before exp, as verl's
#: `compute_policy_loss_vanilla` (verl/trainer/ppo/core_algos.py: negative_approx_kl clamped at
#: +-20.0, then ratio = exp): one absurd behaviour log-prob (an off-policy group brings the
#: sampler's, e.g. -1e4) made the ratio inf, and -A * inf, inf - inf and 0 * inf turned the loss
#: or its gradient into NaN. exp(20) ~ 4.9e8 is finite in float32. A clamped token has no
#: gradient through the ratio, and loses next to nothing: above +20 its loss is the clip's
#: constant -A * (1 + clip_high) for A > 0 and the dual clip's -A * clip_ratio_c for A < 0
#: (neither has a gradient unclamped either); below -20 it is -A * exp(-20) ~ -2e-9 * A for
#: A > 0 and the clip's constant for A < 0.
LOG_RATIO_CLAMP = 20.0


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_low: float = 0.2, clip_high: float = 0.2, clip_ratio_c: float | None = 3.0,
                agg: LossAgg = "token-mean",
                is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate policy loss, with asymmetric clip and dual clip.

    ratio    = exp(clamp(logp - old_logp, -20, 20))                 log-ratio clamped as verl's
    pg_loss1 = -A * ratio
    pg_loss2 = -A * clip(ratio, 1 - clip_low, 1 + clip_high)
    loss     = max(pg_loss1, pg_loss2)                         PPO, Schulman et al. 2017, eq. 7
    where A < 0:  loss = min(loss, -A * clip_ratio_c)          dual clip, Ye et al. 2020, eq. 5
    loss     = w * loss    with is_weights w (`tis_weights`)   TIS, Yao et al. 2025
    Asymmetric (low, high) clip: DAPO "clip-higher", Yu et al. 2025, eq. 10. The weights
    multiply the per-token loss after both clips and before the aggregation, as verl's
    `compute_policy_loss_vanilla` does with `rollout_is_weights`; the clip metrics do not see them.

    The log-ratio is clamped to +-LOG_RATIO_CLAMP before exp (why: at the constant); approx_kl
    is taken from the clamped log-ratio, as verl's ppo_kl.

    Args:
        logp, old_logp: (B, T) log-probs of the taken tokens under the current / behaviour policy.
        advantages: (B, T) (a sequence advantage broadcast over its tokens).
        mask: (B, T).
        clip_ratio_c: dual-clip bound (> 1), or None to disable.
        is_weights: (B, T) detached per-token importance weights, or None (the loss is
            computed exactly as without them).
    Returns:
        scalar loss, and metrics: clip_frac (share of tokens where the clip was active),
        dual_clip_frac, approx_kl (k1 between behaviour and current, from the clamped
        log-ratio, mean over tokens).
    """
    log_ratio = torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)   # (B, T)
    ratio = torch.exp(log_ratio)                                              # (B, T)
    pg_loss1 = -advantages * ratio                                            # (B, T)
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.maximum(pg_loss1, pg_loss2)                               # (B, T)
    clip_active = (pg_loss2 > pg_loss1).float()
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
        pg_loss3 = -advantages * clip_ratio_c
        dual = torch.minimum(clipped, pg_loss3)
        dual_active = ((clipped > pg_loss3) & (advantages < 0)).float()
        pg_losses = torch.where(advantages < 0, dual, clipped)
    else:
        dual_active = torch.zeros_like(clipped)
        pg_losses = clipped
    if is_weights is not None:
        pg_losses = pg_losses * is_weights                                    # (B, T)
    loss = aggregate(pg_losses, mask, agg)
    with torch.no_grad():
        metrics = {"clip_frac": masked_mean(clip_active, mask),
                   "dual_clip_frac": masked_mean(dual_active, mask),
                   "approx_kl": masked_mean(-log_ratio, mask)}
    return loss, metrics


# ---------------------------------------------------------------- train/inference mismatch

def tis_weights(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                cap: float = 2.0) -> torch.Tensor:
    """Truncated importance-sampling (TIS) weight of each token, detached.

    w_t = min(exp(log pi_trainer(y_t) - log pi_rollout(y_t)), C) * m_t        token-level truncation

    The rollout engine (vLLM in bf16) sampled y from pi_rollout, but the trainer's log-probs
    of the same tokens under the same weights are pi_trainer's: the update is off-policy by
    that gap. TIS reweights each token's policy-gradient loss by pi_trainer / pi_rollout,
    truncated from above at C so that a token the rollout engine found much less likely
    cannot dominate the gradient. Truncation is per token (not of the sequence's product of
    ratios): biased, low variance; there is no lower bound (a weight near 0 just removes the
    token's share of the gradient).

    Source: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training" (https://fengyao.notion.site/off-policy-rl), the TIS correction. verl names it
    rollout importance sampling: `compute_rollout_importance_weights`
    (verl/trainer/ppo/mismatch_helper.py) with rollout_is_level="token",
    rollout_is_mode="truncate" computes exp(old_log_prob - rollout_log_prob), clamped at
    `rollout_is_threshold` from above and times response_mask; `compute_policy_loss_vanilla`
    multiplies the per-token PPO loss by it (`policy_loss`'s is_weights). verl first clamps the
    log-ratio to [-20, 20] against overflow; here exp overflows to inf, which the cap turns
    into C, and a weight below exp(-20) ~ 2e-9 stays as it is instead of 2e-9.

    Args:
        trainer_logp: (B, T) the trainer's log-probs of the sampled tokens (the ratio's old
            log-probs: the behaviour policy as the trainer computes it).
        rollout_logp: (B, T) the rollout engine's log-probs of the same tokens.
        mask: (B, T).
        cap: C (verl's documented example: rollout_is_threshold 2.0).
    Returns:
        (B, T) weights in [0, C], no gradient; 0 on padding.
    """
    with torch.no_grad():
        ratio = torch.exp(trainer_logp - rollout_logp)                        # (B, T)
        return torch.clamp(ratio, max=cap) * mask                             # (B, T)


def mismatch_metrics(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                     low: float = 0.5, high: float = 2.0) -> dict[str, float]:
    """How far the rollout engine's log-probs are from the trainer's, on the sampled tokens.

    d_t = log pi_trainer(y_t) - log pi_rollout(y_t)                 (B, T), y ~ pi_rollout
    mean_abs_logp_diff = sum_t |d_t| m_t / sum_t m_t                  over every token of the batch
    kl                 = mean_i ( sum_t k3(d_t) m_t / sum_t m_t )      k3(d) = exp(d) - 1 - d
    ratio_outside_frac = share of tokens with exp(d_t) < low or > high

    kl estimates KL(pi_rollout || pi_trainer) per token with Schulman's k3 (2020, "Approximating
    KL Divergence": r - 1 - log r with r = pi_trainer / pi_rollout, unbiased and >= 0 for
    samples of pi_rollout), averaged over each sequence's tokens, then over the sequences
    (sequences without tokens are left out). This is prime-rl's `mismatch_kl`
    (src/prime_rl/trainer/rl/loss.py, `compute_loss`: per sequence,
    token_mismatch_kl[loss_mask].sum() / loss_mask.sum(), with
    token_mismatch_kl = exp(log_importance_ratio) - log_importance_ratio - 1). k3 is computed
    as expm1(d) - d in float64, as prime-rl's `mismatch_diagnostics`
    (src/prime_rl/trainer/rl/mismatch.py), so that log-prob errors of 1e-6 do not vanish in
    rounding. verl's `mismatch_k3_kl` (verl/trainer/ppo/mismatch_helper.py,
    `compute_mismatch_metrics`) is the same k3 averaged over every token of the batch instead,
    which weighs long responses more. The [0.5, 2] band is the default TIS/masking band of verl
    (rollout_is_threshold 2, lower bound 1 / 2).

    Args:
        trainer_logp, rollout_logp: (B, T).
        mask: (B, T).
    Returns:
        {"mean_abs_logp_diff", "kl", "ratio_outside_frac"} as floats; 0.0 each without tokens.
    """
    with torch.no_grad():
        m = mask.double()                                                     # (B, T)
        d = (trainer_logp.double() - rollout_logp.double()) * m               # (B, T)
        n_tok = m.sum(dim=1)                                                  # (B,)
        k3 = (torch.expm1(d) - d) * m                                         # (B, T), >= 0
        has = n_tok > 0                                                       # (B,)
        kl_seq = k3.sum(dim=1)[has] / n_tok[has]                              # (B',)
        ratio = torch.exp(d)                                                  # (B, T)
        outside = ((ratio < low) | (ratio > high)).double()                  # (B, T)
        return {"mean_abs_logp_diff": float(masked_mean(d.abs(), m)),
                "kl": float(kl_seq.mean()) if kl_seq.numel() else 0.0,
                "ratio_outside_frac": float(masked_mean(outside, m))}


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip_range: float = 0.2, agg: LossAgg = "token-mean") -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss.

    V_clip = V_old + clip(V - V_old, -eps, eps)
    loss   = 0.5 * max((V - R)^2, (V_clip - R)^2)
    Source: the PPO2 baselines implementation (Dhariwal et al. 2017), as in CleanRL ppo.py
    and verl `compute_value_loss`.

    Args: all (B, T). Returns: scalar loss, clip fraction.
    """
    v_clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    loss1 = (values - returns) ** 2
    loss2 = (v_clipped - returns) ** 2
    loss = 0.5 * aggregate(torch.maximum(loss1, loss2), mask, agg)
    return loss, masked_mean((loss2 > loss1).float(), mask).detach()


# ---------------------------------------------------------------- KL and entropy

def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: KLEstimator = "low_var_kl") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi.

    with log r = ref_logp - logp:
      k1 = -log r                         (unbiased, high variance)
      k2 = 0.5 * (log r)^2                (biased, low variance)
      k3 = r - 1 - log r                  (unbiased, low variance, >= 0)
      low_var_kl = clamp(k3, -10, 10)     (verl's name for k3, bounded)
    Source: Schulman 2020, "Approximating KL Divergence" (k1, k2, k3); GRPO uses k3
    (Shao et al. 2024, eq. 4).

    Args: (B, T) each. Returns: (B, T).
    """
    log_r = ref_logp - logp
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r ** 2
    if kind in ("k3", "low_var_kl"):
        k3 = torch.exp(log_r) - 1.0 - log_r
        return torch.clamp(k3, -10.0, 10.0) if kind == "low_var_kl" else k3
    raise ValueError(f"unknown KL estimator {kind!r}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution at each position.

    H = logsumexp(z) - sum_i softmax(z)_i * z_i
    Args: logits (B, T, V). Returns: (B, T), nats.
    """
    p = F.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(dim=-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature) at `tokens`.

    Args: logits (B, T, V) predicting `tokens` (B, T). Returns: (B, T).
    """
    logp = F.log_softmax(logits.float() / temperature, dim=-1)                # (B, T, V)
    return torch.gather(logp, -1, tokens.unsqueeze(-1)).squeeze(-1)           # (B, T)


# ---------------------------------------------------------------- optimisation

def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> float:
    """Clip the global L2 norm of the gradients to `max_norm`; returns the norm before clipping.

    Source: Pascanu et al. 2013, "On the difficulty of training RNNs", Alg. 1.
    """
    norm = torch.nn.utils.clip_grad_norm_(list(params), max_norm)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)   # FSDP2: a replicated DTensor


def lr_lambda(step: int, warmup_steps: int, total_steps: int, kind: Literal["constant", "cosine"] = "constant",
              min_ratio: float = 0.0) -> float:
    """LR multiplier at `step`: linear warmup, then constant or cosine decay to `min_ratio`.

    Cosine: Loshchilov & Hutter 2017, SGDR, eq. 5 (one cycle, no restarts).
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warn_if_kl_is_off(use_kl: bool, kl_coef: float) -> None:
    """Start-up warning: KL is switched on but its coefficient is 0 (it does nothing)."""
    if use_kl and kl_coef == 0.0:
        warnings.warn("KL to the reference is enabled but kl_coef is 0.0: it has no effect "
                      "(set kl_coef > 0 or disable KL to skip the reference forward pass)", stacklevel=2)
