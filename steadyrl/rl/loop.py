"""The in-process reference loop: prompts -> generate -> reward -> update, in one process.

It is the oracle the Kafka pipeline is checked against and the baseline it is benchmarked
against: same model loading, generator, scorers and Trainer, no broker.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from array import array
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from steadyrl.model.data import PromptRow
from steadyrl.model.rewards import resolve_scorer, score_value
from steadyrl.model.scorepool import DEADLINE, ScoringLimits
from steadyrl.model.scorers import ScorerError, build_scorer, spec_kind
from steadyrl.rl.generation import SamplingParams, TorchGenerator
from steadyrl.rl.trainer import Group, TrainConfig, Trainer

log = logging.getLogger(__name__)


class LoopConfig(BaseModel):
    """What the reference loop runs."""

    model_config = ConfigDict(extra="forbid")  # a typo is an error, not a silent default

    steps: int = Field(10, ge=1)
    prompts_per_step: int = Field(8, ge=1, description="B: prompts in one step.")
    group_size: int = Field(8, ge=1, description="G: samples per prompt.")
    max_new_tokens: int = Field(32, ge=1)
    top_p: float = Field(1.0, gt=0, le=1)
    scorer: str = "numeric_match"
    seed: int = 0
    train: TrainConfig = TrainConfig()


def encode_prompt(tokenizer: Any, row: PromptRow) -> list[int]:
    """Token ids of the chat, with the assistant turn opened."""
    ids = tokenizer.apply_chat_template(row.messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return list(ids)


def prompt_seed(run_seed: int, epoch: int, index: int) -> int:
    """Sampling seed of dataset row `index` in `epoch` (the learner's feeder uses the same).

    About run_seed * 1e13, with no upper bound: a run_seed of ~1.85 million or more gives seeds
    >= 2**64, which torch.Generator refuses; the engines take it through
    steadyrl.rl.generation.engine_seed (mod 2**63), both the same way. Non-negative for
    non-negative arguments (the Prompt contract's seed is >= 0)."""
    return (run_seed * 1_000_003 + epoch) * 10_000_019 + index


def prompt_batches(rows: list[PromptRow], batch: int, seed: int) -> Iterator[list[tuple[int, int, PromptRow]]]:
    """Endless (epoch, index, row) batches: each epoch a fresh seeded shuffle."""
    epoch = 0
    while True:
        order = list(range(len(rows)))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        for s in range(0, len(order) - batch + 1, batch):
            yield [(epoch, i, rows[i]) for i in order[s:s + batch]]
        epoch += 1


def prompt_order(n: int, batch: int, seed: int, start: int = 0) -> Iterator[tuple[int, int]]:
    """prompt_batches' (epoch, index) over a dataset of `n` rows, flat and endless, from
    position `start` (how many it yielded before: whole epochs are skipped without drawing
    them). Reads no row: an epoch's order is an array of n int64 (8 MB a million rows).
    Empty when n < batch (no epoch holds a batch)."""
    per_epoch = n // batch * batch
    if per_epoch == 0:
        return
    epoch, skip = divmod(start, per_epoch)
    while True:
        order = array("q", range(n))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)   # the same draws as a list's shuffle
        for k in range(skip, per_epoch):
            yield epoch, order[k]
        skip = 0
        epoch += 1


def run_loop(model: torch.nn.Module, tokenizer: Any, rows: list[PromptRow], cfg: LoopConfig,
             on_step: Callable[[int, dict[str, float]], None] | None = None) -> list[dict[str, float]]:
    """Train `model` in place for cfg.steps; returns one metrics dict per step."""
    torch.manual_seed(cfg.seed)
    scorer = resolve_scorer(cfg.scorer)
    gen = TorchGenerator(model, tokenizer)
    trainer = Trainer(model, tokenizer.pad_token_id, cfg.train)
    params = SamplingParams(n=cfg.group_size, temperature=cfg.train.temperature, top_p=cfg.top_p,
                            max_new_tokens=cfg.max_new_tokens)
    history = []
    batches = prompt_batches(rows, cfg.prompts_per_step, cfg.seed)
    for step in range(cfg.steps):
        t_step = time.perf_counter()
        batch = next(batches)
        prompt_ids = [encode_prompt(tokenizer, row) for _, _, row in batch]
        t0 = time.perf_counter()
        completions = gen.generate(prompt_ids, params, seeds=[prompt_seed(cfg.seed, e, i) for e, i, _ in batch])
        t_gen = time.perf_counter() - t0
        t0 = time.perf_counter()
        groups = []
        for (_, _, row), ids, comps in zip(batch, prompt_ids, completions, strict=True):
            rewards = [score_value(scorer(row.data_source, c.text, row.ground_truth, row.extra_info))[0]
                       for c in comps]
            groups.append(Group(ids, [c.token_ids for c in comps], rewards))
        t_reward = time.perf_counter() - t0
        metrics = trainer.step(groups)
        n_tokens = sum(len(r) for g in groups for r in g.responses)
        metrics.update({"step": step + 1, "timing_s/gen": t_gen, "timing_s/reward": t_reward,
                        "timing_s/step": time.perf_counter() - t_step,
                        "perf/gen_tokens_per_s": n_tokens / max(t_gen, 1e-9)})
        history.append(metrics)
        if on_step:
            on_step(step + 1, metrics)
    return history


class ScorerRaisedOnEveryItem(ValueError):
    """The evaluation's scorer failed on every item (raised, timed out, crashed, returned what
    is not a finite number): no accuracy can be measured. The message is the first item's
    error, which names the scorer (`steadyrl.model.rewards.raised`, steadyrl.model.scorepool)."""


@torch.no_grad()
def evaluate(model: torch.nn.Module, tokenizer: Any, rows: list[PromptRow], scorer: str = "numeric_match",
             max_new_tokens: int = 32, batch_size: int = 32,
             on_batch: Callable[[], None] | None = None,
             on_progress: Callable[[int, int], None] | None = None,
             limits: ScoringLimits | None = None) -> tuple[float, list[dict[str, Any]]]:
    """Greedy accuracy: share of rows whose reward is >= 1.0. Returns (accuracy, per-item results).

    The scorer runs as the reward server runs it: a rule in worker processes with `limits`
    (steadyrl.model.scorepool; default ScoringLimits(): item_timeout_s, memory_limit_mb, each
    generation batch scored within call_deadline_s), a model scorer in this process. on_batch
    is called after each generation batch (a service beats its liveness there), and on_progress
    with (rows done, rows) before the first batch and after each. An item the scorer fails on
    (raises, times out, crashes its process, returns what is not a finite number) counts as
    wrong (reward 0.0, its `error` and `kind` kept, one warning naming how many);
    ScorerRaisedOnEveryItem when it failed on every item.
    """
    limits = limits or ScoringLimits()
    with contextlib.ExitStack() as stack:
        pool = None
        if spec_kind(scorer) == "rule" and limits.pool_processes() > 0:
            pool = stack.enter_context(limits.pool())
        judge = build_scorer(scorer, pool=pool)
        judge.load()
        gen = TorchGenerator(model, tokenizer, batch_size=batch_size)
        params = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens)
        items = []
        errors: list[str] = []
        if on_progress:
            on_progress(0, len(rows))
        for s in range(0, len(rows), batch_size):
            chunk = rows[s:s + batch_size]
            outs = gen.generate([encode_prompt(tokenizer, r) for r in chunk], params)
            asked = [SimpleNamespace(data_source=r.data_source, prompt=r.messages[-1]["content"], response=o[0].text,
                                     ground_truth=r.ground_truth, extra_info=r.extra_info)
                     for r, o in zip(chunk, outs, strict=True)]
            try:
                results = judge.score(asked, deadline=time.monotonic() + limits.call_deadline_s)
                # items the deadline left (a slow reward, not a failing one) are asked again, the
                # heartbeat beating between calls: each call scores at least one item or times it out
                while todo := [i for i, r in enumerate(results) if r.get("kind") == DEADLINE]:
                    if on_batch:
                        on_batch()
                    again = judge.score([asked[i] for i in todo], deadline=time.monotonic() + limits.call_deadline_s)
                    for i, r in zip(todo, again, strict=True):
                        results[i] = r
            except ScorerError as e:   # a model scorer failed on the batch: each item's error
                results = [{"reward": None, "error": str(e), "kind": "scorer_error"} for _ in asked]
            for row, it, res in zip(chunk, asked, results, strict=True):
                if res["reward"] is None:
                    reward, extra = 0.0, {"error": res["error"], "kind": res.get("kind", "scorer_error")}
                    errors.append(res["error"])
                else:
                    reward, extra = res["reward"], res.get("extra", {})
                items.append({"prompt": row.messages[-1]["content"], "ground_truth": row.ground_truth,
                              "response": it.response, "reward": reward, "correct": reward >= 1.0, **extra})
            if on_batch:
                on_batch()
            if on_progress:
                on_progress(len(items), len(rows))
    if items and len(errors) == len(items):
        raise ScorerRaisedOnEveryItem(f"on all {len(items)} items; the first: {errors[0]}")
    if errors:
        log.warning("evaluation: the scorer failed on %d of %d items (counted wrong); the first: %s",
                    len(errors), len(items), errors[0])
    acc = sum(i["correct"] for i in items) / max(1, len(items))
    return acc, items
