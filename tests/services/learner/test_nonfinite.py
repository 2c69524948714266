"""A non-finite update in the learner: the step is skipped (weights, optimizer and version
stay), its batch goes to rl.quarantine with rule non_finite, the feeder replaces it, and the
weights published stay finite. The policy store and the checkpoint refuse non-finite weights."""

import pytest
import torch
from prometheus_client import REGISTRY

from steadyrl.rl import core
from steadyrl.run import checkpoint as ck
from steadyrl.run import policy_files, tensors
from steadyrl.services.learner.state import RunState
from steadyrl.wire.contracts import QuarantinedGroup
from tests.services.learner.conftest import Msg, scored


def _fill(learner, seed=0):
    """Top up and let every prompt in flight come back scored (valid groups)."""
    learner.feeder.top_up()
    for i, pid in enumerate(list(learner.state.in_flight)):
        if pid not in learner.intake.ready:
            learner.intake.accept(Msg(scored(learner.state, pid, seed=seed), pid, offset=100 * seed + i))


def _weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _nonfinite_steps():
    return REGISTRY.get_sample_value("steadyrl_learner_nonfinite_steps_total") or 0.0


def test_a_nan_step_is_skipped_quarantined_and_replaced(make_learner, monkeypatch):
    lrn = make_learner()
    st = lrn.state
    lrn.store.publish(lrn.model, st)                  # version 0, as run() does
    _fill(lrn)
    before, opt_before, counted = _weights(lrn.model), lrn.trainer.opt.state_dict(), _nonfinite_steps()
    real = core.policy_loss
    monkeypatch.setattr(core, "policy_loss", lambda *a, **kw: (real(*a, **kw)[0] * float("nan"), real(*a, **kw)[1]))
    taken = sorted(lrn.intake.ready)
    assert lrn.train_step() is None
    # nothing applied: same weights, no optimizer state, still version 0
    assert st.step == 0 and lrn.trainer.global_step == 0 and st.policy_uri.endswith("v000000")
    assert all(torch.equal(v, lrn.model.state_dict()[k]) for k, v in before.items())
    assert lrn.trainer.opt.state_dict()["state"] == opt_before["state"] == {}
    # the batch is held on rl.quarantine with the rule, out of the run, counted
    held = lrn.outbox.on("rl.quarantine")
    assert len(held) == 4 and all(isinstance(v, QuarantinedGroup) and v.rules == ["non_finite"] for _, v in held)
    assert sorted(v.group.prompt_id for _, v in held) == taken and held[0][1].step == 1
    assert sorted(st.quarantined) == taken and lrn.intake.ready == {} and not st.in_flight
    assert st.counts["quarantined"] == 4 and st.counts["quarantined_batches"] == 1
    assert _nonfinite_steps() == counted + 1
    assert RunState.parse((lrn.run_dir / "state.json").read_text(), "x").quarantined.keys() == set(taken)

    # the feeder publishes 4 other prompts in their place; they train, and what is published is finite
    monkeypatch.setattr(core, "policy_loss", real)
    _fill(lrn, seed=1)
    assert st.fed == 8 and not set(lrn.intake.ready) & set(taken)
    assert lrn.train_step() is not None and st.step == 1
    weights = policy_files.read_version(lrn.store.root, st.policy_uri, st.policy_sha256)
    assert all(bool(torch.isfinite(t).all()) for t in weights.values())
    assert any(not torch.equal(v, lrn.model.state_dict()[k]) for k, v in before.items())


def test_the_policy_store_refuses_non_finite_weights(make_learner):
    lrn = make_learner()
    st = lrn.state
    lrn.store.publish(lrn.model, st)
    uri, sent = st.policy_uri, len(lrn.outbox.on("rl.policy"))
    with torch.no_grad():
        next(lrn.model.parameters())[0, 0] = float("inf")
    st.step = 1
    with pytest.raises(tensors.NonFiniteWeights, match=r"policy version 1 of run .*: refusing to write non-finite "
                                                  r"weights: model\.embed_tokens\.weight hold NaN or infinity"):
        lrn.store.publish(lrn.model, st)
    assert st.policy_uri == uri and len(lrn.outbox.on("rl.policy")) == sent       # nothing announced
    assert not (lrn.store.root / st.run_id / "v000001").exists()                  # nor written


@pytest.mark.parametrize("where", ["model", "optimizer"])
def test_a_checkpoint_refuses_non_finite_weights_and_writes_nothing(make_learner, tmp_path, where):
    lrn = make_learner()
    _fill(lrn)
    lrn.train_step()                                                              # optimizer state exists
    snap = ck.snapshot(lrn.model, lrn.trainer.opt, lrn.trainer.sched)
    if where == "model":
        next(iter(snap["model"].values())).view(-1)[3] = float("nan")
    else:
        snap["optimizer"]["state"][0]["exp_avg"].view(-1)[0] = float("nan")
    with pytest.raises(tensors.NonFiniteWeights, match=f"checkpoint step 1: {where}: refusing"):
        ck.write(tmp_path / "ckpts", 1, snap, {}, {"model": "tiny"})
    assert not (tmp_path / "ckpts").exists() or not any((tmp_path / "ckpts").iterdir())
