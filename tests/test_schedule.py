"""The schedule (experiment/schedule.py: the progress that drives the LR and the warmups, the LR
multiplier with the val minimum's warmdown, the warmups' phase) and the stop at the val minimum
(experiment/plateau.py), called directly. The end-to-end tests (test_plateau.py, test_extend.py,
test_train.py) run them inside the trainer; these pin each condition and boundary, so that a changed
one fails here by name."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from experiment import plateau
from experiment.checkpoint import RunState
from experiment.distributed import Dist
from experiment.schedule import schedule_progress, step_lr_multiplier, warmup_phase


def progress_of(used=0.0, budget=100.0, reserve=4.0, max_steps=0, step=0, tokens=0, max_tokens=math.inf) -> float:
    st = RunState(step=step, tokens_seen=tokens, used_seconds=used)
    t = SimpleNamespace(st=st, cfg=SimpleNamespace(max_steps=max_steps), budget_seconds=budget,
                        max_tokens=max_tokens)
    return schedule_progress(t, SimpleNamespace(reserve_seconds=reserve))


def test_progress_is_the_furthest_of_the_budget_less_its_reserve_max_steps_and_the_pass_cap():
    # The budget: 48 s of the 96 s left once the 4 s reserve for the final eval and save is kept.
    assert progress_of(used=48.0) == 0.5
    assert progress_of(used=48.0, reserve=0.0) == 0.48
    # MAX_STEPS counts when it is set and is further along; the time when that is further.
    assert progress_of(used=48.0, max_steps=10, step=7) == 0.7
    assert progress_of(used=48.0, max_steps=10, step=2) == 0.5
    assert progress_of(used=48.0, max_steps=0, step=7) == 0.5  # unset: steps say nothing
    # The pass cap: tokens seen of the tokens MAX_EPOCHS passes hold, when further than both.
    assert progress_of(used=48.0, max_steps=10, step=7, tokens=900, max_tokens=1000) == 0.9
    assert progress_of(used=48.0, max_steps=10, step=7, tokens=300, max_tokens=1000) == 0.7
    assert progress_of(used=0.0) == 0.0
    # A budget the reserve fills leaves no schedule: any time used is past its end, not a division by 0.
    assert progress_of(used=0.5, budget=4.0, reserve=4.0) > 1
    assert progress_of(used=0.0, budget=4.0, reserve=4.0) == 0.0


def lr_of(progress, anneal_start=-1, anneal_tokens=0, tokens=0, plateau_evals=4) -> float:
    cfg = SimpleNamespace(warmup_frac=0.1, warmdown_frac=0.4, final_lr_frac=0.1, plateau_evals=plateau_evals)
    st = RunState(tokens_seen=tokens, anneal_start_tokens=anneal_start, anneal_tokens=anneal_tokens)
    return step_lr_multiplier(cfg, st, progress)


def test_the_lr_follows_the_schedule_and_the_lower_of_it_and_the_val_minimums_warmdown():
    # No anneal: the schedule alone (warmup to 10%, the peak, the warmdown over the last 40%).
    assert [lr_of(p) for p in (0.05, 0.5, 0.8)] == pytest.approx([0.5, 1.0, 0.1 + 0.9 * 0.5])
    # An anneal from token 1000 over 1000 tokens, half done at 1500: from 1 down to FINAL_LR_FRAC.
    assert lr_of(0.5, anneal_start=1000, anneal_tokens=1000, tokens=1500) == pytest.approx(0.55)
    assert lr_of(0.5, anneal_start=1000, anneal_tokens=1000, tokens=1000) == 1.0
    assert lr_of(0.5, anneal_start=1000, anneal_tokens=1000, tokens=2000) == pytest.approx(0.1)
    # ... from token 0 too (an anneal is "none" only at -1)
    assert lr_of(0.5, anneal_start=0, anneal_tokens=1000, tokens=500) == pytest.approx(0.55)
    # The lower of the two: late in the schedule its own warmdown is lower than a young anneal's.
    assert lr_of(0.95, anneal_start=1000, anneal_tokens=1000, tokens=1500) == pytest.approx(0.1 + 0.9 * 0.05 / 0.4)
    # PLATEAU_EVALS=0 turns the stop at the val minimum off, and with it any anneal a checkpoint holds.
    assert lr_of(0.5, anneal_start=1000, anneal_tokens=1000, tokens=1500, plateau_evals=0) == 1.0
    # A zero-length anneal counts as one token long: done at once, never a division by 0.
    assert lr_of(0.5, anneal_start=1000, anneal_tokens=0, tokens=1001) == pytest.approx(0.1)
    assert lr_of(0.5, anneal_start=1000, anneal_tokens=1, tokens=1001) == pytest.approx(0.1)
    assert lr_of(0.5, anneal_start=1000, anneal_tokens=2, tokens=1001) == pytest.approx(0.55)


def phase_of(st: RunState, progress: float) -> tuple[int, int]:
    return warmup_phase(SimpleNamespace(seq_warmup_frac=0.4, batch_warmup_frac=0.3), st, progress)


def test_the_warmups_phase_follows_the_furthest_progress_and_ends_with_any_warmdown():
    st = RunState()
    # quarter contexts and half batches first, then half contexts, then whole, each at its boundary
    assert [phase_of(st, p) for p in (0.0, 0.19, 0.2, 0.29, 0.3, 0.39, 0.4)] == [
        (4, 1), (4, 1), (2, 1), (2, 1), (2, 0), (2, 0), (1, 0)]
    assert st.warmup_progress == 0.4
    # A lower progress (an extension's longer budget) does not go back: the furthest reached counts.
    st = RunState(warmup_progress=0.25)
    assert phase_of(st, 0.05) == (2, 1) and st.warmup_progress == 0.25
    assert phase_of(st, 0.35) == (2, 0) and st.warmup_progress == 0.35


def test_the_warmups_end_from_the_step_after_an_anneal_begins_or_once_a_warmdown_has():
    assert phase_of(RunState(warmdown_begun=True), 0.0) == (1, 0)
    # the step that began the anneal (its eval came after this decision) still trains in the warmups
    assert phase_of(RunState(anneal_start_tokens=100, tokens_seen=100), 0.0) == (4, 1)
    equal = RunState(anneal_start_tokens=int("4096000"), tokens_seen=int("4096000"))  # two int objects, as a run's
    assert phase_of(equal, 0.0) == (4, 1)
    assert phase_of(RunState(anneal_start_tokens=100, tokens_seen=101), 0.0) == (1, 0)
    assert phase_of(RunState(anneal_start_tokens=0, tokens_seen=1), 0.0) == (1, 0)
    assert phase_of(RunState(anneal_start_tokens=-1, tokens_seen=500), 0.0) == (4, 1)  # no anneal
    # ended, the phase leaves the furthest progress where it was
    st = RunState(warmdown_begun=True, warmup_progress=0.1)
    phase_of(st, 0.9)
    assert st.warmup_progress == 0.1


def test_plateau_gain_at_the_peak_lr_needs_the_margin_below_the_last_gain():
    cfg = SimpleNamespace(plateau_margin=0.25)
    st = RunState(evals_without_gain=3)
    assert plateau.plateau_gain(cfg, st, 2.0, False) is True  # below no reference yet
    assert (st.plateau_ref, st.evals_without_gain) == (2.0, 0)
    st.evals_without_gain = 1
    # the bar is 2.0 x (1 - 0.25) = 1.5, strictly below; a miss leaves the reference and the count
    assert plateau.plateau_gain(cfg, st, 1.9, False) is False
    assert plateau.plateau_gain(cfg, st, 1.5, False) is False
    assert (st.plateau_ref, st.evals_without_gain) == (2.0, 1)
    assert plateau.plateau_gain(cfg, st, 1.25, False) is True
    assert (st.plateau_ref, st.evals_without_gain) == (1.25, 0)
    assert st.warmdown_window == []  # the window is the warmdown's alone


def test_plateau_gain_in_a_warmdown_is_a_new_low_of_its_windows_mean():
    cfg = SimpleNamespace(plateau_margin=0.25)  # no margin in a warmdown: any new low of the mean
    st = RunState()
    assert plateau.WARMDOWN_WINDOW == 2
    assert plateau.plateau_gain(cfg, st, 2.0, True) is None  # the window fills
    assert st.warmdown_window == [2.0] and st.plateau_ref == math.inf
    assert plateau.plateau_gain(cfg, st, 1.0, True) is True  # mean 1.5
    assert (st.plateau_ref, st.warmdown_window) == (1.5, [2.0, 1.0])
    st.evals_without_gain = 1
    assert plateau.plateau_gain(cfg, st, 2.0, True) is False  # mean 1.5 again: not below
    assert (st.plateau_ref, st.warmdown_window, st.evals_without_gain) == (1.5, [1.0, 2.0], 1)
    assert plateau.plateau_gain(cfg, st, 0.5, True) is True  # mean 1.25
    assert (st.plateau_ref, st.warmdown_window, st.evals_without_gain) == (1.25, [2.0, 0.5], 0)


def _stop_harness(warmdown_frac=0.4, total_batch_size=1, plateau_evals=2, margin=0.25):
    cfg = SimpleNamespace(plateau_evals=plateau_evals, plateau_margin=margin, warmdown_frac=warmdown_frac,
                          total_batch_size=total_batch_size, gpu_hourly_usd=4.0)
    t = SimpleNamespace(cfg=cfg, st=RunState(), d=Dist(0, 0, 1, torch.device("cpu")), logs=[],
                        budget_seconds=100.0, prepared=SimpleNamespace(meta={"split": {"train_tokens": 1000}}))
    t.log = t.logs.append
    stopped = []
    loop = SimpleNamespace(used=lambda: 40.0, stop=lambda code, outcome: stopped.append((code, outcome)))

    def check(tokens, progress, val):
        t.st.step = t.st.tokens_seen = tokens
        loop.val_loss, loop.progress = val, progress
        plateau.plateau_check(t, loop)
        return t.st
    return t, check, stopped


def test_plateau_start_anneal_is_as_long_as_the_schedules_warmdown_for_a_run_ending_here():
    t, _, _ = _stop_harness()
    t.st.tokens_seen, t.st.evals_without_gain, t.st.plateau_ref, t.st.warmdown_window = 600, 3, 1.0, [1.0]
    plateau.start_anneal(t, 0.6, "")
    st = t.st
    assert (st.anneal_start_tokens, st.anneal_tokens) == (600, 400)  # 600 x 0.4 / 0.6
    assert (st.warmdown_seen, st.evals_without_gain, st.plateau_ref, st.warmdown_window) == (True, 0, math.inf, [])
    t, _, _ = _stop_harness(total_batch_size=64)
    t.st.tokens_seen = 6
    plateau.start_anneal(t, 0.006, "")
    assert t.st.anneal_tokens == 64  # at least one step
    t, _, _ = _stop_harness(warmdown_frac=1.0)
    t.st.tokens_seen = 600
    plateau.start_anneal(t, 0.6, "")
    assert t.st.anneal_tokens == 600 * 10**9  # WARMDOWN_FRAC=1: a warmdown to the end of the budget


def test_plateau_check_at_the_peak_counts_misses_then_starts_the_anneal_and_ends_the_run_in_it():
    t, check, stopped = _stop_harness()
    assert check(100, 0.1, 2.0).evals_without_gain == 0
    assert check(200, 0.2, 1.9).evals_without_gain == 1
    st = check(300, 0.6, 1.9)  # 0.6 is the warmdown's start (1 - 0.4), not in it: a second miss
    assert (st.evals_without_gain, st.anneal_start_tokens, st.anneal_tokens) == (0, 300, 200)
    assert st.warmdown_seen and not st.plateau_stopped and not stopped
    # the user reads where the anneal starts and ends, in passes over the 1000 training tokens
    assert "the LR warmdown starts now at 0.30 passes and the run ends with it at 0.50 passes" in t.logs[-1]
    # in the anneal its window fills (no count), gains once, then misses PLATEAU_EVALS times
    assert check(350, 0.35, 1.8).evals_without_gain == 0
    assert check(400, 0.4, 1.6).plateau_ref == pytest.approx(1.7)
    assert check(450, 0.45, 1.8).evals_without_gain == 1 and not stopped
    st = check(500, 0.5, 1.8)
    assert st.plateau_stopped and st.evals_without_gain == 2
    assert stopped == [(0, stopped[0][1])] and "stopped improving during the warmdown" in stopped[0][1]
    assert t.logs[-1].endswith("stopping at 0.50 passes")


def test_plateau_check_counts_from_a_checkpoints_state():
    # PLATEAU_EVALS lowered on a resume below the misses already counted: the next miss acts
    t, check, stopped = _stop_harness(plateau_evals=2)
    t.st.plateau_ref, t.st.evals_without_gain = 1.0, 3
    assert check(100, 0.1, 1.0).anneal_start_tokens == 100
    # an anneal recorded without warmdown_seen (a checkpoint from before the field) is a warmdown
    t, check, stopped = _stop_harness()
    t.st.anneal_start_tokens, t.st.anneal_tokens, t.st.plateau_ref = 300, 200, 1.0
    st = check(350, 0.1, 1.0)
    assert (st.warmdown_seen, st.warmdown_window, st.plateau_ref) == (True, [1.0], math.inf)


def test_plateau_check_in_the_schedules_warmdown_starts_its_count_afresh():
    t, check, stopped = _stop_harness(plateau_evals=3)
    check(100, 0.1, 2.0)
    assert check(200, 0.2, 1.9).evals_without_gain == 1
    st = check(300, 0.61, 1.9)  # the schedule's warmdown: the peak's count and reference do not carry over
    assert (st.warmdown_seen, st.evals_without_gain, st.warmdown_window, st.anneal_start_tokens) == (True, 0, [1.9], -1)
    check(400, 0.7, 1.9)  # mean 1.9: a gain against no reference of its own
    assert check(500, 0.8, 1.9).evals_without_gain == 1
    assert check(600, 0.5, 1.9).evals_without_gain == 2 and not stopped  # a dip of the fraction stays in it
    st = check(700, 0.9, 1.9)
    assert st.plateau_stopped and st.anneal_start_tokens == -1 and len(stopped) == 1
