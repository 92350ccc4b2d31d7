"""Training on past a run's end: more TRAINING_HOURS, MAX_EPOCHS or MAX_STEPS for a run whose latest
checkpoint lies in its LR warmdown (a finished run's always does).

Training on from that checkpoint would jump the LR from the warmdown's end back up. Instead the
trainer records, when the warmdown begins, the newest complete checkpoint from before it
(RunState.warmdown_step; retention keeps it while a later step names it), and a resume whose
settings let the run go further loads that step's weights, optimizer state, RNG and data position,
trains on at the peak LR (the steps between that checkpoint and the warmdown's start again, on the
same data), and anneals again at the new end.
It keeps the later step's counters: its step number (new checkpoints come after it, so RESUME=auto
and retention see them as the newest), the budget it used (spent is spent), its best (served until
a new eval beats it) and its measured durations.

A resume with the same settings continues its warmdown (or, finished, ends at once). Settings that
extend the run but leave no time at the peak LR, or a warmdown start that is gone, are refused with
one line that says what to do.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from experiment import checkpoint as ckpt
from experiment.checkpoint import RunState
from experiment.config import ConfigError, TrainConfig


def rewind_step(run_dir: Path, step: int, cfg: TrainConfig, train_tokens: int) -> int | None:
    """The step whose weights a resume of `step` loads instead (its newest checkpoint from before the warmdown), or None
    for a plain resume. ConfigError when the settings extend a run that cannot go back."""
    meta = ckpt.read_meta(run_dir, step)
    st, old = ckpt.run_state(meta), meta["train_config"]
    start = st.warmdown_step
    if not st.warmdown_begun or not extends(cfg, old, meta["budget_seconds"], st, train_tokens):
        return None
    where = f"step {step:06d} of {run_dir} lies in its LR warmdown, and these settings extend the run"
    if start < 0 or start not in ckpt.complete_steps(run_dir) or not ckpt.is_resumable(run_dir, start) \
            or ckpt.damaged_files(run_dir, start):
        gone = (f"step {start:06d}, its newest checkpoint from before the warmdown, is gone or damaged" if start >= 0
                else "it has no checkpoint from before the warmdown")
        raise ConfigError(f"{where}, but {gone}, and training on from step {step:06d} would jump the LR back up: "
                          f"start a new run from its weights (INIT_FROM={run_dir} MODEL_TAG=<a new name>), or keep "
                          "the run's settings")
    tokens = ckpt.run_state(ckpt.read_meta(run_dir, start)).tokens_seen
    if short := too_short(cfg, st, step, tokens, train_tokens):
        raise ConfigError(f"{where}, but {short}; or keep the run's settings")
    return start


def extends(cfg: TrainConfig, old: dict, old_budget: float, st: RunState, train_tokens: int) -> bool:
    """The settings let the run go further than the ones it ran with: a larger budget, pass cap or
    max_steps, or the stop at the val minimum turned off after it ended the run."""
    def cap(epochs: float) -> float:
        return epochs * train_tokens if epochs else math.inf
    if old["plateau_evals"] and (st.plateau_stopped or st.anneal_start_tokens >= 0):
        return not cfg.plateau_evals  # the val minimum ended it: more budget does not move a minimum
    if cfg.budget_usd is not None and old.get("budget_usd") is not None:  # dollars: its hours move with the GPUs
        more = cfg.budget_usd > old["budget_usd"] * (1 + 1e-9)
    else:
        more = cfg.training_hours * 3600 > old_budget + 1e-6
    return (more or cap(cfg.max_epochs) > cap(old["max_epochs"])
            or (cfg.max_steps or math.inf) > (old["max_steps"] or math.inf))


def too_short(cfg: TrainConfig, st: RunState, step: int, start_tokens: int, train_tokens: int) -> str | None:
    """Why the extended run would train nothing new, if so: its schedule is already in its warmdown at
    the rewound start (the same fractions as schedule.schedule_progress), or the pass cap that ended the
    run ends the extended one where it ended (it would repeat the same warmdown on the same data)."""
    peak_end = 1 - cfg.warmdown_frac
    if peak_end <= 0:
        return f"WARMDOWN_FRAC={cfg.warmdown_frac:g} leaves no part of the schedule at the peak LR"
    reserve = st.eval_seconds + st.save_seconds + st.step_seconds
    reasons = []
    if st.used_seconds / max(cfg.training_hours * 3600 - reserve, 1e-9) >= peak_end:
        need = (st.used_seconds / peak_end + reserve) / 3600
        reasons.append(f"TRAINING_HOURS={cfg.training_hours:g} (or BUDGET_USD's hours) leaves no time at the peak "
                       f"LR after the {st.used_seconds / 3600:.3f} h used: give more than {need:.3f}")
    passes, ended = start_tokens / train_tokens, st.tokens_seen / train_tokens
    if cfg.max_epochs and passes / cfg.max_epochs >= peak_end:
        reasons.append(f"MAX_EPOCHS={cfg.max_epochs:g} ends it: the checkpoint from before the warmdown had seen {passes:.2f} "
                       f"passes; give more than {passes / peak_end:.2f} (0: no cap)")
    elif cfg.max_epochs and ended >= cfg.max_epochs * (1 - 1e-9):
        reasons.append(f"MAX_EPOCHS={cfg.max_epochs:g} ends it where it ended, after {ended:.2f} passes: give more "
                       "(0: no cap)")
    if cfg.max_steps and step / cfg.max_steps >= peak_end:
        reasons.append(f"MAX_STEPS={cfg.max_steps} ends it: give at least {math.floor(step / peak_end) + 1}")
    return "; and ".join(reasons) or None


def rewound(start: RunState, latest: RunState) -> RunState:
    """The state an extended run starts from: the warmdown start's weights-side state (tokens seen,
    data position, the val minimum's reference) with the latest step's counters, no warmdown begun."""
    keep = ("step", "used_seconds", "best_val", "best_step", "best_weights", "best_score", "best_by", "eval_seconds",
            "save_seconds", "step_seconds",
            "nonfinite_steps", "save_waits", "save_wait_seconds", "restart_seconds", "gpu_seconds_base")
    # The eval grid counts from the rewound start's tokens; no eval at the resumed step number.
    return dataclasses.replace(start, **{k: getattr(latest, k) for k in keep}, warmdown_begun=False, warmdown_step=-1,
                               anneal_start_tokens=-1, anneal_tokens=0, plateau_stopped=False,
                               warmdown_seen=False, evals_without_gain=0, warmdown_window=[],
                               last_eval_step=latest.step, last_eval_tokens=start.tokens_seen)


def drop_anneal(st: RunState, cfg: TrainConfig) -> bool:
    """A plain resume with PLATEAU_EVALS=0 of the step whose eval started the val minimum's warmdown
    (saved before that warmdown's first update, so no warmdown had begun and rewind_step found nothing
    to go back from): the anneal is not in effect and is dropped, with the count the warmdown kept, so
    the run trains on at the peak LR and its own schedule's warmdown later records its checkpoint
    from before it. True when dropped."""
    if cfg.plateau_evals or st.anneal_start_tokens != st.tokens_seen or st.warmdown_begun:
        return False
    st.anneal_start_tokens, st.anneal_tokens = -1, 0
    st.warmdown_seen, st.evals_without_gain, st.warmdown_window, st.plateau_ref = False, 0, [], math.inf
    return True


def rewind_line(start: int, step: int, st: RunState, train_tokens: int) -> str:
    return (f"extend | the settings extend the run: going back from step {step:06d} (annealed) to step {start:06d}, "
            f"its newest checkpoint from before the warmdown ({st.tokens_seen / train_tokens:.2f} passes); training on "
            "at the peak LR "
            f"to a new warmdown, new checkpoints numbered after {step:06d}; the best stays step "
            f"{st.best_step:06d} ({st.best_val:.4f}) until an eval beats it")
