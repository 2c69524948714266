"""Out-of-memory in a training step: retried in the safe mode, nothing lost or applied twice."""

import pytest
import torch

from steadyrl.model.models import load_policy
from steadyrl.rl.trainer import Group, TrainConfig, Trainer

GROUPS = [Group([1, 5, 40, 7], [[6, 7, 9], [8, 9, 2], [3, 3], [4, 5, 6, 7]], [1.0, 0.0, 0.5, 0.0]),
          Group([2, 9, 11], [[6, 1], [8, 8, 8], [3], [5, 6]], [0.0, 1.0, 1.0, 0.0])]


def _trainer(**cfg):
    model, tok = load_policy("tiny", seed=0)
    return Trainer(model, tok.pad_token_id, TrainConfig(**{"lr": 1e-2, "micro_batch_size": 8, **cfg}))


def _checkpointing(model) -> bool:
    if hasattr(model, "is_activation_checkpointing"):  # transformers >= 5
        return model.is_activation_checkpointing
    return model.is_gradient_checkpointing


def _oom_once(model, error):
    """Make the first forward with gradients raise `error` (as the allocator would)."""
    real, fired = model.forward, []

    def forward(*a, **kw):
        if torch.is_grad_enabled() and not fired:
            fired.append(1)
            raise error
        return real(*a, **kw)

    model.forward = forward
    return fired


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                   RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to "
                                                "allocate 4294967296 bytes")])
def test_an_oom_step_is_retried_in_the_safe_mode_and_equals_a_clean_step(error, caplog):
    tr = _trainer()
    fired = _oom_once(tr.model, error)
    m = tr.step(GROUPS)
    assert fired == [1]
    assert m["perf/oom_fallback"] == 1.0 and m["perf/safe_mode"] == 1.0 and tr.oom_fallbacks == 1
    assert tr.micro_batch_size == 2 and _checkpointing(tr.model)
    assert tr.global_step == 1 and any("out of memory in a training step" in r.getMessage() for r in caplog.records)

    clean = _trainer(micro_batch_size=2)  # the same step, never out of memory
    clean.step(GROUPS)
    for (k, a), b in zip(tr.model.state_dict().items(), clean.model.state_dict().values(), strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), k
    assert tr.opt.state_dict()["state"][0]["step"] == 1  # one optimizer step, not two

    m2 = tr.step(GROUPS)  # "stay": the rest of the run keeps the safe mode
    assert m2["perf/oom_fallback"] == 0.0 and m2["perf/safe_mode"] == 1.0 and tr.micro_batch_size == 2


def test_step_mode_leaves_the_safe_mode_after_the_step_and_off_raises():
    tr = _trainer(oom_fallback="step")
    _oom_once(tr.model, torch.OutOfMemoryError("out of memory"))
    assert tr.step(GROUPS)["perf/oom_fallback"] == 1.0
    assert not tr.safe_mode and tr.micro_batch_size == 8 and not _checkpointing(tr.model)

    off = _trainer(oom_fallback="off")
    _oom_once(off.model, torch.OutOfMemoryError("out of memory"))
    with pytest.raises(torch.OutOfMemoryError):
        off.step(GROUPS)


def test_other_errors_are_not_taken_for_oom():
    tr = _trainer()
    _oom_once(tr.model, RuntimeError("shape mismatch"))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        tr.step(GROUPS)
    assert not tr.safe_mode


def test_a_cache_scored_group_weighs_by_its_weight_and_zero_excludes_it():
    """weight 0 on group 2 = training on group 1 alone with group 2's advantages zeroed."""
    a, b = _trainer(), _trainer()
    a.step([GROUPS[0], Group(*[GROUPS[1].prompt_ids, GROUPS[1].responses, GROUPS[1].rewards], weight=0.0)])
    b.step([GROUPS[0], Group(GROUPS[1].prompt_ids, GROUPS[1].responses, [0.5] * 4)])  # same group, zero advantage
    for (k, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values(), strict=True):
        assert torch.equal(x, y), k
    c = _trainer()
    c.step(GROUPS)
    assert any(not torch.equal(x, y)
               for x, y in zip(a.model.state_dict().values(), c.model.state_dict().values(), strict=True))


def test_the_retry_does_not_keep_the_failed_attempts_tensors_alive():
    """Regression: the retry held the exception, whose traceback kept the failed forward's
    frames (and their tensors) alive; on a GPU that makes the retry run out of memory too."""
    import gc
    import weakref

    tr = _trainer()
    real, seen = tr.model.forward, {}

    def forward(*a, **kw):
        if torch.is_grad_enabled() and "ref" not in seen:
            activations = torch.empty(1 << 20)  # stands for the failed attempt's memory
            seen["ref"] = weakref.ref(activations)
            raise torch.OutOfMemoryError("out of memory")
        if "ref" in seen and "alive" not in seen:
            gc.collect()
            seen["alive"] = seen["ref"]() is not None
        return real(*a, **kw)

    tr.model.forward = forward
    tr.step(GROUPS)
    assert seen["alive"] is False


def test_groups_of_different_sizes_get_their_own_advantages():
    """A data gate removed samples: groups of 4 and 2 train; each group's advantages are
    computed over its own samples; equal sizes take the batched path unchanged."""
    from steadyrl.rl import core

    r = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0])
    got = core.grpo_advantages_by_group(r, [4, 2])
    want = torch.cat([core.grpo_advantages(r[:4][None])[0], core.grpo_advantages(r[4:][None])[0]])
    assert torch.equal(got, want)
    assert torch.equal(core.grpo_advantages_by_group(r, [3, 3]), core.grpo_advantages(r.view(2, 3)).reshape(-1))
    tr = _trainer()
    ragged = [GROUPS[0], Group(GROUPS[1].prompt_ids, GROUPS[1].responses[:2], GROUPS[1].rewards[:2])]
    m = tr.step(ragged)
    assert tr.global_step == 1 and m["critic/score/mean"] == pytest.approx(sum([1, 0, .5, 0, 0, 1]) / 6)


def test_yaml_off_reads_as_off():
    """YAML 1.1 reads a bare `off` as false; the config takes it as "off"."""
    import yaml

    assert TrainConfig(**yaml.safe_load("oom_fallback: off")).oom_fallback == "off"
