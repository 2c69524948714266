"""The learner over N torch.distributed ranks, data parallel (started by torchrun).

Kafka stays the source of truth: rank 0 is the whole learner service (consumer, feeder,
exactly-once accounting, checkpoints, policy announcements, HTTP probes). Ranks 1..N-1 hold a
replica of the model and optimizer and do only the math: before each update rank 0 sends them
the batch (`Leader.send`), every rank runs `Trainer.step` on it, and the trainer splits the
micro-batches over the ranks and sums their gradients so the step equals the one-rank step
(steadyrl/rl/trainer.py; tests/steadyrl/rl/test_distributed_step.py). Followers never talk to
Kafka.

Replicas, not shards: on CPU (gloo) FSDP2 is not used; every rank holds the full weights and
optimizer state, and rank 0 writes the checkpoint as a single rank does. So a checkpoint written
by N ranks resumes on M ranks unchanged (the weights rank 0 restores are sent to the others
before the first update: `sync`). The cost is N copies of the optimizer state.

A rank that dies takes the group down: torchrun stops the others and, with `--max-restarts`,
starts the group again; rank 0 resumes from its newest checkpoint as after any crash (nothing
lost or trained twice: the learner's delivery rules). Decisions are taken from all-reduced
numbers, so every rank takes the same one (clipping, skipping a non-finite step), and an
out-of-memory error on one rank puts every rank into the safe mode together (`Trainer._agreed`:
a flag all-reduced before each collective), so the micro-batch split stays the same on all.
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta

log = logging.getLogger(__name__)


def torchrun_argv(world_size: int, module: str, argv: list[str], max_restarts: int = 3) -> list[str]:
    """The command that runs `python -m module argv` as `world_size` ranks under torchrun
    (`torch.distributed.run --standalone`, through steadyrl.rl.torchrun so that a stop is not a
    traceback: one machine, a free rendezvous port), starting the
    group again up to `max_restarts` times when a rank dies (rank 0 resumes from its checkpoint).
    The learner execs it when `learner.world_size` > 1 and it is not a rank already (no RANK
    in the environment), so `steadyrl up`, compose and Kubernetes start the ranks alike."""
    return [sys.executable, "-m", "steadyrl.rl.torchrun", "--standalone", "--nproc-per-node", str(world_size),
            "--max-restarts", str(max_restarts), "-m", module, *argv]


def attempt_store(timeout_s: float):
    """The store this attempt of the group meets in: torchrun's own store (the agent's TCPStore
    at MASTER_ADDR:MASTER_PORT), under a prefix per restart (`TORCHELASTIC_RESTART_COUNT`).

    torchrun (torch 2.15, `--standalone`) hosts one TCPStore for the life of the agent and
    gives every restarted group the same one with no prefix of its own, so the keys each rank
    left there in the attempt before stay. A rank of the new group that comes up first reads
    the dead rank's gloo address under the same key and fails "connectFullMesh ... Connection
    refused"; every restart can lose the same race until `--max-restarts` is spent (pytorch
    issue 135712; tests/steadyrl/rl/test_distributed_restart.py makes it happen). One agent
    restarts all its ranks together, so they agree on the count.
    Returns None when the agent does not share its store (then env:// as usual)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"steadyrl/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def die_with_parent() -> None:
    """Have the kernel SIGKILL this rank when its parent, torchrun's agent, dies (Linux
    `prctl(PR_SET_PDEATHSIG)`; elsewhere nothing). torchrun starts each rank in a session of its
    own, so a SIGKILL of the agent (or of `steadyrl up`'s process group) left the ranks running
    without it: rank 0 kept the learner's consumer and transactional id, and ranks waiting in a
    collective waited forever. Exits at once if the parent is already gone."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL) != 0:  # 1: PR_SET_PDEATHSIG
        log.warning("could not tie this rank to torchrun's lifetime (prctl failed)")
        return
    if os.getppid() != parent:  # the agent died before prctl took effect
        os._exit(1)


def init_from_env(timeout_s: float = 600.0) -> tuple[int, int]:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT) over gloo,
    in this attempt's own key space (`attempt_store`). Gloo even where CUDA is present: the
    learner's tensors live on the CPU (it has no device setting yet), and NCCL only carries
    CUDA tensors. The rank dies with torchrun (`die_with_parent`). Returns (rank, world size);
    (0, 1) when not started by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    import torch.distributed as dist

    die_with_parent()
    if not dist.is_initialized():  # store None: env:// as usual
        dist.init_process_group("gloo", store=attempt_store(timeout_s), rank=int(os.environ["RANK"]),
                                world_size=world, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def broken_group(e: RuntimeError) -> str | None:
    """The first line of `e` when it is the group breaking (a gloo error: a peer rank died or
    closed), so it can be logged as one line; None for any other error (keep its traceback)."""
    text = str(e)
    return text.splitlines()[0] if "gloo" in text.lower() else None


def _broadcast(obj=None):
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Leader:
    """Rank 0's side of the group: sends the followers what they need before each update."""

    def __init__(self, world: int):
        self.world = world
        self.synced = False

    def send(self, trainer, groups: list) -> None:
        """Before `trainer.step(groups)` on rank 0: the weights, optimizer and schedule first
        (once: after rank 0 restored them), then the batch."""
        if not self.synced:
            _broadcast(("sync", {"model": trainer.model.state_dict(), "opt": trainer.opt.state_dict(),
                                 "sched": trainer.sched.state_dict(), "global_step": trainer.global_step}))
            self.synced = True
        _broadcast(("step", groups))

    def stop(self) -> None:
        """Tell the followers the run is over (they return from `follow`)."""
        _broadcast(("stop", None))


def follow(trainer) -> int:
    """A follower rank's loop: take rank 0's state, then step on each batch it sends, until
    it says stop. Returns 0. A non-finite step is skipped on every rank alike (NonFiniteStep)."""
    from steadyrl.rl.trainer import NonFiniteStep

    steps = 0
    while True:
        kind, payload = _broadcast()
        if kind == "stop":
            log.info("follower stopped", extra={"steps": steps})
            return 0
        if kind == "sync":
            trainer.model.load_state_dict(payload["model"])
            trainer.opt.load_state_dict(payload["opt"])
            trainer.sched.load_state_dict(payload["sched"])
            trainer.global_step = payload["global_step"]
            continue
        try:
            trainer.step(payload)
        except NonFiniteStep:
            pass  # rank 0 took the same decision from the same all-reduced numbers
        steps += 1
