"""The actor's request limits: which prompts it serves.

The actor enforces them on every `POST /generate` (services/actor/routes.py; the `actor:`
section: services/actor/config.py); the learner reads the same `actor:` section of the
stack's settings and checks its dataset against them at start (services/learner/rows.py), so
a prompt the actor would always refuse is reported and never published. One definition, two readers.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

#: Most completions one prompt of a `/generate` request may ask for (its `n`).
MAX_SAMPLES_PER_PROMPT = 256


class GenerationLimits(BaseModel):
    """What one `/generate` request may ask of the actor (the rest of the `actor:` section is
    ignored here: the learner reads only these), beside MAX_SAMPLES_PER_PROMPT."""

    model_config = ConfigDict(extra="ignore")

    max_new_tokens_limit: int = Field(1024, ge=1, description="Largest max_new_tokens a request may ask for.")
    max_sequences: int = Field(512, ge=1, description="Largest prompts x n per request.")
    max_prompt_tokens: int = Field(4096, ge=1,
                                   description="Longest prompt, in tokens (its prompt_ids, or its messages through "
                                               "the chat template); longer gets 422. Prompt + max_new_tokens must "
                                               "also fit the model's context (max_position_embeddings).")


def answer_length_refusal(max_new_tokens: int, limits: GenerationLimits) -> str | None:
    """Why the actor would refuse every prompt of a run asking for `max_new_tokens` (past
    `max_new_tokens_limit`), or None. `up` (steadyrl/local/stack.py) and the learner
    (services/learner/config.py) both refuse such a run at start with this message."""
    if max_new_tokens > limits.max_new_tokens_limit:
        return (f"learner.max_new_tokens {max_new_tokens} > actor.max_new_tokens_limit "
                f"{limits.max_new_tokens_limit}: the actor would refuse every prompt")
    return None


#: Bytes one sampled token takes in a RolloutGroup record (JSON: its id, its log-prob, its share
#: of the answer's text): 29.4 measured for 8 answers of 8 192 tokens (bench/scaling.py's
#: record rows, docs/scaling.md); 32 with a margin.
RECORD_BYTES_PER_TOKEN = 32


def group_record_refusal(group_size: int, max_new_tokens: int, max_record_bytes: int) -> str | None:
    """Why a group of `group_size` answers of `max_new_tokens` tokens would not fit one record of
    at most `max_record_bytes` (rl.rollouts' max_message_bytes, schemas/topics.yaml), or None.
    Estimated at RECORD_BYTES_PER_TOKEN; the learner refuses such a run at start (exit 2):
    otherwise every group of full-length answers would go to the DLQ as too large."""
    estimate = group_size * max_new_tokens * RECORD_BYTES_PER_TOKEN
    if estimate > max_record_bytes:
        return (f"learner.group_size {group_size} x learner.max_new_tokens {max_new_tokens}: a group of full-length "
                f"answers takes about {estimate / 2**20:.1f} MiB as one record ({RECORD_BYTES_PER_TOKEN} bytes a "
                f"token), above rl.rollouts' max_message_bytes of {max_record_bytes / 2**20:.1f} MiB "
                f"(schemas/topics.yaml); every such group would go to the DLQ: lower one of them")
    return None
