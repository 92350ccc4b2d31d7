"""Shared helpers: a tiny corpus made by our own code and a way to launch the trainer for real."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiment import checkpoint as ckpt
from experiment.dataloader import demo_lines
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


def pytest_addoption(parser):
    parser.addoption("--cuda-tests-on-cpu", action="store_true",
                     help="run the tests marked cuda on the CPU (gpucheck on a machine without a GPU)")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a GPU; skipped without one unless --cuda-tests-on-cpu")
