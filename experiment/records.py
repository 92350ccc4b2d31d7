"""Record files (JSON Lines, gzipped JSON Lines, Parquet) as prepare reads them: one document per record.

    *.jsonl, *.jsonl.gz   one JSON object per line; its TEXT_FIELD (default "text") is the document
    *.parquet             its TEXT_FIELD column is the documents, one per row

prepare turns each record file into a plain UTF-8 file of its records' texts with a NUL between two
records, and reads that as it reads a *.txt file: NUL is the one character a text file may not hold,
so it is free to mark the record boundaries, and the encoders write it as BOS. A document is then one
BOS-separated record, as a *.txt file is one. Records whose text is empty (or null) are skipped and
counted; a line that is not a JSON object with that field as a string is a DataError naming file:line.

Memory is bounded by one record (JSONL) or one batch of rows (Parquet), never by the file: the text
is streamed to disk. pyarrow reads Parquet (columnar, compressed pages: not something to write by
hand); it is imported only when a Parquet file is read, so text and JSONL corpora never need it.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile
import time
import zlib
from array import array
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from experiment import chunks

SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
TEXT_SUFFIX = ".txt"
SEPARATOR = b"\x00"
# Settings that change what a record file becomes; in the prepared hash whenever a record file is read.
VERSION = 1
TEXT_FIELD = "text"  # the default field (JSONL) or column (Parquet) holding a document
PARQUET_BATCH_ROWS = 1024  # rows of the text column in memory at once
WRITE_BUFFER = 1 << 22
PYARROW_PIN = "pyarrow==26.0.1"  # as requirements.txt pins it


class RecordError(Exception):
    """A malformed record; the message names file:line (or file row N for Parquet)."""


def is_records(path: Path | str) -> bool:
    return str(path).endswith(SUFFIXES)


def is_data_file(name: str) -> bool:
    """A file prepare reads: *.txt or a record file."""
    return name.endswith(TEXT_SUFFIX) or is_records(name)


def stem(name: str) -> str:
    """A data file's name less its data suffix: data.jsonl.gz is "data", my.notes.txt "my.notes"."""
    for suffix in (*SUFFIXES, TEXT_SUFFIX):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


@dataclass
class Converted:
    """A record file as text: `path` holds the kept records' texts, NUL between two; `lines` the source
    line (JSONL) or 1-based row (Parquet) of each kept record, in order."""
    source: Path
    path: Path
    records: int  # kept: non-empty texts
    empty: int  # skipped: empty or null texts
    lines: array

    def where(self, offset: int, step: int = 1 << 24) -> str:
        """`source:line` of the record holding byte `offset` of `path` (an error message's place). Reads
        up to there a piece at a time: only an error message needs it."""
        before = 0
        with open(self.path, "rb") as f:
            for start in range(0, offset, step):
                before += os.pread(f.fileno(), min(step, offset - start), start).count(SEPARATOR)
        unit = "row " if str(self.source).endswith(".parquet") else ""
        return f"{self.source}:{unit}{self.lines[min(before, len(self.lines) - 1)]}"


def convert(source: Path, field: str, out: Path) -> Converted:
    """source's records (non-empty texts) written to `out`, NUL between two."""
    kept, empty, lines = 0, 0, array("I")  # 4 bytes a record: 40 MB for 10 million of them
    with open(out, "wb", buffering=WRITE_BUFFER) as f:
        for line, text in _texts(source, field):
            if not text:
                empty += 1
                continue
            if "\x00" in text:
                raise RecordError(f"{source}:{line}: the {field!r} text holds a NUL character (binary data?)")
            try:
                data = text.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate from a \ud800 escape: not a character
                raise RecordError(f"{source}:{line}: the {field!r} text is not valid Unicode ({e.reason} at "
                                  f"character {e.start + 1})") from None
            if kept:
                f.write(SEPARATOR)
            f.write(data)
            kept += 1
            lines.append(line)
    return Converted(Path(source), Path(out), kept, empty, lines)


def convert_task(task: tuple[Path, str, Path]) -> Converted:
    """convert, as a worker of chunks.Pool runs it."""
    return convert(*task)


def _texts(source: Path, field: str):
    """(line or row, text or None) for each record of source, in order."""
    name = str(source)
    if name.endswith(".parquet"):
        yield from _parquet_texts(source, field)
    else:
        opener = gzip.open if name.endswith(".gz") else open
        with opener(source, "rb") as f:
            yield from _jsonl_texts(source, f, field)


def _jsonl_texts(source: Path, f, field: str):
    try:
        for number, raw in enumerate(f, 1):
            if not raw.strip():  # a blank line (a trailing one, say) holds no record
                continue
            yield number, _text_of(source, number, raw, field)
    except (OSError, EOFError, zlib.error) as e:  # a truncated or corrupt .gz (BadGzipFile is an OSError)
        raise RecordError(f"{source}: cannot be read as gzip ({e})") from None


def _text_of(source: Path, number: int, raw: bytes, field: str) -> str | None:
    try:
        record = json.loads(raw)
    except UnicodeDecodeError as e:
        raise RecordError(f"{source}:{number}: invalid UTF-8 ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise RecordError(f"{source}:{number}: not JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(record, dict):
        raise RecordError(f"{source}:{number}: a JSON {type(record).__name__}, not an object with a {field!r} field")
    if field not in record:
        shown = ", ".join(map(repr, list(record)[:5])) or "none"
        raise RecordError(f"{source}:{number}: no {field!r} field (its fields: {shown}); set TEXT_FIELD to the one "
                          "that holds the text")
    text = record[field]
    if text is not None and not isinstance(text, str):
        raise RecordError(f"{source}:{number}: the {field!r} field is a JSON {type(text).__name__}, not a string")
    return text


def _parquet_texts(source: Path, field: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise RecordError(f"{source}: reading Parquet needs pyarrow, which this Python lacks: "
                          f"pip install {PYARROW_PIN} (requirements.txt pins it), or convert the file to JSONL") from None
    try:
        # A buffered stream, page by page: by default pyarrow reads ahead whole row groups (and keeps its
        # pool), which took 800 MB for a 483 MB file; so, one batch and a page at a time.
        reader = pq.ParquetFile(source, memory_map=False, buffer_size=1 << 20, pre_buffer=False)
    except Exception as e:  # pyarrow's own errors (ArrowInvalid, ...): not a Parquet file
        raise RecordError(f"{source}: not a readable Parquet file ({e})") from None
    if field not in reader.schema_arrow.names:
        shown = ", ".join(map(repr, reader.schema_arrow.names[:5])) or "none"
        raise RecordError(f"{source}: no {field!r} column (its columns: {shown}); set TEXT_FIELD to the one that "
                          "holds the text")
    kind = reader.schema_arrow.field(field).type
    if not (str(kind) in ("string", "large_string", "string_view")):
        raise RecordError(f"{source}: the {field!r} column holds {kind}, not strings")
    row = 0
    for batch in reader.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[field]):
        for text in batch.column(0).to_pylist():
            row += 1
            yield row, text



@dataclass
class Texts:
    """What prepare's two passes read for each file: the file itself, or a record file's text."""
    paths: list[Path]
    sizes: list[int]
    convs: list[Converted | None]

    def plans(self, chunk_bytes: int) -> list[tuple[int, chunks.Chunk]]:
        return [(i, c) for i, p in enumerate(self.paths) for c in chunks.plan(p, self.sizes[i], chunk_bytes)]


@contextmanager
def as_text(files: list[Path], sizes: list[int], field: str, parent: Path | None, workers: int, log):
    """Texts of the files: each record file converted (on the workers) into a temp directory under
    `parent` (None: the system's), removed on exit; nothing converted when there is none."""
    todo = [i for i, p in enumerate(files) if is_records(p)]
    texts = Texts(list(files), list(sizes), [None] * len(files))
    if not todo:
        yield texts
        return
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".records.", dir=parent))
    try:
        started = time.monotonic()
        tasks = ((files[i], field, tmp / f"{i}.txt") for i in todo)
        with chunks.Pool(min(workers, len(todo))) as pool:
            for i, conv in zip(todo, pool.ordered(convert_task, tasks)):
                texts.paths[i], texts.sizes[i], texts.convs[i] = conv.path, conv.path.stat().st_size, conv
        kept, empty = (sum(getattr(texts.convs[i], k) for i in todo) for k in ("records", "empty"))
        log(f"prepare | {len(todo):,} record file(s): {kept:,} records with text, {empty:,} empty skipped | "
            f"{time.monotonic() - started:.1f} s")
        yield texts
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
