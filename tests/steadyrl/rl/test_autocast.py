"""learner.train.autocast: bf16 (the update's forward under torch.autocast): it engages, stays
near the fp32 step, and the tiny task is still learnt with it; off leaves the step as it was."""

import torch

from steadyrl.model.data import tiny_copy_rows
from steadyrl.model.models import load_policy
from steadyrl.rl.loop import LoopConfig, run_loop
from steadyrl.rl.trainer import Group, TrainConfig, Trainer


def _step(autocast: str) -> tuple[dict, torch.Tensor]:
    model, tok = load_policy("tiny", seed=0)
    groups = [Group([5, 6], [[7, 8, 9], [7, 3, 2], [4, 4, 1], [9, 9, 9]], [1.0, 0.0, 0.5, 0.0]),
              Group([6, 5, 4], [[1, 2], [3, 4], [5, 6], [7, 8]], [0.0, 1.0, 1.0, 0.0])]
    trainer = Trainer(model, tok.pad_token_id, TrainConfig(lr=1e-2, autocast=autocast))  # type: ignore[arg-type]
    metrics = trainer.step(groups)
    return metrics, torch.cat([p.detach().flatten() for p in model.parameters()])


def test_bf16_engages_and_stays_near_the_fp32_step():
    m32, w32 = _step("off")
    m16, w16 = _step("bf16")
    assert m16["actor/pg_loss"] == m16["actor/pg_loss"]  # finite
    assert not torch.equal(w16, w32)                       # the forward really ran in bf16
    assert abs(m16["actor/pg_loss"] - m32["actor/pg_loss"]) < 0.02, (m16["actor/pg_loss"], m32["actor/pg_loss"])
    assert (w16 - w32).abs().max() < 0.05                  # the same update, to bf16's precision
    assert _step("off")[1].equal(w32)                      # off: the fp32 step, bit for bit


def test_the_tiny_task_is_learnt_under_bf16():
    model, tok = load_policy("tiny", seed=0)
    rows = tiny_copy_rows(200, seed=0)
    cfg = LoopConfig(steps=150, prompts_per_step=8, group_size=8, max_new_tokens=4, scorer="tiny_copy", seed=0,
                     train=TrainConfig(lr=3e-3, micro_batch_size=64, autocast="bf16"))
    hist = run_loop(model, tok, rows, cfg)
    first = sum(h["critic/score/mean"] for h in hist[:10]) / 10
    last = sum(h["critic/score/mean"] for h in hist[-10:]) / 10
    assert first < 0.2 and last > first + 0.5, (first, last)


def test_auto_is_bf16_only_where_the_device_computes_it_natively(monkeypatch):
    """Issue 37: the default update under bf16 where it pays (1.59x on a Zen 4 CPU), fp32 where
    bf16 would be emulated (~90x slower on Zen 3); the vLLM actor's dtype decides alike."""
    from steadyrl.local import hardware
    from steadyrl.rl.config import resolve_autocast

    assert TrainConfig().autocast == "auto"
    for avx512_bf16, amx, expect in ((False, False, "off"), (True, False, "bf16"), (False, True, "bf16")):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        got, why = resolve_autocast("auto", "cpu")
        assert got == expect and "CPU" in why
        assert resolve_autocast("off", "cpu") == ("off", "configured")
        assert resolve_autocast("bf16", "cpu") == ("bf16", "configured")
        assert hardware.native_bf16("cpu")[0] == (expect == "bf16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert resolve_autocast("auto", "cuda") == ("off", "this GPU has no native bf16 (before Ampere)")


def test_a_trainer_given_auto_runs_the_resolved_autocast(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    model, tok = load_policy("tiny", seed=0)
    assert Trainer(model, tok.pad_token_id, TrainConfig(lr=1e-2)).cfg.autocast == "bf16"
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert Trainer(model, tok.pad_token_id, TrainConfig(lr=1e-2)).cfg.autocast == "off"
