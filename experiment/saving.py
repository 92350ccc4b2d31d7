"""The loop's saves, beside experiment/saver.py (which stages and writes one save): when a save is
made (maybe_save), how it is completed on every rank and what a failure leaves (finish_save), the
saver a run gets (make_saver), what a save is taken to cost, restoring a checkpoint, and the
export at the end."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from experiment import checkpoint as ckpt
from experiment import export
from experiment.checkpoint import CheckpointError, Retention, RunState
from experiment.config import TrainConfig
from experiment.distributed import Dist, all_ranks_ok, gather_objects
from experiment.files import volume
from experiment.hardware import DISK_WRITE_GBPS, host_available_bytes
from experiment.memory import checkpoint_bytes_per_rank, staged_bytes_per_rank
from experiment.model import GPT
from experiment.optim import ShardedOptimizer
from experiment.runlog import RunLog
from experiment.saver import HOST_STAGING_FRACTION, Saver
from experiment.trainer import Loop, Trainer


def make_saver(cfg: TrainConfig, d: Dist, model: GPT, run_dir: Path, log: RunLog) -> Saver:
    """Saves in the background when ASYNC_SAVE=1 and the node's host memory holds every local rank's
    staged share within HOST_STAGING_FRACTION of what is available (on every node), else blocking.
    On CUDA the share is counted as the pinned allocator takes it (memory.staged_bytes_per_rank)."""
    precision = "bf16" if model.wte.weight.dtype == torch.bfloat16 else "fp32"
    share = staged_bytes_per_rank(model.config, d.world_size, precision, pinned=d.device.type == "cuda",
                                  average=cfg.average != "none")[d.rank]
    need, available = share * d.local_world_size, host_available_bytes()
    background = bool(cfg.async_save) and all_ranks_ok(need <= HOST_STAGING_FRACTION * available, d)
    if background:
        log(f"checkpoint | saves write in the background: {share / 1e9:.2f} GB per rank staged in host memory "
            f"({need / 1e9:.2f} GB of {available / 1e9:.1f} GB available on this node)")
    elif cfg.async_save:
        log(f"warning: this node's ranks would stage {need / 1e9:.1f} GB of checkpoint in host memory, more than "
            f"{HOST_STAGING_FRACTION:g} x the {available / 1e9:.1f} GB available: every save blocks training")
    else:
        log("checkpoint | saves block training (ASYNC_SAVE=0)")
    return Saver(run_dir, d.rank, d.world_size, d.device, background, all_ok=lambda ok: all_ranks_ok(ok, d),
                 gather=lambda files: gather_objects(files, d), write_bps=cfg.save_write_mbps * 1e6)


def checkpoint_seconds(model: GPT, world_size: int, average: bool = False) -> float:
    """A save before one has been measured: the whole checkpoint at the network volume's rate the
    plan assumes (every rank writes its share at once, into one volume)."""
    precision = "bf16" if model.wte.weight.dtype == torch.bfloat16 else "fp32"
    total = sum(a + b for a, b in checkpoint_bytes_per_rank(model.config, world_size, precision, average))
    return total / (DISK_WRITE_GBPS * 1e9)


def export_share(model: GPT, world_size: int, average: bool = False) -> float:
    """The final export's time as a share of a save's: it reads the model's parts and writes the
    model once in bf16 (2 bytes a parameter), where a save writes the parts and the optimizer shards.
    The stop keeps room for it, so best.pt is written inside the budget."""
    precision = "bf16" if model.wte.weight.dtype == torch.bfloat16 else "fp32"
    parts = checkpoint_bytes_per_rank(model.config, world_size, precision, average)
    return (sum(a for a, _ in parts) + 2 * model.num_params()) / sum(a + b for a, b in parts)


def save_seconds(t: Trainer) -> float:
    """What a save takes: the longest measured so far (background writes included, which share the
    machine with training and so run long: the final save's reserve errs on the safe side), else
    the estimate, so a budget that ends before the first save still keeps room for it."""
    return t.st.save_seconds or t.first_save_seconds


def restore_checkpoint(run_dir: Path, step: int, model: GPT, opt: ShardedOptimizer, d: Dist) -> RunState:
    """Model, this rank's optimizer state (from whichever shards hold its parameters: any world size)
    and RNG from a complete step; returns its run state."""
    model_state, shards, meta = ckpt.load_checkpoint(run_dir, step)
    model.load_state_dict(model_state)
    opt.load_shards(shards)
    if d.rank < len(shards):
        torch.set_rng_state(shards[d.rank]["rng"]["cpu"])
        if d.device.type == "cuda" and "cuda" in shards[d.rank]["rng"]:
            torch.cuda.set_rng_state(shards[d.rank]["rng"]["cuda"], d.device)
    else:  # a rank the saved world lacked: a stream of its own (rank 0's would repeat its dropout masks)
        seed = meta.get("train_config", {}).get("seed", 0) + 1_000_003 * (step + 1) + d.rank
        torch.manual_seed(seed)  # CPU and every GPU
    return ckpt.run_state(meta)


def write_checkpoint(run_dir: Path, model: GPT, opt: ShardedOptimizer, st: RunState, val_loss: float | None,
                     run_meta: dict, d: Dist) -> str | None:
    """The step saved here and now (ckpt.save_checkpoint), with the raw weights; None when the step is
    complete, else why not (on every rank alike). The loop saves through its Saver instead (maybe_save)."""
    return ckpt.save_checkpoint(run_dir, st.step, *checkpoint_share(model, opt, st, val_loss, run_meta, d), d.rank,
                                d.world_size, all_ok=lambda ok: all_ranks_ok(ok, d),
                                gather=lambda files: gather_objects(files, d))


def checkpoint_share(model: GPT, opt: ShardedOptimizer, st: RunState, val_loss: float | None, run_meta: dict,
                     d: Dist, weights: str = "raw") -> tuple[dict, dict, dict]:
    """This rank's share of the step as plain data: (its model part, its optimizer shard with the RNG
    states, the step's meta). The tensors are the live ones (a collective: every rank's data position).
    weights="average": the model part holds the weight average (what the step serves); a resume takes
    the weights themselves from the optimizer shards' fp32 masters, which every shard holds."""
    state = ckpt.strip_compile_prefix(model.state_dict())
    if weights == "average":
        state = opt.average.model_part(state)
    rng = {"cpu": torch.get_rng_state()}
    if d.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(d.device)
    meta = {
        "step": st.step, "val_loss": val_loss, "state": dataclasses.asdict(st),
        "data_positions": gather_objects(st.data_state, d), "world_size": d.world_size,
        "model_parts": d.world_size,  # model_<step>.pt alone, or one model_<step>_rank<r>.pt per rank
        "weights": weights,  # what the model files hold: the raw weights or their average
        "model_config": model.config.to_dict(), "weights_dtype": str(model.wte.weight.dtype).removeprefix("torch."),
        "activation_checkpointing": model.activation_checkpointing, **run_meta, "saved_at": time.time(),
    }
    mine = state if d.world_size == 1 else ckpt.model_part(state, opt.owner, d.rank)
    return mine, {**opt.shard_state(), "rng": rng}, meta


def maybe_save(t: Trainer, loop: Loop, save_due: bool, preempted: bool, writing: bool = False) -> None:
    """A checkpoint when one is due, at the last step or at a new best: staged and written in the
    background (Saver), completed at a later step once every rank's writer is done. A save in
    flight is completed first (one at a time: when `writing`, some rank's writer was still at work
    at this step's start, and the wait is logged and counted, unless it is the final save's or a
    stop signal's); the final save is written here and completed before the run ends, and when it
    fails the run ends with 1."""
    st, step, final = t.st, t.st.step, loop.end is not None
    if st.best_step == step == loop.last_complete_step and loop.saved_best[1] != step:
        name_resumed_best(t, loop)
    # No periodic save during a streak of skipped updates: retention must not push the last
    # checkpoint from before the streak out. (Skipped updates leave the weights valid, so the final
    # save still happens, and so does a new best's: best.json must name a step that exists.)
    if not ((save_due or final or st.best_step == step) and step != loop.last_saved_step
            and (final or st.best_step == step or not loop.bad_in_a_row)):
        return
    if t.saver.pending is not None:
        before, t0 = t.saver.pending.step, time.time()
        finish_save(t, loop, wait=True)
        waited = time.time() - t0
        if preempted and loop.last_complete_step == before:
            # A stop signal during a write: that save, complete now, is the one the run stops on. A second
            # would spend another whole write of the grace period; the steps since it are trained again.
            t.log(f"save | stopping on step {before:06d}'s checkpoint, whose write was in flight at the signal "
                  f"(waited {waited:.1f}s); a resume trains the {step - before} steps since it again")
            loop.outcome = loop.outcome.replace(f"at step {step};", f"at step {step}, on step {before}'s checkpoint;")
            return
        if preempted:  # the signal's wait, not a sign that saves come due too often: not counted
            t.log(f"save | step {before:06d}'s write failed (waited {waited:.1f}s): saving step {step:06d} instead")
        elif final:
            t.log(f"save | the final save waited {waited:.1f}s for step {before:06d}'s write to finish")
        elif writing:
            st.save_waits, st.save_wait_seconds = st.save_waits + 1, st.save_wait_seconds + waited
            t.log(f"save | step {step:06d} waited {waited:.1f}s for step {before:06d}'s write to finish "
                  f"({st.save_waits} waits, {st.save_wait_seconds:.1f}s in all: saves come due faster than one "
                  "writes; a longer SAVE_EVERY_MINUTES avoids it)")
    st.used_seconds, st.data_state = loop.used(), loop.data_state
    share = checkpoint_share(t.model, t.opt, st, None if preempted else loop.val_loss, t.run_meta, t.d,
                             "raw" if preempted else loop.weights)
    t.saver.begin(step, *share, background=not final,
                  context={"final": final})
    # Counted from here, after any wait for the write before and a blocking write: a slow save pushes the next
    # one back. A save at an eval's step moves the eval clock here too, so that both come due at one step and
    # the save does not bring a second eval one step after the clock's.
    loop.last_saved_step, loop.last_save_time = step, time.time()  # a failed save is retried when due again
    if t.st.last_eval_step == step:
        loop.last_eval_time = loop.last_save_time
    if not t.saver.pending.background:  # written already (the final save, or staging is off): on every rank
        finish_save(t, loop, wait=True)


def name_resumed_best(t: Trainer, loop: Loop) -> None:
    """The resumed step's own eval made it the best: a preemption saved the step before the eval it
    skipped, and the resume ran that eval. Its checkpoint is complete and holds these weights, so
    best.json names it (a second save of the step would rewrite a complete checkpoint in place)."""
    loop.saved_best = t.st.best()
    if t.d.master:
        repair_best(t.run_dir, t.st, t.log, "the resumed checkpoint, whose eval is the best so far")


def finish_save(t: Trainer, loop: Loop, wait: bool = False) -> None:
    """Complete the pending save on every rank (collectives), once every rank's writer is done:
    `wait` joins this rank's writer first. Logs it, prunes, and on failure keeps best.json naming
    a step that exists."""
    st = t.st
    phase, t0 = loop.phase, time.time()
    loop.enter("save", t.d)  # ranks may wait here for the slowest writer
    if wait:
        t.saver.wait()
    p, error = t.saver.complete()
    loop.enter(phase, t.d)
    blocked = p.staged_seconds + time.time() - t0 if p.background else time.time() - p.started
    st.save_seconds = max(st.save_seconds, p.write_seconds)
    t.report.add({"kind": "save", "step": p.step, "seconds": round(p.write_seconds, 3), "blocked": round(blocked, 3),
                  "ok": error is None})
    if error is None:
        loop.last_complete_step = p.step
        loop.saved_best = ckpt.run_state(p.meta).best()
        if st.warmdown_begun and not p.meta["state"]["warmdown_begun"]:
            st.warmdown_step = p.step  # begun before the warmdown, completed in it: the newest from before it
        if t.d.master:
            retention = Retention(t.cfg.keep_last, bool(t.cfg.keep_best_optimizer),
                                  st.warmdown_step if st.warmdown_begun else -1)
            t.log(f"saved step {p.step:06d} -> {t.run_dir}" + (" (best)" if p.meta["state"]["best_step"] == p.step else "")
                  + f" | written in {p.write_seconds:.1f}s, training blocked {blocked:.2f}s"
                  + ckpt.retain(t.run_dir, retention, t.log))
        return
    if p.context["final"]:
        t.log(f"error: the final checkpoint, step {p.step:06d}, could not be written to {t.run_dir} ({error}); "
              f"{volume_text(t.run_dir)}; the latest complete checkpoint is "
              + (f"step {loop.last_complete_step:06d}" if loop.last_complete_step >= 0 else "none")
              + ": the same command resumes from it once the volume has room")
        loop.stop(1, f"failed: the final checkpoint, step {p.step:06d}, could not be written (training.log says why)")
        return
    stopping = loop.end is not None  # a preemption's save in flight failed: the step it found is saved next
    t.log(f"error: checkpoint step {p.step:06d} not saved ({error}); earlier checkpoints are kept"
          + ("" if stopping else ", training goes on"))
    if t.saver.block_from_now_on() and not stopping:
        t.log("save | every later save blocks training: a save failed, and the host memory staged for saves "
              "is given back")
    if st.best_step == p.step:  # best.json must name a checkpoint that exists; evals stay counted
        st.set_best(loop.saved_best)
        if p.step < st.last_eval_step == st.step and loop.score < st.best_score:
            # this step's eval (made while that earlier write was in flight) beats the best that
            # stands: its save, begun next, makes it the best
            st.set_best((loop.val_loss, st.step, loop.weights, loop.score))


def volume_text(run_dir: Path) -> str:
    try:
        mount, free = volume(run_dir)
    except OSError as e:
        return f"its volume cannot be read ({e})"
    return f"the volume {mount} has {free / 1e6:,.1f} MB free"


def repair_best(run_dir: Path, st: RunState, log: RunLog, why: str = "again, the best its checkpoint records") -> None:
    """Rank 0: best.json names st's best step where it names an older one (on a resume: a kill between
    a step's meta and its best.json; name_resumed_best); the line says `why`."""
    try:
        if ckpt.repair_best(run_dir, st.best_val, st.best_step):
            log(f"best.json names step {st.best_step:06d} {why}")
    except (OSError, CheckpointError) as e:  # the old best.json stands (rank 0 alone must not leave here)
        log(f"warning: best.json could not be rewritten to name step {st.best_step:06d} ({e})")


def export_best(run_dir: Path) -> str:
    """Rank 0 at the end: the best step as one bf16 file, <run_dir>/best.pt; the line that says so.
    A failure (a full disk) costs the file, not the run: the checkpoints hold the same model."""
    try:
        out, facts = export.export(run_dir, None, run_dir.parent)
    except (CheckpointError, OSError) as e:
        return f"warning: the best model was not exported as one file ({e}); python -m experiment.export retries"
    return export.describe(out, facts)
