"""Each formula against values computed by hand or by an independent numpy/loop version."""

import math

import numpy as np
import pytest
import torch

from steadyrl.rl import core

ATOL = 1e-6


def test_grpo_advantages_hand_computed():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    a = core.grpo_advantages(r, eps=0.0 + 1e-6)
    std = math.sqrt(1 / 3)  # unbiased std of [1,0,0,1]
    want = torch.tensor([[0.5 / (std + 1e-6), -0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.5 / (std + 1e-6)],
                         [0.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(a, want, atol=ATOL)
    assert torch.allclose(core.grpo_advantages(r, norm_by_std=False),
                          torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]), atol=ATOL)


def test_grpo_group_of_one_is_zero_not_nan():
    a = core.grpo_advantages(torch.tensor([[3.0], [1.0]]))
    assert torch.equal(a, torch.zeros(2, 1))


def _gae_reference(r, v, gamma, lam):
    """Plain-Python GAE over one unpadded sequence (Schulman et al. 2016, eq. 16)."""
    T = len(r)
    adv = [0.0] * T
    for t in range(T):
        total = 0.0
        for k in range(T - t):
            nv = v[t + k + 1] if t + k + 1 < T else 0.0
            delta = r[t + k] + gamma * nv - v[t + k]
            total += (gamma * lam) ** k * delta
        adv[t] = total
    return adv


def test_gae_matches_the_sum_definition_and_skips_padding():
    r = [0.0, 0.1, -0.2, 1.0]
    v = [0.5, 0.4, 0.3, 0.2]
    gamma, lam = 0.9, 0.8
    want = _gae_reference(r, v, gamma, lam)
    # right-padded to T=6, second row left-padded with 2 masked tokens
    R = torch.tensor([r + [9.0, 9.0], [9.0, 9.0] + r])
    V = torch.tensor([v + [7.0, 7.0], [7.0, 7.0] + v])
    M = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]], dtype=torch.float32)
    adv, ret = core.gae(R, V, M, gamma, lam)
    assert torch.allclose(adv[0, :4], torch.tensor(want), atol=ATOL)
    assert torch.allclose(adv[1, 2:], torch.tensor(want), atol=ATOL)
    assert torch.all(adv[M == 0] == 0) and torch.all(ret[M == 0] == 0)
    assert torch.allclose(ret[0, :4], torch.tensor(want) + torch.tensor(v), atol=ATOL)


def test_last_token_rewards_puts_the_score_on_the_last_response_token():
    scores = torch.tensor([1.0, -0.5, 2.0])
    M = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.float32)
    want = torch.tensor([[0.0, 0.0, 1.0, 0.0],     # length 3: index 2
                         [-0.5, 0.0, 0.0, 0.0],    # length 1: index 0
                         [2.0, 0.0, 0.0, 0.0]])    # empty: index 0, where the mask is 0
    assert torch.equal(core.last_token_rewards(scores, M), want)


def test_empty_response_gets_no_advantage():
    R = core.last_token_rewards(torch.tensor([1.0, 2.0]), torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    adv, _ = core.gae(R, torch.zeros(2, 2), torch.tensor([[1.0, 1.0], [0.0, 0.0]]), 1.0, 1.0)
    assert torch.equal(adv, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))


def test_kl_penalized_rewards_hand_computed():
    R = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    logp = torch.tensor([[-1.0, -2.0, -0.5, -9.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5, -3.0]])
    M = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # k1 = logp - ref = [0.5, -1.0, 0.0, (-6.0, padding)]; r' = r - 0.1 * k1 on response tokens
    want = torch.tensor([[-0.05, 0.1, 1.0, 0.0]])
    assert torch.allclose(core.kl_penalized_rewards(R, logp, ref, M, 0.1), want, atol=ATOL)
    assert torch.equal(core.kl_penalized_rewards(R, logp, ref, M, 0.0), R)


def test_outcome_advantages_broadcast_over_response_tokens():
    got = core.outcome_advantages(torch.tensor([0.5, -1.0]), torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    assert torch.equal(got, torch.tensor([[0.5, 0.5, 0.0], [-1.0, 0.0, 0.0]]))


def test_masked_var_is_the_population_variance():
    x = torch.tensor([[1.0, 2.0, 99.0], [3.0, 6.0, -7.0]])
    M = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    # valid 1, 2, 3, 6: mean 3, squared deviations 4 + 1 + 0 + 9 = 14, / 4 (not / 3)
    assert core.masked_mean(x, M).item() == pytest.approx(3.0, abs=ATOL)
    assert core.masked_var(x, M).item() == pytest.approx(14 / 4, abs=ATOL)


def test_masked_whiten_hand_computed():
    x = torch.tensor([[1.0, 2.0, 99.0], [3.0, 6.0, -7.0]])
    M = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    got = core.masked_whiten(x, M)
    s = math.sqrt(14 / 4 + 1e-8)                 # population variance 3.5 (see above)
    want = torch.tensor([[-2 / s, -1 / s, 0.0], [0 / s, 3 / s, 0.0]])
    assert torch.allclose(got, want, atol=ATOL)
    # verl's masked_whiten divides by sqrt(14 / 3) (Bessel): a different tensor
    assert not torch.allclose(got, torch.tensor([[-2.0, -1.0, 0.0], [0.0, 3.0, 0.0]]) / math.sqrt(14 / 3), atol=1e-3)
    assert core.masked_mean(got, M).item() == pytest.approx(0.0, abs=ATOL)
    assert core.masked_var(got, M).item() == pytest.approx(1.0, abs=ATOL)


def test_masked_whiten_with_under_two_tokens_is_zero():
    one = core.masked_whiten(torch.tensor([[5.0, 1.0]]), torch.tensor([[1.0, 0.0]]))
    none = core.masked_whiten(torch.tensor([[5.0, 1.0]]), torch.zeros(1, 2))
    assert torch.equal(one, torch.zeros(1, 2)) and torch.equal(none, torch.zeros(1, 2))


def test_policy_loss_hand_computed_with_clip_and_dual_clip():
    old = torch.zeros(1, 4)
    ratio = torch.tensor([[1.5, 0.5, 1.1, 5.0]])
    logp = torch.log(ratio)
    A = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    M = torch.ones(1, 4)
    loss, m = core.policy_loss(logp, old, A, M, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0)
    # token 0: A>0, ratio 1.5 -> max(-1.5, -1.28) = -1.28 (clipped)
    # token 1: A>0, ratio 0.5 -> max(-0.5, -0.8)  = -0.5
    # token 2: A<0, ratio 1.1 -> max(1.1, 1.1) = 1.1; dual: min(1.1, 3) = 1.1
    # token 3: A<0, ratio 5.0 -> max(5.0, 1.28) = 5.0; dual: min(5.0, 3.0) = 3.0
    per_token = torch.tensor([-1.28, -0.5, 1.1, 3.0])
    assert abs(loss.item() - per_token.mean().item()) < ATOL
    assert abs(m["clip_frac"].item() - 0.25) < ATOL        # only token 0 (token 1's clip is inactive)
    assert abs(m["dual_clip_frac"].item() - 0.25) < ATOL   # token 3
    assert abs(m["approx_kl"].item() - (-logp).mean().item()) < ATOL


def test_policy_loss_gradient_is_zero_where_clipped():
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.5, 1.0]])).requires_grad_()
    loss, _ = core.policy_loss(logp, old, torch.tensor([[1.0, 1.0]]), torch.ones(1, 2), clip_ratio_c=None)
    loss.backward()
    assert logp.grad[0, 0] == 0 and abs(logp.grad[0, 1].item() + 0.5) < ATOL  # d(-ratio)/dlogp / 2


def test_policy_loss_clamps_the_log_ratio_at_20_hand_computed():
    # behaviour log-probs -1e4 (tokens 0-2) and logp - old = -25 (token 3): unclamped, exp(1e4)
    # is inf, and -A * inf (A > 0), -0 * inf (A = 0) and the dual clip's gradient are NaN
    old = torch.tensor([[-1e4, -1e4, -1e4, 0.0]])
    logp = torch.tensor([[0.0, 0.0, 0.0, -25.0]], requires_grad=True)
    A = torch.tensor([[1.0, -1.0, 0.0, 1.0]])
    M = torch.ones(1, 4)
    loss, m = core.policy_loss(logp, old, A, M, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0)
    # token 0: A=1,  ratio e^20 -> max(-e^20, -1.2) = -1.2 (clipped)
    # token 1: A=-1, ratio e^20 -> max(e^20, 1.2) = e^20; dual: min(e^20, 3) = 3
    # token 2: A=0 -> 0
    # token 3: A=1,  ratio e^-20 (not e^-25) -> max(-e^-20, -0.8) = -e^-20
    per_token = [-1.2, 3.0, 0.0, -math.exp(-20.0)]
    assert abs(loss.item() - sum(per_token) / 4) < ATOL
    assert abs(m["approx_kl"].item() - (-20.0 - 20.0 - 20.0 + 20.0) / 4) < 1e-4   # -mean(clamped log-ratio)
    assert abs(m["clip_frac"].item() - 0.25) < ATOL         # token 0
    assert abs(m["dual_clip_frac"].item() - 0.25) < ATOL    # token 1
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert (logp.grad == 0).all()    # every token is clipped, dual-clipped, A = 0 or past the clamp


def test_aggregation_modes():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    M = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert core.aggregate(loss, M, "token-mean").item() == pytest.approx(10 / 4)
    assert core.aggregate(loss, M, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert core.aggregate(loss, M, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        core.aggregate(loss, M, "nope")


def test_microbatch_weight_hand_computed():
    M = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])   # 3 + 1 + 2 + 2 tokens
    assert core.microbatch_weight(M[:1], M, "token-mean").item() == pytest.approx(3 / 8)
    assert core.microbatch_weight(M[:1], M, "seq-mean-token-sum").item() == pytest.approx(1 / 4)
    assert core.microbatch_weight(M[:1], M, "seq-mean-token-mean").item() == pytest.approx(1 / 4)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_microbatch_weights_add_up_to_the_minibatch_loss(mode):
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [5.0, 6.0, 9.0], [7.0, 8.0, 9.0]])
    M = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    parts = [slice(0, 1), slice(1, 4)]            # micro-batches of 1 and 3 sequences
    total = sum(core.microbatch_weight(M[p], M, mode) * core.aggregate(loss[p], M[p], mode) for p in parts)
    assert total.item() == pytest.approx(core.aggregate(loss, M, mode).item(), abs=ATOL)


def test_value_loss_hand_computed():
    v = torch.tensor([[1.0, 0.0]])
    old = torch.tensor([[0.0, 0.0]])
    R = torch.tensor([[2.0, 1.0]])
    loss, frac = core.value_loss(v, old, R, torch.ones(1, 2), clip_range=0.2)
    # token 0: unclipped (1-2)^2 = 1, clipped v=0.2 -> (0.2-2)^2 = 3.24 -> max 3.24
    # token 1: both (0-1)^2 = 1
    assert loss.item() == pytest.approx(0.5 * (3.24 + 1) / 2, abs=ATOL)
    assert frac.item() == pytest.approx(0.5)


def test_kl_estimators_against_numpy():
    rng = np.random.default_rng(0)
    lp = rng.normal(size=(3, 5))
    ref = rng.normal(size=(3, 5))
    lr = ref - lp
    want = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": np.exp(lr) - 1 - lr,
            "low_var_kl": np.clip(np.exp(lr) - 1 - lr, -10, 10)}
    for kind, w in want.items():
        got = core.kl_estimate(torch.tensor(lp), torch.tensor(ref), kind).numpy()
        assert np.allclose(got, w, atol=ATOL), kind


def test_k1_and_k3_are_unbiased_for_the_true_kl():
    p = torch.tensor([0.7, 0.2, 0.1])
    q = torch.tensor([0.5, 0.3, 0.2])
    true_kl = (p * (p / q).log()).sum()
    idx = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    lp, lq = p.log()[idx], q.log()[idx]
    for kind in ("k1", "k3"):
        assert core.kl_estimate(lp, lq, kind).mean().item() == pytest.approx(true_kl.item(), abs=3e-3)


def test_entropy_from_logits_hand_computed():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]])
    H = core.entropy_from_logits(logits)
    assert H[0, 0].item() == pytest.approx(math.log(4), abs=ATOL)
    assert H[0, 1].item() == pytest.approx(0.0, abs=1e-5)


def test_token_logprobs_with_temperature():
    logits = torch.tensor([[[2.0, 0.0]]])
    got = core.token_logprobs(logits, torch.tensor([[1]]), temperature=2.0)
    want = 0.0 - math.log(math.exp(1.0) + 1.0)
    assert got.item() == pytest.approx(want, abs=ATOL)


def test_lr_schedule():
    assert core.lr_lambda(0, 4, 100) == 0.25
    assert core.lr_lambda(3, 4, 100) == 1.0
    assert core.lr_lambda(50, 0, 100, "constant") == 1.0
    assert core.lr_lambda(0, 0, 100, "cosine") == pytest.approx(1.0)
    assert core.lr_lambda(50, 0, 100, "cosine") == pytest.approx(0.5)
    assert core.lr_lambda(100, 0, 100, "cosine", min_ratio=0.1) == pytest.approx(0.1)


def test_clip_grad_norm_returns_the_norm_before_clipping():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    assert core.clip_grad_norm([p], 1.0) == pytest.approx(5.0)
    assert torch.allclose(p.grad, torch.tensor([0.6, 0.8]), atol=ATOL)


def test_kl_with_zero_coefficient_warns():
    with pytest.warns(UserWarning, match="kl_coef is 0.0"):
        core.warn_if_kl_is_off(True, 0.0)


# ---------------------------------------------------------------- train/inference mismatch

# log pi_trainer - log pi_rollout per token: ratios 1, 1.5, 3 (row 0), 0.25 then padding (row 1)
MIS_TRAINER = torch.tensor([[-1.0, -0.5, -2.0], [-3.0, -1.0, -1.0]])
MIS_DELTA = torch.log(torch.tensor([[1.0, 1.5, 3.0], [0.25, 1.0, 1.0]]))
MIS_ROLLOUT = MIS_TRAINER - MIS_DELTA
MIS_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


def test_tis_weights_hand_computed_truncated_per_token_and_zero_on_padding():
    rollout = MIS_ROLLOUT.clone()
    rollout[1, 1:] = -1000.0                   # padding whose ratio overflows to inf: still 0
    trainer = MIS_TRAINER.clone().requires_grad_()
    w = core.tis_weights(trainer, rollout, MIS_MASK, cap=2.0)
    # min(ratio, 2): 1, 1.5, 2 (3 truncated) | 0.25 (no lower bound), padding 0
    assert torch.allclose(w, torch.tensor([[1.0, 1.5, 2.0], [0.25, 0.0, 0.0]]), atol=ATOL)
    assert w[0, 2] == 2.0 and not w.requires_grad   # exactly the cap; detached
    assert torch.allclose(core.tis_weights(MIS_TRAINER, MIS_ROLLOUT, MIS_MASK, cap=5.0),
                          torch.tensor([[1.0, 1.5, 3.0], [0.25, 0.0, 0.0]]), atol=ATOL)
    same = core.tis_weights(MIS_TRAINER, MIS_TRAINER, MIS_MASK, cap=2.0)
    assert torch.equal(same, MIS_MASK)              # equal log-probs: exactly 1 on every token


def test_mismatch_metrics_hand_computed():
    got = core.mismatch_metrics(MIS_TRAINER, MIS_ROLLOUT, MIS_MASK)
    # mean |d| over the 4 tokens: (0 + ln 1.5 + ln 3 + ln 4) / 4
    assert got["mean_abs_logp_diff"] == pytest.approx((math.log(1.5) + math.log(3) + math.log(4)) / 4, abs=1e-6)
    # k3 = r - 1 - ln r: row 0 (0 + 0.5 - ln 1.5 + 2 - ln 3) / 3, row 1 (0.25 - 1 + ln 4); mean of the rows
    row0 = (0.0 + (0.5 - math.log(1.5)) + (2.0 - math.log(3))) / 3
    row1 = 0.25 - 1.0 + math.log(4)
    assert got["kl"] == pytest.approx((row0 + row1) / 2, abs=1e-6)            # 0.484134
    assert got["ratio_outside_frac"] == pytest.approx(2 / 4)                   # 3 and 0.25 are outside [0.5, 2]


def test_mismatch_metrics_are_zero_for_equal_logprobs_and_skip_empty_sequences():
    assert core.mismatch_metrics(MIS_TRAINER, MIS_TRAINER, MIS_MASK) == {
        "mean_abs_logp_diff": 0.0, "kl": 0.0, "ratio_outside_frac": 0.0}
    # an empty response neither counts as a sequence of KL 0 nor adds tokens
    pad = torch.cat([MIS_MASK, torch.zeros(1, 3)])
    wider = core.mismatch_metrics(torch.cat([MIS_TRAINER, torch.zeros(1, 3)]),
                                  torch.cat([MIS_ROLLOUT, torch.full((1, 3), -5.0)]), pad)
    assert wider == pytest.approx(core.mismatch_metrics(MIS_TRAINER, MIS_ROLLOUT, MIS_MASK))
    assert core.mismatch_metrics(MIS_TRAINER, MIS_ROLLOUT, torch.zeros(2, 3)) == {
        "mean_abs_logp_diff": 0.0, "kl": 0.0, "ratio_outside_frac": 0.0}


def test_mismatch_kl_keeps_tiny_logprob_errors():
    """k3 of d = 1e-6 is d^2 / 2 = 5e-13: expm1 in float64 keeps it, exp(d) - 1 - d in float32 would not."""
    trainer = torch.full((1, 4), -2.0, dtype=torch.float64)
    got = core.mismatch_metrics(trainer, trainer - 1e-6, torch.ones(1, 4))
    assert got["kl"] == pytest.approx(0.5e-12, rel=1e-3)
    assert got["mean_abs_logp_diff"] == pytest.approx(1e-6, rel=1e-6)


def test_policy_loss_with_is_weights_hand_computed():
    old = torch.zeros(1, 2)
    logp = torch.zeros(1, 2, requires_grad=True)       # ratio 1
    A = torch.tensor([[1.0, -1.0]])
    w = torch.tensor([[0.5, 2.0]])
    loss, m = core.policy_loss(logp, old, A, torch.ones(1, 2), is_weights=w)
    # per token -A * ratio (no clip active at ratio 1, dual clip min(1, 3) = 1), times w: -0.5, 2.0
    assert loss.item() == pytest.approx((-0.5 + 2.0) / 2)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.25, 1.0]]))   # w * (-A) * ratio / 2
    assert m["clip_frac"].item() == 0.0
    plain, _ = core.policy_loss(logp.detach(), old, A, torch.ones(1, 2))
    ones, _ = core.policy_loss(logp.detach(), old, A, torch.ones(1, 2), is_weights=torch.ones(1, 2))
    assert torch.equal(plain, ones) and plain.item() == 0.0   # weights of 1 change nothing, bit for bit
