"""The learner hands the trainer every group's actor log-probs and engine, and exports the
train/inference mismatch and TIS figures: /metrics (steadyrl_learner_train{metric=...}) and the
per-step history in state.json."""

import json
import math

from prometheus_client import REGISTRY

from steadyrl.rl.trainer import Trainer
from tests.services.learner.conftest import Msg, scored


def _fill(learner, engine: str):
    learner.feeder.top_up()
    for i, pid in enumerate(list(learner.state.in_flight)):
        sg = scored(learner.state, pid)
        sg = sg.model_copy(update={"group": sg.group.model_copy(update={"engine": engine})})
        learner.intake.accept(Msg(sg, pid, offset=i))


def _gauge(metric: str) -> float | None:
    return REGISTRY.get_sample_value("steadyrl_learner_train", {"metric": metric})


def _train(lrn, monkeypatch) -> tuple[dict, list]:
    seen: list = []
    real = Trainer.step

    def step(self, groups):
        seen.extend(groups)
        return real(self, groups)

    monkeypatch.setattr(Trainer, "step", step)
    lrn.store.publish(lrn.model, lrn.state)
    metrics = lrn.train_step()
    assert metrics is not None
    return metrics, seen


def test_vllm_groups_are_weighed_and_every_figure_is_exported(make_learner, monkeypatch):
    lrn = make_learner()
    _fill(lrn, "vllm")
    ready = {pid: r.group for pid, r in lrn.intake.ready.items()}
    metrics, groups = _train(lrn, monkeypatch)
    # the actor's log-probs of every sample and its engine, as the trainer saw them
    by_prompt = {tuple(sg.group.samples[0].token_ids): sg for sg in ready.values()}
    for g in groups:
        sg = by_prompt[tuple(g.responses[0])]
        assert g.rollout_logprobs == [s.logprobs for s in sg.group.samples] and g.engine == "vllm"
        assert g.behaviour_logprobs is None                                   # fresh: version 0 at step 0
    for k in ("mismatch/mean_abs_logp_diff", "mismatch/kl", "mismatch/ratio_outside_frac",
              "rollout_is/mean_weight", "rollout_is/clipped_frac"):
        assert math.isfinite(metrics[k]) and _gauge(k) == metrics[k], k
    assert metrics["mismatch/kl"] > 0     # the test groups' log-probs (-1.0 each) are not the model's
    row = json.loads((lrn.run_dir / "history.jsonl").read_text().splitlines()[-1])
    assert row["mismatch/kl"] == metrics["mismatch/kl"]
    assert row["rollout_is/mean_weight"] == metrics["rollout_is/mean_weight"]


def test_torch_groups_are_measured_not_weighed(make_learner, monkeypatch):
    lrn = make_learner()
    _fill(lrn, "torch")
    metrics, groups = _train(lrn, monkeypatch)
    assert {g.engine for g in groups} == {"torch"}
    assert "mismatch/kl" in metrics and not any(k.startswith("rollout_is/") for k in metrics)
    assert _gauge("mismatch/kl") == metrics["mismatch/kl"]
    assert math.isnan(_gauge("rollout_is/mean_weight"))                     # no value, not an older step's
    row = json.loads((lrn.run_dir / "history.jsonl").read_text().splitlines()[-1])
    assert "mismatch/mean_abs_logp_diff" in row and "rollout_is/mean_weight" not in row


def test_the_summary_has_the_mismatch_kl_per_step_and_none_for_older_steps(make_learner, monkeypatch):
    from steadyrl.services.learner import report

    lrn = make_learner()
    lrn.state.history.append({"step": 0, "reward_mean": 0.5, "seconds": 1.0})   # a step of a run before it
    _fill(lrn, "torch")
    metrics, _ = _train(lrn, monkeypatch)
    s = report.summary(lrn.lc, lrn.state)
    assert s["mismatch_kl_per_step"] == [None, metrics["mismatch/kl"]]
    json.dumps(s)
