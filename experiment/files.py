"""Generic file primitives: the workspace root, atomic writes, publishing a finished directory.

Used by the data preparation, the checkpoints and gpucheck; knows nothing of either.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


def default_workspace() -> Path:
    """$WORKSPACE when set, so every entry point (trainer, server, sample, bench, gpucheck, prepare)
    finds the same runs; else /workspace/<project> on a rented box with a persistent volume, else the
    repository itself."""
    if os.environ.get("WORKSPACE"):
        return Path(os.environ["WORKSPACE"]).absolute()
    root = Path("/workspace")
    if root.is_dir() and os.access(root, os.W_OK):
        return root / REPO_ROOT.name
    return REPO_ROOT


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the data must be on disk before the rename makes it visible
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj) -> None:
    _atomic_write(Path(path), lambda f: f.write((json.dumps(obj, indent=2) + "\n").encode()))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    _atomic_write(Path(path), lambda f: f.write(data))


def atomic_torch_save(path: Path, obj) -> None:
    def write(f) -> None:
        try:
            torch.save(obj, f)
        except RuntimeError as e:
            # torch.save's zip writer reports a write the disk refused (full, gone) as RuntimeError
            # ("[enforce fail at inline_container.cc] unexpected pos"): an I/O error, raised as one
            # so callers that handle a failed write see it.
            raise OSError(f"writing {path} failed: {e}") from e

    _atomic_write(Path(path), write)


def publish_dir(tmp: Path, final: Path) -> None:
    """Give a fully written directory its final name in one rename (an existing one wins)."""
    if final.exists():
        shutil.rmtree(tmp)
        return
    os.replace(tmp, final)
