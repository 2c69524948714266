"""The policy store on the tiny model: what it announces is what the actor's run check accepts,
and each publish prunes by policy_files.prune's rule (earlier runs too)."""

import shutil
from pathlib import Path

from steadyrl.model.models import load_policy
from steadyrl.run import policy_files
from steadyrl.services.learner.policy_store import PolicyStore
from steadyrl.services.learner.state import RunState
from tests.services.learner.conftest import FakeOutbox

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "run-4bba081"
OLD = "r20261201T075848-5c73"   # the fixture's run (main at 4bba081: legacy one-file versions)


def test_the_learners_run_ids_are_what_prune_recognises():
    assert policy_files.RUN_ID.fullmatch(policy_files.new_run_id())


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
    assert sorted(p.name for p in (root / st.run_id).iterdir()) == ["high_water", "v000002", "v000003"]


def test_a_run_of_4bba081_resumed_publishes_beside_its_legacy_file(tmp_path):
    """The resumed run's first publish writes the version again as a folder; the legacy file
    of the same version stays (a record on the compacted topic may still name it), and the
    actor's run check accepts both records."""
    root = tmp_path / "policies"
    shutil.copytree(FIXTURE / "policies", root)
    model, _ = load_policy("tiny", seed=0)
    store = PolicyStore(root, FakeOutbox(), keep=3)
    store.publish(model, RunState(run_id=OLD, step=6))
    assert sorted(p.name for p in (root / OLD).iterdir()) == ["high_water", "v000006", "v000006.safetensors"]
    for uri in (f"{OLD}/v000006", f"{OLD}/v000006.safetensors"):
        policy_files.check_run(root, uri, OLD, 6)


def test_a_resumed_learners_records_carry_the_version_its_predecessor_reached(tmp_path):
    """Regression (compose-test stall): a learner killed after publishing version 5 and
    stamping prompts with it, resumed from the checkpoint at step 2, prunes versions 3-5 at its
    first publish; its records still name 5 as the run's high-water mark, also those of a
    second resumed learner (the folders are gone by then: the mark is in `high_water`), until
    the run passes it. The actor serves prompts stamped up to the mark (Actor.check_version)."""
    root = tmp_path / "policies"
    model, _ = load_policy("tiny", seed=0)
    run = "r20261203T000000-beef"
    dead = PolicyStore(root, FakeOutbox(), keep=2)
    for step in range(6):
        dead.publish(model, RunState(run_id=run, step=step))
    marks = []
    for _ in range(2):   # the resumed learner, then one resumed again from the same checkpoint
        outbox = FakeOutbox()
        resumed = PolicyStore(root, outbox, keep=2)
        for step in (2, 3):
            resumed.publish(model, RunState(run_id=run, step=step))
        marks.append([(upd.version, upd.high_water) for _, upd in outbox.on("rl.policy")])
    assert marks == [[(2, 5), (3, 5)]] * 2
    assert sorted(p.name for p in (root / run).iterdir()) == ["high_water", "v000002", "v000003"]
    outbox = FakeOutbox()
    for step in (5, 6):
        PolicyStore(root, outbox, keep=2).publish(model, RunState(run_id=run, step=step))
    assert [(upd.version, upd.high_water) for _, upd in outbox.on("rl.policy")] == [(5, 5), (6, 6)]


def test_a_run_written_before_the_high_water_file_counts_its_version_folders(tmp_path):
    """A run of the main before `high_water` (no file) resumed behind its newest version:
    the versions still on disk give the mark, read before the first prune deletes them."""
    root = tmp_path / "policies"
    shutil.copytree(FIXTURE / "policies", root)   # OLD's newest: version 6
    outbox = FakeOutbox()
    model, _ = load_policy("tiny", seed=0)
    PolicyStore(root, outbox, keep=3).publish(model, RunState(run_id=OLD, step=4))
    (_, upd), = outbox.on("rl.policy")
    assert (upd.version, upd.high_water) == (4, 6)
    assert (root / OLD / "high_water").read_text() == "6\n"
