"""Checkpoint cost on SmolLM2-135M-Instruct: step time saving every step (async) vs never,
save and load seconds, bytes written.

    .venv/bin/python bench/checkpoint.py [--rounds 3] [--steps 4] [--out bench/results/checkpoint.json]

Each step is a real GRPO update on 8 groups x 8 samples of 32 tokens (fixed random token
responses, so generation is not timed). Runs `--rounds` rounds of `--steps` steps never
saving, then `--steps` steps saving every step (async, the wait for the last save
included), interleaved so that drift in the machine's speed hits both modes alike, and
reports the median over rounds of each mode's seconds per step and the async overhead
between the medians -- once per `--torch-threads` count (default: all cores, then one core
left free for the background writer). Also: the time the step loop spends in `save()`
(the CPU snapshot), the background write's duration, and a synchronous save, verify and
load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    import torch

    from steadyrl.model.models import SMOLLM2, load_policy
    from steadyrl.rl.trainer import Group, TrainConfig, Trainer
    from steadyrl.run import checkpoint as ck
    from steadyrl.run import ckpt_writer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--torch-threads", default=f"{os.cpu_count()},{max(1, (os.cpu_count() or 2) - 1)}",
                    help="comma-separated intra-op thread counts to measure, e.g. '2,1': all cores to the "
                         "update, then one core left to the background writer")
    ap.add_argument("--out", default=str(ROOT / "bench/results/checkpoint.json"))
    args = ap.parse_args()
    threads = [int(t) for t in args.torch_threads.split(",")]
    torch.manual_seed(0)
    model, tok = load_policy(SMOLLM2)
    trainer = Trainer(model, tok.pad_token_id, TrainConfig(lr=1e-6, micro_batch_size=8))
    rng = random.Random(0)
    groups = [Group([rng.randrange(1000, 2000) for _ in range(60)],
                    [[rng.randrange(1000, 2000) for _ in range(32)] for _ in range(8)],
                    [float(rng.random() < 0.3) for _ in range(8)]) for _ in range(8)]
    config = {"model": SMOLLM2, "tokenizer": SMOLLM2, "algorithm": "grpo"}
    tmp = Path(tempfile.mkdtemp(prefix="ckbench-"))
    try:
        saver = ckpt_writer.AsyncCheckpointer(tmp / "ckpt", config, keep=2)
        snapshot_s: list[float] = []  # save() on the step loop
        write_s: list[float] = []     # the last background write of each block

        def block(save: bool) -> float:
            """Seconds per step over `--steps` steps; with saving, the wait for the block's last
            save is included (charged to the block, as a run's next step would pay it)."""
            t0 = time.perf_counter()
            for _ in range(args.steps):
                trainer.step(groups)
                if save:
                    t1 = time.perf_counter()
                    saver.save(trainer.global_step, model, trainer.opt, trainer.sched,
                               {"global_step": trainer.global_step})
                    snapshot_s.append(time.perf_counter() - t1)
            saver.wait()
            if save:
                write_s.append(saver.last_seconds)
            return (time.perf_counter() - t0) / args.steps

        by_threads = {}
        for n in threads:
            torch.set_num_threads(n)
            snapshot_s.clear()
            write_s.clear()
            block(False)  # warm-up (allocations, optimizer state, this thread count)
            rounds = [{"never": block(False), "every": block(True)} for _ in range(args.rounds)]
            never = statistics.median(r["never"] for r in rounds)
            every = statistics.median(r["every"] for r in rounds)
            by_threads[str(n)] = {
                "step_seconds_never": round(never, 3), "step_seconds_every_step_async": round(every, 3),
                "async_overhead_pct": round(100 * (every / never - 1), 2),
                "save_call_seconds_median": round(statistics.median(snapshot_s), 3),
                "background_write_seconds_median": round(statistics.median(write_s), 2),
                "raw": {"rounds": rounds, "save_call_seconds": list(snapshot_s),
                        "background_write_seconds": list(write_s)}}
            print(json.dumps({n: {k: v for k, v in by_threads[str(n)].items() if k != "raw"}}), flush=True)
        torch.set_num_threads(threads[0])
        t0, c0 = time.perf_counter(), time.process_time()
        ck.write(tmp / "sync", trainer.global_step, ck.snapshot(model, trainer.opt, trainer.sched), {}, config)
        save_s, save_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        path = ck.latest_valid(tmp / "sync", config)
        t0 = time.perf_counter()
        ck.verify(path, config)
        verify_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        ck.load(path, model, trainer.opt, trainer.sched)
        load_s = time.perf_counter() - t0
        files = {str(p.relative_to(path)): p.stat().st_size for p in path.rglob("*") if p.is_file()}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = {
        "benchmark": "checkpoint", "model": SMOLLM2, "rounds": args.rounds, "steps_per_mode_per_round": args.steps,
        "step_batch": "8 groups x 8 samples, 60 prompt + 32 response tokens, micro-batch 8",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "by_torch_threads": by_threads,
        "sync_save_seconds": round(save_s, 2), "sync_save_cpu_seconds": round(save_cpu_s, 2),
        "verify_seconds": round(verify_s, 2), "load_seconds": round(load_s, 2),
        "bytes_per_checkpoint": sum(files.values()), "files": files,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({k: v for k, v in out.items() if k not in ("by_torch_threads", "files")}, indent=2))


if __name__ == "__main__":
    main()
