"""A step's batch: scored groups packed into tensors, and the behaviour log-probs of its rows.

Shapes: N sequences (B prompts x G samples), P prompt tokens (left padded), T response tokens
(right padded), n rows of a micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Group:
    """One prompt's samples and rewards, as the trainer needs them."""

    prompt_ids: list[int]
    responses: list[list[int]]           # G x (T_i,)
    rewards: list[float]                 # (G,)
    # G x (T_i,): log-probs of an older policy that sampled the responses. Give them only
    # when that policy is not the current one (a stale group); the ratio then starts from them.
    behaviour_logprobs: list[list[float]] | None = None
    # Scales the group's advantages, i.e. its share of the policy-gradient loss (0 excludes
    # it). The learner uses it for cache-scored groups.
    weight: float = 1.0
    # G x (T_i,): the rollout engine's log-probs of every response, fresh or stale (the actor's
    # Sample.logprobs). They measure the train/inference mismatch (mismatch/* metrics) and, when
    # TrainConfig.rollout_is says so, weigh the loss (TIS); None: neither.
    rollout_logprobs: list[list[float]] | None = None
    # The engine that generated the samples: "torch", "vllm", or "" (unknown). rollout_is "auto"
    # applies TIS to "vllm" groups only.
    engine: str = ""
    # G x (T_i,) or None per sample: 1 on the policy's tokens, 0 on tool/environment tokens of a
    # multi-turn episode (Sample.loss_mask); None: all ones. It multiplies the response mask, so
    # the losses, KL, entropy and TIS count only the policy's tokens, with unchanged formulas.
    loss_masks: list[list[int] | None] | None = None


def build_batch(groups: list[Group], pad_id: int) -> dict[str, torch.Tensor]:
    """Pack groups into tensors: [left-padded prompt | right-padded response].

    Returns input_ids (N, P+T), attention_mask (N, P+T), position_ids (N, P+T),
    responses (N, T), response_mask (N, T) (1 on response tokens that are trained: padding and
    a group's `loss_masks` zeros are 0), rewards (N,), group_sizes (B,), and P. Groups may
    differ in size (a data gate removed samples). Raises ValueError for an empty group.
    """
    seqs = [(g.prompt_ids, r) for g in groups for r in g.responses]
    masks = [m for g in groups for m in (g.loss_masks or [None] * len(g.responses))]
    P = max(len(p) for p, _ in seqs)
    T = max(max(len(r) for _, r in seqs), 1)
    ids, attn, resp, rmask = [], [], [], []
    for (p, r), m in zip(seqs, masks, strict=True):
        ids.append([pad_id] * (P - len(p)) + p + r + [pad_id] * (T - len(r)))
        attn.append([0] * (P - len(p)) + [1] * (len(p) + len(r)) + [0] * (T - len(r)))
        resp.append(r + [pad_id] * (T - len(r)))
        rmask.append([float(x) for x in (m if m is not None else [1] * len(r))] + [0.0] * (T - len(r)))
    attention_mask = torch.tensor(attn)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    sizes = [len(g.responses) for g in groups]
    if min(sizes) < 1 or any(len(g.rewards) != len(g.responses) for g in groups):
        raise ValueError(f"every group needs >= 1 sample and one reward per sample, got sizes {sizes}")
    return {"input_ids": torch.tensor(ids), "attention_mask": attention_mask, "position_ids": position_ids,
            "responses": torch.tensor(resp), "response_mask": torch.tensor(rmask),
            "rewards": torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32),
            "group_sizes": torch.tensor(sizes), "P": torch.tensor(P)}



def behaviour_logprobs(groups: Sequence[Group], T: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The log-probs stale groups bring of their responses (`Group.behaviour_logprobs`) as
    (logp (N, T), where (N, T) bool: the positions they cover), or None when no group is stale."""
    if all(g.behaviour_logprobs is None for g in groups):
        return None
    N = sum(len(g.responses) for g in groups)
    logp = torch.zeros(N, T)                                                     # (N, T)
    where = torch.zeros(N, T, dtype=torch.bool)                                  # (N, T)
    row = 0
    for g in groups:
        rows: Sequence[list[float] | None] = g.behaviour_logprobs or [None] * len(g.responses)
        for lp in rows:
            if lp is not None:
                logp[row, :len(lp)] = torch.tensor(lp, dtype=logp.dtype)
                where[row, :len(lp)] = True
            row += 1
    return logp, where



@dataclass
class Behaviour:
    """The behaviour policy's log-probs of a step's responses: the ratio's denominator.

    For fresh groups they are the current policy's; stale groups bring the older sampler's
    (`Group.behaviour_logprobs`: decoupled PPO). With several optimizer steps, or a critic,
    they come from a no-grad pass before the update (`old_logp`, stale rows overwritten);
    one update on the whole batch without a critic (`one_pass`) takes them from its own
    forward instead (ratio 1 on fresh rows): no separate pass.
    """

    one_pass: bool
    old_logp: torch.Tensor | None = None                       # (N, T), not one_pass
    old_values: torch.Tensor | None = None                     # (N, T), critic
    stale: tuple[torch.Tensor, torch.Tensor] | None = None     # (N, T) log-probs, (N, T) where they count

    def rows(self, idx: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
        """(n, T) behaviour log-probs of rows `idx`, whose current log-probs are `logp` (n, T)."""
        if not self.one_pass:
            assert self.old_logp is not None
            return self.old_logp[idx]
        behaviour = logp.detach()
        if self.stale is not None:                              # the sampler's, where stale
            behaviour = torch.where(self.stale[1][idx], self.stale[0][idx], behaviour)
        return behaviour
