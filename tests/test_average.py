"""The weight average (AVERAGE=ema): the power-function EMA it defines, evaluated beside the raw
weights without changing training, the better of the two saved as best and served, carried in the
optimizer shards through a crash and a resume and to another world size, and counted in the memory
plan."""

import json
import math
import re
import shutil

import pytest
import torch

from conftest import TINY, run_train, tiny_config
from test_optim import fake_grads, make_model, run_steps

from experiment import checkpoint as ckpt
from experiment.average import MAX_WIDTH, WeightAverage, gamma_for, width_of
from experiment.config import ConfigError, TrainConfig, resolve
from experiment.memory import checkpoint_bytes_per_rank, count_params, plan_memory, staged_bytes_per_rank
from experiment.model import GPTConfig
from experiment.optim import LRS, ShardedOptimizer
from experiment.runlog import report_eval

AVERAGE = ["--average", "ema", "--average_width", "0.2887"]
# A constant LR far too high for the tiny model: the raw weights bounce, and their average wins.
BOUNCING = ["--matrix_lr", "1.0", "--embedding_lr", "0.5", "--unembedding_lr", "0.5", "--warmdown_frac", "0",
            "--plateau_evals", "0"]


def _averaged(width=0.1, every=1, **kw):
    model = make_model()
    opt = ShardedOptimizer(model, **kw, **LRS)
    opt.average = WeightAverage(opt, width, every=every)
    return model, opt


def test_width_and_gamma_invert_each_other():
    for width in (0.01, 0.05, 0.1, 0.2, 0.28):
        assert width_of(gamma_for(width)) == pytest.approx(width, rel=1e-9)
    assert width_of(0) == pytest.approx(MAX_WIDTH, abs=1e-4)  # the widest there is
    assert gamma_for(0.1) == pytest.approx(6.94, abs=0.01)  # Karras et al.'s sigma_rel 0.10


def test_the_average_is_the_power_function_ema():
    """avg_t = b_t avg_(t-1) + (1 - b_t) w_t with b_t = (1 - 1/t)^(gamma + 1): the first update
    copies the weights, and each later one folds them in at that weight."""
    model, opt = _averaged(0.1)
    gamma, expected = gamma_for(0.1), None
    for t in range(1, 9):
        fake_grads(model, t)
        opt.step()
        opt.average.update(t)
        w = {n: p.detach().clone() for n, p in model.named_parameters()}
        beta = (1 - 1 / t) ** (gamma + 1)
        expected = w if expected is None else {n: beta * expected[n] + (1 - beta) * w[n] for n in w}
        if t == 1:
            assert all(torch.equal(opt.average.values[n], w[n]) for n in w)
    for n, v in expected.items():
        torch.testing.assert_close(opt.average.values[n], v, rtol=1e-6, atol=1e-7, msg=n)
    assert not torch.allclose(opt.average.values["lm_head.weight"], model.lm_head.weight)


def test_folding_every_k_steps_equals_every_step_while_the_weights_stand_still():
    """A fold k steps after the last carries the k per-step decays at once (the host copy's schedule)."""
    values = {}
    for every in (1, 4):
        model, opt = _averaged(0.2, every=every)
        for t in range(1, 13):
            if (t - 1) % 4 == 0:  # the weights change only just after each fold of every=4
                fake_grads(model, t)
                opt.step()
            opt.average.update(t)  # every=4 folds at t = 4, 8, 12 only
        values[every] = opt.average.values
    # every=1 folds the same weights 4 times in a row; every=4 folds them once: the same average.
    # Checked at t = 12, after the fold of t = 12 in both.
    for n in values[1]:
        torch.testing.assert_close(values[4][n], values[1][n], rtol=1e-5, atol=1e-6, msg=n)


def test_the_average_skips_steps_between_folds():
    model, opt = _averaged(0.1, every=10)
    run_steps(model, opt, 3)
    before = {n: v.clone() for n, v in opt.average.values.items()}
    for t in range(1, 10):
        opt.average.update(t)
    assert all(torch.equal(before[n], v) for n, v in opt.average.values.items())
    opt.average.update(10)  # the first fold copies
    assert all(torch.equal(v, model.get_parameter(n)) for n, v in opt.average.values.items())


@pytest.mark.parametrize("master", [False, True])
def test_swapped_in_holds_the_average_and_then_the_weights_bit_for_bit(master):
    model, opt = _averaged(0.2, master_weights=master)
    if master:  # as the trainer does: the optimizer is made on fp32 weights, then the model cast
        model.to(torch.bfloat16)
    for t in range(1, 6):
        gen = torch.Generator().manual_seed(t)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()
        opt.average.update(t)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    with opt.average.swapped_in():
        for n, p in model.named_parameters():
            assert torch.equal(p, opt.average.values[n].to(p.dtype)), n
        assert not torch.equal(model.lm_head.weight, weights["lm_head.weight"])
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())


def test_the_average_travels_in_the_shards_to_any_world_size():
    """Two ranks' shards (each its owned parameters' averages) load into one rank, and back into three."""
    shards = []
    for rank in range(2):
        model, opt = _averaged(0.1, rank=rank, world_size=2, communicate=False)
        run_steps(model, opt, 3)
        for t in range(1, 4):
            opt.average.update(t)
        shards.append(opt.shard_state())
    saved = {n: s["average"] for shard in shards for n, s in shard["state"].items()}
    assert set(saved) == {n for n, _ in make_model().named_parameters()}
    for world in (1, 3):
        for rank in range(world):
            _, opt = _averaged(0.1, rank=rank, world_size=world, communicate=False)
            opt.load_shards(shards)
            assert opt.average.values and all(torch.equal(v, saved[n]) for n, v in opt.average.values.items())
            assert all("average" not in s for o in opt.optimizers for s in o.state.values())  # not optimizer state


def test_a_shard_without_averages_starts_them_from_its_weights():
    model = make_model()
    opt = ShardedOptimizer(model, **LRS)
    run_steps(model, opt, 3)
    shard = opt.shard_state()  # a run without AVERAGE
    fresh, averaged = _averaged(0.1)
    averaged.load_shards([shard])
    assert all(torch.equal(v, shard["state"][n]["master"]) for n, v in averaged.average.values.items())
    assert not torch.equal(fresh.lm_head.weight, make_model().lm_head.weight)


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _evals(run_dir):
    return [r for r in _records(run_dir) if r["kind"] == "eval"]


def test_the_better_of_raw_and_average_is_saved_as_best_and_served(tmp_path, corpus):
    run_train([*TINY, "--data_dir", corpus, "--workspace", tmp_path, "--max_steps", 30, "--total_batch_size", 256,
               "--eval_every_steps", 5, "--save_every_steps", 5, "--keep_last", 10, "--keep_best_optimizer", 1,
               *AVERAGE, *BOUNCING])
    run_dir = tmp_path / "checkpoints/d2"
    evals = _evals(run_dir)
    assert len(evals) == 7
    for r in evals:
        assert r["val_loss"] == min(r["val_loss_raw"], r["val_loss_average"])
        assert r["weights"] == ("average" if r["val_loss_average"] < r["val_loss_raw"] else "raw")
    assert any(r["weights"] == "average" for r in evals[1:])
    saved = {r["step"]: r for r in evals[1:]}
    best = min(saved.values(), key=lambda r: r["val_loss"])
    assert ckpt.read_best(run_dir) == {"step": best["step"], "val_loss": best["val_loss"], "weights": best["weights"]}
    for step, r in saved.items():  # each checkpoint's model holds what its eval chose
        model = ckpt.load_model_state(run_dir, step)
        shard = ckpt.load_tensors(ckpt.optim_path(run_dir, step, 0))["state"]
        assert ckpt.read_meta(run_dir, step)["weights"] == r["weights"]
        for n, s in shard.items():
            assert torch.equal(model[n], s[r["weights"] if r["weights"] == "average" else "master"]), (step, n)
    served = torch.load(run_dir / "best.pt", weights_only=True)  # the export of the best: bf16
    shard = ckpt.load_tensors(ckpt.optim_path(run_dir, best["step"], 0))["state"]
    key = "average" if best["weights"] == "average" else "master"
    assert all(torch.equal(served["model"][n], s[key].to(torch.bfloat16)) for n, s in shard.items())
    log = (run_dir / "training.log").read_text()
    assert re.search(r"val_loss [\d.]+ \(the average; raw weights [\d.]+\)", log)
    report = (run_dir / "report.md").read_text()
    assert ("the weight average" in report) == (best["weights"] == "average")


def test_without_average_nothing_is_evaluated_twice_or_named(tmp_path, corpus):
    run_train([*TINY, "--data_dir", corpus, "--workspace", tmp_path, "--max_steps", 10, "--total_batch_size", 256,
               "--eval_every_steps", 5])
    run_dir = tmp_path / "checkpoints/d2"
    assert all("val_loss_average" not in r for r in _evals(run_dir))
    assert ckpt.read_best(run_dir)["weights"] == "raw"
    log = (run_dir / "training.log").read_text()
    assert "val_loss 4." in log and not re.search(r"raw weights|the average|weight average|^average \|", log, re.M)


@pytest.mark.parametrize("nproc", [1, 2])
def test_averaging_never_changes_training(tmp_path, corpus, nproc):
    """The eval swaps the average in and the weights back bit for bit, on every rank: the raw weights
    after the run are those of a run without it."""
    common = [*TINY, "--data_dir", corpus, "--max_steps", 12, "--total_batch_size", 256, "--eval_every_steps", 3,
              *BOUNCING]
    run_train([*common, "--workspace", tmp_path / "a", *AVERAGE], nproc=nproc)
    run_train([*common, "--workspace", tmp_path / "plain"], nproc=nproc)
    a, plain = tmp_path / "a/checkpoints/d2", tmp_path / "plain/checkpoints/d2"
    assert any(r["weights"] == "average" for r in _evals(a))  # the swap was used
    for rank in range(nproc):
        sa, sp = (ckpt.load_tensors(ckpt.optim_path(d, 12, rank))["state"] for d in (a, plain))
        assert sa.keys() == sp.keys()
        for n in sa:
            assert torch.equal(sa[n]["master"], sp[n]["master"]), n
            assert "average" in sa[n] and "average" not in sp[n]
    assert [r["val_loss_raw"] for r in _evals(a)] == [r["val_loss"] for r in _evals(plain)]


def test_an_averaged_run_resumed_after_a_crash_equals_the_uninterrupted_run(tmp_path, corpus):
    common = [*TINY, "--data_dir", corpus, "--max_steps", 12, "--save_every_steps", 6, "--eval_every_steps", 3,
              "--total_batch_size", 256, *AVERAGE, *BOUNCING]
    run_train([*common, "--workspace", tmp_path / "a"])
    a_dir, b_dir = tmp_path / "a/checkpoints/d2", tmp_path / "b/checkpoints/d2"
    shutil.copytree(a_dir, b_dir)
    ckpt.meta_path(b_dir, 12).unlink()  # as if killed while saving step 12
    proc = run_train([*common, "--workspace", tmp_path / "b"])
    assert "resumed from" in proc.stdout and "step 6," in proc.stdout
    a, b = (ckpt.load_tensors(ckpt.optim_path(d, 12, 0))["state"] for d in (a_dir, b_dir))
    for n in a:
        assert torch.equal(a[n]["average"], b[n]["average"]) and torch.equal(a[n]["master"], b[n]["master"]), n
    ma, mb = (ckpt.load_model_state(d, 12) for d in (a_dir, b_dir))
    assert all(torch.equal(ma[n], mb[n]) for n in ma)
    assert ckpt.read_best(a_dir) == ckpt.read_best(b_dir)


def test_bad_average_settings_are_named(tmp_path, corpus):
    for name, value, words in (("average", "swa", "must be one of none, ema, got 'swa'"),
                               ("average_width", 0.0, "must lie in (0, 0.2887], got 0.0"),
                               ("average_width", 0.3, "must lie in (0, 0.2887], got 0.3")):
        with pytest.raises(ConfigError, match="^" + re.escape(f"--{name} {words}")):
            resolve(TrainConfig(**{name: value}), cuda=False, world_size=1)
    assert resolve(TrainConfig(), cuda=True, world_size=1).average == "none"
    proc = run_train([*TINY, "--data_dir", corpus, "--workspace", tmp_path, "--average", "EMA"], check=False)
    assert proc.returncode == 2 and "--average must be one of none, ema, got 'EMA'" in proc.stderr
    assert not list(tmp_path.rglob("*.pt"))


def test_the_memory_plan_counts_the_average():
    config = tiny_config()
    for world in (1, 2):
        plain = plan_memory(config, world, 4, 32, "bf16", False)
        with_it = plan_memory(config, world, 4, 32, "bf16", False, average=True)
        owned = plain.rows["fp32 masters"] // 8  # the most loaded rank's owned parameters
        assert "weight average" not in plain.rows and with_it.rows["weight average"] == 4 * owned
        parts = zip(checkpoint_bytes_per_rank(config, world, "bf16", average=True),
                    checkpoint_bytes_per_rank(config, world, "bf16"))
        assert sum(a[1] - b[1] for a, b in parts) == 4 * count_params(config)
        assert (sum(staged_bytes_per_rank(config, world, "bf16", pinned=False, average=True))
                - sum(staged_bytes_per_rank(config, world, "bf16", pinned=False))) == 4 * count_params(config)


def test_d64_on_eight_80gb_gpus_keeps_its_average_in_host_memory():
    """The plan's d64 mode (bf16 + fp32 masters + recompute, batch 2) fits 80 GiB, and not with the
    average beside it: the trainer then keeps the average on the host (train.weight_average)."""
    d64 = GPTConfig(vocab_size=256, depth=64, max_seq_len=2048, bigram_vocab=16384)
    gib80 = 80 * 2**30
    assert plan_memory(d64, 8, 2, 2048, "bf16", True).fits(gib80)
    assert not plan_memory(d64, 8, 2, 2048, "bf16", True, average=True).fits(gib80)


def test_the_eval_line_names_the_weights_it_chose():
    lines = []
    st = ckpt.RunState(step=5, best_val=1.5, best_step=5, best_weights="average")
    record = report_eval(5, (1.6, 2.3, None), (1.5, 2.2, None), "average", st, (512, 1000, False), lines.append,
                         _Writer())
    assert lines[0].startswith("step 000005 | val_loss 1.5000 (the average; raw weights 1.6000) | val_bpc 2.2000 "
                               "| best 1.5000 @ 000005 (average)")
    assert record["val_loss"] == 1.5 and record["weights"] == "average" and record["val_loss_raw"] == 1.6
    report_eval(5, (1.4, 2.1, None), (1.5, 2.2, None), "raw", st, (512, 1000, False), lines.append, _Writer())
    assert "val_loss 1.4000 (raw weights; the average 1.5000) | val_bpc 2.1000" in lines[1]
    report_eval(5, (1.4, 2.1, None), None, "raw", st, (512, 1000, False), lines.append, _Writer())
    assert "val_loss 1.4000 | val_bpc 2.1000 | best 1.5000 @ 000005 |" in lines[2]
    assert not math.isnan(record["val_bpc"])


class _Writer:
    def add_scalar(self, *args):
        pass

    def flush(self):
        pass
