"""A step trains the B oldest prompts in flight, in feed order, not the first groups to arrive
(issue 37: two `steadyrl up --config configs/tiny.yaml` runs of seed 0 parted at the first
step's mean reward, 0.020 vs 0.035, because step 1 took whichever 8 of the 16 prompts in flight
came back first)."""

from steadyrl.services.learner.buffer import next_batch
from tests.services.learner.conftest import Msg, scored

AGES = {"a": (0, 1.0), "b": (1, 1.0), "c": (2, 1.0), "d": (3, 1.0)}


def test_the_oldest_in_flight_make_the_batch_in_feed_order():
    assert next_batch({"d", "b", "a", "c"}, AGES, 2, set(), 30.0) == ["a", "b"]


def test_a_younger_group_arriving_first_waits_for_the_older_ones():
    assert next_batch({"c", "d"}, AGES, 2, set(), 30.0) is None
    assert next_batch({"a", "c", "d"}, AGES, 2, set(), 30.0) is None   # b still on its way
    assert next_batch({"a"}, AGES, 2, set(), 30.0) is None              # fewer than B ready


def test_a_prompt_waiting_to_go_out_again_or_a_straggler_is_passed_over():
    assert next_batch({"b", "c", "d"}, AGES, 2, {"a"}, 30.0) == ["b", "c"]   # a: sent back by rl.dlq
    old = AGES | {"a": (0, 30.0)}
    assert next_batch({"b", "c", "d"}, old, 2, set(), 30.0) == ["b", "c"]    # a: in flight 30 s, passed over
    assert next_batch({"b", "c", "d"}, old, 2, set(), 30.1) is None


def test_the_loop_waits_for_the_oldest_groups_and_trains_them(make_learner):
    lrn = make_learner(steps=3, prompts_per_step=4, max_staleness=1)
    lrn.store.publish(lrn.model, lrn.state)
    lrn.feeder.top_up()
    order = sorted(lrn.state.in_flight, key=lambda pid: lrn.state.in_flight[pid].seq)
    assert len(order) == 8                       # (max_staleness + 1) x B in flight
    for i, pid in enumerate(order[4:] + order[:3]):   # the second batch first, then 3 of the first
        lrn.intake.accept(Msg(scored(lrn.state, pid), pid, offset=i))
    assert len(lrn.intake.ready) == 7 and lrn.next_batch() is None   # before: trained order[:3] + order[4]
    lrn.intake.accept(Msg(scored(lrn.state, order[3]), order[3], offset=7))
    take = lrn.next_batch()
    assert take == order[:4]
    assert lrn.train_step(take) is not None
    assert sorted(lrn.intake.ready) == sorted(order[4:])
