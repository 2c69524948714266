"""GRPO on SmolLM2-135M-Instruct + the arithmetic set with the in-process reference loop.

    .venv/bin/python bench/smollm2_grpo.py [--steps 20] [--out bench/results/smollm2_grpo.json]

Writes the JSON (reward per step, test-split greedy accuracy before and after, seconds per
step, model load times without and with the safetensors cache) and a PNG curve beside it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def time_loads() -> dict:
    """Load SmolLM2 twice into an empty cache: GGUF conversion, then the safetensors cache."""
    from steadyrl.model.models import SMOLLM2, load_policy

    with tempfile.TemporaryDirectory() as tmp:
        old = os.environ.get("STEADYRL_CACHE")
        os.environ["STEADYRL_CACHE"] = tmp
        try:
            t0 = time.perf_counter()
            load_policy(SMOLLM2)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            load_policy(SMOLLM2)
            second = time.perf_counter() - t0
        finally:
            if old is None:
                del os.environ["STEADYRL_CACHE"]
            else:
                os.environ["STEADYRL_CACHE"] = old
    return {"first_load_from_gguf_s": round(first, 2), "second_load_from_safetensors_s": round(second, 2)}


def main() -> None:
    import torch

    from steadyrl.model.data import ARITHMETIC, read_parquet
    from steadyrl.model.models import SMOLLM2, load_policy
    from steadyrl.rl.loop import LoopConfig, evaluate, run_loop
    from steadyrl.rl.trainer import TrainConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-6)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--eval-limit", type=int, default=0, help="test rows (0: all)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/smollm2_grpo.json"))
    args = ap.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)

    loads = time_loads()
    print("load times", loads, flush=True)
    model, tok = load_policy(SMOLLM2)
    train = read_parquet(ARITHMETIC / "train.parquet")
    test = read_parquet(ARITHMETIC / "test.parquet")[: args.eval_limit or None]

    t0 = time.perf_counter()
    acc_before, _ = evaluate(model, tok, test, max_new_tokens=args.max_new_tokens)
    eval_s = time.perf_counter() - t0
    print(f"test accuracy before: {acc_before:.4f} ({len(test)} items, {eval_s:.0f}s)", flush=True)

    cfg = LoopConfig(steps=args.steps, prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                     max_new_tokens=args.max_new_tokens, scorer="numeric_match", seed=0,
                     train=TrainConfig(lr=args.lr, temperature=args.temperature, micro_batch_size=8))

    def show(step, m):
        print(f"step {step:3d}  reward {m['critic/score/mean']:.3f}  len {m['response_length/mean']:.1f}  "
              f"clip {m['actor/pg_clipfrac']:.3f}  grad {m['actor/grad_norm']:.2f}  {m['timing_s/step']:.1f}s",
              flush=True)

    t0 = time.perf_counter()
    hist = run_loop(model, tok, train, cfg, on_step=show)
    train_s = time.perf_counter() - t0
    acc_after, items = evaluate(model, tok, test, max_new_tokens=args.max_new_tokens)
    print(f"test accuracy after: {acc_after:.4f}", flush=True)

    n = len(test)
    # binomial standard error of the difference of two accuracies on the same n items
    se = ((acc_before * (1 - acc_before) + acc_after * (1 - acc_after)) / n) ** 0.5
    out = {
        "benchmark": "smollm2_grpo", "model": SMOLLM2, "data": "data/arithmetic (train/test parquet)",
        "config": cfg.model_dump(), "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                                "torch": torch.__version__, "device": "cpu"},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model_load": loads,
        "test_items": n, "test_accuracy_before": round(acc_before, 4), "test_accuracy_after": round(acc_after, 4),
        "accuracy_gain": round(acc_after - acc_before, 4), "gain_standard_error": round(se, 4),
        "reward_per_step": [round(h["critic/score/mean"], 4) for h in hist],
        "response_length_per_step": [round(h["response_length/mean"], 2) for h in hist],
        "seconds_per_step": round(train_s / len(hist), 2),
        "phase_seconds_mean": {k: round(sum(h.get(k, 0.0) for h in hist) / len(hist), 2)
                               for k in ("timing_s/gen", "timing_s/reward", "timing_s/old_log_prob",
                                         "timing_s/update_actor")},
        "eval_seconds": round(eval_s, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    plot(out, Path(args.out).with_suffix(".png"))
    print(json.dumps({k: v for k, v in out.items() if k != "config"}, indent=2))


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = out["reward_per_step"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(r) + 1), r, marker="o", label="train reward (mean of B x G samples)")
    ax.axhline(out["test_accuracy_before"], color="grey", ls="--",
               label=f"test acc before {out['test_accuracy_before']:.3f}")
    ax.axhline(out["test_accuracy_after"], color="green", ls="--",
               label=f"test acc after {out['test_accuracy_after']:.3f}")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward / accuracy")
    ax.set_title("SmolLM2-135M-Instruct, GRPO on arithmetic (CPU, in-process loop)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
