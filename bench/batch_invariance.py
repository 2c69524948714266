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
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def mates() -> list[dict]:
    from steadyrl.model.models import load_policy
    from steadyrl.rl.generation import SamplingParams, TorchGenerator

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


def where() -> dict:
    """Which shapes change a row's float result (SmolLM2's weights, no sampling):

    - linear: row r of x[:M] @ W.T (x: 64 random rows, W: layer 0's gate_proj) against the same
      row computed among 64 rows, for M = 1 ... 32: 1 where it differs;
    - padded_length: the last position's logits of one 40-token prompt left-padded to P tokens,
      max |difference| against P = 48;
    - samples: one prompt's 8 samples (seed 11, 32 tokens) alone and with a mate of the same
      length (no padding): the samples whose log-probs differ, and from which token."""
    import torch

    from steadyrl.model.models import load_policy
    from steadyrl.rl.generation import SamplingParams, TorchGenerator

    model, tok = load_policy("smollm2-135m-instruct")
    model.eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, model.config.hidden_size, generator=g)                  # (64, H)
    W = model.model.layers[0].mlp.gate_proj.weight                              # (I, H)
    with torch.no_grad():
        full = x @ W.T                                                          # (64, I)
        linear = {M: [int(bool(((x[:M] @ W.T)[r] != full[r]).any())) for r in range(M)]
                  for M in (1, 2, 3, 4, 6, 8, 12, 16, 32)}
        prompt = torch.randint(0, model.config.vocab_size, (40,), generator=g).tolist()

        def last_logits(P: int) -> torch.Tensor:
            ids = torch.tensor([[tok.pad_token_id] * (P - 40) + prompt] * 8)   # (8, P)
            mask = (torch.arange(P) >= P - 40).long().expand(8, P)              # (8, P)
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            return model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits[0, -1]

        ref = last_logits(48)
        padded = {P: float((last_logits(P) - ref).abs().max()) for P in (40, 41, 44, 48, 56, 64)}
    texts = ["What is 12 + 35?", "Compute 7 * 8 and explain briefly."]          # 40 tokens each
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                       tokenize=False), add_special_tokens=False)["input_ids"] for t in texts]
    gen = TorchGenerator(model, tok)
    sp = SamplingParams(n=8, max_new_tokens=32, temperature=1.0)
    alone = gen.generate([ids[0]], sp, seeds=[11])[0]
    mated = gen.generate([ids[0], ids[1]], sp, seeds=[11, 101])[0]
    samples = []
    for j, (a, b) in enumerate(zip(alone, mated, strict=True)):
        diff = [abs(p - q) for p, q in zip(a.logprobs, b.logprobs, strict=False)]
        first = next((t for t, d in enumerate(diff) if d > 0), None)
        samples.append({"sample": j, "same_tokens": a.token_ids == b.token_ids, "first_differing_token": first,
                        "max_abs_logprob_diff": max(diff, default=0.0)})
    return {"linear_row_differs": linear, "padded_length_max_abs_diff_vs_48": padded,
            "prompt_tokens": [len(i) for i in ids], "samples_alone_vs_mate": samples}


def threads_cost(rounds: int) -> dict:
    """Seconds of part 2's one call (8 prompts x 8 samples x 32 tokens, SmolLM2's shapes) at 2
    and at 1 intra-op thread, alternating within each round: what a bit-repeatable actor costs."""
    import scaling  # bench/scaling.py: the model shapes
    import torch

    from steadyrl.model.models import tiny_tokenizer
    from steadyrl.rl.generation import SamplingParams, TorchGenerator

    model = scaling._model("smollm2-135m").eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 40, (int(torch.randint(40, 60, (1,), generator=g)),), generator=g).tolist()
               for _ in range(8)]
    sp = SamplingParams(n=8, temperature=1.0, max_new_tokens=32)
    before = torch.get_num_threads()
    seconds: dict[str, list[float]] = {"2": [], "1": []}
    try:
        for _ in range(rounds):
            for threads in seconds:
                torch.set_num_threads(int(threads))
                gen = TorchGenerator(model, tiny_tokenizer(), batch_size=64)
                gen.eos_ids = {-1}
                t0 = time.perf_counter()
                gen.generate(prompts, sp, seeds=list(range(8)))
                seconds[threads].append(round(time.perf_counter() - t0, 3))
    finally:
        torch.set_num_threads(before)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    return {"seconds_by_threads": seconds, "median_s": med, "slowdown_at_1": med["1"] / med["2"],
            "load_average_after": os.getloadavg()}


def per_prompt_cost(rounds: int) -> dict:
    import scaling  # bench/scaling.py: the model shapes
    import torch

    from steadyrl.model.models import tiny_tokenizer
    from steadyrl.rl.generation import SamplingParams, TorchGenerator

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
    ap.add_argument("--where", action="store_true",
                    help="only the shapes that change a row's result (where()), added to --out's JSON")
    args = ap.parse_args()
    import torch

    if args.where:
        result = json.loads(args.out.read_text()) if args.out and args.out.exists() else {}
        result["where"] = where()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)   # the same checks at one thread
        one = where()
        result["where"]["one_thread"] = {k: one[k] for k in ("linear_row_differs", "samples_alone_vs_mate")}
        torch.set_num_threads(threads)
        result["where"]["threads_cost"] = threads_cost(args.rounds)
        result["where_command"] = "flock /tmp/steadyrl-bench.lock .venv/bin/python bench/batch_invariance.py --where"
        result["where_when"] = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        text = json.dumps(result, indent=2)
        if args.out:
            args.out.write_text(text + "\n")
        print(json.dumps(result["where"]["threads_cost"], indent=2))  # noqa: T201
        return

    result = {"benchmark": "batch_invariance", "when": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "command": "flock /tmp/steadyrl-bench.lock .venv/bin/python bench/batch_invariance.py",
              "threads": torch.get_num_threads(), "with_mates": mates(), "per_prompt": per_prompt_cost(args.rounds)}
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)  # noqa: T201


if __name__ == "__main__":
    main()
