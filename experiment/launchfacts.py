"""What experiment/run.sh needs to know before its pre-flight, from one Python process (each
process that imports torch costs a launch about two seconds on a small CPU): three lines,
  the number of visible CUDA GPUs (0 without CUDA),
  TrainConfig's field names, space-separated (the settings the launcher maps to flags),
  1 if this torch's torchrun takes --shutdown_timeout (from 2.13 on; 2.11 refuses it and starts nothing), else 0.
"""
from __future__ import annotations

import dataclasses

import torch

from experiment.config import TrainConfig


def has_shutdown_timeout() -> bool:
    """Whether torchrun lists the flag among its options. Any failure of this probe (a torch that
    moved the parser) means no flag: the launch goes on with torchrun's own default, as it should."""
    try:
        from torch.distributed.run import get_args_parser
        return any(s in ("--shutdown_timeout", "--shutdown-timeout")
                   for action in get_args_parser()._actions for s in action.option_strings)
    except Exception:
        return False


def main() -> None:
    print(torch.cuda.device_count() if torch.cuda.is_available() else 0)
    print(*[f.name for f in dataclasses.fields(TrainConfig)])
    print(int(has_shutdown_timeout()))


if __name__ == "__main__":
    main()
