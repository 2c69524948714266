"""The learner's checkpoints verify after they are written (in the writer thread), and
steadyrl_learner_last_verified_checkpoint_step says which is the newest that did -- or that a
resume verified -- so an alert can say "no verified checkpoint for 3 x checkpoint_every steps"."""

import logging

from prometheus_client import REGISTRY

from steadyrl.config import ConfigError
from steadyrl.run import checkpoint as ck
from steadyrl.run import ckpt_writer, signing, tensors
from tests.services.learner.conftest import Msg, scored


def _verified():
    return REGISTRY.get_sample_value("steadyrl_learner_last_verified_checkpoint_step")


def _step(lrn, seed=0):
    lrn.feeder.top_up()
    for i, pid in enumerate(p for p in list(lrn.state.in_flight) if p not in lrn.intake.ready):
        lrn.intake.accept(Msg(scored(lrn.state, pid, seed=seed), pid, offset=100 * seed + i))
    assert lrn.train_step() is not None


def test_each_checkpoint_is_verified_after_it_is_written_and_a_resume_counts_its_own(make_learner):
    lrn = make_learner(checkpoint_every=1)
    lrn.store.publish(lrn.model, lrn.state)
    assert _verified() == 0.0                                        # a new run: none yet
    _step(lrn)
    lrn.saver.wait()                                                 # the background save of step 1
    assert lrn.saver.last_verified_step == 1 and _verified() == 1.0
    assert lrn.saver.last_verify_seconds is not None and lrn.saver.last_verify_seconds < lrn.saver.last_seconds
    _step(lrn, seed=1)
    lrn.saver.wait()
    assert _verified() == 2.0
    lrn.cache.close()

    again = make_learner(checkpoint_every=1)                          # resumes step 2 from its checkpoint
    assert again.state.step == 2 and again.saver.last_verified_step == 2 and _verified() == 2.0


def test_a_checkpoint_that_does_not_verify_after_writing_is_not_counted_and_does_not_stop_the_learner(
        make_learner, monkeypatch, caplog):
    lrn = make_learner(checkpoint_every=1)
    lrn.store.publish(lrn.model, lrn.state)
    _step(lrn)
    lrn.saver.wait()
    real = ck.write

    def write_then_rot(*a, **kw):                                   # the disk changes a byte after the write
        path = real(*a, **kw)
        with open(path / "model" / "model.safetensors", "r+b") as f:
            f.seek(-1, 2)
            f.write(b"\x01" if f.read(1) != b"\x01" else b"\x02")
        return path

    monkeypatch.setattr(ckpt_writer, "write", write_then_rot)
    _step(lrn, seed=1)
    with caplog.at_level(logging.ERROR):
        lrn.saver.wait()                                             # no error raised: the run goes on
    assert lrn.saver.last_verified_step == 1 and _verified() == 1.0
    assert any("did not verify after it was written" in r.getMessage() for r in caplog.records)


def test_verification_can_be_turned_off(tmp_path):
    from steadyrl.model.models import load_policy
    from steadyrl.rl.trainer import TrainConfig, Trainer

    model, tok = load_policy("tiny")
    tr = Trainer(model, tok.pad_token_id, TrainConfig())
    saver = ckpt_writer.AsyncCheckpointer(tmp_path, {"model": "tiny"}, verify=False)
    saver.save(3, model, tr.opt, tr.sched, {})
    saver.wait()
    assert saver.last_verified_step is None and saver.last_verify_seconds is None
    assert ck.verify(tmp_path / "step_000003")["step"] == 3


def test_a_resume_that_changes_training_settings_says_which(make_learner, caplog):
    """learner.train is not in the fingerprint (a run may go on with another autocast), but a
    resume that changes it now logs what changed, from the checkpoint's saved settings; before,
    the switch (and with autocast the log-probs' numerics) went unsaid. A new lr is named as
    not applied: the checkpoint's optimizer state brings the saved one back (review finding:
    the first version of this said "0.01 -> 0.001" while the optimizer kept 0.01)."""
    lrn = make_learner(checkpoint_every=1)
    lrn.store.publish(lrn.model, lrn.state)
    _step(lrn)
    lrn.saver.wait()
    lrn.cache.close()
    assert lrn.state.train["lr"] == 1e-2 and lrn.state.train["autocast"] == "off"
    with caplog.at_level(logging.WARNING, logger="steadyrl.learner"):
        again = make_learner(checkpoint_every=1, train={"lr": 1e-3, "micro_batch_size": 64, "autocast": "bf16"})
    assert again.state.step == 1
    [rec] = [r for r in caplog.records if r.getMessage() == "resumed with changed training settings"]
    assert rec.changed == {"lr": "0.01 -> 0.001 not applied: the checkpoint's optimizer state keeps 0.01",
                           "autocast": "'off' -> 'bf16'"}
    assert [g["lr"] for g in again.trainer.opt.param_groups] == [1e-2]   # what the log says is in effect
    assert again.state.train["lr"] == 1e-2 and again.state.train["autocast"] == "bf16"
    again.cache.close()


def test_a_state_saved_before_the_training_settings_names_no_change(caplog):
    from steadyrl.services.learner.resume import settings_changed
    from steadyrl.services.learner.state import RunState

    old = RunState.parse('{"run_id": "r-a", "step": 7}', "state.json")   # no "train": main up to 137f24c
    with caplog.at_level(logging.WARNING, logger="steadyrl.learner"):
        assert settings_changed(old, {"lr": 1e-3, "autocast": "bf16"}, from_checkpoint=True) == {}
    assert not caplog.records and old.train == {"lr": 1e-3, "autocast": "bf16"}
    newer = RunState(run_id="r-a", train={"lr": 1e-3})          # a setting that joined TrainConfig later
    assert settings_changed(newer, {"lr": 1e-3, "clip": 0.2}, from_checkpoint=True) == {"clip": "(not set) -> 0.2"}
    policy_only = RunState(run_id="r-a", train={"lr": 1e-3})    # no checkpoint yet: a fresh optimizer
    assert settings_changed(policy_only, {"lr": 1e-4}, from_checkpoint=False) == {"lr": "0.001 -> 0.0001"}
    assert policy_only.train == {"lr": 1e-4}


def _sharded_checkpoint(lrn, step: int) -> None:
    """A format-3 checkpoint of the learner's trainer at `step` in its run's checkpoints (one
    process: DCP writes one shard), as a sharded learner writes it, with the meta a resume reads."""
    meta = {"global_step": step, "rng": tensors.rng_state(), "learner_state": lrn.state.model_dump(mode="json")}
    saver = ckpt_writer.AsyncCheckpointer(lrn.run_dir / "checkpoints", lrn.saver.config, key=lrn.saver.key)
    saver.save_sharded(step, lrn.trainer, meta, announce=lambda tmp: None)
    saver.wait()
    assert saver.last_verified_step == step


def test_a_resume_refuses_a_sharded_checkpoint_whose_metadata_runs_code_and_the_code_never_runs(
        make_learner, tmp_path, caplog):
    import pytest

    from tests.steadyrl.test_checkpoint import _plant_code

    lrn = make_learner(checkpoint_every=1)
    lrn.store.publish(lrn.model, lrn.state)
    _step(lrn)
    lrn.saver.wait()                                  # step_000001: the learner's own (format 2)
    _sharded_checkpoint(lrn, 2)                       # step_000002, LATEST: format 3
    lrn.cache.close()
    step2, marker = lrn.run_dir / "checkpoints" / "step_000002", tmp_path / "ran"
    _plant_code(step2, marker)                        # its .metadata now opens `marker` when unpickled
    with caplog.at_level(logging.WARNING):
        again = make_learner(checkpoint_every=1)       # auto: refused, the previous one used
    assert again.state.step == 1
    assert any("names io.open" in getattr(r, "why", "") for r in caplog.records)
    again.cache.close()
    with pytest.raises(ConfigError, match=r"learner.resume: .*names io\.open.*refused, not loaded"):
        make_learner(checkpoint_every=1, resume=str(step2))
    assert not marker.exists()


def test_with_a_key_checkpoints_are_signed_and_a_resume_takes_only_signed_ones(make_learner, tmp_path):
    import pytest
    from pydantic import ValidationError

    key_file, other = tmp_path / "ckpt-key", tmp_path / "other-key"
    key_file.write_text("a" * 64 + "\n")
    other.write_text("b" * 64 + "\n")
    lrn = make_learner(checkpoint_every=1)            # unsigned, as the last main wrote them
    lrn.store.publish(lrn.model, lrn.state)
    _step(lrn)
    lrn.saver.wait()
    lrn.cache.close()
    # exit 2, naming the cause (a restart would fail the same way: up stops instead of looping; issue 46)
    with pytest.raises(ConfigError, match=r"(?s)every checkpoint was refused for its signature.*no usable "
                                          r"checkpoint.*step_000001: not signed") as e:
        make_learner(checkpoint_every=1, checkpoint_key_file=key_file)
    assert e.value.code == 2
    again = make_learner(checkpoint_every=1)          # no key: resumes as before
    assert again.state.step == 1
    again.cache.close()

    signed = make_learner(checkpoint_every=1, resume="never", checkpoint_key_file=key_file)
    signed.store.publish(signed.model, signed.state)
    _step(signed)
    signed.saver.wait()
    signed.cache.close()
    folder = signed.run_dir / "checkpoints" / "step_000001"
    assert (folder / signing.SIGNATURE).is_file() and signed.saver.last_verified_step == 1
    resumed = make_learner(checkpoint_every=1, checkpoint_key_file=key_file)
    assert resumed.state.run_id == signed.state.run_id and resumed.state.step == 1
    resumed.cache.close()
    with pytest.raises(ConfigError, match=r"(?s)the key changed.*does not match manifest.json under the configured "
                                          r"key") as e:   # the signing key changed: exit 2 (issue 46)
        make_learner(checkpoint_every=1, checkpoint_key_file=other)
    assert e.value.code == 2 and "learner.resume: never" in str(e.value)

    inside = tmp_path / "learner" / "key"
    inside.write_text("c" * 64)
    with pytest.raises(ValidationError, match="is under state_dir"):
        make_learner(checkpoint_key_file=inside)
    short = tmp_path / "short-key"
    short.write_text("abc")
    with pytest.raises(ValidationError, match="at least 32 needed"):
        make_learner(checkpoint_key_file=short)


def test_a_run_whose_every_checkpoint_is_broken_stops_with_exit_2_naming_it(make_learner):
    """Issue 46: exit 1, and `up` restarted it for ever; a restart cannot mend a checkpoint."""
    import pytest

    lrn = make_learner(checkpoint_every=1)
    lrn.store.publish(lrn.model, lrn.state)
    _step(lrn)
    lrn.saver.wait()
    lrn.cache.close()
    folder = lrn.run_dir / "checkpoints" / "step_000001"
    with open(folder / "model" / "model.safetensors", "r+b") as f:
        f.seek(-1, 2)
        f.write(b"\x01" if f.read(1) != b"\x01" else b"\x02")
    with pytest.raises(ConfigError, match=rf"(?s)cannot continue run {lrn.state.run_id} \(no checkpoint of it can be "
                                          rf"used\): no usable checkpoint .*step_000001: model/model.safetensors "
                                          rf"(size|sha256) mismatch") as e:
        make_learner(checkpoint_every=1)
    assert e.value.code == 2 and "learner.resume: never" in str(e.value)
    assert make_learner(checkpoint_every=1, resume="never").state.run_id != lrn.state.run_id   # the way on
