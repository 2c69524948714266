import pytest
import torch
from safetensors.torch import save_model

from steadyrl.files import sha256_file
from steadyrl.model.models import tiny_model
from steadyrl.run.policy_files import PolicyRefused
from steadyrl.services.actor import gate
from steadyrl.services.actor.config import ActorConfig, ActorSection
from steadyrl.services.actor.follower import ServedVersion
from steadyrl.services.actor.model import ServedModel, vllm_context


def _actor(root) -> ServedVersion:
    """The tiny model served from policy root `root`."""
    return ServedVersion(ServedModel(ActorSection(model="tiny", policy_root=root)), root)


def _status(actor: ServedVersion, run_id: str, min_version: int) -> int:
    """The HTTP status the version gate gives a settled call for (run_id, min_version): 200 served."""
    d = gate.verdict(actor.snapshot(), gate.Wanted(run_id, min_version))
    return gate.STATUS.get(d, 200)


RUN = "r20261129T100000-aaaa"


def _legacy(root, run: str, version: int, model) -> tuple[str, str]:
    """`model`'s weights as the legacy one-file version `run/v{version:06d}.safetensors`; (uri, sha256)."""
    path = root / run / f"v{version:06d}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_model(model, str(path))
    return str(path.relative_to(root)), sha256_file(path)


def test_a_policy_of_another_shape_is_refused_before_touching_the_model(tmp_path):
    actor = _actor(tmp_path)
    before = {k: v.clone() for k, v in actor.model.module.state_dict().items()}
    uri, sha = _legacy(tmp_path, RUN, 1, tiny_model(len(actor.model.tok), hidden=32))
    with pytest.raises(PolicyRefused) as e:
        actor.load_version(1, uri, sha, run_id=RUN)
    assert e.value.reason == "wrong_model" and actor.version == 0
    assert all(torch.equal(before[k], v) for k, v in actor.model.module.state_dict().items())


@pytest.mark.parametrize("uri,reason", [("../x.safetensors", "outside_root"), ("/etc/passwd", "outside_root"),
                                        ("w.bin", "not_safetensors"), ("nope.safetensors", "missing")])
def test_uris_are_checked(tmp_path, uri, reason):
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(PolicyRefused) as e:
        _actor(root).resolve(uri)
    assert e.value.reason == reason


def test_stale_versions_are_refused(tmp_path):
    actor = _actor(tmp_path)
    uri, sha = _legacy(tmp_path, RUN, 2, tiny_model(len(actor.model.tok), seed=3))
    actor.load_version(2, uri, sha, run_id=RUN)
    with pytest.raises(PolicyRefused, match="stale"):
        actor.load_version(2, uri, sha, run_id=RUN)


def test_a_later_run_replaces_any_version_of_an_earlier_one(tmp_path):
    actor = _actor(tmp_path)
    a, b = "r20261129T100000-aaaa", "r20261129T110000-bbbb"
    model = tiny_model(len(actor.model.tok), seed=3)
    actor.load_version(7, *_legacy(tmp_path, a, 7, model), run_id=a)
    actor.load_version(0, *_legacy(tmp_path, b, 0, model), run_id=b)  # a new run's version 0
    assert (actor.run_id, actor.version) == (b, 0)
    with pytest.raises(PolicyRefused, match="stale"):  # the earlier run cannot come back
        actor.load_version(8, *_legacy(tmp_path, a, 8, model), run_id=a)
    assert _status(actor, "", 5) == 200  # no run named: anything goes
    assert _status(actor, b, 0) == 200
    for run, version, status in [(b, 1, 503),                         # behind: retry soon
                                 ("r20261129T120000-cccc", 0, 503),   # a run not loaded yet
                                 (a, 0, 409)]:                        # an earlier run: refused
        assert _status(actor, run, version) == status, (run, version)


@pytest.mark.parametrize("run,version", [
    ("r20991231T235959-ffff", 3),                  # a run id that sorts last, the served run's file
    ("r20261129T100000-aaaa/../r20261129T100000-aaaa", 3),  # the same folder by a longer road
    ("r20261129T100000-aaaa", 9)])                 # the served run, another version's file
def test_a_record_cannot_pass_a_file_off_as_another_runs_or_versions(tmp_path, run, version):
    """Regression: a record whose run id sorted last, naming an earlier run's file, was
    loaded: the actor then served old weights as the newest run, and every prompt of the
    real run got 409 (an earlier run) and went to rl.dlq."""
    actor = _actor(tmp_path)
    model = tiny_model(len(actor.model.tok), seed=3)
    actor.load_version(3, *_legacy(tmp_path, RUN, 3, model), run_id=RUN)
    uri, sha = _legacy(tmp_path, RUN, 3, model)
    with pytest.raises(PolicyRefused) as e:
        actor.load_version(version, uri, sha, run_id=run)
    assert e.value.reason == "wrong_run" and f"not version {version} of run" in e.value.detail
    assert (actor.run_id, actor.version) == (RUN, 3)
    assert _status(actor, RUN, 3) == 200   # the served run's prompts are still answered


def test_a_record_without_a_run_id_is_refused_by_name(tmp_path):
    """PolicyUpdate before 1.1 named no run; its version lies in no run's folder."""
    actor = _actor(tmp_path)
    uri, sha = _legacy(tmp_path, RUN, 1, tiny_model(len(actor.model.tok), seed=3))
    with pytest.raises(PolicyRefused) as e:
        actor.load_version(1, uri, sha)
    assert e.value.reason == "no_run" and "PolicyUpdate before 1.1" in e.value.detail and actor.version == 0


def test_seeded_samples_do_not_depend_on_the_batch(tmp_path):
    from steadyrl.rl.generation import SamplingParams

    actor = _actor(tmp_path)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=6)
    a, b, c = [1, 5, 6], [1, 7, 8], [1, 9, 10]
    alone = actor.model.gen.generate([b], params, seeds=[42])[0]
    batched = actor.model.gen.generate([a, b, c], params, seeds=[1, 42, 2])[1]
    assert [x.token_ids for x in alone] == [x.token_ids for x in batched]
    other = actor.model.gen.generate([b], params, seeds=[43])[0]
    assert [x.token_ids for x in other] != [x.token_ids for x in alone]


def test_the_same_version_with_other_bytes_is_a_redone_step(tmp_path):
    actor = _actor(tmp_path)
    uri, sha3 = _legacy(tmp_path, RUN, 5, tiny_model(len(actor.model.tok), seed=3))
    actor.load_version(5, uri, sha3, run_id=RUN)
    with pytest.raises(PolicyRefused, match="stale"):  # the same bytes again: nothing to do
        actor.load_version(5, uri, sha3, run_id=RUN)
    _, sha4 = _legacy(tmp_path, RUN, 5, tiny_model(len(actor.model.tok), seed=4))  # step 5 redone
    actor.load_version(5, uri, sha4, run_id=RUN)
    want = tiny_model(len(actor.model.tok), seed=4).state_dict()
    assert all(torch.equal(want[k], v) for k, v in actor.model.module.state_dict().items())


def test_within_a_run_the_newest_record_wins_even_a_lower_version(tmp_path):
    """A learner resumed from its step-10 checkpoint after reaching 13 announces 10 again."""
    actor = _actor(tmp_path)
    actor.load_version(13, *_legacy(tmp_path, RUN, 13, tiny_model(len(actor.model.tok), seed=3)), run_id=RUN)
    actor.load_version(10, *_legacy(tmp_path, RUN, 10, tiny_model(len(actor.model.tok), seed=4)), run_id=RUN)
    assert actor.version == 10


def _version(root, seed: int, vocab: int, run: str = "r20261129T100000-aaaa", version: int = 1):
    """A policy version folder (steadyrl/run/policy_files.py) of the tiny model with `seed`; (uri, sha256)."""
    from steadyrl.run import policy_files
    from steadyrl.run.tensors import unique_tensors

    rel = policy_files.version_dir(run, version)
    sha = policy_files.write_version(root, rel, unique_tensors(tiny_model(vocab, seed=seed).state_dict()))
    return str(rel), sha


def test_a_version_folder_is_loaded_and_every_shard_checked(tmp_path):
    actor = _actor(tmp_path)
    uri, sha = _version(tmp_path, seed=5, vocab=len(actor.model.tok))
    actor.load_version(1, uri, sha, run_id="r20261129T100000-aaaa")
    want = tiny_model(len(actor.model.tok), seed=5).state_dict()
    assert actor.version == 1 and all(torch.equal(want[k], v) for k, v in actor.model.module.state_dict().items())
    uri2, sha2 = _version(tmp_path, seed=6, vocab=len(actor.model.tok), version=2)
    shard = tmp_path / uri2 / "model-00001-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(PolicyRefused) as e:  # the index is right, a shard is not
        actor.load_version(2, uri2, sha2, run_id="r20261129T100000-aaaa")
    assert e.value.reason == "sha256_mismatch" and "model-00001-of-00001" in e.value.detail and actor.version == 1


def test_an_index_naming_a_file_outside_its_folder_is_refused(tmp_path):
    import json

    from steadyrl.run.policy_files import INDEX

    actor = _actor(tmp_path)
    uri, _ = _version(tmp_path, seed=5, vocab=len(actor.model.tok))
    index = json.loads((tmp_path / uri / INDEX).read_text())
    index["metadata"]["sha256"] = {"../../x.safetensors": "0" * 64}
    index["weight_map"] = dict.fromkeys(index["weight_map"], "../../x.safetensors")
    (tmp_path / uri / INDEX).write_text(json.dumps(index))
    with pytest.raises(PolicyRefused) as e:
        actor.load_version(1, uri, sha256_file(tmp_path / uri / INDEX), run_id="r20261129T100000-aaaa")
    assert e.value.reason == "bad_index"


def test_a_version_that_cannot_be_loaded_is_refused_and_the_follower_goes_on(tmp_path):
    """Regression: the policy follower caught only PolicyRefused, so a shard whose bytes match
    the index but are not safetensors raised out of the follower thread, on every start (the
    record stays on the compacted topic)."""
    import json

    from prometheus_client import REGISTRY

    from steadyrl.run.policy_files import INDEX
    from steadyrl.services.actor.follower import PolicyFollower
    from steadyrl.wire.contracts import PolicyUpdate

    actor = _actor(tmp_path)
    folder = tmp_path / "r20261129T100000-aaaa" / "v000001"
    folder.mkdir(parents=True)
    (folder / "model-00001-of-00001.safetensors").write_bytes(b"not safetensors at all")
    index = {"metadata": {"sha256": {"model-00001-of-00001.safetensors":
                                     sha256_file(folder / "model-00001-of-00001.safetensors")}},
             "weight_map": {"lm_head.weight": "model-00001-of-00001.safetensors"}}
    (folder / INDEX).write_text(json.dumps(index))
    cfg = ActorConfig(bootstrap="127.0.0.1:1", actor=ActorSection(model="tiny", policy_root=tmp_path))
    follower = PolicyFollower(actor, cfg)
    try:
        before = REGISTRY.get_sample_value("steadyrl_actor_policy_rejected_total", {"reason": "load_error"}) or 0
        upd = PolicyUpdate(version=1, step=1, uri="r20261129T100000-aaaa/v000001",
                           sha256=sha256_file(folder / INDEX), run_id="r20261129T100000-aaaa")
        assert follower._load(upd) is False and actor.version == 0
        assert REGISTRY.get_sample_value("steadyrl_actor_policy_rejected_total", {"reason": "load_error"}) == before + 1
    finally:
        follower.consumer.close()


def test_the_vllm_backend_without_vllm_is_a_configuration_error_naming_the_venv(tmp_path):
    import importlib.util

    from steadyrl.config import ConfigError

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this interpreter")
    with pytest.raises(ConfigError) as e:
        ServedModel(ActorSection(model="tiny", backend="vllm", policy_root=tmp_path))
    assert "actor.backend vllm" in e.value.message and "make vllm-cpu" in e.value.message


def test_prompts_stamped_with_versions_a_crash_threw_away_are_served(tmp_path):
    """Regression (compose-test stall): the killed learner reached version 260 and stamped
    prompts with it; the learner resumed from step 255 announces 255 with high_water 260.
    Those prompts are served (with 255) instead of 503 until 260 comes back, which needed
    them; a version past the mark still waits. An actor that saw the higher version itself
    keeps it as the mark also from a record without one (policy_update before 1.4)."""
    fresh = _actor(tmp_path)   # started after the crash: it sees only the resumed learner's record
    model = tiny_model(len(fresh.model.tok), seed=3)
    fresh.load_version(255, *_legacy(tmp_path, RUN, 255, model), run_id=RUN, high_water=260)
    watched = _actor(tmp_path)   # followed the dead learner to 260, then the rewind
    watched.load_version(260, *_legacy(tmp_path, RUN, 260, model), run_id=RUN)
    watched.load_version(255, *_legacy(tmp_path, RUN, 255, tiny_model(len(fresh.model.tok), seed=4)), run_id=RUN)
    for actor in (fresh, watched):
        assert (actor.version, actor.high_water) == (255, 260)
        assert _status(actor, RUN, 260) == 200   # served with version 255
        assert _status(actor, RUN, 261) == 503
    later = "r20261129T110000-bbbb"   # a new run starts its own mark
    fresh.load_version(0, *_legacy(tmp_path, later, 0, model), run_id=later)
    assert fresh.high_water == 0
    assert _status(fresh, later, 1) == 503


def test_the_served_version_announced_again_still_raises_the_mark(tmp_path):
    """The resumed learner's first record is the checkpoint's version, byte for byte the one the
    actor may still serve: refused as stale, its high_water counts all the same; so does a
    record of the served run whose version was pruned before the actor read it."""
    actor = _actor(tmp_path)
    model = tiny_model(len(actor.model.tok), seed=3)
    uri, sha = _legacy(tmp_path, RUN, 255, model)
    actor.load_version(255, uri, sha, run_id=RUN)
    with pytest.raises(PolicyRefused, match="stale"):
        actor.load_version(255, uri, sha, run_id=RUN, high_water=260)
    assert (actor.version, actor.high_water) == (255, 260)
    with pytest.raises(PolicyRefused) as e:
        actor.load_version(263, f"{RUN}/v000263", "0" * 64, run_id=RUN)
    assert e.value.reason == "missing" and (actor.version, actor.high_water) == (255, 263)


def test_the_vllm_actor_serves_at_most_max_model_len_tokens(tmp_path):
    """Regression: the vLLM actor took its context from max_position_embeddings alone, so a
    prompt + max_new_tokens past actor.vllm.max_model_len passed the route and failed in the
    engine; now the smaller of the two bounds the route's 422."""
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 8192}')
    assert vllm_context(tmp_path, 2048) == 2048
    assert vllm_context(tmp_path, 16384) == 8192
    (tmp_path / "config.json").write_text("{}")
    assert vllm_context(tmp_path, 2048) == 2048
