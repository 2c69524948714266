"""Tools that fail every way, on the real broker (issue 48, acceptance): a rollout worker whose
tools sleep for ever, call os._exit, return 10 MB and raise, driven by a scripted actor (a real
HTTP server on 127.0.0.1 answering /generate in the actor's response shape with fixed tool
calls: the tiny model does not write <tool_call> by itself). Every episode finishes, each
call's outcome is counted and is the model's tool result, and the worker never dies."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from steadyrl.local.ports import free_port
from steadyrl.model.agents import MAX_TOOL_RESULT_CHARS
from steadyrl.model.models import tiny_tokenizer
from steadyrl.wire import codec
from steadyrl.wire.contracts import EpisodeState, Prompt, RolloutGroup
from tests.helpers import ServiceProc, decode_all, produce_all, read_all
from tests.steadyrl.test_agent_budgets import TOOLS

N = 2   # prompts, of 2 episodes each
CALLS = "".join(f'<tool_call>{{"name": "{t}", "arguments": {{"x": 1}}}}</tool_call>'
                for t in ("ok", "hang", "die", "huge", "boom"))


def _scripted_actor(port: int) -> ThreadingHTTPServer:
    """POST /generate: every prompt gets CALLS (its tiny-tokenizer ids, log-prob -0.5 each)."""
    ids = tiny_tokenizer().encode(CALLS, add_special_tokens=False)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            comp = {"token_ids": ids, "logprobs": [-0.5] * len(ids), "finish_reason": "stop", "text": CALLS}
            out = json.dumps({"policy_version": 0, "engine": "torch", "prompt_ids": [p["prompt_ids"] for p in
                                                                                     body["prompts"]],
                              "completions": [[comp] for _ in body["prompts"]]}).encode()
            self.send_response(200 if self.path == "/generate" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_tools_that_hang_exit_return_10_mb_or_raise_cost_their_calls_and_every_episode_ends(
        bootstrap, prefix, tmp_path):
    (tmp_path / "tools.py").write_text(TOOLS)
    port = free_port()
    actor = _scripted_actor(port)
    prompts = [Prompt(prompt_id=f"r/e0-i{i}", epoch=0, index=i, n_samples=2, ground_truth="1", max_new_tokens=4,
                      messages=[{"role": "user", "content": str(i)}], seed=i) for i in range(N)]
    produce_all(bootstrap, f"{prefix}rl.prompts", [(p.prompt_id, *codec.encode(p)) for p in prompts])
    t0 = time.monotonic()
    worker = ServiceProc("rollout", ["--bootstrap", bootstrap, "--topic-prefix", prefix, "--instance-id", "r0",
                                     "--rollout.actor-url", f"http://127.0.0.1:{port}", "--rollout.batch-size", "2",
                                     "--rollout.agent.tools", f"{tmp_path / 'tools.py'}:ok,hang,die,huge,boom",
                                     "--rollout.agent.model", "tiny", "--rollout.agent.max-turns", "2",
                                     "--rollout.agent.max-tool-calls", "5", "--rollout.agent.tool-timeout-s", "1",
                                     "--rollout.agent.max-episode-tokens", "30000"], tmp_path / "rollout.log")
    try:
        groups = decode_all(read_all(bootstrap, f"{prefix}rl.rollouts", expect=N, timeout_s=90), RolloutGroup)
        took = time.monotonic() - t0
        assert sorted(g.prompt_id for g in groups) == [p.prompt_id for p in prompts]
        assert all(len(g.samples) == 2 and [len(s.turn_versions) for s in g.samples] == [2, 2] for g in groups)
        states = decode_all(read_all(bootstrap, f"{prefix}rl.episodes", expect=N, settle_s=0.5), EpisodeState)
        assert len(states) == N
        for s in states:
            for ep in s.episodes:
                ok, hang, die, huge, boom = [m.content for m in ep.messages if m.role == "tool"]
                assert ok == "1" and hang == "error: the tool did not answer within 1 s"
                assert die.startswith("error: the tool crashed: crashed its process (exited with code 7)")
                assert len(huge) < MAX_TOOL_RESULT_CHARS + 100 and huge.endswith("characters cut]")
                assert boom == "error: RuntimeError: tool broke"
        counted = {o: worker.metric("steadyrl_rollout_tool_calls_total", {"tool": t, "outcome": o})
                   for t, o in (("ok", "ok"), ("hang", "timeout"), ("die", "crash"), ("huge", "cut"),
                                ("boom", "error"))}
        assert counted == dict.fromkeys(counted, 2.0 * N)
        assert worker.metric("steadyrl_rollout_episodes_finished_total", {"how": "turns"}) == 2.0 * N
        assert read_all(bootstrap, f"{prefix}rl.dlq", expect=0, timeout_s=3, settle_s=0.5) == []
        assert worker.proc.poll() is None   # the worker never died
        print(f"{N} groups of 2 episodes, 5 faulty tool calls each: {took:.1f} s")  # noqa: T201
    finally:
        assert worker.stop() == 0
        actor.shutdown()
