"""The stop at the val minimum (docs/training.md, "The stop at the val minimum"): at the peak LR,
PLATEAU_EVALS evals without a gain start a warmdown, and the run ends with it; in a warmdown,
PLATEAU_EVALS evals without a new low of its window's mean end the run. maybe_eval calls
plateau_check after each eval past step 0; every rank saw the same reduced val loss."""

from __future__ import annotations

import math

from experiment.checkpoint import RunState
from experiment.config import WARMDOWN_WINDOW, TrainConfig
from experiment.stopping import plateau_outcome
from experiment.trainer import Loop, Trainer



def plateau_check(t: Trainer, loop: Loop) -> None:
    """The stop at the val minimum, on evals after step 0: at the LR's peak, PLATEAU_EVALS evals in a
    row without a gain (plateau_gain) start the warmdown at once (start_anneal), and the run ends
    with it; in a warmdown (the schedule's or that one), PLATEAU_EVALS without a gain end the run at
    once: the repetition of the data now outweighs the anneal, and the best step is saved already.
    docs/training.md, "The stop at the val minimum"."""
    cfg, st = t.cfg, t.st
    # Every rank agrees: loop.progress is rank 0's (decide). Once begun a warmdown stays begun, though
    # the budget's fraction can dip when the measured reserve shrinks.
    in_warmdown = st.warmdown_seen or st.anneal_start_tokens >= 0 or loop.progress > 1 - cfg.warmdown_frac
    if in_warmdown and not st.warmdown_seen:  # a count from the peak LR does not carry over
        begin_warmdown_count(st)
    gained = plateau_gain(cfg, st, loop.val_loss, in_warmdown)
    if gained is None or gained:
        return
    st.evals_without_gain += 1
    if st.evals_without_gain < cfg.plateau_evals:
        return
    passes = st.tokens_seen / t.prepared.meta["split"]["train_tokens"]
    best = f"best {st.best_val:.4f} at step {st.best_step}"
    if not in_warmdown:
        start_anneal(t, passes, best)
        return
    st.plateau_stopped = True
    t.log(f"plateau | the mean of the last {WARMDOWN_WINDOW} val losses has not gone below its lowest in this "
          f"warmdown for {st.evals_without_gain} evals ({best}): stopping at {passes:.2f} passes")
    loop.stop(0, plateau_outcome(t, loop.used()))


def plateau_gain(cfg: TrainConfig, st: RunState, val_loss: float, in_warmdown: bool) -> bool | None:
    """Whether this eval gains (and if so it becomes the reference, the count starts again); None while
    a warmdown's window fills. At the LR's peak: its val loss is PLATEAU_MARGIN (a fraction) below the
    last gaining one's, so a slow creep adds up to a gain. In a warmdown: the mean of its last
    WARMDOWN_WINDOW val losses is below the lowest such mean in it. The annealing LR moves the val
    loss to a level of its own, which a best from the peak LR does not measure, and on a noisy val
    set (2% from eval to eval on code) one lucky eval must not become the bar; an extended run's
    warmdown is so held to its own evals too."""
    if in_warmdown:
        st.warmdown_window = (st.warmdown_window + [val_loss])[-WARMDOWN_WINDOW:]
        if len(st.warmdown_window) < WARMDOWN_WINDOW:
            return None
        level = sum(st.warmdown_window) / WARMDOWN_WINDOW
        gained = level < st.plateau_ref
    else:
        level = val_loss
        gained = level < st.plateau_ref * (1 - cfg.plateau_margin)
    if gained:
        st.plateau_ref, st.evals_without_gain = level, 0
    return gained


def start_anneal(t: Trainer, passes: float, best: str) -> None:
    """The warmdown the val minimum starts: as long as the schedule's would be for a run planned to
    end here (warmdown_frac / (1 - warmdown_frac) of the tokens so far); the run ends with it."""
    cfg, st = t.cfg, t.st
    wd = cfg.warmdown_frac
    st.anneal_start_tokens = st.tokens_seen
    st.anneal_tokens = max(cfg.total_batch_size, round(st.tokens_seen * wd / max(1 - wd, 1e-9)))
    begin_warmdown_count(st)  # the warmdown gets its own evals
    end = (st.tokens_seen + st.anneal_tokens) / t.prepared.meta["split"]["train_tokens"]
    t.log(f"plateau | no gain of {cfg.plateau_margin:.1%} in {cfg.plateau_evals} evals ({best}): the LR warmdown "
          f"starts now at {passes:.2f} passes and the run ends with it at {end:.2f} passes (PLATEAU_EVALS=0 trains "
          "to the budget)")


def begin_warmdown_count(st: RunState) -> None:
    st.warmdown_seen, st.evals_without_gain, st.plateau_ref, st.warmdown_window = True, 0, math.inf, []
