"""The learner over N torch.distributed ranks, data parallel (started by torchrun).

Kafka stays the source of truth: rank 0 is the whole learner service (consumer, feeder,
exactly-once accounting, checkpoints, policy announcements, HTTP probes). Ranks 1..N-1 hold the
model and optimizer (whole or sharded) and do only the math: before each update rank 0 sends them
the batch (`Leader.step`), every rank runs `Trainer.step` on it, and the trainer splits the
micro-batches over the ranks and sums their gradients so the step equals the one-rank step
(steadyrl/rl/trainer.py; tests/steadyrl/rl/test_distributed_step.py). Followers never talk to
Kafka.

Two ways to hold the state (`train.sharding`). replicate: every rank holds the whole weights and
optimizer state and rank 0 writes the checkpoint as a single rank does. fsdp: FSDP2 (`shard`)
shards the trained parameters, gradients and AdamW moments; every rank keeps a plain copy of
the whole weights, gathered after each step (`gather_into`), for the policy store, evaluation
and drift; checkpoints are sharded, each rank writing its shards (steadyrl.run.checkpoint
ShardWriter, on rank 0's `Leader.save`). Either way rank 0 restores any checkpoint whole and
`sync` hands it to every rank before the first update, so a checkpoint written by N ranks
resumes on M ranks.

A rank that dies takes the group down: torchrun stops the others and, with `--max-restarts`,
starts the group again; rank 0 resumes from its newest checkpoint as after any crash (nothing
lost or trained twice: the learner's delivery rules). Decisions are taken from all-reduced
numbers, so every rank takes the same one (clipping, skipping a non-finite step), and an
out-of-memory error on one rank puts every rank into the safe mode together: replicated
(`Trainer._agree`) by a flag all-reduced before each collective, so the micro-batch split stays
the same on all; sharded, through a restart of the group (`remember_safe_mode`).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import signal
import socket
import struct
import sys
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined, unused-ignore]  # --strict: not re-exported
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import PrefixStore, Store
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from steadyrl.rl.batch import Group
from steadyrl.rl.errors import NonFiniteStep

log = logging.getLogger(__name__)


#: The address the rank group listens on (torchrun's store, gloo's and NCCL's sockets):
#: `STEADYRL_RANKS_HOST`, else loopback. All ranks on one host (what `torchrun_argv` starts)
#: need nothing else; an address other hosts reach must be firewalled to the learner's hosts
#: (docs/deploy.md, "The learner's rank group").
RANKS_HOST_ENV = "STEADYRL_RANKS_HOST"
LOOPBACK = "127.0.0.1"


def ranks_host() -> str:
    """The address the rank group binds: `STEADYRL_RANKS_HOST`, else 127.0.0.1 (IPv4 only)."""
    return os.environ.get(RANKS_HOST_ENV) or LOOPBACK


def torchrun_argv(world_size: int, module: str, argv: list[str], max_restarts: int = 3,
                  host: str | None = None) -> list[str]:
    """The command that runs `python -m module argv` as `world_size` ranks under torchrun on this
    one machine (`torch.distributed.run`, through steadyrl.rl.torchrun so that a stop is not a
    traceback and the group listens on `host` only), starting the group again up to
    `max_restarts` times when a rank dies (rank 0 resumes from its checkpoint).

    `host` (default `ranks_host()`, 127.0.0.1) is the one address of every listening socket of
    the group: the agent's rendezvous store (a c10d store on a free port; torchrun's
    `--standalone` listened on every interface, unauthenticated), the ranks' MASTER_ADDR
    (`--local-addr`) and gloo's and NCCL's sockets (steadyrl.rl.torchrun sets their interface).
    The learner execs it when `learner.world_size` > 1 and it is not a rank already (no RANK
    in the environment), so `steadyrl up`, compose and Kubernetes start the ranks alike."""
    host = host or ranks_host()
    return [sys.executable, "-m", "steadyrl.rl.torchrun", "--ranks-host", host, "--nnodes", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:0", "--local-addr", host,
            "--nproc-per-node", str(world_size), "--max-restarts", str(max_restarts), "-m", module, *argv]


_LISTENERS: list[socket.socket] = []   # the sockets the stores `listening_store` made listen on (kept open)


def listening_store(host: str, port: int, **kw: Any) -> TCPStore:
    """A TCPStore server that listens on `host`:`port` only (0: a free port). torch's TCPStore
    listens on every interface whatever host it is given (`::`, seen in /proc/net/tcp6), so the
    socket is bound here and handed over (`master_listen_fd`, libuv backend). `kw`: TCPStore's
    other arguments (timeout, multi_tenant, ...). Raises OSError when `host`:`port` cannot be
    bound."""
    kw.pop("use_libuv", None)
    kw.pop("is_master", None)
    sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    _LISTENERS.append(sock)
    return TCPStore(host, sock.getsockname()[1], is_master=True, master_listen_fd=sock.fileno(),
                    use_libuv=True, **kw)


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds the IPv4 `address` (its first address,
    SIOCGIFADDR), "lo" for 127.0.0.1 on Linux; None when no interface holds it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def bind_group_to(host: str) -> None:
    """In torchrun's agent, before it starts: every listening socket of the rank group on `host`.
    The c10d rendezvous store (and the shared store a dynamic rendezvous may make) listen on
    `host` only (`listening_store`), and the ranks' gloo and NCCL sockets use the interface
    that holds it (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME; one already set is kept, and none is
    set when no interface holds `host`, with a warning). The ranks inherit the environment."""
    client = c10d.TCPStore  # type: ignore[attr-defined, unused-ignore]  # --strict: not re-exported

    def store(host_name: str, port: int, *args: Any, is_master: bool = False, **kw: Any) -> TCPStore:
        if is_master:
            return listening_store(host, port, **kw)
        made: TCPStore = client(host_name, port, *args, **kw)   # is_master False
        return made

    setattr(c10d, "TCPStore", store)   # the name c10d's _create_tcp_store calls  # noqa: B010
    dyn.DynamicRendezvousHandler._create_tcp_store_server = (   # type: ignore[method-assign]
        lambda self, master_addr, master_port: listening_store(host, master_port, multi_tenant=True))
    iface = interface_of(host)
    if iface is None:
        log.warning("no network interface holds the ranks' address; gloo picks its own",
                    extra={"host": host})
        return
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(var, iface)


def attempt_store(timeout_s: float) -> Store | None:
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
    store = _agent_store(timeout_s)
    if store is None:
        return None
    return PrefixStore(f"steadyrl/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _agent_store(timeout_s: float = 30.0) -> TCPStore | None:
    """A client of torchrun's own store (the agent's TCPStore at MASTER_ADDR:MASTER_PORT), or
    None when the agent does not share it (not under torchrun)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                    timeout=timedelta(seconds=timeout_s))


SAFE_MODE_KEY = "steadyrl/safe_mode"  # in torchrun's store, outside every attempt's prefix


def remember_safe_mode(error: str) -> None:
    """Record in torchrun's store, for the attempts of the group after this one, that a rank ran
    out of memory (a sharded trainer: its peers wait in a collective of the failed forward, so
    the fallback cannot be agreed within the step; this rank then dies and torchrun restarts the
    group). Nothing when not under torchrun."""
    store = _agent_store()
    if store is not None:
        store.set(SAFE_MODE_KEY, error[:300])


def remembered_safe_mode() -> str | None:
    """The out-of-memory error an earlier attempt of this group recorded (`remember_safe_mode`),
    or None. Every rank of a restarted group reads the same answer, so all start in the safe mode."""
    store = _agent_store()
    if store is None or not store.check([SAFE_MODE_KEY]):
        return None
    return store.get(SAFE_MODE_KEY).decode()


def die_with_parent() -> None:
    """Have the kernel SIGKILL this rank when its parent, torchrun's agent, dies (Linux
    `prctl(PR_SET_PDEATHSIG)`; elsewhere nothing). torchrun starts each rank in a session of its
    own, so a SIGKILL of the agent (or of `steadyrl up`'s process group) left the ranks running
    without it: rank 0 kept the learner's consumer and transactional id, and ranks waiting in a
    collective waited forever. Exits at once if the parent is already gone."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL) != 0:  # 1: PR_SET_PDEATHSIG
        log.warning("could not tie this rank to torchrun's lifetime (prctl failed)")
        return
    if os.getppid() != parent:  # the agent died before prctl took effect
        os._exit(1)


GROUP_TIMEOUT_S = 6 * 3600.0
"""How long a rank waits in one collective. Followers wait in a broadcast for rank 0's next
message for as long as rank 0 waits for rollouts or evaluates (minutes on a real model): gloo's
10 minutes broke the group there. A peer that dies is seen at once (its sockets close)."""


def train_device(device: str) -> torch.device:
    """The torch.device of TrainConfig.device: "cpu", or "cuda" as cuda:LOCAL_RANK (torchrun's
    local rank; 0 alone). Raises ValueError naming `learner.train.device` when no GPU is
    visible, or fewer than LOCAL_RANK + 1."""
    if device == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if not torch.cuda.is_available() or torch.cuda.device_count() <= local:
        raise ValueError(f"learner.train.device is cuda, but this process sees {torch.cuda.device_count()} GPUs "
                         f"(local rank {local}): set it to cpu, or give each rank a GPU")
    return torch.device("cuda", local)


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the torch.distributed group, (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def microbatch_plan(rows: int, micro: int, rank: int, world: int, sharded: bool) -> list[int | None]:
    """The micro-batches of a minibatch of `rows` rows this rank runs: the start row of each
    (micro-batch i of size `micro` on rank i % world). Sharded, FSDP2's forward and backward
    are collectives, so every rank runs as many as the rank with the most: a rank with one
    fewer runs first an idle one (None: a zero-weighted copy of the first micro-batch,
    `Trainer._idle_backward`, whose gradient adds exactly 0).

    >>> microbatch_plan(5, 2, 1, 2, sharded=True)    # starts 0, 2, 4: rank 0 runs 0 and 4
    [None, 2]
    """
    starts = list(range(0, rows, micro))
    plan: list[int | None] = list(starts[rank::world])
    if sharded and len(plan) < -(-len(starts) // world):
        plan.insert(0, None)
    return plan


def init_from_env(timeout_s: float = GROUP_TIMEOUT_S, device: str = "cpu") -> tuple[int, int]:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT), in this
    attempt's own key space (`attempt_store`). `device` is the trainer's (TrainConfig.device):
    "cpu": gloo, also where CUDA is present (NCCL only carries CUDA tensors); "cuda": this rank
    takes GPU LOCAL_RANK, and the group is "cpu:gloo,cuda:nccl" (the CUDA tensors of the
    training collectives over NCCL; rank 0's messages, the weights it broadcasts from its CPU
    copy and the checkpoint group over gloo). The rank dies with torchrun (`die_with_parent`).
    Returns (rank, world size); (0, 1) when not started by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    die_with_parent()
    backend = "gloo"
    if device == "cuda":
        torch.cuda.set_device(train_device(device))   # ValueError naming the setting when this rank has no GPU
        backend = "cpu:gloo,cuda:nccl"
    if not dist.is_initialized():  # store None: env:// as usual
        dist.init_process_group(backend, store=attempt_store(timeout_s), rank=int(os.environ["RANK"]),
                                world_size=world, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


#: The longest a rank waits for its peers before it leaves the group (a peer that died never comes).
LEAVE_TIMEOUT_S = 10.0


def leave() -> None:
    """Leave the process group before this rank exits (`destroy_process_group`; nothing when
    none was joined). A rank that exited with its gloo group still up could abort at interpreter
    exit once a peer had gone ("terminate called without an active exception", SIGABRT: exit
    -6), and torchrun then counted the finished group as failed: the CI failure of
    tests/steadyrl/rl/test_distributed_restart.py's out-of-memory test, whose ranks had both
    stepped. A group that broke (a peer died) is left too; an error doing so is logged, not
    raised.

    The ranks first meet at a barrier (gloo: `monitored_barrier`, at most LEAVE_TIMEOUT_S): a
    rank that tore its group down while a peer still finished its last collective made that
    peer fail ("Connection closed by peer") or abort, 1 run in 3 of the same test here."""
    if not dist.is_initialized():
        return
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=LEAVE_TIMEOUT_S))
        else:
            dist.barrier()
    except Exception as e:  # noqa: BLE001 - a peer gone: leave without it
        log.warning("ranks did not meet before leaving", extra={"error": f"{type(e).__name__}: {e}"[:300]})
    try:
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - the rank is exiting either way
        log.warning("could not leave the process group", extra={"error": f"{type(e).__name__}: {e}"})


def broken_group(e: RuntimeError) -> str | None:
    """The first line of `e` when it is the group breaking (a gloo error: a peer rank died or
    closed), so it can be logged as one line; None for any other error (keep its traceback)."""
    text = str(e)
    return text.splitlines()[0] if "gloo" in text.lower() else None


def _broadcast(obj: object = None) -> Any:
    """Rank 0's `obj` on every rank (a collective; pickled: what comes back is whatever rank 0 sent)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shard(module: torch.nn.Module, reshard_after_forward: bool = False) -> torch.nn.Module:
    """Shard `module` in place over the group with FSDP2 (`torch.distributed.fsdp.fully_shard`):
    each transformer block (`module.model.layers[i]`, where it has them) its own unit, then the
    rest (embeddings, final norm, head) at the root. The gradient reduce-scatter sums instead of
    averaging (divide factor 1): the trainer weighs every micro-batch by its share of the whole
    minibatch, so the sum over ranks is the one-rank gradient. A block's parameters stay gathered
    from its forward to its backward (`reshard_after_forward=False`: ZeRO-2's trade, speed for the
    whole weights held during a micro-batch; the trainer keeps them gathered over a minibatch's
    micro-batches too, `Trainer._accumulate`). Parameters become DTensors sharded on dim 0
    (`Shard(0)`) over the group's mesh of the device `module` is on (`mesh`). Returns `module`."""
    mesh = device_mesh(next(module.parameters()).device.type)
    for block in getattr(getattr(module, "model", None), "layers", None) or []:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)   # False: the backward reuses it
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)   # gloo has no PREMUL_SUM
    return module


_MESHES: dict[tuple[int, str], DeviceMesh] = {}   # (id of the default group, device type) -> mesh


def device_mesh(device_type: str = "cpu") -> DeviceMesh:
    """The 1-D device mesh of `device_type` ("cpu", "cuda") over the group (one of each per
    default group). Named, not FSDP2's default: that is a CUDA mesh wherever a GPU is visible,
    also when the trainer's tensors and gloo group are on the CPU."""
    key = (id(dist.group.WORLD), device_type)
    if key not in _MESHES:
        for old in [k for k in _MESHES if k[0] != key[0]]:   # meshes of an ended group
            del _MESHES[old]
        _MESHES[key] = init_device_mesh(device_type, (dist.get_world_size(),))
    return _MESHES[key]


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of `t`: of a DTensor on a GPU mesh, this rank's shard as a DTensor over the
    group's CPU mesh (same placements), which torch.distributed.checkpoint writes as it writes
    the CPU trainer's shards."""
    if isinstance(t, DTensor) and t.device_mesh.device_type != "cpu":
        local = t.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(local, device_mesh("cpu"), t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    return t.detach().to("cpu", copy=True)


def _place(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` (the whole tensor, the same on every rank) laid out as `like`: this rank's shard
    when `like` is a DTensor (on its mesh's device), else `full` itself."""
    if isinstance(like, DTensor) and tuple(full.shape) == tuple(like.shape):
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)   # no scatter again
    return full


def gather_into(module: torch.nn.Module, whole: torch.nn.Module) -> None:
    """Copy the whole parameters of `module` (sharded, FSDP2: an all-gather per parameter, every
    rank; or a plain copy on another device) into the plain module `whole` of the same
    architecture (parameter order as deepcopy keeps it)."""
    with torch.no_grad():
        for src, dst in zip(module.parameters(), whole.parameters(), strict=True):
            dst.copy_(src.full_tensor() if isinstance(src, DTensor) else src)


def place_into(whole: torch.nn.Module, module: torch.nn.Module) -> None:
    """The inverse of `gather_into`, with no collective: copy the plain module `whole`'s
    parameters into `module` (each rank keeps its shard of a DTensor, on its device)."""
    with torch.no_grad():
        for src, dst in zip(whole.parameters(), module.parameters(), strict=True):
            dst.copy_(_place(src.data, dst))


class SyncedTrainer(Protocol):
    """What the group's messages use of a trainer (steadyrl.rl.trainer.Trainer, which imports
    this module): its weights, optimizer, schedule and step, and its `step`."""

    global_step: int
    pending_optimizer: dict[str, Any] | None   # rank 0, sharded: a restored state to scatter

    @property
    def model(self) -> torch.nn.Module: ...
    @property
    def value_head(self) -> torch.nn.Module | None: ...
    @property
    def sharded(self) -> bool: ...
    @property
    def params(self) -> Sequence[torch.Tensor]: ...
    @property
    def opt(self) -> torch.optim.Optimizer: ...
    @property
    def sched(self) -> torch.optim.lr_scheduler.LRScheduler: ...
    def push_weights(self) -> None: ...
    def step(self, groups: list[Group]) -> dict[str, float]: ...


class ShardSaver(Protocol):
    """A follower's writer of its shards of a checkpoint (steadyrl.run.ckpt_writer.ShardWriter)."""

    def save(self, tmp: str, trainer: Any) -> None: ...
    def wait(self) -> None: ...


def sync(trainer: SyncedTrainer) -> None:
    """Every rank takes rank 0's weights, optimizer state, LR schedule and global step (a
    collective; all ranks call it, rank 0 after it restored a checkpoint or a policy version
    into `trainer.model`). The weights are broadcast whole, then each rank keeps its shard when
    the trainer is sharded; the optimizer state is rank 0's whole, index-keyed state
    (`trainer.pending_optimizer` when sharded, else its optimizer's), placed like its parameter.
    So any checkpoint restores on any number of ranks: rank 0 reads it whole."""
    with torch.no_grad():
        _sync(trainer)


def _sync(trainer: SyncedTrainer) -> None:
    rank = dist.get_rank()
    for p in trainer.model.parameters():
        dist.broadcast(p.data, src=0)
    trainer.push_weights()   # into the shards, or the copy on the trainer's device
    head = trainer.value_head
    for p in head.parameters() if head is not None and not trainer.sharded else []:
        dist.broadcast(p.data, src=0)
    # the optimizer's layout first (small: no tensors), then each tensor by broadcast
    opt: dict[str, Any] | None = None
    layout: dict[str, Any] | None = None
    if rank == 0:  # sharded without a restored state: rank 0's param groups (lr) all the same
        opt = ((trainer.pending_optimizer or {"state": {}, "param_groups": trainer.opt.state_dict()["param_groups"]})
               if trainer.sharded else trainer.opt.state_dict())
        layout = {"sched": trainer.sched.state_dict(), "global_step": trainer.global_step,
                  "opt": {"param_groups": opt["param_groups"],
                          "state": {i: {k: (("tensor", (tuple(v.shape), str(v.dtype).removeprefix("torch.")))
                                            if isinstance(v, torch.Tensor) else ("value", v))
                                        for k, v in per.items()} for i, per in opt["state"].items()}}}
    layout = _broadcast(layout)
    trainer.sched.load_state_dict(layout["sched"])
    trainer.global_step = layout["global_step"]
    trainer.pending_optimizer = None
    state: dict[int, dict[str, Any]] = {}   # parameter index -> its optimizer state
    for i, per in layout["opt"]["state"].items():
        state[i] = {}
        for k, (kind, v) in per.items():
            if kind == "value":
                state[i][k] = v
                continue
            if rank == 0:
                assert opt is not None   # the layout came from it
                t = opt["state"][i][k].detach().to("cpu").contiguous()
            else:
                t = torch.empty(v[0], dtype=getattr(torch, v[1]))
            dist.broadcast(t, src=0)
            state[i][k] = _place(t, trainer.params[i])
    trainer.opt.load_state_dict({"state": state, "param_groups": layout["opt"]["param_groups"]})


class Leader:
    """Rank 0's side of the group: tells the followers what to run with it (each a collective)."""

    def __init__(self, world: int):
        self.world = world
        self.synced = False
        # a step was sent and rank 0 has not come back from it: the followers may be inside its
        # collectives, so no other message may follow (`stop` would meet them there)
        self.in_step = False

    def _sync(self, trainer: SyncedTrainer) -> None:
        """The weights, optimizer and schedule rank 0 restored, to every rank (once)."""
        if not self.synced:
            _broadcast(("sync", None))
            sync(trainer)
            self.synced = True

    def step(self, trainer: SyncedTrainer, groups: list[Group]) -> dict[str, float]:
        """`trainer.step(groups)` on every rank: the restored state first (`sync`, once), then
        the batch to the followers, then rank 0's own step. Returns rank 0's metrics; raises
        what the step raises (NonFiniteStep: every rank skipped it alike)."""
        self._sync(trainer)
        _broadcast(("step", groups))
        self.in_step = True
        try:
            metrics = trainer.step(groups)
        except NonFiniteStep:
            self.in_step = False
            raise
        self.in_step = False
        return metrics

    def save(self, trainer: SyncedTrainer, tmp: str) -> None:
        """Before rank 0's sharded checkpoint save: every rank writes its shards into `tmp`. The
        restored state reaches the shards first: a save before the first step (a stop while
        waiting for rollouts) wrote the shards' initial weights under the restored step."""
        self._sync(trainer)
        _broadcast(("save", tmp))

    def stop(self) -> None:
        """Tell the followers the run is over (they return from `follow`). Not after a step
        that raised on rank 0 (`in_step`): the followers are inside its collectives, and torchrun
        ends them when rank 0 exits."""
        if self.in_step:
            log.warning("not telling the other ranks to stop: the step they are in did not end on rank 0")
            return
        _broadcast(("stop", None))


def follow(trainer: SyncedTrainer, saver: ShardSaver | None = None) -> int:
    """A follower rank's loop: take rank 0's state, then step on each batch it sends (and, when
    sharded, write its shards of each checkpoint with `saver`, a steadyrl.run.checkpoint
    ShardWriter), until it says stop. Returns 0. A non-finite step is skipped on every rank
    alike (NonFiniteStep)."""
    steps = 0
    try:
        while True:
            kind, payload = _broadcast()
            if kind == "stop":
                log.info("follower stopped", extra={"steps": steps})
                return 0
            if kind == "sync":
                sync(trainer)
            elif kind == "save":
                assert saver is not None, "a sharded checkpoint needs the follower's ShardWriter"
                saver.save(payload, trainer)
            else:
                with contextlib.suppress(NonFiniteStep):  # rank 0 took the same decision from the same numbers
                    trainer.step(payload)
                steps += 1
    finally:
        if saver is not None:
            saver.wait()
