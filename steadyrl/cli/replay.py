"""`steadyrl replay`: reward shift over a time range of a scored topic (steadyrl.replay, docs/replay.md)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from steadyrl.cli.common import DEFAULT_STATE, LOCAL_BOOTSTRAP, _bootstrap, _require_broker, add_common_options


def cmd_replay(args: argparse.Namespace) -> int:
    """Read a time range of a scored topic, optionally re-score it, report the reward shift
    (steadyrl/replay.py). Exit 2 for a bad argument, 1 when the topic cannot be read or the
    window holds no scored group."""
    from steadyrl import replay as rp  # lazy: entry point (a command), keeps `steadyrl --help` fast

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
        from steadyrl.model.scorers import build_scorer  # lazy: entry point (a command), keeps `steadyrl --help` fast

        try:
            scorer = build_scorer(args.rescore)
            scorer.load()
        except (ValueError, OSError) as e:
            hint = (" (a module:function scorer must be importable here, as in the reward server: "
                    "run from the folder that holds its package, or set PYTHONPATH)" if "No module named" in str(e)
                    else "")
            print(f"error: --rescore {args.rescore!r}: {e}{hint}", file=sys.stderr)
            return 2
    from confluent_kafka import KafkaException  # lazy: entry point (a command), keeps `steadyrl --help` fast

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
        from steadyrl.model.scorers import ScorerError  # lazy: entry point (a command), keeps `steadyrl --help` fast

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
            pairs = [(g, r) for g, r in zip(rescored.groups, window.records, strict=True) if g is not None]
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


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    add_common_options(sp)
    # `--from -30m`: argparse takes a value starting with '-' for an option unless it looks like
    # a negative number; here relative times look like one too (this parser has no such option).
    sp._negative_number_matcher = re.compile(r"^-\d+$|^-\d*\.\d+$|^-(?:\d+(?:\.\d+)?[smhdw])+$")
    sp.set_defaults(fn=cmd_replay)
