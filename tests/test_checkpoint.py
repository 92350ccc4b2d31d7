"""Checkpoints: atomic files, the round trip, retention, serving resolution, parts per rank."""

import json
import pickle

import pytest
import torch

from conftest import ENV, REPO, tiny_config

from experiment import checkpoint as ckpt
from experiment.dataloader import prepare
from experiment.model import GPT, GPTConfig
from experiment.optim import LRS, ShardedOptimizer, partition
from experiment.checkpoint import Retention, RunState
from experiment.distributed import Dist
from experiment.config import TrainConfig, checkpoint_meta
from experiment.runlog import RunLog
from experiment.saving import restore_checkpoint, write_checkpoint


def _fake_step(run_dir, step, complete=True, world=1):
    """A step's files as `world` ranks write them: one model file, or one model part per rank."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for r in range(world):
        (ckpt.model_path(run_dir, step) if world == 1 else ckpt.model_part_path(run_dir, step, r)).write_bytes(b"m")
        ckpt.optim_path(run_dir, step, r).write_bytes(b"o")
    if complete:
        ckpt.atomic_write_json(ckpt.meta_path(run_dir, step), {"step": step, "world_size": world, "model_parts": world})


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


def test_removing_an_incomplete_step_leaves_other_writers_temp_files_and_never_raises(tmp_path, capsys):
    run = tmp_path / "run"
    _fake_step(run, 1)
    _fake_step(run, 2, complete=False)
    ours = [run / ".optim_000002_rank1.pt.k2j3h4g5.tmp", run / ".meta_000002.json.abc.tmp", run / ".best.json.x1.tmp"]
    export = run / ".best.pt.q8w7e6r5.tmp"  # an export writing best.pt beside the checkpoints
    for p in (*ours, export):
        p.write_bytes(b"partial")
    ckpt.remove_incomplete(run)
    assert export.exists() and not any(p.exists() for p in ours) and not ckpt.model_path(run, 2).exists()
    # an I/O error is said, not raised: rank 0 calls this between collectives (a raise ends it alone)
    import unittest.mock

    _fake_step(run, 3, complete=False)
    with unittest.mock.patch("pathlib.Path.unlink", side_effect=PermissionError(13, "Permission denied")):
        ckpt.remove_incomplete(run)
    assert "removing an incomplete checkpoint's files" in capsys.readouterr().err


def test_a_resume_repairs_a_best_json_that_a_kill_left_naming_an_older_step(tmp_path):
    """A kill between step 4's meta (it records step 4 as the best) and its best.json: best.json still
    names step 2, and retention protects only that one, so step 4 would be pruned once it ages out."""
    run = tmp_path / "run"
    for s in (2, 4):
        _fake_step(run, s)
    ckpt.atomic_write_json(run / "best.json", {"step": 2, "val_loss": 2.0})
    assert ckpt.repair_best(run, 1.5, 4) and ckpt.read_best(run) == {"step": 4, "val_loss": 1.5, "weights": "raw"}
    assert not ckpt.repair_best(run, 1.5, 4)  # names it already
    assert not ckpt.repair_best(run, 1.0, 6) and ckpt.read_best(run)["step"] == 4  # step 6 is not complete
    _fake_step(run, 6)
    _fake_step(run, 8)
    assert ckpt.prune(run, keep_last=1) == [2, 6] and ckpt.complete_steps(run) == [4, 8]
    # a --resume to an earlier step: best.json naming a later complete step (that branch's) stands
    ckpt.atomic_write_json(run / "best.json", {"step": 8, "val_loss": 1.2})
    assert not ckpt.repair_best(run, 1.5, 4) and ckpt.read_best(run)["step"] == 8
    (run / "best.json").write_text("{not json")  # damaged: rewritten from what the checkpoint records
    assert ckpt.repair_best(run, 1.5, 4) and ckpt.read_best(run)["step"] == 4


def test_a_launch_the_trainer_ended_is_refused_to_torchruns_restarts_only(tmp_path, monkeypatch):
    from experiment import launch

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    launch.end_launch(tmp_path)  # a plain process: nothing restarts it, nothing is marked
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    launch.end_launch(tmp_path)
    assert len(list(tmp_path.glob(".ended.*"))) == 1
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert launch.launch_ended(tmp_path) is not None  # a restart of the ended launch
    monkeypatch.setattr(launch.os, "getppid", lambda: 1)
    assert launch.launch_ended(tmp_path) is None  # another torchrun's restart
    launch.clear_ended(tmp_path)
    assert not list(tmp_path.iterdir())
    monkeypatch.undo()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    launch.end_launch(tmp_path)  # left by an earlier launch whose torchrun had this pid
    monkeypatch.setenv(launch.AGENT_READS_ENDED, "1")  # the agent cleared such markers before its workers started:
    assert launch.launch_ended(tmp_path) is not None  # a restart for another node's re-join (count 0) reads them
    monkeypatch.delenv(launch.AGENT_READS_ENDED)
    assert launch.launch_ended(tmp_path) is None and not list(tmp_path.iterdir())  # a first attempt: a new launch


def test_a_restart_of_an_ended_launch_exits_0_only_to_an_agent_that_reads_its_code(tmp_path, monkeypatch, capsys):
    from experiment import launch

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.delenv(launch.AGENT_READS_ENDED, raising=False)
    agent = launch.os.getppid()
    assert launch.ended_code(tmp_path, agent) is None
    launch.end_launch(tmp_path, 2)  # the user's mistake
    (tmp_path / f".ended.{launch.socket.gethostname()}.{agent}0.1").touch()  # another agent's (pid 10x longer)
    assert launch.ended_code(tmp_path, agent)[0] == 2
    ended = launch.launch_ended(tmp_path)
    assert launch.not_restarting(tmp_path, ended, True) == 1  # a bare torchrun must see a failure
    monkeypatch.setenv(launch.AGENT_READS_ENDED, "1")
    assert launch.not_restarting(tmp_path, ended, True) == 0  # experiment/agent.py exits 2 for it
    assert capsys.readouterr().err == ""  # the mistake's own error line came once already
    launch.clear_ended(tmp_path)
    (tmp_path / f".ended.another-host.{agent}.2").touch()  # another node's marker: this agent has no code
    assert launch.ended_code(tmp_path, agent) is None and launch.launch_ended(tmp_path) is None
    assert launch.not_restarting(tmp_path, None, True) == 1  # (its ranks told this one: all_ranks_ok)
    assert "its outcome is not on record" in capsys.readouterr().err
    launch.clear_ended(tmp_path)
    launch.end_launch(tmp_path, 1)
    launch.end_launch(tmp_path, 2)  # two ranks of one node, a failure and a mistake: the mistake's code
    markers, real_glob = sorted(tmp_path.glob(".ended.*")), type(tmp_path).glob
    for order in (markers, markers[::-1]):  # whichever order the directory lists them in
        monkeypatch.setattr(type(tmp_path), "glob", lambda self, pattern, order=order: iter(order))
        assert launch.ended_code(tmp_path, agent)[0] == 2
    monkeypatch.setattr(type(tmp_path), "glob", real_glob)
    launch.clear_ended(tmp_path)
    launch.end_launch(tmp_path)  # a failure: code 1, and the restart says why
    assert launch.ended_code(tmp_path, agent)[0] == 1
    assert launch.not_restarting(tmp_path, launch.launch_ended(tmp_path), True) == 0
    assert "error: not restarting" in capsys.readouterr().err
    assert launch.not_restarting(tmp_path, launch.launch_ended(tmp_path), False) == 0
    assert capsys.readouterr().err == ""  # rank 0 alone says it


def test_model_parts_follow_the_same_rules_and_a_half_saved_step_is_never_used(tmp_path):
    run = tmp_path / "run"
    for s in (1, 2, 100000, 1000000):  # 100000's files are a prefix of 1000000's: never confused
        _fake_step(run, s, world=2)
    _fake_step(run, 10, world=2)
    ckpt.meta_path(run, 10).unlink()
    ckpt.model_part_path(run, 10, 1).unlink()  # killed mid-save: one part, one shard, no meta
    ckpt.optim_path(run, 10, 1).unlink()
    assert ckpt.complete_steps(run) == [1, 2, 100000, 1000000] and ckpt.pick_resume_step(run, "auto") == 1000000
    with pytest.raises(ckpt.CheckpointError, match="incomplete checkpoint"):
        ckpt.load_model(ckpt.model_part_path(run, 10, 0))
    with pytest.raises(ckpt.CheckpointError, match="no such checkpoint file"):
        ckpt.resolve_serving_checkpoint(ckpt.model_path(run, 10), tmp_path)
    ckpt.atomic_write_json(run / "best.json", {"step": 1, "val_loss": 1.0})
    assert ckpt.prune(run, keep_last=1) == [2, 100000]
    assert not [p for p in run.iterdir() if "_000002" in p.name or "_100000." in p.name or "_100000_" in p.name]
    ckpt.remove_incomplete(run)
    assert not [p for p in run.iterdir() if "_000010" in p.name]
    assert len([p for p in run.iterdir() if "_000001" in p.name]) == 5  # the best, whole
    assert len([p for p in run.iterdir() if "_1000000" in p.name]) == 5  # the newest, whole


def test_an_old_best_keeps_model_and_meta_but_not_its_optimizer_shards(tmp_path):
    run = tmp_path / "run"
    for s in (1, 2, 3):
        _fake_step(run, s, world=2)
    ckpt.atomic_write_json(run / "best.json", {"step": 1, "val_loss": 1.0})
    assert ckpt.drop_old_best_optimizer(run, keep_last=3) is None  # still among the newest
    # The newest checkpoint from before the warmdown stays resumable: an extended run resumes it.
    assert ckpt.drop_old_best_optimizer(run, keep_last=2, keep_step=1) is None
    assert ckpt.prune(run, keep_last=1, keep_step=2) == [] and ckpt.complete_steps(run) == [1, 2, 3]
    assert ckpt.drop_old_best_optimizer(run, keep_last=2) == 1
    assert ckpt.drop_old_best_optimizer(run, keep_last=2) is None  # nothing left to drop
    assert sorted(p.name for p in run.iterdir() if "_000001" in p.name) == [
        "meta_000001.json", "model_000001_rank0.pt", "model_000001_rank1.pt"]
    assert ckpt.complete_steps(run) == [1, 2, 3] and not ckpt.is_resumable(run, 1)
    ckpt.meta_path(run, 2).unlink()
    ckpt.meta_path(run, 3).unlink()
    with pytest.raises(ckpt.CheckpointError, match="only checkpoints kept for serving"):
        ckpt.pick_resume_step(run, "auto")  # a fresh start would mix two runs in one directory


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
    model = GPT(tiny_config(prepared.meta["vocab_size"]))
    model.init_weights(seed=1)
    opt = ShardedOptimizer(model, **LRS)
    for _ in range(2):
        x = torch.randint(1, 20, (2, 32))
        model(x, x).backward()
        opt.step()
        model.zero_grad()
    run = tmp_path / "checkpoints" / "t"
    _save(run, model, opt, prepared, step=2, val_loss=1.5, best=(1.5, 2))
    return run, model, opt, prepared


def _save(run, model, opt, prepared, step, val_loss, best, cfg=None, log=None):
    st = RunState(step=step, tokens_seen=64 * step, used_seconds=2.5 * step, best_val=best[0], best_step=best[1],
                  data_state={"epoch": 0, "cursor": 4 * step})
    cfg = cfg or TrainConfig(model_tag="t")
    assert write_checkpoint(run, model, opt, st, val_loss, checkpoint_meta(cfg, prepared, 60.0),
                            Dist(0, 0, 1, torch.device("cpu"))) is None
    log = log or RunLog(None)
    log(f"saved step {step:06d}" + ckpt.retain(run, Retention(cfg.keep_last, bool(cfg.keep_best_optimizer)), log))


def test_checkpoint_round_trip_gives_identical_logits_and_state(saved_run):
    run, model, opt, _ = saved_run
    assert json.loads((run / "best.json").read_text()) == {"step": 2, "val_loss": 1.5, "weights": "raw"}
    loaded, meta = ckpt.load_model(ckpt.model_path(run, 2))
    x = torch.randint(1, 20, (2, 32))
    assert torch.equal(loaded(x), model.eval()(x))
    assert meta["data_positions"] == [{"epoch": 0, "cursor": 8}] and meta["world_size"] == meta["model_parts"] == 1
    assert [p.name for p in run.glob("model_*")] == ["model_000002.pt"]

    fresh = GPT(model.config)
    fresh_opt = ShardedOptimizer(fresh, **LRS)
    st = restore_checkpoint(run, 2, fresh, fresh_opt, Dist(0, 0, 1, torch.device("cpu")))
    assert (st.step, st.tokens_seen, st.used_seconds, st.best_step) == (2, 128, 5.0, 2)
    a, b = opt.shard_state()["state"], fresh_opt.shard_state()["state"]
    assert a.keys() == b.keys() and all(torch.equal(a[n][k], b[n][k]) for n in a for k in a[n])


def test_a_rank_the_saved_world_lacked_resumes_with_a_random_stream_of_its_own(saved_run):
    """A resume on more ranks than saved the step: each new rank draws its own dropout masks, not
    rank 0's (every rank that repeats them trains on the same noise), and the same on every resume."""
    run, model, _, _ = saved_run

    def draws(rank: int, world: int) -> torch.Tensor:
        fresh = GPT(model.config)
        restore_checkpoint(run, 2, fresh, ShardedOptimizer(fresh, **LRS), Dist(rank, rank, world, torch.device("cpu")))
        return torch.rand(8)

    saved, new1, new2 = draws(0, 1), draws(1, 3), draws(2, 3)
    assert not torch.equal(new1, saved) and not torch.equal(new2, saved) and not torch.equal(new1, new2)
    assert torch.equal(draws(2, 3), new2) and torch.equal(draws(0, 3), saved)


def test_serving_resolution_prefers_best_and_refuses_incomplete(saved_run, tmp_path):
    run, _, _, _ = saved_run
    assert ckpt.resolve_serving_checkpoint(run, tmp_path) == ckpt.model_path(run, 2)
    assert ckpt.resolve_serving_checkpoint(None, tmp_path) == ckpt.model_path(run, 2)
    _fake_step(run, 9, complete=False)
    with pytest.raises(ckpt.CheckpointError, match="incomplete checkpoint"):
        ckpt.load_model(ckpt.model_path(run, 9))
    with pytest.raises(ckpt.CheckpointError, match="no complete checkpoint"):
        ckpt.resolve_serving_checkpoint(None, tmp_path / "elsewhere")


def test_a_step_saved_in_parts_is_served_from_any_of_its_names(saved_run, tmp_path):
    run, model, _, _ = saved_run
    # The layout two ranks write: each rank's owned parameters in its own file, meta naming 2 parts.
    parts = tmp_path / "checkpoints" / "parts"
    parts.mkdir()
    full = ckpt.load_model_state(run, 2)
    owner = partition({n: t.numel() for n, t in full.items()}, 2)
    for r in range(2):
        ckpt.atomic_torch_save(ckpt.model_part_path(parts, 2, r), ckpt.model_part(full, owner, r))
    meta = ckpt.read_meta(run, 2)
    meta = {k: v for k, v in meta.items() if k != "files"}  # written by hand: no record of the parts' sums
    ckpt.atomic_write_json(ckpt.meta_path(parts, 2), {**meta, "world_size": 2, "model_parts": 2})
    ckpt.atomic_write_json(parts / "best.json", {"step": 2, "val_loss": 1.5})

    merged = ckpt.load_model_state(parts, 2)
    assert merged.keys() == full.keys() and all(torch.equal(merged[n], full[n]) for n in full)
    x = torch.randint(1, 20, (2, 32))
    expected = model.eval()(x)
    named = ckpt.model_path(parts, 2)  # what the trainer prints: it names the step, no such file exists
    for given in (parts, named, ckpt.model_part_path(parts, 2, 1), None):
        path = ckpt.resolve_serving_checkpoint(given, tmp_path)
        assert path == (named if given in (parts, None) else given)
        assert torch.equal(ckpt.load_model(path)[0](x), expected)

    ckpt.model_part_path(parts, 2, 1).unlink()
    with pytest.raises(ckpt.CheckpointError, match="model_000002_rank1.pt: missing"):
        ckpt.load_model(named)
    with pytest.raises(ckpt.CheckpointError, match="no such checkpoint file"):
        ckpt.resolve_serving_checkpoint(ckpt.model_path(parts, 3), tmp_path)


@pytest.mark.parametrize("keep_best_optimizer", [0, 1])
def test_retention_keeps_an_old_best_for_serving_and_resume_skips_it(saved_run, keep_best_optimizer):
    run, model, opt, prepared = saved_run  # step 2 is the best
    cfg, lines = TrainConfig(keep_last=1, keep_best_optimizer=keep_best_optimizer), []
    for step in (3, 4):
        _save(run, model, opt, prepared, step, val_loss=2.0, best=(1.5, 2), cfg=cfg, log=lines.append)
    assert ckpt.complete_steps(run) == [2, 4] and ckpt.read_best(run)["step"] == 2
    assert ckpt.load_model(ckpt.resolve_serving_checkpoint(run, run))[1]["step"] == 2  # still served
    assert ckpt.optim_path(run, 2, 0).exists() == bool(keep_best_optimizer)
    assert ckpt.pick_resume_step(run, "auto") == 4
    if keep_best_optimizer:
        assert ckpt.pick_resume_step(run, "2") == 2 and not any("dropped" in line for line in lines)
    else:
        assert lines[0].startswith("saved step 000003") and lines[0].endswith(
            "; dropped the optimizer shards of best step 000002 (kept for serving, not resuming)")
        with pytest.raises(ckpt.CheckpointError, match=r"--resume 2: step 000002 .* kept for serving only \(its "
                           r"optimizer shards were dropped; set KEEP_BEST_OPTIMIZER=1 to keep them\)"):
            ckpt.pick_resume_step(run, "2")
        ckpt.optim_path(run, 4, 0).unlink()  # were the newest one not resumable either, auto would skip it too
        ckpt.atomic_write_json(ckpt.meta_path(run, 1), {"step": 1, "world_size": 1})
        ckpt.optim_path(run, 1, 0).write_bytes(b"o")
        assert ckpt.pick_resume_step(run, "auto") == 1


LOAD_PEAK = """
import resource, sys, torch
from experiment import checkpoint as ckpt
def rss(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
ckpt.load_model(sys.argv[2])  # a tiny one first: the first load's imports are ~80 MB of their own
before = rss()
model, meta = ckpt.load_model(sys.argv[1])
total = sum(float(p.detach().float().sum()) for p in model.parameters())  # touch every weight
print(rss() - before, next(model.parameters()).dtype, total)
"""


@pytest.mark.slow
def test_a_bf16_checkpoint_loads_as_bf16_in_about_one_copy_of_its_weights(tmp_path):
    """The server's load: no fp32 model built and initialized first, no second copy of the weights."""
    import subprocess
    import sys

    from experiment.model import build_model

    def save(run, depth):
        config = GPTConfig(vocab_size=256, depth=depth, aspect_ratio=64, head_dim=64, max_seq_len=64)
        model = build_model(config, dtype=torch.bfloat16, seed=1)
        run.mkdir()
        ckpt.atomic_torch_save(ckpt.model_path(run, 1), model.state_dict())
        ckpt.atomic_write_json(ckpt.meta_path(run, 1), {"step": 1, "model_config": config.to_dict(),
                                                        "weights_dtype": "bfloat16", "model_parts": 1})
        return model

    model = save(tmp_path / "big", depth=8)  # 25M params
    save(tmp_path / "tiny", depth=1)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    out = subprocess.run([sys.executable, "-c", LOAD_PEAK, str(ckpt.model_path(tmp_path / "big", 1)),
                          str(ckpt.model_path(tmp_path / "tiny", 1))], cwd=REPO, env=ENV,
                         capture_output=True, text=True, check=True).stdout.split()
    grown, dtype, total = int(out[0]), out[1], float(out[2])
    assert dtype == "torch.bfloat16"
    assert total == pytest.approx(sum(float(p.detach().float().sum()) for p in model.parameters()), rel=1e-6)
    # An fp32 model built and initialized first, then the file read and copied in, is 3 copies of the
    # bf16 weights (the loader before this one: 2.9x; this one 1.04x).
    assert grown < 1.5 * weights, f"load grew RSS by {grown / weights:.2f}x the {weights / 2**20:.0f} MiB of weights"


def test_the_meta_records_each_files_size_and_crc_and_damage_is_found(saved_run):
    run, model, opt, prepared = saved_run
    files = ckpt.read_meta(run, 2)["files"]
    assert sorted(files) == ["model_000002.pt", "optim_000002_rank0.pt"]
    for name, info in files.items():
        assert info == ckpt.file_sum(run / name)  # summed on the way out = what is on disk
    assert ckpt.damaged_files(run, 2) == []
    path = ckpt.model_path(run, 2)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit in the middle: same size
    path.write_bytes(bytes(data))
    assert ckpt.damaged_files(run, 2) == [f"{path}: CRC-32 differs from the one its meta records"]
    path.write_bytes(bytes(data[:100]))  # a partial copy
    assert ckpt.damaged_files(run, 2, prefix="model_") == [f"{path}: 100 bytes, its meta records {len(data):,}"]
    with pytest.raises(ckpt.CheckpointError, match="step 000002 is damaged: .*100 bytes"):
        ckpt.load_model(path)  # the server's and sample's loader
    with pytest.raises(ckpt.CheckpointError, match="damaged"):
        ckpt.export_model(path, run / "best.pt")


def test_resume_falls_back_to_the_newest_intact_step_and_says_which_file_is_damaged(saved_run):
    run, model, opt, prepared = saved_run
    _save(run, model, opt, prepared, step=4, val_loss=1.4, best=(1.4, 4))
    ckpt.optim_path(run, 4, 0).write_bytes(b"truncated")
    lines = []
    assert ckpt.pick_resume_step(run, "auto", lines.append) == 2
    assert lines == [f"warning: checkpoint step 000004 is damaged ({ckpt.optim_path(run, 4, 0)}: 9 bytes, its meta "
                     f"records {ckpt.read_meta(run, 4)['files']['optim_000004_rank0.pt']['bytes']:,}); trying an older one"]
    with pytest.raises(ckpt.CheckpointError, match="--resume 4: step 000004 is damaged"):
        ckpt.pick_resume_step(run, "4")
    assert ckpt.pick_resume_step(run, "auto", lines.append, quarantine=True) == 2  # the trainer's rank 0
    assert ckpt.complete_steps(run) == [2] and (run / "meta_000004.json.damaged").is_file()
    ckpt.model_path(run, 2).write_bytes(b"")
    with pytest.raises(ckpt.CheckpointError, match="every resumable checkpoint is damaged \\(steps 000002"):
        ckpt.pick_resume_step(run, "auto", lines.append)


def test_an_export_is_one_bf16_file_that_serves_the_same_model(saved_run, tmp_path):
    from experiment import export
    from experiment.server import Engine

    run, model, _, _ = saved_run
    out, facts = export.export(run, tmp_path / "dl" / "model.pt", tmp_path)
    assert facts["step"] == 2 and facts["bytes"] == out.stat().st_size == ckpt.file_sum(out)["bytes"]
    assert "serve it: bash run.sh serve --checkpoint" in export.describe(out, facts)
    loaded, meta = ckpt.load_model(out)
    assert loaded.wte.weight.dtype == torch.bfloat16 and meta["step"] == 2 and meta["weights_dtype"] == "bfloat16"
    x = torch.randint(1, 20, (2, 32))
    bf16 = GPT(model.config)
    bf16.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    assert torch.equal(loaded.float()(x), bf16.eval()(x))  # exactly the weights, rounded to bf16 once
    assert ckpt.resolve_serving_checkpoint(out, tmp_path) == out
    engine = Engine(loaded, meta, out, torch.device("cpu"), max_batch=2)
    try:
        assert engine.model_id == "t" and engine.info()["step"] == 2  # the run's name, though the file moved
    finally:
        engine.close()
    out.write_bytes(out.read_bytes()[:1000])
    with pytest.raises(ckpt.CheckpointError, match="cannot read it"):
        ckpt.load_model(out)
    assert export.main(["--checkpoint", str(tmp_path / "nowhere")]) == 2


def test_a_file_that_is_no_model_is_named_as_such_not_as_torchs_load_error(tmp_path):
    """A run directory holds more than models: `serve --checkpoint RUN/gen*` picks up its
    generations.json. That file is named as no model file, before torch tries to read it."""
    other = tmp_path / "generations.json"
    other.write_text('{"generations": []}')
    for read in (ckpt.load_model, ckpt.model_meta):
        with pytest.raises(ckpt.CheckpointError, match=r"generations\.json: not a model file: expected model_<step>\.pt"):
            read(other)
    four = tmp_path / "four.pt"  # four bytes, not the zip's signature: no model, not a short one
    four.write_bytes(b"abcd")
    with pytest.raises(ckpt.CheckpointError, match=r"four\.pt: not a model file"):
        ckpt.load_model(four)
    for name, obj in (("none.pt", None), ("dict.pt", {"a": 1})):  # torch's zips, but no export
        torch.save(obj, tmp_path / name)
        with pytest.raises(ckpt.CheckpointError, match=rf"{name[:-3]}\.pt: expected model_<step>\.pt"):
            ckpt.load_model(tmp_path / name)
    with pytest.raises(ckpt.CheckpointError, match=r"missing\.pt: no such file"):
        ckpt.model_meta(tmp_path / "missing.pt")
    cut = tmp_path / "model.pt"  # an interrupted download: too short to say what it was
    cut.write_bytes(b"PK\x03")  # a byte short of the zip's 4-byte signature
    with pytest.raises(ckpt.CheckpointError, match=r"model\.pt: cannot read it \(empty or truncated: 3 bytes\)"):
        ckpt.load_model(cut)


def test_a_file_it_may_not_open_is_a_checkpoint_error_not_a_traceback(tmp_path, monkeypatch):
    """sample, bench and the ensemble tools catch CheckpointError: a file the user may not read
    (root ignores mode bits, so the refusal is simulated) is one line naming it."""
    from pathlib import Path

    locked = tmp_path / "model.pt"
    locked.write_bytes(b"PK\x03\x04")

    def refuse(self, *a, **k):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "open", refuse)
    with pytest.raises(ckpt.CheckpointError, match=r"model\.pt: cannot read it \(\[Errno 13\] Permission denied"):
        ckpt.load_model(locked)


def test_a_write_the_disk_refuses_is_an_os_error_and_leaves_the_previous_file(tmp_path, monkeypatch):
    """The full disk's path without root (the real tmpfs tests need it; tests/README.md): the file
    accepts 64 kB, then refuses with ENOSPC as a full volume does. torch.save's zip writer reports
    that as a RuntimeError; atomic_torch_save makes it the OSError every caller handles, the temp
    file goes, and the previous file stays whole."""
    import errno
    import io
    import os

    from experiment import files

    path = tmp_path / "model_000001.pt"
    ckpt.atomic_torch_save(path, {"w": torch.ones(2)})
    fdopen = os.fdopen

    class Full(io.RawIOBase):
        def __init__(self, f):
            self.f, self.room = f, 64 * 1024

        def writable(self):
            return True

        def write(self, data):
            if len(data) > self.room:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.room -= len(data)
            return self.f.write(data)

        def flush(self):
            self.f.flush()

        def fileno(self):
            return self.f.fileno()

        def close(self):
            super().close()
            self.f.close()

    monkeypatch.setattr(files.os, "fdopen", lambda fd, mode: Full(fdopen(fd, mode)))
    with pytest.raises(OSError, match="writing .*model_000001.pt failed"):
        ckpt.atomic_torch_save(path, {"w": torch.randn(100_000)})
    monkeypatch.undo()
    assert torch.equal(ckpt.load_tensors(path)["w"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["model_000001.pt"]


def test_a_checkpoint_without_the_warmups_progress_resumes_past_them():
    # written before the early-schedule warmups: a resume under way must not switch to them mid-run
    assert ckpt.run_state({"state": {"step": 40, "tokens_seen": 163840}}).warmup_progress == 1.0
    assert ckpt.run_state({"state": {"step": 4, "warmup_progress": 0.12}}).warmup_progress == 0.12


def test_a_checkpoint_written_before_the_eval_grid_was_saved_counts_its_evals_from_the_resumed_step():
    st = ckpt.run_state({"state": {"step": 40, "tokens_seen": 163840, "last_eval_step": 30}})
    assert (st.last_eval_step, st.last_eval_tokens) == (40, 163840)
    st = ckpt.run_state({"state": {"step": 40, "tokens_seen": 163840, "last_eval_step": 30, "last_eval_tokens": 9}})
    assert (st.last_eval_step, st.last_eval_tokens) == (30, 9)  # a saved grid is kept


def test_best_json_names_the_metric_that_chose_it_and_a_sweep_directory_serves_its_winner(tmp_path):
    state = {"best_by": "acc", "best_score": -0.75, "best_step": 5}
    assert ckpt.best_record(5, 1.2, {"weights": "average", "state": state}) == {
        "step": 5, "val_loss": 1.2, "weights": "average", "best_by": "acc", "score": -0.75}
    assert ckpt.best_record(5, 1.2, {"state": {**state, "best_by": "val_loss"}}) == {
        "step": 5, "val_loss": 1.2, "weights": "raw"}
    sweep_dir = tmp_path / "checkpoints" / "sweep"
    assert ckpt.sweep_winner(sweep_dir) is None  # no sweep.json: no sweep
    for name, step, val in (("a", 2, 1.5), ("b", 4, 1.2), ("c", None, None)):
        (sweep_dir / name).mkdir(parents=True)
        if step is not None:
            meta = {"step": step, "val_loss": val, "state": {"best_val": val, "best_step": step}, "world_size": 1,
                    "model_parts": 1}
            assert ckpt.save_checkpoint(sweep_dir / name, step, {"w": torch.ones(2)}, {}, meta) is None
    (sweep_dir / "d").mkdir()
    (sweep_dir / "d" / "best.json").write_text("{damaged")  # a member's damaged best.json: no best of its own
    (sweep_dir / "sweep.json").write_text(json.dumps({"members": [{"member": m} for m in "abcd"], "winner": "a"}))
    assert ckpt.sweep_winner(sweep_dir) == sweep_dir / "b"  # found afresh from the members' best.json
    assert ckpt.resolve_serving_checkpoint(sweep_dir, tmp_path) == ckpt.model_path(sweep_dir / "b", 4)
    assert ckpt.resolve_serving_checkpoint(None, tmp_path) == ckpt.model_path(sweep_dir / "b", 4)
    (sweep_dir / "sweep.json").write_text(json.dumps({"members": [{"member": "c"}]}))
    with pytest.raises(ckpt.CheckpointError, match="the sweep has no winner yet"):
        ckpt.sweep_winner(sweep_dir)


def test_a_sweeps_winner_is_the_lowest_score_when_one_metric_chose_every_best_else_the_lowest_val_loss(tmp_path):
    a = {"val_loss": 1.2, "best_by": "zeta", "score": -0.5}
    b = {"val_loss": 1.5, "best_by": "zeta", "score": -0.9}
    assert ckpt.pick_winner([("a", a), ("b", b), ("c", None)]) == "b"  # one metric: its score
    assert ckpt.pick_winner([("a", a), ("b", {**b, "best_by": "acc"})]) == "a"  # two metrics: the val loss
    assert ckpt.pick_winner([("a", {"val_loss": 1.2}), ("b", {"val_loss": 1.1})]) == "b"
    assert ckpt.pick_winner([("a", {"val_loss": float("nan")}), ("c", None)]) is None
    assert ckpt.best_record(3, 1.0, {"state": {"best_by": "zeta", "best_score": -2.0, "best_step": 3}})["score"] == -2.0
    # an old meta with its state at the top level: its best is its val loss, and so is the score
    flat = {"step": 9, "best_val_loss": 1.25, "best_step": 6, "tokens_seen": 90, "used_seconds": 3.0,
            "data_positions": [{"cursor": 1}]}
    st = ckpt.run_state(flat)
    assert (st.best_val, st.best_score, st.best_step) == (1.25, 1.25, 6)
    assert ckpt.run_state({**flat, "best_step": -1}).best_score == float("inf")
    nested = {"state": {"best_val": 1.5, "best_step": 4}}  # written before BEST_BY: scored by its val loss
    assert ckpt.run_state(nested).best_score == 1.5
    assert ckpt.run_state({"state": {**nested["state"], "best_score": -0.5, "best_by": "acc"}}).best() == (
        1.5, 4, "raw", -0.5)
    # a sweep without a winner yet among the runs: the newest run is served, never an error
    run = tmp_path / "checkpoints" / "plain"
    run.mkdir(parents=True)
    meta = {"step": 2, "val_loss": 1.0, "state": {"best_val": 1.0, "best_step": 2}, "world_size": 1, "model_parts": 1}
    assert ckpt.save_checkpoint(run, 2, {"w": torch.ones(2)}, {}, meta) is None
    (tmp_path / "checkpoints" / "sweep" / "x").mkdir(parents=True)
    (tmp_path / "checkpoints" / "sweep" / "x" / "best.json").write_text("{damaged")  # no best to compare
    (tmp_path / "checkpoints" / "sweep" / "sweep.json").write_text(json.dumps({"members": [{"member": "x"}]}))
    (tmp_path / "checkpoints" / "empty").mkdir()  # a run directory with no checkpoint yet
    assert ckpt.resolve_serving_checkpoint(None, tmp_path) == ckpt.model_path(run, 2)
