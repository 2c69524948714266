"""`steadyrl`: the command line for people (`steadyrl --help` lists the commands).

Heavy imports happen inside each command so `--help` is instant. A command that cannot go on
raises CliError; main() prints it as one `error: ...` line on stderr and exits 2 (a bad
argument) or 1 (anything else), with no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

DEFAULT_STATE = Path(".steadyrl")
LOCAL_BOOTSTRAP = "127.0.0.1:9092"
SERVICE_PORTS = {"reward-server": 8390, "actor": 8100, "rollout": 8200, "reward": 8300, "learner": 8400}
#: What `steadyrl up` runs, in start order: service -> module. `--scale` applies to rollout and reward.
SERVICES = {"reward-server": "services.reward.server", "actor": "services.actor", "rollout": "services.rollout",
            "reward": "services.reward", "learner": "services.learner"}
#: The services `--scale` applies to, and the topic each consumes: its partitions bound N (an
#: instance beyond them would get no partition).
SCALE_INPUT = {"rollout": "rl.prompts", "reward": "rl.rollouts"}
SCALABLE = tuple(SCALE_INPUT)
#: How long the Kafka-facing commands wait for the broker to answer before giving up.
BROKER_CHECK_S = 5.0


class CliError(Exception):
    """A command cannot go on: main() prints `error: <message>` on stderr and returns `code`
    (2: a bad argument, 1: anything else)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def _bootstrap(args) -> str | None:
    """`--bootstrap`, else STEADYRL_BOOTSTRAP, else None (use the local broker)."""
    return args.bootstrap or os.environ.get("STEADYRL_BOOTSTRAP") or None


def _require_broker(bootstrap: str, timeout_s: float = BROKER_CHECK_S) -> None:
    """Raise CliError (1) unless a Kafka broker answers a metadata request at `bootstrap`
    within timeout_s.

    Without this check a command's own clients retry for their whole timeout (up to a minute),
    librdkafka printing a FAIL line to stderr for every connection attempt, and end in a
    traceback. This client's librdkafka log is off (`log_level` 0): the one error line says it.
    """
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    try:
        AdminClient({"bootstrap.servers": bootstrap, "log_level": 0}).list_topics(timeout=timeout_s)
    except KafkaException:
        raise CliError(f"cannot reach the Kafka broker at {bootstrap} (start one with `steadyrl broker start`, "
                       f"or pass --bootstrap)") from None


def _local_broker(args):
    from steadyrl.broker import LocalBroker

    return LocalBroker(Path(args.state_dir) / "broker", port=args.port, controller_port=args.port + 1,
                       heap_mb=args.heap_mb)


def cmd_broker(args) -> int:
    from steadyrl import broker as b

    if args.action == "fetch":
        print(b.fetch())
        return 0
    lb = _local_broker(args)
    if args.action == "start":
        b.fetch()
        lb.start()
        print(json.dumps(lb.status()))
    elif args.action == "stop":
        print("stopped" if lb.stop() else "not running")
    else:
        st = lb.status()
        print(json.dumps(st))
        return 0 if st["running"] else 3
    return 0


def cmd_topics(args) -> int:
    from confluent_kafka import KafkaException

    from steadyrl.topics import create_topics, list_topics

    bootstrap = _bootstrap(args) or LOCAL_BOOTSTRAP
    _require_broker(bootstrap)
    try:
        if args.action == "create":
            for name, what in create_topics(bootstrap, args.prefix).items():
                print(f"{name}\t{what}")
        else:
            for row in list_topics(bootstrap, args.prefix):
                print(f"{row['topic']}\t{'present' if row['present'] else 'MISSING'}\t"
                      f"{row['partitions']}/{row['wanted']} partitions")
    except KafkaException as e:
        raise CliError(f"topics {args.action} on {bootstrap}: {e}") from None
    return 0


def cmd_schemas(args) -> int:
    from steadyrl.schemas import check_schemas, export_schemas

    if args.action == "export":
        for p in export_schemas():
            print(p)
        return 0
    from steadyrl.contracts import ALL_CONTRACTS

    problems = check_schemas()
    for p in problems:
        print(p, file=sys.stderr)
    if not problems:
        print(f"{len(ALL_CONTRACTS)} schemas in schemas/ agree with the models")
    return 1 if problems else 0


def _parse_scale(items: list[str]) -> dict[str, int]:
    """`--scale SERVICE=N` items -> {service: N}. N is 1 up to the partitions of the topic the
    service consumes (SCALE_INPUT, from schemas/topics.yaml). Raises CliError (2)."""
    from steadyrl.topics import load_catalogue

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


def _check_up_args(args) -> dict[str, int]:
    """`up`'s arguments, checked before anything starts; returns the scale. Raises CliError (2)."""
    scale = _parse_scale(args.scale)
    if args.config:
        config = Path(args.config)
        if not config.is_file():
            raise CliError(f"--config {args.config}: {'not a file' if config.exists() else 'no such file'}", 2)
    ports = [SERVICE_PORTS[svc] + i for svc in SERVICES for i in range(scale.get(svc, 1))]
    low, high = min(ports) + args.port_offset, max(ports) + args.port_offset
    if low < 1 or high > 65535:
        raise CliError(f"--port-offset {args.port_offset}: the service ports would be {low}..{high}; "
                       f"give {1 - min(ports)}..{65535 - max(ports)}", 2)
    return scale


def _readiness(ready: dict[str, bool]) -> str:
    """The line `up` prints once the services had their time to get ready."""
    late = [name for name, ok in ready.items() if not ok]
    if not late:
        return "stack up; Ctrl-C stops everything"
    return (f"not ready yet: {', '.join(late)} (see their output above; they keep running and are restarted "
            f"if they exit); Ctrl-C stops everything")


class Progress:
    """The learner's progress as one line per change: bar, step, reward mean, tokens/s."""

    def __init__(self, url: str, out=sys.stdout, width: int = 24):
        self.url, self.out, self.width = url, out, width
        self.t0 = time.monotonic()
        self.last: tuple | None = None
        self.next_poll = 0.0

    def tick(self) -> None:
        import httpx

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


def cmd_up(args) -> int:
    from steadyrl import broker as b
    from steadyrl.supervisor import Child, Supervisor
    from steadyrl.topics import create_topics

    scale = _check_up_args(args)
    bootstrap = _bootstrap(args)
    state = Path(args.state_dir)
    lb = None
    if bootstrap is None:
        b.fetch()
        lb = _local_broker(args)
        print(f"starting Kafka broker ({lb.state_dir}) ...", flush=True)
        bootstrap = lb.bootstrap
        if not lb.start():
            print("a broker was already running there: using it, and leaving it running", flush=True)
            lb = None  # not ours to stop
    _require_broker(bootstrap)
    print(f"broker {bootstrap}: topics {create_topics(bootstrap, args.prefix)}", flush=True)
    url = {svc: f"http://127.0.0.1:{SERVICE_PORTS[svc] + args.port_offset}" for svc in SERVICES}
    policies = str(state / "policies")
    extra = {"actor": ["--actor.policy-root", policies],
             "rollout": ["--rollout.actor-url", url["actor"]],
             "reward": ["--reward.server-url", url["reward-server"]],
             "learner": ["--learner.policy-root", policies, "--learner.state-dir", str(state / "learner")]}
    children = []
    for svc, module in SERVICES.items():
        for i in range(scale.get(svc, 1)):
            port = SERVICE_PORTS[svc] + args.port_offset + i
            children.append(Child(f"{svc}-{i}", [
                sys.executable, "-m", module, "--bootstrap", bootstrap,
                "--topic-prefix", args.prefix, "--instance-id", f"{svc}-{i}", "--metrics-port", str(port),
                *extra.get(svc, []), *(["--config", args.config] if args.config else [])], port,
                final=svc == "learner"))
    def run_finished() -> bool:  # the learner exited 0: done, or only stopped from outside?
        try:
            run = (state / "learner" / "CURRENT").read_text().strip()
            return json.loads((state / "learner" / run / "state.json").read_text())["finished"]
        except (OSError, ValueError, KeyError):
            return False

    sup = Supervisor(children, is_done=run_finished)
    progress = Progress(url["learner"])

    def _stop(signum, frame):
        sup.stop.set()

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        sup.start_all()
        ready = sup.wait_ready()
        for c in children:
            print(f"{c.name}: {'ready' if ready[c.name] else 'NOT ready'} at {c.url}/readyz", flush=True)
        if args.exit_when_ready:
            return 0 if all(ready.values()) else 1
        print(_readiness(ready), flush=True)
        sup.run_until_stopped(tick=progress.tick)
        if sup.failed:
            print(f"{sup.failed} cannot start (configuration error, see its output above); stopping the stack",
                  flush=True)
            return 2
        if sup.finished:
            print(f"{sup.finished} finished its run; stopping the stack", flush=True)
        return 0
    finally:
        print("stopping services ...", flush=True)
        sup.stop_all()
        if lb is not None:
            print("stopping broker ...", flush=True)
            lb.stop()
        print("stopped", flush=True)


def cmd_ckpt(args) -> int:
    """list: every checkpoint of a checkpoints folder with its state. verify: a step folder,
    or every checkpoint of a checkpoints folder, and which one a resume would use. Both exit
    1 when any checkpoint is broken (or there is none)."""
    from steadyrl import checkpoint as ck

    root = Path(args.dir)
    if not root.is_dir():
        print(f"error: {root}: no such folder", file=sys.stderr)
        return 1
    if (root / "manifest.json").exists() or re.fullmatch(r"step_\d+", root.name):  # one checkpoint
        try:
            m = ck.verify(root)
        except ck.CheckpointError as e:
            print(f"invalid: {e}", file=sys.stderr)
            return 1
        print(f"ok: {root} step {m['step']}, format v{m['format_version']}, {len(m['files'])} files verified, "
              f"config {json.dumps(m.get('config', {}))}")
        return 0
    names = ck.list_checkpoints(root)
    if not names:
        hint = f" (did you mean {root / 'checkpoints'}?)" if (root / "checkpoints").is_dir() else ""
        print(f"no checkpoints in {root}{hint}", file=sys.stderr)
        return 1
    latest = (root / "LATEST").read_text().strip() if (root / "LATEST").exists() else None
    broken = 0
    for name in names:
        try:
            m = ck.verify(root / name)
            size = sum(f["size"] for f in m["files"].values())
            status = f"ok  step {m['step']}  {size / 1e6:.1f} MB  {m.get('created', '')}"
        except ck.CheckpointError as e:
            status, broken = f"BROKEN: {e}", broken + 1
        print(f"{'*' if name == latest else ' '} {name}  {status}")
    if args.action == "verify":
        try:
            use = ck.latest_valid(root)
            print(f"a resume would use {use.name}" + ("" if use.name == latest else f" (LATEST names {latest})"))
        except ck.CheckpointError:
            print("a resume would fail: no checkpoint verifies", file=sys.stderr)
    return 1 if broken else 0


def cmd_quarantine(args) -> int:
    """list | show | release | drop batches on rl.quarantine (steadyrl/quarantine.py)."""
    from datetime import datetime, timezone

    from confluent_kafka import KafkaException

    from steadyrl.quarantine import QuarantineError, decide, read_quarantine
    from steadyrl.contracts import QuarantineAction

    bootstrap = _bootstrap(args) or LOCAL_BOOTSTRAP
    if args.action in ("release", "drop"):
        if not args.batch:
            print(f"error: quarantine {args.action} needs a batch id (see `steadyrl quarantine list`)",
                  file=sys.stderr)
            return 2
        _require_broker(bootstrap)
        try:
            e = decide(bootstrap, args.batch, QuarantineAction(args.action), args.note or "", args.prefix)
        except (QuarantineError, RuntimeError, KafkaException) as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        what = (f"{len(e.groups)} groups back on {args.prefix}rl.scored" if args.action == "release"
                else "it will not be trained")
        print(f"{'released' if args.action == 'release' else 'dropped'} {args.batch}: {what}")
        return 0
    _require_broker(bootstrap)
    try:
        entries = read_quarantine(bootstrap, args.prefix)
    except (RuntimeError, KafkaException) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    fig = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
    if args.action == "list":
        if not entries:
            print(f"no quarantined batches on {args.prefix}rl.quarantine")
        for bid, e in entries.items():
            b = e.first
            when = datetime.fromtimestamp(b.quarantined_ms / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
            rewards = [r for q in e.groups.values() for r in q.group.rewards]
            print(f"{bid}  {e.status:8s}  step {b.step}  {when}Z  rules {','.join(b.rules)}  "
                  f"groups {len(e.groups)}/{b.count}  reward mean {sum(rewards) / len(rewards):.3f}  "
                  f"var_ratio {fig(b.var_ratio)}  extreme_share {fig(b.extreme_share)}  ks_p {fig(b.ks_pvalue)}")
        return 0
    if not args.batch or args.batch not in entries:
        print(f"error: no quarantined batch {args.batch!r} (see `steadyrl quarantine list`)", file=sys.stderr)
        return 1
    e = entries[args.batch]
    b = e.first
    print(json.dumps({"batch_id": b.batch_id, "run_id": b.run_id, "step": b.step, "rules": b.rules,
                      "var_ratio": b.var_ratio, "extreme_share": b.extreme_share, "ks_pvalue": b.ks_pvalue,
                      "groups": f"{len(e.groups)}/{b.count}", "status": e.status,
                      "decision": e.decision.model_dump(mode="json") if e.decision else None}, indent=2))
    for i in sorted(e.groups):
        g = e.groups[i].group
        print(f"- {g.prompt_id}  {g.reward_source.value} {g.scorer}  policy v{g.group.policy_version}")
        print(f"  prompt: {g.group.prompt.messages[-1].content[:200]!r}  ground truth: {g.group.prompt.ground_truth!r}")
        for smp, r in zip(g.group.samples, g.rewards):
            print(f"  {r:8.3f}  {smp.text[:120]!r}")
    return 0


def cmd_replay(args) -> int:
    """Read a time range of a scored topic, optionally re-score it, report the reward shift
    (steadyrl/replay.py). Exit 2 for a bad argument, 1 when the topic cannot be read or the
    window holds no scored group."""
    from steadyrl import replay as rp

    times = {}
    for flag, text in (("--from", args.t_from), ("--to", args.t_to)):
        try:
            times[flag] = rp.parse_time(text)
        except ValueError as e:
            print(f"error: {flag} {text!r}: {e}", file=sys.stderr)
            return 2
    if times["--from"] > times["--to"]:
        print(f"error: --from {args.t_from!r} ({rp.format_ms(times['--from'])}) is after --to {args.t_to!r} "
              f"({rp.format_ms(times['--to'])})", file=sys.stderr)
        return 2
    if args.top < 0:
        print(f"error: --top {args.top}: give 0 or more", file=sys.stderr)
        return 2
    scorer = None
    if args.rescore:
        from steadyrl.scorers import build_scorer

        try:
            scorer = build_scorer(args.rescore)
            scorer.load()
        except (ValueError, OSError) as e:
            hint = (" (a module:function scorer must be importable here, as in the reward server: "
                    "run from the folder that holds its package, or set PYTHONPATH)" if "No module named" in str(e)
                    else "")
            print(f"error: --rescore {args.rescore!r}: {e}{hint}", file=sys.stderr)
            return 2
    from confluent_kafka import KafkaException

    bootstrap = _bootstrap(args) or LOCAL_BOOTSTRAP
    _require_broker(bootstrap)
    topic = f"{args.prefix}{args.topic}"
    try:
        window = rp.read_range(bootstrap, topic, times["--from"], times["--to"], timeout_s=args.timeout)
    except (RuntimeError, KafkaException) as e:
        print(f"error: --topic {topic}: {e}", file=sys.stderr)
        return 1
    rescored = None
    if scorer is not None:
        from steadyrl.scorers import ScorerError

        try:
            rescored = rp.rescore([r.group for r in window.records], scorer)
        except ScorerError as e:
            print(f"error: --rescore {args.rescore!r}: {e}", file=sys.stderr)
            return 1
    report = rp.build_report(window, rescored, top=args.top)
    if not window.records:
        print(rp.format_report(report))
        print(f"no scored groups on {topic} between {report['from']} and {report['to']}", file=sys.stderr)
        return 1
    png = Path(args.png or DEFAULT_STATE / "replay" / (f"{topic}_{rp.format_ms(times['--from'])}_"
                                                       f"{rp.format_ms(times['--to'])}.png").replace(":", ""))
    png.parent.mkdir(parents=True, exist_ok=True)
    rp.plot_report(report, png)
    print(rp.format_report(report))
    print(f"histogram: {png}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rp.report_json(report), indent=2) + "\n")
        print(f"report: {args.json}")
    if args.to_topic:
        out_topic = f"{args.prefix}{args.to_topic}"
        if rescored is None:
            pairs = [(r.group, r) for r in window.records]
        else:
            pairs = [(g, r) for g, r in zip(rescored.groups, window.records) if g is not None]
        try:
            created = rp.ensure_topic(bootstrap, out_topic)
            n = rp.republish(bootstrap, out_topic, [g for g, _ in pairs], [r for _, r in pairs], source_topic=topic)
        except KafkaException as e:
            print(f"error: --to-topic {out_topic}: nothing republished (transaction aborted): {e}", file=sys.stderr)
            return 1
        left = len(window.records) - n
        print(f"republished {n} groups to {out_topic} ({created}) in one transaction"
              + (f"; {left} groups not rescored were left out" if left else ""))
    return 0


def cmd_eval(args) -> int:
    import logging
    from collections import defaultdict

    import torch

    from steadyrl.data import load_rows
    from steadyrl.models import load_policy
    from steadyrl.rl.loop import evaluate

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    rows = load_rows(args.data)
    if args.limit and args.limit < len(rows):  # evenly spread, so every module is sampled
        stride = len(rows) / args.limit
        rows = [rows[int(i * stride)] for i in range(args.limit)]
    model, tok = load_policy(args.model)
    acc, items = evaluate(model, tok, rows, scorer=args.scorer, max_new_tokens=args.max_new_tokens,
                          batch_size=args.batch_size)
    by_source = defaultdict(list)
    for row, item in zip(rows, items):
        item["data_source"] = row.data_source
        by_source[row.data_source].append(item["correct"])
    out = Path(args.out or DEFAULT_STATE / "eval" / f"eval-{Path(args.data).stem}.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(i) + "\n" for i in items))
    if len(by_source) > 1:
        for src, oks in sorted(by_source.items()):
            print(f"  {src}: {sum(oks)}/{len(oks)} = {sum(oks) / len(oks):.3f}")
    print(f"accuracy {acc:.4f} ({sum(i['correct'] for i in items)}/{len(items)}) "
          f"model={args.model} data={args.data} greedy, per-item results: {out}")
    return 0


def cmd_score(args) -> int:
    """One item through a reward server scorer (steadyrl.scorers), in-process: prints
    `reward  scorer-id  [extra]`.

    Exit status 2 for a scorer that cannot be built or loaded, 1 when it cannot score the item."""
    from types import SimpleNamespace

    from steadyrl.contracts import RewardSource
    from steadyrl.scorers import ScorerError, build_scorer

    try:
        scorer = build_scorer(args.scorer)
        if scorer.source is RewardSource.model:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        scorer.load()
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    item = SimpleNamespace(data_source=args.data_source, prompt=args.prompt, response=args.response,
                           ground_truth=args.ground_truth, extra_info={})
    try:
        result = scorer.score([item])[0]
    except ScorerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if result["reward"] is None:
        print(f"error: {result['error']}", file=sys.stderr)
        return 1
    extra = f"  {json.dumps(result['extra'])}" if result["extra"] else ""
    print(f"{round(result['reward'], 6)}  {scorer.id}{extra}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="steadyrl")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp, broker_opts=False):
        sp.add_argument("--bootstrap", help="existing cluster (default: $STEADYRL_BOOTSTRAP or the local broker)")
        sp.add_argument("--prefix", default="", help="topic name prefix")
        if broker_opts:
            sp.add_argument("--state-dir", default=str(DEFAULT_STATE), help="broker pid, logs and data; under `up` also policies/ and learner/ (runs, checkpoints, rollout cache)")
            sp.add_argument("--port", type=int, default=9092, help="broker port (controller: port+1)")
            sp.add_argument("--heap-mb", type=int, default=512, help="broker JVM heap, MiB")

    sp = sub.add_parser("broker", help="the local single-node Kafka broker")
    sp.add_argument("action", choices=["fetch", "start", "stop", "status"])
    common(sp, broker_opts=True)
    sp.set_defaults(fn=cmd_broker)

    sp = sub.add_parser("topics", help="create or list the catalogue's topics")
    sp.add_argument("action", choices=["create", "list"])
    common(sp)
    sp.set_defaults(fn=cmd_topics)

    sp = sub.add_parser("schemas", help="export or check the JSON Schemas in schemas/")
    sp.add_argument("action", choices=["export", "check"])
    sp.set_defaults(fn=cmd_schemas)

    sp = sub.add_parser("ckpt", help="list or verify learner checkpoints")
    sp.add_argument("action", choices=["list", "verify"])
    sp.add_argument("dir", help="checkpoint folder (verify: it, or a step_* folder in it)")
    sp.set_defaults(fn=cmd_ckpt)

    sp = sub.add_parser("quarantine", help="batches the learner's reward watch held on rl.quarantine: "
                                           "list, show one, release it to training or drop it")
    sp.add_argument("action", choices=["list", "show", "release", "drop"])
    sp.add_argument("batch", nargs="?", help="batch id (show, release, drop), as `list` prints it")
    sp.add_argument("--note", help="why (stored with the decision)")
    common(sp)
    sp.set_defaults(fn=cmd_quarantine)

    sp = sub.add_parser("replay", help="read a time range of a scored topic, optionally re-score it, and report "
                                       "the reward shift (KS, mean/std, largest changes) with a PNG")
    sp.add_argument("--topic", default="rl.scored", help="scored topic to read (prefix applied)")
    sp.add_argument("--from", dest="t_from", required=True, metavar="T1",
                    help="window start, inclusive: ISO-8601 (UTC when no zone), unix seconds, -30m / -2h, now")
    sp.add_argument("--to", dest="t_to", default="now", metavar="T2", help="window end, inclusive (default now)")
    sp.add_argument("--rescore", metavar="SPEC", help="score the samples again with this scorer and compare: rule "
                                                      "name, module:function, rm:<dir>, embedding:all-minilm-l6-v2 "
                                                      "(without it: the window's first half vs its second half)")
    sp.add_argument("--to-topic", metavar="T", help="re-publish the (re-scored) groups to this topic (prefix "
                                                    "applied; created like rl.scored if missing), in one transaction")
    sp.add_argument("--top", type=int, default=10, help="largest per-sample changes to list (with --rescore)")
    sp.add_argument("--png", help="histogram path (default .steadyrl/replay/<topic>_<from>_<to>.png)")
    sp.add_argument("--json", help="also write the report as JSON here")
    sp.add_argument("--timeout", type=float, default=60.0, help="seconds to read the window")
    common(sp)
    # `--from -30m`: argparse takes a value starting with '-' for an option unless it looks like
    # a negative number; here relative times look like one too (this parser has no such option).
    sp._negative_number_matcher = re.compile(r"^-\d+$|^-\d*\.\d+$|^-(?:\d+(?:\.\d+)?[smhdw])+$")
    sp.set_defaults(fn=cmd_replay)

    sp = sub.add_parser("eval", help="greedy accuracy of a model on a prompt set")
    sp.add_argument("--model", default="smollm2-135m-instruct", help="smollm2-135m-instruct, tiny, or a local HF dir")
    sp.add_argument("--data", default="data/arithmetic/test.parquet", help="verl parquet, or JSONL (question/answer)")
    sp.add_argument("--limit", type=int, default=0, help="N rows spread evenly over the file (0: all)")
    sp.add_argument("--scorer", default="numeric_match")
    sp.add_argument("--max-new-tokens", type=int, default=32)
    sp.add_argument("--batch-size", type=int, default=32)
    sp.add_argument("--out", help="per-item JSONL (default .steadyrl/eval/eval-<data>.jsonl)")
    sp.set_defaults(fn=cmd_eval)

    sp = sub.add_parser("score", help="score one response with a reward server scorer, in-process (hand check)")
    sp.add_argument("--scorer", required=True,
                    help="rule name (numeric_match, tiny_copy, ...), module:function, rm:<dir> or "
                         "embedding:all-minilm-l6-v2")
    sp.add_argument("--prompt", default="", help="the prompt's text (model scorers read it)")
    sp.add_argument("--response", required=True)
    sp.add_argument("--ground-truth", default=None)
    sp.add_argument("--data-source", default="")
    sp.set_defaults(fn=cmd_score)

    sp = sub.add_parser("up", help="broker, topics and every service; trains until the learner's run is done "
                                   "(Ctrl-C stops all)")
    common(sp, broker_opts=True)
    sp.add_argument("--scale", action="append", default=[], metavar="SERVICE=N")
    sp.add_argument("--config", help="YAML config passed to every service")
    sp.add_argument("--exit-when-ready", action="store_true", help="stop everything once all are ready")
    sp.add_argument("--port-offset", type=int, default=0,
                    help="added to every service's HTTP port (actor 8100, rollout 8200+i, reward 8300+i, "
                         "reward-server 8390, learner 8400)")
    sp.set_defaults(fn=cmd_up)
    p.description = f"steadyrl: the command line for people ({', '.join(sub.choices)})."
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command. Exit status: the command's; 130 on Ctrl-C; 141 (as for SIGPIPE) when
    stdout was closed early (`steadyrl ... | head`), quietly."""
    try:
        try:
            args = build_parser().parse_args(argv)
            return args.fn(args) or 0
        except CliError as e:
            print(f"error: {e}", file=sys.stderr)
            return e.code
        finally:
            sys.stdout.flush()  # a closed pipe shows here, not as a traceback at exit
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Nothing more can be said on stdout; point it at /dev/null so the interpreter's own
        # flush at exit does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
