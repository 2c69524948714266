"""A group torchrun starts again after a rank died meets in its own key space
(steadyrl.rl.distributed.attempt_store): the restarted rank 0 must not read the dead rank 1's
gloo address that the attempt before left in torchrun's store.

Regression for the CI failure of tests/integration/test_learner_ranks.py (SIGKILL of rank 1):
every restart of the group failed "Gloo connectFullMesh ... Connection refused" whenever the new
rank 1 came up later than the new rank 0. Here rank 1 is made late on purpose."""

from __future__ import annotations

import os
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


OOM_WORKER = """
import os, sys, torch
from steadyrl.model.models import load_policy
from steadyrl.rl.distributed import init_from_env, leave
from steadyrl.rl.trainer import Group, TrainConfig, Trainer
from tests.steadyrl.rl.test_distributed_step import GROUPS
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
torch.set_num_threads(1)
init_from_env(30)
torch.manual_seed(0)
model, tok = load_policy("tiny", seed=0)
tr = Trainer(model, tok.pad_token_id, TrainConfig(lr=1e-2, micro_batch_size=8, sharding="fsdp"))
print(f"attempt {attempt} rank {rank} safe_mode {tr.safe_mode} micro_batch_size {tr.micro_batch_size}", flush=True)
if attempt == 0 and rank == 1:   # this rank's first forward fails, as the allocator would
    real = tr.module.forward
    def forward(*a, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    tr.module.forward = forward
tr.step(GROUPS)
print(f"attempt {attempt} rank {rank} stepped", flush=True)
leave()  # as services/learner/main.py: exiting with the gloo group up could SIGABRT (CI, exit -6)
"""


def test_sharded_out_of_memory_restarts_the_group_in_the_safe_mode(tmp_path):
    """Sharded (FSDP2), the out-of-memory fallback cannot be agreed inside the step: the other
    rank waits in a collective of the forward that failed. So the rank that ran out records it
    in torchrun's store and dies; torchrun restarts the group and every rank of the next attempt
    starts in the safe mode (micro-batches of 8 -> 2, gradient checkpointing) and steps."""
    script = tmp_path / "oom_worker.py"
    script.write_text(OOM_WORKER)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--max-restarts", "1", str(script)],
        cwd=ROOT, capture_output=True, text=True, timeout=150, env={**os.environ, "PYTHONPATH": str(ROOT)})
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "attempt 0 rank 0 safe_mode False micro_batch_size 8" in out, out
    assert "attempt 0 rank 1 stepped" not in out, out
    for rank in (0, 1):
        assert f"attempt 1 rank {rank} safe_mode True micro_batch_size 2" in out, out
        assert f"attempt 1 rank {rank} stepped" in out, out
