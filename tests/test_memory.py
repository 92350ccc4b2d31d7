"""The memory plan: activation counts, modes, the largest device batch that fits."""

import subprocess
import sys

import pytest
import torch

from conftest import REPO
from experiment.memory import activation_bytes, choose_mode, count_params, largest_fitting_batch, plan_memory
from experiment.model import GPT, GPTConfig
from experiment.optim import LRS, ShardedOptimizer, partition

CONFIG = GPTConfig(vocab_size=128, depth=3, aspect_ratio=32, head_dim=32, max_seq_len=64)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _most_loaded_rank(model, world):
    owner = partition({n: p.numel() for n, p in model.named_parameters()}, world)
    sizes = dict((n, p.numel()) for n, p in model.named_parameters())
    return max(range(world), key=lambda r: sum(s for n, s in sizes.items() if owner[n] == r))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_plan_matches_measured_tensor_sizes(precision):
    world, batch, seq = 3, 2, 64
    model = GPT(CONFIG)
    model.init_weights(seed=0)
    rank = _most_loaded_rank(model, world)
    opt = ShardedOptimizer(model, rank, world, **LRS, master_weights=precision == "bf16", communicate=False)
    if precision == "bf16":
        model.to(torch.bfloat16)
    params = {p.data_ptr() for p in model.parameters()} | {b.data_ptr() for b in model.buffers()}
    saved = {}

    def pack(t):
        if t.data_ptr() not in params:
            saved[(t.data_ptr(), tuple(t.shape), t.dtype)] = t.numel() * t.element_size()
        return t

    x = torch.randint(0, 128, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, x)
    loss.backward()
    opt.step()
    plan = plan_memory(CONFIG, world, batch, seq, precision, activation_checkpointing=False, cuda=False)
    assert plan.rows["weights"] == _bytes(model.parameters())
    assert plan.rows["grads"] == _bytes(p.grad for p in model.parameters())
    assert plan.rows["fp32 masters"] == 2 * _bytes(opt.master.values())  # masters + their fp32 grads
    state = [v for o in opt.optimizers for s in o.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim]
    assert plan.rows["optimizer state"] == _bytes(state)
    if precision == "fp32":  # on CPU the planner's fp32 activations are what autograd really saved
        assert plan.rows["activations"] == pytest.approx(sum(saved.values()), rel=0.01)


def test_activation_checkpointing_saves_less_and_changes_nothing():
    model = GPT(CONFIG)
    model.init_weights(seed=0)
    x = torch.randint(0, 128, (2, 64))
    grads, saved = {}, {}
    for recompute in (False, True):
        model.activation_checkpointing = recompute
        count = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: count.append(t.numel()) or t, lambda t: t):
            loss = model(x, x)
        loss.backward()
        grads[recompute] = [p.grad.clone() for p in model.parameters()]
        saved[recompute] = sum(count)
        model.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))
    assert saved[True] < saved[False] / 3
    # the plan adds back the one block recomputed at a time
    assert activation_bytes(CONFIG, 2, 64, True, 4) < activation_bytes(CONFIG, 2, 64, False, 4) / 2


def test_mode_choice_prefers_cheap_compute_and_honours_settings():
    gib = 2**30
    d64 = GPTConfig(vocab_size=128, depth=64, max_seq_len=2048)
    plan = choose_mode(d64, 8, 2, 2048, 80 * gib)
    assert (plan.precision, plan.activation_checkpointing) == ("bf16", True)  # the only mode that fits 80 GB
    assert choose_mode(d64, 8, 2, 2048, 80 * gib, precision="fp32") is None
    d12 = GPTConfig(vocab_size=128, depth=12, max_seq_len=2048)
    plan = choose_mode(d12, 8, 8, 2048, 80 * gib)
    assert (plan.precision, plan.activation_checkpointing) == ("fp32", False)
    assert choose_mode(d12, 8, 8, 2048, 80 * gib, activation_checkpointing="on").activation_checkpointing


def test_a_generations_teacher_is_counted_and_d64_with_one_does_not_fit_80_gb():
    """A later generation holds its frozen teacher whole on every GPU (bf16 on CUDA, fp32 on CPU) and
    three fp32 tensors of the logits' size for the distillation term: d56 and its teacher fit 8 x 80
    GB; d64 alone fits, but not beside a teacher of its size, in any mode."""
    gib = 2**30
    d64 = GPTConfig(vocab_size=128, depth=64, max_seq_len=2048)
    alone = plan_memory(d64, 8, 2, 2048, "bf16", True)
    taught = plan_memory(d64, 8, 2, 2048, "bf16", True, teacher_params=1000)
    logits = 4 * 2 * 2048 * 128  # fp32, batch 2 x 2048 positions x the vocabulary
    assert taught.rows["teacher"] == 1000 * 2 + 3 * logits and "teacher" not in alone.rows
    assert plan_memory(d64, 8, 2, 2048, "fp32", False, teacher_params=1000).rows["teacher"] == 1000 * 2 + 3 * logits
    assert plan_memory(d64, 8, 2, 2048, "fp32", False, cuda=False, teacher_params=1000).rows["teacher"] == \
        1000 * 4 + 3 * logits
    n = count_params(d64)
    assert choose_mode(d64, 8, 1, 2048, 80 * gib) is not None
    assert choose_mode(d64, 8, 1, 2048, 80 * gib, teacher_params=n) is None
    d56 = GPTConfig(vocab_size=128, depth=56, max_seq_len=2048)
    assert choose_mode(d56, 8, 1, 2048, 80 * gib, teacher_params=count_params(d56)) is not None


def test_device_batch_halves_until_it_fits():
    tried = []

    def fake(b):
        tried.append(b)
        if b > 5:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    assert largest_fitting_batch(fake, 64) == 4 and tried == [64, 32, 16, 8, 4]
    assert largest_fitting_batch(lambda b: fake(100), 8) == 0


@pytest.mark.slow
def test_plan_and_fitprobe_commands_print_their_fields():
    proc = subprocess.run([sys.executable, "-m", "experiment.tools.bench", "plan", "--depth", "64", "--nproc", "8",
                           "--gpu_mem_gb", "80", "--device_batch_size", "2"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for row in ("weights", "grads", "fp32 masters", "optimizer state", "activations", "overhead", "total"):
        assert row in proc.stdout
    assert "12.89B params" in proc.stdout and "bf16 +ckpt | largest device batch that fits:" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "experiment.tools.bench", "fitprobe", "--depth", "2", "--aspect_ratio",
                           "32", "--head_dim", "32", "--seq", "32", "--world", "3", "--device_batch_sizes", "1,2"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("fitprobe | device batch") == 2


def test_nccl_buffers_are_planned_for_collectives_and_held_back_by_the_probe():
    from experiment.memory import NCCL_BUFFER_BYTES, probe_reserve_bytes

    config = GPTConfig(vocab_size=256, depth=24, aspect_ratio=64, head_dim=128, max_seq_len=2048)
    eight = plan_memory(config, 8, 4, 2048, "bf16", False)
    assert eight.rows["NCCL buffers"] == NCCL_BUFFER_BYTES
    assert plan_memory(config, 1, 4, 2048, "bf16", False).rows["NCCL buffers"] == 0  # no process group
    simulated = plan_memory(config, 8, 4, 2048, "bf16", False, collectives=False)  # the fit probe's world
    assert eight.total - simulated.total > NCCL_BUFFER_BYTES  # the overhead fraction applies to it too
    # the probe measures weights, gradients and activations; it holds back the rest it cannot see
    assert probe_reserve_bytes(eight) == (eight.rows["optimizer state"] + eight.rows["fp32 masters"] // 2
                                          + NCCL_BUFFER_BYTES)
