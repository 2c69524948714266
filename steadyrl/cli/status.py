"""`steadyrl status`: where the run under a `steadyrl up` state dir stands, from its files (the
learner's state.json, history and checkpoints) and, while the learner answers, its /progress
(at the port `up` recorded in `<state-dir>/up.json`, unless --port-offset is given)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from steadyrl.cli.common import DEFAULT_STATE, CliError
from steadyrl.cli.up import learner_url
from steadyrl.run.runfolder import current


def cmd_status(args: argparse.Namespace) -> int:
    """Print the run's lines; exit 0. CliError (2) when the state dir holds no run."""
    from steadyrl.run import runview  # lazy: a command's own module, keeps `steadyrl --help` fast

    learner = Path(args.state_dir) / "learner"
    if current(learner) is None:
        raise CliError(f"no run under {learner} (has `steadyrl up` run with this --state-dir? pass the one "
                       f"up used: `steadyrl status --state-dir DIR`)", 2)
    live = runview.fetch_progress(learner_url(args.state_dir, args.port_offset))
    try:
        run = runview.read_run(args.state_dir, live)
    except FileNotFoundError:   # CURRENT names a run whose state.json is not written yet
        raise CliError(f"run {current(learner)} under {learner} has no state.json yet (starting?)", 2) from None
    except ValueError as e:
        raise CliError(f"run {current(learner)} under {learner}: unreadable state.json: {e}", 2) from None
    steps = f"{run.step}/{run.steps}" if run.steps is not None else str(run.step)
    state = "finished" if run.finished else (f"running ({run.phase})" if run.live else "not running")
    print(f"run {run.run_id}: step {steps}, {state}")
    if run.last is not None:
        last = run.last
        ago = time.time() - float(last.get("time", time.time()))
        print(f"last step: reward {last['reward_mean']:.3f}, {last['seconds']:.1f} s, {ago:.0f} s ago")
    print(f"last checkpoint: {run.checkpoint or 'none'}")
    counts = run.counts.line()
    print(f"in flight {run.in_flight}, held {run.held}; counts: {counts or 'none'}")
    print(f"folder {run.path}")
    return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sp = sub.add_parser("status", help="where the run of a `steadyrl up` state dir stands (step, last reward, "
                                       "checkpoint, counts)")
    sp.add_argument("--state-dir", default=str(DEFAULT_STATE), help="`steadyrl up`'s state dir (default .steadyrl)")
    sp.add_argument("--port-offset", type=int, default=None,
                    help="up's --port-offset, to ask the learner live (default: the one up recorded in "
                         "<state-dir>/up.json)")
    sp.set_defaults(fn=cmd_status)
