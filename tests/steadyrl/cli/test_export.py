"""`steadyrl export` and steadyrl.run.export: a tiny run's policy versions, written by the learner's
own policy store, come back from the exported folder through transformers exactly (every
tensor, tied embeddings included, in the version's dtype); version 0 is the base; a missing
version, a changed byte and a non-empty target are refused with one line naming what."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from steadyrl import cli
from steadyrl.model.models import load_policy, tiny_tokenizer
from steadyrl.run import checkpoint as ck
from steadyrl.run.export import MARKER, ExportError, export_base, export_version
from steadyrl.services.learner.policy_store import PolicyStore
from steadyrl.services.learner.state import RunState

RUN = "r20260101T000000-abcd"
FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "run-4bba081"
TIED = ("lm_head.weight", "model.embed_tokens.weight")


class Outbox:
    """What PolicyStore.publish sends on rl.policy, kept instead of produced."""

    def __init__(self):
        self.records = []

    def produce(self, topic, key, value):
        self.records.append((topic, key, value))

    def flush(self):
        pass


def make_run(state: Path, steps: int = 2, keep: int = 3, dtype=torch.float32, checkpoint_at=()) -> dict:
    """A tiny learner run under `state` (steadyrl up's layout: learner/<run>, policies/<run>)
    with versions 0..steps published by the real PolicyStore; returns version -> state dict."""
    run_dir = state / "learner" / RUN
    run_dir.mkdir(parents=True)
    torch.manual_seed(0)
    model, _ = load_policy("tiny", seed=0)  # what the learner's version 0 is
    model.to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    st = RunState(run_id=RUN, config={"model": "tiny", "data": "tiny_copy:16", "seed": 0})
    store = PolicyStore(state / "policies", Outbox(), keep)
    versions = {}
    for step in range(steps + 1):
        if step:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
        st.step = step
        store.publish(model, st)
        versions[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if step in checkpoint_at:
            ck.write(run_dir / "checkpoints", step, ck.snapshot(model, opt, None),
                     {"learner_state": json.loads(st.model_dump_json())}, st.config)
    (run_dir / "state.json").write_text(st.model_dump_json())
    (state / "learner" / "CURRENT").write_text(RUN + "\n")
    return versions


def assert_same(out: Path, want: dict) -> None:
    """`from_pretrained(out)` holds exactly `want` (names, dtypes, values); embeddings tied."""
    from transformers import AutoModelForCausalLM

    dtype = next(iter(want.values())).dtype
    got = AutoModelForCausalLM.from_pretrained(out, dtype=dtype)
    sd = got.state_dict()
    assert set(sd) == set(want)
    assert [k for k, t in want.items() if sd[k].dtype != t.dtype or not torch.equal(sd[k], t)] == []
    assert got.lm_head.weight.data_ptr() == got.model.embed_tokens.weight.data_ptr()


@pytest.fixture
def state(tmp_path):
    return tmp_path / "state"


def test_latest_reloads_exactly_through_transformers(state, tmp_path):
    versions = make_run(state)
    out = export_version(state / "learner" / RUN, "latest", tmp_path / "out")
    assert_same(out, versions[2])
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", MARKER} <= names
    assert not any(n.startswith(".") for n in names) and not list(tmp_path.glob(".out.*"))
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config.get("dtype", config.get("torch_dtype")) == "float32"
    assert "lm_head.weight" not in load_file(str(out / "model.safetensors"))  # as save_pretrained stores a tie
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    assert tok("12+3=15")["input_ids"] == tiny_tokenizer()("12+3=15")["input_ids"]
    m = json.loads((out / MARKER).read_text())
    assert (m["run_id"], m["version"], m["model"], m["dtype"]) == (RUN, 2, "tiny", "float32")
    assert m["checked"] == "every byte against the recorded sha256"
    assert m["files"]["model.safetensors"]


def test_an_older_version_and_version_0_from_the_store(state, tmp_path):
    versions = make_run(state, steps=2, checkpoint_at=(1,))
    run = state / "learner" / RUN
    out1 = export_version(run, 1, tmp_path / "v1")
    assert_same(out1, versions[1])
    assert json.loads((out1 / MARKER).read_text())["checked"] == "every byte against the recorded sha256"
    out0 = export_version(run, 0, tmp_path / "v0")  # still kept (keep 3)
    assert_same(out0, versions[0])
    m = json.loads((out0 / MARKER).read_text())
    assert m["checked"] == "shards against the index; the index's own sha256 is not recorded"
    assert not torch.equal(versions[0]["model.embed_tokens.weight"], versions[1]["model.embed_tokens.weight"])


def test_version_0_pruned_from_the_store_is_the_base_rebuilt(state, tmp_path):
    versions = make_run(state, steps=3, keep=2)
    assert not (state / "policies" / RUN / "v000000").exists()
    out = export_version(state / "learner" / RUN, 0, tmp_path / "v0")
    assert_same(out, versions[0])
    assert json.loads((out / MARKER).read_text())["checked"] == "rebuilt"


def test_bfloat16_version_keeps_its_dtype_and_large_ones_are_sharded(state, tmp_path):
    versions = make_run(state, steps=1, dtype=torch.bfloat16)
    out = export_version(state / "learner" / RUN, 1, tmp_path / "out", max_shard_size="40KB")
    assert_same(out, versions[1])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    config = json.loads((out / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    assert json.loads((out / MARKER).read_text())["dtype"] == "bfloat16"


def test_a_legacy_single_file_version_exports(tmp_path):
    """The run of main at 4bba081: its version is one .safetensors file with a recorded sha256."""
    run = FIXTURE / "learner" / "r20261201T075848-5c73"
    out = export_version(run, "latest", tmp_path / "out")
    legacy = load_file(str(FIXTURE / "policies" / "r20261201T075848-5c73" / "v000006.safetensors"))
    legacy["lm_head.weight"] = legacy["model.embed_tokens.weight"]
    assert_same(out, legacy)


# ---------------------------------------------------------------------------------- refusals

def test_missing_version_is_refused_listing_what_is_kept(state, tmp_path):
    make_run(state, steps=3, keep=2)
    with pytest.raises(ExportError, match=rf"run {RUN} has no policy version 1 under .*kept there: 2, 3"):
        export_version(state / "learner" / RUN, 1, tmp_path / "out")
    with pytest.raises(ExportError, match="no policy version 9: state.json is at step 3"):
        export_version(state / "learner" / RUN, 9, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("victim", ["model-00001-of-00001.safetensors", "model.safetensors.index.json"])
def test_a_changed_byte_is_refused_naming_the_file(state, tmp_path, victim):
    make_run(state, steps=1)
    path = state / "policies" / RUN / "v000001" / victim
    data = bytearray(path.read_bytes())
    data[-2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ExportError, match=rf"sha256_mismatch: {path}: expected [0-9a-f]{{64}}, got [0-9a-f]{{64}}"):
        export_version(state / "learner" / RUN, 1, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_a_non_empty_target_is_refused_unless_forced(state, tmp_path):
    versions = make_run(state, steps=1)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match=rf"{out} exists and is not empty \(--force replaces it\)"):
        export_version(state / "learner" / RUN, 1, out)
    assert (out / "notes.txt").read_text() == "mine"
    export_version(state / "learner" / RUN, 1, out, force=True)
    assert_same(out, versions[1])
    assert not (out / "notes.txt").exists()
    (tmp_path / "empty").mkdir()
    export_version(state / "learner" / RUN, 0, tmp_path / "empty")  # an empty folder is fine


# ---------------------------------------------------------------------------------- the command

def test_cli_by_run_id_prints_one_line(state, tmp_path, capsys):
    versions = make_run(state, steps=1)
    out = tmp_path / "out"
    assert cli.main(["export", RUN, "latest", str(out), "--state-dir", str(state)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"exported version 1 of run {RUN} (tiny, float32) to {out}: ")
    assert_same(out, versions[1])
    # the learner state dir names its CURRENT run; a run folder names itself
    assert cli.main(["export", str(state / "learner"), "0", str(tmp_path / "a")]) == 0
    assert cli.main(["export", str(state / "learner" / RUN), "1", str(tmp_path / "b")]) == 0


@pytest.mark.parametrize("argv, code, says", [
    (["export", RUN, "one", "OUT"], 2, "error: version 'one': expected an int >= 0 or 'latest'"),
    (["export", "r-none", "1", "OUT"], 1, "error: r-none: no such run folder, nor a run id under "),
    (["export", RUN, "7", "OUT"], 1, f"error: run {RUN} has no policy version 7: state.json is at step 1"),
    (["export", RUN, "1", "NONEMPTY"], 1, "exists and is not empty (--force replaces it)"),
])
def test_cli_refusals_are_one_error_line(state, tmp_path, capsys, argv, code, says):
    make_run(state, steps=1)
    (tmp_path / "NONEMPTY").mkdir()
    (tmp_path / "NONEMPTY" / "x").write_text("x")
    argv = [str(tmp_path / a) if a in ("OUT", "NONEMPTY") else a for a in argv]
    assert cli.main([*argv, "--state-dir", str(state)]) == code
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and says in err, err
    assert not (tmp_path / "OUT").exists()


# ---------------------------------------------------------------------------------- export_base

def test_export_base_tiny_is_cached_by_its_marker(tmp_path):
    out = tmp_path / "base"
    export_base("tiny", out, seed=3)
    want = {k: v.clone() for k, v in load_policy("tiny", seed=3)[0].state_dict().items()}
    assert_same(out, want)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    export_base("tiny", out, seed=3)  # up to date: nothing written
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    export_base("tiny", out, seed=4)  # another source: rebuilt in place
    assert_same(out, {k: v.clone() for k, v in load_policy("tiny", seed=4)[0].state_dict().items()})
    shard = out / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1] + b"\0")  # a changed byte: rebuilt, not served
    export_base("tiny", out, seed=4)
    assert_same(out, {k: v.clone() for k, v in load_policy("tiny", seed=4)[0].state_dict().items()})


def test_export_base_leaves_a_foreign_folder_alone(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text("{}")
    with pytest.raises(ExportError, match="exists and is not empty"):
        export_base("tiny", tmp_path / "mine")
    with pytest.raises(ExportError, match="model 'no/such/model': not 'smollm2-135m-instruct', 'tiny', or a local"):
        export_base("no/such/model", tmp_path / "x")


@pytest.mark.slow
def test_export_base_smollm2_from_its_gguf(tmp_path):
    """SmolLM2 (GGUF, converted and cached by steadyrl.model.models): the folder vLLM's backend needs."""
    pytest.importorskip("gguf")
    from steadyrl.model.models import SMOLLM2, smollm2_gguf

    try:
        smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    out = export_base(SMOLLM2, tmp_path / "smollm2")
    assert (out / "generation_config.json").is_file() and (out / "model.safetensors").is_file()
    model, _ = load_policy(SMOLLM2)
    assert_same(out, dict(model.state_dict()))
