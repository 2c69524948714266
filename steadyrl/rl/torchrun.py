"""`python -m steadyrl.rl.torchrun ARGS`: torchrun (`torch.distributed.run`), ending quietly
when it is stopped by a signal.

torchrun turns SIGTERM/SIGINT into a SignalException, stops its ranks (each rank 0 finishes
its step and checkpoint, the others wait for its "stop": services/learner/main.py) and then
lets the exception escape as a traceback, on every `up` Ctrl-C, `docker compose stop` and
pod deletion. Here that stop is one log line and exit status 0, as the one-rank learner's.

`--ranks-host ADDR` (first, consumed here; steadyrl.rl.distributed.torchrun_argv passes it):
every listening socket of the group is on ADDR (`distributed.bind_group_to`), not on every
interface as torchrun's own store is."""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main as torchrun

from steadyrl.rl.distributed import bind_group_to


def main() -> None:
    if sys.argv[1:2] == ["--ranks-host"]:
        bind_group_to(sys.argv[2])
        del sys.argv[1:3]
    try:
        torchrun()
    except SignalException as e:  # the ranks are already stopped (torchrun's own finally)
        print(f"torchrun: stopped by {e.sigval.name}; its ranks were stopped", file=sys.stderr, flush=True)  # noqa: T201
        sys.exit(0)


if __name__ == "__main__":
    main()
