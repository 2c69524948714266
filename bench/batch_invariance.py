"""Does a prompt's sample depend on its batch mates at the torch actor? And what would one
generate() call per prompt (batch-invariant by construction) cost?

    flock /tmp/steadyrl-bench.lock .venv/bin/python bench/batch_invariance.py \\
        [--rounds 3] [--out bench/results/batch_invariance.json]

Part 1, SmolLM2-135M-Instruct's real weights (the chat template, temperature 1, 8 samples of 32
tokens, seed 11): one prompt alone, then with 1-2 mates of other lengths; the same tokens?
the largest log-prob difference of equal samples? Part 2, SmolLM2's shapes with random weights
(as bench/shared_prefill.py): 8 prompts x 8 samples x 32 tokens as one call of 64 sequences
(the actor's batch_size) against 8 calls of one prompt, modes alternating within each round.
Repeatability in docs/architecture.md cites both.
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


def mates() -> list[dict]:
    from steadyrl.generation import SamplingParams, TorchGenerator
    from steadyrl.models import load_policy

    model, tok = load_policy("smollm2-135m-instruct")
    gen = TorchGenerator(model, tok)
    texts = ["What is 12 + 35?", "Compute 7 * 8 and explain briefly.",
             "What is the capital of France? Answer in one word please.", "Hi"]
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                       tokenize=False), add_special_tokens=False)["input_ids"] for t in texts]
    sp = SamplingParams(n=8, max_new_tokens=32, temperature=1.0)
    alone = gen.generate([ids[0]], sp, seeds=[11])[0]
    rows = []
    for m in ([1], [1, 2], [2, 3], [3]):
        out = gen.generate([ids[0]] + [ids[i] for i in m], sp, seeds=[11] + [100 + i for i in m])[0]
        equal = [(a, b) for a, b in zip(alone, out, strict=True) if a.token_ids == b.token_ids]
        rows.append({"mates": [len(ids[i]) for i in m], "prompt_tokens": len(ids[0]), "same_samples": len(equal),
                     "samples": len(alone),
                     "max_abs_logprob_diff": max((abs(x - y) for a, b in equal
                                                  for x, y in zip(a.logprobs, b.logprobs, strict=True)), default=0.0)})
    return rows


def per_prompt_cost(rounds: int) -> dict:
    import scaling  # bench/scaling.py: the model shapes
    import torch

    from steadyrl.generation import SamplingParams, TorchGenerator
    from steadyrl.models import tiny_tokenizer

    model = scaling._model("smollm2-135m").eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 40, (int(torch.randint(40, 60, (1,), generator=g)),), generator=g).tolist()
               for _ in range(8)]
    sp = SamplingParams(n=8, temperature=1.0, max_new_tokens=32)
    seconds: dict[str, list[float]] = {"one_call": [], "per_prompt": []}
    tokens: dict[str, list] = {}
    for _ in range(rounds):
        for mode in seconds:
            gen = TorchGenerator(model, tiny_tokenizer(), batch_size=64)
            gen.eos_ids = {-1}
            t0 = time.perf_counter()
            if mode == "one_call":
                out = gen.generate(prompts, sp, seeds=list(range(8)))
            else:
                out = [gen.generate([p], sp, seeds=[i])[0] for i, p in enumerate(prompts)]
            seconds[mode].append(round(time.perf_counter() - t0, 3))
            tokens[mode] = [c.token_ids for group in out for c in group]
    same = sum(a == b for a, b in zip(tokens["one_call"], tokens["per_prompt"], strict=True))
    med = {k: statistics.median(v) for k, v in seconds.items()}
    return {"seconds": seconds, "median_s": med, "slowdown": med["per_prompt"] / med["one_call"],
            "same_samples": same, "samples": len(tokens["one_call"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import torch

    result = {"benchmark": "batch_invariance", "when": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "command": "flock /tmp/steadyrl-bench.lock .venv/bin/python bench/batch_invariance.py",
              "threads": torch.get_num_threads(), "with_mates": mates(), "per_prompt": per_prompt_cost(args.rounds)}
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)  # noqa: T201


if __name__ == "__main__":
    main()
