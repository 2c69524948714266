"""LocalBroker's and LocalCluster's configuration, without starting a JVM (the cluster running:
tests/integration/test_replication.py)."""

from __future__ import annotations

import re

import pytest

from steadyrl.bus.topics import create_topics
from steadyrl.local.broker import LocalBroker
from steadyrl.local.cluster import LocalCluster, random_cluster_id


def props(broker: LocalBroker) -> dict[str, str]:
    return dict(line.split("=", 1) for line in broker._server_properties().splitlines())


def test_the_single_broker_is_its_own_quorum_with_replication_1(tmp_path):
    p = props(LocalBroker(tmp_path, port=1000, controller_port=1001))
    assert p["node.id"] == "1" and p["controller.quorum.bootstrap.servers"] == "127.0.0.1:1001"
    assert "controller.quorum.voters" not in p
    for key in ("offsets.topic.replication.factor", "transaction.state.log.replication.factor",
                "transaction.state.log.min.isr", "share.coordinator.state.topic.replication.factor",
                "share.coordinator.state.topic.min.isr"):
        assert p[key] == "1", key
    assert "default.replication.factor" not in p and "min.insync.replicas" not in p


def test_cluster_nodes_share_one_static_quorum(tmp_path):
    cluster = LocalCluster(tmp_path, size=3, ports=[1000, 1002, 1004], controller_ports=[1001, 1003, 1005])
    assert cluster.bootstrap == "127.0.0.1:1000,127.0.0.1:1002,127.0.0.1:1004"
    voters = "1@127.0.0.1:1001,2@127.0.0.1:1003,3@127.0.0.1:1005"
    for nid, node in cluster.nodes.items():
        p = props(node)
        assert node.state_dir == (tmp_path / f"node-{nid}").resolve()
        assert p["node.id"] == str(nid) and p["controller.quorum.voters"] == voters
        assert "controller.quorum.bootstrap.servers" not in p
        assert p["listeners"] == f"PLAINTEXT://127.0.0.1:{node.port},CONTROLLER://127.0.0.1:{node.controller_port}"
        assert p["offsets.topic.replication.factor"] == p["transaction.state.log.replication.factor"] == "3"
        assert p["transaction.state.log.min.isr"] == p["share.coordinator.state.topic.min.isr"] == "2"
        assert p["default.replication.factor"] == "3" and p["min.insync.replicas"] == "2"
    assert cluster.pids() == {1: None, 2: None, 3: None}


def test_cluster_picks_distinct_free_ports(tmp_path):
    cluster = LocalCluster(tmp_path)
    ports = [p for n in cluster.nodes.values() for p in (n.port, n.controller_port)]
    assert len(set(ports)) == 6


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="between 1 and"):
        LocalBroker(tmp_path, replication_factor=1, min_insync_replicas=2)
    with pytest.raises(ValueError, match="not among the voters"):
        LocalBroker(tmp_path, node_id=4, voters={1: 1001})
    with pytest.raises(ValueError, match="at least one node"):
        LocalCluster(tmp_path, size=0)
    with pytest.raises(ValueError, match="3 ports"):
        LocalCluster(tmp_path, size=3, ports=[1, 2])
    with pytest.raises(ValueError, match="between 1 and"):
        create_topics("127.0.0.1:1", replication_factor=1, min_insync_replicas=2)  # refused before any I/O


def test_random_cluster_id_is_a_kafka_uuid():
    for _ in range(200):
        cid = random_cluster_id()
        assert re.fullmatch(r"[A-Za-z0-9_-]{22}", cid) and not cid.startswith("-")


def test_a_sasl_broker_has_no_anonymous_super_user_and_its_controller_logs_in(tmp_path):
    """Review regression: with `User:ANONYMOUS` a super user, anyone on the host reached the
    controller listener (127.0.0.1, PLAINTEXT) as a super user and could rewrite ACLs."""
    b = LocalBroker(tmp_path, port=1000, controller_port=1001, sasl=True)
    p = props(b)
    assert p["super.users"] == "User:admin"
    assert "ANONYMOUS" not in b._server_properties()
    assert "PLAINTEXT" not in p["listener.security.protocol.map"].replace("SASL_PLAINTEXT", "")
    assert p["sasl.mechanism.controller.protocol"] == "PLAIN"
    assert p["allow.everyone.if.no.acl.found"] == "false"
    assert (tmp_path / "secrets" / "kafka-admin").stat().st_mode & 0o077 == 0   # the password: owner only
    plain = props(LocalBroker(tmp_path / "plain", port=1000, controller_port=1001))
    assert "super.users" not in plain and "sasl.enabled.mechanisms" not in plain


def test_a_broker_made_without_logins_is_refused_logins_and_one_made_with_them_is_marked(tmp_path):
    """Issue 46: `up` takes logins by default. A state folder's broker formatted PLAINTEXT (by an
    `up` before that, or --insecure) holds no admin credential: starting it with logins would
    hang on its own login, so format() refuses at once, naming why and --insecure."""
    from steadyrl.local.broker import NoLogins

    old = LocalBroker(tmp_path / "old", port=1000, controller_port=1001)
    (old.data).mkdir(parents=True)
    (old.data / "meta.properties").write_text("version=1\n")
    (old.state_dir / "server.properties").write_text(old._server_properties())
    assert old.formatted() and old.made_without_logins()
    with pytest.raises(NoLogins, match="made without logins.*--insecure"):
        LocalBroker(tmp_path / "old", port=1000, controller_port=1001, sasl=True).format(java=None)
    assert "sasl" not in (old.state_dir / "server.properties").read_text()   # nothing written
    # a broker of an earlier --sasl (its server.properties says so) is not one, nor a new folder
    made = LocalBroker(tmp_path / "sasl", port=1000, controller_port=1001, sasl=True)
    made.data.mkdir(parents=True)
    (made.data / "meta.properties").write_text("version=1\n")
    (made.state_dir / "server.properties").write_text(made._server_properties())
    assert not made.made_without_logins()
    assert not LocalBroker(tmp_path / "new", port=1000, controller_port=1001).made_without_logins()
    # once marked (logins_file, written by a format with logins), --insecure starts leave it so
    (old.logins_file).write_text("SCRAM-SHA-512 admin\n")
    assert not old.made_without_logins()
