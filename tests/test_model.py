"""The GPT: shapes, init, the KV cache against the full forward, overfitting one batch."""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import tiny_config
from experiment.model import GPT, GPTConfig
from experiment.optim import LRS, ShardedOptimizer


def tiny(seq=32, vocab=64, perturb=True, bigram=False) -> GPT:
    torch.manual_seed(0)
    model = GPT(tiny_config(vocab, seq, bigram))
    model.init_weights(seed=0)
    if perturb:  # zero-init residual projections make every block the identity; give them weight
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
            model.lm_head.weight.mul_(200)
    return model.eval()


def test_width_and_heads_follow_depth():
    c = GPTConfig(vocab_size=64, depth=6)
    assert (c.n_layer, c.n_embd, c.n_head) == (6, 384, 3)
    with pytest.raises(ValueError, match="head_dim"):
        GPTConfig(vocab_size=64, depth=3, aspect_ratio=40, head_dim=128)


def test_init_is_reproducible_and_starts_near_uniform():
    a, b = tiny(perturb=False), tiny(perturb=False)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    x = torch.randint(0, 64, (2, 16))
    loss = a(x, x).item()
    assert abs(loss - math.log(64)) < 0.05  # near-zero head: every prediction starts uniform


@pytest.mark.parametrize("bigram", [False, True])
def test_kv_cache_logits_equal_full_forward(bigram):
    model = tiny(bigram=bigram)
    ids = torch.randint(0, 64, (1, 20))
    from experiment.model import KVCache

    full = model(ids)
    cache = KVCache(model.config, 1, "cpu", torch.float32)
    prefix = model(ids[:, :7], cache=cache)
    chunk = model(ids[:, 7:12], cache=cache)  # a multi-token chunk after a prefix uses the explicit mask
    steps = [model(ids[:, i : i + 1], cache=cache) for i in range(12, 20)]
    incremental = torch.cat([prefix, chunk, *steps], dim=1)
    torch.testing.assert_close(incremental, full, atol=1e-3, rtol=1e-4)  # logits are O(100) here


@pytest.mark.parametrize("temperature,top_k,bigram", [(0.0, None, False), (1.0, 5, False), (1.0, 5, True)])
def test_kv_cache_generation_equals_naive(temperature, top_k, bigram):
    model = tiny(bigram=bigram)
    prompt = [1, 2, 3, 4, 5]
    runs = []
    for use_cache in (True, False):
        gen = torch.Generator().manual_seed(123)
        runs.append(list(model.generate(prompt, 25, temperature, top_k, gen, use_cache=use_cache)))
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1  # a degenerate model would make the comparison meaningless


def test_generation_continues_past_the_context():
    model = tiny(seq=16)
    out = list(model.generate([1, 2, 3], 40, temperature=0.0))
    assert len(out) == 40 and all(0 <= t < 64 for t in out)


def test_allowed_vocab_masks_padding_ids():
    model = tiny()
    out = list(model.generate([1], 50, temperature=1.0, generator=torch.Generator().manual_seed(0), allowed_vocab=10))
    assert max(out) < 10


def test_bigram_rows_pair_each_token_with_the_one_before():
    model = tiny(bigram=True)
    V, rows = 64, model.config.bigram_rows
    assert rows == 65 * 64  # every (previous or none, current) pair has its own row
    assert GPTConfig(vocab_size=50304, bigram_vocab=50257).bigram_rows == 1 << 14  # BPE: hashed, bounded
    ids = torch.tensor([[3, 5, 7], [9, 9, 1]])
    assert model.bigram_ids(ids).tolist() == [[V * V + 3, 3 * V + 5, 5 * V + 7], [V * V + 9, 9 * V + 9, 9 * V + 1]]
    # With identity blocks (the init) a position's logits are a function of its pair alone.
    bare = tiny(perturb=False, bigram=True)
    with torch.no_grad():
        bare.bigram.weight.normal_()
        bare.lm_head.weight.normal_()
    logits = lambda seq: bare(torch.tensor([seq]))[0]  # noqa: E731
    a, b = logits([4, 2, 6]), logits([1, 2, 6])
    torch.testing.assert_close(a[2], b[2])  # (2, 6) in both
    torch.testing.assert_close(logits([2, 6])[1], a[2])
    assert not torch.allclose(a[1], b[1])  # (4, 2) against (1, 2)
    assert not torch.allclose(logits([2])[0], a[1])  # (none, 2) against (4, 2)
    # the table is a lookup: it adds no matmul FLOPs and is not counted as a multiplied parameter
    plain = tiny(bigram=False)
    assert model.num_params(exclude_embedding=True) == plain.num_params(exclude_embedding=True)
    assert model.estimate_flops() == plain.estimate_flops()


def test_estimate_flops_matches_flop_counter():
    model = tiny(seq=64, perturb=False, bigram=True).train()
    c = model.config
    B, T = 2, 64
    x = torch.randint(0, 64, (B, T))
    with FlopCounterMode(display=False) as counter:
        model(x, x).backward()
    matmul = counter.get_flop_counts()["Global"][torch.ops.aten.mm] / (B * T)
    # The CPU SDPA kernel is not counted by FlopCounterMode: count the same attention spelled out.
    q = torch.randn(B, c.n_head, T, c.head_dim, requires_grad=True)
    k, v = torch.randn_like(q, requires_grad=True), torch.randn_like(q, requires_grad=True)
    with FlopCounterMode(display=False) as att:
        ((q @ k.transpose(-1, -2)).softmax(-1) @ v).sum().backward()
    attention = c.n_layer * att.get_total_flops() / (B * T)
    assert matmul == 6 * model.num_params(exclude_embedding=True)
    assert matmul + attention == pytest.approx(model.estimate_flops(T), rel=1e-3)


@pytest.mark.slow
def test_one_batch_overfits():
    torch.manual_seed(0)
    model = GPT(tiny_config())
    model.init_weights(seed=0)
    opt = ShardedOptimizer(model, **LRS)
    x = torch.randint(1, 64, (4, 32))
    y = torch.roll(x, -1, dims=1)
    first = None
    for _ in range(150):
        loss = model(x, y)
        first = first if first is not None else loss.item()
        loss.backward()
        opt.step()
        model.zero_grad(set_to_none=True)
    assert first > 3.5 and loss.item() < 0.1


def test_relu_squared_matches_autograd_of_the_plain_ops():
    from experiment.model import relu_squared
    x = torch.randn(4, 8, 16, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    g = torch.randn(4, 8, 16, dtype=torch.float64)
    relu_squared(x).backward(g)
    torch.nn.functional.relu(x2).square().backward(g)
    torch.testing.assert_close(relu_squared(x), torch.nn.functional.relu(x2).square())
    torch.testing.assert_close(x.grad, x2.grad)
    assert torch.autograd.gradcheck(relu_squared, (torch.randn(3, 5, dtype=torch.float64, requires_grad=True),))


@pytest.mark.slow
def test_building_and_counting_a_model_never_imports_dynamo_and_a_cpu_embedding_keeps_torchs_init():
    """build_model builds on the meta device, and the memory planner counts parameters there; torch's
    normal_ and arange on a meta tensor would import torch._dynamo, seconds of every pre-flight,
    server and plan on a small CPU. Off the meta device the embedding initializes as torch's does."""
    import subprocess
    import sys

    from conftest import ENV, REPO
    code = ("import sys\nfrom experiment.model import GPTConfig, build_model\nfrom experiment.memory import count_params\n"
            "c = GPTConfig(vocab_size=64, depth=2, aspect_ratio=32, head_dim=32, max_seq_len=32, bigram_vocab=64)\n"
            "count_params(c)\nbuild_model(c, seed=1)\nprint('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
    from experiment.model import Embedding
    torch.manual_seed(3)
    ours = Embedding(8, 4)
    torch.manual_seed(3)
    assert torch.equal(ours.weight, torch.nn.Embedding(8, 4).weight)
