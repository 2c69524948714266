"""What a group read becomes (services/learner/arrival.py) from a table: facts -> decision."""

import pytest

from steadyrl.run.runfolder import Count
from steadyrl.services.learner.arrival import COUNTS, DEAD_LETTERED, Facts, Outcome, decide
from steadyrl.wire.contracts import DLQReason

ACCEPTED, RELEASED, RELEASED_IN_FLIGHT = Outcome.ACCEPTED, Outcome.RELEASED, Outcome.RELEASED_IN_FLIGHT
DUPLICATE, FOREIGN = Outcome.DUPLICATE, Outcome.FOREIGN
DIFFERS, INVALID = Outcome.PROMPT_DIFFERS, Outcome.INVALID_TOKENS


def facts(ours=True, on_releases=False, in_flight=True, released=False, held=False, waiting=False) -> Facts:
    return Facts(ours, on_releases, in_flight, released, held, waiting)


# (facts, differs, invalid, outcome, takes)
TABLE = [
    # one of ours in flight, not waiting: it waits for an update
    (facts(), None, None, ACCEPTED, True),
    # another run's: foreign, whatever else holds (never checked: not taken)
    (facts(ours=False), None, None, FOREIGN, False),
    (facts(ours=False, on_releases=True, held=True), None, None, FOREIGN, False),
    # a second copy while the first waits: duplicate, not checked
    (facts(waiting=True), None, None, DUPLICATE, False),
    # trained already (not in flight): duplicate
    (facts(in_flight=False), None, None, DUPLICATE, False),
    # a held group read again on rl.scored: duplicate (it stays held)
    (facts(in_flight=False, held=True), None, None, DUPLICATE, False),
    # on rl.releases, held: released
    (facts(on_releases=True, in_flight=False, held=True), None, None, RELEASED, True),
    # on rl.releases, in flight and not released yet (resumed from before the hold): replaces it
    (facts(on_releases=True), None, None, RELEASED_IN_FLIGHT, True),
    # ... even while the original waits in the buffer
    (facts(on_releases=True, waiting=True), None, None, RELEASED_IN_FLIGHT, True),
    # on rl.releases, in flight and released already: read as any group of ours
    (facts(on_releases=True, released=True), None, None, ACCEPTED, True),
    (facts(on_releases=True, released=True, waiting=True), None, None, DUPLICATE, False),
    # on rl.releases, neither held nor in flight: duplicate
    (facts(on_releases=True, in_flight=False), None, None, DUPLICATE, False),
    # a prompt rewritten by a stage: refused before anything else of ours
    (facts(), "ground_truth", None, DIFFERS, True),
    (facts(on_releases=True, in_flight=False, held=True), "messages", None, DIFFERS, True),
    # token ids the model cannot take: refused (a released copy too: it stays held)
    (facts(), None, "prompt_token_ids is empty", INVALID, True),
    (facts(on_releases=True, in_flight=False, held=True), None, "samples[0] too long", INVALID, True),
    # both wrong: the prompt first
    (facts(), "messages", "prompt_token_ids is empty", DIFFERS, True),
]


@pytest.mark.parametrize(("f", "differs", "invalid", "outcome", "takes"), TABLE)
def test_decide(f, differs, invalid, outcome, takes):
    assert f.takes is takes
    d = decide(f, differs, invalid)
    assert d.outcome is outcome
    if outcome is DIFFERS:
        assert d.why == f"prompt {differs} differs from the one published"
    elif outcome is INVALID:
        assert d.why == invalid
    else:
        assert d.why == ""


def test_every_outcome_but_accepted_is_counted_and_refusals_go_to_the_dlq():
    assert set(COUNTS) == set(Outcome) - {ACCEPTED}
    assert {COUNTS[o] for o in (Outcome.REJECTED, DIFFERS, INVALID)} == {Count.rejected}
    assert {DIFFERS: DLQReason.rejected, INVALID: DLQReason.invalid_tokens} == DEAD_LETTERED
    assert all(COUNTS[o].value == o.value for o in (RELEASED, RELEASED_IN_FLIGHT, DUPLICATE, FOREIGN))
