"""The training step is written once: the trainer's step and the tools' calls of it agree bit for bit."""

import torch

from conftest import TINY

from experiment import stopping, train, trainstep
from experiment.config import parse_args, resolve
from experiment.distributed import Dist
from experiment.model import GPTConfig, build_model
from experiment.optim import ShardedOptimizer
from experiment.runlog import RunLog
from experiment.step import forward_backward, optimizer_step


# The plain step: none of the early-schedule warmups (their step: test_the_first_step_is_two_updates...)
PLAIN = ["--seq_warmup_frac", "0", "--batch_warmup_frac", "0", "--muon_momentum_warmup_steps", "0"]


def _one_trainer_step(tmp_path, corpus, flags=PLAIN, updates=1):
    """The trainer set up on TINY with 2 micro-batches a step, and one train_step run with a copy of
    its model and optimizer taken before it: (cfg, trainer, copy, copy's optimizer, the micro-batches
    it fed its model, the gradients it handed its optimizer at each update, its loss, its LR
    multiplier). Also returns the step's first micro-batch as the loop held it."""
    cfg = resolve(parse_args([*map(str, TINY), "--data_dir", str(corpus), "--workspace", str(tmp_path),
                              "--total_batch_size", "256", "--device", "cpu", *flags]), cuda=False, world_size=1)
    t = train.setup(cfg, Dist(0, 0, 1, torch.device("cpu")), tmp_path, tmp_path / "checkpoints" / cfg.model_tag,
                    RunLog(None))
    loop = train.start_loop(t)
    assert t.grad_accum == 2
    *_, loop.split, loop.halve = stopping.decide(t, loop, 0)
    first = (loop.x.clone(), loop.y.clone())
    copy = build_model(t.model.config)
    copy.load_state_dict(t.model.state_dict())
    copy_opt = ShardedOptimizer(copy, matrix_lr=cfg.matrix_lr, embedding_lr=cfg.embedding_lr,
                                unembedding_lr=cfg.unembedding_lr)
    inputs, handed = [], []
    t.model.register_forward_pre_hook(lambda module, args: inputs.append((args[0].clone(), args[1].clone())))
    step = t.opt.step

    def capture():
        handed.append({n: p.grad.clone() for n, p in t.model.named_parameters()})
        step()

    t.opt.step = capture
    loss_sum, mult = trainstep.train_step(t, loop)
    t.writer.close()
    assert len(inputs) == 2 * updates and len(handed) == updates
    return t, copy, copy_opt, inputs, handed if updates > 1 else handed[0], loss_sum, mult, first


def test_the_tools_step_gives_the_trainers_loss_gradients_and_update(tmp_path, corpus):
    # 256 tokens per step in micro-batches of 4 x 32: two micro-batches accumulate per step.
    t, tool_model, tool_opt, inputs, handed, loss_sum, mult, _ = _one_trainer_step(tmp_path, corpus)

    # A tool's step on the same micro-batches: forward_backward per micro-batch, then optimizer_step.
    tool_loss = sum(forward_backward(tool_model, x, y, grad_accum=2) for x, y in inputs)
    assert torch.equal(tool_loss, loss_sum)
    assert all(torch.equal(p.grad, handed[n]) for n, p in tool_model.named_parameters())
    tool_opt.set_lr_multiplier(mult)
    kept = [p.grad for p in tool_model.parameters()]
    assert optimizer_step(tool_model, tool_opt)
    # zeroed in place, never dropped (under DDP they are views into its buckets: distributed.wrap_ddp)
    assert all(p.grad is g and not g.any() for p, g in zip(tool_model.parameters(), kept))
    trained = t.model.state_dict()
    assert all(torch.equal(v, trained[n]) for n, v in tool_model.state_dict().items())


def test_a_step_with_a_non_finite_gradient_is_skipped():
    model = build_model(GPTConfig(vocab_size=64, depth=2, aspect_ratio=32, head_dim=32, max_seq_len=16))
    opt = ShardedOptimizer(model, matrix_lr=0.02, embedding_lr=0.2, unembedding_lr=0.004)
    before = {n: v.clone() for n, v in model.state_dict().items()}
    x = torch.randint(0, 64, (2, 16))
    forward_backward(model, x, x)
    next(model.parameters()).grad[0, 0] = float("nan")
    assert not optimizer_step(model, opt)
    assert all(torch.equal(v, before[n]) for n, v in model.state_dict().items())
    assert all(not p.grad.any() for p in model.parameters())  # the NaN cleared with the rest


def test_the_accumulated_step_equals_one_plain_backward_over_the_whole_batch(tmp_path, corpus):
    """An independent reference, built here without the shared step helpers: the trainer's step of 2
    accumulated micro-batches gives the loss, the gradients and the update of one plain
    loss.backward() over both micro-batches at once. Caught: forward_backward without its
    `/ grad_accum` (loss and gradients doubled), an optimizer step before the last micro-batch."""
    t, reference, reference_opt, inputs, handed, loss_sum, mult, _ = _one_trainer_step(tmp_path, corpus)
    x, y = torch.cat([a for a, _ in inputs]), torch.cat([b for _, b in inputs])
    loss = reference(x, y)  # the mean over all 256 tokens of the step
    loss.backward()
    assert torch.allclose(loss_sum, loss.detach(), rtol=1e-5, atol=1e-6), (loss_sum, loss)
    for n, p in reference.named_parameters():
        assert torch.allclose(handed[n], p.grad, rtol=1e-4, atol=1e-7), n
    reference_opt.set_lr_multiplier(mult)
    reference_opt.step()
    trained = t.model.state_dict()
    for n, v in reference.state_dict().items():
        assert torch.allclose(trained[n], v, rtol=1e-4, atol=1e-6), n


def test_the_first_step_is_two_updates_on_quartered_sequences_each_from_half_of_every_micro_batch(tmp_path, corpus):
    """The CPU defaults' first step (the warmups: quarter contexts, half batches, momentum 0.85): the
    first update reads the first half of the rows of both micro-batches, the second update the other
    half; the tools' step on the same inputs, update by update, gives the same weights bit for bit."""
    t, tool_model, tool_opt, inputs, handed, loss_sum, mult, first = _one_trainer_step(tmp_path, corpus, [], 2)
    assert all(x.shape == (8, 8) for x, _ in inputs)  # 4 sequences of 32 -> 16 of 8, 8 per update
    for i in range(2):  # micro-batch 1's halves, inputs and their targets
        assert torch.equal(torch.cat([inputs[0][i], inputs[2][i]]).reshape(4, 32), first[i])
    assert not torch.equal(inputs[1][0], inputs[0][0])  # micro-batch 2, not micro-batch 1 again
    tool_opt.set_lr_multiplier(mult)
    tool_opt.set_muon_momentum(0.85)
    total = torch.zeros(())
    for update in range(2):
        for x, y in inputs[2 * update: 2 * update + 2]:
            total += forward_backward(tool_model, x, y, grad_accum=2) / 2
        assert all(torch.equal(p.grad, handed[update][n]) for n, p in tool_model.named_parameters())
        assert optimizer_step(tool_model, tool_opt)
    assert torch.equal(total, loss_sum)
    trained = t.model.state_dict()
    assert all(torch.equal(v, trained[n]) for n, v in tool_model.state_dict().items())
