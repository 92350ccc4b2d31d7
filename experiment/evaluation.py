"""What the trainer (and the bench) measure of a model: the val loss summed over ranks, and a sample
(the user's own metric, and the demo's sums, are experiment/metric.py's)."""

from __future__ import annotations

import contextlib
import math

import torch

from experiment.batches import val_batches, val_window_count
from experiment.dataloader import Prepared
from experiment.distributed import Dist, autocast_for
from experiment.engine import generate
from experiment.model import GPT


def eval_parts(prepared: Prepared, max_tokens: int, seq_len: int,
               weights: list[float] | None = None) -> list[tuple[dict, float, int]]:
    """(source, weight, its eval sample's size in tokens) for each part the eval reads: with source
    `weights` (several sources, prepared.meta["source_splits"]) each source for max_tokens x its
    weight of its own val tokens (one window at least), else the whole val split for max_tokens."""
    splits = prepared.meta["source_splits"] if weights else None
    if not splits:
        split = prepared.meta["split"]
        splits, weights = [{"name": None, "val": [0, split["val_tokens"]], "val_chars": split["val_chars"]}], [1.0]
    return [(s, w, max(seq_len, int(max_tokens * w))) for s, w in zip(splits, weights)]


def eval_coverage(prepared: Prepared, max_tokens: int, seq_len: int,
                  weights: list[float] | None = None) -> tuple[int, int, bool]:
    """(tokens the eval sample predicts, tokens in the val split, whether the sample is every whole
    window of the split): what an eval line's val loss covers."""
    windows = [val_window_count(s["val"][1] - s["val"][0], seq_len, n)
               for s, _, n in eval_parts(prepared, max_tokens, seq_len, weights)]
    read = sum(k for k, _ in windows) * seq_len
    return read, prepared.meta["split"]["val_tokens"], all(k == n for k, n in windows)


@torch.no_grad()
def evaluate(model: GPT, prepared: Prepared, seq_len: int, batch_size: int, max_tokens: int, d: Dist,
             weights: list[float] | None = None) -> tuple[float, float, dict[str, float] | None]:
    """(val loss in nats/token, bits per character, each source's loss or None), summed over all
    ranks, in the trainer's precision, over the eval sample of each part (eval_parts, val_windows:
    windows spread evenly over the split); with several sources the loss and bpc are the weighted
    means."""
    val, losses, total, bpc = prepared.tokens("val"), {}, 0.0, 0.0
    for source, w, n in eval_parts(prepared, max_tokens, seq_len, weights):
        a, b = source["val"]
        loss = _val_loss(model, val[a:b], seq_len, batch_size, n, d)
        losses[source["name"]] = loss
        total += w * loss
        bpc += w * loss / math.log(2) / (source["val_chars"] / (b - a))
    return total, bpc, losses if len(losses) > 1 else None


def _val_loss(model: GPT, tokens, seq_len: int, batch_size: int, max_tokens: int, d: Dist) -> float:
    """Mean loss in nats/token over the eval sample of `tokens` (val_batches), summed over all ranks."""
    autocast = autocast_for(d.device)
    total = torch.zeros(2, dtype=torch.float64, device=d.device)  # [sum of losses, tokens]
    with evaluating(model):
        for x, y in val_batches(tokens, seq_len, batch_size, max_tokens, d.rank, d.world_size):
            x, y = x.to(d.device), y.to(d.device)
            with autocast:
                total[0] += model(x, y, reduction="sum").double()
            total[1] += y.numel()
    d.all_reduce(total)
    return (total[0] / total[1]).item()


@contextlib.contextmanager
def evaluating(model: GPT):
    """The model in eval mode, then back in the mode it was in: an eval or a sample inside training
    never drops (dropout), so it measures the weights that are served and draws no training RNG."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def sample_text(model: GPT, tok, prompt: list[int], n_tokens: int) -> str:
    """The model's continuation of `prompt`, decoded as the server and the sample command decode
    (seed 0, temperature 0.8): from one eval to the next only the model changes."""
    gen = torch.Generator().manual_seed(0)  # a private generator: sampling never shifts training RNG
    with evaluating(model):
        out = list(generate(model, prompt, n_tokens, temperature=0.8, generator=gen, allowed_vocab=tok.n_real))
    return tok.decode(out)

