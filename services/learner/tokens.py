"""What token ids the learner's model can take: a group outside them would crash its forward
pass (and, read again after a restart, crash it again), so the intake sends it to rl.dlq as
`invalid_tokens` instead (services/learner/intake.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from steadyrl.wire.contracts import ScoredGroup

NO_LIMIT = 10 ** 9  # transformers' model_max_length when the tokenizer names none is int(1e30)


@dataclass(frozen=True)
class TokenLimits:
    """What token ids the model can take: ids in [0, vocab_size) (its embedding rows), and at
    most `context` tokens of prompt + response (the smaller of the config's
    max_position_embeddings and the tokenizer's model_max_length, where each names one;
    None: no limit known). `context_from` names where the limit comes from."""

    vocab_size: int
    context: int | None = None
    context_from: str = ""

    @classmethod
    def of(cls, model: Any, tokenizer: Any) -> TokenLimits:
        """The limits of `model` (a transformers causal LM: get_input_embeddings, config; Any, as
        transformers' own types are not read here) and its tokenizer."""
        rows = int(model.get_input_embeddings().weight.shape[0])
        found = []
        mpe = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        if isinstance(mpe, int) and mpe > 0:
            found.append((mpe, "max_position_embeddings"))
        mml = getattr(tokenizer, "model_max_length", None)
        if isinstance(mml, int) and 0 < mml < NO_LIMIT:
            found.append((mml, "the tokenizer's model_max_length"))
        context, source = min(found) if found else (None, "")
        return cls(rows, context, source)

    def _outside(self, ids: list[int]) -> tuple[int, int] | None:
        """(position, id) of the first id outside [0, vocab_size), or None."""
        if not ids or (min(ids) >= 0 and max(ids) < self.vocab_size):
            return None
        return next((i, t) for i, t in enumerate(ids) if not 0 <= t < self.vocab_size)

    def violation(self, sg: ScoredGroup) -> str | None:
        """Why the model cannot take `sg`'s token ids (naming the id or length and the limit),
        or None when it can."""
        prompt = sg.group.prompt_token_ids
        if not prompt:
            return "prompt_token_ids is empty (an update needs at least one prompt token)"
        vocab = f"outside the vocabulary [0, {self.vocab_size}) (the model's embedding rows)"
        if (bad := self._outside(prompt)) is not None:
            return f"prompt_token_ids[{bad[0]}] = {bad[1]} is {vocab}"
        for j, sample in enumerate(sg.group.samples):
            if (bad := self._outside(sample.token_ids)) is not None:
                return f"samples[{j}].token_ids[{bad[0]}] = {bad[1]} is {vocab}"
            n = len(prompt) + len(sample.token_ids)
            if self.context is not None and n > self.context:
                return (f"samples[{j}]: prompt {len(prompt)} + response {len(sample.token_ids)} = {n} tokens > "
                        f"context length {self.context} ({self.context_from})")
        return None
