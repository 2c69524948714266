"""`steadyrl` as a newcomer meets it, without a broker: an unreachable broker is one error line,
bad `up` arguments stop before anything starts, a closed stdout ends quietly, `--help` lists
every command, and the docs name what the code has."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from steadyrl import cli
from steadyrl.bus.topics import load_catalogue
from tests.helpers import ROOT

UNREACHABLE = "127.0.0.1:1"  # nothing listens on port 1: connection refused at once


def steadyrl(*argv: str, timeout: float = 60, **kw) -> tuple[subprocess.CompletedProcess, float]:
    """Run `python -m steadyrl.cli argv` from the repository root; returns (result, seconds)."""
    env = {k: v for k, v in os.environ.items() if k != "STEADYRL_BOOTSTRAP"}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "steadyrl.cli", *argv], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=timeout, **kw)
    return r, time.monotonic() - t0


# ---------------------------------------------------------------------------- no broker

@pytest.mark.parametrize("argv", [["quarantine", "list"], ["replay", "--from", "-5m"], ["topics", "list"],
                                  ["quarantine", "drop", "some-batch"]], ids=" ".join)
def test_an_unreachable_broker_is_one_error_line_exit_1(argv):
    r, seconds = steadyrl(*argv, "--bootstrap", UNREACHABLE)
    assert r.returncode == 1, r.stderr
    assert seconds < 20
    want = (f"error: cannot reach the Kafka broker at {UNREACHABLE} (start one with `steadyrl broker start`, "
            f"or pass --bootstrap)")
    assert r.stderr.strip() == want, r.stderr  # no librdkafka FAIL lines, no traceback
    assert r.stdout == ""


def test_up_with_an_unreachable_broker_starts_nothing(tmp_path):
    r, seconds = steadyrl("up", "--bootstrap", UNREACHABLE, "--state-dir", str(tmp_path / "state"))
    assert r.returncode == 1 and seconds < 20, r.stderr
    assert r.stderr.strip().startswith(f"error: cannot reach the Kafka broker at {UNREACHABLE}")
    assert "Traceback" not in r.stderr and len(r.stderr.splitlines()) <= 3
    assert not (tmp_path / "state").exists()


# ---------------------------------------------------------------------------- up's arguments

@pytest.mark.parametrize("args, says", [
    (["--config", "nosuch.yaml"], "error: --config nosuch.yaml: no such file"),
    (["--config", "configs"], "error: --config configs: not a file"),
    (["--port-offset", "-9000"], "error: --port-offset -9000: the service ports would be -900..-600; "
                                 "give -8099..57135"),
    (["--port-offset", "57136"], "error: --port-offset 57136"),
    (["--scale", "rollout=0"], "error: --scale rollout=0: N must be 1..8"),
    (["--scale", "reward=9"], "error: --scale reward=9: N must be 1..8"),
    (["--scale", "actor=2"], "error: --scale actor=2: want SERVICE=N with SERVICE one of rollout, reward"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_up_refuses_bad_arguments_before_starting_anything(tmp_path, args, says):
    state = tmp_path / "state"
    r, seconds = steadyrl("up", "--state-dir", str(state), *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert seconds < 10
    assert r.stderr.startswith(says), r.stderr
    assert len(r.stderr.splitlines()) == 1 and r.stdout == ""  # nothing started, nothing said
    assert not (state / "broker").exists() and not state.exists()


def test_up_says_each_config_error_once_before_starting_the_broker(tmp_path):
    """The walk-through's `lerner:` was reported three times (reward server, rollout and reward
    workers), and only after the broker and the services had started."""
    from steadyrl.local.ports import free_port_pair

    config = tmp_path / "mine.yaml"
    config.write_text("lerner:\n  steps: 3\nlearner:\n  max_new_token: 8\n")
    state = tmp_path / "state"
    r, _ = steadyrl("up", "--config", str(config), "--state-dir", str(state), "--port", str(free_port_pair()),
                    "--port-offset", str(20000 + os.getpid() % 500), timeout=180)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.splitlines() == [
        f"error: invalid configuration (config file {config}, STEADYRL_* over it):",
        "  lerner: Extra inputs are not permitted (did you mean `learner`?)",
        "  learner.max_new_token: Extra inputs are not permitted (did you mean `max_new_tokens`?)"]
    assert "broker" not in r.stdout and not state.exists()


def test_scale_bound_is_the_input_topics_partitions():
    catalogue = load_catalogue()
    for svc, topic in cli.SCALE_INPUT.items():
        most = catalogue[topic].partitions
        assert cli._parse_scale([f"{svc}={most}"]) == {svc: most}
        with pytest.raises(cli.CliError) as e:
            cli._parse_scale([f"{svc}={most + 1}"])
        assert e.value.code == 2 and f"N must be 1..{most}" in str(e.value)
    assert catalogue["rl.prompts"].partitions == 8  # the bound the error message above shows


def test_stack_up_only_when_every_service_is_ready():
    assert cli._readiness({"actor-0": True, "learner-0": True}) == "stack up; Ctrl-C stops everything"
    line = cli._readiness({"actor-0": True, "rollout-0": False, "learner-0": False})
    assert "stack up" not in line
    assert line.startswith("not ready yet: rollout-0, learner-0") and "Ctrl-C stops everything" in line


def test_no_keep_running_line_when_up_is_about_to_stop(tmp_path):
    """The walk-through saw "not ready yet ... they keep running and are restarted ... Ctrl-C
    stops everything" just before `up` stopped on a service's configuration error."""
    import io

    from steadyrl.local.ports import free_port
    from steadyrl.local.supervisor import Child, Supervisor

    bad = Child("reward-0", [sys.executable, "-c", "import sys; sys.exit(2)"], free_port())
    sup = Supervisor([bad], out=io.StringIO(), log_dir=tmp_path)
    try:
        sup.start_all()
        ready = sup.wait_ready(timeout_s=30)
        assert sup.failed == "reward-0" and ready == {"reward-0": False}
        assert cli._readiness(ready, stopping=sup.stop.is_set()) is None
    finally:
        sup.stop_all()


# ---------------------------------------------------------------------------- quarantine decisions

@pytest.mark.parametrize("action, says", [("release", "released b1: 2 groups on p.rl.releases, to be trained"),
                                          ("drop", "dropped b1: it will not be trained")])
def test_quarantine_decision_says_released_or_dropped(monkeypatch, capsys, action, says):
    from steadyrl.cli import quarantine as quarantine_cmd
    from steadyrl.run import quarantine

    seen = {}

    def decide(bootstrap, batch, what, note, prefix):
        seen.update(bootstrap=bootstrap, batch=batch, action=what.value, note=note, prefix=prefix)
        return SimpleNamespace(groups={0: None, 1: None})

    monkeypatch.setattr(quarantine, "decide", decide)
    monkeypatch.setattr(quarantine_cmd, "_require_broker", lambda bootstrap: None)  # where the command looks it up
    assert cli.main(["quarantine", action, "b1", "--note", "why", "--prefix", "p.", "--bootstrap", "h:9"]) == 0
    assert capsys.readouterr().out == says + "\n"
    assert seen == {"bootstrap": "h:9", "batch": "b1", "action": action, "note": "why", "prefix": "p."}


# ---------------------------------------------------------------------------- a closed stdout

def test_a_reader_that_stops_early_ends_the_command_quietly(tmp_path):
    """`steadyrl ckpt list DIR | head -1`: far more output than a pipe holds, the reader leaves
    after one line; the command exits 141 (as a SIGPIPE'd filter) without a traceback."""
    for i in range(3000):  # each an empty, so BROKEN, checkpoint: one line each on stdout
        (tmp_path / f"step_{i:06d}").mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "steadyrl.cli", "ckpt", "list", str(tmp_path)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert b"step_000000" in proc.stdout.readline()
        proc.stdout.close()
        err = proc.stderr.read().decode()
        assert proc.wait(60) == 141, err
    finally:
        if proc.poll() is None:
            proc.kill()
    assert err == ""


def test_help_into_a_closed_pipe_is_quiet():
    """argparse itself drops a failed write of the help (exit 0); the text still buffered would
    fail at exit: either way nothing on stderr."""
    r_fd, w_fd = os.pipe()
    os.close(r_fd)  # nobody will read: the first write fails with EPIPE
    try:
        r = subprocess.run([sys.executable, "-m", "steadyrl.cli", "--help"], cwd=ROOT, stdout=w_fd,
                           stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(w_fd)
    assert r.returncode in (0, 141) and r.stderr == ""


# ---------------------------------------------------------------------------- help and docs

def test_help_description_lists_every_command(capsys):
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert {"ckpt", "quarantine", "replay", "up", "broker"} <= set(commands)
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    listed = re.search(r"the command line for people \(([^)]*)\)", text).group(1)
    assert listed.split(", ") == list(commands)


def test_replay_doc_names_every_option():
    parser = cli.build_parser()
    replay = next(a for a in parser._actions if a.dest == "command").choices["replay"]
    doc = (ROOT / "docs" / "replay.md").read_text()
    options = {o for a in replay._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    assert "--timeout" in options
    assert not [o for o in sorted(options) if f"`{o}" not in doc]


def test_readme_layout_names_every_service_and_doc():
    readme = (ROOT / "README.md").read_text()
    layout = " ".join(readme.split("## Layout", 1)[1].split("```")[1].split())
    services = [p.name for p in (ROOT / "services").iterdir() if (p / "__main__.py").exists()]
    docs = [p.name for p in (ROOT / "docs").glob("*.md")]
    assert "alertbridge" in services and "alerts.md" in docs
    assert not [n for n in services + docs if n not in layout]
    assert "reward server" in layout


def test_readme_where_things_are_matches_the_code(monkeypatch):
    """The walk-through's questions: which --state-dir the commands read, which ports, a JSONL
    row's fields, and where the offline machine keeps a tokenizer for a tiny model of one's own."""
    from steadyrl.local.stack import SMOLLM2
    from steadyrl.model import models

    where = (ROOT / "README.md").read_text().split("## Where things are", 1)[1].split("\n## ", 1)[0]
    for argv in (["status"], ["logs", "learner-0"], ["export", "r1", "latest", "out"], ["up"]):
        assert cli.build_parser().parse_args(argv).state_dir == ".steadyrl", argv
    assert all(f"`{name}`" in where for name in ("status", "logs", "export", "--state-dir", "--port",
                                                   "--port-offset", ".steadyrl", "up.json"))
    assert '"question"' in where and '"answer"' in where
    assert "(docs/rl.md#data-steadyrlmodeldatapy)" in where   # the anchor of the heading below
    assert "\n## Data (`steadyrl/model/data.py`)\n" in (ROOT / "docs/rl.md").read_text()   # the anchor's heading
    monkeypatch.delenv("STEADYRL_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", "/home/someone")
    cached = str(models.cache_root() / SMOLLM2).replace("/home/someone", "~")
    assert f"`{cached}/`" in where and "`$STEADYRL_CACHE/models/`" in where


def test_alert_bridge_doc_matches_its_config_and_its_curl_example_is_a_webhook():
    from steadyrl.services.alertbridge.bridge import AlertBridgeConfig, AlertBridgeSection, parse_webhook

    doc = (ROOT / "docs" / "alerts.md").read_text()
    section = doc.split("## Running the alert bridge", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"STEADYRL_ALERTBRIDGE__([A-Z_]+)", section))
    assert named == {f.upper() for f in AlertBridgeSection.model_fields}  # every field, no other
    assert AlertBridgeConfig.model_fields["metrics_port"].default == 8500 and "127.0.0.1:8500" in section
    body = section.split("<<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0]
    hook = parse_webhook(body.encode())
    assert hook.version == "4" and hook.alerts[0].labels["alertname"] == "BreakerOpen"
    assert "http://127.0.0.1:8500/alert/wecom" in section
    for status in ("200", "400", "404", "413", "422", "500", "502", "504"):  # the answers bridge.py documents
        assert f"| {status} |" in section
    assert json.loads(section.split("this prints\n`", 1)[1].split("`", 1)[0])["outcome"] == "sent"


def test_maven_runs_without_colour_codes(monkeypatch, tmp_path):
    """The broker jars are fetched one way (the Makefile calls `steadyrl broker fetch`), which asks
    Maven for plain output into libs_dir()."""
    from steadyrl.local import jars

    make = (ROOT / "Makefile").read_text().splitlines()
    assert not [ln for ln in make if ln.strip().startswith("mvn ")] and "\t$(BIN)/steadyrl broker fetch" in make
    calls = []
    monkeypatch.setattr(jars, "libs_dir", lambda: tmp_path)
    monkeypatch.setattr(jars.subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    assert jars.fetch() == tmp_path
    assert calls and "-Dstyle.color=never" in calls[0] and "-B" in calls[0]
    assert f"-Dsteadyrl.libs={tmp_path}" in calls[0]


def test_version_is_the_installed_packages(capsys):
    """`steadyrl --version` did not exist and steadyrl.__version__ was not set (issue 38)."""
    import importlib.metadata

    import steadyrl
    from steadyrl.cli import main

    assert steadyrl.__version__ == importlib.metadata.version("steadyrl") != "0+unknown"
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"steadyrl {steadyrl.__version__}\n"


def test_bash_completion_names_every_command(capsys):
    """`steadyrl completion bash` is shtab's script of the real parser: every subcommand in it."""
    commands = next(a for a in cli.build_parser()._actions if a.dest == "command").choices
    assert cli.main(["completion", "bash"]) == 0
    script = capsys.readouterr().out
    listed = re.search(r"^_shtab_steadyrl_subparsers=\(([^)]*)\)$", script, re.M).group(1).split()
    assert "completion" in commands and listed == list(commands)
    assert all(f"_shtab_steadyrl_{name}_option_strings=(" in script for name in commands)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0   # bash reads it
