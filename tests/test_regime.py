"""Defaults by regime (experiment/regime.py): a run whose budget passes over the data more than 4 times
takes the data-limited recipe for the settings it leaves unset, and no regularizer otherwise; what
was set explicitly is kept, the pre-flight says and plans the same, and a resume keeps what the run
started with."""

import itertools
import json
import math
import re

import pytest
import torch

from conftest import TINY, run_train
from test_guards import H100, run_preflight

from experiment import autosize, config, guards, regime, train
from experiment.config import TrainConfig, fill_lrs, parse_args, resolve
from experiment.distributed import Dist
from experiment.report import markdown

# TINY with the regime's three settings left to it again (TINY turns the recipe off for other tests).
UNSET = ["--attn_dropout", "auto", "--average", "auto"]


def _cfg(*flags, cuda=False):
    return resolve(parse_args([*map(str, flags)]), cuda=cuda, world_size=1)


def test_the_three_settings_are_left_to_the_regime_by_default_and_an_explicit_one_is_kept():
    assert regime.left_unset(_cfg()) == ["attn_dropout", "average", "max_epochs"]
    assert regime.left_unset(_cfg(cuda=True)) == ["attn_dropout", "average", "max_epochs"]
    assert regime.left_unset(_cfg("--attn_dropout", 0, "--average", "none", "--max_epochs", 8)) == []
    assert regime.left_unset(_cfg("--attn_dropout", "0.1")) == ["average", "max_epochs"]
    cfg = _cfg("--attn_dropout", "0.1", "--max_epochs", 30)
    chosen = regime.fill(cfg, regime.left_unset(cfg), passes=50.0)
    assert chosen == {"average": "ema"} and (cfg.attn_dropout, cfg.average, cfg.max_epochs) == (0.1, "ema", 30)


def test_the_cap_is_the_regimes_only_in_a_run_that_may_average_and_stops_at_its_val_minimum():
    # Nothing left to decide: the run neither measures nor says a regime (TINY's pins).
    assert regime.left_unset(_cfg("--attn_dropout", 0, "--average", "none")) == []
    built = _cfg("--attn_dropout", 0)
    built.average = "".join(["no", "ne"])  # as argv gives it: equal, not the same object
    assert regime.left_unset(built) == []
    assert regime.left_unset(_cfg("--plateau_evals", 0)) == ["attn_dropout", "average"]
    cfg = _cfg("--plateau_evals", 0)
    unset = regime.left_unset(cfg)
    cfg.max_epochs = 8.0
    assert regime.fill(cfg, unset, 100.0) == {"attn_dropout": 0.2, "average": "ema"} and cfg.max_epochs == 8.0


def test_more_than_four_passes_take_the_recipe_and_four_or_fewer_none():
    for passes, expected in ((4.0, (0.0, "none", 8.0)), (4.01, (0.2, "ema", 0.0)), (0.1, (0.0, "none", 8.0))):
        cfg = _cfg()
        unset = regime.left_unset(cfg)
        cfg.max_epochs = 8.0  # the data's pass cap, as launch.fill_pass_cap fills it before the regime
        regime.fill(cfg, unset, passes)
        assert (cfg.attn_dropout, cfg.average, cfg.max_epochs) == expected, passes


def test_the_pass_cap_lifts_only_for_a_run_that_averages():
    cfg = _cfg("--average", "none")
    unset = regime.left_unset(cfg)
    cfg.max_epochs = 16.0
    assert regime.fill(cfg, unset, 100.0) == {"attn_dropout": 0.2} and cfg.max_epochs == 16.0
    cfg = _cfg("--average", "ema", "--attn_dropout", 0)
    unset = regime.left_unset(cfg)
    cfg.max_epochs = 16.0
    assert regime.fill(cfg, unset, 100.0) == {"max_epochs": 0.0} and cfg.max_epochs == 0.0


def test_a_generation_of_generations_auto_plans_its_schedule_for_the_chains_passes():
    """autosize.CHAIN_PASSES: a data-limited generation of GENERATIONS=auto, whose share is all the budget
    the ones before it left, takes MAX_EPOCHS=32 where the recipe lifts the cap and another generation
    fits after the 32 passes (at least 0.4 of them: 44.8 passes in all); under that, and for
    GENERATIONS=N's equal shares and one model, 0; an explicit MAX_EPOCHS, AVERAGE=none or few passes
    keep theirs."""
    from experiment import generations
    assert autosize.CHAIN_PASSES == 2 * autosize.GENERATION_PASSES == 32 and generations.AUTO_MIN_SHARE == 0.4
    for generations_setting, passes, cap in (("auto", 100.0, 32.0), ("auto", 44.8, 32.0), ("auto", 44.79, 0.0),
                                             (3, 100.0, 0.0), (1, 100.0, 0.0)):
        cfg = _cfg("--generations", generations_setting)
        unset = regime.left_unset(cfg)
        cfg.max_epochs = 8.0  # the data's pass cap, as launch.fill_pass_cap fills it before the regime
        assert regime.fill(cfg, unset, passes)["max_epochs"] == cap == cfg.max_epochs, (generations_setting, passes)
        cfg.max_epochs = 8.0
        assert "max_epochs" not in regime.fill(cfg, unset, 4.0) and cfg.max_epochs == 8.0  # plain: the data's cap
    assert regime.pass_cap("".join(["au", "to"]), 100.0) == 32.0  # a string built at run time: equal, not the same
    for flags in (("--max_epochs", 50), ("--average", "none")):
        cfg = _cfg("--generations", "auto", *flags)
        unset = regime.left_unset(cfg)
        cfg.max_epochs = cfg.max_epochs or 8.0
        assert "max_epochs" not in regime.fill(cfg, unset, 100.0) and cfg.max_epochs in (50, 8.0), flags


def test_a_resume_keeps_what_the_checkpoint_resolved_and_an_old_checkpoint_had_none():
    cfg = _cfg()
    unset = regime.left_unset(cfg)
    assert regime.keep(cfg, unset, {"attn_dropout": 0.2, "average": "ema", "max_epochs": 0.0}) == \
        {"attn_dropout": 0.2, "average": "ema"}
    assert (cfg.attn_dropout, cfg.average) == (0.2, "ema")
    cfg = _cfg()
    assert regime.keep(cfg, regime.left_unset(cfg), {}) == {"attn_dropout": 0.0, "average": "none"}
    cfg = _cfg("--average", "ema")  # an explicit setting wins over the checkpoint's
    assert regime.keep(cfg, regime.left_unset(cfg), {"attn_dropout": 0.1, "average": "none"}) == {"attn_dropout": 0.1}
    assert cfg.average == "ema"


def test_the_passes_come_from_max_steps_the_gpu_prediction_auto_or_a_measurement(monkeypatch):
    config = autosize.GPTConfig(vocab_size=64, depth=2, aspect_ratio=32, head_dim=32, max_seq_len=32)
    measured = []

    def measure(c, batch, device):
        measured.append((c.depth, batch))
        return 1000.0

    monkeypatch.setattr(autosize, "measure_tok_per_s", measure)
    cpu = torch.device("cpu")
    cfg = _cfg("--max_steps", 40, "--total_batch_size", 1024, "--training_hours", 1)
    unset = regime.left_unset(cfg)
    assert regime.estimate_passes(cfg, config, 10_240, None, 2, cpu, None, unset) == (4.0, "in MAX_STEPS=40 steps")
    assert not measured  # MAX_STEPS alone keeps it within 4 passes: nothing measured
    capped = _cfg("--max_epochs", 3, "--training_hours", 1)  # an explicit cap too
    assert regime.estimate_passes(capped, config, 10_240, None, 2, cpu, None, regime.left_unset(capped)) == \
        (3, "at MAX_EPOCHS=3")
    assert not measured
    cfg.max_steps, cfg.max_epochs = 0, 8.0  # the data's cap, which the regime may lift: no bound
    passes, how = regime.estimate_passes(cfg, config, 10_240, None, 2, cpu, None, unset)
    assert measured == [(2, cfg.device_batch_size)] and passes == pytest.approx(2000 * 3600 / 10_240)
    assert how == "at the measured 2,000 tok/s"
    cfg.max_steps = 100  # bounds the budget's passes where it ends first
    assert regime.estimate_passes(cfg, config, 10_240, None, 1, cpu, None, unset) == \
        (pytest.approx(10.0), "in MAX_STEPS=100 steps")
    cfg.max_steps = 45  # 4.5 passes: past 4 by half a pass, so the budget's own are had too
    assert regime.estimate_passes(cfg, config, 10_240, None, 1, cpu, None, unset) == \
        (pytest.approx(4.5), "in MAX_STEPS=45 steps")
    cfg.max_steps, cfg.training_hours = 0, 2.0
    auto = {"how": "measured", "candidates": [{"depth": 1, "tok_per_s": 7.0}, {"depth": 4, "tok_per_s": 9.0},
                                              {"depth": 2, "tok_per_s": 500.0}]}
    assert regime.estimate_passes(cfg, config, 10_240, None, 1, cpu, auto, unset)[0] == \
        pytest.approx(500 * 2 * 3600 / 10_240)
    cfg.training_hours = 1.0
    gpu_cfg = _cfg("--training_hours", 1, cuda=True)
    predicted = guards.predicted_rate(gpu_cfg, config, H100, 8)
    passes, how = regime.estimate_passes(gpu_cfg, config, 10**9, H100, 8, None, auto, unset)
    assert passes == pytest.approx(predicted * 3600 / 10**9) and how.startswith("at the predicted")
    assert len(measured) == 3  # MAX_STEPS=100 and 45 above measured; DEPTH=auto's figure and the GPU's did not


def test_a_generations_teacher_is_priced_into_a_measured_or_predicted_rate_and_can_lift_the_chains_cap(monkeypatch):
    """A later generation's step also runs its teacher's forward: a measured rate is priced with it
    (autosize.with_teacher), a predicted one in its compute, DEPTH=auto's candidates (priced when they
    were measured) are not priced twice, and a share that
    makes 44.8 passes only at the bare rate gets no 32-pass cap, whose passes would take longer than
    planned and leave under a next generation's seconds, unspent."""
    config = autosize.GPTConfig(vocab_size=64, depth=2, aspect_ratio=32, head_dim=32, max_seq_len=32)
    monkeypatch.setattr(autosize, "measure_tok_per_s", lambda c, batch, device: 1000.0)
    cpu, step = torch.device("cpu"), autosize.flops_per_token(config)
    cfg = _cfg("--generations", "auto", "--training_hours", 1)
    unset = regime.left_unset(cfg)
    cfg.max_epochs = 8.0
    bare = regime.estimate_passes(cfg, config, 10_240, None, 1, cpu, None, unset)
    assert bare == (pytest.approx(1000 * 3600 / 10_240), "at the measured 1,000 tok/s")
    passes, how = regime.estimate_passes(cfg, config, 10_240, None, 1, cpu, None, unset, teacher_flops=step / 3)
    assert passes == pytest.approx(bare[0] * 0.75) and how == "at the measured 750 tok/s (the teacher's forward priced in)"
    auto = {"how": "measured", "candidates": [{"depth": 2, "tok_per_s": 500.0}]}  # priced when DEPTH=auto measured it
    assert regime.estimate_passes(cfg, config, 10_240, None, 1, cpu, auto, unset, teacher_flops=step) == \
        (pytest.approx(500 * 3600 / 10_240), "at the measured 500 tok/s (the teacher's forward priced in)")
    gpu_cfg = _cfg("--generations", "auto", "--training_hours", 1, cuda=True)
    bare, priced = (guards.predicted_rate(gpu_cfg, config, H100, 8, t) for t in (0.0, step))
    # in the compute, not the communication (as DEPTH=auto's prediction prices it): above half the bare
    # rate (0.59 of it here), which a teacher of the step's own FLOPs would leave were the whole step priced
    assert 0.55 * bare < priced < bare
    assert regime.estimate_passes(gpu_cfg, config, 10**9, H100, 8, None, auto, unset, teacher_flops=step)[0] == \
        pytest.approx(priced * 3600 / 10**9)
    # 50 passes at the bare rate, 37.5 with the teacher: the cap of 32 would leave 5.5, under 0.4 x 32
    d, lines = Dist(0, 0, 1, cpu), []
    cfg.training_hours = 50 * 10_240 / 1000 / 3600
    regime.settle(cfg, d, None, config, 10_240, None, None, None, list(unset), lines.append)
    assert cfg.max_epochs == 32.0
    cfg.max_epochs, cfg.attn_dropout, cfg.average = 8.0, "auto", "auto"
    regime.settle(cfg, d, None, config, 10_240, None, None, None, list(unset), lines.append, step / 3)
    assert cfg.max_epochs == 0.0 and "about 37.5 passes" in lines[-1] and "teacher's forward priced in" in lines[-1]


def test_a_measurement_takes_the_runs_micro_batch_or_one_sequence_and_frees_a_gpus_memory(monkeypatch):
    """On a GPU of unknown peak without DEVICE_BATCH_SIZE the measured step is one sequence, and the
    memory it took is handed back before the device-batch probe (a stand-in device on this CPU)."""
    config = autosize.GPTConfig(vocab_size=64, depth=2, aspect_ratio=32, head_dim=32, max_seq_len=32)
    batches, emptied = [], []
    monkeypatch.setattr(autosize, "measure_tok_per_s", lambda c, batch, device: batches.append(batch) or 10.0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    cfg = _cfg()
    cfg.device_batch_size = None
    assert regime.measured_rate(cfg, config, torch.device("cpu")) == 10.0 and batches == [1] and not emptied
    cfg.device_batch_size = 8
    assert regime.measured_rate(cfg, config, torch.device("cuda", 0)) == 10.0 and batches == [1, 8] and emptied


def test_settle_counts_its_seconds_and_a_resume_or_nothing_left_costs_none(monkeypatch, tmp_path):
    config = autosize.GPTConfig(vocab_size=64, depth=2, aspect_ratio=32, head_dim=32, max_seq_len=32)
    d = Dist(0, 0, 1, torch.device("cpu"))
    clock = itertools.chain([100.0, 250.0], itertools.count(1000.0))  # the call's start and end, then on
    monkeypatch.setattr(regime.time, "time", lambda: next(clock))
    monkeypatch.setattr(autosize, "measure_tok_per_s", lambda c, batch, device: 1000.0)
    lines = []
    cfg = _cfg("--training_hours", 1)
    assert regime.settle(cfg, d, None, config, 10_240, tmp_path, None, None, regime.left_unset(cfg), lines.append) == \
        (150.0, lines[-1])
    assert lines[-1].startswith("regime | the budget makes about 351.6 passes") and "priced" not in lines[-1]
    assert regime.settle(cfg, d, None, config, 10_240, tmp_path, None, None, [], lines.append) == (0.0, None)
    monkeypatch.setattr(regime.ckpt, "read_meta", lambda run_dir, step: {"train_config": {"attn_dropout": 0.2,
                                                                                         "average": "ema"}})
    lines.clear()
    cfg = _cfg()
    assert regime.settle(cfg, d, None, config, 10_240, tmp_path, 7, None, regime.left_unset(cfg), lines.append) == \
        (0.0, "regime | kept from the checkpoint: ATTN_DROPOUT=0.2, AVERAGE=ema") and len(lines) == 1
    assert regime.settle(cfg, d, None, config, 10_240, tmp_path, 7, None, ["max_epochs"], lines.append) == (0.0, None)
    assert len(lines) == 1  # nothing kept, nothing said


def test_a_taught_generation_of_few_passes_takes_the_recipe_without_attention_dropout(monkeypatch, tmp_path):
    """regime.TAUGHT_PASSES: a generation with a teacher whose share makes more than 4 passes and at
    most 10 trains with the weight average and no attention dropout; past 10, or without a teacher, the
    whole recipe; an explicit ATTN_DROPOUT is kept. settle hands a teacher's forward on as `taught`."""
    assert regime.TAUGHT_PASSES == 10
    for passes, taught, dropout, average in ((10.0, True, 0.0, "ema"), (10.01, True, 0.2, "ema"),
                                             (6.0, False, 0.2, "ema"), (4.0, True, 0.0, "none"),
                                             (4.01, True, 0.0, "ema")):
        cfg = _cfg()
        unset = regime.left_unset(cfg)
        cfg.max_epochs = 8.0
        regime.fill(cfg, unset, passes, taught)
        cap = 8.0 if average == "none" else 0.0
        assert (cfg.attn_dropout, cfg.average, cfg.max_epochs) == (dropout, average, cap), passes
    cfg = _cfg("--attn_dropout", "0.1")
    assert regime.fill(cfg, regime.left_unset(cfg), 6.0, True) == {"average": "ema", "max_epochs": 0.0}
    assert cfg.attn_dropout == 0.1
    config = autosize.GPTConfig(vocab_size=64, depth=2, aspect_ratio=32, head_dim=32, max_seq_len=32)
    monkeypatch.setattr(autosize, "measure_tok_per_s", lambda c, batch, device: 1000.0)
    d = Dist(0, 0, 1, torch.device("cpu"))
    # 6.0 passes over 600,000 tokens in the hour; DISTILL_WEIGHT=0 runs the teacher but learns from the labels
    for teacher_flops, weight, dropout in ((0.0, 0.5, 0.2), (1.0, 0.5, 0.0), (1.0, 0.0, 0.2)):
        cfg, lines = _cfg("--training_hours", 1, "--distill_weight", weight), []
        regime.settle(cfg, d, None, config, 600_000, tmp_path, None, None, regime.left_unset(cfg), lines.append,
                      teacher_flops)
        assert cfg.attn_dropout == dropout and f"ATTN_DROPOUT={dropout:g}," in lines[-1], lines


def test_the_line_puts_exactly_four_passes_below_the_threshold():
    assert "at most 4: ATTN_DROPOUT=0" in regime.line(4.0, {"attn_dropout": 0.0}, "at the measured 1 tok/s")
    assert "more than 4, data-limited: AVERAGE=ema" in regime.line(4.01, {"average": "ema"}, "x")


def _setup(ws, corpus, *flags, teachers=None):
    """The trainer set up on TINY with the regime's settings unset: (trainer, the lines it said)."""
    cfg = resolve(parse_args([*map(str, TINY), *UNSET, "--data_dir", str(corpus), "--workspace", str(ws),
                              "--total_batch_size", "256", "--device", "cpu", *map(str, flags)]), cuda=False,
                  world_size=1)
    lines = []
    t = train.setup(cfg, Dist(0, 0, 1, torch.device("cpu")), ws, ws / "checkpoints" / cfg.model_tag, lines.append,
                    teachers=teachers)
    t.writer.close()
    return t, lines


def test_a_generations_setup_prices_its_teachers_forward_into_the_passes(tmp_path, corpus):
    """train.setup hands the loaded teacher's forward FLOPs to the regime: a generation's line says the
    rate is priced, and a run without a teacher's does not."""
    from experiment.teacher import meta_digest
    run_train([*TINY, "--data_dir", corpus, "--workspace", tmp_path, "--max_steps", 4, "--save_every_steps", 4,
               "--model_tag", "teacher"])
    file = tmp_path / "checkpoints/teacher/model_000004.pt"
    teachers = [{"generation": 1, "file": str(file), "meta_sha256": meta_digest(file)}]
    _, taught = _setup(tmp_path, corpus, "--model_tag", "taught", "--distill_weight", 0.5, teachers=teachers)
    _, alone = _setup(tmp_path, corpus, "--model_tag", "alone")
    assert "(the teacher's forward priced in)" in next(x for x in taught if x.startswith("regime | "))
    assert "priced" not in next(x for x in alone if x.startswith("regime | "))


def test_a_data_limited_run_trains_with_the_recipe_and_says_so(tmp_path, corpus):
    t, lines = _setup(tmp_path, corpus)  # an hour over about 36k training tokens: thousands of passes
    line = next(x for x in lines if x.startswith("regime | "))
    assert re.search(r"the budget makes about [\d.]+ passes over the training data at the measured [\d,]+ tok/s: "
                     r"more than 4, data-limited: ATTN_DROPOUT=0.2, AVERAGE=ema, MAX_EPOCHS=0", line), line
    assert (t.cfg.attn_dropout, t.cfg.average, t.cfg.max_epochs) == (0.2, "ema", 0.0)
    assert all(b.attn.dropout == 0.2 for b in t.model.blocks) and t.opt.average is not None
    assert t.max_tokens == math.inf and t.run_meta["train_config"]["attn_dropout"] == 0.2
    assert t.report.facts["regime"] == line.removeprefix("regime | ")
    assert line.removeprefix("regime | ") in markdown(t.report, t.st, "running")  # report.md's regime row
    assert t.st.used_seconds > 0  # the measurement is counted in the budget


def test_a_run_of_few_passes_keeps_the_plain_step(tmp_path, corpus):
    t, lines = _setup(tmp_path, corpus, "--training_hours", "0.00001", "--max_steps", 700)
    line = next(x for x in lines if x.startswith("regime | "))
    assert "at most 4: ATTN_DROPOUT=0, AVERAGE=none" in line and "MAX_EPOCHS" not in line
    assert (t.cfg.attn_dropout, t.cfg.average) == (0.0, "none") and t.opt.average is None
    assert all(b.attn.dropout == 0.0 for b in t.model.blocks)
    train_tokens = t.prepared.meta["split"]["train_tokens"]
    assert t.max_tokens == t.cfg.max_epochs * train_tokens and t.cfg.max_epochs >= 8  # the data's cap


@pytest.mark.slow(seconds=23)
def test_a_resume_keeps_the_regime_and_the_rates_its_run_started_with(tmp_path, corpus, monkeypatch):
    # 700 steps of 256 tokens make about 4.7 passes, so the recipe (the stop at the val minimum may
    # end the run sooner); then a resume whose budget alone would make a fraction of a pass keeps it.
    proc = run_train([*TINY, *UNSET, "--data_dir", corpus, "--workspace", tmp_path, "--total_batch_size", 256,
                      "--max_steps", 700, "--save_every_steps", 100, "--embedding_lr", 0.3])
    assert "passes over the training data in MAX_STEPS=700 steps: more than 4, data-limited" in proc.stdout
    # The CPU rates by depth change between the launch and the resume: the resumed run keeps its own.
    monkeypatch.setattr(config, "CPU_LR_SCALES", ((math.inf, dict(matrix_lr=0.25, embedding_lr=0.25,
                                                                  unembedding_lr=0.25)),))
    t, lines = _setup(tmp_path, corpus, "--training_hours", "0.00001", "--max_steps", 700)
    assert t.resume_step is not None and t.cfg.max_epochs == 0  # the cap the run lifted, kept with the data
    assert "regime | kept from the checkpoint: ATTN_DROPOUT=0.2, AVERAGE=ema" in lines
    assert (t.cfg.attn_dropout, t.cfg.average) == (0.2, "ema") and t.opt.average is not None
    assert (t.cfg.matrix_lr, t.cfg.embedding_lr, t.cfg.unembedding_lr) == pytest.approx((0.02, 0.3, 0.002))
    assert t.opt.matrix_lr() == pytest.approx(0.02) and t.run_meta["train_config"]["matrix_lr"] == 0.02
    assert "resume | learning rates kept from the checkpoint, not today's defaults: MATRIX_LR=0.02, " \
           "EMBEDDING_LR=0.3, UNEMBEDDING_LR=0.002" in lines
    t.lock.close()  # the trainer's lock on the run directory: the next setup takes it
    t, lines = _setup(tmp_path, corpus, "--training_hours", "0.00001", "--max_steps", 700, "--matrix_lr", 0.03)
    assert (t.cfg.matrix_lr, t.cfg.unembedding_lr) == pytest.approx((0.03, 0.002))  # a given rate wins
    assert t.opt.matrix_lr() == pytest.approx(0.03)
    t.lock.close()


def test_a_rate_kept_only_where_left_unset_and_recorded():
    cfg = _cfg("--depth", 6, "--unembedding_lr", 0.5)
    assert fill_lrs(cfg, False, {"matrix_lr": 0.01, "embedding_lr": 0.07, "unembedding_lr": 0.9}) == \
        {"embedding_lr": 0.07}  # the kept rates that differ from today's defaults (d6: 0.01, 0.05)
    assert (cfg.matrix_lr, cfg.embedding_lr, cfg.unembedding_lr) == (0.01, 0.07, 0.5)
    cfg = _cfg("--depth", 6)  # a checkpoint from before the rates were recorded (or a None): today's
    assert fill_lrs(cfg, False, {"matrix_lr": None}) == {} and cfg.matrix_lr == pytest.approx(0.01)


def test_the_preflight_plans_the_recipe_and_the_repeat_guard_leaves_it(tmp_path, corpus):
    plan, lines = run_preflight(tmp_path, "--data_dir", corpus, "--depth", 12, regime=True)
    assert isinstance(plan, dict), plan
    line = next(x for x in lines if x.startswith("preflight | regime | "))
    assert "at the predicted" in line and "data-limited: ATTN_DROPOUT=0.2, AVERAGE=ema, MAX_EPOCHS=0" in line
    assert "priced" not in line
    # a second generation's teacher is priced into its passes, as the trainer prices it
    gens = tmp_path / "gens"
    (gens / "checkpoints/d12").mkdir(parents=True)
    (gens / "checkpoints/d12/generations.json").write_text(json.dumps({"generations": [
        {"index": 1, "dir": "gen1", "seed": 1337, "budget_seconds": 3600.0, "teachers": [], "outcome": "finished",
         "used_seconds": 100.0, "best": None}]}))
    plan, taught = run_preflight(gens, "--data_dir", corpus, "--depth", 12, "--generations", "auto", regime=True)
    assert any("generation 2 (GENERATIONS=auto) starts" in x for x in taught), taught
    regime_line = next(x for x in taught if x.startswith("preflight | regime | "))
    assert "(the teacher's forward priced in)" in regime_line
    plan_line = next(x for x in taught if x.startswith("preflight | plan d12:"))  # the plan's rate: the same
    assert re.search(r"at the predicted ([\d,]+) tok/s", regime_line)[1] == \
        re.search(r"plan d12: ([\d,]+) tok/s PREDICTED", plan_line)[1] != \
        re.search(r"plan d12: ([\d,]+) tok/s PREDICTED", next(x for x in lines if "plan d12:" in x))[1]
    plan_line = next(x for x in lines if x.startswith("preflight | plan d12:"))
    assert "trains the whole 31h budget" in plan_line and "(less if the stop at the val minimum ends it)" in plan_line
    # AVERAGE=auto counts the average in the checkpoint the plan sizes; AVERAGE=none does not
    _, plain = run_preflight(tmp_path, "--data_dir", corpus, "--depth", 12, "--average", "none", regime=True)
    size = [float(re.search(r"checkpoint ([\d.]+) GB", next(x for x in ls if x.startswith("preflight | plan d12:")))[1])
            for ls in (lines, plain)]
    assert size[0] > size[1], size
    # AVERAGE=none keeps the cap, and so the guard against an explicit MAX_EPOCHS=0
    error, lines = run_preflight(tmp_path, "--data_dir", corpus, "--depth", 12, "--average", "none",
                                 "--max_epochs", 0, regime=True)
    assert "d12 would see the training data" in str(error)
    # a generation of GENERATIONS=auto: the regime's cap of CHAIN_PASSES passes, which the guard takes as the cap
    plan, lines = run_preflight(tmp_path, "--data_dir", corpus, "--depth", 12, "--generations", "auto",
                                "--model_tag", "chain", regime=True)
    assert isinstance(plan, dict), plan
    assert any("data-limited: ATTN_DROPOUT=0.2, AVERAGE=ema, MAX_EPOCHS=32" in x for x in lines), lines
    plan_line = next(x for x in lines if x.startswith("preflight | plan d12:"))
    assert "stops after 32 passes" in plan_line and "left to the next generation" in plan_line, plan_line
    plan, lines = run_preflight(tmp_path, "--data_dir", corpus, "--depth", 12, "--training_hours", 1e-7, regime=True)
    assert isinstance(plan, dict) and any("at most 4: ATTN_DROPOUT=0, AVERAGE=none" in x for x in lines), lines


@pytest.mark.slow
def test_auto_is_a_setting_and_a_bad_average_is_named(tmp_path, corpus):
    assert _cfg("--attn_dropout", "auto").attn_dropout is None
    proc = run_train([*TINY, "--data_dir", corpus, "--workspace", tmp_path, "--average", "swa"], check=False)
    assert proc.returncode == 2 and "--average must be one of none, ema, auto, got 'swa'" in proc.stderr
    assert TrainConfig().average == "auto" and TrainConfig().attn_dropout is None


@pytest.mark.slow
def test_depth_auto_takes_the_regularized_rule_only_where_the_run_leaves_the_whole_recipe_to_the_regime(
        tmp_path, corpus):
    cfg = _cfg("--total_batch_size", 4096)
    assert regime.regularizes(cfg, regime.left_unset(cfg), 40_960)
    for pinned in (["--attn_dropout", 0], ["--average", "none"], ["--max_epochs", 8], ["--plateau_evals", 0]):
        cfg = _cfg("--total_batch_size", 4096, *pinned)
        assert not regime.regularizes(cfg, regime.left_unset(cfg), 40_960), pinned
    # MAX_STEPS that keeps the run within 4 passes: the regime leaves it plain, so the plain rule sizes it
    for steps, expected in ((40, False), (41, True), (0, True)):
        cfg = _cfg("--total_batch_size", 4096, "--max_steps", steps)
        assert regime.regularizes(cfg, regime.left_unset(cfg), 40_960) is expected, steps
    cfg = _cfg("--total_batch_size", 4096, "--max_steps", 30)  # 2.5 passes over 50,000 tokens
    assert not regime.regularizes(cfg, regime.left_unset(cfg), 50_000)
    auto = "".join(["au", "to"])  # as argv gives it: equal to "auto", not the same object
    t, lines = _setup(tmp_path / "left", corpus, "--depth", auto)  # 36k tokens for an hour: the data branch
    assert all(c["regularized"] and c["floor"] == autosize.REG_FLOOR for c in t.run_meta["auto"]["candidates"])
    assert "the largest depth the regime regularizes" in t.run_meta["auto"]["reason"]
    assert (t.cfg.attn_dropout, t.cfg.average, t.cfg.max_epochs) == (0.2, "ema", 0.0)  # as the rule assumed
    t, lines = _setup(tmp_path / "pinned", corpus, "--depth", "auto", "--attn_dropout", 0)
    assert not any(c["regularized"] for c in t.run_meta["auto"]["candidates"])
    assert "the largest depth the regime regularizes" not in t.run_meta["auto"]["reason"]
    # An explicit depth with nothing left to the regime: no probe, no measurement; its setup alone charged
    t, lines = _setup(tmp_path / "explicit", corpus, "--attn_dropout", 0, "--average", "none", "--max_epochs", 8)
    assert t.run_meta["auto"] is None and 0.0 < t.st.used_seconds < 2.0
