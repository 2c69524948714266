"""One policy update from scored groups: GRPO, or PPO with a value head and GAE.

The learner service and the in-process reference loop both call `Trainer.step(groups)`;
the formulas live in `steadyrl.rl.core`. A step whose loss or gradient norm is not finite
raises `NonFiniteStep` and leaves nothing of itself applied. Shapes: N sequences (B prompts x G samples),
P prompt tokens (left padded), T response tokens (right padded), V vocabulary.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from steadyrl.rl import core

log = logging.getLogger(__name__)
_T = TypeVar("_T")


def is_out_of_memory(e: BaseException) -> bool:
    """torch.OutOfMemoryError (CUDA), or the CPU allocator's RuntimeError."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    msg = str(e).lower()
    return isinstance(e, RuntimeError) and ("out of memory" in msg or "can't allocate memory" in msg)


class RanksOutOfMemory(RuntimeError):
    """Another rank of the torch.distributed group ran out of memory in this part of the step
    (`Trainer._agreed`): this rank stops too, so every rank takes the out-of-memory fallback
    together and no collective waits for a rank that took another path."""


class NonFiniteStep(RuntimeError):
    """A step whose loss or gradient norm was not finite (NaN or infinite). Nothing of it was
    applied: the weights, the optimizer state, the LR schedule and the global step are those
    of the last good step, also when earlier minibatches of the step had been applied (they
    were rolled back).

    Attributes:
        what: "loss" or "grad_norm".
        value: the non-finite value (for a loss: the first non-finite micro-batch loss).
        epoch, minibatch: where it happened (0-based).
        rolled_back: optimizer steps of this step that had been applied and were undone.
        step: the step that was skipped (global step + 1).
    """

    def __init__(self, what: str, value: float, epoch: int, minibatch: int, rolled_back: int, step: int):
        super().__init__(f"non-finite {what} ({value}) in epoch {epoch}, minibatch {minibatch} of step {step}: "
                         f"the step was skipped ({rolled_back} applied optimizer steps rolled back)")
        self.what, self.value, self.epoch, self.minibatch = what, value, epoch, minibatch
        self.rolled_back, self.step = rolled_back, step


class TrainConfig(BaseModel):
    """Optimisation and loss settings (defaults follow verl where it has one)."""

    model_config = ConfigDict(extra="forbid")  # a typo is an error, not a silent default

    algorithm: Literal["grpo", "ppo"] = "grpo"
    lr: float = Field(1e-6, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "cosine"] = "constant"
    total_steps: int = Field(100, ge=1, description="For the cosine schedule.")
    max_grad_norm: float = Field(1.0, gt=0)
    ppo_epochs: int = Field(1, ge=1, description="Passes over each batch.")
    mini_batch_size: int | None = Field(None, ge=1, description="Sequences per optimizer step; None: whole batch.")
    micro_batch_size: int = Field(8, ge=1, description="Sequences per forward/backward (memory).")
    clip_low: float = Field(0.2, ge=0, lt=1)
    clip_high: float = Field(0.2, ge=0)
    clip_ratio_c: float | None = Field(3.0, gt=1, description="Dual-clip bound; None disables.")
    loss_agg: core.LossAgg = "token-mean"
    norm_adv_by_std: bool = Field(True, description="GRPO: divide by the group std (False: Dr. GRPO).")
    use_kl_loss: bool = Field(False, description="Add kl_coef x KL(pi || ref) to the loss.")
    kl_coef: float = Field(0.001, ge=0)
    kl_estimator: core.KLEstimator = "low_var_kl"
    kl_in_reward: bool = Field(False, description="PPO: subtract kl_coef x k1 from per-token rewards.")
    entropy_coeff: float = Field(0.0, ge=0)
    temperature: float = Field(1.0, gt=0, description="Must equal the sampling temperature.")
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)
    vf_coef: float = Field(0.5, ge=0)
    vf_clip: float = Field(0.2, gt=0)
    autocast: Literal["off", "bf16"] = Field(
        "off", description="bf16: the model's forward in the update (and any no-grad pass) under torch.autocast "
                           "to bfloat16; weights, gradients, AdamW state and the loss stay fp32 (the log-probs are "
                           "taken from fp32 logits). A lever where the CPU has native bf16 (AVX-512 BF16, AMX) or on "
                           "a GPU: an update micro-batch of SmolLM2 1.59x faster on a Zen 4 CPU (docs/benchmarks.md "
                           "\"This machine's peak\"); without native bf16 ~90x slower. Off by default.")
    oom_fallback: Literal["stay", "step", "off"] = Field(
        "stay", description="On out-of-memory in a step: retry it with gradient checkpointing and a 4x smaller "
                            "micro-batch and stay so for the run (stay), for that step only (step), or raise (off).")
    rollout_is: Literal["auto", "on", "off"] = Field(
        "auto", description="Truncated importance sampling (TIS, core.tis_weights) of groups that bring the rollout "
                            "engine's log-probs: each token's policy-gradient loss times min(pi_trainer / "
                            "pi_rollout, rollout_is_cap). auto: for groups generated by vLLM (Group.engine), whose "
                            "log-probs come from another engine in bf16; on: every such group; off: none (the "
                            "step is then exactly the one without rollout log-probs). The mismatch metrics are "
                            "reported either way.")
    rollout_is_cap: float = Field(2.0, ge=1.0, description="TIS truncation C: the largest per-token weight "
                                                           "(verl's rollout_is_threshold).")
    sharding: Literal["replicate", "fsdp"] = Field(
        "fsdp", description="With several ranks (learner.world_size > 1): fsdp shards the trained parameters and "
                            "AdamW moments over the ranks (FSDP2, torch.distributed.fsdp.fully_shard) and "
                            "checkpoints them sharded (torch.distributed.checkpoint); an out-of-memory error "
                            "restarts the group in the safe mode. replicate keeps the whole model, gradients and "
                            "optimizer state on every rank and all-reduces the gradients (DDP's scheme); an "
                            "out-of-memory error is agreed within the step. One rank: no effect.")
    device: Literal["cpu", "cuda"] = Field(
        "cpu", description="Where forward, backward and the optimizer run. cuda: rank r on GPU LOCAL_RANK (one GPU "
                           "per rank: learner.world_size = the GPUs), the training collectives over NCCL; the whole "
                           "policy that the policy store, the evaluation and the checkpoints read stays a CPU copy, "
                           "refreshed after every step. Not yet run on a GPU in this project's tests.")

    @field_validator("oom_fallback", "rollout_is", mode="before")
    @classmethod
    def _yaml_off(cls, v):
        # YAML 1.1 reads a bare `off` as false (and `on` as true)
        return "off" if v is False else "on" if v is True else v

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        if self.kl_in_reward and self.algorithm != "ppo":
            raise ValueError("kl_in_reward needs algorithm=ppo (GRPO puts KL in the loss: use_kl_loss)")
        return self

    @property
    def uses_ref(self) -> bool:
        return self.use_kl_loss or self.kl_in_reward

    def tis_for(self, engine: str) -> bool:
        """Whether TIS weighs a group with rollout log-probs made by `engine` ("" = unknown)."""
        return self.rollout_is == "on" or (self.rollout_is == "auto" and engine == "vllm")


@dataclass
class Group:
    """One prompt's samples and rewards, as the trainer needs them."""

    prompt_ids: list[int]
    responses: list[list[int]]           # G x (T_i,)
    rewards: list[float]                 # (G,)
    # G x (T_i,): log-probs of an older policy that sampled the responses. Give them only
    # when that policy is not the current one (a stale group); the ratio then starts from them.
    behaviour_logprobs: list[list[float]] | None = None
    # Scales the group's advantages, i.e. its share of the policy-gradient loss (0 excludes
    # it). The learner uses it for cache-scored groups.
    weight: float = 1.0
    # G x (T_i,): the rollout engine's log-probs of every response, fresh or stale (the actor's
    # Sample.logprobs). They measure the train/inference mismatch (mismatch/* metrics) and, when
    # TrainConfig.rollout_is says so, weigh the loss (TIS); None: neither.
    rollout_logprobs: list[list[float]] | None = None
    # The engine that generated the samples: "torch", "vllm", or "" (unknown). rollout_is "auto"
    # applies TIS to "vllm" groups only.
    engine: str = ""


class ValueHead(torch.nn.Module):
    """A linear value head on the policy's last hidden state (shared backbone)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.v = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.v.weight)
        torch.nn.init.zeros_(self.v.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:   # (N, L, H) -> (N, L)
        return self.v(hidden).squeeze(-1)


def build_batch(groups: list[Group], pad_id: int) -> dict[str, torch.Tensor]:
    """Pack groups into tensors: [left-padded prompt | right-padded response].

    Returns input_ids (N, P+T), attention_mask (N, P+T), position_ids (N, P+T),
    responses (N, T), response_mask (N, T), rewards (N,), group_sizes (B,), and P.
    Groups may differ in size (a data gate removed samples). Raises ValueError for an
    empty group.
    """
    seqs = [(g.prompt_ids, r) for g in groups for r in g.responses]
    P = max(len(p) for p, _ in seqs)
    T = max(max(len(r) for _, r in seqs), 1)
    ids, attn, resp, rmask = [], [], [], []
    for p, r in seqs:
        ids.append([pad_id] * (P - len(p)) + p + r + [pad_id] * (T - len(r)))
        attn.append([0] * (P - len(p)) + [1] * (len(p) + len(r)) + [0] * (T - len(r)))
        resp.append(r + [pad_id] * (T - len(r)))
        rmask.append([1.0] * len(r) + [0.0] * (T - len(r)))
    attention_mask = torch.tensor(attn)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    sizes = [len(g.responses) for g in groups]
    if min(sizes) < 1 or any(len(g.rewards) != len(g.responses) for g in groups):
        raise ValueError(f"every group needs >= 1 sample and one reward per sample, got sizes {sizes}")
    return {"input_ids": torch.tensor(ids), "attention_mask": attention_mask, "position_ids": position_ids,
            "responses": torch.tensor(resp), "response_mask": torch.tensor(rmask),
            "rewards": torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32),
            "group_sizes": torch.tensor(sizes), "P": torch.tensor(P)}


@dataclass
class RolloutLogprobs:
    """The rollout engine's log-probs of a batch, packed like build_batch's responses."""

    logp: torch.Tensor       # (N, T) the actor's log-probs; 0 on padding and in groups without them
    measured: torch.Tensor   # (N,) bool: rows the mismatch metrics are computed on
    tis: torch.Tensor        # (N,) bool: rows TIS weighs


def rollout_logprobs(groups: list[Group], T: int, cfg: TrainConfig) -> RolloutLogprobs | None:
    """The groups' `rollout_logprobs` as tensors, or None when no group brings them.

    The mismatch is measured on groups with rollout log-probs that the current policy sampled
    (no behaviour_logprobs): for a stale group the trainer no longer has the weights that
    sampled it, so its gap would mix the policy's change with the engines'. TIS weighs every
    group with rollout log-probs that `cfg.tis_for(group.engine)` names. Raises ValueError when
    a response's rollout log-probs are not as long as the response.
    """
    if all(g.rollout_logprobs is None for g in groups):
        return None
    N = sum(len(g.responses) for g in groups)
    logp = torch.zeros(N, T)                                                     # (N, T)
    measured = torch.zeros(N, dtype=torch.bool)                                  # (N,)
    tis = torch.zeros(N, dtype=torch.bool)                                       # (N,)
    row = 0
    for g in groups:
        G = len(g.responses)
        if g.rollout_logprobs is not None:
            if len(g.rollout_logprobs) != G or any(len(lp) != len(r) for lp, r in zip(g.rollout_logprobs,
                                                                                      g.responses)):
                raise ValueError(f"rollout_logprobs must hold one log-prob per response token, got lengths "
                                 f"{[len(lp) for lp in g.rollout_logprobs]} for responses of "
                                 f"{[len(r) for r in g.responses]}")
            for i, lp in enumerate(g.rollout_logprobs):
                logp[row + i, :len(lp)] = torch.tensor(lp, dtype=logp.dtype)
            measured[row:row + G] = g.behaviour_logprobs is None
            tis[row:row + G] = cfg.tis_for(g.engine)
        row += G
    return RolloutLogprobs(logp, measured, tis)


def behaviour_logprobs(groups: Sequence[Group], T: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The log-probs stale groups bring of their responses (`Group.behaviour_logprobs`) as
    (logp (N, T), where (N, T) bool: the positions they cover), or None when no group is stale."""
    if all(g.behaviour_logprobs is None for g in groups):
        return None
    N = sum(len(g.responses) for g in groups)
    logp = torch.zeros(N, T)                                                     # (N, T)
    where = torch.zeros(N, T, dtype=torch.bool)                                  # (N, T)
    row = 0
    for g in groups:
        rows: Sequence[list[float] | None] = g.behaviour_logprobs or [None] * len(g.responses)
        for lp in rows:
            if lp is not None:
                logp[row, :len(lp)] = torch.tensor(lp, dtype=logp.dtype)
                where[row, :len(lp)] = True
            row += 1
    return logp, where


def train_device(device: str) -> torch.device:
    """The torch.device of TrainConfig.device: "cpu", or "cuda" as cuda:LOCAL_RANK (torchrun's
    local rank; 0 alone). Raises ValueError naming `learner.train.device` when no GPU is
    visible, or fewer than LOCAL_RANK + 1."""
    if device == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if not torch.cuda.is_available() or torch.cuda.device_count() <= local:
        raise ValueError(f"learner.train.device is cuda, but this process sees {torch.cuda.device_count()} GPUs "
                         f"(local rank {local}): set it to cpu, or give each rank a GPU")
    return torch.device("cuda", local)


def _rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the torch.distributed group, (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Trainer:
    """Holds the policy, optimizer, LR schedule, optional frozen reference and value head.

    Args:
        model: causal LM being trained (updated in place; sharded, after every step from the
            shards).
        pad_id: tokenizer pad id.
        cfg: TrainConfig.

    Raises ValueError naming `learner.train.device` when it is cuda and no GPU is visible.

    Attributes:
        module: what forward and backward run on: `model`, or a copy of it on `device`
            (cuda), or with `cfg.sharding` fsdp over several ranks an FSDP2-sharded copy of it
            (parameters are DTensors).
        device: the torch.device `module` is on (cuda: cuda:LOCAL_RANK).
        sharded: whether `module` is sharded.
        pending_optimizer: rank 0, sharded: a restored whole optimizer state dict that
            steadyrl.rl.distributed.sync scatters to the shards before the first update.
    """

    def __init__(self, model, pad_id: int, cfg: TrainConfig):
        self.model, self.pad_id, self.cfg = model, pad_id, cfg
        self.device = train_device(cfg.device)
        core.warn_if_kl_is_off(cfg.uses_ref, cfg.kl_coef)
        self.ref: torch.nn.Module | None = None
        if cfg.uses_ref:
            self.ref = copy.deepcopy(model).to(self.device).eval()
            for p in self.ref.parameters():
                p.requires_grad_(False)
        self.value_head: ValueHead | None = (ValueHead(model.config.hidden_size).to(self.device)
                                             if cfg.algorithm == "ppo" else None)
        self.rank, self.world = _rank_and_world()
        # Data parallel over torch.distributed ranks (steadyrl/rl/distributed.py): every rank
        # holds the whole batch and backpropagates its share of the micro-batches (micro-batch i
        # on rank i % world); gradients, metric sums and the finiteness check are summed over
        # ranks, so the step equals the one-rank step (each micro-batch's weight is its share of
        # the whole minibatch, `core.microbatch_weight`). `module` is what forward and backward
        # run on: `model` itself, or a copy of it on the GPU, or with sharding fsdp a sharded
        # copy of it (FSDP2), whose full weights are gathered back into `model` after every
        # step (`model` stays the plain, whole CPU policy that the policy store, the
        # evaluation and the drift metric read; what is restored into it reaches `module`
        # before the next update: `push_weights`).
        self.sharded = self.world > 1 and cfg.sharding == "fsdp"
        self.module = model
        if self.sharded or cfg.device != "cpu":
            self.module = copy.deepcopy(model).to(self.device)
        self.checkpoint_group = None
        if self.sharded:
            import torch.distributed as dist

            from steadyrl.rl import distributed

            # sharded checkpoints' collectives run in a writer thread: a gloo group of their own,
            # made here, where every rank makes its trainer before any collective
            self.checkpoint_group = dist.new_group(backend="gloo")
            distributed.shard(self.module)
            # the frozen reference stays whole on every rank (no gradients, no optimizer state:
            # one copy of the weights), so its no-grad forwards hold no collective
            if self.value_head is not None:
                distributed.shard(self.value_head)
        params = list(self.module.parameters()) + (list(self.value_head.parameters()) if self.value_head else [])
        self.params = params
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: core.lr_lambda(s, cfg.warmup_steps, cfg.total_steps, cfg.lr_schedule))
        self.global_step = 0
        self.micro_batch_size = cfg.micro_batch_size   # 4x smaller in the safe mode
        self.safe_mode = False
        self.oom_fallbacks = 0                         # times a step ran out of memory and was retried
        self.pending_optimizer: dict | None = None     # rank 0, sharded: restored state to scatter (`sync`)
        self._pushed = self.module is self.model       # `module` holds what `model` holds
        if self.sharded and cfg.oom_fallback != "off":
            from steadyrl.rl import distributed

            if (remembered := distributed.remembered_safe_mode()) is not None:  # an earlier attempt ran out
                self._enter_safe_mode(f"an earlier attempt of the group ran out of memory: {remembered}")

    def push_weights(self) -> None:
        """Copy `model`'s weights into `module` when that is another copy (sharded, or on the
        GPU): a checkpoint or a policy version restored into `model` reaches the update. No
        collective (each rank keeps its shard of what it holds); `distributed.sync` calls it
        after its broadcast, `step` before its first update."""
        if self.module is not self.model:
            from steadyrl.rl import distributed

            distributed.place_into(self.model, self.module)
        self._pushed = True

    # -- out-of-memory fallback ------------------------------------------------------------
    def _enter_safe_mode(self, error: str) -> None:
        """Gradient checkpointing on, micro-batch 4x smaller; logged as an event."""
        self.safe_mode = True
        self.oom_fallbacks += 1
        before, self.micro_batch_size = self.micro_batch_size, max(1, self.micro_batch_size // 4)
        if self.sharded:   # gather each block for its forward and again for its backward only
            self.module.set_reshard_after_forward(True)
        if getattr(self.module, "supports_gradient_checkpointing", False):
            if hasattr(self.module, "activation_checkpointing_enable"):  # transformers >= 5
                self.module.activation_checkpointing_enable({"use_reentrant": False})
            else:
                self.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        log.warning("out of memory in a training step; retrying it with gradient checkpointing and a smaller "
                    "micro-batch", extra={"step": self.global_step + 1, "micro_batch_size": f"{before} -> "
                                          f"{self.micro_batch_size}", "error": error[:300],
                                          "mode": self.cfg.oom_fallback})

    def _leave_safe_mode(self) -> None:
        self.safe_mode = False
        self.micro_batch_size = self.cfg.micro_batch_size
        if getattr(self.module, "supports_gradient_checkpointing", False):
            disable = getattr(self.module, "activation_checkpointing_disable", None)   # transformers >= 5
            (disable or self.module.gradient_checkpointing_disable)()

    def _oom_guarded(self, fn: Callable[[], _T]) -> _T:
        """fn(), or -- when it runs out of memory and the fallback is on -- the safe mode and
        fn() once more. fn must leave nothing applied when it raises (no optimizer step)."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - only out-of-memory is handled
            if self.sharded and is_out_of_memory(e) and self.cfg.oom_fallback != "off" and not self.safe_mode:
                # the other ranks wait in a collective of this forward: this rank dies, torchrun
                # restarts the group, and every rank of the next attempt starts in the safe mode
                from steadyrl.rl import distributed

                distributed.remember_safe_mode(f"rank {self.rank}: {type(e).__name__}: {e}")
            if not is_out_of_memory(e) or self.cfg.oom_fallback == "off" or self.safe_mode or self.sharded:
                raise
            error = f"{type(e).__name__}: {e}"  # not `e`: its traceback holds the failed attempt's tensors
        # outside the except block, `e` is gone: the failed attempt's frames and tensors are freed
        self.opt.zero_grad(set_to_none=True)
        self._enter_safe_mode(error)
        return fn()

    def _agreed(self, fn: Callable[[], _T]) -> _T:
        """fn() on this rank, then every rank learns whether any ran out of memory in it (a MAX
        all-reduce of one flag): if one did, all raise -- the rank that did its own error, the
        others RanksOutOfMemory -- so `_oom_guarded` retries the same part in the safe mode on
        every rank alike (the same micro-batch size, hence the same split). fn must hold no
        collective. One rank: fn()."""
        if self.world == 1 or self.sharded:  # sharded: fn holds FSDP2's collectives (see _oom_guarded)
            return fn()
        import torch.distributed as dist

        error: BaseException | None = None
        result = None
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - only out-of-memory is agreed; the rest raise here
            if not is_out_of_memory(e):
                raise  # this rank dies; torchrun stops the group
            error = e
        flag = torch.tensor([1.0 if error is not None else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if error is not None:
            raise error
        if float(flag) > 0:
            raise RanksOutOfMemory(f"another rank ran out of memory (this is rank {self.rank} of {self.world})")
        return result  # type: ignore[return-value]

    # -- non-finite steps ------------------------------------------------------------------
    def _snapshot(self) -> tuple[list[torch.Tensor], dict[int, dict]]:
        """CPU copies of every trained parameter and its optimizer state (by position in
        self.params): what `_restore` puts back, bit for bit."""
        params = [p.detach().to("cpu", copy=True) for p in self.params]
        state = {i: {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                     for k, v in self.opt.state[p].items()}
                 for i, p in enumerate(self.params) if p in self.opt.state}
        return params, state

    @torch.no_grad()
    def _restore(self, snap: tuple[list[torch.Tensor], dict[int, dict]]) -> None:
        """Put a `_snapshot` back in place (the tensors keep their identity: the optimizer and
        any alias still point at them); optimizer state made since it is removed."""
        params, state = snap
        for p, saved in zip(self.params, params):
            p.copy_(saved)
        for i, p in enumerate(self.params):
            if i not in state:
                self.opt.state.pop(p, None)
                continue
            live = self.opt.state[p]
            for k, v in state[i].items():   # the optimizer updates its state in place: same keys
                if isinstance(v, torch.Tensor):
                    live[k].copy_(v)
                else:
                    live[k] = v

    def _skip(self, what: str, value: float, epoch: int, minibatch: int, applied: int,
              snap: tuple[list[torch.Tensor], dict[int, dict]] | None) -> NonFiniteStep:
        """Undo the step so far (`applied` optimizer steps, from `snap`), drop the gradients,
        and return the error to raise."""
        if applied:
            assert snap is not None, "a snapshot is taken before the first of several optimizer steps"
            self._restore(snap)
        self.opt.zero_grad(set_to_none=True)
        if self.safe_mode and self.cfg.oom_fallback == "step" and not self.sharded:  # sharded: stays
            self._leave_safe_mode()
        return NonFiniteStep(what, value, epoch, minibatch, applied, self.global_step + 1)

    # -- forward pieces ------------------------------------------------------------------
    def _forward(self, model: torch.nn.Module, b: dict[str, torch.Tensor], idx: slice | torch.Tensor,
                 need_values: bool = False,
                 need_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Response log-probs (n, T), and the entropy (n, T) and values (n, T) when asked (else None)."""
        P = int(b["P"])
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.autocast == "bf16"):
            out = model(input_ids=b["input_ids"][idx], attention_mask=b["attention_mask"][idx],
                        position_ids=b["position_ids"][idx], output_hidden_states=need_values, use_cache=False)
        logits = out.logits[:, P - 1:-1].float()                                 # (n, T, V) predicts responses
        logp = core.token_logprobs(logits, b["responses"][idx], self.cfg.temperature)   # (n, T)
        ent = core.entropy_from_logits(logits.float() / self.cfg.temperature) if need_entropy else None
        values = None
        if need_values:
            assert self.value_head is not None, "values need the PPO value head"
            values = self.value_head(out.hidden_states[-1][:, P - 1:-1].float())  # (n, T)
        return logp, ent, values

    def _accumulate(self, last: bool) -> None:
        """Sharded: before each micro-batch of a minibatch on this rank, whether its backward is
        the last: only then are the gradients reduce-scattered and the parameters resharded.
        Before it, the blocks stay gathered and their gradients accumulate whole on each rank
        (FSDP2's `set_requires_gradient_sync` / `set_reshard_after_backward`), so a minibatch
        costs one all-gather and one reduce-scatter per block, not one per micro-batch. The price
        is memory: whole weights and whole gradients on every rank during the minibatch. In the
        safe mode every micro-batch reduce-scatters and reshards (and blocks reshard after their
        forward too: `_enter_safe_mode`), so only the shards stay between them."""
        last = last or self.safe_mode   # the safe mode trades this speed back for memory
        for root in (self.module, self.value_head):
            if root is not None:
                root.set_requires_gradient_sync(last)         # type: ignore[operator]
                root.set_reshard_after_backward(last)         # type: ignore[operator]

    def _idle_backward(self, b: dict[str, torch.Tensor], idx: torch.Tensor) -> None:
        """A forward and backward of micro-batch `idx` weighted 0: the collectives FSDP2 runs in
        them (all-gathers, reduce-scatters), with a gradient of exactly 0 (finite activations)."""
        logp, _, values = self._forward(self.module, b, idx, need_values=self.cfg.algorithm == "ppo")
        loss = logp.sum() * 0.0 + (values.sum() * 0.0 if values is not None else 0.0)
        loss.backward()

    @torch.no_grad()
    def _no_grad_pass(self, model: torch.nn.Module, b: dict[str, torch.Tensor],
                      need_values: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (N, T) and, when asked, values (N, T) of the whole batch, by micro-batches."""
        N = b["input_ids"].shape[0]
        mb = self.micro_batch_size
        logps: list[torch.Tensor] = []
        vals: list[torch.Tensor] = []
        for i in range(0, N, mb):
            lp, _, v = self._forward(model, b, slice(i, i + mb), need_values=need_values)
            logps.append(lp)
            if v is not None:   # need_values
                vals.append(v)
        return torch.cat(logps), (torch.cat(vals) if need_values else None)

    # -- one step ------------------------------------------------------------------------
    def _all_reduce(self, mb_sums: dict[str, float],
                    losses: list[torch.Tensor]) -> tuple[dict[str, float], list[torch.Tensor]]:
        """Sum this minibatch's gradients and metric sums over the ranks (in place / returned),
        and gather every rank's micro-batch losses (rank order), so every rank takes the same
        decisions (clip, skip a non-finite step) from the same numbers."""
        import torch.distributed as dist

        if not self.sharded:  # FSDP2 reduce-scattered (summed) the gradients in the backward already
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
            flat = torch.cat([g.reshape(-1) for g in grads])                    # (sum of numels,)
            dist.all_reduce(flat)
            offset = 0
            for p, g in zip(self.params, grads):   # back in place: two copies of the gradients at most
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                p.grad = g
                offset += g.numel()
            del flat
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, (mb_sums, [float(x) for x in losses]))
        total: dict[str, float] = {}
        all_losses: list[torch.Tensor] = []
        for sums, ls in gathered:
            for k, v in sums.items():
                total[k] = total.get(k, 0.0) + v
            all_losses.extend(torch.tensor(x) for x in ls)
        return total, all_losses

    def step(self, groups: list[Group]) -> dict[str, float]:
        """Update the policy on `groups`; returns per-step metrics (verl names).

        Groups may differ in size. Groups with `rollout_logprobs` add the train/inference
        mismatch metrics (mismatch/*) and, where `cfg.rollout_is` says so, TIS weights
        (rollout_is/*); without any, or with rollout_is off, the step is exactly the one
        without them. Raises ValueError for an empty group, and NonFiniteStep
        when a minibatch's loss or gradient norm is not finite: then nothing of the step is
        applied (weights, optimizer state, LR schedule and global step stay those of the last
        good step). A step of one optimizer step checks before it; a step of several (epochs,
        minibatches) takes a CPU copy of the weights and optimizer state before the first and
        puts it back.
        """
        cfg, t_start = self.cfg, time.perf_counter()
        if not self._pushed:
            self.push_weights()
        dev = self.device
        b = {k: v.to(dev) for k, v in build_batch(groups, self.pad_id).items()}
        mask = b["response_mask"]                                                # (N, T)
        sizes = b["group_sizes"]                                                 # (B,)
        N = mask.shape[0]
        group_weight = torch.tensor([g.weight for g in groups], device=dev).repeat_interleave(sizes)   # (N,)
        timing: dict[str, float] = {}
        self.module.train()
        oom_before = self.oom_fallbacks

        # Stale groups: the policy that sampled them is older than the one being updated; the
        # ratio pi_theta / pi_behaviour starts from the log-probs they bring (decoupled PPO).
        # For fresh groups the behaviour log-probs are the current policy's. One GRPO update on
        # the whole batch (one epoch, one minibatch) takes those from its own forward (ratio 1):
        # no separate no-grad pass, whether or not some groups are stale.
        stale = behaviour_logprobs(groups, mask.shape[1])                       # ((N, T), (N, T)) or None
        if stale is not None:
            stale = (stale[0].to(dev), stale[1].to(dev))
        one_pass = cfg.algorithm == "grpo" and cfg.ppo_epochs == 1 and (cfg.mini_batch_size or N) >= N
        old_logp: torch.Tensor | None = None                                     # (N, T)
        old_values: torch.Tensor | None = None                                   # (N, T), PPO
        if not one_pass:
            t0 = time.perf_counter()
            old_logp, old_values = self._oom_guarded(lambda: self._agreed(
                lambda: self._no_grad_pass(self.module, b, need_values=cfg.algorithm == "ppo")))
            if stale is not None:
                old_logp = torch.where(stale[1], stale[0], old_logp)
            timing["old_log_prob"] = time.perf_counter() - t0

        # Train/inference mismatch: the rollout engine's log-probs of the responses against the
        # trainer's behaviour log-probs (old_logp, or in one pass the update's own forward, filled
        # in below). TIS (Yao et al. 2025) multiplies each token's policy-gradient loss by
        # min(pi_trainer / pi_rollout, C): rows it does not weigh get 1.
        ro = rollout_logprobs(groups, mask.shape[1], cfg)                       # None: no group has them
        if ro is not None:
            ro = RolloutLogprobs(ro.logp.to(dev), ro.measured.to(dev), ro.tis.to(dev))
        tis = ro is not None and bool(ro.tis.any())
        trainer_logp = old_logp                                                 # (N, T) or None
        tis_w: torch.Tensor | None = None                                       # (N, T)
        if ro is not None and one_pass:
            trainer_logp = torch.zeros_like(mask)
            tis_w = torch.ones_like(mask) if tis else None
        elif tis:
            assert ro is not None and old_logp is not None
            tis_w = torch.where(ro.tis[:, None], core.tis_weights(old_logp, ro.logp, mask, cfg.rollout_is_cap), 1.0)
        ref_logp: torch.Tensor | None = None                                     # (N, T)
        if (ref := self.ref) is not None:
            t0 = time.perf_counter()
            ref_logp, _ = self._oom_guarded(lambda: self._agreed(lambda: self._no_grad_pass(ref, b)))
            timing["ref"] = time.perf_counter() - t0

        # Advantages
        returns: torch.Tensor | None = None
        if cfg.algorithm == "grpo":
            seq_adv = core.grpo_advantages_by_group(b["rewards"], sizes.tolist(), cfg.norm_adv_by_std)  # (N,)
            advantages = core.outcome_advantages(seq_adv, mask)                            # (N, T)
        else:
            assert old_logp is not None and old_values is not None   # PPO is never one pass here
            token_rewards = core.last_token_rewards(b["rewards"], mask)                    # (N, T)
            if cfg.kl_in_reward:
                assert ref_logp is not None
                token_rewards = core.kl_penalized_rewards(token_rewards, old_logp, ref_logp, mask, cfg.kl_coef)
            advantages, returns = core.gae(token_rewards, old_values, mask, cfg.gamma, cfg.lam)   # (N, T) each
            advantages = core.masked_whiten(advantages, mask)   # over the whole batch, as verl (not per minibatch)
        advantages = advantages * group_weight[:, None]        # (N, T); cache-scored groups weigh less

        # Update
        t0 = time.perf_counter()
        mini = cfg.mini_batch_size or N
        sums: dict[str, float] = {}
        n_updates = 0
        grad_norms = []
        gen = torch.Generator().manual_seed(self.global_step)
        planned = cfg.ppo_epochs * math.ceil(N / mini)           # optimizer steps of this step
        snap: tuple[list[torch.Tensor], dict[int, dict]] | None = None
        for epoch in range(cfg.ppo_epochs):
            order = (torch.randperm(N, generator=gen) if mini < N else torch.arange(N)).to(dev)
            for s in range(0, N, mini):
                mb_idx = order[s:s + mini]

                def minibatch(mb_idx=mb_idx):
                    """Gradients of one minibatch (nothing applied): its metric sums, grad norm and
                    micro-batch losses (checked for finiteness by the caller)."""
                    mb_sums: dict[str, float] = {}
                    losses: list[torch.Tensor] = []
                    self.opt.zero_grad(set_to_none=True)
                    self._agreed(lambda: backprop(mb_idx, mb_sums, losses))
                    if self.world > 1:
                        mb_sums, losses = self._all_reduce(mb_sums, losses)
                    return mb_sums, core.clip_grad_norm(self.params, cfg.max_grad_norm), losses

                def backprop(mb_idx: torch.Tensor, mb_sums: dict[str, float], losses: list[torch.Tensor]) -> None:
                    """This rank's micro-batches of the minibatch: gradients accumulated, metric
                    sums and losses appended (no collective: `_agreed` runs it)."""
                    starts = list(range(0, len(mb_idx), self.micro_batch_size))
                    plan: list[int | None] = list(starts[self.rank::self.world])
                    if self.sharded and len(plan) < -(-len(starts) // self.world):
                        # FSDP2's forward and backward are collectives: every rank runs as many
                        # as the rank with the most micro-batches, this one once more on a
                        # zero-weighted copy of the first (None: its gradient adds exactly 0)
                        plan.insert(0, None)
                    for j, m in enumerate(plan):
                        if self.sharded:
                            self._accumulate(last=j == len(plan) - 1)
                        if m is None:
                            self._idle_backward(b, mb_idx[:self.micro_batch_size])
                            continue
                        idx = mb_idx[m:m + self.micro_batch_size]
                        # share of the minibatch in this micro-batch, so the sum equals the minibatch loss
                        weight = core.microbatch_weight(mask[idx], mask[mb_idx], cfg.loss_agg)
                        sub = {k: (v[idx] if k != "P" else v) for k, v in b.items()
                               if k not in ("rewards", "group_sizes")}
                        logp, ent, values = self._forward(self.module, sub, slice(None),
                                                          need_values=cfg.algorithm == "ppo",
                                                          need_entropy=True)
                        assert ent is not None                                 # need_entropy=True
                        mb_mask = mask[idx]
                        if one_pass:
                            behaviour = logp.detach()
                            if stale is not None:                              # the sampler's, where stale
                                behaviour = torch.where(stale[1][idx], stale[0][idx], behaviour)
                            if ro is not None:                                 # the trainer's side
                                assert trainer_logp is not None
                                trainer_logp[idx] = behaviour
                                if tis_w is not None:
                                    tis_w[idx] = torch.where(ro.tis[idx, None], core.tis_weights(
                                        behaviour, ro.logp[idx], mb_mask, cfg.rollout_is_cap), 1.0)
                        else:
                            assert old_logp is not None
                            behaviour = old_logp[idx]
                        pg_loss, pg_m = core.policy_loss(logp, behaviour, advantages[idx], mb_mask,
                                                         cfg.clip_low, cfg.clip_high, cfg.clip_ratio_c, cfg.loss_agg,
                                                         is_weights=tis_w[idx] if tis_w is not None else None)
                        # loss = L_pg - c_ent * H + beta * KL + c_vf * L_VF, minimised: the negated PPO
                        # objective (Schulman et al. 2017, eq. 9) with GRPO's KL term (Shao et al. 2024, eq. 3)
                        loss = pg_loss
                        entropy = core.aggregate(ent, mb_mask, cfg.loss_agg)
                        if cfg.entropy_coeff:
                            loss = loss - cfg.entropy_coeff * entropy
                        if ref_logp is not None:  # KL(pi || ref) as the update sees it (k3), for people
                            kl_ref = core.masked_mean(core.kl_estimate(logp.detach(), ref_logp[idx], "k3"), mb_mask)
                            mb_sums["actor/kl_ref"] = (mb_sums.get("actor/kl_ref", 0.0)
                                                       + float(kl_ref) * float(weight))
                        if cfg.use_kl_loss:
                            assert ref_logp is not None                        # uses_ref made self.ref
                            kl = core.aggregate(core.kl_estimate(logp, ref_logp[idx], cfg.kl_estimator), mb_mask,
                                                cfg.loss_agg)
                            loss = loss + cfg.kl_coef * kl
                            mb_sums["actor/kl_loss"] = (mb_sums.get("actor/kl_loss", 0.0)
                                                        + float(kl.detach()) * float(weight))
                        if cfg.algorithm == "ppo":
                            assert values is not None and old_values is not None and returns is not None
                            vf_loss, vf_clip = core.value_loss(values, old_values[idx], returns[idx], mb_mask,
                                                               cfg.vf_clip, cfg.loss_agg)
                            loss = loss + cfg.vf_coef * vf_loss
                            mb_sums["critic/vf_loss"] = (mb_sums.get("critic/vf_loss", 0.0)
                                                         + float(vf_loss.detach()) * float(weight))
                            mb_sums["critic/vf_clipfrac"] = (mb_sums.get("critic/vf_clipfrac", 0.0)
                                                             + float(vf_clip) * float(weight))
                        (loss * weight).backward()
                        losses.append(loss.detach())
                        for k, v in (("actor/pg_loss", pg_loss), ("actor/entropy", entropy),
                                     ("actor/pg_clipfrac", pg_m["clip_frac"]), ("actor/ppo_kl", pg_m["approx_kl"]),
                                     ("actor/pg_clipfrac_lower", pg_m["dual_clip_frac"])):
                            mb_sums[k] = mb_sums.get(k, 0.0) + float(v.detach()) * float(weight)

                mb_sums, grad_norm, losses = self._oom_guarded(minibatch)
                finite = torch.isfinite(torch.stack(losses))
                if not bool(finite.all()):
                    bad = float(torch.stack(losses)[~finite][0])
                    raise self._skip("loss", bad, epoch, s // mini, n_updates, snap)
                if not math.isfinite(grad_norm):
                    raise self._skip("grad_norm", grad_norm, epoch, s // mini, n_updates, snap)
                if n_updates == 0 and planned > 1:   # more optimizer steps follow: keep this one's start
                    snap = self._snapshot()
                for k, v in mb_sums.items():
                    sums[k] = sums.get(k, 0.0) + v
                grad_norms.append(grad_norm)
                self.opt.step()
                n_updates += 1
        if self.world > 1 and ro is not None and one_pass:
            # each rank filled the rows of its micro-batches: zeros (TIS weights: ones) elsewhere
            import torch.distributed as dist

            assert trainer_logp is not None
            dist.all_reduce(trainer_logp)
            if tis_w is not None:
                tis_w -= 1.0
                dist.all_reduce(tis_w)
                tis_w += 1.0
        if self.module is not self.model:  # the whole updated weights into `model`, on every rank
            from steadyrl.rl import distributed

            distributed.gather_into(self.module, self.model)
        lr = float(self.sched.get_last_lr()[0])
        self.sched.step()
        self.global_step += 1
        timing["update_actor"] = time.perf_counter() - t0

        metrics = {k: v / n_updates for k, v in sums.items()}
        with torch.no_grad():
            r = b["rewards"]
            metrics.update({
                "critic/score/mean": float(r.mean()), "critic/score/std": float(r.std()) if r.numel() > 1 else 0.0,
                "critic/advantages/mean": float(core.masked_mean(advantages, mask)),
                "critic/advantages/var": float(core.masked_var(advantages, mask)),
                "actor/grad_norm": sum(grad_norms) / len(grad_norms), "actor/lr": lr,
                "response_length/mean": float(mask.sum(1).mean()),
                "training/global_step": self.global_step,
            })
            if ro is not None and bool(ro.measured.any()):
                assert trainer_logp is not None
                rows = ro.measured
                metrics.update({f"mismatch/{k}": v for k, v in
                                core.mismatch_metrics(trainer_logp[rows], ro.logp[rows], mask[rows]).items()})
            if ro is not None and tis_w is not None:
                tis_mask = mask * ro.tis[:, None]                                # (N, T) tokens TIS weighs
                metrics["rollout_is/mean_weight"] = float(core.masked_mean(tis_w, tis_mask))
                metrics["rollout_is/clipped_frac"] = float(core.masked_mean((tis_w >= cfg.rollout_is_cap).float(),
                                                                            tis_mask))
        total = time.perf_counter() - t_start
        metrics.update({f"timing_s/{k}": v for k, v in timing.items()})
        metrics["timing_s/train_step"] = total
        metrics["perf/train_tokens_per_s"] = float(b["attention_mask"].sum()) / total
        metrics["perf/oom_fallback"] = float(self.oom_fallbacks - oom_before)   # 1: this step ran out of memory
        metrics["perf/safe_mode"] = float(self.safe_mode)
        if self.safe_mode and self.cfg.oom_fallback == "step" and not self.sharded:  # sharded: stays
            self._leave_safe_mode()
        return metrics
