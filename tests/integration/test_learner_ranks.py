"""The learner on 2 torch.distributed ranks (gloo, CPU) under `steadyrl up` (torchrun), replicated
and sharded (FSDP2, sharded checkpoints): the tiny pipeline learns and every prompt is trained
once; a SIGKILL of rank 1 takes the group down, torchrun starts it again, rank 0 resumes from
its checkpoint, and the audit still passes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from steadyrl.testing import audit_pipeline, explain
from steadyrl.testing.stack import alive
from tests.integration.test_pipeline import Up, _config


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        out += [int(k) for k in kids]
        todo += [int(k) for k in kids]
    return out


def _rank_pid(up: Up, rank: int) -> int | None:
    """The learner worker of `rank` that this `up` started (torchrun sets RANK in its environment)."""
    for pid in _descendants(up.proc.pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if (f"RANK={rank}".encode() in env and b"steadyrl.services.learner" in cmd
                and b"steadyrl.rl.torchrun" not in cmd):
            return pid
    return None


@pytest.mark.parametrize("sharding", ["replicate", "fsdp"])
def test_two_rank_learner_learns_and_trains_every_prompt_once(bootstrap, tmp_path, sharding):
    steps = 100
    up = Up(bootstrap, tmp_path, _config(tmp_path, steps=steps, world_size=2, eval_data=None,
                                         train={"sharding": sharding}))
    rc = up.wait(420)
    assert rc == 0, up.log()[-4000:]
    assert "follower stopped" in up.log()  # rank 1 stepped beside rank 0 and was told the run is over
    rewards = up.run().summary()["reward_per_step"]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert first < 0.2 and last > first + 0.5, (first, last)
    report = audit_pipeline(bootstrap, up.prefix, up.run(), steps, 8, excuse_dlq=False)
    assert report["ok"], explain(report)


@pytest.mark.parametrize("sharding", ["replicate", "fsdp"])
def test_sigkill_of_rank_1_restarts_the_group_and_nothing_is_lost_or_trained_twice(bootstrap, tmp_path, sharding):
    steps = 40
    up = Up(bootstrap, tmp_path, _config(tmp_path, steps=steps, world_size=2, eval_data=None, checkpoint_every=5,
                                         train={"sharding": sharding}))
    try:
        up.wait_step(12, timeout_s=300)
        pid = _rank_pid(up, 1)
        assert pid is not None, "no rank-1 learner process"
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while _rank_pid(up, 1) in (None, pid):  # torchrun starts the group again
            assert time.monotonic() < deadline and up.proc.poll() is None, up.log()[-4000:]
            time.sleep(0.5)
        rc = up.wait(420)
        assert rc == 0, up.log()[-4000:]
    finally:
        up.close()
    assert "resuming run from checkpoint" in up.log()
    if sharding == "fsdp":   # every checkpoint of the run is sharded: format 3, both ranks' shards
        from steadyrl.run import checkpoint as ck

        ckpts = list((up.run().path / "checkpoints").glob("step_*"))
        assert ckpts
        for path in ckpts:
            files = ck.verify(path)["files"]
            assert {"shards/__0_0.distcp", "shards/__1_0.distcp"} <= set(files), (path, sorted(files))
    # the restarted group joined at once: no rank read the dead rank's address (attempt_store)
    assert "connectFullMesh" not in up.log(), up.log()[-4000:]
    report = audit_pipeline(bootstrap, up.prefix, up.run(), steps, 8, excuse_dlq=False)
    assert report["ok"], explain(report)


def _listening(pids: list[int]) -> dict[int, list[str]]:
    """pid -> the local addresses ("127.0.0.1:port", "[::]:port", ...) of the TCP sockets each
    of `pids` listens on, from /proc/net/tcp and tcp6 and the processes' open files."""
    import ipaddress
    import socket

    listen: dict[str, str] = {}   # socket inode -> address
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A":   # TCP_LISTEN
                continue
            hexaddr, hexport = f[1].split(":")
            raw = bytes.fromhex(hexaddr)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))   # each 32-bit word is host order
            addr = ipaddress.ip_address(raw)
            listen[f[9]] = (f"{addr}:{int(hexport, 16)}" if family == socket.AF_INET
                            else f"[{addr}]:{int(hexport, 16)}")
    out: dict[int, list[str]] = {}
    for pid in pids:
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        out[pid] = sorted(listen[ln[8:-1]] for ln in links if ln.startswith("socket:[") and ln[8:-1] in listen)
    return out


def test_stop_mid_run_ends_every_rank_without_a_traceback(bootstrap, tmp_path):
    """`up` stopped from outside (SIGTERM) while the 2 ranks train: torchrun passes the stop to
    both at once; rank 1 waits for rank 0 to finish its step and say stop, so neither rank's
    collective meets a dead peer (it did: rank 0's stop broadcast failed with a gloo traceback).

    While they train, every socket the group listens on (torchrun's rendezvous store, gloo's
    pairs, rank 0's probes) is on loopback: torchrun's `--standalone` store listened on every
    interface (`[::]:port`), reachable and unauthenticated from any host."""
    up = Up(bootstrap, tmp_path, _config(tmp_path, steps=400, world_size=2, eval_data=None))
    try:
        up.wait_step(5, timeout_s=300)
        group = [up.child_pid("learner-0"), _rank_pid(up, 0), _rank_pid(up, 1)]   # torchrun's agent, the ranks
        assert None not in group, group
        sockets = _listening(group)   # type: ignore[arg-type]
        assert len(sockets[group[0]]) >= 1 and sockets[group[1]] and sockets[group[2]], sockets  # store, gloo
        assert all(a.startswith("127.0.0.1:") for addrs in sockets.values() for a in addrs), sockets
        os.kill(up.proc.pid, signal.SIGTERM)
        rc = up.wait(120)
    finally:
        up.close()
    log = up.log()
    assert rc == 0, log[-4000:]
    assert "waiting for rank 0 to end the run" in log and "follower stopped" in log, log[-4000:]
    assert "Traceback" not in log and "could not tell the other ranks" not in log, log[-4000:]


def test_sigkill_of_torchrun_takes_its_ranks_with_it_and_up_restarts_the_learner(bootstrap, tmp_path):
    """torchrun starts each rank in a session of its own: before die_with_parent, a SIGKILL of
    the agent left both ranks running (rank 0 holding the learner's consumer and transactional
    id) and the restarted learner's group beside them."""
    steps = 40
    up = Up(bootstrap, tmp_path, _config(tmp_path, steps=steps, world_size=2, eval_data=None, checkpoint_every=5))
    try:
        up.wait_step(8, timeout_s=300)
        agent = up.child_pid("learner-0")  # the learner process, exec'd into torchrun
        ranks = [_rank_pid(up, 0), _rank_pid(up, 1)]
        assert None not in ranks, ranks
        os.kill(agent, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(alive(p) for p in ranks):
            assert time.monotonic() < deadline, f"ranks {ranks} outlived their torchrun"
            time.sleep(0.2)
        rc = up.wait(420)  # up starts the learner again; it resumes from its checkpoint
    finally:
        up.close()
    assert rc == 0, up.log()[-4000:]
    assert "resuming run from checkpoint" in up.log()
    report = audit_pipeline(bootstrap, up.prefix, up.run(), steps, 8, excuse_dlq=False)
    assert report["ok"], explain(report)
