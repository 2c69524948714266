"""The provisioned Grafana dashboard: its datasource is the provisioned one and every metric
its queries use is in the catalogue (docs/metrics.md)."""

import json
import re

import yaml

from tests.helpers import ROOT
from tests.steadyrl.test_metrics_catalogue import catalogue

GRAFANA = ROOT / "compose" / "grafana"
PROMQL_WORDS = {"sum", "by", "rate", "increase", "max", "min", "avg", "on", "group_left", "histogram_quantile",
                "le", "without", "or", "and", "unless", "offset", "count", "deriv", "abs"}


def dashboards():
    return {p.name: json.loads(p.read_text()) for p in (GRAFANA / "dashboards").glob("*.json")}


def panels(d):
    for p in d["panels"]:
        yield p
        yield from p.get("panels", [])


def metric_names(expr: str) -> set[str]:
    expr = re.sub(r"\{[^}]*\}", "", expr)        # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)       # ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # label lists
    words = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr)) - PROMQL_WORDS
    return {w for w in words if w.startswith(("steadyrl_", "process_"))}


def base_name(name: str, listed: dict) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and listed.get(name[: -len(suffix)]) == "histogram":
            return name[: -len(suffix)]
    return name


def test_datasource_uid_matches_the_provisioned_one():
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())["datasources"]
    uids = {d["uid"] for d in ds}
    assert uids == {"prometheus"}
    for name, d in dashboards().items():
        for p in panels(d):
            if p["type"] == "row":
                continue
            assert p["datasource"]["uid"] in uids, (name, p["title"])
            assert all(t["datasource"]["uid"] in uids for t in p["targets"]), (name, p["title"])


def test_every_query_metric_is_in_the_catalogue():
    listed = catalogue()
    assert dashboards(), "no dashboard under compose/grafana/dashboards"
    for d in dashboards().values():
        for p in panels(d):
            for t in p.get("targets", []):
                used = {base_name(m, listed) for m in metric_names(t["expr"])}
                assert used, (p["title"], t["expr"])
                assert used <= set(listed), (p["title"], sorted(used - set(listed)))


def test_the_dashboard_has_the_views_the_issue_names():
    titles = " | ".join(p["title"].lower() for d in dashboards().values() for p in panels(d))
    for view in ("time per phase", "per-layer parameter drift", "reward distribution", "reward drift", "memory",
                 "cpu per service", "consumer lag",
                 "breaker state"):
        assert view in titles, view
    kinds = {p["type"] for d in dashboards().values() for p in panels(d)}
    assert "heatmap" in kinds


def test_the_metric_name_parser_sees_through_promql():
    assert metric_names('sum by (stage) (rate(steadyrl_stage_batch_seconds_sum{a="b"}[1m]))') == \
        {"steadyrl_stage_batch_seconds_sum"}
    assert metric_names("histogram_quantile(0.9, sum by (le) (rate(steadyrl_rollout_sample_age_seconds_bucket[5m])))") \
        == {"steadyrl_rollout_sample_age_seconds_bucket"}
