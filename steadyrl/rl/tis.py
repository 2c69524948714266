"""The train/inference mismatch of a step and its correction, TIS, in one place.

The rollout engine (vLLM in bf16) samples with log-probs the trainer does not reproduce
exactly. Groups that bring the engine's log-probs (`Group.rollout_logprobs`) get the mismatch
metrics (mismatch/*) and, where `TrainConfig.rollout_is` says so, truncated importance
sampling: each token's policy-gradient loss times min(pi_trainer / pi_rollout, C) (Yao et al.
2025; `core.tis_weights`). Shapes: N sequences, T response tokens, n rows of a micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from steadyrl.rl import core
from steadyrl.rl.batch import Group
from steadyrl.rl.config import TrainConfig


@dataclass
class RolloutLogprobs:
    """The rollout engine's log-probs of a batch, packed like build_batch's responses."""

    logp: torch.Tensor       # (N, T) the actor's log-probs; 0 on padding and in groups without them
    measured: torch.Tensor   # (N,) bool: rows the mismatch metrics are computed on
    tis: torch.Tensor        # (N,) bool: rows TIS weighs


def rollout_logprobs(groups: list[Group], T: int, cfg: TrainConfig) -> RolloutLogprobs | None:
    """The groups' `rollout_logprobs` as tensors, or None when no group brings them.

    The mismatch is measured on groups with rollout log-probs that the current policy sampled
    (no behaviour_logprobs): for a stale group the trainer no longer has the weights that
    sampled it, so its gap would mix the policy's change with the engines'. TIS weighs every
    group with rollout log-probs that `cfg.tis_for(group.engine)` names. Raises ValueError when
    a response's rollout log-probs are not as long as the response.
    """
    if all(g.rollout_logprobs is None for g in groups):
        return None
    N = sum(len(g.responses) for g in groups)
    logp = torch.zeros(N, T)                                                     # (N, T)
    measured = torch.zeros(N, dtype=torch.bool)                                  # (N,)
    tis = torch.zeros(N, dtype=torch.bool)                                       # (N,)
    row = 0
    for g in groups:
        G = len(g.responses)
        if g.rollout_logprobs is not None:
            if len(g.rollout_logprobs) != G or any(len(lp) != len(r) for lp, r in zip(g.rollout_logprobs,
                                                                                      g.responses, strict=True)):
                raise ValueError(f"rollout_logprobs must hold one log-prob per response token, got lengths "
                                 f"{[len(lp) for lp in g.rollout_logprobs]} for responses of "
                                 f"{[len(r) for r in g.responses]}")
            for i, lp in enumerate(g.rollout_logprobs):
                logp[row + i, :len(lp)] = torch.tensor(lp, dtype=logp.dtype)
            measured[row:row + G] = g.behaviour_logprobs is None
            tis[row:row + G] = cfg.tis_for(g.engine)
        row += G
    return RolloutLogprobs(logp, measured, tis)



class RolloutCorrection:
    """A step's trainer-side log-probs against the rollout engine's, and the TIS weights.

    The trainer's side is the behaviour log-probs (`Behaviour`): known before the update when
    a no-grad pass made them (`old_logp`), else filled in by each micro-batch as the update's
    forward makes them (`weights`), and summed over the ranks at the end (`all_reduce`).
    Rows TIS does not weigh get weight 1; without any row to weigh `weights` returns None and
    the loss is exactly the one without rollout log-probs.
    """

    def __init__(self, ro: RolloutLogprobs, mask: torch.Tensor, cap: float, old_logp: torch.Tensor | None):
        self.ro, self.mask, self.cap = ro, mask, cap                          # mask (N, T)
        self.filled = old_logp is None       # the trainer's side comes from the micro-batches
        self.any_tis = bool(ro.tis.any())
        self.trainer_logp = torch.zeros_like(mask) if old_logp is None else old_logp           # (N, T)
        self.tis_w: torch.Tensor | None = None                                                  # (N, T)
        if self.any_tis:
            self.tis_w = torch.ones_like(mask) if old_logp is None else self._weights(slice(None), old_logp)

    @classmethod
    def of(cls, groups: list[Group], mask: torch.Tensor, cfg: TrainConfig,
           old_logp: torch.Tensor | None) -> RolloutCorrection | None:
        """The step's correction, or None when no group brings rollout log-probs."""
        ro = rollout_logprobs(groups, mask.shape[1], cfg)
        if ro is None:
            return None
        dev = mask.device
        return cls(RolloutLogprobs(ro.logp.to(dev), ro.measured.to(dev), ro.tis.to(dev)), mask,
                   cfg.rollout_is_cap, old_logp)

    def _weights(self, idx: torch.Tensor | slice, behaviour: torch.Tensor) -> torch.Tensor:
        w = core.tis_weights(behaviour, self.ro.logp[idx], self.mask[idx], self.cap)           # (n, T)
        return torch.where(self.ro.tis[idx, None], w, 1.0)                                      # (n, T)

    def weights(self, idx: torch.Tensor, behaviour: torch.Tensor) -> torch.Tensor | None:
        """(n, T) TIS weights of rows `idx` with behaviour log-probs `behaviour` (n, T), or None
        when no row of the step is weighed; records the trainer's side of those rows."""
        if not self.filled:
            return self.tis_w[idx] if self.tis_w is not None else None
        self.trainer_logp[idx] = behaviour
        if self.tis_w is None:
            return None
        w = self._weights(idx, behaviour)
        self.tis_w[idx] = w
        return w

    def all_reduce(self) -> None:
        """Several ranks, filled by micro-batches: each rank filled the rows of its own (zeros,
        TIS weights ones, elsewhere); sum them so every rank has every row. A collective."""
        if not self.filled:
            return
        dist.all_reduce(self.trainer_logp)
        if self.tis_w is not None:
            self.tis_w -= 1.0
            dist.all_reduce(self.tis_w)
            self.tis_w += 1.0

    def metrics(self) -> dict[str, float]:
        """mismatch/* on the rows measured (fresh groups), rollout_is/* on the tokens TIS weighs."""
        out: dict[str, float] = {}
        ro, mask = self.ro, self.mask
        with torch.no_grad():
            if bool(ro.measured.any()):
                rows = ro.measured
                out.update({f"mismatch/{k}": v for k, v in
                            core.mismatch_metrics(self.trainer_logp[rows], ro.logp[rows], mask[rows]).items()})
            if self.tis_w is not None:
                tis_mask = mask * ro.tis[:, None]                                # (N, T) tokens TIS weighs
                out["rollout_is/mean_weight"] = float(core.masked_mean(self.tis_w, tis_mask))
                out["rollout_is/clipped_frac"] = float(core.masked_mean((self.tis_w >= self.cap).float(), tis_mask))
        return out
