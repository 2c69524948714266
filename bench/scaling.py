"""How the torch actor's generation, the learner's update, a policy version and a record scale
with the answer length and the model.

    flock /tmp/steadyrl-bench.lock .venv/bin/python bench/scaling.py [--quick] [--out bench/results/scaling.json]

Every figure is measured in a fresh process (its RSS growth is the peak RSS, VmHWM, after the
phase minus the RSS before it, the peak reset there), on random weights in the shapes of real
configurations, made in code:

    tiny-v49k      hidden 64, 2 layers, SmolLM2's vocabulary (49 152): the vocabulary's cost alone
    smollm2-135m   SmolLM2-135M-Instruct's configuration (30 layers, hidden 576, GQA 9/3 heads)

- `generate`: one request of N answers of T tokens through `TorchGenerator` (the actor's
  path; EOS never ends an answer), with `actor.generate_memory_mib`'s default budget. Per
  generated token its time, beside the floor 2 x parameters FLOPs a token at this machine's
  measured fp32 peak (bench/results/cpu_peak.json; attention's T-dependent term not counted).
- `train`: one learner step (GRPO, AdamW) on N sequences of 16 prompt + T response tokens
  with `learner.train.max_tokens_per_micro_batch`'s default, beside 6 x parameters x tokens.
- `policy`: one version written with `policy_files.write_version` (safetensors + sha256) and
  read back with `read_version` (hash checked), in three layouts changed one thing at a time
  (one shard fsynced before the announcement, as before; shards of SHARD_BYTES; the fsync
  after the announcement, as the learner does now; two interleaved rounds, the faster kept),
  and the share of the weights' elements and bytes
  that one AdamW step at lr 1e-6 changes, in fp32 and after a cast to bf16 (what a delta
  would move).
- `record`: a RolloutGroup of 8 answers of T tokens through the codec (JSON), its size and
  encode + decode time.

`--quick` is the CI shape (tiny-v49k at 32 and 256 tokens, ~1 min); the whole grid ~20-30 min here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = {
    "tiny-v49k": {"vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 4},
    "smollm2-135m": {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3},
    "qwen2.5-0.5b": {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2},
    "qwen2.5-1.5b": {"vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2},
}
PROMPT = 16

# (phase, shape, T, N): N sequences of T answer tokens
FULL = [
    *[("generate", "tiny-v49k", t, 16) for t in (32, 256, 1024, 4096)],
    *[("generate", "smollm2-135m", t, n) for t, n in ((32, 16), (256, 16), (1024, 4), (4096, 2))],
    *[("train", "tiny-v49k", t, 8) for t in (32, 256, 1024, 4096)],
    *[("train", "smollm2-135m", t, n) for t, n in ((32, 8), (256, 8), (1024, 2), (4096, 1))],
    *[("generate", "qwen2.5-0.5b", t, n) for t, n in ((32, 16), (256, 4))],
    ("generate", "qwen2.5-1.5b", 32, 2),
    *[("train", "qwen2.5-0.5b", t, n) for t, n in ((32, 8), (256, 8))],
    ("policy", "smollm2-135m", 32, 8),
    ("policy", "qwen2.5-0.5b", 32, 8),
    ("policy", "qwen2.5-1.5b", 32, 8),
    *[("record", "smollm2-135m", t, 8) for t in (32, 1024, 8192)],
]
QUICK = [("generate", "tiny-v49k", 32, 16), ("generate", "tiny-v49k", 256, 16),
         ("train", "tiny-v49k", 32, 8), ("train", "tiny-v49k", 256, 8), ("record", "tiny-v49k", 1024, 8)]


def _model(shape: str):  # type: ignore[no-untyped-def]
    """Random weights in `shape` (steadyrl.model.models.tiny_config with its fields overridden)."""
    import torch
    from transformers import LlamaForCausalLM

    from steadyrl.model.models import tiny_config

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config(**SHAPES[shape], max_position_embeddings=PROMPT + 8192 + 16))


def _peak_reset() -> None:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux: clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def _rss_mb(field: str = "VmHWM") -> float:
    """This process's peak (VmHWM) or current (VmRSS) resident memory, MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _params(model) -> int:  # type: ignore[no-untyped-def]
    return sum(p.numel() for p in model.parameters())


def one(phase: str, shape: str, T: int, N: int) -> dict:
    """Run one cell in this process; its figures."""
    import torch

    from steadyrl.model.models import tiny_tokenizer
    from steadyrl.rl.generation import SamplingParams, TorchGenerator

    torch.set_num_threads(os.cpu_count() or 1)
    model = _model(shape)
    out: dict = {"phase": phase, "shape": shape, "T": T, "N": N, "params": _params(model)}
    _peak_reset()
    base = _rss_mb("VmRSS")
    out["rss_model_mb"] = base
    if phase == "generate":
        from steadyrl.services.actor.config import ActorSection

        section = ActorSection()   # the actor's defaults: batch_size, generate_memory_mib
        gen = TorchGenerator(model, tiny_tokenizer(), batch_size=section.batch_size,
                             memory_bytes=section.generate_memory_mib << 20)
        gen.eos_ids = {-1}
        out["rows_per_call"] = gen.rows_per_call(PROMPT + T)
        # each decode step's time, stamped by the sampler (called once a step): how a token's
        # cost moves with its position within one call, apart from the length asked for
        from steadyrl.rl import generation

        stamps: list[float] = []
        sample = generation.SeededSampler.__call__

        def stamped(self, input_ids, scores):  # type: ignore[no-untyped-def]
            stamps.append(time.perf_counter())
            return sample(self, input_ids, scores)

        generation.SeededSampler.__call__ = stamped  # type: ignore[method-assign]
        t0 = time.perf_counter()
        # N distinct prompts: no prefill is shared (TorchGenerator._shared_prefill), as before it
        res = gen.generate([[4 + i, *range(3, 2 + PROMPT)] for i in range(N)],
                           SamplingParams(n=1, temperature=1.0, max_new_tokens=T, seed=1))
        s = time.perf_counter() - t0
        assert all(len(g[0].token_ids) == T for g in res)
        out |= {"seconds": s, "ms_per_token": 1e3 * s / (N * T), "flops": 2 * out["params"] * N * T}
        if len(stamps) == T and T > 64:   # one call: steps 1..T-1 are decode steps (0 follows the prefill)
            w = min(256, T // 4)
            out["ms_per_token_first"] = 1e3 * (stamps[w] - stamps[1]) / ((w - 1) * N)
            out["ms_per_token_last"] = 1e3 * (stamps[-1] - stamps[-w]) / ((w - 1) * N)
            out["position_window"] = w
    elif phase == "train":
        from steadyrl.rl.trainer import Group, TrainConfig, Trainer

        g = torch.Generator().manual_seed(1)
        groups = [Group(list(range(3, 3 + PROMPT)), [torch.randint(4, 49152, (T,), generator=g).tolist()
                                                     for _ in range(2)], [0.0, 1.0]) for _ in range(N // 2 or 1)]
        groups = groups if N > 1 else [Group(list(range(3, 3 + PROMPT)), [torch.randint(4, 49152, (T,),
                                                                                         generator=g).tolist()], [1.0])]
        trainer = Trainer(model, 0, TrainConfig(lr=1e-6, micro_batch_size=8))
        out["rows_per_micro_batch"] = trainer.micro_rows(PROMPT + T)
        t0 = time.perf_counter()
        trainer.step(groups)
        s = time.perf_counter() - t0
        out |= {"seconds": s, "ms_per_token": 1e3 * s / (N * T), "flops": 6 * out["params"] * N * (PROMPT + T)}
    elif phase == "policy":
        import tempfile

        from steadyrl.rl.trainer import Group, TrainConfig, Trainer
        from steadyrl.run import policy_files
        from steadyrl.run.tensors import unique_tensors

        before = {k: v.detach().clone() for k, v in unique_tensors(model.state_dict()).items()}
        out["bytes"] = sum(v.numel() * v.element_size() for v in before.values())
        # one thing changed at a time: the layout before (one shard, fsynced before the
        # announcement), then shards of SHARD_BYTES, then the fsync after the announcement
        variants = {"one_shard_fsync": (1 << 62, True), "shards_fsync": (policy_files.SHARD_BYTES, True),
                    "shards_fsync_after": (policy_files.SHARD_BYTES, False)}
        default_shard = policy_files.SHARD_BYTES
        for name, (shard_bytes, durable) in [*variants.items(), *variants.items()]:   # two interleaved rounds
            policy_files.SHARD_BYTES = shard_bytes
            with tempfile.TemporaryDirectory(dir=ROOT / ".steadyrl" if (ROOT / ".steadyrl").is_dir() else None) as d:
                root, rel = Path(d), Path("r1/v000001")
                t0 = time.perf_counter()
                digest = policy_files.write_version(root, rel, before, durable=durable)
                write_s = time.perf_counter() - t0   # until it can be announced
                t0 = time.perf_counter()
                if not durable:
                    policy_files.sync_version(root, rel)
                sync_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                policy_files.read_version(root, str(rel), digest)
                read_s = time.perf_counter() - t0
                runs = out.setdefault(name, {"shards": len(list((root / rel).glob("*.safetensors"))), "rounds": []})
                runs["rounds"].append({"write_s": write_s, "sync_after_s": sync_s, "read_s": read_s})
                runs |= {k: min(r[k] for r in runs["rounds"]) for k in ("write_s", "sync_after_s", "read_s")}
        policy_files.SHARD_BYTES = default_shard
        out["write_s"], out["read_s"] = out["shards_fsync_after"]["write_s"], out["shards_fsync_after"]["read_s"]
        if out["params"] > 10**9:   # AdamW's state alone is ~24 GB at 1.5B: weight sync only
            return out | {"peak_rss_mb": _rss_mb(), "rss_growth_mb": _rss_mb() - base}
        g = torch.Generator().manual_seed(1)
        groups = [Group(list(range(3, 3 + PROMPT)), [torch.randint(4, 49152, (T,), generator=g).tolist()
                                                     for _ in range(2)], [0.0, 1.0]) for _ in range(N // 2)]
        Trainer(model, 0, TrainConfig(lr=1e-6, micro_batch_size=8)).step(groups)
        after = unique_tensors(model.state_dict())
        n = sum(v.numel() for v in before.values())
        fp32 = sum(int((before[k] != after[k]).sum()) for k in before)
        bf16 = sum(int((before[k].bfloat16() != after[k].bfloat16()).sum()) for k in before)
        out |= {"elements": n, "changed_fp32": fp32 / n, "changed_bf16": bf16 / n, "lr": 1e-6}
    elif phase == "record":
        from steadyrl.wire import codec
        from steadyrl.wire.contracts import Prompt, RolloutGroup, Sample

        p = Prompt(prompt_id="e0-i0", epoch=0, index=0, n_samples=N, max_new_tokens=T,
                   messages=[{"role": "user", "content": "x" * 200}])
        g = torch.Generator().manual_seed(1)
        group = RolloutGroup(prompt=p, policy_version=0, prompt_token_ids=list(range(3, 3 + PROMPT)), samples=[
            Sample(text="y" * (4 * T), token_ids=torch.randint(4, 49152, (T,), generator=g).tolist(),
                   logprobs=(-torch.rand(T, generator=g) * 5).tolist()) for _ in range(N)])
        t0 = time.perf_counter()
        value, headers = codec.encode(group)
        enc = time.perf_counter() - t0
        t0 = time.perf_counter()
        codec.decode(value, headers, RolloutGroup)
        dec = time.perf_counter() - t0
        out |= {"bytes": len(value), "encode_ms": 1e3 * enc, "decode_ms": 1e3 * dec}
        try:
            import zlib

            out["deflate_bytes"] = len(zlib.compress(value, 6))
        except ImportError:  # pragma: no cover - zlib is in the standard library
            pass
    out["peak_rss_mb"] = _rss_mb()
    out["rss_growth_mb"] = out["peak_rss_mb"] - base
    return out


def machine_floors() -> dict:
    """This machine's fp32 peak (cpu_peak.json), memory copy bandwidth and fsynced write rate."""
    import tempfile

    import torch

    peak = json.loads((ROOT / "bench/results/cpu_peak.json").read_text())
    gflops = max(m["gflops"] for m in peak["matmul"] if m["dtype"] == "float32")
    a = torch.empty(256 << 20, dtype=torch.uint8)
    b = torch.empty_like(a)
    b.copy_(a)
    t0 = time.perf_counter()
    for _ in range(4):
        b.copy_(a)
    copy = 4 * 2 * a.numel() / (time.perf_counter() - t0)      # read + write
    with tempfile.NamedTemporaryFile(dir=ROOT) as f:
        data = os.urandom(64 << 20)
        t0 = time.perf_counter()
        for _ in range(4):
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
        disk = 4 * len(data) / (time.perf_counter() - t0)
    return {"fp32_gflops": gflops, "memory_copy_gbps": copy / 1e9, "disk_write_gbps": disk / 1e9}


def table(result: dict) -> str:
    """The docs' tables (markdown) of a result."""
    rows, f = result["rows"], result["floors"]
    lines = [f"Floors: fp32 {f['fp32_gflops']:.1f} GFLOP/s, memory copy {f['memory_copy_gbps']:.1f} GB/s, "
             f"fsynced disk write {f['disk_write_gbps']:.2f} GB/s.", "",
             "| phase | model | T | N | rows a call / micro-batch | s | ms a token | first / last decode steps, "
             "ms a token | × floor | RSS growth, MB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["phase"] not in ("generate", "train"):
            continue
        if "error" in r:
            lines.append(f"| {r['phase']} | {r['shape']} | {r['T']} | {r['N']} | | {r['error'][:60]} | | | | |")
            continue
        per = r.get("rows_per_call", r.get("rows_per_micro_batch"))
        window = (f"{r['ms_per_token_first']:.2f} / {r['ms_per_token_last']:.2f} ({r['position_window']})"
                  if "ms_per_token_first" in r else "")
        lines.append(f"| {r['phase']} | {r['shape']} | {r['T']} | {r['N']} | {per} | {r['seconds']:.1f} | "
                     f"{r['ms_per_token']:.2f} | {window} | {r['vs_floor']:.1f} | {r['rss_growth_mb']:.0f} |")
    pol = [r for r in rows if r["phase"] == "policy" and "error" not in r]
    if pol:
        lines += ["", "| policy version | bytes | layout | shards | until announced, s | fsync after, s | "
                  "read + sha256, s |", "|---|---|---|---|---|---|---|"]
        for r in pol:
            for name, label in (("one_shard_fsync", "one shard, fsync, then announce (before)"),
                                ("shards_fsync", "shards, fsync, then announce"),
                                ("shards_fsync_after", "shards, announce, then fsync (now)")):
                v = r.get(name)
                if v:
                    lines.append(f"| {r['shape']} | {r['bytes'] / 1e6:.0f} MB | {label} | {v['shards']} | "
                                 f"{v['write_s']:.2f} | {v['sync_after_s']:.2f} | {v['read_s']:.2f} |")
        lines += ["", "| model | elements changed by one AdamW step, fp32 / bf16 |", "|---|---|"]
        lines += [f"| {r['shape']} | {100 * r['changed_fp32']:.1f} % / {100 * r['changed_bf16']:.1f} % "
                  f"(lr {r['lr']:g}) |" for r in pol if "changed_fp32" in r]
    recs = [r for r in rows if r["phase"] == "record" and "error" not in r]
    if recs:
        lines += ["", "| record: RolloutGroup of N answers | T | bytes (JSON) | deflated | encode, ms | decode, ms |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| N = {r['N']} | {r['T']} | {r['bytes']:,} | {r['deflate_bytes']:,} | {r['encode_ms']:.1f} | "
                  f"{r['decode_ms']:.1f} |" for r in recs]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the CI shape: tiny-v49k at 32 and 256 tokens")
    ap.add_argument("--out", type=Path, default=None, help="JSON result (default: print)")
    ap.add_argument("--table", type=Path, help="print the docs' tables of a result JSON and exit")
    ap.add_argument("--phase", choices=("generate", "train", "policy", "record"),
                    help="run only this phase's cells of the grid; with --out, replace that phase's rows in it")
    ap.add_argument("--shape", choices=SHAPES, help="with --phase: only this model's cells")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    if args.one:
        print(json.dumps(one(*json.loads(args.one))))
        return
    floors = machine_floors()
    rows = []
    cells = [c for c in (QUICK if args.quick else FULL) if args.phase in (None, c[0]) and args.shape in (None, c[1])]
    for cell in cells:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(cell)], capture_output=True, text=True,
                              cwd=ROOT)
        if proc.returncode != 0:
            row = {"phase": cell[0], "shape": cell[1], "T": cell[2], "N": cell[3],
                   "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
        else:
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            if "flops" in row:
                row["floor_s"] = row["flops"] / (floors["fp32_gflops"] * 1e9)
                row["vs_floor"] = row["seconds"] / row["floor_s"]
        row["wall_s"] = time.perf_counter() - t0
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    when = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    result = {"benchmark": "scaling", "command": "flock /tmp/steadyrl-bench.lock .venv/bin/python bench/scaling.py"
              + (" --quick" if args.quick else ""), "when": when, "cores": os.cpu_count(), "floors": floors,
              "rows": rows}
    if args.phase and args.out and args.out.is_file():   # one phase again: its rows replaced, the rest kept
        old = json.loads(args.out.read_text())
        again = {(r["phase"], r["shape"], r["T"]) for r in rows}
        old["rows"] = [r for r in old["rows"] if (r["phase"], r["shape"], r["T"]) not in again] + rows
        what = f" --phase {args.phase}" + (f" --shape {args.shape}" if args.shape else "")
        old.setdefault("rerun", {})[what.strip()] = {"when": when, "floors": floors,
                                                     "command": result["command"] + what}
        result = old
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
