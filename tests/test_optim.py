"""Muon + AdamW in ZeRO-1 shards: the partition, two ranks equal one, Newton-Schulz."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import tiny_config
from experiment.model import GPT
from experiment.optim import LRS, ShardedOptimizer, partition



def make_model() -> GPT:
    model = GPT(tiny_config(max_seq_len=16))
    model.init_weights(seed=0)
    return model


def fake_grads(model: GPT, step: int) -> None:
    """The same 'all-reduced' gradients on every rank, as DDP leaves them."""
    gen = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def run_steps(model: GPT, opt: ShardedOptimizer, steps: int) -> None:
    for step in range(steps):
        fake_grads(model, step)
        opt.set_lr_multiplier(1.0 - step / (2 * steps))
        opt.step()


def test_partition_is_balanced_deterministic_and_complete():
    sizes = {f"p{i}": s for i, s in enumerate([100, 90, 50, 40, 30, 20, 10, 5, 5])}
    owner = partition(sizes, 3)
    assert owner == partition(dict(reversed(sizes.items())), 3)  # order-independent
    assert set(owner) == set(sizes) and set(owner.values()) == {0, 1, 2}
    load = [sum(s for n, s in sizes.items() if owner[n] == r) for r in range(3)]
    assert max(load) - min(load) <= max(sizes.values())


def _zero1_worker(rank, world, init_file, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = make_model()
        opt = ShardedOptimizer(model, rank, world, **LRS)
        run_steps(model, opt, 4)
        torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                    "shard": opt.shard_state()}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    # As in experiment/train.py: skip interpreter finalization, where gloo's threads sometimes abort.
    os._exit(0)


@pytest.fixture(scope="module")
def zero1_world2(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero1")
    mp.spawn(_zero1_worker, args=(2, str(out / "init"), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.slow
def test_zero1_equals_unsharded_optimizer(zero1_world2):
    reference = make_model()
    run_steps(reference, ShardedOptimizer(reference, 0, 1, **LRS), 4)
    for rank in zero1_world2:
        for n, p in reference.named_parameters():
            torch.testing.assert_close(rank["params"][n], p.detach(), rtol=0, atol=0, msg=n)
    assert not torch.equal(reference.lm_head.weight, make_model().lm_head.weight)  # it did train


def test_each_rank_keeps_state_only_for_the_parameters_it_owns(zero1_world2):
    names = [n for n, _ in make_model().named_parameters()]
    owned = [set(r["shard"]["owned"]) for r in zero1_world2]
    assert owned[0].isdisjoint(owned[1]) and owned[0] | owned[1] == set(names)
    for r, shard in enumerate(zero1_world2):
        assert set(shard["shard"]["state"]) == owned[r]
    expected = partition({n: p.numel() for n, p in make_model().named_parameters()}, 2)
    assert owned[0] == {n for n, r in expected.items() if r == 0}


@pytest.mark.parametrize("world_to", [1, 3])
def test_state_moves_to_another_world_size(zero1_world2, world_to):
    shards = [r["shard"] for r in zero1_world2]
    saved = {n: s for shard in shards for n, s in shard["state"].items()}
    for rank in range(world_to):
        model = make_model()
        opt = ShardedOptimizer(model, rank, world_to, communicate=False, **LRS)
        loaded = opt.load_shards(shards)
        mine = [n for n, r in opt.owner.items() if r == rank]
        assert loaded == len(mine)
        state = opt.shard_state()["state"]
        for n in mine:
            for k, v in saved[n].items():
                assert torch.equal(state[n][k], v), (n, k)


def test_lr_multiplier_scales_every_group():
    opt = ShardedOptimizer(make_model(), **LRS)
    opt.set_lr_multiplier(0.25)
    for o in opt.optimizers:
        for g in o.param_groups:
            assert g["lr"] == pytest.approx(0.25 * g["initial_lr"])
    assert opt.matrix_lr() == pytest.approx(0.005)


def test_batched_muon_is_torch_muon_with_an_fp32_iteration():
    from experiment.optim import BatchedMuon, newton_schulz
    coeffs = torch.optim._muon.DEFAULT_A, torch.optim._muon.DEFAULT_B, torch.optim._muon.DEFAULT_C
    g = torch.randn(3, 48, 16, dtype=torch.float64)
    batched = newton_schulz(g, coeffs, 5, 1e-7)
    for i in range(3):  # torch's per-matrix iteration, run in float64 instead of bf16
        x = g[i].T / g[i].norm()
        for _ in range(5):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=coeffs[1], alpha=coeffs[2]), x, beta=coeffs[0])
        torch.testing.assert_close(batched[i], x.T)
    # Two steps of each optimizer on the same parameters: the same update up to torch's bf16 rounding,
    # and the same state, so a checkpoint of one loads into the other.
    torch.manual_seed(0)
    params = [[torch.randn(32, 16, requires_grad=True), torch.randn(16, 16, requires_grad=True),
               torch.randn(32, 16, requires_grad=True)] for _ in range(2)]
    params[1] = [p.detach().clone().requires_grad_() for p in params[0]]
    opts = [torch.optim.Muon(params[0], lr=0.05), BatchedMuon(params[1], lr=0.05)]
    for _ in range(2):
        grads = [torch.randn(32, 16), torch.randn(16, 16), torch.randn(32, 16)]
        for ps, opt in zip(params, opts):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            opt.step()
    for a, b in zip(*params):
        assert (a - b).norm() / a.norm() < 0.02
    fresh = BatchedMuon([p.detach().clone() for p in params[0]], lr=0.05)
    fresh.load_state_dict(opts[0].state_dict())
    torch.testing.assert_close(fresh.state_dict()["state"][0]["momentum_buffer"],
                               opts[1].state_dict()["state"][0]["momentum_buffer"])


def test_sharded_optimizer_uses_batched_muon_on_cpu():
    from experiment.optim import BatchedMuon
    opt = ShardedOptimizer(GPT(tiny_config()), **LRS)
    assert isinstance(opt.optimizers[0], BatchedMuon)


def test_lookup_tables_take_adamw_at_the_embedding_lr():
    model = GPT(tiny_config(bigram=True))
    opt = ShardedOptimizer(model, **LRS)
    muon, adamw = opt.optimizers
    assert not any(p is model.bigram.weight for p in muon.param_groups[0]["params"])
    group = next(g for g in adamw.param_groups if any(p is model.bigram.weight for p in g["params"]))
    assert any(p is model.wte.weight for p in group["params"])


def test_adamw_first_step_moves_each_entry_by_its_lr():
    """Adam's first update is lr x g / (|g| + eps): with the tiny eps every entry with a gradient moves
    by its group's lr (scaled by (768 / width) ** 0.5), whatever the gradient's size."""
    model = make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = ShardedOptimizer(model, **LRS)
    fake_grads(model, 0)
    for p in model.parameters():
        p.grad *= 1e-3  # a small gradient: a large eps would shrink its step
    opt.step()
    scale = (model.config.n_embd / 768) ** -0.5
    for name, lr in (("wte.weight", LRS["embedding_lr"]), ("lm_head.weight", LRS["unembedding_lr"])):
        moved = (model.get_parameter(name).detach() - before[name]).abs()
        torch.testing.assert_close(moved, torch.full_like(moved, lr * scale), rtol=1e-3, atol=0)
