"""steadyrl/local/placement.py: the default share of the machine, explicit overrides, bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from steadyrl.local import placement
from steadyrl.local.placement import Placement, ServicePlacement, default_placement, format_cpus, parse_cpus, resolve
from tests.helpers import ROOT

TWO, EIGHT = frozenset({0, 1}), frozenset(range(8))


def test_cpu_lists_round_trip_and_refuse_nonsense():
    assert parse_cpus("0-3,6") == {0, 1, 2, 3, 6}
    assert format_cpus({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    for bad in ("", "a", "3-1", "1-x"):
        with pytest.raises(ValueError):
            parse_cpus(bad)
    with pytest.raises(ValidationError):
        ServicePlacement(cpus="2-1")


def test_staleness_0_leaves_actor_and_learner_unlimited_and_light_services_one_thread():
    d = default_placement(EIGHT, max_staleness=0)
    assert d["learner"] == ServicePlacement() and d["actor"] == ServicePlacement()
    assert all(d[s].threads == 1 and d[s].cpus is None for s in ("rollout", "reward", "reward_server"))


@pytest.mark.parametrize("cpus, learner, actor", [(TWO, ("0", 1), ("1", 1)), (EIGHT, ("0-3", 4), ("4-7", 4)),
                                                   (frozenset({0, 2, 4}), ("0,2", 2), ("4", 1))])
def test_async_splits_the_cores_between_learner_and_actor_disjointly(cpus, learner, actor):
    d = default_placement(cpus, max_staleness=2)
    assert (d["learner"].cpus, d["learner"].threads) == learner
    assert (d["actor"].cpus, d["actor"].threads) == actor
    assert not parse_cpus(d["learner"].cpus) & parse_cpus(d["actor"].cpus)
    # services that run at once never ask for more threads than there are cores
    assert d["learner"].threads + d["actor"].threads <= len(cpus)


def test_one_cpu_async_gives_each_one_thread():
    d = default_placement(frozenset({0}), max_staleness=1)
    assert d["learner"].threads == d["actor"].threads == 1 and d["actor"].cpus is None


def test_gpus_two_or_more_give_the_actor_its_own():
    d = default_placement(EIGHT, 1, gpus=4)
    assert d["actor"].devices == "0" and d["learner"].devices == "1,2,3"
    assert default_placement(EIGHT, 1, gpus=1)["actor"].devices is None


def test_explicit_fields_replace_only_themselves_and_foreign_cpus_are_refused():
    got = resolve(Placement(learner=ServicePlacement(threads=3)), EIGHT, 2)
    assert got["learner"].threads == 3 and got["learner"].cpus == "0-3"  # cpus stays the default
    with pytest.raises(ValueError, match="placement.actor.cpus 9"):
        resolve(Placement(actor=ServicePlacement(cpus="9")), EIGHT, 0)
    with pytest.raises(ValidationError):
        Placement.model_validate({"learnr": {"threads": 1}})


def test_child_env_sets_every_thread_variable():
    env = placement.child_env(ServicePlacement(threads=2, devices="1"))
    assert env == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "2",
                   "CUDA_VISIBLE_DEVICES": "1"}
    assert placement.child_env(ServicePlacement()) == {}


@pytest.mark.parametrize("text, field", [
    ("placement:\n  learner:\n    threads: 0\n", "placement.learner.threads"),
    ("learner:\n  world_size: two\n", "learner.world_size"),  # up reads it for the placement
])
def test_up_refuses_a_bad_setting_naming_the_field(tmp_path, text, field):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    r = subprocess.run([sys.executable, "-m", "steadyrl.cli", "up", "--config", str(cfg), "--bootstrap", "127.0.0.1:1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and field in r.stderr, r.stderr


@pytest.mark.parametrize("cpus, staleness, learner, actor", [
    (frozenset({0, 1}), 1, ("1", "0"), ("1", "1")),        # no core to spare: 2 ranks x 1 thread on one core
    (frozenset(range(4)), 1, ("1", "0-1"), ("2", "2-3")),    # 2 ranks, 1 thread each, on 2 cores
    (frozenset(range(8)), 2, ("2", "0-3"), ("4", "4-7")),
    (frozenset(range(8)), 0, ("4", None), (None, None)),     # turns: the ranks divide every core
])
def test_the_learners_threads_are_per_rank(cpus, staleness, learner, actor):
    """2 learner ranks: each rank's threads are its share of the learner's cores (torchrun gives
    each rank OMP_NUM_THREADS), so the two never ask for more threads than the learner has cores."""
    d = default_placement(cpus, staleness, learner_ranks=2)
    assert (str(d["learner"].threads), d["learner"].cpus) == learner
    assert (None if d["actor"].threads is None else str(d["actor"].threads), d["actor"].cpus) == actor


def test_four_ranks_take_the_cores_the_actor_can_spare():
    d = default_placement(frozenset(range(6)), 1, learner_ranks=4)
    assert (d["learner"].threads, d["learner"].cpus, d["actor"].threads, d["actor"].cpus) == (1, "0-3", 2, "4-5")



def test_an_odd_core_goes_to_the_actor_not_idle_beside_the_ranks():
    d = default_placement(frozenset(range(5)), 1, learner_ranks=2)
    assert (d["learner"].threads, d["learner"].cpus, d["actor"].threads, d["actor"].cpus) == (1, "0-1", 3, "2-4")
