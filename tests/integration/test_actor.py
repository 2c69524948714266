"""The actor over HTTP, following rl.policy with sha256, policy-root and run checks."""

import time

import httpx

from steadyrl.model.models import load_policy
from steadyrl.run import policy_files
from steadyrl.run.tensors import unique_tensors
from steadyrl.wire import codec
from steadyrl.wire.contracts import PolicyUpdate
from tests.helpers import ServiceProc, produce_all

RUN = "r20261129T100000-aaaa"


def _publish(bootstrap, prefix, upd):
    produce_all(bootstrap, f"{prefix}rl.policy", [("policy", *codec.encode(upd))])


def _weights(root, version, seed, run=RUN) -> PolicyUpdate:
    """The tiny model with `seed` as version `version` of `run` under `root`, and its record."""
    model, _ = load_policy("tiny", seed=seed)
    rel = policy_files.version_dir(run, version)
    sha = policy_files.write_version(root, rel, unique_tensors(model.state_dict()))
    return PolicyUpdate(version=version, step=version, uri=str(rel), sha256=sha, run_id=run)


def _version(svc, expect, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if svc.metric("steadyrl_actor_policy_version") == expect:
            return
        time.sleep(0.2)
    raise AssertionError(f"actor never served version {expect}")


def _refusals(svc, reason, at_least, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while (svc.metric("steadyrl_actor_policy_rejected_total", {"reason": reason}) or 0) < at_least:
        assert time.monotonic() < deadline, f"refusal {reason} not counted"
        time.sleep(0.2)


def _actor(bootstrap, prefix, root, tmp_path, instance):
    return ServiceProc("actor", ["--bootstrap", bootstrap, "--topic-prefix", prefix, "--instance-id", instance,
                                 "--actor.model", "tiny", "--actor.policy-root", str(root)], tmp_path / "actor.log")


def test_actor_serves_and_follows_only_verified_policies(bootstrap, prefix, tmp_path):
    root = tmp_path / "policies"
    _publish(bootstrap, prefix, _weights(root, 1, seed=5))
    svc = _actor(bootstrap, prefix, root, tmp_path, "a0")
    try:
        svc.wait_ready()
        body = {"prompts": [{"messages": [{"role": "user", "content": "7"}]}, {"prompt_ids": [5, 6]}],
                "n": 3, "max_new_tokens": 4, "temperature": 1.0, "seed": 1}
        r = httpx.post(f"{svc.url}/generate", json=body, timeout=30)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["policy_version"] == 1
        assert [len(g) for g in out["completions"]] == [3, 3]
        c = out["completions"][0][0]
        assert len(c["token_ids"]) == len(c["logprobs"]) <= 4 and c["finish_reason"] in ("stop", "length")

        # refused: wrong sha256, a path outside the root; the actor keeps serving version 1
        v2 = _weights(root, 2, seed=6)
        _publish(bootstrap, prefix, v2.model_copy(update={"sha256": "0" * 64}))
        outside = _weights(tmp_path / "elsewhere", 3, seed=7)
        _publish(bootstrap, prefix, outside.model_copy(update={"uri": f"../elsewhere/{outside.uri}"}))
        _refusals(svc, "outside_root", 1)
        assert svc.metric("steadyrl_actor_policy_rejected_total", {"reason": "sha256_mismatch"}) == 1
        assert httpx.post(f"{svc.url}/generate", json=body, timeout=30).json()["policy_version"] == 1

        # accepted: the right sha256 under the root
        _publish(bootstrap, prefix, v2)
        _version(svc, 2)
        assert httpx.post(f"{svc.url}/generate", json=body, timeout=30).json()["policy_version"] == 2

        # bad requests get 4xx with a message
        r = httpx.post(f"{svc.url}/generate", json={"prompts": [{}]}, timeout=10)
        assert r.status_code == 422 and "exactly one of messages or prompt_ids" in r.text
        r = httpx.post(f"{svc.url}/generate", json={**body, "max_new_tokens": 5000}, timeout=10)
        assert r.status_code == 422 and "limit 1024" in r.text
    finally:
        assert svc.stop() == 0


def test_a_restarted_actor_loads_the_newest_version(bootstrap, prefix, tmp_path):
    root = tmp_path / "policies"
    for v, seed in ((1, 1), (2, 2)):
        _publish(bootstrap, prefix, _weights(root, v, seed=seed))
    svc = _actor(bootstrap, prefix, root, tmp_path, "a1")
    try:
        svc.wait_ready()
        assert svc.metric("steadyrl_actor_policy_version") == 2
        assert svc.metric("steadyrl_actor_policy_loads_total") == 1  # only the newest is loaded
    finally:
        assert svc.stop() == 0


def test_a_forged_record_of_a_later_run_id_does_not_take_the_actor_over(bootstrap, prefix, tmp_path):
    """Regression: a record whose run id sorts last, naming an earlier run's (never pruned)
    file, pinned the actor on those weights as the newest run, and every prompt of the real
    run got 409 and went to rl.dlq. Now the record is refused (the folder names its run), at
    start and while following, and the real run's prompts keep being answered."""
    root = tmp_path / "policies"
    earlier = _weights(root, 4, seed=3, run="r20261128T000000-0001")   # an ended run's file
    _publish(bootstrap, prefix, _weights(root, 1, seed=5))
    forged = earlier.model_copy(update={"run_id": "r20991231T235959-ffff", "version": 9})
    _publish(bootstrap, prefix, forged)   # the newest record when the actor starts
    svc = _actor(bootstrap, prefix, root, tmp_path, "a2")
    body = {"prompts": [{"prompt_ids": [5, 6]}], "n": 2, "max_new_tokens": 3, "temperature": 1.0, "seed": 1,
            "run_id": RUN, "min_policy_version": 1}
    try:
        svc.wait_ready()
        assert svc.metric("steadyrl_actor_policy_version") == 1            # the real run, not the forgery
        assert svc.metric("steadyrl_actor_policy_rejected_total", {"reason": "wrong_run"}) == 1
        r = httpx.post(f"{svc.url}/generate", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["policy_version"] == 1, r.text

        _publish(bootstrap, prefix, forged.model_copy(update={"version": 10}))  # again, while following
        _refusals(svc, "wrong_run", 2)
        r = httpx.post(f"{svc.url}/generate", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["policy_version"] == 1, r.text
        old = httpx.post(f"{svc.url}/generate", json={**body, "run_id": earlier.run_id}, timeout=30)
        assert old.status_code == 409, old.text                            # an earlier run's prompt: refused

        _publish(bootstrap, prefix, _weights(root, 2, seed=6))             # the real run goes on
        _version(svc, 2)
        r = httpx.post(f"{svc.url}/generate", json={**body, "min_policy_version": 2}, timeout=30)
        assert r.status_code == 200 and r.json()["policy_version"] == 2, r.text
    finally:
        assert svc.stop() == 0


def test_a_restarted_actor_takes_the_mark_from_records_before_1_4(bootstrap, prefix, tmp_path):
    """Records without high_water (policy_update before 1.4): version 5, then the resumed
    learner's 2. An actor started after both serves 2 and still answers prompts stamped 5 (the
    highest version of the run among the records left on the compacted topic); 6 waits."""
    root = tmp_path / "policies"
    for v, seed in ((5, 1), (2, 2)):
        _publish(bootstrap, prefix, _weights(root, v, seed=seed))
    svc = _actor(bootstrap, prefix, root, tmp_path, "a3")
    body = {"prompts": [{"prompt_ids": [5, 6]}], "n": 1, "max_new_tokens": 2, "run_id": RUN}
    try:
        svc.wait_ready()
        assert svc.metric("steadyrl_actor_policy_version") == 2
        assert svc.metric("steadyrl_actor_policy_high_water") == 5
        r = httpx.post(f"{svc.url}/generate", json={**body, "min_policy_version": 5}, timeout=30)
        assert r.status_code == 200 and r.json()["policy_version"] == 2, r.text
        r = httpx.post(f"{svc.url}/generate", json={**body, "min_policy_version": 6}, timeout=30)
        assert r.status_code == 503, r.text
    finally:
        assert svc.stop() == 0
