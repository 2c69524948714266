"""A GRPO/PPO step over 2 torch.distributed ranks (gloo, CPU) equals the 1-rank step: each rank
backpropagates every other micro-batch with its share of the whole minibatch's loss, and the
gradients are summed (steadyrl/rl/trainer.py). Tolerance: the same sums in another order; AdamW's
first step divides each gradient by its own magnitude, so rounding in near-zero gradients moves
weights by up to ~1e-6 of lr 1e-2. One rank with micro-batches of 2 against 4 or 12 differs by
3.0e-6 and 7.0e-6 (measured); 2 ranks against 1 by 2.7e-6-1.05e-5. So: weights within 2e-5
(0.2 % of lr), and the gradients of the last minibatch (summed over ranks, clipped) within 1e-5
of their largest element."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from steadyrl.local.ports import free_port
from steadyrl.model.models import load_policy
from steadyrl.rl.trainer import Group, TrainConfig, Trainer

GROUPS = [Group([1, 5, 40, 7], [[6, 7, 9], [8, 9, 2], [3, 3], [4, 5, 6, 7]], [1.0, 0.0, 0.5, 0.0]),
          Group([2, 9, 11], [[6, 1], [8, 8, 8, 8, 8], [3], [5, 6]], [0.0, 1.0, 1.0, 0.0]),
          Group([3, 4], [[7, 7], [9], [10, 11, 12, 13], [12]], [0.0, 1.0, 0.0, 1.0])]
TOL = 2e-5


def _step(cfg: dict) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    torch.manual_seed(0)
    model, tok = load_policy("tiny", seed=0)
    tr = Trainer(model, tok.pad_token_id, TrainConfig(**cfg))
    metrics = tr.step(GROUPS)
    grads = {f"grad.{n}": full(p.grad).detach().clone() for n, p in tr.module.named_parameters() if p.grad is not None}
    return {k: v.detach().clone() for k, v in model.state_dict().items()} | grads, metrics


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (FSDP2's sharded gradients: a collective), else `t`."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


CONFIGS = {  # 12 samples in micro-batches of 2: 6 micro-batches, 3 per rank
    "token-mean": {"loss_agg": "token-mean"},
    "seq-mean-token-sum": {"loss_agg": "seq-mean-token-sum"},
    "seq-mean-token-mean": {"loss_agg": "seq-mean-token-mean"},
    "minibatches": {"loss_agg": "token-mean", "mini_batch_size": 6, "ppo_epochs": 2},   # 4 optimizer steps
    "ppo": {"algorithm": "ppo", "loss_agg": "token-mean"},
    "uneven": {"loss_agg": "token-mean", "micro_batch_size": 4},   # 3 micro-batches: rank 1 has one fewer
    "kl": {"loss_agg": "token-mean", "use_kl_loss": True, "kl_coef": 0.1},   # and a reference model
}
SHARDINGS = ("replicate", "fsdp")
CASES = [f"{sharding}/{name}" for sharding in SHARDINGS for name in CONFIGS]


def _cfg(case: str) -> dict:
    sharding, _, name = case.rpartition("/")
    # autocast off: the ranks are spawned, so conftest's fp32 patch does not reach them, and "auto"
    # is bf16 on a CPU with native bf16 (Zen 4: weights 0.02 apart, two lr steps)
    return {"lr": 1e-2, "micro_batch_size": 2, "autocast": "off", **CONFIGS[name],
            **({"sharding": sharding} if sharding else {})}


def _rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {case: _step(_cfg(case)) for case in CASES}
        if rank == 0:
            torch.save({name: {"weights": w, "metrics": m} for name, (w, m) in results.items()}, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """Every config's step on 2 ranks (one spawn: importing torch twice per config is slow)."""
    out = str(tmp_path_factory.mktemp("ranks") / "rank0.pt")
    mp.spawn(_rank, args=(2, free_port(), out), nprocs=2, join=True)
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_step_equals_one_rank(case, two_ranks):
    one, m1 = _step(_cfg(case))   # one rank: sharding has no effect
    two = two_ranks[case]
    assert one.keys() == two["weights"].keys()
    weights = [k for k in one if not k.startswith("grad.")]
    diff = max(float((one[k] - two["weights"][k]).abs().max()) for k in weights)
    assert diff <= TOL, diff
    g_scale = max(float(one[k].abs().max()) for k in one if k.startswith("grad."))
    g_diff = max(float((one[k] - two["weights"][k]).abs().max()) for k in one if k.startswith("grad."))
    assert g_diff <= 1e-5 * g_scale, (g_diff, g_scale)
    base = load_policy("tiny", seed=0)[0].state_dict()
    moved = max(float((one[k] - base[k]).abs().max()) for k in weights)
    assert moved > 1e-4                          # the step did change the weights
    for k in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "critic/score/mean"):
        assert abs(m1[k] - two["metrics"][k]) <= 1e-5 * max(1.0, abs(m1[k])), k


# -- the out-of-memory fallback, agreed across ranks ------------------------------------------
OOM_CASES = {  # where rank 1 alone runs out of memory: micro-batches of 8 -> 2 in the safe mode (fp32: see _cfg)
    "update": ({"lr": 1e-2, "autocast": "off", "micro_batch_size": 8, "loss_agg": "token-mean"}, True),
    "old_log_prob": ({"lr": 1e-2, "autocast": "off", "micro_batch_size": 8, "loss_agg": "token-mean",
                      "mini_batch_size": 6, "ppo_epochs": 2}, False),   # not on-policy: a no-grad pass comes first
}


def _oom_rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {}
        for name, (cfg, with_grad) in OOM_CASES.items():
            torch.manual_seed(0)
            model, tok = load_policy("tiny", seed=0)
            tr = Trainer(model, tok.pad_token_id, TrainConfig(**cfg, sharding="replicate"))
            if rank == 1:   # this rank's first such forward fails, as the allocator would
                real, fired = model.forward, []

                def forward(*a, _real=real, _fired=fired, _grad=with_grad, **kw):
                    if torch.is_grad_enabled() == _grad and not _fired:
                        _fired.append(1)
                        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
                    return _real(*a, **kw)

                model.forward = forward
            m = tr.step(GROUPS)
            results[name] = {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
                             "oom_fallback": m["perf/oom_fallback"], "micro_batch_size": tr.micro_batch_size,
                             "fallbacks": tr.oom_fallbacks}
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_one_ranks_out_of_memory_puts_every_rank_in_the_safe_mode(tmp_path):
    """Replicated, rank 1 alone runs out of memory (in the update, or in the no-grad pass before it): both
    ranks retry the part in the safe mode together (`Trainer._agree`), so the collectives stay
    matched and the step equals the one-rank step with the safe mode's micro-batches."""
    out = str(tmp_path / "oom.pt")
    mp.spawn(_oom_rank, args=(2, free_port(), out), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{r}", weights_only=True) for r in (0, 1)]
    for name, (cfg, _) in OOM_CASES.items():
        r0, r1 = ranks[0][name], ranks[1][name]
        for r in (r0, r1):
            assert r["oom_fallback"] == 1.0 and r["fallbacks"] == 1 and r["micro_batch_size"] == 2, (name, r)
        same = max(float((r0["weights"][k] - r1["weights"][k]).abs().max()) for k in r0["weights"])
        assert same == 0.0, (name, same)          # the same summed gradients: the same replica
        one, _ = _step({**cfg, "micro_batch_size": 2})   # one rank, never out of memory
        diff = max(float((one[k] - r0["weights"][k]).abs().max()) for k in r0["weights"])
        assert diff <= TOL, (name, diff)
