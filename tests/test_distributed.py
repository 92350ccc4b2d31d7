"""Process-group setup and teardown, and the collective timeouts by phase."""

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp

from experiment.distributed import PHASE_TIMEOUTS, setup_distributed


def _join(rank: int, port: int):
    """Rank `rank` of a 2-rank gloo group on `port`, once both ranks are up."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    d = setup_distributed(cuda=False)
    d.all_reduce(torch.ones(1))
    return d


def _timeout_worker(rank: int, port: int, out: str) -> None:
    d = _join(rank, port)
    d.set_timeout(timedelta(seconds=2))
    if rank == 1:  # a rank that hangs: it never reaches the collective, and leaves once rank 0 has said
        deadline = time.time() + 120
        while not os.path.exists(out) and time.time() < deadline:
            time.sleep(0.1)
        os._exit(0)
    t0 = time.time()
    try:
        d.all_reduce(torch.ones(1))
        result = "returned"
    except Exception as e:  # gloo raises on the timeout; the trainer then dies and torchrun restarts it
        result = type(e).__name__
    with open(out, "w") as f:
        f.write(f"{result} {time.time() - t0:.1f}")
    # Leave as the trainer does, without interpreter finalization: with gloo's threads still up it
    # aborts now and then (SIGABRT, "terminate called without an active exception"), which is no
    # part of what this test checks.
    os._exit(0)


def _spawn_two(worker, path, join: bool = True):
    """worker(rank, port, str(path)) on 2 processes, on a free port; waits for both unless join=False."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    workers = mp.spawn(worker, args=(port, str(path)), nprocs=2, join=False)
    while join and not workers.join():
        pass
    return workers


@pytest.mark.slow
def test_a_phase_timeout_bounds_the_wait_for_a_hung_rank(tmp_path):
    out = tmp_path / "rank0.txt"
    _spawn_two(_timeout_worker, out)
    result, seconds = out.read_text().split()
    # the 2 s timeout, not the 30 minutes of the setup phase (the hung rank waits for this answer, so
    # a slow machine cannot make its exit look like the timeout)
    assert result != "returned" and float(seconds) < 60
    assert PHASE_TIMEOUTS["step"] < PHASE_TIMEOUTS["setup"] == PHASE_TIMEOUTS["save"]


def _bucket_worker(rank: int, port: int, out: str) -> None:
    """The trainer's DDP step with 3 accumulated micro-batches: where every gradient lives after
    each micro-batch, and the averaged gradient against one process over all the data."""
    import copy

    from experiment.distributed import wrap_ddp
    from experiment.model import GPT, GPTConfig
    from experiment.optim import LRS, ShardedOptimizer
    from experiment.step import forward_backward, optimizer_step

    d = _join(rank, port)
    model = GPT(GPTConfig(vocab_size=64, depth=2, aspect_ratio=32, head_dim=32, max_seq_len=16))
    model.init_weights(seed=3)
    reference = copy.deepcopy(model)
    opt = ShardedOptimizer(model, rank, 2, **LRS)
    ddp = wrap_ddp(model, d)
    buckets = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    synced = getattr(ddp, "forward_sync_buffers", ddp.broadcast_buffers)
    lines = [f"buffers {int(synced)} params {len(list(model.parameters()))} buckets {len(buckets)}"]
    data = torch.randint(0, 64, (2, 3, 2, 2, 16), generator=torch.Generator().manual_seed(5))  # step, micro, rank
    for step in range(2):
        for micro in range(3):
            x = data[step, micro, rank]
            forward_backward(ddp, x, x, 3, defer_sync=ddp if micro < 2 else None)
            # DDP rebuilds its buckets once, after the first step: count storages, not addresses
            where = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes() for p in model.parameters()}
            lines.append(f"step {step} micro {micro} bytes {sum(where.values())} storages {len(where)}")
        if step == 0:
            reference.zero_grad()
            for micro in range(3):
                for r in range(2):
                    forward_backward(reference, data[0, micro, r], data[0, micro, r], 6)
            diff = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
            lines.append(f"max grad diff {diff:.2e}")
        optimizer_step(model, opt)
    if rank == 0:
        with open(out, "w") as f:
            f.write("\n".join(lines))
    os._exit(0)


@pytest.mark.slow
def test_gradients_live_in_ddps_buckets_through_accumulation_and_average_right(tmp_path):
    # A gradient dropped between steps comes back beside the buckets at the next no_sync backward:
    # a second full copy of the gradients on every rank.
    out = tmp_path / "rank0.txt"
    _spawn_two(_bucket_worker, out)
    lines = out.read_text().splitlines()
    buffers, params, buckets = (int(v) for v in lines[0].split()[1::2])
    assert buffers == 0 and buckets < params  # views into a few shared buffers, the RoPE tables never broadcast
    assert [int(line.split()[-1]) for line in lines if " storages " in line] == [buckets] * 6
    # what those buckets hold is the memory plan's gradient row: DDP adds no copy of its own
    from experiment.memory import plan_memory
    from experiment.model import GPTConfig

    plan = plan_memory(GPTConfig(vocab_size=64, depth=2, aspect_ratio=32, head_dim=32, max_seq_len=16), 2, 2, 16,
                       "fp32", False, cuda=False)
    assert {int(line.split()[-3]) for line in lines if " storages " in line} == {plan.rows["grads"]}
    assert plan.rows["NCCL buffers"] == 0  # gloo on CPU; on CUDA with 2 ranks NCCL's are planned
    diff = next(line for line in lines if line.startswith("max grad diff"))
    assert float(diff.split()[-1]) < 1e-6  # the mean over 2 ranks x 3 micro-batches


def _stuck_worker(rank: int, port: int, ready: str) -> None:
    from experiment.distributed import StopSignal

    d = _join(rank, port)
    d.set_timeout(timedelta(seconds=120))
    if rank == 1:
        time.sleep(60)  # the peer that never reaches the next collective
        os._exit(0)
    with StopSignal(announce=False, grace=lambda: 2.0):
        open(ready, "w").close()
        d.all_reduce(torch.ones(1))  # blocks in C: the Python handler of a SIGTERM never runs here
    os._exit(0)


def _state(pid: int) -> str:
    """The process's main thread state from /proc: R running, S sleeping (blocked), ..."""
    with open(f"/proc/{pid}/task/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.slow
def test_a_stop_signal_bounds_the_exit_of_a_rank_stuck_in_a_collective(tmp_path):
    import signal

    ready = tmp_path / "ready"
    rank0, rank1 = _spawn_two(_stuck_worker, ready, join=False).processes
    try:
        deadline = time.time() + 60
        while not ready.exists() and time.time() < deadline:
            time.sleep(0.1)
        # inside the all-reduce: after `ready` the main thread's next wait is the collective's
        while _state(rank0.pid) == "R" and time.time() < deadline:
            time.sleep(0.01)
        t0 = time.time()
        os.kill(rank0.pid, signal.SIGTERM)
        rank0.join(timeout=30)
        assert rank0.exitcode == 128 + signal.SIGTERM and time.time() - t0 < 10  # not gloo's 120 s timeout
    finally:
        for p in (rank0, rank1):
            if p.is_alive():
                p.kill()


@pytest.mark.slow(seconds=48)
def test_compiled_ddp_with_recompute_and_accumulation_matches_eager():
    # torch.compile over DDP splits the graph at DDP's buckets (1 MB here: several graphs) while every
    # block recomputes its activations in backward and 3 micro-batches accumulate under no_sync.
    import json
    import subprocess
    import sys

    from conftest import ENV, REPO

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                           "experiment.tools.ddpcheck", "--device", "cpu", "--bucket_mb", "1", "--aspect_ratio", "128",
                           "--head_dim", "64"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert r["world"] == 2 and r["buckets"] > 2 and r["grads_in_buckets"]
    for eager, compiled in zip(r["eager_losses"], r["compiled_losses"]):
        assert abs(eager - compiled) <= 1e-5 * eager
    assert r["max_param_diff"] < 1e-3 * r["max_param"]
    # the all-reduce over both ranks, timed (gloo over loopback here; NCCL over the box's links on GPUs)
    assert r["link_mb"] == 64 and 0 < r["link_gbps"] < 1000


def test_link_bandwidth_is_the_bus_bandwidth_nccl_tests_report(monkeypatch):
    """2 (n-1)/n x bytes / seconds per all-reduce (a ring moves that much over each link), timed over
    the iterations after 2 warm-ups; none on one rank."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from experiment.distributed import Dist
    from experiment.tools import ddpcheck

    calls, clock = [], iter([10.0, 12.0])
    monkeypatch.setattr(dist, "all_reduce", lambda x: calls.append(x.numel()))
    monkeypatch.setattr(ddpcheck, "time", SimpleNamespace(perf_counter=lambda: next(clock)))  # its clock alone
    d = Dist(0, 0, 4, torch.device("cpu"))
    gbps = ddpcheck.link_bandwidth(d, mb=100, iters=4)
    assert calls == [25_000_000] * 6  # 2 warm-ups + 4 timed, of 100 MB of fp32
    assert gbps == pytest.approx(2 * 3 / 4 * 100e6 / 0.5 / 1e9)  # 4 in 2 s: 0.5 s each
    assert ddpcheck.link_bandwidth(Dist(0, 0, 1, torch.device("cpu")), mb=100) is None


def test_the_backend_and_gpu_of_each_local_rank():
    from experiment.distributed import pick_backend
    assert pick_backend(False, "auto", 3, 0) == ("gloo", None)
    assert pick_backend(True, "auto", 1, 8) == ("nccl", 1)
    assert pick_backend(True, "gloo", 1, 1) == ("gloo", 0)  # two ranks share the one GPU: a test of the path
    assert pick_backend(True, "gloo", 3, 2) == ("gloo", 1)
    with pytest.raises(ValueError, match="LOCAL_RANK 1 but 1 GPU"):
        pick_backend(True, "auto", 1, 1)  # NCCL would refuse it later, and less clearly
    with pytest.raises(ValueError, match="DIST_BACKEND must be auto or gloo"):
        pick_backend(True, "mpi", 0, 1)


def test_gloo_on_cuda_needs_an_explicit_device_batch():
    from experiment.config import ConfigError, TrainConfig, resolve
    with pytest.raises(ConfigError, match="dist_backend gloo on CUDA needs --device_batch_size"):
        resolve(TrainConfig(depth=2, dist_backend="gloo"), True, 2)
    assert resolve(TrainConfig(depth=2, dist_backend="gloo", device_batch_size=1), True, 2).device_batch_size == 1
    with pytest.raises(ConfigError, match="dist_backend must be one of auto, gloo"):
        resolve(TrainConfig(depth=2, dist_backend="nccl"), False, 1)


@pytest.mark.slow
def test_every_rank_applies_rank_0s_lr_whatever_its_own_clock(tmp_path, corpus):
    """Rank 1's wall clock runs twice as fast as rank 0's (tests/faulty_train.py), so its own budget
    fraction, eval and save durations all disagree with rank 0's. Each rank applies its LR to the
    ZeRO-1 shard it owns: every step's multiplier must be the same on both, and follow the schedule
    (it reaches the warmdown). Broken before: each rank computed its own from its own clock."""
    import subprocess
    import sys

    from conftest import ENV, REPO, TINY

    args = [*TINY, "--data_dir", corpus, "--workspace", tmp_path, "--total_batch_size", 256,
            "--training_hours", 0.003, "--plateau_evals", 0, "--save_every_steps", 10]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "tests/faulty_train.py"), *map(str, args)]
    env = {**ENV, "FAULT_CLOCK_RANK": "1", "FAULT_CLOCK_RATE": "2", "RECORD_LR": str(tmp_path)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lrs = [[float(v) for v in (tmp_path / f"lr_rank{r}.txt").read_text().split()] for r in range(2)]
    assert len(lrs[0]) == len(lrs[1]) > 20
    assert min(lrs[0]) < 0.5 and lrs[0][0] == 1.0  # the peak, then the warmdown (WARMDOWN_FRAC 0.4 on CPU)
    assert lrs[0] == lrs[1]
