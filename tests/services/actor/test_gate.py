"""The version gate (services/actor/gate.py) from a table: served state + call -> decision."""

import math

import pytest

from steadyrl.services.actor.gate import STATUS, Decision, Served, Wanted, decide, explain, verdict

A, B, C = "r20261129T100000-aaaa", "r20261129T110000-bbbb", "r20261129T120000-cccc"   # in start order
SERVE, WAIT, BEHIND, EARLIER = Decision.SERVE, Decision.WAIT, Decision.BEHIND, Decision.EARLIER_RUN
NOW = 100.0   # the call came at NOW (monotonic seconds)


def served(run=B, version=5, high_water=5, loading=None, quiet_since=-math.inf) -> Served:
    return Served(run, version, high_water, loading, quiet_since)


# (served state, (run_id, min_version) of the call, timed_out, decision)
DECIDE = [
    # a call naming no run takes any version, even while a later one loads
    (served(loading=(C, 0)), ("", 9), False, SERVE),
    # the served run at the served version, or one older: served
    (served(), (B, 5), False, SERVE),
    (served(), (B, 2), False, SERVE),
    # an earlier run than the served one: 409, whatever loads
    (served(loading=(C, 0)), (A, 0), False, EARLIER),
    # a later run, nothing loading: 503 at once
    (served(), (C, 0), False, BEHIND),
    # a later run that is being loaded: wait for it
    (served(loading=(C, 0)), (C, 0), False, WAIT),
    # the served run ahead while a later run loads: wait for it (then the call's run is earlier: 409)
    (served(loading=(C, 0)), (B, 7), False, WAIT),
    # the served run ahead, the very version loading: wait
    (served(loading=(B, 6)), (B, 6), False, WAIT),
    # the served run ahead, a newer version loading than asked: wait
    (served(loading=(B, 8)), (B, 6), False, WAIT),
    # the load would not be enough (6 < 7), and 7 is above the mark: 503 at once
    (served(loading=(B, 6)), (B, 7), False, BEHIND),
    # an earlier run loading does not serve a call of the served run: above the mark, 503
    (served(loading=(A, 9)), (B, 6), False, BEHIND),
    # a later run than the one loading: the load does not serve it, 503
    (served(loading=(B, 9)), (C, 0), False, BEHIND),
    # the served run ahead, above the mark, nothing loading: 503
    (served(high_water=6), (B, 7), False, BEHIND),
    # under the mark (a resumed learner), no empty poll of rl.policy yet: its record may come, wait
    (served(high_water=8), (B, 7), False, WAIT),
    # under the mark, the last empty poll began before the call came: still wait
    (served(high_water=8, quiet_since=NOW - 1), (B, 7), False, WAIT),
    # under the mark, an empty poll began when the call came: settled, served with 5
    (served(high_water=8, quiet_since=NOW), (B, 7), False, SERVE),
    # under the mark, settled after the call: served with 5
    (served(high_water=8, quiet_since=NOW + 1), (B, 8), False, SERVE),
    # at the mark while its version loads: waits for the load, not served with 5
    (served(high_water=8, quiet_since=NOW + 1, loading=(B, 6)), (B, 6), False, WAIT),
    # timed out waiting for a load: judged against the served version, 503
    (served(loading=(B, 6)), (B, 6), True, BEHIND),
    # timed out waiting for an empty poll under the mark: judged against the served version, 503
    (served(high_water=8), (B, 7), True, BEHIND),
    # timed out but nothing to wait for: the settled verdict, served
    (served(high_water=8, quiet_since=NOW), (B, 7), True, SERVE),
    # a later run waited for in vain: 503
    (served(loading=(C, 0)), (C, 0), True, BEHIND),
    # the base weights ("" / 0) and a call of any run: a later run, 503
    (served(run="", version=0, high_water=0), (A, 0), False, BEHIND),
    # the base weights while the first version loads: wait
    (served(run="", version=0, high_water=0, loading=(A, 1)), (A, 1), False, WAIT),
]


@pytest.mark.parametrize("state, call, timed_out, want", DECIDE)
def test_decide(state, call, timed_out, want):
    assert decide(state, Wanted(*call, since=NOW), timed_out) is want


# verdict: the answer under the generation lock, from the state then and whether the wait settled
VERDICT = [
    # no run named: served
    (served(), ("", 99), True, SERVE),
    # an earlier run: 409, settled or not
    (served(), (A, 0), True, EARLIER),
    (served(), (A, 0), False, EARLIER),
    # a later run: 503, settled or not
    (served(), (C, 0), True, BEHIND),
    (served(), (C, 0), False, BEHIND),
    # settled: judged against the mark, so a version under it is served with the served one
    (served(high_water=8), (B, 8), True, SERVE),
    (served(high_water=8), (B, 9), True, BEHIND),
    # not settled (the wait timed out): judged against the served version
    (served(high_water=8), (B, 6), False, BEHIND),
    (served(high_water=8), (B, 5), False, SERVE),
]


@pytest.mark.parametrize("state, call, settled, want", VERDICT)
def test_verdict(state, call, settled, want):
    assert verdict(state, Wanted(*call), settled) is want


def test_refusals_carry_their_status_and_the_messages_name_both_sides():
    s, w = served(), Wanted(C, 3)
    assert STATUS == {BEHIND: 503, EARLIER: 409}
    assert explain(BEHIND, s, w) == f"serving run {B!r} version 5; waiting for run {C!r} version >= 3"
    assert explain(EARLIER, s, Wanted(A, 0)) == f"prompt of run {A!r}, earlier than the served run {B!r}"
