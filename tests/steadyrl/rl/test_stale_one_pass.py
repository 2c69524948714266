"""A single GRPO update (one epoch, one minibatch) with stale groups in its batch runs no
separate no-grad pass: fresh rows take their behaviour log-probs from the update's own forward,
stale rows from what they bring. Before, one stale group (max_staleness >= 1) made the trainer
run a no-grad forward over the whole batch, a third more model work a step, for rows it then
overwrote or that equal the update's forward (issue 22: work the algorithm does not need; on the
tiny pipeline at max_staleness 1 that pass was 10.5 % of the learner's CPU samples)."""

from __future__ import annotations

import torch

from steadyrl.model.models import load_policy
from steadyrl.rl.trainer import Group, TrainConfig, Trainer, build_batch
from tests.steadyrl.rl.test_distributed_step import GROUPS

CFG = {"lr": 1e-2, "micro_batch_size": 4}


def _trainer() -> Trainer:
    torch.manual_seed(0)
    model, tok = load_policy("tiny", seed=0)
    return Trainer(model, tok.pad_token_id, TrainConfig(**CFG))


def _current_logprobs(tr: Trainer, groups: list[Group]) -> list[list[list[float]]]:
    """Each response's log-probs under the trainer's current weights, per group."""
    lp, _ = tr._no_grad_pass(tr.module, build_batch(groups, tr.pad_id))      # (N, T)
    out, row = [], 0
    for g in groups:
        out.append([lp[row + i, :len(r)].tolist() for i, r in enumerate(g.responses)])
        row += len(g.responses)
    return out


def _weights(tr: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tr.model.state_dict().items()}


def test_a_stale_group_costs_no_extra_pass_and_its_own_logprobs_are_its_ratio_base():
    fresh = _trainer()
    m_fresh = fresh.step(GROUPS)

    stale = _trainer()
    # group 0 stale, bringing the log-probs the current weights give: the same step as fresh
    lps = _current_logprobs(stale, GROUPS)
    g0 = GROUPS[0]
    marked = [Group(g0.prompt_ids, g0.responses, g0.rewards, lps[0]), *GROUPS[1:]]
    m_stale = stale.step(marked)
    assert "timing_s/old_log_prob" not in m_stale          # no no-grad pass over the batch
    a, b = _weights(fresh), _weights(stale)
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert diff <= 1e-6, diff
    assert abs(m_fresh["actor/ppo_kl"] - m_stale["actor/ppo_kl"]) <= 1e-7

    # a stale group whose sampler differed: its ratio starts from what it brought
    moved = _trainer()
    shifted = [Group(g0.prompt_ids, g0.responses, g0.rewards, [[x - 0.5 for x in lp] for lp in lps[0]]),
               *GROUPS[1:]]
    m_moved = moved.step(shifted)
    assert "timing_s/old_log_prob" not in m_moved
    assert m_moved["actor/pg_clipfrac"] > m_fresh["actor/pg_clipfrac"]   # ratio e^0.5 > 1 + 0.2 on those rows
