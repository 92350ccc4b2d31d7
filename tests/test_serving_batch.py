"""Batched decoding (model.Batch, GPT.decode_step): each member gets exactly what generate gives it alone."""

import random

import pytest
import torch

from conftest import tiny_config
from experiment.model import GPT, Batch, KVCache, KVSlots, sample_next

VOCAB, ALLOWED = 64, 60


def tiny(seq: int) -> GPT:
    """The tiny config with weight in every block (zero-init projections would make blocks the identity)."""
    model = GPT(tiny_config(VOCAB, seq))
    model.init_weights(seed=0)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        model.lm_head.weight.mul_(200)
    return model.eval()


def test_decode_step_logits_are_bitwise_those_of_a_batch_one_decode():
    model = tiny(seq=32)
    rng = random.Random(0)
    seqs = [[rng.randrange(ALLOWED) for _ in range(n)] for n in (1, 7, 20, 31)]  # one ends at the last position
    slots = KVSlots(model.config, 6, "cpu", torch.float32)
    rows = [5, 0, 3, 2]  # any slot order
    alone = []
    with torch.no_grad():
        for seq, slot in zip(seqs, rows):
            cache = KVCache(model.config, 1, "cpu", torch.float32)
            if len(seq) > 1:  # the prefix: prefilled into the slot, and into a cache of its own
                model(torch.tensor([seq[:-1]]), cache=slots.slot(slot))
                model(torch.tensor([seq[:-1]]), cache=cache)
            alone.append(model(torch.tensor([seq[-1:]]), cache=cache)[0, -1])
    batched = model.decode_step([s[-1] for s in seqs], rows, [len(s) - 1 for s in seqs], slots)
    for row, logits in enumerate(alone):
        assert torch.equal(batched[row], logits), row
    with pytest.raises(ValueError, match="max_seq_len"):
        model.decode_step([1], [1], [32], slots)


def run_schedule(model: GPT, requests: list[dict], slots: int, seed: int) -> list[list[int]]:
    """Requests join at random steps while others run, and leave at their own length."""
    rng = random.Random(seed)
    batch = Batch(model, slots)
    waiting, running = list(range(len(requests))), {}
    outs = [[] for _ in requests]

    def take(slot, token):
        i = running[slot]
        outs[i].append(token)
        if len(outs[i]) == requests[i]["n"]:
            batch.leave(slot)
            del running[slot]

    while waiting or running:
        while waiting and batch.free and (not running or rng.random() < 0.4):
            i = waiting.pop(0)
            r = requests[i]
            slot, token = batch.join(r["prompt"], r["temperature"], r["top_k"], torch.Generator().manual_seed(i),
                                     ALLOWED, r["top_p"])
            running[slot] = i
            take(slot, token)
        if running:
            for slot, token in batch.step().items():
                take(slot, token)
    return outs


@pytest.mark.parametrize("slots", [3, 8])
def test_batch_members_get_exactly_what_generate_gives_alone(slots):
    model = tiny(seq=16)  # short context: most requests outgrow it, so the cache is rebuilt mid-batch
    rng = random.Random(slots)
    requests = [{"prompt": [rng.randrange(ALLOWED) for _ in range(rng.randint(1, 24))], "n": rng.randint(1, 45),
                 "temperature": (0.0, 1.0, 0.7, 1.5)[i % 4], "top_k": (None, 5, None)[i % 3],
                 "top_p": (None, None, 0.9, 0.5, None)[i % 5]} for i in range(10)]
    batched = run_schedule(model, requests, slots, seed=slots)
    for i, r in enumerate(requests):
        alone = list(model.generate(r["prompt"], r["n"], r["temperature"], r["top_k"],
                                    torch.Generator().manual_seed(i), allowed_vocab=ALLOWED, top_p=r["top_p"]))
        assert batched[i] == alone, i
    assert any(len(r["prompt"]) + r["n"] > 16 for r in requests)
    assert len({t for out in batched for t in out}) > 5  # not a degenerate model


def test_batch_slots_are_reused_and_a_full_batch_refuses():
    model = tiny(seq=16)
    batch = Batch(model, 2)
    a, _ = batch.join([1, 2], temperature=0)
    b, _ = batch.join([3], temperature=0)
    assert {a, b} == {0, 1} and not batch.free
    with pytest.raises(RuntimeError, match="every slot"):
        batch.join([4], temperature=0)
    batch.leave(a)
    assert batch.join([4], temperature=0)[0] == a and set(batch.step()) == {0, 1}
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
