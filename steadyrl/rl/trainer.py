"""One policy update from scored groups: `Trainer.step(groups)`.

The learner service and the in-process reference loop both call it. What the update computes
is `steadyrl.rl.algos` (estimators and losses registered by name, `minibatch_loss`) over the
formulas of `steadyrl.rl.core`; this module runs it: the batch on the device, the no-grad
passes, the minibatch loop and its optimizer steps, micro-batches split over the ranks
(`steadyrl.rl.distributed`), the out-of-memory fallback and the rollback of a non-finite step
(`NonFiniteStep`: nothing of the step applied). The update itself is `Trainer._update`, read
top to bottom: the minibatch loop, each micro-batch's forward, loss and backward, then the
ranks' agreement on running out of memory and the fallback as plain steps. Shapes: N
sequences (B prompts x G samples), P prompt tokens (left padded), T response tokens (right
padded), V vocabulary.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

from steadyrl.rl import algos, core, distributed
from steadyrl.rl.algos import MetricSums, MicroBatch
from steadyrl.rl.batch import Behaviour, Group, behaviour_logprobs, build_batch
from steadyrl.rl.config import TrainConfig, resolve_autocast
from steadyrl.rl.distributed import train_device
from steadyrl.rl.errors import NonFiniteStep, RanksOutOfMemory, is_out_of_memory
from steadyrl.rl.tis import RolloutCorrection, RolloutLogprobs, rollout_logprobs

# what importers of this module have always found here
__all__ = ["Group", "NonFiniteStep", "RanksOutOfMemory", "RolloutLogprobs", "TrainConfig", "Trainer", "ValueHead",
           "behaviour_logprobs", "build_batch", "is_out_of_memory", "rollout_logprobs", "train_device"]

log = logging.getLogger(__name__)
#: `Trainer._snapshot`: CPU copies of the trained parameters, and their optimizer state by position
Snapshot = tuple[list[torch.Tensor], dict[int, dict[str, Any]]]


class ValueHead(torch.nn.Module):
    """A linear value head on the policy's last hidden state (shared backbone)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.v = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.v.weight)
        torch.nn.init.zeros_(self.v.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:   # (N, L, H) -> (N, L)
        v: torch.Tensor = self.v(hidden)                           # (N, L, 1)
        return v.squeeze(-1)




@dataclass
class StepInputs:
    """What every minibatch of a step reads: the batch on the device and what was computed
    from it before the update (all rows, N)."""

    batch: dict[str, torch.Tensor]        # build_batch's, on the device
    advantages: torch.Tensor              # (N, T)
    returns: torch.Tensor | None          # (N, T), critic
    behaviour: Behaviour
    ref_logp: torch.Tensor | None         # (N, T), with a reference
    tis: RolloutCorrection | None         # with rollout log-probs

    @property
    def mask(self) -> torch.Tensor:       # (N, T)
        return self.batch["response_mask"]


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
        progress: called after each micro-batch's forward (the no-grad passes' too) and
            backward: the learner beats its heartbeat there (default: nothing).
    """

    def __init__(self, model: torch.nn.Module, pad_id: int, cfg: TrainConfig):
        self.device = train_device(cfg.device)
        if cfg.autocast == "auto":   # the learner resolves it at start (and logs why); direct callers here
            cfg = cfg.model_copy(update={"autocast": resolve_autocast(cfg.autocast, cfg.device)[0]})
        self.model, self.pad_id, self.cfg = model, pad_id, cfg
        core.warn_if_kl_is_off(cfg.uses_ref, cfg.kl_coef)
        self.ref: torch.nn.Module | None = None
        if cfg.uses_ref:
            self.ref = copy.deepcopy(model).to(self.device).eval()
            for p in self.ref.parameters():
                p.requires_grad_(False)
        self.estimator = algos.estimator_of(cfg.algorithm)
        self.policy_loss = algos.policy_loss_of(cfg.algorithm)
        self.critic = self.estimator.critic   # a value head, trained with the policy
        hf_config: Any = model.config   # a transformers model's
        self.value_head: ValueHead | None = (ValueHead(hf_config.hidden_size).to(self.device)
                                             if self.critic else None)
        self.rank, self.world = distributed.rank_and_world()
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
        self.checkpoint_group: dist.ProcessGroup | None = None
        if self.sharded:
            # sharded checkpoints' collectives run in a writer thread: a gloo group of their own,
            # made here, where every rank makes its trainer before any collective (so a member of it)
            self.checkpoint_group = cast(dist.ProcessGroup, dist.new_group(backend="gloo"))
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
        self.progress: Callable[[], None] = lambda: None
        self.pending_optimizer: dict[str, Any] | None = None   # rank 0, sharded: restored state to scatter (`sync`)
        self._pushed = self.module is self.model       # `module` holds what `model` holds
        if (self.sharded and cfg.oom_fallback != "off"
                and (remembered := distributed.remembered_safe_mode()) is not None):  # an earlier attempt ran out
            self._enter_safe_mode(f"an earlier attempt of the group ran out of memory: {remembered}")

    def push_weights(self) -> None:
        """Copy `model`'s weights into `module` when that is another copy (sharded, or on the
        GPU): a checkpoint or a policy version restored into `model` reaches the update. No
        collective (each rank keeps its shard of what it holds); `distributed.sync` calls it
        after its broadcast, `step` before its first update."""
        if self.module is not self.model:
            distributed.place_into(self.model, self.module)
        self._pushed = True

    # -- out-of-memory fallback ------------------------------------------------------------
    def _enter_safe_mode(self, error: str) -> None:
        """Gradient checkpointing on, micro-batch 4x smaller; logged as an event."""
        self.safe_mode = True
        self.oom_fallbacks += 1
        before, self.micro_batch_size = self.micro_batch_size, max(1, self.micro_batch_size // 4)
        if self.sharded:   # gather each block for its forward and again for its backward only
            self.module.set_reshard_after_forward(True)   # type: ignore[operator]  # an FSDPModule's method
        hf: Any = self.module   # a transformers model: its gradient checkpointing API
        if getattr(hf, "supports_gradient_checkpointing", False):
            if hasattr(hf, "activation_checkpointing_enable"):  # transformers >= 5
                hf.activation_checkpointing_enable({"use_reentrant": False})
            else:
                hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        log.warning("out of memory in a training step; retrying it with gradient checkpointing and a smaller "
                    "micro-batch", extra={"step": self.global_step + 1, "micro_batch_size": f"{before} -> "
                                          f"{self.micro_batch_size}", "error": error[:300],
                                          "mode": self.cfg.oom_fallback})

    def _leave_safe_mode(self) -> None:
        self.safe_mode = False
        self.micro_batch_size = self.cfg.micro_batch_size
        hf: Any = self.module   # a transformers model: its gradient checkpointing API
        if getattr(hf, "supports_gradient_checkpointing", False):
            disable = getattr(hf, "activation_checkpointing_disable", None)   # transformers >= 5
            (disable or hf.gradient_checkpointing_disable)()

    def _end_of_step(self) -> None:
        """After a step, done or skipped: oom_fallback "step" leaves the safe mode (sharded, the
        group's restart put every rank in it: it stays)."""
        if self.safe_mode and self.cfg.oom_fallback == "step" and not self.sharded:
            self._leave_safe_mode()

    def _agree(self, oom: Exception | None) -> Exception | None:
        """Whether any rank ran out of memory in the part just run (a MAX all-reduce of one flag,
        every rank at the same point): this rank's own error, RanksOutOfMemory where only another
        rank's, None where none did. So every rank takes the fallback together, with the same
        micro-batch size, hence the same split. One rank, or sharded (the part held FSDP2's
        collectives: a rank out of memory dies, see `_fall_back`): `oom` as it is, no collective."""
        if self.world == 1 or self.sharded:
            return oom
        flag = torch.tensor([0.0 if oom is None else 1.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if oom is None and float(flag) > 0:
            return RanksOutOfMemory(f"another rank ran out of memory (this is rank {self.rank} of {self.world})")
        return oom

    def _fall_back(self, oom: Exception) -> None:
        """The out-of-memory fallback (`cfg.oom_fallback`): the safe mode (`_enter_safe_mode`),
        after which the caller runs the part again. Raises `oom` when the fallback is off, was
        taken already, or the module is sharded: then this rank dies (the others wait in a
        collective of its forward) and, the fallback on, it leaves word for torchrun's restart of
        the group, whose every rank starts in the safe mode."""
        if self.sharded and self.cfg.oom_fallback != "off" and not self.safe_mode:
            distributed.remember_safe_mode(f"rank {self.rank}: {type(oom).__name__}: {oom}")
        if self.cfg.oom_fallback == "off" or self.safe_mode or self.sharded:
            raise oom
        oom.__traceback__ = None   # its frames hold the failed attempt's tensors: freed before the retry
        self.opt.zero_grad(set_to_none=True)
        self._enter_safe_mode(f"{type(oom).__name__}: {oom}")

    # -- non-finite steps ------------------------------------------------------------------
    def _snapshot(self) -> Snapshot:
        """CPU copies of every trained parameter and its optimizer state (by position in
        self.params): what `_restore` puts back, bit for bit."""
        params = [p.detach().to("cpu", copy=True) for p in self.params]
        state = {i: {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                     for k, v in self.opt.state[p].items()}
                 for i, p in enumerate(self.params) if p in self.opt.state}
        return params, state

    @torch.no_grad()
    def _restore(self, snap: Snapshot) -> None:
        """Put a `_snapshot` back in place (the tensors keep their identity: the optimizer and
        any alias still point at them); optimizer state made since it is removed."""
        params, state = snap
        for p, saved in zip(self.params, params, strict=True):
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
              snap: Snapshot | None) -> NonFiniteStep:
        """Undo the step so far (`applied` optimizer steps, from `snap`), drop the gradients,
        and return the error to raise."""
        if applied:
            assert snap is not None, "a snapshot is taken before the first of several optimizer steps"
            self._restore(snap)
        self.opt.zero_grad(set_to_none=True)
        self._end_of_step()
        return NonFiniteStep(what, value, epoch, minibatch, applied, self.global_step + 1)

    # -- forward pieces ------------------------------------------------------------------
    def _forward(self, model: torch.nn.Module, b: dict[str, torch.Tensor], idx: slice | torch.Tensor,
                 need_values: bool = False,
                 need_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Response log-probs (n, T), and the entropy (n, T) and values (n, T) when asked (else None).

        The LM head runs only on the T + 1 last positions (`logits_to_keep`): the prompt's own
        logits are never used, and at the default shape they were 71 % of the head's work."""
        P = int(b["P"])
        T = b["responses"].shape[1]
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.autocast == "bf16"):
            out = model(input_ids=b["input_ids"][idx], attention_mask=b["attention_mask"][idx],
                        position_ids=b["position_ids"][idx], output_hidden_states=need_values, use_cache=False,
                        logits_to_keep=T + 1)                                    # logits (n, T + 1, V)
        logits = out.logits[:, :-1].float()                                      # (n, T, V) predicts responses
        logp = core.token_logprobs(logits, b["responses"][idx], self.cfg.temperature)   # (n, T)
        ent = core.entropy_from_logits(logits.float() / self.cfg.temperature) if need_entropy else None
        values = None
        if need_values:
            assert self.value_head is not None, "values need the PPO value head"
            values = self.value_head(out.hidden_states[-1][:, P - 1:-1].float())  # (n, T)
        self.progress()
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

    @property
    def micro_tokens(self) -> int | None:
        """max_tokens_per_micro_batch, 4x smaller in the safe mode (as micro_batch_size)."""
        tokens = self.cfg.max_tokens_per_micro_batch
        return None if tokens is None else max(1, tokens // 4) if self.safe_mode else tokens

    def micro_rows(self, width: int) -> int:
        """Rows of one micro-batch when every row is `width` tokens (the batch's padded prompt +
        response): micro_batch_size, fewer where rows x width would pass
        max_tokens_per_micro_batch, at least 1. The forward's activations are rows x width x
        hidden per layer and its logits rows x (T + 1) x V floats, so this bounds a micro-batch's
        memory at any answer length."""
        if self.micro_tokens is None:
            return self.micro_batch_size
        return max(1, min(self.micro_batch_size, self.micro_tokens // width))

    def _idle_backward(self, b: dict[str, torch.Tensor], idx: torch.Tensor) -> None:
        """A forward and backward of micro-batch `idx` weighted 0: the collectives FSDP2 runs in
        them (all-gathers, reduce-scatters), with a gradient of exactly 0 (finite activations)."""
        logp, _, values = self._forward(self.module, b, idx, need_values=self.critic)
        loss = logp.sum() * 0.0 + (values.sum() * 0.0 if values is not None else 0.0)
        loss.backward()   # type: ignore[no-untyped-call, unused-ignore]  # --strict: torch's backward is unannotated

    @torch.no_grad()
    def _no_grad_pass(self, model: torch.nn.Module, b: dict[str, torch.Tensor],
                      need_values: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (N, T) and, when asked, values (N, T) of the whole batch, by micro-batches.
        Out of memory on a rank: as in `_update`, the ranks agree on it and the pass runs again
        in the safe mode where the fallback takes it."""
        N, width = b["input_ids"].shape                                        # (N, P + T)
        while True:   # once; once more, in the safe mode, after running out of memory
            logps, vals, oom = list[torch.Tensor](), list[torch.Tensor](), None
            try:
                mb = self.micro_rows(width)
                for i in range(0, N, mb):
                    lp, _, v = self._forward(model, b, slice(i, i + mb), need_values=need_values)
                    logps.append(lp)
                    if v is not None:   # need_values
                        vals.append(v)
            except Exception as e:  # noqa: BLE001 - only out-of-memory is agreed and falls back
                if not is_out_of_memory(e):
                    raise  # this rank dies; torchrun stops the group
                oom, logps, vals = e, [], []
            if (oom := self._agree(oom)) is None:
                return torch.cat(logps), (torch.cat(vals) if need_values else None)
            self._fall_back(oom)   # raises it unless the fallback takes it

    # -- one step ------------------------------------------------------------------------
    def _all_reduce(self, sums: MetricSums, losses: list[torch.Tensor]) -> tuple[MetricSums, list[torch.Tensor]]:
        """Sum this minibatch's gradients and metric sums over the ranks (in place / returned),
        and gather every rank's micro-batch losses (rank order), so every rank takes the same
        decisions (clip, skip a non-finite step) from the same numbers."""
        if not self.sharded:  # FSDP2 reduce-scattered (summed) the gradients in the backward already
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
            flat = torch.cat([g.reshape(-1) for g in grads])                    # (sum of numels,)
            dist.all_reduce(flat)
            offset = 0
            for p, g in zip(self.params, grads, strict=True):   # back in place: two copies of the gradients at most
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                p.grad = g
                offset += g.numel()
            del flat
        gathered: list[Any] = [None] * self.world   # each rank's (metric sums, micro-batch losses)
        dist.all_gather_object(gathered, (sums.sums, [float(x) for x in losses]))
        total = MetricSums()
        all_losses: list[torch.Tensor] = []
        for rank_sums, rank_losses in gathered:
            total.merge(rank_sums)
            all_losses.extend(torch.tensor(x) for x in rank_losses)
        return total, all_losses

    # -- one step ------------------------------------------------------------------------
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
        t_start, oom_before = time.perf_counter(), self.oom_fallbacks
        timing: dict[str, float] = {}
        if not self._pushed:
            self.push_weights()
        self.module.train()
        b = {k: v.to(self.device) for k, v in build_batch(groups, self.pad_id).items()}
        behaviour = self._behaviour(groups, b, timing)                     # the ratio's denominator
        tis = RolloutCorrection.of(groups, b["response_mask"], self.cfg, behaviour.old_logp)   # None: no rollout lps
        ref_logp = self._reference_logprobs(b, timing)                    # None: no reference
        advantages, returns = self._advantages(groups, b, behaviour, ref_logp)
        x = StepInputs(b, advantages, returns, behaviour, ref_logp, tis)

        t0 = time.perf_counter()
        sums, grad_norms = self._update(x)
        if self.world > 1 and tis is not None:
            tis.all_reduce()
        if self.module is not self.model:  # the whole updated weights into `model`, on every rank
            distributed.gather_into(self.module, self.model)
        lr = float(self.sched.get_last_lr()[0])
        self.sched.step()
        self.global_step += 1
        timing["update_actor"] = time.perf_counter() - t0

        metrics = {**sums.means(len(grad_norms)), **self._batch_metrics(x),
                   "actor/grad_norm": sum(grad_norms) / len(grad_norms), "actor/lr": lr,
                   "training/global_step": self.global_step}
        if tis is not None:
            metrics.update(tis.metrics())
        total = time.perf_counter() - t_start
        metrics.update({f"timing_s/{k}": v for k, v in timing.items()})
        metrics["timing_s/train_step"] = total
        metrics["perf/train_tokens_per_s"] = float(b["attention_mask"].sum()) / total
        metrics["perf/oom_fallback"] = float(self.oom_fallbacks - oom_before)   # 1: this step ran out of memory
        metrics["perf/safe_mode"] = float(self.safe_mode)
        self._end_of_step()
        return metrics

    def _behaviour(self, groups: list[Group], b: dict[str, torch.Tensor], timing: dict[str, float]) -> Behaviour:
        """The step's behaviour log-probs (`Behaviour`): from a no-grad pass over the batch
        (and the critic's values from the same pass), or -- one update on the whole batch
        without a critic -- from the update's own forward."""
        cfg, mask = self.cfg, b["response_mask"]
        N = mask.shape[0]
        stale = behaviour_logprobs(groups, mask.shape[1])                     # ((N, T), (N, T)) or None
        if stale is not None:
            stale = (stale[0].to(self.device), stale[1].to(self.device))
        if not self.critic and cfg.ppo_epochs == 1 and (cfg.mini_batch_size or N) >= N:
            return Behaviour(one_pass=True, stale=stale)
        t0 = time.perf_counter()
        old_logp, old_values = self._no_grad_pass(self.module, b, need_values=self.critic)
        if stale is not None:
            old_logp = torch.where(stale[1], stale[0], old_logp)              # (N, T)
        timing["old_log_prob"] = time.perf_counter() - t0
        return Behaviour(one_pass=False, old_logp=old_logp, old_values=old_values, stale=stale)

    def _reference_logprobs(self, b: dict[str, torch.Tensor], timing: dict[str, float]) -> torch.Tensor | None:
        """(N, T) log-probs of the frozen reference (KL in the loss or in the reward), or None
        when the config keeps no reference."""
        if (ref := self.ref) is None:
            return None
        t0 = time.perf_counter()
        ref_logp, _ = self._no_grad_pass(ref, b)
        timing["ref"] = time.perf_counter() - t0
        return ref_logp

    def _advantages(self, groups: list[Group], b: dict[str, torch.Tensor], behaviour: Behaviour,
                    ref_logp: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The algorithm's estimator (`algos.ADV_ESTIMATORS`): advantages (N, T) times each
        group's weight (cache-scored groups weigh less), and the critic's returns (N, T)."""
        sizes = b["group_sizes"]                                                  # (B,)
        advantages, returns = self.estimator.fn(algos.AdvantageInputs(
            b["rewards"], sizes.tolist(), b["response_mask"], behaviour.old_logp, behaviour.old_values, ref_logp),
            self.cfg)
        group_weight = torch.tensor([g.weight for g in groups], device=self.device).repeat_interleave(sizes)   # (N,)
        return advantages * group_weight[:, None], returns

    def _update(self, x: StepInputs) -> tuple[MetricSums, list[float]]:
        """`ppo_epochs` passes over the batch in shuffled minibatches of `mini_batch_size`, one
        optimizer step each, read as CleanRL's PPO update. For each minibatch, each of this
        rank's micro-batches (`distributed.microbatch_plan`): the forward, the loss
        (`algos.minibatch_loss`: the algorithm's policy loss, entropy, KL, value loss) and its
        backward, weighted by the micro-batch's share of the minibatch. Then, as plain steps:
        the ranks agree whether one ran out of memory (`_agree`; if one did, the fallback,
        `_fall_back`, and the minibatch again), the gradients are summed over the ranks,
        clipped, checked finite and applied. Returns the metric sums and grad norms of the
        optimizer steps; raises NonFiniteStep with every applied optimizer step of the step
        rolled back."""
        cfg, (N, width) = self.cfg, x.batch["input_ids"].shape                # (N, P + T)
        mini = cfg.mini_batch_size or N
        gen = torch.Generator().manual_seed(self.global_step)
        planned = cfg.ppo_epochs * math.ceil(N / mini)           # optimizer steps of this step
        sums, grad_norms, snap = MetricSums(), list[float](), None
        loss: torch.Tensor | None = None
        for epoch in range(cfg.ppo_epochs):
            order = (torch.randperm(N, generator=gen) if mini < N else torch.arange(N)).to(self.device)
            for s in range(0, N, mini):
                mb_idx = order[s:s + mini]                                       # (m,) the minibatch's rows
                while True:   # once; once more, in the safe mode, after a rank ran out of memory
                    self.opt.zero_grad(set_to_none=True)
                    mb_sums, losses, oom = MetricSums(), list[torch.Tensor](), None
                    rows = self.micro_rows(width)
                    plan = distributed.microbatch_plan(len(mb_idx), rows, self.rank, self.world, self.sharded)
                    try:
                        for j, start in enumerate(plan):
                            if self.sharded:
                                self._accumulate(last=j == len(plan) - 1)
                            if start is None:   # sharded, none left for this rank: FSDP2's collectives only
                                self._idle_backward(x.batch, mb_idx[:rows])
                                continue
                            idx = mb_idx[start:start + rows]                     # (n,) the micro-batch's rows
                            loss, metrics = algos.minibatch_loss(self._microbatch(x, idx), cfg, self.policy_loss)
                            # its share of the minibatch, so the micro-batches' sum is the minibatch's loss
                            weight = core.microbatch_weight(x.mask[idx], x.mask[mb_idx], cfg.loss_agg)
                            (loss * weight).backward()   # type: ignore[no-untyped-call, unused-ignore]  # --strict: torch's backward is unannotated
                            self.progress()
                            losses.append(loss.detach())
                            mb_sums.add(metrics, weight)
                    except Exception as e:  # noqa: BLE001 - only out-of-memory is agreed and falls back
                        if not is_out_of_memory(e):
                            raise  # this rank dies; torchrun stops the group
                        oom, loss = e, None   # with `loss`, the failed backward's graph goes
                    if (oom := self._agree(oom)) is None:
                        break
                    self._fall_back(oom)   # raises it unless the fallback takes it
                if self.world > 1:   # summed over the ranks: gradients, metric sums; every rank's losses
                    mb_sums, losses = self._all_reduce(mb_sums, losses)
                grad_norm = core.clip_grad_norm(self.params, cfg.max_grad_norm)
                self._check_finite(losses, grad_norm, epoch, s // mini, len(grad_norms), snap)
                if not grad_norms and planned > 1:   # more optimizer steps follow: keep this one's start
                    snap = self._snapshot()
                sums.merge(mb_sums)
                grad_norms.append(grad_norm)
                self.opt.step()
        return sums, grad_norms

    def _microbatch(self, x: StepInputs, idx: torch.Tensor) -> MicroBatch:
        """Rows `idx` of the step's inputs, with the forward of the policy (and critic) on them."""
        sub = {k: (v[idx] if k != "P" else v) for k, v in x.batch.items() if k not in ("rewards", "group_sizes")}
        logp, entropy, values = self._forward(self.module, sub, slice(None), need_values=self.critic,
                                              need_entropy=True)
        assert entropy is not None                                             # need_entropy=True
        behaviour = x.behaviour.rows(idx, logp)                                # (n, T)

        def rows(t: torch.Tensor | None) -> torch.Tensor | None:
            return t[idx] if t is not None else None

        return MicroBatch(logp, entropy, behaviour, x.advantages[idx], x.mask[idx], values=values,
                          old_values=rows(x.behaviour.old_values), returns=rows(x.returns),
                          ref_logp=rows(x.ref_logp),
                          is_weights=x.tis.weights(idx, behaviour) if x.tis is not None else None)

    def _check_finite(self, losses: list[torch.Tensor], grad_norm: float, epoch: int, minibatch: int,
                      applied: int, snap: Snapshot | None) -> None:
        """Raise NonFiniteStep (the step rolled back: `_skip`) when a micro-batch loss or the
        grad norm is not finite."""
        stacked = torch.stack(losses)
        finite = torch.isfinite(stacked)
        if not bool(finite.all()):
            raise self._skip("loss", float(stacked[~finite][0]), epoch, minibatch, applied, snap)
        if not math.isfinite(grad_norm):
            raise self._skip("grad_norm", grad_norm, epoch, minibatch, applied, snap)

    def _batch_metrics(self, x: StepInputs) -> dict[str, float]:
        """Scores, advantages and response lengths of the batch."""
        with torch.no_grad():
            r, mask = x.batch["rewards"], x.mask
            return {"critic/score/mean": float(r.mean()), "critic/score/std": float(r.std()) if r.numel() > 1 else 0.0,
                    "critic/advantages/mean": float(core.masked_mean(x.advantages, mask)),
                    "critic/advantages/var": float(core.masked_var(x.advantages, mask)),
                    "response_length/mean": float(mask.sum(1).mean())}
