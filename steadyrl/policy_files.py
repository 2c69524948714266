"""The policy store's layout: how one policy version lies on disk, written by the learner and
read by the actor (torch or vLLM).

    <policy_root>/<run_id>/v000007/
        model.safetensors.index.json          Hugging Face's sharded-checkpoint index:
                                              {"metadata": {"total_size", "sha256": {file: hex}},
                                               "weight_map": {tensor name: file}}
        model-00001-of-00005.safetensors      the shards, ~128 MiB each (SHARD_BYTES), written
        ...                                   and verified by one thread each

A version is a Hugging Face weights folder, so vLLM (`reload_weights(weights_path=...)`) and
`transformers` read it as it is, and one index serves a single-file learner and a sharded one.
The `rl.policy` record names the folder (`uri`, relative to the root) and the sha256 of its
index; the index holds each shard's sha256, so checking the index's hash and then each
shard's checks every byte. A version is written into a hidden folder and renamed into place:
readers see a whole version or none.

Before this layout (main up to 4bba081) a version was one file `<run_id>/v000007.safetensors`
and `sha256` was that file's: `read_version` still accepts such a record (a resumed run's
first announcement, an old record on the compacted topic).

The folder names the run and the version: `check_run` is how the actor knows a record's
weights are that run's (an earlier run's folder cannot be announced under a later run id),
and `prune` is the one rule by which the learner deletes versions.

    <policy_root>/<run_id>/high_water         the highest version of the run ever written
                                              (`raise_high_water`), one decimal integer

`prune` deletes the versions a crash threw away (after the version a resumed learner goes on
from); `high_water` keeps the highest of them, which prompts stamped by the dead learner still name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from steadyrl.config import ConfigError
from steadyrl.files import fsync_dir, sha256_file, write_atomic

if TYPE_CHECKING:  # torch is imported only where tensors are read or written (below)
    import torch

INDEX = "model.safetensors.index.json"
#: the learner's run ids (`new_run_id`: a UTC second, then 16 random bits); a later run's id
#: sorts after every earlier run's, whatever the clocks said. Only folders so named are pruned.
RUN_ID = re.compile(r"r\d{8}T\d{6}-[0-9a-f]{4}")
_RUN_TIME = "r%Y%m%dT%H%M%S"

log = logging.getLogger(__name__)


def new_run_id(*places: Path, now: float | None = None) -> str:
    """A new learner run's id, `r%Y%m%dT%H%M%S-xxxx` (RUN_ID): a UTC second, then 16 random
    bits, made to sort after every run already present under `places` (the learner's state
    dir and the policy root: entries named like a run id).

    The actor and the policy store order runs by their ids as strings (a later run's version 0
    replaces an earlier run's weights; prune deletes earlier runs), so the order must not hang
    on the clock of the node a learner happens to start on: the second is the clock's (`now`,
    default time.time()) unless a run present has the same second or a later one (a clock
    behind the previous run's start, or two runs within one second); then it is that newest
    run's second plus one, logged as a warning when the clock is behind. The runs present are
    the high-water mark, which only grows: one learner owns a state dir and a policy root, and
    prune deletes only runs that sort before the current one, so the newest run stays. The
    actor loads a version only from its run's folder under the policy root (check_run), so
    every run it can serve is counted (unless its folder was deleted by hand while an actor
    still serves it from memory). Ids of earlier mains (the start second only) have the same
    form and keep sorting among these as before.

    Raises ConfigError (exit 2) when a present name matches RUN_ID but holds no date
    (`r20261399T...`) or the last second of year 9999: no id can sort after it.
    """
    t = time.time() if now is None else now
    clock = datetime.fromtimestamp(int(t // 1), UTC)
    newest = max((p.name for place in places if place.is_dir() for p in place.iterdir()
                  if RUN_ID.fullmatch(p.name)), default="")
    stamp = clock
    if newest and newest >= clock.strftime(_RUN_TIME):
        try:
            stamp = datetime.strptime(newest[:16], _RUN_TIME).replace(tzinfo=UTC) + timedelta(seconds=1)
        except (ValueError, OverflowError) as e:
            where = [str(place / newest) for place in places if (place / newest).exists()]
            raise ConfigError(f"a new learner run cannot sort after {where[0]}: its name is not a start "
                              f"time ({e}); rename or remove it") from None
        if newest[:16] > clock.strftime(_RUN_TIME):
            log.warning("the clock is behind the newest run present: the new run's id takes the second after it",
                        extra={"newest_run": newest, "clock": clock.strftime(_RUN_TIME),
                               "run_id_time": stamp.strftime(_RUN_TIME)})
    return stamp.strftime(_RUN_TIME) + f"-{random.getrandbits(16):04x}"


class PolicyRefused(Exception):
    """A policy record that must not be loaded; `reason` is a short label for metrics."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def version_dir(run_id: str, version: int) -> Path:
    """The folder of one version, relative to the policy root."""
    return Path(run_id) / f"v{version:06d}"


#: a version's tensors go into shards of about this many bytes (a tensor is never split), so a
#: version is written and verified by several threads at once (hashlib and file I/O release
#: the GIL); the layout depends only on the tensors, not on the machine that writes it.
SHARD_BYTES = 128 << 20


def shard_plan(tensors: dict[str, torch.Tensor], shard_bytes: int | None = None) -> list[dict[str, torch.Tensor]]:
    """`tensors` split in order into consecutive groups of about `shard_bytes` (default
    SHARD_BYTES) bytes each: a group closes once it reaches that size."""
    shard_bytes = SHARD_BYTES if shard_bytes is None else shard_bytes
    plan: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        if size >= shard_bytes:
            plan.append({})
            size = 0
        plan[-1][name] = t
        size += t.numel() * t.element_size()
    return plan


def _threads(n: int) -> int:
    return max(1, min(n, os.cpu_count() or 1))


def write_version(root: Path, rel: Path, tensors: dict[str, torch.Tensor], *, durable: bool = True) -> str:
    """Write `tensors` (name -> CPU torch.Tensor, no shared storage) as the version folder
    `root/rel`; returns the sha256 of its index (what `rl.policy` announces).

    The tensors go into shards of about SHARD_BYTES (`shard_plan`), each written and hashed
    by its own thread. Written into `.vNNNNNN.tmp-<pid>` and renamed into place: a reader sees
    a whole version or none. `durable` (default): the shards, the index and the folders are
    fsynced first, so a version announced after this returned survives a power loss; False
    leaves that to `sync_version`, which the learner calls after announcing (the actor then
    reads the version from the page cache while the disk catches up). Rewriting a version
    with the same bytes keeps the folder; other bytes replace it. Raises OSError when the disk
    refuses (ENOSPC...), having removed its temporary and left any version already there as
    it was.
    """
    from steadyrl.run.tensors import write_safetensors  # lazy: heavy (torch, via checkpoint); the learner only

    final = root / rel
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        plan = shard_plan(tensors)
        names = [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
        with ThreadPoolExecutor(_threads(len(plan))) as pool:   # hashed on the way
            written = list(pool.map(lambda i: write_safetensors(tmp / names[i], plan[i], fsync=durable),
                                    range(len(plan))))
        index = {"metadata": {"total_size": sum(w["size"] for w in written),
                              "sha256": {n: w["sha256"] for n, w in zip(names, written, strict=True)}},
                 "weight_map": {name: names[i] for i, part in enumerate(plan) for name in part}}
        text = (json.dumps(index, indent=1, sort_keys=True) + "\n").encode()
        with open(tmp / INDEX, "wb") as f:
            f.write(text)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        digest = hashlib.sha256(text).hexdigest()
        if (final / INDEX).is_file() and sha256_file(final / INDEX) == digest:
            shutil.rmtree(tmp)  # the same version again (a resumed run re-announces it)
            if durable:
                sync_version(root, rel)
            return digest
        if durable:
            fsync_dir(tmp)
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if durable:
        fsync_dir(final.parent)
    return digest


def sync_version(root: Path, rel: Path) -> None:
    """fsync the version folder `root/rel` (every file, the folder, the run's folder): what
    `write_version(durable=False)` left to do. Raises OSError (EIO...); after a failed fsync
    the kernel may have dropped the unwritten pages, so the caller rewrites the version."""
    final = root / rel
    for p in sorted(final.iterdir()):
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    fsync_dir(final)
    fsync_dir(final.parent)


def resolve(root: Path, uri: str) -> Path:
    """The version folder (or legacy file) `uri` names, checked to lie under `root`.

    Raises PolicyRefused: outside_root, not_safetensors (neither a folder nor a .safetensors
    file), missing.
    """
    p = Path(uri)
    p = (p if p.is_absolute() else root / p).resolve()
    if not p.is_relative_to(root):
        raise PolicyRefused("outside_root", f"{uri} resolves to {p}, outside policy_root {root}")
    if p.suffix not in ("", ".safetensors"):
        raise PolicyRefused("not_safetensors", f"{p} is neither a version folder nor a .safetensors file")
    if not (p / INDEX if p.suffix == "" else p).is_file():
        raise PolicyRefused("missing", f"{p} does not exist" + (f" (no {INDEX})" if p.is_dir() else ""))
    return p


def check_run(root: Path, uri: str, run_id: str, version: int) -> Path:
    """The version `uri` names (see resolve), checked to be version `version` of run `run_id`:
    after resolving links it must be `root/<run_id>/v{version:06d}` (or that name plus
    `.safetensors`, a legacy file), which is where the learner writes it (`version_dir`).

    A record names its run and version, but whoever can write `rl.policy` can name any; the
    folder the learner created cannot be renamed by a record. So an earlier run's weights
    cannot be announced under a later run id (which would make the actor serve them as the
    newest run and answer the real run's prompts 409), nor one version's as another's.

    Raises PolicyRefused: those of resolve; no_run (`run_id` empty: a record written before
    PolicyUpdate 1.1, which named no run); wrong_run (the path is not that run's version).
    """
    root = root.resolve()
    path = resolve(root, uri)
    if not run_id:
        raise PolicyRefused("no_run", f"{uri}: the record names no run_id (PolicyUpdate before 1.1); "
                                      f"a version is loaded only from its run's folder <run_id>/v{{version:06d}}")
    if "/" in run_id or "\\" in run_id or run_id in (".", ".."):  # pathlib would fold `r1/.` into `r1`
        raise PolicyRefused("wrong_run", f"{uri} is not version {version} of run {run_id!r}: that run_id is not "
                                         f"a folder name")
    want = root / version_dir(run_id, version)
    if path not in (want, want.with_name(want.name + ".safetensors")):
        raise PolicyRefused("wrong_run", f"{uri} resolves to {path}, not version {version} of run {run_id!r} "
                                         f"({want.relative_to(root)}): a record cannot move weights to another run")
    return path


def read_version(root: Path, uri: str, sha256: str) -> dict[str, torch.Tensor]:
    """The tensors (name -> torch.Tensor) of the version `uri`, every byte checked against
    `sha256` (the index's, or a legacy file's). Raises PolicyRefused (see resolve;
    sha256_mismatch, bad_index)."""
    from safetensors.torch import load_file  # lazy: heavy (torch, via safetensors.torch), a reader's path only

    path = resolve(root, uri)
    head = path / INDEX if path.is_dir() else path
    got = sha256_file(head)
    if got != sha256:
        raise PolicyRefused("sha256_mismatch", f"{head}: expected {sha256}, got {got}")
    if not path.is_dir():
        return load_file(str(path))
    try:
        index = json.loads(head.read_text())
        shards = index["metadata"]["sha256"]
        files = set(index["weight_map"].values())
    except (ValueError, KeyError, TypeError) as e:
        raise PolicyRefused("bad_index", f"{head}: {e!r}") from None
    if files - set(shards) or any(Path(f).name != f for f in shards):
        raise PolicyRefused("bad_index", f"{head}: every shard must be a file of the folder with a sha256")
    order = sorted(shards.items())
    with ThreadPoolExecutor(_threads(len(order))) as pool:   # one thread a shard, as they were written
        hashes = list(pool.map(lambda item: sha256_file(path / item[0]), order))
    for (shard, want), have in zip(order, hashes, strict=True):
        if have != want:
            raise PolicyRefused("sha256_mismatch", f"{path / shard}: expected {want}, got {have}")
    tensors: dict[str, torch.Tensor] = {}
    for shard, _ in order:
        tensors.update(load_file(str(path / shard)))
    return tensors


def _versions(run_dir: Path) -> dict[int, list[Path]]:
    """version -> its folder and/or legacy file in `run_dir` (hidden write leftovers excluded)."""
    found: dict[int, list[Path]] = {}
    for p in run_dir.glob("v*"):
        stem = p.name.removesuffix(".safetensors")
        if stem[1:].isdigit():
            found.setdefault(int(stem[1:]), []).append(p)
    return found


def _remove(p: Path) -> None:
    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)


HIGH_WATER = "high_water"


def raise_high_water(root: Path, run_id: str, version: int) -> int:
    """Record that run `run_id` has written `version`; returns the run's high-water mark: the
    highest version it ever wrote, by this learner or one before it (>= `version`).

    Read from `<root>/<run_id>/high_water` and the version folders still there (a run written
    before this file existed has only those: a resumed learner calls this before its first
    `prune`, so the versions its predecessor wrote past the checkpoint still count), written
    back atomically and fsynced when it rises. A file that does not hold an integer is counted
    as absent. A run first resumed by a learner before this file (main up to 85ad3de) has
    already pruned the versions past its checkpoint: the mark then starts from what is left.
    The actor serves a prompt stamped with a version above the one it serves but at most the
    high-water mark (services/actor/gate.py `verdict`): that version was thrown
    away by a crash and will not come, or comes again from the resumed learner.
    Raises OSError when the disk refuses."""
    run_dir = root / run_id
    path = run_dir / HIGH_WATER
    try:
        recorded = int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        recorded = -1
    mark = max([recorded, version, *_versions(run_dir)])
    if mark != recorded:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(path, f"{mark}\n")   # fsynced: the folders it stands for are about to go
    return mark


def prune(root: Path, run_id: str, current: int, keep: int, keep_runs: int) -> list[Path]:
    """The policy files' pruning rule; the learner applies it after each publish of version
    `current` of run `run_id` (a run's first publish is at its start: version 0, or the
    version a resume continues from). Under `root`:

    1. run `run_id`: versions after `current` are deleted (weights a crash threw away: the
       learner resumed from an earlier checkpoint); of the others the newest `keep`
       (>= 1, `learner.keep_policies`) stay, `current` (what the newest `rl.policy` record
       names) among them.
    2. earlier runs (folders named like a learner run id, RUN_ID, that sort before `run_id`,
       i.e. started earlier): ended, since one learner owns a policy root and the actor never
       goes back to an earlier run once a later one is announced. The newest `keep_runs`
       (`learner.keep_earlier_runs`) keep only their newest version (what `steadyrl export
       RUN latest` reads); older runs are deleted whole.
    3. anything else is left alone: later runs, folders not named like a run id, a run's
       hidden write leftovers (`.v000007.tmp-PID`) unless its whole folder goes.

    Legacy `.safetensors` files count as their version. Returns the paths deleted (for the
    log); raises OSError when the disk refuses.
    """
    gone: list[Path] = []
    found = _versions(root / run_id)
    kept = sorted(v for v in found if v <= current)[-keep:]
    for v, paths in found.items():
        if v not in kept:
            gone += paths
    earlier = sorted((p for p in root.iterdir() if p.is_dir() and not p.is_symlink()
                      and RUN_ID.fullmatch(p.name) and p.name < run_id), key=lambda p: p.name)
    recent = earlier[len(earlier) - keep_runs:] if keep_runs else []
    for run in earlier:
        if run not in recent:
            gone.append(run)
            continue
        versions = _versions(run)
        newest = max(versions, default=None)
        gone += [p for v, paths in versions.items() if v != newest for p in paths]
    for p in gone:
        _remove(p)
    return gone
