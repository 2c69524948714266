"""The SmolLM2 cache (steadyrl.model.models.smollm2_cached) built by the learner's ranks at once on a
fresh machine. Regression: transformers' save_pretrained writes nothing on a rank > 0 of an
initialised torch.distributed group, so rank 1 renamed a folder of tokenizer files alone into
the cache first, and every load after failed ("Should have a `model_type` key in its
config.json"; bench/ranks.py's 2-rank arms on a fresh machine)."""

from __future__ import annotations

import os

import torch.multiprocessing as mp

from steadyrl.local.ports import free_port
from steadyrl.model import models


def _rank(rank: int, world: int, port: int, cache: str) -> None:
    import torch.distributed as dist

    os.environ["STEADYRL_CACHE"] = cache
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out = models.smollm2_cached()
        assert models._complete(out), sorted(p.name for p in out.iterdir())
    finally:
        dist.destroy_process_group()


def test_two_ranks_converting_at_once_leave_a_complete_cache(tmp_path):
    mp.spawn(_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    out = tmp_path / "models" / models.SMOLLM2
    assert models._complete(out)
    assert not list(out.parent.glob("*.tmp-*"))


def test_a_cache_of_tokenizer_files_alone_is_converted_again(tmp_path, monkeypatch):
    monkeypatch.setenv("STEADYRL_CACHE", str(tmp_path))
    broken = tmp_path / "models" / models.SMOLLM2
    broken.mkdir(parents=True)
    (broken / "tokenizer_config.json").write_text("{}")   # what the race above left
    out = models.smollm2_cached()
    assert out == broken and models._complete(out)
