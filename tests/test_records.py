"""Record files (JSONL, gzipped JSONL, Parquet) beside *.txt: one document per record, the places of
their problems named, the plan and the pre-flight agreeing, the prepared hash covering format and field."""

import gzip
import json
import random
import re
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from conftest import REPO
from experiment import dataloader, records
from experiment.dataloader import DataError, prepare
from experiment.preflight import records_note

QUIET = dict(log=lambda line: None)


def _jsonl(path, rows, gz=False):
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    path.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    return path


def _parquet(path, **columns):
    """A Parquet file; a test that writes one skips where pyarrow is missing (requirements.txt pins it)."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, row_group_size=2)  # several row groups, as big files have
    return path


def _stream(p) -> list[int]:
    """The tokens in file order (each file's train part, then its val part), as prepare wrote them."""
    train, val = p.tokens("train"), p.tokens("val")
    return np.concatenate([np.concatenate([train[slice(*s["train"])], val[slice(*s["val"])]])
                           for s in p.meta["sources"]]).tolist()


def _documents(p) -> list[str]:
    """The stream cut at each BOS: the documents the model sees, in order."""
    tok, out = p.tokenizer(), []
    for i in _stream(p):
        if i == tok.bos_id:
            out.append([])
        else:
            out[-1].append(i)
    return [tok.decode(d) for d in out]


def _corpus(root):
    """Text, JSONL, gzipped JSONL and Parquet mixed, at the top level and in two sub-directories."""
    (root / "notes.txt").parent.mkdir(parents=True, exist_ok=True)
    (root / "notes.txt").write_text("a plain file\n" * 40)
    _jsonl(root / "web" / "a.jsonl", [{"text": "first page", "url": "u"}, {"text": ""}, {"text": None},
                                      "", {"text": "second\npage é", "id": 2}])
    _jsonl(root / "web" / "b.jsonl.gz", [{"text": "gz page " * 20}], gz=True)
    _parquet(root / "books" / "c.parquet", text=["book one " * 30, "", None, "book two"], id=[1, 2, 3, 4])
    return ["a plain file\n" * 40, "book one " * 30, "book two", "first page", "second\npage é", "gz page " * 20]


def test_records_and_text_files_mixed_are_one_document_per_record(tmp_path):
    expected = _corpus(tmp_path / "data")
    p = prepare(tmp_path / "data", tmp_path / "ws", max_seq_len=8, val_fraction=0.1, workers=2, **QUIET)
    assert _documents(p) == expected  # files in list_sources' order: top level, then books/, then web/
    by_file = {s["path"].rsplit("/", 1)[1]: s for s in p.meta["sources"]}
    assert {n: (s["source"], s.get("records"), s.get("empty_records")) for n, s in by_file.items()} == {
        "notes.txt": ("data", None, None), "c.parquet": ("books", 2, 2), "a.jsonl": ("web", 2, 2),
        "b.jsonl.gz": ("web", 1, 0)}
    assert sum(len(d) + 1 for d in expected) == p.meta["split"]["train_tokens"] + p.meta["split"]["val_tokens"]
    assert records_note(p.meta) == " | 5 records from 3 record file(s), 4 empty skipped"
    assert records_note({"sources": [{"path": "a.txt"}]}) == ""
    assert not list((tmp_path / "ws" / "prepared").glob(".records.*"))  # the converted text is gone


def test_the_plan_counts_what_prepare_writes_and_writes_nothing(tmp_path, monkeypatch):
    _corpus(tmp_path / "data")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    v = dataloader.validate(tmp_path / "data", max_seq_len=8, val_fraction=0.1, **QUIET)
    p = prepare(tmp_path / "data", tmp_path / "ws", max_seq_len=8, val_fraction=0.1, **QUIET)
    assert v["exact"] and v["tokens"] == p.meta["split"]["train_tokens"] + p.meta["split"]["val_tokens"]
    assert v["sources"] == {s["name"]: s["train"][1] - s["train"][0] + s["val"][1] - s["val"][0]
                            for s in p.meta["source_splits"]}
    assert not any(scratch.iterdir())
    with pytest.raises(DataError, match=r"a\.jsonl:5: character 'é'"):
        dataloader.validate(tmp_path / "data", alphabet="".join(map(chr, range(32, 127))) + "\n", max_seq_len=8,
                            **QUIET)
    assert not any(scratch.iterdir())  # nor after an error


BAD = [
    ("not json", [{"text": "ok"}, '{"text": "unclosed'], r"x\.jsonl:2: not JSON: .* \(column \d+\)"),
    ("array", [{"text": "ok"}, "", '["a"]'], r"x\.jsonl:3: a JSON list, not an object with a 'text' field"),
    ("no field", [{"body": "ok", "id": 1}], r"x\.jsonl:1: no 'text' field \(its fields: 'body', 'id'\); set TEXT_FIELD"),
    ("number", [{"text": "ok"}, {"text": 7}], r"x\.jsonl:2: the 'text' field is a JSON int, not a string"),
    ("nul", [{"text": "ok"}, {"text": "a\u0000b"}], r"x\.jsonl:2: the 'text' text holds a NUL character"),
    ("surrogate", [{"text": "ok"}, '{"text": "a\\ud800b"}'], r"x\.jsonl:2: the 'text' text is not valid Unicode"),
    ("all empty", [{"text": ""}, {"text": None}], r"x\.jsonl: no record holds text \(2 empty\)"),
]


@pytest.mark.parametrize("case,rows,message", BAD, ids=[b[0] for b in BAD])
def test_a_malformed_record_is_named_by_file_and_line_and_nothing_is_written(tmp_path, case, rows, message):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "fine.txt").write_text("hello\n" * 50)
    _jsonl(tmp_path / "data" / "x.jsonl", rows)
    with pytest.raises(DataError, match=message):
        prepare(tmp_path / "data", tmp_path / "ws", max_seq_len=8, **QUIET)
    assert not [p for p in (tmp_path / "ws").rglob("*") if p.is_file()]  # the temp directory is gone too
    with pytest.raises(DataError, match=message):
        dataloader.validate(tmp_path / "data", max_seq_len=8, **QUIET)


def _corrupt(raw: bytes) -> bytes:
    """A gzip stream with its deflate data damaged in the middle (zlib's "invalid ... code" errors)."""
    middle = len(raw) // 2
    return raw[:middle] + bytes(b ^ 0xFF for b in raw[middle:middle + 8]) + raw[middle + 8:]


def test_broken_gzip_invalid_utf8_and_parquet_problems_are_named(tmp_path):
    data = tmp_path / "data"
    _jsonl(data / "ok.jsonl", [{"text": "fine " * 40}])
    cases = [
        ("z.jsonl.gz", gzip.compress(b'{"text": "cut"}\n' * 100)[:-20], r"z\.jsonl\.gz: cannot be read as gzip"),
        ("n.jsonl.gz", b'{"text": "not gzipped"}\n', r"n\.jsonl\.gz: cannot be read as gzip"),
        ("c.jsonl.gz", _corrupt(gzip.compress(b'{"text": "abc"}\n' * 1000)), r"c\.jsonl\.gz: cannot be read as gzip"),
        ("u.jsonl", b'{"text": "ok"}\n{"text": "\xff"}\n', r"u\.jsonl:2: invalid UTF-8"),
    ]
    for name, raw, message in cases:
        (data / name).write_bytes(raw)
        with pytest.raises(DataError, match=message):
            prepare(data, tmp_path / "ws", max_seq_len=8, **QUIET)
        (data / name).unlink()
    _parquet(data / "p.parquet", body=["x"])
    with pytest.raises(DataError, match=r"p\.parquet: no 'text' column \(its columns: 'body'\); set TEXT_FIELD"):
        prepare(data, tmp_path / "ws", max_seq_len=8, **QUIET)
    _parquet(data / "p.parquet", text=[1, 2])
    with pytest.raises(DataError, match=r"p\.parquet: the 'text' column holds int64, not strings"):
        prepare(data, tmp_path / "ws", max_seq_len=8, **QUIET)
    (data / "p.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"p\.parquet: not a readable Parquet file"):
        prepare(data, tmp_path / "ws", max_seq_len=8, **QUIET)


def test_without_pyarrow_a_parquet_file_says_what_to_install(tmp_path, monkeypatch):
    _parquet(tmp_path / "data" / "p.parquet", text=["words " * 50])
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails as where it is not installed
    with pytest.raises(DataError, match=r"p\.parquet: reading Parquet needs pyarrow.*pip install pyarrow==\d"):
        prepare(tmp_path / "data", tmp_path / "ws", max_seq_len=8, workers=1, **QUIET)


@pytest.mark.parametrize("chunk", [1 << 20, 64])
def test_a_character_outside_the_alphabet_names_the_source_line_past_skipped_records(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(dataloader, "CHUNK_BYTES", chunk)  # 64: the record is many chunks in
    rows = [{"text": "ab " * 30}, {"text": ""}, "", {"text": "ba " * 30}, {"text": "ab" * 40 + "X"}, {"text": "ab"}]
    _jsonl(tmp_path / "data" / "x.jsonl", rows)
    with pytest.raises(DataError, match=r"x\.jsonl:5: character 'X' \(U\+0058\) is not in --alphabet"):
        prepare(tmp_path / "data", tmp_path / "ws", alphabet="ab ", max_seq_len=8, workers=2, **QUIET)
    _parquet(tmp_path / "data" / "x.parquet", text=["ab", None, "aXb"])
    (tmp_path / "data" / "x.jsonl").unlink()
    with pytest.raises(DataError, match=r"x\.parquet:row 3: character 'X'"):
        prepare(tmp_path / "data", tmp_path / "ws", alphabet="ab ", max_seq_len=1, val_fraction=0.5, **QUIET)


def test_the_prepared_hash_covers_the_format_and_the_field(tmp_path):
    text = "the same words " * 40
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_text(text)
    _jsonl(tmp_path / "j" / "a.jsonl", [{"text": text, "body": text.upper()}])
    _jsonl(tmp_path / "g" / "a.jsonl.gz", [{"text": text}], gz=True)
    ws, kw = tmp_path / "ws", dict(max_seq_len=8, **QUIET)
    dirs = {prepare(tmp_path / d, ws, **kw).dir for d in "tjg"}
    assert len(dirs) == 3  # one document each, the same tokens, three formats: three hashes
    assert len({tuple(_stream(prepare(tmp_path / d, ws, **kw))) for d in "tjg"}) == 1
    body = prepare(tmp_path / "j", ws, text_field="body", **kw)
    assert body.dir not in dirs and _documents(body) == [text.upper()]
    assert prepare(tmp_path / "j", ws, **kw).dir in dirs  # each field its own, both kept
    # A corpus of *.txt alone is hashed as before record files existed: its prepared data stays a hit.
    assert dataloader._settings([tmp_path / "t" / "a.txt"], "char", None, 0.05, "body") == {
        "tokenizer": "char", "alphabet": None, "val_fraction": 0.05}


def test_text_field_reaches_preparation_from_the_plan_and_from_a_launch(tmp_path):
    from experiment.config import TrainConfig
    from experiment.launch import prepare_data, uses_demo

    _jsonl(tmp_path / "data" / "x.jsonl", [{"body": "words " * 40, "title": "t"}, {"body": "more"}])
    with pytest.raises(DataError, match=r"x\.jsonl:1: no 'text' field \(its fields: 'body', 'title'\)"):
        dataloader.validate(tmp_path / "data", max_seq_len=8, **QUIET)
    v = dataloader.validate(tmp_path / "data", max_seq_len=8, text_field="body", **QUIET)
    assert v["tokens"] == 1 + 240 + 1 + 4
    cfg = TrainConfig(data_dir=str(tmp_path / "data"), text_field="body", max_seq_len=8)
    assert _documents(prepare_data(cfg, tmp_path / "ws", QUIET["log"])) == ["words " * 40, "more"]
    # $WORKSPACE/data holding record files alone is the user's data, not a reason for the demo
    assert not uses_demo(TrainConfig(), tmp_path) and uses_demo(TrainConfig(), tmp_path / "ws")


def test_an_unchanged_record_corpus_is_a_hit_without_converting(tmp_path, monkeypatch):
    _corpus(tmp_path / "data")
    first = prepare(tmp_path / "data", tmp_path / "ws", max_seq_len=8, val_fraction=0.1, **QUIET)
    monkeypatch.setattr(dataloader, "_stat_trusted", lambda stats, at: True)
    prepare(tmp_path / "data", tmp_path / "ws", max_seq_len=8, val_fraction=0.1, **QUIET)  # writes the stat memo
    monkeypatch.setattr(records, "convert", lambda *a: pytest.fail("an unchanged corpus was converted again"))
    assert prepare(tmp_path / "data", tmp_path / "ws", max_seq_len=8, val_fraction=0.1, **QUIET).dir == first.dir


def test_records_under_a_bpe_encoding_are_separated_by_its_end_of_text(tmp_path, monkeypatch):
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken_ext.openai_public import r50k_pat_str
    ranks = {bytes([i]): i for i in range(256)}
    for piece in (b"th", b"he", b"the", b" t", b"at", b"in"):
        ranks[piece] = len(ranks)
    enc = tiktoken.Encoding("testbpe", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": len(ranks)})
    real = tiktoken.get_encoding
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: enc if name == "testbpe" else real(name))
    monkeypatch.setattr(dataloader, "CHUNK_BYTES", 128)  # records cut across chunks
    rng = random.Random(3)
    words = ["the", "cat", "in", "hat", "é", "sat\nin"]  # lines: where a long record's chunks are cut
    long = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 60))) for _ in range(30)]
    # records of one line, shorter than the cut's window: the chunks end between records, never in a word
    short = [" ".join(rng.choice(words[:5]) for _ in range(rng.randint(1, 8))) for _ in range(60)]
    for name, texts in (("long", long), ("short", short)):
        _jsonl(tmp_path / name / "x.jsonl", [{"text": t} for t in texts])
        p = prepare(tmp_path / name, tmp_path / "ws", tokenizer="testbpe", max_seq_len=8, val_fraction=0.2,
                    workers=2, **QUIET)
        assert _stream(p) == [i for t in texts for i in [enc.eot_token] + enc.encode_ordinary(t)], name


@pytest.mark.slow
def test_the_cli_reads_another_field_and_exits_2_naming_the_line(tmp_path):
    _jsonl(tmp_path / "data" / "x.jsonl", [{"body": "words " * 40}, {"body": "more"}, {"title": "none"}])
    cmd = [sys.executable, "-m", "experiment.dataloader", "prepare", "--data_dir", str(tmp_path / "data"),
           "--workspace", str(tmp_path / "ws"), "--max_seq_len", "8", "--text_field", "body"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and re.search(r"x\.jsonl:3: no 'body' field \(its fields: 'title'\)", proc.stderr)
    _jsonl(tmp_path / "data" / "x.jsonl", [{"body": "words " * 40}, {"body": "more"}])
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "2 records with text, 0 empty skipped" in proc.stderr
