"""A transactional stage killed with SIGKILL mid-batch and restarted: every input exactly once."""

import time

import pytest

from steadyrl.bus.topics import create_topics
from steadyrl.wire import codec
from steadyrl.wire.contracts import ScoredGroup
from tests.helpers import ServiceProc, decode_all, produce_all, read_all, rollout_group, unique_prefix

N = 200


def _worker(bootstrap, reward_server, prefix, log, batch_size):
    # 20 ms a sample: batches of 10 take 0.2 s (no pause), of 40 take 0.8 s (partitions
    # paused while polling goes on), so both paths are killed mid-batch.
    return ServiceProc("reward", ["--bootstrap", bootstrap, "--topic-prefix", prefix, "--instance-id", "eos0",
                                  "--reward.server-url", reward_server, "--reward.scorer", "tests.helpers:slow_numeric",
                                  "--reward.batch-size", str(batch_size), "--metrics-interval", "1"], log)


@pytest.mark.slow
@pytest.mark.parametrize("round_", range(10))
def test_sigkill_mid_batch_then_restart_yields_each_input_once(bootstrap, reward_server, tmp_path, round_):
    prefix = unique_prefix()
    create_topics(bootstrap, prefix)
    groups = [rollout_group(i) for i in range(N)]
    produce_all(bootstrap, f"{prefix}rl.rollouts", [(g.prompt_id, *codec.encode(g)) for g in groups])

    batch_size = 10 if round_ % 2 == 0 else 40
    first = _worker(bootstrap, reward_server, prefix, tmp_path / "first.log", batch_size)
    try:
        # Kill while a batch is being transformed, after 1 or 2 commits.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            committed = first.metric("steadyrl_stage_transactions_total", {"result": "committed"}) or 0
            busy = first.metric("steadyrl_stage_busy") or 0
            if committed >= round_ % 2 + 1 and busy == 1:
                break
            time.sleep(0.01)
        else:
            pytest.fail("the worker never got mid-batch")
    finally:
        first.kill()  # SIGKILL: the point of the test, and no leftover process if it failed
    assert committed < N / batch_size, "killed too late: the whole input was already done"

    second = _worker(bootstrap, reward_server, prefix, tmp_path / "second.log", batch_size)
    try:
        scored = decode_all(read_all(bootstrap, f"{prefix}rl.scored", expect=N, timeout_s=90), ScoredGroup)
    finally:
        assert second.stop() == 0
    ids = [s.prompt_id for s in scored]
    assert len(ids) == N, f"{len(ids)} outputs for {N} inputs ({len(ids) - len(set(ids))} duplicates)"
    assert set(ids) == {g.prompt_id for g in groups}
    assert read_all(bootstrap, f"{prefix}rl.dlq", expect=0, settle_s=0.5) == []
