"""The policy store: the learner writes each version's weights under `policy_root` and
announces them on rl.policy (like prime-rl's `broadcast/filesystem.py`). Layout and checks:
steadyrl/run/policy_files.py.

Version k is the weights after k steps (version 0: the initial ones). After each publish
the store prunes by `policy_files.prune`'s rule: the run's newest `keep_policies` versions
up to the current one stay (later ones are weights a crash threw away), the newest
`keep_earlier_runs` earlier runs keep their newest version, older runs go.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import Gauge

from steadyrl.model.models import state_dict_mismatch
from steadyrl.run import diskspace, policy_files
from steadyrl.run.checkpoint import CheckpointError
from steadyrl.run.tensors import refuse_nonfinite, unique_tensors
from steadyrl.wire.contracts import PolicyUpdate

from .outbox import Outbox
from .state import RunState

if TYPE_CHECKING:
    import torch

log = logging.getLogger("steadyrl.learner")

STEP = Gauge("steadyrl_learner_step", "Learner global step (= policy version published)")


class PolicyStore:
    """Writes, announces and reads back the run's policy versions under `root`."""

    def __init__(self, root: Path, outbox: Outbox, keep: int, keep_runs: int = 1):
        """`keep`: versions of the run kept (learner.keep_policies); `keep_runs`: earlier runs
        that keep their newest version (learner.keep_earlier_runs, whose default is 1)."""
        self.root, self.outbox, self.keep, self.keep_runs = root.resolve(), outbox, keep, keep_runs

    def publish(self, model: torch.nn.Module, st: RunState, announced: Callable[[], None] | None = None) -> None:
        """Write `model`'s weights as version `st.step` of run `st.run_id`, record its uri and
        sha256 in `st`, announce it on rl.policy (flushed, with the run's high-water mark:
        policy_files.raise_high_water), call `announced()` (the learner sends the next step's
        prompts there), fsync the version and prune older versions.

        Raises steadyrl.run.tensors.NonFiniteWeights, writing and announcing nothing, when a
        weight holds NaN or infinity (the trainer skips such steps: this never should).

        On a full disk (ENOSPC) the write is retried with backoff until space returns
        (steadyrl.run.diskspace.retry, writer `policy`: logged, counted, /readyz `disk`): nothing is
        announced meanwhile, the previous version stays the newest on disk and on rl.policy.

        The version is announced from the page cache and fsynced after (policy_files.sync_version):
        the actor reads and verifies it while the disk catches up, so the fsync is off the
        actor's path; this returns once the version is on disk, before the state naming it is
        saved. A power loss between the announcement and the fsync can leave the announced
        version torn: the actor refuses it by its sha256 and keeps serving the previous one,
        and the learner resumes from the state before it. A failed fsync (EIO) rewrites the
        version durably and announces it again."""
        rel = policy_files.version_dir(st.run_id, st.step)
        tensors = unique_tensors(model.state_dict())
        refuse_nonfinite(tensors, f"policy version {st.step} of run {st.run_id}")
        digest = diskspace.retry(lambda: policy_files.write_version(self.root, rel, tensors, durable=False),
                                 "policy", self.root / rel)
        st.policy_uri, st.policy_sha256 = str(rel), digest
        high_water = diskspace.retry(lambda: policy_files.raise_high_water(self.root, st.run_id, st.step),
                                     "policy", self.root / st.run_id / policy_files.HIGH_WATER)   # before prune
        update = PolicyUpdate(version=st.step, step=st.step, uri=st.policy_uri, sha256=st.policy_sha256,
                              run_id=st.run_id, high_water=high_water)
        self.outbox.produce("rl.policy", "policy", update)
        self.outbox.flush()
        if announced is not None:
            announced()
        try:
            policy_files.sync_version(self.root, rel)
        except OSError as e:
            log.warning("policy version could not be fsynced: writing it again", extra={
                "version": st.step, "error": str(e)})
            shutil.rmtree(self.root / rel, ignore_errors=True)   # its unwritten pages may be gone
            diskspace.retry(lambda: policy_files.write_version(self.root, rel, tensors), "policy", self.root / rel)
            self.outbox.produce("rl.policy", "policy", update)
            self.outbox.flush()
        gone = policy_files.prune(self.root, st.run_id, st.step, self.keep, self.keep_runs)
        if any(p.parent == self.root for p in gone):
            log.info("policy files of earlier runs pruned", extra={
                "runs": sorted(p.name for p in gone if p.parent == self.root)})
        STEP.set(st.step)
        log.info("policy published", extra={"version": st.step, "uri": str(rel)})

    def load(self, model: torch.nn.Module, st: RunState) -> None:
        """Load the version `st` names into `model`. Raises CheckpointError: the bytes are not
        what the state says, or they do not fit the model."""
        try:
            weights = policy_files.read_version(self.root, st.policy_uri, st.policy_sha256)
        except policy_files.PolicyRefused as e:
            raise CheckpointError(f"policy version {st.policy_uri} of run {st.run_id}: {e}") from None
        why = state_dict_mismatch(model, weights)
        if why:
            raise CheckpointError(f"{st.policy_uri}: weights do not fit the model: {why}")
        model.load_state_dict(weights, strict=False)
