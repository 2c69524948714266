"""`steadyrl up`'s live panel (steadyrl/cli/panel.py): what it draws from a state, and which of
the services' lines it lets through (issue 38)."""

import io
from types import SimpleNamespace

from rich.console import Console

from steadyrl.cli import panel
from steadyrl.cli.panel import LivePanel, PanelState, render
from steadyrl.run.runview import eta_s, evaluations


def text_of(state: PanelState, width: int = 120) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    console.print(render(state))
    out = console.file.getvalue()
    assert isinstance(out, str)
    return out


def test_render_shows_step_eta_reward_evaluation_breaker_and_counts():
    out = text_of(PanelState(run_id="r1", step=7, steps=20, phase="training", phase_s=3, elapsed_s=125,
                             eta_s=65, reward=0.21875, tokens_per_s=32.4,
                             evals={"test": {"before": 0.1438, "after": 0.2432}, "hard": {"before": 0.05}},
                             breaker={"reward-0": "closed"}, dlq=3,
                             restarts={"learner-0": 1, "reward-0": 1, "broker": 0},
                             counts="dlq 3, republished 2", checkpoint="step_000005", log_dir="/s/logs"))
    assert "run r1" in out
    assert "7/20" in out and "35%" in out and "ETA 1m05s" in out and "elapsed 2m05s" in out
    assert "0.219 (last batch)" in out and "32 tokens/s" in out
    assert "test before 0.144 -> after 0.243" in out and "hard before 0.050" in out
    assert "closed" in out and "DLQ" in out and " 3 " in out
    assert "2 crashes absorbed, 0 prompts given up (learner-0 x1, reward-0 x1)" in out
    assert "counts: dlq 3, republished 2" in out
    assert "step_000005" in out and "/s/logs/<instance>.log" in out


def test_render_before_anything_is_known_and_during_an_evaluation():
    out = text_of(PanelState())
    assert "ETA -" in out and "starting" in out and "none yet" in out
    assert "0 crashes absorbed" in out and "counts: none" in out
    out = text_of(PanelState(step=0, steps=100, phase="eval before", phase_s=42))
    assert "evaluating test (before training), 42s" in out
    out = text_of(PanelState(step=100, steps=100, phase="eval after", evals={"test": {"before": 0.1, "after": 0.3}},
                             breaker={"reward-0": "closed", "reward-1": "open"}))
    assert "evaluating harder splits (after training)" in out and "done: test 0.300" in out
    assert "reward-0 closed, reward-1 open" in out
    out = text_of(PanelState(phase="eval after", phase_s=61, evaluating={"split": "level04", "done": 64, "rows": 96}))
    assert "evaluating level04 64/96 (after training), 1m01s" in out


def test_eta_and_evaluations_read_from_the_run():
    history = [{"seconds": s} for s in (9.0, 2.0, 2.0, 3.0)]
    assert eta_s(4, 10, history) == 6 * 2.5
    assert eta_s(4, None, history) is None and eta_s(0, 10, []) is None
    before = {"accuracy": 0.25, "splits": {"hard": {"accuracy": 0.125}}}
    assert evaluations(before, {"accuracy": 0.5, "splits": {}}) == {"test": {"before": 0.25, "after": 0.5},
                                                                    "hard": {"before": 0.125}}
    assert evaluations(None, None) == {}


def test_lines_warnings_show_info_goes_to_the_log_only_and_summary_waits(tmp_path):
    console = Console(file=io.StringIO(), width=200, color_system=None)
    view = LivePanel(tmp_path, "http://127.0.0.1:1", {}, dict, console=console)
    view._live = SimpleNamespace(stop=lambda: None)   # as while drawn: SUMMARY lines are held
    out = view.out
    out.write('learner-0 | {"ts": 1, "level": "INFO", "service": "learner", "logger": "x", "msg": "step", "step": 1}\n')
    out.write('rollout-0 | {"ts": 1, "level": "WARNING", "service": "rollout", "logger": "x", "msg": "slow", '
              '"seconds": 3}\n')
    out.write('learner-0 | {"ts": 1, "level": "INFO", "msg": "evaluation", "when": "before", "accuracy": 0.25, '
              '"n": 64}\n')
    out.write("learner-0 | SUMMARY counts: none\n")
    out.write("actor-0   | listening http://127.0.0.1:8100\n")
    out.write("actor-0   | Loading weights: 45%|####      | 9/20 [00:03<00:04, 2.6it/s]\n")
    out.write("reward-0 | exited with 1; restart #1 in 1s\nbroker | restarted (pid 7)\n")
    shown = console.file.getvalue()
    assert "rollout-0 | WARNING slow (seconds=3)" in shown
    assert "exited with 1; restart #1" in shown and "broker | restarted" in shown
    assert '"msg"' not in shown and "listening" not in shown and "it/s" not in shown and "SUMMARY" not in shown
    assert view._evals == {"test": {"before": 0.25}}
    view.stop()   # not started: only the held lines print
    assert "learner-0 | SUMMARY counts: none" in console.file.getvalue()


def test_librdkafkas_start_up_retry_goes_to_the_log_only():
    """Printed above the panel on every start (a fresh broker's transaction coordinator loads)."""
    retry = ('{"ts": 1796414318.449, "level": "WARNING", "service": "rollout", "logger": '
             '"rdkafka.rollout-rollout-0-producer", "msg": "GETPID [rollout-rollout-0-producer#producer-2] '
             '[thrd:main]: Failed to acquire transactional PID from broker TxnCoordinator/1: Broker: Coordinator '
             'load in progress: retrying"}')
    assert panel.summarize("rollout-0", retry)[0] == "quiet"
    other = retry.replace("Coordinator load in progress: retrying", "Fatal error: Broker: Producer fenced")
    assert panel.summarize("rollout-0", other)[0] == "show"                       # another GETPID warning shows
    ours = retry.replace('"rdkafka.rollout-rollout-0-producer"', '"steadyrl.rollout"')
    assert panel.summarize("rollout-0", ours)[0] == "show"                        # only librdkafka's own line


def test_plain_when_not_a_terminal_or_asked(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setenv("TERM", "xterm")
    assert panel.wanted(False, Tty()) and not panel.wanted(True, Tty()) and not panel.wanted(False, io.StringIO())
    monkeypatch.setenv("TERM", "dumb")
    assert not panel.wanted(False, Tty())


def test_an_error_shows_whole_a_warning_is_cut():
    """The walk-through's stop message ("... learner.scorer_failure_limit (16) sets how many") was
    cut at 240 characters, before what to do."""
    from steadyrl.cli.panel import shown

    msg = "x" * 300 + " what to do"
    assert shown("learner-0", {"level": "ERROR", "msg": msg}).plain.endswith("what to do")
    cut = shown("learner-0", {"level": "WARNING", "msg": msg}).plain
    assert cut.endswith("...") and len(cut) < 280


def _scrape(text: str):
    from steadyrl.run.runview import parse_metrics

    return parse_metrics(text)


ROLLOUT_0 = """\
# TYPE steadyrl_rollout_turns_per_episode histogram
steadyrl_rollout_turns_per_episode_bucket{le="+Inf"} 4.0
steadyrl_rollout_turns_per_episode_count 4.0
steadyrl_rollout_turns_per_episode_sum 10.0
# TYPE steadyrl_rollout_episodes_truncated counter
steadyrl_rollout_episodes_truncated_total{reason="turns"} 1.0
steadyrl_rollout_episodes_truncated_total{reason="tokens"} 0.0
# TYPE steadyrl_rollout_tool_calls counter
steadyrl_rollout_tool_calls_total{tool="calc",outcome="ok"} 7.0
steadyrl_rollout_tool_calls_total{tool="calc",outcome="timeout"} 1.0
steadyrl_rollout_tool_calls_total{tool="calc",outcome="error"} 0.0
"""
ROLLOUT_1 = (ROLLOUT_0.replace("_count 4.0", "_count 2.0").replace("_sum 10.0", "_sum 2.0")
             .replace('outcome="ok"} 7.0', 'outcome="ok"} 3.0')
             + 'steadyrl_rollout_tool_calls_total{tool="unknown",outcome="invalid"} 2.0\n')
ONE_TURN = """\
# TYPE steadyrl_rollout_turns_per_episode histogram
steadyrl_rollout_turns_per_episode_bucket{le="+Inf"} 0.0
steadyrl_rollout_turns_per_episode_count 0.0
steadyrl_rollout_turns_per_episode_sum 0.0
# TYPE steadyrl_rollout_episodes_truncated counter
steadyrl_rollout_episodes_truncated_total{reason="turns"} 0.0
"""


def test_agent_figures_sum_the_rollout_workers_and_a_one_turn_run_has_none():
    a = panel.agent_figures([_scrape(ROLLOUT_0), _scrape(ROLLOUT_1), {}])   # {}: a worker not answering
    assert a is not None and (a.episodes, a.turns) == (6, 12.0) and a.truncated == {"turns": 2}
    assert a.tools == {"calc": {"ok": 10, "timeout": 2}, "unknown": {"invalid": 2}}
    assert panel.agent_figures([_scrape(ONE_TURN)]) is None and panel.agent_figures([]) is None


def test_render_shows_turns_and_tool_outcomes_only_for_a_multi_turn_run():
    state = PanelState(run_id="r1", step=3, steps=10)
    plain = text_of(state)
    assert "agents" not in plain
    a = panel.agent_figures([_scrape(ROLLOUT_0), _scrape(ROLLOUT_1)])
    out = text_of(PanelState(run_id="r1", step=3, steps=10, agents=a), width=160)
    assert "6 episodes, 2.0 turns/episode (truncated: turns 2)" in out
    assert "calc: ok 10, timeout 2; unknown: invalid 2" in out
    # the same rows, the agents row added after accuracy; the one-turn panel has the rows it had
    def rows(text):
        return [line.strip("│ ").split("  ")[0] for line in text.splitlines()[1:-1]]

    assert rows(plain) == ["step", "phase", "reward", "accuracy", "breaker", "DLQ", "restarts", "checkpoint"]
    assert rows(out) == ["step", "phase", "reward", "accuracy", "agents", "breaker", "DLQ", "restarts", "checkpoint"]


def test_the_live_panel_reads_the_rollout_workers_metrics(tmp_path):
    """A real HTTP server as the rollout worker's /metrics; the learner not answering."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import httpx

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):   # noqa: N802 - http.server's name
            body = ROLLOUT_0.encode()
            self.send_response(200)
            self.send_header("content-type", "text/plain; version=0.0.4")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        view = LivePanel(tmp_path, "http://127.0.0.1:1", {}, dict, rollout_urls={"rollout-0": url})
        with httpx.Client(timeout=2.0) as http:
            view.poll(http)
        a = view.snapshot().agents
        assert a is not None and a.episodes == 4 and a.tools == {"calc": {"ok": 7, "timeout": 1}}
    finally:
        server.shutdown()
