"""The embedded single-node Apache Kafka broker (KRaft), started from Maven Central jars.

`LocalBroker` owns one broker process and everything it needs under one state dir:

    <state_dir>/server.properties   written on every start
    <state_dir>/cluster.id          KRaft cluster id, created once
    <state_dir>/data/               log.dirs (kept across restarts)
    <state_dir>/logs/server.log     broker log (log4j2), stdout/stderr in logs/stdout.log
    <state_dir>/broker.pid          pid of the running `kafka.Kafka`

The jars come from `broker/pom.xml` (`mvn dependency:copy-dependencies` into `broker/libs/`).
Guarantees: `start()` returns only once metadata answers on the bootstrap address; `stop()`
ends only the pid this state dir recorded, SIGTERM first, SIGKILL after a grace period.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parent.parent
BROKER_DIR = PROJECT_ROOT / "broker"


class BrokerError(RuntimeError):
    """The broker could not be fetched, formatted, started or reached."""


def libs_dir() -> Path:
    """Folder holding the broker jars (`STEADYRL_KAFKA_LIBS` or `broker/libs`)."""
    return Path(os.environ.get("STEADYRL_KAFKA_LIBS", BROKER_DIR / "libs"))


def fetch(quiet: bool = True) -> Path:
    """Copy the broker jars from Maven into `libs_dir()` unless they are already there.

    Returns the folder. Raises BrokerError if Maven fails or is missing.
    """
    libs = libs_dir()
    if any(libs.glob("kafka_2.13-*.jar")) and any(libs.glob("log4j-slf4j-impl-*.jar")):
        return libs
    # -B: no prompts, no download progress; -Dstyle.color=never: no ANSI colour codes in any case
    cmd = ["mvn", "-B", "-Dstyle.color=never", "-f", str(BROKER_DIR / "pom.xml"), "dependency:copy-dependencies",
           f"-DoutputDirectory={libs}"]
    if quiet:
        cmd.insert(1, "-q")
    try:
        subprocess.run(cmd, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise BrokerError(f"fetching the Kafka broker with Maven failed: {e}") from e
    return libs


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers kill(0); look at its state.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@dataclass
class LocalBroker:
    """One single-node KRaft broker on 127.0.0.1.

    Args:
        state_dir: folder for config, data, logs and pid (created if missing).
        port: PLAINTEXT listener port; the controller listens on `controller_port`.
        heap_mb: JVM max heap in MiB (-Xmx); -Xms is half of it.
    """

    state_dir: Path
    port: int = 9092
    controller_port: int = 9093
    heap_mb: int = 512

    def __post_init__(self) -> None:
        self.state_dir = Path(self.state_dir).resolve()

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid_file(self) -> Path:
        return self.state_dir / "broker.pid"

    @property
    def log_file(self) -> Path:
        return self.state_dir / "logs" / "server.log"

    def pid(self) -> int | None:
        """Pid of the broker this state dir started, if it is still running."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        if _pid_alive(pid) and "kafka.Kafka" in _cmdline(pid):
            return pid
        return None

    def _server_properties(self) -> str:
        data = self.state_dir / "data"
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.bootstrap.servers": f"127.0.0.1:{self.controller_port}",
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "log.dirs": str(data),
            # Single node: every internal topic has replication 1.
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
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
        return "".join(f"{k}={v}\n" for k, v in props.items())

    def _java(self, *args: str, **kw) -> subprocess.CompletedProcess:
        cp = f"{libs_dir()}/*"
        return subprocess.run(["java", "-cp", cp, *args], capture_output=True, text=True, **kw)

    def format(self) -> None:
        """Write server.properties and format KRaft storage (no-op if already formatted)."""
        (self.state_dir / "logs").mkdir(parents=True, exist_ok=True)
        (self.state_dir / "data").mkdir(parents=True, exist_ok=True)
        cfg = self.state_dir / "server.properties"
        cfg.write_text(self._server_properties())
        cid_file = self.state_dir / "cluster.id"
        if not cid_file.exists():
            r = self._java("kafka.tools.StorageTool", "random-uuid")
            if r.returncode != 0:
                raise BrokerError(f"StorageTool random-uuid failed: {r.stderr.strip()}")
            cid_file.write_text(r.stdout.strip().splitlines()[-1])
        r = self._java("kafka.tools.StorageTool", "format", "--standalone", "-t",
                       cid_file.read_text().strip(), "-c", str(cfg), "-g")
        if r.returncode != 0:
            raise BrokerError(f"StorageTool format failed: {r.stdout.strip()} {r.stderr.strip()}")

    def start(self, timeout_s: float = 90.0) -> bool:
        """Start the broker if it is not running and wait until metadata answers.

        Returns True if this call started it, False if it was already running.
        Raises BrokerError (with the log tail) if the JVM exits or metadata does not
        answer within `timeout_s`.
        """
        if self.pid() is not None:
            self.wait_ready(timeout_s)
            return False
        if not any(libs_dir().glob("kafka_2.13-*.jar")):
            raise BrokerError(f"no broker jars in {libs_dir()}: run `steadyrl broker fetch` (or `make`)")
        self.format()
        logs = self.state_dir / "logs"
        cmd = [
            "java", f"-Xmx{self.heap_mb}m", f"-Xms{self.heap_mb // 2}m", "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={BROKER_DIR / 'log4j2.properties'}",
            f"-Dkafka.logs.dir={logs}",
            "-cp", f"{libs_dir()}/*", "kafka.Kafka", str(self.state_dir / "server.properties"),
        ]
        out = open(logs / "stdout.log", "ab")
        # Own session: a Ctrl-C in the terminal reaches our supervisor, which stops us in order.
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=self.state_dir)
        out.close()
        self.pid_file.write_text(str(proc.pid))
        self._proc = proc
        self.wait_ready(timeout_s, proc)
        log.info("broker started", extra={"pid": proc.pid, "bootstrap": self.bootstrap})
        return True

    def wait_ready(self, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
        """Block until the broker answers a metadata request (not merely the port)."""
        from confluent_kafka.admin import AdminClient

        deadline = time.monotonic() + timeout_s
        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0,
                             "logger": logging.getLogger("steadyrl.broker.admin")})
        last_err: Exception | None = None
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise BrokerError(f"broker exited with code {proc.returncode}:\n{self.log_tail()}")
            try:
                md = admin.list_topics(timeout=2.0)
                if md.brokers:
                    return
            except Exception as e:  # KafkaException while the broker is coming up
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

    def kill(self) -> None:
        """SIGKILL the broker (for crash tests); data stays for a restart."""
        pid = self.pid()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            self._wait_exit(pid, 10.0)

    def _wait_exit(self, pid: int, timeout_s: float) -> bool:
        proc = getattr(self, "_proc", None)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc is not None and proc.pid == pid:
                if proc.poll() is not None:
                    return True
            elif not _pid_alive(pid):
                return True
            time.sleep(0.1)
        return False

    def status(self) -> dict:
        """`{"running": bool, "pid": int|None, "bootstrap": str, "state_dir": str}`."""
        pid = self.pid()
        return {"running": pid is not None, "pid": pid, "bootstrap": self.bootstrap,
                "state_dir": str(self.state_dir)}

    def log_tail(self, lines: int = 30) -> str:
        texts = []
        for f in (self.state_dir / "logs" / "stdout.log", self.log_file):
            try:
                texts.append("\n".join(f.read_text(errors="replace").splitlines()[-lines:]))
            except OSError:
                pass
        return "\n".join(texts)
