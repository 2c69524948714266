"""The update gives the same parameters as before its refactor (steadyrl/rl/trainer.py `_update`).

The recorded values were computed by the update as it was before it was rewritten to read top to
bottom (the minibatch loop, the loss and the backward in one function; the out-of-memory fallback
and the ranks' agreement as plain steps around it): two steps of the tiny model under each
algorithm, with minibatches, epochs, micro-batches, a token budget, stale groups with TIS, a
reference with the KL loss, a critic, and an out-of-memory fallback. Bit for bit (sha256 of the
parameters) where the machine computes as the recording one did (torch version and CPU
capability); elsewhere the parameters' sum and the grad norm to 1e-6 (another CPU's kernels may
round the last bits differently).
"""

import hashlib

import pytest
import torch

from steadyrl.model.models import load_policy
from steadyrl.rl.trainer import Group, TrainConfig, Trainer

GROUPS = [Group([1, 5, 40, 7], [[6, 7, 9], [8, 9, 2], [3, 3], [4, 5, 6, 7]], [1.0, 0.0, 0.5, 0.0]),
          Group([2, 9, 11], [[6, 1], [8, 8, 8], [3], [5, 6]], [0.0, 1.0, 1.0, 0.0], weight=0.5)]
CONFIGS = {
    "grpo": {"micro_batch_size": 3},
    "ppo": {"algorithm": "ppo", "ppo_epochs": 2, "mini_batch_size": 4, "micro_batch_size": 2, "entropy_coeff": 0.01,
            "use_kl_loss": True, "kl_coef": 0.1},
    "dapo_stale_tis": {"algorithm": "dapo", "ppo_epochs": 2, "mini_batch_size": 3, "micro_batch_size": 2,
                       "rollout_is": "on"},
    "dr_grpo_tokens": {"algorithm": "dr_grpo", "mini_batch_size": 4, "max_tokens_per_micro_batch": 14},
    "grpo_oom": {"micro_batch_size": 3},
}
RECORDED_ON = ("2.15.0+cu132", "AVX512")   # torch.__version__, torch.backends.cpu.get_cpu_capability()
#: name -> (sha256 of the parameters after two steps, their sum, the second step's actor/grad_norm)
RECORDED = {
    "dapo_stale_tis": (
        "35dc3b130cdc9ff63671f615d8b61950197d85f3b0456c3301fee7f68857b3ab", 313.0461745799039, 1.2457070350646973),
    "dr_grpo_tokens": (
        "ac7b8ed277e9aa2512998e00982801e5199e32d2f704fabcfecfb5bdecaa1c3c", 319.9944062938084, 3.2298531532287598),
    "grpo": (
        "70660933ad5636324060c9f12cd1002451d9a7e91827a64f3ae738e2abdf1392", 318.79194122217086, 1.7731529474258423),
    "grpo_oom": (
        "38de2d0ff2b7206a7f08d500df79dfe3a3c8e18190e284e572af6b67df12a0e9", 318.79190500828554, 1.7731529474258423),
    "ppo": (
        "1d3da99e108144db7b983dfdc7870e6c62c95c977acb57068c048ef7257819ef", 325.64653810750315, 2.308661848306656),
}


def _stale(g: Group) -> Group:
    lps = [[-1.5 - 0.1 * i for i in range(len(s))] for s in g.responses]
    return Group(g.prompt_ids, g.responses, g.rewards, lps, rollout_logprobs=lps, engine="vllm")


def _oom_once(model: torch.nn.Module) -> None:
    real, fired = model.forward, []

    def forward(*a, **kw):
        if torch.is_grad_enabled() and not fired:
            fired.append(1)
            raise torch.OutOfMemoryError("out of memory")
        return real(*a, **kw)

    model.forward = forward


@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_steps_give_the_parameters_recorded_before_the_refactor(name):
    model, tok = load_policy("tiny", seed=0)
    tr = Trainer(model, tok.pad_token_id, TrainConfig(**{"lr": 1e-2, "autocast": "off", **CONFIGS[name]}))
    if name.endswith("_oom"):
        _oom_once(model)
    groups = [_stale(g) for g in GROUPS] if "stale" in name else GROUPS
    metrics = [tr.step(groups) for _ in range(2)][-1]
    sha, total, grad_norm = RECORDED[name]
    assert sum(float(p.detach().double().sum()) for p in tr.params) == pytest.approx(total, rel=1e-6, abs=0)
    assert metrics["actor/grad_norm"] == pytest.approx(grad_norm, rel=1e-6)
    assert metrics["perf/safe_mode"] == float(name.endswith("_oom"))
    if (torch.__version__, torch.backends.cpu.get_cpu_capability()) == RECORDED_ON:
        h = hashlib.sha256()
        for p in tr.params:
            h.update(p.detach().cpu().numpy().tobytes())
        assert h.hexdigest() == sha, "the update no longer gives the same parameters bit for bit"
