"""The feeder publishes exactly steps x B new prompts in a run, at most (max_staleness + 1) x B
in flight (regression: a new run's state started at fed = -1 and published one prompt more)."""

from steadyrl.services.learner.config import LearnerSection, load_dataset
from steadyrl.services.learner.feeder import Feeder
from steadyrl.services.learner.state import RunState


class Outbox:
    def __init__(self):
        self.sent = []

    def produce(self, topic, key, value):
        self.sent.append((topic, key, value))

    def flush(self):
        pass


def test_a_run_publishes_steps_times_b_new_prompts_in_all():
    lc = LearnerSection(model="tiny", data="tiny_copy:64", eval_data=None, steps=3, prompts_per_step=4,
                        max_staleness=1, prompt_gate={"cooldown_s": 0})
    st, out = RunState(run_id="r1"), Outbox()
    feeder = Feeder(lc, load_dataset(lc.data), st, out)
    assert feeder.top_up() == 8 and len(st.in_flight) == 8          # (1 + 1) x 4 in flight
    for _ in range(3):                                                # train a step's worth, top up
        for pid in sorted(st.in_flight, key=lambda p: st.in_flight[p].seq)[:4]:
            del st.in_flight[pid]
        feeder.top_up()
    ids = [key for _, key, _ in out.sent]
    assert len(ids) == len(set(ids)) == 3 * 4 and st.fed == 12 and st.feeder_position == 12
    assert not st.in_flight  # every prompt of the run was taken for a step
