"""The prepare benchmark: a synthetic char-level corpus of a given size, prepared cold and then again.

    python -m experiment.tools.prepbench [--mb 100] [--files 4] [--format txt] [--record_kb 4] [--dir D] [--keep]
    (also `python -m experiment.tools.bench prepare ...`)

--format jsonl, jsonl.gz or parquet writes the same text as record files instead: each file's
lines grouped into records of about --record_kb KB (one JSONL line or one Parquet row each, field
"text"), so that a run of each format compares them on the same characters.

Writes the corpus into a temp directory, runs `python -m experiment.dataloader prepare` on it in a
child process and prints the wall time, MB/s, the child's peak RSS (ru_maxrss: the largest single
process, the parent or one of its workers) and the peak PSS of its whole process tree (sampled every
0.1 s: workers share pages with the parent, PSS counts each page once), then the time of a second
prepare of the unchanged files (a cache hit, by their stat), both as the CLI's wall time and inside
prepare(). The corpus is pseudo-English from our own generator (Zipf-distributed random words, lines
of about 70 characters, 1 word in 100 with a non-ASCII character such as 'é' or '—', so that every
chunk takes the multi-byte path as real text does); it is deleted afterwards unless --keep.
The child runs with the defaults: one worker per core.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from experiment import dataloader
from experiment.files import REPO_ROOT

BLOCK_BYTES = 8 << 20  # the generator's unit: one block of words at a time
NON_ASCII = ["é", "ü", "—", "’", "“", "”", "ß", "ç"]


def _vocabulary(rng: np.random.Generator, n: int = 6000) -> tuple[np.ndarray, np.ndarray]:
    """Entries 'word + separator' (object array of bytes) and their probabilities: Zipf over n words,
    then a separator per use: a space mostly, a newline for 1 word in 10 (lines of ~60-80 characters),
    a comma or full stop, and for 1 word in 100 a non-ASCII character (é, —, ’, ...) before the space."""
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    freq = 1 / np.arange(1, 27) ** 0.9
    words = ["".join(rng.choice(letters, size=int(rng.integers(1, 11)), p=freq / freq.sum())) for _ in range(n)]
    words = [w.capitalize() if i % 40 == 7 else w for i, w in enumerate(words)]
    seps = [(" ", 0.84), ("\n", 0.10), (", ", 0.03), (". ", 0.02), (None, 0.01)]
    entries = [(w + (sep or NON_ASCII[i % len(NON_ASCII)] + " ")).encode() for i, w in enumerate(words) for sep, _ in seps]
    p_word = 1 / np.arange(1, n + 1) ** 1.05
    p = np.outer(p_word / p_word.sum(), [q for _, q in seps]).ravel()
    return np.array(entries, dtype=object), p / p.sum()


def write_corpus(directory: Path, total_bytes: int, n_files: int, seed: int = 0) -> float:
    """n_files files of about total_bytes in all, in whole lines; returns the share of non-ASCII bytes."""
    rng = np.random.default_rng(seed)
    entries, p = _vocabulary(rng)
    non_ascii = written = 0
    mean = float(sum(len(e) * q for e, q in zip(entries, p)))
    per_file = total_bytes // n_files
    for f in range(n_files):
        with open(directory / f"part{f:05d}.txt", "wb") as out:
            left = per_file
            while left > 0:
                size = int(min(BLOCK_BYTES, 2 * left + 4096) / mean)  # small files: no 8 MB block each
                block = b"".join(entries[rng.choice(len(entries), size=size, p=p)])
                if len(block) >= left:  # the last block: the file ends after a whole line
                    block, left = block[: block.rfind(b"\n", 0, left) + 1], 0
                else:
                    left -= len(block)
                out.write(block)
                written += len(block)
                non_ascii += len(block) - len(block.translate(None, bytes(range(0x80, 0x100))))
    return non_ascii / written


def to_records(txt: Path, fmt: str, record_bytes: int) -> None:
    """txt (whole lines) rewritten as a record file of the same name with fmt's suffix; txt removed.
    Streams: a record at a time (JSONL) or 1,024 of them (Parquet)."""
    import gzip
    import json

    out = txt.with_suffix("." + fmt)

    def texts():
        record, n = [], 0
        with open(txt, encoding="utf-8") as f:
            for line in f:
                record.append(line)
                n += len(line)
                if n >= record_bytes:
                    yield "".join(record)
                    record, n = [], 0
        if record:
            yield "".join(record)

    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema([("text", pa.string())])
        with pq.ParquetWriter(out, schema) as writer:
            batch = []
            for text in texts():
                batch.append(text)
                if len(batch) == 1024:
                    writer.write_table(pa.table({"text": batch}, schema=schema))
                    batch = []
            if batch:
                writer.write_table(pa.table({"text": batch}, schema=schema))
    else:
        with (gzip.open(out, "wt", encoding="utf-8", compresslevel=6) if fmt == "jsonl.gz"
              else open(out, "w", encoding="utf-8")) as f:
            for text in texts():
                f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    txt.unlink()


def _tree_pss_kb(pid: int) -> int:
    """PSS of pid and its descendants, in kB (0 for a process gone meanwhile)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in open(f"/proc/{p}/smaps_rollup"):
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in open(f"/proc/{p}/task/{task}/children").read().split()]
        except OSError:
            pass
    return total


# Runs argv[2:] with this interpreter and writes its ru_maxrss and CPU seconds to argv[1]. A child of this small
# process, not of the benchmark: a child's ru_maxrss starts at its parent's RSS when it forked (vfork
# and exec hand the parent's high-water mark on), and the benchmark has imported torch.
LAUNCHER = """import os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.executable, [sys.executable] + sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
open(sys.argv[1], "w").write(f"{usage.ru_maxrss} {usage.ru_utime + usage.ru_stime}")
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run_child(args: list[str], scratch: Path) -> tuple[float, int, int, float, str]:
    """(wall seconds, ru_maxrss kB, peak tree PSS kB, CPU seconds of all its processes, output) of
    `python args...`."""
    peak, usage_file = [0], scratch / "usage"
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(usage_file), *args], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    done = threading.Event()

    def sample():
        while not done.wait(0.1):
            peak[0] = max(peak[0], _tree_pss_kb(proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out = proc.stdout.read()
    proc.wait()
    wall = time.perf_counter() - started
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"python {' '.join(args)} exited {proc.returncode}:\n{out}")
    maxrss, cpu = usage_file.read_text().split()
    return wall, int(maxrss), peak[0], float(cpu), out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mb", type=float, default=100, help="corpus size in MB (10^6 bytes)")
    p.add_argument("--files", type=int, default=4, help="number of files the corpus is split into")
    p.add_argument("--format", default="txt", choices=["txt", "jsonl", "jsonl.gz", "parquet"],
                   help="the files' format (the same text in each)")
    p.add_argument("--record_kb", type=float, default=4, help="record size of a record format, in KB")
    p.add_argument("--dir", default=None, help="where the temp directory goes (default: the system's temp)")
    p.add_argument("--keep", action="store_true", help="keep the corpus and the prepared directory")


def main(args) -> int:
    total = int(args.mb * 1e6)
    free = shutil.disk_usage(args.dir or tempfile.gettempdir()).free
    if free < 3 * total:
        print(f"prepbench: needs ~{3 * total / 1e9:.1f} GB free for the corpus and its tokens, {free / 1e9:.1f} GB "
              "there; pass --dir", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="prepbench.", dir=args.dir))
    try:
        data, ws = root / "data", root / "ws"
        data.mkdir()
        t = time.perf_counter()
        share = write_corpus(data, total, args.files)
        text_mb = sum(f.stat().st_size for f in data.iterdir()) / 1e6
        if args.format != "txt":
            for f in sorted(data.iterdir()):
                to_records(f, args.format, int(args.record_kb * 1000))
        size = sum(f.stat().st_size for f in data.iterdir())
        print(f"prepbench | corpus {size / 1e6:,.0f} MB in {args.files} {args.format} files ({text_mb:,.0f} MB of text, "
              f"{share:.2%} non-ASCII bytes), written in {time.perf_counter() - t:.1f} s | {root}")
        time.sleep(dataloader.STAT_TRUST_SECONDS)  # files this fresh are not trusted by their stat (see dataloader)
        cmd = ["-m", "experiment.dataloader", "prepare", "--data_dir", str(data), "--workspace", str(ws)]
        _, base_rss, _, base_cpu, _ = run_child(["-c", "import experiment.dataloader"], root)
        load = os.getloadavg()[0]
        wall, rss, pss, cpu, out = run_child(cmd, root)
        inner = float(re.search(r"in ([\d.]+) s", out).group(1))
        for line in out.splitlines():
            if line.startswith("prepare |"):  # the child's progress lines
                print(f"  {line}")
        print(f"prepbench | cold prepare: {wall:.1f} s wall ({size / 1e6 / wall:.0f} MB/s), {inner:.1f} s inside "
              f"prepare() ({size / 1e6 / inner:.0f} MB/s) | peak RSS {rss / 1024:,.0f} MB (largest process; "
              f"python + imports alone: {base_rss / 1024:,.0f} MB) | peak PSS {pss / 1024:,.0f} MB (process tree) "
              f"| CPU {cpu:.1f} s in all its processes ({base_cpu:.1f} s of it python + imports) | {os.cpu_count()} CPUs, "
              f"load average {load:.1f} before")
        hit_wall, hit_rss, _, _, _ = run_child(cmd, root)
        t = time.perf_counter()
        dataloader.prepare(data, ws, log=print)
        hit = time.perf_counter() - t
        print(f"prepbench | cache hit: {hit_wall:.1f} s wall for the CLI (mostly python + imports), {hit * 1000:.1f} ms "
              f"inside prepare() | peak RSS {hit_rss / 1024:,.0f} MB")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m experiment.tools.prepbench", description=__doc__.split("\n")[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
