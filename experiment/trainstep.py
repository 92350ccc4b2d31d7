"""The trainer's step: grad_accum micro-batches through experiment/step.py's forward_backward, the
warmups' shorter sequences and half batches, and the update, skipped when not finite."""

from __future__ import annotations

import torch

from experiment.optim import muon_momentum
from experiment.schedule import step_lr_multiplier
from experiment.step import forward_backward, optimizer_step
from experiment.trainer import Loop, Trainer


MAX_NONFINITE_IN_A_ROW = 5  # then the run is diverging, not unlucky: stop rather than burn the budget


def train_step(t: Trainer, loop: Loop) -> tuple[torch.Tensor, float]:
    """One step: grad_accum micro-batches, the gradient all-reduce on the last only, and the update;
    early in the schedule (loop.split, loop.halve: decide) in shorter sequences and as two updates of
    half the tokens each. Returns (the summed loss, on the device; the LR multiplier); a diverging
    run stops the loop."""
    cfg, d, st = t.cfg, t.d, t.st
    mult = step_lr_multiplier(cfg, st, loop.progress)  # rank 0's progress (decide): one LR for every shard
    t.opt.set_lr_multiplier(mult)
    t.opt.set_muon_momentum(muon_momentum(st.step, cfg.muon_momentum_warmup_steps))
    rows = loop.x.size(0) * loop.split  # the same tokens, shorter sequences
    if loop.halve and rows > 1:
        loss_sum = half_batch_steps(t, loop, rows)
    else:
        loss_sum = torch.zeros((), device=d.device)
        for micro in range(t.grad_accum):
            loss_sum += micro_backward(t, micro, *(v.reshape(rows, -1) for v in (loop.x, loop.y)))
            next_micro_batch(t, loop)
    if loop.end is None:  # else a first half's skipped update ended the run (a diverging loss)
        apply_update(t, loop)
        if t.opt.average is not None:  # once per step: the step count makes a resume continue it exactly
            t.opt.average.update(st.step + 1)
    st.tokens_seen += cfg.total_batch_size
    return loss_sum, mult


def micro_backward(t: Trainer, micro: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One of the update's grad_accum micro-batches; the gradient all-reduce waits for the last."""
    defer = t.ddp if t.d.world_size > 1 and micro < t.grad_accum - 1 else None
    if t.teacher is None:
        return forward_backward(t.train_model, x, y, t.grad_accum, defer_sync=defer)
    return forward_backward(t.train_model, x, y, t.grad_accum, defer_sync=defer, teacher=t.teacher.probs(x),
                            distill=(t.cfg.distill_weight, t.cfg.distill_temperature))


def next_micro_batch(t: Trainer, loop: Loop) -> None:
    loop.data_state = t.batches.state()
    # Prefetch: on GPU the kernels queued above still run while the CPU slices the next batch.
    loop.x, loop.y = (v.to(t.d.device, non_blocking=True) for v in next(t.batches))


def half_batch_steps(t: Trainer, loop: Loop, rows: int) -> torch.Tensor:
    """The step's tokens as two optimizer steps (the batch warmup): the first half of the rows of
    every micro-batch, then the second half. Halving rows, not micro-batches, keeps the two updates'
    data the same on any world size (with the same device batch), so elastic resumes stay exact.
    Returns the step's mean loss, summed on the device."""
    micro_batches = []
    for _ in range(t.grad_accum):
        micro_batches.append(tuple(v.reshape(rows, -1) for v in (loop.x, loop.y)))
        next_micro_batch(t, loop)
    loss_sum = torch.zeros((), device=t.d.device)
    for half in (slice(0, rows // 2), slice(rows // 2, rows)):
        if half.start:  # the first half's update; the second's is the step's own (train_step)
            apply_update(t, loop)
            if loop.end is not None:
                break
        for micro, (x, y) in enumerate(micro_batches):
            loss_sum += micro_backward(t, micro, x[half], y[half]) / 2
    return loss_sum


def apply_update(t: Trainer, loop: Loop) -> None:
    """The optimizer step, skipped when the gradients are not finite; MAX_NONFINITE_IN_A_ROW skips in
    a row end the run. DDP leaves identical gradients on every rank, so every rank reaches the same
    verdict."""
    if optimizer_step(t.model, t.opt):
        loop.bad_in_a_row = 0
        return
    t.st.nonfinite_steps += 1
    loop.bad_in_a_row += 1
    t.log(f"step {t.st.step + 1:06d} | non-finite loss or gradients: update skipped "
          f"({loop.bad_in_a_row} in a row, {t.st.nonfinite_steps} in all)")
    if loop.bad_in_a_row >= MAX_NONFINITE_IN_A_ROW:
        t.log(f"error: {loop.bad_in_a_row} non-finite updates in a row; stopping. The last good checkpoint is "
              f"step {max(loop.last_complete_step, 0):06d}; lower the learning rates or check the data")
        loop.stop(1, f"failed: {loop.bad_in_a_row} non-finite updates in a row")
