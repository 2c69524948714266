"""Prometheus and Alertmanager configuration (compose/prometheus, compose/alertmanager; docs/alerts.md).

The real tools check them: `promtool check config`, `promtool test rules` (every alert's cases
in compose/prometheus/tests/), `amtool check-config` and `amtool config routes test`, and a real
Alertmanager on loopback shows the inhibitions: DataflowCollapse silences its parts, and a
ServiceDown of what the learner needs silences LearnerStalled. The binaries come from
the Debian packages prometheus and prometheus-alertmanager (.ci/run installs them). Without
them a test is skipped, except in CI (env CI set), where a missing binary fails.

The Kubernetes scrape config (deploy/k8s/prometheus/scrape-config.yaml) and its PodMonitor
alternative are checked too: promtool with the rules, and the relabelling played on the pods of
deploy/k8s/base, which must come out with the compose job names the rules select on.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import time

import httpx
import pytest
import yaml

from tests.helpers import ROOT, need_tool

PROM = ROOT / "compose" / "prometheus"
CONFIG = PROM / "prometheus.yml"
RULES = sorted((PROM / "rules").glob("*.yml"))
RULE_TESTS = sorted((PROM / "tests").glob("*.yml"))
AM_CONFIG = ROOT / "compose" / "alertmanager" / "alertmanager.yml"
K8S_BASE = ROOT / "deploy" / "k8s" / "base"
K8S_SCRAPE = ROOT / "deploy" / "k8s" / "prometheus" / "scrape-config.yaml"
K8S_PODMONITOR = ROOT / "deploy" / "k8s" / "prometheus" / "podmonitor.yaml"
SEVERITIES = {"P0", "P1", "P2", "P3"}
#: The parts DataflowCollapse inhibits (compose/alertmanager/alertmanager.yml).
COLLAPSE_PARTS = {"BreakerOpen", "ConsumerLagGrowing", "RolloutRestarting", "TrainBufferDropped"}
#: Everything DataflowCollapse inhibits: its parts, and the learner's stall it causes.
COLLAPSE_INHIBITS = COLLAPSE_PARTS | {"LearnerStalled"}
#: The alerts a person on call expects first (issue 18): a service down, the learner stalled, the
#: DLQ growing, checkpoints stale, non-finite steps.
ONCALL = {"ServiceDown", "LearnerStalled", "DLQGrowing", "CheckpointStale", "NonFiniteSteps"}
#: How to get promtool and amtool, for the tests that skip (locally) or fail (CI) without them.
PROMETHEUS_HINT = "apt-get install --no-install-recommends prometheus prometheus-alertmanager; .ci/run installs it"


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def shown(r: subprocess.CompletedProcess) -> str:
    return f"exit {r.returncode}\n--- stdout\n{r.stdout[-6000:]}\n--- stderr\n{r.stderr[-6000:]}"


def alerts() -> list[dict]:
    return [rule for f in RULES for g in yaml.safe_load(f.read_text())["groups"] for rule in g["rules"]
            if "alert" in rule]


def test_prometheus_config_is_valid_and_loads_every_rule_file():
    r = run(need_tool("promtool", PROMETHEUS_HINT), "check", "config", str(CONFIG.relative_to(ROOT)))
    assert r.returncode == 0, shown(r)
    out = r.stdout + r.stderr
    # rule_files are resolved relative to the config file: each one must have been found
    assert f"{len(RULES)} rule files found" in out, shown(r)
    for f in RULES:
        assert f.name in out, (f.name, shown(r))


def test_alert_rules_pass_their_promtool_tests():
    assert RULE_TESTS, "no promtool tests in compose/prometheus/tests"
    r = run(need_tool("promtool", PROMETHEUS_HINT), "test", "rules", *(str(t.relative_to(ROOT)) for t in RULE_TESTS))
    assert r.returncode == 0, shown(r)


def test_every_alert_has_a_severity_annotations_and_cases_that_fire_and_stay_quiet():
    fires, quiet = set(), set()
    for t in RULE_TESTS:
        for case in yaml.safe_load(t.read_text())["tests"]:
            for a in case.get("alert_rule_test", []):
                (fires if a.get("exp_alerts") else quiet).add(a["alertname"])
    names = {a["alert"] for a in alerts()}
    assert {"CPUBound", "KLDrift", "MemoryLeak", "RewardStdHigh", "ConsumerLagGrowing", "BreakerOpen",
            "DataflowCollapse"} | COLLAPSE_PARTS | ONCALL <= names
    for a in alerts():
        assert a["labels"]["severity"] in SEVERITIES, a["alert"]
        assert a["annotations"]["summary"] and a["annotations"]["description"], a["alert"]
    assert names <= fires, f"alerts never shown firing in a test: {sorted(names - fires)}"
    assert names <= quiet, f"alerts never shown quiet in a test: {sorted(names - quiet)}"
    assert [a["labels"]["severity"] for a in alerts() if a["alert"] == "DataflowCollapse"] == ["P0"]


def test_service_down_watches_every_scrape_job():
    """ServiceDown's job list is exactly the jobs compose (and so Kubernetes) scrapes: a new
    service without it would never be reported down."""
    (rule,) = [a for a in alerts() if a["alert"] == "ServiceDown"]
    (jobs,) = re.findall(r'\bup\{job=~"([^"]+)"\}', rule["expr"])
    assert set(jobs.split("|")) == compose_jobs()


def test_every_metric_the_rules_read_is_exported_by_the_code():
    """A renamed metric would leave a rule silently empty: each name an expression reads is
    registered somewhere under steadyrl/ or services/ (counters without `_total`), or comes
    from prometheus_client's process collector or Prometheus itself."""
    source = "\n".join(p.read_text() for d in ("steadyrl", "services") for p in (ROOT / d).rglob("*.py"))
    builtin = {"up", "process_cpu_seconds_total", "process_resident_memory_bytes", "process_start_time_seconds"}
    used = set()
    for f in RULES:
        for g in yaml.safe_load(f.read_text())["groups"]:
            for rule in g["rules"]:
                expr = re.sub(r"\b\w+:\w+:\w+\b", " ", rule["expr"])      # recording rule names
                expr = re.sub(r'"[^"]*"', '""', expr)                      # label values
                used |= set(re.findall(r"\b(?:steadyrl_\w+|process_\w+|up)\b(?=\s*[{\[)]|\s*$|\s)", expr))
    assert used
    missing = [m for m in sorted(used - builtin) if f'"{re.sub(r"_total$", "", m)}"' not in source]
    assert not missing, f"rules read metrics no service registers: {missing}"


# ------------------------------------------------------------------------------- Kubernetes

def compose_jobs() -> set[str]:
    return {j["job_name"] for j in yaml.safe_load(CONFIG.read_text())["scrape_configs"]}


def rule_jobs() -> set[str]:
    """The job names the rules select on (job="rollout", ...)."""
    return {m for f in RULES for m in re.findall(r'\bjob\s*=\s*"([^"]+)"', f.read_text())}


def k8s_pods() -> tuple[str, list[dict]]:
    """The namespace and the pod templates of deploy/k8s/base, as kustomize renders them: the
    kustomization's namespace, and its common labels where it puts them on templates."""
    kz = yaml.safe_load((K8S_BASE / "kustomization.yaml").read_text())
    common = {k: v for entry in kz.get("labels", []) if entry.get("includeTemplates")
              for k, v in entry["pairs"].items()}
    pods = []
    for res in kz["resources"]:
        for d in yaml.safe_load_all((K8S_BASE / res).read_text()):
            if d and d["kind"] in ("Deployment", "StatefulSet"):
                tpl = d["spec"]["template"]
                pods.append({"workload": d["metadata"]["name"], "kind": d["kind"],
                             "labels": {**tpl["metadata"].get("labels", {}), **common},
                             "annotations": tpl["metadata"].get("annotations", {}), "spec": tpl["spec"]})
    return kz["namespace"], pods


def scraped_pods() -> dict[str, dict]:
    """Workload name -> pod template of the pods that ask to be scraped."""
    return {p["workload"]: p for p in k8s_pods()[1] if p["annotations"].get("prometheus.io/scrape") == "true"}


def sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def pod_role_targets(namespace: str, pod: dict, name: str, ip: str, phase: str = "Running") -> list[dict]:
    """What Prometheus' Kubernetes discovery (role: pod) gives for a pod: one target per
    container port, one per port-less container, init containers included, with the meta
    labels of https://prometheus.io/docs/prometheus/latest/configuration/configuration/#pod."""
    meta = {"__meta_kubernetes_namespace": namespace, "__meta_kubernetes_pod_name": name,
            "__meta_kubernetes_pod_ip": ip, "__meta_kubernetes_pod_phase": phase,
            "__meta_kubernetes_pod_ready": "true" if phase == "Running" else "false",
            "__meta_kubernetes_pod_controller_kind": "StatefulSet" if pod["kind"] == "StatefulSet" else "ReplicaSet"}
    for k, v in pod["labels"].items():
        meta[f"__meta_kubernetes_pod_label_{sanitize(k)}"] = str(v)
        meta[f"__meta_kubernetes_pod_labelpresent_{sanitize(k)}"] = "true"
    for k, v in pod["annotations"].items():
        meta[f"__meta_kubernetes_pod_annotation_{sanitize(k)}"] = str(v)
        meta[f"__meta_kubernetes_pod_annotationpresent_{sanitize(k)}"] = "true"
    host = f"[{ip}]" if ":" in ip else ip
    targets = []
    for init, containers in (("true", pod["spec"].get("initContainers", [])), ("false", pod["spec"]["containers"])):
        for c in containers:
            base = {**meta, "__meta_kubernetes_pod_container_name": c["name"],
                    "__meta_kubernetes_pod_container_init": init}
            for port in c.get("ports", []) or [None]:
                if port is None:
                    targets.append({**base, "__address__": ip})
                else:
                    targets.append({**base, "__address__": f"{host}:{port['containerPort']}",
                                    "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                                    "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
                                    "__meta_kubernetes_pod_container_port_protocol": port.get("protocol", "TCP")})
    return targets


def relabel(labels: dict[str, str], configs: list[dict]) -> dict[str, str] | None:
    """Prometheus' relabelling (the replace, keep and drop actions): regexes anchored at both
    ends, source values joined by `;`, `$1`/`${1}` in the replacement; None if dropped."""
    labels = dict(labels)
    for cfg in configs:
        action = cfg.get("action", "replace")
        assert action in ("replace", "keep", "drop"), f"this check knows no action {action!r}"
        value = cfg.get("separator", ";").join(labels.get(n, "") for n in cfg.get("source_labels", []))
        m = re.fullmatch(str(cfg.get("regex", "(.*)")), value)
        if action == "keep" and not m or action == "drop" and m:
            return None
        if action == "replace" and m:
            out = re.sub(r"\$(?:\{(\w+)\}|(\d+))", lambda g, m=m: m.group(int(g.group(1) or g.group(2))) or "",
                         str(cfg.get("replacement", "$1")))
            if out:
                labels[cfg["target_label"]] = out
            else:
                labels.pop(cfg["target_label"], None)
    return labels


def scrape_targets(job: dict, discovered: list[dict]) -> set[tuple]:
    """The targets a scrape job ends up with: defaults, relabelling, `instance` from the
    address where unset, `__` labels dropped, equal targets merged."""
    out = set()
    for t in discovered:
        labels = relabel({"job": job["job_name"], "__metrics_path__": job.get("metrics_path", "/metrics"),
                          "__scheme__": job.get("scheme", "http"), **t}, job.get("relabel_configs", []))
        if labels is None:
            continue
        labels.setdefault("instance", labels["__address__"])
        url = f"{labels['__scheme__']}://{labels['__address__']}{labels['__metrics_path__']}"
        out.add((url, tuple(sorted((k, v) for k, v in labels.items() if not k.startswith("__")))))
    return out


def test_k8s_scrape_config_is_valid_with_the_rules(tmp_path):
    """A minimal prometheus.yml with the Kubernetes scrape config and the rule files passes
    `promtool check config`. Debian's Prometheus is built without Kubernetes discovery
    (promtool answers `field kubernetes_sd_configs not found`): there the discovery block is
    checked here and swapped for an empty static one, so promtool still checks the rest (the
    relabel rules' regexes and labels, the intervals, the rules)."""
    scrape = yaml.safe_load(K8S_SCRAPE.read_text())
    assert set(scrape) == {"scrape_configs"}, "a fragment with scrape_configs only"
    config = {"global": {"scrape_interval": "5s", "scrape_timeout": "4s", "evaluation_interval": "5s"},
              "rule_files": [str(f) for f in RULES], **scrape}
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    r = run(need_tool("promtool", PROMETHEUS_HINT), "check", "config", str(path))
    if r.returncode != 0 and "field kubernetes_sd_configs not found" in r.stdout + r.stderr:
        namespace = k8s_pods()[0]
        for job in config["scrape_configs"]:
            assert job.pop("kubernetes_sd_configs") == [{"role": "pod", "namespaces": {"names": [namespace]}}], job
            job["static_configs"] = [{"targets": []}]
        path.write_text(yaml.safe_dump(config))
        r = run(need_tool("promtool", PROMETHEUS_HINT), "check", "config", str(path))
    assert r.returncode == 0, shown(r)
    assert f"{len(RULES)} rule files found" in r.stdout + r.stderr, shown(r)
    # the rules' windows want a scrape every 5 s, as under compose
    compose_global = yaml.safe_load(CONFIG.read_text())["global"]
    for job in scrape["scrape_configs"]:
        assert job["scrape_interval"] == compose_global["scrape_interval"], job["job_name"]
        assert job["scrape_timeout"] == compose_global["scrape_timeout"], job["job_name"]


@pytest.mark.parametrize("ip", ["10.244.1.17", "fd00:10:244::11"])
def test_k8s_scrape_config_gives_each_pod_its_compose_job_name(ip):
    """The relabelling, played on the pods of deploy/k8s/base as Kubernetes discovery presents
    them: one target per steadyrl pod at the address and path of its annotations, job = its
    compose service name (the names the rules select on), instance = the pod's name; Kafka (no
    scrape annotation), init containers and finished pods are not scraped."""
    namespace, pods = k8s_pods()
    (job,) = yaml.safe_load(K8S_SCRAPE.read_text())["scrape_configs"]
    host = f"[{ip}]" if ":" in ip else ip
    want, got = set(), set()
    for pod in pods:
        name = f"{pod['workload']}-0" if pod["kind"] == "StatefulSet" else f"{pod['workload']}-7d9c5b6f4-x2x7q"
        ann = pod["annotations"]
        if ann.get("prometheus.io/scrape") == "true":
            want.add((f"http://{host}:{ann['prometheus.io/port']}{ann['prometheus.io/path']}",
                      (("instance", name), ("job", pod["labels"]["app.kubernetes.io/name"]),
                       ("namespace", namespace))))
        got |= scrape_targets(job, pod_role_targets(namespace, pod, name, ip))
        assert not scrape_targets(job, pod_role_targets(namespace, pod, name, ip, phase="Succeeded")), name
    assert got == want
    jobs = {dict(labels)["job"] for _, labels in got}
    assert jobs == compose_jobs(), "the Kubernetes job names are compose's"
    assert rule_jobs() <= jobs, f"rules select jobs nothing scrapes: {rule_jobs() - jobs}"


def test_k8s_podmonitor_matches_the_scrape_config():
    """The PodMonitor alternative selects the same pods on the same port and gives the same
    job and instance (the operator takes job from `jobLabel`'s pod label)."""
    namespace, pods = k8s_pods()
    pm = yaml.safe_load(K8S_PODMONITOR.read_text())
    assert (pm["apiVersion"], pm["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    spec = pm["spec"]
    assert pm["metadata"]["namespace"] == namespace and spec["namespaceSelector"] == {"matchNames": [namespace]}
    assert spec["jobLabel"] == "app.kubernetes.io/name"
    (ep,) = spec["podMetricsEndpoints"]
    (job,) = yaml.safe_load(K8S_SCRAPE.read_text())["scrape_configs"]
    assert (ep["interval"], ep["scrapeTimeout"]) == (job["scrape_interval"], job["scrape_timeout"])
    assert ep["relabelings"] == [{"sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "instance"}]
    scraped = set()
    for pod in pods:
        if not spec["selector"]["matchLabels"].items() <= pod["labels"].items():
            continue
        ports = {p.get("name"): p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        if ep["port"] not in ports:
            continue
        ann = pod["annotations"]
        assert ann.get("prometheus.io/scrape") == "true", pod["workload"]
        assert (str(ports[ep["port"]]), ep["path"]) == (ann["prometheus.io/port"], ann["prometheus.io/path"])
        scraped.add(pod["labels"][spec["jobLabel"]])
    assert scraped == {p["labels"]["app.kubernetes.io/name"] for p in scraped_pods().values()} == compose_jobs()


def test_alertmanager_config_is_valid():
    r = run(need_tool("amtool", PROMETHEUS_HINT), "check-config", str(AM_CONFIG.relative_to(ROOT)))
    assert r.returncode == 0, shown(r)
    assert "SUCCESS" in r.stdout, shown(r)


def test_alertmanager_config_holds_no_secret():
    """Robot URLs and secrets live in the bridge's environment: every receiver posts to the
    bridge or the generic webhook, with no credentials in the file (the webhooks to the bridge
    name the file of the stack's HTTP token, a compose secret: issue 21)."""
    cfg = yaml.safe_load(AM_CONFIG.read_text())
    urls = [w["url"] for r in cfg["receivers"] for w in r.get("webhook_configs", [])]
    assert {"http://alertbridge:8500/alert/dingtalk", "http://alertbridge:8500/alert/wecom"} <= set(urls)
    for r in cfg["receivers"]:
        assert set(r) <= {"name", "webhook_configs"}, r
        for w in r["webhook_configs"]:
            allowed = r"http://(alertbridge:8500/alert/(dingtalk|wecom)|alert-webhook:9000/alerts)"
            assert re.fullmatch(allowed, w["url"]), w
            if w["url"].startswith("http://alertbridge:"):
                assert w["http_config"] == {"authorization": {"type": "Bearer",
                                                              "credentials_file": "/run/secrets/alert-token"}}, w
            else:
                assert "http_config" not in w, w
    assert not re.search(r"access_token|oapi\.dingtalk|qyapi\.weixin", AM_CONFIG.read_text())


@pytest.mark.parametrize("severity, receiver", [("P0", "chat"), ("P1", "chat"), ("P2", "chat"), ("P3", "webhook"),
                                                (None, "webhook")])
def test_alertmanager_routes_by_severity(severity, receiver):
    labels = ["alertname=Any", *([f"severity={severity}"] if severity else [])]
    r = run(need_tool("amtool", PROMETHEUS_HINT), "config", "routes", "test", "--config.file", str(AM_CONFIG),
            "--verify.receivers", receiver, *labels)
    assert r.returncode == 0, shown(r)


@contextlib.contextmanager
def real_alertmanager(tmp_path):
    """Alertmanager on loopback with the compose config; yields its API v2 URL."""
    from steadyrl.local.ports import free_port

    binary = shutil.which("alertmanager") or need_tool("prometheus-alertmanager", PROMETHEUS_HINT)  # Debian names it so
    port = free_port()
    with open(tmp_path / "alertmanager.log", "wb") as log:  # the child writes it; read back by path
        proc = subprocess.Popen([binary, f"--config.file={AM_CONFIG}", f"--storage.path={tmp_path / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=",
                                 "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/api/v2"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (tmp_path / "alertmanager.log").read_text()
            try:
                if httpx.get(f"{url}/status", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "alertmanager did not start"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def am_alert(name: str, cluster: str = "steadyrl", **labels) -> dict:
    return {"labels": {"alertname": name, "cluster": cluster, **labels}, "annotations": {"summary": name}}


def post_and_settle(url: str, sent: list[dict], suppressed: set[tuple[str, str]]) -> dict[tuple, dict]:
    """Post `sent`; wait until Alertmanager holds them all with exactly the (alertname, cluster,
    job, instance) keys in `suppressed` suppressed (inhibition is evaluated as alerts arrive).
    Returns the status of each alert by that key."""
    r = httpx.post(f"{url}/alerts", json=sent, timeout=5)
    assert r.status_code == 200, r.text

    def key(labels: dict) -> tuple:
        return labels["alertname"], labels["cluster"], labels.get("job", ""), labels.get("instance", "")

    want = {key(a["labels"]) for a in sent if key(a["labels"])[:2] in suppressed or key(a["labels"]) in suppressed}
    deadline = time.monotonic() + 20
    while True:
        st = {key(a["labels"]): a["status"] for a in httpx.get(f"{url}/alerts", timeout=5).json()}
        got = {k for k, s in st.items() if s["state"] == "suppressed"}
        if len(st) == len(sent) and got == want:
            return st
        assert time.monotonic() < deadline, json.dumps({str(k): v for k, v in st.items()}, indent=1)
        time.sleep(0.2)


def test_dataflow_collapse_inhibits_its_parts_in_a_real_alertmanager(tmp_path):
    """Alertmanager on loopback with the compose config: while DataflowCollapse fires, its parts
    and the learner's stall in the same cluster are suppressed; another cluster's and other
    alerts are not (a service down is a cause, never silenced by the collapse)."""
    with real_alertmanager(tmp_path) as url:
        sent = [am_alert("DataflowCollapse", severity="P0"),
                am_alert("BreakerOpen", severity="P1", job="reward", instance="r0:8300", state="open"),
                am_alert("ConsumerLagGrowing", severity="P2", job="learner", client="learner-0", topic="rl.scored"),
                am_alert("RolloutRestarting", severity="P3", job="rollout", instance="ro0:8200"),
                am_alert("TrainBufferDropped", severity="P2", job="learner", instance="l0:8400"),
                am_alert("LearnerStalled", severity="P1", job="learner", instance="l0:8400"),
                am_alert("CPUBound", severity="P3", job="actor", instance="a:8100"),            # not a part
                am_alert("ServiceDown", severity="P1", job="rollout", instance="ro1:8200"),    # a cause
                am_alert("BreakerOpen", cluster="other", severity="P1", job="reward")]          # another stack
        st = post_and_settle(url, sent, {(name, "steadyrl") for name in COLLAPSE_INHIBITS})
        for k, s in st.items():
            if k[0] in COLLAPSE_INHIBITS and k[1] == "steadyrl":
                assert s["inhibitedBy"], (k, s)
            else:
                assert s["state"] == "active", (k, s)


def test_service_down_inhibits_learner_stalled_in_a_real_alertmanager(tmp_path):
    """One stack per cluster label, all in one Alertmanager: LearnerStalled is suppressed by a
    ServiceDown of the learner, the actor, the reward server or a scaled job with no target left
    (instance "none"); not by one rollout replica of several, nor by another stack's outage.
    ServiceDown itself stays active, and so do the learner's other alerts."""
    stalled = {"severity": "P1", "job": "learner", "instance": "l0:8400"}
    with real_alertmanager(tmp_path) as url:
        sent = [am_alert("ServiceDown", "learner-down", severity="P1", job="learner", instance="l0:8400"),
                am_alert("LearnerStalled", "learner-down", **stalled),
                am_alert("ServiceDown", "actor-down", severity="P1", job="actor", instance="actor:8100"),
                am_alert("LearnerStalled", "actor-down", **stalled),
                am_alert("CheckpointStale", "actor-down", severity="P2", job="learner", instance="l0:8400"),
                am_alert("ServiceDown", "server-down", severity="P1", job="reward-server", instance="rs:8390"),
                am_alert("LearnerStalled", "server-down", **stalled),
                am_alert("ServiceDown", "rollout-gone", severity="P1", job="rollout", instance="none"),
                am_alert("LearnerStalled", "rollout-gone", **stalled),
                am_alert("ServiceDown", "one-replica", severity="P1", job="rollout", instance="ro1:8200"),
                am_alert("LearnerStalled", "one-replica", **stalled),
                am_alert("ServiceDown", "bridge-down", severity="P1", job="alertbridge", instance="ab:8500"),
                am_alert("LearnerStalled", "bridge-down", **stalled),
                am_alert("LearnerStalled", "alone", **stalled),
                am_alert("ServiceDown", "elsewhere", severity="P1", job="actor", instance="actor:8100")]
        silenced = {("LearnerStalled", c) for c in ("learner-down", "actor-down", "server-down", "rollout-gone")}
        st = post_and_settle(url, sent, silenced)
        for k, s in st.items():
            if k[:2] in silenced:
                assert s["inhibitedBy"], (k, s)
            else:
                assert s["state"] == "active", (k, s)
