"""Staleness across turns (issue 48, item 5): an episode's turns may span policy versions. The
learner's bound (max_staleness) counts from the episode's oldest turn, its first; a turn newer
than the learner makes the group "future"; the off-policy ratio of each token is against the
log-prob stored when its turn was sampled, and mask-0 (tool) tokens count for nothing.

The trajectory is built by hand with the worker's own functions (steadyrl/model/agents.py):

    prompt [5, 6] | turn 1 (v)   [10, 11] lp -0.5 -1.0 | tool [12]
                  | turn 2 (v+1) [13]     lp -2.0      | tool [14, 15]
                  | turn 3 (v+2) [16, 17] lp -0.25 -0.75
"""

import math

import pytest
import torch

from steadyrl.model import agents
from steadyrl.rl import batch, core
from steadyrl.services.learner.loop import trainer_groups
from steadyrl.wire.contracts import Prompt, RewardSource, RolloutGroup, Sample, ScoredGroup
from tests.services.learner.conftest import Msg, scored

V = 3
TOKENS = [10, 11, 12, 13, 14, 15, 16, 17]
MASK = [1, 1, 0, 1, 0, 0, 1, 1]
STORED = [-0.5, -1.0, 0.0, -2.0, 0.0, 0.0, -0.25, -0.75]


def _episode_group(prompt: Prompt, v: int = V) -> RolloutGroup:
    state = agents.start(prompt, [{"role": "user", "content": "3"}], [5, 6])
    for ep in state.episodes:
        agents.add_turn(ep, [10, 11], [-0.5, -1.0], "a", "stop", v)
        agents.add_observation(ep, [{"role": "tool", "content": "t"}], [12])
        agents.add_turn(ep, [13], [-2.0], "b", "stop", v + 1)
        agents.add_observation(ep, [{"role": "tool", "content": "u"}], [14, 15])
        agents.add_turn(ep, [16, 17], [-0.25, -0.75], "c", "stop", v + 2)
        ep.done = True
    return agents.finished(state)


def _prompt(pid: str = "p0", n: int = 2, **kw) -> Prompt:
    return Prompt(prompt_id=pid, epoch=0, index=0, messages=[{"role": "user", "content": "3"}], n_samples=n, **kw)


def test_the_trajectory_has_the_masks_log_probs_and_versions_of_its_turns():
    g = _episode_group(_prompt())
    s = g.samples[0]
    assert (s.token_ids, s.loss_mask, s.logprobs, s.turn_versions) == (TOKENS, MASK, STORED, [V, V + 1, V + 2])
    assert (g.policy_version, g.oldest_version, g.newest_version) == (V, V, V + 2)
    # a writer that labels the group with its last turn's version changes nothing: the turns say
    relabelled = g.model_copy(update={"policy_version": V + 2})
    assert (relabelled.oldest_version, relabelled.newest_version) == (V, V + 2)
    one = RolloutGroup(prompt=_prompt(n=1), prompt_token_ids=[5], policy_version=7,
                       samples=[Sample(text="x", token_ids=[9], logprobs=[-1.0])])
    assert one.oldest_version == one.newest_version == 7                 # one turn: policy_version


def _accept_episode(lrn, v: int, label: int) -> str:
    """An episode group of turns v, v+1, v+2 (labelled `label`) in the learner's buffer."""
    lrn.feeder.top_up()
    pid = next(iter(lrn.state.in_flight))
    base = scored(lrn.state, pid)
    g = _episode_group(base.group.prompt, v).model_copy(update={"policy_version": label})
    lrn.intake.accept(Msg(base.model_copy(update={"group": g, "rewards": [1.0] * len(g.samples)}), pid))
    assert pid in lrn.intake.ready
    return pid


@pytest.mark.parametrize(("max_staleness", "kept"), [(1, False), (2, True)])
def test_the_staleness_bound_counts_from_the_episodes_first_turn(make_learner, max_staleness, kept):
    lrn = make_learner(max_staleness=max_staleness, steps=10)
    lrn.state.step = V + 2                 # the last turn is fresh, the first is 2 versions old
    pid = _accept_episode(lrn, V, label=V + 2)
    attempt = lrn.state.in_flight[pid].attempt
    lrn.intake.drop_stale()
    assert (pid in lrn.intake.ready) is kept
    if not kept:   # dropped as stale: published again with a new seed
        assert pid in lrn.state.requeue and lrn.state.in_flight[pid].attempt == attempt + 1
        assert lrn.state.counts.get("stale_dropped") == 1


def test_a_turn_newer_than_the_learner_makes_the_episode_future(make_learner):
    lrn = make_learner(max_staleness=4, steps=10)
    lrn.state.step = V + 1                 # turn 3 (v+2) came from weights this learner does not have
    pid = _accept_episode(lrn, V, label=V)
    attempt = lrn.state.in_flight[pid].attempt
    lrn.intake.drop_stale()
    assert pid not in lrn.intake.ready and pid in lrn.state.requeue
    assert lrn.state.in_flight[pid].attempt == attempt          # same seed: not stale
    assert lrn.state.counts.get("future_dropped") == 1


@pytest.mark.parametrize(("version", "step", "max_staleness", "kept"),
                         [(3, 4, 1, True), (2, 4, 1, False), (5, 4, 1, False), (4, 4, 0, True)])
def test_one_turn_groups_are_judged_as_before(make_learner, version, step, max_staleness, kept):
    lrn = make_learner(max_staleness=max_staleness, steps=10)
    lrn.state.step = step
    lrn.feeder.top_up()
    pid = next(iter(lrn.state.in_flight))
    lrn.intake.accept(Msg(scored(lrn.state, pid, version=version), pid))
    lrn.intake.drop_stale()
    assert (pid in lrn.intake.ready) is kept


def _scored(g: RolloutGroup) -> ScoredGroup:
    return ScoredGroup(group=g, rewards=[1.0] * len(g.samples), reward_source=RewardSource.rule, scorer="t")


def test_each_tokens_ratio_is_against_the_log_prob_stored_for_its_turn():
    g = _episode_group(_prompt(), V).model_copy(update={"policy_version": V + 2})
    [tg] = trainer_groups([_scored(g)], step=V + 2, cache_scored_weight=1.0)
    # stale from its first turn on: the stored log-probs are the ratio's denominator, token by token
    assert tg.behaviour_logprobs == [STORED, STORED] and tg.loss_masks == [MASK, MASK]
    b = batch.build_batch([tg], pad_id=0)
    mask = b["response_mask"]                                                   # (2, 8)
    assert mask[0].tolist() == [float(m) for m in MASK]
    old, where = batch.behaviour_logprobs([tg], mask.shape[1])                  # (2, 8), (2, 8)
    assert where.all() and old[0].tolist() == STORED
    # the current policy: each model token 0.1 nats likelier than its sampler found it; the tool
    # tokens carry log-ratios the clip would not hide (e^6): counted, they would dominate
    logp = old + torch.tensor([0.1 if m else 6.0 for m in MASK]).expand(2, -1)
    adv = torch.ones(2, 8) * mask
    loss, m = core.policy_loss(logp, old, adv, mask, agg="token-mean")
    # 5 model tokens per row, each -A * ratio = -e^0.1 (inside the 0.2 clip)
    assert loss.item() == pytest.approx(-math.exp(0.1), abs=1e-6)
    assert m["approx_kl"].item() == pytest.approx(-0.1, abs=1e-6)
    # the TIS weight is per token and masked too: tool tokens weigh 0 whatever their log-probs
    w = core.tis_weights(logp, old, mask, cap=2.0)
    assert w[0].tolist() == pytest.approx([math.exp(0.1) if x else 0.0 for x in MASK], abs=1e-6)


def test_a_one_turn_group_brings_its_log_probs_only_when_older_than_the_step():
    one = RolloutGroup(prompt=_prompt(n=1), prompt_token_ids=[5], policy_version=4,
                       samples=[Sample(text="x", token_ids=[9], logprobs=[-1.0])])
    assert trainer_groups([_scored(one)], step=4, cache_scored_weight=1.0)[0].behaviour_logprobs is None
    assert trainer_groups([_scored(one)], step=5, cache_scored_weight=1.0)[0].behaviour_logprobs == [[-1.0]]
