"""The waiting half of the version gate on a real ServedVersion (tiny model, real loads): a
/generate call ahead of the served weights waits while the follower loads a version that
serves it, or until the follower polls rl.policy empty, at most its timeout
(ServedVersion.wait_settled; which states wait is tests/services/actor/test_gate.py)."""

import threading
import time

import pytest
from safetensors.torch import save_model

from steadyrl.files import sha256_file
from steadyrl.model.models import tiny_model
from steadyrl.run.policy_files import PolicyRefused
from steadyrl.services.actor import gate
from steadyrl.services.actor.config import ActorSection
from steadyrl.services.actor.follower import ServedVersion
from steadyrl.services.actor.model import ServedModel

RUN = "r20261129T100000-aaaa"


def _publish(root, version: int, vocab: int) -> tuple[str, str]:
    """A legacy one-file version `RUN/v{version:06d}.safetensors` of the tiny model; (uri, sha256)."""
    path = root / RUN / f"v{version:06d}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_model(tiny_model(vocab, seed=version), str(path))
    return str(path.relative_to(root)), sha256_file(path)


@pytest.fixture
def served(tmp_path):
    """Serving RUN version 3 (its high-water mark 3), caught up."""
    sv = ServedVersion(ServedModel(ActorSection(model="tiny", policy_root=tmp_path)), tmp_path)
    sv.load_version(3, *_publish(tmp_path, 3, len(sv.model.tok)), run_id=RUN)
    sv.caught_up = True
    return sv


def _wait(sv: ServedVersion, run_id: str, min_version: int, timeout_s: float = 5.0) -> tuple[bool, float]:
    """(settled, seconds waited) of a call for (run_id, min_version) coming now."""
    t0 = time.monotonic()
    settled = sv.wait_settled(gate.Wanted(run_id, min_version, since=t0), timeout_s)
    return settled, time.monotonic() - t0


def _status(sv: ServedVersion, run_id: str, min_version: int, settled: bool) -> int:
    d = gate.verdict(sv.snapshot(), gate.Wanted(run_id, min_version), settled)
    return gate.STATUS.get(d, 200)


def test_a_call_waits_for_the_version_being_loaded_then_is_served(served, tmp_path):
    uri, sha = _publish(tmp_path, 4, len(served.model.tok))
    loading, release = threading.Event(), threading.Event()

    def follower():
        with served.announce_loading(RUN, 4):
            loading.set()
            release.wait(5)
            served.load_version(4, uri, sha, run_id=RUN)

    t = threading.Thread(target=follower)
    t.start()
    assert loading.wait(5)
    threading.Timer(0.3, release.set).start()
    settled, _ = _wait(served, RUN, 4)
    assert settled and release.is_set() and served.version == 4   # it returned once the load had ended
    t.join(5)
    assert _status(served, RUN, 4, settled) == 200


def _refuse_later(served, run: str, version: int, then=None):
    """A follower thread that announces (run, version), refuses it after 0.3 s (its file is
    missing), then runs `then`."""
    def follower():
        with served.announce_loading(run, version):
            time.sleep(0.3)
            with pytest.raises(PolicyRefused):
                served.load_version(version, f"{run}/v{version:06d}", "0" * 64, run_id=run)
        if then is not None:
            then()

    t = threading.Thread(target=follower)
    t.start()
    return t


def test_a_refused_load_of_a_later_run_ends_the_wait_and_the_call_gets_503(served):
    later = "r20261129T110000-bbbb"
    t = _refuse_later(served, later, 0)
    settled, waited = _wait(served, later, 0)
    t.join(5)
    assert served.loading is None and (served.run_id, served.version) == (RUN, 3)
    assert settled and 0.25 < waited < 2.5   # not the timeout: the wait ended with the load
    assert _status(served, later, 0, settled) == 503


def test_a_refused_version_of_the_served_run_is_served_with_the_version_before_once_settled(served):
    """The refused record raised the mark to 4: the call for 4 waits on for the follower's next
    empty poll of rl.policy, then is served with 3."""
    t = _refuse_later(served, RUN, 4, then=lambda: served.policy_quiet(time.monotonic()))
    settled, waited = _wait(served, RUN, 4)
    t.join(5)
    assert (served.version, served.high_water) == (3, 4)
    assert settled and 0.25 < waited < 2.5
    assert _status(served, RUN, 4, settled) == 200


def test_a_call_the_load_would_not_serve_does_not_wait(served):
    with served.announce_loading(RUN, 4):
        settled, waited = _wait(served, RUN, 6)   # above the version loading
    assert settled and waited < 2.5 and _status(served, RUN, 6, settled) == 503


def test_the_wait_is_bounded(served):
    with served.announce_loading(RUN, 4):   # a load that does not end while the call waits
        settled, waited = _wait(served, RUN, 4, timeout_s=0.2)
    assert not settled and 0.15 < waited < 3.0
    assert _status(served, RUN, 4, settled) == 503


def test_a_call_under_the_mark_waits_for_an_empty_poll_of_the_policy_topic(served):
    """Served 3, mark 6 (a resumed learner): a call for 5 waits until the follower has polled
    rl.policy empty after the call came, then is served with 3; without such a poll it is not
    settled, and gets 503."""
    served.raise_high_water(6)
    settled, _ = _wait(served, RUN, 5, timeout_s=0.2)   # no empty poll yet
    assert not settled and _status(served, RUN, 5, settled) == 503
    threading.Timer(0.3, served.policy_quiet, args=(time.monotonic() + 0.1,)).start()
    settled, waited = _wait(served, RUN, 5)
    assert settled and 0.25 < waited < 2.5
    assert _status(served, RUN, 5, settled) == 200
