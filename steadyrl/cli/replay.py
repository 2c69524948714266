"""`steadyrl replay`: reward shift over a time range of a scored topic, or the turns of the
episodes on rl.episodes (steadyrl.replay, docs/replay.md)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from steadyrl.cli.common import (
    DEFAULT_STATE,
    LOCAL_BOOTSTRAP,
    CliError,
    _bootstrap,
    _require_broker,
    add_common_options,
)

if TYPE_CHECKING:
    from steadyrl.model.scorers import Scorer
    from steadyrl.replay import Rescored, Window


def cmd_replay(args: argparse.Namespace) -> int:
    """Read a time range of a scored topic, optionally re-score it, report the reward shift
    (steadyrl/replay.py). Exit 2 for a bad argument, 1 when the topic cannot be read or the
    window holds no scored group."""
    from steadyrl import replay as rp  # lazy: entry point (a command), keeps `steadyrl --help` fast

    t_from, t_to = _time_range(args)
    if args.topic == "rl.episodes":
        return _episodes(args, t_from, t_to)
    if args.prompt is not None:
        raise CliError("--prompt reads one group's episodes: give it with --topic rl.episodes", 2)
    if args.top < 0:
        raise CliError(f"--top {args.top}: give 0 or more", 2)
    scorer = _rescorer(args.rescore) if args.rescore else None
    from confluent_kafka import KafkaException  # lazy: entry point (a command), keeps `steadyrl --help` fast

    bootstrap = _bootstrap(args) or LOCAL_BOOTSTRAP
    _require_broker(bootstrap)
    topic = f"{args.prefix}{args.topic}"
    try:
        window = rp.read_range(bootstrap, topic, t_from, t_to, timeout_s=args.timeout)
    except (RuntimeError, KafkaException) as e:
        raise CliError(f"--topic {topic}: {e}", 1) from None
    rescored = None
    if scorer is not None:
        from steadyrl.model.scorers import ScorerError  # lazy: entry point (a command), keeps `steadyrl --help` fast

        try:
            rescored = rp.rescore([r.group for r in window.records], scorer)
        except ScorerError as e:
            raise CliError(f"--rescore {args.rescore!r}: {e}", 1) from None
    report = rp.build_report(window, rescored, top=args.top)
    if not window.records:
        print(rp.format_report(report))
        print(f"no scored groups on {topic} between {report['from']} and {report['to']}", file=sys.stderr)
        return 1
    png = Path(args.png or DEFAULT_STATE / "replay" / (f"{topic}_{rp.format_ms(t_from)}_"
                                                       f"{rp.format_ms(t_to)}.png").replace(":", ""))
    png.parent.mkdir(parents=True, exist_ok=True)
    rp.plot_report(report, png)
    print(rp.format_report(report))
    print(f"histogram: {png}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rp.report_json(report), indent=2) + "\n")
        print(f"report: {args.json}")
    if args.to_topic:
        _republish(args, bootstrap, topic, window, rescored)
    return 0


def _episodes(args: argparse.Namespace, t_from: int, t_to: int) -> int:
    """`--topic rl.episodes`: each group's turns in order, with the finished groups' last answers
    and rewards from rl.scored (steadyrl/replay/episodes.py). Exit 2 for an option that reads
    scored groups only, 1 when the topic cannot be read or the window holds no episode."""
    from confluent_kafka import KafkaException  # lazy: entry point (a command), keeps `steadyrl --help` fast

    from steadyrl.replay.episodes import format_episodes, read_episodes  # lazy: entry point (a command), as above

    for flag, given in (("--rescore", args.rescore), ("--to-topic", args.to_topic), ("--png", args.png)):
        if given:
            raise CliError(f"{flag} works on scored groups; rl.episodes holds episode states (give --topic "
                           "rl.scored)", 2)
    bootstrap = _bootstrap(args) or LOCAL_BOOTSTRAP
    _require_broker(bootstrap)
    topic = f"{args.prefix}{args.topic}"
    try:
        eps = read_episodes(bootstrap, topic, t_from, t_to, prompt_id=args.prompt,
                            scored_topic=f"{args.prefix}rl.scored", timeout_s=args.timeout)
    except (RuntimeError, KafkaException) as e:
        raise CliError(f"--topic {topic}: {e}", 1) from None
    print(format_episodes(eps))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(
            {pid: [{"partition": r.partition, "offset": r.offset, "timestamp_ms": r.timestamp_ms,
                    "state": r.state.model_dump(mode="json")} for r in states]
             for pid, states in eps.groups.items()}, indent=2) + "\n")
        print(f"episodes: {args.json}")
    if not eps.groups:
        print(f"no episode states on {topic} between {args.t_from} and {args.t_to}"
              + (f" for prompt {args.prompt}" if args.prompt else ""), file=sys.stderr)
        return 1
    return 0


def _time_range(args: argparse.Namespace) -> tuple[int, int]:
    """--from and --to as milliseconds since the epoch. Raises CliError (2): unreadable, or
    --from after --to."""
    from steadyrl import replay as rp  # lazy: entry point (a command), keeps `steadyrl --help` fast

    times = {}
    for flag, text in (("--from", args.t_from), ("--to", args.t_to)):
        try:
            times[flag] = rp.parse_time(text)
        except ValueError as e:
            raise CliError(f"{flag} {text!r}: {e}", 2) from None
    if times["--from"] > times["--to"]:
        raise CliError(f"--from {args.t_from!r} ({rp.format_ms(times['--from'])}) is after --to {args.t_to!r} "
                       f"({rp.format_ms(times['--to'])})", 2)
    return times["--from"], times["--to"]


def _rescorer(spec: str) -> Scorer:
    """The loaded scorer of --rescore `spec`. Raises CliError (2) when it cannot be built or loaded."""
    from steadyrl.model.scorers import build_scorer  # lazy: entry point (a command), keeps `steadyrl --help` fast

    try:
        scorer = build_scorer(spec)
        scorer.load()
    except (ValueError, OSError) as e:
        hint = (" (a module:function scorer must be importable here, as in the reward server: "
                "run from the folder that holds its package, or set PYTHONPATH)" if "No module named" in str(e)
                else "")
        raise CliError(f"--rescore {spec!r}: {e}{hint}", 2) from None
    return scorer


def _republish(args: argparse.Namespace, bootstrap: str, topic: str, window: Window,
               rescored: Rescored | None) -> None:
    """Write the window's groups (re-scored ones when `rescored`; a group not re-scored is left
    out) to --to-topic in one transaction. Raises CliError (1) when it aborted."""
    from confluent_kafka import KafkaException  # lazy: entry point (a command), keeps `steadyrl --help` fast

    from steadyrl import replay as rp  # lazy: entry point (a command), keeps `steadyrl --help` fast

    out_topic = f"{args.prefix}{args.to_topic}"
    if rescored is None:
        pairs = [(r.group, r) for r in window.records]
    else:
        pairs = [(g, r) for g, r in zip(rescored.groups, window.records, strict=True) if g is not None]
    try:
        created = rp.ensure_topic(bootstrap, out_topic)
        n = rp.republish(bootstrap, out_topic, [g for g, _ in pairs], [r for _, r in pairs], source_topic=topic)
    except KafkaException as e:
        raise CliError(f"--to-topic {out_topic}: nothing republished (transaction aborted): {e}", 1) from None
    left = len(window.records) - n
    print(f"republished {n} groups to {out_topic} ({created}) in one transaction"
          + (f"; {left} groups not rescored were left out" if left else ""))


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sp = sub.add_parser("replay", help="read a time range of a scored topic, optionally re-score it, and report "
                                       "the reward shift (KS, mean/std, largest changes) with a PNG; or read "
                                       "rl.episodes: each agent episode's turns in order")
    sp.add_argument("--topic", default="rl.scored", help="scored topic to read (prefix applied); rl.episodes: the "
                                                         "episodes' turns in order")
    sp.add_argument("--from", dest="t_from", required=True, metavar="T1",
                    help="window start, inclusive: ISO-8601 (UTC when no zone), unix seconds, -30m / -2h, now")
    sp.add_argument("--to", dest="t_to", default="now", metavar="T2", help="window end, inclusive (default now)")
    sp.add_argument("--rescore", metavar="SPEC", help="score the samples again with this scorer and compare: rule "
                                                      "name, module:function, rm:<dir>, embedding:all-minilm-l6-v2 "
                                                      "(without it: the window's first half vs its second half)")
    sp.add_argument("--to-topic", metavar="T", help="re-publish the (re-scored) groups to this topic (prefix "
                                                    "applied; created like rl.scored if missing), in one transaction")
    sp.add_argument("--prompt", metavar="PROMPT_ID", help="with --topic rl.episodes: only this group's episodes")
    sp.add_argument("--top", type=int, default=10, help="largest per-sample changes to list (with --rescore)")
    sp.add_argument("--png", help="histogram path (default .steadyrl/replay/<topic>_<from>_<to>.png)")
    sp.add_argument("--json", help="also write the report as JSON here")
    sp.add_argument("--timeout", type=float, default=60.0, help="seconds to read the window")
    add_common_options(sp)
    # `--from -30m`: argparse takes a value starting with '-' for an option unless it looks like
    # a negative number; here relative times look like one too (this parser has no such option).
    sp._negative_number_matcher = re.compile(r"^-\d+$|^-\d*\.\d+$|^-(?:\d+(?:\.\d+)?[smhdw])+$")
    sp.set_defaults(fn=cmd_replay)
