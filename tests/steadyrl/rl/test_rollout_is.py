"""Train/inference mismatch in the trainer: mismatch/* metrics on every step with rollout
log-probs, TIS (rollout_is) weighing the policy-gradient loss where it is on, and the step
bit for bit the old one where it is off."""

import math

import pytest
import torch

from steadyrl.model.data import encode_prompt, tiny_copy_rows
from steadyrl.model.models import load_policy
from steadyrl.rl.generation import SamplingParams, TorchGenerator
from steadyrl.rl.trainer import Group, TrainConfig, Trainer, build_batch

PROMPT = [1, 5, 40]
RESPONSES = [[6, 7, 9], [8, 9]]
# per-token pi_trainer / pi_rollout the tests give the rollout engine: 3.0 is truncated at C = 2
RATIOS = [[0.6, 1.5, 3.0], [1.0, 0.8]]
VOLATILE = ("timing_s/", "perf/train_tokens_per_s", "mismatch/", "rollout_is/")


def _trainer(**cfg) -> Trainer:
    model, tok = load_policy("tiny", seed=5)
    return Trainer(model, tok.pad_token_id, TrainConfig(**{"lr": 1e-2, "micro_batch_size": 64, **cfg}))


def _trainer_logprobs(groups: list[Group]) -> list[list[list[float]]]:
    """The trainer's log-probs of each response before any update (what an exact engine reports)."""
    t = _trainer()
    b = build_batch(groups, t.pad_id)
    logp, _ = t._no_grad_pass(t.model, b)
    out, row = [], 0
    for g in groups:
        out.append([logp[row + i, :len(r)].tolist() for i, r in enumerate(g.responses)])
        row += len(g.responses)
    return out


def _rollout(lps: list[list[float]], ratios: list[list[float]]) -> list[list[float]]:
    """Rollout log-probs whose ratio pi_trainer / pi_rollout is `ratios`."""
    return [[lp - math.log(r) for lp, r in zip(seq, rs, strict=True)] for seq, rs in zip(lps, ratios, strict=True)]


def _step(groups: list[Group], **cfg) -> tuple[dict, dict]:
    t = _trainer(**cfg)
    metrics = t.step(groups)
    return {k: v.clone() for k, v in t.model.state_dict().items()}, metrics


def _assert_same_step(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    for k in a[0]:
        assert torch.equal(a[0][k], b[0][k]), k
    strip = [{k: v for k, v in m.items() if not k.startswith(VOLATILE)} for m in (a[1], b[1])]
    assert strip[0] == strip[1]


def _plain() -> Group:
    return Group(PROMPT, RESPONSES, [1.0, 0.0])


def _with_rollout(engine: str = "", ratios=RATIOS, behaviour: bool = False) -> Group:
    lps = _trainer_logprobs([_plain()])[0]
    rollout = _rollout(lps, ratios)
    return Group(PROMPT, RESPONSES, [1.0, 0.0], rollout if behaviour else None, rollout_logprobs=rollout,
                 engine=engine)


CONFIGS = [{}, {"algorithm": "ppo"}, {"ppo_epochs": 2, "mini_batch_size": 1, "micro_batch_size": 1}]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["grpo-on-policy", "ppo", "grpo-2-epochs-minibatches"])
@pytest.mark.parametrize("rollout_is,engine", [("off", "vllm"), ("auto", "torch"), ("auto", "")])
def test_tis_off_is_the_step_without_rollout_logprobs_bit_for_bit(cfg, rollout_is, engine):
    old = _step([_plain()], **cfg)
    new = _step([_with_rollout(engine)], rollout_is=rollout_is, **cfg)
    _assert_same_step(old, new)
    assert not any(k.startswith("rollout_is/") for k in new[1])
    assert new[1]["mismatch/mean_abs_logp_diff"] > 0.1          # measured all the same


def test_tis_on_multiplies_each_tokens_loss_by_the_hand_computed_weight():
    on = _step([_with_rollout("vllm")], rollout_is="auto")[1]
    # GRPO on rewards (1, 0): mean 0.5, unbiased std sqrt(0.5): A = +-0.5 / (sqrt(0.5) + 1e-6).
    # On-policy the ratio is 1, so each token's loss is -A * w, w = min(RATIOS, 2); token-mean over 5.
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    w = [[0.6, 1.5, 2.0], [1.0, 0.8]]
    want = (-a * sum(w[0]) + a * sum(w[1])) / 5
    assert on["actor/pg_loss"] == pytest.approx(want, abs=1e-5)
    assert on["rollout_is/mean_weight"] == pytest.approx((0.6 + 1.5 + 2.0 + 1.0 + 0.8) / 5, abs=1e-5)
    assert on["rollout_is/clipped_frac"] == pytest.approx(1 / 5)
    off = _step([_with_rollout("vllm")], rollout_is="off")[1]
    assert off["actor/pg_loss"] == pytest.approx((-a * 3 + a * 2) / 5, abs=1e-5)   # the unweighted loss
    # rollout_is "on" weighs every group that brings rollout log-probs, whatever its engine
    assert _step([_with_rollout("torch")], rollout_is="on")[1]["actor/pg_loss"] == pytest.approx(want, abs=1e-5)


def _grads(**cfg) -> torch.Tensor:
    t = _trainer(**cfg)
    t.step([_with_rollout("vllm")])
    return torch.cat([p.grad.flatten() for p in t.model.parameters() if p.grad is not None])


def test_tis_on_changes_the_gradient_and_micro_batching_does_not():
    off, on = _grads(rollout_is="off"), _grads(rollout_is="on")
    assert not torch.allclose(off, on, atol=1e-4)
    assert torch.allclose(on, _grads(rollout_is="on", micro_batch_size=1), atol=1e-6)


def test_tis_weights_from_the_old_logprobs_when_the_step_is_not_on_policy():
    """PPO: the trainer's behaviour log-probs are its no-grad pass (old_logp): same weights."""
    m = _step([_with_rollout("vllm")], algorithm="ppo", rollout_is="on")[1]
    assert m["rollout_is/mean_weight"] == pytest.approx((0.6 + 1.5 + 2.0 + 1.0 + 0.8) / 5, abs=1e-5)
    assert m["rollout_is/clipped_frac"] == pytest.approx(1 / 5)


def test_stale_groups_weigh_one_and_stay_out_of_the_mismatch_metrics():
    """A stale group's ratio already starts from the actor's log-probs (behaviour_logprobs), so
    TIS weighs it 1; its gap to the current weights is the policy's change, not measured."""
    stale = _with_rollout("vllm", behaviour=True)
    m = _step([stale], rollout_is="on")[1]
    assert m["rollout_is/mean_weight"] == pytest.approx(1.0, abs=1e-6)
    assert not any(k.startswith("mismatch/") for k in m)
    both = _step([stale, _with_rollout("vllm")], rollout_is="on")[1]
    alone = _step([_with_rollout("vllm")], rollout_is="on")[1]
    for k in ("mismatch/mean_abs_logp_diff", "mismatch/kl", "mismatch/ratio_outside_frac"):
        assert both[k] == pytest.approx(alone[k], abs=1e-6)


def test_mismatch_metrics_hand_computed_in_a_step():
    m = _step([_with_rollout("vllm")], rollout_is="off")[1]
    d = [math.log(r) for rs in RATIOS for r in rs]
    assert m["mismatch/mean_abs_logp_diff"] == pytest.approx(sum(map(abs, d)) / 5, abs=1e-5)
    k3 = [[r - 1 - math.log(r) for r in rs] for rs in RATIOS]
    assert m["mismatch/kl"] == pytest.approx((sum(k3[0]) / 3 + sum(k3[1]) / 2) / 2, abs=1e-5)
    assert m["mismatch/ratio_outside_frac"] == pytest.approx(1 / 5)        # only 3.0 is outside [0.5, 2]


def test_torch_generation_has_no_mismatch_and_a_perturbed_one_has():
    """The torch backend samples with the trainer's own forward: its log-probs are the
    trainer's (to float rounding), so the mismatch is ~0; shifted log-probs show up."""
    model, tok = load_policy("tiny", seed=1)
    prompts = [encode_prompt(tok, r) for r in tiny_copy_rows(3, seed=1)]
    out = TorchGenerator(model, tok).generate(prompts, SamplingParams(n=2, temperature=0.7, max_new_tokens=5,
                                                                      seed=3))

    def step(shift: float) -> dict:
        m, t = load_policy("tiny", seed=1)
        trainer = Trainer(m, t.pad_token_id, TrainConfig(temperature=0.7))
        return trainer.step([Group(p, [c.token_ids for c in g], [0.0, 1.0],
                                   rollout_logprobs=[[lp + shift for lp in c.logprobs] for c in g], engine="torch")
                             for p, g in zip(prompts, out, strict=True)])

    exact = step(0.0)
    assert exact["mismatch/mean_abs_logp_diff"] < 1e-4
    assert exact["mismatch/kl"] < 1e-8 and exact["mismatch/ratio_outside_frac"] == 0.0
    shifted = step(0.3)   # the rollout engine 0.3 nats more confident on every token
    assert shifted["mismatch/mean_abs_logp_diff"] == pytest.approx(0.3, abs=1e-4)
    assert shifted["mismatch/kl"] == pytest.approx(math.exp(-0.3) - 1 + 0.3, abs=1e-4)
    assert shifted["mismatch/ratio_outside_frac"] == 0.0                      # exp(-0.3) = 0.74
    assert step(-1.0)["mismatch/ratio_outside_frac"] == 1.0                   # exp(1) = 2.72 > 2


def test_rollout_logprobs_must_match_the_responses():
    bad = Group(PROMPT, RESPONSES, [1.0, 0.0], rollout_logprobs=[[-1.0, -1.0, -1.0], [-1.0]])
    with pytest.raises(ValueError, match="one log-prob per response token"):
        _trainer().step([bad])


def test_rollout_is_settings():
    assert TrainConfig().rollout_is == "auto" and TrainConfig().rollout_is_cap == 2.0
    assert TrainConfig(rollout_is=False).rollout_is == "off"      # YAML 1.1 reads a bare off as false
    assert TrainConfig(rollout_is=True).rollout_is == "on"
    cfg = TrainConfig()
    assert cfg.tis_for("vllm") and not cfg.tis_for("torch") and not cfg.tis_for("")
    assert TrainConfig(rollout_is="on").tis_for("") and not TrainConfig(rollout_is="off").tis_for("vllm")
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        TrainConfig(rollout_is_cap=0.5)
    with pytest.raises(ValueError):
        TrainConfig(rollout_is="sometimes")
