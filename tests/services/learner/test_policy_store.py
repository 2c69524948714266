"""The policy store on the tiny model: what it announces is what the actor's run check accepts,
and each publish prunes by policy_files.prune's rule (earlier runs too)."""

import shutil
from pathlib import Path

from services.learner.policy_store import PolicyStore
from services.learner.state import RunState, new_run_id
from steadyrl import policy_files
from steadyrl.models import load_policy
from tests.services.learner.conftest import FakeOutbox

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "run-4bba081"
OLD = "r20261201T075848-5c73"   # the fixture's run (main at 4bba081: legacy one-file versions)


def test_the_learners_run_ids_are_what_prune_recognises():
    assert policy_files.RUN_ID.fullmatch(new_run_id())


def test_a_new_runs_first_publish_prunes_earlier_runs_and_is_accepted_by_the_run_check(tmp_path):
    root = tmp_path / "policies"
    shutil.copytree(FIXTURE / "policies", root)
    older = "r20261130T000000-0000"
    (root / older / "v000004").mkdir(parents=True)
    (root / OLD / "v000005.safetensors").write_bytes(b"x")
    model, _ = load_policy("tiny", seed=0)
    outbox = FakeOutbox()
    st = RunState(run_id="r20261202T000000-beef")
    store = PolicyStore(root, outbox, keep=2, keep_runs=1)
    store.publish(model, st)   # version 0, at the run's start
    (_, upd), = outbox.on("rl.policy")
    assert (upd.run_id, upd.version, upd.uri) == (st.run_id, 0, f"{st.run_id}/v000000")
    assert policy_files.check_run(root, upd.uri, upd.run_id, upd.version) == (root / upd.uri).resolve()
    assert not (root / older).exists()                                  # beyond keep_runs: deleted whole
    assert [p.name for p in (root / OLD).iterdir()] == ["v000006.safetensors"]   # its newest only
    for step in (1, 2, 3):
        st.step = step
        store.publish(model, st)
    assert sorted(p.name for p in (root / st.run_id).iterdir()) == ["v000002", "v000003"]


def test_a_run_of_4bba081_resumed_publishes_beside_its_legacy_file(tmp_path):
    """The resumed run's first publish writes the version again as a folder; the legacy file
    of the same version stays (a record on the compacted topic may still name it), and the
    actor's run check accepts both records."""
    root = tmp_path / "policies"
    shutil.copytree(FIXTURE / "policies", root)
    model, _ = load_policy("tiny", seed=0)
    store = PolicyStore(root, FakeOutbox(), keep=3)
    store.publish(model, RunState(run_id=OLD, step=6))
    assert sorted(p.name for p in (root / OLD).iterdir()) == ["v000006", "v000006.safetensors"]
    for uri in (f"{OLD}/v000006", f"{OLD}/v000006.safetensors"):
        policy_files.check_run(root, uri, OLD, 6)
