"""INIT_FROM (experiment/finetune.py): a fresh run from a trained model's weights on new text, its
shape and vocabulary kept; text with characters outside that vocabulary is refused at the pre-flight."""

import json

import pytest

from conftest import TINY, run_meta, run_train
from test_train import _launch

from experiment import checkpoint as ckpt
from experiment.dataloader import Prepared, demo_lines


def _first_loss(proc) -> float:
    line = next(x for x in proc.stdout.splitlines() if x.startswith("step 000001 | loss"))
    return float(line.split("| loss ")[1].split()[0])


@pytest.fixture
def source(tmp_path, corpus):
    """A tiny model trained 30 steps on the sums corpus: the run directory d2."""
    run_train([*TINY, "--data_dir", corpus, "--workspace", tmp_path, "--total_batch_size", 256, "--max_steps", 30])
    return tmp_path / "checkpoints/d2"


@pytest.mark.slow
def test_a_run_from_a_trained_models_weights_keeps_its_vocabulary_and_starts_where_it_left(tmp_path, source):
    new = tmp_path / "new"
    new.mkdir()
    (new / "more.txt").write_text("".join(demo_lines(3000, seed=99)))  # other sums: a subset of its characters
    common = [*TINY, "--data_dir", new, "--workspace", tmp_path, "--total_batch_size", 256, "--max_steps", 3]
    tuned = run_train([*common, "--init_from", source])
    fresh = run_train([*common, "--model_tag", "fresh"])
    val = run_meta(tmp_path, 30)["val_loss"]
    assert f"init | weights from {source}/model_000030.pt (step 30, val_loss {val:.4f} on its own data)" in tuned.stdout
    assert _first_loss(tuned) < _first_loss(fresh) - 1.0  # it starts trained (fresh: about ln 64 = 4.2)
    meta = run_meta(tmp_path, 3, tag="d2-ft")  # MODEL_TAG: the source's tag + "-ft"
    assert meta["model_config"] == run_meta(tmp_path, 30)["model_config"]
    theirs = Prepared.load(run_meta(tmp_path, 30)["prepared"]["dir"]).meta["chars"]
    ours = Prepared.load(meta["prepared"]["dir"]).meta["chars"]
    assert ours == theirs and len(set("".join(demo_lines(3000, seed=99)))) <= len(theirs)
    # A second start of the new run resumes its own checkpoints, not INIT_FROM's weights again.
    again = run_train([*common, "--init_from", source])
    assert "init |" not in again.stdout and "resumed from" in again.stdout
    # Another source under the same MODEL_TAG: refused, not silently resumed.
    other = run_train([*common, "--init_from", source / "best.pt"], check=False)
    assert other.returncode == 2 and "d2-ft holds a run started from" in other.stderr
    # The same from the exported best.pt (bf16).
    exported = run_train([*common, "--init_from", source / "best.pt", "--model_tag", "from-export"])
    assert abs(_first_loss(exported) - _first_loss(tuned)) < 0.05


@pytest.mark.slow
def test_settings_that_contradict_the_source_and_foreign_characters_exit_2(tmp_path, source):
    proc = run_train([*TINY[2:], "--depth", 4, "--init_from", source, "--workspace", tmp_path], check=False)
    assert proc.returncode == 2 and "--depth 4: INIT_FROM's model" in proc.stderr and "has depth 2" in proc.stderr
    proc = run_train([*TINY, "--init_from", source, "--model_tag", "d2", "--workspace", tmp_path], check=False)
    assert proc.returncode == 2 and "that is this run's own directory" in proc.stderr
    proc = run_train([*TINY, "--init_from", tmp_path / "nothing", "--workspace", tmp_path], check=False)
    assert proc.returncode == 2 and f"--init_from {tmp_path / 'nothing'}:" in proc.stderr
    # Through the launcher: the pre-flight names every character the model cannot spell, and the files.
    new = tmp_path / "new"
    new.mkdir()
    (new / "a.txt").write_text("".join(demo_lines(2000, seed=3)) + "Zé\n")
    (new / "b.txt").write_text("".join(demo_lines(2000, seed=4)))
    proc = _launch(tmp_path, DATA_DIR=str(new), INIT_FROM="checkpoints/d2", DEPTH="auto")  # relative to here
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert "2 character(s) of the data are not in INIT_FROM's vocabulary: 'Z' (U+005A), 'é' (U+00E9)" in errors[0]
    assert f"in {new / 'a.txt'};" in errors[0] and "b.txt" not in errors[0] and "config {" not in proc.stdout
    assert json.loads((source / "best.json").read_text())["step"] in ckpt.complete_steps(source)


def test_init_from_without_max_seq_len_takes_the_sources_context(tmp_path):
    """The source's context is the fine-tune's unless MAX_SEQ_LEN is given (a model trained on 64
    tokens of context, not the CPU default of 256)."""
    from experiment import finetune
    from experiment.config import parse_args

    run = tmp_path / "checkpoints/src"
    run.mkdir(parents=True)
    (run / "model_000005.pt").write_bytes(b"")  # only the meta is read
    model_config = {"depth": 2, "aspect_ratio": 32, "head_dim": 32, "bigram_vocab": 0, "max_seq_len": 64}
    (run / "meta_000005.json").write_text(json.dumps({"step": 5, "model_config": model_config,
                                                      "tokenizer": {"tokenizer": "char", "chars": "0123456789+="},
                                                      "train_config": {"model_tag": "src"}}))
    source = run / "model_000005.pt"
    assert finetune.apply(parse_args(["--init_from", str(source)])).max_seq_len == 64
    assert finetune.apply(parse_args(["--init_from", str(source), "--max_seq_len", "128"])).max_seq_len == 128


def _fake_source(tmp_path, tokenizer=None, bigram_vocab=0, train_config=None, name="src", aspect_ratio=32):
    """A source run directory whose step 5 has a meta and an empty model file (only the meta is read)."""
    from experiment.model import GPTConfig

    run = tmp_path / "checkpoints" / name
    run.mkdir(parents=True)
    (run / "model_000005.pt").write_bytes(b"")
    model_config = GPTConfig(vocab_size=12, depth=2, aspect_ratio=aspect_ratio, head_dim=32, max_seq_len=64,
                             bigram_vocab=bigram_vocab).to_dict()
    (run / "meta_000005.json").write_text(json.dumps({
        "step": 5, "model_config": model_config,
        "tokenizer": tokenizer or {"tokenizer": "char", "chars": "0123456789+="},
        "train_config": {"model_tag": "src"} if train_config is None else train_config}))
    return run / "model_000005.pt"


def test_init_from_takes_the_sources_shape_tokenizer_and_tag_and_refuses_what_contradicts_it(tmp_path):
    from experiment import finetune
    from experiment.config import ConfigError, parse_args

    plain = parse_args([])
    assert finetune.apply(plain) is plain and finetune.chars(plain) is None
    src = str(_fake_source(tmp_path))
    cfg = finetune.apply(parse_args(["--init_from", src]))
    assert (cfg.depth, cfg.aspect_ratio, cfg.head_dim, cfg.bigram_embed) == (2, 32, 32, 0)
    assert (cfg.tokenizer, cfg.max_seq_len, cfg.model_tag) == ("char", 64, "src-ft")
    assert finetune.chars(cfg) == "0123456789+="
    same = ["--depth", "2", "--aspect_ratio", "32", "--head_dim", "32", "--bigram_embed", "0", "--model_tag", "mine"]
    cfg = finetune.apply(parse_args(["--init_from", src, *same]))
    assert (cfg.depth, cfg.aspect_ratio, cfg.head_dim, cfg.bigram_embed, cfg.model_tag) == (2, 32, 32, 0, "mine")
    for flag, value, theirs in (("--depth", "4", "depth 2"), ("--aspect_ratio", "64", "aspect_ratio 32"),
                                ("--head_dim", "16", "head_dim 32"), ("--bigram_embed", "1", "bigram_embed 0")):
        with pytest.raises(ConfigError, match=f"{flag} {value}: INIT_FROM's model .* has {theirs}; leave it unset"):
            finetune.apply(parse_args(["--init_from", src, flag, value]))
    # a tiktoken model: its encoding ("char", the flag's default, reads as unset), no fixed characters;
    # a source without a tag gives "model-ft"
    gpt2 = str(_fake_source(tmp_path, {"tokenizer": "tiktoken", "encoding": "gpt2"}, bigram_vocab=12,
                            train_config={}, name="bpe"))
    cfg = finetune.apply(parse_args(["--init_from", gpt2]))
    assert (cfg.tokenizer, cfg.bigram_embed, cfg.model_tag) == ("gpt2", 1, "model-ft")
    assert finetune.apply(parse_args(["--init_from", gpt2, "--tokenizer", "gpt2"])).tokenizer == "gpt2"
    assert finetune.chars(cfg) is None
    # a generation's tag loses its /gen<k> (the fine-tune is a run beside the generations); a sweep member's stays
    for tag, want in (("run/gen3", "run-ft"), ("sweep/a", "sweep/a-ft")):
        src = str(_fake_source(tmp_path, {"tokenizer": "tiktoken", "encoding": "gpt2"}, bigram_vocab=12,
                               train_config={"model_tag": tag}, name=tag.replace("/", "_")))
        assert finetune.apply(parse_args(["--init_from", src])).model_tag == want
    with pytest.raises(ConfigError, match="--tokenizer cl100k_base: INIT_FROM's model .* uses gpt2; leave it unset"):
        finetune.apply(parse_args(["--init_from", gpt2, "--tokenizer", "cl100k_base"]))
    # a setting equal to the source's is kept whatever int object holds it (320 is not a shared small int)
    wide = str(_fake_source(tmp_path, name="wide", aspect_ratio=320))
    assert finetune.apply(parse_args(["--init_from", wide, "--aspect_ratio", "320"])).aspect_ratio == 320


def test_an_init_from_that_names_no_model_is_refused_by_name(tmp_path):
    import torch

    from experiment import checkpoint as ckpt
    from experiment import finetune
    from experiment.config import ConfigError, parse_args

    with pytest.raises(ConfigError, match=f"--init_from {tmp_path / 'nothing'}: .*no such checkpoint file"):
        finetune.apply(parse_args(["--init_from", str(tmp_path / "nothing")]))
    odd = tmp_path / "odd.pt"  # an export's format without its meta
    torch.save({"format": ckpt.EXPORT_FORMAT}, odd)
    with pytest.raises(ConfigError, match=f"--init_from {odd}: 'meta'"):
        finetune.apply(parse_args(["--init_from", str(odd)]))


def test_a_fine_tune_writes_elsewhere_than_its_source_and_goes_on_only_from_the_same_source(tmp_path):
    from experiment import finetune
    from experiment.config import ConfigError, parse_args
    from experiment.model import GPTConfig

    src = _fake_source(tmp_path)
    other = _fake_source(tmp_path, name="other")
    cfg = parse_args(["--init_from", str(src)])
    finetune.check_dir(parse_args([]), src.parent)  # no INIT_FROM: nothing to check
    with pytest.raises(ConfigError, match="that is this run's own directory"):
        finetune.check_dir(cfg, src.parent)
    new = tmp_path / "checkpoints/src-ft"
    finetune.check_dir(cfg, new)  # not there yet
    finetune.check_dir(cfg, tmp_path / "checkpoints/a-ft")  # a name that sorts before the source's
    new.mkdir()
    finetune.check_dir(cfg, new)  # empty
    (new / "meta_000003.json").write_text(json.dumps({"step": 3, "train_config": {"init_from": str(src)}}))
    finetune.check_dir(cfg, new)  # its own restart
    (new / "meta_000004.json").write_text(json.dumps({"step": 4, "train_config": {"init_from": str(other)}}))
    with pytest.raises(ConfigError, match=f"{new} holds a run started from {other}"):
        finetune.check_dir(cfg, new)  # the newest step names another source
    later = _fake_source(tmp_path, name="zz")  # a name that sorts after the source's
    (new / "meta_000004.json").write_text(json.dumps({"step": 4, "train_config": {"init_from": str(later)}}))
    with pytest.raises(ConfigError, match=f"{new} holds a run started from {later}"):
        finetune.check_dir(cfg, new)
    (new / "meta_000004.json").write_text(json.dumps({"step": 4, "train_config": {}}))
    finetune.check_dir(cfg, new)  # a run that was no fine-tune
    # the model this data builds: the source's, but for the context (RoPE's tables are not weights)
    finetune.check_target(cfg, GPTConfig(vocab_size=12, depth=2, aspect_ratio=32, head_dim=32, max_seq_len=128))
    with pytest.raises(ConfigError, match="its model .* differs from the one this data builds"):
        finetune.check_target(cfg, GPTConfig(vocab_size=13, depth=2, aspect_ratio=32, head_dim=32, max_seq_len=64))
