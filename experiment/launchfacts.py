"""What experiment/run.sh needs to know before its pre-flight, from one Python process: three lines,
  the number of visible CUDA GPUs (0 without CUDA),
  TrainConfig's field names, space-separated (the settings the launcher maps to flags),
  1 if this torch's torchrun takes --shutdown_timeout (from 2.13 on; 2.11 refuses it and starts nothing), else 0.
It imports torch only where a GPU may be present: importing it costs a launch 1.3-3.5 s of CPU, a
large part of a short CPU launch (tests/README.md, "Where the time goes").
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import re
from pathlib import Path

from experiment.config import TrainConfig

SHUTDOWN_TIMEOUT_FROM = (2, 13)  # the first torch whose torchrun takes --shutdown_timeout


def may_have_gpus(dev: Path = Path("/dev"), proc: Path = Path("/proc/driver/nvidia/gpus")) -> bool:
    """Whether an NVIDIA GPU may be visible: its device nodes (/dev/nvidia0, ...; /dev/dxg under WSL2;
    /dev/nvhost-* on Jetson) or the driver's list of GPUs (/proc/driver/nvidia/gpus, there before the
    nodes on a machine that makes them at CUDA's first use). With none of them CUDA sees no GPU, so
    the count is 0 without asking torch; a sign that proves empty costs only the import."""
    return (any(dev.glob("nvidia[0-9]*")) or (dev / "dxg").exists() or any(dev.glob("nvhost-*"))
            or proc.is_dir() and any(proc.iterdir()))


def gpu_count() -> int:
    if not may_have_gpus():
        return 0
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def has_shutdown_timeout() -> bool:
    """Whether the installed torch is one whose torchrun takes the flag, from its version (read from
    the package's metadata, without importing torch): 2.14 and later, and 2.13 but for its pre-releases
    (2.13.0a0, 2.13.0.dev..., 2.13.0rc1: built before the flag may have landed). A version that cannot
    be read means no flag: the launch goes on with torchrun's own default, as it should."""
    try:
        found = re.match(r"(\d+)\.(\d+)(?:\.\d+)*(\S*)", importlib.metadata.version("torch"))
    except importlib.metadata.PackageNotFoundError:
        return False
    if found is None:
        return False
    version, rest = (int(found[1]), int(found[2])), found[3]
    pre = re.match(r"\.?(a|b|rc|dev)\d*", rest) is not None
    return version > SHUTDOWN_TIMEOUT_FROM or version == SHUTDOWN_TIMEOUT_FROM and not pre


def main() -> None:
    print(gpu_count())
    print(*[f.name for f in dataclasses.fields(TrainConfig)])
    print(int(has_shutdown_timeout()))


if __name__ == "__main__":
    main()
