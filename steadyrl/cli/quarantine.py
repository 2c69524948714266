"""`steadyrl quarantine list|show|release|drop`: batches the reward watch held (steadyrl.run.quarantine)."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime

from steadyrl.cli.common import LOCAL_BOOTSTRAP, _bootstrap, _require_broker, add_common_options


def _fig(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def cmd_quarantine(args: argparse.Namespace) -> int:
    """list | show | release | drop batches on rl.quarantine (steadyrl/run/quarantine.py)."""
    from confluent_kafka import KafkaException  # lazy: entry point (a command), keeps `steadyrl --help` fast

    from steadyrl.run.quarantine import (  # lazy: entry point (a command), keeps `steadyrl --help` fast
        QuarantineError,
        decide,
        read_quarantine,
    )
    from steadyrl.wire.contracts import QuarantineAction  # lazy: entry point (a command), keeps `steadyrl --help` fast

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
        what = (f"{len(e.groups)} groups on {args.prefix}rl.releases, to be trained" if args.action == "release"
                else "it will not be trained")
        print(f"{'released' if args.action == 'release' else 'dropped'} {args.batch}: {what}")
        return 0
    _require_broker(bootstrap)
    try:
        entries = read_quarantine(bootstrap, args.prefix)
    except (RuntimeError, KafkaException) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if args.action == "list":
        if not entries:
            print(f"no quarantined batches on {args.prefix}rl.quarantine")
        for bid, e in entries.items():
            b = e.first
            when = datetime.fromtimestamp(b.quarantined_ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")
            rewards = [r for q in e.groups.values() for r in q.group.rewards]
            print(f"{bid}  {e.status:8s}  step {b.step}  {when}Z  rules {','.join(b.rules)}  "
                  f"groups {len(e.groups)}/{b.count}  reward mean {sum(rewards) / len(rewards):.3f}  "
                  f"var_ratio {_fig(b.var_ratio)}  extreme_share {_fig(b.extreme_share)}  ks_p {_fig(b.ks_pvalue)}")
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
        for smp, r in zip(g.group.samples, g.rewards, strict=True):
            print(f"  {r:8.3f}  {smp.text[:120]!r}")
    return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sp = sub.add_parser("quarantine", help="batches the learner's reward watch held on rl.quarantine: "
                                           "list, show one, release it to training or drop it")
    sp.add_argument("action", choices=["list", "show", "release", "drop"])
    sp.add_argument("batch", nargs="?", help="batch id (show, release, drop), as `list` prints it")
    sp.add_argument("--note", help="why (stored with the decision)")
    add_common_options(sp)
    sp.set_defaults(fn=cmd_quarantine)
