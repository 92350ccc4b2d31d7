"""Data preparation and batches: validation errors, tokenizers, the cache, disjoint resumable per-rank windows."""

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, SHAKESPEARE
from experiment import chunks, dataloader
from experiment.batches import TokenBatches, val_batches, val_windows
from experiment.dataloader import CharTokenizer, DataError, demo_lines, prepare, write_demo_corpus


def _files(tmp_path, **files):
    d = tmp_path / "data"
    d.mkdir(exist_ok=True)
    for name, content in files.items():
        (d / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return d


def _assert_nothing_written(ws):
    assert not (ws / "prepared").exists() or not any((ws / "prepared").iterdir())


GOOD = "hello world\n" * 100


@pytest.mark.parametrize("case,files,kwargs,message", [
    ("missing dir", None, {}, r"missing: data directory does not exist"),
    ("no data files", {"notes.md": GOOD}, {}, r"data: no data files \(expected UTF-8 \*\.txt, or \*\.jsonl"),
    ("empty file", {"a.txt": GOOD, "b.txt": ""}, {}, r"b\.txt: file is empty"),
    ("invalid utf-8", {"a.txt": b"abc\ndef\xff\xfeghi"}, {}, r"a\.txt: invalid UTF-8 at byte offset 7 \(line 2\)"),
    ("nul byte", {"a.txt": GOOD + "ab\x00c\n"}, {}, r"a\.txt:101:3: NUL byte"),
    ("alphabet", {"a.txt": GOOD + "hello World\n"}, {"alphabet": "helo wrd\n"},
     r"a\.txt:101:7: character 'W' \(U\+0057\) is not in --alphabet"),
    ("too few tokens", {"a.txt": "tiny\n"}, {}, r"the train split has 6 tokens, fewer than one sequence needs"),
])
def test_bad_data_is_rejected_naming_the_place_and_writes_nothing(tmp_path, case, files, kwargs, message):
    data = _files(tmp_path, **files) if files is not None else tmp_path / "missing"
    ws = tmp_path / "ws"
    with pytest.raises(DataError, match=message):
        prepare(data, ws, max_seq_len=64, **kwargs)
    _assert_nothing_written(ws)


@pytest.mark.slow
def test_cli_exits_nonzero_with_the_file_named(tmp_path):
    data = _files(tmp_path, **{"a.txt": GOOD, "broken.txt": b"ok\n\xc3("})
    ws = tmp_path / "ws"
    proc = subprocess.run([sys.executable, "-m", "experiment.dataloader", "prepare", "--data_dir", str(data),
                           "--workspace", str(ws)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "broken.txt: invalid UTF-8 at byte offset 3" in proc.stderr
    _assert_nothing_written(ws)


def test_prepare_vocab_split_and_cache(tmp_path):
    data = _files(tmp_path, **{"a.txt": "abc\n" * 300, "b.txt": "xyz\n" * 200})
    ws = tmp_path / "ws"
    p = prepare(data, ws, val_fraction=0.1, max_seq_len=32)
    m = p.meta
    assert m["chars"] == "\nabcxyz" and m["vocab_size"] == 64 and m["dtype"] == "uint8"
    # One source (the directory's files): 10% of it to val, a's share too small to cut (MIN_VAL_PIECE),
    # so the last file gives the source's 200 tokens as its tail.
    train, val = p.tokens("train"), p.tokens("val")
    streams = [np.concatenate([train[slice(*s["train"])], val[slice(*s["val"])]]) for s in m["sources"]]
    assert [s["name"] for s in m["source_splits"]] == ["data"] and [len(s) for s in streams] == [1201, 801]
    assert [s["val"][1] - s["val"][0] for s in m["sources"]] == [0, 200]
    assert m["source_splits"][0]["val"] == [0, 200] == [0, m["source_splits"][0]["val_chars"]]
    assert len(train) + len(val) == 2 + 1200 + 800 and m["split"]["val_tokens"] == 200
    tok = p.tokenizer()
    assert streams[0][0] == tok.bos_id and streams[1][0] == tok.bos_id  # BOS opens every file
    assert tok.decode(streams[0][1:].tolist()) == "abc\n" * 300 and tok.decode(streams[1][1:].tolist()) == "xyz\n" * 200
    assert [s["tokens"] for s in m["sources"]] == [1201, 801]
    mtime = (p.dir / "train.bin").stat().st_mtime_ns
    again = prepare(data, ws, val_fraction=0.1, max_seq_len=32)
    assert again.dir == p.dir and (p.dir / "train.bin").stat().st_mtime_ns == mtime  # cache hit
    (data / "b.txt").write_text("xyz\n" * 201)
    assert prepare(data, ws, val_fraction=0.1, max_seq_len=32).dir != p.dir  # content change -> new hash


def test_char_tokenizer_names_unknown_characters():
    tok = CharTokenizer("abc")
    assert tok.decode(tok.encode("cab")) == "cab"
    with pytest.raises(ValueError, match="'xz'"):
        tok.encode("axbz")


@pytest.mark.skipif(not SHAKESPEARE.exists(), reason="../shared/data/tinyshakespeare.txt not present")
def test_prepare_real_corpus(tmp_path):
    p = prepare(SHAKESPEARE, tmp_path, val_fraction=0.1, max_seq_len=256)
    assert p.meta["vocab_used"] == 66 and p.meta["vocab_size"] == 128  # 65 characters + BOS
    text = SHAKESPEARE.read_text()
    assert p.tokenizer().decode(p.tokens("train")[:1000].tolist()) == text[:999]


def test_tiktoken_encoding(tmp_path):
    pytest.importorskip("tiktoken")
    from experiment.dataloader import TiktokenTokenizer
    try:
        TiktokenTokenizer("gpt2")
    except DataError as e:  # offline machines cannot download the BPE files
        pytest.skip(str(e))
    data = _files(tmp_path, **{"a.txt": "the cat sat on the mat. " * 400})
    p = prepare(data, tmp_path / "ws", tokenizer="gpt2", max_seq_len=32)
    assert p.meta["tokenizer"] == "tiktoken" and p.meta["vocab_size"] % 64 == 0 and p.meta["dtype"] == "uint16"


def _windows(it, n):
    """Window ids of n micro-batches: the data is arange, so x[:, 0] is a window's first token."""
    return [set(next(it)[0][:, 0].tolist()) for _ in range(n)]


@pytest.mark.parametrize("world,batch", [(1, 4), (2, 3), (3, 2), (4, 1)])
def test_rank_shards_are_disjoint_and_cover_the_epoch(world, batch):
    tokens = np.arange(33 * 16 + 1, dtype=np.uint32)  # 33 windows of 16
    seq = 16
    per_step = world * batch
    steps = 33 // per_step
    its = [TokenBatches(tokens, seq, batch, r, world, seed=5) for r in range(world)]
    seen = [_windows(it, steps) for it in its]
    flat = [w for rank in seen for step in rank for w in step]
    assert len(flat) == len(set(flat)) == steps * per_step  # no window twice, across ranks and steps
    for it in its:
        x, y = next(it)  # the next epoch starts: reshuffled, still aligned windows
        assert torch.equal(x[:, 1:], y[:, :-1])
    assert len({it.state()["epoch"] for it in its}) == 1


def test_two_ranks_read_what_one_rank_reads_over_two_micro_steps():
    tokens = np.arange(40 * 8 + 1, dtype=np.uint32)
    one = TokenBatches(tokens, 8, 3, 0, 1, seed=1)
    two = [TokenBatches(tokens, 8, 3, r, 2, seed=1) for r in range(2)]
    for _ in range(5):
        a = torch.cat([next(one)[0], next(one)[0]])
        b = torch.cat([next(two[0])[0], next(two[1])[0]])
        assert torch.equal(a, b)


def test_iterator_resumes_from_its_state_across_epochs():
    tokens = np.arange(10 * 8 + 1, dtype=np.uint32)
    it = TokenBatches(tokens, 8, 3, 0, 1, seed=3)
    for _ in range(4):  # crosses the epoch boundary (3 micro-steps per epoch)
        next(it)
    state = json.loads(json.dumps(it.state()))  # survives the trip through meta.json
    resumed = TokenBatches(tokens, 8, 3, 0, 1, seed=3, state=state)
    for _ in range(7):
        assert torch.equal(next(it)[0], next(resumed)[0])


def test_too_small_for_one_micro_step_is_an_error():
    with pytest.raises(DataError, match="fewer than one micro-step"):
        TokenBatches(np.arange(100, dtype=np.uint32), 16, 4, 0, 2)


def test_val_slice_is_split_across_ranks_without_overlap():
    tokens = np.arange(21 * 10 + 1, dtype=np.uint32)
    full = torch.cat([x[:, 0] for x, _ in val_batches(tokens, 10, 4, 1000, 0, 1)])
    parts = [torch.cat([x[:, 0] for x, _ in val_batches(tokens, 10, 4, 1000, r, 3)]) for r in range(3)]
    assert sorted(torch.cat(parts).tolist()) == full.tolist() == list(range(0, 210, 10))
    assert len(list(val_batches(tokens, 10, 100, 55, 0, 1))[0][0]) == 5  # max_tokens bounds the sample


def test_val_sample_spreads_over_the_whole_split_at_even_strides():
    starts = val_windows(100 * 10 + 1, 10, 34 * 10)  # 34 of the split's 100 windows
    assert starts == list(range(0, 1000, 30))  # every 3rd window, from the first to the last
    assert val_windows(100 * 10 + 1, 10, 10**9) == list(range(0, 1000, 10))  # it fits: the whole split
    uneven = [w // 10 for w in val_windows(1000, 10, 25 * 10)]  # 25 of 99 windows
    assert uneven[0] == 0 and uneven[-1] == 98 and len(uneven) == 25  # the first and the last window
    assert {b - a for a, b in zip(uneven, uneven[1:])} == {4, 5}  # at strides as even as they can be
    tokens = np.arange(100 * 10 + 1, dtype=np.uint32)
    firsts = torch.cat([x[:, 0] for x, _ in val_batches(tokens, 10, 8, 340, 0, 1)]).tolist()
    assert firsts == starts  # the batches read those windows


def test_demo_corpus_is_correct_arithmetic_and_deterministic(tmp_path):
    path = write_demo_corpus(tmp_path, n_lines=500)
    lines = path.read_text().splitlines()
    assert len(lines) == 500 and lines == [l.strip() for l in demo_lines(500)]
    for line in lines:
        lhs, rhs = line.split("=")
        a, b = lhs.split("+")
        assert int(a) + int(b) == int(rhs)


# ---------------------------------------------------------------- prepare in chunks

MIXED = "ab \n\tXyz" + "é日—😀"  # 1- to 4-byte UTF-8 characters


def _random_text(rng, n):
    return "".join(rng.choice(MIXED) for _ in range(n))


def _stream(p) -> np.ndarray:
    """The token stream in file order: each file's train part, then its val part (its last tokens)."""
    train, val = p.tokens("train"), p.tokens("val")
    return np.concatenate([np.concatenate([train[slice(*s["train"])], val[slice(*s["val"])]])
                           for s in p.meta["sources"]])


def _val_tokens(p, fraction: float) -> int:
    return sum(int((s["train"][1] - s["train"][0] + s["val"][1] - s["val"][0]) * fraction)
               for s in p.meta["source_splits"])


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_chunked_prepare_gives_the_whole_file_encoding(tmp_path, monkeypatch, seed):
    rng = random.Random(seed)
    texts = {f"{k}.txt": _random_text(rng, rng.randint(50, 3000)) for k in "abc"}
    monkeypatch.setattr(dataloader, "CHUNK_BYTES", rng.choice([8, 13, 64, 500]))  # cuts land everywhere
    p = prepare(_files(tmp_path, **texts), tmp_path / "ws", val_fraction=0.1, max_seq_len=4, workers=2)
    chars = sorted(set("".join(texts.values())))
    expected = [i for name in sorted(texts) for i in [0] + [chars.index(c) + 1 for c in texts[name]]]
    assert p.meta["chars"] == "".join(chars) and p.meta["dtype"] == "uint8"
    assert _stream(p).tolist() == expected
    assert p.meta["split"]["val_tokens"] == len(p.tokens("val")) == _val_tokens(p, 0.1)
    assert [len(texts[n]) + 1 for n in sorted(texts)] == [sum(map(lambda r: r[1] - r[0], (s["train"], s["val"])))
                                                         for s in p.meta["sources"]]
    assert [s["tokens"] for s in p.meta["sources"]] == [len(texts[n]) + 1 for n in sorted(texts)]


def test_chunked_prepare_with_more_than_255_characters_writes_uint16(tmp_path, monkeypatch):
    rng = random.Random(0)
    text = "".join(rng.choice("abc\n" + "".join(map(chr, range(0x400, 0x500)))) for _ in range(5000))
    monkeypatch.setattr(dataloader, "CHUNK_BYTES", 100)
    p = prepare(_files(tmp_path, **{"a.txt": text}), tmp_path / "ws", max_seq_len=4, workers=2)
    assert p.meta["dtype"] == "uint16" and p.meta["vocab_used"] == 4 + 256 + 1
    ids = np.concatenate([p.tokens("train"), p.tokens("val")])
    assert ids[0] == 0 and p.tokenizer().decode(ids[1:].tolist()) == text


def _whole_file_error(path, raw: bytes, alphabet):
    """The message of the checks made on the whole file at once (prepare before it read in chunks)."""
    def line_col(text, i):
        return text.count("\n", 0, i) + 1, i - (text.rfind("\n", 0, i) + 1) + 1
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        return f"{path}: invalid UTF-8 at byte offset {e.start} (line {line}): {e.reason}"
    if "\x00" in text:
        line, col = line_col(text, text.index("\x00"))
        return f"{path}:{line}:{col}: NUL byte (binary file?)"
    for i, ch in enumerate(text):
        if alphabet is not None and ch not in alphabet:
            line, col = line_col(text, i)
            return f"{path}:{line}:{col}: character {ch!r} (U+{ord(ch):04X}) is not in --alphabet"
    return None


@pytest.mark.parametrize("seed", range(6))
def test_chunked_errors_name_the_place_a_whole_file_check_names(tmp_path, monkeypatch, seed):
    rng = random.Random(seed)
    monkeypatch.setattr(dataloader, "CHUNK_BYTES", rng.choice([8, 11, 32, 200]))
    checked = 0
    for case in range(15):
        raw = bytearray(_random_text(rng, rng.randint(1, 400)).encode())
        for _ in range(rng.randint(1, 3)):  # invalid UTF-8, a NUL, or a character outside the alphabet
            raw[rng.randrange(len(raw))] = rng.choice([0xFF, 0x80, 0xC3, 0xE6, 0xF0, 0x00, ord("Q")])
        alphabet = MIXED if rng.random() < 0.5 else None
        data = tmp_path / f"case{case}"
        data.mkdir()
        (data / "a.txt").write_text("ab\n" * 40)
        (data / "b.txt").write_bytes(bytes(raw))
        expected = _whole_file_error(data / "b.txt", bytes(raw), alphabet)
        if expected is None:
            continue
        with pytest.raises(DataError) as e:
            prepare(data, tmp_path / "ws", alphabet=alphabet, max_seq_len=4, workers=rng.choice([1, 2]))
        assert str(e.value) == expected
        checked += 1
    assert checked >= 5
    _assert_nothing_written(tmp_path / "ws")


def test_cache_hit_by_stat_reads_no_file_and_a_touch_keeps_the_hash(tmp_path, monkeypatch):
    data = _files(tmp_path, **{"a.txt": GOOD, "b.txt": "xyz\n" * 200})
    ws = tmp_path / "ws"
    p = prepare(data, ws, max_seq_len=32)
    assert not (ws / "prepared/.stat").exists()  # files written within STAT_TRUST_SECONDS: not trusted yet
    monkeypatch.setattr(dataloader, "STAT_TRUST_SECONDS", 0)  # instead of waiting for them to age
    assert prepare(data, ws, max_seq_len=32).dir == p.dir
    assert len(list((ws / "prepared/.stat").iterdir())) == 1

    def no_reading(*args):
        raise AssertionError("a cache hit by stat reads no file")
    with monkeypatch.context() as m:
        m.setattr(chunks, "read", no_reading)
        m.setattr(chunks, "plan", no_reading)
        assert prepare(data, ws, max_seq_len=32).dir == p.dir

    os.utime(data / "a.txt")  # same content, new mtime: read again, same hash and directory
    again = prepare(data, ws, max_seq_len=32)
    assert again.dir == p.dir and again.meta["hash"] == p.meta["hash"]
    assert len(list((ws / "prepared/.stat").iterdir())) == 2

    before = (data / "b.txt").stat()  # same size, mtime put back: ctime and content still tell
    (data / "b.txt").write_text("xyw\n" * 200)
    os.utime(data / "b.txt", ns=(before.st_atime_ns, before.st_mtime_ns))
    changed = prepare(data, ws, max_seq_len=32)
    assert changed.dir != p.dir and changed.meta["sources"][1]["sha256"] != p.meta["sources"][1]["sha256"]


def test_progress_lines_give_mb_per_second_and_eta(tmp_path, monkeypatch):
    monkeypatch.setattr(dataloader, "CHUNK_BYTES", 64)
    monkeypatch.setattr(dataloader, "PROGRESS_SECONDS", 0)
    lines = []
    prepare(_files(tmp_path, **{"a.txt": GOOD * 3}), tmp_path / "ws", max_seq_len=32, log=lines.append)
    for what in ("validate", "encode"):
        assert any(re.fullmatch(rf"prepare \| {what} [\d,]+/[\d,]+ MB \| \d+ MB/s \| ETA \d+ s", l) for l in lines)


# The pre-tokenizer patterns of r50k/gpt2 and of cl100k (as tiktoken defines them); the encoding is
# byte-level with a few merges, built here: the real ones download their files on first use.
CL100K_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|"""
                  r"""\s++$|\s*[\r\n]|\s+(?!\S)|\s""")


@pytest.mark.parametrize("pattern", ["r50k", "cl100k"])
def test_tiktoken_chunks_encode_as_the_whole_file(tmp_path, monkeypatch, pattern):
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken_ext.openai_public import r50k_pat_str
    ranks = {bytes([i]): i for i in range(256)}
    for piece in (b"th", b"he", b"the", b" t", b" the", b"at", b" c", b"\n\n", b"in", b"  "):
        ranks[piece] = len(ranks)
    enc = tiktoken.Encoding("testbpe", pat_str=r50k_pat_str if pattern == "r50k" else CL100K_PATTERN,
                            mergeable_ranks=ranks, special_tokens={"<|endoftext|>": len(ranks)})
    real = tiktoken.get_encoding
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: enc if name == "testbpe" else real(name))
    rng = random.Random(1)
    words = ["the", "cat", "sat", "on", "mat.", "  ", "42", "café", "<|endoftext|>", "it's", "\n\n", "x"]
    lines = ["w" + " ".join(rng.choice(words) for _ in range(rng.randint(1, 12))) + "z" for _ in range(400)]
    texts = {"a.txt": "\n".join(lines[:250]) + "\n", "b.txt": "\n".join(lines[250:])}
    monkeypatch.setattr(dataloader, "CHUNK_BYTES", 256)
    p = prepare(_files(tmp_path, **texts), tmp_path / "ws", tokenizer="testbpe", val_fraction=0.2, max_seq_len=8,
                workers=2)
    eot = enc.eot_token
    expected = [i for name in sorted(texts) for i in [eot] + enc.encode_ordinary(texts[name])]
    ids = _stream(p).tolist()
    assert ids == expected and p.meta["split"]["val_tokens"] == _val_tokens(p, 0.2)
    val = p.tokens("val")
    assert p.meta["split"]["val_chars"] == sum(len(p.tokenizer().decode(val[slice(*s["val"])].tolist()))
                                               for s in p.meta["source_splits"])


def test_the_top_level_files_are_one_source_and_each_sub_directory_another(tmp_path):
    data = _files(tmp_path, **{"web.txt": "abc\n" * 300, "web2.txt": "abd\n" * 50})
    (data / "code").mkdir()
    (data / "code" / "x.txt").write_text("xyz\n" * 100)
    (data / "code" / "y.txt").write_text("xy\n" * 100)
    p = prepare(data, tmp_path / "ws", val_fraction=0.1, max_seq_len=16)
    splits = p.meta["source_splits"]
    assert [s["name"] for s in splits] == ["data", "code"]  # the top-level files first
    assert [s["source"] for s in p.meta["sources"]] == ["data", "data", "code", "code"]
    assert [s["val"][1] - s["val"][0] for s in splits] == [int(0.1 * (1201 + 201)), int(0.1 * (401 + 301))]
    tok, val = p.tokenizer(), p.tokens("val")
    web2 = p.meta["sources"][1]
    assert tok.decode(val[slice(*web2["val"])].tolist()) == ("abd\n" * 50)[-140:]  # the last file's tail
    assert splits[0]["val"] == [p.meta["sources"][0]["val"][0], p.meta["sources"][1]["val"][1]]
    (data / "data").mkdir()
    (data / "data" / "z.txt").write_text("abc\n")
    with pytest.raises(DataError, match=r"top-level data files and its sub-directory data/ would both be the "
                                        r"source 'data'"):
        prepare(data, tmp_path / "ws", max_seq_len=16)


def test_val_shares_hold_the_sources_fraction_exactly_in_whole_records_or_long_tails():
    from experiment.dataloader import MIN_VAL_PIECE, val_shares

    assert MIN_VAL_PIECE == 2048
    assert val_shares([5000], 0.05) == [250]  # one file: its tail
    assert val_shares([1201, 801], 0.1) == [0, 200]  # a's 120 too few to cut: the last file's tail
    assert val_shares([3000, 2000, 50], 0.1) == [0, 455, 50]  # the last whole, the rest from the tails before it
    assert val_shares([4096, 4096], 0.5) == [2048, 2048]  # a tail of exactly MIN_VAL_PIECE is cut
    assert val_shares([4094, 10], 0.5) == [2042, 10]  # 2,047 owed: waits; the end takes it back from a's tail
    assert val_shares([30000] * 10, 0.05) == [0, 3000] * 5  # 1,500 owed waits for the next file
    small = val_shares([100] * 300, 0.05)
    assert [i for i, v in enumerate(small) if v] == list(range(19, 300, 20)) and set(small) == {0, 100}
    rng = random.Random(5)
    for _ in range(200):
        sizes = [rng.choice([rng.randint(1, 300), rng.randint(1, 60000)]) for _ in range(rng.randint(1, 12))]
        fraction = rng.choice([0.01, 0.05, 0.1, 0.5])
        shares = val_shares(sizes, fraction)
        assert sum(shares) == int(sum(sizes) * fraction) and all(0 <= v <= n for v, n in zip(shares, sizes))


def test_top_level_files_around_a_sub_directory_are_still_one_source(tmp_path):
    data = _files(tmp_path, **{"a.txt": "abc\n" * 300, "z.txt": "xyz\n" * 300})
    (data / "m").mkdir()
    (data / "m" / "x.txt").write_text("mmm\n" * 300)
    link = tmp_path / "linked"
    os.symlink(data, link)
    p = prepare(link, tmp_path / "ws", val_fraction=0.1, max_seq_len=16)
    assert [s["name"] for s in p.meta["source_splits"]] == ["linked", "m"]  # named as given, not as resolved
    assert [Path(s["path"]).name for s in p.meta["sources"]] == ["a.txt", "z.txt", "x.txt"]


def test_a_flat_directory_of_many_small_record_files_is_one_corpus_with_val_across_the_files(tmp_path):
    """Records kept one per file, in time order: val holds whole records (each after its BOS, none cut
    mid-record) spread from the first files to the last, 5% of the tokens in all, and a file far
    smaller than one val window is no error."""
    rng = random.Random(3)
    texts = {f"rec{k:04d}.txt": f"record {k}: " + _random_text(rng, rng.randint(20, 200)) for k in range(300)}
    p = prepare(_files(tmp_path, **texts), tmp_path / "ws", val_fraction=0.05, max_seq_len=32, workers=2)
    assert [s["name"] for s in p.meta["source_splits"]] == ["data"]
    tok, val, files = p.tokenizer(), p.tokens("val"), p.meta["sources"]
    assert p.meta["split"]["val_tokens"] == len(val) == int(sum(f["tokens"] for f in files) * 0.05)
    held = [i for i, f in enumerate(files) if f["val"][1] > f["val"][0]]
    whole = [i for i in held if files[i]["val"][1] - files[i]["val"][0] == files[i]["tokens"]]
    assert held[:-1] == whole[: len(held) - 1] and 10 <= len(whole)  # whole records (the last may be a tail)
    assert held[0] < 40 and held[-2] > 250  # from the first records to the last ones
    for i in whole:
        ids = val[slice(*files[i]["val"])]
        assert ids[0] == tok.bos_id and tok.decode(ids[1:].tolist()) == texts[Path(files[i]["path"]).name]


def test_a_source_too_small_for_one_val_sequence_is_named(tmp_path):
    data = _files(tmp_path, **{"big.txt": "abc\n" * 1000})
    (data / "tiny").mkdir()
    (data / "tiny" / "t.txt").write_text("xyz\n" * 20)
    with pytest.raises(DataError, match=r"source tiny gives 8 tokens to val, fewer than one sequence needs"):
        prepare(data, tmp_path / "ws", val_fraction=0.1, max_seq_len=16)


def test_hidden_directories_are_skipped_symlinked_ones_followed_and_data_dir_names_the_sources(tmp_path,
                                                                                               monkeypatch):
    import os

    data = _files(tmp_path, **{"web.txt": "abc\n" * 300})
    (data / ".ipynb_checkpoints").mkdir()
    (data / ".ipynb_checkpoints" / "web-checkpoint.txt").write_text("abc\n" * 300)
    elsewhere = tmp_path / "elsewhere" / "code"
    elsewhere.mkdir(parents=True)
    (elsewhere / "x.txt").write_text("xyz\n" * 300)
    os.symlink(elsewhere, data / "code")
    os.symlink(data, elsewhere / "loop")  # a symlink loop is walked once
    p = prepare(data, tmp_path / "ws", val_fraction=0.1, max_seq_len=16)
    assert [s["name"] for s in p.meta["source_splits"]] == ["data", "code"]
    # The same files under another DATA_DIR are another corpus (top-level files, not a sub-directory),
    # also when their stat is remembered from the first prepare.
    only = tmp_path / "only"
    (only / "code").mkdir(parents=True)
    (only / "code" / "x.txt").write_text("xyz\n" * 300)
    monkeypatch.setattr(dataloader, "STAT_TRUST_SECONDS", 0)  # its stat is remembered at once
    first = prepare(only, tmp_path / "ws", val_fraction=0.1, max_seq_len=16)
    again = prepare(only / "code", tmp_path / "ws", val_fraction=0.1, max_seq_len=16)
    assert [s["name"] for s in first.meta["source_splits"]] == ["code"]
    assert again.dir != first.dir and [s["path"] for s in again.meta["sources"]] == [str(only / "code" / "x.txt")]


def test_validate_counts_the_tokens_prepare_writes_by_source_without_writing(tmp_path, monkeypatch):
    """dataloader.validate (plan's data check before renting): prepare's checks and counts, no files."""
    data = tmp_path / "data"
    b = "xyz\n" * 50 + "q"  # 201 characters: an odd count, and bytes that 4 does not divide
    for sub, name, text in (("code", "a.txt", GOOD * 3), ("code", "b.txt", b), ("prose", "c.txt", GOOD)):
        (data / sub).mkdir(parents=True, exist_ok=True)
        (data / sub / name).write_text(text)
    quiet = dict(log=lambda line: None)
    v = dataloader.validate(data, max_seq_len=8, workers=2, **quiet)
    assert not (tmp_path / "ws").exists()
    p = prepare(data, tmp_path / "ws", max_seq_len=8)
    split = p.meta["split"]
    # a BOS before each file, then its characters; each source's val part as prepare cuts it
    assert v == {"tokens": split["train_tokens"] + split["val_tokens"], "exact": True,
                 "sources": {"code": 1 + len(GOOD) * 3 + 1 + 201, "prose": 1 + len(GOOD)}}
    assert dataloader.validate(data, tokenizer="".join(["ch", "ar"]), max_seq_len=8, **quiet) == v  # from a flag
    lines = []  # its progress lines go where it is told
    monkeypatch.setattr(dataloader, "PROGRESS_SECONDS", 0)
    dataloader.validate(data, max_seq_len=8, log=lines.append)
    assert any(line.startswith("prepare | validate") for line in lines)
    prose = next(s for s in p.meta["source_splits"] if s["name"] == "prose")
    need = prose["val"][1] - prose["val"][0]  # 5% of 1,201 tokens: 60
    with pytest.raises(DataError, match=f"{data}: source prose gives {need} tokens to val"):
        dataloader.validate(data, max_seq_len=need, **quiet)
    dataloader.validate(data, max_seq_len=need - 1, **quiet)  # prepare takes it too
    prepare(data, tmp_path / "ws", max_seq_len=need - 1)
    # the splits' own checks come first: the val split as a whole, and the default context of 256
    val = split["val_tokens"]
    with pytest.raises(DataError, match=f"the val split has {val:,} tokens, .*max_seq_len \\+ 1 = {val + 1}"):
        dataloader.validate(data, max_seq_len=val, **quiet)
    with pytest.raises(DataError, match=f"the val split has {val:,} tokens, .*max_seq_len \\+ 1 = 257"):
        dataloader.validate(data, **quiet)
    # ... and the train split, which a VAL_FRACTION of 0.9 leaves short
    train = prepare(data, tmp_path / "ws9", max_seq_len=8, val_fraction=0.9).meta["split"]["train_tokens"]
    with pytest.raises(DataError, match=f"the train split has {train:,} tokens"):
        dataloader.validate(data, val_fraction=0.9, max_seq_len=train, **quiet)
    dataloader.validate(data, val_fraction=0.9, max_seq_len=train - 1, **quiet)
    # tiktoken: estimated from the bytes (4 a token), never encoded here
    v = dataloader.validate(data, tokenizer="gpt2", max_seq_len=8, workers=1, **quiet)
    assert v == {"tokens": 3 + len(GOOD) * 3 // 4 + 201 // 4 + len(GOOD) // 4, "exact": False,
                 "sources": {"code": 2 + len(GOOD) * 3 // 4 + 201 // 4, "prose": 1 + len(GOOD) // 4}}
    with pytest.raises(DataError, match="a.txt: invalid UTF-8"):
        (data / "code" / "a.txt").write_bytes(b"ok\n\xff\xfe\n")
        dataloader.validate(data, max_seq_len=8, **quiet)
