"""What one group's items of a /score answer make of it (services/reward/client.py `_outcome`,
a pure decision): table-tested, no server."""

import math

import pytest

from steadyrl.bus.stage import RetryLater
from steadyrl.model.scorepool import DEADLINE
from steadyrl.services.reward.client import Scores, _outcome
from steadyrl.wire.codec import Rejected
from steadyrl.wire.contracts import DLQReason, Prompt, RewardSource, RolloutGroup, Sample


def group(n: int) -> RolloutGroup:
    p = Prompt(prompt_id="p1", epoch=0, index=0, n_samples=n, data_source="tiny_copy",
               messages=[{"role": "user", "content": "question"}], ground_truth="a")
    return RolloutGroup(prompt=p, samples=[Sample(text="a", token_ids=[1], logprobs=[-0.1]) for _ in range(n)],
                        policy_version=0)


def ok(r: float, **extra: object) -> dict:
    return {"reward": r, "extra": extra}


@pytest.mark.parametrize("chunk, kind, what", [
    ([ok(1.0), ok(0.0, k=1)], Scores, [1.0, 0.0]),
    ([ok(1), ok(0)], Scores, [1.0, 0.0]),                                         # ints are rewards too
    ([ok(1.0), {"reward": None, "kind": "scorer_timeout", "error": "slow"}], Rejected, DLQReason.scorer_timeout),
    ([ok(1.0), {"reward": None, "error": "boom"}], Rejected, DLQReason.scorer_error),   # a server before kinds
    ([ok(1.0), {"reward": None, "kind": DEADLINE, "error": "late"}], RetryLater, "1 of 2 items unscored"),
    ([{"reward": None, "kind": DEADLINE, "error": "late"}, {"reward": None, "kind": "scorer_crash", "error": "x"}],
     Rejected, DLQReason.scorer_crash),                                          # a failure outranks the deadline
    ([ok(1.0), ok(math.inf)], Rejected, DLQReason.non_finite),
])
def test_a_groups_items_decide_scores_rejected_or_retry(chunk, kind, what):
    out = _outcome(group(len(chunk)), chunk, "rule:tiny_copy@1", RewardSource.rule, 2.5)
    assert isinstance(out, kind), out
    if kind is Scores:
        assert out.rewards == what and out.scorer == "rule:tiny_copy@1" and out.source is RewardSource.rule
        assert out.extra == [c["extra"] for c in chunk]
    elif kind is Rejected:
        assert out.reason is what, out
    else:
        assert what in str(out) and out.own and out.counts and out.backoff_s == 2.5


@pytest.mark.parametrize("chunk, error", [
    ([ok(1.0), {"reward": True}], TypeError),                 # a bool is not a reward
    ([ok(1.0), {"reward": "1.0"}], TypeError),
    ([ok(1.0), {"reward": None, "kind": "scorer_error"}], KeyError),   # unscored without its error
])
def test_a_malformed_item_raises_for_the_caller_to_hold(chunk, error):
    with pytest.raises(error):
        _outcome(group(len(chunk)), chunk, "rule:tiny_copy@1", RewardSource.rule, 1.0)
