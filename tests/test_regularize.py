"""Weight decay and dropout for many passes: off, the step is today's bit for bit; on, dropout changes
training and never eval or serving, weight decay shrinks weights at the documented rate, and a
resume of a regularized run equals the uninterrupted one."""

import re
import shutil

import pytest
import torch

from conftest import TINY, run_train, tiny_config
from test_step import PLAIN, _one_trainer_step

from experiment import checkpoint as ckpt
from experiment import demo_metric, metric
from experiment.config import ConfigError, TrainConfig, resolve
from experiment.dataloader import prepare, write_demo_corpus
from experiment.distributed import Dist
from experiment.evaluation import evaluate, sample_text
from experiment.model import build_model, rms_norm
from experiment.optim import LRS, ShardedOptimizer, uses_muon
from experiment.step import forward_backward

OFF = ["--weight_decay", "0", "--adam_weight_decay", "0", "--dropout", "0", "--attn_dropout", "0"]
ON = {"weight_decay": ["--weight_decay", "0.5"], "adam_weight_decay": ["--adam_weight_decay", "0.5"],
      "dropout": ["--dropout", "0.3"], "attn_dropout": ["--attn_dropout", "0.3"]}


def _trained(flags, tmp_path, corpus):
    """The trainer's step with `flags` beside a plain step (no regularizer) on the same micro-batches
    from the same weights: (trainer's loss, its weights, the plain step's loss, its weights)."""
    t, plain, plain_opt, inputs, _, loss_sum, mult, _ = _one_trainer_step(tmp_path, corpus, [*PLAIN, *flags])
    plain_loss = sum(forward_backward(plain, x, y, grad_accum=2) for x, y in inputs)
    plain_opt.set_lr_multiplier(mult)
    plain_opt.step()
    return loss_sum, t.model.state_dict(), plain_loss, plain.state_dict()


def test_every_regularizer_at_zero_is_todays_step_bit_for_bit(tmp_path, corpus):
    loss, weights, plain_loss, plain_weights = _trained(OFF, tmp_path, corpus)
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(v, weights[n]) for n, v in plain_weights.items())


@pytest.mark.parametrize("name", list(ON))
def test_each_regularizer_on_changes_the_step(tmp_path, corpus, name):
    """The same comparison can fail: each setting, on alone, reaches the trainer's step."""
    loss, weights, plain_loss, plain_weights = _trained(ON[name], tmp_path, corpus)
    changed = [n for n, v in plain_weights.items() if not torch.equal(v, weights[n])]
    assert changed, f"{name} changed no weight"
    # The first step's loss is the same either way (each block's output projection starts at zero, so
    # dropout has nothing to drop yet); dropout changes the gradients, weight decay only the update.
    assert torch.equal(loss, plain_loss)
    if not name.endswith("dropout"):
        decayed = {n for n, p in weights.items() if uses_muon(n, p.shape) == (name == "weight_decay")}
        assert set(changed) <= decayed


def _model_and_batch(seed=0):
    """A model as if trained: its output projections, zero at init, given weights, so that the
    branches dropout acts on are not zero."""
    model = build_model(tiny_config(bigram=True), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.blocks:
            for lin in (block.attn.c_proj, block.mlp.c_proj):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) * 0.1)
    x = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(seed))
    return model, x


def test_the_trainer_gives_each_block_its_two_rates(tmp_path, corpus):
    t, *_ = _one_trainer_step(tmp_path, corpus, [*PLAIN, "--dropout", "0.3", "--attn_dropout", "0.1"])
    assert all(b.dropout == 0.3 and b.attn.dropout == 0.1 for b in t.model.blocks)
    assert t.model.training  # back in training mode after the step's eval


def test_evals_samples_and_the_demo_check_inside_training_never_drop(tmp_path):
    """The trainer's eval, its sample and the demo's sums, called on a model in training mode with
    dropout on: the plain model's results, no training RNG drawn, and training mode back after."""
    prepared = prepare(write_demo_corpus(tmp_path / "data", n_lines=3000).parent, tmp_path, max_seq_len=32)
    config = tiny_config(vocab_size=prepared.meta["vocab_size"], bigram=True)
    plain = build_model(config, seed=3)
    dropped = build_model(config, state_dict=plain.state_dict())
    dropped.set_dropout(0.5, 0.5)
    tok, prompt, cpu = prepared.tokenizer(), prepared.tokens("val")[:8].tolist(), Dist(0, 0, 1, torch.device("cpu"))
    results = []
    for model in (plain, dropped):
        before = torch.get_rng_state()
        results.append((evaluate(model, prepared, 32, 4, 2048, cpu)[0], sample_text(model, tok, prompt, 16),
                        metric.measure(demo_metric.sums, model, tok, 60)))
        assert torch.equal(before, torch.get_rng_state()) and model.training
    assert results[0] == results[1]


def test_each_block_adds_its_attention_then_its_mlp_to_the_residual_stream():
    """Pre-norm residual blocks, x + attn(norm(x)) then + mlp(norm(x)), against the blocks' own parts:
    the sign matters to trained weights (from scratch a flipped sign trains the same, negated)."""
    model, x = _model_and_batch()
    model.eval()
    h = model.embed(x, model.bigram_ids(x))
    cos, sin = model.rope_cos[:x.size(1)], model.rope_sin[:x.size(1)]
    with torch.no_grad():
        for block in model.blocks:
            h = h + block.attn(rms_norm(h), cos, sin, None)
            h = h + block.mlp(rms_norm(h))
        torch.testing.assert_close(model(x), model.lm_head(rms_norm(h)).float(), rtol=0, atol=0)


def test_dropout_off_draws_no_random_numbers():
    """Off, no dropout kernel runs (so none is in a compiled graph either): a training forward and
    backward leave the global RNG where it was. On, each kind draws."""
    model, x = _model_and_batch()
    for residual, attention, draws in ((0.0, 0.0, False), (0.2, 0.0, True), (0.0, 0.2, True)):
        model.set_dropout(residual, attention)
        before = torch.get_rng_state()
        model(x, x).backward()
        assert torch.equal(before, torch.get_rng_state()) != draws, (residual, attention)


def test_dropout_changes_training_and_not_eval_or_serving():
    plain, x = _model_and_batch()
    dropped = build_model(plain.config, state_dict=plain.state_dict())
    dropped.set_dropout(0.3, 0.3)
    assert not torch.equal(plain(x, x), dropped(x, x))  # training mode: dropped
    first, second = dropped(x, x), dropped(x, x)
    assert not torch.equal(first, second)  # a new mask each forward
    plain.eval(), dropped.eval()
    assert torch.equal(plain(x), dropped(x))  # eval: no dropout, bit for bit
    with torch.no_grad():
        assert torch.equal(plain(x, x), dropped(x, x))
    prompt = x[0, :5].tolist()
    assert list(plain.generate(prompt, 20, temperature=0)) == list(dropped.generate(prompt, 20, temperature=0))
    assert dropped.training is False and dropped.blocks[0].dropout == 0.3  # kept for the next training step
    dropped.train()
    assert not torch.equal(plain(x, x), dropped(x, x))


@pytest.mark.parametrize("mult", [1.0, 0.25])
def test_weight_decay_shrinks_weights_by_one_minus_lr_times_decay_per_update(mult):
    """With zero gradients the update is the decay alone: Muon's matrices x (1 - matrix lr x
    weight_decay), AdamW's tables and head x (1 - their lr x adam_weight_decay), the lr the
    scheduled one (LRS x the multiplier, AdamW's scaled by (768 / width) ** 0.5)."""
    model, _ = _model_and_batch()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = ShardedOptimizer(model, **LRS, weight_decay=0.5, adam_weight_decay=0.1)
    opt.set_lr_multiplier(mult)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    adam_scale = (model.config.n_embd / 768) ** -0.5
    adam_lr = {"wte.weight": LRS["embedding_lr"], "bigram.weight": LRS["embedding_lr"],
               "lm_head.weight": LRS["unembedding_lr"]}
    for n, p in model.named_parameters():
        if uses_muon(n, p.shape):
            factor = 1 - mult * LRS["matrix_lr"] * 0.5
        else:
            factor = 1 - mult * adam_lr[n] * adam_scale * 0.1
        torch.testing.assert_close(p.detach(), before[n] * factor, rtol=1e-6, atol=0, msg=n)
        assert factor < 1


def test_every_regularizer_is_off_by_default_and_takes_what_it_is_given():
    for cuda in (False, True):  # attention dropout's default follows the regime (tests/test_regime.py)
        cfg = resolve(TrainConfig(), cuda=cuda, world_size=1)
        assert (cfg.weight_decay, cfg.adam_weight_decay, cfg.dropout, cfg.attn_dropout) == (0, 0, 0, None)
    given = dict(weight_decay=1.6, adam_weight_decay=0.1, dropout=0.3, attn_dropout=0.99)
    cfg = resolve(TrainConfig(**given), cuda=False, world_size=1)
    assert {k: getattr(cfg, k) for k in given} == given


def test_bad_regularizer_settings_are_named():
    for name, value, words in (("dropout", 1.0, "must lie in [0, 1)"), ("dropout", -0.1, "must lie in [0, 1)"),
                               ("attn_dropout", 1.5, "must lie in [0, 1)"),
                               ("weight_decay", -1.0, "must be a finite number >= 0"),
                               ("adam_weight_decay", float("nan"), "must be a finite number >= 0"),
                               ("weight_decay", float("inf"), "must be a finite number >= 0")):
        with pytest.raises(ConfigError, match="^" + re.escape(f"--{name} {words}")):
            resolve(TrainConfig(**{name: value}), cuda=False, world_size=1)
    model = build_model(tiny_config())
    for residual, attention in ((1.0, 0.0), (-0.1, 0.0), (0.0, 1.5), (0.0, -0.5)):
        with pytest.raises(ValueError, match="dropout (residual|attention) must lie in"):
            model.set_dropout(residual, attention)
    model.set_dropout(0.0, 0.999)  # the edges that work


@pytest.mark.slow
def test_a_bad_dropout_exits_2_naming_it_and_writes_nothing(tmp_path, corpus):
    proc = run_train([*TINY, "--data_dir", corpus, "--workspace", tmp_path, "--dropout", "1"], check=False)
    assert proc.returncode == 2 and "--dropout must lie in [0, 1), got 1.0" in proc.stderr
    assert not list(tmp_path.rglob("*.pt"))


@pytest.mark.slow
def test_a_regularized_run_resumed_after_a_crash_equals_the_uninterrupted_run(tmp_path, corpus):
    """Dropout's masks come from the RNG each rank's checkpoint keeps, so a resume draws the masks
    the uninterrupted run drew."""
    common = [*TINY, "--data_dir", corpus, "--max_steps", 6, "--save_every_steps", 3, "--total_batch_size", 256,
              "--dropout", "0.2", "--attn_dropout", "0.1", "--weight_decay", "0.5", "--adam_weight_decay", "0.1"]
    run_train([*common, "--workspace", tmp_path / "a"])
    run_train([*common[:-8], "--workspace", tmp_path / "plain"])
    a_dir, b_dir = tmp_path / "a/checkpoints/d2", tmp_path / "b/checkpoints/d2"
    shutil.copytree(a_dir, b_dir)
    ckpt.meta_path(b_dir, 6).unlink()  # as if killed while saving step 6
    proc = run_train([*common, "--workspace", tmp_path / "b"])
    assert "resumed from" in proc.stdout and "step 3," in proc.stdout
    a, b, plain = (ckpt.load_model_state(d, 6) for d in (a_dir, b_dir, tmp_path / "plain/checkpoints/d2"))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not all(torch.equal(a[n], plain[n]) for n in a)


@pytest.mark.slow
def test_each_rank_draws_its_masks_from_a_stream_of_its_own(tmp_path, corpus):
    """Two ranks seeded alike would drop the same positions of their different sequences."""
    run_train([*TINY, "--data_dir", corpus, "--workspace", tmp_path, "--max_steps", 1, "--total_batch_size", 256,
               "--dropout", "0.2"], nproc=2)
    run_dir = tmp_path / "checkpoints/d2"
    states = [ckpt.load_tensors(ckpt.optim_path(run_dir, 1, r))["rng"]["cpu"] for r in range(2)]
    assert not torch.equal(*states)
