"""A step whose loss or gradient norm is not finite is skipped: the weights, the optimizer
state, the LR schedule and the global step stay those of the last good step, bit for bit,
also when earlier minibatches (or epochs) of the same step had already been applied."""

import math

import pytest
import torch

from steadyrl.model.models import load_policy
from steadyrl.rl import core
from steadyrl.rl.trainer import Group, NonFiniteStep, TrainConfig, Trainer, build_batch

GROUPS = [Group([1, 5, 40, 7], [[6, 7, 9], [8, 9, 2], [3, 3], [4, 5, 6, 7]], [1.0, 0.0, 0.5, 0.0]),
          Group([2, 9, 11], [[6, 1], [8, 8, 8], [3], [5, 6]], [0.0, 1.0, 1.0, 0.0])]
OTHER = [Group([3, 4], [[7, 7], [9], [10, 11], [12]], [0.0, 1.0, 0.0, 1.0]),
         Group([8, 8, 8], [[5], [6, 6], [7], [8]], [1.0, 1.0, 0.0, 0.0])]


def _trainer(**cfg):
    model, tok = load_policy("tiny", seed=0)
    return Trainer(model, tok.pad_token_id, TrainConfig(**{"lr": 1e-2, "micro_batch_size": 8, **cfg}))


def _state(tr: Trainer) -> dict:
    """Everything a step may change, as CPU copies."""
    opt = tr.opt.state_dict()
    return {"weights": {k: v.clone() for k, v in tr.model.state_dict().items()},
            "opt": {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                    for i, s in opt["state"].items()},
            "groups": opt["param_groups"], "sched": tr.sched.state_dict(), "global_step": tr.global_step,
            "lr": tr.sched.get_last_lr()}


def _assert_same(a: dict, b: dict) -> None:
    assert a["weights"].keys() == b["weights"].keys()
    for k in a["weights"]:
        assert torch.equal(a["weights"][k], b["weights"][k]), k
    assert a["opt"].keys() == b["opt"].keys()
    for i in a["opt"]:
        assert a["opt"][i].keys() == b["opt"][i].keys(), i
        for k, v in a["opt"][i].items():
            w = b["opt"][i][k]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (i, k)
    assert (a["groups"], a["sched"], a["global_step"], a["lr"]) == (b["groups"], b["sched"], b["global_step"], b["lr"])


def _nan_grad_on_call(tr: Trainer, calls: set[int]):
    """A hook that turns the embedding's gradient into NaN on the backward passes numbered
    `calls` (1-based): a gradient blow-up in that micro-batch."""
    seen = [0]

    def hook(g):
        seen[0] += 1
        return g * float("nan") if seen[0] in calls else g

    return tr.model.get_input_embeddings().weight.register_hook(hook), seen


def test_a_nan_gradient_skips_the_step_and_changes_nothing():
    tr = _trainer()
    tr.step(GROUPS)                                          # a good step: optimizer state exists
    before = _state(tr)
    handle, _ = _nan_grad_on_call(tr, {1})
    with pytest.raises(NonFiniteStep) as err:
        tr.step(OTHER)
    handle.remove()
    assert err.value.what == "grad_norm" and math.isnan(err.value.value)
    assert err.value.step == 2 and err.value.rolled_back == 0 and "skipped" in str(err.value)
    _assert_same(before, _state(tr))
    assert all(p.grad is None for p in tr.params)            # no NaN gradient left behind
    assert all(bool(torch.isfinite(v).all()) for v in tr.model.state_dict().values())

    # the skipped step leaves no trace: the next step equals that step on a trainer that never saw it
    ref = _trainer()
    ref.step(GROUPS)
    tr.step(OTHER)
    ref.step(OTHER)
    _assert_same(_state(ref), _state(tr))


def test_the_first_step_skipped_leaves_no_optimizer_state():
    tr = _trainer()
    before = _state(tr)
    handle, _ = _nan_grad_on_call(tr, {1})
    with pytest.raises(NonFiniteStep):
        tr.step(GROUPS)
    handle.remove()
    _assert_same(before, _state(tr))
    assert tr.opt.state_dict()["state"] == {}


def test_a_nan_loss_skips_the_step(monkeypatch):
    tr = _trainer()
    tr.step(GROUPS)
    before = _state(tr)
    real = core.policy_loss

    def nan_loss(*a, **kw):
        loss, m = real(*a, **kw)
        return loss * float("nan"), m

    monkeypatch.setattr(core, "policy_loss", nan_loss)
    with pytest.raises(NonFiniteStep) as err:
        tr.step(OTHER)
    assert err.value.what == "loss"
    _assert_same(before, _state(tr))


def test_an_infinite_loss_is_not_finite_either(monkeypatch):
    tr = _trainer()
    before = _state(tr)
    real = core.policy_loss
    monkeypatch.setattr(core, "policy_loss", lambda *a, **kw: (real(*a, **kw)[0] + float("inf"), real(*a, **kw)[1]))
    with pytest.raises(NonFiniteStep) as err:
        tr.step(GROUPS)
    assert err.value.what == "loss" and err.value.value == float("inf")
    _assert_same(before, _state(tr))


@pytest.mark.parametrize("cfg, nan_at, where", [
    ({"mini_batch_size": 4}, {2}, (0, 1)),                       # minibatch 2 of 2, after minibatch 1 was applied
    ({"mini_batch_size": 4, "ppo_epochs": 2}, {4}, (1, 1)),      # the last minibatch of epoch 2
    ({"ppo_epochs": 3}, {3}, (2, 0)),                            # whole-batch minibatches, epoch 3
    ({"algorithm": "ppo", "mini_batch_size": 4}, {2}, (0, 1)),   # PPO: the value head rolls back too
    ({"mini_batch_size": 4, "micro_batch_size": 2}, {3}, (0, 1)),  # micro-batches: the 3rd backward
])
def test_a_later_minibatch_going_nan_rolls_back_the_ones_applied(cfg, nan_at, where):
    tr = _trainer(**cfg)
    tr.step(GROUPS)
    before = _state(tr)
    value_head = ({k: v.clone() for k, v in tr.value_head.state_dict().items()} if tr.value_head else {})
    handle, _ = _nan_grad_on_call(tr, nan_at)
    with pytest.raises(NonFiniteStep) as err:
        tr.step(OTHER)
    handle.remove()
    assert (err.value.epoch, err.value.minibatch) == where and err.value.rolled_back >= 1
    _assert_same(before, _state(tr))
    if tr.value_head is not None:
        assert all(torch.equal(v, tr.value_head.state_dict()[k]) for k, v in value_head.items())

    ref = _trainer(**cfg)   # and the run goes on as if the bad step had never been tried
    ref.step(GROUPS)
    ref.step(OTHER)
    tr.step(OTHER)
    _assert_same(_state(ref), _state(tr))


def test_finite_steps_take_no_snapshot_when_one_optimizer_step_is_all(monkeypatch):
    """The default GRPO step (one epoch, whole-batch minibatch) checks before its one
    optimizer step and copies nothing; several optimizer steps copy once, before the first."""
    copies = []
    real = Trainer._snapshot
    monkeypatch.setattr(Trainer, "_snapshot", lambda self: copies.append(1) or real(self))
    _trainer().step(GROUPS)
    assert copies == []
    _trainer(mini_batch_size=4, ppo_epochs=2).step(GROUPS)
    assert copies == [1]


@pytest.mark.parametrize("cfg", [{}, {"ppo_epochs": 2, "mini_batch_size": 4}, {"algorithm": "ppo"}],
                         ids=["grpo-one-pass", "grpo-epochs-minibatches", "ppo"])
def test_an_absurd_behaviour_logprob_of_a_stale_group_gives_a_finite_step(cfg, monkeypatch):
    """Issue 33: a stale group (max_staleness >= 1) brings its sampler's log-probs; one of
    -1e4 (the contracts accept it: steadyrl/wire/contracts.py LOGPROB_MIN) made exp(logp - old_logp)
    inf and the step NaN. The ratio's log is clamped at +-20 (core.LOG_RATIO_CLAMP)."""
    probe = _trainer(**cfg)
    lp, _ = probe._no_grad_pass(probe.module, build_batch(GROUPS, probe.pad_id))   # (N, T)
    g0 = GROUPS[0]
    behaviour = [lp[i, :len(r)].tolist() for i, r in enumerate(g0.responses)]
    behaviour[1][2] = -1e4                                     # one token of one sample
    groups = [Group(g0.prompt_ids, g0.responses, g0.rewards, behaviour), *GROUPS[1:]]

    tr = _trainer(**cfg)
    before = _state(tr)
    m = tr.step(groups)
    assert tr.global_step == 1
    for k in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/pg_clipfrac", "actor/pg_clipfrac_lower"):
        assert math.isfinite(m[k]), (k, m[k])
    assert m["actor/pg_clipfrac"] + m["actor/pg_clipfrac_lower"] > 0   # the -1e4 token: clip or dual clip
    after = _state(tr)["weights"]
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(before["weights"][k], after[k]) for k in after)   # the step was applied

    # the same batch without the clamp is the NaN step the issue saw
    monkeypatch.setattr(core, "LOG_RATIO_CLAMP", math.inf)
    with pytest.raises(NonFiniteStep):
        _trainer(**cfg).step(groups)
