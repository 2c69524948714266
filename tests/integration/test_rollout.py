"""Rollout worker + actor over the real broker: prompts held while the actor is down, then each once."""

import time

import httpx

from steadyrl.local.ports import free_port
from steadyrl.wire import codec
from steadyrl.wire.contracts import DLQRecord, Prompt, RolloutGroup
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


def test_rollout_gate_drops_long_samples_and_sends_emptied_groups_to_dlq(bootstrap, prefix, tmp_path):
    """The real actor, a limit of 1 response token: prompts allowed 1 new token keep all their
    samples; prompts allowed 4 lose every sample longer than 1 (the tiny model rarely stops
    at once) and, emptied, go to rl.dlq with reason `rejected`. Every prompt is accounted
    for once."""
    port = free_port()
    short = [_prompt(i).model_copy(update={"max_new_tokens": 1}) for i in range(4)]
    long = [_prompt(10 + i) for i in range(6)]
    produce_all(bootstrap, f"{prefix}rl.prompts", [(p.prompt_id, *codec.encode(p)) for p in short + long])
    actor = ServiceProc("actor", ["--bootstrap", bootstrap, "--topic-prefix", prefix, "--instance-id", "a1",
                                  "--actor.model", "tiny", "--actor.policy-root", str(tmp_path),
                                  "--metrics-port", str(port)], tmp_path / "actor.log")
    rollout = ServiceProc("rollout", ["--bootstrap", bootstrap, "--topic-prefix", prefix, "--instance-id", "r1",
                                      "--rollout.actor-url", f"http://127.0.0.1:{port}",
                                      "--rollout.max-response-tokens", "1"], tmp_path / "rollout.log")
    try:
        rollout.wait_ready()
        groups = decode_all(read_all(bootstrap, f"{prefix}rl.rollouts", expect=4, timeout_s=120), RolloutGroup)
        dlq_msgs = read_all(bootstrap, f"{prefix}rl.dlq", expect=1)
        dlq = decode_all(dlq_msgs, DLQRecord)
        seen = [g.prompt_id for g in groups] + [m.key().decode() for m in dlq_msgs]
        assert sorted(seen) == sorted(p.prompt_id for p in short + long)
        for g in groups:
            assert all(len(s.token_ids) <= 1 for s in g.samples)
            assert len(g.samples) + g.rejected.get("too_long", 0) == 3
        assert {p.prompt_id for p in short} <= {g.prompt_id for g in groups}
        assert all(g.rejected == {} for g in groups if g.prompt_id in {p.prompt_id for p in short})
        for d in dlq:
            assert d.reason.value == "rejected" and "rollout gate: all 3 samples rejected (too_long x3)" in d.error
        rejected = rollout.metric("steadyrl_rollout_samples_rejected_total", {"reason": "too_long"})
        assert rejected == sum(g.rejected.get("too_long", 0) for g in groups) + 3 * len(dlq)
    finally:
        assert rollout.stop() == 0
        assert actor.stop() == 0


def test_a_prompt_whose_policy_never_comes_leaves_once_its_budget_is_spent(bootstrap, prefix, tmp_path):
    """The actor answers 503 ("behind") for a prompt of a run it will never serve, while it
    serves the others: the prompt goes to rl.dlq as retries_exhausted with the actor's last
    message, and its partition moves on. Before, it was held for good."""
    from confluent_kafka import Producer

    port = free_port()
    stuck = _prompt(50).model_copy(update={"prompt_id": "stuck", "run_id": "zz-never", "min_policy_version": 1})
    after = [_prompt(60 + i) for i in range(3)]  # behind it, in its partition
    others = [_prompt(i) for i in range(4)]
    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for part, ps in ((0, [stuck, *after]), (1, others)):
        for pr in ps:
            value, headers = codec.encode(pr)
            p.produce(f"{prefix}rl.prompts", value, key=pr.prompt_id, headers=headers, partition=part)
    assert p.flush(30) == 0
    actor = ServiceProc("actor", ["--bootstrap", bootstrap, "--topic-prefix", prefix, "--instance-id", "a2",
                                  "--actor.model", "tiny", "--actor.policy-root", str(tmp_path),
                                  "--metrics-port", str(port)], tmp_path / "actor.log")
    rollout = ServiceProc("rollout", ["--bootstrap", bootstrap, "--topic-prefix", prefix, "--instance-id", "r2",
                                      "--rollout.actor-url", f"http://127.0.0.1:{port}",
                                      "--rollout.max-hold-s", "2", "--rollout.max-attempts", "3"],
                          tmp_path / "rollout.log")
    try:
        rollout.wait_ready()
        groups = decode_all(read_all(bootstrap, f"{prefix}rl.rollouts", expect=7, timeout_s=120), RolloutGroup)
        dlq_msgs = read_all(bootstrap, f"{prefix}rl.dlq", expect=1, settle_s=2)
        assert sorted(g.prompt_id for g in groups) == sorted(pr.prompt_id for pr in after + others)
        [dlq] = decode_all(dlq_msgs, DLQRecord)
        assert dlq_msgs[0].key() == b"stuck" and dlq.reason.value == "retries_exhausted"
        assert "last error: actor not ready: serving run '' version 0; waiting for run 'zz-never'" in dlq.error
        assert rollout.metric("steadyrl_stage_dlq_records_total", {"reason": "retries_exhausted"}) == 1
    finally:
        assert rollout.stop() == 0
        assert actor.stop() == 0


def test_prompts_a_killed_learner_stamped_past_the_resumed_checkpoint_are_served(bootstrap, prefix, tmp_path):
    """Regression (compose-test stall, max_staleness 1): the learner killed at step 5 had
    published version 5 and stamped prompts with it; its successor resumed from step 2 and
    announced version 2 (high_water 5). The actor answered those prompts 503 ("waiting for
    version >= 5"), each worker held its partition on them, and the resumed learner waited for
    their groups to train the steps to 5: a deadlock. Now they are generated with version 2
    (the learner's staleness rule judges them); a prompt past the mark still waits."""
    from tests.integration.test_actor import _weights

    run = "r20261203T000000-dead"
    root = tmp_path / "policies"
    dead = _weights(root, 5, seed=1, run=run)
    resumed = _weights(root, 2, seed=2, run=run).model_copy(update={"high_water": 5})
    produce_all(bootstrap, f"{prefix}rl.policy", [("policy", *codec.encode(u)) for u in (dead, resumed)])
    stamped = [_prompt(i).model_copy(update={"prompt_id": f"{run}/e0-i{i}", "run_id": run, "min_policy_version": v})
               for i, v in ((0, 5), (1, 3), (2, 2))]
    produce_all(bootstrap, f"{prefix}rl.prompts", [(pr.prompt_id, *codec.encode(pr)) for pr in stamped])
    port = free_port()
    actor = ServiceProc("actor", ["--bootstrap", bootstrap, "--topic-prefix", prefix, "--instance-id", "a4",
                                  "--actor.model", "tiny", "--actor.policy-root", str(root),
                                  "--metrics-port", str(port)], tmp_path / "actor.log")
    rollout = ServiceProc("rollout", ["--bootstrap", bootstrap, "--topic-prefix", prefix, "--instance-id", "r4",
                                      "--rollout.actor-url", f"http://127.0.0.1:{port}"], tmp_path / "rollout.log")
    try:
        rollout.wait_ready()
        groups = decode_all(read_all(bootstrap, f"{prefix}rl.rollouts", expect=3, timeout_s=120), RolloutGroup)
        assert sorted((g.prompt_id, g.policy_version) for g in groups) == [(pr.prompt_id, 2) for pr in stamped]
        assert actor.metric("steadyrl_actor_policy_high_water") == 5
        body = {"prompts": [{"prompt_ids": [5, 6]}], "n": 1, "max_new_tokens": 2, "run_id": run,
                "min_policy_version": 6}
        r = httpx.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=30)
        assert r.status_code == 503 and "waiting for run" in r.text, r.text
    finally:
        assert rollout.stop() == 0
        assert actor.stop() == 0


def test_with_a_token_the_actor_serves_only_workers_that_send_it(bootstrap, prefix, tmp_path):
    """http_token_file on both sides: a worker with a wrong token is refused (401) and holds its
    prompts (a credentials problem, not bad prompts: nothing dead-lettered); one with the right
    token gets every group; the actor's probes answer without a token."""
    import httpx

    token, wrong = tmp_path / "token", tmp_path / "wrong"
    token.write_text("right-token\n")
    wrong.write_text("wrong-token\n")
    port = free_port()
    prompts = [_prompt(i) for i in range(4)]
    produce_all(bootstrap, f"{prefix}rl.prompts", [(p.prompt_id, *codec.encode(p)) for p in prompts])
    actor = ServiceProc("actor", ["--bootstrap", bootstrap, "--topic-prefix", prefix, "--instance-id", "a0",
                                  "--actor.model", "tiny", "--actor.policy-root", str(tmp_path),
                                  "--metrics-port", str(port), "--http-token-file", str(token)],
                        tmp_path / "actor.log")

    def rollout(name, token_file):
        return ServiceProc("rollout", ["--bootstrap", bootstrap, "--topic-prefix", prefix, "--instance-id", name,
                                       "--rollout.actor-url", f"http://127.0.0.1:{port}",
                                       "--rollout.retry-backoff-s", "0.5", "--http-token-file", str(token_file)],
                           tmp_path / f"{name}.log")

    workers = []
    try:
        actor.wait_ready()
        assert httpx.get(f"{actor.url}/readyz").status_code == 200
        assert httpx.post(f"{actor.url}/generate", json={"prompts": [{"prompt_ids": [5]}]}).status_code == 401
        workers.append(rollout("r-wrong", wrong))
        workers[0].wait_ready()
        deadline = time.monotonic() + 60
        while "credentials (401" not in workers[0].log_path.read_text():
            assert time.monotonic() < deadline, "the worker with the wrong token was never refused"
            time.sleep(0.5)
        assert read_all(bootstrap, f"{prefix}rl.rollouts", expect=0, settle_s=0.5) == []
        assert read_all(bootstrap, f"{prefix}rl.dlq", expect=0, settle_s=0.5) == []
        assert workers.pop().stop() == 0   # its prompts go back to the group, uncommitted
        workers.append(rollout("r-right", token))
        groups = decode_all(read_all(bootstrap, f"{prefix}rl.rollouts", expect=4, timeout_s=120), RolloutGroup)
        assert sorted(g.prompt_id for g in groups) == sorted(p.prompt_id for p in prompts)
        assert read_all(bootstrap, f"{prefix}rl.dlq", expect=0, settle_s=0.5) == []
    finally:
        for w in workers:
            assert w.stop() == 0
        assert actor.stop() == 0
