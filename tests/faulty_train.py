"""The trainer with one injected fault, for the tests that need it inside torchrun's workers (a
monkeypatch in the test process does not reach them):

    python -m torch.distributed.run ... tests/faulty_train.py <train.py's flags>

    FAULT_STAGING_RANK=r   rank r's first copy of a save into host memory fails, as when the rank
                           that pins last finds host memory gone (the other ranks' copies succeed)
    FAULT_CLOCK_RANK=r     rank r's wall clock (time.time) runs FAULT_CLOCK_RATE times as fast as the
                           others' from its start: ranks whose clocks and measured durations disagree
    RECORD_LR=dir          every rank appends each LR multiplier it sets to dir/lr_rank<r>.txt
    HEARTBEAT_SECONDS=s    the run's heartbeat every s seconds (experiment/restarts.py), where it has one
    FAULT_EXPORT_SECONDS=s the final export of best.pt takes s seconds longer, as a large model's does
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import time  # noqa: E402

from experiment import saver, train  # noqa: E402
from experiment.optim import ShardedOptimizer  # noqa: E402


def fail_first_staging() -> None:
    stage, failed = saver.HostBuffers.stage, []

    def stage_once_failing(self, obj, key=()):
        if key == () and not failed:  # the top-level call of a save's staging
            failed.append(True)
            raise RuntimeError("CUDA error: out of memory (injected by tests/faulty_train.py)")
        return stage(self, obj, key)

    saver.HostBuffers.stage = stage_once_failing


def skew_clock(rate: float) -> None:
    real, start = time.time, time.time()
    time.time = lambda: start + rate * (real() - start)


def slow_export(seconds: float) -> None:
    export = train.export_best

    def slowly(run_dir):
        time.sleep(seconds)
        return export(run_dir)

    train.export_best = slowly


def record_lr(out: Path) -> None:
    set_lr = ShardedOptimizer.set_lr_multiplier

    def recording(self, mult):
        with open(out / f"lr_rank{os.environ.get('RANK', '0')}.txt", "a") as f:
            f.write(f"{mult!r}\n")
        return set_lr(self, mult)

    ShardedOptimizer.set_lr_multiplier = recording


if __name__ == "__main__":
    rank = os.environ.get("RANK", "0")
    if os.environ.get("FAULT_STAGING_RANK") == rank:
        fail_first_staging()
    if os.environ.get("FAULT_CLOCK_RANK") == rank:
        skew_clock(float(os.environ.get("FAULT_CLOCK_RATE", "2")))
    if os.environ.get("RECORD_LR"):
        record_lr(Path(os.environ["RECORD_LR"]))
    if os.environ.get("FAULT_EXPORT_SECONDS"):
        slow_export(float(os.environ["FAULT_EXPORT_SECONDS"]))
    if os.environ.get("HEARTBEAT_SECONDS"):
        try:
            from experiment import restarts
            restarts.HEARTBEAT_SECONDS = float(os.environ["HEARTBEAT_SECONDS"])
        except ImportError:  # a trainer from before the heartbeat: the test shows what it lacks
            pass
    code = train.main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
