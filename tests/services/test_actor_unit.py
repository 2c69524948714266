import pytest
import torch
from safetensors.torch import save_model

from services.actor.server import Actor, ActorConfig, ActorSection, PolicyRefused, sha256_file
from steadyrl.models import tiny_model


def _actor(root):
    return Actor(ActorConfig(actor=ActorSection(model="tiny", policy_root=root)))


def test_a_policy_of_another_shape_is_refused_before_touching_the_model(tmp_path):
    actor = _actor(tmp_path)
    before = {k: v.clone() for k, v in actor.model.state_dict().items()}
    save_model(tiny_model(len(actor.tok), hidden=32), str(tmp_path / "small.safetensors"))
    with pytest.raises(PolicyRefused) as e:
        actor.load_version(1, "small.safetensors", sha256_file(tmp_path / "small.safetensors"))
    assert e.value.reason == "wrong_model" and actor.version == 0
    assert all(torch.equal(before[k], v) for k, v in actor.model.state_dict().items())


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
    save_model(tiny_model(len(actor.tok), seed=3), str(tmp_path / "v.safetensors"))
    actor.load_version(2, "v.safetensors", sha256_file(tmp_path / "v.safetensors"))
    with pytest.raises(PolicyRefused, match="stale"):
        actor.load_version(2, "v.safetensors", sha256_file(tmp_path / "v.safetensors"))
