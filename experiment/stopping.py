"""When the loop stops: each step's decisions (decide: the last step, evals and saves due, the
schedule's warmdown and the warmups' phase, rank 0's for every rank), why a run ended, the
projected end, and how long a stopping rank may take."""

from __future__ import annotations

import math
import time

import torch

from experiment.config import EVAL_STRETCH
from experiment.saving import save_seconds
from experiment.schedule import schedule_progress, warmup_phase
from experiment.trainer import Loop, Trainer


def final_reserve(t: Trainer) -> float:
    """What the run's end takes after its last step's decision: the final eval, the final save, the
    export of best.pt (a share of a save: saving.export_share) and one more step. The LR schedule
    ends where they begin, and the budget holds them."""
    return t.st.eval_seconds + save_seconds(t) * (1 + t.export_share) + t.st.step_seconds


def eval_stretch(t: Trainer, loop: Loop) -> float:
    """The least seconds from the latest eval (its end, or its step's save) to the next clock-driven eval
    or save: the latest eval's seconds times (1 - EVAL_SHARE) / EVAL_SHARE. Before this process's first
    eval, the slowest of the run's (a resume's checkpoint holds it); the latest after it, so that one
    slow eval does not stretch the rest of the run."""
    return (loop.eval_seconds or t.st.eval_seconds) * EVAL_STRETCH


def decide(t: Trainer, loop: Loop, signum: int, writing: bool = False) -> tuple[int, ...]:
    """(last step, eval due, save due, signal, a rank still writing a save, the schedule's warmdown
    begins at this step, the step's context split, its halved batch: 0 or 1); sets loop.progress, the
    schedule's progress that the step's LR follows. Rank 0 decides the clock-driven flags and the
    progress; a stop signal may reach any rank, and so may a writer still at work. One all-reduce
    (max) gives every rank the same decisions, so none is left waiting in a collective."""
    cfg, d, st, step = t.cfg, t.d, t.st, t.st.step
    stretch = eval_stretch(t, loop)
    eval_due = (time.time() - loop.last_eval_time >= max(cfg.eval_every_minutes * 60, stretch)
                or (cfg.eval_every_steps > 0 and step % cfg.eval_every_steps == 0) or step == 0
                or st.tokens_seen - st.last_eval_tokens >= t.eval_every_tokens)
    # A save brings an eval (it writes the weights the eval chose): the clock's saves wait the stretch too.
    save_due = (time.time() - loop.last_save_time >= max(cfg.save_every_minutes * 60, stretch)
                or (cfg.save_every_steps > 0 and step % cfg.save_every_steps == 0 and step > 0))
    # An eval (and the save a new best brings) or a save due now is paid for on top of the reserve
    # for the final ones: when both no longer fit, this step is the last, and its eval the final one.
    save = save_seconds(t)
    due_now = (st.eval_seconds + save) * eval_due + save * (save_due and not eval_due)
    # What a save in flight still needs: the final save waits for it. Not in the schedule's reserve,
    # which would dip the LR during every background write.
    in_flight = t.saver.seconds_left(save)
    # A resume's setup and lost seconds, charged at the first step it trains (restarts.charge): a step
    # they would carry past the budget is not trained, and a relaunch of a run that ended with less
    # than them left trains nothing and is charged nothing.
    pending = t.restart_lost + t.restart_setup
    last = (step >= t.max_steps or st.tokens_seen >= t.max_tokens or stopped_at_minimum(t)
            or st.used_seconds + pending + loop.reserve_seconds + in_flight + due_now >= t.budget_seconds)
    progress = schedule_progress(t, loop) if d.master else 0.0
    warmdown = not st.warmdown_begun and progress > 1 - cfg.warmdown_frac and not last
    # The phase decides how many updates (and collectives) the step makes: every rank takes rank 0's.
    split, halve = warmup_phase(cfg, st, progress) if d.master else (0, 0)
    # float64: the flags exactly, and the schedule's progress, which sets the step's LR on every rank.
    # Each rank's own clock and measured durations would give each ZeRO-1 shard an LR of its own.
    flags = torch.tensor([d.master and last, d.master and eval_due, d.master and save_due, signum, writing,
                          d.master and warmdown, split, halve, progress], dtype=torch.float64, device=d.device)
    *decided, loop.progress = d.all_reduce(flags, "max").tolist()
    return tuple(int(v) for v in decided)


def stopped_at_minimum(t: Trainer) -> bool:
    """The stop at the val minimum ended the run: a warmdown stopped gaining, or the one it started
    is done. PLATEAU_EVALS=0 on a resume overrules it: the run goes back to its checkpoint from before
    the warmdown and trains on (extend.py)."""
    st = t.st
    return bool(t.cfg.plateau_evals) and (st.plateau_stopped or st.anneal_start_tokens >= 0
                                          and st.tokens_seen >= st.anneal_start_tokens + st.anneal_tokens)


MAX_STEPS_OUTCOME = "finished: max_steps reached"  # GENERATIONS=auto begins no generation after it


def last_outcome(t: Trainer) -> str:
    if t.st.step >= t.max_steps:
        return MAX_STEPS_OUTCOME
    if stopped_at_minimum(t):
        return plateau_outcome(t, t.st.used_seconds)
    if t.st.tokens_seen >= t.max_tokens:
        return f"finished: {t.cfg.max_epochs:g} passes over the training data (MAX_EPOCHS), before the budget"
    return "finished: the budget is spent"


def plateau_outcome(t: Trainer, used: float) -> str:
    """Why a run that the stop at the val minimum ended stopped, and the budget it left."""
    st, left = t.st, unspent_text(t, max(t.budget_seconds - used, 0))
    if st.plateau_stopped:
        return (f"finished: the val loss stopped improving during the warmdown (best {st.best_val:.4f} at step "
                f"{st.best_step}); {left} of the budget unspent")
    passes = st.anneal_start_tokens / t.prepared.meta["split"]["train_tokens"]
    return (f"finished: the val loss stopped improving at {passes:.2f} passes and the warmdown started there is "
            f"done; {left} of the budget unspent")


def unspent_text(t: Trainer, seconds: float) -> str:
    """Seconds, hours, and on GPUs the dollars at GPU_HOURLY_USD."""
    usd = f", ${seconds / 3600 * t.cfg.gpu_hourly_usd * t.d.world_size:,.0f}" if t.d.device.type == "cuda" else ""
    return f"{seconds:,.0f}s ({seconds / 3600:.2f}h{usd})"


def projected_end(t: Trainer, used: float, rate: float) -> tuple[float, str]:
    """Seconds to the run's end at `rate` tok/s, and what ends it: the first of the budget, the
    MAX_EPOCHS passes, the warmdown that the val minimum started, and max_steps."""
    st = t.st
    ends = [(t.budget_seconds - used, "budget")]
    if t.max_tokens < math.inf:
        ends.append(((t.max_tokens - st.tokens_seen) / rate, f"{t.cfg.max_epochs:g} passes"))
    if st.anneal_start_tokens >= 0 and t.cfg.plateau_evals:
        ends.append(((st.anneal_start_tokens + st.anneal_tokens - st.tokens_seen) / rate,
                     "the warmdown the val minimum started"))
    if t.cfg.max_steps:
        ends.append(((t.cfg.max_steps - st.step - 1) * t.cfg.total_batch_size / rate, "max_steps"))
    seconds, cause = min(ends)
    return max(seconds, 0.0), cause


# After a stop signal, a rank that has not exited within the step, the save and this margin hangs
# (a collective with a dead peer, a device sync): it exits at once (StopSignal's grace timer).
STOP_MARGIN_SECONDS = 60.0


def stop_grace(t: Trainer) -> float:
    """Seconds a stopping rank gets: twice its step and its longest save plus a margin, and its longest
    eval (a signal may come in one: EVAL_METRIC gives way at its next generate step)."""
    return STOP_MARGIN_SECONDS + 2 * (t.st.step_seconds + save_seconds(t)) + t.st.eval_seconds
