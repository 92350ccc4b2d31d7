"""DEPTH=auto: the model size that the budget and the data support, from throughput measured here.

The rule (fitted from the README's sweep of budget x depth on a 2-core CPU, "DEPTH=auto"): a depth is
eligible if the budget, at its measured tok/s, gives it at least MIN_TOKENS_PER_PARAM tokens per
parameter and repeats the training data at most MAX_EPOCHS times; of those, take the one nearest
TOKENS_PER_PARAM tokens per parameter (in log). A faster machine or a longer budget buys more tokens,
so a larger model; a small corpus rules out the small models that would cycle through it many
times. When none is eligible, the largest depth that still gets MIN_TOKENS_PER_PARAM (the budget
outruns the data: the planner warns), else the smallest.

The same arithmetic answers an explicit DEPTH: `supported_depth` is the largest depth on the ladder
that MAX_EPOCHS passes over the data give MIN_TOKENS_PER_PARAM tokens per parameter, the most the
rule could ever pick on this data, and `data_lines` warns when a depth will repeat the data more
than MAX_GOOD_EPOCHS times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from experiment.hardware import mean_seconds
from experiment.memory import count_params
from experiment.model import GPTConfig, build_model
from experiment.optim import LRS, ShardedOptimizer
from experiment.runlog import MAX_GOOD_EPOCHS
from experiment.step import forward_backward, optimizer_step

# Fitted (README, DEPTH=auto): the loss-minimizing tokens/param, from a parabola in log tokens/param
# through d2, d4 and d6, was 10.5 at a 60 s budget and 7.3 at 180 s; 9 is their geometric mean.
TOKENS_PER_PARAM = 9.0
# Fitted: the winners repeated Tiny Shakespeare 4.8 (d2, 60 s), 3.0 (d4, 180 s) and 4.0 (d6, 600 s)
# times; the losers the rule must exclude, 13.9 (d2, 180 s) and 11.4 (d4, 600 s). Repeating data
# past about 4 epochs stops paying (Muennighoff et al. 2023); 8 lies between the two groups.
MAX_EPOCHS = 8
# Fitted: the 600 s winner (d6) got 1.5 tokens/param; losers that got less: d6 at 180 s (0.39), d8 at
# 180 s (0.2).
MIN_TOKENS_PER_PARAM = 1.0
LADDER = (2, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 56, 64)
PROBE_STEPS = 2  # timed steps per candidate at the run's micro-batch, after one warm-up step


@dataclass
class Candidate:
    depth: int
    width: int
    params: int
    tok_per_s: float  # measured, all ranks together
    tokens: float  # in the budget at that rate
    epochs: float

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.params


def ladder(aspect_ratio: int, head_dim: int) -> list[int]:
    """Depths whose width the head size divides."""
    return [d for d in LADDER if (d * aspect_ratio) % head_dim == 0]


def measure_tok_per_s(config: GPTConfig, batch: int, device: torch.device) -> float:
    """One rank's training tok/s over PROBE_STEPS steps after a warm-up step, on random tokens,
    eager: the trainer's own step (experiment/step.py), one micro-batch per step."""
    model = build_model(config, device)
    opt = ShardedOptimizer(model, **LRS, communicate=False)
    x = torch.randint(0, config.vocab_size, (batch, config.max_seq_len), device=device)

    def step() -> None:
        forward_backward(model, x, x)
        optimizer_step(model, opt)

    mean_seconds(device, 1, step)  # warm-up
    return batch * config.max_seq_len / mean_seconds(device, PROBE_STEPS, step)


def candidate(config: GPTConfig, tok_per_s: float, budget_s: float, train_tokens: int) -> Candidate:
    tokens = tok_per_s * budget_s
    return Candidate(config.depth, config.n_embd, count_params(config), tok_per_s, tokens, tokens / train_tokens)


def choose(candidates: list[Candidate]) -> Candidate:
    trained = [c for c in candidates if c.tokens_per_param >= MIN_TOKENS_PER_PARAM]
    eligible = [c for c in trained if c.epochs <= MAX_EPOCHS]
    if eligible:
        return min(eligible, key=lambda c: abs(math.log(c.tokens_per_param / TOKENS_PER_PARAM)))
    return max(trained, key=lambda c: c.params) if trained else min(candidates, key=lambda c: c.params)


def probe_and_choose(make_config, batch: int, device: torch.device, world_size: int, budget_s: float,
                     train_tokens: int) -> tuple[Candidate, list[Candidate]]:
    """Measure the ladder from the smallest depth up until no larger depth can be chosen (one below
    MIN_TOKENS_PER_PARAM, or below half the target and within MAX_EPOCHS: larger ones only get
    fewer tokens per parameter), then choose. make_config(depth) -> GPTConfig."""
    candidates = []
    for depth in ladder(make_config(2).aspect_ratio, make_config(2).head_dim):
        config = make_config(depth)
        try:
            rate = measure_tok_per_s(config, batch, device) * world_size
        except torch.OutOfMemoryError:
            break
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        candidates.append(candidate(config, rate, budget_s, train_tokens))
        c = candidates[-1]
        if c.tokens_per_param < MIN_TOKENS_PER_PARAM or (c.tokens_per_param < TOKENS_PER_PARAM / 2
                                                          and c.epochs <= MAX_EPOCHS):
            break
    return choose(candidates), candidates


def reason(c: Candidate, candidates: list[Candidate]) -> str:
    measured = ", ".join(f"d{x.depth} {x.tok_per_s:,.0f}" for x in candidates)
    return (f"auto: d{c.depth} w{c.width}, {c.tokens / 1e6:.1f}M tokens in budget, {c.tokens / c.params:.1f} "
            f"tokens/param, {c.epochs:.1f} epochs (nearest {TOKENS_PER_PARAM:g} tokens/param of those with "
            f">= {MIN_TOKENS_PER_PARAM:g} and <= {MAX_EPOCHS} epochs; measured tok/s: {measured})")


def supported_depth(make_config, train_tokens: int) -> int | None:
    """The largest ladder depth that MAX_EPOCHS passes over train_tokens give MIN_TOKENS_PER_PARAM
    tokens per parameter; None if even the smallest is too large."""
    fits = [d for d in ladder(make_config(2).aspect_ratio, make_config(2).head_dim)
            if MAX_EPOCHS * train_tokens / count_params(make_config(d)) >= MIN_TOKENS_PER_PARAM]
    return max(fits) if fits else None


def data_lines(depth: int, make_config, total_tokens: float, train_tokens: int, auto: bool = False) -> list[str]:
    """The depth the data supports, and a warning when this depth will repeat the data more than
    MAX_GOOD_EPOCHS times in the budget."""
    best = supported_depth(make_config, train_tokens)
    params = count_params(make_config(depth))
    lines = [f"planner | the data ({train_tokens:,} train tokens) supports up to "
             f"{'d' + str(best) if best else 'less than the smallest depth'} ({MIN_TOKENS_PER_PARAM:g} token/param "
             f"over at most {MAX_EPOCHS} epochs); d{depth} has {params:,} params"]
    epochs = total_tokens / train_tokens
    if epochs > MAX_GOOD_EPOCHS:
        fix = "more data or a smaller budget" if auto else "DEPTH=auto, a smaller DEPTH, more data or a smaller budget"
        lines.append(f"warning: d{depth} will see the training data {epochs:.1f} times in the budget (past "
                     f"{MAX_GOOD_EPOCHS}, repeated tokens are worth less and less); consider {fix}")
    return lines
