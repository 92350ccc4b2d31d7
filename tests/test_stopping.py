"""When the loop stops (experiment/stopping.py), called directly: what ended a run and the words for
it, the projected end the progress line gives, and the grace a stopping rank gets. decide is tested
in test_train.py (test_an_eval_due_when_the_budget_has_no_room...) and test_step.py."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
import torch

from experiment import stopping
from experiment.checkpoint import RunState
from experiment.distributed import Dist


def trainer(st: RunState, device="cpu", world=1, max_steps=10**9, max_tokens=math.inf, plateau_evals=4,
            cfg_max_steps=0, max_epochs=8.0, budget=1000.0, first_save=0.0):
    cfg = SimpleNamespace(plateau_evals=plateau_evals, max_steps=cfg_max_steps, max_epochs=max_epochs,
                          total_batch_size=100, gpu_hourly_usd=4.0)
    d = SimpleNamespace(device=torch.device(device), world_size=world)
    return SimpleNamespace(cfg=cfg, st=st, d=d, max_steps=max_steps, max_tokens=max_tokens, budget_seconds=budget,
                           first_save_seconds=first_save, prepared=SimpleNamespace(meta={"split": {"train_tokens": 400}}))


def test_the_stop_at_the_minimum_ends_a_run_when_its_warmdown_stopped_gaining_or_its_anneal_is_done():
    assert not stopping.stopped_at_minimum(trainer(RunState(tokens_seen=10**6)))  # no anneal (-1)
    assert stopping.stopped_at_minimum(trainer(RunState(plateau_stopped=True)))
    anneal = dict(anneal_start_tokens=1000, anneal_tokens=500)
    assert not stopping.stopped_at_minimum(trainer(RunState(tokens_seen=1499, **anneal)))
    assert stopping.stopped_at_minimum(trainer(RunState(tokens_seen=1500, **anneal)))
    assert stopping.stopped_at_minimum(trainer(RunState(tokens_seen=500, anneal_start_tokens=0, anneal_tokens=500)))
    # PLATEAU_EVALS=0 (a resume that extends the run) overrules both
    assert not stopping.stopped_at_minimum(trainer(RunState(plateau_stopped=True), plateau_evals=0))
    assert not stopping.stopped_at_minimum(trainer(RunState(tokens_seen=1500, **anneal), plateau_evals=0))


def test_the_last_steps_outcome_names_what_ended_it_first():
    st = RunState(step=10, tokens_seen=800, used_seconds=400.0, anneal_start_tokens=200, anneal_tokens=100)
    assert stopping.last_outcome(trainer(st, max_steps=10, max_tokens=800)) == "finished: max_steps reached"
    assert stopping.last_outcome(trainer(st, max_steps=8)) == "finished: max_steps reached"  # a resume past it
    assert stopping.last_outcome(trainer(st, max_steps=11, max_tokens=800)).startswith(
        "finished: the val loss stopped improving at 0.50 passes and the warmdown started there is done; 600s")
    assert stopping.last_outcome(trainer(st, max_steps=11, max_tokens=800, plateau_evals=0)) == (
        "finished: 8 passes over the training data (MAX_EPOCHS), before the budget")
    assert stopping.last_outcome(trainer(st, max_steps=11, max_tokens=801, plateau_evals=0)) == (
        "finished: the budget is spent")
    assert stopping.last_outcome(trainer(st, max_steps=11, max_tokens=700, plateau_evals=0)) == (
        "finished: 8 passes over the training data (MAX_EPOCHS), before the budget")  # past the cap
    st.plateau_stopped, st.best_val, st.best_step = True, 1.25, 7
    assert stopping.last_outcome(trainer(st, max_steps=11)) == (
        "finished: the val loss stopped improving during the warmdown (best 1.2500 at step 7); "
        "600s (0.17h) of the budget unspent")


def test_the_budget_left_is_said_in_seconds_hours_and_on_gpus_dollars():
    st = RunState()
    assert stopping.unspent_text(trainer(st), 7200.0) == "7,200s (2.00h)"
    assert stopping.unspent_text(trainer(st, device="cuda", world=8), 7200.0) == "7,200s (2.00h, $64)"
    used_past = trainer(RunState(plateau_stopped=True), budget=100.0)
    assert "0s (0.00h) of the budget unspent" in stopping.plateau_outcome(used_past, 150.0)  # never negative


def test_the_projected_end_is_the_first_of_the_budget_the_passes_the_anneal_and_max_steps():
    st = RunState(step=9, tokens_seen=1000)
    assert stopping.projected_end(trainer(st), 400.0, 10.0) == (600.0, "budget")
    assert stopping.projected_end(trainer(st), 1200.0, 10.0) == (0.0, "budget")  # never negative
    # 2000 tokens to the pass cap at 10 tok/s: 200 s, sooner than the budget's 600 s
    assert stopping.projected_end(trainer(st, max_tokens=3000), 400.0, 10.0) == (200.0, "8 passes")
    assert stopping.projected_end(trainer(st, max_tokens=3000), 400.0, 2.0) == (600.0, "budget")
    assert stopping.projected_end(trainer(st, max_tokens=3000), 400.0, 16.0) == (125.0, "8 passes")
    assert stopping.projected_end(trainer(st, max_tokens=3000), 400.0, 32.0) == (62.5, "8 passes")
    # the anneal the val minimum started ends at 1000 + 1500 tokens: 150 s; not with PLATEAU_EVALS=0
    st.anneal_start_tokens, st.anneal_tokens = 1000, 1500
    assert stopping.projected_end(trainer(st), 400.0, 10.0) == (150.0, "the warmdown the val minimum started")
    assert stopping.projected_end(trainer(st), 400.0, 16.0) == (93.75, "the warmdown the val minimum started")
    assert stopping.projected_end(trainer(st, plateau_evals=0), 400.0, 10.0) == (600.0, "budget")
    st.anneal_start_tokens, st.anneal_tokens = 0, 500  # from token 0: it ended at 500 tokens, already passed
    assert stopping.projected_end(trainer(st), 400.0, 10.0) == (0.0, "the warmdown the val minimum started")
    # max_steps 20 after step 9: steps 10-19 of 100 tokens at 10 tok/s, 100 s
    st.anneal_start_tokens = -1
    assert stopping.projected_end(trainer(st, cfg_max_steps=20), 400.0, 10.0) == (100.0, "max_steps")
    assert stopping.projected_end(trainer(st, cfg_max_steps=20), 400.0, 1.0) == (600.0, "budget")
    st.step = 10
    assert stopping.projected_end(trainer(st, cfg_max_steps=20), 400.0, 10.0) == (90.0, "max_steps")
    assert stopping.projected_end(trainer(st, cfg_max_steps=20), 400.0, 16.0) == (56.25, "max_steps")


def test_a_stopping_rank_gets_twice_its_step_and_save_its_longest_eval_and_a_margin():
    st = RunState(step_seconds=3.0, save_seconds=5.0, eval_seconds=7.0)
    assert stopping.stop_grace(trainer(st)) == stopping.STOP_MARGIN_SECONDS + 2 * (3.0 + 5.0) + 7.0 == 83.0
    # before the first save, its estimate
    st.save_seconds = 0.0
    assert stopping.stop_grace(trainer(st, first_save=11.0)) == 60.0 + 2 * (3.0 + 11.0) + 7.0


def decide_cfg(**given):
    """The settings decide reads: evals and saves by the clock only far apart, no warmups."""
    return SimpleNamespace(**{**dict(eval_every_minutes=1000.0, eval_every_steps=0, save_every_minutes=1000.0,
                                     save_every_steps=0, plateau_evals=4, max_steps=0, warmdown_frac=0.4,
                                     seq_warmup_frac=0.0, batch_warmup_frac=0.0), **given})


def decide_trainer(cfg, st: RunState, rank=0, world=1, max_steps=10**9, max_tokens=math.inf):
    """A 100 s budget with no save in flight or estimated, no eval by tokens."""
    return SimpleNamespace(cfg=cfg, d=Dist(rank, rank, world, torch.device("cpu")), st=st, max_steps=max_steps,
                           budget_seconds=100.0, max_tokens=max_tokens, first_save_seconds=0.0,
                           saver=SimpleNamespace(seconds_left=lambda s: 0.0), eval_every_tokens=math.inf,
                           restart_lost=0.0, restart_setup=0.0)


def test_decide_gives_every_rank_rank_0s_flags_and_progress():
    """A rank other than 0 decides nothing clock-driven itself: its flags are 0 (the all-reduce's max
    gives it rank 0's), a signal or a save still at work counts from any rank."""
    cfg = decide_cfg(eval_every_minutes=1.0, save_every_minutes=1.0, seq_warmup_frac=0.3, batch_warmup_frac=0.3)
    st = RunState(step=5, used_seconds=70.0)
    t = decide_trainer(cfg, st, rank=1, world=2)
    loop = SimpleNamespace(eval_seconds=0.0, last_eval_time=0.0, last_save_time=0.0, reserve_seconds=0.0)
    t.d.all_reduce = lambda flags, op: flags  # one rank's own view, before the reduce
    assert stopping.decide(t, loop, 15, writing=True) == (0, 0, 0, 15, 1, 0, 0, 0)
    assert loop.progress == 0.0 and st.warmup_progress == 0.0
    t.d = Dist(0, 0, 2, torch.device("cpu"))
    t.d.all_reduce = lambda flags, op: flags
    # rank 0: an eval and a save due by the clock, the schedule's warmdown begins (70% of the budget)
    assert stopping.decide(t, loop, 0) == (0, 1, 1, 0, 0, 1, 1, 0)
    assert loop.progress == 0.7 and st.warmup_progress == 0.7
    for used in (30.0, 50.0, 60.0):  # up to the warmdown's start (60%): none begins
        st.used_seconds = used
        assert stopping.decide(t, loop, 0)[5] == 0, used


def test_the_last_step_is_max_steps_or_the_pass_caps_or_any_past_them():
    now = time.time()

    def last(step, tokens, max_steps=10**9, max_tokens=math.inf):
        t = decide_trainer(decide_cfg(), RunState(step=step, tokens_seen=tokens), max_steps=max_steps,
                           max_tokens=max_tokens)
        loop = SimpleNamespace(eval_seconds=0.0, last_eval_time=now, last_save_time=now, reserve_seconds=0.0)
        return stopping.decide(t, loop, 0)[0]

    assert [last(s, 0, max_steps=5) for s in (4, 5, 6)] == [0, 1, 1]  # 6: a resume past a lowered MAX_STEPS
    big = int("4000000000")  # two int objects, as a run's counts are
    assert [last(5, n, max_tokens=big) for n in (big - 1, int("4000000000"), big + 1)] == [0, 1, 1]


def test_a_save_due_by_the_clock_is_paid_for_before_the_budget_ends():
    now = time.time()
    for used, last in ((96.0, 0), (97.0, 1)):  # 97 + a 3 s save reaches the 100 s budget
        t = decide_trainer(decide_cfg(save_every_minutes=1.0), RunState(step=5, used_seconds=used, save_seconds=3.0))
        loop = SimpleNamespace(eval_seconds=0.0, last_eval_time=now, last_save_time=now - 120, reserve_seconds=0.0)
        assert stopping.decide(t, loop, 0)[:3] == (last, 0, 1), used


def test_a_resumes_pending_restart_charge_is_paid_for_before_its_first_step():
    """A resume's lost seconds and setup are charged at the first step it trains: a step they would
    carry past the budget is not trained. Before, a relaunch of a run that had ended 0.07 s short of
    its 10 s budget trained one more step and was charged its 1.0 s setup: 10.9 s of 10."""
    now = time.time()
    loop = SimpleNamespace(eval_seconds=0.0, last_eval_time=now, last_save_time=now, reserve_seconds=0.5)
    for used, lost, setup, last in ((98.0, 0.0, 1.0, 0), (98.0, 0.0, 1.5, 1), (97.0, 2.0, 0.5, 1),
                                    (96.0, 2.0, 1.0, 0), (99.4, 0.0, 0.0, 0)):
        t = decide_trainer(decide_cfg(), RunState(step=735, used_seconds=used))
        t.restart_lost, t.restart_setup = lost, setup
        assert stopping.decide(t, loop, 0)[0] == last, (used, lost, setup)


def test_saves_are_due_by_steps_from_step_1_and_evals_at_step_0():
    cfg = decide_cfg(save_every_steps=3)
    now = time.time()
    for step, evals, saves in ((0, 1, 0), (1, 0, 0), (3, 0, 1), (4, 0, 0), (6, 0, 1)):
        t = decide_trainer(cfg, RunState(step=step, used_seconds=1.0))
        loop = SimpleNamespace(eval_seconds=0.0, last_eval_time=now, last_save_time=now, reserve_seconds=0.0)
        assert stopping.decide(t, loop, 0)[1:3] == (evals, saves), step
    cfg.eval_every_steps, cfg.save_every_steps = 2, 0
    for step, evals in ((2, 1), (3, 0), (4, 1)):
        st = RunState(step=step, used_seconds=1.0)
        t.st = st
        assert stopping.decide(t, loop, 0)[1:3] == (evals, 0), step
    cfg.eval_every_steps, cfg.save_every_steps = 0, 1  # a save every step
    assert stopping.decide(t, loop, 0)[1:3] == (0, 1)
    cfg.eval_every_steps, cfg.save_every_steps = 1, 0  # an eval every step
    assert stopping.decide(t, loop, 0)[1:3] == (1, 0)
    cfg.eval_every_steps, cfg.save_every_steps = 0, 1
    t.st = RunState(step=1, used_seconds=1.0)
    assert stopping.decide(t, loop, 0)[1:3] == (0, 1)  # from step 1
    # EVAL_EVERY_EPOCHS: due once its tokens have gone by since the last eval, or more
    cfg.save_every_steps, t.eval_every_tokens = 0, 1000.0
    for last_eval_tokens, due in ((4001, 0), (4000, 1), (3000, 1)):
        t.st = RunState(step=7, used_seconds=1.0, tokens_seen=5000, last_eval_tokens=last_eval_tokens)
        assert stopping.decide(t, loop, 0)[1:3] == (due, 0), last_eval_tokens


def test_evals_and_saves_are_due_by_the_clock_from_the_minute_they_are_set_to(monkeypatch):
    monkeypatch.setattr(stopping.time, "time", lambda: 10_000.0)
    t = decide_trainer(decide_cfg(eval_every_minutes=2.0, save_every_minutes=3.0), RunState(step=5, used_seconds=1.0))
    for ago, due in ((119.0, (0, 0)), (120.0, (1, 0)), (179.0, (1, 0)), (180.0, (1, 1))):
        loop = SimpleNamespace(eval_seconds=0.0, last_eval_time=10_000.0 - ago, last_save_time=10_000.0 - ago,
                               reserve_seconds=0.0)
        assert stopping.decide(t, loop, 0)[1:3] == due, ago


def test_the_runs_end_keeps_room_for_the_final_eval_save_export_and_step():
    """final_reserve: the measured eval, save and step, and the export as its share of a save; before
    any save is measured, the estimate of the first one."""
    t = trainer(RunState(eval_seconds=3.0, save_seconds=10.0, step_seconds=0.5), first_save=99.0)
    t.export_share = 0.5
    assert stopping.final_reserve(t) == pytest.approx(3.0 + 10.0 * 1.5 + 0.5)
    t = trainer(RunState(eval_seconds=3.0, step_seconds=0.5), first_save=20.0)
    t.export_share = 0.25
    assert stopping.final_reserve(t) == pytest.approx(3.0 + 20.0 * 1.25 + 0.5)


def test_a_slow_eval_stretches_the_clocks_cadence_so_evals_take_at_most_a_tenth(monkeypatch):
    """EVAL_EVERY_MINUTES=0.5 with a 12 s eval (a d8's on 2 CPU cores) would spend 29% of the run
    evaluating: the next clock-driven eval waits 9 x 12 = 108 s, and so does the next save by the clock,
    which brings an eval. The process's latest eval sets it; before its first, the run's slowest (a
    resume's checkpoint). The evals and saves by steps stand."""
    monkeypatch.setattr(stopping.time, "time", lambda: 10_000.0)
    cfg = decide_cfg(eval_every_minutes=0.5)

    def due(latest, slowest, eval_ago=0.0, save_ago=0.0):
        t = decide_trainer(cfg, RunState(step=50, used_seconds=1.0, eval_seconds=slowest))
        loop = SimpleNamespace(eval_seconds=latest, last_eval_time=10_000.0 - eval_ago,
                               last_save_time=10_000.0 - save_ago, reserve_seconds=0.0)
        return stopping.decide(t, loop, 0)[1:3]

    for latest, slowest, ago, expected in ((12.0, 12.0, 107.0, 0), (12.0, 12.0, 108.0, 1), (1.0, 12.0, 31.0, 1),
                                           (1.0, 1.0, 29.0, 0), (0.0, 12.0, 107.0, 0), (0.0, 12.0, 108.0, 1),
                                           (0.0, 0.0, 30.0, 1), (12.5, 12.5, 112.2, 0), (12.5, 12.5, 112.5, 1)):
        assert due(latest, slowest, eval_ago=ago)[0] == expected, (latest, slowest, ago)
    cfg.save_every_minutes = 1.0  # a save brings an eval: the clock's saves wait as long
    for latest, ago, expected in ((12.0, 107.0, 0), (12.0, 108.0, 1), (1.0, 60.0, 1), (1.0, 59.0, 0)):
        assert due(latest, latest, save_ago=ago)[1] == expected, (latest, ago)
    cfg.eval_every_steps, cfg.save_every_steps = 10, 25
    assert due(12.0, 12.0) == (1, 1)
