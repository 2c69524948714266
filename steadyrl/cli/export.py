"""`steadyrl export RUN VERSION DIR`: a policy version of a learner run as a Hugging Face model
folder (steadyrl.run.export)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from steadyrl.cli.common import DEFAULT_STATE, CliError
from steadyrl.run.runfolder import RunDir, current, run_ids


def _run_dir(run: str, state_dir: str) -> Path:
    """RUN as a folder: a run's (holding state.json), a learner state dir (the run its CURRENT
    names), or a run id under `<state_dir>/learner/` (`steadyrl up`'s layout)."""
    p = Path(run)
    if (p / "state.json").is_file():
        return p
    if p.is_dir() and current(p):
        return RunDir(p).path
    learner = Path(state_dir) / "learner"
    if "/" not in run and (learner / run / "state.json").is_file():
        return learner / run
    if p.is_dir():
        raise CliError(f"{run}: not a learner run (no state.json) nor a learner state dir (no CURRENT)")
    known = run_ids(learner)
    raise CliError(f"{run}: no such run folder, nor a run id under {learner} "
                   f"({'runs there: ' + ', '.join(known[-5:]) if known else 'no runs there'})")


def _version(text: str) -> int | str:
    if text == "latest" or (text.isdigit() and text.isascii()):
        return text if text == "latest" else int(text)
    raise CliError(f"version {text!r}: expected an int >= 0 or 'latest'", code=2)


def cmd_export(args: argparse.Namespace) -> int:
    """Write the version, then one line: what, from where, how it was checked, which files."""
    version = _version(args.version)
    run_dir = _run_dir(args.run, args.state_dir)
    from transformers.utils import logging as hf_logging  # lazy: heavy (transformers), entry point (a command)

    from steadyrl.run.export import MARKER, ExportError, export_version  # lazy: heavy (torch), entry point (a command)

    # one line of output, not a bar per shard
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # transformers: untyped
    try:
        out = export_version(run_dir, version, args.dir, policy_root=args.policy_root, model=args.model,
                             force=args.force, max_shard_size=args.max_shard_size)
    except ExportError as e:
        raise CliError(str(e)) from None
    m = json.loads((out / MARKER).read_text())
    size = sum((out / f).stat().st_size for f in m["files"])
    print(f"exported version {m['version']} of run {m['run_id']} ({m['model']}, {m['dtype']}) to {out}: "
          f"{', '.join(m['files'])} ({size / 1e6:.1f} MB); checked: {m['checked']}")
    return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sp = sub.add_parser("export", help="a policy version of a run as a Hugging Face model folder (vLLM, transformers)")
    sp.add_argument("run", help="run folder (<state-dir>/learner/<run_id>), a learner state dir (its CURRENT run), "
                                "or a run id under <state-dir>/learner")
    sp.add_argument("version", help="policy version: an int (0: the base weights) or latest")
    sp.add_argument("dir", help="folder to write (must not exist or be empty, unless --force)")
    sp.add_argument("--state-dir", default=str(DEFAULT_STATE), help="`steadyrl up`'s state dir, where a run id is "
                                                                   "looked up (default .steadyrl)")
    sp.add_argument("--policy-root", help="the learner's policy_root (default: policies/ beside the run's learner/)")
    sp.add_argument("--model", help="the base model (default: the one the run recorded)")
    sp.add_argument("--max-shard-size", default="5GB", help="past this the weights are sharded with an index")
    sp.add_argument("--force", action="store_true", help="replace a non-empty DIR")
    sp.set_defaults(fn=cmd_export)
