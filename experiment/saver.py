"""The trainer's saves: each rank copies its share into host memory and a background thread writes it
while training goes on; the step is completed (meta last) once every rank's writer is done.

Every rank makes the same calls in the same order, and no collective leaves the main thread:

    begin(step, ...)   copy this rank's share into host buffers (pinned on CUDA, allocated once and
                       reused), then start a thread that writes it (checkpoint.write_rank_files)
    writing()          this rank's thread is still writing; the loop's per-step flag all-reduce takes
                       the max, so all ranks learn at the same step that every writer is done
    wait()             join this rank's thread: a save due while one is in flight waits, and the final
                       and the preemption save wait for themselves
    complete()         collective: every rank's outcome, then rank 0 writes the meta (the completion
                       marker) with every file's size and CRC-32 (checkpoint.complete_step)

One save is in flight at a time, so one share's host buffers suffice and the run directory never holds
two writers. A crash at any moment leaves at most an incomplete step, which is never loaded.

Why not torch.distributed.checkpoint.async_save: it writes DCP's own layout (.distcp files and a
.metadata file). The layout here (per-rank model parts and optimizer shards, meta last with the files'
checksums) is what resume at any world size, the server, the export and the damage checks read, and
it only needs its writer moved off the training thread: about a hundred lines, against a second
checkpoint format to read, convert and check.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from experiment import checkpoint as ckpt

# Staging holds one checkpoint share per rank in host memory between saves. It is used only while
# the node's ranks together need at most this fraction of the memory available at start: the rest
# is for the data's page cache, the dataloader and the system.
HOST_STAGING_FRACTION = 0.5
# The background writer's nice value. Measured with bench save on 2 cores that training keeps busy:
# at 0 a step while the writer works took 27% longer; at 19, no longer, and the write took longer
# instead (it runs when the training threads wait). Waiting for a write (a save due while one is in
# flight, a preemption) leaves the cores idle, so the writer has them then.
WRITER_NICE = 19


def lower_priority(nice: int) -> None:
    """Nice the calling thread (on Linux a thread is a task with its own nice value): the writer then
    runs on what the training threads leave idle instead of taking a core from them."""
    if not nice:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):  # not Linux, or not allowed: the writer competes as it is
        pass


class HostBuffers:
    """Host copies of a nested state (dicts, lists, tensors, plain values), their tensors allocated
    at the first save and reused by the later ones (pinning memory costs about a second per GB)."""

    def __init__(self, pinned: bool) -> None:
        self.pinned, self.buffers = pinned, {}

    def stage(self, obj, key: tuple = ()):
        if torch.is_tensor(obj):
            buf = self.buffers.get(key)
            if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
                buf = self.buffers[key] = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=self.pinned)
            return buf.copy_(obj.detach(), non_blocking=self.pinned)
        if isinstance(obj, dict):
            return {k: self.stage(v, (*key, k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.stage(v, (*key, i)) for i, v in enumerate(obj))
        return obj

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


@dataclass
class Pending:
    """A save begun and not yet completed."""
    step: int
    meta: dict  # rank 0 writes it at completion, with every rank's files
    started: float
    staged_seconds: float  # training was blocked for the copy to host memory
    # Written in a background thread: the same on every rank (a rank whose staging failed has no
    # thread, yet completes with the others), so the caller may branch on it.
    background: bool
    thread: threading.Thread | None  # None: written in the calling thread, or the staging failed
    outcome: dict = field(default_factory=dict)  # the writer's: error, files, done_at
    context: dict = field(default_factory=dict)  # the caller's, handed back at completion

    @property
    def write_seconds(self) -> float:
        """From the save's start until this rank's files were on disk: what a blocking save costs."""
        return self.outcome["done_at"] - self.started


class Saver:
    """One rank's saves into `run_dir`. `all_ok(ok)` and `gather(obj)` are the collectives of
    checkpoint.complete_step; `write_bps` caps the write rate (0: none), to stand in for a slow volume;
    `writer_nice` is the background writer's nice value (0: it competes with training as it is)."""

    def __init__(self, run_dir: Path, rank: int, world_size: int, device: torch.device, background: bool,
                 all_ok: Callable[[bool], bool], gather: Callable[[dict], list], write_bps: float = 0,
                 writer_nice: int = WRITER_NICE) -> None:
        self.run_dir, self.rank, self.world_size, self.device = Path(run_dir), rank, world_size, device
        self.background, self.all_ok, self.gather, self.write_bps = background, all_ok, gather, write_bps
        self.writer_nice = writer_nice
        self.buffers = HostBuffers(pinned=device.type == "cuda")
        self.pending: Pending | None = None

    def begin(self, step: int, model_data: dict, optimizer_data: dict, meta: dict, background: bool,
              context: dict | None = None) -> None:
        """Start saving `step`: in a background thread when `background` (and staging is on), else
        here, in this thread. The data may be live tensors: they are copied before this returns."""
        assert self.pending is None, "one save in flight at a time: wait() and complete() the pending one first"
        started = time.time()
        data = {"model": model_data, "optimizer": optimizer_data}
        background, staging_error = background and self.background, None
        if background:
            try:
                data = self.buffers.stage(data)
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()  # the non-blocking copies have landed
            except (RuntimeError, MemoryError) as e:  # host memory ran out: this save fails, the training does not
                staging_error = f"staging in host memory: {type(e).__name__}: {e}"
        p = Pending(step, meta, started, time.time() - started, background, None, context=context or {})
        if staging_error:  # complete() tells every rank (it is still a background save on every rank, so this
            self._failed(p, staging_error)  # one does not complete it early, alone in a collective)
        elif background:
            p.thread = threading.Thread(target=self._write, args=(p, data), name=f"save-{step}", daemon=True)
            p.thread.start()
        else:
            self._write(p, data)
        self.pending = p

    def _write(self, p: Pending, data: dict) -> None:
        if p.thread is not None:
            lower_priority(self.writer_nice)
        try:
            error, files = ckpt.write_rank_files(self.run_dir, p.step, data["model"], data["optimizer"], self.rank,
                                                 self.world_size, self.write_bps)
        except Exception as e:  # anything else the writer meets: the save fails, the training does not
            self._failed(p, f"{type(e).__name__}: {e}")
            return
        p.outcome.update(error=error, files=files, done_at=time.time())

    def _failed(self, p: Pending, error: str) -> None:
        # Rank 0 logs only that a rank failed: this rank says what (stderr reaches workers/).
        print(f"rank {self.rank}: checkpoint step {p.step:06d} not written: {error}", file=sys.stderr, flush=True)
        p.outcome.update(error=error, files={}, done_at=time.time())

    def writing(self) -> bool:
        """This rank's writer is still at work (false once it is done, and with nothing pending)."""
        return self.pending is not None and self.pending.thread is not None and self.pending.thread.is_alive()

    def wait(self) -> float:
        """Until this rank's writer is done; returns the seconds waited."""
        t0 = time.time()
        if self.pending is not None and self.pending.thread is not None:
            self.pending.thread.join()
        return time.time() - t0

    def complete(self) -> tuple[Pending, str | None]:
        """Every rank, once every rank's writer is done: the pending step completed, or why not (its
        files removed; earlier steps untouched). Returns (the save, None or the reason)."""
        p, self.pending = self.pending, None
        error = ckpt.complete_step(self.run_dir, p.step, p.outcome["error"], p.outcome["files"], p.meta, self.rank,
                                   self.all_ok, self.gather)
        return p, error

    def block_from_now_on(self) -> bool:
        """Every later save blocks training, and the host buffers are freed: after a failed save (host
        memory short while staging, a volume that refused a write), a second one is likelier than
        not, and a blocking save leaves nothing staged to fail. Call it on every rank alike. True
        when saves were in the background until now."""
        was, self.background = self.background, False
        self.buffers = HostBuffers(pinned=self.buffers.pinned)
        if self.buffers.pinned:  # the pinned allocator caches freed blocks, still page-locked: give them back
            empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
            if empty is not None:  # torch 2.13; older ones keep the cache
                empty()
        return was

    def seconds_left(self, save_seconds: float) -> float:
        """A guess at what the pending write still needs (a save takes about `save_seconds`): the
        reserve at the budget's end keeps it, since the final save waits for it."""
        if self.pending is None:
            return 0.0
        return max(save_seconds - (time.time() - self.pending.started), 0.0)
