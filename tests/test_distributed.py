"""Process-group setup and teardown, and the collective timeouts by phase."""

import os
import time
from datetime import timedelta

import torch
import torch.multiprocessing as mp

from experiment.distributed import PHASE_TIMEOUTS, setup_distributed


def _timeout_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    d = setup_distributed(cuda=False)
    d.all_reduce(torch.ones(1))  # both ranks are up
    d.set_timeout(timedelta(seconds=2))
    if rank == 1:
        time.sleep(8)  # a rank that hangs
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


def test_a_phase_timeout_bounds_the_wait_for_a_hung_rank(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "rank0.txt"
    workers = mp.spawn(_timeout_worker, args=(port, str(out)), nprocs=2, join=False)
    while not workers.join():
        pass
    result, seconds = out.read_text().split()
    assert result != "returned" and float(seconds) < 6  # not the 30 minutes of the setup phase
    assert PHASE_TIMEOUTS["step"] < PHASE_TIMEOUTS["setup"] == PHASE_TIMEOUTS["save"]
