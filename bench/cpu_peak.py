"""This machine's measured compute peak, and what the learner's update reaches of it.

    flock /tmp/steadyrl-bench.lock .venv/bin/python bench/cpu_peak.py [--out bench/results/cpu_peak.json]

The floors in docs/benchmarks.md divide a step's FLOPs by a peak. This measures the peak
instead of assuming one from the instruction set:

- the CPU's vector features (/proc/cpuinfo: avx2, avx512f, avx512_bf16, amx_bf16) and torch's
  dispatch level (`torch.backends.cpu.get_cpu_capability()`);
- a square fp32 and bf16 matmul (n = 2048; 2 n^3 FLOPs) at 1 and at all threads: the most a
  dense kernel gets here;
- one micro-batch of the learner's update on SmolLM2-135M-Instruct (8 sequences of 72 tokens:
  40 prompt, 32 response; forward + backward of the loss the trainer uses), fp32; under
  `torch.autocast("cpu", torch.bfloat16)` (issue 22's bf16 lever) only where bf16 matmuls are
  not slower than fp32 ones (without AVX-512 BF16 or AMX they are ~90x slower: then the bf16
  figure is the fp32 one scaled by the matmul ratio, and says so), with its FLOPs counted as
  6 x parameters x tokens (Kaplan et al. 2020, sec. 2.1: 2 N per token forward, 4 N
  backward; the tied LM head counted once, attention's n_ctx term under 3 % at 72 tokens).

Each figure is the median of `--repeats` timed runs after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FEATURES = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def cpu_features() -> dict:
    """Model name and the vector features this CPU reports (Linux /proc/cpuinfo)."""
    name, flags = platform.processor() or "?", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name in ("?", "") or line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return {"model_name": name, "cores": os.cpu_count(), "features": {f: f in flags for f in FEATURES}}


def _median_s(fn, repeats: int) -> tuple[float, list[float]]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def matmul(dtype, threads: int, repeats: int, n: int = 2048) -> dict:
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    med, times = _median_s(lambda: a @ b, repeats)
    return {"dtype": str(dtype).removeprefix("torch."), "threads": threads, "n": n, "median_s": med,
            "gflops": 2 * n ** 3 / med / 1e9, "times_s": times}


def update_microbatch(threads: int, repeats: int, bf16: bool) -> dict:
    """Forward + backward of one micro-batch of the trainer's GRPO loss on SmolLM2."""
    import torch

    from steadyrl.model.models import SMOLLM2, load_policy
    from steadyrl.rl import core

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, _ = load_policy(SMOLLM2)
    model.train()
    n, P, T = 8, 40, 32
    ids = torch.randint(1000, 2000, (n, P + T))
    mask = torch.ones(n, T)
    adv = torch.randn(n, 1).expand(n, T)

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=ids, use_cache=False).logits[:, P - 1:-1]        # (n, T, V)
            logp = core.token_logprobs(logits.float(), ids[:, P:], 1.0)               # (n, T)
        loss, _ = core.policy_loss(logp, logp.detach(), adv, mask, 0.2, 0.28, 3.0, "token-mean")
        loss.backward()

    med, times = _median_s(step, repeats)
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    flops = 6 * params * n * (P + T)
    return {"bf16_autocast": bf16, "threads": threads, "sequences": n, "tokens": n * (P + T), "params": params,
            "flops": flops, "median_s": med, "gflops": flops / med / 1e9, "times_s": times}


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench/results/cpu_peak.json"))
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    threads = sorted({1, cores})
    command = " ".join(["flock /tmp/steadyrl-bench.lock .venv/bin/python bench/cpu_peak.py", *sys.argv[1:]])
    result = {"benchmark": "cpu_peak", "command": command,
              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": cpu_features(),
              "torch": torch.__version__, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "matmul": [*(matmul(torch.float32, t, args.repeats) for t in threads),
                         # bf16 without AVX-512 BF16 / AMX runs ~1 GFLOP/s here: a smaller n, 2 repeats
                         *(matmul(torch.bfloat16, t, 2, n=1024) for t in threads)],
              "update_microbatch": [update_microbatch(cores, args.repeats, False)]}
    fp32 = max(m["gflops"] for m in result["matmul"] if m["dtype"] == "float32" and m["threads"] == cores)
    bf16 = max(m["gflops"] for m in result["matmul"] if m["dtype"] == "bfloat16" and m["threads"] == cores)
    feats = result["machine"]["features"]
    if feats["avx512_bf16"] or feats["amx_bf16"] or bf16 >= fp32:  # native bf16: the lever measured
        result["update_microbatch"].append(update_microbatch(cores, args.repeats, True))
    else:  # ~90x slower matmuls: not run, estimated from the fp32 update
        u = result["update_microbatch"][0]
        result["update_microbatch_bf16_estimate_s"] = u["median_s"] * fp32 / bf16
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for m in result["matmul"]:
        print(f"matmul {m['dtype']:>8} threads {m['threads']}: {m['gflops']:7.1f} GFLOP/s ({m['median_s']:.3f} s)")
    for u in result["update_microbatch"]:
        print(f"update micro-batch bf16={u['bf16_autocast']!s:5} threads {u['threads']}: {u['median_s']:.2f} s, "
              f"{u['gflops']:.1f} GFLOP/s")
    if "update_microbatch_bf16_estimate_s" in result:
        est = result["update_microbatch_bf16_estimate_s"]
        print(f"bf16 update micro-batch (estimated from the matmul ratio): {est:.0f} s")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
