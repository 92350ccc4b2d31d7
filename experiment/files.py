"""Generic file primitives: the workspace root, atomic writes, publishing a finished directory.

Used by the data preparation, the checkpoints and gpucheck; knows nothing of either.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import zlib
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


def volume(path: Path) -> tuple[Path, int]:
    """(the mount point that holds `path`, its free bytes): what an error about a full disk names."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    mount = path
    while not os.path.ismount(mount):
        mount = mount.parent
    return mount, shutil.disk_usage(path).free


def _atomic_write(path: Path, write, durable: bool = True):
    """write(f) into a temp file beside path, fsync (unless not `durable`), rename; returns what write
    returned."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            result = write(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())  # the data must be on disk before the rename makes it visible
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return result


class _Summing:
    """A write-only file that counts and CRC-32s the bytes passing through it to the real one, and
    with `max_bps` > 0 sleeps to keep to that many bytes per second (a slow volume, for the tests and
    `bench save`)."""

    def __init__(self, f, max_bps: float = 0) -> None:
        self.f, self.bytes, self.crc32, self.max_bps = f, 0, 0, max_bps
        self.started = time.monotonic()

    def write(self, data) -> int:
        self.bytes += len(data)
        self.crc32 = zlib.crc32(data, self.crc32)
        written = self.f.write(data)
        if self.max_bps > 0:
            time.sleep(max(self.bytes / self.max_bps - (time.monotonic() - self.started), 0))
        return written

    def flush(self) -> None:
        self.f.flush()


def file_sum(path: Path) -> dict:
    """{"bytes", "crc32"} of a file as it is on disk now, read in 64 MiB blocks."""
    crc, n = 0, 0
    with open(path, "rb") as f:
        while block := f.read(1 << 26):
            crc, n = zlib.crc32(block, crc), n + len(block)
    return {"bytes": n, "crc32": crc}


def atomic_write_json(path: Path, obj, durable: bool = True) -> None:
    _atomic_write(Path(path), lambda f: f.write((json.dumps(obj, indent=2) + "\n").encode()), durable)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    _atomic_write(Path(path), lambda f: f.write(data))


def atomic_torch_save(path: Path, obj, max_bps: float = 0) -> dict:
    """torch.save(obj) to path atomically; returns {"bytes", "crc32"} of what was written (summed on
    the way out, so checking the file later costs no second read now). `max_bps`: _Summing's cap."""
    def write(f) -> dict:
        summing = _Summing(f, max_bps)
        try:
            torch.save(obj, summing)
            return {"bytes": summing.bytes, "crc32": summing.crc32}
        except RuntimeError as e:
            # torch.save's zip writer reports a write the disk refused (full, gone) as RuntimeError
            # ("[enforce fail at inline_container.cc] unexpected pos"): an I/O error, raised as one
            # so callers that handle a failed write see it.
            raise OSError(f"writing {path} failed: {e}") from e

    return _atomic_write(Path(path), write)


def publish_dir(tmp: Path, final: Path) -> None:
    """Give a fully written directory its final name in one rename (an existing one wins)."""
    if final.exists():
        shutil.rmtree(tmp)
        return
    os.replace(tmp, final)
