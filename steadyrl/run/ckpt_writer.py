"""Checkpoints written in the background: `AsyncCheckpointer` snapshots on the caller's thread
and writes (then verifies) in a thread at nice +10, one save in flight; `ShardWriter` writes
one rank's shards of a sharded checkpoint with torch.distributed.checkpoint."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.distributed as dist

from steadyrl.run import diskspace
from steadyrl.run.checkpoint import SHARDED_FORMAT_VERSION, finish_folder, snapshot, verify, write
from steadyrl.run.tensors import (
    CheckpointError,
    NonFiniteWeights,
    file_entry,
    local_part,
    nonfinite,
    optimizer_parts,
    refuse_nonfinite,
    unique_tensors,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.optim.lr_scheduler import LRScheduler

log = logging.getLogger(__name__)


def _lower_priority() -> None:
    """Nice +10 for the calling thread (Linux: a thread has its own nice value), so the step
    loop's threads win the CPU over a checkpoint writer."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


class ShardedTrainer(Protocol):
    """What a sharded save uses of a trainer (steadyrl.rl.trainer.Trainer): its whole model,
    its (FSDP-sharded) module, optimizer and schedule, and the gloo group checkpoints use."""

    @property
    def model(self) -> torch.nn.Module: ...
    @property
    def module(self) -> torch.nn.Module: ...
    @property
    def opt(self) -> torch.optim.Optimizer: ...
    @property
    def sched(self) -> LRScheduler: ...
    @property
    def checkpoint_group(self) -> ProcessGroup | int | None: ...   # int: torch's NON_GROUP_MEMBER, in its types


class ShardWriter:
    """One rank's part of a sharded checkpoint (format 3): `save(tmp, trainer)` copies this
    rank's shards of the trained weights and optimizer state (the only part the caller waits
    for) and writes them into `<tmp>/shards/` in a background thread with
    `torch.distributed.checkpoint.save`, over the trainer's `checkpoint_group` (a gloo group of
    its own: its collectives never meet the training's). Every rank of the group calls `save`
    with the same `tmp`, one save at a time. `wait()` joins the write in flight and re-raises
    its error."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def snapshot(self, trainer: ShardedTrainer) -> tuple[dict[str, Any], dict[str, Any]]:
        """(tables of this rank's shard copies, the optimizer's JSON part)."""
        from steadyrl.rl.distributed import to_host  # lazy: heavy (torch.distributed, FSDP), only sharded trainers

        opt_tensors, opt_json = optimizer_parts(trainer.opt.state_dict())
        tables = {"model": {k: to_host(v)   # tied weights: one name, as format 2
                            for k, v in unique_tensors(trainer.module.state_dict()).items()},
                  "optimizer": {k: to_host(v) for k, v in opt_tensors.items()}}
        return tables, opt_json

    def save(self, tmp: str | Path, trainer: ShardedTrainer, then: Callable[[dict[str, Any]], None] | None = None
             ) -> None:
        """Start writing this rank's shards into `<tmp>/shards/`; `then(opt_json)` runs in the same
        thread after the write (rank 0: the manifest), given the optimizer's JSON part. Every rank
        first learns whether any rank's optimizer shards hold NaN or infinity (a MAX all-reduce
        on the checkpoint group): if one does, no rank writes and each raises NonFiniteWeights
        from `wait()`, so no rank waits in DCP for one that refused."""
        self.wait()
        tables, opt_json = self.snapshot(trainer)

        def run() -> None:
            from torch.distributed.checkpoint.filesystem import FileSystemWriter  # lazy: heavy (torch DCP)
            from torch.distributed.checkpoint.state_dict_saver import save as dcp_save  # lazy: heavy (torch DCP)

            # a gloo group of every rank (dist.new_group): never NON_GROUP_MEMBER, which torch's types allow
            group = cast("ProcessGroup | None", trainer.checkpoint_group)
            _lower_priority()
            try:
                bad = nonfinite({k: local_part(v) for k, v in tables["optimizer"].items()})
                flag = torch.tensor([1.0 if bad else 0.0])
                if group is not None:
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
                if float(flag) > 0:
                    raise NonFiniteWeights(f"checkpoint {tmp}: refusing to write non-finite optimizer state "
                                           f"({', '.join(bad[:3]) or 'on another rank'})")
                dcp_save(tables, storage_writer=FileSystemWriter(str(Path(tmp) / "shards"), thread_count=1),
                         process_group=group)
                if then is not None:
                    then(opt_json)
            except BaseException as e:  # noqa: BLE001 - handed to wait(), which raises it in the caller
                self.error = e

        self._thread = threading.Thread(target=run, name="checkpoint-shards", daemon=False)
        self._thread.start()

    def wait(self, beat: Callable[[], None] = lambda: None) -> None:
        """Block until this rank's write (if any) is done, calling `beat` about every second."""
        if self._thread is not None:
            _join(self._thread, beat)
            self._thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise CheckpointError(f"checkpoint save failed: {type(err).__name__}: {err}") from err


def _join(thread: threading.Thread, beat: Callable[[], None]) -> None:
    """Join `thread`, calling `beat` about every second until it ends."""
    while thread.is_alive():
        thread.join(timeout=1.0)
        beat()


class AsyncCheckpointer:
    """Background writer: `save()` snapshots on the caller's thread and returns; the write
    runs in a thread, and then (`verify`) the verification of what was written, in the same
    thread. At most one save is in flight (a second waits for the first).

    Args:
        root: checkpoint folder.
        config: recorded in every manifest, checked on resume.
        keep: complete checkpoints kept.
        verify: re-read and re-hash each checkpoint after writing it (`verify()`).
        verified_step: the step of a checkpoint known to verify already (the one a resume
            verified), or None.
        key: sign every checkpoint with it (manifest.sig) and verify with it (`read_key`).
        beat: called about every second while `save` or `wait` waits for the write in
            flight (the liveness heartbeat of the thread that waits).

    Attributes:
        last_verified_step: the newest step whose checkpoint verified after it was written
            (or `verified_step`); a checkpoint that fails is logged and leaves it as it was.
        last_seconds, last_verify_seconds: the last write's and verification's durations.
    """

    def __init__(self, root: Path, config: dict[str, Any], keep: int = 3, verify: bool = True,
                 verified_step: int | None = None, beat: Callable[[], None] = lambda: None,
                 key: bytes | None = None) -> None:
        self.root, self.config, self.keep, self.verify = Path(root), config, keep, verify
        self.key = key
        self.beat = beat
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.last_seconds: float | None = None
        self.last_verify_seconds: float | None = None
        self.last_verified_step = verified_step
        self.shards: ShardWriter | None = None   # made at the first sharded save; its write is a save in flight

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: LRScheduler | None,
             meta: dict[str, Any]) -> None:
        self.wait()
        snap = snapshot(model, optimizer, scheduler)

        def attempt() -> Path:
            try:
                return write(self.root, step, snap, meta, self.config, self.keep, self.key)
            except OSError:  # a refused write's temporary goes at once; LATEST stays the last good one
                shutil.rmtree(self.root / f"step_{step:06d}.tmp-{os.getpid()}", ignore_errors=True)
                raise

        def run() -> None:
            _lower_priority()
            t0 = time.perf_counter()
            try:  # a full disk: retried with backoff until space returns (steadyrl.run.diskspace.retry)
                final = diskspace.retry(attempt, "checkpoint", self.root / f"step_{step:06d}", beat=lambda: None)
                self.last_seconds = time.perf_counter() - t0
            except BaseException as e:  # noqa: BLE001 - handed to wait(), which raises it in the caller
                self.error = e
                return
            if self.verify:
                self._verify(final, step)

        self._thread = threading.Thread(target=run, name=f"checkpoint-{step}", daemon=False)
        self._thread.start()

    def save_sharded(self, step: int, trainer: ShardedTrainer, meta: dict[str, Any],
                     announce: Callable[[str], None]) -> None:
        """Rank 0's side of a sharded checkpoint (format 3) of `trainer` (sharding fsdp): refuse
        non-finite weights (its whole `model`), prepare the folder, `announce(tmp)` it to the
        other ranks (each then calls ShardWriter.save with it; rank 0's Leader.save hands them
        the restored state first), write rank 0's shards, and --
        in the writer's thread, once every rank's shards are in (DCP's last collective) --
        meta.json, the manifest of every shard, LATEST, and the verification."""
        self.wait()
        self.shards = self.shards or ShardWriter()
        refuse_nonfinite(trainer.model.state_dict(), f"checkpoint step {step}: model")
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f"{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        announce(str(tmp))
        t0 = time.perf_counter()
        scheduler = trainer.sched.state_dict()   # now: the step loop goes on while the shards are written

        def finish(opt_json: dict[str, Any]) -> None:
            files = {str(p.relative_to(tmp)): file_entry(p) for p in sorted((tmp / "shards").iterdir())}
            full_meta = {**meta, "optimizer": opt_json, "scheduler": scheduler}
            written = finish_folder(self.root, tmp, final, step, files, full_meta, self.config, self.keep,
                              SHARDED_FORMAT_VERSION, self.key)
            self.last_seconds = time.perf_counter() - t0
            if self.verify:
                self._verify(written, step)

        self.shards.save(tmp, trainer, then=finish)

    def _verify(self, path: Path, step: int) -> None:
        """Verify the checkpoint just written (as a resume would); record its step when it does."""
        t0 = time.perf_counter()
        try:
            verify(path, self.config, self.key)
        except CheckpointError as e:  # the previous verified checkpoint stays the one to count on
            log.error("checkpoint did not verify after it was written", extra={"checkpoint": str(path),
                                                                                "why": str(e)})
        else:
            self.last_verified_step = step
        finally:
            self.last_verify_seconds = time.perf_counter() - t0

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete, calling `beat` about every
        second meanwhile (the waiting thread stays live). Re-raises its error."""
        if self._thread is not None:
            _join(self._thread, self.beat)
            self._thread = None
        if self.shards is not None:
            self.shards.wait(self.beat)   # raises CheckpointError naming the failed sharded save
        if self.error is not None:
            err, self.error = self.error, None
            raise CheckpointError(f"checkpoint save failed: {type(err).__name__}: {err}") from err
