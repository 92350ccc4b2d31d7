"""`bench corpus`: a second benchmark corpus of another kind than Tiny Shakespeare: Python source.

    python -m experiment.tools.bench corpus --out code.txt [--mb 1.2]

Every machine that runs the trainer has one: the standard library of the Python that runs this
command. The files are taken in sorted path order (test suites and non-ASCII files left out, so the
alphabet stays printable ASCII plus newline), each preceded by a `# file: <relative path>` line, until
--mb megabytes are written. The same Python version gives the same bytes; the header line prints a
hash of the output so two runs can be checked for equal data.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

from experiment.files import atomic_write_bytes

SKIP_PARTS = {"test", "tests", "idlelib", "site-packages", "__pycache__", "lib2to3"}


def stdlib_sources(root: Path):
    """(relative path, text) of the standard library's .py files in sorted order, ASCII only."""
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_PARTS & set(rel.parts):
            continue
        try:
            text = path.read_text(encoding="ascii")
        except (UnicodeDecodeError, OSError):
            continue
        text = text.replace("\t", "    ").replace("\r", "")
        yield str(rel), text


def build(root: Path, max_bytes: int) -> str:
    parts, size = [], 0
    for rel, text in stdlib_sources(root):
        if size >= max_bytes:
            break
        piece = f"# file: {rel}\n{text}\n"
        parts.append(piece)
        size += len(piece)
    if size < max_bytes:
        raise RuntimeError(f"{root} holds only {size:,} bytes of ASCII Python, fewer than {max_bytes:,}")
    return "".join(parts)


def add_arguments(p) -> None:
    p.add_argument("--out", required=True, help="the .txt file to write")
    p.add_argument("--mb", type=float, default=1.2, help="megabytes of source (whole files, so a little more)")
    p.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"], help="the source tree to read")


def main(args) -> int:
    text = build(Path(args.stdlib), int(args.mb * 1e6))
    atomic_write_bytes(Path(args.out), text.encode())
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    print(f"corpus | {args.out}: {len(text):,} chars of Python from {args.stdlib}, "
          f"{len(set(text))} distinct characters, sha256 {digest}")
    return 0
