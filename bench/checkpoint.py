"""Checkpoint cost on SmolLM2-135M-Instruct: step time saving every step (async) vs never,
save and load seconds, bytes written.

    .venv/bin/python bench/checkpoint.py [--steps 4] [--out bench/results/checkpoint.json]

Each step is a real GRPO update on 8 groups x 8 samples of 32 tokens (fixed random token
responses, so generation is not timed). Runs `never`, `every step (async)`, then `never`
again, and reports the mean step time of each and the async overhead against the mean of
the two `never` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    import torch

    from steadyrl import checkpoint as ck
    from steadyrl.models import SMOLLM2, load_policy
    from steadyrl.rl.trainer import Group, TrainConfig, Trainer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "bench/results/checkpoint.json"))
    args = ap.parse_args()
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
        def steps(save: bool) -> list[float]:
            saver = ck.AsyncCheckpointer(tmp / "ckpt", config, keep=2)
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                trainer.step(groups)
                if save:
                    saver.save(trainer.global_step, model, trainer.opt, trainer.sched, {"global_step": trainer.global_step})
                times.append(time.perf_counter() - t0)
            saver.wait()
            return times

        steps(False)  # warm-up (allocations, optimizer state)
        never_a = steps(False)
        every = steps(True)
        never_b = steps(False)
        t0 = time.perf_counter()
        ck.write(tmp / "sync", trainer.global_step, ck.snapshot(model, trainer.opt, trainer.sched), {}, config)
        save_s = time.perf_counter() - t0
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
    mean = lambda xs: sum(xs) / len(xs)
    never = mean(never_a + never_b)
    out = {
        "benchmark": "checkpoint", "model": SMOLLM2, "steps_per_mode": args.steps,
        "step_batch": "8 groups x 8 samples, 60 prompt + 32 response tokens, micro-batch 8",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "step_seconds_never": round(never, 3), "step_seconds_every_step_async": round(mean(every), 3),
        "async_overhead_pct": round(100 * (mean(every) / never - 1), 2),
        "sync_save_seconds": round(save_s, 2), "verify_seconds": round(verify_s, 2), "load_seconds": round(load_s, 2),
        "bytes_per_checkpoint": sum(files.values()), "files": files,
        "raw": {"never_a": never_a, "every": every, "never_b": never_b},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({k: v for k, v in out.items() if k not in ("raw", "files")}, indent=2))


if __name__ == "__main__":
    main()
