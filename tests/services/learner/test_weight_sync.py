"""Weight sync from the learner's policy store to the actor (issue 36): versions written in
several shards by several threads, announced before their fsync, verified by the actor shard
by shard. The actor's weights are the learner's bit for bit after every step, a fresh
(resumed) actor gets the newest version whole, a corrupted shard is refused, and a failed
fsync writes the version again."""

import errno

import pytest
import torch

from steadyrl.model.models import load_policy
from steadyrl.rl.trainer import Group, TrainConfig, Trainer
from steadyrl.run import policy_files
from steadyrl.run.policy_files import PolicyRefused
from steadyrl.run.tensors import unique_tensors
from steadyrl.services.actor.config import ActorSection
from steadyrl.services.actor.follower import ServedVersion
from steadyrl.services.actor.model import ServedModel
from steadyrl.services.learner.policy_store import PolicyStore
from steadyrl.services.learner.state import RunState
from tests.services.learner.conftest import FakeOutbox

RUN = "r20261204T100000-abcd"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(_bits(a[k]), _bits(b[k])) for k in a)


def _actor(root) -> ServedVersion:
    return ServedVersion(ServedModel(ActorSection(model="tiny", policy_root=root)), root)


def _served(actor: ServedVersion) -> dict[str, torch.Tensor]:
    assert actor.model.module is not None
    return unique_tensors(actor.model.module.state_dict())


def _batch(step: int) -> list[Group]:
    g = torch.Generator().manual_seed(step)
    return [Group(list(range(3, 9)), [torch.randint(4, 40, (6,), generator=g).tolist() for _ in range(4)],
                  [0.0, 1.0, 0.0, 1.0]) for _ in range(2)]


@pytest.fixture
def small_shards(monkeypatch):
    """Shards of 64 KiB: the tiny model's 340 KB version is written as several, as a real model's is."""
    monkeypatch.setattr(policy_files, "SHARD_BYTES", 64 << 10)


def _load_newest(actor: ServedVersion, outbox: FakeOutbox) -> None:
    _, upd = outbox.on("rl.policy")[-1]
    actor.load_version(upd.version, upd.uri, upd.sha256, upd.run_id, upd.high_water)


def test_the_actor_serves_the_learners_weights_bit_for_bit_after_every_step(tmp_path, small_shards):
    model, _ = load_policy("tiny", seed=0)
    trainer = Trainer(model, 0, TrainConfig(lr=1e-3, micro_batch_size=8))
    outbox, st = FakeOutbox(), RunState(run_id=RUN)
    store, actor = PolicyStore(tmp_path, outbox, keep=2), _actor(tmp_path)
    loaded_before_fsync = []

    def announced() -> None:   # what the learner does there: the actor loads from the page cache
        _load_newest(actor, outbox)
        loaded_before_fsync.append(actor.version)

    store.publish(model, st, announced)
    assert len(list((tmp_path / RUN / "v000000").glob("*.safetensors"))) > 2
    for step in (1, 2, 3):
        before = {k: v.clone() for k, v in unique_tensors(model.state_dict()).items()}
        trainer.step(_batch(step))
        st.step = trainer.global_step
        assert not _same_bits(before, unique_tensors(model.state_dict()))   # the step changed the weights
        store.publish(model, st, announced)
        assert _same_bits(_served(actor), unique_tensors(model.state_dict())), f"step {step}"
    assert loaded_before_fsync == [0, 1, 2, 3] and actor.version == 3

    fresh = _actor(tmp_path)   # a resumed actor: the newest version, whole
    _load_newest(fresh, outbox)
    assert fresh.version == 3 and _same_bits(_served(fresh), unique_tensors(model.state_dict()))


def test_a_corrupted_shard_is_refused_by_name_and_the_served_weights_stay(tmp_path, small_shards):
    model, _ = load_policy("tiny", seed=0)
    outbox = FakeOutbox()
    store, actor = PolicyStore(tmp_path, outbox, keep=3), _actor(tmp_path)
    store.publish(model, RunState(run_id=RUN))
    _load_newest(actor, outbox)
    served = {k: v.clone() for k, v in _served(actor).items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3)
    store.publish(model, RunState(run_id=RUN, step=1))
    shards = sorted((tmp_path / RUN / "v000001").glob("*.safetensors"))
    victim = shards[len(shards) // 2]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x10
    victim.write_bytes(bytes(data))
    with pytest.raises(PolicyRefused) as e:
        _load_newest(actor, outbox)
    assert e.value.reason == "sha256_mismatch" and victim.name in e.value.detail
    assert actor.version == 0 and _same_bits(_served(actor), served)


def test_a_failed_fsync_writes_the_version_again_and_announces_it_again(tmp_path, monkeypatch):
    model, _ = load_policy("tiny", seed=0)
    outbox = FakeOutbox()
    store = PolicyStore(tmp_path, outbox, keep=2)
    real, calls = policy_files.sync_version, []

    def sync_once_failing(root, rel):
        calls.append(rel)
        if len(calls) == 1:
            (root / rel / policy_files.INDEX).write_text("torn by the failed writeback")
            raise OSError(errno.EIO, "Input/output error")
        real(root, rel)

    monkeypatch.setattr(policy_files, "sync_version", sync_once_failing)
    st = RunState(run_id=RUN)
    store.publish(model, st)
    records = [u for _, u in outbox.on("rl.policy")]
    assert len(records) == 2 and records[0] == records[1]
    policy_files.read_version(tmp_path, st.policy_uri, st.policy_sha256)   # whole again: no PolicyRefused
