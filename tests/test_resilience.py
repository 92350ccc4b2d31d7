"""Surviving a day on rented GPUs: preemption, kill -9, elastic restarts, nodes, a full disk, divergence.

Restarts on another GPU count, several nodes, a failed save, a diverging loss: all on CPU with gloo
ranks."""

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ENV, REPO, TINY, built_once, run_meta, run_train, train_cmd, write_corpus
from experiment import checkpoint as ckpt
from experiment import onexit
from experiment.model import GPT, GPTConfig
from experiment.optim import LRS, ShardedOptimizer
from experiment.distributed import Dist, ParentWatch
from experiment.saving import restore_checkpoint

def _state(ws, step, tag="d2"):
    return ckpt.load_model_state(ws / "checkpoints" / tag, step)


def _wait_for(predicate, timeout=120, what="condition"):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_until_logged(args, nproc: int, ws, line: str, **popen):
    """Starts a run and returns its process once training.log shows `line`."""
    torchrun = ("--standalone",) if nproc > 1 else ()
    proc = subprocess.Popen(train_cmd(args, nproc, torchrun=torchrun), cwd=REPO, env=ENV, text=True, **popen)
    log = ws / "checkpoints/d2/training.log"
    _wait_for(lambda: log.exists() and line in log.read_text(), what=line)
    return proc


# ---------------------------------------------------------------- preemption


@pytest.mark.slow
def test_sigterm_finishes_the_step_saves_and_exits_zero(tmp_path, corpus):
    args = [*TINY, "--data_dir", corpus, "--workspace", tmp_path, "--total_batch_size", 256]
    proc = _launch_until_logged(args, 1, tmp_path, "step 000008 | loss", stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    steps = ckpt.complete_steps(tmp_path / "checkpoints/d2")
    assert len(steps) == 1 and steps[0] >= 8 and f"received SIGTERM: saving step {steps[0]:06d}" in out
    assert run_meta(tmp_path, steps[0])["val_loss"] is None  # no eval spent in the grace period
    again = run_train([*args, "--max_steps", steps[0] + 2])
    assert f"resumed from {ckpt.model_path(tmp_path / 'checkpoints/d2', steps[0])}" in again.stdout


@pytest.mark.slow
def test_a_preempted_run_keeps_the_eval_grid_of_the_uninterrupted_one(tmp_path, corpus):
    """EVAL_EVERY_EPOCHS=0.05 evaluates every few steps of 256 tokens (a twentieth of a pass); a SIGTERM at
    some step between two evals, then the same command. The resumed run evaluates at the uninterrupted
    run's steps (the grid is in the checkpoint, and so is the step of the latest eval), with the same
    losses, best step and outcome. Broken before: the grid restarted at the preempted step."""
    args = [*TINY, "--data_dir", corpus, "--total_batch_size", 256, "--max_steps", 40, "--eval_every_epochs", 0.05,
            "--eval_every_minutes", 60, "--plateau_evals", 0]
    run_train([*args, "--workspace", tmp_path / "a"])
    proc = _launch_until_logged([*args, "--workspace", tmp_path / "b"], 1, tmp_path / "b", "step 000011 | loss",
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "received SIGTERM" in out, err[-2000:]
    stopped = ckpt.complete_steps(tmp_path / "b/checkpoints/d2")[-1]
    # Step 11's own save or a later step's; or, on a loaded machine, an earlier best's whose background
    # write was still in flight at the signal, which the run then stops on and says so (saving.maybe_save).
    in_flight = re.search(r"save \| stopping on step (\d+)'s checkpoint, whose write was in flight", out)
    assert 11 <= stopped < 40 or (in_flight and int(in_flight.group(1)) == stopped), out[-2000:]
    run_train([*args, "--workspace", tmp_path / "b"])

    def evals(ws):
        return [(r["step"], r["val_loss"]) for r in _records(ws / "checkpoints/d2") if r["kind"] == "eval"]

    def end(ws):
        return [r["outcome"] for r in _records(ws / "checkpoints/d2") if r["kind"] == "end"][-1]

    grid = [s for s, _ in evals(tmp_path / "a")]
    every = grid[1]  # 1,800 tokens of 256 a step, rounded up; then the final eval
    assert 1 < every < 11 and grid == sorted({*range(0, 40, every), 40})
    assert evals(tmp_path / "b") == evals(tmp_path / "a"), stopped
    assert end(tmp_path / "b") == end(tmp_path / "a") == "finished: max_steps reached"
    assert ckpt.read_best(tmp_path / "b/checkpoints/d2") == ckpt.read_best(tmp_path / "a/checkpoints/d2")
    state_a, state_b = run_meta(tmp_path / "a", 40)["state"], run_meta(tmp_path / "b", 40)["state"]
    assert (state_b["best_step"], state_b["best_val"]) == (state_a["best_step"], state_a["best_val"])


@pytest.mark.slow
def test_signal_on_one_rank_stops_all_ranks_with_a_complete_checkpoint(tmp_path, corpus):
    args = [*TINY, "--data_dir", corpus, "--workspace", tmp_path, "--total_batch_size", 256]
    agent = _launch_until_logged(args, 2, tmp_path, "step 000006 | loss", stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE)
    workers = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2
    os.kill(int(workers[-1]), signal.SIGINT)  # Ctrl-C reaching one worker only
    out, err = agent.communicate(timeout=120)
    assert agent.returncode == 0, err[-2000:]  # every worker saved and exited 0
    step = ckpt.complete_steps(tmp_path / "checkpoints/d2")[-1]
    assert "received SIGINT" in out and run_meta(tmp_path, step)["world_size"] == 2
    assert all(ckpt.optim_path(tmp_path / "checkpoints/d2", step, r).exists() for r in range(2))


@pytest.mark.slow
def test_second_signal_exits_at_once(tmp_path, corpus):
    # 64 accumulation micro-steps per step, and a preemption save written at 0.05 MB/s (about 20 s for
    # the 0.9 MB share): the second signal arrives while the step or its save still runs, however
    # slow a loaded machine makes the sender.
    args = [*TINY, "--data_dir", corpus, "--workspace", tmp_path, "--total_batch_size", 8192, "--save_write_mbps", 0.05]
    proc = _launch_until_logged(args, 1, tmp_path, "step 000001 | loss", stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
    proc.send_signal(signal.SIGTERM)
    assert "SIGTERM: finishing this step" in proc.stderr.readline()  # the first one was handled
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert not ckpt.complete_steps(tmp_path / "checkpoints/d2")


def _records(run_dir):
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()  # a zombie has exited; only its reaper is missing
    except FileNotFoundError:
        return False


def _children(pid: int) -> list[int]:
    return [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]




def _writing_step(run_dir):
    """The step whose temp file is being written, else None."""
    import re
    names = [p.name for p in run_dir.iterdir()] if run_dir.exists() else []
    steps = [int(m.group(1)) for n in names if n.endswith(".tmp") and (m := re.match(r"\.(?:model|optim)_(\d{6,})", n))]
    return steps[0] if steps else None


@pytest.mark.slow
def test_training_goes_on_during_a_background_write_and_sigterm_completes_it(tmp_path, corpus):
    # Each rank's share is ~0.9 MB: at 0.2 MB/s a save writes for ~4.5 s, hundreds of tiny steps.
    args = [*TINY, "--data_dir", corpus, "--workspace", tmp_path, "--total_batch_size", 256, "--save_every_steps", 4,
            "--save_write_mbps", 0.2]
    run_dir = tmp_path / "checkpoints/d2"
    agent = _launch_until_logged(args, 2, tmp_path, "waited", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _wait_for(lambda: _writing_step(run_dir) is not None, what="a background write")
    writing = _writing_step(run_dir)
    t0 = time.time()
    for worker in subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout.split():
        os.kill(int(worker), signal.SIGTERM)  # a preemption signals every process of the box
    out, err = agent.communicate(timeout=120)
    assert agent.returncode == 0, err[-2000:]
    log = (run_dir / "training.log").read_text()
    steps = ckpt.complete_steps(run_dir)
    # the write in flight was completed and is the checkpoint the run stopped on: no second write in
    # the grace period (before, the step the signal found was written after it, two writes)
    assert f"received SIGTERM: completing step {writing:06d}'s save, in flight, and exiting" in log
    assert f"stopping on step {writing:06d}'s checkpoint" in log and steps[-1] == writing, (steps, writing)
    stopped = writing
    # the stop took the rest of one write and a step, bounded by the run's own longest write
    longest = max(r["seconds"] for r in _records(run_dir) if r["kind"] == "save")
    assert time.time() - t0 < 2 * longest + 30 and "Traceback" not in err, (time.time() - t0, longest)
    assert ckpt.pick_resume_step(run_dir, "auto") == stopped
    # a save due while one wrote waited, and said so; the meta counts it
    assert "save | step 000008 waited" in log and run_meta(tmp_path, stopped)["state"]["save_waits"] >= 1
    # steps ran between a save's start and its completion
    records = _records(run_dir)
    first_save = next(i for i, r in enumerate(records) if r["kind"] == "save")
    assert any(r["kind"] == "train" and r["step"] > records[first_save]["step"] for r in records[:first_save])
    assert records[first_save]["blocked"] < records[first_save]["seconds"]


@pytest.mark.slow(seconds=27)
def test_a_second_launch_on_a_running_run_exits_2_and_one_after_a_kill_resumes(tmp_path, corpus):
    env = {**ENV, "DEPTH": "2", "ASPECT_RATIO": "32", "HEAD_DIM": "32", "MAX_SEQ_LEN": "32", "DEVICE_BATCH_SIZE": "4",
           "TOTAL_BATCH_SIZE": "256", "SAMPLE_TOKENS": "0", "DATA_DIR": str(corpus), "WORKSPACE": str(tmp_path),
           "SAVE_EVERY_STEPS": "5", "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
           "PLATEAU_EVALS": "0"}  # the first launch must still run when the second starts: no stop at the minimum
    launch = ["bash", str(REPO / "experiment/run.sh")]
    run_dir = tmp_path / "checkpoints/d2"
    first = subprocess.Popen(launch, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True, start_new_session=True)
    try:
        for line in first.stdout:  # until it trains (and saved step 5)
            if line.startswith("saved step 000005"):
                break
        second = subprocess.run(launch, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"{run_dir} is in use by a running launch (pid {first.pid} on " in second.stderr
        assert "launcher | " not in second.stdout  # refused by the pre-flight, before any worker
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # kill -9 of the launch: the lock dies with it
        first.wait(timeout=60)
    # Its worker outlives the launcher: it saves a last checkpoint and exits by itself (ParentWatch),
    # holding the trainer lock until then (test_the_trainer_lock_is_held_while_its_process_lives).
    deadline = time.time() + 90
    while subprocess.run(["pgrep", "-f", "--", f"--workspace={tmp_path}"], capture_output=True).returncode == 0:
        assert time.time() < deadline, "the killed launch's worker is still running"
        time.sleep(0.5)
    last = ckpt.complete_steps(run_dir)[-1]
    again = subprocess.run(launch + [f"MAX_STEPS={last + 3}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0 and f"resumed from {ckpt.model_path(run_dir, last)}" in again.stdout, [
        l for l in again.stdout.splitlines() if "resum" in l or "preflight" in l]
    assert ckpt.complete_steps(run_dir)[-1] == last + 3


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


@pytest.mark.slow(seconds=15)
def test_a_torchrun_killed_while_its_workers_still_import_leaves_no_worker_behind(tmp_path, corpus):
    """kill -9 of torchrun the moment its worker exists (it is still importing torch, long before its
    first step): the worker sees its agent gone and exits, instead of training on alone."""
    env = {**ENV, "DEPTH": "2", "ASPECT_RATIO": "32", "HEAD_DIM": "32", "MAX_SEQ_LEN": "32", "DEVICE_BATCH_SIZE": "4",
           "TOTAL_BATCH_SIZE": "256", "SAMPLE_TOKENS": "0", "DATA_DIR": str(corpus), "WORKSPACE": str(tmp_path),
           "PLATEAU_EVALS": "0", "TRAINING_HOURS": "1", "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    launch = subprocess.Popen(["bash", str(REPO / "experiment/run.sh")], cwd=tmp_path, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    workers = []
    try:
        deadline = time.time() + 120
        while not workers:  # run.sh's pid becomes the agent's (exec: experiment/agent.py); then its worker appears
            assert launch.poll() is None and time.time() < deadline, "no worker started"
            if "experiment.agent" in _cmdline(launch.pid):
                workers = [p for p in _children(launch.pid) if "experiment.train" in _cmdline(p)]
            time.sleep(0.02)
        assert "step 0" not in ((tmp_path / "checkpoints/d2/training.log").read_text()
                                if (tmp_path / "checkpoints/d2/training.log").exists() else "")
        launch.kill()
        launch.wait()
        deadline = time.time() + 30
        while any(map(_alive, workers)) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(map(_alive, workers)), "the worker outlived its killed torchrun"
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _watchers(run_dir) -> list[str]:
    """Pids of ON_EXIT watchers (experiment.onexit) of this run directory still running."""
    found = subprocess.run(["pgrep", "-f", f"experiment.onexit .* {run_dir} "], capture_output=True, text=True)
    return found.stdout.split()


def _wait_for_file(path, seconds=30):
    deadline = time.time() + seconds
    while not (path.is_file() and path.read_text().endswith("\n")):
        assert time.time() < deadline, f"{path} never written"
        time.sleep(0.2)
    return path.read_text()


def test_the_trainer_lock_is_held_while_its_process_lives(tmp_path):
    from experiment.config import ConfigError
    from experiment.launch import check_not_running, hold_trainer_lock

    lock = hold_trainer_lock(tmp_path)
    for refused in (lambda: check_not_running(tmp_path), lambda: hold_trainer_lock(tmp_path)):
        with pytest.raises(ConfigError, match=f"in use by .*trainer pid {os.getpid()} on "):
            refused()
    lock.close()  # as when its process ends
    check_not_running(tmp_path)
    hold_trainer_lock(tmp_path).close()


@pytest.mark.slow
def test_the_readmes_on_exit_example_stops_the_pod_when_the_run_finished_or_failed_not_on_a_ctrl_c(tmp_path):
    """The README's ON_EXIT line, run by the real watcher (experiment.onexit) after each kind of end,
    with a stand-in runpodctl on PATH: a Ctrl-C or a preemption (stopped) must leave the pod up."""
    example = re.search(r"ON_EXIT='([^'\n]*runpodctl[^'\n]*)'", (REPO / "README.md").read_text()).group(1)
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    (bin_dir / "runpodctl").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "runpodctl").chmod(0o755)
    gone = subprocess.Popen(["true"])
    gone.wait()
    for status in ("finished", "stopped", "failed"):
        run_dir = tmp_path / status
        run_dir.mkdir()
        (run_dir / "metrics.jsonl").write_text(f'{{"kind": "end", "time": 100.0, "outcome": "{status}: why"}}\n')
        env = {**ENV, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RUNPOD_POD_ID": f"pod-{status}"}
        subprocess.run([sys.executable, "-m", "experiment.onexit", str(gone.pid), str(run_dir), "0", example],
                       cwd=REPO, env=env, timeout=60, capture_output=True)
    assert calls.read_text().splitlines() == ["stop pod pod-finished", "stop pod pod-failed"]


@pytest.mark.slow(seconds=27)
def test_on_exit_runs_once_when_the_run_ends_however_it_ends(tmp_path, corpus):
    out = tmp_path / "on_exit.txt"
    env = {**ENV, "DEPTH": "2", "ASPECT_RATIO": "32", "HEAD_DIM": "32", "MAX_SEQ_LEN": "32", "DEVICE_BATCH_SIZE": "4",
           "TOTAL_BATCH_SIZE": "256", "SAMPLE_TOKENS": "0", "DATA_DIR": str(corpus), "WORKSPACE": str(tmp_path),
           "SAVE_EVERY_STEPS": "5", "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
           "WARMDOWN_FRAC": "0",  # the second launch trains on from the first's step 3 (test_extend.py)
           "ON_EXIT": f'echo "$RUN_STATUS|$RUN_OUTCOME|$BEST_CHECKPOINT|$BEST_VAL_LOSS|$BEST_EXPORT" >> {out}'}
    launch = ["bash", str(REPO / "experiment/run.sh")]
    run_dir = tmp_path / "checkpoints/d2"
    done = subprocess.run([*launch, "MAX_STEPS=3"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    status, outcome, best, val, export = _wait_for_file(out).strip().split("|")
    assert (status, outcome, best) == ("finished", "finished: max_steps reached", str(ckpt.model_path(run_dir, 3)))
    assert export == str(run_dir / "best.pt") and ckpt.load_model(run_dir / "best.pt")[1]["step"] == 3
    assert float(val) == ckpt.read_best(run_dir)["val_loss"]

    # kill -9 of the whole launch: the watcher, in its own session, still reports it, once
    out.unlink()
    killed = subprocess.Popen(launch, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True, start_new_session=True)
    try:
        for line in killed.stdout:
            if line.startswith("saved step"):
                break
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait(timeout=60)
    lines = _wait_for_file(out, seconds=90).splitlines()
    _wait_for(lambda: not _watchers(run_dir), timeout=60, what="the ON_EXIT watcher to exit")
    assert lines == out.read_text().splitlines() and len(lines) == 1  # it ran the command once, then left
    # the workers outlive their killed launcher: they save and stop, and say so
    assert lines[0].startswith("stopped|stopped: SIGTERM at step "), lines
    assert "on_exit | " in (run_dir / "on_exit.log").read_text()
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"kind": "train", "step": 1')  # no last words, a cut line
    assert onexit.outcome_env(run_dir, since=time.time())["RUN_STATUS"] == "failed"


# ---------------------------------------------------------------- kill -9 anywhere


@pytest.mark.slow(seconds=45)
def test_kill9_at_random_points_and_during_saves_then_resume_equals_uninterrupted(tmp_path, corpus):
    steps = 40
    # An eval comes with every save, so the stop at the val minimum would end the reference before
    # step 40 and the kills would land after its end: off, so every launch has steps left to kill.
    args = [*TINY, "--data_dir", corpus, "--max_steps", steps, "--save_every_steps", 1, "--total_batch_size", 256,
            "--keep_last", 2, "--plateau_evals", 0]
    run_train([*args, "--workspace", tmp_path / "ref"], nproc=2)
    ws = tmp_path / "killed"
    run_dir = ws / "checkpoints/d2"
    rng = random.Random(1234)

    def files():
        return [p.name for p in run_dir.iterdir()] if run_dir.exists() else []

    def temp_file_present():
        return any(n.endswith(".tmp") for n in files())

    def shards_without_meta():
        names = files()
        metas = {n[5:11] for n in names if n.startswith("meta_") and n.endswith(".json")}
        return any(n.startswith("optim_") and n.endswith(".pt") and n[6:12] not in metas for n in names)

    def background_write():  # training has gone 3 steps past the save still writing
        writing = _writing_step(run_dir)
        return writing is not None and any(r.get("step", 0) >= writing + 3 for r in _records(run_dir))

    hit = []
    # A kill aimed at a moment of a save goes to a launch whose saves write slowly (every 4 steps at
    # 0.3 MB/s, ~3 s a save, training beside the write), so the moment lasts long enough to be seen
    # on a loaded machine; one that still misses its moment is tried again, not counted.
    slow = ["--save_every_steps", 4, "--save_write_mbps", 0.3]
    for what, predicate in [("random", None), ("background write", background_write), ("mid-write", temp_file_present),
                            ("shards, no meta", shards_without_meta), ("random", None), ("mid-write", temp_file_present)]:
        for attempt in range(1 if predicate is None else 4):
            flags = [*args, "--workspace", ws, *(slow if predicate is not None else [])]
            agent = subprocess.Popen(train_cmd(flags, 2), cwd=REPO, env=ENV,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            if predicate is None:
                start = (ckpt.complete_steps(run_dir) or [0])[-1]
                stop_at = start + rng.randint(1, 5)
                _wait_for(lambda: (ckpt.complete_steps(run_dir) or [0])[-1] >= stop_at or agent.poll() is not None,
                          what="progress")
                time.sleep(rng.uniform(0, 0.05))
            else:
                deadline = time.time() + 60
                while not predicate() and agent.poll() is None and time.time() < deadline:
                    time.sleep(0.002)
            landed = agent.poll() is None and (predicate is None or predicate())
            if agent.poll() is None:
                # torchrun starts its workers in sessions of their own: each gets its SIGKILL
                workers = _children(agent.pid)
                for pid in [*workers, agent.pid]:
                    os.kill(pid, signal.SIGKILL)  # the workers and the agent, with no warning
                _wait_for(lambda: not any(_alive(w) for w in workers), timeout=60, what="the workers to be gone")
            agent.wait()
            if landed:
                hit.append(what)
                break
    assert hit.count("mid-write") == 2 and "shards, no meta" in hit and "background write" in hit, hit
    assert ckpt.complete_steps(run_dir)[-1] < steps, "the kills came too late to test anything"
    run_train([*args, "--workspace", ws], nproc=2)
    ref, got = _state(tmp_path / "ref", steps), _state(ws, steps)
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
    assert run_meta(ws, steps)["data_positions"] == run_meta(tmp_path / "ref", steps)["data_positions"]


@pytest.mark.slow
def test_torchrun_restarts_a_dead_worker_and_the_run_resumes(tmp_path, corpus):
    args = [*TINY, "--data_dir", corpus, "--max_steps", 12, "--save_every_steps", 2, "--total_batch_size", 256]
    run_train([*args, "--workspace", tmp_path / "ref"], nproc=2)
    ws = tmp_path / "restarted"
    agent = subprocess.Popen(train_cmd([*args, "--workspace", ws], 2, torchrun=("--standalone", "--max-restarts=1")),
                             cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: ckpt.complete_steps(ws / "checkpoints/d2"), what="a first checkpoint")
    worker = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout.split()[0]
    os.kill(int(worker), signal.SIGKILL)
    out, err = agent.communicate(timeout=300)
    assert agent.returncode == 0, err[-2000:]
    assert "resumed from" in out
    ref, got = _state(tmp_path / "ref", 12), _state(ws, 12)
    assert all(torch.equal(ref[n], got[n]) for n in ref)


@pytest.mark.slow(seconds=35)
def test_a_kill_9_past_the_last_save_charges_the_lost_time_to_the_budget(tmp_path, corpus):
    """kill -9 a few seconds past the newest complete checkpoint, then the same command (to a near end).
    The budget used counts the training the kill threw away (the heartbeat's, at most
    HEARTBEAT_SECONDS old: 1 s here) and the restart's setup, and the done line and the report say
    how much was lost. Broken before: the resumed run's budget went on from the checkpoint's."""
    args = [*TINY, "--data_dir", corpus, "--workspace", tmp_path, "--total_batch_size", 256, "--save_every_steps", 400,
            "--async_save", 0, "--eval_every_minutes", 60, "--eval_every_epochs", 0, "--save_every_minutes", 60]
    run_dir = tmp_path / "checkpoints/d2"
    cmd = [sys.executable, str(REPO / "tests/faulty_train.py"), *map(str, args)]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**ENV, "HEARTBEAT_SECONDS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    log = run_dir / "training.log"
    _wait_for(lambda: log.exists() and "saved step 000400" in log.read_text(), what="the first save")
    time.sleep(3)  # about a hundred tiny steps on these machines, two or three hundred on a fast one: no second save
    proc.kill()
    killed_at = time.time()
    proc.wait(timeout=60)
    step = ckpt.complete_steps(run_dir)[-1]
    saved = run_meta(tmp_path, step)
    expected = killed_at - saved["saved_at"]  # wall seconds since that save began: all of them lost
    assert step == 400 and expected >= 3
    again = subprocess.run([*cmd, "--max_steps", str(step + 3)], cwd=REPO, capture_output=True, text=True,
                           env={**ENV, "HEARTBEAT_SECONDS": "1", "FAULT_EXPORT_SECONDS": "2"}, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    state = run_meta(tmp_path, step + 3)["state"]
    assert state["used_seconds"] - saved["state"]["used_seconds"] >= expected - 2.5
    lost, setup = map(float, re.search(r"restart \| ([\d.]+)s trained past the checkpoint were lost and ([\d.]+)s went "
                                       "to this restart's setup and load", again.stdout).groups())
    assert expected - 2.5 <= lost <= expected + 0.5, (lost, expected)  # a heartbeat a second, and a loaded machine
    assert setup > 0 and state["restart_seconds"] == pytest.approx(lost + setup, abs=0.1)
    done = next(line for line in again.stdout.splitlines() if line.startswith("done: "))
    assert f"{state['restart_seconds']:.1f}s of it lost to restarts" in done
    assert "lost to restarts" in (run_dir / "report.md").read_text()
    # The final export (2 s longer here) is on the bill: the heartbeat after it holds the done line's
    # seconds, so an extension of this run is charged them (its lost seconds past the final checkpoint).
    spent = float(re.search(r"\(([\d.]+)s of [\d.]+s\)", done).group(1))
    beat = json.loads((run_dir / "heartbeat.json").read_text())
    assert beat["used_seconds"] >= max(spent - 0.1, state["used_seconds"] + 2)
    # The same command again on the finished run trains no step and is charged nothing: its own
    # export (4 s here) is not added to what a later extension is charged (its loop's milliseconds are).
    done_again = subprocess.run([*cmd, "--max_steps", str(step + 3)], cwd=REPO, capture_output=True, text=True,
                                env={**ENV, "HEARTBEAT_SECONDS": "1", "FAULT_EXPORT_SECONDS": "4"}, timeout=240)
    assert done_again.returncode == 0, done_again.stderr[-3000:]
    assert json.loads((run_dir / "heartbeat.json").read_text())["used_seconds"] < beat["used_seconds"] + 1


def test_the_lost_seconds_come_from_a_heartbeat_written_since_the_resumed_checkpoint(tmp_path):
    """restarts.lost_seconds: the heartbeat's budget used past the resumed checkpoint's, only for
    RESUME=auto and a heartbeat from that step on; a torn or missing one counts as nothing."""
    import json

    from experiment import restarts
    from experiment.config import parse_args

    (tmp_path / "meta_000010.json").write_text(json.dumps({"step": 10, "state": {"step": 10, "used_seconds": 100.0}}))
    auto, older = parse_args([]), parse_args(["--resume", "10"])
    beat = tmp_path / restarts.HEARTBEAT

    def lost(step, used, cfg=auto, resume_step=10):
        beat.write_text(json.dumps({"step": step, "used_seconds": used, "time": 0.0}))
        return restarts.lost_seconds(tmp_path, resume_step, cfg)

    assert lost(14, 130.5) == 30.5
    assert lost(10, 112.0) == 12.0  # a beat at the checkpoint's own step, after its save began
    assert lost(10, 100.0) == 0.0 and lost(10, 90.0) == 0.0  # never negative
    assert lost(14, 130.5, cfg=parse_args(["--resume", "".join(["au", "to"])])) == 30.5  # RESUME=auto from the shell
    assert lost(9, 130.5) == 0.0  # written before the checkpoint: it knows nothing past it
    assert lost(14, 130.5, cfg=older) == 0.0  # RESUME=<step>: a branch
    # no checkpoint to resume, but a heartbeat: a crash before the first save lost all it trained
    assert lost(14, 130.5, resume_step=None) == 130.5
    assert lost(14, 130.5, cfg=parse_args(["--resume", "never"]), resume_step=None) == 0.0  # afresh by choice
    beat.write_text('{"step": 14, "used_se')  # torn
    assert restarts.lost_seconds(tmp_path, 10, auto) == 0.0
    beat.unlink()
    assert restarts.lost_seconds(tmp_path, 10, auto) == 0.0


def test_a_restarts_lost_and_setup_seconds_are_charged_once_at_its_first_step(tmp_path):
    """restarts.restart_cost then charge: the lost seconds and the setup since launch go into the budget
    used (used_at_start) and restart_seconds, once; the heartbeat says so at once (forced)."""
    import json
    from types import SimpleNamespace

    from experiment import restarts
    from experiment.checkpoint import RunState

    logs = []
    t = SimpleNamespace(d=Dist(0, 0, 1, torch.device("cpu")), st=RunState(step=12, restart_seconds=5.0),
                        lost_seconds=30.5, launched=100.0, run_dir=tmp_path, log=logs.append, resume_step=12)
    assert restarts.restart_cost(t, 112.0) == 42.5
    assert (t.restart_lost, t.restart_setup) == (30.5, 12.0)
    loop = SimpleNamespace(used_at_start=200.0, last_beat=time.time(), beat_failed=False, end=None, outcome="running")
    loop.used = lambda: loop.used_at_start
    restarts.charge(t, loop)
    assert (loop.used_at_start, t.st.restart_seconds, t.restart_lost, t.restart_setup) == (242.5, 47.5, 0.0, 0.0)
    assert "restart | 30.5s trained past the checkpoint were lost and 12.0s went to this restart's setup" in logs[0]
    beat = json.loads((tmp_path / restarts.HEARTBEAT).read_text())
    assert (beat["step"], beat["used_seconds"]) == (12, 242.5)  # though a beat was just written
    restarts.charge(t, loop)  # nothing is left to charge
    assert (loop.used_at_start, t.st.restart_seconds) == (242.5, 47.5)


def test_the_budget_counts_the_launch_from_the_launchers_start(tmp_path, corpus, monkeypatch):
    """experiment/run.sh exports LAUNCH_STARTED before its pre-flight: a fresh run's budget counts from
    there (the pre-flight, data preparation and torchrun's start are on the bill), a restart by
    torchrun from its own start, and a value from elsewhere is ignored."""
    from experiment import launch, train
    now = time.time()
    monkeypatch.setenv("LAUNCH_STARTED", repr(now - 100))
    assert launch.launch_started() == pytest.approx(now - 100)
    for env in ({"LAUNCH_STARTED": "soon"}, {"LAUNCH_STARTED": repr(now + 60)},
                {"LAUNCH_STARTED": repr(now - 100), "TORCHELASTIC_RESTART_COUNT": "1"}):  # a restart: its own
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            assert launch.launch_started() == pytest.approx(time.time(), abs=5)
    args = [*map(str, TINY), "--data_dir", str(corpus), "--workspace", str(tmp_path), "--max_steps", "2",
            "--save_every_steps", "2"]
    assert train.main(args) == 0
    assert run_meta(tmp_path, 2)["state"]["used_seconds"] >= 100


def test_a_restart_charge_still_pending_when_the_loop_ends_stays_in_the_heartbeat(tmp_path):
    """A resume that trains no step (a stop before its first, or a finished run relaunched) leaves its
    uncharged lost seconds in the heartbeat, and a stopped one its setup too: the next launch is
    charged them. Broken before: the loop's last heartbeat wrote the checkpoint's budget used alone."""
    import json
    from types import SimpleNamespace

    from experiment import restarts
    from experiment.checkpoint import RunState

    t = SimpleNamespace(d=Dist(0, 0, 1, torch.device("cpu")), st=RunState(step=10), run_dir=tmp_path, log=print,
                        restart_lost=30.5, restart_setup=12.0)
    # a finished run relaunched: its first decision ends it (end 0) with no step trained; its setup
    # bought nothing and is not charged, the lost seconds it found stay on record
    loop = SimpleNamespace(last_beat=0.0, beat_failed=False, used=lambda: 100.0, end=0,
                           outcome="finished: the budget is spent")
    restarts.beat(t, loop, force=True)
    beat = json.loads((tmp_path / restarts.HEARTBEAT).read_text())
    assert beat["used_seconds"] == 130.5 and beat["world_size"] == 1
    loop.outcome = "stopped: SIGTERM at step 10"  # stopped before its first step: the setup was this restart's too
    restarts.beat(t, loop, force=True)
    assert json.loads((tmp_path / restarts.HEARTBEAT).read_text())["used_seconds"] == 142.5
    (tmp_path / "meta_000010.json").write_text(json.dumps({"step": 10, "state": {"step": 10, "used_seconds": 100.0}}))
    from experiment.config import parse_args
    assert restarts.lost_seconds(tmp_path, 10, parse_args([])) == 42.5


@pytest.mark.slow(seconds=20)
def test_a_kill_9_before_the_first_save_charges_what_it_trained_to_the_fresh_start(tmp_path, corpus):
    """No checkpoint yet (on GPUs the first comes with the first eval, about 30 minutes in): the same
    command starts afresh, and its budget counts what the killed launch trained (its heartbeat)."""
    args = [*TINY, "--data_dir", corpus, "--workspace", tmp_path, "--total_batch_size", 256, "--save_every_steps", 4000,
            "--async_save", 0, "--eval_every_minutes", 60, "--eval_every_epochs", 0, "--save_every_minutes", 60]
    run_dir = tmp_path / "checkpoints/d2"
    cmd = [sys.executable, str(REPO / "tests/faulty_train.py"), *map(str, args)]
    env = {**ENV, "HEARTBEAT_SECONDS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    beat = run_dir / "heartbeat.json"
    _wait_for(lambda: beat.exists() and json.loads(beat.read_text())["used_seconds"] >= 3, what="3 s of training")
    proc.kill()
    proc.wait(timeout=60)
    trained = json.loads(beat.read_text())["used_seconds"]
    assert not ckpt.complete_steps(run_dir)
    again = subprocess.run([*cmd, "--max_steps", "3"], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    lost = float(re.search(r"restart \| ([\d.]+)s trained before the first checkpoint were lost", again.stdout).group(1))
    assert lost == pytest.approx(trained, abs=0.05)
    state = run_meta(tmp_path, 3)["state"]
    assert state["used_seconds"] >= trained
    assert state["restart_seconds"] == pytest.approx(lost, abs=0.05)  # its setup counts once, as a fresh run's


def test_the_heartbeat_is_rank_0s_every_heartbeat_seconds_and_a_failed_write_is_said_once(tmp_path, monkeypatch):
    import json
    from types import SimpleNamespace

    from experiment import restarts
    from experiment.checkpoint import RunState

    logs, fsynced = [], []
    write = restarts.atomic_write_json
    # not fsynced: on a network volume an fsync can wait behind a background save's gigabytes
    monkeypatch.setattr(restarts, "atomic_write_json",
                        lambda path, obj, durable=True: fsynced.append(durable) or write(path, obj, durable=durable))
    t = SimpleNamespace(d=Dist(0, 0, 1, torch.device("cpu")), st=RunState(step=3), run_dir=tmp_path, log=logs.append,
                        restart_lost=0.0, restart_setup=0.0)
    loop = SimpleNamespace(last_beat=0.0, beat_failed=False, used=lambda: 7.0, end=None, outcome="running")
    path = tmp_path / restarts.HEARTBEAT
    restarts.beat(t, loop)
    assert json.loads(path.read_text())["step"] == 3 and time.time() - loop.last_beat < 5
    t.st.step = 4
    restarts.beat(t, loop)  # within HEARTBEAT_SECONDS (10 s) of the last: not written
    assert json.loads(path.read_text())["step"] == 3
    loop.last_beat = time.time() - 9.5
    restarts.beat(t, loop)
    assert json.loads(path.read_text())["step"] == 3
    loop.last_beat = time.time() - 10.5
    restarts.beat(t, loop)
    assert json.loads(path.read_text()) == {"step": 4, "used_seconds": 7.0, "time": loop.last_beat, "world_size": 1}
    t.st.step = 5
    restarts.beat(t, loop, force=True)
    assert json.loads(path.read_text())["step"] == 5
    path.unlink()
    t.d = Dist(1, 1, 2, torch.device("cpu"))
    restarts.beat(t, loop, force=True)  # another rank never writes it
    assert not path.exists()
    (tmp_path / "a_file").write_text("")
    t.d, t.run_dir = Dist(0, 0, 1, torch.device("cpu")), tmp_path / "a_file"  # a write that fails
    restarts.beat(t, loop, force=True)
    assert loop.beat_failed and len(logs) == 1 and "could not be written" in logs[0]  # said at once
    restarts.beat(t, loop, force=True)
    assert loop.beat_failed and len(logs) == 1  # and once
    t.run_dir = tmp_path
    restarts.beat(t, loop, force=True)
    assert not loop.beat_failed and path.exists()
    assert fsynced and not any(fsynced)


@pytest.mark.slow
def test_workers_exit_on_their_own_when_the_agent_is_killed(tmp_path, corpus):
    args = [*TINY, "--data_dir", corpus, "--workspace", tmp_path, "--total_batch_size", 256]
    with open(tmp_path / "agent.log", "w") as out:
        agent = _launch_until_logged(args, 2, tmp_path, "step 000004 | loss", stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
    workers = _children(agent.pid)
    assert len(workers) == 2
    agent.kill()  # SIGKILL: the agent can neither forward a signal nor reap its workers
    agent.wait()
    # ParentWatch's own bound: the agent's death is noticed within a poll, the workers finish the step
    # and save, and whatever still lives `grace_seconds` later exits at once
    watch = ParentWatch()
    deadline = time.time() + watch.poll_seconds + watch.grace_seconds + 15
    while any(map(_alive, workers)) and time.time() < deadline:
        time.sleep(0.5)
    assert not any(map(_alive, workers)), (tmp_path / "agent.log").read_text()[-3000:]
    # They left the preemption way: a complete checkpoint, from which the run resumes.
    steps = ckpt.complete_steps(tmp_path / "checkpoints/d2")
    assert steps and "torchrun's agent" in (tmp_path / "agent.log").read_text()
    again = run_train([*args, "--max_steps", steps[-1] + 2], nproc=2)
    assert f"resumed from {ckpt.model_path(tmp_path / 'checkpoints/d2', steps[-1])}" in again.stdout


# ---------------------------------------------------------------- another world size


def test_a_budget_in_dollars_resumed_on_another_gpu_count_buys_the_hours_its_dollars_left(tmp_path):
    """launch.spent_base and dollar_budget: 8 GPUs for 1 h of a $64 budget at $4 (2 h on 8), then
    4 GPUs: $32 spent, $32 left buy 2 h on 4, so the run's budget is 1 + 2 = 3 h of its clock."""
    from experiment import launch
    from experiment.config import parse_args, resolve
    meta = {"step": 10, "world_size": 8, "state": {"step": 10, "used_seconds": 3600.0}}
    (tmp_path / "meta_000010.json").write_text(json.dumps(meta))
    assert launch.spent_base(meta, 8) == 0 and launch.spent_base(meta, 4) == 4 * 3600
    cfg = resolve(parse_args(["--budget_usd", "64"]), cuda=False, world_size=4)
    assert cfg.training_hours == 4  # what 4 GPUs would get from nothing spent
    lines = []
    launch.dollar_budget(cfg, tmp_path, 10, 4, lines.append)
    assert cfg.training_hours == pytest.approx(3) and "$32.00 of BUDGET_USD=$64.00 spent" in lines[0]
    again = {**meta, "world_size": 4, "state": {"step": 10, "used_seconds": 3600.0, "gpu_seconds_base": 4 * 3600}}
    assert launch.spent_base(again, 4) == 4 * 3600  # spent stays spent on the same count
    assert launch.spent_base(again, 8) == 0  # back on 8: (base + used x 4) = 8 GPU-hours = used x 8
    launch.dollar_budget(cfg, tmp_path, None, 4, lines.append)  # a fresh run: config.resolve's hours
    assert cfg.training_hours == pytest.approx(3) and len(lines) == 1
    # seconds lost past the checkpoint on 8 GPUs, charged on 4: the GPU-seconds they cost beyond 4's
    from experiment import restarts
    (tmp_path / restarts.HEARTBEAT).write_text(json.dumps({"step": 12, "used_seconds": 3700.0, "world_size": 8}))
    assert restarts.lost_on_other_gpus(tmp_path, 100.0, 4) == 400.0
    launch.dollar_budget(cfg, tmp_path, 10, 4, lines.append, gpu_fix=400.0)
    assert cfg.training_hours == pytest.approx(3 - 100 / 3600)  # $32 + 100 s on 8 GPUs spent
    (tmp_path / restarts.HEARTBEAT).write_text(json.dumps({"step": 12, "used_seconds": 3700.0}))  # an old one
    assert restarts.lost_on_other_gpus(tmp_path, 100.0, 4) == 0.0


@pytest.mark.slow(seconds=80)
def test_a_budget_usd_run_moved_from_2_ranks_to_1_spends_its_dollars_once(tmp_path, corpus):
    """BUDGET_USD through the launcher: 2 ranks stopped (SIGTERM) part way, then the same command on
    1 rank. The dollars spent in all (GPU-seconds x GPU_HOURLY_USD) stay within the budget; before,
    the 1-rank launch took BUDGET_USD's hours for 1 GPU, twice the 2-rank ones, and spent a fifth more."""
    budget_usd, rate = 60 * 2 * 4 / 3600, 4.0  # 60 s on 2 ranks, the launch's setup included
    env = {**ENV, "DEPTH": "2", "ASPECT_RATIO": "32", "HEAD_DIM": "32", "MAX_SEQ_LEN": "32", "DEVICE_BATCH_SIZE": "4",
           "TOTAL_BATCH_SIZE": "256", "SAMPLE_TOKENS": "0", "DATA_DIR": str(corpus), "WORKSPACE": str(tmp_path),
           "PLATEAU_EVALS": "0", "BUDGET_USD": repr(budget_usd), "GPU_HOURLY_USD": "4", "SAVE_EVERY_STEPS": "10",
           "MAX_RESTARTS": "0", "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
           # the whole budget, whatever the machine: a fast one made the default cap's 8 passes in 35 s of 60 s
           "MAX_EPOCHS": "0"}
    run_dir = tmp_path / "checkpoints/d2"
    launch = ["bash", str(REPO / "experiment/run.sh")]
    first = subprocess.Popen(launch, cwd=tmp_path, env={**env, "NPROC_PER_NODE": "2"}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    beat = run_dir / "heartbeat.json"
    _wait_for(lambda: beat.exists() and json.loads(beat.read_text())["step"] >= 10, what="10 steps")
    first.send_signal(signal.SIGTERM)  # torchrun forwards it: each rank saves and stops
    first.wait(timeout=120)
    stopped = run_meta(tmp_path, ckpt.complete_steps(run_dir)[-1])["state"]
    # as if the 2 ranks had trained 5 s past that save before a kill: spent on 2 GPUs, charged on 1
    beat.write_text(json.dumps({"step": stopped["step"], "used_seconds": stopped["used_seconds"] + 5, "time": 0,
                                "world_size": 2}))
    again = subprocess.run(launch, cwd=tmp_path, env={**env, "NPROC_PER_NODE": "1"}, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "spent by earlier launches (on 2 GPU(s) last)" in again.stdout and "extend |" not in again.stdout
    final = run_meta(tmp_path, ckpt.complete_steps(run_dir)[-1])
    st = final["state"]
    spent = (st["gpu_seconds_base"] + st["used_seconds"] * final["world_size"]) * rate / 3600
    # the 2-rank launch's seconds cost one GPU-second more each than 1 rank's, the 5 lost ones too
    assert final["world_size"] == 1 and st["gpu_seconds_base"] == pytest.approx(stopped["used_seconds"] + 5, abs=0.01)
    assert 0.9 * budget_usd < spent <= budget_usd * 1.01, (spent, budget_usd)


@pytest.fixture
def elastic_runs(request):
    """Uninterrupted 6-step runs that also save step 3, on 1, 2 and 3 ranks: run(batch, world) -> its
    workspace, trained on first use in the whole test run (a parallel run's workers share them), so
    each is trained once and only when a test needs it; args(batch): their flags."""
    corpus = built_once(request, "elastic-corpus", write_corpus) / "corpus"

    # 256 tokens: 1 rank x 2 micro-steps or 2 ranks x 1, bit-identical sums (the 1/2 scale is exact).
    # 768 tokens: also divisible by 3 ranks, but 1/3 and 1/6 round differently (compared loosely).
    def args(batch: int) -> list:
        return [*TINY, "--data_dir", corpus, "--max_steps", 6, "--save_every_steps", 3, "--total_batch_size", batch]

    def run(batch: int, world: int) -> Path:
        return built_once(request, f"elastic-b{batch}-w{world}",
                          lambda ws: run_train([*args(batch), "--workspace", ws], nproc=world))
    return run, args


@pytest.mark.slow(seconds=40)
@pytest.mark.parametrize("world_from,world_to,batch", [(2, 1, 256), (1, 2, 256), (2, 3, 768)])
def test_resume_on_another_world_size(elastic_runs, tmp_path, world_from, world_to, batch):
    run, flags = elastic_runs
    args = flags(batch)
    src = run(batch, world_from) / "checkpoints/d2"
    ws = tmp_path / f"from{world_from}to{world_to}"
    run_dir = ws / "checkpoints/d2"
    run_dir.mkdir(parents=True)
    for p in src.iterdir():
        if "_000003" in p.name:
            shutil.copy(p, run_dir / p.name)
    # Each rank of the new world loads the checkpoint with the trainer's own loader: together they
    # hold exactly the optimizer state the old world saved, each parameter once.
    shards = [ckpt.load_tensors(ckpt.optim_path(src, 3, r)) for r in range(world_from)]
    saved = {n: s for shard in shards for n, s in shard["state"].items()}
    restored = {}
    meta = ckpt.read_meta(src, 3)
    for rank in range(world_to):
        model = GPT(GPTConfig(**meta["model_config"]))
        opt = ShardedOptimizer(model, rank, world_to, **LRS, communicate=False)
        restore_checkpoint(run_dir, 3, model, opt, Dist(rank, rank, world_to, torch.device("cpu")))
        mine = opt.shard_state()["state"]
        assert restored.keys().isdisjoint(mine.keys())
        restored.update(mine)
    assert restored.keys() == saved.keys()
    assert all(torch.equal(restored[n][k], saved[n][k]) for n in saved for k in saved[n])

    run_train([*args, "--workspace", ws], nproc=world_to)
    reference = run(batch, world_to)  # the same world size, never interrupted
    ref, got = _state(reference, 6), _state(ws, 6)
    # The same windows were read, none skipped or repeated: the global data position matches.
    assert run_meta(ws, 6)["data_positions"] == run_meta(reference, 6)["data_positions"]
    if batch == 256:
        assert all(torch.equal(ref[n], got[n]) for n in ref)
    else:
        # Muon orthogonalizes in bf16 and lifts every small singular direction to unit size, so
        # the different rounding of 3 vs 2 ranks shows in the weights; the model is as good.
        assert run_meta(ws, 6)["val_loss"] == pytest.approx(run_meta(reference, 6)["val_loss"], abs=0.02)


# ---------------------------------------------------------------- several nodes


@pytest.mark.slow
def test_two_nodes_of_one_process_equal_one_node_of_two(tmp_path, corpus):
    args = [*TINY, "--data_dir", corpus, "--max_steps", 4, "--total_batch_size", 256]
    run_train([*args, "--workspace", tmp_path / "one_node"], nproc=2)
    port = _free_port()
    nodes = []
    for node_rank in range(2):
        rdzv = ("--nnodes=2", f"--node_rank={node_rank}", "--rdzv_backend=c10d",
                f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=test-two-nodes")
        nodes.append(subprocess.Popen(train_cmd([*args, "--workspace", tmp_path / "two_nodes"], 1, torchrun=rdzv),
                                      cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for node in nodes:
        out, err = node.communicate(timeout=300)
        assert node.returncode == 0, err[-2000:]
    one, two = _state(tmp_path / "one_node", 4), _state(tmp_path / "two_nodes", 4)
    assert all(torch.equal(one[n], two[n]) for n in one)
    assert run_meta(tmp_path / "two_nodes", 4)["world_size"] == 2


@pytest.mark.slow(seconds=20)
def test_a_users_error_on_two_nodes_ends_each_nodes_launch_once_with_exit_2(tmp_path, corpus):
    """Two loopback nodes of one process each, through the launcher's agent (experiment/agent.py), and
    EVAL_METRIC whose function raises: rank 0 decides it for both ranks. Each node's launch ends after
    its one restart found its own node's marker: exit 2 on both, the error once a node (local rank 0
    says it), no traceback, no ChildFailedError."""
    metric = tmp_path / "m.py"
    metric.write_text("def f(generate, tokenizer):\n    raise RuntimeError('a bad record')\n")
    run_dir, port = tmp_path / "ws/checkpoints/d2", _free_port()
    args = [*TINY, "--data_dir", corpus, "--workspace", tmp_path / "ws", "--max_steps", 4, "--total_batch_size", 256,
            "--eval_metric", f"{metric}:f"]
    nodes = [subprocess.Popen([sys.executable, "-m", "experiment.agent", str(run_dir), "--nnodes=2",
                               f"--node_rank={rank}", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                               "--rdzv_id=test-mistake", "--nproc_per_node=1", "--max-restarts=3", "-m",
                               "experiment.train", *map(str, args)],
                              cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    for node in nodes:
        out, err = node.communicate(timeout=300)
        assert node.returncode == 2, (out + err)[-3000:]
        assert err.count("raised RuntimeError: a bad record") == 1 and (out + err).count("error:") == 1, err[-3000:]
        assert "Traceback" not in out + err and "ChildFailedError" not in out + err
    assert not ckpt.complete_steps(run_dir)


# ---------------------------------------------------------------- faults in the run itself


@pytest.mark.slow
def test_failed_save_keeps_earlier_checkpoints_and_training_goes_on(tmp_path, corpus):
    args = [*TINY, "--data_dir", corpus, "--workspace", tmp_path, "--total_batch_size", 256, "--max_steps", 6,
            "--save_every_steps", 2, "--warmdown_frac", 0]  # no warmdown: 8 steps go on from step 6 (test_extend.py)
    run_dir = tmp_path / "checkpoints/d2"
    run_dir.mkdir(parents=True)
    ckpt.optim_path(run_dir, 4, 1).mkdir()  # rank 1 cannot write its step-4 shard (like a full disk)
    proc = run_train(args, nproc=2)
    assert "error: checkpoint step 000004 not saved" in proc.stdout and "writing checkpoint step 000004 failed" in proc.stderr
    assert ckpt.complete_steps(run_dir) == [2, 6]
    assert not list(run_dir.glob("model_000004*"))  # the partial step's model parts were cleaned up

    ckpt.model_part_path(run_dir, 8, 1).mkdir()  # now rank 1 cannot write its model part: the final save fails
    proc = run_train([*args, "--max_steps", 8], nproc=2, check=False)
    assert proc.returncode != 0 and "the final checkpoint, step 000008, could not be written" in proc.stdout
    assert ckpt.complete_steps(run_dir) == [2, 6]


def test_nonfinite_losses_skip_updates_and_a_streak_stops_the_run(tmp_path, corpus, monkeypatch, capsys):
    from experiment import train
    from experiment.model import GPT

    forward = GPT.forward
    calls = {"n": 0}
    poisoned = {3, 4}  # micro-steps (one per step here: no half-batch steps) whose loss is NaN

    def maybe_nan(self, idx, targets=None, **kw):
        out = forward(self, idx, targets, **kw)
        if targets is not None and self.training:
            calls["n"] += 1
            if calls["n"] in poisoned or calls["n"] >= 8:
                return out * float("nan")
        return out

    monkeypatch.setattr(GPT, "forward", maybe_nan)
    base = [*map(str, TINY), "--data_dir", str(corpus), "--workspace", str(tmp_path), "--total_batch_size", "128",
            "--save_every_steps", "1", "--batch_warmup_frac", "0"]
    code = train.main([*base, "--max_steps", "6"])
    out = capsys.readouterr().out
    assert code == 0 and "update skipped (2 in a row, 2 in all)" in out
    meta = run_meta(tmp_path, 6)
    assert meta["state"]["nonfinite_steps"] == 2
    assert all(torch.isfinite(t).all() for t in _state(tmp_path, 6).values())

    code = train.main([*base, "--max_steps", "40"])  # from the 8th call on, every loss is NaN
    out = capsys.readouterr().out
    assert code == 1 and "5 non-finite updates in a row; stopping" in out
    assert ckpt.complete_steps(tmp_path / "checkpoints/d2")[-1] == 7  # nothing saved after the streak began


def test_in_half_batch_steps_each_update_counts_and_the_fifth_skip_ends_the_step(tmp_path, corpus, monkeypatch,
                                                                                  capsys):
    from experiment import train
    from experiment.model import GPT

    forward, calls = GPT.forward, {"n": 0}

    def nan_from_the_third(self, idx, targets=None, **kw):
        out = forward(self, idx, targets, **kw)
        if targets is not None and self.training:
            calls["n"] += 1
            if calls["n"] >= 3:
                return out * float("nan")
        return out

    monkeypatch.setattr(GPT, "forward", nan_from_the_third)
    code = train.main([*map(str, TINY), "--data_dir", str(corpus), "--workspace", str(tmp_path), "--total_batch_size",
                       "128", "--batch_warmup_frac", "1", "--max_steps", "20", "--save_every_steps", "1"])
    out = capsys.readouterr().out
    # two forwards (updates) a step: step 1's two skip, step 2's two, step 3's first is the fifth
    assert code == 1 and "5 non-finite updates in a row; stopping" in out
    assert calls["n"] == 7  # no forward after the update that ended the run


def test_a_new_best_during_skipped_updates_is_saved_so_best_json_can_name_it(tmp_path, corpus, monkeypatch):
    """Steps 2 and 3 skip their updates (one forward per update: no half-batch steps); step 3's eval
    (the first since step 0) is a new best. Broken before: no save during a streak, so the run ended with best_step naming step 3, which no file held."""
    from experiment import train
    from experiment.model import GPT

    forward, calls = GPT.forward, {"n": 0}

    def nan_at_steps_2_and_3(self, idx, targets=None, **kw):
        out = forward(self, idx, targets, **kw)
        if targets is not None and self.training:
            calls["n"] += 1
            if calls["n"] in (3, 4):
                return out * float("nan")
        return out

    monkeypatch.setattr(GPT, "forward", nan_at_steps_2_and_3)
    code = train.main([*map(str, TINY), "--data_dir", str(corpus), "--workspace", str(tmp_path), "--total_batch_size",
                       "128", "--eval_every_steps", "3", "--max_steps", "4", "--batch_warmup_frac", "0"])
    run_dir = tmp_path / "checkpoints/d2"
    assert code == 0 and run_meta(tmp_path, 4)["state"]["best_step"] == 3
    assert 3 in ckpt.complete_steps(run_dir) and ckpt.read_best(run_dir)["step"] == 3


def test_a_kill_between_meta_and_best_json_is_repaired_by_the_resume(tmp_path, corpus, monkeypatch):
    from experiment import train

    write, killed = ckpt.atomic_write_json, []

    def killed_at_step_4s_best_json(path, obj):
        if path.name == "best.json" and obj["step"] == 4:
            killed.append(True)
            raise KeyboardInterrupt  # stands in for a kill -9 after meta_000004.json went in
        write(path, obj)

    base = [*map(str, TINY), "--data_dir", str(corpus), "--workspace", str(tmp_path), "--total_batch_size", "128",
            "--eval_every_steps", "2", "--save_every_steps", "2", "--async_save", "0"]
    monkeypatch.setattr(ckpt, "atomic_write_json", killed_at_step_4s_best_json)
    with pytest.raises(KeyboardInterrupt):
        train.main([*base, "--max_steps", "6"])
    monkeypatch.undo()
    run_dir = tmp_path / "checkpoints/d2"
    assert killed and ckpt.complete_steps(run_dir)[-1] == 4 and ckpt.read_best(run_dir)["step"] == 2
    assert train.main([*base, "--max_steps", "4"]) == 0  # a resume with no step left to run still repairs it
    assert ckpt.read_best(run_dir) == {"step": 4, "val_loss": run_meta(tmp_path, 4)["val_loss"], "weights": "raw"}


@pytest.mark.slow
def test_a_staging_failure_on_one_rank_leaves_both_training_and_later_saves_blocking(tmp_path, corpus):
    """Rank 1's first copy into host memory fails while rank 0's succeeds. Broken before: rank 1 alone
    completed that save at once, its all-reduce meeting rank 0's next collective (a hang on NCCL)."""
    args = [*TINY, "--data_dir", corpus, "--workspace", tmp_path, "--total_batch_size", 256, "--max_steps", 8,
            "--save_every_steps", 2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "tests/faulty_train.py"), *map(str, args)]
    proc = subprocess.run(cmd, cwd=REPO, env={**ENV, "FAULT_STAGING_RANK": "1"}, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "checkpoints/d2"
    assert "saves write in the background" in proc.stdout and "injected by tests/faulty_train.py" in proc.stderr
    assert "error: checkpoint step 000002 not saved" in proc.stdout and "step 000008 | loss" in proc.stdout
    assert proc.stdout.count("every later save blocks training") == 1
    steps = ckpt.complete_steps(run_dir)
    assert 2 not in steps and steps[-3:] == [4, 6, 8] and not list(run_dir.glob("*_000002*"))
    later = [r for r in _records(run_dir) if r["kind"] == "save" and r["step"] > 2]
    assert len(later) == 3 and all(r["ok"] and r["blocked"] >= r["seconds"] for r in later), later  # blocking


@pytest.fixture
def small_disk(tmp_path):
    """tmp_path/checkpoints/d2 on a real 2.5 MiB tmpfs (room for one tiny checkpoint and its best.pt,
    1.8 MiB, not two); remount it with more room through the returned function. Needs root (CI and the dev machines run as root)."""
    run_dir = tmp_path / "checkpoints/d2"
    run_dir.mkdir(parents=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2560k", "tmpfs", str(run_dir)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield lambda size: subprocess.run(["mount", "-o", f"remount,size={size}", str(run_dir)], check=True)
    finally:
        subprocess.run(["umount", "-l", str(run_dir)], capture_output=True)


@pytest.mark.slow
def test_a_full_disk_costs_a_save_not_the_run(tmp_path, corpus, small_disk):
    # A real full filesystem: torch.save reports it as RuntimeError, not OSError.
    args = [*TINY, "--data_dir", corpus, "--workspace", tmp_path, "--total_batch_size", 256, "--max_steps", 6,
            "--save_every_steps", 2, "--keep_last", 1]
    proc = run_train(args, check=False)
    run_dir = tmp_path / "checkpoints/d2"
    assert "saves write in the background" in proc.stdout  # step 4's write fails in the background writer
    assert "error: checkpoint step 000004 not saved" in proc.stdout and "writing checkpoint step 000004" in proc.stderr
    assert "step 000006 | loss" in proc.stdout  # training went on after the failed save
    assert proc.returncode == 1 and "the final checkpoint, step 000006, could not be written" in proc.stdout
    assert ckpt.complete_steps(run_dir) == [2]  # the earlier checkpoint is kept, whole
    assert not [p.name for p in run_dir.iterdir() if "_000004" in p.name or "_000006" in p.name or p.suffix == ".tmp"]
    small_disk("16m")  # room again: the same command resumes from step 2 and finishes
    again = run_train(args)
    assert "resumed from" in again.stdout and ckpt.complete_steps(run_dir)[-1] == 6


@pytest.mark.slow(seconds=21)
def test_a_full_disk_at_the_final_save_ends_the_launch_once(tmp_path, corpus, small_disk):
    """The whole launch (run.sh, torchrun, MAX_RESTARTS=3) on a volume that fills at step 4's save.
    Broken before: the failed final save exited 1, torchrun restarted the worker 3 times, and each
    restart resumed step 2 and trained to the same failed final save (config printed 4 times)."""
    out = tmp_path / "on_exit.txt"
    env = {**ENV, "DEPTH": "2", "ASPECT_RATIO": "32", "HEAD_DIM": "32", "MAX_SEQ_LEN": "32", "DEVICE_BATCH_SIZE": "4",
           "TOTAL_BATCH_SIZE": "256", "SAMPLE_TOKENS": "0", "EVAL_TOKENS": "512", "DATA_DIR": str(corpus),
           "WORKSPACE": str(tmp_path), "MAX_STEPS": "6", "SAVE_EVERY_STEPS": "2", "KEEP_LAST": "1", "LOG_EVERY_STEPS": "1",
           "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}", "ON_EXIT": f'echo "$RUN_OUTCOME" >> {out}'}
    proc = subprocess.run(["bash", str(REPO / "experiment/run.sh")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    run_dir = tmp_path / "checkpoints/d2"
    assert proc.returncode != 0 and proc.stdout.count("config {") == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "below the planned peak" in proc.stdout  # the pre-flight's disk guard, a warning on CPU
    assert ("error: not restarting: the trainer ended this launch with a failure that a restart would repeat "
            "(failed: the final checkpoint, step 000006, could not be written") in proc.stderr
    assert proc.stdout.count("step 000003 | loss") == 1 and proc.stdout.count("step 000006 | loss") == 1  # trained once
    line = next(x for x in proc.stdout.splitlines() if x.startswith("error: the final checkpoint"))
    assert f"the volume {run_dir} has" in line and "MB free" in line and "checkpoint is step 000002" in line
    assert ckpt.complete_steps(run_dir) == [2] and not ckpt.damaged_files(run_dir, 2)
    assert _wait_for_file(out).splitlines() == [
        "failed: the final checkpoint, step 000006, could not be written (training.log says why)"]
    # the same command again is a resume: the pre-flight's disk check warns (on a fresh CUDA run it refuses)
    plan = tmp_path / "plan.json"
    again = subprocess.run([sys.executable, "-m", "experiment.preflight", "--world_size=1", f"--plan_file={plan}",
                            *[f"--{k.lower()}={env[k]}" for k in ("DEPTH", "ASPECT_RATIO", "HEAD_DIM", "MAX_SEQ_LEN",
                                                                   "DATA_DIR", "WORKSPACE", "KEEP_LAST")]],
                           cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "resumes step 000002" in again.stdout, again.stderr[-2000:]
    assert any(x.startswith("warning: the volume") and "below the planned peak" in x for x in again.stdout.splitlines())


# ---------------------------------------------------------------- memory modes


@pytest.mark.slow
def test_bf16_with_master_shards_resumes_exactly_and_recompute_changes_nothing(tmp_path, corpus):
    args = [*TINY, "--data_dir", corpus, "--max_steps", 6, "--save_every_steps", 3, "--total_batch_size", 256,
            "--precision", "bf16"]
    run_train([*args, "--workspace", tmp_path / "a", "--activation_checkpointing", "on"], nproc=2)
    run_train([*args, "--workspace", tmp_path / "b", "--activation_checkpointing", "off"], nproc=2)
    a, b = _state(tmp_path / "a", 6), _state(tmp_path / "b", 6)
    assert all(v.dtype == torch.bfloat16 for v in a.values())
    assert all(torch.equal(a[n], b[n]) for n in a)  # recomputing blocks gives the same gradients
    meta = run_meta(tmp_path / "a", 6)
    assert meta["weights_dtype"] == "bfloat16" and meta["activation_checkpointing"] is True
    # fp32 masters live only in the owner's shard, and a resume restores them exactly.
    run_dir = tmp_path / "a/checkpoints/d2"
    shards = [ckpt.load_tensors(ckpt.optim_path(run_dir, 6, r))["state"] for r in range(2)]
    assert set(shards[0]).isdisjoint(shards[1])
    assert all(s["master"].dtype == torch.float32 for shard in shards for s in shard.values())
    resumed = tmp_path / "c/checkpoints/d2"
    resumed.mkdir(parents=True)
    for p in run_dir.iterdir():
        if "_000003" in p.name:
            shutil.copy(p, resumed / p.name)
    run_train([*args, "--workspace", tmp_path / "c", "--activation_checkpointing", "on"], nproc=2)
    c = _state(tmp_path / "c", 6)
    assert all(torch.equal(a[n], c[n]) for n in a)
    masters_c = [ckpt.load_tensors(ckpt.optim_path(resumed, 6, r))["state"] for r in range(2)]
    assert all(torch.equal(shards[r][n]["master"], masters_c[r][n]["master"]) for r in range(2) for n in shards[r])
