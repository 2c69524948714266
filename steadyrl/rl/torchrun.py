"""`python -m steadyrl.rl.torchrun ARGS`: torchrun (`torch.distributed.run`), ending quietly
when it is stopped by a signal.

torchrun turns SIGTERM/SIGINT into a SignalException, stops its ranks (each rank 0 finishes
its step and checkpoint, the others wait for its "stop": services/learner/main.py) and then
lets the exception escape as a traceback, on every `up` Ctrl-C, `docker compose stop` and
pod deletion. Here that stop is one log line and exit status 0, as the one-rank learner's."""

from __future__ import annotations

import sys


def main() -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    try:
        torchrun()
    except SignalException as e:  # the ranks are already stopped (torchrun's own finally)
        print(f"torchrun: stopped by {e.sigval.name}; its ranks were stopped", file=sys.stderr, flush=True)  # noqa: T201
        sys.exit(0)


if __name__ == "__main__":
    main()
