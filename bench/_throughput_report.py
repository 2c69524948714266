"""The pipeline arms' Kafka overhead per record, for bench/throughput.py: every service's
/metrics scraped during a run (`Scraper`), each trained group followed through the topics by
its record timestamps (`trace`), the stages' own metrics, per-record summaries over rounds
(`kafka_summary`, `per_record_overhead`) and the markdown tables of both result files
(`tables`). See bench/throughput.py's docstring for what is measured."""

from __future__ import annotations

import contextlib
import re
import statistics
import threading
import time
import uuid
from collections.abc import Callable

SERVICE_PORTS = {"actor": 8100, "rollout": 8200, "reward": 8300, "reward-server": 8390, "learner": 8400}


# ---- during a run ---------------------------------------------------------------------------
class Scraper(threading.Thread):
    """Scrapes every service's /metrics each `interval_s`: keeps the last full scrape, the first
    full scrape at or after learner step `steady_from` (with the broker's CPU time at both),
    and every learner phase-gauge sample."""

    def __init__(self, offset: int, steady_from: int, broker_cpu: Callable[[], float], interval_s: float = 5.0):
        super().__init__(daemon=True)
        self.urls = {k: f"http://127.0.0.1:{p + offset}/metrics" for k, p in SERVICE_PORTS.items()}
        self.interval_s, self.stop = interval_s, threading.Event()
        self.steady_from, self.broker_cpu = steady_from, broker_cpu
        self.last: dict[str, str] = {}
        self.full_first: dict | None = None
        self.full_last: dict | None = None
        self.phase_samples: list[dict] = []

    def run(self) -> None:
        import httpx

        while not self.stop.wait(self.interval_s):
            cycle = {"t": time.monotonic(), "broker_cpu_s": self.broker_cpu(), "texts": {}}
            for name, url in self.urls.items():
                try:
                    text = httpx.get(url, timeout=2).text
                except httpx.HTTPError:
                    continue
                self.last[name] = cycle["texts"][name] = text
                if name == "learner":
                    ph = {m.group(1): float(m.group(2)) for m in
                          re.finditer(r'^steadyrl_learner_phase_seconds\{phase="([^"]+)"\} (\S+)$', text, re.M)}
                    step = re.search(r"^steadyrl_learner_step (\S+)$", text, re.M)
                    if ph and step:
                        self.phase_samples.append({"step": float(step.group(1)), **ph})
            if len(cycle["texts"]) == len(self.urls):
                step = re.search(r"^steadyrl_learner_step (\S+)$", cycle["texts"]["learner"], re.M)
                if self.full_first is None and step and float(step.group(1)) >= self.steady_from:
                    self.full_first = cycle
                elif self.full_first is not None:
                    self.full_last = cycle



#: Steps each run's steady window leaves out (their timing includes warm-up). None: max(5, N/10);
#: bench/throughput.py --warm-steps sets it (SmolLM2 runs of a few steps).
WARM_STEPS: int | None = None


def warm_steps(n: int) -> int:
    """The warm steps of an N-step run (WARM_STEPS, else max(5, N/10)), at most N - 1 (a short
    warm-up round keeps one steady step)."""
    return min(WARM_STEPS if WARM_STEPS is not None else max(5, n // 10), n - 1)

def cpu_per_record(first: dict | None, last: dict | None) -> dict:
    """CPU milliseconds per group (per step for the learner) of each process over the steady
    window between two full scrapes: process_cpu_seconds_total and the stage counters."""
    if not first or not last:
        return {}

    def d(svc, name, labels=None):
        a, b = _metric(first["texts"][svc], name, labels), _metric(last["texts"][svc], name, labels)
        return None if a is None or b is None else b - a

    groups = d("reward", "steadyrl_stage_records_total", {"stage": "reward", "outcome": "ok"})
    prompts = d("rollout", "steadyrl_stage_records_total", {"stage": "rollout", "outcome": "ok"})
    steps = d("learner", "steadyrl_learner_step")
    out = {"window_s": last["t"] - first["t"], "groups": groups, "prompts": prompts, "steps": steps}
    for svc, per in (("rollout", prompts), ("actor", prompts), ("reward", groups), ("reward-server", groups),
                     ("learner", steps)):
        cpu = d(svc, "process_cpu_seconds_total")
        out[f"{svc}_cpu_ms_per_{'step' if svc == 'learner' else 'group'}"] = (
            None if not per or cpu is None else 1000 * cpu / per)
    if groups:
        out["broker_cpu_ms_per_group"] = 1000 * (last["broker_cpu_s"] - first["broker_cpu_s"]) / groups
    return out


def _metric(text: str, name: str, labels: dict | None = None) -> float | None:
    """Sum of the samples of `name` whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    total, found = 0.0, False
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                total += s.value
                found = True
    return total if found else None


def stage_metrics(last: dict[str, str]) -> dict:
    """Means and counts from the last scrape of each service (the run's last ~5 s are missing)."""
    out: dict = {}

    def hist(svc, name, labels=None):
        text = last.get(svc, "")
        s, c = _metric(text, f"{name}_sum", labels), _metric(text, f"{name}_count", labels)
        return {"count": c, "mean_s": (s / c) if s is not None and c else None}

    out["rollout_transform"] = hist("rollout", "steadyrl_stage_batch_seconds", {"stage": "rollout"})
    out["reward_transform"] = hist("reward", "steadyrl_stage_batch_seconds", {"stage": "reward"})
    out["actor_generate"] = hist("actor", "steadyrl_actor_generate_seconds")
    out["reward_server_score"] = hist("reward-server", "steadyrl_reward_server_score_seconds")
    out["reward_call"] = hist("reward", "steadyrl_reward_call_seconds")
    for svc in ("rollout", "reward"):
        text = last.get(svc, "")
        out[f"{svc}_records_ok"] = _metric(text, "steadyrl_stage_records_total", {"stage": svc, "outcome": "ok"})
        out[f"{svc}_txns_committed"] = _metric(text, "steadyrl_stage_transactions_total",
                                               {"stage": svc, "result": "committed"})
        out[f"{svc}_txns_aborted"] = _metric(text, "steadyrl_stage_transactions_total",
                                             {"stage": svc, "result": "aborted"})
    out["actor_policy_loads"] = _metric(last.get("actor", ""), "steadyrl_actor_policy_loads_total")
    return out


def read_topic(bootstrap: str, topic: str, expect: int, timeout_s: float = 120.0) -> list[dict]:
    """Every committed record of `topic`: key, partition, offset, timestamp (ms), size, value bytes, headers."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"tp-read-{uuid.uuid4().hex}",
                  "isolation.level": "read_committed", "enable.auto.commit": False,
                  "fetch.max.bytes": 33554432, "max.partition.fetch.bytes": 16777216,
                  "receive.message.max.bytes": 34603008})
    parts = c.list_topics(topic, timeout=10).topics[topic].partitions
    c.assign([TopicPartition(topic, p, 0) for p in parts])
    out, deadline, last_new = [], time.monotonic() + timeout_s, time.monotonic()
    try:
        while time.monotonic() < deadline:
            got = [m for m in c.consume(1000, timeout=0.2) if m.error() is None]
            if got:
                last_new = time.monotonic()
                out += [{"key": m.key().decode() if m.key() else None, "partition": m.partition(),
                         "offset": m.offset(), "ts": m.timestamp()[1], "bytes": len(m.value() or b""),
                         "value": m.value(), "headers": m.headers()} for m in got]
            elif len(out) >= expect and time.monotonic() - last_new >= 1.0:
                break
        return out
    finally:
        c.close()


def delete_topics(bootstrap: str, prefix: str) -> None:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    names = [t for t in admin.list_topics(timeout=10).topics if t.startswith(prefix)]
    if names:
        for f in admin.delete_topics(names, operation_timeout=30).values():
            with contextlib.suppress(Exception):  # best effort clean-up
                f.result(30)


def parse_log(text: str) -> dict:
    """Counts and timestamps from `up`'s prefixed JSON log lines."""
    from steadyrl.testing.stack import log_records

    deferred = {"rollout": 0, "reward": 0}
    deferred_why: dict[str, int] = {}
    loaded: dict[int, float] = {}
    restarts = 0
    for line in text.splitlines():  # a child's exit: a plain (not JSON) line under the child's prefix
        if " | " in line and "exited with" in line.partition(" | ")[2]:
            restarts += 1
    for name, rec in log_records(text):
        if rec.get("msg") == "batch deferred":
            svc = name.rsplit("-", 1)[0]
            deferred[svc] = deferred.get(svc, 0) + 1
            why = re.sub(r"\d+", "N", str(rec.get("why", "")))[:80]
            deferred_why[why] = deferred_why.get(why, 0) + 1
        elif rec.get("msg") == "policy loaded" and name.startswith("actor"):
            loaded[int(rec["version"])] = float(rec["ts"])
    return {"deferred_batches": deferred, "deferred_why": deferred_why, "actor_loaded_ts": loaded,
            "child_exits": restarts}



def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _dist(xs: list[float]) -> dict:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {}
    return {"p50_ms": round(pct(xs, 0.5), 1), "p90_ms": round(pct(xs, 0.9), 1),
            "mean_ms": round(statistics.mean(xs), 1), "n": len(xs)}


def trace(lc, consumed, t, logs, metrics, phase_samples, codec, Prompt, RolloutGroup, ScoredGroup, PolicyUpdate):
    """Per trained group: record timestamps through rl.prompts -> rl.rollouts -> rl.scored -> rl.policy."""
    n = lc["steps"]
    dec = lambda r, c: codec.decode(r["value"], r["headers"], c)  # noqa: E731
    prompts: dict[tuple, list[int]] = {}
    for r in t["rl.prompts"]:
        p = dec(r, Prompt)
        prompts.setdefault((p.prompt_id, p.seed), []).append(r["ts"])
    rollouts: dict[tuple, list[int]] = {}
    for r in t["rl.rollouts"]:
        g = dec(r, RolloutGroup)
        rollouts.setdefault((g.prompt_id, g.prompt.seed), []).append(r["ts"])
    scored = {(r["partition"], r["offset"]): r for r in t["rl.scored"]}
    policy = {}
    for r in t["rl.policy"]:
        u = dec(r, PolicyUpdate)
        policy[u.version] = r["ts"]
    hops = {"prompt_to_rollout": [], "rollout_to_scored": [], "scored_to_trained": [], "prompt_to_trained": [],
            "policy_to_rollout": []}
    per_step: dict[int, dict] = {}
    missing = 0
    for c in consumed:
        r = scored.get((c["partition"], c["offset"]))
        if r is None:
            missing += 1
            continue
        sg = dec(r, ScoredGroup)
        key = (sg.prompt_id, sg.group.prompt.seed)
        ts_s = r["ts"]
        ts_r = max((x for x in rollouts.get(key, []) if x <= ts_s), default=None)
        ts_p = max((x for x in prompts.get(key, []) if ts_r is None or x <= ts_r), default=None)
        ts_v = policy.get(c["step"])
        if None in (ts_r, ts_p, ts_v):
            missing += 1
            continue
        hops["prompt_to_rollout"].append(ts_r - ts_p)
        hops["rollout_to_scored"].append(ts_s - ts_r)
        hops["scored_to_trained"].append(ts_v - ts_s)
        hops["prompt_to_trained"].append(ts_v - ts_p)
        if sg.group.policy_version in policy:
            hops["policy_to_rollout"].append(ts_r - policy[sg.group.policy_version])
        s = per_step.setdefault(c["step"], {"P": [], "R": [], "S": []})
        s["P"].append(ts_p)
        s["R"].append(ts_r)
        s["S"].append(ts_s)
    # the step cycle as a chain: policy k-1 announced -> last prompt of step k out -> its last
    # rollout out -> its last scored group out -> policy k announced (serial at max_staleness 0)
    chain = {"policy_to_prompts_out": [], "prompts_out_to_rollouts_out": [], "rollouts_out_to_scored_out": [],
             "scored_out_to_policy": [], "cycle": []}
    for k, s in sorted(per_step.items()):
        if k - 1 not in policy or k not in policy:
            continue
        t0, t1, t2, t3, t4 = policy[k - 1], max(s["P"]), max(s["R"]), max(s["S"]), policy[k]
        chain["policy_to_prompts_out"].append(t1 - t0)
        chain["prompts_out_to_rollouts_out"].append(t2 - t1)
        chain["rollouts_out_to_scored_out"].append(t3 - t2)
        chain["scored_out_to_policy"].append(t4 - t3)
        chain["cycle"].append(t4 - t0)
    w = warm_steps(n)
    chain_steady = {k: _dist(v[w - 1:]) for k, v in chain.items()}  # chain lists start at step 1
    load_lag = [ts * 1000 - policy[v] for v, ts in logs["actor_loaded_ts"].items() if v in policy and v > 0]
    # transactions and batch sizes of the stages
    sizes = {}
    for name in ("rl.prompts", "rl.rollouts", "rl.scored", "rl.policy"):
        b = [r["bytes"] for r in t[name]]
        sizes[name] = {"records": len(b), "median_bytes": statistics.median(b) if b else None}
    phases = {}
    for k in ("wait", "train_step", "update_actor", "publish_policy", "old_log_prob"):
        xs = [p[k] for p in phase_samples if k in p]
        if xs:
            phases[k] = {"median_ms": round(1000 * statistics.median(xs), 1), "samples": len(xs)}
    return {"records_traced": sum(len(v["P"]) for v in per_step.values()), "records_missing": missing,
            "hops_ms": {k: _dist(v) for k, v in hops.items()}, "step_chain_ms": chain_steady,
            "actor_policy_load_lag_ms": _dist(load_lag), "stage_metrics": metrics,
            "learner_phase_gauges": phases, "deferred_batches": logs["deferred_batches"],
            "deferred_why": logs["deferred_why"], "child_exits": logs["child_exits"], "record_sizes": sizes}



def kafka_summary(rounds: list[dict]) -> dict:
    """Median over rounds of each pipeline arm's per-record figures."""
    out = {}
    arms = sorted({a for r in rounds for a in r["arms"] if a.startswith("pipeline")})
    for arm in arms:
        ks = [r["arms"][arm]["kafka"] for r in rounds if arm in r["arms"]]
        if not ks:
            continue

        def med(path, ks=ks):
            vals = []
            for k in ks:
                v = k
                for p in path:
                    v = v.get(p) if isinstance(v, dict) else None
                if isinstance(v, (int, float)):
                    vals.append(v)
            return statistics.median(vals) if vals else None

        hops = {h: {q: med(["hops_ms", h, q]) for q in ("p50_ms", "p90_ms", "mean_ms")} for h in ks[0]["hops_ms"]}
        chain = {h: {q: med(["step_chain_ms", h, q]) for q in ("p50_ms", "p90_ms", "mean_ms")}
                 for h in ks[0]["step_chain_ms"]}
        sm = {k: {q: med(["stage_metrics", k, q]) for q in ("mean_s", "count")} if isinstance(v, dict)
              else med(["stage_metrics", k]) for k, v in ks[0]["stage_metrics"].items()}
        phases = {k: med(["learner_phase_gauges", k, "median_ms"]) for k in ks[0]["learner_phase_gauges"]}
        cpu = {k: med(["cpu_per_record", k]) for k in ks[0].get("cpu_per_record", {})}
        out[arm] = {"rounds": len(ks), "hops_ms": hops, "step_chain_ms": chain, "stage_metrics": sm,
                    "learner_phase_median_ms": phases, "cpu_per_record": cpu,
                    "actor_policy_load_lag_ms": {q: med(["actor_policy_load_lag_ms", q]) for q in ("p50_ms", "p90_ms")},
                    "deferred_rollout_batches": [k["deferred_batches"].get("rollout", 0) for k in ks],
                    "deferred_why": ks[0]["deferred_why"], "record_sizes": ks[0]["record_sizes"],
                    "records_traced": [k["records_traced"] for k in ks],
                    "records_missing": [k["records_missing"] for k in ks]}
    return out


def per_record_overhead(ks: dict, steps: int) -> dict:
    """Per stage: hop latency vs the stage's transform and its work (medians/means in ms)."""
    sm = ks["stage_metrics"]

    def ms(k):
        v = sm.get(k, {}).get("mean_s")
        return None if v is None else 1000 * v

    def per_step(k):  # calls per step
        c = sm.get(k, {}).get("count")
        return None if not c else c / steps

    out = {}
    hop = ks["hops_ms"]["prompt_to_rollout"]["mean_ms"]
    tr, work = ms("rollout_transform"), ms("actor_generate")
    out["rollout"] = {"hop_mean_ms": hop, "transform_mean_ms": tr, "work_mean_ms": work,
                      "beyond_work_ms": None if None in (hop, work) else hop - work,
                      "in_transform_beyond_work_ms": None if None in (tr, work) else tr - work,
                      "outside_transform_ms": None if None in (hop, tr) else hop - tr,
                      "batches_per_step": per_step("rollout_transform"),
                      "actor_calls_per_step": per_step("actor_generate")}
    hop = ks["hops_ms"]["rollout_to_scored"]["mean_ms"]
    tr, work = ms("reward_transform"), ms("reward_server_score")
    out["reward"] = {"hop_mean_ms": hop, "transform_mean_ms": tr, "work_mean_ms": work,
                     "call_mean_ms": ms("reward_call"),
                     "beyond_work_ms": None if None in (hop, work) else hop - work,
                     "in_transform_beyond_work_ms": None if None in (tr, work) else tr - work,
                     "outside_transform_ms": None if None in (hop, tr) else hop - tr,
                     "batches_per_step": per_step("reward_transform")}
    hop = ks["hops_ms"]["scored_to_trained"]["mean_ms"]
    ph = ks["learner_phase_median_ms"]
    work = ph.get("train_step")
    out["learner"] = {"hop_mean_ms": hop, "work_train_step_ms": work, "publish_policy_ms": ph.get("publish_policy"),
                      "beyond_work_ms": None if None in (hop, work) else hop - work}
    return out


# ---- tables ---------------------------------------------------------------------------------
def tables(res: dict, ko: dict | None) -> str:
    s = res.get("summary") or res["summary_all_rounds"]
    f = lambda x, d=1: "-" if x is None else f"{x:,.{d}f}".replace(",", " ")  # noqa: E731
    lines = ["| arm | samples/s (steady) | tokens/s (steady) | s/step | end-to-end s | e2e samples/s "
             "| CPU-s per 1k samples |", "|---|---|---|---|---|---|---|"]
    for a, v in s["per_arm"].items():
        sps = v["samples_per_s"]
        lines.append(f"| {a} | {f(sps['median'])} ({f(sps['min'])}–{f(sps['max'])}) "
                     f"| {f(v['tokens_per_s']['median'])} | {f(v['s_per_step']['median'], 3)} "
                     f"| {f(v['e2e_s']['median'])} "
                     f"| {f(v['e2e_samples_per_s']['median'])} | {f(v['cpu_s_per_1k_samples']['median'], 2)} |")
    lines += ["", "| ratio (within a round) | samples/s, steady | tokens/s, steady | samples/s, end-to-end |",
              "|---|---|---|---|"]
    want = ["pipeline-s0 / loop", "pipeline-s2 / loop", "pipeline-s2 / pipeline-s0", "trl / loop", "pipeline-s0 / trl",
            "pipeline-s2 / trl", "loop / trl", "pipeline-s2 / pipeline-s2-unplaced",
            "pipeline-s0 / pipeline-s0-unplaced", "pipeline-s2-unplaced / pipeline-s0-unplaced",
            "pipeline-s0 / pipeline-s0@before", "pipeline-s2 / pipeline-s2@before", "pipeline-s2@before / trl",
            "pipeline-s0@before / loop"]
    for k in want:
        r = s["ratios"].get(k)
        if r:
            cell = lambda m: f"{m['median']:.3f} ({m['min']:.3f}–{m['max']:.3f})"  # noqa: E731
            lines.append(f"| {k} | {cell(r['samples_per_s'])} | {cell(r['tokens_per_s'])} "
                         f"| {cell(r['e2e_samples_per_s'])} |")
    if ko:
        for arm, k in ko.items():
            if arm.startswith("_"):
                continue
            lines += ["", f"**{arm}**: per-record hops (record timestamps; median over rounds of each run's "
                          "p50 / p90 / mean, ms)", "", "| hop | p50 | p90 | mean |", "|---|---|---|---|"]
            for h, v in k["hops_ms"].items():
                lines.append(f"| {h} | {f(v['p50_ms'])} | {f(v['p90_ms'])} | {f(v['mean_ms'])} |")
            if arm.removesuffix("@before") == "pipeline-s0":  # at max_staleness 2 the steps overlap: no serial chain
                lines += ["", "| step chain (steady steps) | p50 | mean |", "|---|---|---|"]
                for h, v in k["step_chain_ms"].items():
                    lines.append(f"| {h} | {f(v['p50_ms'])} | {f(v['mean_ms'])} |")
            o = k.get("per_record")
            if o:
                lines += ["", "| stage | batches/step | hop mean ms | transform mean ms | work mean ms "
                              "| beyond work ms | (in transform) | (outside transform) |",
                          "|---|---|---|---|---|---|---|---|"]
                for st in ("rollout", "reward"):
                    v = o[st]
                    lines.append(f"| {st} | {f(v['batches_per_step'], 2)} | {f(v['hop_mean_ms'])} "
                                 f"| {f(v['transform_mean_ms'])} | {f(v['work_mean_ms'], 2)} "
                                 f"| {f(v['beyond_work_ms'])} | {f(v['in_transform_beyond_work_ms'])} "
                                 f"| {f(v['outside_transform_ms'])} |")
                v = o["learner"]
                lines.append(f"| learner | 1 | {f(v['hop_mean_ms'])} | - | {f(v['work_train_step_ms'])} (train_step) "
                             f"| {f(v['beyond_work_ms'])} | - | - |")
            c = k.get("cpu_per_record")
            if c:
                lines += ["", "| CPU ms per group (steady window) | rollout worker | actor | reward worker "
                              "| reward server | broker | learner (per step) |", "|---|---|---|---|---|---|---|",
                          f"| {arm} | {f(c.get('rollout_cpu_ms_per_group'), 2)} "
                          f"| {f(c.get('actor_cpu_ms_per_group'), 2)} | {f(c.get('reward_cpu_ms_per_group'), 2)} "
                          f"| {f(c.get('reward-server_cpu_ms_per_group'), 2)} "
                          f"| {f(c.get('broker_cpu_ms_per_group'), 2)} | {f(c.get('learner_cpu_ms_per_step'), 1)} |"]
    return "\n".join(lines)
