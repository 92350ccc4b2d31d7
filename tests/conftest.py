"""Shared helpers: a tiny corpus made by our own code and a way to launch the trainer for real."""

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from experiment import checkpoint as ckpt
from experiment.dataloader import demo_lines
from experiment.distributed import process_alive
from experiment.model import GPTConfig

REPO = Path(__file__).resolve().parent.parent
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"

# 2 layers x 64 dims: the style guide's tiny config; every test run takes seconds. An hour over the
# tiny corpus would be data-limited, so the regime's recipe is off unless a test asks for it
# (tests/test_regime.py tests the defaults by regime): the plain step, the data's pass cap.
TINY = ["--depth", "2", "--aspect_ratio", "32", "--head_dim", "32", "--max_seq_len", "32",
        "--device_batch_size", "4", "--sample_tokens", "0", "--log_every_steps", "1",
        "--training_hours", "1", "--eval_tokens", "512", "--attn_dropout", "0", "--average", "none"]


def tiny_config(vocab_size: int = 64, max_seq_len: int = 32, bigram: bool = False) -> GPTConfig:
    """The model TINY trains: 2 layers x 64 dims, 2 heads of 32 (bigram: with the bigram table)."""
    return GPTConfig(vocab_size=vocab_size, depth=2, aspect_ratio=32, head_dim=32, max_seq_len=max_seq_len,
                     bigram_vocab=vocab_size if bigram else 0)


def run_meta(workspace: Path, step: int, tag: str = "d2") -> dict:
    """meta_<step>.json of run `tag` under `workspace` (d2: the model tag TINY trains under)."""
    return ckpt.read_meta(Path(workspace) / "checkpoints" / tag, step)


def write_corpus(parent: Path) -> Path:
    """parent/corpus/sums.txt: one small arithmetic text file (about 40k characters)."""
    d = parent / "corpus"
    d.mkdir()
    (d / "sums.txt").write_text("".join(demo_lines(4000, seed=7)))
    return d


@pytest.fixture
def corpus(tmp_path) -> Path:
    return write_corpus(tmp_path)


# PYTHON: the launchers (run.sh, experiment/run.sh) run this interpreter, not a .venv of their own.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHON": sys.executable}


@pytest.fixture(scope="session")
def workspace(tmp_path_factory):
    """A workspace with one tiny run (checkpoints/d2) trained by the real trainer, for serving and sampling."""
    ws = tmp_path_factory.mktemp("serve")
    run_train([*TINY, "--data_dir", write_corpus(ws), "--workspace", ws, "--max_steps", 30, "--total_batch_size", 256,
               "--max_seq_len", 64])
    return ws


def train_cmd(args, nproc: int = 1, torchrun=("--standalone",)) -> list[str]:
    """The trainer as users run it: plain `python -m` for one process, torchrun (gloo) for more."""
    if nproc == 1 and not torchrun:
        return [sys.executable, "-m", "experiment.train", *map(str, args)]
    return [sys.executable, "-m", "torch.distributed.run", *torchrun, f"--nproc_per_node={nproc}",
            "-m", "experiment.train", *map(str, args)]


def run_train(args, nproc: int = 1, check: bool = True, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = train_cmd(args, nproc, torchrun=() if nproc == 1 else ("--standalone",))
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def _state(pid: int) -> str:
    """The process's state letter from /proc (R, S, T, Z, ...); "X" when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def wait_gone(pids: list[int], seconds: float = 60) -> None:
    """Until every process kill_tree killed is gone (a zombie counts as gone: process_alive)."""
    deadline = time.time() + seconds
    while alive := [p for p in pids if process_alive(p)]:
        assert time.time() < deadline, f"killed processes still running: {alive}"
        time.sleep(0.01)


def kill_tree(pid: int) -> list[int]:
    """kill -9 of pid and every process under it, as a reboot would end them; returns their pids.
    torchrun gives each worker a session of its own, so a killpg of the launch misses them, and a
    worker that saw its agent die before its own SIGKILL came would save and stop (ParentWatch):
    every process of the tree is stopped first, then killed. Each is stopped (its state T, or Z: a
    fork under way when the signal came has ended) before its children are listed: a stopped process
    forks no child the walk could miss. (A process already exiting hands its children to init, out of
    the walk's reach; none of the trees this kills exits at that moment.)"""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            os.kill(p, signal.SIGSTOP)
        except ProcessLookupError:
            continue
        deadline = time.time() + 2
        while _state(p) not in "TtZX" and time.time() < deadline:
            time.sleep(0.001)
        tree.append(p)
        todo += [int(c) for c in subprocess.run(["pgrep", "-P", str(p)], capture_output=True, text=True).stdout.split()]
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return tree


def pytest_addoption(parser):
    parser.addoption("--cuda-tests-on-cpu", action="store_true",
                     help="run the tests marked cuda on the CPU (gpucheck on a machine without a GPU)")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a GPU; skipped without one unless --cuda-tests-on-cpu")
    config.addinivalue_line("markers", "slow(seconds=N): launches processes or takes over a second; `bash run.sh "
                                       "test --quick` leaves it out. seconds: about how long it takes alone on a "
                                       "2-core machine, where that is 20 or more (the parallel run starts it first)")
    config.addinivalue_line("markers", "alone: runs with no other test beside it when the suite runs in parallel")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # One core a worker: a worker's in-process torch must not spread over the core the other
        # worker is using (oversubscribed, both run slower than one at a time).
        import torch
        torch.set_num_threads(1)


def built_once(request, name: str, build) -> Path:
    """A directory that build(dir) fills once per test run, whichever worker of a parallel run asks
    first; a worker that asks while another builds waits for it. Its users only read it. A build that
    failed fails every later test that asks for it at once (each would wait for it again)."""
    base = request.getfixturevalue("tmp_path_factory").getbasetemp()
    # An xdist worker's own config only (not a pytest a test started): pytest-N/ holds every worker's basetemp
    root = base.parent if hasattr(request.config, "workerinput") else base
    done = root / "built-once" / name
    done.parent.mkdir(exist_ok=True)
    with open(done.parent / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (done.parent / f"{name}.failed").exists():
            pytest.fail(f"built_once({name!r}) failed in an earlier test")
        if not (done / ".built").exists():
            shutil.rmtree(done, ignore_errors=True)  # a worker that died building it left a part
            done.mkdir()
            try:
                build(done)
            except BaseException:
                (done.parent / f"{name}.failed").touch()
                raise
            (done / ".built").touch()
    return done


# Fixtures shared by several tests that launch processes (each worker of a parallel run builds its own,
# unless built_once).
SHARED_RUNS = {"workspace", "zero1_world2", "elastic_runs"}


def pytest_itemcollected(item):
    """A shared fixture that trains or spawns ranks costs seconds: whoever uses it is slow (marked as
    it is collected, before -m "not slow" deselects)."""
    if SHARED_RUNS & set(getattr(item, "fixturenames", ())):
        item.add_marker(pytest.mark.slow)


@pytest.hookimpl(trylast=True)  # after -m and -k deselect: the split below counts the tests that run
def pytest_collection_modifyitems(config, items):
    # In parallel (pytest-xdist's worksteal: the list is cut into one run a worker, and an idle worker
    # takes half of another's remaining tail): each worker's run goes longest first (slow(seconds=N):
    # about N s on a 2-core machine), then the other slow tests, then the quick ones, so the long ones
    # start early and the short ones fill the end; `alone` tests last, where the other workers lose the
    # least time waiting for them.
    def order(item):
        slow = item.get_closest_marker("slow")
        return (item.get_closest_marker("alone") is not None, slow is None,
                -(slow.kwargs.get("seconds", 0) if slow else 0))
    items.sort(key=order)
    items[:] = worker_runs(items, getattr(config, "workerinput", {}).get("workercount", 1))


def worker_runs(ordered: list, k: int) -> list:
    """`ordered` dealt out to k workers in turn, as one list that pytest-xdist's first split cuts back
    into those k runs: it gives worker i len(left) // (k - i) of what is left, so the runs take those
    sizes. (Every k-th item, with an odd count on 2 workers, put the first run's last test, an `alone`
    one, at the head of the second: it waited out the first run's longest test, a core idle 4 minutes.)"""
    sizes, left = [], len(ordered)
    for i in range(k):
        sizes.append(left // (k - i))
        left -= sizes[-1]
    runs: list[list] = [[] for _ in range(k)]
    turn = 0
    for item in ordered:
        while len(runs[turn % k]) == sizes[turn % k]:
            turn += 1
        runs[turn % k].append(item)
        turn += 1
    return [item for run in runs for item in run]


@pytest.fixture(autouse=True)
def machine_share(request):
    """Under pytest-xdist, a test marked `alone` holds the machine: it waits for the tests running
    on other workers to end, and none starts beside it. Every test takes a shared lock, an `alone`
    one an exclusive lock; the turnstile before it keeps a stream of shared takers from starving
    an exclusive one. Without xdist (one process) it does nothing, and so does a pytest that a test
    starts (gpucheck's run of tests/test_cuda.py): it inherits the workers' environment, but not
    their locks, and waiting on the turnstile an `alone` test holds while its parent test holds the
    shared lock deadlocked a whole suite (load 0, forever)."""
    run = getattr(request.config, "workerinput", {}).get("testrunuid")  # an xdist worker's own config only
    if run is None:
        yield
        return
    base = Path(tempfile.gettempdir()) / f"pytest-share-{run}"
    alone = request.node.get_closest_marker("alone") is not None
    with open(f"{base}.turnstile", "a") as gate, open(f"{base}.lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(gate, fcntl.LOCK_UN)
        yield  # the lock goes with the file's close


QUICK_SECONDS = 2.0  # an unmarked test slower than this is named at the end of a quick run


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """A quick run (-m 'not slow') names the tests it ran that took longer than QUICK_SECONDS:
    mark them slow, or the quick tier grows back into the whole suite."""
    if "not slow" not in (config.getoption("markexpr") or ""):
        return
    total: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for r in reports:
            if getattr(r, "when", None) in ("setup", "call", "teardown"):
                total[r.nodeid] = total.get(r.nodeid, 0.0) + r.duration
    slow = sorted((s, n) for n, s in total.items() if s > QUICK_SECONDS)
    if slow:
        terminalreporter.write_line(f"quick tier: {len(slow)} test(s) over {QUICK_SECONDS:.0f} s; mark them "
                                    "@pytest.mark.slow:")
        for s, n in reversed(slow):
            terminalreporter.write_line(f"  {s:5.1f} s  {n}")
