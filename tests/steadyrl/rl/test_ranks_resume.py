"""A checkpoint written by one rank resumes on two and the reverse (gloo, CPU): rank 0 restores
the checkpoint whole (steadyrl/run/checkpoint.py, verified) and sends it to the other rank before
the first update (`Leader.send` -> `sync`). Replicated, rank 0 writes the state as one rank
does; sharded (FSDP2), every rank writes its shards (format 3) and one process reads them back
whole, so the rank count is free to change between runs. Tolerance as
tests/steadyrl/rl/test_distributed_step.py (2e-5: the same sums in another order)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from steadyrl.local.ports import free_port
from steadyrl.model.models import load_policy
from steadyrl.rl.trainer import Group, TrainConfig, Trainer
from steadyrl.run import checkpoint as ck
from steadyrl.run import ckpt_writer
from tests.steadyrl.rl.test_distributed_step import GROUPS, TOL

NEXT = [Group([7, 8], [[9, 9], [10], [11, 12, 13], [6]], [1.0, 0.0, 0.0, 1.0]),
        Group([4, 4, 4], [[5, 6], [7, 8, 9], [3], [2, 2]], [0.0, 0.0, 1.0, 1.0])]
# the LR schedule moves; fp32 (autocast off): the ranks are spawned, out of conftest's reach, and
# "auto" is bf16 on a CPU with native bf16
CFG = {"lr": 1e-2, "autocast": "off", "micro_batch_size": 2, "warmup_steps": 1, "total_steps": 10}


def _trainer(sharding: str = "replicate") -> Trainer:
    torch.manual_seed(0)
    model, tok = load_policy("tiny", seed=0)
    return Trainer(model, tok.pad_token_id, TrainConfig(**CFG, sharding=sharding))


def _save(tr: Trainer, root: Path, step: int) -> Path:
    return ck.write(root, step, ck.snapshot(tr.model, tr.opt, tr.sched), {"global_step": tr.global_step}, {})


def _resume(tr: Trainer, path: Path) -> None:
    ck.verify(path)
    meta = ck.load(path, tr.model, None if tr.sharded else tr.opt, tr.sched)
    tr.pending_optimizer = meta.pop("optimizer_state", None)
    tr.global_step = meta["global_step"]


def _weights(tr: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tr.model.state_dict().items()}


def _two_ranks(rank: int, world: int, port: int, one_rank_ckpt: str, out: str, sharding: str) -> None:
    """Resume the one-rank checkpoint on 2 ranks, step on NEXT, save, step on GROUPS."""
    import torch.distributed as dist

    from steadyrl.rl import distributed

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        tr = _trainer(sharding)
        if rank == 0:
            _resume(tr, Path(one_rank_ckpt))
            leader = distributed.Leader(world)
            saver = ckpt_writer.AsyncCheckpointer(Path(out) / "two_rank_ckpt", {})
            if tr.sharded:   # a save before any step (a stop while waiting): the restored state, not the initial
                early = ckpt_writer.AsyncCheckpointer(Path(out) / "saved_before_a_step", {})
                early.save_sharded(tr.global_step, tr, {"global_step": tr.global_step},
                                   announce=lambda tmp: leader.save(tr, tmp))
                early.wait()
            after = []
            for i, groups in enumerate((NEXT, GROUPS)):
                leader.step(tr, groups)
                after.append(_weights(tr))
                if i == 0 and tr.sharded:   # every rank writes its shards, in the background
                    saver.save_sharded(tr.global_step, tr, {"global_step": tr.global_step},
                                       announce=lambda tmp: leader.save(tr, tmp))
                elif i == 0:
                    _save(tr, Path(out) / "two_rank_ckpt", tr.global_step)
            saver.wait()
            leader.stop()
            torch.save({"after_next": after[0], "after_groups": after[1]}, f"{out}/rank0.pt")
        else:
            assert distributed.follow(tr, ckpt_writer.ShardWriter() if tr.sharded else None) == 0
            torch.save({"after_groups": _weights(tr), "global_step": tr.global_step}, f"{out}/rank1.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sharding", ["replicate", "fsdp"])
def test_a_checkpoint_moves_between_one_and_two_ranks(tmp_path, sharding):
    # one rank: a step, a checkpoint
    first = _trainer()
    first.step(GROUPS)
    one_rank_ckpt = _save(first, tmp_path / "one_rank_ckpt", 1)

    # 1 -> 2: two ranks resume it and go on, and checkpoint after the first of their steps
    mp.spawn(_two_ranks, args=(2, free_port(), str(one_rank_ckpt), str(tmp_path), sharding), nprocs=2, join=True)
    written = ck.latest_valid(tmp_path / "two_rank_ckpt")
    assert written is not None
    manifest = ck.verify(written)
    if sharding == "fsdp":   # format 3: each rank's shards, every one in the manifest
        assert manifest["format_version"] == ck.SHARDED_FORMAT_VERSION
        assert {"shards/.metadata", "shards/__0_0.distcp", "shards/__1_0.distcp"} <= set(manifest["files"])
        from torch.distributed.checkpoint import FileSystemReader

        keys = FileSystemReader(str(written / "shards")).read_metadata().state_dict_metadata
        assert "model.model.embed_tokens.weight" in keys and "model.lm_head.weight" not in keys   # tied: once
        # saved on 2 ranks before their first step: the one-rank checkpoint they resumed, whole
        # (it held the shards' initial weights and no optimizer state under the restored step)
        early, _, _ = ck.read(ck.latest_valid(tmp_path / "saved_before_a_step"))
        resumed, resumed_opt, _ = ck.read(one_rank_ckpt)
        early_opt = ck.read(ck.latest_valid(tmp_path / "saved_before_a_step"))[1]
        assert early.keys() == resumed.keys()
        for k in resumed:
            assert torch.equal(early[k], resumed[k]), k
        assert early_opt["state"].keys() == resumed_opt["state"].keys()
        for i in resumed_opt["state"]:
            assert torch.equal(early_opt["state"][i]["exp_avg"], resumed_opt["state"][i]["exp_avg"]), i
    else:
        assert manifest["format_version"] == ck.FORMAT_VERSION
    r0, r1 = torch.load(tmp_path / "rank0.pt", weights_only=True), torch.load(tmp_path / "rank1.pt", weights_only=True)
    assert r1["global_step"] == 3
    for k in r0["after_groups"]:           # the follower got the checkpoint and stayed a replica
        assert torch.equal(r0["after_groups"][k], r1["after_groups"][k]), k

    ref = _trainer()                       # the same resume on one rank
    _resume(ref, one_rank_ckpt)
    ref.step(NEXT)
    diff = max(float((ref.model.state_dict()[k] - r0["after_next"][k]).abs().max()) for k in r0["after_next"])
    assert diff <= TOL, diff

    # 2 -> 1: one rank resumes the two ranks' checkpoint: the same parameters, and the same next step
    back = _trainer()
    _resume(back, ck.latest_valid(tmp_path / "two_rank_ckpt"))
    assert back.global_step == 2
    for k, v in back.model.state_dict().items():
        assert torch.equal(v, r0["after_next"][k]), k
    back.step(GROUPS)
    diff = max(float((back.model.state_dict()[k] - r0["after_groups"][k]).abs().max()) for k in r0["after_groups"])
    assert diff <= TOL, diff
    moved = max(float((back.model.state_dict()[k] - r0["after_next"][k]).abs().max()) for k in r0["after_next"])
    assert moved > 1e-4                    # the step after the resume did change the weights
