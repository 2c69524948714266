#!/usr/bin/env python3
"""The mid-run checks of `make compose-test` (deploy/compose-test.sh), issue 20.

Standard library only on the host; the `audit` command runs inside a steadyrl container (this
file piped to `python -`), where the project is installed.

    compose_checks.py chaos   --project P --out F [options] -- COMPOSE...   (host)
    compose_checks.py grafana --project P --out F --start T0 --end T1         (host)
    compose_checks.py audit   --steps N --batch B                             (in the image)

chaos: `COMPOSE up -d --no-build --scale rollout=R --scale reward=W` mid-run; each new replica
  must turn healthy (its own /readyz, which needs a partition) and its /metrics, scraped by the
  stack's Prometheus, must show partitions of its input topic (`steadyrl_kafka_consumer_lag`
  has one series per partition the consumer fetches) and input records handled
  (`steadyrl_stage_records_total`); Prometheus must have every replica as a target, up. Then
  SIGKILL (`kill -9` of `docker inspect`'s State.Pid, the container's main process: `docker
  kill` would be a manual stop, which restart policies ignore) of one rollout, one reward and
  the learner container; each must be restarted by its restart policy (RestartCount + 1, a new
  PID) and turn healthy again, and the learner must train a step after its restart.

grafana: every query of compose/grafana/dashboards/*.json, over the run's time range, through
  Prometheus' HTTP API (/api/v1/query_range, from inside the Prometheus container: the test
  network is internal). A query must return at least one series unless
  compose/grafana/expected-empty.json lists it (with why); a listed query that is not on a
  dashboard fails, one that returned series is reported.

audit: steadyrl.testing.audit.audit_pipeline on the run of the learner-state volume against
  kafka:9092: every published prompt trained exactly once, none lost (DLQ not excused), both
  stages exactly once.

Each command prints what it saw, writes a JSON report (--out), and exits 1 on a failed check.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = ROOT / "compose" / "grafana" / "dashboards"
EXPECTED_EMPTY = ROOT / "compose" / "grafana" / "expected-empty.json"
#: input topic of each scalable stage (schemas/topics.yaml; no topic prefix in the test stack)
INPUT_TOPIC = {"rollout": "rl.prompts", "reward": "rl.rollouts"}
METRICS_PORT = {"rollout": 8200, "reward": 8300}


def say(msg: str) -> None:
    print(f"[compose-checks {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)  # noqa: T201


class Failed(Exception):
    pass


# ---------------------------------------------------------------------------- docker
def sh(*argv: str, check: bool = True, timeout: float = 120) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise Failed(f"{' '.join(argv[:4])} ... exited {r.returncode}: {r.stderr.strip()[-500:]}")
    return r.stdout


class Stack:
    def __init__(self, project: str):
        self.project = project

    def containers(self, service: str) -> list[str]:
        """Full ids of the service's containers (any state), by compose's labels, oldest first."""
        out = sh("docker", "ps", "-aq", "--no-trunc", "--filter", f"label=com.docker.compose.project={self.project}",
                 "--filter", f"label=com.docker.compose.service={service}")
        number = lambda c: int(self.inspect(c)["Config"]["Labels"].get("com.docker.compose.container-number", 0))
        return sorted(out.split(), key=number)

    def inspect(self, cid: str) -> dict:
        return json.loads(sh("docker", "inspect", cid))[0]

    def name(self, cid: str) -> str:
        return self.inspect(cid)["Name"].lstrip("/")

    def health(self, cid: str) -> str:
        st = self.inspect(cid)["State"]
        return (st.get("Health") or {}).get("Status", "") if st.get("Running") else st.get("Status", "")

    def ip(self, cid: str) -> str:
        nets = self.inspect(cid)["NetworkSettings"]["Networks"]
        return next(iter(nets.values()))["IPAddress"]

    def prometheus(self) -> str:
        c = self.containers("prometheus")
        if not c:
            raise Failed("no prometheus container")
        return c[0]

    def prom(self, path: str, **params) -> dict:
        """GET Prometheus' API inside its container (wget: the network is internal)."""
        url = f"http://localhost:9090{path}?{urllib.parse.urlencode(params)}"
        r = subprocess.run(["docker", "exec", self.prometheus(), "wget", "-qO-", "--content-on-error", url],
                           capture_output=True, text=True, timeout=60)
        try:
            body = json.loads(r.stdout)
        except ValueError:
            raise Failed(f"Prometheus {path} {params}: no JSON (wget exit {r.returncode}: {r.stderr.strip()[-300:]})")
        if body.get("status") != "success":
            raise Failed(f"Prometheus {path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.prom("/api/v1/query", query=expr)["result"]

    def learner_steps(self) -> list[tuple[float, int]]:
        """(ts, step) of every `step` line the learner container logged (all its restarts)."""
        c = self.containers("learner")
        if not c:
            return []
        out = subprocess.run(["docker", "logs", c[0]], capture_output=True, text=True, timeout=60)
        steps = []
        for line in (out.stdout + out.stderr).splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("msg") == "step" and "step" in rec:
                steps.append((float(rec["ts"]), int(rec["step"])))
        return sorted(steps)


def wait_for(what: str, cond, timeout_s: float, every_s: float = 2.0):
    """cond() until truthy (returned) or timeout (Failed with what, and cond's last error)."""
    deadline, last = time.time() + timeout_s, None
    while True:
        try:
            got = cond()
            if got:
                return got
        except Failed as e:
            last = e
        if time.time() > deadline:
            raise Failed(f"{what}: not within {timeout_s:.0f} s" + (f" (last: {last})" if last else ""))
        time.sleep(every_s)


# ---------------------------------------------------------------------------- chaos
def partitions_of(stack: Stack, service: str, ip: str) -> list[int]:
    """The partitions of the service's input topic that the replica at ip reports a consumer lag
    for on its /metrics, as Prometheus scraped them last."""
    inst = f"{ip}:{METRICS_PORT[service]}"
    sel = f'job="{service}",instance="{inst}",topic="{INPUT_TOPIC[service]}"'
    res = stack.query(f"steadyrl_kafka_consumer_lag{{{sel}}}")
    return sorted(int(r["metric"]["partition"]) for r in res)


def records_of(stack: Stack, service: str, ip: str) -> float:
    inst = f"{ip}:{METRICS_PORT[service]}"
    res = stack.query(f'sum(steadyrl_stage_records_total{{job="{service}",instance="{inst}"}})')
    return float(res[0]["value"][1]) if res else 0.0


def targets_up(stack: Stack, job: str) -> list[str]:
    t = stack.prom("/api/v1/targets", state="active")["activeTargets"]
    return sorted(x["labels"]["instance"] for x in t if x["labels"].get("job") == job and x["health"] == "up")


def kill9(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except PermissionError:  # not root: the container's user is not ours
        sh("sudo", "-n", "kill", "-9", str(pid))


def chaos(args) -> dict:
    stack = Stack(args.project)
    t0 = time.time()
    rep: dict = {"steps": args.steps, "scale": {"rollout": args.rollout, "reward": args.reward}}

    def step_now() -> int:
        s = stack.learner_steps()
        return s[-1][1] if s else 0

    wait_for(f"the learner's step {args.scale_at_step}", lambda: step_now() >= args.scale_at_step, args.timeout_s)
    before = {s: stack.containers(s) for s in ("rollout", "reward")}
    rep["scale_up_at_step"] = step_now()
    say(f"scale-up at learner step {rep['scale_up_at_step']}: rollout={args.rollout} reward={args.reward}")
    t_scale = time.time()
    r = subprocess.run([*args.compose, "up", "-d", "--no-build", "--scale", f"rollout={args.rollout}",
                        "--scale", f"reward={args.reward}"], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise Failed(f"compose up --scale exited {r.returncode}: {r.stderr[-1000:]}")
    rep["scale_up_command_s"] = round(time.time() - t_scale, 1)
    after = {s: stack.containers(s) for s in ("rollout", "reward")}
    for s, n in (("rollout", args.rollout), ("reward", args.reward)):
        if len(after[s]) != n:
            raise Failed(f"{s}: {len(after[s])} containers after --scale {s}={n}")
        if not set(before[s]) <= set(after[s]):
            raise Failed(f"{s}: a running replica was recreated by the scale-up")
    new = [(s, c) for s in ("rollout", "reward") for c in after[s] if c not in before[s]]
    rep["new_replicas"] = []
    for s, c in new:
        name, ip = stack.name(c), stack.ip(c)
        wait_for(f"{name} healthy", lambda c=c: stack.health(c) == "healthy", args.timeout_s)
        t_healthy = time.time() - t_scale
        parts = wait_for(f"{name}'s /metrics (via Prometheus) showing partitions of {INPUT_TOPIC[s]}",
                         lambda s=s, ip=ip: partitions_of(stack, s, ip), args.timeout_s)
        records = wait_for(f"{name} handling input records (steadyrl_stage_records_total)",
                           lambda s=s, ip=ip: records_of(stack, s, ip), args.timeout_s)
        row = {"service": s, "container": name, "instance": f"{ip}:{METRICS_PORT[s]}", "partitions": parts,
               "healthy_after_s": round(t_healthy, 1), "records_at_check": records,
               "partitions_after_s": round(time.time() - t_scale, 1)}
        rep["new_replicas"].append(row)
        say(f"new replica {name}: healthy after {row['healthy_after_s']} s, partitions {parts} of "
            f"{INPUT_TOPIC[s]}, {records:.0f} records handled")
    for s, n in (("rollout", args.rollout), ("reward", args.reward)):
        up = wait_for(f"Prometheus: {n} {s} targets up", lambda s=s, n=n: len(targets_up(stack, s)) == n
                      and targets_up(stack, s), args.timeout_s)
        rep.setdefault("targets_up", {})[s] = up
    rep["partitions_by_replica"] = {
        s: {stack.name(c): partitions_of(stack, s, stack.ip(c)) for c in after[s]} for s in ("rollout", "reward")}
    say(f"partitions by replica: {rep['partitions_by_replica']}")

    # ---- SIGKILL of the main process of one rollout, one reward and the learner container
    victims = [("rollout", after["rollout"][0]), ("reward", after["reward"][0]),
               ("learner", stack.containers("learner")[0])]
    step_at_kill = step_now()
    if step_at_kill >= args.steps - args.min_steps_after:
        raise Failed(f"the learner is at step {step_at_kill} of {args.steps} at the kills: the run is too short "
                     f"to outlast them (raise COMPOSE_TEST_STEPS)")
    rep["kill_at_step"] = step_at_kill
    kills = []
    for s, c in victims:
        st = stack.inspect(c)["State"]
        if not st.get("Running") or not st.get("Pid"):
            raise Failed(f"{stack.name(c)} is not running before its kill ({st.get('Status')})")
        kills.append({"service": s, "cid": c, "container": stack.name(c), "pid": st["Pid"],
                      "restarts_before": stack.inspect(c)["RestartCount"]})
    t_kill = time.time()
    for k in kills:
        kill9(k["pid"])
        say(f"kill -9 {k['pid']} (main process of {k['container']})")
    rep["kills"] = kills
    for k in kills:
        c = k["cid"]

        def restarted(c=c, k=k):
            d = stack.inspect(c)
            st = d["State"]
            return d["RestartCount"] > k["restarts_before"] and st.get("Running") and st["Pid"] != k["pid"]

        wait_for(f"{k['container']} restarted by its restart policy", restarted, args.timeout_s, every_s=0.5)
        d = stack.inspect(c)
        k["restart_count"], k["new_pid"] = d["RestartCount"], d["State"]["Pid"]
        k["exit_code_seen"] = d["State"].get("ExitCode")
        k["restarted_after_s"] = round(time.time() - t_kill, 1)
    for k in kills:
        wait_for(f"{k['container']} healthy again", lambda c=k["cid"]: stack.health(c) == "healthy", args.timeout_s)
        k["healthy_after_s"] = round(time.time() - t_kill, 1)
        say(f"{k['container']}: restarted (RestartCount {k['restart_count']}, pid {k['pid']} -> {k['new_pid']}) "
            f"after {k['restarted_after_s']} s, healthy after {k['healthy_after_s']} s")
        k.pop("cid")

    def trained_after_kill():
        later = [(ts, n) for ts, n in stack.learner_steps() if ts > t_kill]
        return later[0] if later else None

    ts, n = wait_for("a step trained by the restarted learner", trained_after_kill, args.timeout_s)
    rep["learner_first_step_after_kill"] = {"step": n, "after_s": round(ts - t_kill, 1)}
    say(f"the restarted learner trained step {n} {ts - t_kill:.1f} s after the kills (killed at step {step_at_kill})")
    rep["wall_s"] = round(time.time() - t0, 1)
    return rep


# ---------------------------------------------------------------------------- grafana
def dashboard_queries() -> list[dict]:
    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        d = json.loads(path.read_text())

        def walk(panels):
            for p in panels:
                yield p
                yield from walk(p.get("panels", []))

        for p in walk(d.get("panels", [])):
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append({"dashboard": path.name, "panel": p.get("title", ""), "ref": t.get("refId", ""),
                                "expr": t["expr"]})
    return out


def expected_empty() -> dict[str, str]:
    """expr -> why it is empty on a CPU run (compose/grafana/expected-empty.json)."""
    return {e["expr"]: e["why"] for e in json.loads(EXPECTED_EMPTY.read_text())["queries"]}


def grafana(args) -> dict:
    stack = Stack(args.project)
    queries, empty_ok = dashboard_queries(), expected_empty()
    exprs = {q["expr"] for q in queries}
    stale = sorted(set(empty_ok) - exprs)
    failures = [f"expected-empty.json lists a query no dashboard has: {e}" for e in stale]
    for q in queries:
        data = stack.prom("/api/v1/query_range", query=q["expr"], start=f"{args.start:.3f}", end=f"{args.end:.3f}",
                          step=str(args.step))
        series = [r for r in data["result"] if r.get("values")]
        q["series"] = len(series)
        q["expected_empty"] = empty_ok.get(q["expr"])
        if not series and q["expected_empty"] is None:
            failures.append(f"{q['panel']} [{q['ref']}] returned no series: {q['expr']}")
        state = "non-empty" if series else ("expected-empty" if q["expected_empty"] else "EMPTY")
        note = " (listed as expected-empty, but has series)" if series and q["expected_empty"] else ""
        say(f"{state:14} {len(series):3} series  {q['panel']} [{q['ref']}]{note}")
    rep = {"queried": len(queries), "non_empty": sum(1 for q in queries if q["series"]),
           "expected_empty": sum(1 for q in queries if not q["series"] and q["expected_empty"]),
           "listed_but_non_empty": [q["expr"] for q in queries if q["series"] and q["expected_empty"]],
           "start": args.start, "end": args.end, "failures": failures, "queries": queries}
    return rep


# ---------------------------------------------------------------------------- audit (in the image)
def audit(args) -> dict:
    from steadyrl.testing.audit import audit_pipeline, explain
    from steadyrl.testing.run import RunDir

    report = audit_pipeline(args.bootstrap, args.prefix, RunDir(args.state_dir), args.steps, args.batch,
                            excuse_dlq=False, client="compose-test-audit")
    report["explain"] = explain(report)
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("chaos")
    c.add_argument("--project", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--steps", type=int, required=True, help="the learner's learner.steps")
    c.add_argument("--scale-at-step", type=int, default=5)
    c.add_argument("--min-steps-after", type=int, default=20, help="steps that must remain at the kills")
    c.add_argument("--rollout", type=int, default=3)
    c.add_argument("--reward", type=int, default=2)
    c.add_argument("--timeout-s", type=float, default=600)
    c.add_argument("compose", nargs=argparse.REMAINDER, help="-- the compose command with -p and -f")
    g = sub.add_parser("grafana")
    g.add_argument("--project", required=True)
    g.add_argument("--out", required=True)
    g.add_argument("--start", type=float, required=True)
    g.add_argument("--end", type=float, required=True)
    g.add_argument("--step", type=int, default=5)
    a = sub.add_parser("audit")
    a.add_argument("--steps", type=int, required=True)
    a.add_argument("--batch", type=int, required=True)
    a.add_argument("--bootstrap", default="kafka:9092")
    a.add_argument("--prefix", default="")
    a.add_argument("--state-dir", default="/var/lib/steadyrl/learner")
    args = ap.parse_args(argv)
    if args.cmd == "chaos":
        if args.compose[:1] == ["--"]:
            args.compose = args.compose[1:]
        if not args.compose:
            ap.error("chaos needs the compose command after --")
    try:
        if args.cmd == "chaos":
            rep = chaos(args)
            ok = True
        elif args.cmd == "grafana":
            rep = grafana(args)
            ok = not rep["failures"]
            for f in rep["failures"]:
                say(f"FAIL: {f}")
            say(f"grafana: {rep['queried']} queries, {rep['non_empty']} non-empty, {rep['expected_empty']} "
                f"expected-empty, {len(rep['failures'])} failures")
        else:
            rep = audit(args)
            print(json.dumps(rep, default=str))  # noqa: T201  the report, for the script
            return 0 if rep["ok"] else 1
    except Failed as e:
        say(f"FAIL: {e}")
        rep, ok = {"error": str(e)}, False
    Path(args.out).write_text(json.dumps(rep, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
