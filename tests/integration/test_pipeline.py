"""The whole pipeline (reward server, actor, rollout, reward, learner) under `steadyrl up`,
on the tiny model and task, against the real broker."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from steadyrl.run.quarantine import read_quarantine
from steadyrl.testing import RunDir, audit_pipeline, explain, read_all, run_ids, unique_prefix, up_child_pid
from steadyrl.testing.stack import parse_metrics
from steadyrl.wire import codec
from steadyrl.wire.contracts import ScoredGroup
from tests.helpers import ROOT

TINY = ROOT / "configs" / "tiny.yaml"


def _config(tmp_path: Path, **learner) -> Path:
    cfg = yaml.safe_load(TINY.read_text())
    if "train" in learner:   # merged into the tiny config's train section
        learner["train"] = {**cfg["learner"].get("train", {}), **learner["train"]}
    cfg["learner"].update(learner)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class Up:
    """`steadyrl up` on the session broker, in its own process group."""

    def __init__(self, bootstrap: str, tmp_path: Path, config: Path, *extra: str, env: dict | None = None,
                 log_path: Path | None = None):
        self.state = tmp_path / "state"
        self.prefix = unique_prefix()
        self.offset = 2000 + (os.getpid() * 7 + int(time.time())) % 3000
        self.log_path = log_path or tmp_path / "up.log"   # up's output (stdout and stderr)
        self.log_path.unlink(missing_ok=True)
        # appended to, as `up >> file`: each write of up's goes at the end of the file, even
        # when a test appends to it as well (one without O_APPEND would write over what the
        # test appended, and need no new page of a volume the test keeps full)
        with open(self.log_path, "ab") as log:  # the child writes it; read back by path
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "steadyrl.cli", "up", "--bootstrap", bootstrap, "--state-dir", str(self.state),
                 "--prefix", self.prefix, "--port-offset", str(self.offset), "--config", str(config), *extra],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **(env or {})})

    def url(self, base_port: int, i: int = 0) -> str:
        return f"http://127.0.0.1:{base_port + self.offset + i}"

    def progress(self) -> dict:
        try:
            return httpx.get(f"{self.url(8400)}/progress", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return {}

    def wait_step(self, step: int, timeout_s: float = 240) -> None:
        """Until the learner reports `step` (fails if `up` exits or time runs out)."""
        deadline = time.monotonic() + timeout_s
        while (self.progress().get("step") or 0) < step:
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log()[-4000:]
            time.sleep(0.1)

    def child_pid(self, instance: str) -> int:
        """PID of the child `python -m steadyrl.services.* --instance-id <instance>` that this `up` started."""
        pid = up_child_pid(self.proc.pid, instance)
        assert pid is not None, f"no child {instance} of up (pid {self.proc.pid})"
        return pid

    def wait(self, timeout_s: float) -> int:
        """`up`'s exit status; it is stopped after. Running past `timeout_s` fails with the tail
        of its log (what each service said), not only the command line."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"up ran past {timeout_s} s; its log ends:\n{self.log()[-6000:]}") from None
        finally:
            self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def run(self) -> RunDir:
        """The learner's run (the one CURRENT names), read fresh."""
        return RunDir.of_up(self.state)


def _audit_exactly_once(up: Up, bootstrap: str, steps: int, batch: int = 8) -> None:
    """Every prompt id the feeder published (rl.prompts) was trained exactly once (consumed.jsonl),
    none lost (to rl.dlq either), and each stage turned its inputs into one output each
    (steadyrl.testing.audit)."""
    report = audit_pipeline(bootstrap, up.prefix, up.run(), steps, batch, excuse_dlq=False)
    assert report["ok"], explain(report)


def _published_weights(up: Up) -> dict:
    """The tensors of the last policy version the run announced, every byte checked."""
    from steadyrl.run import policy_files

    st = up.run().state
    return policy_files.read_version((up.state / "policies").resolve(), st["policy_uri"], st["policy_sha256"])


def test_reward_rises_through_the_full_pipeline(bootstrap, tmp_path):
    up = Up(bootstrap, tmp_path, TINY)
    rc = up.wait(300)
    out = up.log()
    assert rc == 0, out[-4000:]
    summary = up.run().summary()
    rewards = summary["reward_per_step"]
    assert len(rewards) == 100
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert first < 0.2 and last > first + 0.5, (first, last)
    assert summary["eval"]["after"] > summary["eval"]["before"] and summary["eval"]["learned"]
    assert "SUMMARY test accuracy" in out and "progress [" in out and "learner-0 finished its run" in out
    assert up.run().curve.stat().st_size > 1000


def test_staleness_0_pipeline_equals_the_in_process_loop(bootstrap, tmp_path):
    """Same prompts, seeds and samples: the learner's weights after 8 steps equal run_loop's.

    Tolerance: exact (max |diff| == 0) is expected on this CPU path; the assertion allows 1e-6
    for BLAS kernels that sum in a batch-size dependent order.
    """
    from steadyrl.model.models import load_policy
    from steadyrl.rl.loop import LoopConfig, run_loop
    from steadyrl.rl.trainer import TrainConfig
    from steadyrl.services.learner.config import load_dataset

    steps = 8
    config = _config(tmp_path, steps=steps, max_staleness=0, eval_data=None)
    lc = yaml.safe_load(config.read_text())["learner"]
    up = Up(bootstrap, tmp_path, config)
    rc = up.wait(300)
    assert rc == 0, up.log()[-4000:]
    run = up.run()
    assert all(h["policy_versions"] == [h["step"] - 1] for h in run.history), "not on-policy"

    model, tok = load_policy("tiny", seed=0)
    cfg = LoopConfig(steps=steps, prompts_per_step=lc["prompts_per_step"], group_size=lc["group_size"],
                     max_new_tokens=lc["max_new_tokens"], scorer="tiny_copy", seed=0,
                     train=TrainConfig(**lc["train"]))
    hist = run_loop(model, tok, load_dataset(lc["data"]), cfg)
    assert [h["critic/score/mean"] for h in hist] == [h["reward_mean"] for h in run.history]

    learned = _published_weights(up)
    own = model.state_dict()
    diff = max((learned[k] - own[k]).abs().max().item() for k in learned)
    assert diff <= 1e-6, f"max |pipeline - in-process| over all parameters: {diff}"
    assert set(learned) <= set(own) and len(learned) >= len(own) - 1  # tied embeddings: one name kept


@pytest.mark.slow
def test_kill_rollout_and_reward_mid_run_every_prompt_trained_once(bootstrap, tmp_path):
    """3 rollout and 2 reward workers; rollout-0 and reward-0 get SIGKILL at step 20 of 100."""
    steps = 100
    up = Up(bootstrap, tmp_path, _config(tmp_path, steps=steps, eval_data=None),
            "--scale", "rollout=3", "--scale", "reward=2")
    try:
        up.wait_step(20)
        # --scale rollout=3: every rollout worker has partitions and has handled prompts
        for i in range(3):
            ready = httpx.get(f"{up.url(8200, i)}/readyz", timeout=5).json()
            assert ready["checks"]["assignment"]["ok"], ready
        victims = [up.child_pid("rollout-0"), up.child_pid("reward-0")]
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        rc = up.proc.wait(300)
    finally:
        up.close()
    out = up.log()
    assert rc == 0, out[-4000:]
    assert "rollout-0       | exited with -9" in out and "reward-0        | exited with -9" in out

    _audit_exactly_once(up, bootstrap, steps)


def test_rollout_workers_scale_to_three_and_each_consumes(bootstrap, tmp_path):
    up = Up(bootstrap, tmp_path, _config(tmp_path, steps=30, eval_data=None), "--scale", "rollout=3")
    try:
        deadline = time.monotonic() + 240
        handled = [0.0, 0.0, 0.0]
        while not all(handled):
            assert up.proc.poll() is None and time.monotonic() < deadline, (handled, up.log()[-3000:])
            for i in range(3):
                try:
                    text = httpx.get(f"{up.url(8200, i)}/metrics", timeout=2).text
                except httpx.HTTPError:
                    continue
                for line in text.splitlines():
                    if line.startswith('steadyrl_stage_records_total{outcome="ok",stage="rollout"}'):
                        handled[i] = float(line.split()[-1])
            time.sleep(0.5)
        assert up.proc.wait(240) == 0
    finally:
        up.close()


@pytest.mark.slow
def test_learner_killed_mid_run_resumes_and_trains_every_prompt_once(bootstrap, tmp_path):
    """SIGKILL the learner at step 30 of 100: it resumes its run from state.json (offsets,
    feeder position, prompts in flight) and the audit log still holds each prompt once."""
    steps = 100
    up = Up(bootstrap, tmp_path, _config(tmp_path, steps=steps, eval_data=None))
    try:
        up.wait_step(30)
        os.kill(up.child_pid("learner-0"), signal.SIGKILL)
        rc = up.proc.wait(300)
    finally:
        up.close()
    out = up.log()
    assert rc == 0, out[-4000:]
    assert "learner-0       | exited with -9" in out and "resuming run" in out
    _audit_exactly_once(up, bootstrap, steps)
    summary = up.run().summary()
    assert len(summary["reward_per_step"]) == steps


def test_a_group_size_the_actor_refuses_stops_up_at_start_with_the_field_named(bootstrap, tmp_path):
    """group_size 300 > the 256 samples of one prompt the actor generates: every prompt would be
    refused. It used to cycle through rl.dlq for ever (and before that, exit after a batch's
    worth); the learner refused it at start (exit 2, the field named) and `up` stopped the
    stack instead of restarting the learner (issue 33); now `up` refuses it before any service
    starts (its config check, 49ac106), exit 2, the field named."""
    up = Up(bootstrap, tmp_path, _config(tmp_path, steps=5, group_size=300, eval_data=None))
    rc = up.wait(180)
    out = up.log()
    assert rc == 2 and "learner.group_size 300 > 256" in out, out[-4000:]
    assert "invalid configuration" in out and "restart #" not in out and "ready at" not in out, out[-4000:]


@pytest.mark.slow
def test_learner_killed_three_times_ends_bitwise_equal_to_the_uninterrupted_loop(bootstrap, tmp_path):
    """Checkpoints every 5 steps; SIGKILL the learner at step 7, then half-way through writing
    a checkpoint (a failpoint, armed by deleting its marker: weights written, optimizer not),
    then at step 22 of 30. Each restart goes on from the newest complete checkpoint (throwing
    away up to 4 steps, whose groups are redone with the same seeds): the final weights equal
    run_loop's exactly, and the audit log holds every prompt once."""
    from steadyrl.model.models import load_policy
    from steadyrl.rl.loop import LoopConfig, run_loop
    from steadyrl.rl.trainer import TrainConfig
    from steadyrl.services.learner.config import load_dataset

    steps = 30
    config = _config(tmp_path, steps=steps, max_staleness=0, eval_data=None, checkpoint_every=5)
    lc = yaml.safe_load(config.read_text())["learner"]
    marker = tmp_path / "failpoint-fired"
    marker.write_text("disarmed until the test deletes this file\n")
    up = Up(bootstrap, tmp_path, config, env={"STEADYRL_FAILPOINT": f"checkpoint.mid_write:{marker}"})
    ckpts = None
    try:
        up.wait_step(7)
        os.kill(up.child_pid("learner-0"), signal.SIGKILL)
        time.sleep(1.0)  # the supervisor notices; /progress answers again once restarted
        up.wait_step(0)
        ckpts = up.run().checkpoints
        marker.unlink()  # the restarted learner's next save kills it half-way
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert up.proc.poll() is None and time.monotonic() < deadline, up.log()[-4000:]
            time.sleep(0.05)
        killed_in = marker.read_text()
        time.sleep(1.0)
        up.wait_step(0)
        up.wait_step(22)
        os.kill(up.child_pid("learner-0"), signal.SIGKILL)
        time.sleep(1.0)
        up.wait_step(0)
        rc = up.proc.wait(300)
    finally:
        up.close()
    assert killed_in.startswith("checkpoint.mid_write pid ")
    assert not list(ckpts.glob("*.tmp-*")), "the half-written save was not cleaned up"
    out = up.log()
    assert rc == 0, out[-4000:]
    assert out.count("learner-0       | exited with -9") == 3
    assert out.count("resuming run from checkpoint") == 3
    _audit_exactly_once(up, bootstrap, steps)
    import pyarrow.dataset as ds

    cache = ds.dataset(up.run().rollout_cache, format="ipc").to_table()
    keys = list(zip(cache.column("prompt_id").to_pylist(), cache.column("sample").to_pylist(), strict=True))
    assert len(keys) == len(set(keys)) == steps * lc["prompts_per_step"] * lc["group_size"]
    assert sorted(set(cache.column("step").to_pylist())) == list(range(1, steps + 1))

    model, tok = load_policy("tiny", seed=0)
    cfg = LoopConfig(steps=steps, prompts_per_step=lc["prompts_per_step"], group_size=lc["group_size"],
                     max_new_tokens=lc["max_new_tokens"], scorer="tiny_copy", seed=0,
                     train=TrainConfig(**lc["train"]))
    run_loop(model, tok, load_dataset(lc["data"]), cfg)
    learned = _published_weights(up)
    own = model.state_dict()
    diff = max((learned[k] - own[k]).abs().max().item() for k in learned)
    assert diff == 0.0, f"max |killed pipeline - in-process| over all parameters: {diff}"


@pytest.mark.slow
def test_reward_server_hanging_mid_run_training_goes_on_with_cached_scores(bootstrap, tmp_path):
    """SIGSTOP the reward server in the second epoch (a real hang: connections are accepted,
    nothing answers). The reward worker's breaker opens after 3 timeouts; groups whose prompt
    was scored in epoch 1 are scored from the cache (reward_source=cache, similarity 1.0) and
    training goes on; after SIGCONT the probe half-opens it and rule scores resume. Every
    prompt is trained exactly once."""
    # While the server hangs, every group is scored from the cache at once and the learner runs
    # at its own pace (~8 steps/s here): with 60 steps the run ended 0.03 s after the breaker
    # half-opened, before a rule score (CI, 2026-12-02). 160 leaves ~100 steps after SIGCONT.
    steps = 160
    config = _config(tmp_path, steps=steps, eval_data=None)
    cfg = yaml.safe_load(config.read_text())
    cfg["reward"] = {"timeout_s": 1.0, "retry_backoff_s": 0.2, "probe_interval_s": 0.5, "reset_timeout_s": 60}
    config.write_text(yaml.safe_dump(cfg))
    # the stopped server's /livez fails: up would restart it (issue 46); here it hangs until SIGCONT
    up = Up(bootstrap, tmp_path, config, "--liveness-failures", "0")
    server = None
    try:
        up.wait_step(36)  # epoch 2 (32 steps of 8 of the 256 prompts) has begun: its prompts are cached
        server = up.child_pid("reward-server-0")
        os.kill(server, signal.SIGSTOP)
        stopped_at = up.progress()["step"]
        up.wait_step(stopped_at + 8, timeout_s=120)  # training goes on while the server hangs
        metrics = httpx.get(f"{up.url(8400)}/metrics", timeout=5).text
        reward_metrics = httpx.get(f"{up.url(8300)}/metrics", timeout=5).text
        os.kill(server, signal.SIGCONT)
        server = None
        rc = up.proc.wait(300)
    finally:
        if server is not None:
            os.kill(server, signal.SIGCONT)
        up.close()
    out = up.log()
    assert rc == 0, out[-4000:]
    assert 'steadyrl_reward_breaker_state{state="open"} 1.0' in reward_metrics
    assert 'steadyrl_reward_fallback_groups_total{outcome="cache"}' in reward_metrics
    cached = [line for line in metrics.splitlines()
              if line.startswith('steadyrl_learner_trained_groups_total{reward_source="cache"}')]
    assert cached and float(cached[0].split()[-1]) >= 8, metrics
    _audit_exactly_once(up, bootstrap, steps)
    scored = [codec.decode(m.value(), m.headers(), ScoredGroup)
              for m in read_all(bootstrap, f"{up.prefix}rl.scored", expect=steps * 8)]
    by_source = {}
    for s in scored:
        by_source.setdefault(s.reward_source.value, []).append(s)
    assert len(by_source.get("cache", [])) >= 8
    assert all(s.cache_similarity == 1.0 and s.group.prompt.epoch >= 1 for s in by_source["cache"])
    assert all(e["cache_of"] for s in by_source["cache"] for e in s.reward_extra)
    last = max(scored, key=lambda s: s.scored_ms)
    assert last.reward_source.value == "rule", "the breaker did not close after the server came back"
    assert up.run().counts["cache_scored"] >= float(cached[0].split()[-1])  # saved; it grew after the sample


def _quarantine_cli(bootstrap: str, prefix: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "steadyrl.cli", "quarantine", *args, "--bootstrap", bootstrap,
                           "--prefix", prefix], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_inflated_rewards_mid_run_are_quarantined_and_release_puts_them_back(bootstrap, tmp_path):
    """The reward server starts adding 4.0 to every reward (64 items: one batch's worth) at
    step 40 of 80. The batch holding them trips the watch and goes to rl.quarantine instead of
    training; training goes on, also after the learner is killed while the batch is held (its
    groups, read again, stay held); `steadyrl quarantine release` puts it back (on rl.releases) and
    the learner trains its groups once; `drop` marks another and it is never trained."""
    steps = 80
    # rebaseline_after 6: a few legit holds (this task learns fast) plus the inflated ones must
    # not make the inflated rewards the new normal (rebaselining has its own unit tests)
    config = _config(tmp_path, steps=steps, eval_data=None, checkpoint_every=5,
                     reward_watch={"action": "quarantine", "rebaseline_after": 6, "rebaseline_window": 10})
    cfg = yaml.safe_load(config.read_text())
    cfg["reward_server"].update(scorers=["tests.scorers:inflating_tiny_copy"],
                                default_scorer="tests.scorers:inflating_tiny_copy")
    config.write_text(yaml.safe_dump(cfg))
    inflate = tmp_path / "inflate"
    up = Up(bootstrap, tmp_path, config, env={"STEADYRL_TEST_INFLATE": str(inflate)})
    slow = Path(f"{inflate}.slow")
    try:
        up.wait_step(40)
        slow.touch()  # the run slows down until the release is done (the tiny steps are ~50 ms)
        inflate.write_text("64")
        deadline = time.monotonic() + 120
        while True:  # until a batch with inflated rewards is on rl.quarantine
            listed = _quarantine_cli(bootstrap, up.prefix, "list")
            assert listed.returncode == 0, listed.stderr
            inflated = [line.split()[0] for line in listed.stdout.splitlines()
                        if float(line.split("reward mean ")[1].split()[0]) > 1.0]
            if inflated:
                break
            assert time.monotonic() < deadline and up.proc.poll() is None, (listed.stdout, up.log()[-3000:])
            time.sleep(0.5)
        # Kill only once a checkpoint holds the hold: resuming from one before it rolls the run
        # back past the held batch (its prompts were published after that checkpoint), and a
        # release of it is then, rightly, a duplicate (found in a run: killed at step 44, resumed
        # at 40, the release never trained).
        held_at = int(re.search(r"/q(\d+)-", inflated[0]).group(1))
        after_hold = (held_at // 5 + 1) * 5  # checkpoint_every 5
        latest = up.run().checkpoints / "LATEST"
        while not latest.exists() or int(latest.read_text().strip().split("_")[-1]) < after_hold:
            assert time.monotonic() < deadline + 120 and up.proc.poll() is None, up.log()[-3000:]
            time.sleep(0.2)
        before_kill = up.progress()["step"]
        os.kill(up.child_pid("learner-0"), signal.SIGKILL)  # restarted by `up`; held groups must stay held
        up.wait_step(before_kill + 2, timeout_s=180)
        release = inflated[0]
        done = _quarantine_cli(bootstrap, up.prefix, "release", release, "--note", "test")
        assert done.returncode == 0 and "released" in done.stdout, done.stderr
        again = _quarantine_cli(bootstrap, up.prefix, "release", release)
        assert again.returncode == 1 and "already released" in again.stderr
        assert up.proc.poll() is None, "the run ended before the release could be trained"
        slow.unlink()
        rc = up.proc.wait(300)
    finally:
        up.close()
    assert rc == 0, up.log()[-4000:]
    listed = _quarantine_cli(bootstrap, up.prefix, "list").stdout
    others = [line.split()[0] for line in listed.splitlines() if line.split()[1] == "held"]
    if others:
        dropped = _quarantine_cli(bootstrap, up.prefix, "drop", others[0])
        assert dropped.returncode == 0, dropped.stderr
        assert f"{others[0]}  dropped" in _quarantine_cli(bootstrap, up.prefix, "list").stdout
    shown = _quarantine_cli(bootstrap, up.prefix, "show", release)
    assert '"status": "released"' in shown.stdout and '"rules"' in shown.stdout, shown.stdout
    assert f"{release}  released" in listed

    run = up.run()
    consumed = run.consumed()
    trained = {c["prompt_id"]: c for c in consumed}
    assert len(trained) == len(consumed) == steps * 8, "a prompt was trained twice"
    held = set(run.quarantined)
    entries = read_quarantine(bootstrap, up.prefix)
    released = {q.group.prompt_id for q in entries[release].groups.values()}
    # Regression: this read the learner's step after the second release command and required
    # it below `steps`; with the tiny model's 50 ms steps the last 4 steps can pass in that
    # command's own start-up (found in CI: released at step 76, run over at 80 before the
    # read). What matters is that the release was trained before the run ended:
    assert released <= set(trained), f"released groups never trained: {released - set(trained)}"
    assert run.counts["released"] == len(released) and not released & held
    for pid in released:  # trained once, after the release, with the rewards it was held with
        assert trained[pid]["step"] > entries[release].first.step
        assert trained[pid]["topic"] == "rl.releases"  # the command's copy, read from its own topic
    assert run.counts["release_on_scored"] == 0  # the command wrote nothing with the header to rl.scored
    assert max(trained[pid]["reward_mean"] for pid in released) > 1.0
    scored = [codec.decode(m.value(), m.headers(), ScoredGroup)
              for m in read_all(bootstrap, f"{up.prefix}rl.scored", expect=steps * 8)]
    # no other inflated group was trained: an inflated group is held, released, or (after the
    # learner's restart rolled back to its checkpoint) dropped as from discarded weights and
    # generated again with an honest reward
    assert {s.prompt_id for s in scored if max(s.rewards) > 1.0}
    assert all(trained[pid]["reward_mean"] <= 1.0 for pid in set(trained) - released)
    # training went on past the held batch to the last step
    assert sorted({c["step"] for c in consumed}) == list(range(1, steps + 1))


def _stage_records(base_url: str, stage: str) -> float:
    """A stage's `steadyrl_stage_records_total{outcome="ok"}` from its /metrics (0 when unread)."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=2).text
    except httpx.HTTPError:
        return 0.0
    key = ("steadyrl_stage_records_total", frozenset({"stage": stage, "outcome": "ok"}.items()))
    return parse_metrics(text).get(key, 0.0)


def _wait_for_plateau(read, quiet_s: float, timeout_s: float) -> float:
    """Poll `read()` until its value has not changed for `quiet_s`; that value."""
    deadline = time.monotonic() + timeout_s
    last, since = read(), time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, f"still changing after {timeout_s} s: {last}"
        time.sleep(0.25)
        value = read()
        if value != last:
            last, since = value, time.monotonic()
    return last


def test_a_full_train_buffer_evicts_and_every_prompt_is_still_trained_once(bootstrap, tmp_path):
    """max_staleness 3 keeps 4 x B prompts in flight; the learner is SIGSTOPped so their groups
    pile up; on SIGCONT it reads them at once into a buffer of max_buffer_size = B: the
    oldest are evicted (fifo), their prompts published again, and every prompt is still
    trained exactly once."""
    steps = 12
    config = _config(tmp_path, steps=steps, eval_data=None, max_staleness=3, max_buffer_size=8,
                     buffer_eviction="fifo")
    up = Up(bootstrap, tmp_path, config, "--liveness-failures", "0")   # stopped on purpose: not restarted
    learner = None
    try:
        up.wait_step(2)
        learner = up.child_pid("learner-0")
        os.kill(learner, signal.SIGSTOP)
        stopped_at = up.progress().get("step") or 2
        # the feeder keeps 4 x 8 prompts ahead of the stopped learner: wait until their groups
        # are all scored (the reward stage's count stops growing), not for a fixed time
        scored = _wait_for_plateau(lambda: _stage_records(up.url(8300), "reward"), quiet_s=3, timeout_s=120)
        assert scored - stopped_at * 8 >= 16, (scored, stopped_at)  # enough waiting to overflow 8
        os.kill(learner, signal.SIGCONT)
        learner = None
        up.wait_step(4)
        metrics = httpx.get(f"{up.url(8400)}/metrics", timeout=5).text
        rc = up.proc.wait(300)
    finally:
        if learner is not None:
            os.kill(learner, signal.SIGCONT)
        up.close()
    assert rc == 0, up.log()[-4000:]
    assert 'steadyrl_rollout_buffer_size{stage="train"}' in metrics
    evicted = [line for line in metrics.splitlines()
               if line.startswith('steadyrl_learner_buffer_evictions_total{policy="fifo"}')]
    assert evicted and float(evicted[0].split()[-1]) >= 8, metrics
    aged = [line for line in metrics.splitlines() if line.startswith("steadyrl_rollout_sample_age_seconds_count")]
    assert aged and float(aged[0].split()[-1]) >= 16, metrics
    counts = up.run().counts
    assert counts["evicted"] >= 8, counts
    assert "train buffer full: group evicted" in up.log()
    _audit_exactly_once(up, bootstrap, steps)


def test_learner_on_finish_idle_stays_up_and_does_not_start_a_new_run(bootstrap, tmp_path):
    """learner.on_finish: idle (what the Kubernetes StatefulSet sets): the finished learner keeps
    serving /progress (done) and its probes instead of exiting into a restart and a new run."""
    up = Up(bootstrap, tmp_path, _config(tmp_path, steps=3, eval_data=None, on_finish="idle"))
    try:
        deadline = time.monotonic() + 240
        while not up.progress().get("done"):
            assert up.proc.poll() is None and time.monotonic() < deadline, up.log()[-4000:]
            time.sleep(0.2)
        pid = up.child_pid("learner-0")
        time.sleep(3)
        assert up.child_pid("learner-0") == pid, "the learner exited or was restarted"
        assert httpx.get(f"{up.url(8400)}/livez", timeout=5).status_code == 200
        assert up.progress()["step"] == 3
        metrics = httpx.get(f"{up.url(8400)}/metrics", timeout=5).text
        assert "steadyrl_learner_reward_std NaN" in metrics   # no stale figure for the alert rules
        runs = run_ids(up.state / "learner")
        assert len(runs) == 1, runs
    finally:
        up.close()
    assert "idling until stopped" in up.log()
