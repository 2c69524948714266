"""Generation behind one interface: the torch backend here, the vLLM one in
services/actor/vllm_engine.py (it runs in the actor's own virtualenv).

    gen = TorchGenerator(model, tokenizer)
    out = gen.generate([[ids of prompt 1], [ids of prompt 2]], SamplingParams(n=8, max_new_tokens=16))
    out[i][j]  # Completion j of prompt i: token_ids, logprobs, text, finish_reason

Log-probabilities are those of the sampling distribution softmax(logits / temperature)
before top-p filtering, per generated token, in nats.

Sampling is reproducible per prompt: completion j of a prompt with seed s draws its tokens
from its own random stream (seeded from s and j), so it does not depend on which other
prompts share the batch. The Kafka pipeline (actor) and the in-process loop therefore
produce the same samples for the same prompt, seed and weights. The EOS token, when generated, is
the last entry of `token_ids` (the policy must learn to stop) but not part of `text`.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field

from steadyrl.rl import core


class SamplingParams(BaseModel):
    """How to sample. temperature 0 means greedy."""

    n: int = Field(1, ge=1, description="Completions per prompt.")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(64, ge=1)
    seed: int | None = Field(None, description="Seed of every prompt without its own (see generate's seeds).")


#: Seeds the engines are given are below this: 2**63.
SEED_MODULUS = 1 << 63


def engine_seed(seed: int) -> int:
    """A prompt's sampling seed as both actor engines take it: `seed mod 2**63`, in [0, 2**63 - 1].

    Prompt seeds have no upper bound (steadyrl/rl/loop.py prompt_seed is about
    run_seed * 1e13, so a learner.seed of ~1.85 million or more gives seeds >= 2**64), but
    `torch.Generator.manual_seed` refuses 2**64 and above ("Overflow when unpacking long
    long"). The torch backend (`sample_seed`) and the vLLM one
    (services/actor/vllm_engine.py `request_kwargs`) both reduce through this function;
    below 2**63 it is the identity, so the seeds of every run that worked before are
    unchanged. 63 bits, not 64: vLLM seeds sample i of a request's n with seed + i (its
    ParentRequest, vllm/v1/engine/parallel_sampling.py), and 2**63 + 1024 is still below 2**64.
    Python's `%` makes a negative seed non-negative too. Raises TypeError for what is not an
    integer (a float, a str; numpy integers are taken).
    """
    return operator.index(seed) % SEED_MODULUS


def sample_seed(prompt_seed: int, j: int) -> int:
    """Seed of completion j of a prompt seeded `prompt_seed` (a 63-bit mix, no collisions for small j).

    The prompt's seed goes through `engine_seed` first; the mix is linear mod 2**63, so the
    result is the one it was before that reduction came, for every seed."""
    s = engine_seed(prompt_seed)
    return (s * 6364136223846793005 + 1442695040888963407 * (j + 1)) % SEED_MODULUS


class SeededSampler:
    """A logits processor that samples each row from its own `torch.Generator`.

    Draws token ~ top-p(softmax(scores / temperature)) by inverse CDF with one uniform per
    row and step, and returns scores that are 0 at the drawn token and -inf elsewhere, so
    greedy decoding emits exactly the drawn tokens. Args: one seed per row (N,).

    `logprobs` gets, per step, the drawn token's log-probability under softmax(scores /
    temperature) before top-p, (N,) nats: what a request keeps is O(N·T), not the O(N·T·V)
    of transformers' `output_logits` (40 GB at 64 answers of 4 096 tokens and V = 49 152).
    """

    def __init__(self, seeds: list[int], temperature: float, top_p: float):
        self.gens = [torch.Generator().manual_seed(s) for s in seeds]
        self.temperature, self.top_p = temperature, top_p
        self.logprobs: list[torch.Tensor] = []                                   # T x (N,)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(scores.float() / self.temperature, dim=-1)            # (N, V)
        if self.top_p < 1.0:  # keep the smallest set of tokens whose mass reaches top_p
            sorted_p, order = probs.sort(dim=-1, descending=True)
            drop = (sorted_p.cumsum(-1) - sorted_p) >= self.top_p              # mass before token
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        u = torch.stack([torch.rand((), generator=g) for g in self.gens]).to(probs.device)  # (N,)
        cdf = probs.cumsum(-1)                                                  # (N, V)
        # right=True: u = 0 must not pick a leading zero-probability token
        token = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).clamp(max=probs.shape[-1] - 1)
        self.logprobs.append(core.token_logprobs(scores.unsqueeze(1), token, self.temperature).squeeze(1))  # (N,)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter(-1, token, 0.0)


class GreedyLogprobs:
    """A logits processor for greedy decoding: leaves the scores as they are (generate takes
    their argmax) and appends, per step, the argmax token's log-probability under
    softmax(scores), (N,) nats, to `logprobs` (O(N·T) kept, as `SeededSampler`)."""

    def __init__(self) -> None:
        self.logprobs: list[torch.Tensor] = []                                   # T x (N,)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        best = scores.argmax(dim=-1, keepdim=True)                              # (N, 1)
        self.logprobs.append(core.token_logprobs(scores.unsqueeze(1), best).squeeze(1))  # (N,)
        return scores


@dataclass
class Completion:
    token_ids: list[int]        # (T,)
    logprobs: list[float]       # (T,)
    text: str
    finish_reason: Literal["stop", "length"]


class Generator(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]: ...


#: From this many new tokens a generate() call preallocates its KV cache (transformers' static
#: cache) instead of growing it a token at a time (DynamicCache: a torch.cat of every layer's
#: keys and values each step, whose freed copies fragment the heap). SmolLM2's shapes, 2
#: answers of 1 536 tokens: RSS +539 MB -> +175 MB, 64.0 -> 60.1 ms a token; at 32 tokens the
#: static cache is ~18 % slower (16 answers: 8.3 -> 10.0 ms a token), so short answers keep the
#: dynamic one (bench/results/benchmarks-log.md, "Long answers").
STATIC_CACHE_FROM = 512


def sequence_bytes(config: Any, length: int, dtype_bytes: int = 4) -> int:
    """Bytes one sequence of `length` tokens (prompt + answer) takes while it is generated, an
    upper estimate: its KV cache, 2 · layers · kv_heads · head_dim · length · dtype_bytes; the
    prefill's activations, length · (intermediate + 4 · hidden) · 4; and one step's work on the
    vocabulary in the sampler, 8 float32 rows of V (logits, probabilities, their sort and CDF).

    `config` is a transformers model config (hidden_size, num_hidden_layers,
    num_attention_heads, vocab_size; num_key_value_heads, head_dim, intermediate_size when it
    has them)."""
    hidden, layers = int(config.hidden_size), int(config.num_hidden_layers)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    inter = int(getattr(config, "intermediate_size", None) or 4 * hidden)
    kv = 2 * layers * kv_heads * head_dim * length * dtype_bytes
    prefill = length * (inter + 4 * hidden) * 4
    return kv + prefill + 8 * int(config.vocab_size) * 4


def cache_argument(model: Any) -> str:
    """The name a transformers model's forward() takes its KV cache by: `cache` (transformers
    5.x) or `past_key_values` (before; still accepted there with a FutureWarning)."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


class TorchGenerator:
    """`transformers.generate` on a causal LM, batched with left padding.

    A request of N = prompts x n sequences runs as generate() calls of at most `batch_size`
    sequences, fewer where `memory_bytes` asks: a call takes `sequence_bytes` per sequence at
    the request's longest prompt plus max_new_tokens, so memory stays near the budget at any
    answer length (and the log-probs kept are O(N·T): `SeededSampler`).

    Args:
        model: a causal LM (its weights are read at each call: training updates show at once),
            a transformers PreTrainedModel with `generate`.
        tokenizer: with pad and EOS tokens set.
        batch_size: max sequences per generate() call.
        memory_bytes: what one call's sequences may take (KV cache, activations, sampling),
            bytes; None: no limit but batch_size. At least one sequence runs per call.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, batch_size: int = 64,
                 memory_bytes: int | None = None):
        self.model, self.tok, self.batch_size, self.memory_bytes = model, tokenizer, batch_size, memory_bytes
        self.eos_ids: set[int] = {tokenizer.eos_token_id}
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if gen_eos is not None:
            self.eos_ids |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos])

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: list[int | None] | None = None) -> list[list[Completion]]:
        """params.n completions of each prompt (token ids, (P_i,)).

        seeds: one per prompt (None entries: params.seed, else a draw from torch's global
        generator). Returns completions[i][j] for prompt i, sample j.
        """
        given = list(seeds) if seeds is not None else [None] * len(prompts)
        if len(given) != len(prompts):
            raise ValueError(f"{len(given)} seeds for {len(prompts)} prompts")
        drawn = [s if s is not None else params.seed if params.seed is not None
                 else int(torch.randint(0, 1 << 62, ())) for s in given]
        flat = [p for p in prompts for _ in range(params.n)]
        row_seeds = [sample_seed(s, j) for s in drawn for j in range(params.n)]
        rows = self.rows_per_call(max((len(p) for p in prompts), default=0) + params.max_new_tokens)
        done: list[Completion] = []
        for i in range(0, len(flat), rows):
            done += self._generate_batch(flat[i:i + rows], params, row_seeds[i:i + rows])
        return [done[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]

    def rows_per_call(self, length: int) -> int:
        """Sequences one generate() call runs for sequences of `length` tokens: batch_size, or
        fewer so that they fit memory_bytes (`sequence_bytes`), at least 1."""
        if self.memory_bytes is None:
            return self.batch_size
        config: Any = getattr(self.model, "config", None)
        dtype = next(self.model.parameters()).dtype
        per = sequence_bytes(config, length, torch.finfo(dtype).bits // 8)
        return max(1, min(self.batch_size, self.memory_bytes // per))

    def _shared_prefill(self, input_ids: torch.Tensor, attn: torch.Tensor) -> Any:
        """The KV cache of the rows of `input_ids` (N, P; left-padded, `attn` its mask) up to
        their last token, computed once per distinct row and repeated for its copies (a
        prompt's n samples), so a prompt's prefix is computed once, not n times; generate()
        then starts from the last prompt token. None when no row repeats (or P < 2): generate()
        prefills as usual. Positions are generate()'s (the mask's running count), so the
        cache is the one generate() would have built, up to floating-point order."""
        from transformers import DynamicCache  # lazy: heavy (transformers)

        N, P = input_ids.shape
        uniq, inverse = torch.unique(input_ids, dim=0, return_inverse=True)     # (U, P), (N,)
        if uniq.shape[0] == N or P < 2:
            return None
        first = torch.full((uniq.shape[0],), N, dtype=torch.long, device=input_ids.device)
        first.scatter_reduce_(0, inverse, torch.arange(N, device=input_ids.device), "amin")
        mask = attn[first]                                                       # (U, P)
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)       # (U, P)
        cache = DynamicCache(config=getattr(self.model, "config", None))
        self.model(input_ids=uniq[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1],
                   use_cache=True, **{cache_argument(self.model): cache})
        cache.reorder_cache(inverse)                                             # U -> N rows
        return cache

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams,
                        row_seeds: list[int]) -> list[Completion]:
        from transformers import LogitsProcessorList  # lazy: heavy (transformers); rl.loop, the vLLM actor import this

        device = next(self.model.parameters()).device
        P = max(len(p) for p in prompts)
        pad = self.tok.pad_token_id
        input_ids = torch.tensor([[pad] * (P - len(p)) + p for p in prompts], device=device)   # (N, P)
        attn = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts], device=device)
        greedy = params.temperature == 0.0
        was_training = self.model.training
        self.model.eval()
        chooser = GreedyLogprobs() if greedy else SeededSampler(row_seeds, params.temperature, params.top_p)
        lm: Any = self.model  # transformers' generate(), which nn.Module does not declare
        static = params.max_new_tokens >= STATIC_CACHE_FROM
        try:
            shared = None if static else self._shared_prefill(input_ids, attn)
            new = lm.generate(
                input_ids=input_ids, attention_mask=attn, max_new_tokens=params.max_new_tokens,
                do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=pad,
                logits_processor=LogitsProcessorList([chooser]), eos_token_id=sorted(self.eos_ids),
                cache_implementation="static" if static else None,
                **({cache_argument(self.model): shared} if shared is not None else {}),
            )[:, P:]                                                                 # (N, T)
        finally:
            self.model.train(was_training)
        logp = torch.stack(chooser.logprobs, dim=1)                                 # (N, T)
        result = []
        for row, lp in zip(new.tolist(), logp.tolist(), strict=True):
            end = next((j for j, t in enumerate(row) if t in self.eos_ids), None)
            reason: Literal["stop", "length"]
            if end is None:
                ids, lps, reason, text_ids = row, lp, "length", row
            else:
                ids, lps, reason, text_ids = row[:end + 1], lp[:end + 1], "stop", row[:end]
            result.append(Completion(ids, lps, self.tok.decode(text_ids, skip_special_tokens=True), reason))
        return result
