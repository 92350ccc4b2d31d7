import json
import pickle

import pytest
import torch

from experiment import checkpoint as ckpt
from experiment.dataloader import prepare
from experiment.model import GPT, GPTConfig
from experiment.optim import ShardedOptimizer
from experiment.checkpoint import RunState, load_checkpoint, save_checkpoint
from experiment.distributed import Dist
from experiment.train import RunLog, TrainConfig


def _fake_step(run_dir, step, complete=True):
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt.model_path(run_dir, step).write_bytes(b"m")
    ckpt.optim_path(run_dir, step, 0).write_bytes(b"o")
    if complete:
        ckpt.atomic_write_json(ckpt.meta_path(run_dir, step), {"step": step})


def test_only_steps_with_meta_count_and_prune_keeps_last_k_and_best(tmp_path):
    run = tmp_path / "run"
    for s in (1, 2, 3, 4, 5):
        _fake_step(run, s)
    _fake_step(run, 6, complete=False)  # a crash mid-save
    assert ckpt.complete_steps(run) == [1, 2, 3, 4, 5]
    ckpt.atomic_write_json(run / "best.json", {"step": 2, "val_loss": 1.0})
    assert ckpt.prune(run, keep_last=2) == [1, 3]
    assert ckpt.complete_steps(run) == [2, 4, 5]
    assert not list(run.glob("*_000001*")) and ckpt.model_path(run, 2).exists()
    ckpt.remove_incomplete(run)
    assert not ckpt.model_path(run, 6).exists() and ckpt.model_path(run, 5).exists()


def test_failed_write_keeps_the_previous_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "model_000001.pt"
    ckpt.atomic_torch_save(path, {"w": torch.ones(2)})
    with pytest.raises((pickle.PicklingError, AttributeError)):
        ckpt.atomic_torch_save(path, {"w": lambda: None})  # unpicklable: fails mid-write
    assert torch.equal(ckpt.load_tensors(path)["w"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["model_000001.pt"]


@pytest.fixture
def saved_run(tmp_path, corpus):
    prepared = prepare(corpus, tmp_path, max_seq_len=32)
    model = GPT(GPTConfig(vocab_size=prepared.meta["vocab_size"], depth=2, aspect_ratio=32, head_dim=32, max_seq_len=32))
    model.init_weights(seed=1)
    opt = ShardedOptimizer(model, matrix_lr=0.02, embedding_lr=0.2, unembedding_lr=0.004)
    for _ in range(2):
        x = torch.randint(1, 20, (2, 32))
        model(x, x).backward()
        opt.step()
        model.zero_grad()
    st = RunState(step=2, tokens_seen=128, used_seconds=5.0, best_val=1.5, best_step=2)
    run = tmp_path / "checkpoints" / "t"
    d = Dist(0, 0, 1, torch.device("cpu"))
    save_checkpoint(run, model, opt, {"epoch": 0, "cursor": 8}, st, 1.5, TrainConfig(), prepared, 60.0, d,
                    RunLog(None))
    return run, model, opt


def test_checkpoint_round_trip_gives_identical_logits_and_state(saved_run):
    run, model, opt = saved_run
    assert json.loads((run / "best.json").read_text()) == {"step": 2, "val_loss": 1.5}
    loaded, meta = ckpt.load_model(ckpt.model_path(run, 2))
    x = torch.randint(1, 20, (2, 32))
    assert torch.equal(loaded(x), model.eval()(x))
    assert meta["data_positions"] == [{"epoch": 0, "cursor": 8}] and meta["world_size"] == 1

    fresh = GPT(model.config)
    fresh_opt = ShardedOptimizer(fresh, matrix_lr=0.02, embedding_lr=0.2, unembedding_lr=0.004)
    st = load_checkpoint(run, 2, fresh, fresh_opt, Dist(0, 0, 1, torch.device("cpu")))
    assert (st.step, st.tokens_seen, st.used_seconds, st.best_step) == (2, 128, 5.0, 2)
    a, b = opt.shard_state()["state"], fresh_opt.shard_state()["state"]
    assert a.keys() == b.keys() and all(torch.equal(a[n][k], b[n][k]) for n in a for k in a[n])


def test_serving_resolution_prefers_best_and_refuses_incomplete(saved_run, tmp_path):
    run, _, _ = saved_run
    assert ckpt.resolve_serving_checkpoint(run, tmp_path) == ckpt.model_path(run, 2)
    assert ckpt.resolve_serving_checkpoint(None, tmp_path) == ckpt.model_path(run, 2)
    _fake_step(run, 9, complete=False)
    with pytest.raises(ckpt.CheckpointError, match="incomplete checkpoint"):
        ckpt.load_model(ckpt.model_path(run, 9))
    with pytest.raises(ckpt.CheckpointError, match="no complete checkpoint"):
        ckpt.resolve_serving_checkpoint(None, tmp_path / "elsewhere")
