"""A prompt's samples share its prefill (issue 37): TorchGenerator computes each distinct
prompt's prefix once and repeats its KV cache for the prompt's n samples. The samples and
log-probs are those of prefilling every sample on its own."""

from __future__ import annotations

import pytest
import torch

from steadyrl.model.models import load_policy
from steadyrl.rl import generation
from steadyrl.rl.generation import SamplingParams, TorchGenerator


def _prompts(k: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, 40, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
            for _ in range(k)]


def _first_forward_rows(model) -> list[int]:
    """Batch sizes of the model's forward calls, recorded by a hook."""
    rows: list[int] = []
    model.register_forward_pre_hook(lambda _m, args, kwargs: rows.append(
        (kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]).shape[0]), with_kwargs=True)
    return rows


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_samples_of_a_shared_prefill_are_those_of_one_prefill_each(temperature):
    model, tok = load_policy("tiny", seed=0)
    prompts, params = _prompts(5), SamplingParams(n=4, temperature=temperature, max_new_tokens=6, seed=3)
    rows = _first_forward_rows(model)
    shared = TorchGenerator(model, tok).generate(prompts, params)
    assert rows[0] == 5 and rows[1] == 20   # the prefixes once each, then every sample from the last prompt token
    each = TorchGenerator(model, tok)
    each._shared_prefill = lambda *_a, **_k: None   # type: ignore[method-assign]
    alone = each.generate(prompts, params)
    for a, b in zip(shared, alone, strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) < 1e-5


def test_distinct_prompts_and_long_answers_prefill_as_before(monkeypatch):
    model, tok = load_policy("tiny", seed=0)
    rows = _first_forward_rows(model)
    TorchGenerator(model, tok).generate(_prompts(3), SamplingParams(n=1, temperature=1.0, max_new_tokens=2, seed=1))
    assert rows[0] == 3                                      # nothing repeats: generate()'s own prefill
    rows.clear()
    TorchGenerator(model, tok).generate(_prompts(1), SamplingParams(n=2, temperature=1.0, max_new_tokens=1, seed=1))
    assert rows[0] == 1
    monkeypatch.setattr(generation, "STATIC_CACHE_FROM", 2)   # long answers: a static cache, generate()'s prefill
    rows.clear()
    TorchGenerator(model, tok).generate(_prompts(2), SamplingParams(n=3, temperature=1.0, max_new_tokens=2, seed=1))
    assert rows[0] == 6
