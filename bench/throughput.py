"""Throughput of the Kafka pipeline (max_staleness 0 and 2) vs the in-process loop vs TRL's
GRPOTrainer, interleaved on one machine; and the Kafka overhead per record through each stage.

    flock /tmp/steadyrl-bench.lock .venv/bin/python bench/throughput.py [--steps 200] [--rounds 3]

Arms, same tiny model (steadyrl.model.models `tiny`, seed 0), task (tiny_copy:256 prompts, tiny_copy
reward), B x G, max_new_tokens, learning settings and steps (configs/tiny.yaml's learner
section, `--steps` steps, no evaluation):

  pipeline-s0  `steadyrl up --bootstrap <bench broker>` at max_staleness 0: five service
               processes (reward server, actor, rollout, reward, learner) over Kafka
  pipeline-s2  the same at max_staleness 2
  pipeline-s0-unplaced, pipeline-s2-unplaced
               the same without placement (every `placement:` field null: each process
               starts torch's default threads, one per core, on any CPU), i.e. as before
               steadyrl/local/placement.py
  loop         steadyrl.rl.loop.run_loop in one process (bench/_throughput_arms.py loop)
  trl          trl.GRPOTrainer in one process, from bench/.venv-trl (bench/_throughput_arms.py trl);
               the bench creates that venv on first use (trl over the project's .venv, which
               is left untouched: see setup_trl_venv)

`--model smollm2` runs the same arms on the real job instead (SMOLLM2 below: SmolLM2-135M-Instruct,
the arithmetic train split, 8 prompts x 8 samples, 32 new tokens, numeric_match; issue 22 point 4),
writing bench/results/throughput_smollm2.json; a few steps per arm are enough there:

    flock /tmp/steadyrl-bench.lock .venv/bin/python bench/throughput.py --model smollm2 --steps 6 \\
        --warm-steps 2 --warmup-steps 0 --rounds 2 --arms pipeline-s0,pipeline-s2,loop,trl

Each round runs every arm once, in that order (A B C D, A B C D, ...; `--alternate`: A B C D,
D C B A, ..., by clean rounds: a disturbed round is rerun in its order, so use an even
--rounds); `--autocast bf16` runs the loop and the pipeline under learner.train.autocast bf16
and TRL with its bf16=True. A warm-up round of
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

The pipeline runs also give the Kafka overhead per record (bench/results/kafka_overhead.json;
computed in bench/_throughput_report.py):
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

from bench import _throughput_report  # noqa: E402
from bench._throughput_report import (  # noqa: E402
    Scraper,
    cpu_per_record,
    delete_topics,
    kafka_summary,
    parse_log,
    pct,
    per_record_overhead,
    read_topic,
    stage_metrics,
    tables,
    trace,
    warm_steps,
)
from steadyrl.testing.audit import audit_run  # noqa: E402
from steadyrl.testing.run import RunDir  # noqa: E402

PY = ROOT / ".venv" / "bin" / "python"
TRL_PY = ROOT / "bench" / ".venv-trl" / "bin" / "python"
ARMS = ("pipeline-s0", "pipeline-s2", "loop", "trl")
#: Arms beyond the default set (`--arms`): the pipeline without placement.
EXTRA_ARMS = ("pipeline-s0-unplaced", "pipeline-s2-unplaced")
#: A placement section that limits nothing (steadyrl/local/placement.py): the stack as before it.
UNPLACED = {svc: {"threads": None, "cpus": None} for svc in ("actor", "rollout", "reward", "reward_server", "learner")}


#: An arm named ARM@before runs ARM from the checkout `--before` names (an earlier commit):
#: before/after of a change in the same interleaved rounds.
BEFORE = "@before"


def arm_config_key(arm: str) -> tuple[int, bool]:
    """(max_staleness, placed) of a pipeline arm (`pipeline-s2`, `pipeline-s0-unplaced`,
    `pipeline-s2@before`)."""
    arm = arm.removesuffix(BEFORE)
    return int(arm.split("-")[1][1:]), not arm.endswith("-unplaced")
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
    "when the ratio is 1; the advantage's epsilon is 1e-4 in TRL, 1e-6 in steadyrl (both divide by the unbiased "
    "group std).",
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
#: The real job's arm set (`--model smollm2`; issue 22 point 4): SmolLM2-135M-Instruct on the
#: arithmetic train split, 8 prompts x 8 samples, 32 new tokens, `make run`'s learning settings
#: (lr 1e-5, temperature 0.8, micro-batch 8), numeric_match reward; no evaluation, and the reward
#: watch only observes (no batch held back), so every arm does the same work.
SMOLLM2 = {
    "learner": {"model": "smollm2-135m-instruct", "data": "data/arithmetic/train.parquet", "eval_data": None,
                "eval_splits": {}, "reward_watch": {"action": "observe"},
                "prompts_per_step": 8, "group_size": 8, "max_new_tokens": 32,
                "train": {"lr": 1e-5, "micro_batch_size": 8, "temperature": 0.8}},
    "reward_server": {"default_scorer": "numeric_match"},
}


def base_config(model: str) -> dict:
    """The stack config an arm set starts from: configs/tiny.yaml (`tiny`) or SMOLLM2."""
    import copy

    import yaml

    if model == "smollm2":
        return copy.deepcopy(SMOLLM2)
    return yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())


def make_config(path: Path, steps: int, staleness: int, placed: bool = True, model: str = "tiny",
                autocast: str | None = None) -> Path:
    """Write arm config `path`: the model's base config at `steps` and `staleness`, placed or not,
    and with learner.train.autocast set when `autocast` is given (the loop and the pipeline read
    the same learner section; TRL gets its own bf16 switch from it: trl_settings)."""
    import yaml

    cfg = base_config(model)
    cfg["learner"].update(steps=steps, max_staleness=staleness, eval_data=None)
    if autocast not in (None, "off"):  # off is the default: written, an ARM@before tree would refuse the key
        cfg["learner"]["train"]["autocast"] = autocast
    if not placed:
        cfg["placement"] = UNPLACED
    path.write_text(yaml.safe_dump(cfg))
    return path


def config_for_tree(config: Path, tree: Path) -> Path:
    """`config` as the checkout `tree` takes it: a checkout from before steadyrl/local/placement.py
    refuses the `placement` section as unknown (its services place nothing: each starts torch's
    default threads, one per core, on any CPU), and one from before a learner key refuses that key.
    Returns `config` itself when `tree` knows every key, else a copy beside it without them.
    Only the learner section's top-level keys are checked, by their names' presence in the tree's
    learner sources: a nested or other section's key the tree lacks still fails its service at
    start, loudly (every section refuses unknown keys)."""
    import re

    import yaml

    cfg = yaml.safe_load(config.read_text())
    learner_src = "\n".join(p.read_text() for p in (tree / "services" / "learner").rglob("*.py")) \
        if (tree / "services" / "learner").is_dir() else (tree / "services" / "learner.py").read_text()
    dropped = [k for k in cfg["learner"] if not re.search(rf"\b{re.escape(k)}\b", learner_src)]
    placed = any((tree / "steadyrl" / where / "placement.py").exists() for where in ("", "local"))  # local/: since 47
    if placed and not dropped:
        return config
    if not placed:
        cfg.pop("placement", None)
    for k in dropped:
        del cfg["learner"][k]
    out = config.with_name(f"{config.stem}-for-{tree.name}.yaml")
    out.write_text(yaml.safe_dump(cfg))
    return out


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
    w = warm_steps(n)
    steady_s = sum(step_seconds[w:]) if step_seconds is not None else step_end[n - 1] - step_end[w - 1]
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
def run_pipeline(tag: str, config: Path, bootstrap: str, offset: int, work: Path, broker_pid: int | None,
                 timeout_s: float, keep: bool = False, tree: Path = ROOT) -> dict:
    """One pipeline run: `steadyrl up` from the checkout `tree` (its code: `python -m` puts the
    working folder first on sys.path, and every service inherits it), this venv's python."""
    from steadyrl.wire import codec
    from steadyrl.wire.contracts import PolicyUpdate, Prompt, RolloutGroup, ScoredGroup

    lc = learner_section(config)
    n, B = lc["steps"], lc["prompts_per_step"]
    state = work / f"state-{tag}"
    prefix = f"tp{uuid.uuid4().hex[:8]}."
    log = work / f"up-{tag}.log"
    scraper = Scraper(offset, warm_steps(n), lambda: proc_cpu(broker_pid))
    with Meter(broker_pid) as m, open(log, "wb") as lf:
        proc = subprocess.Popen([str(PY), "-m", "steadyrl.cli", "up", "--bootstrap", bootstrap, "--state-dir",
                                 str(state), "--prefix", prefix, "--port-offset", str(offset), "--config", str(config)],
                                cwd=tree, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)
        scraper.start()
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(10)
            raise RuntimeError(f"{tag}: steadyrl up ran past {timeout_s} s; log {log}") from None
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
    # follow each trained group through the topics
    t = {name: read_topic(bootstrap, f"{prefix}{name}", expect)
         for name, expect in (("rl.prompts", n * B), ("rl.rollouts", n * B), ("rl.scored", n * B),
                              ("rl.policy", n + 1))}
    run = RunDir.of_up(state)
    lf = learner_figures(run, lc, m.figures["wall_s"], published=[r["key"] for r in t["rl.prompts"]])
    logs = parse_log(text)
    overhead = trace(lc, run.consumed(), t, logs, stage_metrics(scraper.last), scraper.phase_samples, codec,
                     Prompt, RolloutGroup, ScoredGroup, PolicyUpdate)
    overhead["cpu_per_record"] = cpu_per_record(scraper.full_first, scraper.full_last)
    overhead["stale_drops"] = lf["stale_drops"]
    overhead["counts"] = lf["counts"]
    delete_topics(bootstrap, prefix)
    if not keep:
        shutil.rmtree(state, ignore_errors=True)
    cpu = m.figures["cpu_s"] + m.figures["broker_cpu_s"]
    return {**lf["figures"], "meter": m.figures, "cpu_s_per_1k_samples": 1000 * cpu / (n * B * lc["group_size"]),
            "audit": lf["audit"], "policy_versions_trained": lf["policy_versions_trained"], "kafka": overhead,
            "step_seconds_by_quarter": lf["step_seconds_by_quarter"], "step_seconds": lf["step_seconds"]}


def learner_figures(run: RunDir, lc: dict, e2e_s: float, published: list[str] | None = None) -> dict:
    """What a pipeline arm reports from the learner's own files (through `RunDir`): the
    throughput `figures` from the per-step history, the exactly-once `audit` (steadyrl.testing's
    `audit_run`; `published`: the prompt ids on rl.prompts), `stale_drops` (the learner's
    stale_dropped count), its `counts`, the trained groups' version lag and the step seconds."""
    n, B = lc["steps"], lc["prompts_per_step"]
    hist = run.history
    rep = audit_run(run, n, B, published=published)
    ids = run.trained_ids()
    audit = {"trained": len(ids), "unique": len(set(ids)), "expected": n * B, "ok": rep["ok"], "checks": rep["checks"]}
    fig = _figures(lc, [], [h["tokens"] for h in hist], e2e_s=e2e_s, step_seconds=[h["seconds"] for h in hist])
    fig["reward_first10_last10"] = [statistics.mean(h["reward_mean"] for h in hist[:10]),
                                    statistics.mean(h["reward_mean"] for h in hist[-10:])]
    return {"figures": fig, "audit": audit, "stale_drops": run.counts["stale_dropped"],
            "counts": run.counts.as_dict(), "policy_versions_trained": _version_lag(hist),
            "step_seconds_by_quarter": _quarters([h["seconds"] for h in hist]),
            "step_seconds": _step_seconds(hist, fig["warm_steps"], lc.get("checkpoint_every", 5))}


def _step_seconds(hist: list[dict], w: int, every: int) -> dict:
    """Distribution of the steady steps' seconds, and checkpoint steps (step % every == 0) apart."""
    xs = [h["seconds"] for h in hist[w:]]
    ck = [h["seconds"] for h in hist[w:] if h["step"] % every == 0]
    other = [h["seconds"] for h in hist[w:] if h["step"] % every]
    return {"p50": pct(xs, 0.5), "p90": pct(xs, 0.9), "p99": pct(xs, 0.99), "max": max(xs), "mean": statistics.mean(xs),
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


# ---- main ---------------------------------------------------------------------------------
def code_state(tree: Path = ROOT) -> dict:
    """The commit measured in `tree` and any uncommitted change under services/ and steadyrl/."""
    git = lambda *a: subprocess.run(["git", *a], cwd=tree, capture_output=True, text=True).stdout.strip()  # noqa: E731
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
    ap.add_argument("--out", help="default bench/results/throughput.json (--model smollm2: throughput_smollm2.json)")
    ap.add_argument("--overhead-out", help="default bench/results/kafka_overhead.json (or kafka_overhead_smollm2.json)")
    ap.add_argument("--max-foreign-cores", type=float, default=0.15,
                    help="a round is clean when, during each of its arms, the machine's busy cores minus the arm's "
                         "own (its processes and the broker) stayed below this (plus 0.15 for a pipeline arm: its "
                         "kernel I/O work), and no CI process was seen")
    ap.add_argument("--max-rounds", type=int, default=0, help="stop after this many rounds, clean or not "
                                                              "(default 2 x rounds + 2)")
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny",
                    help="the arm set's model and task: tiny (configs/tiny.yaml) or smollm2 (SMOLLM2: the real job)")
    ap.add_argument("--warm-steps", type=int, help="steps left out of each run's steady window (default max(5, N/10))")
    ap.add_argument("--before", help=f"a checkout of an earlier commit (git worktree add): pipeline arms named "
                                     f"ARM{BEFORE} run from it, in the same rounds as the others")
    ap.add_argument("--autocast", choices=["off", "bf16"],
                    help="learner.train.autocast for the loop and pipeline arms; bf16 also sets TRL's bf16=True "
                         "(which also covers TRL's generation; steadyrl's only the update). Default: the base "
                         "config's, i.e. off. An ARM@before checkout without the setting refuses it at start")
    ap.add_argument("--alternate", action="store_true",
                    help="alternate the arms' order between clean rounds (A B C D, D C B A, ...; a disturbed round "
                         "is rerun in the same order; the warm-up round runs forward), so no arm keeps one position; "
                         "balanced only with an even --rounds")
    ap.add_argument("--tables", action="store_true", help="print the markdown tables of --out/--overhead-out and exit")
    args = ap.parse_args()
    tail = "" if args.model == "tiny" else f"_{args.model}"
    args.out = args.out or str(ROOT / f"bench/results/throughput{tail}.json")
    args.overhead_out = args.overhead_out or str(ROOT / f"bench/results/kafka_overhead{tail}.json")
    if args.warm_steps is not None:
        if not 1 <= args.warm_steps < args.steps:
            raise SystemExit(f"--warm-steps {args.warm_steps}: must be at least 1 and below --steps {args.steps}")
        _throughput_report.WARM_STEPS = args.warm_steps
    if args.tables:
        ko = json.loads(Path(args.overhead_out).read_text()) if Path(args.overhead_out).exists() else None
        print(tables(json.loads(Path(args.out).read_text()), ko.get("by_arm") if ko else None))
        return
    import signal

    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))  # run the finally blocks: stop the arm, the broker
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background
    arms = args.arms.split(",")
    before = Path(args.before).resolve() if args.before else None
    if any(a.endswith(BEFORE) for a in arms) and not (before and (before / "steadyrl").is_dir()):
        raise SystemExit(f"arms named ...{BEFORE} need --before: a checkout of the earlier commit")
    if "trl" in arms and not TRL_PY.exists():
        print(f"creating {TRL_PY.parent.parent} (trl {TRL_VERSION} over the project's .venv)", flush=True)
        setup_trl_venv()
    work = Path(args.state_dir)
    work.mkdir(parents=True, exist_ok=True)
    keys = [(s, placed) for s in (0, 2) for placed in (True, False)]
    cfg = {k: make_config(work / f"{args.model}-steps{args.steps}-s{k[0]}{'' if k[1] else '-unplaced'}.yaml",
                          args.steps, *k, model=args.model, autocast=args.autocast) for k in keys}
    from steadyrl.local import broker as b
    from steadyrl.local import jars

    lb = None
    bootstrap = args.bootstrap
    if not bootstrap:
        jars.fetch()
        lb = b.LocalBroker(work / "broker", port=args.port, controller_port=args.port + 1)
        ours = lb.pid() is None  # a broker already running there is refused below, never stopped
        try:
            started = lb.start()
        except BaseException:  # a SIGTERM while it starts (SystemExit 143): stop what was spawned
            if ours:
                lb.stop()
            raise
        if not started:
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
            tree = before if arm.endswith(BEFORE) and before else ROOT
            r = run_pipeline(tag.replace(BEFORE, "-before"), config_for_tree(steps_cfg[arm_config_key(arm)], tree),
                             bootstrap, args.port_offset, work, broker_pid, args.arm_timeout, tree=tree)
        else:
            r = run_inproc(arm, steps_cfg[(0, True)], min_s, work, broker_pid, args.arm_timeout)
        r["started"] = time.strftime("%H:%M:%S", time.gmtime(t0))
        print(f"  {tag}: {r['samples_per_s']:.1f} samples/s, {r['tokens_per_s']:.1f} tokens/s, "
              f"{r['s_per_step'] * 1000:.1f} ms/step, e2e {r['e2e_s']:.1f} s, arm wall {r['meter']['wall_s']:.1f} s, "
              f"machine busy {r['meter']['machine_busy_cores']:.2f} cores", flush=True)
        return r

    max_rounds = args.max_rounds or 2 * args.rounds + 2
    try:
        if args.warmup_steps:
            wcfg = {k: make_config(work / f"{args.model}-warm-s{k[0]}{'' if k[1] else '-unplaced'}.yaml",
                                   args.warmup_steps, *k, model=args.model, autocast=args.autocast) for k in keys}
            print(f"warm-up round ({args.warmup_steps} steps, not recorded)", flush=True)
            for arm in arms:
                run_arm(arm, wcfg, 0.0, f"warmup-{arm}")
        while sum(r["clean"] for r in rounds) < args.rounds and len(rounds) < max_rounds:
            i = len(rounds)
            print(f"round {i + 1} ({sum(r['clean'] for r in rounds)}/{args.rounds} clean so far, at most "
                  f"{max_rounds})", flush=True)
            rnd = {"round": i + 1, "arms": {}}
            # by clean rounds so far: a disturbed round is rerun in its own order, so the clean
            # rounds stay balanced between the two orders
            order = arms[::-1] if args.alternate and sum(r["clean"] for r in rounds) % 2 else arms
            rnd["order"] = order
            for arm in order:
                rnd["arms"][arm] = run_arm(arm, cfg, args.min_arm_seconds, f"r{i + 1}-{arm}")
            rnd["disturbed"] = {a: why for a, x in rnd["arms"].items()
                                if (why := disturbed(a, x, args.max_foreign_cores))}
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
    base = base_config(args.model)
    lc = base["learner"]
    clean = [r for r in rounds if r["clean"]]
    trl_v = None
    for r in rounds:
        if "trl" in r["arms"]:
            trl_v = r["arms"]["trl"].get("versions")
    res = {
        "benchmark": "throughput",
        "what": f"GRPO throughput on {lc.get('model')} and {lc['data']}: the Kafka pipeline (steadyrl up) at "
                "max_staleness 0 and 2, the in-process loop (run_loop), TRL's GRPOTrainer; interleaved rounds",
        "when": started, "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)},
        "versions": {"steadyrl_venv": versions(), "trl_venv": trl_v,
                     "broker": ("Apache Kafka 4.1.1, single node KRaft, local, -Xmx512m" if lb
                                else f"external {bootstrap}")},
        "settings": {"model": lc.get("model"), "data": lc["data"], "scorer": base["reward_server"]["default_scorer"],
                     "B_prompts_per_step": lc["prompts_per_step"], "G_group_size": lc["group_size"],
                     "max_new_tokens": lc["max_new_tokens"], "steps": args.steps,
                     "warm_steps_excluded": warm_steps(args.steps),
                     "train": {"autocast": "off", **lc["train"],
                               **({"autocast": args.autocast} if args.autocast else {})},
                     "rounds": args.rounds,
                     "order_per_round": ("alternating: " + ",".join(arms) + ", reversed after an odd number of "
                                         "clean rounds")
                                        if args.alternate else arms,
                     "min_arm_seconds": args.min_arm_seconds,
                     "warmup_round_steps": args.warmup_steps, "metrics_scrape_interval_s": 5.0,
                     "pipeline": ("configs/tiny.yaml" if args.model == "tiny" else "bench/throughput.py SMOLLM2")
                                 + " with steps, max_staleness and eval_data=None; one instance of each "
                                 "service; a fresh topic prefix per run"},
        "trl_settings": rounds[0]["arms"]["trl"].get("settings") if rounds and "trl" in rounds[0]["arms"] else None,
        "code": code_state(),
        "code_before": code_state(Path(args.before)) if args.before else None,  # the ARM@before arms
        "differences": DIFFERENCES,
        "ci_wait_s": round(ci_waited, 1),
        "clean_rounds": [r["round"] for r in rounds if r["clean"]],
        "clean_rule": f"every arm of the round: no CI process seen, and machine busy cores minus the arm's own "
                      f"< {args.max_foreign_cores} (pipeline arms: < {args.max_foreign_cores + PIPELINE_KERNEL_CORES}, "
                      f"their kernel I/O work shows as foreign)",
        "summary": summarize(clean, arms) if clean else None,
        "summary_all_rounds": summarize(rounds, arms) if rounds else None,
        "rounds": [{"round": r["round"], "order": r.get("order", arms), "clean": r["clean"],
                    "disturbed": r["disturbed"],
                    "arms": {a: {**{k: v for k, v in x.items() if k != "kafka"},
                                 "foreign_cores": round(foreign_cores(x), 3)} for a, x in r["arms"].items()}}
                   for r in rounds],
    }
    ks = kafka_summary(clean)
    for k in ks.values():
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
