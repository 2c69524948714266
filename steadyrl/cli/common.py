"""What the command modules share: the error every command raises, where the broker is, and
the `--bootstrap/--prefix` (and broker) options."""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path

from steadyrl.bus.kafka import client_config, current_auth
from steadyrl.local.broker import LocalBroker

DEFAULT_STATE = Path(".steadyrl")
LOCAL_BOOTSTRAP = "127.0.0.1:9092"
#: How long the Kafka-facing commands wait for the broker to answer before giving up.
BROKER_CHECK_S = 5.0


class CliError(Exception):
    """A command cannot go on: main() prints `error: <message>` on stderr and returns `code`
    (2: a bad argument, 1: anything else)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def _bootstrap(args: argparse.Namespace) -> str | None:
    """`--bootstrap`, else STEADYRL_BOOTSTRAP, else None (use the local broker)."""
    bootstrap: str | None = args.bootstrap or os.environ.get("STEADYRL_BOOTSTRAP") or None
    return bootstrap


def _require_broker(bootstrap: str, timeout_s: float = BROKER_CHECK_S) -> None:
    """Raise CliError (1) unless a Kafka broker answers a metadata request at `bootstrap`
    within timeout_s.

    Without this check a command's own clients retry for their whole timeout (up to a minute),
    librdkafka printing a FAIL line to stderr for every connection attempt, and end in a
    traceback. This client's librdkafka log is off (`log_level` 0): the one error line says it.
    """
    from confluent_kafka import KafkaException  # lazy: heavy (confluent_kafka), keeps `steadyrl --help` fast
    from confluent_kafka.admin import AdminClient  # lazy: heavy (confluent_kafka), keeps `steadyrl --help` fast

    try:
        AdminClient(client_config(bootstrap) | {"log_level": 0}).list_topics(timeout=timeout_s)
    except KafkaException:
        if current_auth().security_protocol == "PLAINTEXT" and _listens(bootstrap):
            raise CliError(f"the Kafka broker at {bootstrap} does not answer without logging in (`steadyrl up`'s "
                           f"own broker takes logins by default): log in as a principal with "
                           f"STEADYRL_KAFKA__SECURITY_PROTOCOL=SASL_PLAINTEXT STEADYRL_KAFKA__USERNAME=<principal> "
                           f"STEADYRL_KAFKA__PASSWORD_FILE=<state-dir>/broker/secrets/kafka-<principal> (`up` "
                           f"prints it)") from None
        raise CliError(f"cannot reach the Kafka broker at {bootstrap} (start one with `steadyrl broker start`, "
                       f"or pass --bootstrap)") from None


def _listens(bootstrap: str) -> bool:
    """Whether the first address of `bootstrap` (host:port) takes a TCP connection within 1 s."""
    host, _, port = bootstrap.split(",")[0].strip().rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=1.0):
            return True
    except (OSError, ValueError):
        return False


def _local_broker(args: argparse.Namespace) -> LocalBroker:
    return LocalBroker(Path(args.state_dir) / "broker", port=args.port, controller_port=args.port + 1,
                       heap_mb=args.heap_mb, sasl=args.sasl)


def add_common_options(sp: argparse.ArgumentParser, broker_opts: bool = False) -> None:
    """`--bootstrap` and `--prefix` on a subcommand; with broker_opts also the local broker's
    `--state-dir`, `--port` and `--heap-mb`."""
    sp.add_argument("--bootstrap", help="existing cluster (default: $STEADYRL_BOOTSTRAP or the local broker)")
    sp.add_argument("--prefix", default="", help="topic name prefix")
    if broker_opts:
        sp.add_argument("--state-dir", default=str(DEFAULT_STATE),
                        help="broker pid, logs and data; under `up` also policies/ and learner/ "
                             "(runs, checkpoints, rollout cache)")
        sp.add_argument("--port", type=int, default=9092, help="broker port (controller: port+1)")
        sp.add_argument("--heap-mb", type=int, default=512, help="broker JVM heap, MiB")
        sp.add_argument("--sasl", action="store_true",
                        help="the local broker with SCRAM logins and ACLs (steadyrl/local/acl.py); passwords in "
                             "<state-dir>/broker/secrets/kafka-<principal>")
