"""prepare's memory is bounded by its chunk size, not by the corpus size.

A corpus twice the memory prepare may add is prepared under that limit, on two worker processes.
The limit is RLIMIT_DATA (the process's private writable memory: heap, anonymous maps, thread
stacks), set after the imports (torch maps far more address space than RLIMIT_AS would allow). The
workers are forked, so they inherit it. A prepare that held the corpus as bytes, str, UTF-32 and
int64 (about 30x its size) fails here with MemoryError.
"""

import json
import subprocess
import sys

import pytest

from conftest import REPO
from experiment.dataloader import demo_lines

CORPUS_MB = 72
LIMIT_MB = 32  # what prepare may add to the data segment it starts with

CHILD = r"""
import json, resource, sys
from pathlib import Path
from experiment import dataloader

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

dataloader.CHUNK_BYTES = 1 << 20
limit = status("VmData:") + int(sys.argv[3]) * 2**20
resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
rss = status("VmRSS:")
p = dataloader.prepare(Path(sys.argv[1]), Path(sys.argv[2]), max_seq_len=64, workers=2)
print(json.dumps({"dir": str(p.dir), "rss_at_start": rss, "peak_rss": status("VmHWM:"),
                  "worker_peak_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["txt", "jsonl"])
def test_prepare_of_a_corpus_larger_than_its_memory_limit(tmp_path, fmt):
    """The same text as one *.txt file, and as one JSONL file of 3,000-line records (converted to text
    on disk first: records.py)."""
    block = "".join(demo_lines(3_000))
    data = tmp_path / "data"
    data.mkdir()
    n = CORPUS_MB * 2**20 // len(block)
    with open(data / f"sums.{fmt}", "w") as f:
        for _ in range(n):
            f.write(block if fmt == "txt" else json.dumps({"text": block}) + "\n")
    size = (data / f"sums.{fmt}").stat().st_size
    assert size > 2 * LIMIT_MB * 2**20
    proc = subprocess.run([sys.executable, "-c", CHILD, str(data), str(tmp_path / "ws"), str(LIMIT_MB)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["peak_rss"] - out["rss_at_start"] < LIMIT_MB * 2**20
    assert out["worker_peak_rss"] < out["rss_at_start"] + LIMIT_MB * 2**20  # a worker shares the parent's pages
    meta = json.loads((tmp_path / "ws/prepared" / out["dir"].rsplit("/", 1)[1] / "meta.json").read_text())
    # BOS + one id per character, a BOS per record
    assert meta["split"]["train_tokens"] + meta["split"]["val_tokens"] == (size + 1 if fmt == "txt" else n * (len(block) + 1))
