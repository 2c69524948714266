"""A transactional stage that lives through a broker restart keeps going within seconds.

Regression: every stage that lived through a SIGKILL + restart of the (single) broker hung in
its next send_offsets_to_transaction until the 35 s deadline ended the process
(librdkafka#5456 and #5511: the producer keeps a stale group coordinator and its request
never times out). In bench/chaos.py that cost ~56 s of training, and up to 113 s when the
stages hung one after another as records reached them.
"""

import threading
import time

import pytest
from prometheus_client import REGISTRY

from steadyrl.bus.stage import Output, Stage
from steadyrl.bus.topics import create_topics
from steadyrl.local.broker import LocalBroker
from steadyrl.local.ports import free_port
from steadyrl.wire import codec
from steadyrl.wire.contracts import RewardSource, RolloutGroup, ScoredGroup
from tests.helpers import decode_all, produce_all, read_all, rollout_group, unique_prefix


def _scored(g: RolloutGroup, meta) -> list[Output]:
    return [Output("rl.scored", g.prompt_id, ScoredGroup(group=g, rewards=[1.0], reward_source=RewardSource.rule,
                                                        scorer="test"))]


@pytest.mark.slow
def test_stage_recovers_within_seconds_after_the_broker_is_restarted(tmp_path):
    broker = LocalBroker(tmp_path / "broker", port=free_port(), controller_port=free_port())
    broker.start()
    stop = threading.Event()
    worker = None
    try:
        prefix = unique_prefix()
        create_topics(broker.bootstrap, prefix)
        st = Stage(name="t", bootstrap=broker.bootstrap, topic_prefix=prefix, instance_id="w0",
                   input_topic="rl.rollouts", input_contract=RolloutGroup, group_id=f"{prefix}g", handle=_scored,
                   batch_size=4, stats_interval_s=1.0)
        failure: list[BaseException] = []

        def run():
            try:
                st.run(stop)
            except BaseException as e:  # noqa: BLE001 - handed to the test
                failure.append(e)

        worker = threading.Thread(target=run, name="stage")
        worker.start()
        before = [rollout_group(i) for i in range(8)]
        produce_all(broker.bootstrap, f"{prefix}rl.rollouts", [(g.prompt_id, *codec.encode(g)) for g in before])
        read_all(broker.bootstrap, f"{prefix}rl.scored", expect=8, timeout_s=60)

        broker.kill()
        time.sleep(3)
        broker.start()
        back = time.monotonic()
        after = [rollout_group(i) for i in range(8, 16)]
        produce_all(broker.bootstrap, f"{prefix}rl.rollouts", [(g.prompt_id, *codec.encode(g)) for g in after])
        scored = decode_all(read_all(broker.bootstrap, f"{prefix}rl.scored", expect=16, timeout_s=60), ScoredGroup)
        took = time.monotonic() - back

        assert not failure, failure
        assert sorted(s.prompt_id for s in scored) == sorted(g.prompt_id for g in before + after)  # exactly once
        # the hang lasted >= 35 s (the send_offsets deadline) and then ended the stage
        assert took < 20, f"records produced after the restart took {took:.1f} s to come out"
        assert worker.is_alive()
        # the producer was replaced (once), the process did not exit
        assert REGISTRY.get_sample_value("steadyrl_stage_producer_renewals_total", {"stage": "t"}) == 1
    finally:
        stop.set()
        if worker is not None:
            worker.join(timeout=60)
        broker.stop()
