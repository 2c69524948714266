"""The actor's settings: the `actor:` section of the service config (`ActorConfig`).

Every field's name and default is part of the config-file contract: a file written for an
earlier release must still load. Unknown keys are an error (`extra="forbid"`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field

from steadyrl.config import ServiceConfig
from steadyrl.local.stack import ActorStack, VLLMStack


class VLLMSection(VLLMStack):
    """The vLLM backend's engine settings (services/actor/vllm_engine.py VLLMSettings);
    `max_model_len` is steadyrl.local.stack's (`up` checks it against learner.max_new_tokens)."""

    model_config = ConfigDict(extra="forbid")

    dtype: Literal["auto", "bfloat16", "float32", "float16"] = Field(
        "auto", description="Engine dtype; auto: bfloat16 on a GPU or a CPU with native bf16, else float32.")
    kv_cache_gib: float | None = Field(1.0, gt=0, description="KV-cache size, GiB (CPU: host memory); "
                                                              "None: gpu_memory_utilization decides (GPU).")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="GPU: share of its memory vLLM may take.")
    max_num_seqs: int = Field(256, ge=1, description="Sequences in one engine batch at most.")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="Tokens in one engine step at most "
                                                                      "(longer prefills are chunked); None: vLLM's.")
    enforce_eager: bool = Field(True, description="No torch.compile / CUDA graphs (faster start).")
    cpu_threads_bind: str | None = Field(None, description="CPU: the engine worker's cores (vLLM's "
                                                          "VLLM_CPU_OMP_THREADS_BIND); None: every CPU on "
                                                          "machines of at most 4, else vLLM's auto.")


class ActorSection(ActorStack):
    """The actor's own settings, beside those shared: `model` and `backend` (steadyrl.local.stack's
    `ActorStack`: the learner and `up` read them too) and the request limits (`GenerationLimits`:
    the learner checks its data against them).

    Raises (at validation): an unknown `model` name (the service exits 2 at start)."""

    model_config = ConfigDict(extra="forbid")  # a typo is an error, not a silent default

    vllm: VLLMSection = VLLMSection()
    policy_root: Path = Field(Path(".steadyrl/policies"), description="Only weights under this folder are loaded.")
    batch_size: int = Field(64, ge=1, description="torch: sequences per generate() call at most.")
    generate_memory_mib: int = Field(2048, ge=16,
                                     description="torch: what one generate() call's sequences may take (KV cache, "
                                                 "prefill, sampling), MiB; long answers run in calls of fewer "
                                                 "than batch_size sequences to fit it.")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024,
                                description="Largest POST /generate body, bytes; larger gets 413 (8 MiB: ~100x a "
                                            "batch of 64 chat prompts).")
    max_concurrent: int = Field(16, ge=1,
                                description="POST /generate calls in progress at once (torch: generation is one "
                                            "at a time, the rest wait their turn; vllm: the engine batches them "
                                            "together); past it 503 with Retry-After.")
    body_timeout_s: float = Field(30.0, gt=0,
                                  description="Seconds a request body may take to arrive; slower gets 408.")


class ActorConfig(ServiceConfig):
    """The actor service's config: the common service settings plus `actor:`."""

    actor: ActorSection = ActorSection()
