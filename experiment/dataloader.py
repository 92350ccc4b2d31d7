"""Text files -> validated, tokenized memmap (train.bin, val.bin, meta.json); the batches over them
are experiment/batches.py's.

    python -m experiment.dataloader prepare --data_dir D [--workspace W] [--alphabet S]
        [--tokenizer char|<tiktoken encoding>] [--val_fraction F] [--max_seq_len T]

Every input problem is found before anything is written: the prepared directory is built under a
temp name and renamed into place only when complete, and it is keyed by a hash of the sources and
the tokenizer settings, so a second prepare of the same data is a cache hit.

The files are read in chunks (experiment/chunks.py), so memory stays bounded whatever the corpus
size, and on every core: pass 1 validates each chunk and collects its characters while this
process takes each file's sha256, pass 2 encodes the chunks straight into the final dtype. Files
whose stat (path, size, mtime, ctime, inode) is unchanged since a prepare are a cache hit without
being read.
"""

from __future__ import annotations

import argparse
import codecs
import hashlib
import itertools
import json
import os
import random
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from experiment import chunks, records
from experiment.files import atomic_write_bytes, atomic_write_json, default_workspace, publish_dir

VOCAB_MULTIPLE = 64  # padded vocab: matmul-friendly head shape, room for BOS
DEMO_FILE = "arithmetic.txt"
# Per chunk: a worker holds a few times this (bytes, text, ids), and 2 chunks per worker are in flight.
CHUNK_BYTES = 8 << 20
# At most this many workers (default: one per core): each holds ~50-100 MB, so memory stays near 2 GB on
# a big box too; char prepare is then limited by this process's sha256 (~1.8 GB/s on the dev machine).
MAX_WORKERS = 32
MAX_NAMED_CHARS = 20  # characters an INIT_FROM vocabulary error lists
PROGRESS_SECONDS = 5.0
# A file whose mtime or ctime is this recent is not trusted to be identified by its stat (see _stat_trusted).
STAT_TRUST_SECONDS = 2.0
STAT_KEY_VERSION = 2
# The least a file gives val as its tail (tokens; the default context on GPUs): a smaller share waits
# for a file it covers whole, so val holds whole records or long tails, not scraps cut mid-record.
MIN_VAL_PIECE = 2048


class DataError(Exception):
    """Bad input data; the message names the file (and line:column where it applies)."""


# ---------------------------------------------------------------- tokenizers


def pad_vocab(n: int) -> int:
    return -(-n // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


class CharTokenizer:
    """Id 0 is BOS (separates files); characters take ids 1..n in code point order."""

    def __init__(self, chars: str):
        self.chars = chars
        self.bos_id = 0
        self.vocab_size = pad_vocab(len(chars) + 1)
        self.n_real = len(chars) + 1
        self._index = {c: i + 1 for i, c in enumerate(chars)}

    def encode(self, text: str) -> list[int]:
        unknown = sorted(set(text) - self._index.keys())
        if unknown:
            raise ValueError(f"characters not in the vocabulary: {''.join(unknown)!r}")
        return [self._index[c] for c in text]

    def decode(self, ids) -> str:
        return "".join(self.chars[i - 1] for i in ids if 1 <= i <= len(self.chars))


class TiktokenTokenizer:
    """A tiktoken encoding; its end-of-text token plays BOS."""

    def __init__(self, name: str):
        import tiktoken

        try:
            self.enc = tiktoken.get_encoding(name)
        except ValueError as e:
            raise DataError(f"--tokenizer {name!r}: not a tiktoken encoding ({e})") from e
        except Exception as e:  # the BPE files download on first use; offline machines fail here
            raise DataError(
                f"--tokenizer {name!r}: cannot load the encoding files ({type(e).__name__}); on an "
                "offline machine, copy them into $TIKTOKEN_CACHE_DIR first"
            ) from e
        self.name = name
        self.bos_id = self.enc.eot_token
        self.n_real = self.enc.n_vocab
        self.vocab_size = pad_vocab(self.enc.n_vocab)

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def decode(self, ids) -> str:
        return self.enc.decode([i for i in ids if i < self.n_real and i != self.bos_id])


def tokenizer_from_meta(meta: dict):
    if meta["tokenizer"] == "char":
        return CharTokenizer(meta["chars"])
    return TiktokenTokenizer(meta["encoding"])


# ---------------------------------------------------------------- validation


def list_sources(data_dir: Path) -> list[Path]:
    """A directory's data files (*.txt, and the record files *.jsonl, *.jsonl.gz, *.parquet: experiment/
    records.py) and those under its sub-directories (the top-level files first, then each sub-directory's,
    each by relative path: a source's files are contiguous), or a single data file. Hidden directories
    (.ipynb_checkpoints, .git) are skipped; symlinked ones are followed, once each."""
    data_dir = Path(data_dir)
    if data_dir.is_file():
        if not records.is_data_file(data_dir.name):
            raise DataError(f"{data_dir}: not a data file (*.txt, *.jsonl, *.jsonl.gz or *.parquet)")
        return [data_dir]
    if not data_dir.is_dir():
        raise DataError(f"{data_dir}: data directory does not exist")
    files, seen = [], set()
    for parent, dirs, names in os.walk(data_dir, followlinks=True):
        real = os.path.realpath(parent)
        if real in seen:  # a symlink loop, or a directory linked twice
            dirs.clear()
            continue
        seen.add(real)
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        files += [Path(parent) / n for n in names if records.is_data_file(n) and (Path(parent) / n).is_file()]
    # The top-level files first (they are one source), then each sub-directory's: a source's files
    # are contiguous in the stream.
    files.sort(key=lambda p: (p.parent != data_dir, p.relative_to(data_dir).parts))
    if not files:
        raise DataError(f"{data_dir}: no data files (expected UTF-8 *.txt, or *.jsonl, *.jsonl.gz, *.parquet)")
    return files


def source_names(data_dir: Path, files: list[Path]) -> list[str]:
    """Each file's source: the data files directly in data_dir are one, named by the directory (a
    flat directory of many record files is one corpus); a sub-directory is one, named by the
    sub-directory, whatever data files it holds; a single file is one, named by its stem."""
    data_dir = Path(data_dir)
    if data_dir.is_file():
        return [records.stem(data_dir.name)]
    top = Path(os.path.abspath(data_dir)).name or "data"  # a symlinked data/ is still "data"
    names = [top if p.parent == data_dir else p.relative_to(data_dir).parts[0] for p in files]
    sub_directories = {n for p, n in zip(files, names) if p.parent != data_dir}
    if top in sub_directories and any(p.parent == data_dir for p in files):
        raise DataError(f"{data_dir}: its top-level data files and its sub-directory {top}/ would both be the "
                        f"source {top!r}; move the files into a sub-directory, or rename {top}/")
    return names


def _relative_names(data_dir: Path, files: list[Path]) -> list[str]:
    """Names in the prepared hash: a top-level file's name (as before sub-directories were sources)."""
    data_dir = Path(data_dir)
    return [p.name if data_dir.is_file() else str(p.relative_to(data_dir)) for p in files]


class _FileScan:
    """A file's pass-1 results so far: characters, counts, and its first problem of each kind. A record
    file is scanned as its converted text (conv), and its problems are named by its own lines."""

    def __init__(self, path: Path, size: int, conv: records.Converted | None = None):
        self.path, self.size, self.conv, self.chunk_chars = path, size, conv, []
        self.ascii, self.codes, self.nul, self.outside = set(), chunks.NO_CODES, None, None
        self.sha = hashlib.sha256()

    def add(self, s: chunks.Scan) -> None:
        if s.utf8:  # the whole file's first problem: the same check on the whole file stops here too
            offset, reason = s.utf8
            line = chunks.line_col(self.path, offset)[0]
            raise DataError(f"{self.path}: invalid UTF-8 at byte offset {offset} (line {line}): {reason}")
        self.chunk_chars.append(s.chars)
        self.ascii.update(s.ascii)
        self.codes = np.union1d(self.codes, s.codes)  # a running union: bounded by the vocabulary
        self.nul = self.nul if self.nul is not None else s.nul
        self.outside = self.outside or s.outside

    def check(self) -> None:
        """Once every chunk is in: the problems in the order a whole-file check finds them."""
        if self.size == 0:
            raise DataError(f"{self.path}: no record holds text ({self.conv.empty} empty)" if self.conv
                            else f"{self.path}: file is empty")
        if self.nul is not None:
            line, col = chunks.line_col(self.path, self.nul)
            raise DataError(f"{self.path}:{line}:{col}: NUL byte (binary file?)")
        if self.outside:
            offset, ch = self.outside
            where = self.conv.where(offset) if self.conv else "{}:{}:{}".format(self.path, *chunks.line_col(self.path, offset))
            raise DataError(f"{where}: character {ch!r} (U+{ord(ch):04X}) is not in --alphabet")


# ---------------------------------------------------------------- prepare


@dataclass(frozen=True)
class Prepared:
    dir: Path
    meta: dict

    @classmethod
    def load(cls, directory: str | Path) -> Prepared:
        """A prepared directory as prepare() published it (meta.json beside the token files)."""
        directory = Path(directory)
        return cls(directory, json.loads((directory / "meta.json").read_text()))

    def tokens(self, split: str) -> np.memmap:
        return np.memmap(self.dir / f"{split}.bin", dtype=self.meta["dtype"], mode="r")

    def tokenizer(self):
        return tokenizer_from_meta(self.meta)


def _dtype_for(vocab_size: int) -> str:
    for dt in ("uint8", "uint16", "uint32"):
        if vocab_size - 1 <= np.iinfo(dt).max:
            return dt
    raise DataError(f"vocabulary of {vocab_size} does not fit uint32")


def check_seq_len(meta: dict, max_seq_len: int, where: str) -> None:
    """Each split must hold at least one full training sequence (max_seq_len + 1 tokens); with
    several sources, so must each source's val part (each source's loss is evaluated)."""
    need = max_seq_len + 1
    for split in ("train", "val"):
        have = meta["split"][f"{split}_tokens"]
        if have < need:
            raise DataError(
                f"{where}: the {split} split has {have:,} tokens, fewer than one sequence needs "
                f"(max_seq_len + 1 = {need:,}); add text, lower --max_seq_len or change --val_fraction"
            )
    for s in meta.get("source_splits") or []:
        have = s["val"][1] - s["val"][0]
        if have < need:
            raise DataError(
                f"{where}: source {s['name']} gives {have:,} tokens to val, fewer than one sequence needs "
                f"(max_seq_len + 1 = {need:,}); add text to it, lower --max_seq_len or raise --val_fraction"
            )


class _Progress:
    """A line every PROGRESS_SECONDS while a pass runs: MB done, MB/s, ETA of the pass."""

    def __init__(self, what: str, total: int, log):
        self.what, self.total, self.log, self.done = what, total, log, 0
        self.started = self.last = time.monotonic()

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= PROGRESS_SECONDS and self.done < self.total:
            self.last, rate = now, self.done / (now - self.started)
            self.log(f"prepare | {self.what} {self.done / 1e6:,.0f}/{self.total / 1e6:,.0f} MB | "
                     f"{rate / 1e6:.0f} MB/s | ETA {(self.total - self.done) / rate:.0f} s")


def _stat_key(settings: dict, relative: list[str], files: list[Path], stats: list[os.stat_result]) -> str:
    # ctime and inode too: a copy that keeps the mtime (cp -p, rsync -a) changes them.
    ids = [[str(p.resolve()), *_identity(s)] for p, s in zip(files, stats)]
    # The names relative to DATA_DIR too: they name the sources, so the same files under another
    # DATA_DIR are another corpus (/d/code/x.txt is source code of /d, source x of /d/code).
    return hashlib.sha256(json.dumps([STAT_KEY_VERSION, settings, relative, ids]).encode()).hexdigest()[:16]


def _stat_trusted(stats: list[os.stat_result], at_ns: int) -> bool:
    """Stats taken at at_ns identify the contents only if no file changed within STAT_TRUST_SECONDS
    before: a rewrite within the same timestamp tick would keep size and times (git's "racy" files)."""
    return all(max(s.st_mtime_ns, s.st_ctime_ns) < at_ns - STAT_TRUST_SECONDS * 1e9 for s in stats)


def _identity(s: os.stat_result) -> tuple:
    return s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino


def _check_unchanged(files: list[Path], stats: list[os.stat_result]) -> None:
    for p, s in zip(files, stats):
        if _identity(p.stat()) != _identity(s):
            raise DataError(f"{p}: changed while being prepared; prepare again once it is written")


@contextmanager
def _as_text(files: list[Path], stats, field: str, parent: Path | None, workers: int, log):
    """records.as_text, its errors as DataError (naming file:line)."""
    try:
        with records.as_text(files, [st.st_size for st in stats], field, parent, workers, log) as texts:
            yield texts
    except records.RecordError as e:
        raise DataError(str(e)) from None


def _scan(files: list[Path], texts: records.Texts, plans, alphabet: str | None, pool: chunks.Pool, log) -> list[_FileScan]:
    """Pass 1: every file validated (the first problem raises, naming the place), its characters
    collected and its sha256 taken, one chunk at a time; the workers scan while this process hashes."""
    scans = [_FileScan(p, n, conv) for p, n, conv in zip(files, texts.sizes, texts.convs)]
    progress = _Progress("validate", sum(texts.sizes), log)

    def tasks():
        for i, c in plans:
            scans[i].sha.update(chunks.read(c))  # hashlib drops the GIL; the page cache serves the worker
            yield c, alphabet, scans[i].conv is not None

    results = pool.ordered(chunks.scan, tasks())
    checked = 0
    try:
        for (i, c), result in zip(plans, results):
            for earlier in scans[checked:i]:  # files before this one are complete (in order, empty ones too)
                earlier.check()
            checked = i
            scans[i].add(result)
            progress.add(c.length)
    finally:
        results.close()
    for rest in scans[checked:]:
        rest.check()
    return scans


def file_parts(names: list[str], counts: list[int], val_fraction: float) -> list[dict]:
    """Per file (each source's files contiguous in the stream): where its tokens start in the stream, and
    the [start, stop) of its first part in train.bin and of its last part in val.bin (val_shares)."""
    parts, stream, train_at, val_at = [], 0, 0, 0
    for name, group in itertools.groupby(zip(names, counts), key=lambda nc: nc[0]):
        sizes = [n for _, n in group]
        for n, n_val in zip(sizes, val_shares(sizes, val_fraction)):
            parts.append({"name": name, "stream": stream, "train": [train_at, train_at + n - n_val],
                          "val": [val_at, val_at + n_val]})
            stream, train_at, val_at = stream + n, train_at + n - n_val, val_at + n_val
    if len({p["name"] for p in parts}) != len(list(itertools.groupby(p["name"] for p in parts))):
        raise AssertionError("a source's files must be contiguous (list_sources' order)")
    return parts


def val_shares(sizes: list[int], val_fraction: float) -> list[int]:
    """How many of each file's last tokens go to val: int(sum(sizes) x val_fraction) in all, drawn
    across the files by the running total, not from the last ones (records kept in time order, or one
    file per writer, are measured from the first to the last). A file whose share owed so far covers
    it goes whole (its BOS first, so val records never run into each other); one that owes at least
    MIN_VAL_PIECE tokens gives its tail; a smaller share waits for a later file. What is still owed
    at the end comes from the tails of the last files (the last file's first). One file is its own
    tail, as ever."""
    shares, held, total = [], 0, 0
    for n in sizes:
        total += n
        owed = int(total * val_fraction) - held
        share = n if owed >= n else owed if owed >= MIN_VAL_PIECE else 0
        shares.append(share)
        held += share
    short = int(total * val_fraction) - held
    for i in reversed(range(len(sizes))):
        if short <= 0:
            break
        more = min(short, sizes[i] - shares[i])
        shares[i], short = shares[i] + more, short - more
    return shares


def source_parts(files: list[dict]) -> list[dict]:
    """file_parts grouped by source: a source's files are contiguous in train.bin and in val.bin."""
    parts = []
    for name, group in itertools.groupby(files, key=lambda f: f["name"]):
        group = list(group)
        parts.append({"name": name, "train": [group[0]["train"][0], group[-1]["train"][1]],
                      "val": [group[0]["val"][0], group[-1]["val"][1]]})
    return parts


def _target(train: str, val: str, part: dict, at: int) -> chunks.Target:
    """Stream position `at` of file `part`: its train tokens first, then its val tokens."""
    local = at - part["stream"]
    return chunks.Target(train, val, part["train"][1], part["train"][0] + local, part["val"][0])


def _encode_chars(names: list[str], plans, chunk_chars, tok: CharTokenizer, dtype: str, val_fraction: float,
                  tmp: Path, pool: chunks.Pool, progress: _Progress) -> tuple[list[int], list[dict]]:
    """Pass 2, characters: every file's length and each chunk's place are known from pass 1, so each
    worker writes its chunk's ids straight into train.bin or val.bin; returns the tokens and the
    file_parts of every file."""
    codes = np.frombuffer(tok.chars.encode("utf-32-le"), dtype=np.uint32)
    cc = chunks.CharCodes(bytes(codes[codes < 0x80].astype(np.uint8)), codes[codes >= 0x80], dtype)
    counts = [0] * len(names)
    for (i, _), n in zip(plans, chunk_chars):
        counts[i] += n
    counts = [n + 1 for n in counts]  # BOS before every file: the model learns where documents start
    parts = file_parts(names, counts, val_fraction)
    itemsize = np.dtype(dtype).itemsize
    for split in ("train", "val"):
        with open(tmp / f"{split}.bin", "wb") as f:
            f.truncate(sum(p[split][1] - p[split][0] for p in parts) * itemsize)
    train, val = str(tmp / "train.bin"), str(tmp / "val.bin")
    targets, at = [], 0
    for (i, c), n in zip(plans, chunk_chars):
        part = parts[i]
        if c.offset == 0:
            chunks.write_at(np.array([tok.bos_id], dtype=dtype), _target(train, val, part, at))
            at += 1
        targets.append(_target(train, val, part, at))
        at += n
    tasks = ((c, cc, target) for (_, c), target in zip(plans, targets))
    for (_, c), n, written in zip(plans, chunk_chars, pool.ordered(chunks.encode_chars_into, tasks)):
        if written != n:
            raise DataError(f"{c.path}: changed while being prepared; prepare again once it is written")
        progress.add(c.length)
    return counts, parts


def _encode_stream(texts: records.Texts, plans, tok, dtype: str, out: Path, pool: chunks.Pool,
                   progress: _Progress) -> list[int]:
    """Pass 2, tiktoken: BOS then each file's tokens appended to `out` in order (how many, only the
    encoder knows); returns the tokens per file."""
    counts = [0] * len(texts.paths)
    bos = np.array([tok.bos_id], dtype=dtype)
    tasks = ((c, tok.name, dtype, texts.convs[i] is not None) for i, c in plans)
    with open(out, "wb") as f:
        for (i, c), ids in zip(plans, pool.ordered(chunks.encode_tiktoken, tasks)):
            if c.offset == 0:
                f.write(bos)
                counts[i] += 1
            f.write(ids)
            counts[i] += len(ids)
            progress.add(c.length)
    return counts


def _split_off_val(train: Path, val: Path, n_val: int, itemsize: int, step: int = 1 << 26) -> None:
    """Moves the last n_val tokens of `train` into `val` (validation = the tail of the stream)."""
    cut = train.stat().st_size - n_val * itemsize
    with open(train, "r+b") as src, open(val, "wb") as dst:
        for start in range(cut, cut + n_val * itemsize, step):
            dst.write(os.pread(src.fileno(), min(step, cut + n_val * itemsize - start), start))
        src.truncate(cut)


def _split_files(stream: Path, val: Path, parts: list[dict], itemsize: int, step: int = 1 << 26) -> None:
    """Several files: each one's train part stays in `stream` (compacted), its val part goes to `val`."""
    compact = stream.with_suffix(".compact")
    with open(stream, "rb") as src, open(compact, "wb") as train, open(val, "wb") as dst:
        for p in parts:
            n_train = p["train"][1] - p["train"][0]
            n_val = p["val"][1] - p["val"][0]
            for out, first, n in ((train, p["stream"], n_train), (dst, p["stream"] + n_train, n_val)):
                for start in range(first * itemsize, (first + n) * itemsize, step):
                    out.write(os.pread(src.fileno(), min(step, (first + n) * itemsize - start), start))
    os.replace(compact, stream)


def _decoded_chars(tok, val: Path, dtype: str, start: int, stop: int, step: int = 1 << 22) -> int:
    """len(tok.decode(val tokens [start, stop))), a piece at a time (an incremental decoder joins split
    characters)."""
    ids = (np.memmap(val, dtype=dtype, mode="r") if val.stat().st_size else np.zeros(0, dtype))[start:stop]
    decoder, n = codecs.getincrementaldecoder("utf-8")(errors="replace"), 0
    for at in range(0, len(ids), step):
        piece = ids[at : at + step]
        piece = piece[(piece < tok.n_real) & (piece != tok.bos_id)]
        n += len(decoder.decode(tok.enc.decode_bytes(piece.tolist())))
    return n + len(decoder.decode(b"", final=True))


def _fsync(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def prepare(
    data_dir: Path,
    workspace: Path,
    tokenizer: str = "char",
    alphabet: str | None = None,
    val_fraction: float = 0.05,
    max_seq_len: int = 256,
    *,
    chars: str | None = None,
    text_field: str = records.TEXT_FIELD,
    workers: int | None = None,
    log=None,
) -> Prepared:
    """Validates and tokenizes data_dir into <workspace>/prepared/<hash>/, or finds it there.
    chars: the char tokenizer's fixed vocabulary (INIT_FROM's model's: experiment/finetune.py), each
    character keeping its id; a character outside it is a DataError naming it (default: the data's).
    text_field: the JSON field or Parquet column holding a record file's documents.
    workers: processes for the chunks (default: one per core this process may use, at most
    MAX_WORKERS; 1 runs them in this process); log: where the progress lines go (default: stderr)."""
    if not 0 < val_fraction < 1:
        raise DataError(f"--val_fraction must be in (0, 1), got {val_fraction}")
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    files = list_sources(data_dir)
    names, relative = source_names(data_dir, files), _relative_names(data_dir, files)
    root = Path(workspace) / "prepared"
    settings = _settings(files, tokenizer, alphabet, val_fraction, text_field)
    if chars is not None and tokenizer == "char":
        settings["chars"] = chars
    if len(files) > 1:  # val across the files (file_parts): another layout than the one-file stream's tail
        settings["val"] = "per file"
        settings["sources"] = list(dict.fromkeys(names))  # the top-level source is named by its directory
    stats, stat_at = [p.stat() for p in files], time.time_ns()
    remembered = root / ".stat" / f"{_stat_key(settings, relative, files, stats)}.json"
    prepared = _remembered(root, remembered)  # unchanged files: a hit without reading them
    if prepared is None:
        prepared = _prepare_files(files, names, relative, stats, settings, max_seq_len, root, str(data_dir),
                                  workers, log)
        _check_unchanged(files, stats)
        if _stat_trusted(stats, stat_at):
            atomic_write_json(remembered, {"hash": prepared.dir.name})
    check_seq_len(prepared.meta, max_seq_len, str(data_dir))
    return prepared


def _settings(files: list[Path], tokenizer: str, alphabet: str | None, val_fraction: float, text_field: str) -> dict:
    """What the prepared hash covers besides the files: with a record file, the field read and the
    conversion's version too (a corpus of *.txt alone keeps the hash it had before record files)."""
    settings = {"tokenizer": tokenizer, "alphabet": alphabet, "val_fraction": val_fraction}
    if any(records.is_records(p) for p in files):
        settings["records"] = {"version": records.VERSION, "text_field": text_field}
    return settings


def default_workers() -> int:
    """One process per core this process may use, at most MAX_WORKERS."""
    return min(MAX_WORKERS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())


def validate(data_dir: Path, tokenizer: str = "char", alphabet: str | None = None, val_fraction: float = 0.05,
             max_seq_len: int = 256, *, text_field: str = records.TEXT_FIELD, workers: int | None = None,
             log=None) -> dict:
    """prepare's checks without its writes, for `plan` before renting: pass 1 over every file (UTF-8,
    empty files, NUL bytes, malformed records, ALPHABET) and each source's val share against max_seq_len
    (a record file's text goes to a temp directory for the pass, then is removed). DataError names
    the first problem. Returns {"tokens": the corpus's tokens, "sources": {name: tokens}, "exact": bool};
    with tiktoken the tokens are estimated as bytes / 4 (exact: False), since counting means encoding."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    files = list_sources(data_dir)
    names = source_names(data_dir, files)
    stats = [p.stat() for p in files]
    workers = workers or default_workers()
    with _as_text(files, stats, text_field, None, workers, log) as texts:  # record files: in a temp directory
        plans = texts.plans(CHUNK_BYTES)
        with chunks.Pool(min(workers, len(plans))) as pool:
            scans = _scan(files, texts, plans, alphabet, pool, log)
    # prepare's counts: a BOS before every file, then its characters (or, estimated, its tokens)
    counts = [1 + (sum(s.chunk_chars) if tokenizer == "char" else s.size // 4) for s in scans]
    parts = source_parts(file_parts(names, counts, val_fraction))
    split = {"train_tokens": sum(p["train"][1] - p["train"][0] for p in parts),
             "val_tokens": sum(p["val"][1] - p["val"][0] for p in parts)}
    check_seq_len({"split": split, "source_splits": parts}, max_seq_len, str(data_dir))
    by_source = {p["name"]: sum(c for n, c in zip(names, counts) if n == p["name"]) for p in parts}
    return {"tokens": sum(counts), "sources": by_source, "exact": tokenizer == "char"}


def _remembered(root: Path, memo: Path) -> Prepared | None:
    if memo.is_file():
        final = root / json.loads(memo.read_text())["hash"]
        if (final / "meta.json").is_file():
            return Prepared.load(final)
    return None


def _prepare_files(files, names, relative, stats, settings: dict, max_seq_len: int, root: Path, where: str,
                   workers: int | None, log) -> Prepared:
    """Pass 1 (validation, characters, content hash), then the content hash's directory if it exists,
    else pass 2 writing it."""
    workers = workers or default_workers()
    field = settings.get("records", {}).get("text_field")
    with _as_text(files, stats, field, root, workers, log) as texts:  # record files: converted under root
        plans = texts.plans(CHUNK_BYTES)
        with chunks.Pool(min(workers, len(plans))) as pool:
            scans = _scan(files, texts, plans, settings["alphabet"], pool, log)  # every error surfaces before any write
            digests = [s.sha.hexdigest() for s in scans]
            final = root / hashlib.sha256(json.dumps([settings, relative, digests]).encode()).hexdigest()[:16]
            if (final / "meta.json").exists():
                return Prepared.load(final)
            return _write(files, names, stats, texts, plans, scans, settings, max_seq_len, final, pool, where, log)


def _tokens(tmp: Path, tok, dtype: str, names: list[str], texts: records.Texts, plans, scans, val_fraction: float,
            pool: chunks.Pool, log) -> tuple[list[int], list[dict]]:
    """Pass 2: tmp/train.bin and tmp/val.bin, each file's tail in val (file_parts; one file: the tail
    of the stream); returns the tokens and the file_parts of every file."""
    progress = _Progress("encode", sum(texts.sizes), log)
    itemsize = np.dtype(dtype).itemsize
    if isinstance(tok, CharTokenizer):
        chunk_chars = [n for s in scans for n in s.chunk_chars]
        return _encode_chars(names, plans, chunk_chars, tok, dtype, val_fraction, tmp, pool, progress)
    counts = _encode_stream(texts, plans, tok, dtype, tmp / "train.bin", pool, progress)
    parts = file_parts(names, counts, val_fraction)
    if len(parts) == 1:
        _split_off_val(tmp / "train.bin", tmp / "val.bin", parts[0]["val"][1] - parts[0]["val"][0], itemsize)
    else:
        _split_files(tmp / "train.bin", tmp / "val.bin", parts, itemsize)
    return counts, parts


def _write(files, names, stats, texts: records.Texts, plans, scans, settings: dict, max_seq_len: int, final: Path,
           pool: chunks.Pool, where: str, log) -> Prepared:
    """Pass 2 into a temp directory next to `final`, renamed into place once complete."""
    tok = _tokenizer(settings, scans)
    dtype = _dtype_for(tok.vocab_size)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        try:
            counts, parts = _tokens(tmp, tok, dtype, names, texts, plans, scans, settings["val_fraction"], pool, log)
        except Exception:
            _check_unchanged(files, stats)  # a file rewritten since pass 1 breaks pass 2: say that, if so
            raise
        meta = _meta(final.name, settings, tok, dtype, source_parts(parts), tmp / "val.bin",
                     [{"path": str(p.resolve()), "source": name, "sha256": s.sha.hexdigest(), "bytes": st.st_size,
                       "tokens": count, "train": part["train"], "val": part["val"],
                       **({"records": s.conv.records, "empty_records": s.conv.empty} if s.conv else {})}
                      for p, name, s, st, count, part in zip(files, names, scans, stats, counts, parts)])
        check_seq_len(meta, max_seq_len, where)
        _check_unchanged(files, stats)
        for split in ("train", "val"):
            _fsync(tmp / f"{split}.bin")
        atomic_write_json(tmp / "meta.json", meta)
        publish_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Prepared(final, meta)


def _tokenizer(settings: dict, scans: list[_FileScan]):
    """char: the characters pass 1 found, in code point order, or the fixed vocabulary settings["chars"]
    (DataError naming each character outside it and the files that hold one); else the tiktoken encoding."""
    if settings["tokenizer"] != "char":
        return TiktokenTokenizer(settings["tokenizer"])
    found = [set(s.ascii) | set(s.codes.tolist()) for s in scans]
    if "chars" not in settings:
        return CharTokenizer("".join(map(chr, sorted(set().union(*found)))))
    vocab = set(map(ord, settings["chars"]))
    if outside := sorted(set().union(*found) - vocab):
        files = [str(s.path) for s, codes in zip(scans, found) if codes - vocab]
        shown = ", ".join(f"{chr(c)!r} (U+{c:04X})" for c in outside[:MAX_NAMED_CHARS])
        raise DataError(f"{len(outside)} character(s) of the data are not in INIT_FROM's vocabulary: {shown}"
                        + (" ..." if len(outside) > MAX_NAMED_CHARS else "") + f"; in {', '.join(files[:5])}"
                        + (f" and {len(files) - 5} more files" if len(files) > 5 else "")
                        + "; remove or replace them, or train a new model")
    return CharTokenizer(settings["chars"])


def _meta(key: str, settings: dict, tok, dtype: str, parts: list[dict], val: Path, sources: list[dict]) -> dict:
    char = settings["tokenizer"] == "char"
    for part in parts:  # bits per character need the characters behind each val token
        part["val_chars"] = (part["val"][1] - part["val"][0] if char
                             else _decoded_chars(tok, val, dtype, *part["val"]))
    n_train, n_val = (sum(p[split][1] - p[split][0] for p in parts) for split in ("train", "val"))
    return {
        "version": 1,
        "hash": key,
        "tokenizer": "char" if char else "tiktoken",
        "encoding": None if char else settings["tokenizer"],
        "chars": tok.chars if char else None,
        "bos_id": int(tok.bos_id),
        "vocab_size": tok.vocab_size,
        "vocab_used": tok.n_real,
        "dtype": dtype,
        "alphabet": settings["alphabet"],
        "sources": sources,  # per file
        "source_splits": parts,  # per source: its [start, stop) in train.bin and in val.bin
        "split": {"val_fraction": settings["val_fraction"], "train_tokens": n_train, "val_tokens": n_val,
                  "val_chars": sum(p["val_chars"] for p in parts)},
    }


# ---------------------------------------------------------------- demo corpus


def demo_lines(n_lines: int, seed: int = 1234):
    """Sums of 1- to 3-digit numbers, e.g. '407+38=445'. Correctness is checkable: a model that learned
    the task completes 'a+b=' with the right digits."""
    rng = random.Random(seed)
    for _ in range(n_lines):
        a, b = (rng.randrange(10 ** rng.randint(1, 3)) for _ in range(2))
        yield f"{a}+{b}={a + b}\n"


def write_demo_corpus(directory: Path, n_lines: int = 120_000) -> Path:
    path = Path(directory) / DEMO_FILE
    if not path.exists():
        atomic_write_bytes(path, "".join(demo_lines(n_lines)).encode())
    return path


# ---------------------------------------------------------------- CLI


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiment.dataloader", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="validate and tokenize data files into the prepared cache")
    p.add_argument("--data_dir", required=True, help="directory of UTF-8 *.txt, *.jsonl, *.jsonl.gz or *.parquet "
                   "files (sub-directories too), or one such file")
    p.add_argument("--text_field", default=records.TEXT_FIELD, help="the JSONL field or Parquet column that holds "
                   "a document")
    p.add_argument("--workspace", default=None, help="root of prepared/ (default: as WORKSPACE in run.sh)")
    p.add_argument("--alphabet", default=None, help="allowed characters; any other one is an error")
    p.add_argument("--tokenizer", default="char", help="char, or a tiktoken encoding name")
    p.add_argument("--val_fraction", type=float, default=0.05, help="fraction of each source's tokens held out for "
                   "validation, drawn across its files (docs/data.md)")
    p.add_argument("--max_seq_len", type=int, default=256, help="each split must hold one sequence of this")
    args = parser.parse_args(argv)
    workspace = Path(args.workspace) if args.workspace else default_workspace()
    started = time.perf_counter()
    try:
        prepared = prepare(Path(args.data_dir), workspace, args.tokenizer, args.alphabet,
                           args.val_fraction, args.max_seq_len, text_field=args.text_field)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seconds, m = time.perf_counter() - started, prepared.meta
    size = sum(s["bytes"] for s in m["sources"])
    print(f"prepared {prepared.dir}: {m['split']['train_tokens']:,} train + {m['split']['val_tokens']:,} val "
          f"tokens, vocab {m['vocab_size']} ({m['tokenizer']}), {len(m['sources'])} file(s), {size / 1e6:,.1f} MB "
          f"in {seconds:.2f} s ({size / 1e6 / seconds:,.0f} MB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
