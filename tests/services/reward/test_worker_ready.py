"""The reward worker's /readyz is not ready while its stage is being built (bench/recovery.py
saw a restarted worker answer 200 before its consumer existed, 6 s before it had partitions)."""

from steadyrl.http import Health


def test_readyz_fails_until_the_stage_checks_exist_and_pass(monkeypatch):
    from steadyrl.services.reward import worker

    seen, real = {}, worker.Stage

    def stage(**kw):
        seen["ready_while_building"] = kw["health"].ready()
        return real(**kw)

    monkeypatch.setattr(worker, "Stage", stage)
    monkeypatch.setattr(worker, "run_service", lambda name, cfg, build, **kw: seen.setdefault("build", build) and 0)
    worker.main(["--bootstrap", "127.0.0.1:1", "--reward.server-url", "http://127.0.0.1:1"])
    health = Health()
    st = seen["build"](health)
    try:
        assert seen["ready_while_building"] == (False, {}), seen["ready_while_building"]
        ok, checks = health.ready()
        assert not ok and set(checks) == {"assignment", "broker", "reward_server"}
        assert checks["assignment"] == {"ok": False, "detail": "0 partitions of rl.rollouts assigned"}
    finally:
        st.close()
