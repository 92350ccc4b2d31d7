"""Everything that touches the persistent volume: workspace root, atomic writes, checkpoint files.

One writer and one reader, shared by the trainer and the server: file primitives first, then the
trainer's save (every rank's shard, meta last) and load (any world size). Layout (design.md):
    <workspace>/checkpoints/<model_tag>/model_<step>.pt, optim_<step>_rank<r>.pt, meta_<step>.json,
    best.json. A step counts only once its meta file exists: meta is written last, after every
    rank's files are on disk, so a crash mid-save leaves an incomplete step that is never loaded.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from experiment.distributed import Dist, all_ranks_ok
from experiment.model import GPT, GPTConfig

if TYPE_CHECKING:  # annotations only: dataloader imports this module
    from experiment.dataloader import Prepared
    from experiment.optim import ShardedOptimizer
    from experiment.train import RunLog, TrainConfig

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


# ---------------------------------------------------------------- the trainer's checkpoints


@dataclass
class RunState:
    """What a checkpoint restores besides weights and optimizer state."""
    step: int = 0
    tokens_seen: int = 0
    used_seconds: float = 0.0
    best_val: float = math.inf
    best_step: int = -1
    evals_since_best: int = 0
    data_state: dict | None = None
    # Measured durations (longest eval, longest save, recent step): the reserve kept for the final
    # eval + save. Persisted, so a resumed run still knows what its ending costs.
    eval_seconds: float = 0.0
    save_seconds: float = 0.0
    step_seconds: float = 0.0
    nonfinite_steps: int = 0  # updates skipped because the loss or gradients were not finite


def save_checkpoint(run_dir: Path, model: GPT, opt: ShardedOptimizer, data_state: dict, st: RunState,
                    val_loss: float | None, cfg: TrainConfig, prepared: Prepared, budget_seconds: float,
                    d: Dist, log: RunLog) -> bool:
    """Model once (rank 0), one optimizer shard per rank, then meta last as the completion marker.

    Returns False on every rank if any rank failed to write (disk full, say): the step stays
    incomplete, its files are removed, and the checkpoints before it are untouched.
    """
    error = None
    try:
        if d.master:
            atomic_torch_save(model_path(run_dir, st.step), strip_compile_prefix(model.state_dict()))
        rng = {"cpu": torch.get_rng_state()}
        if d.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(d.device)
        atomic_torch_save(optim_path(run_dir, st.step, d.rank), {**opt.shard_state(), "rng": rng})
    except OSError as e:
        error = e
        print(f"[rank {d.rank}] error: writing checkpoint step {st.step:06d} failed: {e}", file=sys.stderr, flush=True)
    positions = [None] * d.world_size
    if d.world_size > 1:
        dist.all_gather_object(positions, data_state)
    else:
        positions = [data_state]
    # Every rank's files are on disk (or have failed) before the meta can make the step complete.
    if not all_ranks_ok(error is None, d):
        if d.master:
            remove_incomplete(run_dir)
            log(f"error: checkpoint step {st.step:06d} not saved ({error or 'another rank failed'}); "
                "earlier checkpoints are kept, training goes on")
        return False
    ok = True
    if d.master:
        try:
            ok = _write_meta(run_dir, model, st, val_loss, cfg, prepared, budget_seconds, positions, d, log)
        except OSError as e:
            ok = False
            remove_incomplete(run_dir)
            log(f"error: checkpoint step {st.step:06d} not saved (meta: {e}); earlier checkpoints are kept")
    return all_ranks_ok(ok, d)


def _write_meta(run_dir, model, st, val_loss, cfg, prepared, budget_seconds, positions, d, log) -> bool:
    improved = st.best_step == st.step
    meta = {
        "step": st.step, "tokens_seen": st.tokens_seen, "used_seconds": st.used_seconds,
        "budget_seconds": budget_seconds, "val_loss": val_loss,
        "best_val_loss": st.best_val, "best_step": st.best_step, "evals_since_best": st.evals_since_best,
        "eval_seconds": st.eval_seconds, "save_seconds": st.save_seconds, "step_seconds": st.step_seconds,
        "model_config": model.config.to_dict(), "train_config": dataclasses.asdict(cfg),
        "world_size": d.world_size, "data_positions": positions, "nonfinite_steps": st.nonfinite_steps,
        "weights_dtype": str(model.wte.weight.dtype).removeprefix("torch."),
        "activation_checkpointing": model.activation_checkpointing,
        "tokenizer": {k: prepared.meta[k] for k in ("tokenizer", "encoding", "chars", "bos_id", "vocab_size", "vocab_used")},
        "prepared": {"dir": str(prepared.dir), "hash": prepared.meta["hash"]},
        "saved_at": time.time(),
    }
    atomic_write_json(meta_path(run_dir, st.step), meta)
    if improved:
        atomic_write_json(run_dir / "best.json", {"step": st.step, "val_loss": val_loss})
    try:
        deleted = prune(run_dir, cfg.keep_last)
    except OSError as e:  # the new checkpoint is complete; old ones linger until the next prune
        deleted = []
        log(f"warning: pruning old checkpoints failed: {e}")
    log(f"saved step {st.step:06d} -> {run_dir}" + (" (best)" if improved else "")
        + (f"; pruned {', '.join(f'{s:06d}' for s in deleted)}" if deleted else ""))
    return True


def load_checkpoint(run_dir: Path, step: int, model: GPT, opt: ShardedOptimizer, d: Dist) -> RunState:
    meta = read_meta(run_dir, step)
    model.load_state_dict(strip_compile_prefix(load_tensors(model_path(run_dir, step))))
    shards = [load_tensors(optim_path(run_dir, step, r)) for r in range(meta["world_size"])]
    opt.load_shards(shards)
    own = shards[d.rank] if d.rank < len(shards) else shards[0]
    torch.set_rng_state(own["rng"]["cpu"])
    if d.device.type == "cuda" and "cuda" in own["rng"]:
        torch.cuda.set_rng_state(own["rng"]["cuda"], d.device)
    return RunState(step=meta["step"], tokens_seen=meta["tokens_seen"], used_seconds=meta["used_seconds"],
                    best_val=meta["best_val_loss"] if meta["best_step"] >= 0 else math.inf,
                    best_step=meta["best_step"], evals_since_best=meta["evals_since_best"],
                    data_state=meta["data_positions"][0], eval_seconds=meta["eval_seconds"],
                    save_seconds=meta["save_seconds"], step_seconds=meta["step_seconds"],
                    nonfinite_steps=meta["nonfinite_steps"])


def pick_resume_step(run_dir: Path, resume: str) -> int | None:
    steps = complete_steps(run_dir)
    if resume == "never":
        if steps:
            raise CheckpointError(f"--resume never, but {run_dir} holds checkpoints (steps {steps}); "
                              "choose another --model_tag or move them away")
        return None
    if resume == "auto":
        return steps[-1] if steps else None
    if int(resume) not in steps:
        raise CheckpointError(f"--resume {resume}: no complete checkpoint at that step in {run_dir} (have {steps})")
    return int(resume)
