"""Process-group setup and the few collectives the trainer's decisions need.

Works with and without torchrun: nccl on CUDA, gloo on CPU (and on CUDA with DIST_BACKEND=gloo, a test
of several ranks sharing one GPU), and no process group at all for a plain `python -m` world of one.
"""

from __future__ import annotations

import inspect
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed import distributed_c10d

# How long a rank waits in a collective for the others, by phase. A hang is a fault: the process
# group aborts, the worker dies and torchrun restarts the run from its latest checkpoint. Setup and
# saves wait on other ranks' disk reads and writes and on the first steps' torch.compile (minutes at
# d64); a step or an eval does not (NCCL's own default is 10 minutes). Data preparation is no phase:
# the pre-flight does it before any process group exists.
PHASE_TIMEOUTS = {"setup": timedelta(minutes=30), "save": timedelta(minutes=30), "step": timedelta(minutes=10)}


@dataclass
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    store: object = None  # a store we made must outlive the process group that uses it
    local_world_size: int = 1  # ranks on this node (they share its host memory)

    @property
    def master(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place over all ranks (sum, min or max); a world of one has nothing to reduce."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN,
                                        "max": dist.ReduceOp.MAX}[op])
        return tensor

    def set_timeout(self, timeout: timedelta) -> None:
        """The collective timeout of the process group from now on (PHASE_TIMEOUTS)."""
        setter = getattr(distributed_c10d, "_set_pg_timeout", None)  # private, but the one way short of a new group
        if self.world_size > 1 and setter is not None:
            setter(timeout)

    def close(self) -> None:
        """The teardown of setup_distributed: destroy the process group, then let go of our store."""
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
        self.store = None  # only now: the group's threads may use the store until they are gone


def resolve_device(flag: str) -> torch.device:
    """--device auto|cpu|cuda -> the device type to run on; asking for CUDA without it is an error."""
    if flag not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {flag!r}")
    if flag == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but CUDA is not available")
    return torch.device("cuda" if flag == "cuda" or (flag == "auto" and torch.cuda.is_available()) else "cpu")


def autocast_for(device: torch.device):
    """The trainer's precision context: bf16 autocast on CUDA (fp32 logits and loss in the model),
    plain fp32 on CPU. One object may be entered again and again."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def sync(device: torch.device) -> None:
    """Wait for the device's queued work: timings must end with it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pick_backend(cuda: bool, flag: str, local_rank: int, gpus: int) -> tuple[str, int | None]:
    """(process-group backend, GPU index or None) for DIST_BACKEND. NCCL refuses two ranks on one GPU;
    gloo does not, so with gloo local rank r uses GPU r mod gpus: the multi-rank path on one GPU."""
    if flag not in ("auto", "gloo"):
        raise ValueError(f"DIST_BACKEND must be auto or gloo, got {flag!r}")
    if not cuda:
        return "gloo", None
    if flag == "gloo":
        return "gloo", local_rank % gpus
    if local_rank >= gpus:
        raise ValueError(f"LOCAL_RANK {local_rank} but {gpus} GPU(s) visible: run at most one process per GPU "
                         "(NPROC_PER_NODE), or DIST_BACKEND=gloo to share GPUs in a test")
    return "nccl", local_rank


def local_backend(cuda: bool, flag: str = "auto") -> tuple[str, int | None]:
    """pick_backend for this process (torchrun's LOCAL_RANK, the visible GPUs)."""
    return pick_backend(cuda, flag, int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count() if cuda else 0)


def setup_distributed(cuda: bool, backend: tuple[str, int | None] | None = None) -> Dist:
    """torchrun sets RANK/WORLD_SIZE; plain `python -m` runs as a world of one with no process group.
    `backend`: local_backend's answer (None: DIST_BACKEND=auto's)."""
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    backend, index = backend or local_backend(cuda)
    device = torch.device("cuda", index) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    store = None
    if world_size > 1:
        device_id = device if backend == "nccl" else None
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if restart > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun keeps its store across worker restarts, and the new workers would read the
            # dead workers' addresses from it ("Connection refused"); a per-attempt prefix avoids that.
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                  is_master=False)
            dist.init_process_group(backend, store=dist.PrefixStore(f"attempt_{restart}", store), rank=rank,
                                    world_size=world_size, device_id=device_id, timeout=PHASE_TIMEOUTS["setup"])
        else:
            dist.init_process_group(backend, device_id=device_id, timeout=PHASE_TIMEOUTS["setup"])
    return Dist(rank, local_rank, world_size, device, store, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def all_ranks_ok(ok: bool, d: Dist) -> bool:
    """True on every rank iff ok on every rank (one tiny all-reduce; also a barrier)."""
    if d.world_size == 1:
        return ok
    return bool(d.all_reduce(torch.tensor([int(ok)], device=d.device), "min").item())


def broadcast_object(obj, d: Dist):
    if d.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# DDP's buckets, as a fraction of the gradients: about DDP_BUCKETS of them, never below DDP's own
# 25 MB. torch.compile splits the graph at every bucket so that its all-reduce overlaps the rest
# of backward (torch._dynamo.config.optimize_ddp); at 25 MB a d32 model is some 130 subgraphs,
# compiled by every rank at once on shared cores. Eight keep all but the last bucket's all-reduce
# overlapped with backward, and compile eight graphs.
DDP_BUCKETS = 8
DDP_MIN_BUCKET_MB = 25


def bucket_cap_mb(model: torch.nn.Module) -> float:
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return max(DDP_MIN_BUCKET_MB, grad_bytes / DDP_BUCKETS / 2**20)


def wrap_ddp(model: torch.nn.Module, d: Dist, always: bool = False, bucket_mb: float | None = None) -> torch.nn.Module:
    """DDP over `model` with more than one rank (else the model itself, unless `always`: a check of
    the DDP path on one GPU), its gradients views into DDP's all-reduce buckets from the first
    micro-batch on. DDP repoints a gradient into its bucket only if the gradient exists when DDP is
    built, or at a synced backward; a no_sync backward into a missing gradient allocates a second
    full copy beside the buckets. So: zero gradients exist before the wrap, and optimizer_step
    zeroes them in place (set_to_none=False), never drops them. broadcast_buffers off: the only
    buffers are the RoPE tables, equal on every rank by construction (and non-persistent), which DDP
    would otherwise broadcast at every forward. Buckets: bucket_cap_mb (`bucket_mb` overrides it,
    for checks)."""
    if d.world_size == 1 and not always:
        return model
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    # torch 2.13 names the switch forward_sync_buffers (broadcast_buffers is deprecated there); the
    # GPU boxes' torch 2.11 knows only broadcast_buffers.
    no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters \
        else {"broadcast_buffers": False}
    return DDP(model, device_ids=[d.device.index] if d.device.type == "cuda" else None, gradient_as_bucket_view=True,
               bucket_cap_mb=bucket_mb or bucket_cap_mb(model), **no_sync)


def gather_objects(obj, d: Dist) -> list:
    """Every rank's obj, in rank order, on every rank."""
    if d.world_size == 1:
        return [obj]
    out = [None] * d.world_size
    dist.all_gather_object(out, obj)
    return out


class StopSignal:
    """SIGTERM/SIGINT (preemption, Ctrl-C): the first lets the step finish and the run save and exit 0;
    a second one exits at once.

    With `grace` (seconds, asked when the signal comes), the first also starts a timer that needs no
    help from the main thread: Python runs a signal handler only between bytecodes, so a rank blocked
    in a collective or a device sync whose peer died (NCCL over NVLink notices no dead peer) would
    never run it, and torchrun would wait out its whole shutdown timeout before SIGKILL. The C-level
    handler still writes the signal's number to the wakeup fd at once; a thread reading it exits the
    process `grace()` seconds later unless the run has ended by then. A save cut short that way
    leaves an incomplete step, which resume never loads."""

    def __init__(self, announce: bool, grace: Callable[[], float] | None = None):
        self.announce, self.grace = announce, grace

    def __enter__(self):
        self.signum = 0
        self._ended = threading.Event()
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        if self.grace is not None:
            self._read, write = socket.socketpair()
            write.setblocking(False)
            self._write = write
            self._previous_fd = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
            threading.Thread(target=self._grace_timer, name="stop-grace", daemon=True).start()
        return self

    def _handle(self, signum, frame):
        if self.signum:
            os._exit(128 + signum)
        self.signum = signum
        if self.announce:
            print(f"{signal.Signals(signum).name}: finishing this step, then saving and exiting "
                  "(send it again to exit at once, without a checkpoint)", file=sys.stderr, flush=True)

    def _grace_timer(self) -> None:
        while True:
            try:
                data = self._read.recv(1)
            except OSError:
                return
            if not data or self._ended.is_set():
                return
            if data[0] in (signal.SIGTERM, signal.SIGINT):
                break
        seconds = self.grace()
        if not self._ended.wait(seconds):
            print(f"[rank {os.environ.get('RANK', '0')}] still running {seconds:.0f} s after "
                  f"{signal.Signals(data[0]).name}: exiting now (a collective or a device sync hangs); the last "
                  "complete checkpoint is kept", file=sys.stderr, flush=True)
            os._exit(128 + data[0])

    def __exit__(self, *exc):
        self._ended.set()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self.grace is not None:
            signal.set_wakeup_fd(self._previous_fd)
            self._read.shutdown(socket.SHUT_RDWR)  # wakes the timer's recv, which then returns
            self._write.close()


def process_alive(pid: int) -> bool:
    """Whether pid runs: not gone, and not a zombie (killed, its own parent yet to reap it)."""
    if os.path.isdir("/proc/self"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # the state, after the command's name
        except (FileNotFoundError, ProcessLookupError):
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


class ParentWatch:
    """Workers must not outlive torchrun's agent. Killed with SIGKILL (a closed tmux window, an OOM
    kill), the agent cannot stop them: they live on, reparented, in process groups of their own,
    holding their GPUs, and a collective with a dead peer hangs for its whole timeout. A daemon
    thread polls the agent's pid; once the agent is gone it sends its own process SIGTERM (the
    preemption path: finish the step, save, exit) and, if the process still lives `grace_seconds`
    later (stuck in a collective with a dead peer), exits at once. A save cut short that way leaves
    an incomplete step, which resume never loads. Only under torchrun (TORCHELASTIC_RUN_ID set): a
    plain `python -m` run belongs to its shell.

    The agent's pid comes from experiment/run.sh (LAUNCH_AGENT_PID: its own pid, which torchrun takes
    over by exec), not from getppid() here: an agent killed in a launch's first seconds, while this
    process still imported torch, would leave the reaper as the parent to watch, and the worker would
    train on alone. Without run.sh (torchrun by hand), the parent at this point."""

    def __init__(self, poll_seconds: float = 2.0, grace_seconds: float = 45.0):
        self.poll_seconds, self.grace_seconds = poll_seconds, grace_seconds

    def start(self) -> ParentWatch:
        if "TORCHELASTIC_RUN_ID" in os.environ:
            self.parent = int(os.environ.get("LAUNCH_AGENT_PID") or os.getppid())
            threading.Thread(target=self._watch, name="parent-watch", daemon=True).start()
        return self

    def _watch(self) -> None:
        while process_alive(self.parent):
            time.sleep(self.poll_seconds)
        print(f"[rank {os.environ.get('RANK', '?')}] torchrun's agent (pid {self.parent}) is gone: saving and "
              f"exiting (at once in {self.grace_seconds:.0f} s if that hangs)", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(self.grace_seconds)
        os._exit(1)
