"""Text files -> validated, tokenized memmap (train.bin, val.bin, meta.json); resumable batches.

    python -m experiment.dataloader prepare --data_dir D [--workspace W] [--alphabet S]
        [--tokenizer char|<tiktoken encoding>] [--val_fraction F] [--max_seq_len T]

Every input problem is found before anything is written: the prepared directory is built under a
temp name and renamed into place only when complete, and it is keyed by a hash of the sources and
the tokenizer settings, so a second prepare of the same data is a cache hit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from experiment.files import atomic_write_bytes, atomic_write_json, default_workspace, publish_dir

VOCAB_MULTIPLE = 64  # padded vocab: matmul-friendly head shape, room for BOS
DEMO_FILE = "arithmetic.txt"


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
        self._codes = np.frombuffer(chars.encode("utf-32-le"), dtype=np.uint32)
        self._index = {c: i + 1 for i, c in enumerate(chars)}

    def encode(self, text: str) -> list[int]:
        unknown = sorted(set(text) - self._index.keys())
        if unknown:
            raise ValueError(f"characters not in the vocabulary: {''.join(unknown)!r}")
        return [self._index[c] for c in text]

    def encode_array(self, codes: np.ndarray) -> np.ndarray:
        # codes: uint32 code points, all known (checked by the caller); vectorized for GB corpora.
        return np.searchsorted(self._codes, codes).astype(np.int64) + 1

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
    """A directory's *.txt files (sorted, not recursive), or a single .txt file."""
    data_dir = Path(data_dir)
    if data_dir.is_file():
        if data_dir.suffix != ".txt":
            raise DataError(f"{data_dir}: not a .txt file")
        return [data_dir]
    if not data_dir.is_dir():
        raise DataError(f"{data_dir}: data directory does not exist")
    files = sorted(p for p in data_dir.glob("*.txt") if p.is_file())
    if not files:
        raise DataError(f"{data_dir}: no *.txt files (expected UTF-8 text files)")
    return files


def _line_col(text: str, index: int) -> tuple[int, int]:
    line = text.count("\n", 0, index) + 1
    return line, index - (text.rfind("\n", 0, index) + 1) + 1


def read_text(path: Path, alphabet: str | None) -> str:
    """Reads one source; raises DataError naming file, line:column (or byte offset) and character."""
    raw = path.read_bytes()
    if not raw:
        raise DataError(f"{path}: file is empty")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}: invalid UTF-8 at byte offset {e.start} (line {line}): {e.reason}") from None
    nul = text.find("\x00")
    if nul >= 0:
        line, col = _line_col(text, nul)
        raise DataError(f"{path}:{line}:{col}: NUL byte (binary file?)")
    if alphabet is not None and set(text) - set(alphabet):  # the slow scan only when one exists
        allowed = set(alphabet)
        for i, ch in enumerate(text):
            if ch not in allowed:
                line, col = _line_col(text, i)
                raise DataError(f"{path}:{line}:{col}: character {ch!r} (U+{ord(ch):04X}) is not in --alphabet")
    return text


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
    """Each split must hold at least one full training sequence (max_seq_len + 1 tokens)."""
    need = max_seq_len + 1
    for split in ("train", "val"):
        have = meta["split"][f"{split}_tokens"]
        if have < need:
            raise DataError(
                f"{where}: the {split} split has {have:,} tokens, fewer than one sequence needs "
                f"(max_seq_len + 1 = {need:,}); add text, lower --max_seq_len or change --val_fraction"
            )


def prepare(
    data_dir: Path,
    workspace: Path,
    tokenizer: str = "char",
    alphabet: str | None = None,
    val_fraction: float = 0.05,
    max_seq_len: int = 256,
) -> Prepared:
    if not 0 < val_fraction < 1:
        raise DataError(f"--val_fraction must be in (0, 1), got {val_fraction}")
    files = list_sources(data_dir)
    texts = [read_text(p, alphabet) for p in files]  # every error surfaces before any write
    digests = [hashlib.sha256(t.encode("utf-8")).hexdigest() for t in texts]
    settings = {"tokenizer": tokenizer, "alphabet": alphabet, "val_fraction": val_fraction}
    key = hashlib.sha256(json.dumps([settings, [p.name for p in files], digests]).encode()).hexdigest()[:16]
    final = Path(workspace) / "prepared" / key
    if (final / "meta.json").exists():
        prepared = Prepared.load(final)
        check_seq_len(prepared.meta, max_seq_len, str(data_dir))
        return prepared

    if tokenizer == "char":
        codes = [np.frombuffer(t.encode("utf-32-le"), dtype=np.uint32) for t in texts]
        chars = np.unique(np.concatenate([np.unique(c) for c in codes]))
        tok = CharTokenizer(chars.astype("<u4").tobytes().decode("utf-32-le"))
        streams = [tok.encode_array(c) for c in codes]
    else:
        tok = TiktokenTokenizer(tokenizer)
        streams = [np.asarray(tok.encode(t), dtype=np.int64) for t in texts]
    # BOS before every file: the model learns where documents start and never mixes two mid-line.
    ids = np.concatenate([np.concatenate([[tok.bos_id], s]) for s in streams])
    n_val = int(len(ids) * val_fraction)
    dtype = _dtype_for(tok.vocab_size)
    val_chars = None
    meta = {
        "version": 1,
        "hash": key,
        "tokenizer": "char" if tokenizer == "char" else "tiktoken",
        "encoding": None if tokenizer == "char" else tokenizer,
        "chars": tok.chars if tokenizer == "char" else None,
        "bos_id": int(tok.bos_id),
        "vocab_size": tok.vocab_size,
        "vocab_used": tok.n_real,
        "dtype": dtype,
        "alphabet": alphabet,
        "sources": [
            {"path": str(p.resolve()), "sha256": d, "bytes": p.stat().st_size, "tokens": len(s) + 1}
            for p, d, s in zip(files, digests, streams)
        ],
        "split": {"val_fraction": val_fraction, "train_tokens": len(ids) - n_val, "val_tokens": n_val},
    }
    if tokenizer != "char":  # bits per character need the characters behind the val tokens
        val_chars = len(tok.decode(ids[len(ids) - n_val :].tolist()))
    meta["split"]["val_chars"] = val_chars if val_chars is not None else n_val
    check_seq_len(meta, max_seq_len, str(data_dir))

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=final.parent))
    try:
        ids[: len(ids) - n_val].astype(dtype).tofile(tmp / "train.bin")
        ids[len(ids) - n_val :].astype(dtype).tofile(tmp / "val.bin")
        atomic_write_json(tmp / "meta.json", meta)
        publish_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Prepared(final, meta)


# ---------------------------------------------------------------- batches


class TokenBatches:
    """Resumable (x, y) micro-batches, disjoint across ranks by construction.

    The token stream is cut into non-overlapping windows of seq_len + 1 tokens (stride seq_len, an
    offset drawn per epoch), visited in a per-epoch permutation that every rank computes from the
    same seed. A global cursor counts windows consumed by all ranks: each micro-step takes the next
    world_size * batch_size windows and rank r reads block r of them. So no window is seen twice in
    an epoch, the ranks never overlap, and the state (epoch, cursor) is the same on every rank.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, state: dict | None = None):
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.epoch, self.cursor = (state["epoch"], state["cursor"]) if state else (0, 0)
        self._layout()
        if self.n_windows < world_size * batch_size:
            raise DataError(
                f"training split holds {self.n_windows} sequences of {seq_len + 1} tokens, fewer than one "
                f"micro-step needs (world_size {world_size} x device_batch_size {batch_size})"
            )

    def _layout(self) -> None:
        rng = np.random.default_rng([self.seed, self.epoch])
        self.offset = int(rng.integers(self.seq_len)) if self.epoch > 0 else 0
        self.n_windows = (len(self.tokens) - self.offset - 1) // self.seq_len
        self.order = rng.permutation(self.n_windows)

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        step = self.world_size * self.batch_size
        if self.cursor + step > self.n_windows:  # drop the ragged tail, reshuffle
            self.epoch, self.cursor = self.epoch + 1, 0
            self._layout()
        first = self.cursor + self.rank * self.batch_size
        starts = self.offset + self.order[first : first + self.batch_size] * self.seq_len
        self.cursor += step
        batch = np.stack([self.tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)
        batch = torch.from_numpy(batch)  # (B, T + 1)
        return batch[:, :-1], batch[:, 1:]


def val_batches(tokens: np.ndarray, seq_len: int, batch_size: int, max_tokens: int,
                rank: int = 0, world_size: int = 1):
    """The fixed val slice (first max_tokens of val, whole windows); window i goes to rank i % world."""
    n = min((len(tokens) - 1) // seq_len, max(1, max_tokens // seq_len))
    mine = list(range(rank, n, world_size))
    for i in range(0, len(mine), batch_size):
        rows = [tokens[w * seq_len : w * seq_len + seq_len + 1] for w in mine[i : i + batch_size]]
        batch = torch.from_numpy(np.stack(rows).astype(np.int64))
        yield batch[:, :-1], batch[:, 1:]


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
    p = sub.add_parser("prepare", help="validate and tokenize *.txt files into the prepared cache")
    p.add_argument("--data_dir", required=True, help="directory of UTF-8 *.txt files, or one .txt file")
    p.add_argument("--workspace", default=None, help="root of prepared/ (default: as WORKSPACE in run.sh)")
    p.add_argument("--alphabet", default=None, help="allowed characters; any other one is an error")
    p.add_argument("--tokenizer", default="char", help="char, or a tiktoken encoding name")
    p.add_argument("--val_fraction", type=float, default=0.05, help="last fraction of tokens for validation")
    p.add_argument("--max_seq_len", type=int, default=256, help="each split must hold one sequence of this")
    args = parser.parse_args(argv)
    workspace = Path(args.workspace) if args.workspace else default_workspace()
    try:
        prepared = prepare(Path(args.data_dir), workspace, args.tokenizer, args.alphabet,
                           args.val_fraction, args.max_seq_len)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    m = prepared.meta
    print(f"prepared {prepared.dir}: {m['split']['train_tokens']:,} train + {m['split']['val_tokens']:,} val "
          f"tokens, vocab {m['vocab_size']} ({m['tokenizer']}), {len(m['sources'])} file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
