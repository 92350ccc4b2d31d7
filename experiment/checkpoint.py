"""Checkpoint files: names, retention, the trainer's save and load, the server's loader.

One writer and one reader, shared by the trainer and the server (atomic file primitives live in
experiment/files.py): names and retention first, the server's loader, then the trainer's save (every
rank's files, meta last) and load (any world size). Save and load take and give plain data (state
dicts, meta, rank and world size); the trainer turns its model and optimizer into them. Layout:
    <workspace>/checkpoints/<model_tag>/model_<step>.pt (one process) or model_<step>_rank<r>.pt
    (world > 1: each rank writes the weights it owns, so no rank writes the whole model),
    optim_<step>_rank<r>.pt, meta_<step>.json, best.json. A step counts only once its meta file
    exists: meta is written last, after every rank's files are on disk, so a crash mid-save leaves an
    incomplete step that is never loaded. The meta records each file's size and CRC-32 as written
    ("files"), so a file damaged later (a partial copy, a volume error) is found before it is loaded.
An export (export_model) is one file, the model in bf16 with its meta, for download and serving.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable

import torch

from experiment.files import atomic_torch_save, atomic_write_json, file_sum
from experiment.model import GPT, GPTConfig, build_model

META_RE = re.compile(r"^meta_(\d{6,})\.json$")
MODEL_RE = re.compile(r"^model_(\d{6,})(?:_rank\d+)?\.pt$")  # the whole model or one rank's part
STEP_FILE_RE = re.compile(r"^(?:model|optim)_(\d{6,})(?:_rank\d+)?\.pt$")
# _atomic_write's temp files of the trainer's own files (checkpoints, the report): .<name>.<random>.tmp
CHECKPOINT_TMP_RE = re.compile(
    r"^\.(?:(?:model|optim)_\d{6,}(?:_rank\d+)?\.pt|meta_\d{6,}\.json|best\.json|heartbeat\.json|report\.md|loss\.svg)\..+\.tmp$")
# A step's files are checked against their recorded CRC-32 when they total at most this (a read of
# seconds); larger steps are checked by size, which finds a truncated file, the common damage.
CHECKSUM_MAX_BYTES = 2 * 10**9
EXPORT_FORMAT = "nanogpt-budget-export-1"
EXPORT_NAME = "best.pt"  # the run directory's export of its best step (experiment/export.py)


class CheckpointError(Exception):
    """A checkpoint that cannot be used, with the path and the reason."""


def load_tensors(path: Path) -> dict:
    # weights_only: a checkpoint is data, never code. mmap avoids a full copy in RAM for big models.
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def model_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f"model_{step:06d}.pt"


def model_part_path(run_dir: Path, step: int, rank: int) -> Path:
    return Path(run_dir) / f"model_{step:06d}_rank{rank}.pt"


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


def _step_files(run_dir: Path, step: int) -> list[Path]:
    """The step's model file or parts and its optimizer shards. Matched by number, not by a glob:
    `*_100000*.pt` would also match step 1000000's files."""
    return [p for p in run_dir.iterdir() if (m := STEP_FILE_RE.match(p.name)) and int(m.group(1)) == step]


def prune(run_dir: Path, keep_last: int, keep_step: int = -1) -> list[int]:
    """Delete complete checkpoints older than the newest `keep_last`, never the best one, nor `keep_step`.

    The meta file goes first, so an interrupted prune leaves an incomplete (ignored) step, never a
    complete step with files missing. Returns the deleted steps.
    """
    run_dir = Path(run_dir)
    steps = complete_steps(run_dir)
    best = read_best(run_dir)
    protected = set(steps[-keep_last:]) if keep_last > 0 else set()
    protected.add(keep_step)
    if best is not None:
        protected.add(int(best["step"]))
    deleted = []
    for step in steps:
        if step in protected:
            continue
        meta_path(run_dir, step).unlink(missing_ok=True)
        for p in _step_files(run_dir, step):
            p.unlink(missing_ok=True)
        deleted.append(step)
    return deleted


def drop_old_best_optimizer(run_dir: Path, keep_last: int, keep_step: int = -1) -> int | None:
    """Delete the optimizer shards of the best step once it is older than the newest `keep_last`.

    It is kept to be served, not resumed (a resume continues from the newest steps), and its shards
    are most of its bytes: fp32 master plus momentum is 4-6x the bf16 weights. Model and meta stay,
    so it remains a complete, servable step; `is_resumable` tells it apart. Returns the step whose
    shards were deleted now, else None.
    """
    run_dir = Path(run_dir)
    best, steps = read_best(run_dir), complete_steps(run_dir)
    newest = steps[-keep_last:] if keep_last > 0 else []
    if best is None or int(best["step"]) not in steps or int(best["step"]) in (*newest, keep_step):
        return None  # keep_step (the one before the warmdown) stays resumable
    shards = list(run_dir.glob(f"optim_{int(best['step']):06d}_rank*.pt"))
    for p in shards:
        p.unlink(missing_ok=True)
    return int(best["step"]) if shards else None


def damaged_files(run_dir: Path, step: int, prefix: str = "") -> list[str]:
    """What is wrong with the step's files whose names start with `prefix` (all, or "model_"),
    against the sizes and CRC-32s its meta recorded: sizes always, checksums when those files total
    at most CHECKSUM_MAX_BYTES. Empty when intact, or when the meta predates the record."""
    recorded = {n: info for n, info in read_meta(run_dir, step).get("files", {}).items() if n.startswith(prefix)}
    checksums = sum(info["bytes"] for info in recorded.values()) <= CHECKSUM_MAX_BYTES
    problems = []
    for name, info in sorted(recorded.items()):
        path = Path(run_dir) / name
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != info["bytes"]:
            problems.append(f"{path}: {path.stat().st_size:,} bytes, its meta records {info['bytes']:,}")
        elif checksums and file_sum(path)["crc32"] != info["crc32"]:
            problems.append(f"{path}: CRC-32 differs from the one its meta records")
    return problems


def is_resumable(run_dir: Path, step: int) -> bool:
    """A complete step with every rank's optimizer shard on disk (retention drops an old best's)."""
    world = read_meta(run_dir, step)["world_size"]
    return all(optim_path(run_dir, step, r).is_file() for r in range(world))


def remove_incomplete(run_dir: Path) -> None:
    """Drop files of steps that never got their meta (a crash mid-save) and the checkpoints' stale
    temp files; another writer's temp file (an export's .best.pt.*.tmp) is not ours to delete.
    Rank 0 calls this between collectives, so an I/O error here is said on stderr, never raised: a
    raise would end rank 0 alone and leave the other ranks waiting in the next collective."""
    run_dir = Path(run_dir)
    try:
        done = set(complete_steps(run_dir))
        for p in run_dir.glob("*.pt"):
            m = STEP_FILE_RE.match(p.name)
            if m and int(m.group(1)) not in done and p.is_file():
                p.unlink(missing_ok=True)
        for p in run_dir.glob(".*.tmp"):
            if CHECKPOINT_TMP_RE.match(p.name):
                p.unlink(missing_ok=True)
    except OSError as e:
        print(f"warning: removing an incomplete checkpoint's files from {run_dir} failed ({e}); they are never "
              "loaded, and the next launch tries again", file=sys.stderr, flush=True)


def repair_best(run_dir: Path, best_val: float, best_step: int) -> bool:
    """Make best.json name the best step the resumed checkpoint records, when that step is complete
    and best.json names another: a kill between a step's meta and its best.json leaves best.json
    behind, and retention protects only the step best.json names. True when it was rewritten."""
    steps = complete_steps(run_dir)
    if best_step < 0 or best_step not in steps:
        return False
    try:
        best = read_best(run_dir)
    except CheckpointError:  # unreadable (damaged): the resumed checkpoint knows the best, rewrite it
        best = None
    # A later step than the recorded best is another branch's (a --resume to an earlier step): it stands.
    if best is not None and int(best["step"]) in steps and int(best["step"]) >= best_step:
        return False
    atomic_write_json(Path(run_dir) / "best.json", best_record(best_step, best_val, read_meta(run_dir, best_step)))
    return True


def best_record(step: int, val_loss: float, meta: dict) -> dict:
    """best.json: the step, its val loss and which weights its model files hold; with BEST_BY naming
    a metric also that and the step's score (lower is better: experiment/metric.py), by which a
    sweep's members compare."""
    record = {"step": step, "val_loss": val_loss, "weights": meta.get("weights", "raw")}
    state = meta.get("state", {})
    if state.get("best_by", "val_loss") != "val_loss":  # the step is the best its meta records
        record.update(best_by=state["best_by"], score=state["best_score"])
    return record


SWEEP_RECORD = "sweep.json"  # a sweep directory's table (experiment/sweep.py)
GENERATIONS_RECORD = "generations.json"  # a run of several generations (experiment/generations.py)


def sweep_winner(path: Path) -> Path | None:
    """A sweep directory's winner, its run directory, found afresh from its members' best.json (a
    member may have gone on after the table was written); None when `path` is no sweep directory."""
    record_path = Path(path) / SWEEP_RECORD
    if not record_path.is_file():
        return None
    members = [Path(path) / m["member"] for m in read_json(record_path).get("members", [])]
    best = pick_winner([(m, _best_or_none(m)) for m in members])
    if best is None:
        raise CheckpointError(f"{path}: the sweep has no winner yet (no member has a best checkpoint)")
    return best


def generation_winner(path: Path) -> Path | None:
    """A run directory of generations -> the directory of the generation it serves: the one its
    best.json names (experiment/generations.py's winner), or while none has finished, the one
    served_generation picks of those begun; None for any other directory."""
    record_path = Path(path) / GENERATIONS_RECORD
    if not record_path.is_file():
        return None
    top_best = read_best(path)
    if top_best is not None and "dir" in top_best:
        return Path(path) / top_best["dir"]
    gens = read_json(record_path).get("generations", [])
    best = served_generation([(Path(path) / g["dir"], bool(g.get("student")), _best_or_none(Path(path) / g["dir"]))
                              for g in gens])
    if best is None:
        raise CheckpointError(f"{path}: no generation has a best checkpoint yet")
    return best


def served_generation(gens: list[tuple[object, bool, dict | None]]) -> object | None:
    """The key of the generation a run of generations serves, from (key, is a STUDENT_DEPTH student,
    best.json) in the order they trained: the newest student with a best (the user named its size to
    serve it), else the best of those with one (pick_winner); None while none has a best. The rule of
    experiment/generations.py's winner and of generation_winner's fallback alike."""
    students = [k for k, student, best in gens if student and best]
    if students:
        return students[-1]
    return pick_winner([(k, best) for k, _, best in gens if best])


def pick_winner(bests: list[tuple]) -> object | None:
    """The key of the best of (key, best.json) pairs: the lowest score where every member with a best
    was chosen by the same BEST_BY metric, else the lowest val loss; None when none has a best."""
    scored = [(k, b) for k, b in bests if b is not None and math.isfinite(b["val_loss"])]
    if not scored:
        return None
    by = {b.get("best_by", "val_loss") for _, b in scored}
    key = (lambda kb: kb[1]["score"]) if len(by) == 1 and by != {"val_loss"} else (lambda kb: kb[1]["val_loss"])
    return min(scored, key=key)[0]


def _best_or_none(run_dir: Path) -> dict | None:
    try:
        return read_best(run_dir)
    except CheckpointError:
        return None


def resolve_serving_checkpoint(path: str | Path | None, workspace: Path) -> Path:
    """A model_*.pt as given; a run directory -> its best (else latest); a sweep directory -> its
    winner's best; None -> newest run's best (a sweep counts as its winner).

    A step saved in per-rank parts is named by model_<step>.pt (what the trainer prints), though
    that file does not exist, or by any of its model_<step>_rank<r>.pt."""
    if path is None:
        root = Path(workspace) / "checkpoints"
        dirs = [d for d in root.iterdir() if d.is_dir()] if root.is_dir() else []
        runs = [r for r in (_winner_or(d) for d in dirs) if r is not None and r.is_dir() and complete_steps(r)]
        if not runs:
            raise CheckpointError(f"no complete checkpoint under {root}; train first (bash run.sh)")
        path = max(runs, key=lambda d: max(meta_path(d, s).stat().st_mtime for s in complete_steps(d)))
    path = Path(path)
    if path.is_dir():
        path = sweep_winner(path) or path
        path = generation_winner(path) or path
        best = read_best(path)
        steps = complete_steps(path)
        if best is not None and int(best["step"]) in steps:
            return model_path(path, int(best["step"]))
        if not steps:
            raise CheckpointError(f"{path}: no complete checkpoint (no meta_*.json)")
        return model_path(path, steps[-1])
    if not path.is_file() and not _names_step_in_parts(path):
        raise CheckpointError(f"{path}: no such checkpoint file")
    return path


def _winner_or(run_or_sweep: Path) -> Path | None:
    try:
        run = sweep_winner(run_or_sweep) or run_or_sweep
        return generation_winner(run) or run
    except CheckpointError:  # a sweep with no winner yet has nothing to serve
        return None


def _names_step_in_parts(path: Path) -> bool:
    m = MODEL_RE.match(path.name)
    if not m or not meta_path(path.parent, int(m.group(1))).is_file():
        return False
    return read_meta(path.parent, int(m.group(1))).get("model_parts", 1) > 1


def model_part(state: dict, owner: dict[str, int], rank: int) -> dict:
    """Rank's share of a state_dict: the parameters it owns in the optimizer's partition. Entries
    that are no parameter (none today: the RoPE tables are non-persistent buffers) go to rank 0."""
    return {name: t for name, t in state.items() if owner.get(name, 0) == rank}


def load_model_state(run_dir: Path, step: int) -> dict:
    """The step's full model state_dict (plain names), from its one file or every rank's part.

    The one reader of weights: resume, serving and tests all come here, whichever layout was saved.
    """
    parts = read_meta(run_dir, step).get("model_parts", 1)  # metas from before parts: one file
    paths = ([model_path(run_dir, step)] if parts == 1
             else [model_part_path(run_dir, step, r) for r in range(parts)])
    state = {}
    for path in paths:
        if not path.is_file():
            raise CheckpointError(f"{path}: missing; step {step:06d} was saved in {parts} model file(s)")
        part = strip_compile_prefix(load_tensors(path))
        if not state.keys().isdisjoint(part):
            raise CheckpointError(f"{path}: holds entries another part of step {step:06d} also holds")
        state.update(part)
    return state


def load_model(path: Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> tuple[GPT, dict]:
    """Rebuild the model from its meta alone, its weights assigned straight from the (memory-mapped)
    files in `dtype` (None: the dtype it was saved in) on `device`: a bf16 d64 serves from one GPU
    without an fp32 copy anywhere. `path` is a step's model file (its files are checked against the
    sizes and checksums its meta recorded) or an export. Returns (model in eval mode, meta)."""
    path = Path(path)
    m = MODEL_RE.match(path.name)
    if not m:
        return _load_export(path, device, dtype)
    step = int(m.group(1))
    meta_file = meta_path(path.parent, step)
    if not meta_file.exists():
        raise CheckpointError(f"{path}: incomplete checkpoint ({meta_file.name} missing)")
    meta = read_json(meta_file)
    if damaged := damaged_files(path.parent, step, prefix="model_"):
        raise CheckpointError(f"{path}: step {step:06d} is damaged: {'; '.join(damaged)}")
    if dtype is None:
        name = meta.get("weights_dtype", "float32")  # metas from before the field: fp32
        if name not in ("float32", "bfloat16", "float16"):
            raise CheckpointError(f"{meta_file}: weights_dtype {name!r} is not float32, bfloat16 or float16")
        dtype = getattr(torch, name)
    try:
        model = build_model(GPTConfig(**meta["model_config"]), device, dtype, load_model_state(path.parent, step))
    except (RuntimeError, OSError, KeyError) as e:
        raise CheckpointError(f"{path}: cannot load weights ({e})") from e
    return model.eval(), meta


def load_serving(spec: str | None, workspace: Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None) -> list[tuple[GPT, dict, Path]]:
    """(model, meta, path) of what the server or sample decodes: `spec` names one checkpoint (a model
    file, an export or a run directory, as resolve_serving_checkpoint; None: the newest run's best),
    or several separated by commas, an ensemble decoded as one model. Members whose tokenizers differ
    are a CheckpointError naming both: their token ids would mean different characters."""
    specs = [None] if spec is None else [one.strip() for one in spec.split(",")]
    if "" in specs:
        raise CheckpointError(f"--checkpoint {spec!r}: an empty name in the list (several are separated by commas)")
    members: list[tuple[GPT, dict, Path]] = []
    for one in specs:
        path = resolve_serving_checkpoint(one, workspace)
        model, meta = load_model(path, device, dtype)
        if members and meta["tokenizer"] != members[0][1]["tokenizer"]:
            raise CheckpointError(f"ensemble members need one tokenizer: {path} has {_tokenizer_words(meta)}, "
                                  f"{members[0][2]} has {_tokenizer_words(members[0][1])}")
        members.append((model, meta, path))
    return members


def _tokenizer_words(meta: dict) -> str:
    t = meta["tokenizer"]
    return (f"tiktoken {t['encoding']}" if t.get("encoding") else
            f"{t['tokenizer']} over {len(t['chars'] or '')} characters {(t['chars'] or '')[:12]!r}...")


def model_meta(path: Path) -> dict:
    """The meta of what load_model(path) loads, without building the model: a step's meta file, or an
    export's meta (its tensors memory-mapped, not read)."""
    path = Path(path)
    if m := MODEL_RE.match(path.name):
        return read_meta(path.parent, int(m.group(1)))
    return _read_export(path)["meta"]


def export_model(src: Path, out: Path) -> dict:
    """One file, `out`, holding the model of the step `src` names (a model_<step>.pt, or any part
    of a step saved in parts) in bf16 with its meta: what a user downloads and serves. The step's
    model files are checked first. Returns the step, the bytes written and their CRC-32."""
    src = Path(src)
    m = MODEL_RE.match(src.name)
    if not m or not meta_path(src.parent, int(m.group(1))).is_file():
        raise CheckpointError(f"{src}: expected a complete step's model file (model_<step>.pt) or its run directory")
    run_dir, step = src.parent, int(m.group(1))
    if damaged := damaged_files(run_dir, step, prefix="model_"):
        raise CheckpointError(f"{src}: step {step:06d} is damaged: {'; '.join(damaged)}")
    meta = {k: v for k, v in read_meta(run_dir, step).items() if k not in ("files", "data_positions")}
    state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_model_state(run_dir, step).items()}
    meta.update(weights_dtype="bfloat16", exported_from=str(src))
    return {"step": step, **atomic_torch_save(Path(out), {"format": EXPORT_FORMAT, "meta": meta, "model": state})}


def _read_export(path: Path) -> dict:
    """An export's contents, its tensors memory-mapped."""
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    expected = ("expected model_<step>.pt, model_<step>_rank<r>.pt, an export (python -m experiment.export), "
                "or a run, sweep or generations directory")
    try:
        with path.open("rb") as f:
            head = f.read(4)
        # torch.save writes a zip: a run's .json or a text file is no model, and torch's error would not say so
        zipped = head == b"PK\x03\x04"
        obj = load_tensors(path) if zipped else None
    except Exception as e:  # unreadable, a damaged zip
        raise CheckpointError(f"{path}: cannot read it ({e})") from e
    if len(head) < 4:  # what an interrupted copy leaves; the trainer's own writes are atomic
        raise CheckpointError(f"{path}: cannot read it (empty or truncated: {len(head)} bytes)")
    if not zipped:
        raise CheckpointError(f"{path}: not a model file: {expected}")
    if not isinstance(obj, dict) or obj.get("format") != EXPORT_FORMAT:
        raise CheckpointError(f"{path}: {expected}")
    return obj


def _load_export(path: Path, device, dtype: torch.dtype | None) -> tuple[GPT, dict]:
    obj = _read_export(path)
    meta = obj["meta"]
    try:
        model = build_model(GPTConfig(**meta["model_config"]), device, dtype or torch.bfloat16, obj["model"])
    except (RuntimeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: cannot load weights ({e})") from e
    return model.eval(), meta


# ---------------------------------------------------------------- the trainer's checkpoints


@dataclass
class RunState:
    """What a checkpoint restores besides weights and optimizer state: one dict in meta ("state")."""
    step: int = 0
    tokens_seen: int = 0
    used_seconds: float = 0.0
    best_val: float = math.inf
    best_step: int = -1
    best_weights: str = "raw"  # the best step's model: its "raw" weights or their "average" (AVERAGE)
    # What BEST_BY compares, lower for better: the best step's val loss, or its metric's number (metric.BestBy),
    # and the BEST_BY it was measured by (a resume under another one holds no best to beat).
    best_score: float = math.inf
    best_by: str = "val_loss"
    # The stop at the val minimum (plateau.py, plateau_check): the level of the last eval that gained
    # (at the peak LR its val loss, PLATEAU_MARGIN below the one before; in a warmdown the mean of the
    # warmdown's last plateau.WARMDOWN_WINDOW val losses, held in warmdown_window, below its best so far), the
    # evals since, whether a warmdown has been seen, the anneal it started, and whether it ended the run.
    plateau_ref: float = math.inf
    warmdown_window: list[float] = field(default_factory=list)
    evals_without_gain: int = 0
    warmdown_seen: bool = False
    anneal_start_tokens: int = -1  # tokens_seen where the warmdown started at the plateau; -1: none
    anneal_tokens: int = 0  # its length
    plateau_stopped: bool = False  # a warmdown stopped gaining: the run is over (a resume trains no more)
    # Whether the LR warmdown (the schedule's or the val minimum's) has begun, and the newest complete
    # checkpoint from before it (-1: none). Kept while a later step names it: an extended run goes
    # back to it (experiment/extend.py).
    warmdown_begun: bool = False
    warmdown_step: int = -1
    # The furthest schedule progress the early-schedule warmups (schedule.warmup_phase) have reached, rank
    # 0's: monotone, so an extended run (a longer budget lowers the progress) does not go back to them.
    warmup_progress: float = 0.0
    data_state: dict | None = None  # the data position of the step's next batch (every rank reads the same)
    # Measured durations (longest eval, longest save, recent step): the reserve kept for the final
    # eval + save. Persisted, so a resumed run still knows what its ending costs.
    eval_seconds: float = 0.0
    save_seconds: float = 0.0
    step_seconds: float = 0.0
    # The latest eval's step and tokens_seen (EVAL_EVERY_EPOCHS counts from there): a resume keeps the
    # eval grid, and runs the eval a preemption's save skipped at its step.
    last_eval_step: int = -1
    last_eval_tokens: int = 0
    # Wall seconds lost to restarts, counted in used_seconds: training past the newest complete
    # checkpoint that a crash or a stop threw away (the run's heartbeat says how far it got), and each
    # restart's setup and load (experiment/restarts.py).
    restart_seconds: float = 0.0
    # GPU-seconds spent = gpu_seconds_base + used_seconds x the world size: nonzero once a resume ran on
    # another GPU count than the launches before it (launch.spent_base), so BUDGET_USD counts dollars.
    gpu_seconds_base: float = 0.0
    nonfinite_steps: int = 0  # updates skipped because the loss or gradients were not finite
    save_waits: int = 0  # saves that came due while the one before was still writing, and waited
    save_wait_seconds: float = 0.0

    def best(self) -> tuple:
        """The best as one value: what a failed save of a new best falls back to (Loop.saved_best)."""
        return self.best_val, self.best_step, self.best_weights, self.best_score

    def set_best(self, best: tuple) -> None:
        self.best_val, self.best_step, self.best_weights, self.best_score = best


def run_state(meta: dict) -> RunState:
    """The RunState a meta records."""
    if "state" in meta:  # fields added or dropped since a checkpoint was written take their defaults
        known = {f.name for f in fields(RunState)}
        st = RunState(**{k: v for k, v in meta["state"].items() if k in known})
        if "warmdown_window" not in meta["state"] and st.warmdown_seen and not st.plateau_stopped:
            # Written before the warmdown had its own window: its reference meant a new best; start afresh.
            st.plateau_ref, st.evals_without_gain = math.inf, 0
        if "warmup_progress" not in meta["state"]:
            # Written before the early-schedule warmups (or without their progress): a resume of a run
            # under way must not switch to them in its middle.
            st.warmup_progress = 1.0
        if "last_eval_tokens" not in meta["state"]:
            st.last_eval_step, st.last_eval_tokens = st.step, st.tokens_seen  # the eval grid from the resumed step
        if "best_score" not in meta["state"]:  # written before BEST_BY: its best was by val loss
            st.best_score = st.best_val
        return st
    # Metas written before the state was one dict hold its fields at the top level.
    flat = {f.name: meta[f.name] for f in fields(RunState) if f.name in meta}
    best = meta["best_val_loss"] if meta["best_step"] >= 0 else math.inf
    return RunState(**flat, best_val=best, best_score=best,
                    data_state=meta["data_positions"][0], last_eval_step=meta["step"],
                    last_eval_tokens=flat.get("tokens_seen", 0))


@dataclass(frozen=True)
class Retention:
    keep_last: int  # complete checkpoints kept, plus the best
    keep_best_optimizer: bool  # an old best keeps its optimizer shards (resumable), else only what serves
    keep_step: int = -1  # also kept, whole: the newest checkpoint from before the warmdown (the newest step's warmdown_step)


def save_checkpoint(run_dir: Path, step: int, model_data: dict, optimizer_data: dict, meta: dict, rank: int = 0,
                    world_size: int = 1, all_ok: Callable[[bool], bool] = bool,
                    gather: Callable[[dict], list] = lambda files: [files]) -> str | None:
    """A whole save, here and now: this rank's files (write_rank_files), then the step completed
    (complete_step). experiment/saver.py does the same with the write in a background thread."""
    error, files = write_rank_files(run_dir, step, model_data, optimizer_data, rank, world_size)
    return complete_step(run_dir, step, error, files, meta, rank, all_ok, gather)


def write_rank_files(run_dir: Path, step: int, model_data: dict, optimizer_data: dict, rank: int,
                     world_size: int, write_bps: float = 0) -> tuple[str | None, dict]:
    """Rank `rank`'s files of `step`: its model data (the whole model in one process, else the part
    it owns) and its optimizer shard. Returns (the error, if any; {file name: {"bytes", "crc32"}}).
    `write_bps` caps the write rate (0: none)."""
    # every rank writes what it owns: no rank writes (and no rank waits on) the whole model
    model_file = model_path(run_dir, step) if world_size == 1 else model_part_path(run_dir, step, rank)
    try:
        return None, {p.name: atomic_torch_save(p, data, write_bps)
                      for p, data in ((model_file, model_data), (optim_path(run_dir, step, rank), optimizer_data))}
    except OSError as e:
        print(f"[rank {rank}] error: writing checkpoint step {step:06d} failed: {e}", file=sys.stderr, flush=True)
        return str(e), {}


def complete_step(run_dir: Path, step: int, error: str | None, files: dict, meta: dict, rank: int,
                  all_ok: Callable[[bool], bool], gather: Callable[[dict], list]) -> str | None:
    """Every rank, after its write_rank_files (`error`, `files`): once every rank's files are on disk,
    rank 0 writes `meta` last as the completion marker, with every rank's file sizes and CRC-32s (and
    best.json when meta's state names this step the best). `all_ok(ok)` is True on every rank iff ok
    on every rank, `gather(obj)` every rank's obj (collectives; with one process, trivial).

    Returns None when the step is complete, else why it is not, on every rank alike: its files are
    removed and the checkpoints before it are untouched (a full disk costs one save, not the run).
    """
    if not all_ok(error is None):  # every rank's files are on disk before meta can complete the step
        if rank == 0:
            remove_incomplete(run_dir)
        return error or "another rank failed"
    files = {name: info for part in gather(files) for name, info in part.items()}
    error = None
    if rank == 0:
        try:
            atomic_write_json(meta_path(run_dir, step), {**meta, "files": files})
            if meta["state"]["best_step"] == step:
                atomic_write_json(run_dir / "best.json", best_record(step, meta["val_loss"], meta))
        except OSError as e:
            # meta's or best.json's write: either way the step is reported not saved, so it must not
            # stay complete on disk while best.json names an earlier step. Rank 0 must still reach
            # the collective below, whatever the removal meets.
            error = f"meta: {e}"
            with contextlib.suppress(OSError):
                meta_path(run_dir, step).unlink(missing_ok=True)
                remove_incomplete(run_dir)
    return None if all_ok(error is None) else error or "rank 0 failed to write meta"


def retain(run_dir: Path, retention: Retention, log: Callable[[str], None]) -> str:
    """Keep-last-k plus the best (without its optimizer shards unless keep_best_optimizer); returns
    what was deleted, for the "saved step" line. Rank 0, after a step is complete."""
    try:
        deleted = prune(run_dir, retention.keep_last, retention.keep_step)
        dropped = (None if retention.keep_best_optimizer
                   else drop_old_best_optimizer(run_dir, retention.keep_last, retention.keep_step))
    except (OSError, CheckpointError) as e:  # the new checkpoint is complete; old ones linger until the next prune
        log(f"warning: pruning old checkpoints failed: {e}")
        return ""
    return ((f"; pruned {', '.join(f'{s:06d}' for s in deleted)}" if deleted else "")
            + (f"; dropped the optimizer shards of best step {dropped:06d} (kept for serving, not resuming)"
               if dropped is not None else ""))


def load_checkpoint(run_dir: Path, step: int) -> tuple[dict, list[dict], dict]:
    """(the full model state_dict, every rank's optimizer shard in rank order, meta) of a complete
    step. A rank of any world size takes what it owns from the shards (elastic resume)."""
    meta = read_meta(run_dir, step)
    shards = [load_tensors(optim_path(run_dir, step, r)) for r in range(meta["world_size"])]
    return load_model_state(run_dir, step), shards, meta


def pick_resume_step(run_dir: Path, resume: str, log: Callable[[str], None] | None = None,
                     quarantine: bool = False) -> int | None:
    """The step to resume (None: a fresh run). RESUME=auto takes the newest resumable step whose files
    are intact (damaged_files), saying which damaged ones it passed over; with `quarantine` (the
    trainer's rank 0) their meta is renamed to meta_<step>.json.damaged, so the step no longer counts
    as complete. CheckpointError when no step can be resumed and a fresh start would mix runs."""
    step = _pick_step(run_dir, resume)
    if step is None:
        return None
    if resume != "auto":
        if damaged := damaged_files(run_dir, step):
            raise CheckpointError(f"--resume {resume}: step {step:06d} is damaged: {'; '.join(damaged)}")
        return step
    skipped = []
    for candidate in reversed([s for s in complete_steps(run_dir) if s <= step and is_resumable(run_dir, s)]):
        if not (damaged := damaged_files(run_dir, candidate)):
            return candidate
        skipped.append(candidate)
        (log or print)(f"warning: checkpoint step {candidate:06d} is damaged ({'; '.join(damaged)}); trying an older one")
        if quarantine:
            meta_path(run_dir, candidate).rename(meta_path(run_dir, candidate).with_suffix(".json.damaged"))
    raise CheckpointError(f"{run_dir}: every resumable checkpoint is damaged (steps {', '.join(f'{s:06d}' for s in skipped)}"
                          "; the warnings above name the files); move them away to start afresh (the budget then counts the "
                          "time the lost run used, from its heartbeat; RESUME=never starts a new budget)")


def _pick_step(run_dir: Path, resume: str) -> int | None:
    steps = complete_steps(run_dir)
    if resume == "never":
        if steps:
            raise CheckpointError(f"--resume never, but {run_dir} holds checkpoints (steps {steps}); "
                              "choose another --model_tag or move them away")
        return None
    resumable = [s for s in steps if is_resumable(run_dir, s)]
    if resume == "auto":
        if steps and not resumable:  # a fresh start here would mix two runs' steps in one directory
            raise CheckpointError(f"{run_dir} holds only checkpoints kept for serving (steps {steps}, optimizer "
                                  "shards dropped); choose another --model_tag or move them away")
        return resumable[-1] if resumable else None
    if int(resume) not in steps:
        raise CheckpointError(f"--resume {resume}: no complete checkpoint at that step in {run_dir} (have {steps})")
    if int(resume) not in resumable:
        raise CheckpointError(f"--resume {resume}: step {int(resume):06d} in {run_dir} was kept for serving only (its "
                              "optimizer shards were dropped; set KEEP_BEST_OPTIMIZER=1 to keep them); "
                              f"resumable steps: {resumable}")
    return int(resume)
