"""A prompt's prefill computed once for its n samples (TorchGenerator._shared_prefill) vs once
per sample, on the default run's generation shape.

    flock /tmp/steadyrl-bench.lock .venv/bin/python bench/shared_prefill.py [--rounds 3] \\
        [--out bench/results/shared_prefill.json]

SmolLM2-135M's shapes with random weights (bench/scaling.py `smollm2-135m`), 8 prompts of
40-59 tokens x 8 samples, 32 new tokens, temperature 1, one generate() call of 64 sequences
(the actor's batch_size), EOS never ends an answer. The two modes alternate within each round;
each round's seconds are kept, and the medians compared. The floor beside it: 2 x parameters
FLOPs for every prompt and answer token at this machine's fp32 peak (scaling.machine_floors),
prefill counted once per prompt (shared) or once per sample.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> None:
    import scaling  # bench/scaling.py: the model shapes and the machine's floors
    import torch

    from steadyrl.model.models import tiny_tokenizer
    from steadyrl.rl.generation import SamplingParams, TorchGenerator

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    model = scaling._model("smollm2-135m").eval()
    params_n = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 40, (int(torch.randint(40, 60, (1,), generator=g)),), generator=g).tolist()
               for _ in range(8)]
    sampling = SamplingParams(n=8, temperature=1.0, max_new_tokens=32, seed=1)
    seconds: dict[str, list[float]] = {"per_sample": [], "shared": []}
    for _ in range(args.rounds):
        for mode in seconds:
            gen = TorchGenerator(model, tiny_tokenizer(), batch_size=64)
            gen.eos_ids = {-1}
            if mode == "per_sample":
                gen._shared_prefill = lambda *_a, **_k: None  # type: ignore[method-assign]
            t0 = time.perf_counter()
            gen.generate(prompts, sampling)
            seconds[mode].append(time.perf_counter() - t0)
    gflops = scaling.machine_floors()["fp32_gflops"]
    prompt_tokens = sum(len(p) for p in prompts)
    answer_tokens = 8 * 8 * 32
    flops = {"per_sample": 2 * params_n * (8 * prompt_tokens + answer_tokens),
             "shared": 2 * params_n * (prompt_tokens + answer_tokens)}
    result = {"benchmark": "shared_prefill", "when": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "command": "flock /tmp/steadyrl-bench.lock .venv/bin/python bench/shared_prefill.py",
              "shape": {"model": "smollm2-135m", "prompts": 8, "n": 8, "prompt_tokens": prompt_tokens,
                        "max_new_tokens": 32},
              "seconds": seconds, "median_s": {k: statistics.median(v) for k, v in seconds.items()},
              "flops": flops, "fp32_gflops": gflops,
              "floor_s": {k: v / (gflops * 1e9) for k, v in flops.items()}}
    result["speedup"] = result["median_s"]["per_sample"] / result["median_s"]["shared"]
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
