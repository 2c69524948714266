"""vLLM backend: runs only where CUDA and vLLM are present (the `gpu` extra)."""

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                                 reason="needs a CUDA GPU and vLLM (pip install -e '.[gpu]')")]


def test_vllm_generates_with_logprobs_and_reloads_weights():
    from steadyrl.generation import SamplingParams, VLLMGenerator
    from steadyrl.models import SMOLLM2, load_policy, smollm2_cached

    path = smollm2_cached()
    gen = VLLMGenerator(str(path), gpu_memory_utilization=0.3)
    _, tok = load_policy(SMOLLM2)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True)
    out = gen.generate([list(ids)], SamplingParams(n=4, temperature=1.0, max_new_tokens=8), seeds=[0])
    assert len(out) == 1 and len(out[0]) == 4
    c = out[0][0]
    assert len(c.token_ids) == len(c.logprobs) > 0 and all(lp <= 0 for lp in c.logprobs)
    model, _ = load_policy(SMOLLM2)
    gen.load_weights(model.state_dict())
