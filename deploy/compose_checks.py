#!/usr/bin/env python3
"""The mid-run checks of `make compose-test` (deploy/compose-test.sh), issue 20.

Standard library only on the host; the `audit` command runs inside a steadyrl container (this
file piped to `python -`), where the project is installed.

    compose_checks.py chaos   --project P --out F [options] -- COMPOSE...   (host)
    compose_checks.py grafana --project P --out F --start T0 --end T1         (host)
    compose_checks.py audit   --steps N --batch B                             (in the image)
    compose_checks.py forge   [--secrets-dir /run/secrets]                    (in the image)

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
  kafka:9092, as the admin principal (the script passes its credentials): every published prompt
  trained exactly once, none lost (DLQ not excused), both stages exactly once.

forge (issue 21, mid-run, in a one-off container of topic-init, which has every password file):
  records no principal may write, sent the way an attacker on the network would, each refused by
  the broker: a forged group on rl.scored and a forged policy record on rl.policy from the rollout
  principal (plain and transactional, with a transactional id of its own prefix: refused with
  TOPIC_AUTHORIZATION_FAILED), a forged DLQ record on rl.dlq from the actor principal (which may
  write nothing), and all three from a client with a wrong password, an unknown user and no
  credentials at all (the SASL listener refuses the login: nothing delivered). Then, as admin,
  every record of the three topics is read (read_uncommitted: aborted ones too): none carries the
  forgery's nonce. HTTP: the actor's POST /generate, the reward server's POST /score and the
  alert bridge's POST /alert/dingtalk answer 401 without a token and with a wrong one, while
  /livez answers 200 without one.

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
            raise Failed(f"Prometheus {path} {params}: no JSON "
                         f"(wget exit {r.returncode}: {r.stderr.strip()[-300:]})") from None
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


# ---------------------------------------------------------------------------- forge (in the image)
FORGE_HEADER = "steadyrl-forged"


def _kafka_conf(bootstrap: str, username: str | None, password: str | None) -> dict:
    conf = {"bootstrap.servers": bootstrap, "log_level": 0, "socket.timeout.ms": 10000}
    if username is not None:
        conf |= {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-512",
                 "sasl.username": username, "sasl.password": password or ""}
    return conf


def forge_produce(conf: dict, topic: str, value: bytes, nonce: str, *, transactional_id: str | None = None,
                  timeout_s: float = 15.0) -> dict:
    """Try to write one record; what the client saw: delivered or not, the delivery/transaction
    error, and the client's own errors (a refused login: _AUTHENTICATION)."""
    from confluent_kafka import KafkaException, Producer

    seen: list[str] = []
    out: dict = {"topic": topic, "delivered": False, "error": None}

    def on_error(err):
        seen.append(f"{err.name()}: {err.str()}")

    def on_delivery(err, msg):
        if err is None:
            out["delivered"] = True
        else:
            out["error"] = err.name()
            out["error_text"] = err.str()

    pconf = conf | {"error_cb": on_error, "message.timeout.ms": int(timeout_s * 1000),
                    "enable.idempotence": transactional_id is not None}
    if transactional_id:
        pconf |= {"transactional.id": transactional_id, "transaction.timeout.ms": 30000}
    p = Producer(pconf)
    headers = [(FORGE_HEADER, nonce.encode())]
    try:
        if transactional_id:
            p.init_transactions(timeout_s)
            p.begin_transaction()
        p.produce(topic, value, key=f"forged-{nonce}".encode(), headers=headers, on_delivery=on_delivery)
        if transactional_id:
            p.commit_transaction(timeout_s)
            out["delivered"] = out["delivered"] or out["error"] is None
        p.flush(timeout_s + 5)
    except KafkaException as e:
        err = e.args[0]
        out["delivered"] = False
        out["error"] = out["error"] or err.name()
        out["error_text"] = err.str()
    out["client_errors"] = sorted(set(seen))[:5]
    return out


def read_all(conf: dict, topic: str, timeout_s: float = 60.0) -> list:
    """Every record of the topic, aborted ones too (read_uncommitted), as admin."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer(conf | {"group.id": f"compose-test-forge-{os.getpid()}", "enable.auto.commit": False,
                         "isolation.level": "read_uncommitted", "auto.offset.reset": "earliest"})
    try:
        md = c.list_topics(topic, timeout=timeout_s).topics[topic]
        if md.error is not None:
            raise Failed(f"{topic}: {md.error}")
        parts = [TopicPartition(topic, p, 0) for p in md.partitions]
        ends = {tp.partition: c.get_watermark_offsets(tp, timeout=timeout_s)[1] for tp in parts}
        c.assign(parts)
        got, deadline = [], time.time() + timeout_s
        pos = dict.fromkeys(ends, 0)
        while any(pos[p] < ends[p] for p in ends) and time.time() < deadline:
            for m in c.consume(500, timeout=1.0):
                if not m.error():
                    got.append(m)
            # the consumer's position, not the last record's offset + 1: a partition whose last
            # entry is a transaction's commit or abort marker ends past every record it delivers
            for tp in c.position(parts):
                pos[tp.partition] = max(pos[tp.partition], tp.offset)
        if any(pos[p] < ends[p] for p in ends):
            raise Failed(f"{topic}: could not read to the end within {timeout_s:.0f} s "
                         f"(at {pos}, ends {ends})")
        return got
    finally:
        c.close()


def http_status(url: str, *, token: str | None = None, method: str = "GET", body: bytes | None = None) -> int:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError) as e:  # not reached at all: a failed check, not a crash
        say(f"{method} {url}: {e}")
        return 0


def forge(args) -> dict:
    import uuid

    secrets = Path(args.secrets_dir)
    pw = lambda who: (secrets / f"kafka-{who}").read_text().strip()  # noqa: E731
    nonce = uuid.uuid4().hex
    topic = lambda t: f"{args.prefix}{t}"  # noqa: E731
    group = json.dumps({"prompt_id": f"forged-{nonce}", "rewards": [1.0] * 8, "note": "forged group"}).encode()
    policy = json.dumps({"version": 10**9, "path": "/tmp/evil", "sha256": "0" * 64, "note": "forged policy"}).encode()
    dlq = json.dumps({"stage": "forged", "reason": "forged", "note": "forged DLQ record"}).encode()
    b = args.bootstrap
    wrong = "wrong-" + uuid.uuid4().hex
    attempts = [
        # (who, conf, topic, value, transactional id, what the broker must answer)
        ("rollout", _kafka_conf(b, "rollout", pw("rollout")), "rl.scored", group, None, "TOPIC_AUTHORIZATION_FAILED"),
        ("rollout", _kafka_conf(b, "rollout", pw("rollout")), "rl.policy", policy, None, "TOPIC_AUTHORIZATION_FAILED"),
        ("rollout (transactional)", _kafka_conf(b, "rollout", pw("rollout")), "rl.scored", group,
         f"steadyrl-rollout-forge-{nonce[:8]}", "TOPIC_AUTHORIZATION_FAILED"),
        ("actor", _kafka_conf(b, "actor", pw("actor")), "rl.dlq", dlq, None, "TOPIC_AUTHORIZATION_FAILED"),
    ]
    for t, v in (("rl.scored", group), ("rl.policy", policy), ("rl.dlq", dlq)):
        attempts += [("rollout, wrong password", _kafka_conf(b, "rollout", wrong), t, v, None, "login refused"),
                     ("unknown user", _kafka_conf(b, "mallory", wrong), t, v, None, "login refused"),
                     ("no credentials", _kafka_conf(b, None, None), t, v, None, "not delivered")]
    rep: dict = {"nonce": nonce, "attempts": [], "failures": []}
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(attempts)) as pool:  # a refused login waits out its timeout: all at once
        results = list(pool.map(lambda a: forge_produce(a[1], topic(a[2]), a[3], nonce, transactional_id=a[4],
                                                        timeout_s=args.timeout_s), attempts))
    for (who, _conf, _t, _value, _txn, want), r in zip(attempts, results, strict=True):
        r["who"], r["want"] = who, want
        r["login_refused"] = any("_AUTHENTICATION" in e or "uthentication failed" in e for e in r["client_errors"])
        ok = not r["delivered"]
        if want == "TOPIC_AUTHORIZATION_FAILED":
            ok = ok and r["error"] == want
        elif want == "login refused":
            ok = ok and r["login_refused"]
        r["ok"] = ok
        rep["attempts"].append(r)
        say(f"{'refused' if ok else 'NOT AS WANTED'}: {who} -> {t}: delivered={r['delivered']} error={r['error']} "
            f"client errors={r['client_errors'][:2]}")
        if not ok:
            rep["failures"].append(f"{who} -> {t}: want {want}, got delivered={r['delivered']} error={r['error']} "
                                   f"{r['client_errors']}")
    admin = _kafka_conf(b, "admin", pw("admin"))
    rep["scanned"] = {}
    for t in ("rl.scored", "rl.policy", "rl.dlq"):
        msgs = read_all(admin, topic(t))
        forged = [m for m in msgs if nonce.encode() in (m.value() or b"") or
                  any(k == FORGE_HEADER for k, _ in (m.headers() or []))]
        rep["scanned"][t] = {"records": len(msgs), "forged": len(forged)}
        say(f"{t}: {len(msgs)} records read as admin, {len(forged)} forged")
        if forged:
            rep["failures"].append(f"{t}: {len(forged)} forged records are on the topic")

    token = (secrets / "http-token").read_text().strip() if (secrets / "http-token").exists() else None
    alert = (secrets / "alert-token").read_text().strip() if (secrets / "alert-token").exists() else None
    rep["http"] = []
    # each route with the other route's token: the alert bridge's must not open /generate or
    # /score, the work token must not open /alert/* (tokens per caller route, issue 34)
    routes = (("actor", args.actor_url, "/generate", alert), ("reward-server", args.reward_server_url, "/score", alert),
              ("alertbridge", args.alertbridge_url, "/alert/dingtalk", token))
    for name, base, path, other in () if args.skip_http else routes:
        row = {"service": name,
               "no_token": http_status(base + path, method="POST", body=b"{}"),
               "wrong_token": http_status(base + path, token="wrong-" + nonce, method="POST", body=b"{}"),
               "other_routes_token": http_status(base + path, token=other, method="POST", body=b"{}")
               if other else None,
               "livez_no_token": http_status(base + "/livez")}
        rep["http"].append(row)
        say(f"HTTP {name}: POST {path} without a token {row['no_token']}, with a wrong one {row['wrong_token']}, "
            f"with the other routes' token {row['other_routes_token']}; GET /livez without one "
            f"{row['livez_no_token']}")
        if row["no_token"] != 401 or row["wrong_token"] != 401 or row["livez_no_token"] != 200 \
                or row["other_routes_token"] not in (None, 401):
            rep["failures"].append(f"HTTP {name}: {row}")
    rep["http_token_known"] = token is not None
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
    f = sub.add_parser("forge")
    f.add_argument("--bootstrap", default="kafka:9092")
    f.add_argument("--prefix", default="")
    f.add_argument("--secrets-dir", default="/run/secrets")
    f.add_argument("--actor-url", default="http://actor:8100")
    f.add_argument("--reward-server-url", default="http://reward-server:8390")
    f.add_argument("--alertbridge-url", default="http://alertbridge:8500")
    f.add_argument("--timeout-s", type=float, default=15.0, help="per forged record")
    f.add_argument("--skip-http", action="store_true", help="Kafka only (no pipeline running)")
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
        elif args.cmd == "forge":
            rep = forge(args)
            for f in rep["failures"]:
                say(f"FAIL: {f}")
            print(json.dumps(rep, default=str))  # noqa: T201  the report, for the script
            return 0 if not rep["failures"] else 1
        else:
            rep = audit(args)
            print(json.dumps(rep, default=str))  # noqa: T201  the report, for the script
            return 0 if rep["ok"] else 1
    except Failed as e:
        say(f"FAIL: {e}")
        if args.cmd in ("audit", "forge"):  # in the image: the report goes to stdout
            print(json.dumps({"ok": False, "error": str(e), "failures": [str(e)]}))  # noqa: T201
            return 1
        rep, ok = {"error": str(e)}, False
    Path(args.out).write_text(json.dumps(rep, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
