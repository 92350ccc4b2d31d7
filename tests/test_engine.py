"""Batched decoding (engine.Batch, engine.decode_step): each member gets exactly what it gets alone."""

import random

import pytest
import torch

from conftest import tiny_config
from experiment import engine
from experiment.engine import Batch, KVSlots, block_linear, decode_step
from experiment.model import GPT, GPTConfig, sample_next

VOCAB, ALLOWED = 64, 60


def tiny(seq: int, bigram: bool = False) -> GPT:
    """The tiny config with weight in every block (zero-init projections would make blocks the identity)."""
    model = GPT(tiny_config(VOCAB, seq, bigram))
    model.init_weights(seed=0)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        model.lm_head.weight.mul_(200)
    return model.eval()


def prefilled(model: GPT, seqs: list[list[int]]) -> KVSlots:
    """A KVSlots holding every sequence but its last token, sequence i in slot i."""
    slots = KVSlots(model.config, len(seqs) + 2, "cpu", model.wte.weight.dtype)
    slots.k.normal_(), slots.v.normal_()  # stale values from earlier occupants must not matter
    with torch.no_grad():
        for i, seq in enumerate(seqs):
            if len(seq) > 1:
                model(torch.tensor([seq[:-1]]), cache=slots.slot(i))
    return slots


def previous(seqs: list[list[int]]) -> list[int]:
    """Each sequence's token before its last (the bigram's "none", VOCAB, for a lone token)."""
    return [s[-2] if len(s) > 1 else VOCAB for s in seqs]


@pytest.mark.parametrize("dtype,bigram", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_decode_step_is_batch_invariant_and_agrees_with_forward(dtype, bigram):
    model = tiny(seq=160, bigram=bigram).to(dtype)
    rng = random.Random(0)
    # each attends over its own span (64, 128 or 160 positions), alone or together
    seqs = [[rng.randrange(ALLOWED) for _ in range(n)] for n in (1, 7, 70, 160, 130, 3)]  # one fills the context
    batched = decode_step(model, [s[-1] for s in seqs], [len(s) - 1 for s in seqs], prefilled(model, seqs),
                          previous(seqs))
    for i, seq in enumerate(seqs):
        alone = decode_step(model, [seq[-1]], [len(seq) - 1], prefilled(model, [seq]), previous([seq]))
        assert torch.equal(batched[i], alone[0]), i  # bit for bit, whatever the other rows
        with torch.no_grad():
            full = model(torch.tensor([seq]))[0, -1]
        # logits are O(100) here; bf16 keeps 8 bits of mantissa
        torch.testing.assert_close(batched[i], full, **({"atol": 1e-3, "rtol": 1e-4} if dtype == torch.float32
                                                        else {"atol": 2.0, "rtol": 0.05}))
    with pytest.raises(ValueError, match="max_seq_len"):
        decode_step(model, [1], [160], prefilled(model, [[1]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_step_is_batch_invariant_with_one_wide_head(dtype):
    """One head of 128 over up to 300 positions. One bmm over the batch's (row, head) pairs gave the
    long rows other bits in a batch of 8 than alone (fp32, MKL on a Xeon): the BLAS plans a batched
    product by its batch count. Attention row by row does not."""
    model = GPT(GPTConfig(vocab_size=VOCAB, depth=2, aspect_ratio=64, head_dim=128, max_seq_len=320))
    model.init_weights(seed=0)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    model = model.to(dtype).eval()
    rng = random.Random(0)
    seqs = [[rng.randrange(ALLOWED) for _ in range(n)] for n in (1, 7, 70, 300, 130, 3, 256, 200)]
    batched = decode_step(model, [s[-1] for s in seqs], [len(s) - 1 for s in seqs], prefilled(model, seqs))
    for i, seq in enumerate(seqs):
        alone = decode_step(model, [seq[-1]], [len(seq) - 1], prefilled(model, [seq]))
        assert torch.equal(batched[i], alone[0]), (i, len(seq))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_linear_gives_a_row_the_same_bits_in_any_batch(dtype):
    # bf16 rounding hides most summation-order differences, so many rows: with a plain bmm, a batch
    # of one differed from batches of 2+ in 11 of these 4,096 rows. Batches of 7 put each row in
    # another place of its block, beside other rows, than batches of 2 or 64 do.
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(64, 64, generator=gen) * 10)
    layer = layer.to(dtype)
    x = torch.randn(4096, 1, 64, generator=gen).to(dtype)
    by_batch = {b: torch.cat([block_linear(x[i : i + b], layer) for i in range(0, 4096, b)]) for b in (1, 2, 7, 64)}
    for b in (2, 7, 64):
        assert torch.equal(by_batch[b], by_batch[1]), b


def run_schedule(model: GPT, requests: list[dict], slots: int, seed: int) -> list[list[int]]:
    """Requests join at random steps while others run, and leave at their own length."""
    rng = random.Random(seed)
    batch = Batch(model, slots, ALLOWED)
    waiting, running = list(range(len(requests))), {}
    outs = [[] for _ in requests]

    def take(member, token):
        i = running[member]
        outs[i].append(token)
        if len(outs[i]) == requests[i]["n"]:
            batch.leave(member)
            del running[member]

    while waiting or running:
        while waiting and batch.free and (not running or rng.random() < 0.4):
            i = waiting.pop(0)
            r = requests[i]
            member, token = batch.join(r["prompt"], r["temperature"], r["top_k"], torch.Generator().manual_seed(r["seed"]),
                                       r["top_p"])
            running[member] = i
            take(member, token)
        if running:
            for member, token in batch.step().items():
                take(member, token)
    return outs


def requests_for(seed: int, n: int = 10, longest: int = 45) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": [rng.randrange(ALLOWED) for _ in range(rng.randint(1, 24))], "n": rng.randint(1, longest),
             "temperature": (0.0, 1.0, 0.7, 1.5)[i % 4], "top_k": (None, 5, None)[i % 3],
             "top_p": (None, None, 0.9, 0.5, None)[i % 5], "seed": i} for i in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("slots,seq,bigram", [(3, 16, False), (8, 16, True), (5, 80, False)])
def test_batch_members_get_exactly_what_they_get_alone(slots, seq, bigram):
    # Context 16: most requests outgrow it, so caches are rebuilt mid-batch. Context 80: decode steps
    # attend over 64 or 80 positions, by the longest member.
    model = tiny(seq=seq, bigram=bigram)
    requests = requests_for(slots, n=10, longest=5 * seq)
    batched = run_schedule(model, requests, slots, seed=slots)
    alone = [run_schedule(model, [r], 1, seed=0)[0] for r in requests]
    assert batched == alone
    assert any(len(r["prompt"]) + r["n"] > seq for r in requests)
    assert len({t for out in batched for t in out}) > 5  # not a degenerate model


@pytest.mark.parametrize("bigram", [False, True])
def test_batch_greedy_tokens_are_generates(bigram):
    """Decode steps agree with forward to float rounding, so greedy tokens are generate's (also
    across cache rebuilds, where the bigram's previous token restarts as none)."""
    model = tiny(seq=16, bigram=bigram)
    requests = [{**r, "temperature": 0.0, "top_k": None, "top_p": None} for r in requests_for(0, 6)]
    for r, out in zip(requests, run_schedule(model, requests, 4, seed=1)):
        assert out == list(model.generate(r["prompt"], r["n"], 0.0, allowed_vocab=ALLOWED))


def test_batch_slots_are_reused_and_a_full_batch_refuses():
    model = tiny(seq=16)
    batch = Batch(model, 2)
    a, _ = batch.join([1, 2], temperature=0)
    b, _ = batch.join([3], temperature=0)
    assert a != b and batch.free == 0
    with pytest.raises(RuntimeError, match="every slot"):
        batch.join([4], temperature=0)
    batch.leave(a)  # b moves into slot 0
    c, _ = batch.join([4], temperature=0)
    assert batch.free == 0 and set(batch.step()) == {b, c} and [m.id for m in batch.rows] == [b, c]
    with pytest.raises(ValueError, match="prompt token"):
        Batch(model, 1).join([])


def test_top_p_samples_only_the_smallest_set_reaching_p():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    gen = torch.Generator().manual_seed(0)

    def drawn(top_p):
        return {sample_next(logits, 1.0, None, gen, top_p=top_p) for _ in range(400)}

    assert drawn(0.8) == {0, 1}  # 0.5 + 0.3 reaches 0.8
    assert drawn(0.81) == {0, 1, 2}
    assert drawn(0.1) == {0}
    assert drawn(None) == drawn(1.0) == {0, 1, 2, 3}


def test_leave_moves_only_the_live_prefix_and_clear_drops_every_member():
    model = tiny(seq=16)
    batch = Batch(model, 3)
    batch.caches[0].k.normal_(), batch.caches[0].v.normal_()  # stale values past a member's positions
    a, _ = batch.join([1, 2, 3], temperature=0)
    b, _ = batch.join([4, 5, 6, 7, 8], temperature=0)
    batch.step()
    n = batch.rows[1].pos
    assert n == 6
    k1, v1, k0 = batch.caches[0].k[:, 1].clone(), batch.caches[0].v[:, 1].clone(), batch.caches[0].k[:, 0].clone()
    batch.leave(a)  # b moves from slot 1 into slot 0: its n positions, not the whole slot
    assert torch.equal(batch.caches[0].k[:, 0, :, :n], k1[:, :, :n]) and torch.equal(batch.caches[0].v[:, 0, :, :n], v1[:, :, :n])
    assert torch.equal(batch.caches[0].k[:, 0, :, n:], k0[:, :, n:])
    assert [m.id for m in batch.rows] == [b] and batch.rows[0].pos == n
    batch.clear()
    assert batch.rows == [] and batch.free == 3 and batch.step() == {}
    c, _ = batch.join([1, 2, 3], temperature=0)
    assert [m.id for m in batch.rows] == [c]


def test_a_step_that_rebuilds_every_member_runs_no_decode(monkeypatch):
    model = tiny(seq=16)
    batch = Batch(model, 2)
    a, _ = batch.join(list(range(16)), temperature=0)  # fills the context: its next step is a rebuild
    b, _ = batch.join(list(range(20, 36)), temperature=0)
    decodes = []
    original = engine.decode_step
    monkeypatch.setattr(engine, "decode_step", lambda *args: decodes.append(1) or original(*args))
    assert set(batch.step()) == {a, b} and decodes == []
    assert set(batch.step()) == {a, b} and decodes == [1]
    for prompt, member in ((list(range(16)), batch.rows[0]), (list(range(20, 36)), batch.rows[1])):
        assert member.tokens[16:] == list(model.generate(prompt, 3, 0.0))


def other(seq: int, bigram: bool = False, seed: int = 2) -> GPT:
    """A second model of tiny's shape with other weights: an ensemble member."""
    model = tiny(seq, bigram)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def test_an_ensemble_draws_from_the_mean_of_its_members_probabilities():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, VOCAB, generator=gen) * 5, torch.randn(3, VOCAB, generator=gen) * 5
    mean = (a[:, :ALLOWED].softmax(-1) + b[:, :ALLOWED].softmax(-1)) / 2  # the padding is out of each
    mixed = engine.mix_logits([a, b], ALLOWED)
    torch.testing.assert_close(mixed[:, :ALLOWED].exp(), mean)
    assert torch.isinf(mixed[:, ALLOWED:]).all()
    assert engine.mix_logits([a], ALLOWED) is a  # one model decodes exactly as before
    # Greedy ensemble tokens are the argmax of the mean of the members' full-forward probabilities.
    models, prompt = [tiny(seq=64), other(seq=64)], [3, 1, 4, 1, 5]
    out = list(engine.generate(models, prompt, 30, 0.0, allowed_vocab=ALLOWED))
    seq = list(prompt)
    with torch.no_grad():
        for token in out:
            probs = sum(m(torch.tensor([seq]))[0, -1, :ALLOWED].softmax(-1) for m in models) / 2
            assert token == int(probs.argmax())
            seq.append(token)
    alone = [list(engine.generate(m, prompt, 30, 0.0, allowed_vocab=ALLOWED)) for m in models]
    assert out != alone[0] and out != alone[1]  # neither member's own tokens


@pytest.mark.slow
@pytest.mark.parametrize("bigram", [False, True])
def test_an_ensembles_requests_get_exactly_what_they_get_alone(bigram):
    """The batch invariance of a single model, for an ensemble: each member's decode is invariant and
    the mean is taken row by row. Context 16: caches are rebuilt mid-batch, in every member."""
    models = [tiny(seq=16, bigram=bigram), other(seq=16, bigram=bigram)]
    requests = requests_for(4, n=10, longest=60)
    batched = run_schedule(models, requests, 4, seed=4)
    assert batched == [run_schedule(models, [r], 1, seed=0)[0] for r in requests]
    assert run_schedule([models[0]], requests, 4, seed=4) == run_schedule(models[0], requests, 4, seed=4)
    assert batched != run_schedule(models[0], requests, 4, seed=4)


def test_an_ensembles_members_need_one_vocabulary_and_context():
    with pytest.raises(ValueError, match="member 2 has max_seq_len 32, member 1 has 16"):
        Batch([tiny(seq=16), tiny(seq=32)], 2)
    with pytest.raises(ValueError, match="member 3 has max_seq_len 16, member 1 has 32"):
        Batch([tiny(seq=32), tiny(seq=32), tiny(seq=16)], 2)
    # equal settings are equal whatever objects hold them (300 and int("300") are two ints)
    assert len(Batch([tiny(seq=300), other(seq=int("300"))], 2).caches) == 2


def test_generate_samples_at_temperature_1_by_default():
    model, prompt = tiny(seq=64), [3, 1, 4]
    default = list(engine.generate(model, prompt, 20, generator=torch.Generator().manual_seed(5)))
    assert default == list(engine.generate(model, prompt, 20, 1.0, generator=torch.Generator().manual_seed(5)))
