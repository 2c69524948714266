"""bench/gpu_check.py in its CPU smoke mode (`--device cpu --quick`): the tiny model's generation,
GRPO step and step timing pass, the OOM check is skipped for want of CUDA, and the JSON says so.
The GPU run itself (SmolLM2's shape, a real CUDA OOM) needs a machine this suite does not have."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.gpu_check import IdTokenizer, Report
from steadyrl.testing import REPO


def test_the_cpu_quick_mode_passes_and_skips_the_oom_check_without_cuda(tmp_path):
    out = tmp_path / "gpu_check.json"
    run = subprocess.run([sys.executable, "bench/gpu_check.py", "--device", "cpu", "--quick", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads(out.read_text())
    status = {c["name"]: (c["status"], c["reason"]) for c in doc["checks"]}
    for name in ("tiny/build", "tiny/generate", "tiny/grpo_step", "tiny/step_timing"):
        assert status[name][0] == "pass", status[name]
    assert status["oom_fallback"] == ("skip", "no CUDA")
    assert status["smollm2-shape"][0] == "skip"
    assert doc["passed"] and doc["exit_code"] == 0 and doc["aborted"] is None
    tiny = doc["figures"]["tiny"]
    assert tiny["generate"]["tokens_per_s"] > 0 and tiny["step"]["tokens_per_s"] > 0 and tiny["step"]["median_s"] > 0
    assert "PASSED (exit 0)" in run.stdout


def test_a_failed_check_exits_1_and_a_time_limit_skip_exits_2(tmp_path):
    r = Report(tmp_path / "x.json", time_limit=1.0)
    r.add("a", "pass", "ok")
    r.add("oom_fallback", "skip", "no CUDA")        # a skip by design does not fail the run
    assert r.exit_code() == 0
    r.add("b", "skip", "time limit", time_limit=True)
    assert r.exit_code() == 2
    r.add("c", "fail", "RuntimeError: boom")
    assert r.exit_code() == 1
    r.write()
    assert json.loads((tmp_path / "x.json").read_text())["passed"] is False


def test_the_stand_in_tokenizer_gives_what_the_torch_generator_reads():
    tok = IdTokenizer(49152, pad_token_id=2, eos_token_id=2, bos_token_id=1)
    assert (tok.pad_token_id, tok.eos_token_id, len(tok)) == (2, 2, 49152)
    assert tok.decode([1, 17, 5, 2], skip_special_tokens=True) == "17 5"
    assert tok.decode([17, 2]) == "17 2"


class FakeCudaMemory:
    """A pretend GPU memory for the control flow of the CUDA-only checks: a forward of n
    sequences needs n x 100 bytes; the filler (the uint8 tensor the check makes) takes its size
    off `free`; a forward that does not fit raises torch.OutOfMemoryError as CUDA would."""

    def __init__(self, torch, free: int = 10_000):
        self.torch, self.free, self.peak, self.filler = torch, free, 0, None

    def available(self) -> int:
        filler = self.filler() if self.filler is not None else None
        return self.free - (filler.numel() if filler is not None else 0)

    def hook(self, module, args, kwargs):
        need = kwargs["input_ids"].shape[0] * 100
        if need > self.available():
            raise self.torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {need} bytes (fake)")
        self.peak = max(self.peak, need)

    def install(self, monkeypatch):
        import weakref

        torch, real_empty = self.torch, self.torch.empty

        def empty(*a, **k):
            t = real_empty(*a, **k)
            if k.get("dtype") is torch.uint8:
                self.filler = weakref.ref(t)
            return t

        def reset():
            self.peak = 0

        monkeypatch.setattr(torch, "empty", empty)
        for name, fn in {"synchronize": lambda *a: None, "empty_cache": lambda: None,
                         "reset_peak_memory_stats": lambda *a: reset(), "memory_allocated": lambda *a: 0,
                         "memory_reserved": lambda *a: 0, "max_memory_allocated": lambda *a: self.peak,
                         "max_memory_reserved": lambda *a: self.peak,
                         "mem_get_info": lambda *a: (self.available(), self.free)}.items():
            monkeypatch.setattr(torch.cuda, name, fn)


def test_the_cuda_only_paths_on_a_fake_gpu_memory(tmp_path, monkeypatch):
    """What a real GPU run does after a plain step that fails (the step under `torch.device`),
    and the OOM check, driven on the CPU by a fake memory: the check's own logic, not CUDA's."""
    import argparse
    import contextlib

    import torch

    from bench import gpu_check
    from steadyrl.rl import trainer as trainer_mod

    fake = FakeCudaMemory(torch)
    fake.install(monkeypatch)
    report = Report(tmp_path / "fake.json", time_limit=120)
    checks = gpu_check.Checks(argparse.Namespace(device="cpu", dtype="float32"), report)
    checks.cuda = True   # take the GPU-only branches (the tensors stay on the CPU)

    # The plain step fails as a CPU-only batch would on a GPU; under the check's context it runs.
    inside = {"on": False}

    @contextlib.contextmanager
    def marked_context():
        inside["on"] = True
        try:
            yield
        finally:
            inside["on"] = False

    real_step = trainer_mod.Trainer.step

    def step(self, groups):
        if not inside["on"]:
            raise RuntimeError("Expected all tensors to be on the same device, but found cuda:0 and cpu (fake)")
        return real_step(self, groups)

    monkeypatch.setattr(trainer_mod.Trainer, "step", step)
    monkeypatch.setattr(checks, "default_device_context", marked_context)
    built = {}
    real_build = checks.build

    def build(which):
        model, tok = real_build(which)
        model.register_forward_pre_hook(fake.hook, with_kwargs=True)
        built["model"] = model
        return model, tok

    monkeypatch.setattr(checks, "build", build)
    got = checks.model_checks("tiny", gpu_check.QUICK)
    assert got is not None
    checks.oom_check("tiny", got)
    status = {c["name"]: (c["status"], c["reason"]) for c in report.checks}
    assert status["tiny/grpo_step"][0] == "fail" and "same device" in status["tiny/grpo_step"][1]
    assert status["tiny/grpo_step_default_device"][0] == "pass", status
    assert status["tiny/step_timing"][0] == "pass", status
    assert status["tiny/oom_fallback"][0] == "pass", status["tiny/oom_fallback"]
    oom = report.figures["tiny"]["oom"]
    n = 2 * 4   # QUICK: 2 prompts x 4 samples, one micro-batch; the fallback's is n // 4
    assert (oom["normal_peak_allocated_bytes"], oom["safe_peak_reserved_bytes"]) == (n * 100, n // 4 * 100)
    assert oom["filler_bytes"] == 10_000 - (n * 100 + n // 4 * 100) // 2
    assert oom["logged_error"].startswith("OutOfMemoryError: CUDA out of memory")
    assert oom["free_after_bytes"] == 10_000                # the filler was freed
    assert report.exit_code() == 1                          # the plain step's failure stands
