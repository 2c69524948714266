"""The errors a training step raises, shared by the trainer and the rank group
(steadyrl.rl.trainer, steadyrl.rl.distributed) without either importing the other."""

from __future__ import annotations

import torch


def is_out_of_memory(e: BaseException) -> bool:
    """torch.OutOfMemoryError (CUDA), or the CPU allocator's RuntimeError."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    msg = str(e).lower()
    return isinstance(e, RuntimeError) and ("out of memory" in msg or "can't allocate memory" in msg)


class RanksOutOfMemory(RuntimeError):
    """Another rank of the torch.distributed group ran out of memory in this part of the step
    (`Trainer._agree`): this rank stops too, so every rank takes the out-of-memory fallback
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
