"""The learner's update step on SmolLM2-135M-Instruct with 1 and 2 torch.distributed ranks
(gloo, CPU), and the checkpoint save / verify / load of that trainer.

    flock /tmp/steadyrl-bench.lock .venv/bin/python bench/ranks.py [--steps 3] [--out bench/results/ranks.json]
    ... bench/ranks.py --arms ranks1 --merge     # rerun one arm (e.g. one another process loaded)

The step is the real job's shape: 8 prompts x 8 samples = 64 sequences, prompts of 36-44
tokens (left padded to 44), 32 response tokens, random token ids from the tokenizer's
vocabulary (fixed seed), rewards 0/1 mixed in every group (so every advantage is non-zero),
GRPO, token-mean, TrainConfig's defaults otherwise (lr 1e-6, micro_batch_size 8, ppo_epochs 1,
no mini_batch_size: on-policy, so no extra no-grad pass). Arms, each in its own process:

  gemm       torch.mm of 2048 x 2048 fp32 at 1 and 2 threads: this CPU's measured matmul rate
  ranks1     one process, torch.set_num_threads(2)
  ranks1-t1  one process, 1 thread
  ranks2     two processes (torch.multiprocessing, gloo over 127.0.0.1), 1 thread each; every
             rank holds the whole model and batch and backpropagates micro-batches i % 2 == rank;
             the gradients (one flat fp32 tensor of every parameter) are all-reduced
             (steadyrl/rl/trainer.py Trainer._all_reduce)
  ranks2-fsdp  as ranks2 with `sharding: fsdp`: FSDP2 shards the trained weights, gradients and
             AdamW moments (each block all-gathered in its forward and backward, gradients
             reduce-scattered), the whole weights gathered back into the plain model after the
             step; the wrapped `_all_reduce` then only gathers the metric sums

Before each arm it waits (up to `--quiet-wait-s`) until other processes use < 0.2 cores; the
CPU-seconds other processes used during the arm (all cores' busy time from /proc/stat less the
arm's own) are recorded beside it, so a loaded run shows.
Per arm: 1 warm-up step, then `--steps` timed steps (median, min, max of the wall seconds;
for ranks2 rank 0's, each step started after a barrier). In ranks2 the trainer's `_all_reduce`
is wrapped: a barrier first (its wait = the time one rank waits for the other's backward:
imbalance), then the real call (flattening, the gloo all-reduce, copying back, gathering the
metric sums), timed; compute = step - wait - all-reduce. Then, separately, `--allreduce-reps`
all-reduces of a flat fp32 tensor of the model's parameter count (the bare gloo collective).

Checkpoint (ranks1, after its steps, and rank 0 of ranks2 while rank 1 waits in a barrier:
format 2, rank 0 writes the whole replicated state): snapshot (CPU copies), write
(steadyrl.run.checkpoint.write: safetensors + sha256 + fsync), verify, load; bytes on disk.
ranks2-fsdp: format 3, every rank writes its shards at once (AsyncCheckpointer.save_sharded /
ShardWriter: torch.distributed.checkpoint), timed from the call to the end of rank 0's
finish (manifest, rename); snapshot = the call's return (what the step loop waits for); load =
`checkpoint.read` of the whole tables on rank 0 alone (what a resume on any rank count does).

The floor beside the figures: FLOPs per step = 6 x parameters x tokens (forward + backward of
every padded token: the trainer computes logits for the whole sequence), against the measured
gemm rate and the FMA peak (cores x FMA units x fp32 lanes x 2 x clock, from lscpu's flags).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

B, G, P_MIN, P_MAX, T = 8, 8, 36, 44, 32
ARMS = ["gemm", "ranks1", "ranks1-t1", "ranks2", "ranks2-fsdp"]


def make_groups(tok, seed: int = 0):
    from steadyrl.rl.trainer import Group

    rng = random.Random(seed)
    special = set(tok.all_special_ids)
    vocab = [i for i in range(tok.vocab_size) if i not in special]
    groups = []
    for _ in range(B):
        k = rng.randint(1, G - 1)                      # 1..7 right answers: rewards mixed
        rewards = [1.0] * k + [0.0] * (G - k)
        rng.shuffle(rewards)
        groups.append(Group([rng.choice(vocab) for _ in range(rng.randint(P_MIN, P_MAX))],
                            [[rng.choice(vocab) for _ in range(T)] for _ in range(G)], rewards))
    return groups


def _summary(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3),
            "raw": [round(x, 3) for x in xs]}


def checkpoint_cost(trainer, model) -> dict:
    import torch

    from steadyrl.model.models import SMOLLM2
    from steadyrl.run import checkpoint as ck

    config = {"model": SMOLLM2, "tokenizer": SMOLLM2, "algorithm": "grpo"}
    tmp = Path(tempfile.mkdtemp(prefix="ranksbench-"))
    try:
        t0 = time.perf_counter()
        snap = ck.snapshot(model, trainer.opt, trainer.sched)
        t1 = time.perf_counter()
        path = ck.write(tmp / "ckpt", trainer.global_step, snap, {"global_step": trainer.global_step}, config)
        t2 = time.perf_counter()
        del snap
        ck.verify(path, config)
        t3 = time.perf_counter()
        ck.load(path, model, trainer.opt, trainer.sched)
        t4 = time.perf_counter()
        files = {str(p.relative_to(path)): p.stat().st_size for p in path.rglob("*") if p.is_file()}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"threads": torch.get_num_threads(), "snapshot_s": round(t1 - t0, 3), "write_s": round(t2 - t1, 3),
            "save_s": round(t2 - t0, 3), "verify_s": round(t3 - t2, 3), "load_s": round(t4 - t3, 3),
            "verify_load_s": round(t4 - t2, 3), "bytes": sum(files.values()), "files": files}


def sharded_checkpoint_cost(trainer, rank: int) -> dict:
    """Every rank writes its shards (format 3); rank 0 times it and reads the whole tables back."""
    import torch.distributed as dist

    from steadyrl.model.models import SMOLLM2
    from steadyrl.run import checkpoint as ck
    from steadyrl.run import ckpt_writer

    config = {"model": SMOLLM2, "tokenizer": SMOLLM2, "algorithm": "grpo"}
    root = Path(_broadcast_obj(tempfile.mkdtemp(prefix="ranksbench-") if rank == 0 else None))
    try:
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            saver = ckpt_writer.AsyncCheckpointer(root / "ckpt", config)
            saver.verify = False                           # timed on its own below
            saver.save_sharded(trainer.global_step, trainer, {"global_step": trainer.global_step},
                               announce=lambda tmp: _broadcast_obj(tmp))
            t1 = time.perf_counter()
            saver.wait()
            t2 = time.perf_counter()
            path = ck.latest_valid(root / "ckpt", config)
            t3 = time.perf_counter()
            ck.read(path)
            t4 = time.perf_counter()
            files = {str(p.relative_to(path)): p.stat().st_size for p in path.rglob("*") if p.is_file()}
        else:
            writer = ckpt_writer.ShardWriter()
            writer.save(_broadcast_obj(None), trainer)
            writer.wait()
        dist.barrier()
    finally:
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    if rank:
        return {}
    return {"format": ck.SHARDED_FORMAT_VERSION, "snapshot_s": round(t1 - t0, 3), "write_s": round(t2 - t1, 3),
            "save_s": round(t2 - t0, 3), "verify_s": round(t3 - t2, 3), "load_s": round(t4 - t3, 3),
            "verify_load_s": round(t4 - t2, 3), "bytes": sum(files.values()), "files": files}


def _broadcast_obj(obj):
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def run_steps(steps: int, rank: int = 0, world: int = 1, sharding: str = "replicate") -> dict:
    """Load the model, build the trainer, 1 warm-up + `steps` timed steps (rank 0 reports)."""
    import torch

    from steadyrl.model.models import SMOLLM2, load_policy
    from steadyrl.rl.trainer import TrainConfig, Trainer

    dist = None
    if world > 1:
        import torch.distributed as dist
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model, tok = load_policy(SMOLLM2, seed=0)
    cfg = TrainConfig(sharding=sharding)                  # lr 1e-6, micro-batch 8, GRPO token-mean
    trainer = Trainer(model, tok.pad_token_id, cfg)
    groups = make_groups(tok)
    load_s = time.perf_counter() - t0
    waits: list[float] = []       # in the wrapped _all_reduce: barrier wait (imbalance)
    reduces: list[float] = []     # the _all_reduce proper
    if dist is not None:
        orig = trainer._all_reduce

        def timed(*a):
            t = time.perf_counter()
            dist.barrier()
            t_mid = time.perf_counter()
            out = orig(*a)
            waits.append(t_mid - t)
            reduces.append(time.perf_counter() - t_mid)
            return out

        trainer._all_reduce = timed
    step_s, update_s, wait_s, reduce_s = [], [], [], []
    metrics: dict = {}
    for i in range(steps + 1):
        if dist is not None:
            dist.barrier()
        waits.clear()
        reduces.clear()
        t = time.perf_counter()
        metrics = trainer.step(groups)
        dt = time.perf_counter() - t
        if i == 0:
            warmup_s = dt
            continue
        step_s.append(dt)
        update_s.append(metrics["timing_s/update_actor"])
        wait_s.append(sum(waits))
        reduce_s.append(sum(reduces))
    n_params = sum(p.numel() for p in trainer.params)
    tokens = sum(len(g.responses) for g in groups) * (max(len(g.prompt_ids) for g in groups) + T)   # N x (P + T)
    out = {"rank": rank, "world": world, "sharding": sharding if world > 1 else None,
           "threads": torch.get_num_threads(), "model_load_s": round(load_s, 2),
           "warmup_step_s": round(warmup_s, 3), "step_s": _summary(step_s),
           "update_actor_s": _summary(update_s), "params": n_params, "padded_tokens_per_step": tokens,
           "real_tokens_per_step": sum(len(g.prompt_ids) * G + G * T for g in groups),
           "last_metrics": {k: metrics[k] for k in ("actor/pg_loss", "actor/grad_norm", "critic/advantages/var")}}
    if dist is not None:
        out["allreduce_in_step_s"] = _summary(reduce_s)
        out["imbalance_wait_in_step_s"] = _summary(wait_s)
        out["compute_s"] = _summary([s - w - r for s, w, r in zip(step_s, wait_s, reduce_s, strict=True)])
        # the bare collective on a flat fp32 tensor of every parameter
        flat = torch.ones(n_params)
        bare = []
        for _ in range(3):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(flat)
            bare.append(time.perf_counter() - t)
        out["bare_allreduce_s"] = _summary(bare)
        out["bare_allreduce_bytes"] = flat.numel() * flat.element_size()
        del flat
        dist.barrier()
        if trainer.sharded:
            out["checkpoint"] = sharded_checkpoint_cost(trainer, rank)
        else:
            if rank == 0:
                out["checkpoint"] = checkpoint_cost(trainer, model)
            dist.barrier()                                # rank 1 waits here while rank 0 saves
    else:
        out["checkpoint"] = checkpoint_cost(trainer, model)
    return out


def _rank(rank: int, world: int, port: int, steps: int, out: str, sharding: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        res = run_steps(steps, rank, world, sharding)
        res["max_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)   # this rank's peak
        if rank == 0:
            Path(out).write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def gemm_rate() -> dict:
    import torch

    res = {}
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        torch.mm(a, b)
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            torch.mm(a, b)
            ts.append(time.perf_counter() - t)
        res[str(threads)] = round(2 * n ** 3 / min(ts) / 1e9, 1)
    return {"n": n, "gflops_by_threads": res}


def arm(name: str, steps: int, out: str) -> None:
    import torch

    if name == "gemm":
        res = gemm_rate()
    elif name in ("ranks1", "ranks1-t1"):
        torch.set_num_threads(2 if name == "ranks1" else 1)
        res = run_steps(steps)
        res["max_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    elif name in ("ranks2", "ranks2-fsdp"):
        import torch.multiprocessing as mp

        from steadyrl.local.ports import free_port

        mp.spawn(_rank, args=(2, free_port(), steps, out, "fsdp" if name == "ranks2-fsdp" else "replicate"),
                 nprocs=2, join=True)
        return
    else:
        raise SystemExit(f"unknown arm {name}")
    Path(out).write_text(json.dumps(res))


def lscpu() -> dict:
    text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    info = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    info = {k.strip(): v.strip() for k, v in info.items()}
    flags = info.get("Flags", "").split()
    mhz = None
    with contextlib.suppress(OSError, StopIteration, ValueError):
        mhz = float(next(line.split(":")[1] for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("cpu MHz")))
    return {"model_name": info.get("Model name"), "cpus": os.cpu_count(), "cpu_family": info.get("CPU family"),
            "model": info.get("Model"), "hypervisor": info.get("Hypervisor vendor"), "mhz": mhz,
            "avx512f": "avx512f" in flags, "avx2": "avx2" in flags, "fma": "fma" in flags}


def _machine_busy_s() -> float:
    """CPU-seconds all cores have been busy since boot (/proc/stat: everything but idle and iowait)."""
    f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(f) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")


def _wait_quiet(limit_s: float) -> float:
    """Wait until other processes use < 0.2 cores over 5 s (at most `limit_s`); returns the wait."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        b0, ru0 = _machine_busy_s(), resource.getrusage(resource.RUSAGE_SELF)
        time.sleep(5)
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        own = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
        if _machine_busy_s() - b0 - own < 0.2 * 5:
            break
    return round(time.perf_counter() - t0, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per arm (after 1 warm-up step)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--out", default=str(ROOT / "bench/results/ranks.json"))
    ap.add_argument("--merge", action="store_true",
                    help="keep the arms of an existing --out that this run does not run (rerun one arm)")
    ap.add_argument("--quiet-wait-s", type=float, default=180,
                    help="before each arm, wait up to this long for the machine to be quiet (others < 0.2 cores)")
    ap.add_argument("--arm", help=argparse.SUPPRESS)        # internal: run one arm, JSON to --arm-out
    ap.add_argument("--arm-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm:
        arm(args.arm, args.steps, args.arm_out)
        return

    import torch

    cmd = "flock /tmp/steadyrl-bench.lock .venv/bin/python bench/ranks.py" + (
        f" --steps {args.steps}" if args.steps != 3 else "")
    results: dict = {}
    wall: dict = {}
    quiet_waits: dict = {}
    old = json.loads(Path(args.out).read_text()) if args.merge and Path(args.out).exists() else {}
    if old:
        results, wall = dict(old["arms"]), dict(old["arm_wall_s"])
        cmd = old["command"] + " ; " + cmd + f" --arms {args.arms} --merge"
    with tempfile.TemporaryDirectory(prefix="ranksbench-") as tmp:
        for name in args.arms.split(","):
            out = Path(tmp) / f"{name}.json"
            quiet_waits[name] = _wait_quiet(args.quiet_wait_s)
            t0, busy0 = time.perf_counter(), _machine_busy_s()
            ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run([sys.executable, __file__, "--arm", name, "--arm-out", str(out),
                            "--steps", str(args.steps)], check=True, cwd=ROOT)
            ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            own = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
            wall[name] = round(time.perf_counter() - t0, 1)
            results[name] = json.loads(out.read_text())
            # other load on the machine during the arm: all cores' busy CPU-s less the arm's own
            results[name]["arm_cpu_s"] = round(own, 1)
            results[name]["others_cpu_s_during_arm"] = round(max(0.0, _machine_busy_s() - busy0 - own), 1)
            brief = {k: v for k, v in results[name].items() if k not in ("checkpoint", "last_metrics")}
            print(name, json.dumps(brief), flush=True)

    cpu = lscpu()
    # floor: 6 x params x padded tokens, against the measured gemm rate and the FMA peak
    step_arm = next((results[a] for a in ("ranks1", "ranks1-t1", "ranks2") if a in results), None)
    floor: dict = {}
    if step_arm is not None:
        flops = 6 * step_arm["params"] * step_arm["padded_tokens_per_step"]
        lanes = 16 if cpu["avx512f"] else 8                     # fp32 lanes per FMA (512 / 256 bit)
        ghz = (cpu["mhz"] or 3000) / 1000
        peak_core = 2 * lanes * 2 * ghz                         # 2 FMA units x lanes x 2 FLOP x GHz
        floor = {"flops_per_step": flops, "formula": "6 x params x padded tokens (N x (P + T))",
                 "no_grad_pass": "none: GRPO, ppo_epochs 1, no mini_batch_size is on-policy",
                 "fma_peak_gflops_per_core": round(peak_core, 1),
                 "fma_peak_assumptions": f"2 FMA units x {lanes} fp32 lanes x 2 FLOP x {ghz:.2f} GHz (lscpu MHz)",
                 "floor_s_at_fma_peak": {"1 core": round(flops / (peak_core * 1e9), 2),
                                         "2 cores": round(flops / (2 * peak_core * 1e9), 2)}}
        if "gemm" in results:
            g = results["gemm"]["gflops_by_threads"]
            floor["floor_s_at_measured_gemm"] = {"1 thread": round(flops / (g["1"] * 1e9), 2),
                                                 "2 threads": round(flops / (g["2"] * 1e9), 2)}
        for a in ("ranks1", "ranks1-t1", "ranks2", "ranks2-fsdp"):
            if a in results:
                results[a]["achieved_gflops"] = round(flops / results[a]["step_s"]["median"] / 1e9, 1)
        if "ranks2" in results:
            S = results["ranks2"]["bare_allreduce_bytes"]
            floor["allreduce_bytes_per_rank"] = {"tensor": S, "sent_and_received_each_ring": S,
                                                 "note": "ring all-reduce: each rank sends and receives "
                                                         "2 (W-1)/W x S = S for W = 2"}
    out = {
        "benchmark": "ranks", "model": "smollm2-135m-instruct", "command": cmd, "steps": args.steps,
        "step_batch": f"{B} prompts x {G} samples, {P_MIN}-{P_MAX} prompt tokens (padded to {P_MAX}) + {T} "
                      "response tokens, GRPO token-mean, TrainConfig defaults (lr 1e-6, micro_batch_size 8)",
        "machine": {**cpu, "platform": platform.platform(), "torch": torch.__version__,
                    "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "arm_wall_s": wall, "quiet_wait_s_before_arm": {**old.get("quiet_wait_s_before_arm", {}), **quiet_waits},
        "arms": results, "floor": floor,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "arms"}, indent=2))


if __name__ == "__main__":
    main()
