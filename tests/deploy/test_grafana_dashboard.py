"""The provisioned Grafana dashboard: its datasource is the provisioned one, every metric its
queries use is in the catalogue (docs/metrics.md) or is Prometheus' own (ALERTS), every query
parses (promtool) and reaches Prometheus as plain PromQL (the compose test sends each as it is),
the "Run health" row comes first with the views issue 38 names, and its queries compute what
their titles say on made-up series (promtool test rules)."""

import json
import re
import subprocess

import pytest
import yaml

from tests.deploy.test_prometheus_rules import PROMETHEUS_HINT
from tests.helpers import ROOT, need_tool
from tests.steadyrl.test_metrics_catalogue import catalogue

GRAFANA = ROOT / "compose" / "grafana"
PROMQL_WORDS = {"sum", "by", "rate", "increase", "max", "min", "avg", "on", "group_left", "histogram_quantile",
                "le", "without", "or", "and", "unless", "offset", "count", "deriv", "abs"}
#: Series Prometheus writes itself, not a service: the alert rules' state.
PROMETHEUS_SERIES = {"ALERTS"}
#: What may stand before "(" in a query: PromQL's functions and aggregations used or likely,
#: and the label-list keywords (a typo such as `rates(` is caught here, not on a live stack).
PROMQL_CALLS = {"abs", "avg", "avg_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min", "count",
                "count_over_time", "delta", "deriv", "floor", "histogram_quantile", "idelta", "increase", "irate",
                "label_replace", "last_over_time", "max", "max_over_time", "min", "min_over_time", "quantile",
                "quantile_over_time", "rate", "resets", "round", "scalar", "sort", "sort_desc", "stddev", "sum",
                "sum_over_time", "time", "timestamp", "topk", "bottomk", "vector", "by", "without", "on", "ignoring",
                "group_left", "group_right"}
#: The "Run health" row (issue 38): a view (words of a panel title in the row) -> the metrics
#: its queries must use.
RUN_HEALTH = {
    "step of total steps": {"steadyrl_learner_step", "steadyrl_learner_planned_steps"},
    "eta": {"steadyrl_learner_planned_steps", "steadyrl_learner_step", "steadyrl_learner_median_step_seconds"},
    "stalled": {"steadyrl_learner_stalled", "steadyrl_learner_last_step_timestamp_seconds"},
    "last verified checkpoint": {"steadyrl_learner_last_verified_checkpoint_step",
                                 "steadyrl_learner_last_verified_checkpoint_timestamp_seconds"},
    "evaluation accuracy per split": {"steadyrl_learner_eval_accuracy", "steadyrl_learner_eval_split_accuracy"},
    "policy lag": {"steadyrl_learner_policy_lag", "steadyrl_actor_policy_version"},
    "service restarts": {"process_start_time_seconds"},
    "firing alerts": {"ALERTS"},
}
#: The "Agents" row (issue 48): a view -> the metrics its queries must use (histograms by base name).
AGENTS = {
    "turns per episode": {"steadyrl_rollout_turns_per_episode_bucket"},
    "tool calls by tool and outcome": {"steadyrl_rollout_tool_calls_total"},
    "truncated": {"steadyrl_rollout_episodes_truncated_total", "steadyrl_rollout_episodes_finished_total"},
    "tool latency": {"steadyrl_rollout_tool_call_seconds_bucket"},
    "environment latency": {"steadyrl_rollout_env_step_seconds_bucket"},
    "episode tokens": {"steadyrl_rollout_episode_tokens_bucket"},
}
#: The learner's figures (issue 38): a view -> the steadyrl_learner_train{metric=...} it shows.
LEARNER_VIEWS = {"actor/pg_loss": {"actor/pg_loss"}, "actor/grad_norm": {"actor/grad_norm"},
                 "response length": {"response_length/mean"}, "actor/lr": {"actor/lr"},
                 "log-prob mismatch": {"mismatch/kl", "mismatch/mean_abs_logp_diff", "mismatch/ratio_outside_frac"}}


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
    return {w for w in words if w.startswith(("steadyrl_", "process_")) or w in PROMETHEUS_SERIES}


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
                assert used <= set(listed) | PROMETHEUS_SERIES, (p["title"], sorted(used - set(listed)))


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


def queries():
    """(dashboard, panel title, refId, expr) of every query."""
    return [(name, p["title"], t["refId"], t["expr"]) for name, d in dashboards().items() for p in panels(d)
            for t in p.get("targets", [])]


def rows(d) -> dict[str, list[dict]]:
    """Row title -> the panels under it (by position: from its y to the next row's)."""
    ordered = sorted(panels(d), key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
    out: dict[str, list[dict]] = {}
    current = None
    for p in ordered:
        if p["type"] == "row":
            current = out.setdefault(p["title"], [])
        else:
            assert current is not None, f"{p['title']}: above the first row"
            current.append(p)
    return out


def view_panels(row: list[dict], view: str) -> list[dict]:
    return [p for p in row if re.search(rf"(?<![\w/]){re.escape(view)}(?![\w/])", p["title"].lower())]


def used_metrics(ps: list[dict]) -> set[str]:
    return {m for p in ps for t in p["targets"] for m in metric_names(t["expr"])}


def test_run_health_is_the_top_row_with_each_view():
    d = dashboards()["steadyrl.json"]
    top = min((p for p in panels(d) if p["type"] == "row"), key=lambda p: p["gridPos"]["y"])
    assert top["title"] == "Run health" and top["gridPos"]["y"] == 0
    row = rows(d)["Run health"]
    for view, need in RUN_HEALTH.items():
        shown = view_panels(row, view)
        assert shown, f"no {view!r} panel in the Run health row"
        assert need <= used_metrics(shown), (view, sorted(need - used_metrics(shown)))


def test_the_agents_row_shows_turns_tool_outcomes_latencies_tokens_and_truncation():
    row = rows(dashboards()["steadyrl.json"])["Agents"]
    for view, need in AGENTS.items():
        shown = view_panels(row, view)
        assert shown, f"no {view!r} panel in the Agents row"
        assert need <= used_metrics(shown), (view, sorted(need - used_metrics(shown)))
    (tools,) = view_panels(row, "tool calls by tool and outcome")
    assert "by (tool, outcome)" in tools["targets"][0]["expr"]


def test_the_learners_figures_each_have_a_panel():
    d = dashboards()["steadyrl.json"]
    every = [p for ps in rows(d).values() for p in ps]
    for view, need in LEARNER_VIEWS.items():
        shown = view_panels(every, view)
        assert shown, f"no {view!r} panel"
        labels = {m for p in shown for t in p["targets"]
                  for m in re.findall(r'steadyrl_learner_train\{metric="([^"]+)"\}', t["expr"])}
        assert need <= labels, (view, sorted(need - labels))


def test_panels_do_not_overlap_and_fit_the_grid():
    for name, d in dashboards().items():
        taken: dict[tuple[int, int], str] = {}
        for p in panels(d):
            g = p["gridPos"]
            assert g["x"] >= 0 and g["x"] + g["w"] <= 24, (name, p["title"])
            for y in range(g["y"], g["y"] + g["h"]):
                for x in range(g["x"], g["x"] + g["w"]):
                    assert (x, y) not in taken, (name, p["title"], taken.get((x, y)))
                    taken[(x, y)] = p["title"]
        ids = [p["id"] for p in panels(d)]
        assert len(ids) == len(set(ids)), name


def test_every_query_is_plain_promql():
    """Balanced brackets outside strings, ranges with a unit, only PromQL's functions, and no
    Grafana variable ($__range, $__rate_interval): the compose test sends each query to
    Prometheus as it is, where a variable would not parse."""
    pairs = {")": "(", "]": "[", "}": "{"}
    for name, title, ref, expr in queries():
        where = (name, title, ref, expr)
        assert "$" not in expr, where
        bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
        stack: list[str] = []
        for c in bare:
            if c in "([{":
                stack.append(c)
            elif c in pairs:
                assert stack and stack.pop() == pairs[c], where
        assert not stack, where
        for r in re.findall(r"\[([^\]]*)\]", bare):
            assert re.fullmatch(r"\d+[smhdwy](:\d+[smhdwy])?", r), where
        calls = set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*\(", re.sub(r"\{[^}]*\}", "", bare)))
        assert calls <= PROMQL_CALLS, (where, sorted(calls - PROMQL_CALLS))


def test_every_query_parses_with_promtool(tmp_path):
    """Each query as a recording rule of one file: `promtool check rules` parses them all."""
    promtool = need_tool("promtool", PROMETHEUS_HINT)
    rules = [{"record": f"dashboard:query_{i}", "expr": q[3]} for i, q in enumerate(queries())]
    path = tmp_path / "dashboard.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{len(rules)} rules found" in r.stdout + r.stderr


def _expr(title: str, ref: str) -> str:
    (expr,) = [q[3] for q in queries() if q[1] == title and q[2] == ref]
    return expr


LEARNER = 'job="learner", instance="learner:8400"'
ONE = "{" + LEARNER + "}"


@pytest.mark.parametrize(("title", "ref", "samples"), [
    # step 10 of 50 at a median 3 s a step -> 120 s; step 50: 0 (never negative)
    ("ETA (steps left x median step time)", "A", [(ONE, 120, 0)]),
    ("Progress: step of total steps", "C", [(ONE, 0.2, 1)]),
    # the last step at 280 s -> 20 s ago at 5 min, 320 s at 10 min
    ("Stalled", "B", [("{}", 20, 320)]),
    # step 5's checkpoint written at 240 s -> 60 s old at 5 min; step 10's at 590 s
    ("Last verified checkpoint: step and age", "B", [(ONE, 60, 10)]),
    ("Last verified checkpoint: step and age", "C", [(ONE, 5, 40)]),
    # the learner at 10 and 50, the actor serving 9 and 50
    ("Policy lag (staleness, in versions)", "B", [("{}", 1, 0)]),
    # the learner restarted once (its start time changed), the actor never
    ("Service restarts (last hour)", "A", [('{job="learner"}', 1, 1), ('{job="actor"}', 0, 0)]),
    # no alert at 5 min (0, not "no data"), one firing at 10 min
    ("Firing alerts", "A", [("{}", 0, 1)]),
])
def test_the_run_health_queries_compute_what_their_titles_say(tmp_path, title, ref, samples):
    """Made-up series a minute apart for 10 min; the panel's own query, evaluated by promtool at
    5 and 10 min: `samples` is every series it must return, (labels, value at 5, value at 10)."""
    promtool = need_tool("promtool", PROMETHEUS_HINT)
    series = {
        f"steadyrl_learner_step{ONE}": "10x5 50x5",
        f"steadyrl_learner_planned_steps{ONE}": "50x10",
        f"steadyrl_learner_median_step_seconds{ONE}": "3x10",
        f"steadyrl_learner_last_step_timestamp_seconds{ONE}": "280x10",
        f"steadyrl_learner_last_verified_checkpoint_step{ONE}": "5x5 10x5",
        f"steadyrl_learner_last_verified_checkpoint_timestamp_seconds{ONE}": "240x5 590x5",
        'steadyrl_actor_policy_version{job="actor", instance="actor:8100"}': "9x5 50x5",
        f"process_start_time_seconds{ONE}": "0x1 90x9",
        'process_start_time_seconds{job="actor", instance="actor:8100"}': "0x10",
        'ALERTS{alertname="LearnerStalled", alertstate="firing", severity="P1"}': "_x6 1x4",
    }
    cases = [{"expr": _expr(title, ref), "eval_time": t,
              "exp_samples": [{"labels": labels, "value": v[i]} for labels, *v in samples]}
             for i, t in enumerate(("5m", "10m"))]
    tests = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": [{"series": k, "values": v} for k, v in series.items()],
        "promql_expr_test": cases}]}
    path = tmp_path / "health_test.yml"
    path.write_text(yaml.safe_dump(tests))
    r = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
