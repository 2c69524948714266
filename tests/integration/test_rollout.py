"""Rollout worker + actor over the real broker: prompts held while the actor is down, then each once."""

import time

from steadyrl import codec
from steadyrl.broker import free_port
from steadyrl.contracts import DLQRecord, Prompt, RolloutGroup
from tests.helpers import ServiceProc, decode_all, produce_all, read_all

N = 12


def _prompt(i, n=3):
    return Prompt(prompt_id=f"e0-i{i}", epoch=0, index=i, n_samples=n, ground_truth=str(i % 10), max_new_tokens=4,
                  messages=[{"role": "user", "content": str(i % 10)}], data_source="tiny_copy")


def test_prompts_wait_for_the_actor_then_each_yields_one_group(bootstrap, prefix, tmp_path):
    port = free_port()
    prompts = [_prompt(i) for i in range(N)] + [_prompt(99, n=100)]  # 100 > max_sequences 64: the actor refuses
    produce_all(bootstrap, f"{prefix}rl.prompts", [(p.prompt_id, *codec.encode(p)) for p in prompts])
    rollout = ServiceProc("rollout", ["--bootstrap", bootstrap, "--topic-prefix", prefix, "--instance-id", "r0",
                                      "--rollout.actor-url", f"http://127.0.0.1:{port}",
                                      "--rollout.retry-backoff-s", "0.5"],
                          tmp_path / "rollout.log")
    actor = None
    try:
        rollout.wait_ready()
        time.sleep(3)  # the actor is down: batches are held, nothing is produced or lost
        assert read_all(bootstrap, f"{prefix}rl.rollouts", expect=0, settle_s=0.5) == []
        assert "actor unreachable" in rollout.log_path.read_text()
        actor = ServiceProc("actor", ["--bootstrap", bootstrap, "--topic-prefix", prefix, "--instance-id", "a0",
                                      "--actor.model", "tiny", "--actor.policy-root", str(tmp_path),
                                      "--actor.max-sequences", "64", "--metrics-port", str(port)],
                            tmp_path / "actor.log")
        groups = decode_all(read_all(bootstrap, f"{prefix}rl.rollouts", expect=N, timeout_s=120), RolloutGroup)
        assert sorted(g.prompt_id for g in groups) == sorted(p.prompt_id for p in prompts[:N])
        for g in groups:
            assert len(g.samples) == 3 and g.policy_version == 0 and g.prompt_token_ids
            assert all(len(s.token_ids) == len(s.logprobs) <= 4 for s in g.samples)
        [dlq] = decode_all(read_all(bootstrap, f"{prefix}rl.dlq", expect=1), DLQRecord)
        assert dlq.reason.value == "handler_error" and "max_sequences" in dlq.error
    finally:
        assert rollout.stop() == 0
        if actor is not None:
            assert actor.stop() == 0
