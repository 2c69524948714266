import json

from prometheus_client import CollectorRegistry

from steadyrl.bus.kafka import KafkaStats

STATS = {
    "name": "c", "type": "consumer",
    "brokers": {
        "127.0.0.1:9092/bootstrap": {"nodeid": -1, "state": "UP", "rtt": {"avg": 0}},
        "127.0.0.1:9092/1": {"nodeid": 1, "state": "UP", "rtt": {"avg": 2500}},
    },
    "topics": {"rl.rollouts": {"partitions": {
        "0": {"consumer_lag": 12}, "1": {"consumer_lag": -1}, "-1": {"consumer_lag": 99},
        # a transactional stage: committed by its producer, stored by it: the stored lag counts
        "2": {"consumer_lag": 40, "consumer_lag_stored": 3}, "3": {"consumer_lag": -1, "consumer_lag_stored": 0}}}},
    "cgrp": {"state": "up", "rebalance_cnt": 3},
    "eos": {"txn_state": "InTransaction"},
}


def test_statistics_become_metrics():
    stats = KafkaStats()
    reg = CollectorRegistry()
    reg.register(stats)
    assert stats.brokers_up("c") is None
    stats.callback("c")(json.dumps(STATS))
    v = reg.get_sample_value
    assert v("steadyrl_kafka_consumer_lag", {"client": "c", "topic": "rl.rollouts", "partition": "0"}) == 12
    # unknown lag (-1) and the internal partition -1 are not exported
    assert v("steadyrl_kafka_consumer_lag", {"client": "c", "topic": "rl.rollouts", "partition": "1"}) is None
    assert v("steadyrl_kafka_consumer_lag", {"client": "c", "topic": "rl.rollouts", "partition": "-1"}) is None
    assert v("steadyrl_kafka_consumer_lag", {"client": "c", "topic": "rl.rollouts", "partition": "2"}) == 3
    assert v("steadyrl_kafka_consumer_lag", {"client": "c", "topic": "rl.rollouts", "partition": "3"}) == 0
    assert v("steadyrl_kafka_rebalances_total", {"client": "c"}) == 3
    assert v("steadyrl_kafka_txn_state", {"client": "c", "state": "InTransaction"}) == 1
    assert v("steadyrl_kafka_broker_rtt_seconds", {"client": "c", "broker": "1"}) == 0.0025
    assert v("steadyrl_kafka_brokers_up", {"client": "c"}) == 1
    assert stats.brokers_up("c") == 1


def test_garbage_statistics_are_ignored():
    stats = KafkaStats()
    stats.callback("c")("{not json")
    assert stats.latest("c") is None
