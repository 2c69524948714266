"""`steadyrl up`'s live panel on a terminal: one block, redrawn in place, in place of the
services' scrolling lines.

What it shows (`PanelState`, drawn by the pure `render`): the step against the total with an
ETA, the last batch's reward, the phase (during an evaluation, which one and the splits done so
far), the last evaluation accuracy per split, the circuit breaker each reward worker keeps
on its calls to the reward server (`steadyrl_reward_breaker_state`), in a multi-turn run the
episodes' turns and tool calls by outcome (the rollout workers' `/metrics`), the DLQ count, and the restarts ("2 crashes
absorbed") beside the run's counts (`Counts.line()`, as the SUMMARY prints them). The figures
come through steadyrl.run.runview, as `steadyrl status` reads them.

The services' lines reach the panel through `LinePanel.out` (given to the Supervisor and the
BrokerWatch as their `out`): a warning or error (a JSON log line of level WARNING and above)
and any plain line (a traceback, a restart notice) print above the panel; the learner's
SUMMARY lines print after it stops; the rest (INFO log lines, a library's progress bars,
librdkafka's start-up "Coordinator load in progress: retrying", `TRANSIENT`) only go to
`<state>/logs/<instance>.log`, where the supervisor keeps every line whole.
Plain lines, as before, when stdout is not a terminal, TERM is dumb, or `up --plain`.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO, cast

import httpx
from rich.console import Console, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from steadyrl.run import runview
from steadyrl.run.runfolder import Count

#: Levels of a JSON log line that print above the panel.
SHOWN_LEVELS = frozenset({"WARNING", "ERROR", "CRITICAL"})
#: Plain lines that only go to the log file: a server's "listening" line and progress bars
#: (transformers', tqdm's: "45%|####  | 9/20 [00:03<00:04, 2.6it/s]").
QUIET = re.compile(r"^listening https?://|\d+%\|.*\||\d+(\.\d+)?(it/s|s/it)\]")
#: librdkafka's warnings (JSON lines of an `rdkafka.*` logger) that only say a start-up wait is
#: retried: a transactional producer asking for its id while the broker's transaction coordinator
#: still loads (every start of a fresh broker). To the log file only, like an INFO line.
TRANSIENT = re.compile(r"^GETPID \[[^\]]*\] \[[^\]]*\]: .*Coordinator load in progress: retrying$")
#: A log line's fields that are not worth a person's screen.
_PLUMBING = frozenset({"ts", "level", "service", "logger", "msg", "exc", "taskName"})


def wanted(plain: bool, stream: TextIO | None = None) -> bool:
    """Whether `up` draws the panel: stdout is a terminal, TERM is not dumb, and not --plain.
    (NO_COLOR keeps the panel, without colour: rich reads it.)"""
    stream = sys.stdout if stream is None else stream
    return not plain and stream.isatty() and os.environ.get("TERM", "") not in ("dumb", "unknown")


def duration(seconds: float) -> str:
    """`1h02m`, `3m05s` or `42s`."""
    s = int(max(seconds, 0))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


@dataclass
class PanelState:
    """What the panel shows, gathered by `LivePanel` (each field may be unknown: None or empty)."""

    run_id: str | None = None
    step: int = 0
    steps: int | None = None
    phase: str = "starting"                   # the learner's, or "starting" before it answers
    phase_s: float = 0.0                      # seconds in this phase
    elapsed_s: float = 0.0                    # since up started the services
    eta_s: float | None = None
    reward: float | None = None               # the last batch's mean reward
    tokens_per_s: float | None = None
    evals: dict[str, dict[str, float]] = field(default_factory=dict)   # split -> {"before"/"after": accuracy}
    evaluating: dict[str, Any] | None = None  # the learner's /progress `eval`: {split, done, rows}
    breaker: dict[str, str] = field(default_factory=dict)              # reward instance -> closed/open/half_open
    dlq: int = 0
    restarts: dict[str, int] = field(default_factory=dict)             # instance (or "broker") -> restarts
    abandoned: int = 0
    counts: str = ""                          # Counts.line() of the run
    checkpoint: str | None = None
    log_dir: str = ""
    agents: AgentFigures | None = None        # multi-turn runs only: the rollout workers' episodes


@dataclass
class AgentFigures:
    """A multi-turn run's episodes so far, summed over the rollout workers (`agent_figures`)."""

    episodes: int = 0                                                  # finished and written
    turns: float = 0.0                                                 # their assistant turns in all
    truncated: dict[str, int] = field(default_factory=dict)            # reason -> episodes
    tools: dict[str, dict[str, int]] = field(default_factory=dict)     # tool -> outcome -> calls


def agent_figures(scrapes: list[runview.Metrics]) -> AgentFigures | None:
    """The episode metrics of the rollout workers' `/metrics` (steadyrl/model/agent_metrics.py),
    summed; None while no episode finished and no tool was called (a one-turn run: the panel
    stays as it is)."""
    fig = AgentFigures()
    for metrics in scrapes:
        for (name, labels), v in metrics.items():
            lab = dict(labels)
            if name == "steadyrl_rollout_turns_per_episode_count":
                fig.episodes += int(v)
            elif name == "steadyrl_rollout_turns_per_episode_sum":
                fig.turns += v
            elif name == "steadyrl_rollout_episodes_truncated_total" and v:
                fig.truncated[lab["reason"]] = fig.truncated.get(lab["reason"], 0) + int(v)
            elif name == "steadyrl_rollout_tool_calls_total" and v:
                calls = fig.tools.setdefault(lab["tool"], {})
                calls[lab["outcome"]] = calls.get(lab["outcome"], 0) + int(v)
    return fig if fig.episodes or fig.tools else None


def _agents(a: AgentFigures) -> Text:
    mean = f"{a.turns / a.episodes:.1f}" if a.episodes else "-"
    text = Text(f"{a.episodes} episodes, {mean} turns/episode")
    if a.truncated:
        text.append(" (truncated: " + ", ".join(f"{why} {n}" for why, n in sorted(a.truncated.items())) + ")",
                    style="yellow")
    for tool, calls in sorted(a.tools.items()):
        bad = sum(n for outcome, n in calls.items() if outcome not in ("ok", "invalid", "over_limit"))
        text.append(f"; {tool}: " + ", ".join(f"{outcome} {n}" for outcome, n in sorted(
            calls.items(), key=lambda kv: (kv[0] != "ok", kv[0]))), style="yellow" if bad else "")
    return text


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _phase(s: PanelState) -> Text:
    if s.phase.startswith("eval "):
        when = s.phase.removeprefix("eval ")
        done = [f"{name} {ev[when]:.3f}" for name, ev in s.evals.items() if when in ev]
        doing = runview.MAIN_SPLIT if not done else "harder splits"
        if s.evaluating:   # the learner says which split and how far
            doing = f"{s.evaluating.get('split')} {s.evaluating.get('done')}/{s.evaluating.get('rows')}"
        text = Text(f"evaluating {doing} ({when} training), {duration(s.phase_s)}", style="bold")
        if done:
            text.append(f"; done: {', '.join(done)}", style="dim")
        return text
    return Text(f"{s.phase}, {duration(s.phase_s)}")


def _restarts(s: PanelState) -> Text:
    crashes = sum(s.restarts.values())
    text = Text(f"{crashes} crash{'es' if crashes != 1 else ''} absorbed, {s.abandoned} prompts given up",
                style="yellow" if crashes else "")
    if crashes:
        text.append(" (" + ", ".join(f"{name} x{n}" for name, n in sorted(s.restarts.items()) if n) + ")")
    text.append(f"; counts: {s.counts or 'none'}", style="dim")
    return text


def _breaker(s: PanelState) -> Text:
    if not s.breaker:
        return Text("-")
    states = set(s.breaker.values())
    style = "green" if states == {"closed"} else "red" if "open" in states else "yellow"
    if len(states) == 1:
        return Text(states.pop(), style=style)
    return Text(", ".join(f"{name} {state}" for name, state in sorted(s.breaker.items())), style=style)


def render(s: PanelState) -> RenderableType:
    """The panel for `s`: a titled box of labelled rows (pure: no I/O, no clock)."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="cyan", no_wrap=True)
    grid.add_column()
    total = f"/{s.steps}" if s.steps is not None else ""
    step = Table.grid(padding=(0, 2))
    step.add_row(Text(f"{s.step}{total}", style="bold"),
                 ProgressBar(total=max(s.steps or 1, 1), completed=min(s.step, s.steps or 0), width=30),
                 Text(f"{100 * s.step / s.steps:.0f}%" if s.steps else ""),
                 Text(f"ETA {duration(s.eta_s)}" if s.eta_s is not None else "ETA -"),
                 Text(f"elapsed {duration(s.elapsed_s)}", style="dim"))
    grid.add_row("step", step)
    grid.add_row("phase", _phase(s))
    reward = Text(f"{_fmt(s.reward)} (last batch)")
    if s.tokens_per_s is not None:
        reward.append(f", {s.tokens_per_s:.0f} tokens/s", style="dim")
    grid.add_row("reward", reward)
    evals = Text(", ".join(f"{name} " + " -> ".join(f"{when} {acc:.3f}" for when, acc in sorted(ev.items(),
                           key=lambda kv: kv[0] != "before")) for name, ev in s.evals.items()) or "none yet")
    grid.add_row("accuracy", evals)
    if s.agents is not None:
        grid.add_row("agents", _agents(s.agents))
    grid.add_row("breaker", Text.assemble(_breaker(s), ("  (reward workers -> reward server)", "dim")))
    grid.add_row("DLQ", Text(str(s.dlq), style="yellow" if s.dlq else ""))
    grid.add_row("restarts", _restarts(s))
    grid.add_row("checkpoint", Text(s.checkpoint or "none yet"))
    if s.log_dir:
        grid.add_row("logs", Text(f"{s.log_dir}/<instance>.log", style="dim"))
    title = f"steadyrl up - run {s.run_id}" if s.run_id else "steadyrl up"
    return Panel(grid, title=title, title_align="left", expand=False)


def summarize(name: str, text: str) -> tuple[str, dict[str, Any] | None]:
    """How a service's output line is handled: ("summary", None) a SUMMARY line; ("show",
    None) a plain line worth a person's eye; ("quiet", None) one for the log file only; and
    for a JSON log line ("show" or "quiet", the record)."""
    if text.startswith("SUMMARY "):
        return "summary", None
    if text.startswith("{"):
        try:
            record = json.loads(text)
        except ValueError:
            record = None
        if isinstance(record, dict) and "level" in record:
            if str(record.get("logger", "")).startswith("rdkafka.") and TRANSIENT.match(str(record.get("msg", ""))):
                return "quiet", record
            return ("show" if record["level"] in SHOWN_LEVELS else "quiet"), record
    return ("quiet" if not text.strip() or QUIET.search(text) else "show"), None


def shown(name: str, record: dict[str, Any], width: int = 240) -> Text:
    """A warning's or an error's log record as one readable line: `name | LEVEL msg (k=v, ...)`,
    and an exception's last line. A warning is cut at `width` characters; an error is shown
    whole (it says what to do, and there is one)."""
    level = str(record.get("level"))
    extra = ", ".join(f"{k}={v}" for k, v in record.items() if k not in _PLUMBING)
    body = str(record.get("msg", "")) + (f" ({extra})" if extra else "")
    if record.get("exc"):
        body += f": {str(record['exc']).strip().splitlines()[-1]}"
    if len(body) > width and level == "WARNING":
        body = body[:width - 3] + "..."
    return Text.assemble((f"{name} | ", "dim"), (level, "red" if level != "WARNING" else "yellow"), f" {body}")


class _Lines:
    """A TextIO-like `out` for the Supervisor and the BrokerWatch: each line to LivePanel.line."""

    def __init__(self, line: Callable[[str], None]) -> None:
        self._line, self._part, self._lock = line, "", threading.Lock()

    def write(self, s: str) -> int:
        with self._lock:
            *lines, self._part = (self._part + s).split("\n")
        for line in lines:
            self._line(line)
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


class LivePanel:
    """The panel, live: `start()` draws it and polls the run every `poll_s` seconds in a thread
    (the learner's /progress, the run folder, each reward worker's /metrics); `out` takes the
    services' lines (see the module); `stop()` ends it and prints the held SUMMARY lines.

    Args:
        state_dir: up's --state-dir.
        learner_url: the learner's HTTP address.
        reward_urls: reward worker instance -> HTTP address (their breaker state).
        restarts: instance -> restarts so far (the supervisor's children, the broker watch).
        rollout_urls: rollout worker instance -> HTTP address (a multi-turn run's episodes).
    """

    def __init__(self, state_dir: Path, learner_url: str, reward_urls: dict[str, str],
                 restarts: Callable[[], dict[str, int]], console: Console | None = None, poll_s: float = 2.0,
                 rollout_urls: dict[str, str] | None = None) -> None:
        self.state_dir, self.learner_url, self.reward_urls = Path(state_dir), learner_url, reward_urls
        self.rollout_urls = rollout_urls or {}
        self.restarts, self.poll_s = restarts, poll_s
        self.console = console or Console()
        self.out = cast(TextIO, _Lines(self.line))   # what the Supervisor writes to: write() and flush()
        self.state = PanelState(log_dir=str(self.state_dir / "logs"))
        self._evals: dict[str, dict[str, float]] = {}   # from the learner's "evaluation" log lines
        self._summary: list[Text] = []
        self._lock = threading.Lock()
        self._t0 = self._phase_t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._live: Live | None = None

    # ---- the services' lines ---------------------------------------------------------------
    def line(self, line: str) -> None:
        """One line of `out` (`name | text`, the supervisor's form)."""
        name, sep, text = line.partition(" | ")
        name, text = (name.strip(), text) if sep else ("", line)
        kind, record = summarize(name, text)
        if record is not None and record.get("msg") == "evaluation" and record.get("accuracy") is not None:
            with self._lock:
                split = str(record.get("split") or runview.MAIN_SPLIT)
                self._evals.setdefault(split, {})[str(record.get("when"))] = float(record["accuracy"])
        if kind == "summary":
            with self._lock:
                if self._live is not None:
                    self._summary.append(Text(line))
                    return
            self._print(Text(line))
        elif kind == "show":
            self._print(shown(name, record) if record is not None else Text(line))

    def _print(self, text: Text) -> None:
        self.console.print(text, soft_wrap=True, highlight=False)

    # ---- polling ---------------------------------------------------------------------------
    def poll(self, http: httpx.Client) -> None:
        """Read the run once and keep it as `state`."""
        live = runview.fetch_progress(self.learner_url, http)
        breaker = {}
        for name, url in self.reward_urls.items():
            metrics = runview.fetch_metrics(url, http)
            on = [dict(labels).get("state", "") for (metric, labels), v in metrics.items()
                  if metric == "steadyrl_reward_breaker_state" and v == 1]
            if on:
                breaker[name] = on[0]
        agents = agent_figures([runview.fetch_metrics(url, http) for url in self.rollout_urls.values()])
        # this start's run: the one the learner names (before it answers, CURRENT may still name
        # the last run of this state dir); while it does not answer (a restart), the one it named
        run_id = live.get("run_id") or self.state.run_id
        run: runview.RunView | None = None
        if run_id is not None:
            try:
                run = runview.read_run(self.state_dir, live, run_id)
            except (OSError, ValueError, KeyError):
                run = None
        phase = str(live.get("phase") or ("starting" if run is None else "done" if run.finished
                                          else "learner not answering"))
        with self._lock:
            if phase != self.state.phase:
                self._phase_t0 = time.monotonic()
            evals = {**(run.evals if run is not None else {})}
            for split, ev in self._evals.items():
                evals[split] = {**evals.get(split, {}), **ev}
            last = run.last if run is not None else None
            # the learner gone (the run ended, a restart) and its folder not read: the last known step
            step = int(live.get("step") or (run.step if run else self.state.step))
            steps = live.get("steps", self.state.steps)
            self.state = replace(
                self.state, run_id=run_id, step=step, steps=steps, phase=phase,
                eta_s=runview.eta_s(step, steps, run.history) if run and not run.finished else None,
                reward=live.get("reward_mean", last["reward_mean"] if last else None),
                tokens_per_s=live.get("tokens_per_s"), evals=evals, breaker=breaker,
                evaluating=live.get("eval") if isinstance(live.get("eval"), dict) else None,
                dlq=run.counts[Count.dlq] if run else 0, abandoned=run.counts[Count.abandoned] if run else 0,
                counts=run.counts.line() if run else "", checkpoint=run.checkpoint if run else None,
                agents=agents or self.state.agents)   # a worker not answering (a restart): the last known

    def snapshot(self) -> PanelState:
        """`state` with the clocks of now."""
        with self._lock:
            now = time.monotonic()
            return replace(self.state, elapsed_s=now - self._t0, phase_s=now - self._phase_t0,
                           restarts=dict(self.restarts()))

    def _poll_loop(self) -> None:
        with httpx.Client(timeout=2.0) as http:
            while not self._stop.is_set():
                try:
                    self.poll(http)
                except Exception as e:  # noqa: BLE001 - the panel must never take `up` down
                    self._print(Text(f"panel | not updated: {type(e).__name__}: {e}", style="dim"))
                self._stop.wait(self.poll_s)

    # ---- start, stop -----------------------------------------------------------------------
    def start(self) -> LivePanel:
        self._t0 = self._phase_t0 = time.monotonic()
        live = Live(console=self.console, refresh_per_second=2, get_renderable=lambda: render(self.snapshot()))
        with self._lock:
            self._live = live
        live.start()
        self._thread = threading.Thread(target=self._poll_loop, name="panel", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Draw the panel a last time, stop it, and print the SUMMARY lines it held (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        with self._lock:
            live, self._live = self._live, None
            summary, self._summary = self._summary, []
        if live is not None:
            live.stop()
        for text in summary:
            self._print(text)
