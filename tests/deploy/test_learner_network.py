"""The compose learner's rank group (issue 34): on a network only the learner joins, internal,
and its address left at loopback (steadyrl.rl.distributed.ranks_host)."""

from tests.deploy.test_deploy_static import compose_raw, compose_services


def test_only_the_learner_joins_the_learner_ranks_network_and_it_is_internal():
    assert compose_raw()["networks"]["learner-ranks"] == {"internal": True}
    on = [name for name, svc in compose_services().items() if "learner-ranks" in (svc.get("networks") or [])]
    assert on == ["learner"]
    learner = compose_services()["learner"]
    assert "default" in learner["networks"]   # Kafka and Prometheus are there
    env = learner.get("environment") or {}
    assert "STEADYRL_RANKS_HOST" not in env   # loopback: the ranks share one container
