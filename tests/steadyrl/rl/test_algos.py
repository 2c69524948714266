"""Each registered advantage estimator and policy loss, and the minibatch loss, against values
computed by hand (steadyrl/rl/algos.py); the registry and the algorithm presets."""

import math

import pytest
import torch

from steadyrl.model.models import load_policy
from steadyrl.rl import algos
from steadyrl.rl.algos import AdvantageInputs, MetricSums, MicroBatch
from steadyrl.rl.distributed import microbatch_plan
from steadyrl.rl.trainer import Group, TrainConfig, Trainer

ATOL = 1e-6


# ---------------------------------------------------------------- advantage estimators

def test_grpo_estimator_hand_computed():
    # groups of 2 and 2: rewards (1, 0) and (3, 3); mask rows of 3, 1, 2 and 0 tokens
    rewards = torch.tensor([1.0, 0.0, 3.0, 3.0])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]], dtype=torch.float32)
    adv, returns = algos.ADV_ESTIMATORS["grpo"].fn(AdvantageInputs(rewards, [2, 2], mask), TrainConfig())
    # group 1: mean 0.5, unbiased std sqrt(((0.5)^2 + (0.5)^2) / 1) = sqrt(0.5): A = +-0.5 / (sqrt(0.5) + 1e-6)
    # group 2: mean 3, std 0: A = 0 / (0 + 1e-6) = 0
    a = 0.5 / (math.sqrt(0.5) + 1e-6)   # 0.70710...
    want = torch.tensor([[a, a, a], [-a, 0, 0], [0, 0, 0], [0, 0, 0]])
    assert returns is None
    assert torch.allclose(adv, want, atol=ATOL)
    # norm_adv_by_std False: r - mean only
    adv, _ = algos.ADV_ESTIMATORS["grpo"].fn(AdvantageInputs(rewards, [2, 2], mask),
                                             TrainConfig(norm_adv_by_std=False))
    assert torch.allclose(adv, torch.tensor([[0.5, 0.5, 0.5], [-0.5, 0, 0], [0, 0, 0], [0, 0, 0]]), atol=ATOL)


def test_dr_grpo_estimator_hand_computed_has_no_std():
    # groups of 3 and 2: rewards (1, 0, 0) and (2, 4); one token each
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0])
    mask = torch.ones(5, 1)
    adv, returns = algos.ADV_ESTIMATORS["dr_grpo"].fn(AdvantageInputs(rewards, [3, 2], mask),
                                                      TrainConfig(algorithm="dr_grpo"))
    # group 1: mean 1/3 -> (2/3, -1/3, -1/3); group 2: mean 3 -> (-1, 1); no division by the std
    want = torch.tensor([[2 / 3], [-1 / 3], [-1 / 3], [-1.0], [1.0]])
    assert returns is None
    assert torch.allclose(adv, want, atol=ATOL)


def test_gae_estimator_hand_computed_whitened_with_returns():
    # one response of 2 tokens (T = 3, one padding), score 1.0, critic values (0.5, 0.25)
    rewards, mask = torch.tensor([1.0]), torch.tensor([[1.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.25, 9.0]])
    cfg = TrainConfig(algorithm="ppo", gamma=1.0, lam=1.0)
    adv, returns = algos.ADV_ESTIMATORS["gae"].fn(AdvantageInputs(rewards, [1], mask, old_values=values), cfg)
    # r = (0, 1); delta_1 = 1 + 0 - 0.25 = 0.75; delta_0 = 0 + 0.25 - 0.5 = -0.25
    # A = (-0.25 + 0.75, 0.75) = (0.5, 0.75); returns = A + V = (1.0, 1.0)
    # whitened: mean 0.625, population var ((-0.125)^2 + 0.125^2) / 2 = 0.015625, std 0.125 -> (-1, 1)
    assert torch.allclose(returns, torch.tensor([[1.0, 1.0, 0.0]]), atol=ATOL)
    assert torch.allclose(adv, torch.tensor([[-1.0, 1.0, 0.0]]), atol=1e-5)
    assert algos.ADV_ESTIMATORS["gae"].critic and not algos.ADV_ESTIMATORS["grpo"].critic


def test_gae_estimator_with_kl_in_reward_hand_computed():
    rewards, mask = torch.tensor([1.0]), torch.tensor([[1.0, 1.0]])
    x = AdvantageInputs(rewards, [1], mask, old_logp=torch.tensor([[-1.0, -2.0]]),
                        old_values=torch.tensor([[0.5, 0.25]]), ref_logp=torch.tensor([[-1.5, -1.5]]))
    cfg = TrainConfig(algorithm="ppo", gamma=1.0, lam=1.0, kl_in_reward=True, kl_coef=0.1)
    adv, returns = algos.ADV_ESTIMATORS["gae"].fn(x, cfg)
    # k1 = old - ref = (0.5, -0.5): r = (0 - 0.05, 1 + 0.05) = (-0.05, 1.05)
    # delta_1 = 1.05 - 0.25 = 0.8; delta_0 = -0.05 + 0.25 - 0.5 = -0.3; A = (0.5, 0.8); returns (1.0, 1.05)
    assert torch.allclose(returns, torch.tensor([[1.0, 1.05]]), atol=ATOL)
    assert torch.allclose(adv, torch.tensor([[-1.0, 1.0]]), atol=1e-5)    # mean 0.65, +-0.15 / 0.15


# ---------------------------------------------------------------- policy losses
# Two responses, T = 2: row 0 two tokens with A = +1 and ratios 1.5, 0.5; row 1 one token with
# A = -1 and ratio 4 (its padding token has ratio 1 and must not count).
LOGP = torch.tensor([[math.log(1.5), math.log(0.5)], [math.log(4.0), 0.0]])
OLD = torch.zeros(2, 2)
ADV = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])


def _loss(name: str, **cfg) -> tuple[float, dict[str, float]]:
    loss, m = algos.POLICY_LOSSES[name](LOGP, OLD, ADV, MASK, TrainConfig(**cfg), None)
    return float(loss), {k: float(v) for k, v in m.items()}


def test_ppo_loss_hand_computed_each_aggregation():
    # clip (0.8, 1.2), dual clip c = 3, per token l = max(-A r, -A clip(r)):
    #   r 1.5, A +1: max(-1.5, -1.2) = -1.2 (clipped)
    #   r 0.5, A +1: max(-0.5, -0.8) = -0.5
    #   r 4.0, A -1: max(4.0, 1.2) = 4.0, then the dual clip min(4.0, 3) = 3.0
    loss, m = _loss("ppo")                                           # token-mean: (-1.2 - 0.5 + 3) / 3
    assert loss == pytest.approx(1.3 / 3, abs=ATOL)
    assert m["clip_frac"] == pytest.approx(1 / 3) and m["dual_clip_frac"] == pytest.approx(1 / 3)
    # approx_kl: mean of -log r = -(ln 1.5 + ln 0.5 + ln 4) / 3 = -ln 3 / 3
    assert m["approx_kl"] == pytest.approx(-math.log(3.0) / 3, abs=ATOL)
    # GRPO's own aggregation: mean over responses of each one's token mean: ((-1.7) / 2 + 3 / 1) / 2
    assert _loss("ppo", loss_agg="seq-mean-token-mean")[0] == pytest.approx(1.075, abs=ATOL)
    # without the dual clip the last token costs 4: (-1.2 - 0.5 + 4) / 3
    assert _loss("ppo", clip_ratio_c=None)[0] == pytest.approx(2.3 / 3, abs=ATOL)


def test_dr_grpo_loss_hand_computed_sums_tokens_without_length_normalisation():
    # 1/G sum_i sum_t l: ((-1.2 - 0.5) + 3.0) / 2 responses = 0.65 (GRPO's 1/|o_i| would give 1.075)
    loss, m = _loss("dr_grpo", algorithm="dr_grpo")
    assert loss == pytest.approx(0.65, abs=ATOL)
    assert m["clip_frac"] == pytest.approx(1 / 3)


def test_dapo_loss_hand_computed_token_mean_with_clip_higher():
    # clip (1 - 0.2, 1 + 0.28), the algorithm's default eps_high:
    #   r 1.5, A +1: max(-1.5, -1.28) = -1.28;  r 0.5: -0.5;  r 4, A -1: max(4, 1.28) = 4 -> dual 3
    # token-mean over the 3 tokens: (-1.28 - 0.5 + 3) / 3 = 1.22 / 3
    cfg = TrainConfig(algorithm="dapo")
    assert (cfg.clip_low, cfg.clip_high, cfg.loss_agg) == (0.2, 0.28, "token-mean")
    loss, m = _loss("dapo", algorithm="dapo")
    assert loss == pytest.approx(1.22 / 3, abs=ATOL)
    assert m["clip_frac"] == pytest.approx(1 / 3)
    # clip-higher widens only the upper side: a ratio of 1.25 is clipped at 1.2 but not at 1.28
    one = torch.ones(1, 1)
    lp = torch.tensor([[math.log(1.25)]])
    assert float(algos.POLICY_LOSSES["dapo"](lp, 0 * one, one, one, cfg, None)[0]) == pytest.approx(-1.25, abs=ATOL)
    assert float(algos.POLICY_LOSSES["ppo"](lp, 0 * one, one, one, TrainConfig(), None)[0]) == pytest.approx(-1.2,
                                                                                                         abs=ATOL)


def test_policy_losses_take_the_tis_weights_per_token():
    # weights (0.5, 2) on row 0, 1 on row 1: token-mean (-1.2 * 0.5 - 0.5 * 2 + 3 * 1) / 3 = 1.4 / 3
    w = torch.tensor([[0.5, 2.0], [1.0, 1.0]])
    loss, _ = algos.POLICY_LOSSES["ppo"](LOGP, OLD, ADV, MASK, TrainConfig(), w)
    assert float(loss) == pytest.approx(1.4 / 3, abs=ATOL)


# ---------------------------------------------------------------- the minibatch loss

def test_minibatch_loss_hand_computed_with_entropy_kl_and_value_loss():
    cfg = TrainConfig(algorithm="ppo", use_kl_loss=True, kl_coef=0.5, entropy_coeff=0.1, vf_coef=0.5, vf_clip=0.2)
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    values = torch.tensor([[0.5, 1.0]], requires_grad=True)
    mb = MicroBatch(logp=logp, entropy=torch.tensor([[0.5, 1.5]]), old_logp=torch.tensor([[-1.0, -1.0]]),
                    advantages=torch.tensor([[2.0, 2.0]]), mask=torch.ones(1, 2), values=values,
                    old_values=torch.tensor([[0.5, 0.5]]), returns=torch.tensor([[1.0, 1.0]]),
                    ref_logp=torch.tensor([[-1.0, -1.0 + math.log(2.0)]]))
    loss, m = algos.minibatch_loss(mb, cfg, algos.POLICY_LOSSES["ppo"])
    # pg: ratio 1, l = -A = -2 per token -> -2;  entropy: (0.5 + 1.5) / 2 = 1.0
    # KL: log r = ref - logp = (0, ln 2), k3 = r - 1 - log r = (0, 1 - ln 2) -> mean (1 - ln 2) / 2 = 0.153426
    # value: V_clip = 0.5 + clip(V - 0.5, +-0.2) = (0.5, 0.7); (V - R)^2 = (0.25, 0); (V_clip - R)^2 = (0.25, 0.09)
    #        0.5 * mean(max) = 0.5 * (0.25 + 0.09) / 2 = 0.085, clipped on 1 of 2 tokens
    kl = (1 - math.log(2.0)) / 2
    assert float(loss.detach()) == pytest.approx(-2.0 - 0.1 * 1.0 + 0.5 * kl + 0.5 * 0.085, abs=ATOL)
    want = {"actor/pg_loss": -2.0, "actor/entropy": 1.0, "actor/kl_ref": kl, "actor/kl_loss": kl,
            "critic/vf_loss": 0.085, "critic/vf_clipfrac": 0.5, "actor/pg_clipfrac": 0.0, "actor/ppo_kl": 0.0,
            "actor/pg_clipfrac_lower": 0.0}
    assert {k: pytest.approx(v, abs=ATOL) for k, v in want.items()} == {k: float(v) for k, v in m.items()}
    assert not any(v.requires_grad for v in m.values())
    loss.backward()
    assert logp.grad is not None and values.grad is not None
    # d loss / d V: 0.5 * 0.5 * d/dV mean(max(...)): token 0 (0.5 - 1) * 2 / 2 = -0.5; token 1 clipped: 0
    assert torch.allclose(values.grad, torch.tensor([[0.5 * 0.5 * -0.5, 0.0]]), atol=ATOL)


def test_metric_sums_weigh_merge_and_average():
    s = MetricSums()
    s.add({"a": torch.tensor(2.0), "b": 1.0}, 0.25)             # a 0.5, b 0.25
    s.add({"a": torch.tensor(4.0)}, torch.tensor(0.75))          # a 0.5 + 3.0 = 3.5
    other = MetricSums({"a": 1.5, "c": 2.0})
    s.merge(other)                                               # a 5.0, c 2.0
    s.merge({"b": 0.75})                                         # b 1.0
    assert s.means(2) == {"a": 2.5, "b": 0.5, "c": 1.0}


# ---------------------------------------------------------------- registry and presets

def test_every_algorithm_names_registered_pieces_and_a_name_is_registered_once():
    for name, alg in algos.ALGORITHMS.items():
        assert alg.estimator in algos.ADV_ESTIMATORS and alg.loss in algos.POLICY_LOSSES, name
        TrainConfig(algorithm=name)
    with pytest.raises(ValueError, match="already registered"):
        algos.register_policy_loss("ppo")(algos.ppo_clip_loss)
    with pytest.raises(ValueError, match="already registered"):
        algos.register_adv_estimator("grpo")(algos.grpo_advantages)


def test_config_refuses_what_the_algorithm_fixes_and_unknown_names():
    with pytest.raises(ValueError, match="algorithm dr_grpo fixes loss_agg"):
        TrainConfig(algorithm="dr_grpo", loss_agg="token-mean")
    with pytest.raises(ValueError, match="fixes norm_adv_by_std"):
        TrainConfig(algorithm="dr_grpo", norm_adv_by_std=True)
    with pytest.raises(ValueError, match="unknown algorithm 'reinforce'"):
        TrainConfig(algorithm="reinforce")
    with pytest.raises(ValueError, match="kl_in_reward needs algorithm=ppo"):
        TrainConfig(algorithm="dapo", kl_in_reward=True)
    assert TrainConfig(algorithm="dapo", clip_high=0.3).clip_high == 0.3        # a default, not fixed
    assert TrainConfig(algorithm="dr_grpo", loss_agg="seq-mean-token-sum").loss_agg == "seq-mean-token-sum"


def test_microbatch_plan_splits_over_ranks_with_an_idle_one_when_sharded():
    # 5 rows in micro-batches of 2 start at 0, 2, 4: rank 0 runs 0 and 4, rank 1 runs 2
    assert microbatch_plan(5, 2, 0, 2, sharded=True) == [0, 4]
    assert microbatch_plan(5, 2, 1, 2, sharded=True) == [None, 2]    # FSDP2: as many forwards as rank 0
    assert microbatch_plan(5, 2, 1, 2, sharded=False) == [2]
    assert microbatch_plan(5, 2, 0, 1, sharded=False) == [0, 2, 4]


# ---------------------------------------------------------------- the new algorithms in a step

GROUPS = [Group([1, 5, 40], [[6, 7, 9], [8, 9], [7], [9, 9, 9, 6]], [1.0, 0.0, 0.5, 0.0]),
          Group([3, 4], [[5, 6], [6, 7, 8]], [0.0, 1.0])]


def _grads(algorithm: str, micro: int) -> tuple[torch.Tensor, dict[str, float]]:
    model, tok = load_policy("tiny", seed=3)
    t = Trainer(model, tok.pad_token_id, TrainConfig(algorithm=algorithm, lr=1e-2, micro_batch_size=micro))
    m = t.step(GROUPS)
    return torch.cat([p.grad.flatten() for p in t.model.parameters() if p.grad is not None]), m


@pytest.mark.parametrize("algorithm", ["dr_grpo", "dapo"])
def test_a_step_of_the_new_algorithms_does_not_depend_on_the_micro_batch_split(algorithm):
    whole, m = _grads(algorithm, 64)
    split, _ = _grads(algorithm, 1)
    assert math.isfinite(m["actor/pg_loss"]) and "timing_s/old_log_prob" not in m   # one pass, no critic
    assert torch.allclose(whole, split, atol=1e-6)
