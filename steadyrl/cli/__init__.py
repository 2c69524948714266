"""`steadyrl`: the command line for people (`steadyrl --help` lists the commands).

One module per command or group (broker.py: broker, topics, schemas; up.py; ckpt.py; export.py;
logs.py; quarantine.py; replay.py; eval.py; score.py; status.py; completion.py), each with its `cmd_*`
functions and an `add_parsers(sub)` (completion's takes the whole parser too); common.py holds what
they share. What only one command needs (torch, transformers, confluent_kafka, the steadyrl
modules of that command) is imported inside it, marked `# lazy:`, so `--help` stays fast. A
command that cannot go on raises CliError; main() prints it as one `error: ...` line on stderr
and exits 2 (a bad argument) or 1 (anything else), with no traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

from steadyrl import __version__
from steadyrl.cli import broker, ckpt, completion, eval, export, logs, quarantine, replay, score, status, up

__all__ = ["BROKER_CHECK_S", "DEFAULT_STATE", "LOCAL_BOOTSTRAP", "SCALABLE", "SCALE_INPUT", "SERVICES",
           "SERVICE_PORTS", "CliError", "Progress", "_bootstrap", "_check_up_args", "_local_broker", "_parse_scale",
           "_readiness", "_require_broker", "build_parser", "cmd_broker", "cmd_ckpt", "cmd_eval", "cmd_export",
           "cmd_quarantine", "cmd_replay", "cmd_schemas", "cmd_score", "cmd_topics", "cmd_up", "main"]

# Re-exported: tests, bench/ and docs name these as steadyrl.cli.X.
from steadyrl.cli.broker import cmd_broker, cmd_schemas, cmd_topics
from steadyrl.cli.ckpt import cmd_ckpt
from steadyrl.cli.common import (
    BROKER_CHECK_S,
    DEFAULT_STATE,
    LOCAL_BOOTSTRAP,
    CliError,
    _bootstrap,
    _local_broker,
    _require_broker,
)
from steadyrl.cli.eval import cmd_eval
from steadyrl.cli.export import cmd_export
from steadyrl.cli.quarantine import cmd_quarantine
from steadyrl.cli.replay import cmd_replay
from steadyrl.cli.score import cmd_score
from steadyrl.cli.up import (
    SCALABLE,
    SCALE_INPUT,
    SERVICE_PORTS,
    SERVICES,
    Progress,
    _check_up_args,
    _parse_scale,
    _readiness,
    cmd_up,
)

#: The command modules, in the order `steadyrl --help` lists their commands.
COMMANDS = (broker, ckpt, export, logs, quarantine, replay, eval, score, status, up)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="steadyrl")
    p.add_argument("--version", action="version", version=f"steadyrl {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        module.add_parsers(sub)
    completion.add_parsers(sub, p)   # last: its script is written from the whole parser
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

