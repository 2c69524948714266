"""A multi-turn trajectory's loss mask (Sample.loss_mask, steadyrl/model/agents.py): tool tokens are
in the sequence but out of the loss. build_batch multiplies it into the response mask, and the
losses follow with unchanged formulas; checked here against values computed by hand."""

import math

import pytest
import torch

from steadyrl.rl import core
from steadyrl.rl.batch import Group, build_batch


def _batch():
    g = Group(prompt_ids=[1, 2], responses=[[5, 6, 7], [8, 9]], rewards=[1.0, 0.0],
              loss_masks=[[1, 0, 1], None])
    return build_batch([g], pad_id=0)


def test_the_loss_mask_zeroes_tool_tokens_in_the_response_mask_and_keeps_them_attended():
    b = _batch()
    assert b["response_mask"].tolist() == [[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]   # the tool token is context
    assert b["responses"].tolist() == [[5, 6, 7], [8, 9, 0]]


def test_the_policy_loss_with_a_mask_matches_the_hand_computed_value():
    mask = _batch()["response_mask"]
    old = torch.full((2, 3), -1.0)
    # the masked positions carry ratios the clip would not hide (e^5, e^9): counted, they would dominate
    logp = old + torch.tensor([[0.1, 5.0, 0.0], [-0.1, 0.0, 9.0]])
    adv = torch.tensor([[1.0], [-1.0]]) * mask
    loss, m = core.policy_loss(logp, old, adv, mask, agg="token-mean")
    # row 0, A = 1: -e^0.1 (inside the clip), -1; row 1, A = -1: e^-0.1, 1; over 4 tokens
    want = (-math.exp(0.1) - 1.0 + math.exp(-0.1) + 1.0) / 4
    assert loss.item() == pytest.approx(want, abs=1e-6)
    assert m["approx_kl"].item() == pytest.approx((-0.1 - 0.0 + 0.1 - 0.0) / 4, abs=1e-6)
    seq = core.aggregate(torch.ones(2, 3), mask, "seq-mean-token-sum")
    assert seq.item() == pytest.approx((2 + 2) / 2)


def test_the_score_lands_on_the_last_policy_token_not_on_the_trailing_tool_token():
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    r = core.last_token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)
    assert r.tolist() == [[0, 0, 2, 0], [0, 3, 0, 0], [4, 0, 0, 0]]
