"""Placement: how the machine is shared between the stack's services (the `placement:` section).

For each service: its intra-op threads (torch/OpenMP/MKL), its CPU set (Linux CPU list, e.g.
`0-3,6`) and, on GPU machines, its devices (`CUDA_VISIBLE_DEVICES`). `steadyrl up` applies them
to each child (environment and CPU affinity, set before the child's interpreter starts); compose
and Kubernetes get the same from their resources (docs/deploy.md). Every service logs and
exports what it got (`steadyrl_placement_threads`; its CPUs are `steadyrl_host_cpu_cores`).

Why: every torch process starts one intra-op thread per core. Five of them on two cores spin
against each other (OpenMP threads busy-wait), and the async pipeline, which runs the actor and
the learner at once, was 3.3x slower than with one thread each (docs/benchmarks.md).

The default (`default_placement`) is computed from the machine and the staleness:
- max_staleness 0: the actor and the learner take turns (the actor waits for each new
  version), so each may use every core: no limit is set (torch's own default, which keeps the
  learner's arithmetic identical to the in-process loop's).
- max_staleness >= 1: they run at once, so the cores are split: the learner gets ceil(n/2),
  the actor the rest (at least 1 each), on disjoint CPU sets when there are >= 2 CPUs.
- the learner on N ranks (`learner.world_size`, torchrun): its `threads` are per rank (torchrun
  passes OMP_NUM_THREADS to each), so its cores are divided between the ranks, and in async its
  share is a whole number of cores per rank, at least one each where the machine can spare them
  (the actor keeps one; on 2 cores, 2 ranks share the learner's one core).
- rollout, reward and the reward server wait on HTTP and Kafka: 1 thread each, any CPU.
- GPUs: one GPU is shared; with >= 2 the actor gets the first and the learner the others.
An explicit entry in `placement:` replaces the default of that field for that service.
"""

from __future__ import annotations

import logging
import math
import os
import sys

from prometheus_client import Gauge
from pydantic import BaseModel, ConfigDict, Field, field_validator

log = logging.getLogger(__name__)

THREADS = Gauge("steadyrl_placement_threads", "Intra-op threads of this process (0: not set, the library default)")

SERVICES = ("actor", "rollout", "reward", "reward_server", "learner")
#: Services that mostly wait on HTTP and Kafka: one intra-op thread is plenty.
LIGHT = ("rollout", "reward", "reward_server")
#: The environment variables that set a process's intra-op threads (torch reads OMP at import).
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def parse_cpus(text: str) -> frozenset[int]:
    """A Linux CPU list (`0-3,6`) as a set of CPU numbers. Raises ValueError if malformed or empty."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"not a CPU list: {text!r} (e.g. '0-3,6')")
        a, b = int(lo), int(hi or lo)
        if b < a:
            raise ValueError(f"not a CPU list: {text!r} ({part}: end before start)")
        cpus.update(range(a, b + 1))
    if not cpus:
        raise ValueError(f"empty CPU list {text!r}")
    return frozenset(cpus)


def format_cpus(cpus: frozenset[int] | set[int]) -> str:
    """The shortest Linux CPU list of `cpus` ({0, 1, 2, 5} -> `0-2,5`)."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


class ServicePlacement(BaseModel):
    """One service's share. None: not limited (all threads, any CPU, every device)."""

    model_config = ConfigDict(extra="forbid")

    threads: int | None = Field(None, ge=1, le=1024, description="Intra-op threads (OMP/MKL_NUM_THREADS).")
    cpus: str | None = Field(None, description="CPU list the process may run on, e.g. '0-3,6'.")
    devices: str | None = Field(None, description="CUDA_VISIBLE_DEVICES, e.g. '0' or '1,2'.")

    @field_validator("cpus")
    @classmethod
    def _cpu_list(cls, v: str | None) -> str | None:
        return None if v is None else format_cpus(parse_cpus(v))


class Placement(BaseModel):
    """The `placement:` section: one entry per service; a missing field takes the default."""

    model_config = ConfigDict(extra="forbid")

    actor: ServicePlacement = Field(default_factory=ServicePlacement)
    rollout: ServicePlacement = Field(default_factory=ServicePlacement)
    reward: ServicePlacement = Field(default_factory=ServicePlacement)
    reward_server: ServicePlacement = Field(default_factory=ServicePlacement)
    learner: ServicePlacement = Field(default_factory=ServicePlacement)


def available_cpus() -> frozenset[int]:
    """The CPUs this process may run on (its affinity; all online CPUs where there is none)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return frozenset(range(os.cpu_count() or 1))


def default_placement(cpus: frozenset[int], max_staleness: int, gpus: int = 0,
                      learner_ranks: int = 1) -> dict[str, ServicePlacement]:
    """The default share of each service (module doc) on `cpus` with `gpus` GPUs and the learner
    on `learner_ranks` torch.distributed ranks (the learner's `threads` are per rank)."""
    order = sorted(cpus)
    n = len(order)
    ranks = max(1, learner_ranks)
    out = {svc: ServicePlacement(threads=1) for svc in LIGHT}
    if max_staleness == 0 or n < 2:
        if max_staleness == 0:  # turns: each may use every core; the learner's split between its ranks
            out["learner"] = ServicePlacement(threads=None if ranks == 1 else max(1, n // ranks))
            out["actor"] = ServicePlacement(threads=None)
        else:
            out["learner"] = ServicePlacement(threads=1)
            out["actor"] = ServicePlacement(threads=1)
    else:
        per_rank = max(1, math.ceil(n / 2) // ranks)
        k = min(per_rank * ranks, n - 1)  # whole cores for each rank; the actor keeps at least one
        out["learner"] = ServicePlacement(threads=per_rank, cpus=format_cpus(set(order[:k])))
        out["actor"] = ServicePlacement(threads=n - k, cpus=format_cpus(set(order[k:])))
    if gpus >= 2:
        out["actor"] = out["actor"].model_copy(update={"devices": "0"})
        out["learner"] = out["learner"].model_copy(update={"devices": ",".join(str(i) for i in range(1, gpus))})
    return out


def resolve(explicit: Placement, cpus: frozenset[int], max_staleness: int,
            gpus: int = 0, learner_ranks: int = 1) -> dict[str, ServicePlacement]:
    """Each service's placement: the default, with every field `explicit` sets replacing it.

    Raises ValueError when a CPU list names a CPU outside `cpus` (the process could not run)."""
    default = default_placement(cpus, max_staleness, gpus, learner_ranks)
    out = {}
    for svc in SERVICES:
        given = getattr(explicit, svc)
        p = default[svc].model_copy(update=given.model_dump(exclude_unset=True))
        if p.cpus is not None and not parse_cpus(p.cpus) <= cpus:
            raise ValueError(f"placement.{svc}.cpus {p.cpus} is not within this machine's CPUs {format_cpus(cpus)}")
        out[svc] = p
    return out


def child_env(p: ServicePlacement) -> dict[str, str]:
    """The environment a child started with placement `p` gets (threads, devices)."""
    env = {var: str(p.threads) for var in THREAD_VARS} if p.threads is not None else {}
    if p.devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = p.devices
    return env


def cpu_set(p: ServicePlacement) -> frozenset[int] | None:
    """`p.cpus` as a set (the child's affinity, set before exec so all its threads inherit it);
    None: any CPU."""
    return parse_cpus(p.cpus) if p.cpus is not None else None


def report(service: str) -> dict[str, object]:
    """What this process got: intra-op threads (torch's, if torch is loaded, else the
    environment's), CPUs and devices; logged, and the threads exported as
    steadyrl_placement_threads (the CPUs are steadyrl_host_cpu_cores, steadyrl/local/hardware.py).
    Returns the same as a dict."""
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    cpus = available_cpus()
    got: dict[str, object] = {"threads": threads, "cpus": format_cpus(cpus),
                              "devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    THREADS.set(threads)
    log.info("placement", extra={"service": service, **got})
    return got
