"""When the stage pauses its partitions during a transform (steadyrl/bus/stage.py
`_transform_while_polling`): only past `pause_after_s`, beating the heartbeat meanwhile. A
pause costs the next batch: after a resume the consumer took 0.3-0.9 s to deliver records
already committed, on every turn of an episode past 0.5 s (docs/agents.md)."""

import time

import pytest

from steadyrl.bus.records import Transformed
from steadyrl.bus.stage import Stage
from steadyrl.wire.contracts import RolloutGroup


class _Consumer:
    """Records pause/resume; owns no partition (the loop pauses what it is assigned)."""

    def __init__(self):
        self.paused = 0

    def assignment(self):
        return []

    def pause(self, partitions):
        self.paused += 1

    def resume(self, partitions):
        pass

    def poll(self, timeout):
        return None

    def close(self):
        pass


@pytest.fixture
def stage(request):
    """A Stage on a broker that is not there (its clients never connect), `pause_after_s` from
    the test's parameter, its consumer replaced by `_Consumer`."""
    st = Stage(name="pause-unit", bootstrap="127.0.0.1:1", topic_prefix="unit.", instance_id="w0",
               input_topic="rl.rollouts", input_contract=RolloutGroup, group_id="g", handle=lambda value, meta: [],
               pause_after_s=request.param)
    st.consumer.close()
    st.consumer = _Consumer()
    yield st
    st.close()


def _slow_transform(stage: Stage, seconds: float) -> list[float]:
    """Make the stage's transform take `seconds`; returns the list its heartbeats go to."""
    beats: list[float] = []
    stage.health.beat = lambda: beats.append(time.monotonic())   # type: ignore[method-assign]
    stage._transform = lambda msgs: (time.sleep(seconds), Transformed())[1]   # type: ignore[method-assign]
    return beats


@pytest.mark.parametrize("stage", [10.0], indirect=True)
def test_a_transform_shorter_than_pause_after_s_is_not_paused_and_beats_each_second(stage):
    beats = _slow_transform(stage, 2.5)
    t0 = time.monotonic()
    stage._transform_while_polling([])
    assert stage.consumer.paused == 0
    assert len(beats) == 2 and all(b - t0 < 2.6 for b in beats)   # at 1 s and 2 s: /livez stays up


@pytest.mark.parametrize("stage", [0.2], indirect=True)
def test_a_transform_past_pause_after_s_is_paused_while_the_loop_polls(stage):
    _slow_transform(stage, 0.6)
    stage.consumer.assignment = lambda: [type("TP", (), {"topic": "t", "partition": 0})()]
    stage._transform_while_polling([])
    assert stage.consumer.paused == 1
