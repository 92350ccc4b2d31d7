"""Training on past a run's end (experiment/extend.py): the step where the warmdown began is saved and
kept; settings that extend an annealed run go back to it and anneal again at the new end, with no LR
jump; settings that cannot are refused in one line that says what to do."""

import dataclasses
import json
import math
import shutil

import pytest
import torch

from conftest import TINY, run_meta, run_train

from experiment import checkpoint as ckpt
from experiment.checkpoint import RunState
from experiment.config import ConfigError, parse_args, resolve
from experiment.extend import extends, rewind_step, rewound, too_short


def _lines(proc, prefix):
    return {int(line.split()[1]): line for line in proc.stdout.splitlines() if line.startswith("step ") and prefix in line}


def _field(line, name):
    return float(line.split(f"| {name} ")[1].split()[0])


@pytest.mark.slow
def test_an_extended_run_goes_back_to_its_warmdown_start_and_anneals_again(tmp_path, corpus):
    # CPU warmdown_frac 0.4: over 10 steps the warmdown begins at step 7 (7/10 > 0.6); saves every 3
    # steps (blocking, so "the newest complete checkpoint" is exact): step 6 is the one before it.
    common = [*TINY, "--data_dir", corpus, "--total_batch_size", 256, "--eval_every_steps", 5,
              "--save_every_steps", 3, "--async_save", 0, "--keep_last", 1, "--plateau_evals", 0]
    first = run_train([*common, "--workspace", tmp_path / "a", "--max_steps", 10])
    run_dir = tmp_path / "a/checkpoints/d2"
    state = run_meta(tmp_path / "a", 10)["state"]
    assert state["warmdown_begun"] and state["warmdown_step"] == 6
    assert run_meta(tmp_path / "a", 6)["state"]["warmdown_begun"] is False
    best = ckpt.read_best(run_dir)
    assert set(ckpt.complete_steps(run_dir)) == {6, best["step"], 10}  # 6 kept past KEEP_LAST=1
    assert ckpt.is_resumable(run_dir, 6)
    refuse, missing = tmp_path / "b", tmp_path / "c"
    shutil.copytree(tmp_path / "a", refuse)
    shutil.copytree(tmp_path / "a", missing)

    again = run_train([*common, "--workspace", tmp_path / "a", "--max_steps", 10])  # the same settings: done
    assert "extend |" not in again.stdout and ckpt.complete_steps(run_dir)[-1] == 10

    more = run_train([*common, "--workspace", tmp_path / "a", "--max_steps", 20])
    assert "extend | the settings extend the run: going back from step 000010 (annealed) to step 000006" in more.stdout
    before, after = _lines(first, "| loss"), _lines(more, "| loss")
    # Step 6's weights on step 6's batch: the same loss as the first run's step 7 had, and its peak LR,
    # where the first run's last step took a quarter of it (progress 0.9, warmdown 0.4).
    assert _field(after[11], "loss") == _field(before[7], "loss")
    assert _field(after[11], "lr") == _field(before[7], "lr") == 4 * _field(before[10], "lr")
    assert _field(after[20], "lr") == _field(before[1], "lr") / 8  # annealed again at the new end (0.95)
    meta = run_meta(tmp_path / "a", 20)
    # The new warmdown begins at 13 (13/20 > 0.6): the newest checkpoint before it is step 12, kept.
    assert meta["state"]["warmdown_step"] == 12 and 12 in ckpt.complete_steps(run_dir)
    assert 6 not in ckpt.complete_steps(run_dir)  # the old one: pruned once no newer step names it
    assert meta["state"]["tokens_seen"] == (6 + 10) * 256  # step 6's tokens, then 10 steps more
    new_best = ckpt.read_best(run_dir)
    assert new_best["val_loss"] <= best["val_loss"] and new_best["step"] in ckpt.complete_steps(run_dir)

    # Too few steps for any at the peak LR: refused, saying how many would do; nothing written.
    proc = run_train([*common, "--workspace", refuse, "--max_steps", 12], check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "MAX_STEPS=12 ends it: give at least 17" in errors[0]
    assert set(ckpt.complete_steps(refuse / "checkpoints/d2")) == {6, best["step"], 10}

    # The checkpoint before the warmdown gone: training on from the annealed step would jump the LR.
    ckpt.meta_path(missing / "checkpoints/d2", 6).unlink()
    proc = run_train([*common, "--workspace", missing, "--max_steps", 20], check=False)
    assert proc.returncode == 2 and "step 000006, its newest checkpoint from before the warmdown, is gone" in proc.stderr
    assert f"INIT_FROM={missing / 'checkpoints/d2'}" in proc.stderr


@pytest.mark.slow
def test_a_resume_with_plateau_evals_0_of_the_step_that_started_the_anneal_trains_on_at_the_peak(tmp_path, corpus):
    """The newest checkpoint is the one whose eval started the val minimum's warmdown: saved before
    its first update, so it records the anneal but no warmdown begun (a background save of that step,
    then Ctrl-C or kill -9). A relaunch with PLATEAU_EVALS=0, as the log suggests, trains on at the
    peak LR, and its schedule's own warmdown records its checkpoint from before it (step 12 here: the
    warmdown begins at 13 of 20). Broken before: the stale anneal marked the warmdown begun at the
    resumed step, whose checkpoint retention then kept for good and a later extension rewound to."""
    common = [*TINY, "--data_dir", corpus, "--total_batch_size", 256, "--save_every_steps", 3, "--async_save", 0,
              "--keep_last", 1, "--workspace", tmp_path]
    run_train([*common, "--max_steps", 6, "--plateau_evals", 0])
    path = ckpt.meta_path(tmp_path / "checkpoints/d2", 6)
    meta = ckpt.read_json(path)
    st = meta["state"]  # as the step whose eval started the anneal saves it (maybe_eval, then maybe_save)
    st.update(warmdown_begun=False, warmdown_step=-1, anneal_start_tokens=st["tokens_seen"], anneal_tokens=4 * 256,
              warmdown_seen=True, plateau_ref=math.inf, warmdown_window=[])
    meta["train_config"]["plateau_evals"] = 4
    path.write_text(json.dumps(meta))
    more = run_train([*common, "--max_steps", 20, "--plateau_evals", 0])
    state = run_meta(tmp_path, 20)["state"]
    assert state["warmdown_begun"] and state["warmdown_step"] == 12 and state["anneal_start_tokens"] == -1
    assert 6 not in ckpt.complete_steps(tmp_path / "checkpoints/d2")  # nothing pins the resumed step
    after = _lines(more, "| loss")
    assert _field(after[7], "lr") == _field(after[12], "lr") > _field(after[14], "lr")  # the peak until 13
    assert "the warmdown the val minimum started at step 000006 is dropped" in more.stdout


def test_only_the_anneal_begun_at_the_resumed_step_itself_is_dropped():
    from experiment.extend import drop_anneal

    on = resolve(parse_args(["--plateau_evals", "4"]), cuda=False, world_size=1)
    off = resolve(parse_args(["--plateau_evals", "0"]), cuda=False, world_size=1)
    stale = dict(tokens_seen=800, anneal_start_tokens=800, anneal_tokens=400, warmdown_seen=True, evals_without_gain=1)
    st = RunState(**stale)
    assert drop_anneal(st, off) and (st.anneal_start_tokens, st.anneal_tokens, st.warmdown_seen) == (-1, 0, False)
    assert not drop_anneal(RunState(**stale), on)  # the stop at the val minimum on: the anneal is in effect
    assert not drop_anneal(RunState(**stale, warmdown_begun=True), off)  # extend.rewind_step's to go back from
    under_way = RunState(**{**stale, "tokens_seen": 1000})  # a meta from before warmdown_begun was recorded
    assert not drop_anneal(under_way, off) and under_way.anneal_start_tokens == 800


def test_what_extends_a_run_and_what_leaves_no_time_at_the_peak_lr():
    cfg = resolve(parse_args(["--training_hours", "1", "--max_epochs", "8", "--plateau_evals", "4"]), cuda=False,
                  world_size=1)
    old = {"plateau_evals": 4, "max_epochs": 8.0, "max_steps": 0}
    st = RunState(used_seconds=3600.0, tokens_seen=6000)
    assert not extends(cfg, old, 3600.0, st, 1000)  # the same settings
    assert extends(cfg, old, 1800.0, st, 1000)  # more hours
    assert extends(cfg, {**old, "max_epochs": 4.0}, 3600.0, st, 1000)  # more passes
    assert not extends(cfg, {**old, "max_epochs": 0.0}, 3600.0, st, 1000)  # a cap where there was none
    plateau = RunState(used_seconds=3600.0, anneal_start_tokens=500)
    assert not extends(cfg, old, 3600.0, plateau, 1000)  # it ended at the val minimum, and still would
    assert not extends(cfg, old, 1800.0, plateau, 1000)  # more hours do not move a minimum
    off = resolve(parse_args(["--training_hours", "1", "--plateau_evals", "0"]), cuda=False, world_size=1)
    assert extends(off, old, 3600.0, plateau, 1000)
    # BUDGET_USD: the dollars decide, not the hours they buy on this launch's GPU count (4 GPUs get twice 8's)
    usd = resolve(parse_args(["--budget_usd", "32", "--max_epochs", "8"]), cuda=False, world_size=4)
    assert usd.training_hours == 2 and not extends(usd, {**old, "budget_usd": 32.0}, 3600.0, st, 1000)
    assert extends(usd, {**old, "budget_usd": 31.0}, 3600.0, st, 1000)
    assert extends(usd, old | {"budget_usd": None}, 3600.0, st, 1000)  # it ran on TRAINING_HOURS: its hours
    # CPU warmdown_frac 0.4: the peak LR ends at 60% of the schedule.
    two = resolve(parse_args(["--training_hours", "2", "--max_epochs", "8"]), cuda=False, world_size=1)
    assert too_short(two, st, 100, 4000, 1000) is None  # 1 h of 2 used; 4 of 8 passes
    short = too_short(two, RunState(used_seconds=5000.0), 100, 6000, 1000)
    assert "TRAINING_HOURS=2 (or BUDGET_USD's hours) leaves no time at the peak LR after the 1.389 h used: give " \
           "more than 2.315" in short
    assert "MAX_EPOCHS=8 ends it: the checkpoint from before the warmdown had seen 6.00 passes; give more than " \
           "10.00" in short
    # The pass cap that ended the run, not raised: more hours would repeat the same warmdown.
    capped = too_short(two, RunState(used_seconds=100.0, tokens_seen=8000), 100, 4000, 1000)
    assert capped == "MAX_EPOCHS=8 ends it where it ended, after 8.00 passes: give more (0: no cap)"
    whole = resolve(parse_args(["--warmdown_frac", "1"]), cuda=False, world_size=1)
    assert "WARMDOWN_FRAC=1 leaves no part of the schedule at the peak LR" in too_short(whole, st, 100, 0, 1000)
    assert math.isclose(5000 / 0.6 / 3600, 2.3148, rel_tol=1e-3)
    # The extended run serves the annealed best until beaten, but its own warmdown is held to its own
    # evals: the old warmdown's count and window are gone, the peak-LR reference is the branch point's.
    state = rewound(RunState(step=6, tokens_seen=600, best_val=2.0, best_step=6, plateau_ref=2.0, warmdown_begun=False),
                    RunState(step=10, tokens_seen=1000, best_val=1.5, best_step=10, plateau_ref=1.6, warmdown_begun=True,
                             warmdown_seen=True, warmdown_window=[1.7, 1.6], evals_without_gain=2, warmdown_step=6,
                             used_seconds=9.0))
    assert (state.step, state.tokens_seen, state.used_seconds, state.best_val, state.plateau_ref) == (10, 600, 9.0, 1.5, 2.0)
    assert not state.warmdown_begun and state.warmdown_step == -1
    assert (state.warmdown_seen, state.warmdown_window, state.evals_without_gain) == (False, [], 0)


@pytest.mark.slow
def test_with_background_saves_the_step_kept_is_the_newest_from_before_the_warmdown(tmp_path, corpus):
    """A save begun before the warmdown and completed in it (the default background writes) is the newest
    checkpoint from before it: recorded and kept, not pruned (KEEP_LAST=1)."""
    run_train([*TINY, "--data_dir", corpus, "--total_batch_size", 256, "--save_every_steps", 1, "--keep_last", 1,
               "--plateau_evals", 0, "--workspace", tmp_path, "--max_steps", 10])
    run_dir = tmp_path / "checkpoints/d2"
    start = run_meta(tmp_path, 10)["state"]["warmdown_step"]
    assert start in (6, 7) and start in ckpt.complete_steps(run_dir) and ckpt.is_resumable(run_dir, start)
    assert run_meta(tmp_path, start)["state"]["warmdown_begun"] is False  # saved before the warmdown's first update


def test_a_stop_inside_the_schedules_warmdown_extends_only_with_plateau_evals_0():
    """The stop at the val minimum can end a run inside the schedule's own warmdown (plateau_stopped,
    no anneal of its own): more hours do not move that minimum, PLATEAU_EVALS=0 trains on."""
    on = resolve(parse_args(["--training_hours", "2", "--plateau_evals", "4"]), cuda=False, world_size=1)
    off = resolve(parse_args(["--training_hours", "1", "--plateau_evals", "0"]), cuda=False, world_size=1)
    old = {"plateau_evals": 4, "max_epochs": 8.0, "max_steps": 0}
    stopped = RunState(used_seconds=3000.0, plateau_stopped=True)
    assert stopped.anneal_start_tokens == -1
    assert not extends(on, old, 3600.0, stopped, 1000)
    assert extends(off, old, 3600.0, stopped, 1000)


def test_too_short_counts_the_reserve_for_the_final_eval_and_save():
    """2,100 s used of a 3,600 s budget is 58% of it, short of the warmdown at 60%; less the 300 s
    that the final eval, save and step take, it is 64%: no time at the peak LR is left."""
    cfg = resolve(parse_args(["--training_hours", "1", "--max_epochs", "0"]), cuda=False, world_size=1)
    st = RunState(used_seconds=2100.0, eval_seconds=100.0, save_seconds=100.0, step_seconds=100.0)
    short = too_short(cfg, st, step=10, start_tokens=0, train_tokens=1000)
    assert short and "TRAINING_HOURS=1 " in short and "give more than 1.056" in short
    assert too_short(cfg, RunState(used_seconds=2100.0), step=10, start_tokens=0, train_tokens=1000) is None


def test_an_extended_run_keeps_the_latest_steps_best_as_a_pair():
    """The best that stands is the latest step's (its val loss and its step together), not the rewound
    start's: best.json and the served model must name one step."""
    start = RunState(step=6, tokens_seen=1536, best_val=2.0, best_step=3)
    latest = RunState(step=10, tokens_seen=2560, best_val=1.5, best_step=9, used_seconds=50.0, best_weights="average")
    st = rewound(start, latest)
    assert (st.best_val, st.best_step, st.step, st.tokens_seen, st.used_seconds) == (1.5, 9, 10, 1536, 50.0)
    assert st.best_weights == "average"  # what step 9's model files hold (AVERAGE)


def test_too_short_names_the_max_steps_that_would_leave_time_at_the_peak():
    """MAX_STEPS ends the extended run where the resumed step already lies in its warmdown (step /
    MAX_STEPS >= 1 - WARMDOWN_FRAC, 0.6 on CPU, the boundary included): it names the least that works."""
    def short(max_steps, step):
        cfg = resolve(parse_args(["--training_hours", "100", "--max_epochs", "0", "--max_steps", str(max_steps)]),
                      cuda=False, world_size=1)
        return too_short(cfg, RunState(), step=step, start_tokens=0, train_tokens=1000)

    assert "MAX_STEPS=12 ends it: give at least 17" in short(12, 10)  # 10 / 0.6 = 16.7
    assert short(17, 10) is None
    assert "MAX_STEPS=10 ends it: give at least 11" in short(10, 6)  # 6 / 10 is 0.6 exactly
    assert short(11, 6) is None


def _checkpoint(run_dir, step, tokens, warmdown_begun=False, warmdown_step=-1, budget=3600.0, **state):
    """A complete step of a run that ran 1 h with MAX_EPOCHS=8 and the stop at the val minimum off."""
    meta = {"step": step, "val_loss": None, "world_size": 1, "model_parts": 1, "budget_seconds": budget,
            "train_config": {"plateau_evals": 0, "max_epochs": 8.0, "max_steps": 0},
            "state": dataclasses.asdict(RunState(step=step, tokens_seen=tokens, warmdown_begun=warmdown_begun,
                                                 warmdown_step=warmdown_step, **state))}
    assert ckpt.save_checkpoint(run_dir, step, {"w": torch.ones(2)}, {"s": torch.ones(1)}, meta) is None


def test_rewind_step_goes_back_only_when_the_settings_extend_a_run_in_its_warmdown(tmp_path):
    more = resolve(parse_args(["--training_hours", "4", "--max_epochs", "8", "--plateau_evals", "0"]), cuda=False,
                   world_size=1)
    same = resolve(parse_args(["--training_hours", "1", "--max_epochs", "8", "--plateau_evals", "0"]), cuda=False,
                   world_size=1)
    _checkpoint(tmp_path, 6, 600, used_seconds=2000.0)
    _checkpoint(tmp_path, 10, 1000, warmdown_begun=True, warmdown_step=6, used_seconds=3600.0)
    assert rewind_step(tmp_path, 10, more, 1000) == 6
    assert rewind_step(tmp_path, 10, same, 1000) is None  # a plain resume: its warmdown goes on
    assert rewind_step(tmp_path, 6, more, 1000) is None  # before the warmdown: nothing to go back from
    # The extended run's peak is measured from the warmdown start's tokens: 6 of 8 passes leave none
    _checkpoint(tmp_path / "late", 6, 6000, used_seconds=2000.0)
    _checkpoint(tmp_path / "late", 10, 8000, warmdown_begun=True, warmdown_step=6, used_seconds=3600.0)
    with pytest.raises(ConfigError, match=r"MAX_EPOCHS=8 ends it: the checkpoint from before the warmdown had seen "
                                          r"6\.00 passes"):
        rewind_step(tmp_path / "late", 10, more, 1000)
    # Step 0 (the untrained model's save, when the warmdown began before any other) is a start like any
    _checkpoint(tmp_path / "zero", 0, 0)
    _checkpoint(tmp_path / "zero", 10, 1000, warmdown_begun=True, warmdown_step=0, used_seconds=3600.0)
    assert rewind_step(tmp_path / "zero", 10, more, 1000) == 0
    ckpt.meta_path(tmp_path / "zero", 0).unlink()
    with pytest.raises(ConfigError, match="step 000000, its newest checkpoint from before the warmdown, is gone"):
        rewind_step(tmp_path / "zero", 10, more, 1000)


def test_rewind_step_refuses_a_warmdown_start_that_is_none_gone_incomplete_or_damaged(tmp_path):
    more = resolve(parse_args(["--training_hours", "4", "--max_epochs", "8", "--plateau_evals", "0"]), cuda=False,
                   world_size=1)

    def run(name, start=6):
        run_dir = tmp_path / name
        _checkpoint(run_dir, 6, 600, used_seconds=2000.0)
        _checkpoint(run_dir, 10, 1000, warmdown_begun=True, warmdown_step=start, used_seconds=3600.0)
        return run_dir

    with pytest.raises(ConfigError, match="it has no checkpoint from before the warmdown"):
        rewind_step(run("none", start=-1), 10, more, 1000)
    gone = run("gone")
    ckpt.meta_path(gone, 6).unlink()
    incomplete = run("incomplete")
    ckpt.optim_path(incomplete, 6, 0).unlink()  # retention dropped its optimizer shard, in a meta that
    meta = json.loads(ckpt.meta_path(incomplete, 6).read_text())  # predates the files' record (no damage seen)
    del meta["files"]
    ckpt.meta_path(incomplete, 6).write_text(json.dumps(meta))
    damaged = run("damaged")
    path = ckpt.model_path(damaged, 6)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))  # same size, another checksum
    for run_dir in (gone, incomplete, damaged):
        with pytest.raises(ConfigError, match="step 000006, its newest checkpoint from before the warmdown, is gone "
                                              "or damaged"):
            rewind_step(run_dir, 10, more, 1000)


def _cfg(*flags):
    return resolve(parse_args([*map(str, flags)]), cuda=False, world_size=1)


def test_extends_compares_budgets_to_the_second_and_max_steps_by_value():
    old = {"plateau_evals": 0, "max_epochs": 8.0, "max_steps": 1000}
    st = RunState(used_seconds=3600.0)
    cfg = _cfg("--training_hours", 3600.5 / 3600, "--max_epochs", 8, "--plateau_evals", 0, "--max_steps", 1000)
    assert extends(cfg, old, 3600.0, st, 1000)  # half a second more is more
    same = _cfg("--training_hours", 1, "--max_epochs", 8, "--plateau_evals", 0, "--max_steps", 1000)
    assert extends(same, old, 3599.5, st, 1000) and not extends(same, old, 3600.0, st, 1000)
    assert not extends(same, {**old, "max_steps": int("1000")}, 3600.0, st, 1000)  # equal, as read from a meta
    fewer = _cfg("--training_hours", 1, "--max_epochs", 8, "--plateau_evals", 0, "--max_steps", 500)
    assert not extends(fewer, old, 3600.0, st, 1000)  # fewer steps extend nothing
    assert extends(same, {**old, "max_steps": 500}, 3600.0, st, 1000)


def test_too_short_at_its_boundaries():
    one = _cfg("--training_hours", 1, "--max_epochs", 0)
    assert too_short(one, RunState(used_seconds=2160.0), 10, 0, 1000)  # 60% used: the warmdown's start itself
    assert too_short(one, RunState(used_seconds=2159.9), 10, 0, 1000) is None
    tiny = _cfg("--training_hours", 0.01, "--max_epochs", 0)  # 36 s, less than the reserve for the end
    assert too_short(tiny, RunState(used_seconds=1.0, eval_seconds=100.0), 10, 0, 1000)
    assert too_short(tiny, RunState(used_seconds=0.4, eval_seconds=35.5), 10, 0, 1000)  # 0.4 of the 0.5 s left
    # the hours it names, at the third decimal's rounding: 6,481.9 s is 1.80053 h, 6,481.77 s 1.80049 h
    hours = _cfg("--training_hours", 1.8, "--max_epochs", 0)
    assert "give more than 1.801" in too_short(hours, RunState(used_seconds=3889.14), 10, 0, 1000)
    assert "give more than 1.800" in too_short(hours, RunState(used_seconds=3889.06), 10, 0, 1000)
    # passes: the warmdown start's 6.9 of MAX_EPOCHS=11 is 63% (ends it), 4.8 of 8 is 60% exactly (ends it)
    eleven, eight = _cfg("--training_hours", 100, "--max_epochs", 11), _cfg("--training_hours", 100, "--max_epochs", 8)
    assert "MAX_EPOCHS=11 ends it: " in too_short(eleven, RunState(), 10, 6900, 1000)
    assert "MAX_EPOCHS=8 ends it: " in too_short(eight, RunState(), 10, 4800, 1000)
    assert too_short(eight, RunState(), 10, 4799, 1000) is None
    # the cap that ended the run: 2.5 passes of MAX_EPOCHS=2.5, and a hair short of 8 over 10^10 tokens
    half = _cfg("--training_hours", 100, "--max_epochs", 2.5)
    assert "ends it where it ended, after 2.50 passes" in too_short(half, RunState(tokens_seen=2500), 10, 0, 1000)
    assert too_short(eight, RunState(tokens_seen=7500), 10, 0, 1000) is None  # 7.5 of 8: the cap did not end it
    big = 10**10
    assert "ends it where it ended" in too_short(eight, RunState(tokens_seen=8 * big - 1), 10, 0, big)


def test_rewound_and_drop_anneal_clear_every_field_of_the_old_warmdown():
    latest = RunState(step=10, tokens_seen=1000, warmdown_begun=True, warmdown_step=6, anneal_start_tokens=800,
                      anneal_tokens=300, plateau_stopped=True, warmdown_seen=True, evals_without_gain=2,
                      warmdown_window=[1.7])
    st = rewound(RunState(step=6, tokens_seen=600), latest)
    assert (st.anneal_start_tokens, st.anneal_tokens, st.plateau_stopped) == (-1, 0, False)
    assert (st.last_eval_step, st.last_eval_tokens) == (10, 600)
    from experiment.extend import drop_anneal

    tokens = int("800")  # as read from a meta: equal, not the same int
    st = RunState(tokens_seen=800, anneal_start_tokens=tokens, anneal_tokens=400, warmdown_seen=True,
                  evals_without_gain=3, warmdown_window=[1.5], plateau_ref=1.2)
    assert drop_anneal(st, _cfg("--plateau_evals", 0))
    assert (st.anneal_start_tokens, st.anneal_tokens, st.warmdown_seen, st.evals_without_gain, st.warmdown_window,
            st.plateau_ref) == (-1, 0, False, 0, [], math.inf)
