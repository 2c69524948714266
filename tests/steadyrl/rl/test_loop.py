"""The in-process loop and the trainer on the tiny model (CPU, fixed seeds)."""

import json
import subprocess
import sys

import pytest
import torch

from steadyrl.model.data import encode_prompt, tiny_copy_rows
from steadyrl.model.models import load_policy
from steadyrl.rl.generation import SamplingParams, TorchGenerator
from steadyrl.rl.loop import LoopConfig, evaluate, run_loop
from steadyrl.rl.trainer import Group, TrainConfig, Trainer, build_batch
from tests.helpers import ROOT


def _mean(xs):
    return sum(xs) / len(xs)


@pytest.mark.parametrize("algorithm,steps", [("grpo", 150), ("ppo", 150)])
def test_tiny_task_is_learned(algorithm, steps):
    model, tok = load_policy("tiny", seed=0)
    rows = tiny_copy_rows(200, seed=0)
    cfg = LoopConfig(steps=steps, prompts_per_step=8, group_size=8, max_new_tokens=4, scorer="tiny_copy", seed=0,
                     train=TrainConfig(algorithm=algorithm, lr=3e-3, micro_batch_size=64))
    hist = run_loop(model, tok, rows, cfg)
    first = _mean([h["critic/score/mean"] for h in hist[:10]])
    last = _mean([h["critic/score/mean"] for h in hist[-10:]])
    assert first < 0.2, first
    assert last > first + 0.5, (first, last)
    acc, items = evaluate(model, tok, rows[:50], scorer="tiny_copy", max_new_tokens=4)
    assert acc > 0.8 and items[0]["response"] == items[0]["ground_truth"] * 4


def test_generation_logprobs_equal_the_trainers_forward():
    model, tok = load_policy("tiny", seed=1)
    gen = TorchGenerator(model, tok)
    rows = tiny_copy_rows(3, seed=1)
    prompts = [encode_prompt(tok, r) for r in rows]
    out = gen.generate(prompts, SamplingParams(n=2, temperature=0.7, max_new_tokens=5, seed=3))
    assert len(out) == 3 and all(len(g) == 2 for g in out)
    groups = [Group(p, [c.token_ids for c in g], [0.0, 1.0]) for p, g in zip(prompts, out, strict=True)]
    trainer = Trainer(model, tok.pad_token_id, TrainConfig(temperature=0.7))
    b = build_batch(groups, tok.pad_token_id)
    logp, _ = trainer._no_grad_pass(model, b)
    want = torch.zeros_like(logp)
    for i, c in enumerate(c for g in out for c in g):
        want[i, :len(c.logprobs)] = torch.tensor(c.logprobs)
    assert torch.allclose(logp * b["response_mask"], want, atol=1e-5)


def test_eos_ends_a_completion_and_stays_in_its_tokens():
    model, tok = load_policy("tiny", seed=2)
    def eos_first(module, inputs, logits):  # make EOS by far the likeliest next token
        logits[..., tok.eos_token_id] += 100.0
        return logits

    model.lm_head.register_forward_hook(eos_first)
    c = TorchGenerator(model, tok).generate([encode_prompt(tok, tiny_copy_rows(1)[0])],
                                            SamplingParams(max_new_tokens=5, temperature=0))[0][0]
    assert c.finish_reason == "stop" and c.token_ids[-1] == tok.eos_token_id and c.text == ""


def _grads(micro, agg, tokens=None):
    model, tok = load_policy("tiny", seed=3)
    g = [Group([5, 6], [[7, 8, 9], [7]], [1.0, 0.0]), Group([5], [[9, 9], [8, 7, 6, 5]], [0.0, 1.0])]
    t = Trainer(model, tok.pad_token_id, TrainConfig(micro_batch_size=micro, loss_agg=agg, lr=1e-9,
                                                     max_grad_norm=1e9, max_tokens_per_micro_batch=tokens))
    t.step(g)
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batching_does_not_change_the_gradient(agg):
    assert torch.allclose(_grads(1, agg), _grads(4, agg), atol=1e-6)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("tokens", [6, 13, 5])   # the batch is 4 rows of 2 + 4 tokens: 1, 2, 1 rows a micro-batch
def test_a_token_budget_micro_batch_gives_the_same_gradient(agg, tokens):
    assert torch.allclose(_grads(4, agg, tokens=None), _grads(4, agg, tokens=tokens), atol=1e-6)


def test_micro_rows_follow_the_token_budget():
    model, tok = load_policy("tiny", seed=3)
    t = Trainer(model, tok.pad_token_id, TrainConfig(micro_batch_size=8, max_tokens_per_micro_batch=4096))
    assert t.micro_rows(100) == 8               # today's shapes: micro_batch_size rows
    assert t.micro_rows(1024) == 4 and t.micro_rows(4096) == 1
    assert t.micro_rows(10_000) == 1            # a sequence longer than the budget runs alone
    t._enter_safe_mode("test")                  # the out-of-memory fallback: 4x fewer tokens too
    assert t.micro_tokens == 1024 and t.micro_rows(512) == 2
    t._leave_safe_mode()
    assert t.micro_rows(1024) == 4
    none = Trainer(model, tok.pad_token_id, TrainConfig(micro_batch_size=8, max_tokens_per_micro_batch=None))
    assert none.micro_rows(10_000) == 8


def test_kl_loss_with_zero_coefficient_warns():
    model, tok = load_policy("tiny")
    with pytest.warns(UserWarning, match="kl_coef is 0.0"):
        Trainer(model, tok.pad_token_id, TrainConfig(use_kl_loss=True, kl_coef=0.0))


def test_kl_to_reference_is_zero_before_any_update_and_grows_after():
    model, tok = load_policy("tiny", seed=4)
    t = Trainer(model, tok.pad_token_id, TrainConfig(use_kl_loss=True, kl_coef=0.1, lr=1e-2))
    g = [Group([5, 6], [[7, 8, 9], [7]], [1.0, 0.0])]
    m1 = t.step(g)
    assert m1["actor/kl_ref"] == pytest.approx(0.0, abs=1e-7)
    m2 = t.step(g)
    assert m2["actor/kl_ref"] > 1e-6


def test_ppo_needs_kl_in_reward_only_with_ppo():
    with pytest.raises(ValueError, match="kl_in_reward needs algorithm=ppo"):
        TrainConfig(kl_in_reward=True)


def test_seeded_sampler_draws_from_softmax_and_respects_top_p():
    from steadyrl.rl.generation import SeededSampler

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20_000, 1)      # (N, V)
    p = torch.softmax(logits[0] / 0.7, -1)
    out = SeededSampler(list(range(20_000)), temperature=0.7, top_p=1.0)(None, logits)
    assert torch.isfinite(out).sum(-1).eq(1).all()                       # exactly one token kept per row
    freq = torch.bincount(out.argmax(-1), minlength=4).float() / 20_000
    assert torch.allclose(freq, p, atol=0.015), (freq, p)
    # top_p 0.8: the smallest set reaching 0.8 of the mass is tokens {0, 1} (0.76 < 0.8 <= 0.95)
    out = SeededSampler(list(range(20_000)), temperature=0.7, top_p=0.8)(None, logits)
    kept = p[:3] / p[:3].sum() if p[:2].sum() < 0.8 else p[:2] / p[:2].sum()
    freq = torch.bincount(out.argmax(-1), minlength=4).float() / 20_000
    assert torch.allclose(freq[:len(kept)], kept, atol=0.015) and freq[len(kept):].sum() == 0


def test_stale_groups_start_the_ratio_from_their_behaviour_logprobs():
    """Behaviour log-probs equal to the current ones give the on-policy update exactly;
    other ones change it (the ratio is no longer 1, clipping can act)."""
    from steadyrl.rl.trainer import Group, Trainer, build_batch

    def run(behaviour):
        model, tok = load_policy("tiny", seed=5)
        trainer = Trainer(model, tok.pad_token_id, TrainConfig(lr=1e-2, micro_batch_size=64))
        groups = [Group([1, 5, 40], [[6, 7], [8, 9, 2]], [1.0, 0.0], behaviour)]
        trainer.step(groups)
        return model, trainer, groups

    fresh, _, groups = run(None)
    model, tok = load_policy("tiny", seed=5)
    t = Trainer(model, tok.pad_token_id, TrainConfig(micro_batch_size=64))
    b = build_batch(groups, tok.pad_token_id)
    cur, _ = t._no_grad_pass(model, b)
    same = [cur[0, :2].tolist(), cur[1, :3].tolist()]
    replay, _, _ = run(same)
    far = [[x - 1.0 for x in same[0]], [x - 1.0 for x in same[1]]]   # ratio e^1 > 1.2: clipped
    clipped, _, _ = run(far)
    diff = lambda m1, m2: max((a - b).abs().max().item() for a, b in zip(m1.parameters(), m2.parameters(), strict=True))
    assert diff(fresh, replay) < 1e-6
    assert diff(fresh, clipped) > 1e-4


_LONG_STEP = """
import json, resource, torch
from steadyrl.model.models import tiny_config
from steadyrl.rl.trainer import Group, TrainConfig, Trainer
from transformers import LlamaForCausalLM
torch.manual_seed(0)
model = LlamaForCausalLM(tiny_config(49152, max_position_embeddings=528))
g = torch.Generator().manual_seed(1)
groups = [Group([5, 6, 7], [torch.randint(4, 49152, (512,), generator=g).tolist() for _ in range(4)],
                [0.0, 1.0, 0.0, 1.0]) for _ in range(2)]
t = Trainer(model, 0, TrainConfig(micro_batch_size=8, max_tokens_per_micro_batch=1024))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t.step(groups)
print(json.dumps({"grew_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024}))
"""


def test_a_token_budget_bounds_a_long_answer_step_s_memory():
    """8 answers of 512 tokens over a 49 152-token vocabulary, micro_batch_size 8: one
    micro-batch of all 8 rows grew RSS by 3 905 MB (the logits and their log-softmax, entropy
    and gradients, 8 x 515 x 49 152 floats each); 1 024 tokens a micro-batch (1 row) by 531 MB."""
    proc = subprocess.run([sys.executable, "-c", _LONG_STEP], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    grew = json.loads(proc.stdout.strip().splitlines()[-1])["grew_mb"]
    assert grew < 1500, grew
