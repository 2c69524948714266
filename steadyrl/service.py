"""Process scaffolding shared by every service: logs, HTTP probes, signals, the main loop.

    cfg = config.load(RewardConfig, argv, prog="steadyrl-reward")
    run_service("reward", cfg, lambda health: build_stage(cfg, health))

`run_service` sets up structured logs, starts /livez /readyz /metrics on
cfg.metrics_host:cfg.metrics_port, turns SIGTERM/SIGINT into a stop event, and runs the
loop object's `run(stop)` on the main thread. It prints `listening <url>` as the first
line on stdout so supervisors and tests can find a port picked at random.
"""

from __future__ import annotations

import errno
import logging
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Protocol

from fastapi import FastAPI

from steadyrl import httpproof, logs
from steadyrl.bus import kafka
from steadyrl.config import ConfigError, ServiceConfig
from steadyrl.http import Health, HealthServer, make_app
from steadyrl.local import hardware, placement

log = logging.getLogger(__name__)


class Loop(Protocol):
    def run(self, stop: threading.Event) -> None: ...


def run_service(name: str, cfg: ServiceConfig, build: Callable[[Health], Loop],
                extra_routes: Callable[[FastAPI], object] | None = None) -> int:
    """Run one service process until SIGTERM/SIGINT. Returns the exit status."""
    logs.setup(name, cfg.log_level, cfg.log_format)

    kafka.use_auth(cfg.kafka)  # one process, one principal: every client it builds logs in as it

    hardware.register()  # steadyrl_gpu_available, GPU memory/temperature/utilisation/PCIe, host cores
    health = Health(liveness_timeout_s=cfg.liveness_timeout_s or max(60.0, 6 * cfg.metrics_interval))
    app = make_app(name, health)
    if extra_routes is not None:
        extra_routes(app)
    httpproof.install(app, cfg.http_token())   # a work route's token proven both ways, besides the bearer
    try:
        server = HealthServer(app, cfg.metrics_host, cfg.metrics_port).start()
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise

        # a port another process holds: a restart would not free it, so stop (exit 2) naming it
        raise ConfigError(f"metrics_port {cfg.metrics_port}: {cfg.metrics_host}:{cfg.metrics_port} is already in use "
                          f"by another process (`ss -ltnp 'sport = :{cfg.metrics_port}'` names it)") from None
    print(f"listening {server.url}", flush=True)  # noqa: T201  the port, for whoever started it (tests, up)
    stop = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("stop requested", extra={"signal": signal.Signals(signum).name})
        health.stopping = True   # /livez: on its way out (the stopper's grace period bounds it)
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        loop = build(health)

        placement.report(name)  # what this process got (threads, CPUs, devices), once its libraries are loaded
        loop.run(stop)
        health.stopping = True
    except Exception:
        log.exception("service failed")
        return 1
    finally:
        server.stop()
    log.info("service stopped")
    return 0


def main_guard(fn: Callable[[list[str]], int]) -> None:
    """Run `fn(sys.argv[1:])` and exit with its status; config errors print cleanly."""
    try:
        sys.exit(fn(sys.argv[1:]))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)  # noqa: T201  a config error at start: one line, exit 2
        sys.exit(2)
