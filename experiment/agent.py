"""torchrun as experiment/run.sh starts it: torch.distributed.run's own agent, in this process, and
one thing more. When the trainer ended the launch (launch.end_launch: the user's mistake found at the
start, a final save the volume refused, a diverging loss), the launch ends once, with the trainer's
exit code (2 for a mistake), instead of after MAX_RESTARTS restarts with torchrun's ChildFailedError
traceback and exit 1.

    python -m experiment.agent RUN_DIR [torchrun's flags] -m experiment.train [flags]

How: its workers see AGENT_READS_ENDED, so a restart that finds this node's marker exits 0 at once
(launch.not_restarting); torchrun then ends after that one restart, and this process exits with the
code in the marker. With MAX_RESTARTS=0 torchrun fails at once; when the first failed worker left a
marker with the code it exited with, this process exits with the marker's code too. Otherwise (a
restart that crashed after the marker, say) every outcome is torchrun's own, tracebacks included.
Before any worker starts it removes the markers an earlier launch with its pid left, so that every
attempt (a restart for another node's re-join too, whose restart count stays 0) reads them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    run_dir, args = Path(argv[0]), argv[1:]
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from experiment.launch import AGENT_READS_ENDED, clear_markers, ended_code, marker_codes

    clear_markers(run_dir, os.getpid())  # an earlier launch's, whose torchrun had this pid: before any worker
    os.environ[AGENT_READS_ENDED] = "1"  # the workers inherit it
    try:
        torchrun.main(args)
    except ChildFailedError as e:
        found, failure = ended_code(run_dir, os.getpid()), e.get_first_failure()[1]
        if found is None or marker_codes(run_dir, os.getpid()).get(failure.pid) != failure.exitcode:
            raise  # a crash (first, or in a restart after the marker): torchrun's own report says which rank and why
        return found[0]
    found = ended_code(run_dir, os.getpid())
    return found[0] if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
