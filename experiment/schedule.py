"""The schedule: how far the run is (schedule_progress: of the budget, max_steps or the pass cap),
the LR multiplier of a step, and the early-schedule warmups' phase (shorter sequences, half
batches: docs/training.md, "Early in the schedule")."""

from __future__ import annotations

from experiment.checkpoint import RunState
from experiment.config import TrainConfig
from experiment.optim import lr_multiplier
from experiment.trainer import Loop, Trainer


def schedule_progress(t: Trainer, loop: Loop) -> float:
    """The fraction of the LR schedule done at this step: of the budget (less the reserve for the
    final eval and save), of max_steps (a max_steps run is reproducible: its schedule follows steps)
    or of the MAX_EPOCHS passes, whichever is furthest, so the schedule ends where the run does."""
    st = t.st
    progress = st.used_seconds / max(t.budget_seconds - loop.reserve_seconds, 1e-9)
    if t.cfg.max_steps:
        progress = max(progress, st.step / t.cfg.max_steps)
    return max(progress, st.tokens_seen / t.max_tokens)


def step_lr_multiplier(cfg: TrainConfig, st: RunState, progress: float) -> float:
    """The LR multiplier of a step at `progress` (the schedule's: warmup, peak, warmdown), lowered
    further by the warmdown the val minimum started, where there is one."""
    mult = lr_multiplier(progress, cfg.warmup_frac, cfg.warmdown_frac, cfg.final_lr_frac)
    if st.anneal_start_tokens >= 0 and cfg.plateau_evals:  # the warmdown the val minimum started, or the schedule's
        done = (st.tokens_seen - st.anneal_start_tokens) / max(st.anneal_tokens, 1)
        mult = min(mult, lr_multiplier(done, 0.0, 1.0, cfg.final_lr_frac))
    return mult


def warmup_phase(cfg: TrainConfig, st: RunState, progress: float) -> tuple[int, int]:
    """(the context split, halved batch: 0 or 1) of the early-schedule warmups at this step. They follow
    the furthest schedule progress reached (st.warmup_progress: an extension does not return to them)
    and end when a warmdown begins: the val minimum's anneal trains whole sequences and batches."""
    # From the step after an anneal begins: the step that began it (its eval came after this
    # decision) trained in the warmups, and so does its resume, whose checkpoint records the anneal.
    if st.warmdown_begun or 0 <= st.anneal_start_tokens < st.tokens_seen:
        return 1, 0
    st.warmup_progress = max(st.warmup_progress, progress)
    return context_split(st.warmup_progress, cfg.seq_warmup_frac), int(st.warmup_progress < cfg.batch_warmup_frac)


def context_split(progress: float, seq_warmup_frac: float) -> int:
    """Into how many shorter sequences each max_seq_len one is cut at this point of the schedule:
    4 over the first half of seq_warmup_frac, 2 over its second half, then 1 (docs/training.md)."""
    if progress >= seq_warmup_frac:
        return 1
    return 4 if progress < seq_warmup_frac / 2 else 2
