"""The torch actor's memory at long answers: O(N·T) log-probs kept, calls split to a budget."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from steadyrl.model.models import tiny_config, tiny_model, tiny_tokenizer
from steadyrl.rl import generation
from steadyrl.rl.generation import SamplingParams, TorchGenerator, sequence_bytes
from tests.helpers import ROOT

# 16 answers of 512 tokens over SmolLM2's vocabulary: full-vocabulary logits kept per token
# (transformers' output_logits, stacked, scaled, log_softmax) were 4 x 16 x 512 x 49 152 x 4
# bytes = 6.4 GB at their peak; the sampled token's log-prob per step is 32 KB.
_LONG = """
import json, resource, torch
from steadyrl.rl.generation import SamplingParams, TorchGenerator
from steadyrl.model.models import tiny_config, tiny_tokenizer
from transformers import LlamaForCausalLM
torch.manual_seed(0)
model = LlamaForCausalLM(tiny_config(49152, max_position_embeddings=1024))
tok = tiny_tokenizer()
gen = TorchGenerator(model, tok)
gen.eos_ids = {-1}                                   # no answer stops early: all 512 tokens
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = gen.generate([[5, 6, 7]] * 4, SamplingParams(n=4, temperature=1.0, max_new_tokens=512, seed=1))
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"grew_mb": (after - before) / 1024, "lengths": [len(c.token_ids) for g in out for c in g],
                  "finite": all(lp <= 0.0 for g in out for c in g for lp in c.logprobs)}))
"""


def test_long_answers_keep_the_actor_s_memory_flat():
    proc = subprocess.run([sys.executable, "-c", _LONG], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["lengths"] == [512] * 16 and result["finite"]
    assert result["grew_mb"] < 500, result        # was ~6 400 MB with the logits kept


def _smollm2_shapes() -> LlamaConfig:
    """SmolLM2-135M's configuration (no weights)."""
    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192)


def test_sequence_bytes_counts_the_kv_cache_prefill_and_sampling():
    cfg = _smollm2_shapes()
    kv_per_token = 2 * 30 * 3 * 64 * 4                       # 46 080 bytes a token in float32
    assert sequence_bytes(cfg, 1000) == kv_per_token * 1000 + 1000 * (1536 + 4 * 576) * 4 + 8 * 49152 * 4
    assert sequence_bytes(cfg, 1000, dtype_bytes=2) < sequence_bytes(cfg, 1000)


def test_a_request_splits_into_calls_that_fit_the_memory_budget():
    model, tok = tiny_model(40, seed=0), tiny_tokenizer()
    gen = TorchGenerator(model, tok, batch_size=64, memory_bytes=None)
    assert gen.rows_per_call(4096) == 64
    budget = 3 * sequence_bytes(model.config, 100) + 1
    gen.memory_bytes = budget
    assert gen.rows_per_call(100) == 3 and gen.rows_per_call(10_000) == 1
    assert 3 < gen.rows_per_call(10) < 64        # shorter sequences: more of them per call


def test_splitting_a_request_does_not_change_its_samples():
    """Each sample draws from its own seeded stream, so 1 sequence per call and 64 per call
    give the same tokens and log-probs."""
    model, tok = tiny_model(40, seed=3), tiny_tokenizer()
    params = SamplingParams(n=4, temperature=0.8, top_p=0.9, max_new_tokens=6, seed=11)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    whole = TorchGenerator(model, tok, batch_size=64).generate(prompts, params)
    one = TorchGenerator(model, tok, batch_size=64, memory_bytes=1).generate(prompts, params)
    assert [[c.token_ids for c in g] for g in whole] == [[c.token_ids for c in g] for g in one]
    for g1, g2 in zip(whole, one, strict=True):
        for c1, c2 in zip(g1, g2, strict=True):
            assert torch.allclose(torch.tensor(c1.logprobs), torch.tensor(c2.logprobs), atol=1e-5)


def test_long_answers_preallocate_the_kv_cache_and_sample_the_same(monkeypatch):
    """From STATIC_CACHE_FROM new tokens the KV cache is transformers' static one; the samples
    are those of the dynamic cache (the same tokens, log-probs to float rounding)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(40, max_position_embeddings=1024))
    T = generation.STATIC_CACHE_FROM
    params = SamplingParams(n=3, temperature=0.9, max_new_tokens=T, seed=5)
    prompts = [[5, 6, 7], [8, 9]]
    gen = TorchGenerator(model, tiny_tokenizer())
    gen.eos_ids = {-1}
    calls = []
    real = model.generate

    def spy(*a, **kw):
        calls.append(kw.get("cache_implementation"))
        return real(*a, **kw)

    monkeypatch.setattr(model, "generate", spy)
    static = gen.generate(prompts, params)
    monkeypatch.setattr(generation, "STATIC_CACHE_FROM", 10**9)
    dynamic = gen.generate(prompts, params)
    assert calls == ["static", None]
    assert [[c.token_ids for c in g] for g in static] == [[c.token_ids for c in g] for g in dynamic]
    for g1, g2 in zip(static, dynamic, strict=True):
        for c1, c2 in zip(g1, g2, strict=True):
            assert len(c1.token_ids) == T
            assert torch.allclose(torch.tensor(c1.logprobs), torch.tensor(c2.logprobs), atol=1e-4)
