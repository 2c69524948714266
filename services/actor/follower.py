"""Following `rl.policy`: the served version (`ServedVersion`) and the loop that reads the
topic and loads each version into it (`PolicyFollower`).

On start the follower reads `rl.policy` from the beginning (compacted: the newest record per
key survives) and loads the newest version it can verify (older ones if the newest is
refused); afterwards every new record is loaded as it arrives. A later run (run ids sort in
start order) replaces whatever an earlier run left; within a run the newest record wins, even a
lower version (a learner resumed from a checkpoint redoes the steps since).

A version is loaded only if its `uri` resolves to the folder `<policy_root>/<run_id>/v{version:06d}`
of the record's own run and version (policy_files.check_run), whose index has the record's
sha256 and whose shards have the index's (steadyrl/run/policy_files.py; a legacy single file
`v{version:06d}.safetensors`: its sha256), and whose tensors have the served model's names and
shapes. Otherwise the actor keeps serving what it has, logs the refusal and counts it in
`steadyrl_actor_policy_rejected_total{reason}`. Weights are safetensors only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from confluent_kafka import OFFSET_BEGINNING, Consumer, Message, TopicPartition
from prometheus_client import Counter, Gauge, Histogram

from steadyrl.bus.kafka import consumer_config
from steadyrl.bus.topics import topic_name
from steadyrl.http import Health
from steadyrl.run import policy_files
from steadyrl.run.policy_files import PolicyRefused
from steadyrl.wire import codec
from steadyrl.wire.contracts import PolicyUpdate

from . import gate
from .config import ActorConfig
from .model import ServedModel
from .vllm_engine import EngineDead

log = logging.getLogger("steadyrl.actor")

POLICY_VERSION = Gauge("steadyrl_actor_policy_version", "Policy version being served")
POLICY_HIGH_WATER = Gauge("steadyrl_actor_policy_high_water",
                          "Highest version of the served run any learner wrote (above the served "
                          "version while a resumed learner redoes the steps a crash threw away)")
POLICY_LOADS = Counter("steadyrl_actor_policy_loads", "Policy versions loaded")
POLICY_REJECTED = Counter("steadyrl_actor_policy_rejected", "Policy records refused", ["reason"])
RELOAD_SECONDS = Histogram("steadyrl_actor_policy_reload_seconds",
                           "Time to load a verified policy version into the served weights (drain included)",
                           buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300))


class ServedVersion:
    """The policy version `model` serves, and the state the version gate (gate.py) reads.

    One condition variable guards `run_id`, `version`, `sha256`, `high_water`, `loading` and
    `quiet_since` (the terms of gate.py); every change notifies it, and callers waiting in
    `wait_settled` re-decide. `caught_up` turns True once the follower has read the topic up to
    its end at start. Lock order: `model.swap` before the condition variable.
    """

    def __init__(self, model: ServedModel, policy_root: Path):
        self.model = model
        self.root = policy_root.resolve()
        self.run_id, self.version, self.sha256 = "", 0, ""   # "" / 0: the base weights
        self.high_water = 0
        self.loading: tuple[str, int] | None = None
        self.quiet_since = float("-inf")
        self.caught_up = False
        self._cv = threading.Condition()
        POLICY_VERSION.set(0)

    def snapshot(self) -> gate.Served:
        """The gate's view of the state now."""
        with self._cv:
            return self._served()

    def _served(self) -> gate.Served:
        return gate.Served(self.run_id, self.version, self.high_water, self.loading, self.quiet_since)

    def wait_settled(self, wanted: gate.Wanted, timeout_s: float) -> bool:
        """Block while the gate says WAIT for `wanted`, at most `timeout_s` seconds. Returns True
        when the wait settled (pass it to gate.verdict), False on the timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: gate.decide(self._served(), wanted) is not gate.Decision.WAIT,
                                     timeout=timeout_s)

    def resolve(self, uri: str) -> Path:
        """The version folder (or legacy file) of `uri`, checked to lie under policy_root
        (steadyrl/run/policy_files.py). Raises PolicyRefused."""
        return policy_files.resolve(self.root, uri)

    def load_version(self, version: int, uri: str, sha256: str, run_id: str = "", high_water: int = 0) -> None:
        """Verify version `version` of run `run_id` at `uri` (its sha256 `sha256`) and serve it.

        Refused (PolicyRefused, the served weights untouched): `stale` (an earlier run, or the
        served run, version and bytes again), `no_run` and `wrong_run` (policy_files.check_run),
        those of policy_files.read_version, and `wrong_model` (other tensor names or shapes).
        Within one run the newest record wins, even a lower version or the same version with
        other bytes. `high_water`: the record's mark (0 before policy_update 1.4); the served
        run's mark becomes the highest of it, `version` and the mark it had, also from a record
        refused here. Running generate calls finish on the old weights; new ones wait for the
        swap."""
        if run_id == self.run_id:
            self.raise_high_water(max(version, high_water))
        if run_id < self.run_id or (run_id, version, sha256) == (self.run_id, self.version, self.sha256):
            raise PolicyRefused("stale", f"run {run_id!r} version {version} is not newer than serving "
                                         f"run {self.run_id!r} version {self.version}")
        policy_files.check_run(self.root, uri, run_id, version)
        state = policy_files.read_version(self.root, uri, sha256)  # every byte checked
        why = self.model.mismatch(state)
        if why:
            raise PolicyRefused("wrong_model", why)
        folder = self.resolve(uri)
        t0 = time.perf_counter()
        with self.model.swap.exclusive():
            self.model.load_weights(state, folder)
            with self._cv:
                seen = self.high_water if run_id == self.run_id else 0
                self.run_id, self.version, self.sha256 = run_id, version, sha256
                self.high_water = max(high_water, version, seen)
                self._cv.notify_all()
        RELOAD_SECONDS.observe(time.perf_counter() - t0)
        POLICY_VERSION.set(version)
        POLICY_HIGH_WATER.set(self.high_water)
        POLICY_LOADS.inc()
        log.info("policy loaded", extra={"run_id": run_id, "version": version, "uri": uri})

    def raise_high_water(self, mark: int) -> None:
        """Raise the served run's high-water mark to `mark`; never lowers it."""
        with self._cv:
            if mark > self.high_water:
                self.high_water = mark
                POLICY_HIGH_WATER.set(mark)
                self._cv.notify_all()

    @contextmanager
    def announce_loading(self, run_id: str, version: int) -> Iterator[None]:
        """`loading` is (run_id, version) while the block runs, None after (also on a raise)."""
        with self._cv:
            self.loading = (run_id, version)
        try:
            yield
        finally:
            with self._cv:
                self.loading = None
                self._cv.notify_all()

    def policy_quiet(self, since: float) -> None:
        """A poll of rl.policy begun at monotonic `since` (seconds) returned no record."""
        with self._cv:
            self.quiet_since = since
            self._cv.notify_all()


class PolicyFollower:
    """Reads `rl.policy` from the beginning, then follows it, loading each version into
    `served` (module doc). Every actor reads every record (assign, no consumer group)."""

    def __init__(self, served: ServedVersion, cfg: ActorConfig):
        self.served = served
        self.topic = topic_name("rl.policy", cfg.topic_prefix)
        conf = consumer_config(cfg.bootstrap, f"actor-{cfg.instance_id}", f"actor-{cfg.instance_id}",
                               cfg.metrics_interval)
        conf.pop("group.protocol")
        self.consumer = Consumer(conf)
        self.consumer.assign([TopicPartition(self.topic, 0, OFFSET_BEGINNING)])

    def _end_offset(self) -> int:
        return self.consumer.get_watermark_offsets(TopicPartition(self.topic, 0), timeout=10)[1]

    def run(self, stop: threading.Event, health: Health) -> None:
        """Follow until `stop` is set, beating `health`; close the consumer at the end.

        Raises:
            EngineDead: the vLLM engine died (the process exits and is restarted).
        """
        end = self._end_offset()
        seen: list[PolicyUpdate] = []   # read while catching up
        position = 0
        while not stop.is_set():
            if self.served.model.dead:
                raise EngineDead("the vLLM engine died (its log above says why): exiting, to be restarted")
            health.beat()
            started = time.monotonic()
            msg = self.consumer.poll(0.5)
            if msg is None and self.served.caught_up:
                self.served.policy_quiet(started)
            if msg is not None and msg.error() is None:
                offset = msg.offset()
                assert offset is not None, "librdkafka sets it on every record (not on an error event)"
                position = offset + 1
                upd = self._decode(msg)
                if upd is not None:
                    if self.served.caught_up:
                        self._load(upd)
                    else:
                        seen.append(upd)
            if not self.served.caught_up and position >= end:
                self._catch_up(seen)
        self.consumer.close()

    @staticmethod
    def _decode(msg: Message) -> PolicyUpdate | None:
        """The record's PolicyUpdate, or None (refused by the codec, counted and logged)."""
        try:
            return codec.decode(msg.value(), msg.headers(), PolicyUpdate)
        except codec.Rejected as rej:
            POLICY_REJECTED.labels(rej.reason.value).inc()
            log.warning("policy record refused", extra={"reason": rej.reason.value, "detail": rej.detail})
            return None

    def _catch_up(self, seen: list[PolicyUpdate]) -> None:
        """At the topic's end at start: load the newest run's last record that verifies (earlier
        ones if it is refused), take the served run's mark from every record of it on the topic
        (records before policy_update 1.4 carry none), and mark the actor caught up."""
        order = sorted(enumerate(seen), key=lambda t: (t[1].run_id, t[0]), reverse=True)
        for upd in (u for _, u in order):
            if self._load(upd):
                break
        self.served.raise_high_water(max((max(u.version, u.high_water) for u in seen
                                          if u.run_id == self.served.run_id), default=0))
        self.served.caught_up = True
        log.info("policy caught up", extra={"version": self.served.version})

    def _load(self, upd: PolicyUpdate) -> bool:
        """Load `upd` (a PolicyUpdate), announced as loading meanwhile. Returns False when it is
        refused (counted by reason, `load_error` for a file that cannot be read or loaded)."""
        try:
            with self.served.announce_loading(upd.run_id, upd.version):
                self.served.load_version(upd.version, upd.uri, upd.sha256, upd.run_id, upd.high_water)
            return True
        except PolicyRefused as e:
            POLICY_REJECTED.labels(e.reason).inc()
            log.warning("policy refused", extra={"version": upd.version, "reason": e.reason, "detail": e.detail})
            return False
        except Exception as e:  # noqa: BLE001  the record stays on the compacted topic: raising would end every start
            POLICY_REJECTED.labels("load_error").inc()
            log.warning("policy refused", extra={"version": upd.version, "reason": "load_error",
                                                 "detail": f"{type(e).__name__}: {e}"})
            return False
