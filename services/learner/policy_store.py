"""The policy store: the learner writes each version's weights under `policy_root` and
announces them on rl.policy (like prime-rl's `broadcast/filesystem.py`). Layout and checks:
steadyrl/policy_files.py.

Version k is the weights after k steps (version 0: the initial ones). The newest
`keep_policies` versions of a run stay; versions after the current one are weights a crash
threw away (the learner resumed from an earlier checkpoint) and are removed.
"""

from __future__ import annotations

import logging
from pathlib import Path

from prometheus_client import Gauge

from services.learner.outbox import Outbox
from services.learner.state import RunState
from steadyrl import policy_files
from steadyrl.checkpoint import CheckpointError, refuse_nonfinite, unique_tensors
from steadyrl.contracts import PolicyUpdate
from steadyrl.models import state_dict_mismatch

log = logging.getLogger("steadyrl.learner")

STEP = Gauge("steadyrl_learner_step", "Learner global step (= policy version published)")


class PolicyStore:
    """Writes, announces and reads back the run's policy versions under `root`."""

    def __init__(self, root: Path, outbox: Outbox, keep: int):
        self.root, self.outbox, self.keep = root.resolve(), outbox, keep

    def publish(self, model, st: RunState) -> None:
        """Write `model`'s weights as version `st.step` of run `st.run_id`, record its uri and
        sha256 in `st`, announce it on rl.policy (flushed) and prune older versions.

        Raises steadyrl.checkpoint.NonFiniteWeights, writing and announcing nothing, when a
        weight holds NaN or infinity (the trainer skips such steps: this never should)."""
        rel = policy_files.version_dir(st.run_id, st.step)
        tensors = unique_tensors(model.state_dict())
        refuse_nonfinite(tensors, f"policy version {st.step} of run {st.run_id}")
        digest = policy_files.write_version(self.root, rel, tensors)
        st.policy_uri, st.policy_sha256 = str(rel), digest
        self.outbox.produce("rl.policy", "policy", PolicyUpdate(
            version=st.step, step=st.step, uri=st.policy_uri, sha256=st.policy_sha256, run_id=st.run_id))
        self.outbox.flush()
        policy_files.prune(self.root / st.run_id, st.step, self.keep)
        STEP.set(st.step)
        log.info("policy published", extra={"version": st.step, "uri": str(rel)})

    def load(self, model, st: RunState) -> None:
        """Load the version `st` names into `model`. Raises RuntimeError (the bytes are not
        what the state says) or CheckpointError (they do not fit the model)."""
        try:
            weights = policy_files.read_version(self.root, st.policy_uri, st.policy_sha256)
        except policy_files.PolicyRefused as e:
            raise RuntimeError(f"cannot resume run {st.run_id}: {e}") from None
        why = state_dict_mismatch(model, weights)
        if why:
            raise CheckpointError(f"{st.policy_uri}: weights do not fit the model: {why}")
        model.load_state_dict(weights, strict=False)
