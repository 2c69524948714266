"""A long training step beats the learner's heartbeat as it goes (Trainer.progress).

Found by the SmolLM2 calculator runs of issue 48: on 2 loaded cores one step of 16 episodes
took 177 s, more than stall_min_s (120 s) and the liveness timeout (60 s); the learner beat
only before the step, so /livez failed, `up` killed the learner and the run began the step
again from its last checkpoint."""

import time
from types import SimpleNamespace

from steadyrl.http import Health
from steadyrl.model.models import load_policy
from steadyrl.rl.trainer import Group, TrainConfig, Trainer
from steadyrl.services.learner.loop import Learner
from steadyrl.services.learner.stall import Stall

GROUPS = [Group([1, 5, 40, 7], [[6, 7, 9], [8, 9, 2], [3, 3], [4, 5, 6, 7]], [1.0, 0.0, 0.5, 0.0]),
          Group([2, 9, 11], [[6, 1], [8, 8, 8], [3], [5, 6]], [0.0, 1.0, 1.0, 0.0])]


def test_progress_is_called_after_every_micro_batch_forward_and_backward():
    model, tok = load_policy("tiny", seed=0)
    tr = Trainer(model, tok.pad_token_id, TrainConfig(lr=1e-2, micro_batch_size=2, ppo_epochs=2))
    calls = []
    tr.progress = lambda: calls.append(1)
    tr.step(GROUPS)
    # 8 rows in micro-batches of 2: the no-grad pass for the behaviour log-probs (4 forwards),
    # then 2 epochs of one minibatch of 4 micro-batches, each a forward and a backward
    assert len(calls) == 4 + 2 * 4 * 2


def test_a_train_beat_keeps_livez_up_for_as_long_as_the_stall_rule_gives_a_step():
    health = Health(liveness_timeout_s=0.05)
    learner = SimpleNamespace(health=health, stall=Stall(factor=5.0, min_s=120.0, history=[]))
    Learner.train_beat(learner)   # type: ignore[arg-type]
    time.sleep(0.15)
    assert health.live()[0]        # past liveness_timeout_s, within stall_min_s
    health.beat()                  # the step is over: the grace ends with the next beat
    time.sleep(0.15)
    assert not health.live()[0]
