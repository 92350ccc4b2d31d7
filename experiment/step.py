"""The training step, written once: a micro-batch's forward and backward, then the optimizer step.

The trainer (experiment/trainstep.py) runs grad_accum forward_backward calls and one optimizer_step per
step (early in a CPU run's schedule two of each per micro-batch's halves, on shorter sequences: the
warmups in docs/training.md); DEPTH=auto's probe, the device-batch probe and every measurement tool
call the same two functions on the whole step, so what they time or size is the trainer's step
after its warmups.
"""

from __future__ import annotations

import contextlib

import torch

from experiment.distributed import autocast_for
from experiment.optim import ShardedOptimizer, gradients_finite


def forward_backward(run: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, grad_accum: int = 1,
                     defer_sync: torch.nn.Module | None = None, autocast=None,
                     teacher: torch.Tensor | None = None, distill: tuple[float, float] = (0.5, 1.0)) -> torch.Tensor:
    """One micro-batch: the loss of run(x, y) in the trainer's precision (autocast_for; `autocast`
    overrides it, for a profile), scaled by 1/grad_accum so the accumulated gradient is the mean
    over the step's micro-batches, and its backward. `run` is what the trainer steps: the model, or
    its DDP wrapper, compiled or not. `defer_sync`: the DDP wrapper whose gradient all-reduce waits
    for a later micro-batch (no_sync), else None. Returns the scaled loss, detached, on the device:
    reading it is a host sync, which the caller does only when it logs. `teacher`: a teacher's
    probabilities for x (experiment/generations.py), the loss then model.distillation_loss's with
    `distill` = (weight, temperature)."""
    deferred = defer_sync.no_sync() if defer_sync is not None else contextlib.nullcontext()
    with deferred, autocast if autocast is not None else autocast_for(x.device):
        loss = (run(x, y) if teacher is None else run(x, y, teacher=teacher, distill=distill)) / grad_accum
    loss.backward()
    return loss.detach()


def optimizer_step(model: torch.nn.Module, opt: ShardedOptimizer, check_finite: bool = True) -> bool:
    """The update from the accumulated gradients, then the gradients cleared. With check_finite (the
    trainer's way; one host sync) a step whose gradients hold a NaN or inf is skipped: the weights
    stay valid. Returns whether the update was applied."""
    finite = gradients_finite(model) if check_finite else True
    if finite:
        opt.step()
    # Zeroed in place, never dropped: under DDP the gradients are views into its all-reduce buckets
    # (distributed.wrap_ddp), and a dropped one comes back as a second copy at the next backward.
    model.zero_grad(set_to_none=False)
    return finite
