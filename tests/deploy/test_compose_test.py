"""Static checks of make compose-test's own pieces (deploy/compose-test.sh, deploy/compose_checks.py,
compose/grafana/expected-empty.json); the target itself needs a Docker engine and runs in .ci/run."""

import importlib.util
import json
import shutil
import subprocess

import pytest

from tests.deploy.test_grafana_dashboard import rows
from tests.helpers import ROOT

SCRIPT = ROOT / "deploy" / "compose-test.sh"


def checks():
    spec = importlib.util.spec_from_file_location("compose_checks", ROOT / "deploy" / "compose_checks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_script_parses():
    bash = shutil.which("bash")
    assert bash
    subprocess.run([bash, "-n", str(SCRIPT)], check=True)


def test_every_dashboard_query_is_found():
    mod = checks()
    queries = mod.dashboard_queries()
    raw = 0
    for p in mod.DASHBOARDS.glob("*.json"):
        raw += json.dumps(json.loads(p.read_text())).count('"expr"')
    assert queries and len(queries) == raw
    assert all(q["expr"].strip() and q["panel"] for q in queries)


def test_expected_empty_names_dashboard_queries_each_with_a_reason():
    mod = checks()
    exprs = {q["expr"]: q["panel"] for q in mod.dashboard_queries()}
    listed = json.loads(mod.EXPECTED_EMPTY.read_text())["queries"]
    assert listed
    for e in listed:
        assert e["expr"] in exprs, e
        assert exprs[e["expr"]] == e["panel"], e
        assert len(e["why"]) > 20, e
    assert len({e["expr"] for e in listed}) == len(listed)


def test_the_run_health_and_learner_rows_are_queried_live_and_barely_excused():
    """Issue 38: every query of the Run health and Learner updates rows is one the compose test
    runs against the live Prometheus; only two may come back empty: the harder splits' accuracy
    (configs/tiny.yaml has none) and the firing-alerts table (a healthy run may have none)."""
    mod = checks()
    d = json.loads((mod.DASHBOARDS / "steadyrl.json").read_text())
    new = {(p["title"], t["expr"]) for row in ("Run health", "Learner updates") for p in rows(d)[row]
           for t in p["targets"]}
    assert len(new) >= 20
    assert new <= {(q["panel"], q["expr"]) for q in mod.dashboard_queries()}
    excused = {e["expr"] for e in json.loads(mod.EXPECTED_EMPTY.read_text())["queries"]} & {e for _, e in new}
    assert excused == {"steadyrl_learner_eval_split_accuracy",
                       'sum by (alertname, severity) (ALERTS{alertstate="firing"})'}


def test_the_stack_config_is_tiny_yaml_with_more_steps(tmp_path):
    """The script's sed on configs/tiny.yaml changes learner.steps and nothing else."""
    src = (ROOT / "configs" / "tiny.yaml").read_text()
    out = subprocess.run(["sed", r"s/^  steps:[[:space:]]*[0-9]*/  steps: 300/"], input=src, text=True,
                         capture_output=True, check=True).stdout
    import yaml

    a, b = yaml.safe_load(src), yaml.safe_load(out)
    assert b["learner"]["steps"] == 300
    b["learner"]["steps"] = a["learner"]["steps"]
    assert a == b


@pytest.mark.parametrize("cmd", ["chaos", "grafana", "audit", "forge"])
def test_the_checks_cli(cmd):
    mod = checks()
    with pytest.raises(SystemExit) as e:
        mod.main([cmd, "--help"])
    assert e.value.code == 0
