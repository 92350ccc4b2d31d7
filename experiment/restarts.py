"""What a restart costs, counted in the budget (RunState.restart_seconds, inside used_seconds).

A crash (kill -9, a lost node) or a stop on a save in flight throws away the training done since the
newest complete checkpoint, and every restart spends its setup and load before the loop runs again.
The user paid for both. Rank 0 writes a heartbeat (heartbeat.json: the budget used and the step)
every HEARTBEAT_SECONDS and when the loop ends; a resume of the newest checkpoint charges the budget
the heartbeat's seconds past that checkpoint plus its own seconds from the trainer's start to the
loop. A resume of an older step (RESUME=<step>) starts a branch: what the abandoned one trained is
not charged to it. docs/survival.md, "What a restart costs".
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
    """Rank 0 before a resume: the budget seconds the last launch used past the checkpoint it resumes
    (0 on a fresh run, an explicit RESUME step, or without a readable heartbeat)."""
    if resume_step is None or cfg.resume != "auto":
        return 0.0
    try:
        beat = json.loads((run_dir / HEARTBEAT).read_text())
        used = float(beat["used_seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0
    return max(used - ckpt.run_state(ckpt.read_meta(run_dir, resume_step)).used_seconds, 0.0)


def charge(t: Trainer, now: float) -> float:
    """On a resume, before the loop: rank 0's lost seconds and this restart's setup, on every rank;
    added to the run state's restart_seconds and logged. Returns the seconds charged."""
    lost, setup = broadcast_object((t.lost_seconds, now - t.launched), t.d)
    t.st.restart_seconds += lost + setup
    t.log(f"restart | {lost:.1f}s trained past the checkpoint were lost and {setup:.1f}s went to this restart's "
          f"setup and load: both counted in the budget ({t.st.restart_seconds:.1f}s lost to restarts in all)")
    return lost + setup


def beat(t: Trainer, loop: Loop, force: bool = False) -> None:
    """Rank 0: heartbeat.json, when HEARTBEAT_SECONDS have passed since the last (or `force`). A
    failed write costs the accounting's precision, not the run: said once."""
    now = time.time()
    if not t.d.master or not force and now - loop.last_beat < HEARTBEAT_SECONDS:
        return
    loop.last_beat = now
    try:
        atomic_write_json(t.run_dir / HEARTBEAT, {"step": t.st.step, "used_seconds": loop.used(), "time": now})
        loop.beat_failed = False
    except OSError as e:
        if not loop.beat_failed:
            t.log(f"warning: {t.run_dir / HEARTBEAT} could not be written ({e}); a crash now may leave some "
                  "of the time it throws away out of the budget")
        loop.beat_failed = True
