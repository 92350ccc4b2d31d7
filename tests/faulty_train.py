"""The trainer with one injected fault, for the tests that need it inside torchrun's workers (a
monkeypatch in the test process does not reach them):

    python -m torch.distributed.run ... tests/faulty_train.py <train.py's flags>

    FAULT_STAGING_RANK=r   rank r's first copy of a save into host memory fails, as when the rank
                           that pins last finds host memory gone (the other ranks' copies succeed)
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiment import saver, train  # noqa: E402


def fail_first_staging() -> None:
    stage, failed = saver.HostBuffers.stage, []

    def stage_once_failing(self, obj, key=()):
        if key == () and not failed:  # the top-level call of a save's staging
            failed.append(True)
            raise RuntimeError("CUDA error: out of memory (injected by tests/faulty_train.py)")
        return stage(self, obj, key)

    saver.HostBuffers.stage = stage_once_failing


if __name__ == "__main__":
    if os.environ.get("FAULT_STAGING_RANK") == os.environ.get("RANK"):
        fail_first_staging()
    code = train.main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
