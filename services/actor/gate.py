"""The actor's version gate: whether a /generate call is served now, waits, or is refused.

A pure decision (no threads, clocks or I/O) over what the actor serves (`Served`) and what the
call asks for (`Wanted`). The follower (follower.py) evaluates `decide` under its condition
variable while a call waits; the route evaluates `verdict` under the generation lock, so the
version it answers with is the one that generates.

Terms:

- served run / version: the weights generating now; "" and 0 are the base weights. Run ids sort
  in start order (policy_files.new_run_id).
- high-water mark: the highest version of the served run any learner wrote (>= version). A
  version in (version, high_water] was written and then thrown away by a crash (the learner
  resumed from an earlier checkpoint and redoes the steps since), or is the resumed learner's
  next version whose record is on its way.
- loading: the (run, version) the follower is reading and verifying now, else None.
- quiet_since: monotonic time (seconds) at which the follower began its newest poll of
  rl.policy that returned no record; -inf before the first.
- a call is *ahead* when it names a run later than the served one, or the served run and a
  `min_version` above the served version. A call naming no run ("") takes any version.

Decisions (`decide`):

- SERVE: generate with the served weights.
- WAIT: ahead, and either the version loading satisfies the call, or the call is for the served
  run with `min_version` at most the mark and no empty poll of rl.policy began after the call
  came (`Wanted.since`): its version's record may be on its way (a learner flushes a version's
  record before it stamps prompts with it). The caller re-decides when the state changes, and
  gives up after a timeout.
- BEHIND (HTTP 503, retry soon): the served run is earlier than the call's, or the version
  judged against is below `min_version`. The version judged against is the high-water mark once
  the wait settled (a thrown-away version is served with the served weights; the learner's
  staleness rule judges the group), the served version when it timed out.
- EARLIER_RUN (HTTP 409): the call names a run earlier than the served one; it never will be
  served.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class Decision(enum.Enum):
    SERVE = "serve"
    WAIT = "wait"
    BEHIND = "behind"
    EARLIER_RUN = "earlier_run"


#: HTTP status of each refusal.
STATUS = {Decision.BEHIND: 503, Decision.EARLIER_RUN: 409}


@dataclass(frozen=True)
class Served:
    """What the actor serves and is doing (see the module doc for each term)."""

    run_id: str = ""
    version: int = 0
    high_water: int = 0
    loading: tuple[str, int] | None = None
    quiet_since: float = -math.inf


@dataclass(frozen=True)
class Wanted:
    """What a call accepts: versions >= `min_version` of run `run_id` ("": any); `since`: the
    monotonic time (seconds) the call began waiting."""

    run_id: str
    min_version: int
    since: float = 0.0


def _ahead(s: Served, w: Wanted) -> bool:
    """The call names a later run, or the served run and a version above the served one."""
    return bool(w.run_id) and (w.run_id > s.run_id or (w.run_id == s.run_id and s.version < w.min_version))


def must_wait(s: Served, w: Wanted) -> bool:
    """True while the call should wait for the follower (the WAIT rule of the module doc).

    Measured against the served version, not the mark: a resumed learner's call for the version
    being read waits for it rather than taking the one before."""
    if not _ahead(s, w):
        return False
    if s.loading is not None:
        run, version = s.loading
        if run > w.run_id or (run == w.run_id and version >= w.min_version):
            return True
    return w.run_id == s.run_id and w.min_version <= s.high_water and s.quiet_since < w.since


def verdict(s: Served, w: Wanted, settled: bool = True) -> Decision:
    """SERVE, BEHIND or EARLIER_RUN for the call now. `settled`: its wait ended without a
    timeout (judge against the high-water mark), else judge against the served version."""
    if not w.run_id:
        return Decision.SERVE
    if w.run_id < s.run_id:
        return Decision.EARLIER_RUN
    if w.run_id > s.run_id or (s.high_water if settled else s.version) < w.min_version:
        return Decision.BEHIND
    return Decision.SERVE


def decide(s: Served, w: Wanted, timed_out: bool = False) -> Decision:
    """The call's decision in state `s`: WAIT while it must wait and has not `timed_out`, else
    `verdict` (settled unless it had to wait)."""
    wait = must_wait(s, w)
    if wait and not timed_out:
        return Decision.WAIT
    return verdict(s, w, settled=not wait)


def explain(d: Decision, s: Served, w: Wanted) -> str:
    """The HTTP detail of refusal `d` (BEHIND or EARLIER_RUN)."""
    if d is Decision.EARLIER_RUN:
        return f"prompt of run {w.run_id!r}, earlier than the served run {s.run_id!r}"
    return f"serving run {s.run_id!r} version {s.version}; waiting for run {w.run_id!r} version >= {w.min_version}"
