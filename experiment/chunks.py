"""Text files in chunks, for prepare: where a file is cut, what a worker does with one chunk (validate
it and collect its characters; encode it), and an ordered pool that keeps few chunks in flight.

Memory is bounded by the chunk size, never by the corpus: a worker holds one chunk (its bytes, the
decoded text, the ids), and at most 2 x workers chunks are in flight. Workers are forked, so they
inherit what the parent imported (torch included) instead of importing it again, and run numpy and
tiktoken only. Nothing here knows the tokenizer classes or DataError: results are plain data.
"""

from __future__ import annotations

import multiprocessing
import os
import re
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

CUT_WINDOW = 1 << 16  # a cut is looked for in the last 64 KiB before a chunk's nominal end
CONTINUATION = bytes(range(0x80, 0xC0))  # UTF-8 continuation bytes: deleting them leaves one byte per character
NON_ASCII = bytes(range(0x80, 0x100))
NO_CODES = np.zeros(0, dtype=np.uint32)
# A newline between two ASCII letters: the pre-tokenizer regexes of tiktoken's encodings (gpt2, cl100k,
# o200k) never make a piece that crosses it, so encoding the chunks one by one gives the tokens of the
# whole file. It is also a clean cut for UTF-8 (after an ASCII byte) and for line numbers.
_CLEAN_CUT = re.compile(rb"[A-Za-z]\n(?=[A-Za-z])")


@dataclass(frozen=True)
class Chunk:
    path: str
    offset: int  # in bytes, from the start of the file
    length: int
    last: bool  # the file's last chunk


def read(chunk: Chunk) -> bytes:
    with open(chunk.path, "rb") as f:
        return os.pread(f.fileno(), chunk.length, chunk.offset)


def plan(path: Path, size: int, chunk_bytes: int) -> list[Chunk]:
    """path cut into chunks of about chunk_bytes, each ending where _cut says."""
    chunks, start = [], 0
    # 4 bytes of valid UTF-8 always hold a character's first byte, so a cut never splits one
    window = max(4, min(CUT_WINDOW, chunk_bytes // 2))
    chunk_bytes = max(chunk_bytes, 2 * window)
    with open(path, "rb") as f:
        while size - start > chunk_bytes:
            end = start + chunk_bytes - window
            end += _cut(os.pread(f.fileno(), window, end))
            chunks.append(Chunk(str(path), start, end - start, False))
            start = end
    if size > start:
        chunks.append(Chunk(str(path), start, size - start, True))
    return chunks


def _cut(tail: bytes) -> int:
    """Where a chunk ends within `tail`, its last bytes (an index), best first: after the last NUL
    (a record boundary in a record file's text: records.py); after a newline between letters (see
    _CLEAN_CUT); after the last newline; after the last ASCII byte (no UTF-8
    character is split, and a truncated one before it is reported as in the whole file); before the
    last UTF-8 lead byte (scan() reports a truncated character as the whole file would); the end."""
    record = tail.rfind(b"\x00")  # a text file holds none (pass 1 refuses it)
    if record >= 0:
        return record + 1
    clean = None
    for clean in _CLEAN_CUT.finditer(tail):
        pass
    if clean is not None:
        return clean.start() + 2
    newline = tail.rfind(b"\n")
    if newline >= 0:
        return newline + 1
    b = np.frombuffer(tail, dtype=np.uint8)
    ascii_at = np.flatnonzero(b < 0x80)
    if len(ascii_at):
        return int(ascii_at[-1]) + 1
    lead_at = np.flatnonzero(b >= 0xC0)
    if len(lead_at):
        return int(lead_at[-1])
    return len(tail)  # 4 or more continuation bytes in a row: invalid, and scan() finds it before here


def multibyte(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Of valid UTF-8 bytes b (uint8): the multi-byte characters' lead positions, code points, lengths."""
    lead = np.flatnonzero(b >= 0xC0)
    b0 = b[lead].astype(np.uint32)
    n = 2 + (b0 >= 0xE0).astype(np.int64) + (b0 >= 0xF0)  # sequence length from the lead byte
    code = b0 & np.where(n == 2, 0x1F, np.where(n == 3, 0x0F, 0x07)).astype(np.uint32)
    for k in (1, 2, 3):
        more = n > k
        code[more] = (code[more] << 6) | (b[lead[more] + k] & 0x3F)
    return lead, code, n


def _distinct_ascii(raw: bytes) -> bytes:
    # bytes.translate deletes known bytes at memory speed; the few survivors teach the next round.
    seen = {c for c in raw[:4096] if c < 0x80}
    rest = raw
    while True:
        rest = rest.translate(None, NON_ASCII + bytes(seen))
        if not rest:
            return bytes(sorted(seen))
        seen.update(rest[:4096])


# ---------------------------------------------------------------- pass 1: validate, collect characters


@dataclass(frozen=True)
class Scan:
    """One chunk's characters and its first problem of each kind (offsets in bytes from the file start)."""
    chars: int = 0  # characters in the chunk
    ascii: bytes = b""  # its distinct ASCII characters, sorted
    codes: np.ndarray = field(default_factory=lambda: NO_CODES)  # its distinct code points >= 0x80, sorted
    utf8: tuple[int, str] | None = None  # first invalid UTF-8: offset, reason
    nul: int | None = None  # first NUL: offset
    outside: tuple[int, str] | None = None  # first character not in the alphabet: offset, character


def scan(task: tuple[Chunk, str | None, bool]) -> Scan:
    """records: the chunk is of a record file's text (experiment/records.py), where NUL separates
    records: no error, and no character of the vocabulary (the encoders write it as BOS)."""
    chunk, alphabet, records = task
    raw = read(chunk)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        reason = e.reason
        if reason == "unexpected end of data" and not chunk.last:
            reason = "invalid continuation byte"  # cut before a lead byte (see _cut): what the whole file says
        return Scan(utf8=(chunk.offset + e.start, reason))
    nul = -1 if records else raw.find(b"\x00")
    ascii_chars = _distinct_ascii(raw).replace(b"\x00", b"") if records else _distinct_ascii(raw)
    codes = NO_CODES if raw.isascii() else np.unique(multibyte(np.frombuffer(raw, dtype=np.uint8))[1])
    outside = None
    if alphabet is not None:
        bad = (set(ascii_chars.decode()) | set(map(chr, codes.tolist()))) - set(alphabet)
        if bad:
            i = min(text.find(c) for c in bad)
            outside = (chunk.offset + len(text[:i].encode()), text[i])
    return Scan(len(text), ascii_chars, codes, None, chunk.offset + nul if nul >= 0 else None, outside)


def line_col(path: Path, offset: int, step: int = 1 << 24) -> tuple[int, int]:
    """1-based line and column (in characters) of byte `offset`; the bytes before it are valid UTF-8.
    Reads the file up to there a piece at a time: only an error message needs it."""
    line, line_start = 1, 0
    with open(path, "rb") as f:
        for start in range(0, offset, step):
            piece = os.pread(f.fileno(), min(step, offset - start), start)
            line += piece.count(b"\n")
            last = piece.rfind(b"\n")
            if last >= 0:
                line_start = start + last + 1
        col = 1
        for start in range(line_start, offset, step):
            piece = os.pread(f.fileno(), min(step, offset - start), start)
            col += len(piece.translate(None, CONTINUATION))
    return line, col


# ---------------------------------------------------------------- pass 2: encode


@dataclass(frozen=True)
class CharCodes:
    """A character vocabulary as the encoder needs it (ids 1..n in code point order, 0 is BOS)."""
    ascii: bytes  # the vocabulary's ASCII characters, sorted: ids 1..len(ascii)
    codes: np.ndarray  # its code points >= 0x80, sorted: the ids after those
    dtype: str


@dataclass(frozen=True)
class Target:
    """Where ids go: position `at` of a token stream whose first n_train tokens go to train.bin at
    their position, the rest to val.bin from val_at on (a source's val part, after earlier sources')."""
    train: str
    val: str
    n_train: int
    at: int
    val_at: int


def write_at(ids: np.ndarray, target: Target) -> None:
    k = max(0, min(len(ids), target.n_train - target.at))  # how many of ids fall in train
    val_at = target.at + k - target.n_train + target.val_at
    for path, part, at in ((target.train, ids[:k], target.at), (target.val, ids[k:], val_at)):
        if len(part):
            with open(path, "r+b") as f:
                view, offset = memoryview(part).cast("B"), at * ids.itemsize
                while view:  # pwrite may write less than asked
                    n = os.pwrite(f.fileno(), view, offset)
                    view, offset = view[n:], offset + n


def encode_chars_into(task: tuple[Chunk, CharCodes, Target]) -> int:
    """encode_chars, written where the target says; returns how many ids."""
    chunk, cc, target = task
    ids = encode_chars(chunk, cc)
    write_at(ids, target)
    return len(ids)


def encode_chars(chunk: Chunk, cc: CharCodes) -> np.ndarray:
    """Ids of a chunk's characters (all in the vocabulary: pass 1 built it from the data). NUL, never in
    the vocabulary, gets id 0: BOS, between a record file's records."""
    raw = read(chunk)
    table = np.zeros(256, dtype=cc.dtype)  # ASCII byte -> id; lead bytes -> 0, replaced below
    table[np.frombuffer(cc.ascii, dtype=np.uint8)] = np.arange(1, len(cc.ascii) + 1)
    if cc.dtype == "uint8":  # one C pass maps the bytes and drops continuation bytes
        ids = np.frombuffer(raw.translate(table.tobytes(), CONTINUATION), dtype=np.uint8)
    else:
        ids = table[np.frombuffer(raw.translate(None, CONTINUATION), dtype=np.uint8)]
    if not raw.isascii():
        lead, code, n = multibyte(np.frombuffer(raw, dtype=np.uint8))
        ids = ids.copy() if not ids.flags.writeable else ids
        skipped = np.cumsum(n - 1) - (n - 1)  # continuation bytes before each lead byte
        ids[lead - skipped] = len(cc.ascii) + 1 + np.searchsorted(cc.codes, code)
    return ids


def encode_tiktoken(task: tuple[Chunk, str, str, bool]) -> np.ndarray:
    """records: NUL separates records (see scan) and becomes the end-of-text token, BOS."""
    chunk, encoding, dtype, records = task
    import tiktoken

    enc = tiktoken.get_encoding(encoding)  # cached per process (each worker loads it once, from tiktoken's disk cache)
    # disallowed_special=() with no special allowed: special-token text is plain text, as encode_ordinary
    pieces = read(chunk).decode("utf-8").split("\x00") if records else [read(chunk).decode("utf-8")]
    ids = [enc.encode_to_numpy(pieces[0], disallowed_special=()).astype(dtype)]
    for piece in pieces[1:]:
        ids += [np.array([enc.eot_token], dtype=dtype), enc.encode_to_numpy(piece, disallowed_special=()).astype(dtype)]
    return np.concatenate(ids)


# ---------------------------------------------------------------- the pool


class Pool:
    """Runs fn over tasks in task order: on `workers` forked processes (one pool serves both passes,
    so their heaps are warm for the second), or inline for one worker."""

    def __init__(self, workers: int):
        self.workers = workers
        self.executor = (ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
                         if workers > 1 else None)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        if self.executor:
            self.executor.shutdown(wait=True, cancel_futures=True)

    def ordered(self, fn, tasks):
        """fn(task) for each task, yielded in order, with at most 2 x workers tasks in flight (so at
        most that many results wait in memory). Closing the generator early cancels the rest."""
        if self.executor is None:
            yield from map(fn, tasks)
            return
        pending = deque()
        try:
            for task in tasks:
                pending.append(self.executor.submit(fn, task))
                if len(pending) >= 2 * self.workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()
