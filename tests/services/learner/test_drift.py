"""Per-layer parameter drift and the KL trend test of the learner's algorithm metrics."""

import numpy as np
import pytest
import torch

from steadyrl.model.models import tiny_config
from steadyrl.services.learner.drift import ParamDrift, kl_trend, layer_of


def test_layer_labels():
    assert layer_of("model.layers.3.mlp.up_proj.weight") == "layers.3"
    assert layer_of("model.layers.12.self_attn.q_proj.weight") == "layers.12"
    assert layer_of("model.embed_tokens.weight") == "embed_tokens"
    assert layer_of("model.norm.weight") == "norm"
    assert layer_of("lm_head.weight") == "lm_head"


def test_drift_is_the_relative_l2_distance_per_layer():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(32))
    d = ParamDrift(model)
    assert set(d.measure(model).values()) == {0.0}
    with torch.no_grad():
        for n, p in model.named_parameters():
            if layer_of(n) == "layers.0":
                p.mul_(1.5)                       # every parameter of block 0 scaled: drift exactly 0.5
    drift = d.measure(model)
    assert drift["layers.0"] == pytest.approx(0.5, rel=1e-6)
    assert all(v == 0.0 for k, v in drift.items() if k != "layers.0")


def test_kl_trend_finds_a_rising_kl_and_not_noise():
    rng = np.random.default_rng(0)
    rising = list(0.01 * np.arange(20) + rng.normal(0, 0.005, 20))
    slope, p = kl_trend(rising)
    assert slope == pytest.approx(0.01, rel=0.2) and p < 0.01
    _, p_noise = kl_trend(list(rng.normal(0.05, 0.005, 20)))
    assert p_noise > 0.05
    assert kl_trend([0.1, 0.2, 0.3]) is None and kl_trend([0.1] * 10) is None
