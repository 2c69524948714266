"""Throughput of the Kafka pipeline (max_staleness 0 and 2) vs the in-process loop vs TRL's
GRPOTrainer, interleaved on one machine; and the Kafka overhead per record through each stage.

    flock /tmp/steadyrl-bench.lock .venv/bin/python bench/throughput.py [--steps 200] [--rounds 3]

Arms, same tiny model (steadyrl.models `tiny`, seed 0), task (tiny_copy:256 prompts, tiny_copy
reward), B x G, max_new_tokens, learning settings and steps (configs/tiny.yaml's learner
section, `--steps` steps, no evaluation):

  pipeline-s0  `steadyrl up --bootstrap <bench broker>` at max_staleness 0: five service
               processes (reward server, actor, rollout, reward, learner) over Kafka
  pipeline-s2  the same at max_staleness 2
  loop         steadyrl.rl.loop.run_loop in one process (bench/_throughput_arms.py loop)
  trl          trl.GRPOTrainer in one process, from bench/.venv-trl (bench/_throughput_arms.py trl);
               the bench creates that venv on first use (trl over the project's .venv, which
               is left untouched: see setup_trl_venv)

Each round runs every arm once, in that order (A B C D, A B C D, ...); a warm-up round of
short runs goes first and is not counted. An arm much faster than the others repeats its
N-step run (fresh model, same seed) until it has run `--min-arm-seconds`. Figures per run:

  steady samples/s and tokens/s: from the end of step W (W = max(5, N/10)) to the end of
      step N; samples = B x G per step, tokens = generated response tokens (EOS included);
  end-to-end seconds: process start to exit (imports, model, and for the pipeline service
      start-up and shutdown; the broker is already running);
  CPU seconds: the arm's process tree (getrusage of reaped children), plus the broker's
      CPU time during the arm; machine CPU: all cores, from /proc/stat (so other load shows).

Ratios are taken within a round (same minutes, same machine load) and reported as the
median over rounds, with the range.

The pipeline runs also give the Kafka overhead per record (bench/results/kafka_overhead.json):
each trained group is followed through the topics by its record timestamps (CreateTime,
set by the producing client): rl.prompts (learner) -> rl.rollouts (rollout worker) ->
rl.scored (reward worker) -> the rl.policy record of the step that trained it (learner).
Each hop is set against the stage's own metrics, scraped from /metrics every 5 s:
steadyrl_stage_batch_seconds (the stage's transform of a batch), steadyrl_actor_generate_seconds
and steadyrl_reward_server_score_seconds (the work), the learner's phase gauges.

Starts its own broker (`--port`, state in `--state-dir`) unless `--bootstrap` is given;
stops what it started. Before each arm, waits while a process with /tmp/ci in its command
line runs (CI on the same cores), polling every 30 s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PY = ROOT / ".venv" / "bin" / "python"
TRL_PY = ROOT / "bench" / ".venv-trl" / "bin" / "python"
ARMS = ("pipeline-s0", "pipeline-s2", "loop", "trl")
SERVICE_PORTS = {"actor": 8100, "rollout": 8200, "reward": 8300, "reward-server": 8390, "learner": 8400}
CLK = os.sysconf("SC_CLK_TCK")

# Differences between the arms that the bench does not remove (written into the JSON).
DIFFERENCES = [
    "Prompt order: the loop and the pipeline take prompts in steadyrl's seeded order (prompt_batches); TRL's "
    "RepeatSampler shuffles the same 256 rows with its own seeded order. The task is one digit per prompt, so "
    "every batch costs the same work.",
    "Sampling: steadyrl samples each row with its own seeded torch.Generator through a logits processor "
    "(SeededSampler) and keeps per-token log-probs from output_logits; TRL calls model.generate(do_sample=True) "
    "and keeps no sampling log-probs (it re-computes them in the update). Same HF generate loop, KV cache on.",
    "Loss: both are token-mean (TRL loss_type='dapo') over the one batch, group-std advantages, clip 0.2/0.2, no "
    "KL, one on-policy update per batch (no old-log-prob pass). steadyrl adds dual-clip (c=3), which is inert "
    "when the ratio is 1; the advantage's epsilon is 1e-4 in TRL, 1e-6 in steadyrl (both divide by the unbiased group std).",
    "TRL runs inside transformers.Trainer (accelerate, dataloader, callbacks, metric gathering, one "
    "logits-to-keep forward); steadyrl's loop calls its own Trainer.step. Both use torch's default intra-op "
    "threads (2 here).",
    "The pipeline does what the loop does not: five processes and a broker share the 2 cores; every step the "
    "learner writes the policy (safetensors, fsync, sha256), announces it on rl.policy, the actor loads it, "
    "state.json and consumed.jsonl are fsynced, the Arrow rollout cache is appended, and a checkpoint is "
    "written every 5 steps (checkpoint_every default). These are part of what is measured.",
    "TRL runs in bench/.venv-trl: a venv that adds trl and its new dependencies (datasets, pandas, dill, "
    "multiprocess, xxhash) and imports everything else, torch included, from the project's .venv (a .pth "
    "line): the same torch, transformers and accelerate files as the other arms.",
]


TRL_VERSION = "1.16.0"  # `pip install --dry-run trl` into .venv changed nothing installed; 1.16.0 was the newest


def setup_trl_venv(path: Path = TRL_PY.parent.parent) -> None:
    """bench/.venv-trl: a venv that sees the project's .venv (a .pth line runs site.addsitedir on
    its site-packages, so torch, transformers and accelerate are the very same files) and adds
    trl and the packages trl needs that .venv lacks. The project's .venv is not touched."""
    import site

    subprocess.run([sys._base_executable, "-m", "venv", str(path)], check=True)
    own = next(p for p in site.getsitepackages() if p.endswith("site-packages"))
    pth = next(path.glob("lib/python*/site-packages")) / "_steadyrl_venv.pth"
    pth.write_text(f"import site; site.addsitedir({own!r})\n")
    subprocess.run([str(path / "bin" / "pip"), "install", "-q", f"trl=={TRL_VERSION}"], check=True)


# ---- machine ------------------------------------------------------------------------------
def ci_running() -> list[str]:
    out = subprocess.run(["pgrep", "-af", "/tmp/ci"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.strip()]


def wait_for_ci(poll_s: float = 30.0) -> float:
    """Seconds waited until no process with /tmp/ci in its command line runs."""
    t0 = time.monotonic()
    while ci_running():
        print(f"  CI is running ({len(ci_running())} processes); waiting {poll_s:.0f} s", flush=True)
        time.sleep(poll_s)
    return time.monotonic() - t0


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, all cores."""
    f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = f[3] + f[4]
    return (sum(f[:8]) - idle) / CLK, sum(f[:8]) / CLK


def proc_cpu(pid: int | None) -> float:
    if not pid:
        return 0.0
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / CLK
    except (OSError, IndexError, ValueError):
        return 0.0


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class Meter:
    """Wall, CPU of the reaped children, broker CPU, machine CPU and load around one arm."""

    def __init__(self, broker_pid: int | None):
        self.broker_pid = broker_pid

    def __enter__(self):
        self.t0 = time.monotonic()
        self.c0, self.b0, self.m0 = children_cpu(), proc_cpu(self.broker_pid), machine_cpu()
        self.load0 = os.getloadavg()[0]
        self.ci_seen: list[str] = []
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._watch_ci, daemon=True)
        self._watch.start()
        return self

    def _watch_ci(self) -> None:
        while not self._stop.wait(10):
            if not self.ci_seen:
                self.ci_seen = ci_running()[:3]

    def __exit__(self, *exc):
        self._stop.set()
        wall = time.monotonic() - self.t0
        busy, total = machine_cpu()
        self.figures = {
            "wall_s": wall, "cpu_s": children_cpu() - self.c0, "broker_cpu_s": proc_cpu(self.broker_pid) - self.b0,
            "machine_busy_cores": (busy - self.m0[0]) / wall, "loadavg_1m_start": self.load0,
            "loadavg_1m_end": os.getloadavg()[0], "ci_seen_during": self.ci_seen,
        }
        return False


# ---- configs ------------------------------------------------------------------------------
def make_config(path: Path, steps: int, staleness: int) -> Path:
    import yaml

    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg["learner"].update(steps=steps, max_staleness=staleness, eval_data=None)
    path.write_text(yaml.safe_dump(cfg))
    return path


def learner_section(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())["learner"]


# ---- the in-process arms --------------------------------------------------------------------
def run_inproc(kind: str, config: Path, min_seconds: float, work: Path, broker_pid: int | None,
               timeout_s: float) -> dict:
    out = work / f"{kind}-{uuid.uuid4().hex[:6]}.json"
    py = PY if kind == "loop" else TRL_PY
    log = work / f"{out.stem}.log"
    with Meter(broker_pid) as m, open(log, "wb") as lf:
        rc = subprocess.run([str(py), str(ROOT / "bench" / "_throughput_arms.py"), kind, "--config", str(config),
                             "--out", str(out), "--min-seconds", str(min_seconds)],
                            cwd=ROOT, stdout=lf, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
    if rc != 0:
        raise RuntimeError(f"{kind} arm exited {rc}: {log.read_text()[-3000:]}")
    res = json.loads(out.read_text())
    lc = learner_section(config)
    runs = []
    for r in res["runs"]:
        runs.append(_figures(lc, r["step_end"], r["tokens"], e2e_s=res["import_s"] + r["setup_s"] + r["loop_s"]))
        runs[-1]["reward_first10_last10"] = [statistics.mean(r["reward"][:10]), statistics.mean(r["reward"][-10:])]
        for k, v in r.get("phase_s", {}).items():
            runs[-1][f"median_{k}"] = statistics.median(v)
    n_samples = len(runs) * lc["steps"] * lc["prompts_per_step"] * lc["group_size"]
    return {**_merge(runs), "runs": runs, "repeats": len(runs), "meter": m.figures,
            "cpu_s_per_1k_samples": 1000 * (m.figures["cpu_s"] + m.figures["broker_cpu_s"]) / n_samples,
            "import_s": res["import_s"], "versions": res.get("versions"), "torch_threads": res.get("torch_threads"),
            "settings": res.get("settings")}


def _figures(lc: dict, step_end: list[float], tokens: list[int], e2e_s: float, step_seconds=None) -> dict:
    """Steady-state and end-to-end figures of one N-step run."""
    n = lc["steps"]
    per_step = lc["prompts_per_step"] * lc["group_size"]
    w = max(5, n // 10)
    if step_seconds is not None:
        steady_s = sum(step_seconds[w:])
    else:
        steady_s = step_end[n - 1] - step_end[w - 1]
    assert len(tokens) == n and (step_seconds is not None or len(step_end) == n), (len(tokens), len(step_end), n)
    steady_tokens = sum(tokens[w:])
    return {"steps": n, "warm_steps": w, "steady_s": steady_s, "steady_samples": (n - w) * per_step,
            "steady_tokens": steady_tokens, "samples_per_s": (n - w) * per_step / steady_s,
            "tokens_per_s": steady_tokens / steady_s, "s_per_step": steady_s / (n - w),
            "e2e_s": e2e_s, "e2e_samples_per_s": n * per_step / e2e_s}


def _merge(runs: list[dict]) -> dict:
    """One arm's figures over its repeats: totals for the steady window, median end-to-end."""
    s = sum(r["steady_s"] for r in runs)
    return {"samples_per_s": sum(r["steady_samples"] for r in runs) / s,
            "tokens_per_s": sum(r["steady_tokens"] for r in runs) / s,
            "s_per_step": s / sum(r["steps"] - r["warm_steps"] for r in runs),
            "e2e_s": statistics.median(r["e2e_s"] for r in runs),
            "e2e_samples_per_s": statistics.median(r["e2e_samples_per_s"] for r in runs)}


# ---- the pipeline arms ----------------------------------------------------------------------
class Scraper(threading.Thread):
    """Scrapes every service's /metrics each `interval_s`: keeps the last full scrape, the first
    full scrape at or after learner step `steady_from` (with the broker's CPU time at both),
    and every learner phase-gauge sample."""

    def __init__(self, offset: int, steady_from: int, broker_pid: int | None, interval_s: float = 5.0):
        super().__init__(daemon=True)
        self.urls = {k: f"http://127.0.0.1:{p + offset}/metrics" for k, p in SERVICE_PORTS.items()}
        self.interval_s, self.stop = interval_s, threading.Event()
        self.steady_from, self.broker_pid = steady_from, broker_pid
        self.last: dict[str, str] = {}
        self.full_first: dict | None = None
        self.full_last: dict | None = None
        self.phase_samples: list[dict] = []

    def run(self) -> None:
        import httpx

        while not self.stop.wait(self.interval_s):
            cycle = {"t": time.monotonic(), "broker_cpu_s": proc_cpu(self.broker_pid), "texts": {}}
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
            try:
                f.result(30)
            except Exception:  # noqa: BLE001 - best effort clean-up
                pass


def parse_log(text: str) -> dict:
    """Counts and timestamps from `up`'s prefixed JSON log lines."""
    deferred = {"rollout": 0, "reward": 0}
    deferred_why: dict[str, int] = {}
    loaded: dict[int, float] = {}
    restarts = 0
    for line in text.splitlines():
        name, sep, rest = line.partition(" | ")
        if not sep:
            continue
        name = name.strip()
        if "exited with" in rest:
            restarts += 1
        if not rest.startswith("{"):
            continue
        try:
            rec = json.loads(rest)
        except ValueError:
            continue
        if rec.get("msg") == "batch deferred":
            svc = name.rsplit("-", 1)[0]
            deferred[svc] = deferred.get(svc, 0) + 1
            why = re.sub(r"\d+", "N", str(rec.get("why", "")))[:80]
            deferred_why[why] = deferred_why.get(why, 0) + 1
        elif rec.get("msg") == "policy loaded" and name.startswith("actor"):
            loaded[int(rec["version"])] = float(rec["ts"])
    return {"deferred_batches": deferred, "deferred_why": deferred_why, "actor_loaded_ts": loaded,
            "child_exits": restarts}


def run_pipeline(tag: str, config: Path, bootstrap: str, offset: int, work: Path, broker_pid: int | None,
                 timeout_s: float, keep: bool = False) -> dict:
    from steadyrl import codec
    from steadyrl.contracts import PolicyUpdate, Prompt, RolloutGroup, ScoredGroup

    lc = learner_section(config)
    n, B = lc["steps"], lc["prompts_per_step"]
    state = work / f"state-{tag}"
    prefix = f"tp{uuid.uuid4().hex[:8]}."
    log = work / f"up-{tag}.log"
    scraper = Scraper(offset, max(5, n // 10), broker_pid)
    with Meter(broker_pid) as m, open(log, "wb") as lf:
        proc = subprocess.Popen([str(PY), "-m", "steadyrl.cli", "up", "--bootstrap", bootstrap, "--state-dir",
                                 str(state), "--prefix", prefix, "--port-offset", str(offset), "--config", str(config)],
                                cwd=ROOT, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)
        scraper.start()
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(10)
            raise RuntimeError(f"{tag}: steadyrl up ran past {timeout_s} s; log {log}")
        except BaseException:  # stopped from outside: take the stack down with us
            os.killpg(proc.pid, 15)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
            raise
        finally:
            scraper.stop.set()
    text = log.read_text(errors="replace")
    if rc != 0:
        raise RuntimeError(f"{tag}: steadyrl up exited {rc}: {text[-3000:]}")
    run_dir = state / "learner" / (state / "learner" / "CURRENT").read_text().strip()
    st = json.loads((run_dir / "state.json").read_text())
    hist = st["history"]
    consumed = [json.loads(x) for x in (run_dir / "consumed.jsonl").read_text().splitlines()]
    # exactly-once, as tests/integration/test_pipeline.py audits it
    ids = [c["prompt_id"] for c in consumed]
    audit = {"trained": len(ids), "unique": len(set(ids)), "expected": n * B,
             "ok": len(ids) == n * B == len(set(ids)) and sorted({c["step"] for c in consumed}) == list(range(1, n + 1))}
    fig = _figures(lc, [], [h["tokens"] for h in hist], e2e_s=m.figures["wall_s"],
                   step_seconds=[h["seconds"] for h in hist])
    fig["reward_first10_last10"] = [statistics.mean(h["reward_mean"] for h in hist[:10]),
                                    statistics.mean(h["reward_mean"] for h in hist[-10:])]
    # follow each trained group through the topics
    t = {name: read_topic(bootstrap, f"{prefix}{name}", expect)
         for name, expect in (("rl.prompts", n * B), ("rl.rollouts", n * B), ("rl.scored", n * B),
                              ("rl.policy", n + 1))}
    logs = parse_log(text)
    overhead = trace(lc, consumed, t, logs, stage_metrics(scraper.last), scraper.phase_samples, codec,
                     Prompt, RolloutGroup, ScoredGroup, PolicyUpdate)
    overhead["cpu_per_record"] = cpu_per_record(scraper.full_first, scraper.full_last)
    overhead["stale_drops"] = st["counts"].get("stale", 0)
    overhead["counts"] = st["counts"]
    delete_topics(bootstrap, prefix)
    if not keep:
        shutil.rmtree(state, ignore_errors=True)
    cpu = m.figures["cpu_s"] + m.figures["broker_cpu_s"]
    return {**fig, "meter": m.figures, "cpu_s_per_1k_samples": 1000 * cpu / (n * B * lc["group_size"]),
            "audit": audit, "policy_versions_trained": _version_lag(hist), "kafka": overhead,
            "step_seconds_by_quarter": _quarters([h["seconds"] for h in hist]),
            "step_seconds": _step_seconds(hist, fig["warm_steps"], lc.get("checkpoint_every", 5))}


def _step_seconds(hist: list[dict], w: int, every: int) -> dict:
    """Distribution of the steady steps' seconds, and checkpoint steps (step % every == 0) apart."""
    xs = [h["seconds"] for h in hist[w:]]
    ck = [h["seconds"] for h in hist[w:] if h["step"] % every == 0]
    other = [h["seconds"] for h in hist[w:] if h["step"] % every]
    return {"p50": _pct(xs, 0.5), "p90": _pct(xs, 0.9), "p99": _pct(xs, 0.99), "max": max(xs), "mean": statistics.mean(xs),
            "checkpoint_every": every, "median_checkpoint_steps": statistics.median(ck) if ck else None,
            "median_other_steps": statistics.median(other) if other else None,
            "mean_checkpoint_steps": statistics.mean(ck) if ck else None,
            "mean_other_steps": statistics.mean(other) if other else None}


def _quarters(xs: list[float]) -> list[float]:
    q = max(1, len(xs) // 4)
    return [statistics.median(xs[i:i + q]) for i in range(0, q * 4, q)]


def _version_lag(hist: list[dict]) -> dict:
    """How far behind the trained groups' policy versions were (0 = on-policy)."""
    lags: dict[int, int] = {}
    for h in hist:
        for v in h["policy_versions"]:
            lag = h["step"] - 1 - v
            lags[lag] = lags.get(lag, 0) + 1
    return {str(k): lags[k] for k in sorted(lags)}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _dist(xs: list[float]) -> dict:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {}
    return {"p50_ms": round(_pct(xs, 0.5), 1), "p90_ms": round(_pct(xs, 0.9), 1), "mean_ms": round(statistics.mean(xs), 1),
            "n": len(xs)}


def trace(lc, consumed, t, logs, metrics, phase_samples, codec, Prompt, RolloutGroup, ScoredGroup, PolicyUpdate):
    """Per trained group: record timestamps through rl.prompts -> rl.rollouts -> rl.scored -> rl.policy."""
    n, B = lc["steps"], lc["prompts_per_step"]
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
    w = max(5, n // 10)
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


def foreign_cores(x: dict) -> float:
    """Cores busy during the arm with work that was not the arm's (other sessions, CI, kernel)."""
    m = x["meter"]
    return m["machine_busy_cores"] - (m["cpu_s"] + m["broker_cpu_s"]) / m["wall_s"]


#: Allowance for a pipeline arm's foreign cores: in otherwise quiet rounds they showed 0.12-0.14
#: (0.02-0.03 in others); kernel work for their fsyncs and sockets is charged to no process.
PIPELINE_KERNEL_CORES = 0.15


def disturbed(arm: str, x: dict, max_foreign: float) -> str | None:
    if x["meter"]["ci_seen_during"]:
        return "CI ran during the arm"
    f = foreign_cores(x)
    limit = max_foreign + (PIPELINE_KERNEL_CORES if arm.startswith("pipeline") else 0.0)
    return f"{f:.2f} foreign cores busy (limit {limit:.2f})" if f >= limit else None


# ---- summary ------------------------------------------------------------------------------
def summarize(rounds: list[dict], arms: list[str]) -> dict:
    keys = ("samples_per_s", "tokens_per_s", "s_per_step", "e2e_s", "e2e_samples_per_s", "cpu_s_per_1k_samples")
    per_arm = {}
    for a in arms:
        got = [r["arms"][a] for r in rounds if a in r["arms"]]
        per_arm[a] = {k: {"median": statistics.median(g[k] for g in got), "min": min(g[k] for g in got),
                          "max": max(g[k] for g in got)} for k in keys}
    ratios = {}
    for num in arms:
        for den in arms:
            if num == den:
                continue
            for k in ("samples_per_s", "tokens_per_s", "e2e_samples_per_s"):
                vals = [r["arms"][num][k] / r["arms"][den][k] for r in rounds
                        if num in r["arms"] and den in r["arms"]]
                if vals:
                    ratios.setdefault(f"{num} / {den}", {})[k] = {
                        "median": statistics.median(vals), "min": min(vals), "max": max(vals),
                        "per_round": [round(v, 4) for v in vals]}
    return {"per_arm": per_arm, "ratios": ratios}


def kafka_summary(rounds: list[dict]) -> dict:
    """Median over rounds of each pipeline arm's per-record figures."""
    out = {}
    for arm in ("pipeline-s0", "pipeline-s2"):
        ks = [r["arms"][arm]["kafka"] for r in rounds if arm in r["arms"]]
        if not ks:
            continue

        def med(path):
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
                    "records_traced": [k["records_traced"] for k in ks], "records_missing": [k["records_missing"] for k in ks]}
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
                      "batches_per_step": per_step("rollout_transform"), "actor_calls_per_step": per_step("actor_generate")}
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
    lines = ["| arm | samples/s (steady) | tokens/s (steady) | s/step | end-to-end s | e2e samples/s | CPU-s per 1k samples |",
             "|---|---|---|---|---|---|---|"]
    for a, v in s["per_arm"].items():
        lines.append(f"| {a} | {f(v['samples_per_s']['median'])} ({f(v['samples_per_s']['min'])}–{f(v['samples_per_s']['max'])}) "
                     f"| {f(v['tokens_per_s']['median'])} | {f(v['s_per_step']['median'], 3)} | {f(v['e2e_s']['median'])} "
                     f"| {f(v['e2e_samples_per_s']['median'])} | {f(v['cpu_s_per_1k_samples']['median'], 2)} |")
    lines += ["", "| ratio (within a round) | samples/s, steady | tokens/s, steady | samples/s, end-to-end |", "|---|---|---|---|"]
    want = ["pipeline-s0 / loop", "pipeline-s2 / loop", "pipeline-s2 / pipeline-s0", "trl / loop", "pipeline-s0 / trl",
            "pipeline-s2 / trl", "loop / trl"]
    for k in want:
        r = s["ratios"].get(k)
        if r:
            cell = lambda m: f"{m['median']:.3f} ({m['min']:.3f}–{m['max']:.3f})"  # noqa: E731
            lines.append(f"| {k} | {cell(r['samples_per_s'])} | {cell(r['tokens_per_s'])} | {cell(r['e2e_samples_per_s'])} |")
    if ko:
        for arm, k in ko.items():
            if arm.startswith("_"):
                continue
            lines += ["", f"**{arm}**: per-record hops (record timestamps; median over rounds of each run's p50 / p90 / mean, ms)", "",
                      "| hop | p50 | p90 | mean |", "|---|---|---|---|"]
            for h, v in k["hops_ms"].items():
                lines.append(f"| {h} | {f(v['p50_ms'])} | {f(v['p90_ms'])} | {f(v['mean_ms'])} |")
            if arm == "pipeline-s0":  # at max_staleness 2 the steps overlap: no serial chain
                lines += ["", "| step chain (steady steps) | p50 | mean |", "|---|---|---|"]
                for h, v in k["step_chain_ms"].items():
                    lines.append(f"| {h} | {f(v['p50_ms'])} | {f(v['mean_ms'])} |")
            o = k.get("per_record")
            if o:
                lines += ["", "| stage | batches/step | hop mean ms | transform mean ms | work mean ms | beyond work ms "
                              "| (in transform) | (outside transform) |", "|---|---|---|---|---|---|---|---|"]
                for st in ("rollout", "reward"):
                    v = o[st]
                    lines.append(f"| {st} | {f(v['batches_per_step'], 2)} | {f(v['hop_mean_ms'])} | {f(v['transform_mean_ms'])} "
                                 f"| {f(v['work_mean_ms'], 2)} | {f(v['beyond_work_ms'])} | {f(v['in_transform_beyond_work_ms'])} "
                                 f"| {f(v['outside_transform_ms'])} |")
                v = o["learner"]
                lines.append(f"| learner | 1 | {f(v['hop_mean_ms'])} | - | {f(v['work_train_step_ms'])} (train_step) "
                             f"| {f(v['beyond_work_ms'])} | - | - |")
            c = k.get("cpu_per_record")
            if c:
                lines += ["", "| CPU ms per group (steady window) | rollout worker | actor | reward worker | reward server "
                              "| broker | learner (per step) |", "|---|---|---|---|---|---|---|",
                          f"| {arm} | {f(c.get('rollout_cpu_ms_per_group'), 2)} | {f(c.get('actor_cpu_ms_per_group'), 2)} "
                          f"| {f(c.get('reward_cpu_ms_per_group'), 2)} | {f(c.get('reward-server_cpu_ms_per_group'), 2)} "
                          f"| {f(c.get('broker_cpu_ms_per_group'), 2)} | {f(c.get('learner_cpu_ms_per_step'), 1)} |"]
    return "\n".join(lines)


# ---- main ---------------------------------------------------------------------------------
def code_state() -> dict:
    """The commit measured and any uncommitted change under services/ and steadyrl/."""
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    return {"head": git("rev-parse", "--short", "HEAD"),
            "uncommitted": git("status", "--porcelain", "--", "services", "steadyrl").splitlines()}


def versions() -> dict:
    from importlib.metadata import version

    out = {"python": platform.python_version()}
    for n in ("torch", "transformers", "accelerate", "confluent-kafka", "pydantic"):
        out[n] = version(n)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--min-arm-seconds", type=float, default=20.0,
                    help="the in-process arms repeat their N-step run until they ran this long")
    ap.add_argument("--warmup-steps", type=int, default=15, help="steps of the unrecorded warm-up round (0: none)")
    ap.add_argument("--bootstrap", help="use this broker instead of starting one")
    ap.add_argument("--port", type=int, default=19492, help="port of the broker this bench starts (controller +1)")
    ap.add_argument("--state-dir", default="/tmp/bench-tp", help="broker state and run folders")
    ap.add_argument("--port-offset", type=int, default=5000, help="added to the services' HTTP ports")
    ap.add_argument("--no-ci-wait", action="store_true")
    ap.add_argument("--arm-timeout", type=float, default=1800.0)
    ap.add_argument("--out", default=str(ROOT / "bench/results/throughput.json"))
    ap.add_argument("--overhead-out", default=str(ROOT / "bench/results/kafka_overhead.json"))
    ap.add_argument("--max-foreign-cores", type=float, default=0.15,
                    help="a round is clean when, during each of its arms, the machine's busy cores minus the arm's "
                         "own (its processes and the broker) stayed below this (plus 0.15 for a pipeline arm: its "
                         "kernel I/O work), and no CI process was seen")
    ap.add_argument("--max-rounds", type=int, default=0, help="stop after this many rounds, clean or not "
                                                              "(default 2 x rounds + 2)")
    ap.add_argument("--tables", action="store_true", help="print the markdown tables of --out/--overhead-out and exit")
    args = ap.parse_args()
    if args.tables:
        ko = json.loads(Path(args.overhead_out).read_text()) if Path(args.overhead_out).exists() else None
        print(tables(json.loads(Path(args.out).read_text()), ko.get("by_arm") if ko else None))
        return
    import signal

    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))  # run the finally blocks: stop the arm, the broker
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background
    arms = args.arms.split(",")
    if "trl" in arms and not TRL_PY.exists():
        print(f"creating {TRL_PY.parent.parent} (trl {TRL_VERSION} over the project's .venv)", flush=True)
        setup_trl_venv()
    work = Path(args.state_dir)
    work.mkdir(parents=True, exist_ok=True)
    cfg = {s: make_config(work / f"steps{args.steps}-s{s}.yaml", args.steps, s) for s in (0, 2)}
    from steadyrl import broker as b

    lb = None
    bootstrap = args.bootstrap
    if not bootstrap:
        b.fetch()
        lb = b.LocalBroker(work / "broker", port=args.port, controller_port=args.port + 1)
        if not lb.start():
            raise SystemExit(f"a broker already runs in {work / 'broker'}: stop it or pass --bootstrap")
        bootstrap = lb.bootstrap
    broker_pid = lb.pid() if lb else None
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rounds: list[dict] = []
    ci_waited = 0.0

    def run_arm(arm: str, steps_cfg: dict[int, Path], min_s: float, tag: str) -> dict:
        nonlocal ci_waited
        if not args.no_ci_wait:
            ci_waited += wait_for_ci()
        t0 = time.time()
        if arm.startswith("pipeline"):
            r = run_pipeline(tag, steps_cfg[int(arm[-1])], bootstrap, args.port_offset, work, broker_pid,
                             args.arm_timeout)
        else:
            r = run_inproc(arm, steps_cfg[0], min_s, work, broker_pid, args.arm_timeout)
        r["started"] = time.strftime("%H:%M:%S", time.gmtime(t0))
        print(f"  {tag}: {r['samples_per_s']:.1f} samples/s, {r['tokens_per_s']:.1f} tokens/s, "
              f"{r['s_per_step'] * 1000:.1f} ms/step, e2e {r['e2e_s']:.1f} s, arm wall {r['meter']['wall_s']:.1f} s, "
              f"machine busy {r['meter']['machine_busy_cores']:.2f} cores", flush=True)
        return r

    max_rounds = args.max_rounds or 2 * args.rounds + 2
    try:
        if args.warmup_steps:
            wcfg = {s: make_config(work / f"warm-s{s}.yaml", args.warmup_steps, s) for s in (0, 2)}
            print(f"warm-up round ({args.warmup_steps} steps, not recorded)", flush=True)
            for arm in arms:
                run_arm(arm, wcfg, 0.0, f"warmup-{arm}")
        while sum(r["clean"] for r in rounds) < args.rounds and len(rounds) < max_rounds:
            i = len(rounds)
            print(f"round {i + 1} ({sum(r['clean'] for r in rounds)}/{args.rounds} clean so far, at most "
                  f"{max_rounds})", flush=True)
            rnd = {"round": i + 1, "arms": {}}
            for arm in arms:
                rnd["arms"][arm] = run_arm(arm, cfg, args.min_arm_seconds, f"r{i + 1}-{arm}")
            rnd["disturbed"] = {a: why for a, x in rnd["arms"].items() if (why := disturbed(a, x, args.max_foreign_cores))}
            rnd["clean"] = not rnd["disturbed"]
            print(f"  round {i + 1}: {'clean' if rnd['clean'] else 'disturbed: ' + json.dumps(rnd['disturbed'])}",
                  flush=True)
            rounds.append(rnd)
            _write(args, arms, rounds, started, bootstrap, lb, ci_waited)  # partial results survive a crash
    finally:
        if lb is not None:
            lb.stop()
    res, ko = _write(args, arms, rounds, started, bootstrap, lb, ci_waited)
    print(tables(res, ko["by_arm"]))


def _write(args, arms, rounds, started, bootstrap, lb, ci_waited):
    lc = learner_section(ROOT / "configs" / "tiny.yaml")
    clean = [r for r in rounds if r["clean"]]
    trl_v = None
    for r in rounds:
        if "trl" in r["arms"]:
            trl_v = r["arms"]["trl"].get("versions")
    res = {
        "benchmark": "throughput",
        "what": "GRPO throughput on the tiny model and tiny_copy task: the Kafka pipeline (steadyrl up) at "
                "max_staleness 0 and 2, the in-process loop (run_loop), TRL's GRPOTrainer; interleaved rounds",
        "when": started, "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)},
        "versions": {"steadyrl_venv": versions(), "trl_venv": trl_v,
                     "broker": "Apache Kafka 4.1.1, single node KRaft, local, -Xmx512m" if lb else f"external {bootstrap}"},
        "settings": {"model": lc.get("model"), "data": lc["data"], "scorer": "tiny_copy",
                     "B_prompts_per_step": lc["prompts_per_step"], "G_group_size": lc["group_size"],
                     "max_new_tokens": lc["max_new_tokens"], "steps": args.steps,
                     "warm_steps_excluded": max(5, args.steps // 10), "train": lc["train"], "rounds": args.rounds,
                     "order_per_round": arms, "min_arm_seconds": args.min_arm_seconds,
                     "warmup_round_steps": args.warmup_steps, "metrics_scrape_interval_s": 5.0,
                     "pipeline": "configs/tiny.yaml with steps, max_staleness and eval_data=None; one instance of each "
                                 "service; a fresh topic prefix per run"},
        "trl_settings": rounds[0]["arms"]["trl"].get("settings") if rounds and "trl" in rounds[0]["arms"] else None,
        "code": code_state(),
        "differences": DIFFERENCES,
        "ci_wait_s": round(ci_waited, 1),
        "clean_rounds": [r["round"] for r in rounds if r["clean"]],
        "clean_rule": f"every arm of the round: no CI process seen, and machine busy cores minus the arm's own "
                      f"< {args.max_foreign_cores} (pipeline arms: < {args.max_foreign_cores + PIPELINE_KERNEL_CORES}, "
                      f"their kernel I/O work shows as foreign)",
        "summary": summarize(clean, arms) if clean else None,
        "summary_all_rounds": summarize(rounds, arms) if rounds else None,
        "rounds": [{"round": r["round"], "clean": r["clean"], "disturbed": r["disturbed"],
                    "arms": {a: {**{k: v for k, v in x.items() if k != "kafka"},
                                 "foreign_cores": round(foreign_cores(x), 3)} for a, x in r["arms"].items()}}
                   for r in rounds],
    }
    ks = kafka_summary(clean)
    for arm, k in ks.items():
        k["per_record"] = per_record_overhead(k, args.steps)
    ko = {"benchmark": "kafka_overhead", "when": started,
          "what": "per trained group, record timestamps (CreateTime) through rl.prompts -> rl.rollouts -> rl.scored -> "
                  "the rl.policy record of its step, against the stages' own metrics (transform, work), in the "
                  "pipeline runs of bench/throughput.py",
          "machine": res["machine"], "settings": res["settings"], "rounds_used": res["clean_rounds"], "by_arm": ks,
          "per_run": [{"round": r["round"], "arm": a, **x["kafka"]} for r in rounds for a, x in r["arms"].items()
                      if "kafka" in x]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1, default=str) + "\n")
    Path(args.overhead_out).write_text(json.dumps(ko, indent=1, default=str) + "\n")
    return res, ko


if __name__ == "__main__":
    main()
