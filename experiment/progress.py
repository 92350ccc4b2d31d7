"""What a step measured: its time (the reserve's step cost), the throughput, the step line every
log_every_steps, and once, from the rate of the first warm steps, the plan to the end of the run."""

from __future__ import annotations

import time

import torch

from experiment import autosize, launch, restarts
from experiment.hardware import memory_gib
from experiment.runlog import log_step, planner_line, source_epoch_lines
from experiment.stopping import projected_end, unspent_text
from experiment.trainer import Loop, Trainer


# The first steps after a (re)start hold torch.compile and allocator warm-up: tens of seconds on a
# GPU, not a step's cost. They stay out of the throughput figures and the end-of-run reserve.
WARMUP_STEPS = 3


def updated_step_seconds(previous: float, dt: float, warm: bool) -> float:
    """Moving average of the step time, which the reserve for the final eval + save includes.
    Warm-up steps leave it as it was (0 on a fresh start, the checkpoint's on a resume): on an H100
    a 30 s compile step taken for a step's cost stopped an 80 s run after one step."""
    if not warm:
        return previous
    return 0.9 * previous + 0.1 * dt if previous else dt


def begin_step(t: Trainer, loop: Loop) -> float:
    """Before the step: a step whose phase changed (the warmups' shorter sequences or half batches
    begin or end) runs new shapes, on CUDA a graph compiled mid-run, so it waits in collectives
    under setup's timeout, not the step's (record_step goes back once a step is warm). A resume's
    first step charges the restart's cost to the budget (restarts.charge). Returns the step's start
    time."""
    if loop.reshaped:
        loop.enter("setup", t.d)
    if t.restart_lost or t.restart_setup:
        restarts.charge(t, loop)
    return time.time()


def record_step(t: Trainer, loop: Loop, loss_sum: torch.Tensor, mult: float, t0: float) -> None:
    """Step time and throughput; the step line every log_every_steps; once, the planner's projection."""
    cfg, d, st = t.cfg, t.d, t.st
    logging = (st.step + 1) % cfg.log_every_steps == 0
    if logging:  # the mean over ranks, not rank 0's; .item() syncs the device, so only on logging steps
        train_loss = (d.all_reduce(loss_sum) / d.world_size).item()
    dt = time.time() - t0
    # A step whose phase changed (begin_step) is timed like a warm-up step.
    warm = st.step - (t.resume_step or 0) >= WARMUP_STEPS and not loop.reshaped
    st.step_seconds = updated_step_seconds(st.step_seconds, dt, warm)
    if warm:
        loop.measured_tokens += cfg.total_batch_size
        loop.measured_time += dt
        loop.enter("step", d)  # compiled and warmed up: a collective that waits minutes now is a hang
    tok_s = cfg.total_batch_size / dt
    if logging:
        mfu = t.flops_per_token * tok_s / (t.peak * d.world_size) if t.peak else None
        rate = loop.measured_tokens / loop.measured_time if loop.measured_time else tok_s
        seconds, cause = projected_end(t, loop.used(), rate)
        log_step(t.log, t.writer, st.step + 1, train_loss, t.opt.matrix_lr(), mult, dt, tok_s, mfu,
                 memory_gib(d.device), loop.used() / 3600, cfg.training_hours, (seconds / 3600, cause))
        t.report.note("projected end", f"in {seconds / 3600:.2f} h ({cause}), at step {st.step + 1}'s measured "
                                       f"{rate:,.0f} tok/s")
        t.report.add({"kind": "train", "step": st.step + 1, "used_seconds": round(loop.used(), 3),
                      "tokens_seen": st.tokens_seen, "loss": train_loss, "tok_s": tok_s, "mfu": mfu})
    if not loop.planned and loop.measured_time > 0 and st.step - (t.resume_step or 0) >= 10:
        loop.planned = True
        plan_from_measured_rate(t, loop, loop.measured_tokens / loop.measured_time)


def plan_from_measured_rate(t: Trainer, loop: Loop, rate: float) -> None:
    """Once, from the tok/s measured over the first warm steps: the projection to the end of the run
    (the budget, or MAX_EPOCHS passes when they come first: then the seconds left unspent), the data
    warnings, and for a predicted DEPTH=auto choice the measured rate against the prediction."""
    cfg, st, train_tokens = t.cfg, t.st, t.prepared.meta["split"]["train_tokens"]
    left = max(t.budget_seconds - st.used_seconds - loop.reserve_seconds, 0)
    to_cap = (t.max_tokens - st.tokens_seen) / rate
    plan = planner_line(rate, min(left, to_cap), st.step + 1, st.tokens_seen, cfg.total_batch_size,
                        cfg.training_hours, train_tokens, t.model.num_params())
    t.log(plan)
    t.report.note("plan", plan.removeprefix("planner | "))
    if to_cap < left:
        rest = ("left to the next generation (GENERATIONS=auto)" if cfg.generations == "auto"
                else "of the budget unspent (MAX_EPOCHS=0 trains the whole budget)")
        t.log(f"planner | MAX_EPOCHS={cfg.max_epochs:g}: the data's passes end about {to_cap / 3600:.3f}h from now; the "
              f"run stops there with about {unspent_text(t, left - to_cap)} {rest}")
    total = min(st.tokens_seen + rate * left, t.max_tokens)
    chained = t.teacher is not None and cfg.generations == "auto"  # its share is what the generations left
    for line in autosize.data_lines(cfg.depth, launch.make_config(cfg, t.prepared), total, train_tokens,
                                    cfg.total_batch_size, auto=t.run_meta["auto"] is not None or chained,
                                    averaged=cfg.average != "none",
                                    by="GENERATIONS=auto" if chained else "DEPTH=auto"):
        t.log(line)
    if t.weights:
        for line in source_epoch_lines(total, t.weights, t.prepared.meta["source_splits"]):
            t.log(line)
    auto = t.run_meta["auto"] or {}
    if auto.get("how") == "predicted" and t.resume_step is None:
        t.log(autosize.check_prediction(auto["candidates"], cfg.depth, rate, t.budget_seconds, train_tokens,
                                        bool(auto.get("chain"))))
