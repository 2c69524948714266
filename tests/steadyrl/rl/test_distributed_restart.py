"""A group torchrun starts again after a rank died meets in its own key space
(steadyrl.rl.distributed.attempt_store): the restarted rank 0 must not read the dead rank 1's
gloo address that the attempt before left in torchrun's store.

Regression for the CI failure of tests/integration/test_learner_ranks.py (SIGKILL of rank 1):
every restart of the group failed "Gloo connectFullMesh ... Connection refused" whenever the new
rank 1 came up later than the new rank 0. Here rank 1 is made late on purpose."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

WORKER = '''
import os, signal, sys, time
import torch, torch.distributed as dist
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if attempt == 1 and rank == 1:
    time.sleep(3)  # the restarted rank 1 comes up late: rank 0 looks up its address first
if attempt == 1 and sys.argv[1] == "plain":
    from datetime import timedelta
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=10))
    # the key plain env:// init puts rank 1's gloo address under, left by the dead attempt
    print(f"rank {rank} finds a stale address: {agent.check(['default_pg/0//cpu//0/1'])}", flush=True)
    sys.exit(0)
if sys.argv[1] == "steadyrl":
    from steadyrl.rl.distributed import init_from_env
    init_from_env(30)
else:
    from datetime import timedelta
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
t = torch.ones(1)
dist.all_reduce(t)
print(f"attempt {attempt} rank {rank} sum {t.item():.0f}", flush=True)
if attempt == 0 and rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)  # the group goes down; torchrun starts it again
if attempt == 0:
    time.sleep(60)  # rank 0 waits to be stopped by torchrun
dist.destroy_process_group()
'''


def _torchrun(tmp_path: Path, how: str) -> subprocess.CompletedProcess:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--max-restarts", "1", str(script), how],
        cwd=ROOT, capture_output=True, text=True, timeout=150)


def test_restarted_group_joins_in_its_own_attempt_space(tmp_path):
    done = _torchrun(tmp_path, "steadyrl")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "attempt 1 rank 0 sum 2" in done.stdout and "attempt 1 rank 1 sum 2" in done.stdout, done.stdout


def test_torchrun_keeps_the_dead_attempts_keys(tmp_path):
    """The race attempt_store works around, still there in this torch: the restarted group finds
    rank 1's address from the attempt before under the key plain env:// init would read. When
    this starts to fail, torchrun isolates restarts itself and attempt_store can go."""
    done = _torchrun(tmp_path, "plain")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "rank 0 finds a stale address: True" in done.stdout, done.stdout
