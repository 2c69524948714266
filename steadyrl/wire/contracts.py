"""Message contracts: the value of every record on every steadyrl topic.

Each contract is a pydantic model with a schema name and a `MAJOR.MINOR` version. The
`schema` header of a record is `name/vMAJOR.MINOR` (e.g. `prompt/v1.0`). A reader accepts
any minor version of its own major: minors only add optional fields, and unknown fields
are ignored. A new major means an incompatible change.

The JSON Schema of each model is checked in under `schemas/` (`steadyrl schemas export`
writes them; a test fails when a file and its model disagree).

Numbers are finite and bounded. Every float is finite (`Finite`: NaN and Infinity, as a JSON
literal, a string such as "nan" or a literal that overflows, are refused: `non_finite` in
steadyrl/wire/codec.py); token ids are in [0, 2**31 - 1] (`TokenId`: no vocabulary is larger, and
a larger id would overflow the int32/int64 tensors of every engine; whether an id is in the
model's vocabulary is the learner's check); counters, versions, offsets and timestamps are
int64 (`Int64`: a bigger integer overflows a metric's float or a tensor). These bounds came
in one minor of every contract (prompt 1.2, rollout_group 1.2, scored_group 1.2,
policy_update 1.3, dlq_record 1.2, quarantined_group 1.1, quarantine_decision 1.1). They
only refuse records no correct writer produces (the pydantic JSON of a NaN was `null`,
which never validated as a number; NaN and Infinity are not JSON), so they are not a new
major: a reader of any 1.x accepts every record of those minors, and a reader of these
minors accepts every correct record of an earlier one. Read them with this module's
minors to have the checks; an older reader still trains what they refuse.

A contract that embeds another moves its minor with the embedded one's (its JSON Schema
changes with it): rollout_group 1.3 (`engine`) is scored_group 1.3 and quarantined_group 1.2.

Behaviour log-probs are in [LOGPROB_MIN, LOGPROB_MAX] = [-1e5, 0.01] nats (`LogProb`; issue
33): rollout_group 1.4, scored_group 1.4, quarantined_group 1.3. One of -1e30, finite, made
an off-policy step NaN; the learner now clamps the log-ratio too (steadyrl/rl/core.py
policy_loss), and the bound makes such a record a DLQ record (`validation_failed`) instead.
Like the finite bounds it refuses only what no correct engine writes.

A prompt's attempt (issue 46): prompt 1.3 carries `attempt`, the learner's count of its
publishes of that prompt with a new seed, and so rollout_group 1.5, scored_group 1.5 and
quarantined_group 1.4 do (embedded); dlq_record 1.5 carries the attempt of the prompt the
refused record held (`codec.dlq_record` reads it from the record), so the learner counts a
refusal only for the attempt in flight (services/learner/dlq_check.py). Both optional: a
record of an earlier minor has none (None), and decodes as before.
"""

from __future__ import annotations

import time
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

INT64_MAX = 2**63 - 1
TOKEN_ID_MAX = 2**31 - 1

#: A float that is neither NaN nor +-Infinity.
Finite = Annotated[float, Field(allow_inf_nan=False)]
#: Lowest behaviour log-prob a record may carry, nats. A sampled token's log-prob is above
#: about -104 when the sampler draws from float32 probabilities (e^-103.3 is float32's smallest
#: positive: a token below it has probability 0 and is never drawn); an engine reporting
#: log-probs of another distribution than it sampled from (raw logits, another temperature)
#: can go lower, by the logit range over the temperature: a float32 log_softmax of logits with
#: std 100 reaches -1.8e3. -1e5 leaves a wide margin below both (-1e4 is accepted) and keeps what
#: the learner forms from log-probs finite in float32 (a square such as k2 = d^2 / 2 is 5e9, a
#: sum over 32768 tokens 3.3e9); -1e30 squared is inf. The loss no longer depends on it (the
#: log-ratio is clamped at +-20, steadyrl/rl/core.py policy_loss): it refuses a broken writer.
LOGPROB_MIN = -1e5
#: Highest: a log-prob is <= 0, and torch's (and vLLM's) log_softmax subtracts the max first,
#: so it never rounds above 0; log(p) of a probability that rounded above 1 does: by at most
#: log(1 + 2**-7) = 0.0078 in bfloat16 (its spacing above 1), 1.2e-7 in float32. 0.01 allows
#: that rounding from any engine; a larger positive value is not a rounding of a log-prob.
LOGPROB_MAX = 0.01
#: A behaviour log-prob: finite and in [LOGPROB_MIN, LOGPROB_MAX] nats.
LogProb = Annotated[float, Field(ge=LOGPROB_MIN, le=LOGPROB_MAX, allow_inf_nan=False)]
#: An integer that fits int64 (counters, versions, offsets, ms timestamps).
Int64 = Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]
#: A count, index or version: int64, never negative.
Count64 = Annotated[int, Field(ge=0, le=INT64_MAX)]
#: A token id: [0, 2**31 - 1]; the vocabulary bound is the model's (the learner checks it).
TokenId = Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]
#: Standard base64 (RFC 4648, padded), as base64.b64encode writes it.
BASE64_PATTERN = r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
SHA256_PATTERN = r"^[0-9a-f]{64}$"


def now_ms() -> int:
    """Wall-clock time in milliseconds since the epoch."""
    return int(time.time() * 1000)


class Contract(BaseModel):
    """Base of all message values. Subclasses set SCHEMA_NAME and SCHEMA_VERSION."""

    model_config = ConfigDict(extra="ignore", frozen=False)

    SCHEMA_NAME: ClassVar[str]
    SCHEMA_VERSION: ClassVar[str]  # "MAJOR.MINOR"

    @classmethod
    def schema_header(cls) -> str:
        """The `schema` header value, e.g. `prompt/v1.0`."""
        return f"{cls.SCHEMA_NAME}/v{cls.SCHEMA_VERSION}"

    @classmethod
    def major(cls) -> int:
        return int(cls.SCHEMA_VERSION.split(".")[0])


class ChatMessage(BaseModel):
    """One chat turn. `tool` (prompt 1.4): a tool's result, appended by an agent episode
    (steadyrl/model/agents.py); `name` names the tool."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    name: str | None = Field(default=None, max_length=256, description="The tool of a `tool` message.")

    @model_serializer(mode="wrap")
    def _without_unset_name(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """No `name` key when it is None: a one-turn prompt is written, hashed and sent to the
        actor (whose messages are string maps) exactly as before 1.4."""
        out: dict[str, Any] = handler(self)
        if out.get("name") is None:
            out.pop("name", None)
        return out


class Prompt(Contract):
    """One prompt on `rl.prompts`, with the number of samples wanted (key: prompt_id)."""

    SCHEMA_NAME: ClassVar[str] = "prompt"
    # 1.1: run_id, sampling settings, seed, min_policy_version; 1.2: finite temperature and
    # top_p, int64 epoch/index/created_ms/min_policy_version (refuses only what no writer makes);
    # 1.3: attempt; 1.4: the `tool` role and ChatMessage.name (agents)
    SCHEMA_VERSION: ClassVar[str] = "1.4"

    prompt_id: str = Field(min_length=1, max_length=256,
                           description="Deterministic id `{run_id}/e{epoch}-i{index}` (feeder) or caller-chosen.")
    epoch: Count64 = Field(description="Pass over the dataset this prompt belongs to.")
    index: Count64 = Field(description="Row of the dataset.")
    messages: list[ChatMessage] = Field(min_length=1, description="Chat to complete.")
    n_samples: int = Field(ge=1, le=1024, description="Completions wanted (GRPO group size).")
    data_source: str = Field(default="", description="verl `data_source`: picks the reward function.")
    ground_truth: str | None = Field(default=None, description="verl `reward_model.ground_truth`.")
    extra_info: dict[str, Any] = Field(default_factory=dict)
    created_ms: Int64 = Field(default_factory=now_ms, description="Feeder time, ms since epoch.")
    run_id: str = Field(default="", max_length=128,
                        description="Learner run that published it (ids sort in start order); empty: any run.")
    temperature: Finite = Field(default=1.0, ge=0.0, le=10.0, description="Sampling temperature (the learner's).")
    top_p: Finite = Field(default=1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(default=64, ge=1, le=32768)
    # Not bounded above: the feeder's seeds (steadyrl/rl/loop.py prompt_seed) pass 2**63 for a
    # large run seed, and both actor engines reduce them mod 2**63 with one function
    # (steadyrl/rl/generation.py engine_seed; torch.Generator refuses 2**64 and above).
    seed: int | None = Field(default=None, ge=0,
                             description="Sampling seed: same seed, weights, prompt -> same samples.")
    min_policy_version: Count64 = Field(default=0,
                                        description="Generate with this policy version of run_id or a newer one.")
    attempt: Count64 | None = Field(default=None, description=(
        "Times the learner published this prompt again with a new seed before this publish (0: its first "
        "seed); a refusal on rl.dlq names it. None: not set (a writer before 1.3, or not the learner's)."))


class Sample(BaseModel):
    """One completion of a prompt."""

    text: str
    token_ids: list[TokenId] = Field(description="Response token ids, (T,), each in [0, 2**31 - 1].")
    logprobs: list[LogProb] = Field(description="Behaviour-policy log-probabilities of token_ids, (T,), nats; "
                                                "finite, in [-1e5, 0.01] (1.4; before: finite).")
    finish_reason: Literal["stop", "length", "error"] = "stop"
    # rollout_group 1.6: multi-turn episodes (steadyrl/model/agents.py)
    loss_mask: list[Annotated[int, Field(ge=0, le=1)]] | None = Field(default=None, description=(
        "(T,): 1 on the policy's tokens, 0 on tool/environment tokens an episode appended; the learner "
        "trains only where 1, and logprobs count only there (0.0 elsewhere). None: all ones (one turn)."))
    turn_versions: list[Count64] | None = Field(default=None, description=(
        "Policy version of each assistant turn of an episode, in order; None: one turn (policy_version)."))

    @model_serializer(mode="wrap")
    def _one_turn_as_before(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """No `loss_mask` / `turn_versions` key when None: a one-turn sample is written exactly as
        before rollout_group 1.6."""
        out: dict[str, Any] = handler(self)
        for key in ("loss_mask", "turn_versions"):
            if out.get(key) is None:
                out.pop(key, None)
        return out

    @model_validator(mode="after")
    def _same_length(self) -> Sample:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"token_ids has {len(self.token_ids)} entries but logprobs has "
                             f"{len(self.logprobs)}; they must match")
        if self.loss_mask is not None and len(self.loss_mask) != len(self.token_ids):
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries for {len(self.token_ids)} tokens")
        return self


class RolloutGroup(Contract):
    """The n completions of one prompt on `rl.rollouts` (key: prompt_id)."""

    SCHEMA_NAME: ClassVar[str] = "rollout_group"
    # 1.1: rejected; 1.2: token ids in [0, 2**31 - 1], finite log-probs, at most 1024 samples
    # (Prompt.n_samples' bound), int64 version/time/counts (refuses only what no writer makes);
    # 1.3: engine; 1.4: log-probs in [LOGPROB_MIN, LOGPROB_MAX] (refuses only what no engine makes);
    # 1.5: prompt.attempt (prompt 1.3); 1.6: samples' loss_mask and turn_versions, the tool role (prompt 1.4)
    SCHEMA_VERSION: ClassVar[str] = "1.6"

    prompt: Prompt
    prompt_token_ids: list[TokenId] = Field(default_factory=list, description="Tokenized chat, (P,).")
    samples: list[Sample] = Field(min_length=1, max_length=1024)
    policy_version: Count64 = Field(description="Policy that generated every sample.")
    actor: str = Field(default="", description="Which actor instance answered.")
    generated_ms: Int64 = Field(default_factory=now_ms)
    rejected: dict[str, Count64] = Field(default_factory=dict,
                                         description="Samples the rollout gate removed, by reason (too_long, ...).")
    engine: str = Field(default="", max_length=64,
                        description="Generation engine that made the samples and their log-probs: torch or vllm "
                                    "(the learner's TIS correction follows it); empty: unknown (a worker before "
                                    "1.3).")

    @property
    def prompt_id(self) -> str:
        return self.prompt.prompt_id

    @property
    def oldest_version(self) -> int:
        """The oldest policy version that sampled any of the group's tokens: `policy_version`, or
        an episode's earlier turn (`Sample.turn_versions`). The learner's staleness bound counts
        from it (docs/agents.md)."""
        return min([self.policy_version, *(v for s in self.samples for v in s.turn_versions or ())])

    @property
    def newest_version(self) -> int:
        """The newest policy version that sampled any of the group's tokens (an episode's last
        turn, or `policy_version`): above the learner's step, weights a crash threw away."""
        return max([self.policy_version, *(v for s in self.samples for v in s.turn_versions or ())])

    def prompt_text(self) -> str:
        """The text the group's prompt is matched and scored on: its last user message."""
        users = [m.content for m in self.prompt.messages if m.role == "user"]
        return users[-1] if users else self.prompt.messages[-1].content


class RewardSource(StrEnum):
    """Where a reward came from."""

    rule = "rule"
    model = "model"
    cache = "cache"


class ScoredGroup(Contract):
    """A rollout group with one reward per sample, on `rl.scored` (key: prompt_id), and on
    `rl.releases` when `steadyrl quarantine release` puts a held group back."""

    SCHEMA_NAME: ClassVar[str] = "scored_group"
    # 1.1: group.rejected (rollout_group 1.1); 1.2: finite rewards and cache_similarity,
    # rollout_group 1.2's bounds, int64 scored_ms (refuses only what no writer makes);
    # 1.3: group.engine (rollout_group 1.3); 1.4: bounded log-probs (rollout_group 1.4);
    # 1.5: group.prompt.attempt (rollout_group 1.5); 1.6: loss masks (rollout_group 1.6)
    SCHEMA_VERSION: ClassVar[str] = "1.6"

    group: RolloutGroup
    rewards: list[Finite] = Field(description="One scalar reward per sample, (n,); finite.")
    reward_source: RewardSource
    scorer: str = Field(description="Scorer name and version, e.g. `rule:numeric_match@1`.")
    cache_similarity: Finite | None = Field(default=None, ge=0.0, le=1.0,
                                            description="Similarity of the prompt a cached reward came from.")
    reward_extra: list[dict[str, Any]] = Field(default_factory=list, max_length=1024,
                                               description="Per-sample extra fields a scorer returned.")
    scored_ms: Int64 = Field(default_factory=now_ms)

    @model_validator(mode="after")
    def _one_reward_per_sample(self) -> ScoredGroup:
        if len(self.rewards) != len(self.group.samples):
            raise ValueError(f"{len(self.rewards)} rewards for {len(self.group.samples)} samples")
        return self

    @property
    def prompt_id(self) -> str:
        return self.group.prompt.prompt_id


class PolicyUpdate(Contract):
    """A new policy version on `rl.policy` (compacted, constant key)."""

    SCHEMA_NAME: ClassVar[str] = "policy_update"
    # 1.1: run_id; 1.2: uri names a version folder; 1.3: int64 version/step/created_ms, uri
    # without control characters and at most 4096 long (a NUL made the actor's path
    # resolution raise ValueError) (refuses only what no writer makes); 1.4: high_water
    SCHEMA_VERSION: ClassVar[str] = "1.4"

    version: Count64
    step: Count64 = Field(description="Learner global step that produced it.")
    uri: str = Field(min_length=1, max_length=4096, pattern=r"^[^\x00-\x1f\x7f]+$",
                     description="The version's folder under the policy root (Hugging Face layout: "
                                 "model.safetensors.index.json and its shards, steadyrl/run/policy_files.py); "
                                 "before 1.2 one .safetensors file. No control characters.")
    sha256: str = Field(pattern=SHA256_PATTERN, description="Of the folder's index (which holds each "
                                                            "shard's); before 1.2 of the file.")
    created_ms: Int64 = Field(default_factory=now_ms)
    run_id: str = Field(default="", max_length=128,
                        description="Learner run; a later run's version 0 replaces any version of an earlier run.")
    high_water: Count64 = Field(default=0, description=(
        "The highest version of run_id any learner wrote (steadyrl/run/policy_files.py raise_high_water); "
        "above `version` after a learner resumed from an earlier checkpoint: the versions between were "
        "thrown away, and the actor serves prompts stamped with one of them with the version it serves. "
        "Before 1.4: 0."))


class DLQReason(StrEnum):
    """Why a record went to `rl.dlq`."""

    undecodable = "undecodable"              # not UTF-8 JSON
    missing_schema_header = "missing_schema_header"
    wrong_schema = "wrong_schema"            # another contract on this topic
    major_version_mismatch = "major_version_mismatch"
    validation_failed = "validation_failed"
    oversize = "oversize"
    handler_error = "handler_error"          # the stage's transform raised
    rejected = "rejected"                    # a data gate refused it
    # 1.1: a reader of 1.0 cannot name these, and still sees the record (key, topic, offset)
    non_finite = "non_finite"                # NaN or Infinity where a number must be finite
    invalid_tokens = "invalid_tokens"        # token ids the model cannot take (vocabulary, context)
    retries_exhausted = "retries_exhausted"  # failed its budget of tries while the dependency answered others
    output_oversize = "output_oversize"      # what it turned into is above the output topic's record limit
    # 1.3
    scorer_error = "scorer_error"            # the reward scorer raised on (or cannot take) items of the group
    # 1.4
    scorer_timeout = "scorer_timeout"        # the reward scorer did not return in time on items of the group
    scorer_crash = "scorer_crash"            # the reward scorer crashed its process on items of the group


class DLQRecord(Contract):
    """A record some stage could not accept, on `rl.dlq` (key: the original key)."""

    SCHEMA_NAME: ClassVar[str] = "dlq_record"
    # 1.1: reasons non_finite, invalid_tokens, retries_exhausted, output_oversize; 1.2: key_b64
    # and payload_b64 are base64, payload_sha256 is hex, int64 partition/offset/size/time
    # (refuses only what no writer makes); 1.3: reason scorer_error (a 1.2 reader counts the
    # record as unreadable, and still publishes its prompt again); 1.4: reasons scorer_timeout,
    # scorer_crash (the same for a 1.3 reader); 1.5: attempt (a 1.4 reader ignores it)
    SCHEMA_VERSION: ClassVar[str] = "1.5"

    reason: DLQReason
    error: str = Field(description="Human-readable detail naming what was expected and what came.")
    stage: str = Field(description="Service/instance that rejected it.")
    topic: str
    partition: Int64
    offset: Int64
    key_b64: str | None = Field(default=None, pattern=BASE64_PATTERN)
    schema_seen: str | None = Field(default=None, description="The `schema` header seen, if any.")
    payload_b64: str = Field(pattern=BASE64_PATTERN,
                             description="Original value (base64), truncated to codec.DLQ_PAYLOAD_LIMIT bytes.")
    payload_size: Count64 = Field(description="Original value size in bytes.")
    payload_sha256: str = Field(pattern=SHA256_PATTERN)
    payload_truncated: bool = False
    rejected_ms: Int64 = Field(default_factory=now_ms)
    attempt: Count64 | None = Field(default=None, description=(
        "The `attempt` of the prompt the refused record held (prompt 1.3: the prompt itself, a rollout group's "
        "or a scored group's prompt); the learner counts the refusal only for the attempt in flight. None: "
        "the record held none that could be read, or a writer before 1.5."))


class QuarantinedGroup(Contract):
    """One group of a batch the learner's reward watch held back instead of training, on
    `rl.quarantine` (key: batch_id). A batch of n groups is n records (index 0..n-1), so a
    record stays within one group's size. `steadyrl quarantine release` puts them on
    rl.releases."""

    SCHEMA_NAME: ClassVar[str] = "quarantined_group"
    # 1.1: finite watch figures, int64 step/index/count/time, index < count, scored_group 1.2's
    # bounds (refuses only what no writer makes); 1.2: group.group.engine (scored_group 1.3);
    # 1.3: bounded log-probs (scored_group 1.4); 1.4: group.group.prompt.attempt (scored_group 1.5);
    # 1.5: loss masks (scored_group 1.6)
    SCHEMA_VERSION: ClassVar[str] = "1.5"

    batch_id: str = Field(min_length=1, max_length=256, description="`{run_id}/q{step:06d}-{hash of its prompt ids}`: "
                                                                     "the same groups held again get the same id.")
    run_id: str = Field(max_length=128)
    step: int = Field(ge=1, le=INT64_MAX, description="The learner step this batch would have made.")
    index: Count64 = Field(description="This group's place in the batch.")
    count: int = Field(ge=1, le=INT64_MAX, description="Groups in the batch.")
    rules: list[str] = Field(min_length=1, description="Watch rules the batch tripped: variance, extremes.")
    var_ratio: Finite | None = Field(default=None, description="var(batch) / var(reference).")
    extreme_share: Finite | None = Field(default=None, description="Share of rewards above the reference q99.")
    ks_pvalue: Finite | None = Field(default=None, description="Two-sample KS p-value, batch vs reference.")
    group: ScoredGroup
    quarantined_ms: Int64 = Field(default_factory=now_ms)

    @model_validator(mode="after")
    def _index_in_batch(self) -> QuarantinedGroup:
        if self.index >= self.count:
            raise ValueError(f"index {self.index} is not below count {self.count}")
        return self


class QuarantineAction(StrEnum):
    release = "release"   # its groups go to rl.releases and are trained
    drop = "drop"         # never trained (the learner already published other prompts in their place)


class QuarantineDecision(Contract):
    """A person's decision on a quarantined batch, on `rl.quarantine` (key: batch_id)."""

    SCHEMA_NAME: ClassVar[str] = "quarantine_decision"
    SCHEMA_VERSION: ClassVar[str] = "1.1"  # 1.1: int64 decided_ms (refuses only what no writer makes)

    batch_id: str = Field(min_length=1, max_length=256)
    action: QuarantineAction
    by: str = Field(default="", max_length=256, description="Who decided (user@host).")
    note: str = Field(default="", max_length=4096)
    decided_ms: Int64 = Field(default_factory=now_ms)


class Episode(BaseModel):
    """One episode of a group in flight: the exact token ids so far and what each is."""

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far (the environment's).")
    prompt_ids: list[TokenId] = Field(min_length=1, description="(P,): the first turn's prompt, as the actor "
                                                                "tokenized it.")
    token_ids: list[TokenId] = Field(default_factory=list, description="(T,): every token after the prompt, "
                                                                       "model and tool/environment, in order.")
    logprobs: list[LogProb] = Field(default_factory=list, description="(T,): behaviour log-probs of model "
                                                                      "tokens, 0.0 on the others.")
    loss_mask: list[Annotated[int, Field(ge=0, le=1)]] = Field(default_factory=list,
                                                               description="(T,): 1 model token, 0 other.")
    turn_versions: list[Count64] = Field(default_factory=list, description="Policy version of each assistant turn.")
    text: str = Field(default="", description="The last assistant turn's text (scored when done).")
    finish_reason: Literal["stop", "length", "error"] = "stop"
    done: bool = False
    truncated: Literal["turns", "tokens", "time"] | None = Field(
        default=None, description="Why a done episode was cut short: max_turns, max_episode_tokens or "
                                  "episode_timeout_s; None: it ended by itself (or goes on).")
    reward: Finite | None = Field(default=None, description="The environment's reward, when it gave one.")
    env_state: Any = Field(default=None, description="The environment's JSON state (None: rebuilt from messages).")

    @model_validator(mode="after")
    def _aligned(self) -> Episode:
        if not len(self.token_ids) == len(self.logprobs) == len(self.loss_mask):
            raise ValueError(f"token_ids ({len(self.token_ids)}), logprobs ({len(self.logprobs)}) and loss_mask "
                             f"({len(self.loss_mask)}) must have one entry per token")
        return self


class EpisodeState(Contract):
    """A group of multi-turn episodes between two turns, on `rl.episodes` (key: prompt_id): a
    rollout worker reads it, runs one assistant turn and one tool/environment step of every
    unfinished episode, and writes the next state (or the finished RolloutGroup on
    rl.rollouts) in the transaction that commits this one (steadyrl/model/agents.py)."""

    SCHEMA_NAME: ClassVar[str] = "episode_state"
    # 1.1: episodes' truncated
    SCHEMA_VERSION: ClassVar[str] = "1.1"

    prompt: Prompt
    turn: Count64 = Field(description="Assistant turns done by every unfinished episode.")
    episodes: list[Episode] = Field(min_length=1, max_length=1024)
    engine: str = Field(default="", max_length=64)
    actor: str = Field(default="")
    started_ms: Int64 = Field(default_factory=now_ms)

    @property
    def prompt_id(self) -> str:
        return self.prompt.prompt_id


ALL_CONTRACTS: tuple[type[Contract], ...] = (Prompt, RolloutGroup, ScoredGroup, PolicyUpdate, DLQRecord,
                                             QuarantinedGroup, QuarantineDecision, EpisodeState)
