"""Typed service configuration: defaults < YAML file < environment < CLI flags.

Every service defines one `ServiceConfig` subclass with its own section (e.g. `reward:`).
Environment variables are `STEADYRL_<FIELD>` and `STEADYRL_<SECTION>__<FIELD>`
(`STEADYRL_BOOTSTRAP` points everything at an existing cluster); CLI flags are kebab-case
(`--metrics-port`, `--reward.batch-size`); `--config FILE.yaml` names the YAML file.
A bad value stops the service at start with the field named (`ConfigError`).

One YAML file can configure the whole stack (`steadyrl up --config configs/tiny.yaml`):
each service reads the shared fields and its own section, and ignores the sections of the
other services (`STACK_SECTIONS`); any other unknown key is an error.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import socket
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator
from pydantic_core import ErrorDetails
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, YamlConfigSettingsSource

from steadyrl import verl
from steadyrl.assets import asset_dir
from steadyrl.bus.kafka import KafkaAuth

if TYPE_CHECKING:
    import httpx


class ConfigError(SystemExit):
    """Bad configuration; the message names each offending field. Exits with status 2.
    `lines`: one line per offending field (the message's, after its first line)."""

    def __init__(self, message: str, lines: list[str] | None = None):
        super().__init__(2)
        self.message = message
        self.lines = lines if lines is not None else [message]

    def __str__(self) -> str:
        return self.message


#: Top-level sections of a stack-wide YAML file; each service reads its own.
STACK_SECTIONS = frozenset({"actor", "rollout", "reward", "reward_server", "learner", "alertbridge",
                            "placement"})  # placement: read by `steadyrl up` (steadyrl/local/placement.py)


class _StackYaml(YamlConfigSettingsSource):
    """The YAML source, minus the other services' sections."""

    def __call__(self) -> dict[str, Any]:
        data = super().__call__()
        own = set(self.settings_cls.model_fields)
        return {k: v for k, v in data.items() if k in own or k not in STACK_SECTIONS}


def config_path(path: str | Path) -> Path:
    """The file a `--config` path names: `path` itself, except a relative `configs/...` path
    with no such file under the working folder, which is the copy steadyrl ships
    (`asset_dir("configs")`, e.g. configs/tiny.yaml) when that exists: the same rule as
    steadyrl.model.data.dataset_path for `data/...`. Nothing else is checked: the caller reports a
    missing file."""
    p = Path(path)
    if p.is_absolute() or p.exists() or not p.parts or p.parts[0] != "configs":
        return p
    shipped = asset_dir("configs").joinpath(*p.parts[1:])
    return shipped if shipped.is_file() else p


def read_token(path: Path | None) -> str | None:
    """The bearer token a token file holds (stripped), or None when `path` is None."""
    return path.read_text().strip() if path is not None else None


def check_token_file(path: Path | None) -> Path | None:
    """`path` as it is when it is None or names a readable file holding a token (a settings
    validator). Raises ValueError: the file cannot be read, or is empty."""
    try:
        token = read_token(path)
    except OSError as e:
        raise ValueError(f"cannot read the token file: {e.strerror}") from None
    if token == "":
        raise ValueError("the token file is empty")
    return path


def _default_instance() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class ServiceConfig(BaseSettings):
    """Settings every service shares."""

    model_config = SettingsConfigDict(env_prefix="STEADYRL_", env_nested_delimiter="__",
                                      cli_kebab_case=True, extra="forbid",
                                      nested_model_default_partial_update=True)

    bootstrap: str = Field("127.0.0.1:9092", description="Kafka bootstrap servers (host:port,...).")
    kafka: KafkaAuth = Field(default_factory=KafkaAuth,
                             description="This process's Kafka credentials (steadyrl.bus.kafka.KafkaAuth): "
                                         "PLAINTEXT by default; SASL_PLAINTEXT/SASL_SSL with a SCRAM username "
                                         "and password_file under ACLs (docs/deploy.md, Trust).")
    topic_prefix: str = Field("", description="Prefix of every topic name (isolates runs and tests).")
    instance_id: str = Field(default_factory=_default_instance,
                             description="Stable id of this instance; transactional.id derives from it.")
    metrics_host: str = Field("127.0.0.1", description="Bind address of /livez, /readyz, /metrics.")
    metrics_port: int = Field(0, ge=0, le=65535, description="Port of the HTTP server; 0 picks a free one.")
    metrics_interval: float = Field(5.0, gt=0, le=3600,
                                    description="Seconds between librdkafka statistics and process metrics.")
    liveness_timeout_s: float | None = Field(
        None, gt=0, description="/livez fails once the service's loop has not beaten its heartbeat for this long "
                                "(an orchestrator then restarts it). None: max(60, 6 x metrics_interval).")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["json", "text"] = "json"
    http_token_file: Path | None = Field(
        None, description="A file holding the stack's HTTP work token (a secret: never in the repo). When set, "
                          "the work routes (actor /generate, reward server /score) answer 401 without "
                          "`Authorization: Bearer <token>`, and the rollout and reward workers send it; /livez, "
                          "/readyz and /metrics stay open. The alert bridge refuses it: its routes take their "
                          "own token (alertbridge.token_file). None: no HTTP authentication (loopback).")

    http_token_proof: bool = Field(
        False, description="As a client of the work routes (a rollout or reward worker): prove the token of "
                           "http_token_file without sending it, and take an answer only with the server's proof "
                           "of it (steadyrl/httpproof.py): another process on the server's port gets no token and "
                           "cannot answer in its place. The servers take both; `steadyrl up` turns it on.")

    @field_validator("http_token_file")
    @classmethod
    def _token_file_readable(cls, path: Path | None) -> Path | None:
        return check_token_file(path)

    def http_token(self) -> str | None:
        """The bearer token of `http_token_file` (None: no HTTP authentication)."""
        return read_token(self.http_token_file)

    def http_auth_headers(self) -> dict[str, str]:
        """The headers a client of the stack's HTTP services sends: the bearer token, if any
        (none under http_token_proof: `http_auth` proves it instead)."""
        token = self.http_token()
        return {"Authorization": f"Bearer {token}"} if token and not self.http_token_proof else {}

    def http_auth(self) -> httpx.Auth | None:
        """The httpx auth of a client of the work routes under http_token_proof (the token
        proven both ways: steadyrl/httpproof.py ProvenToken); None otherwise."""
        token = self.http_token()
        if not token or not self.http_token_proof:
            return None
        from steadyrl.httpproof import ProvenToken  # lazy: only clients that prove a token

        return ProvenToken(token)

    yaml_file: ClassVar[Path | None] = None  # set by load() on a subclass; read by the source hook

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources = [init_settings, env_settings]
        if cls.yaml_file is not None:
            sources.append(_StackYaml(settings_cls, yaml_file=cls.yaml_file))
        return tuple(sources)


S = TypeVar("S", bound=ServiceConfig)


def _shown_input(err: ErrorDetails) -> str:
    """` (got <value>)` for a config error, except where the value may be a secret (an unknown
    key, i.e. a misspelt secret's name, or a field named like a secret, token, key or URL; not
    a count of tokens such as max_new_tokens) and for a whole section (a check across fields:
    its message names them). At most 200 characters."""
    name = str(err["loc"][-1]).lower() if err["loc"] else ""
    value = err.get("input")
    secret = re.search(r"secret|token(?!s)|passw|key|url", name)
    if err["type"] == "extra_forbidden" or secret or isinstance(value, dict):
        return ""
    shown = repr(value)
    return f" (got {shown if len(shown) <= 200 else shown[:197] + '...'})"


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (itself, or the one model of an Optional/union), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (Union, types.UnionType):
        models = [m for a in get_args(annotation) if (m := _model_of(a)) is not None]
        return models[0] if len(models) == 1 else None
    return None


def suggestion(cls: type[BaseModel], loc: tuple[str | int, ...]) -> str:
    """` (did you mean `<name>`?)` for an unknown key at `loc` (a pydantic error location in
    `cls`) close to a field of the model holding it (difflib); at the top of a service's
    config, the stack's sections count as well (`lerner` -> `learner`). "" when none is close."""
    model: type[BaseModel] | None = cls
    for part in loc[:-1]:
        field = model.model_fields.get(part) if model is not None and isinstance(part, str) else None
        model = _model_of(field.annotation) if field is not None else None
        if model is None:
            return ""
    assert model is not None
    names = set(model.model_fields) | (STACK_SECTIONS if len(loc) == 1 else set())
    close = difflib.get_close_matches(str(loc[-1]), sorted(names), n=1, cutoff=0.7)
    return f" (did you mean `{close[0]}`?)" if close else ""


def unknown_key_hint(cls: type[BaseModel], loc: tuple[str | int, ...]) -> str:
    """The hint for an unknown key at `loc` in `cls`: verl's name for one of ours (verl.hint),
    else the closest field's name (`suggestion`), else ""."""
    return verl.hint(loc) or suggestion(cls, loc)


def load(cls: type[S], argv: list[str] | None = None, prog: str | None = None) -> S:
    """Build `cls` from `--config FILE`, the environment and CLI flags in `argv`.

    Raises:
        ConfigError: a field failed validation (each is named with its message), or the
            YAML file is missing or not YAML.
    """
    argv = list(argv) if argv is not None else []
    if "-h" in argv or "--help" in argv:
        print("--config FILE.yaml    YAML settings (precedence: defaults < YAML < STEADYRL_* env < flags)")  # noqa: T201  --help
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=Path, default=None)
    known, rest = pre.parse_known_args(argv)
    if known.config is not None:
        known.config = config_path(known.config)   # configs/tiny.yaml from any folder: the shipped one
    if known.config is not None and not known.config.is_file():
        raise ConfigError(f"config file not found: {known.config}")

    class _Loaded(cls):  # type: ignore[misc,valid-type]
        model_config = SettingsConfigDict(cli_prog_name=prog or cls.__name__)

    _Loaded.yaml_file = known.config
    _Loaded.__name__ = cls.__name__

    try:
        loaded = _Loaded(_cli_parse_args=rest)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {known.config} is not valid YAML: {e}") from None
    except ValidationError as e:
        # a check across fields (a model validator) has no location: its message names the fields
        lines = [f"  {'.'.join(str(p) for p in err['loc']) or 'settings'}: {err['msg']}{_shown_input(err)}"
                 f"{unknown_key_hint(cls, err['loc']) if err['type'] == 'extra_forbidden' else ''}"
                 for err in e.errors()]
        where = f" (config file {known.config})" if known.config is not None else ""
        raise ConfigError(f"invalid {cls.__name__}{where}:\n" + "\n".join(lines), lines) from None
    return loaded
