"""ON_EXIT: the user's command, run once when a launch ends for any reason (finished, budget spent,
the stop at the val minimum, a stop signal, a crash, torchrun giving up, the launcher killed).

    python -m experiment.onexit PID RUN_DIR SINCE COMMAND      (started by experiment/run.sh)

experiment/run.sh starts this watcher in its own session just before it becomes torchrun (exec keeps
its pid, PID), so the signals that stop the run do not reach it. It waits for PID to be gone and for
the trainer's last words (its "end" record in metrics.jsonl, written after SINCE; workers of a
killed launcher still save and say them; none within WORKERS_GRACE_SECONDS means the run died
without saying why), and runs COMMAND through the shell with:

    RUN_STATUS      finished | stopped | failed
    RUN_OUTCOME     the trainer's words, e.g. "finished: the budget is spent"
    RUN_DIR         the run directory
    BEST_CHECKPOINT the best checkpoint's model file, or the run directory when several ranks saved it
                    in parts (the server and sample serve a run directory's best); empty when none
    BEST_VAL_LOSS   its val loss (empty when there is none)
    BEST_EXPORT     <run directory>/best.pt, the best model as one bf16 file (empty when absent)

e.g. ON_EXIT='[ "$RUN_STATUS" != stopped ] && runpodctl stop pod $RUNPOD_POD_ID' stops the pod that bills
for idle GPUs when the run finished or failed, and leaves it up after a Ctrl-C or a preemption.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

from experiment import checkpoint as ckpt
from experiment.report import read_records

POLL_SECONDS = 2.0
# Workers whose launcher was killed finish their step, save and exit by themselves (ParentWatch:
# poll 2 s, hard exit 45 s later); their last words come within this long after the launcher is gone.
WORKERS_GRACE_SECONDS = 60.0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's: not ours, but alive
        return True
    return True


def last_words(run_dir: Path, since: float) -> str | None:
    """The trainer's outcome of a launch that started at `since` (seconds since the epoch), if it said one."""
    ends = [r for r in read_records(run_dir / "metrics.jsonl") if r.get("kind") == "end" and r["time"] >= since]
    return ends[-1]["outcome"] if ends else None


def outcome_env(run_dir: Path, since: float) -> dict[str, str]:
    """The RUN_* and BEST_* variables of a launch that started at `since`."""
    outcome = last_words(run_dir, since) or ("failed: the run ended without its last words (a crash, torchrun "
                                             "giving up, or every process killed); see training.log")
    env = {"RUN_STATUS": outcome.split(":")[0], "RUN_OUTCOME": outcome, "RUN_DIR": str(run_dir),
           "BEST_CHECKPOINT": "", "BEST_VAL_LOSS": "",
           "BEST_EXPORT": str(run_dir / ckpt.EXPORT_NAME) if (run_dir / ckpt.EXPORT_NAME).is_file() else ""}
    best_dir = run_dir
    with contextlib.suppress(ckpt.CheckpointError):  # a run of generations: the served generation's directory
        best_dir = ckpt.generation_winner(run_dir) or run_dir
    best = ckpt.read_best(best_dir) if best_dir.is_dir() else None
    if best is not None and best["step"] in ckpt.complete_steps(best_dir):
        path = ckpt.model_path(best_dir, best["step"])  # saved in parts by several ranks: the run directory
        env.update(BEST_CHECKPOINT=str(path if path.is_file() else best_dir), BEST_VAL_LOSS=str(best["val_loss"]))
    return env


def main(argv=None) -> int:
    pid, run_dir, since, command = (argv or sys.argv[1:])
    while alive(int(pid)):
        time.sleep(POLL_SECONDS)
    deadline = time.time() + WORKERS_GRACE_SECONDS
    while last_words(Path(run_dir), float(since)) is None and time.time() < deadline:
        time.sleep(POLL_SECONDS)
    env = outcome_env(Path(run_dir), float(since))
    try:
        print(f"on_exit | {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} | {env['RUN_OUTCOME']} | running: "
              f"{command}", flush=True)
    except OSError:  # on_exit.log lives in the run directory, whose volume may be full: run the command anyway
        pass
    return subprocess.run(command, shell=True, env={**os.environ, **env}).returncode


if __name__ == "__main__":
    sys.exit(main())
