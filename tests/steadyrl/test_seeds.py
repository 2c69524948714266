"""Issue 33: both actor engines reduce a prompt's seed the same way, through
steadyrl.rl.generation.engine_seed (mod 2**63). A learner.seed of ~1.85 million or more gives
prompt seeds >= 2**64 (steadyrl/rl/loop.py prompt_seed); the torch backend reduced them, the
vLLM one passed them on and torch.Generator refused them. The engine itself:
tests/integration/test_vllm_actor.py (needs .venv-vllm)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from steadyrl.model.models import load_policy
from steadyrl.rl.generation import SEED_MODULUS, SamplingParams, TorchGenerator, engine_seed, sample_seed
from steadyrl.rl.loop import prompt_seed
from steadyrl.services.actor.vllm_engine import request_kwargs

BIG = 2**64 + 5          # above what torch.Generator takes


def test_torch_generator_refuses_a_seed_of_2_64_the_bug():
    torch.Generator().manual_seed(2**64 - 1)
    with pytest.raises((ValueError, RuntimeError), match="Overflow"):
        torch.Generator().manual_seed(2**64)


def test_a_run_seed_of_1_85_million_makes_prompt_seeds_of_2_64():
    assert prompt_seed(1_840_000, 0, 0) < 2**64 <= prompt_seed(1_850_000, 0, 0)
    assert prompt_seed(20261203, 0, 0) > 2**67                 # a date as the seed (the case)


@pytest.mark.parametrize("seed, want", [
    (0, 0), (7, 7), (2**63 - 1, 2**63 - 1),                     # below 2**63: unchanged
    (2**63, 0), (BIG, 5), (2**64, 0), (3 * 2**63 + 9, 9),
    (10**400, 10**400 % 2**63),                                 # the contract has no upper bound
    (-1, 2**63 - 1),
    (np.int64(11), 11),
])
def test_engine_seed_is_mod_2_63(seed, want):
    got = engine_seed(seed)
    assert got == want and 0 <= got < SEED_MODULUS and type(got) is int


@pytest.mark.parametrize("bad", [1.5, "3", None])
def test_engine_seed_refuses_what_is_not_an_integer(bad):
    with pytest.raises(TypeError):
        engine_seed(bad)


def test_sample_seeds_are_those_before_the_reduction():
    """The torch backend's mix was already mod 2**63 and linear: reducing first changes no seed."""
    for s in (0, 3, 2**62 + 1, 2**63 - 1, 2**63, BIG, prompt_seed(20261203, 2, 17)):
        for j in (0, 1, 7, 1023):
            old = (s * 6364136223846793005 + 1442695040888963407 * (j + 1)) % (1 << 63)
            assert sample_seed(s, j) == old


@pytest.mark.parametrize("seed", [BIG, prompt_seed(20261203, 0, 3)])
def test_vllm_request_carries_the_reduced_seed_and_every_sample_seed_fits(seed):
    params = SamplingParams(n=1024, temperature=0.7, top_p=0.9, max_new_tokens=9)
    kw = request_kwargs(params, seed)
    assert kw["seed"] == engine_seed(seed) == seed % 2**63
    assert kw["seed"] != seed                                   # it was passed on as it is before
    # vLLM seeds sample i of the request's n with seed + i (vllm/v1/engine/parallel_sampling.py)
    for i in (0, params.n - 1):
        torch.Generator().manual_seed(kw["seed"] + i)
    assert (kw["n"], kw["temperature"], kw["top_p"], kw["max_tokens"], kw["logprobs"]) == (1024, 0.7, 0.9, 9, 0)


def test_vllm_request_keeps_small_seeds_and_none():
    params = SamplingParams(n=2)
    assert request_kwargs(params, 3)["seed"] == 3
    assert request_kwargs(params, 2**63 - 1)["seed"] == 2**63 - 1
    assert request_kwargs(params, None)["seed"] is None


def test_torch_backend_samples_a_seed_above_2_64_as_its_reduction():
    model, tok = load_policy("tiny", seed=0)
    gen = TorchGenerator(model, tok)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=6)
    prompt = [[5, 6, 7]]
    big = gen.generate(prompt, params, seeds=[BIG])
    small = gen.generate(prompt, params, seeds=[engine_seed(BIG)])
    other = gen.generate(prompt, params, seeds=[6])
    tokens = [[c.token_ids for c in g] for g in (big[0], small[0], other[0])]
    assert tokens[0] == tokens[1] and tokens[0] != tokens[2]
