"""learner.train.device (issue 23): with cuda the trainer updates a copy of the policy on the GPU
and keeps `model`, what the policy store, the evaluation and the checkpoints read, a whole CPU
copy refreshed after every step; what is restored into `model` reaches the update
(`Trainer.push_weights`).

No GPU here: the CPU tests run that copy path with the device function answering "cpu" for
cuda (the copy is then a second CPU module), so everything but the transfers is exercised; the
gpu-marked test runs the same step on a real GPU where one is visible."""

from __future__ import annotations

import pytest
import torch

from steadyrl.model.models import load_policy
from steadyrl.rl import trainer as trainer_mod
from steadyrl.rl.trainer import Group, TrainConfig, Trainer
from tests.steadyrl.rl.test_distributed_step import GROUPS

STALE = [Group(GROUPS[0].prompt_ids, GROUPS[0].responses, GROUPS[0].rewards,
               behaviour_logprobs=[[-1.5] * len(r) for r in GROUPS[0].responses],
               rollout_logprobs=[[-1.4] * len(r) for r in GROUPS[0].responses], engine="vllm"),
         *GROUPS[1:]]


def _trainer(device: str = "cpu", **cfg) -> Trainer:
    torch.manual_seed(0)
    model, tok = load_policy("tiny", seed=0)
    return Trainer(model, tok.pad_token_id, TrainConfig(**{"lr": 1e-2, "micro_batch_size": 4, **cfg},
                                                        device=device))


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float) -> None:
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= tol, f"largest weight difference {worst}"


@pytest.fixture
def cuda_as_cpu(monkeypatch):
    """device cuda takes the copy path, on the CPU."""
    monkeypatch.setattr(trainer_mod, "train_device", lambda device: torch.device("cpu"))


@pytest.mark.parametrize("cfg", [{}, {"algorithm": "ppo", "ppo_epochs": 2, "mini_batch_size": 6},
                                 {"use_kl_loss": True, "kl_coef": 0.1}], ids=["grpo", "ppo", "kl"])
def test_the_copy_path_steps_as_the_plain_trainer_and_refreshes_model(cuda_as_cpu, cfg):
    plain, copied = _trainer(**cfg), _trainer("cuda", **cfg)
    assert copied.module is not copied.model and plain.module is plain.model
    for _ in range(2):
        m_plain = plain.step(STALE)
        m_copied = copied.step(STALE)
    assert m_copied["actor/pg_loss"] == pytest.approx(m_plain["actor/pg_loss"], abs=1e-6)
    _assert_close(_weights(copied.model), _weights(plain.model), 1e-6)     # `model` follows the update
    _assert_close(_weights(copied.module), _weights(copied.model), 0.0)


def test_weights_restored_into_model_reach_the_update(cuda_as_cpu):
    """A resume loads the checkpoint into `model`; the first step must train from it, not from
    the weights the copy was made of."""
    source = _trainer()
    source.step(GROUPS)
    restored = _trainer("cuda")
    restored.model.load_state_dict(source.model.state_dict())
    reference = _trainer()
    reference.model.load_state_dict(source.model.state_dict())
    restored.step(GROUPS)
    reference.step(GROUPS)
    _assert_close(_weights(restored.model), _weights(reference.model), 1e-6)


def test_cuda_without_a_gpu_is_refused_naming_the_setting(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"learner\.train\.device is cuda"):
        _trainer("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_one_rank_step_on_the_gpu_equals_the_cpu_step():
    cpu, gpu = _trainer(), _trainer("cuda")
    assert next(gpu.module.parameters()).is_cuda and not next(gpu.model.parameters()).is_cuda
    for _ in range(2):
        cpu.step(STALE)
        gpu.step(STALE)
    _assert_close(_weights(gpu.model), _weights(cpu.model), 1e-4)   # fp32 on both; kernels differ
