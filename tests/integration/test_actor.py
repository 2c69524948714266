"""The actor over HTTP, following rl.policy with sha256 and policy-root checks."""

import time

import httpx
from safetensors.torch import save_model

from steadyrl import codec
from steadyrl.contracts import PolicyUpdate
from steadyrl.files import sha256_file
from steadyrl.models import load_policy
from tests.helpers import ServiceProc, produce_all


def _publish(bootstrap, prefix, upd):
    produce_all(bootstrap, f"{prefix}rl.policy", [("policy", *codec.encode(upd))])


def _weights(root, name, seed):
    model, _ = load_policy("tiny", seed=seed)
    path = root / name / "model.safetensors"
    path.parent.mkdir(parents=True)
    save_model(model, str(path))
    return path


def _version(svc, expect, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if svc.metric("steadyrl_actor_policy_version") == expect:
            return
        time.sleep(0.2)
    raise AssertionError(f"actor never served version {expect}")


def test_actor_serves_and_follows_only_verified_policies(bootstrap, prefix, tmp_path):
    root = tmp_path / "policies"
    v1 = _weights(root, "v1", seed=5)
    _publish(bootstrap, prefix, PolicyUpdate(version=1, step=1, uri="v1/model.safetensors", sha256=sha256_file(v1)))
    svc = ServiceProc("actor", ["--bootstrap", bootstrap, "--topic-prefix", prefix, "--instance-id", "a0",
                                "--actor.model", "tiny", "--actor.policy-root", str(root)], tmp_path / "actor.log")
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
        v2 = _weights(root, "v2", seed=6)
        _publish(bootstrap, prefix, PolicyUpdate(version=2, step=2, uri="v2/model.safetensors", sha256="0" * 64))
        outside = _weights(tmp_path, "elsewhere", seed=7)
        _publish(bootstrap, prefix, PolicyUpdate(version=3, step=3, uri="../elsewhere/model.safetensors",
                                                 sha256=sha256_file(outside)))
        deadline = time.monotonic() + 30
        while (svc.metric("steadyrl_actor_policy_rejected_total", {"reason": "outside_root"}) or 0) < 1:
            assert time.monotonic() < deadline, "refusals not counted"
            time.sleep(0.2)
        assert svc.metric("steadyrl_actor_policy_rejected_total", {"reason": "sha256_mismatch"}) == 1
        assert httpx.post(f"{svc.url}/generate", json=body, timeout=30).json()["policy_version"] == 1

        # accepted: the right sha256 under the root
        _publish(bootstrap, prefix, PolicyUpdate(version=4, step=4, uri="v2/model.safetensors", sha256=sha256_file(v2)))
        _version(svc, 4)
        assert httpx.post(f"{svc.url}/generate", json=body, timeout=30).json()["policy_version"] == 4

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
        p = _weights(root, f"v{v}", seed=seed)
        _publish(bootstrap, prefix,
                 PolicyUpdate(version=v, step=v, uri=f"v{v}/model.safetensors", sha256=sha256_file(p)))
    svc = ServiceProc("actor", ["--bootstrap", bootstrap, "--topic-prefix", prefix, "--instance-id", "a1",
                                "--actor.model", "tiny", "--actor.policy-root", str(root)], tmp_path / "actor.log")
    try:
        svc.wait_ready()
        assert svc.metric("steadyrl_actor_policy_version") == 2
        assert svc.metric("steadyrl_actor_policy_loads_total") == 1  # only the newest is loaded
    finally:
        assert svc.stop() == 0
