"""The weight average (AVERAGE=ema): the power-function EMA it defines, evaluated beside the raw
weights without changing training, the better of the two saved as best and served, carried in the
optimizer shards through a crash and a resume and to another world size, and counted in the memory
plan."""

import contextlib
import json
import math
import re
import shutil
from types import SimpleNamespace

import pytest
import torch

from conftest import TINY, run_train, tiny_config
from test_optim import fake_grads, make_model, run_steps
from test_report import FACTS
from test_saver import _trainer

from experiment import checkpoint as ckpt
from experiment import saving, train
from experiment.average import MAX_WIDTH, WeightAverage, gamma_for, width_of
from experiment.config import ConfigError, TrainConfig, parse_args, resolve
from experiment.dataloader import Prepared
from experiment.distributed import Dist
from experiment.evaluation import evaluate
from experiment.memory import checkpoint_bytes_per_rank, count_params, plan_memory, staged_bytes_per_rank
from experiment.hardware import DISK_WRITE_GBPS
from experiment.metric import BestBy
from experiment.model import GPT, GPTConfig, build_model
from experiment.saver import HOST_STAGING_FRACTION
from experiment.optim import LRS, ShardedOptimizer
from experiment.report import RunReport
from experiment.runlog import RunLog, report_eval
from experiment.trainer import Loop

AVERAGE = ["--average", "ema", "--average_width", "0.2886"]
CPU = Dist(0, 0, 1, torch.device("cpu"))
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


def test_the_average_records_no_autograd_graph():
    """The trainer folds outside no_grad, from parameters that require grad: the average must stay
    plain data (a graph would hold every step's weights alive)."""
    model, opt = _averaged(0.1)
    run_steps(model, opt, 2)
    assert torch.is_grad_enabled() and model.lm_head.weight.requires_grad
    opt.average.update(1)
    opt.average.update(2)
    opt.average.reset_to_weights(["lm_head.weight"])
    assert not any(v.requires_grad or v.grad_fn is not None for v in opt.average.values.values())


def test_the_average_lives_where_it_is_told():
    """Beside the weights by default; on the device given (host memory for a model too large for its GPU)."""
    model, opt = _averaged(0.1)
    assert {v.device.type for v in opt.average.values.values()} == {"cpu"}
    elsewhere = WeightAverage(opt, 0.1, torch.device("meta"), every=10)
    assert {v.device.type for v in elsewhere.values.values()} == {"meta"} and elsewhere.every == 10


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
        for t in range(1, 4):
            fake_grads(model, t)
            opt.step()
            opt.average.update(t)
        shards.append(opt.shard_state())
    saved = {n: s["average"] for shard in shards for n, s in shard["state"].items()}
    assert set(saved) == {n for n, _ in make_model().named_parameters()}
    assert not any(torch.equal(s["average"], s["master"]) for shard in shards for s in shard["state"].values())
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_without_average_nothing_is_evaluated_twice_or_named(tmp_path, corpus):
    run_train([*TINY, "--data_dir", corpus, "--workspace", tmp_path, "--max_steps", 10, "--total_batch_size", 256,
               "--eval_every_steps", 5])
    run_dir = tmp_path / "checkpoints/d2"
    assert all("val_loss_average" not in r for r in _evals(run_dir))
    assert ckpt.read_best(run_dir)["weights"] == "raw"
    log = (run_dir / "training.log").read_text()
    assert "val_loss 4." in log and not re.search(r"raw weights|the average|weight average|^average \|", log, re.M)


@pytest.mark.slow(seconds=20)
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
    # The average the eval measured is the one the shards hold, whole on every rank: assembled from
    # the ranks' shards and evaluated in one process, it gives the eval's loss.
    averages = {n: s["average"] for r in range(nproc)
                for n, s in ckpt.load_tensors(ckpt.optim_path(a, 12, r))["state"].items()}
    meta = ckpt.read_meta(a, 12)
    model = GPT(GPTConfig(**meta["model_config"]))
    model.load_state_dict({**model.state_dict(), **averages})
    loss, _, _ = evaluate(model, Prepared.load(meta["prepared"]["dir"]), 32, 4, 512, CPU)
    assert loss == pytest.approx(_evals(a)[-1]["val_loss_average"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_averaged_run_resumed_after_a_crash_equals_the_uninterrupted_run(tmp_path, corpus, precision):
    """The model files may hold the average; the resume trains on the shards' fp32 masters (in bf16,
    the weights are their cast) and goes on with the shards' averages."""
    common = [*TINY, "--data_dir", corpus, "--max_steps", 12, "--save_every_steps", 6, "--eval_every_steps", 3,
              "--total_batch_size", 256, "--precision", precision, *AVERAGE, *BOUNCING]
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
    assert ckpt.read_meta(a_dir, 6)["weights"] == "average"  # the resumed step's model files held the average


@pytest.mark.slow
def test_bad_average_settings_are_named(tmp_path, corpus):
    for name, value, words in (("average", "swa", "must be one of none, ema, auto, got 'swa'"),
                               ("average_width", 0.0, "must lie in (0, 0.2886], got 0.0"),
                               ("average_width", 0.3, "must lie in (0, 0.2886], got 0.3")):
        with pytest.raises(ConfigError, match="^" + re.escape(f"--{name} {words}")):
            resolve(TrainConfig(**{name: value}), cuda=False, world_size=1)
    assert resolve(TrainConfig(), cuda=True, world_size=1).average == "auto"  # by regime: tests/test_regime.py
    assert resolve(TrainConfig(average="ema", average_width=0.2886), cuda=False, world_size=1).average_width == 0.2886
    proc = run_train([*TINY, "--data_dir", corpus, "--workspace", tmp_path, "--average", "EMA"], check=False)
    assert proc.returncode == 2 and "--average must be one of none, ema, auto, got 'EMA'" in proc.stderr
    assert not list(tmp_path.rglob("*.pt"))


def test_the_memory_plan_counts_the_average():
    config = tiny_config()
    for world in (1, 2):
        plain = plan_memory(config, world, 4, 32, "bf16", False)
        with_it = plan_memory(config, world, 4, 32, "bf16", False, average=True)
        owned = plain.rows["fp32 masters"] // 8  # the most loaded rank's owned parameters
        assert "weight average" not in plain.rows and with_it.rows["weight average"] == (4 + 2) * owned  # + bf16 cast
        fp32 = plan_memory(config, world, 4, 32, "fp32", False, average=True)
        assert fp32.rows["weight average"] == 4 * owned  # no cast: the fp32 average is the weights' dtype
        parts = zip(checkpoint_bytes_per_rank(config, world, "bf16", average=True),
                    checkpoint_bytes_per_rank(config, world, "bf16"))
        assert sum(a[1] - b[1] for a, b in parts) == 4 * count_params(config)
        assert (sum(staged_bytes_per_rank(config, world, "bf16", pinned=False, average=True))
                - sum(staged_bytes_per_rank(config, world, "bf16", pinned=False))) == 4 * count_params(config)


def test_d64_on_eight_80gb_gpus_keeps_its_average_in_host_memory():
    """The plan's d64 mode (bf16 + fp32 masters + recompute, batch 2) fits 80 GiB, and not with the
    average beside it: the trainer then keeps the average on the host (memory.place_average)."""
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


@pytest.mark.slow
def test_the_first_step_copies_the_weights(tmp_path, corpus):
    run_train([*TINY, "--data_dir", corpus, "--workspace", tmp_path, "--max_steps", 1, "--total_batch_size", 256,
               *AVERAGE])
    shard = ckpt.load_tensors(ckpt.optim_path(tmp_path / "checkpoints/d2", 1, 0))["state"]
    assert all(torch.equal(s["average"], s["master"]) for s in shard.values())


class _Swap:
    @contextlib.contextmanager
    def swapped_in(self):
        yield


def _eval_at(step, last_saved_step, raw, average, monkeypatch):
    """train.maybe_eval at `step` with evaluate giving `raw`, then `average` (loss, bpc, None)."""
    results = iter([(raw, 1.0, None), (average, 1.0, None)])
    monkeypatch.setattr(train, "evaluate", lambda *args: next(results))
    st = ckpt.RunState(step=step, best_val=3.0, best_step=3, best_score=3.0)
    cfg = SimpleNamespace(max_seq_len=32, device_batch_size=4, eval_tokens=512, sample_tokens=0, plateau_evals=0)
    t = SimpleNamespace(cfg=cfg, st=st, opt=SimpleNamespace(average=_Swap()), model=None, prepared=None, d=CPU,
                        weights=None, report=SimpleNamespace(add=lambda r: None, write=lambda *a: None),
                        eval_coverage=(512, 1000, False), log=lambda line: None, writer=_Writer(), metric=None,
                        best_by=BestBy())
    loop = _loop(last_saved_step)
    train.maybe_eval(t, loop)
    return st, loop


def _loop(last_saved_step):
    return Loop(x=None, y=None, data_state={}, started=0.0, used_at_start=0.0, last_eval_time=0.0,
                last_save_time=0.0, last_saved_step=last_saved_step, last_complete_step=last_saved_step)


def test_a_step_saved_before_its_eval_stands_for_its_raw_weights(monkeypatch):
    """A preemption saves the raw weights and skips the eval, which the resume runs at that step: the
    checkpoint is not written again, so its eval, and the best it may set, are the raw weights'."""
    st, loop = _eval_at(9, 9, raw=2.0, average=1.5, monkeypatch=monkeypatch)
    assert (loop.weights, loop.val_loss, st.best_val, st.best_step, st.best_weights) == ("raw", 2.0, 2.0, 9, "raw")
    st, loop = _eval_at(9, 6, raw=2.0, average=2.0, monkeypatch=monkeypatch)  # a tie keeps the raw weights
    assert loop.weights == "raw"
    st, loop = _eval_at(9, 6, raw=1.5, average=2.0, monkeypatch=monkeypatch)  # the raw weights better
    assert (loop.weights, loop.val_loss, st.best_weights) == ("raw", 1.5, "raw")
    st, loop = _eval_at(1000, int("1000"), raw=2.0, average=1.5, monkeypatch=monkeypatch)  # equal, not identical
    assert loop.weights == "raw"
    st, loop = _eval_at(9, 6, raw=2.0, average=1.5, monkeypatch=monkeypatch)  # not saved yet: the better one
    assert (loop.weights, loop.val_loss, st.best_val, st.best_step, st.best_weights) == ("average", 1.5, 1.5, 9,
                                                                                          "average")


def test_an_evals_clock_counts_from_its_end_and_its_seconds_are_the_latest_and_the_slowest(monkeypatch):
    """The clock's next eval waits from the end of this one (stopping.eval_stretch), by this process's
    latest eval; the run's slowest is what the reserve and a resume's first cadence take."""
    clock = {"now": 1000.0}

    def evaluate(*args):  # each of the two evals (raw, average) takes 5 s
        clock["now"] += 5.0
        return (2.0, 1.0, None)

    def report_write(*args):  # so does writing the report, after the evals
        clock["now"] += 5.0

    monkeypatch.setattr(train.time, "time", lambda: clock["now"])
    monkeypatch.setattr(train, "evaluate", evaluate)
    st = ckpt.RunState(step=9, best_val=3.0, best_step=3, best_score=3.0, eval_seconds=30.0)
    cfg = SimpleNamespace(max_seq_len=32, device_batch_size=4, eval_tokens=512, sample_tokens=0, plateau_evals=0)
    t = SimpleNamespace(cfg=cfg, st=st, opt=SimpleNamespace(average=_Swap()), model=None, prepared=None, d=CPU,
                        weights=None, report=SimpleNamespace(add=lambda r: None, write=report_write),
                        eval_coverage=(512, 1000, False), log=lambda line: None, writer=_Writer(), metric=None,
                        best_by=BestBy())
    loop = _loop(6)
    train.maybe_eval(t, loop)
    assert (loop.last_eval_time, loop.eval_seconds, st.eval_seconds) == (1015.0, 15.0, 30.0)
    st.eval_seconds = 10.0
    train.maybe_eval(t, loop)
    assert (loop.last_eval_time, loop.eval_seconds, st.eval_seconds) == (1030.0, 15.0, 15.0)


def test_repairing_best_json_names_the_weights_that_step_holds(tmp_path):
    for step, weights in ((2, "raw"), (4, "average")):
        meta = {"step": step, "val_loss": 2.0, "state": {"best_val": 2.0, "best_step": 2}, "world_size": 1,
                "model_parts": 1, "weights": weights}
        assert ckpt.save_checkpoint(tmp_path, step, {"w": torch.ones(3)}, {}, meta) is None
    assert ckpt.read_best(tmp_path)["weights"] == "raw"
    assert ckpt.repair_best(tmp_path, 1.5, 4)  # a kill between step 4's meta and its best.json
    assert ckpt.read_best(tmp_path) == {"step": 4, "val_loss": 1.5, "weights": "average"}


def test_a_failed_best_save_falls_back_to_the_saved_best_and_its_weights(tmp_path):
    st, lines = ckpt.RunState(), []
    t, loop = _trainer(tmp_path, st, lines.append)

    def save(step, fails, weights):
        if fails:
            ckpt.optim_path(tmp_path, step, 0).mkdir()  # its shard cannot be written
        meta = {"step": step, "val_loss": loop.val_loss, "weights": weights, "world_size": 1, "model_parts": 1,
                "state": {"best_val": st.best_val, "best_step": st.best_step, "best_weights": st.best_weights}}
        t.saver.begin(step, {"w": torch.ones(10)}, {}, meta, background=False, context={"final": False})
        saving.finish_save(t, loop, wait=True)

    st.step, st.last_eval_step, loop.val_loss, loop.weights = 2, 2, 2.0, "average"
    st.best_val, st.best_step, st.best_weights = 2.0, 2, "average"
    save(2, fails=False, weights="average")
    st.step, st.last_eval_step, loop.val_loss, loop.weights = 3, 3, 1.5, "raw"
    st.best_val, st.best_step, st.best_weights = 1.5, 3, "raw"
    save(3, fails=True, weights="raw")
    assert (st.best_val, st.best_step, st.best_weights) == (2.0, 2, "average")
    assert ckpt.read_best(tmp_path) == {"step": 2, "val_loss": 2.0, "weights": "average"}


def test_the_saver_and_the_first_save_estimate_count_the_average(tmp_path, monkeypatch):
    model = build_model(tiny_config())
    d, params = CPU, count_params(tiny_config())
    assert saving.checkpoint_seconds(model, 1) == saving.checkpoint_seconds(model, 1, average=False)
    extra = saving.checkpoint_seconds(model, 1, average=True) - saving.checkpoint_seconds(model, 1)
    assert extra == pytest.approx(4 * params / (DISK_WRITE_GBPS * 1e9), rel=1e-9)
    plain, averaged = (staged_bytes_per_rank(tiny_config(), 1, "fp32", pinned=False, average=a)[0] for a in (0, 1))
    monkeypatch.setattr(saving, "host_available_bytes", lambda: (plain + averaged) / 2 / HOST_STAGING_FRACTION)
    for average, background in (("none", True), ("ema", False)):  # staging fits without it, not with it
        average = "".join(average)  # as parsed from a command line: equal to the literal, not the same object
        cfg = SimpleNamespace(async_save=1, save_write_mbps=0.0, average=average)
        assert saving.make_saver(cfg, d, model, tmp_path, lambda line: None).background == background


@pytest.mark.parametrize("average", ["none", "ema"])
def test_the_trainer_reserves_room_for_a_save_with_the_average(tmp_path, corpus, average):
    """Until a save is measured, the reserve for the final save is the checkpoint's size at the disk
    rate the plan assumes: with the average, 4 bytes per parameter more."""
    cfg = resolve(parse_args([*map(str, TINY), "--data_dir", str(corpus), "--workspace", str(tmp_path),
                              "--device", "cpu", "--average", average]), cuda=False, world_size=1)
    t = train.setup(cfg, CPU, tmp_path, tmp_path / "checkpoints" / cfg.model_tag, RunLog(None))
    assert (t.opt.average is not None) == (average == "ema")
    assert t.first_save_seconds == saving.checkpoint_seconds(t.model, 1, average == "ema")
    assert saving.checkpoint_seconds(t.model, 1, True) > saving.checkpoint_seconds(t.model, 1, False)
    t.lock.close()


def test_the_report_says_which_weights_are_best(tmp_path):
    rows = {}
    for average, weights in (("none", "raw"), ("ema", "raw"), ("ema", "average")):
        report = RunReport(tmp_path / f"{average}-{weights}", {**FACTS, "config": {"average": average}}, resume_step=None)
        report.run_dir.mkdir()
        report.write(ckpt.RunState(step=9, best_val=1.5, best_step=9, best_weights=weights), "running")
        rows[average, weights] = next(line for line in (report.run_dir / "report.md").read_text().splitlines()
                                      if line.startswith("| best |"))
    assert rows["none", "raw"] == "| best | val loss 1.5000 at step 9: model_000009.pt |"
    assert rows["ema", "raw"].endswith("model_000009.pt, the raw weights: their average (AVERAGE) did not beat them |")
    assert rows["ema", "average"].endswith("model_000009.pt, the weight average (AVERAGE), which beat the raw weights |")
