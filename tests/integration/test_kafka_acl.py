"""Kafka with SCRAM logins and ACLs (steadyrl/local/acl.py) on a real broker: the tiny pipeline runs
with one principal per service, and what an unauthorised principal writes is refused by the
broker, so the learner never reads it."""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from steadyrl.bus import kafka
from steadyrl.bus.kafka import KafkaAuth, client_config
from steadyrl.bus.topics import create_topics
from steadyrl.local import acl
from steadyrl.local.broker import LocalBroker, ensure_password
from steadyrl.local.ports import free_port
from steadyrl.testing import audit_pipeline, explain, unique_prefix
from steadyrl.wire import codec
from steadyrl.wire.contracts import Prompt, ScoredGroup
from tests.helpers import rollout_group
from tests.integration.test_pipeline import Up, _config


@pytest.fixture(scope="module")
def sasl_broker(tmp_path_factory):
    broker = LocalBroker(tmp_path_factory.mktemp("sasl-broker"), port=free_port(), controller_port=free_port(),
                         sasl=True)
    broker.start()
    for principal in (acl.ADMIN, *acl.PRINCIPALS):
        ensure_password(broker.secrets_dir, principal)
    yield broker
    broker.stop()


@pytest.fixture
def as_admin(sasl_broker):
    """This test process's clients log in as admin (restored after)."""
    before = kafka._auth
    kafka.use_auth(sasl_broker.admin_auth())
    yield sasl_broker
    kafka._auth = before


def _as(broker: LocalBroker, principal: str) -> KafkaAuth:
    return acl.auth_for(principal, broker.secrets_dir)


def _produce(broker: LocalBroker, auth: KafkaAuth, topic: str, key: str, value: bytes, headers=None,
             timeout_s: float = 20.0) -> KafkaError | None:
    """One idempotent produce as `auth`; its delivery error (None: written)."""
    p = Producer(client_config(broker.bootstrap, auth) | {"enable.idempotence": True, "message.timeout.ms": 15000,
                                                          "log_level": 0})
    errors: list = []
    p.produce(topic, value, key, headers=headers or [], on_delivery=lambda err, msg: errors.append(err))
    p.flush(timeout_s)
    assert errors, "no delivery report"
    return errors[0]


def _count(broker: LocalBroker, topic: str, timeout_s: float = 10.0) -> int:
    """Records on `topic` (high watermarks), read as admin."""
    c = Consumer(client_config(broker.bootstrap, broker.admin_auth()) | {"group.id": f"count-{uuid.uuid4().hex}"})
    try:
        md = c.list_topics(topic, timeout=timeout_s).topics[topic]
        return sum(c.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout_s)[1] for p in md.partitions)
    finally:
        c.close()


def _forged_scored(i: int = 0, prompt: Prompt | None = None) -> tuple[bytes, list]:
    """A ScoredGroup of reward 1 for every sample (for `prompt`, or a made-up one), scorer `forger@1`."""
    group = rollout_group(i)
    if prompt is not None:
        group = group.model_copy(update={"prompt": prompt})
    return codec.encode(ScoredGroup(group=group, rewards=[1.0] * len(group.samples), reward_source="rule",
                                    scorer="forger@1"))


def test_each_principal_writes_only_its_topics_and_strangers_get_nothing(as_admin):
    broker, prefix = as_admin, unique_prefix()
    create_topics(broker.bootstrap, prefix)
    applied = acl.apply(broker.bootstrap, broker.secrets_dir, prefix)
    assert set(applied) == set(acl.PRINCIPALS) and all(n > 0 for n in applied.values())
    assert acl.apply(broker.bootstrap, broker.secrets_dir, prefix) == applied  # idempotent
    t = {name: f"{prefix}{name}" for name in ("rl.prompts", "rl.rollouts", "rl.scored", "rl.policy", "rl.dlq",
                                              "rl.releases", "rl.quarantine")}
    value, headers = _forged_scored()
    denied = KafkaError.TOPIC_AUTHORIZATION_FAILED

    # A forged group (from the rollout principal), a forged policy record and forged DLQ records
    # (from the actor principal), and a forged release (from the reward principal): all refused.
    assert _produce(broker, _as(broker, "rollout"), t["rl.scored"], "forged-0", value, headers).code() == denied
    assert _produce(broker, _as(broker, "reward"), t["rl.policy"], "run-zzz", b"{}").code() == denied
    assert _produce(broker, _as(broker, "actor"), t["rl.dlq"], "p-1", b"{}").code() == denied
    assert _produce(broker, _as(broker, "reward"), t["rl.releases"], "forged-0", value, headers).code() == denied
    assert _produce(broker, _as(broker, "rollout"), t["rl.prompts"], "p-1", b"{}").code() == denied
    # ... while each owner writes its own.
    assert _produce(broker, _as(broker, "reward"), t["rl.scored"], "forged-0", value, headers) is None
    assert _produce(broker, _as(broker, "rollout"), t["rl.dlq"], "p-1", b"{}") is None
    assert _count(broker, t["rl.policy"]) == 0 and _count(broker, t["rl.releases"]) == 0
    assert _count(broker, t["rl.scored"]) == 1 and _count(broker, t["rl.prompts"]) == 0

    # A wrong password and no login at all: nothing is written.
    wrong = broker.state_dir / "wrong-password"
    wrong.write_text("not-the-password\n")
    bad = KafkaAuth(security_protocol="SASL_PLAINTEXT", username="learner", password_file=wrong)
    err = _produce(broker, bad, t["rl.policy"], "run-zzz", b"{}")
    assert err is not None and err.code() in (KafkaError._MSG_TIMED_OUT, KafkaError._AUTHENTICATION)
    assert _produce(broker, KafkaAuth(), t["rl.policy"], "run-zzz", b"{}") is not None
    assert _count(broker, t["rl.policy"]) == 0

    # Reads and groups: the rollout principal may not read rl.scored, nor join the reward group.
    c = Consumer(client_config(broker.bootstrap, _as(broker, "rollout")) |
                 {"group.id": "steadyrl-reward", "auto.offset.reset": "earliest", "log_level": 0})
    try:
        c.subscribe([t["rl.scored"]])
        msg = None
        for _ in range(30):
            msg = c.poll(1.0)
            if msg is not None:
                break
        assert msg is not None and msg.error() is not None, "the rollout principal read rl.scored"
        assert msg.error().code() in (KafkaError.GROUP_AUTHORIZATION_FAILED, KafkaError.TOPIC_AUTHORIZATION_FAILED)
    finally:
        c.close()

    # Transactional ids: the rollout principal cannot take (and fence) a reward worker's.
    p = Producer(client_config(broker.bootstrap, _as(broker, "rollout")) |
                 {"transactional.id": "steadyrl-reward-reward-0", "log_level": 0})
    with pytest.raises(KafkaException) as info:
        p.init_transactions(15)
    assert info.value.args[0].code() == KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED


def test_the_tiny_pipeline_runs_with_a_principal_per_service_and_forgeries_are_refused(as_admin, tmp_path):
    """`steadyrl up --sasl --kafka-secrets` on the SCRAM broker: every prompt trained once (the
    audit, as admin), while a forged group for each in-flight prompt id from the rollout
    principal is refused, so none of them is on rl.scored."""
    from steadyrl.testing.procs import read_all

    broker = as_admin
    steps = 12
    up = Up(broker.bootstrap, tmp_path, _config(tmp_path, steps=steps, eval_data=None), "--sasl",
            "--kafka-secrets", str(broker.secrets_dir))
    try:
        up.wait_step(2, timeout_s=240)
        prompts = read_all(broker.bootstrap, f"{up.prefix}rl.prompts", expect=8, timeout_s=30, settle_s=0.5)
        in_flight = [codec.decode(m.value(), m.headers(), Prompt) for m in prompts[-8:]]
        rollout = _as(broker, "rollout")
        for prompt in in_flight:
            value, headers = _forged_scored(prompt=prompt)
            err = _produce(broker, rollout, f"{up.prefix}rl.scored", prompt.prompt_id, value, headers)
            assert err is not None and err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
        rc = up.proc.wait(300)
        assert rc == 0, up.log()[-4000:]
    finally:
        up.close()
    assert "principals (ACLs each) {" in up.log()
    report = audit_pipeline(broker.bootstrap, up.prefix, up.run(), steps, 8, excuse_dlq=False)
    assert report["ok"], explain(report)
    scored = read_all(broker.bootstrap, f"{up.prefix}rl.scored", expect=steps * 8, timeout_s=30, settle_s=0.5)
    assert not [m for m in scored if b"forger" in (m.value() or b"")]


def test_a_service_with_a_wrong_password_fails_at_start_naming_the_field(tmp_path):
    """Bad credentials config stops a service at start (exit 2) with the field named."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    r = subprocess.run([sys.executable, "-m", "steadyrl.services.rollout",
                        "--kafka.security-protocol", "SASL_PLAINTEXT",
                        "--kafka.username", "rollout", "--kafka.password-file", str(tmp_path / "missing")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "kafka" in r.stderr and "cannot read password_file" in r.stderr


def test_the_commands_principals_replay_to_replay_topics_and_quarantine_writes_releases(as_admin):
    """The replay principal creates and fills a `replay.*` topic but not rl.scored; the
    quarantine principal commits a transaction to rl.releases (the release path)."""
    from steadyrl.replay.republish import ensure_topic, republish

    broker, prefix = as_admin, unique_prefix()
    create_topics(broker.bootstrap, prefix)
    acl.apply(broker.bootstrap, broker.secrets_dir, prefix)
    group = ScoredGroup(group=rollout_group(0), rewards=[1.0], reward_source="rule", scorer="replayed@1")
    kafka.use_auth(_as(broker, "replay"))
    assert ensure_topic(broker.bootstrap, f"{prefix}replay.drift") == "created"
    assert republish(broker.bootstrap, f"{prefix}replay.drift", [group], timeout_s=30) == 1
    with pytest.raises(KafkaException):  # the transaction fails (TOPIC_AUTHORIZATION_FAILED, in the log)
        republish(broker.bootstrap, f"{prefix}rl.scored", [group], timeout_s=30)
    kafka.use_auth(broker.admin_auth())
    assert _count(broker, f"{prefix}replay.drift") >= 1 and _count(broker, f"{prefix}rl.scored") == 0
    value, headers = codec.encode(group)
    p = Producer(client_config(broker.bootstrap, _as(broker, "quarantine")) |
                 {"transactional.id": f"quarantine-{uuid.uuid4().hex}", "log_level": 0})
    p.init_transactions(30)
    p.begin_transaction()
    p.produce(f"{prefix}rl.releases", value, group.prompt_id, headers=headers)
    p.commit_transaction(30)
    assert _count(broker, f"{prefix}rl.releases") >= 1
