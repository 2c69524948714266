"""The learner's settings: its `learner:` section of the stack's YAML, and the datasets it names."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import ConfigDict, Field, field_validator, model_validator

from steadyrl.bus.topics import load_catalogue
from steadyrl.config import ServiceConfig
from steadyrl.local.limits import MAX_SAMPLES_PER_PROMPT, GenerationLimits, answer_length_refusal, group_record_refusal
from steadyrl.local.stack import LearnerStack
from steadyrl.model.data import (
    DATA_DIR,
    Beat,
    MemoryRows,
    Rows,
    RowSource,
    dataset_path,
    load_rows,
    open_source,
    tiny_copy_rows,
)
from steadyrl.model.rewards import resolve_scorer
from steadyrl.model.scorepool import ScoringLimits
from steadyrl.rl.trainer import TrainConfig
from steadyrl.run.checkpoint import CheckpointError
from steadyrl.run.signing import read_key

from .prompt_gate import PromptGateConfig
from .watch import WatchConfig

DEFAULT_EVAL_SPLITS = {"level04": "data/arithmetic/test_level04.parquet",
                       "level09": "data/arithmetic/test_level09.parquet"}


def check_dataset(v: str) -> str:
    """`v` if it names a dataset load_dataset can read: tiny_copy:N, or an existing .parquet/.jsonl file
    (a relative `data/...` path may name the copy shipped with steadyrl: steadyrl.model.data.dataset_path)."""
    if v.startswith("tiny_copy:"):
        n = v.split(":", 1)[1]
        if not n.isdigit() or int(n) < 1:
            raise ValueError(f"tiny_copy:N needs a row count N >= 1, got {n!r}")
        return v
    p = dataset_path(v)
    if p.suffix not in (".parquet", ".jsonl", ".json"):
        raise ValueError(f"{v}: expected a .parquet (verl) or .jsonl file, or tiny_copy:N")
    if not p.is_file():
        raise ValueError(f"{v}: no such file (relative paths start at {Path.cwd()}; data/... also at the "
                         f"data shipped with steadyrl, {DATA_DIR})")
    return v


def check_datasets(v: str | list[str]) -> str | list[str]:
    """`v` if each file it names passes check_dataset: one dataset, or several read as one (their
    rows concatenated in the order given); a list of one is that one (as a resume compares it)."""
    if isinstance(v, str):
        return check_dataset(v)
    if not v:
        raise ValueError("an empty list: give one dataset or several")
    files = [check_dataset(one) for one in v]
    return files[0] if len(files) == 1 else files


def data_label(spec: str | list[str]) -> str:
    """A dataset setting as a person reads it: the file, or the files joined by ', '."""
    return spec if isinstance(spec, str) else ", ".join(spec)


class LearnerSection(LearnerStack):
    """The learner's own settings (the defaults are `make run`: SmolLM2 on the arithmetic set),
    beside those `steadyrl up` and the actor read too (`LearnerStack`: model, max_staleness,
    world_size)."""

    model_config = ConfigDict(extra="forbid")  # a typo is an error, not a silent default

    data: str | list[str] = Field("data/arithmetic/train.parquet",
                                  description="verl parquet, JSONL, or tiny_copy:N; a list: several files, "
                                              "their rows concatenated in the order given.")
    eval_data: str | list[str] | None = Field("data/arithmetic/test.parquet",
                                              description="Greedy accuracy before and after training (None: "
                                                          "skip); a list as data.")
    eval_limit: int = Field(0, ge=0, description="Rows of eval_data, spread evenly (0: all).")
    # None, not the defaults, as the field's default: the config loader merges a value given
    # for a field into a dict default (steadyrl/config.py, partial updates of nested defaults),
    # so `eval_splits: {}` kept both default splits; None is replaced. `harder_splits` resolves it.
    eval_splits: dict[str, str] | None = Field(
        None, description="Harder test splits, name -> dataset (as eval_data): each is evaluated like eval_data, "
                          "greedy before and after, when eval_data is set; summary.json `eval_splits` "
                          "({}: none; unset: the same modules at entropy slices 4 and 9 of 20).")
    eval_splits_limit: int = Field(96, ge=0, description="Rows of each eval_splits dataset, spread evenly "
                                                         "(0: all).")
    eval_scorer: str = Field("numeric_match", description="Scorer of the evaluations (a registered name or "
                                                          "module:function), checked at start.")
    eval_max_new_tokens: int = Field(32, ge=1)
    steps: int = Field(20, ge=1, description="Policy updates; the learner exits when done.")
    prompts_per_step: int = Field(8, ge=1, description="B: groups per update.")
    # the prompt contract's bounds (steadyrl/wire/contracts.py Prompt): a value past them would make
    # every prompt record invalid, so it fails here, at start, naming the field
    group_size: int = Field(8, ge=1, le=1024, description="G: samples per prompt.")
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int = Field(0, ge=0, le=2**63 - 1, description="Prompt order, sampling seeds and the tiny model's init.")
    policy_root: Path = Field(Path(".steadyrl/policies"),
                              description="Weights are written under it (the actor's root).")
    keep_policies: int = Field(3, ge=2, description="Policy files kept per run (the newest; >= 2 so the one "
                                                   "state.json names survives a crash mid-step).")
    keep_earlier_runs: int = Field(1, ge=0, description="Earlier runs under policy_root that keep their newest "
                                                        "version (for steadyrl export); older runs are deleted "
                                                        "(steadyrl/run/policy_files.py prune).")
    state_dir: Path = Field(Path(".steadyrl/learner"), description="Run state, audit log and summary.")
    resume: str = Field("auto", description="auto: continue the unfinished run in state_dir from its newest "
                                            "valid checkpoint; never: always a new run; or a checkpoint folder.")
    on_finish: Literal["exit", "idle"] = Field(
        "exit", description="When the run is done: exit 0 (`steadyrl up`, compose), or idle and keep serving "
                            "/progress and the probes until stopped (a Kubernetes StatefulSet, which would "
                            "restart an exited learner into a new run).")
    checkpoint_every: int = Field(5, ge=1, description="Steps between checkpoints (also one on stop and at the end).")
    keep_checkpoints: int = Field(3, ge=1, description="Complete checkpoints kept per run.")
    checkpoint_key_file: Path | None = Field(
        None, description="A file holding the checkpoint signing key (a secret, at least 32 bytes: `openssl rand "
                          "-hex 32`), kept off the checkpoint volume (not under state_dir). When set, every "
                          "checkpoint is signed (manifest.sig, HMAC-SHA256 of its manifest) and a resume takes "
                          "only checkpoints signed with it. None: unsigned; a resume checks the hashes only.")
    stall_factor: float = Field(5.0, gt=0, description="Stalled (/readyz `progress`, steadyrl_learner_stalled): "
                                "waiting or training with prompts in flight and no step for longer than "
                                "max(stall_factor x the median seconds between the last 20 steps, stall_min_s).")
    stall_min_s: float = Field(120.0, ge=0, description="The least time without a step that counts as a stall.")
    prompt_max_refusals: int = Field(5, ge=1, description="A prompt sent back by rl.dlq this many times (each "
                                     "time published again with a new seed, after a backoff of 1, 2, 4, ... 60 s) "
                                     "is abandoned once prompt_min_refusal_s have also passed since its first "
                                     "refusal: recorded in <run>/abandoned.jsonl, counted, and its slot goes to the "
                                     "next row.")
    prompt_min_refusal_s: float = Field(60.0, ge=0, description="The least time from a prompt's first refusal "
                                        "to its abandonment (a refusal that lasts a moment, e.g. a reward server "
                                        "restarting, costs no prompt).")
    scorer_failure_limit: int | None = Field(
        None, ge=1, description="Groups in a row (each a generation of a prompt) on whose every sample the reward "
                                "scorer failed (rl.dlq reasons scorer_error, scorer_timeout, scorer_crash, "
                                "non_finite), with no group scored in between, after which the learner stops the "
                                "run with exit 2 naming the scorer, the kinds of failure and an example: a scorer "
                                "that fails on everything can never make a step. A group scored resets the count; "
                                "an open breaker or a reward server down never count. None: max(16, 2 x "
                                "prompts_per_step).")
    republish_factor: float = Field(5.0, gt=0, description="A prompt in flight, not refused, not waiting, for "
                                    "longer than max(republish_factor x the median seconds between the last 20 "
                                    "steps, republish_min_s) is published again with the same id: its records "
                                    "were lost (a topic's retention passed, a consumer group reset).")
    republish_min_s: float = Field(300.0, gt=0, description="The least time in flight before a prompt is "
                                   "published again (see republish_factor).")
    rollout_cache_max_file_bytes: int = Field(2 * 1024 ** 3, ge=1024,
                                              description="Size cap of one rollout-cache part file, bytes.")
    rollout_cache_max_bytes: int | None = Field(20 * 1024 ** 3, ge=1024, description="Total cap of the run's "
                                                "rollout cache, bytes: after each part is closed the oldest parts "
                                                "are deleted until the rest fit (None: no cap).")
    rollout_cache_retention_h: float | None = Field(None, gt=0, description="Rollout-cache parts older than this "
                                                    "many hours are deleted after each part is closed (None: "
                                                    "kept until the total cap).")
    cache_scored_weight: float = Field(1.0, ge=0, le=1,
                                       description="Scales the advantages of a cache-scored group (scored from a "
                                                   "similar prompt while the reward server was down): its share "
                                                   "of the policy-gradient signal. At 0 it adds no policy gradient; "
                                                   "its tokens still count in token-mean, entropy/KL and PPO's "
                                                   "value loss.")
    max_buffer_size: int = Field(64, ge=1, description="Scored groups waiting for an update at most; one more "
                                                       "evicts one (its prompt is published again).")
    buffer_eviction: Literal["fifo", "priority"] = Field(
        "fifo", description="fifo: the oldest goes; priority: the least mean |advantage| (no learning signal) goes.")
    trackers: list[Literal["console", "tensorboard", "mlflow", "wandb", "jsonl"]] = Field(
        ["jsonl"], description="Experiment trackers for the per-step metrics under verl's names (docs/trackers.md): "
                               "jsonl (<run>/metrics.jsonl), console, tensorboard, mlflow, wandb (the last three "
                               "need the `trackers` extra). One that fails logs one error and is off; training "
                               "goes on.")
    tracker_queue: int = Field(1000, ge=1, description="Calls (a step's figures, an artifact) each tracker other "
                                                      "than jsonl and console holds while it is behind; past it a "
                                                      "call is dropped and counted, the learner never waits "
                                                      "(docs/trackers.md).")
    tracker_timeout_s: float = Field(60.0, gt=0, description="A tracker call (other than jsonl's and console's) "
                                                             "running longer is reported hung and the learner goes "
                                                             "on without it; at the end the learner waits this long "
                                                             "at most for the trackers to finish.")
    tensorboard_dir: Path | None = Field(None, description="TensorBoard event files go in <tensorboard_dir>/<run_id> "
                                                            "(None: <run folder>/tensorboard).")
    mlflow_tracking_uri: str | None = Field(None, description="MLflow tracking URI (None: a local SQLite store, "
                                                               "<state_dir>/mlflow.db with artifacts in "
                                                               "<state_dir>/mlartifacts, every run of this state dir).")
    mlflow_experiment: str = Field("steadyrl", min_length=1, description="MLflow experiment of the runs.")
    wandb_project: str = Field("steadyrl", min_length=1, description="W&B project of the runs.")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="offline: files under <run folder>/wandb (`wandb sync` uploads them); online only "
                               "with WANDB_API_KEY set (else offline, with a warning).")
    reward_watch: WatchConfig = WatchConfig()
    prompt_gate: PromptGateConfig = PromptGateConfig()
    train: TrainConfig = TrainConfig(lr=1e-5, temperature=0.8, total_steps=20)

    @field_validator("data", "eval_data")
    @classmethod
    def _dataset_exists(cls, v: str | list[str] | None) -> str | list[str] | None:
        return v if v is None else check_datasets(v)

    @field_validator("eval_splits")
    @classmethod
    def _splits_exist(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        for name, spec in (v or {}).items():
            if not name or not name.replace("_", "").replace("-", "").isalnum():
                raise ValueError(f"eval_splits: name {name!r} is not letters, digits, '_' or '-'")
            try:
                check_dataset(spec)
            except ValueError as e:
                raise ValueError(f"eval_splits.{name}: {e}") from None
        return v

    @field_validator("trackers")
    @classmethod
    def _once_each(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(v))

    @field_validator("eval_scorer")
    @classmethod
    def _scorer_exists(cls, v: str) -> str:
        resolve_scorer(v)  # ValueError naming it: unknown name, or no such module or function
        return v

    @field_validator("train")
    @classmethod
    def _temperature_in_contract(cls, v: TrainConfig) -> TrainConfig:
        # the prompt contract's bound: every prompt record carries it (Prompt.temperature)
        if not 0 <= v.temperature <= 10:
            raise ValueError(f"temperature {v.temperature} is outside [0, 10] (the prompt contract's bound)")
        return v

    @model_validator(mode="after")
    def _key_readable_and_apart(self) -> LearnerSection:
        if self.checkpoint_key_file is None:
            return self
        try:
            read_key(self.checkpoint_key_file)
        except CheckpointError as e:
            raise ValueError(f"checkpoint_key_file: {e}") from None
        key, state = self.checkpoint_key_file.resolve(), self.state_dir.resolve()
        if key.is_relative_to(state):
            raise ValueError(f"checkpoint_key_file {self.checkpoint_key_file} is under state_dir {self.state_dir}: "
                             "a key kept beside the checkpoints signs nothing (keep it off the checkpoint volume)")
        return self

    def checkpoint_key(self) -> bytes | None:
        """The bytes of `checkpoint_key_file` (None: checkpoints are not signed)."""
        return read_key(self.checkpoint_key_file) if self.checkpoint_key_file is not None else None

    @model_validator(mode="after")
    def _buffer_holds_a_batch(self) -> LearnerSection:
        if self.max_buffer_size < self.prompts_per_step:
            raise ValueError(f"max_buffer_size {self.max_buffer_size} < prompts_per_step {self.prompts_per_step}: "
                             "the buffer could never hold a batch")
        return self

    @property
    def harder_splits(self) -> dict[str, str]:
        """eval_splits, or DEFAULT_EVAL_SPLITS where it is unset (None; see the field)."""
        return dict(DEFAULT_EVAL_SPLITS) if self.eval_splits is None else self.eval_splits

    def fingerprint(self) -> dict[str, Any]:
        """What a run cannot change on resume: model, data and the order and shape of batches."""
        return {"model": self.model, "data": self.data, "prompts_per_step": self.prompts_per_step,
                "group_size": self.group_size, "seed": self.seed, "algorithm": self.train.algorithm}


class LearnerConfig(ServiceConfig):
    """The learner process: the shared service settings, its own section, and the actor's
    request limits (the `actor:` section's `GenerationLimits`; the rest of it is ignored): the
    learner checks its data against them at start (services/learner/rows.py)."""

    learner: LearnerSection = LearnerSection()
    actor: GenerationLimits = GenerationLimits()
    reward_server: ScoringLimits = ScoringLimits()   # the evaluation scores the reward as the server does

    @model_validator(mode="after")
    def _actor_takes_the_prompts(self) -> LearnerConfig:
        lc, actor = self.learner, self.actor
        if (why := answer_length_refusal(lc.max_new_tokens, actor)) is not None:
            raise ValueError(why)
        most = min(MAX_SAMPLES_PER_PROMPT, actor.max_sequences)
        if lc.group_size > most:
            raise ValueError(f"learner.group_size {lc.group_size} > {most}, the most samples of one prompt the actor "
                             f"generates (actor.max_sequences {actor.max_sequences}, and "
                             f"{MAX_SAMPLES_PER_PROMPT} per prompt): it would refuse every prompt")
        catalogue = load_catalogue()
        record_bytes = min(catalogue[t].max_message_bytes for t in ("rl.rollouts", "rl.scored"))
        if (why := group_record_refusal(lc.group_size, lc.max_new_tokens, record_bytes)) is not None:
            raise ValueError(why)
        return self


def load_dataset(spec: str | list[str], lenient: bool = False) -> list[Any]:
    """Rows of `spec`: a file (see steadyrl.model.data.load_rows) or `tiny_copy:N`, or a list of them
    (rows concatenated in the order given); with `lenient`, a row that is not a prompt is a
    steadyrl.model.data.RowError at its index instead of an error. Typed list[Any] as
    steadyrl.model.data.load_rows types its rows: PromptRows (and RowErrors)."""
    if not isinstance(spec, str):
        return [row for one in spec for row in load_dataset(one, lenient)]
    if spec.startswith("tiny_copy:"):
        return tiny_copy_rows(int(spec.split(":", 1)[1]), seed=0)
    return load_rows(spec, lenient)


def open_dataset(spec: str | list[str], beat: Beat | None = None) -> Rows:
    """The dataset of `spec` (as load_dataset) indexed, each row read when asked for
    (steadyrl.model.data.Rows: what the learner serves, a dataset of any size); `beat` is called as a
    JSONL file is indexed. Raises as steadyrl.model.data.open_source."""
    sources: list[RowSource] = []
    for one in [spec] if isinstance(spec, str) else spec:
        if one.startswith("tiny_copy:"):
            sources.append(MemoryRows(tiny_copy_rows(int(one.split(":", 1)[1]), seed=0)))
        else:
            sources.append(open_source(one, beat))
    return Rows(sources)


_T = TypeVar("_T")


def spread(rows: Sequence[_T], limit: int) -> Sequence[_T]:
    """`limit` rows evenly spread over `rows` (all when limit is 0 or larger)."""
    if not limit or limit >= len(rows):
        return rows
    stride = len(rows) / limit
    return [rows[int(i * stride)] for i in range(limit)]
