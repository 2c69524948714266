"""Issue 46's acceptance: under the default `steadyrl up` (its own broker, no flag) a process on the
host without the run's credentials can neither write a group that gets trained nor use the
work routes. One tiny run on its own broker: while it trains, a plain Kafka producer (no
credentials, as any local process) tries to write a forged scored group (reward 1 everywhere)
for a prompt in flight, and plain HTTP calls try /generate and /score without a token and with
the other route's; the broker refuses the one, the services answer 401 to the others, nothing
forged is on rl.scored, and the run, stopped as Ctrl-C does, trained each prompt once. A
command on that broker is told how to log in, and works once it does. Started again on the same
folder, the stack logs in with passwords made anew and gets ready."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import httpx
import yaml
from confluent_kafka import Consumer, Producer, TopicPartition

from steadyrl.bus.kafka import KafkaAuth, client_config
from steadyrl.httpproof import ProvenToken
from steadyrl.local.broker import LocalBroker
from steadyrl.local.ports import free_port_pair
from steadyrl.run.runfolder import RunDir
from steadyrl.wire import codec
from steadyrl.wire.contracts import Prompt, ScoredGroup
from tests.helpers import own_things, rollout_group

STEPS = 10_000   # still training when the checks are done: then stopped as Ctrl-C does


def _read(bootstrap: str, auth: KafkaAuth, topic: str, timeout_s: float = 20.0) -> list:
    """Every record of `topic` now, read as `auth`."""
    c = Consumer(client_config(bootstrap, auth) | {"group.id": f"closed-{uuid.uuid4().hex}", "log_level": 0,
                                                   "enable.auto.commit": False})
    try:
        parts = c.list_topics(topic, timeout=timeout_s).topics[topic].partitions
        ends = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout_s)[1] for p in parts}
        c.assign([TopicPartition(topic, p, 0) for p in parts])
        out, deadline = [], time.monotonic() + timeout_s
        while sum(ends.values()) > len(out) and time.monotonic() < deadline:
            out += [m for m in c.consume(100, timeout=0.5) if m.error() is None]
        return out
    finally:
        c.close()


def test_a_process_without_the_runs_credentials_gets_nothing_trained_under_the_default_up(tmp_path):
    home = tmp_path / "mine"
    home.mkdir()
    own_things(home, "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                     "    return float(solution_str[:1] == ground_truth)\n")
    state, port, offset = home / "run", free_port_pair(), 3000 + os.getpid() % 500
    tiny = {"learner": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 4,
                        "train": {"lr": 0.003, "micro_batch_size": 16}, "prompt_gate": {"cooldown_s": 0}}}
    (home / "small.yaml").write_text(yaml.safe_dump(tiny))
    bootstrap = f"127.0.0.1:{port}"
    url = {svc: f"http://127.0.0.1:{base + offset}" for svc, base in
           (("actor", 8100), ("reward-server", 8390), ("learner", 8400))}
    cmd = [sys.executable, "-m", "steadyrl.cli", "up", "--plain", "--model", "model", "--data", "train.jsonl",
           "--reward", "my_reward.py:compute_score", "--steps", str(STEPS), "--config", "small.yaml",
           "--state-dir", str(state), "--port", str(port), "--port-offset", str(offset)]
    with open(tmp_path / "up.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=home, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    out = lambda: (tmp_path / "up.log").read_text(errors="replace")   # noqa: E731
    admin = LocalBroker(state / "broker", port=port, sasl=True).admin_auth()
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, out()[-4000:]
            try:
                if httpx.get(f"{url['learner']}/progress", timeout=2).json().get("step", 0) >= 1:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.3)
        # a prompt in flight (read as admin: the test knows more than the forger needs to)
        prompts = [codec.decode(m.value(), m.headers(), Prompt) for m in _read(bootstrap, admin, "rl.prompts")]
        target = prompts[-1]
        group = rollout_group(0).model_copy(update={"prompt": target})
        value, headers = codec.encode(ScoredGroup(group=group, rewards=[1.0] * len(group.samples),
                                                  reward_source="rule", scorer="forger@1"))
        # the forger: a plain producer, as any process on the host
        errors: list = []
        p = Producer(client_config(bootstrap, KafkaAuth()) | {"message.timeout.ms": 4000, "log_level": 0})
        p.produce("rl.scored", value, target.prompt_id, headers=headers,
                  on_delivery=lambda err, msg: errors.append(err))
        p.flush(15)
        assert errors and errors[0] is not None, "a producer without credentials wrote rl.scored"
        scored = _read(bootstrap, admin, "rl.scored")
        assert scored and not [m for m in scored if b"forger" in (m.value() or b"")]
        # a command on that broker: without logging in it is told how; as its principal it works
        env = {k: v for k, v in os.environ.items() if not k.startswith("STEADYRL_")}
        qcmd = [sys.executable, "-m", "steadyrl.cli", "quarantine", "list", "--bootstrap", bootstrap]
        r = subprocess.run(qcmd, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "does not answer without logging in" in r.stderr, r.stderr
        login = {"STEADYRL_KAFKA__SECURITY_PROTOCOL": "SASL_PLAINTEXT", "STEADYRL_KAFKA__USERNAME": "quarantine",
                 "STEADYRL_KAFKA__PASSWORD_FILE": str(state / "broker" / "secrets" / "kafka-quarantine")}
        r = subprocess.run(qcmd, env={**env, **login}, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr[-2000:]
        # the work routes: no token, or the other route's, is 401; the route's own opens it
        gen, score = ((state / "secrets" / name).read_text().strip() for name in ("http-generate", "http-score"))
        for route, own, other in ((f"{url['actor']}/generate", gen, score),
                                  (f"{url['reward-server']}/score", score, gen)):
            assert httpx.post(route, json={}, timeout=10).status_code == 401
            assert httpx.post(route, json={}, headers={"Authorization": f"Bearer {other}"},
                              timeout=10).status_code == 401
            assert httpx.post(route, json={}, headers={"Authorization": f"Bearer {own}"},
                              timeout=10).status_code == 422   # past the token: the empty body is refused
            with httpx.Client(auth=ProvenToken(own), timeout=10) as proven:   # as the workers call it
                assert proven.post(route, json={}).status_code == 422       # and the answer proves the token
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            proc.wait(60)
    text = out()
    assert rc == 0, text[-4000:]
    closed = re.search(r"closed: Kafka logins per service .*each take a token of their own \(([0-9.]+) s\)", text)
    assert closed is not None, text[:4000]
    logging.getLogger(__name__).info("logins and tokens added %s s to up's start", closed[1])
    # the run trained what its reward workers scored, each prompt once
    trained = [c["prompt_id"] for c in RunDir.of_up(state).consumed()]
    assert trained and len(trained) == len(set(trained)) and len(trained) % 4 == 0
    # started again on the same folder (a resume): its broker takes the logins it was made with,
    # every service logs in with the passwords made anew, and every one gets ready
    before = (state / "broker" / "secrets" / "kafka-rollout").read_text()
    r = subprocess.run([*cmd, "--exit-when-ready"], cwd=home, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert (state / "broker" / "secrets" / "kafka-rollout").read_text() != before
