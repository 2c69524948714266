"""A local Kafka cluster: `LocalCluster` runs `size` (3) `LocalBroker` nodes on 127.0.0.1, each
a combined broker+controller of one static KRaft quorum (`controller.quorum.voters` names all of
them), under `<state_dir>/node-<id>/` with one shared `<state_dir>/cluster.id`. Internal topics
(`__consumer_offsets`, `__transaction_state`, share state) get replication `size` and
`min.insync.replicas` 2, and so do topics created without explicit settings; one node can be
SIGKILLed and started again by id (tests/integration/test_replication.py, docs/replication.md).
"""

from __future__ import annotations

import base64
import logging
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from steadyrl.bus.kafka import client_config
from steadyrl.local.broker import LocalBroker
from steadyrl.local.jars import BrokerError
from steadyrl.local.ports import free_port

log = logging.getLogger(__name__)


def random_cluster_id() -> str:
    """A KRaft cluster id as Kafka's `StorageTool random-uuid` makes it (22 URL-safe base64
    characters of a random UUID, never starting with '-'), without starting a JVM."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cid.startswith("-"):
            return cid


class LocalCluster:
    """`size` KRaft nodes on 127.0.0.1, each broker and controller, one static quorum.

    Node ids are 1..size; node i lives in `<state_dir>/node-<i>/` (a `LocalBroker`: config, data,
    logs, pid) and all share `<state_dir>/cluster.id`, made once. Data dirs are kept across
    restarts, so a node that was killed starts again where it was and catches up.

    Args:
        state_dir: the cluster's folder (created if missing).
        size: number of nodes (voters); 3 tolerates the loss of one node.
        heap_mb: JVM max heap of each node, MiB.
        replication_factor: of the internal topics and the brokers' default (default: size).
        min_insync_replicas: of the transaction log and the brokers' default (default: 2, or 1
            for a cluster of one).
        ports, controller_ports: PLAINTEXT and controller port of each node (default: free
            ports on 127.0.0.1, picked now).

    Raises ValueError for a size below 1, port lists of another length, or settings
    `LocalBroker` refuses.
    """

    def __init__(self, state_dir: Path, size: int = 3, heap_mb: int = 384, replication_factor: int | None = None,
                 min_insync_replicas: int | None = None, ports: list[int] | None = None,
                 controller_ports: list[int] | None = None):
        if size < 1:
            raise ValueError(f"a cluster needs at least one node, not {size}")
        self.state_dir = Path(state_dir).resolve()
        ports = ports or [free_port() for _ in range(size)]
        controller_ports = controller_ports or [free_port() for _ in range(size)]
        if len(ports) != size or len(controller_ports) != size:
            raise ValueError(f"{size} nodes need {size} ports and {size} controller ports")
        rf = size if replication_factor is None else replication_factor
        min_isr = min(2, rf) if min_insync_replicas is None else min_insync_replicas
        voters = {i + 1: controller_ports[i] for i in range(size)}
        self.nodes: dict[int, LocalBroker] = {
            nid: LocalBroker(self.state_dir / f"node-{nid}", port=ports[nid - 1], controller_port=cport,
                             heap_mb=heap_mb, node_id=nid, voters=voters, replication_factor=rf,
                             min_insync_replicas=min_isr)
            for nid, cport in voters.items()}

    @property
    def bootstrap(self) -> str:
        """Every node's address, comma-separated (a client needs any one of them alive)."""
        return ",".join(n.bootstrap for n in self.nodes.values())

    def node(self, node_id: int) -> LocalBroker:
        """The node with `node.id` node_id. Raises KeyError for an unknown id."""
        return self.nodes[node_id]

    def _cluster_id(self) -> str:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        f = self.state_dir / "cluster.id"
        if not f.exists():
            f.write_text(random_cluster_id())
        return f.read_text().strip()

    def start(self, timeout_s: float = 180.0) -> bool:
        """Start every node that is not running (all at once: a node waits for a majority of
        the quorum) and wait until each answers metadata listing every node as a broker.

        Returns True if this call started any node. Raises BrokerError (with the log tail of the
        node at fault) if a JVM exits or the cluster is not complete within `timeout_s` seconds.
        """
        cid = self._cluster_id()
        down = [n for n in self.nodes.values() if n.pid() is None]
        for n in down:
            n.state_dir.mkdir(parents=True, exist_ok=True)
            (n.state_dir / "cluster.id").write_text(cid)
        with ThreadPoolExecutor(max_workers=max(len(down), 1)) as pool:  # formatting is a JVM each
            procs = dict(zip((n.node_id for n in down), pool.map(LocalBroker.spawn, down), strict=True))
        self.wait_ready(timeout_s, procs)
        if down:
            log.info("cluster started", extra={"nodes": [n.node_id for n in down], "bootstrap": self.bootstrap})
        return bool(down)

    def start_node(self, node_id: int, timeout_s: float = 120.0) -> bool:
        """Start one node again (same ports and data) and wait until the cluster lists it as a
        broker again. Returns False if it was running. Raises BrokerError as `start`."""
        node = self.nodes[node_id]
        if node.pid() is not None:
            return False
        proc = node.spawn()
        self.wait_ready(timeout_s, {node_id: proc}, only=[node_id])
        return True

    def wait_ready(self, timeout_s: float, procs: dict[int, subprocess.Popen[bytes]] | None = None,
                   only: list[int] | None = None) -> None:
        """Block until each node of `only` (default: all) answers a metadata request on its own
        address and the cluster's metadata lists every node that runs as a broker.

        Raises BrokerError if a node of `procs` exits, or past `timeout_s` seconds.
        """
        from confluent_kafka import KafkaException  # lazy: heavy (confluent_kafka), only broker calls need it
        from confluent_kafka.admin import AdminClient  # lazy: heavy (confluent_kafka), only broker calls need it

        deadline = time.monotonic() + timeout_s
        want = only or list(self.nodes)
        admins = {nid: AdminClient(client_config(self.nodes[nid].bootstrap) | {"log_level": 0,
                                    "logger": logging.getLogger("steadyrl.local.broker.admin")}) for nid in want}
        pending, last = set(want), ""
        while time.monotonic() < deadline:
            for nid, proc in (procs or {}).items():
                if proc.poll() is not None:
                    raise BrokerError(f"node {nid} exited with code {proc.returncode}:\n"
                                      f"{self.nodes[nid].log_tail()}")
            for nid in sorted(pending):
                try:
                    listed = set(admins[nid].list_topics(timeout=2.0).brokers)
                except KafkaException as e:  # while the node is coming up
                    last = f"node {nid}: {e}"
                    continue
                running = {i for i, n in self.nodes.items() if n.pid() is not None}
                if running <= listed:
                    pending.discard(nid)
                else:
                    last = f"node {nid} lists brokers {sorted(listed)}, running {sorted(running)}"
            if not pending:
                return
            time.sleep(0.3)
        tails = "\n".join(f"--- node {nid}\n{self.nodes[nid].log_tail(15)}" for nid in sorted(pending))
        raise BrokerError(f"cluster {self.bootstrap} not ready in {timeout_s:.0f}s ({last}):\n{tails}")

    def kill(self, node_id: int) -> int | None:
        """SIGKILL one node (its data stays); returns its pid, None if it was not running."""
        return self.nodes[node_id].kill()

    def stop(self, grace_s: float = 30.0) -> bool:
        """Stop every node at once: SIGTERM, SIGKILL after `grace_s` seconds. Returns True if any
        node was running."""
        with ThreadPoolExecutor(max_workers=len(self.nodes)) as pool:
            return any(list(pool.map(lambda n: n.stop(grace_s), self.nodes.values())))

    def pids(self) -> dict[int, int | None]:
        """node id -> pid of its running JVM (None: not running)."""
        return {nid: n.pid() for nid, n in self.nodes.items()}

    def partitions(self, topic: str, timeout_s: float = 10.0) -> dict[int, dict[str, Any]]:
        """partition -> {"leader": node id (-1: none), "replicas": [...], "isr": [...]} of
        `topic`, from a metadata request to any node. A node may not know a topic created a
        moment ago: asked again for up to `timeout_s` seconds, then KeyError (the topic is
        absent); confluent_kafka.KafkaException if no node answers."""
        from confluent_kafka.admin import AdminClient  # lazy: heavy (confluent_kafka), only broker calls need it

        admin = AdminClient(client_config(self.bootstrap) | {"log_level": 0})
        deadline = time.monotonic() + timeout_s
        while True:
            t = admin.list_topics(topic, timeout=timeout_s).topics[topic]
            if t.error is None:
                break
            if time.monotonic() > deadline:
                raise KeyError(f"{topic}: {t.error}")
            time.sleep(0.2)
        return {p.id: {"leader": p.leader, "replicas": list(p.replicas), "isr": list(p.isrs)}
                for p in t.partitions.values()}

    def brokers(self, timeout_s: float = 10.0) -> set[int]:
        """Node ids the cluster's metadata lists as brokers now (a killed node drops out once
        the controller fences it: `broker.session.timeout.ms`, 9 s by default)."""
        from confluent_kafka.admin import AdminClient  # lazy: heavy (confluent_kafka), only broker calls need it

        return set(AdminClient(client_config(self.bootstrap) | {"log_level": 0})
                   .list_topics(timeout=timeout_s).brokers)

    def status(self) -> dict[str, Any]:
        """`{"bootstrap": str, "state_dir": str, "nodes": {id: LocalBroker.status()}}`."""
        return {"bootstrap": self.bootstrap, "state_dir": str(self.state_dir),
                "nodes": {nid: n.status() for nid, n in self.nodes.items()}}
