"""Shared fixtures. Integration tests run against a real Kafka broker: the one named by
STEADYRL_BOOTSTRAP, else one this suite starts (and stops) in a temporary folder."""

from __future__ import annotations

import os

import pytest

from steadyrl.bus.topics import create_topics
from steadyrl.local.broker import LocalBroker
from steadyrl.local.jars import fetch
from steadyrl.local.ports import free_port
from tests.helpers import unique_prefix


@pytest.fixture(scope="session")
def bootstrap(tmp_path_factory):
    existing = os.environ.get("STEADYRL_BOOTSTRAP")
    if existing:
        yield existing
        return
    fetch()
    broker = LocalBroker(tmp_path_factory.mktemp("broker"), port=free_port(), controller_port=free_port())
    broker.start()
    try:
        yield broker.bootstrap
    finally:
        broker.stop()


@pytest.fixture
def prefix(bootstrap):
    """A fresh topic prefix with every catalogue topic created under it."""
    p = unique_prefix()
    create_topics(bootstrap, p)
    return p


TEST_SCORERS = ["numeric_match", "tiny_copy", "tests.helpers:failing_scorer", "tests.helpers:slow_numeric"]


@pytest.fixture(scope="session")
def reward_server(tmp_path_factory):
    """A reward server on 127.0.0.1 serving the rule scorers and the test ones; yields its URL."""
    import json

    from tests.helpers import ServiceProc

    log = tmp_path_factory.mktemp("reward-server") / "server.log"
    svc = ServiceProc("reward.server", ["--reward-server.scorers", json.dumps(TEST_SCORERS)], log)
    try:
        svc.wait_ready()
        yield svc.url
    finally:
        svc.stop()


# Exact figures of the suite are fp32's. `learner.train.autocast` defaults to auto (bf16 where
# the CPU computes it natively, steadyrl.local.hardware.native_bf16); the services the tests start
# inherit this, and tests/steadyrl/rl/test_autocast.py covers auto itself.
os.environ.setdefault("STEADYRL_LEARNER__TRAIN__AUTOCAST", "off")


@pytest.fixture(autouse=True)
def _fp32_updates(monkeypatch):
    """In-process Trainers of the suite resolve autocast auto to off on any CPU (see above)."""
    import torch  # lazy: heavy; only the fixture's first use pays

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
