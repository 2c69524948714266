"""How far the policy has moved: per-layer parameter drift and the KL trend.

Parameter drift of layer l (its parameters concatenated), relative to the reference weights
θ0 (the model as loaded, before any update or resume):

    drift_l = ||θ_l - θ0_l||_2 / ||θ0_l||_2                       (dimensionless)

Layers are the model's blocks: `layers.<i>` for every parameter under `...layers.<i>.`, else
the first name part after the model prefix (`embed_tokens`, `norm`, `lm_head`, ...), so a
model with 30 blocks exports ~33 series. Exported as `steadyrl_learner_param_drift{layer}`.

KL trend over the last `window` steps of `actor/kl_ref` (KL to the reference policy, when
the trainer has one: `train.use_kl_loss` or `kl_in_reward`):

    slope     Theil-Sen estimator (median of pairwise slopes; Sen 1968), KL units per step
    p-value   Mann-Kendall trend test = Kendall's tau of (step, KL), two-sided (Kendall 1938)

Exported as `steadyrl_learner_kl_slope` and `steadyrl_learner_kl_trend_pvalue`; the KLDrift
alert wants both a slope above its effect size and p < 0.01.
"""

from __future__ import annotations

import re

import torch
from scipy.stats import kendalltau, theilslopes

_BLOCK = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


def layer_of(name: str) -> str:
    """The layer label of a parameter name: `model.layers.3.mlp.up_proj.weight` -> `layers.3`,
    `model.embed_tokens.weight` -> `embed_tokens`, `lm_head.weight` -> `lm_head`."""
    m = _BLOCK.search(name)
    if m:
        return f"layers.{m.group(1)}"
    parts = name.split(".")
    return parts[1] if parts[0] in ("model", "transformer") and len(parts) > 2 else parts[0]


class ParamDrift:
    """Relative L2 distance of each layer from a snapshot taken at construction.

    Args:
        model: the policy; its parameters are copied (fp32, CPU) as the reference: memory of
            one more fp32 copy of the weights (0.54 GB for SmolLM2-135M).
    """

    def __init__(self, model: torch.nn.Module):
        self.ref = {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in model.named_parameters()}

    @torch.no_grad()
    def measure(self, model: torch.nn.Module) -> dict[str, float]:
        """{layer: drift_l} for the model's current parameters."""
        diff2: dict[str, float] = {}
        ref2: dict[str, float] = {}
        for n, p in model.named_parameters():
            r = self.ref[n]
            layer = layer_of(n)
            diff2[layer] = diff2.get(layer, 0.0) + float((p.detach().to("cpu", torch.float32) - r).pow(2).sum())
            ref2[layer] = ref2.get(layer, 0.0) + float(r.pow(2).sum())
        return {layer: (diff2[layer] / ref2[layer]) ** 0.5 if ref2[layer] > 0 else 0.0 for layer in diff2}


def kl_trend(values: list[float]) -> tuple[float, float] | None:
    """(Theil-Sen slope per step, Mann-Kendall two-sided p-value) of a series at steps 0..n-1;
    None with fewer than 4 points (no test has power there) or a constant series."""
    if len(values) < 4 or max(values) == min(values):
        return None
    x = list(range(len(values)))
    slope = float(theilslopes(values, x)[0])
    return slope, float(kendalltau(x, values).pvalue)
