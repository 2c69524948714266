"""A step whose groups all scored alike has no learning signal (GRPO's advantages are 0): the
learner warns once, and again only when it changes, and counts such steps (issue 38: a random
tiny model scored 0 everywhere trained to a model equal to the base, with no word of it)."""

import json

from steadyrl.run.runfolder import Counts
from steadyrl.services.learner.flat import FlatSteps, flat_rewards
from tests.services.learner.conftest import Msg, scored


def test_flat_rewards():
    assert flat_rewards([[0.0] * 4] * 8) == (0.0,)
    assert flat_rewards([[0.0] * 4, [1.0] * 4, [0.0] * 4]) == (0.0, 1.0)   # alike within each group
    assert flat_rewards([[0.0, 0.0], [0.0, 0.25]]) is None                  # one group has a signal
    assert flat_rewards([]) is None


def test_warned_once_and_again_only_when_it_changes():
    f = FlatSteps()
    flat, warning = f.seen([[0.0] * 8] * 8)
    assert flat and warning == ("all 8 groups scored alike (every reward 0.0): no learning signal this step "
                                "(group-relative advantages are 0); see docs/rl.md#when-every-sample-scores-alike")
    assert f.seen([[0.0] * 8] * 8) == (True, None)                          # the same again: said already
    flat, warning = f.seen([[1.0] * 8, [0.0] * 8])                          # other rewards: said again
    assert flat and warning is not None and warning.startswith(
        "every one of the 2 groups scored its samples alike (rewards 0.0, 1.0)")
    assert f.seen([[1.0, 0.0]]) == (False, None)                            # a signal: nothing to say
    flat, warning = f.seen([[1.0] * 8, [0.0] * 8])                          # flat again after it: said again
    assert flat and warning is not None


def test_a_step_of_flat_groups_changes_nothing_and_is_warned_and_counted(make_learner, caplog):
    lrn = make_learner(steps=3)
    st = lrn.state
    lrn.store.publish(lrn.model, st)
    before = {k: v.detach().clone() for k, v in lrn.model.state_dict().items()}

    def step(rewards):
        lrn.feeder.top_up()
        for i, pid in enumerate(p for p in st.in_flight if p not in lrn.intake.ready):
            lrn.intake.accept(Msg(scored(st, pid, rewards=list(rewards)), pid, offset=st.step * 10 + i))
        return lrn.train_step()

    m = step([0.0] * 4)
    assert m is not None and m["actor/grad_norm"] == 0.0 and m["actor/pg_loss"] == 0.0
    assert all((v == before[k]).all() for k, v in lrn.model.state_dict().items())   # the step changed nothing
    m = step([0.0] * 4)
    assert m is not None and m["actor/grad_norm"] == 0.0
    warned = [r for r in caplog.records if "scored alike" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelname == "WARNING"
    assert warned[0].getMessage().startswith("all 4 groups scored alike (every reward 0.0): no learning signal")
    m = step([1.0, 0.0, 0.0, 0.0])
    assert m is not None and m["actor/grad_norm"] > 0
    assert st.counts["flat_reward_steps"] == 2
    assert Counts(st.counts).line().startswith("flat_reward_steps 2")
    assert json.loads((lrn.run_dir / "state.json").read_text())["counts"]["flat_reward_steps"] == 2
