"""Which run the learner continues, and from what.

Files live in `<state_dir>/<run_id>/`; `<state_dir>/CURRENT` names the run in progress.

    learner.resume = auto     CURRENT names an unfinished run with the same fingerprint:
                              continue it from its newest valid checkpoint (or, before the
                              first one, from the policy store's weights); else a new run
    learner.resume = never    always a new run
    learner.resume = <folder> that checkpoint; it must verify and match (else ConfigError)

With `learner.checkpoint_key_file` set, every checkpoint resumed from must carry a signature
made with that key (steadyrl/run/checkpoint.py, "Signing"): an unsigned or foreign one is refused
as a broken one is (`auto` falls back to an older signed one, else stops naming why). Format
3's pickled metadata is read through an allow-list either way (never executed).

The fingerprint is what a run cannot change on resume: the learner section's
(`LearnerSection.fingerprint`), the topic prefix and the id of rl.scored (its offsets point
into that topic: the id differs between prefixes, clusters and re-creations).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Protocol

from steadyrl.config import ConfigError
from steadyrl.files import read_step_lines, write_atomic
from steadyrl.run import checkpoint as ck
from steadyrl.run import policy_files, signing

from .state import RunState, StateError

log = logging.getLogger("steadyrl.learner")


class Restorer(Protocol):
    """Puts saved weights into the live model and trainer."""

    def from_checkpoint(self, path: Path) -> RunState:
        """Weights, optimizer, LR schedule and RNG of a verified checkpoint; its run state."""

    def from_policy(self, st: RunState) -> None:
        """The weights `st` names in the policy store (a run with no checkpoint yet)."""


def recorded(want: dict[str, Any], saved: dict[str, Any], what: str) -> dict[str, Any]:
    """`want` without the keys `saved` lacks: a run or checkpoint written before a key joined
    the fingerprint resumes (with a warning) instead of being abandoned."""
    missing = sorted(k for k in want if k not in saved)
    if missing:
        log.warning("saved by an older version: these were not recorded, so not checked",
                    extra={"run": what, "not_recorded": missing})
    return {k: v for k, v in want.items() if k in saved}


#: learner.train settings the optimizer's state holds (AdamW's param groups, LambdaLR's base
#: lrs): a resume from a checkpoint restores them with it, so the saved values stay in effect
OPTIMIZER_HELD = ("lr", "weight_decay")


def settings_changed(st: RunState, now: dict[str, Any], from_checkpoint: bool) -> dict[str, str]:
    """The learner.train settings (`now`, `TrainConfig.model_dump(mode="json")`) a continued run
    `st` changes: {name: "saved -> now"}, logged as a warning (a resume may switch `autocast`,
    and with it the log-probs' numerics, without starting a new run; before, it did so
    silently). `lr` and `weight_decay` changed on a resume `from_checkpoint` are named "not
    applied": the checkpoint's optimizer state brings the saved values back (from the policy
    store, with no checkpoint yet, the optimizer starts from `now`). Records in `st.train` what
    is in effect. A state written before `train` was recorded ({}) changes nothing that could
    be named."""
    changed: dict[str, str] = {}
    effective = dict(now)
    for k, v in now.items() if st.train else ():
        if k not in st.train:
            changed[k] = f"(not set) -> {v!r}"
        elif st.train[k] != v and from_checkpoint and k in OPTIMIZER_HELD:
            changed[k] = f"{st.train[k]!r} -> {v!r} not applied: the checkpoint's optimizer state keeps {st.train[k]!r}"
            effective[k] = st.train[k]
        elif st.train[k] != v:
            changed[k] = f"{st.train[k]!r} -> {v!r}"
    if changed:
        log.warning("resumed with changed training settings",
                    extra={"run_id": st.run_id, "step": st.step, "changed": changed})
    st.train = effective
    return changed


def open_run(state_dir: Path, resume: str, fingerprint: dict[str, Any], restorer: Restorer,
             policy_root: Path | None = None, key: bytes | None = None) -> RunState:
    """The run to continue, or a new one (see the module doc); CURRENT names it afterwards.

    A new run's id sorts after every run under `state_dir` and `policy_root` whatever the
    clock says (policy_files.new_run_id): the actor would refuse the policy of a run whose id
    sorts before the one it serves, and answer its prompts 409.

    `key`: the checkpoint signing key (steadyrl.run.signing.read_key), or None (signatures not
    checked).

    Raises ConfigError (exit 2: a restart would fail the same way), naming the cause and what
    to do, when an explicit `resume` checkpoint does not verify (with `key`: is not signed with
    it), does not match or does not load; when the run to continue cannot be: its saved state
    cannot be read (StateError), every checkpoint of it is broken, or none is signed with `key`
    (the signing key changed), or its weights (a run with no checkpoint yet) are refused; or
    when no new run id can sort after a run present.
    """
    current = state_dir / "CURRENT"
    if resume not in ("auto", "never"):
        path = Path(resume)
        try:
            saved = ck.verify(path, key=key).get("config", {})
        except ck.CheckpointError as e:
            raise ConfigError(f"learner.resume: {e}") from None
        for k, v in recorded(fingerprint, saved, str(path)).items():
            if saved[k] != v:
                raise ConfigError(f"learner.resume: {path}: {k} mismatch: expected {v!r}, got {saved[k]!r}")
        try:
            st = restorer.from_checkpoint(path)
        except (ck.CheckpointError, StateError) as e:
            raise ConfigError(f"learner.resume: {e}") from None
        st.config = fingerprint
        write_atomic(current, st.run_id + "\n")
        return st
    if resume == "auto" and current.exists():
        run = current.read_text().strip()
        try:
            resumed = _continue(state_dir / run, fingerprint, restorer, key)
        except (ck.CheckpointError, StateError) as e:
            raise cannot_continue(run, e, key) from None
        if resumed is not None:
            return resumed
    places = [state_dir] + ([policy_root] if policy_root is not None else [])
    st = RunState(run_id=policy_files.new_run_id(*places), config=fingerprint)
    write_atomic(current, st.run_id + "\n")
    return st


def cannot_continue(run: str, e: Exception, key: bytes | None) -> ConfigError:
    """The ConfigError (exit 2) for an unfinished run `run` that cannot be continued because of
    `e`: what is wrong, its likely cause (a changed signing key when every checkpoint was
    refused for its signature) and the ways on."""
    lines = str(e).splitlines()
    refused = [line for line in lines[1:] if line.strip()] or lines
    if key is not None and isinstance(e, ck.CheckpointError) and all(signing.SIGNATURE in line for line in refused):
        cause = ("every checkpoint was refused for its signature: learner.checkpoint_key_file is not the key they "
                 "were signed with (the key changed), or they were written without one; give the run's key back")
    elif isinstance(e, StateError):
        cause = "its saved state cannot be read by this version"
    else:
        cause = "no checkpoint of it can be used"
    return ConfigError(f"learner: cannot continue run {run} ({cause}): {e}\n"
                       f"A restart would fail the same way. To go on: restore a good checkpoint or the run's files, "
                       f"give learner.resume a checkpoint folder to start from, or set learner.resume: never to "
                       f"start a new run (the unfinished one is kept).")


def _continue(run_dir: Path, fingerprint: dict[str, Any], restorer: Restorer, key: bytes | None = None
              ) -> RunState | None:
    """The unfinished run in `run_dir` if its fingerprint matches; None: start a new run."""
    path = run_dir / "state.json"
    if not path.exists():
        return None
    st = RunState.parse(path.read_text(), str(path))
    if st.finished:
        return None
    check = recorded(fingerprint, st.config, st.run_id)
    changed = {k: f"{st.config.get(k)!r} -> {v!r}" for k, v in check.items() if st.config.get(k) != v}
    if changed:
        log.warning("not resuming the unfinished run: its configuration differs; starting a new run",
                    extra={"run_id": st.run_id, "step": st.step, "changed": changed})
        return None
    found = ck.latest_valid(run_dir / "checkpoints", check, key)  # raises if all are broken (or unsigned)
    if found is not None:
        st = restorer.from_checkpoint(found)  # latest_valid verified it
    else:
        restorer.from_policy(st)
        log.warning("resuming run without a checkpoint yet", extra={
            "run_id": st.run_id, "step": st.step, "note": "optimizer moments restart from zero"})
    st.config = fingerprint  # records now what an older version did not
    return st


def trim_audit(run_dir: Path, step: int) -> None:
    """Drop audit lines (consumed.jsonl) of steps after `step`, the saved state's (a crash
    between the two writes), and a line a crash cut short: those groups are re-read from the
    saved offsets and trained again."""
    path = run_dir / "consumed.jsonl"
    rows, lines = read_step_lines(path)
    keep = [row for row in rows if row["step"] <= step]
    if len(keep) != lines:
        log.warning("audit log trimmed to the saved step", extra={"step": step, "dropped": lines - len(keep)})
        write_atomic(path, "".join(json.dumps(row) + "\n" for row in keep))


def trim_history(run_dir: Path, st: RunState) -> None:
    """Load the run's per-step history into `st.history` from history.jsonl, keeping the rows
    of steps <= st.step (a resume from an older checkpoint, or a crash between the row's append
    and the state's save; the last row of a step wins) and rewriting the file when it dropped
    any. A run written before history.jsonl kept its history in state.json (and each
    checkpoint's meta): that history, already in `st.history`, is written to the file."""
    path = run_dir / "history.jsonl"
    if not path.exists():
        if st.history:
            write_atomic(path, "".join(json.dumps(row) + "\n" for row in st.history if row["step"] <= st.step))
            log.info("history moved from state.json to history.jsonl", extra={"rows": len(st.history)})
        st.history = [row for row in st.history if row["step"] <= st.step]
        return
    rows, lines = read_step_lines(path)
    by_step = {row["step"]: row for row in rows if row["step"] <= st.step}
    st.history = [by_step[k] for k in sorted(by_step)]
    if len(st.history) != lines:
        write_atomic(path, "".join(json.dumps(row) + "\n" for row in st.history))
