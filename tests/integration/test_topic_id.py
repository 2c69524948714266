"""steadyrl.bus.topics.topic_id against the real broker: the identity a run's offsets are
checked against on resume."""

import time

import pytest

from steadyrl.bus.topics import create_topics, topic_id
from tests.helpers import unique_prefix


def test_each_prefix_has_its_own_scored_topic_id_and_it_is_stable(bootstrap, prefix):
    other = unique_prefix()
    create_topics(bootstrap, other)
    a = topic_id(bootstrap, f"{prefix}rl.scored")
    assert a == topic_id(bootstrap, f"{prefix}rl.scored") and len(a) >= 16
    assert topic_id(bootstrap, f"{other}rl.scored") != a


def test_no_broker_is_a_clear_error_after_the_wait():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="cannot describe topic x.rl.scored at 127.0.0.1:1 within 3 s"):
        topic_id("127.0.0.1:1", "x.rl.scored", timeout_s=3)
    assert time.monotonic() - t0 < 20
