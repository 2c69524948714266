"""Layered checkpoints: round trip, every broken case with its own error, fallback, async."""

import json
import shutil

import pytest
import torch

from steadyrl.model.models import load_policy
from steadyrl.rl.trainer import Group, TrainConfig, Trainer
from steadyrl.run import checkpoint as ck
from steadyrl.run import ckpt_writer, shards, signing
from steadyrl.run import tensors as tensors_mod

CONFIG = {"model": "tiny", "tokenizer": "tiny-chars", "algorithm": "grpo"}


def _trained(steps=2, seed=0):
    model, tok = load_policy("tiny", seed=seed)
    tr = Trainer(model, tok.pad_token_id, TrainConfig(lr=1e-2, micro_batch_size=64))
    for i in range(steps):
        tr.step([Group([1, 5, 40], [[6, 7], [8, 9, 2]], [1.0, float(i % 2)])])
    return model, tr


def _save(root, step=2, **kw):
    model, tr = _trained(step)
    return ck.write(root, step, ck.snapshot(model, tr.opt, tr.sched), {"global_step": step, "rng": tensors_mod.rng_state()},
                    CONFIG, **kw), model, tr


def test_round_trip_restores_weights_optimizer_scheduler_and_rng(tmp_path):
    path, model, tr = _save(tmp_path)
    assert (tmp_path / "LATEST").read_text().strip() == path.name == "step_000002"
    torch.manual_seed(123)
    want_next = torch.rand(3)
    model2, tr2 = _trained(0, seed=9)
    torch.manual_seed(123)
    meta = ck.load(ck.latest_valid(tmp_path, CONFIG), model2, tr2.opt, tr2.sched)
    assert meta["global_step"] == 2
    assert all(torch.equal(a, b)
               for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True))
    assert tr2.sched.last_epoch == tr.sched.last_epoch
    s1, s2 = tr.opt.state_dict()["state"], tr2.opt.state_dict()["state"]
    assert all(torch.equal(s1[k]["exp_avg"], s2[k]["exp_avg"]) for k in s1)
    torch.manual_seed(0)
    tensors_mod.set_rng_state(meta["rng"])  # the RNG state saved at step 2 continues identically
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), want_next)


@pytest.mark.parametrize("break_it,message", [
    (lambda p: (p / "model/model.safetensors").write_bytes((p / "model/model.safetensors").read_bytes()[:100]),
     "model/model.safetensors size mismatch: expected"),
    (lambda p: (p / "meta.json").write_text(json.dumps({"global_step": 999}).ljust(len((p / "meta.json").read_text()))),
     "meta.json sha256 mismatch: expected"),
    (lambda p: shutil.rmtree(p / "optimizer"), "optimizer/optimizer.safetensors missing"),
    (lambda p: (p / "manifest.json").write_text(
        (p / "manifest.json").read_text().replace('"format_version": "2.0"', '"format_version": "9.0"')),
     "checkpoint format mismatch: expected v2.0 or v3.0, got v9.0"),
    (lambda p: (p / "manifest.json").unlink(), "no manifest.json"),
])
def test_each_broken_checkpoint_says_what_is_wrong(tmp_path, break_it, message):
    path, _, _ = _save(tmp_path)
    break_it(path)
    with pytest.raises(ck.CheckpointError, match=message.replace("(", r"\(")):
        ck.verify(path, CONFIG)


def test_another_model_is_refused_by_name(tmp_path):
    path, _, _ = _save(tmp_path)
    with pytest.raises(ck.CheckpointError, match="model mismatch: expected 'smollm2-135m-instruct', got 'tiny'"):
        ck.verify(path, {**CONFIG, "model": "smollm2-135m-instruct"})


def test_a_corrupt_newest_falls_back_to_the_previous_with_a_warning(tmp_path, caplog):
    model, tr = _trained(1)
    for step in (1, 2):
        ck.write(tmp_path, step, ck.snapshot(model, tr.opt, tr.sched), {"global_step": step}, CONFIG)
    (tmp_path / "step_000002" / "model" / "model.safetensors").write_bytes(b"garbage")
    assert ck.latest_valid(tmp_path, CONFIG).name == "step_000001"
    assert any("step_000002" in str(getattr(r, "checkpoint", "")) for r in caplog.records)
    (tmp_path / "step_000001" / "meta.json").write_text("{}")
    with pytest.raises(ck.CheckpointError, match="no usable checkpoint"):
        ck.latest_valid(tmp_path, CONFIG)


def test_half_written_saves_are_never_read_and_keep_k(tmp_path):
    model, tr = _trained(1)
    (tmp_path / "step_000009.tmp-1").mkdir(parents=True)  # a crash mid-save
    assert ck.latest_valid(tmp_path) is None
    for step in range(1, 6):
        ck.write(tmp_path, step, ck.snapshot(model, tr.opt, tr.sched), {}, CONFIG, keep=2)
    assert ck.list_checkpoints(tmp_path) == ["step_000004", "step_000005"]
    assert not list(tmp_path.glob("*.tmp-*"))


_KILLED_MID_SAVE = """
import os
import sys
from pathlib import Path
from tests.steadyrl.test_checkpoint import CONFIG, _trained
from steadyrl.run import checkpoint as ck
from steadyrl.run import ckpt_writer
from steadyrl.run import shards
from steadyrl.run import signing
from steadyrl.run import tensors as tensors_mod
model, tr = _trained(1)
root = Path(sys.argv[1])
ck.write(root, 1, ck.snapshot(model, tr.opt, tr.sched), {"global_step": 1}, CONFIG)
os.environ["STEADYRL_FAILPOINT"] = sys.argv[2]  # armed for the second save only
saver = ckpt_writer.AsyncCheckpointer(root, CONFIG)
saver.save(2, model, tr.opt, tr.sched, {"global_step": 2})  # the failpoint SIGKILLs us mid-write
saver.wait()
print("not killed")
"""


def test_kill_9_in_the_middle_of_a_save_leaves_the_previous_checkpoint_latest(tmp_path):
    """A real SIGKILL half-way through an async save (weights written, optimizer not): the
    half-written folder is never read, LATEST still names step 1 and it verifies; the next
    save removes the leftover."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root, marker = tmp_path / "ckpt", tmp_path / "fired"
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", _KILLED_MID_SAVE, str(root), f"checkpoint.mid_write:{marker}"],
                          cwd=repo,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert marker.read_text().startswith("checkpoint.mid_write")
    (half,) = root.glob("step_000002.tmp-*")
    assert (half / "model" / "model.safetensors").is_file()
    assert not (half / "optimizer" / "optimizer.safetensors").exists()
    assert (root / "LATEST").read_text().strip() == "step_000001"
    assert ck.latest_valid(root, CONFIG).name == "step_000001"
    model, tr = _trained(1)
    ck.write(root, 2, ck.snapshot(model, tr.opt, tr.sched), {"global_step": 2}, CONFIG)  # marker set: no kill
    assert ck.list_checkpoints(root) == ["step_000001", "step_000002"] and not list(root.glob("*.tmp-*"))


def test_async_save_writes_the_snapshot_not_later_updates(tmp_path):
    model, tr = _trained(1)
    saver = ckpt_writer.AsyncCheckpointer(tmp_path, CONFIG)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    saver.save(1, model, tr.opt, tr.sched, {"global_step": 1})
    with torch.no_grad():  # the step loop goes on changing the weights
        for p in model.parameters():
            p.add_(1.0)
    saver.wait()
    model2, tr2 = _trained(0, seed=5)
    ck.load(ck.latest_valid(tmp_path, CONFIG), model2, tr2.opt, tr2.sched)
    assert all(torch.equal(want[k], v) for k, v in model2.state_dict().items())


def test_ckpt_cli_lists_and_verifies(tmp_path, capsys):
    from steadyrl.cli import main

    model, tr = _trained(1)
    for step in (1, 2):
        ck.write(tmp_path, step, ck.snapshot(model, tr.opt, tr.sched), {}, CONFIG)
    assert main(["ckpt", "list", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "* step_000002  ok  step 2" in out and "  step_000001  ok  step 1" in out
    assert out.count(f"format v{ck.FORMAT_VERSION} (whole)") == 2, out   # sharded ones say so
    assert main(["ckpt", "verify", str(tmp_path)]) == 0 and "a resume would use step_000002" in capsys.readouterr().out
    assert main(["ckpt", "verify", str(tmp_path / "step_000001")]) == 0 and "ok:" in capsys.readouterr().out
    (tmp_path / "step_000002" / "meta.json").write_text('{"global_step": 7}')
    assert main(["ckpt", "verify", str(tmp_path / "step_000002")]) == 1
    assert "meta.json size mismatch" in capsys.readouterr().err
    # regression: verifying the folder said "ok" (the fallback) and exited 0 with the newest broken
    assert main(["ckpt", "verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "* step_000002  BROKEN:" in out and "a resume would use step_000001 (LATEST names step_000002)" in out
    assert main(["ckpt", "list", str(tmp_path)]) == 1
    capsys.readouterr()
    (tmp_path / "step_000001" / "manifest.json").unlink()
    assert main(["ckpt", "verify", str(tmp_path / "step_000001")]) == 1
    assert "no manifest.json" in capsys.readouterr().err
    assert main(["ckpt", "list", str(tmp_path.parent)]) == 1 and main(["ckpt", "list", str(tmp_path / "nope")]) == 1
    assert "no such folder" in capsys.readouterr().err


def test_streamed_safetensors_read_back_with_the_library_and_hash_matches(tmp_path):
    from safetensors.torch import load_file

    from steadyrl.files import sha256_file

    tensors = {"bf16": torch.randn(3, 5).to(torch.bfloat16), "scalar": torch.tensor(7.0),
               "empty": torch.zeros(0, 4), "i64": torch.arange(10), "t": torch.randn(4, 6).t()}  # non-contiguous
    entry = tensors_mod.write_safetensors(tmp_path / "x.safetensors", tensors, {"step": "3"})
    back = load_file(str(tmp_path / "x.safetensors"))
    assert set(back) == set(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)
    assert back["bf16"].dtype == torch.bfloat16 and back["scalar"].shape == ()
    assert entry == {"size": (tmp_path / "x.safetensors").stat().st_size,
                     "sha256": sha256_file(tmp_path / "x.safetensors")}


def test_saving_the_same_step_again_never_leaves_latest_dangling(tmp_path):
    """Regression: a second save of the same step deleted the folder LATEST names before the
    new one was in place; a crash then left no checkpoint. Now the old one is renamed aside
    (`.old-<pid>`, never listed, removed by the next save) until the new one is in."""
    model, tr = _trained(1)
    for _ in range(2):
        ck.write(tmp_path, 1, ck.snapshot(model, tr.opt, tr.sched), {"global_step": 1}, CONFIG, keep=1)
    assert ck.list_checkpoints(tmp_path) == ["step_000001"] and ck.latest_valid(tmp_path, CONFIG)
    (tmp_path / "step_000001").rename(tmp_path / "step_000001.old-7")  # a crash between the two renames
    (tmp_path / "step_000002.tmp-7").mkdir()
    assert ck.list_checkpoints(tmp_path) == []
    ck.write(tmp_path, 2, ck.snapshot(model, tr.opt, tr.sched), {"global_step": 2}, CONFIG, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step_000002"]


def test_keep_never_deletes_the_checkpoint_just_written(tmp_path):
    model, tr = _trained(1)
    (tmp_path / "step_000009").mkdir()  # a newer-named, broken folder
    ck.write(tmp_path, 3, ck.snapshot(model, tr.opt, tr.sched), {"global_step": 3}, CONFIG, keep=1)
    assert (tmp_path / "step_000003").is_dir() and ck.latest_valid(tmp_path, CONFIG).name == "step_000003"


def test_snapshot_keeps_distinct_empty_tensors_apart():
    """Regression: tensors were de-duplicated by data_ptr alone, and every empty tensor has 0."""
    class Opt:
        def state_dict(self):
            empty = {"a": torch.zeros(0, 4), "b": torch.zeros(3, 0), "c": torch.zeros(0, dtype=torch.int64)}
            return {"state": {0: empty}, "param_groups": []}

    model, _ = _trained(0)
    snap = ck.snapshot(model, Opt(), None)["optimizer"]["state"][0]
    assert [(tuple(t.shape), t.dtype) for t in snap.values()] == [((0, 4), torch.float32), ((3, 0), torch.float32),
                                                                   ((0,), torch.int64)]


@pytest.mark.parametrize("manifest", ["[]", '{"format_version": "2.0"}',
                                      '{"format_version": "2.0", "files": {"meta.json": 3}}'])
def test_a_malformed_manifest_is_a_checkpoint_error_and_falls_back(tmp_path, manifest):
    model, tr = _trained(1)
    for step in (1, 2):
        ck.write(tmp_path, step, ck.snapshot(model, tr.opt, tr.sched), {"global_step": step}, CONFIG)
    (tmp_path / "step_000002" / "manifest.json").write_text(manifest)
    with pytest.raises(ck.CheckpointError):
        ck.verify(tmp_path / "step_000002", CONFIG)
    assert ck.latest_valid(tmp_path, CONFIG).name == "step_000001"


# -- format 3: the same tables as torch.distributed.checkpoint shards ---------------------------
def _sharded_save(tr: Trainer, root, step: int) -> None:
    """A format-3 save on one process (no group: DCP writes one shard file, __0_0.distcp)."""
    saver = ckpt_writer.AsyncCheckpointer(root, CONFIG)
    saver.save_sharded(step, tr, {"global_step": tr.global_step, "rng": tensors_mod.rng_state()}, announce=lambda tmp: None)
    saver.wait()
    assert saver.last_verified_step == step


def test_a_sharded_checkpoint_verifies_reads_back_whole_and_loads(tmp_path):
    _, tr = _trained()
    _sharded_save(tr, tmp_path, 1)
    path = ck.latest_valid(tmp_path, CONFIG)
    manifest = ck.verify(path, CONFIG)
    assert manifest["format_version"] == ck.SHARDED_FORMAT_VERSION
    assert {"shards/.metadata", "shards/__0_0.distcp", "meta.json"} <= set(manifest["files"])
    weights, opt_state, meta = ck.read(path)
    for k, v in tr.model.state_dict().items():
        if k in weights:
            assert torch.equal(weights[k], v), k
    assert "lm_head.weight" not in weights                      # tied: stored once, as format 2
    _, fresh = _trained(steps=1)   # optimizer state to load into
    ck.load(path, fresh.model, fresh.opt, fresh.sched)
    assert all(torch.equal(a, b)
               for a, b in zip(fresh.model.state_dict().values(), tr.model.state_dict().values(), strict=True))
    assert fresh.opt.state_dict()["state"][0]["exp_avg"].equal(tr.opt.state_dict()["state"][0]["exp_avg"])
    assert fresh.sched.state_dict() == tr.sched.state_dict()


def test_a_changed_shard_is_named_and_the_previous_checkpoint_used(tmp_path, caplog):
    _, tr = _trained()
    _sharded_save(tr, tmp_path, 1)
    tr.step([Group([2, 9], [[6, 1], [8, 8]], [0.0, 1.0])])
    _sharded_save(tr, tmp_path, 2)
    shard = tmp_path / "step_000002" / "shards" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ck.CheckpointError, match=r"shards/__0_0.distcp sha256 mismatch"):
        ck.verify(tmp_path / "step_000002", CONFIG)
    assert ck.latest_valid(tmp_path, CONFIG) == tmp_path / "step_000001"
    assert "checkpoint unusable" in caplog.text


def test_an_unknown_format_is_refused_naming_both_readable_ones(tmp_path):
    _, tr = _trained()
    _sharded_save(tr, tmp_path, 1)
    mpath = tmp_path / "step_000001" / "manifest.json"
    manifest = json.loads(mpath.read_text())
    mpath.write_text(json.dumps({**manifest, "format_version": "4.0"}))
    with pytest.raises(ck.CheckpointError, match=r"expected v2.0 or v3.0, got v4.0"):
        ck.verify(tmp_path / "step_000001", CONFIG)


# -- no code from the folder: format 3's pickled metadata through an allow-list; signatures ---
KEY = b"k" * 32


class _RunsCode:
    """Pickles as a call of `open(marker, "w")`: unpickling it creates the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant_code(step_dir, marker) -> None:
    """Replace the shards' metadata with a pickle of the same metadata that also runs code, and
    re-hash it into the manifest (as whoever hands the folder over can)."""
    import pickle

    meta_path = step_dir / "shards" / ".metadata"
    md = shards.shard_metadata(step_dir / "shards")
    md.planner_data = {"x": _RunsCode(marker)}
    meta_path.write_bytes(pickle.dumps(md))
    mpath = step_dir / "manifest.json"
    manifest = json.loads(mpath.read_text())
    manifest["files"]["shards/.metadata"] = tensors_mod.file_entry(meta_path)
    mpath.write_text(json.dumps(manifest, indent=2))


def test_a_sharded_checkpoint_whose_metadata_runs_code_is_refused_and_the_code_never_runs(tmp_path, capsys):
    import pickle

    from steadyrl.cli import main

    _, tr = _trained()
    _sharded_save(tr, tmp_path, 1)
    step_dir = tmp_path / "step_000001"
    marker = tmp_path / "ran"
    _plant_code(step_dir, marker)
    # the planted pickle does run code when unpickled as torch's reader does (pickle.load)
    pickle.loads((step_dir / "shards" / ".metadata").read_bytes().replace(b"/ran", b"/ra2"))
    assert (tmp_path / "ra2").exists()

    with pytest.raises(ck.CheckpointError, match=r"\.metadata: names io\.open, which a checkpoint's "
                                                 r"metadata does not hold \(refused, not loaded\)"):
        ck.verify(step_dir, CONFIG)
    with pytest.raises(ck.CheckpointError, match=r"(?s)no usable checkpoint.*io\.open"):
        ck.latest_valid(tmp_path, CONFIG)
    with pytest.raises(ck.CheckpointError, match=r"io\.open"):   # read (load) refuses it unverified too
        ck.read(step_dir)
    assert main(["ckpt", "verify", str(step_dir)]) == 1
    assert "invalid:" in (err := capsys.readouterr().err) and "names io.open" in err
    assert main(["ckpt", "verify", str(tmp_path)]) == 1
    got = capsys.readouterr()
    assert "step_000001  BROKEN:" in got.out and "io.open" in got.out and "a resume would fail" in got.err
    assert not marker.exists()


def test_the_shards_metadata_may_only_point_at_listed_plain_files(tmp_path):
    import pickle

    _, tr = _trained()
    _sharded_save(tr, tmp_path, 1)
    step_dir = tmp_path / "step_000001"
    md = shards.shard_metadata(step_dir / "shards")
    index = next(iter(md.storage_data))
    md.storage_data[index].relative_path = "../meta.json"
    with pytest.raises(ck.CheckpointError, match=r"points at .*\.\./meta\.json.*only plain files"):
        shards.shard_metadata(step_dir / "shards", pickle.dumps(md))
    for junk, why in ((b"not a pickle", "not a distributed checkpoint's metadata"),
                      (pickle.dumps({"a": 1}), r"not a distributed checkpoint's metadata \(a dict\)")):
        with pytest.raises(ck.CheckpointError, match=why):
            shards.shard_metadata(step_dir / "shards", junk)


def test_a_signed_checkpoint_verifies_only_under_its_key_and_unsigned_ones_only_without(tmp_path, capsys):
    from steadyrl.cli import main

    model, tr = _trained(1)
    ck.write(tmp_path / "whole", 1, ck.snapshot(model, tr.opt, tr.sched), {}, CONFIG, key=KEY)
    saver = ckpt_writer.AsyncCheckpointer(tmp_path / "sharded", CONFIG, key=KEY)
    saver.save_sharded(1, tr, {"global_step": 1}, announce=lambda tmp: None)
    saver.wait()
    assert saver.last_verified_step == 1          # verified after writing, with the key
    for folder in (tmp_path / "whole" / "step_000001", tmp_path / "sharded" / "step_000001"):
        assert (folder / signing.SIGNATURE).read_text().startswith("hmac-sha256 ")
        ck.verify(folder, CONFIG, KEY)
        ck.verify(folder, CONFIG)                 # no key: not checked (as the last main read them)
        with pytest.raises(ck.CheckpointError, match="does not match manifest.json under the configured key"):
            ck.verify(folder, CONFIG, b"o" * 32)
    # a manifest changed after signing (here: the config it records) is refused
    mpath = tmp_path / "whole" / "step_000001" / "manifest.json"
    mpath.write_text(mpath.read_text().replace('"grpo"', '"ppo"'))
    with pytest.raises(ck.CheckpointError, match="does not match"):
        ck.verify(mpath.parent, key=KEY)
    # unsigned (written by the last main, or without the key): fine without a key, refused with one
    ck.write(tmp_path / "plain", 1, ck.snapshot(model, tr.opt, tr.sched), {}, CONFIG)
    plain = tmp_path / "plain" / "step_000001"
    ck.verify(plain, CONFIG)
    with pytest.raises(ck.CheckpointError, match=r"not signed \(no manifest.sig\) and a checkpoint key is "
                                                 r"configured.*steadyrl ckpt sign"):
        ck.verify(plain, CONFIG, KEY)
    with pytest.raises(ck.CheckpointError, match="(?s)no usable checkpoint.*not signed"):
        ck.latest_valid(tmp_path / "plain", CONFIG, KEY)

    key_file = tmp_path / "key"
    key_file.write_text(KEY.decode() + "\n")
    assert main(["ckpt", "verify", str(plain), "--key-file", str(key_file)]) == 1
    assert "not signed" in capsys.readouterr().err
    assert main(["ckpt", "verify", str(plain)]) == 0 and "unsigned" in capsys.readouterr().out
    assert main(["ckpt", "sign", str(plain), "--key-file", str(key_file)]) == 0     # trusted: adopt it
    assert main(["ckpt", "verify", str(tmp_path / "plain"), "--key-file", str(key_file)]) == 0
    assert "signature ok" in capsys.readouterr().out
    short = tmp_path / "short"
    short.write_text("abc\n")
    assert main(["ckpt", "verify", str(plain), "--key-file", str(short)]) == 2
    assert "at least 32 needed" in capsys.readouterr().err
