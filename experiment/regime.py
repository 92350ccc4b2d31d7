"""Defaults by regime: the settings that follow from how many times the budget would pass over the data.

A run whose budget would pass over its training data more than PASSES times is data-limited: past
about 4 passes repeated tokens are worth less and less (Muennighoff et al. 2023), and without
regularization its val loss bottoms out early, so the stop at the val minimum leaves most of the
budget unspent. There the settings a run leaves to the regime take RECIPE: attention dropout 0.2
(a STUDENT_DEPTH student's is its record's, 0 unless ATTN_DROPOUT is given: generations.student_fields;
a taught generation's share of at most TAUGHT_PASSES passes takes none),
the weight average (AVERAGE=ema) and no pass cap (MAX_EPOCHS=0: the stop at the val minimum ends the
run, as it guards every run; a generation of GENERATIONS=auto whose budget makes enough passes for
another generation after them caps its schedule at autosize.CHAIN_PASSES passes instead: pass_cap).
The CPU screens that chose it: docs/performance.md, "Defaults by regime". At PASSES or fewer they
take OFF, so such a run's step is the plain one: no dropout in the graph, no average, the data's pass
cap.

The passes are the budget's tokens at the run's tok/s over the training tokens (fewer where MAX_STEPS
or an explicit MAX_EPOCHS ends the run first): the tok/s predicted on a GPU whose peak is known (as
the pre-flight and DEPTH=auto predict them), else DEPTH=auto's measured figure for the chosen
depth, else a few eager steps measured at start. A resumed run keeps what its checkpoint resolved to.
"""

from __future__ import annotations

import math
import time

import torch

from experiment import autosize, generations, guards
from experiment import checkpoint as ckpt
from experiment.distributed import broadcast_object
from experiment.runlog import MAX_GOOD_EPOCHS

PASSES = MAX_GOOD_EPOCHS
RECIPE = {"attn_dropout": 0.2, "average": "ema", "max_epochs": 0.0}
# A generation taught by another (half its loss on the teacher's predictions) whose share makes at most
# this many passes trains without attention dropout. Paired on one first generation each (whole Tiny
# Shakespeare): d4 shares of 6 passes (two seeds) served 1.4279 and 1.4216 without it, 1.4503 and 1.4437
# with it; a d6 share of 8.8 passes (3,600 s) 1.3907 without, 1.3968 with. On 100,000 characters (shares
# of 45-52 passes) it served 0.011 higher without: there it stops at its val minimum, as one model does
# (docs/performance.md, "A taught generation without attention dropout"). The gain shrinks with the
# passes (0.022 at 6, 0.006 at 8.8): a line through them crosses zero at 9.8 (8.1 with the relaunch's
# estimate of that share, 7.6: estimates of one share move with the machine's speed). On 100,000
# characters at 200-240 s, second generations of 11.4-24.3 passes served 0.001-0.018 higher without
# (seven pairs, three seeds); third ones of 5.6 and 8.7 passes 0.098 and 0.050 lower. Between 9 and 11
# nothing is measured.
TAUGHT_PASSES = 10
OFF = {"attn_dropout": 0.0, "average": "none"}  # MAX_EPOCHS keeps the data's cap (launch.fill_pass_cap)
SETTINGS = tuple(RECIPE)
UNSET = (None, "auto")  # what a setting left to the regime holds until it is resolved


def left_unset(cfg) -> list[str]:
    """The regime's settings this run leaves to it (ATTN_DROPOUT and MAX_EPOCHS unset, AVERAGE=auto):
    taken before the data's pass cap fills MAX_EPOCHS. The cap is the regime's to lift only in a run
    that may average and that the stop at the val minimum guards (PLATEAU_EVALS > 0): without the
    stop nothing would end a run of hundreds of passes."""
    names = [name for name in SETTINGS if getattr(cfg, name) in UNSET]
    if "max_epochs" in names and (cfg.average == "none" or not cfg.plateau_evals):
        names.remove("max_epochs")
    return names


def regularizes(cfg, unset: list[str], train_tokens: int) -> bool:
    """Whether a data-limited run takes the whole recipe (every one of its settings left to the
    regime, and no MAX_STEPS that keeps it within PASSES passes, where the regime leaves it plain):
    DEPTH=auto's data branch for regularized training assumes it (autosize.reg_passes). A taught
    generation of at most TAUGHT_PASSES passes then trains without its attention dropout (fill): a
    later generation sized by DEPTH=auto (GENERATIONS=N; an auto chain keeps the first one's depth)
    is sized as if it had it, not measured."""
    bounded = cfg.max_steps and cfg.max_steps * cfg.total_batch_size / train_tokens <= PASSES
    return set(SETTINGS) <= set(unset) and not bounded


def estimate_passes(cfg, config, train_tokens: int, gpu, world_size: int, device, auto: dict | None,
                    unset: list[str], teacher_flops: float = 0.0) -> tuple[float, str]:
    """(The passes the run makes over the training data: the budget's at `config`'s tok/s, or fewer
    where MAX_STEPS or an explicit MAX_EPOCHS ends it first; how they were had). Where those bounds
    alone keep them within PASSES nothing is measured. A generation's teacher forward
    (`teacher_flops` per token) is priced into the rate (DEPTH=auto's candidates have it already):
    unpriced, a generation's passes came out about a quarter too many on CPU, and the chain's pass
    cap could leave budget no generation spends."""
    bounds = [(math.inf, "")]
    if cfg.max_steps:
        bounds.append((cfg.max_steps * cfg.total_batch_size / train_tokens, f"in MAX_STEPS={cfg.max_steps} steps"))
    if cfg.max_epochs and "max_epochs" not in unset:  # a cap the regime may not lift
        bounds.append((cfg.max_epochs, f"at MAX_EPOCHS={cfg.max_epochs:g}"))
    bound, why = min(bounds)
    if bound <= PASSES:
        return bound, why
    if gpu is not None and gpu.peak is not None:  # the pre-flight's plan predicts the same
        rate, how = guards.predicted_rate(cfg, config, gpu, world_size, teacher_flops), "predicted"
    elif auto:  # DEPTH=auto measured it already, a teacher priced in (autosize.probe_and_choose)
        rate, how = next(c["tok_per_s"] for c in auto["candidates"] if c["depth"] == config.depth), auto["how"]
    else:
        rate = autosize.with_teacher(measured_rate(cfg, config, device) * world_size, config, teacher_flops)
        how = "measured"
    passes = rate * cfg.training_hours * 3600 / train_tokens
    said = f"at the {how} {rate:,.0f} tok/s" + (" (the teacher's forward priced in)" if teacher_flops else "")
    return (bound, why) if bound < passes else (passes, said)


def measured_rate(cfg, config, device) -> float:
    """One rank's eager tok/s at the run's micro-batch (on a GPU of unknown peak without
    DEVICE_BATCH_SIZE: one sequence, a lower bound on the passes)."""
    try:
        return autosize.measure_tok_per_s(config, cfg.device_batch_size or 1, device)
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the batch probe that follows must see the memory free


def settle(cfg, d, gpu, config, train_tokens: int, run_dir, resume_step: int | None, auto: dict | None,
           unset: list[str], log, teacher_flops: float = 0.0) -> tuple[float, str | None]:
    """The trainer, on every rank alike: the unset settings from the checkpoint (a resume) or by the
    regime of rank 0's estimate (every rank measures at once, so each sees the load training will
    put on the machine; a generation's teacher priced in). Returns (the seconds it took, counted in
    the budget; the line said)."""
    if not unset:
        return 0.0, None
    if resume_step is not None:
        chosen = keep(cfg, unset, ckpt.read_meta(run_dir, resume_step)["train_config"])
        said = f"regime | kept from the checkpoint: {settings_text(chosen)}" if chosen else None
        if said:
            log(said)
        return 0.0, said
    t0 = time.time()
    passes, how = broadcast_object(estimate_passes(cfg, config, train_tokens, gpu, d.world_size, d.device, auto,
                                                   unset, teacher_flops), d)
    said = line(passes, fill(cfg, unset, passes, is_taught(cfg, teacher_flops)), how)
    log(said)
    return time.time() - t0, said


def is_taught(cfg, teacher_flops: float) -> bool:
    """Whether this run learns from a teacher: its forward is in the step (`teacher_flops`) and the
    distillation term has a weight (DISTILL_WEIGHT=0 runs the teacher but learns from the labels alone)."""
    return teacher_flops > 0 and bool(cfg.distill_weight)


def fill(cfg, unset: list[str], passes: float, taught: bool = False) -> dict[str, object]:
    """Set the unset settings by the regime that `passes` puts the run in; returns those set. MAX_EPOCHS
    is left to it only in a run that may average (left_unset): the recipe was measured so. A taught
    generation of at most TAUGHT_PASSES passes takes the
    recipe without attention dropout (`taught`: is_taught)."""
    limited = passes > PASSES
    chosen = {name: (RECIPE if limited else OFF)[name] for name in unset if name in OFF}
    if taught and passes <= TAUGHT_PASSES and "attn_dropout" in chosen:
        chosen["attn_dropout"] = OFF["attn_dropout"]
    if limited and "max_epochs" in unset:
        chosen["max_epochs"] = pass_cap(cfg.generations, passes)
    for name, value in chosen.items():
        setattr(cfg, name, value)
    return chosen


def pass_cap(generations_setting, passes: float) -> float:
    """The recipe's MAX_EPOCHS for a budget of `passes`: none (0); for a generation of GENERATIONS=auto,
    whose share is all the budget the generations before it left, autosize.CHAIN_PASSES where what
    those passes would leave could start another generation (generations.AUTO_MIN_SHARE of them): its
    schedule is then planned for the passes it is likely to use, not for the whole rest of the budget.
    Under that, a cap would leave budget no generation spends, so the schedule spans the share."""
    chain = generations_setting == "auto" and passes >= autosize.CHAIN_PASSES * (1 + generations.AUTO_MIN_SHARE)
    return float(autosize.CHAIN_PASSES) if chain else RECIPE["max_epochs"]


def keep(cfg, unset: list[str], train_config: dict) -> dict[str, object]:
    """A resumed run: the unset settings take what the checkpoint's run resolved (MAX_EPOCHS is kept
    with the data: launch.default_pass_cap). A checkpoint from before the regime had them off."""
    chosen = {name: train_config.get(name, OFF[name]) for name in unset if name in OFF}
    chosen = {name: OFF[name] if value in UNSET else value for name, value in chosen.items()}
    for name, value in chosen.items():
        setattr(cfg, name, value)
    return chosen


def settings_text(chosen: dict[str, object]) -> str:
    return ", ".join(f"{name.upper()}={value:g}" if isinstance(value, float) else f"{name.upper()}={value}"
                     for name, value in chosen.items())


def line(passes: float, chosen: dict[str, object], how: str) -> str:
    """The regime in words: the passes, which side of PASSES they fall, what the unset settings became."""
    return (f"regime | the budget makes about {passes:.1f} passes over the training data {how}: "
            + (f"more than {PASSES}, data-limited: {settings_text(chosen)}" if passes > PASSES
               else f"at most {PASSES}: {settings_text(chosen)}")
            + " (docs/training.md, \"Defaults by regime\")")
