"""Everything that touches the persistent volume: workspace root, atomic writes, checkpoint files.

One writer and one reader, shared by the trainer and the server. Layout (design.md):
    <workspace>/checkpoints/<model_tag>/model_<step>.pt, optim_<step>_rank<r>.pt, meta_<step>.json,
    best.json. A step counts only once its meta file exists: meta is written last, after every
    rank's files are on disk, so a crash mid-save leaves an incomplete step that is never loaded.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from experiment.model import GPT, GPTConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
META_RE = re.compile(r"^meta_(\d{6,})\.json$")


class CheckpointError(Exception):
    """A checkpoint that cannot be used, with the path and the reason."""


def default_workspace() -> Path:
    """/workspace/<project> on a rented box with a persistent volume, else the repository itself."""
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
    _atomic_write(Path(path), lambda f: torch.save(obj, f))


def load_tensors(path: Path) -> dict:
    # weights_only: a checkpoint is data, never code. mmap avoids a full copy in RAM for big models.
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def model_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f"model_{step:06d}.pt"


def optim_path(run_dir: Path, step: int, rank: int) -> Path:
    return Path(run_dir) / f"optim_{step:06d}_rank{rank}.pt"


def meta_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f"meta_{step:06d}.json"


def complete_steps(run_dir: Path) -> list[int]:
    """Steps whose meta (the completion marker) exists, ascending."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    return sorted(int(m.group(1)) for p in run_dir.iterdir() if (m := META_RE.match(p.name)))


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read JSON ({e})") from e


def read_meta(run_dir: Path, step: int) -> dict:
    return read_json(meta_path(run_dir, step))


def read_best(run_dir: Path) -> dict | None:
    path = Path(run_dir) / "best.json"
    return read_json(path) if path.exists() else None


def strip_compile_prefix(state_dict: dict) -> dict:
    # torch.compile wraps the module and prefixes every key; checkpoints always hold plain names.
    return {k.removeprefix("_orig_mod."): v for k, v in state_dict.items()}


def prune(run_dir: Path, keep_last: int) -> list[int]:
    """Delete complete checkpoints older than the newest `keep_last`, never the best one.

    The meta file goes first, so an interrupted prune leaves an incomplete (ignored) step, never a
    complete step with files missing. Returns the deleted steps.
    """
    run_dir = Path(run_dir)
    steps = complete_steps(run_dir)
    best = read_best(run_dir)
    protected = set(steps[-keep_last:]) if keep_last > 0 else set()
    if best is not None:
        protected.add(int(best["step"]))
    deleted = []
    for step in steps:
        if step in protected:
            continue
        meta_path(run_dir, step).unlink(missing_ok=True)
        for p in run_dir.glob(f"*_{step:06d}*.pt"):
            p.unlink(missing_ok=True)
        deleted.append(step)
    return deleted


def remove_incomplete(run_dir: Path) -> None:
    """Drop files of steps that never got their meta (a crash mid-save) and stale temp files."""
    run_dir = Path(run_dir)
    done = set(complete_steps(run_dir))
    for p in run_dir.glob("*.pt"):
        m = re.match(r"^(?:model|optim)_(\d{6,})", p.name)
        if m and int(m.group(1)) not in done and p.is_file():
            p.unlink(missing_ok=True)
    for p in run_dir.glob(".*.tmp"):
        p.unlink(missing_ok=True)


def resolve_serving_checkpoint(path: str | Path | None, workspace: Path) -> Path:
    """A model_*.pt as given; a run directory -> its best (else latest); None -> newest run's best."""
    if path is None:
        root = Path(workspace) / "checkpoints"
        runs = [d for d in root.iterdir() if d.is_dir() and complete_steps(d)] if root.is_dir() else []
        if not runs:
            raise CheckpointError(f"no complete checkpoint under {root}; train first (bash run.sh)")
        path = max(runs, key=lambda d: max(meta_path(d, s).stat().st_mtime for s in complete_steps(d)))
    path = Path(path)
    if path.is_dir():
        best = read_best(path)
        steps = complete_steps(path)
        if best is not None and int(best["step"]) in steps:
            return model_path(path, int(best["step"]))
        if not steps:
            raise CheckpointError(f"{path}: no complete checkpoint (no meta_*.json)")
        return model_path(path, steps[-1])
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    return path


def load_model(path: Path, device: str | torch.device = "cpu") -> tuple[GPT, dict]:
    """Rebuild the model from its meta alone and load its weights; returns (model, meta)."""
    path = Path(path)
    m = re.match(r"^model_(\d{6,})\.pt$", path.name)
    if not m:
        raise CheckpointError(f"{path}: expected a file named model_<step>.pt")
    meta_file = meta_path(path.parent, int(m.group(1)))
    if not meta_file.exists():
        raise CheckpointError(f"{path}: incomplete checkpoint ({meta_file.name} missing)")
    meta = read_json(meta_file)
    model = GPT(GPTConfig(**meta["model_config"]))
    try:
        state = strip_compile_prefix(load_tensors(path))
        model.load_state_dict(state)
    except (RuntimeError, OSError, KeyError) as e:
        raise CheckpointError(f"{path}: cannot load weights ({e})") from e
    return model.to(device).eval(), meta


def publish_dir(tmp: Path, final: Path) -> None:
    """Give a fully written directory its final name in one rename (an existing one wins)."""
    if final.exists():
        shutil.rmtree(tmp)
        return
    os.replace(tmp, final)
