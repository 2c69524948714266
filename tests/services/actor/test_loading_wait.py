"""A /generate call that is ahead of the served weights waits while the follower loads a
version that satisfies it, instead of 503 (Actor.wait_for_loading; no model, no HTTP).

Found on SmolLM2 (issue 22): at max_staleness 0 the next step's prompts reach the actor
while it still reads and verifies the new version (~0.6 s); every step's first call got 503,
and the rollout worker held its batch and fetched it again ~0.5 s later.
"""

import threading
import time

import pytest

from steadyrl.services.actor.server import Actor


def _actor(run_id: str = "r1", version: int = 3) -> Actor:
    a = Actor.__new__(Actor)  # only what the version checks read
    a.run_id, a.version, a.high_water, a.loading, a._loaded = run_id, version, version, None, threading.Condition()
    a.quiet_since = float("-inf")
    return a


def _waits(a: Actor, run_id: str, min_version: int, timeout_s: float = 5.0) -> float:
    t0 = time.monotonic()
    a.wait_for_loading(run_id, min_version, timeout_s)
    return time.monotonic() - t0


def test_a_request_waits_for_the_version_being_loaded_then_is_served():
    a = _actor()
    loading, release = threading.Event(), threading.Event()

    def follower():
        with a.announce_loading("r1", 4):
            loading.set()
            release.wait(5)
            a.version = a.high_water = 4   # what load_version does when the bytes check out

    t = threading.Thread(target=follower)
    t.start()
    assert loading.wait(5)
    threading.Timer(0.3, release.set).start()
    _waits(a, "r1", 4)
    assert release.is_set()        # it returned only once the load had ended
    t.join(5)
    a.check_version("r1", 4)       # served now: no 503


def test_a_failed_load_ends_the_wait_and_the_request_gets_503():
    from fastapi import HTTPException

    a = _actor()
    with pytest.raises(RuntimeError):
        with a.announce_loading("r1", 4):
            raise RuntimeError("sha256_mismatch")  # the follower refuses the file; version stays 3
    assert a.loading is None
    assert _waits(a, "r1", 4, timeout_s=5.0) < 2.5  # not the timeout: the wait ended with the load
    with pytest.raises(HTTPException) as e:
        a.check_version("r1", 4)
    assert e.value.status_code == 503


@pytest.mark.parametrize("run_id, min_version, loading", [
    ("r1", 3, ("r1", 4)),          # served already
    ("r1", 6, ("r1", 4)),          # the load would not be enough: 503 at once, as before
    ("r1", 4, None),               # nothing is loading
    ("r2", 0, ("r1", 9)),          # a later run than the one loading
    ("", 0, ("r1", 4)),            # a request that names no run
])
def test_no_wait_when_the_load_would_not_serve_the_request(run_id, min_version, loading):
    a = _actor()
    a.loading = loading
    assert _waits(a, run_id, min_version, timeout_s=5.0) < 2.5  # half the timeout: no wait, on any machine


def test_the_wait_is_bounded():
    a = _actor()
    a.loading = ("r1", 4)          # a load that never ends
    assert 0.15 < _waits(a, "r1", 4, timeout_s=0.2) < 3.0


def test_a_resumed_learners_prompt_waits_for_its_version_below_the_high_water_mark():
    """After a resume (served 255, mark 260) a prompt for 256 while 256 is being read waits for
    it, as at any time, instead of taking 255 because 256 is under the mark (review of the
    high-water fix: at max_staleness 0 every such group would be stale)."""
    a = _actor(version=255)
    a.high_water = 260
    a.loading = ("r1", 256)
    assert 0.15 < _waits(a, "r1", 256, timeout_s=0.2) < 3.0


def test_a_prompt_under_the_mark_waits_for_an_empty_poll_of_the_policy_topic():
    """Review finding (newcomer helper): a resumed learner's prompt for its next version (under
    the mark) could reach the actor before the follower had read that version's record, and was
    served with the version before: stale at max_staleness 0, republished with a new seed, so a
    killed-and-resumed run no longer trained on the uninterrupted run's samples. Now such a
    request waits until the follower polled rl.policy empty after the request came: a record on
    its way is read first (and its load waited for); a thrown-away version is then served with
    the served one. Without an empty poll it is not settled: 503 as before the mark."""
    from fastapi import HTTPException

    a = _actor(version=255)
    a.high_water = 260
    threading.Timer(0.3, a.policy_quiet, args=(time.monotonic() + 0.1,)).start()
    assert 0.25 < _waits(a, "r1", 258, timeout_s=5.0) < 2.5   # until the empty poll begun after it
    a.check_version("r1", 258, settled=True)                   # then served with 255: no raise
    quiet = _actor(version=255)
    quiet.high_water = 260
    assert quiet.wait_for_loading("r1", 258, timeout_s=0.2) is False   # no empty poll: not settled
    with pytest.raises(HTTPException) as e:
        quiet.check_version("r1", 258, settled=False)
    assert e.value.status_code == 503
