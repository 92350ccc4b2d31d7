"""What a restart costs, counted in the budget (RunState.restart_seconds, inside used_seconds).

A crash (kill -9, a lost node) or a stop on a save in flight throws away the training done since the
newest complete checkpoint, and every restart spends its setup and load before the loop runs again.
The user paid for both. Rank 0 writes a heartbeat (heartbeat.json: the budget used and the step)
every HEARTBEAT_SECONDS between steps and when the loop ends. A resume charges the budget, at its
first step, its own seconds from the trainer's start to the loop and, when it resumes the newest
checkpoint (RESUME=auto), the heartbeat's seconds past that checkpoint. A launch that finds a
heartbeat but no checkpoint (a crash before the first save) starts afresh and is charged the same
way: all the heartbeat's seconds, and its own setup. A resume of an older step
(RESUME=<step>) starts a branch: what the abandoned one trained is not charged to it.
docs/survival.md, "What a restart costs".
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from experiment import checkpoint as ckpt
from experiment.config import TrainConfig
from experiment.distributed import broadcast_object
from experiment.files import atomic_write_json
from experiment.trainer import Loop, Trainer

HEARTBEAT = "heartbeat.json"
# How much a kill -9 can leave uncounted: the time since the last heartbeat. A small file written
# atomically this often costs nothing next to a step.
HEARTBEAT_SECONDS = 10.0


def lost_seconds(run_dir: Path, resume_step: int | None, cfg: TrainConfig) -> float:
    """Rank 0 before a resume: the budget seconds the last launch used past the checkpoint it resumes,
    or, with no checkpoint to resume, all it used (a crash before the first save: the run starts
    afresh, but its lost training was paid for). 0 on an explicit RESUME (a step: a branch; never: a
    fresh run by choice), or without a readable heartbeat from that step on."""
    if cfg.resume != "auto":
        return 0.0
    try:
        beat = json.loads((run_dir / HEARTBEAT).read_text())
        used, step = float(beat["used_seconds"]), int(beat["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0
    if resume_step is None:
        return max(used, 0.0)
    if step < resume_step:  # written before this checkpoint (a heartbeat that failed since): nothing known
        return 0.0
    return max(used - ckpt.run_state(ckpt.read_meta(run_dir, resume_step)).used_seconds, 0.0)


def lost_on_other_gpus(run_dir: Path, lost: float, world_size: int) -> float:
    """GPU-seconds the lost seconds cost beyond what charging them on `world_size` GPUs counts: they
    were spent on the heartbeat's GPU count (RunState.gpu_seconds_base: BUDGET_USD stays dollars)."""
    try:
        spent_on = int(json.loads((run_dir / HEARTBEAT).read_text()).get("world_size", world_size))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0.0
    return lost * (spent_on - world_size)


def restarted(t: Trainer) -> bool:
    """A resume, or a fresh start after a launch that trained and lost it all (every rank alike: the
    lost seconds are rank 0's, broadcast with the resume step)."""
    return t.resume_step is not None or t.lost_seconds > 0


def restart_cost(t: Trainer, now: float) -> float:
    """On a resume, before the loop (every rank: a broadcast): rank 0's lost seconds plus this
    restart's setup, charged at the first step the resumed run trains (charge)."""
    # A fresh start's setup is in its budget already, as every fresh run's is (train.setup)
    setup = now - t.launched if t.resume_step is not None else 0.0
    lost, setup = broadcast_object((t.lost_seconds, setup), t.d)
    t.restart_lost, t.restart_setup = lost, setup
    return lost + setup


def charge(t: Trainer, loop: Loop) -> None:
    """At the resumed run's first step: the restart's cost counts in the budget (used_at_start) and in
    st.restart_seconds, logged, and the heartbeat says so at once. A relaunch of a finished run trains
    no step and is charged nothing: its setup buys no training, and a later extension keeps its hours."""
    lost, setup = t.restart_lost, t.restart_setup
    loop.used_at_start += lost + setup
    t.st.restart_seconds += lost + setup
    t.restart_lost = t.restart_setup = 0.0
    if t.resume_step is None:
        t.log(f"restart | {lost:.1f}s trained before the first checkpoint were lost: counted in the budget, as "
              f"this fresh start's setup is ({t.st.restart_seconds:.1f}s lost to restarts in all)")
    else:
        t.log(f"restart | {lost:.1f}s trained past the checkpoint were lost and {setup:.1f}s went to this restart's "
              f"setup and load: both counted in the budget ({t.st.restart_seconds:.1f}s lost to restarts in all)")
    beat(t, loop, force=True)


def after_export(t: Trainer, loop: Loop) -> None:
    """The final export of best.pt is on the bill: the heartbeat after it, so that an extension of the
    run is charged it; not after a relaunch of a finished run, which trained no step (charge)."""
    if t.resume_step is None or t.st.step > t.resume_step:
        beat(t, loop, force=True)


def beat(t: Trainer, loop: Loop, force: bool = False) -> None:
    """Rank 0: heartbeat.json, when HEARTBEAT_SECONDS have passed since the last (or `force`). Renamed
    into place but not fsynced: an fsync on a network volume can wait behind a background save's
    gigabytes, and every rank would wait at the next collective; a heartbeat a power cut tore is
    read as none (an undercount, never a double count). A failed write costs the accounting's
    precision, not the run: said once."""
    now = time.time()
    if not t.d.master or not force and now - loop.last_beat < HEARTBEAT_SECONDS:
        return
    loop.last_beat = now
    path = t.run_dir / HEARTBEAT
    # A restart's charge still pending (no step has trained since the resume) stays on record for the
    # launch after this one: its lost seconds, and its setup when a stop signal cut it short (a
    # finished run relaunched is charged no setup: charge's docstring).
    stopped = loop.outcome.startswith("stopped")
    pending = t.restart_lost + (t.restart_setup if stopped else 0.0)
    try:
        atomic_write_json(path, {"step": t.st.step, "used_seconds": loop.used() + pending, "time": now,
                                 "world_size": t.d.world_size}, durable=False)
        loop.beat_failed = False
    except OSError as e:
        if not loop.beat_failed:
            t.log(f"warning: {path} could not be written ({e}); a crash now may leave some of the time it "
                  "throws away out of the budget")
        loop.beat_failed = True
