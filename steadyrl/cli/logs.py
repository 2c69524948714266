"""`steadyrl logs <instance>`: a service's whole output under `steadyrl up` (its JSON lines, as
log collectors read them), from `<state-dir>/logs/<instance>.log`."""

from __future__ import annotations

import argparse
import time
from collections import deque
from pathlib import Path

from steadyrl.cli.common import DEFAULT_STATE, CliError


def cmd_logs(args: argparse.Namespace) -> int:
    """Print the last `--lines` lines of the instance's log; with --follow, then each new line
    until Ctrl-C. CliError (2) for an instance without a log, naming those that have one."""
    folder = Path(args.state_dir) / "logs"
    path = folder / f"{args.instance}.log"
    if not path.is_file():
        known = sorted(p.stem for p in folder.glob("*.log")) if folder.is_dir() else []
        raise CliError(f"no log of {args.instance!r} in {folder}"
                       + (f": there are {', '.join(known)}" if known else " (has `steadyrl up` run with this "
                          "--state-dir?)"), 2)
    with open(path, errors="replace") as f:
        for line in deque(f, maxlen=args.lines):
            print(line, end="")
        while args.follow:
            line = f.readline()
            if line:
                print(line, end="", flush=True)
            else:
                time.sleep(0.5)
    return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sp = sub.add_parser("logs", help="a service's output under `steadyrl up` (learner-0, actor-0, reward-0, ...)")
    sp.add_argument("instance", help="the instance, as `up` prefixes its lines: learner-0, actor-0, rollout-0, ...")
    sp.add_argument("--state-dir", default=str(DEFAULT_STATE), help="`steadyrl up`'s state dir (default .steadyrl)")
    sp.add_argument("-n", "--lines", type=int, default=50, help="last lines to print (default 50)")
    sp.add_argument("-f", "--follow", action="store_true", help="then print new lines until Ctrl-C")
    sp.set_defaults(fn=cmd_logs)
