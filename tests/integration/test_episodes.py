"""Multi-turn episodes on the real broker (issue 48): the real actor (tiny model), rollout
workers running examples/agents/try_again.py, one of them killed -9 mid-episode. Every group
finishes once on rl.rollouts, no turn is on rl.episodes twice, and every trained trajectory
extends its last committed state (steadyrl/testing/audit.py audit_episodes)."""

import time

from steadyrl.local.ports import free_port
from steadyrl.testing.audit import audit_episodes
from steadyrl.wire import codec
from steadyrl.wire.contracts import EpisodeState, Prompt, RolloutGroup
from tests.helpers import ROOT, ServiceProc, decode_all, produce_all, read_all

N = 16
ENV = str(ROOT / "examples" / "agents" / "try_again.py") + ":TryAgain"


def _prompt(i: int) -> Prompt:
    return Prompt(prompt_id=f"r/e0-i{i}", epoch=0, index=i, n_samples=2, ground_truth=str(i % 10), max_new_tokens=4,
                  messages=[{"role": "user", "content": str(i % 10)}], data_source="tiny_copy", seed=1000 + i)


def _rollout(bootstrap, prefix, port, tmp_path, name):
    return ServiceProc("rollout", ["--bootstrap", bootstrap, "--topic-prefix", prefix, "--instance-id", "r0",
                                   "--rollout.actor-url", f"http://127.0.0.1:{port}", "--rollout.batch-size", "2",
                                   "--rollout.agent.env", ENV, "--rollout.agent.model", "tiny",
                                   "--rollout.agent.max-turns", "4"],
                       tmp_path / f"{name}.log")


def test_episodes_survive_a_kill_9_mid_episode_and_each_finishes_once(bootstrap, prefix, tmp_path):
    port = free_port()
    actor = ServiceProc("actor", ["--bootstrap", bootstrap, "--topic-prefix", prefix, "--instance-id", "a0",
                                  "--actor.model", "tiny", "--actor.policy-root", str(tmp_path),
                                  "--metrics-port", str(port)], tmp_path / "actor.log")
    prompts = [_prompt(i) for i in range(N)]
    produce_all(bootstrap, f"{prefix}rl.prompts", [(p.prompt_id, *codec.encode(p)) for p in prompts])
    first = _rollout(bootstrap, prefix, port, tmp_path, "rollout-1")
    second = None
    try:
        read_all(bootstrap, f"{prefix}rl.episodes", expect=3, timeout_s=120, settle_s=0)   # episodes in flight
        first.kill()
        t0 = time.monotonic()
        second = _rollout(bootstrap, prefix, port, tmp_path, "rollout-2")
        groups = decode_all(read_all(bootstrap, f"{prefix}rl.rollouts", expect=N, timeout_s=120), RolloutGroup)
        took = time.monotonic() - t0
        states = decode_all(read_all(bootstrap, f"{prefix}rl.episodes", expect=1, settle_s=0.5), EpisodeState)
        report = audit_episodes(states, groups, [p.prompt_id for p in prompts])
        assert report["ok"], report
        assert report["states"] >= 3   # the kill came between turns of some episodes
        for g in groups:
            for s in g.samples:
                turns = len(s.turn_versions)
                assert 1 <= turns <= 4 and s.loss_mask[0] == 1 and s.loss_mask[-1] == 1
                m = s.loss_mask
                assert sum(1 for a, b in zip(m, m[1:], strict=False) if (a, b) == (0, 1)) == turns - 1
                assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.loss_mask, strict=True) if m == 0)
                assert len(g.prompt_token_ids) + len(s.token_ids) <= 4096
        print(f"{N} groups, {report['states']} committed states; {took:.1f} s after the kill")  # noqa: T201
    finally:
        if second is not None:
            assert second.stop() == 0
        first.kill()
        assert actor.stop() == 0
