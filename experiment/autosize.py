"""DEPTH=auto: the model size that the budget and the data support.

The rule (fitted from sweeps of budget x depth on a 2-core CPU and proven on a grid of corpora x data
sizes x budgets: docs/performance.md, "DEPTH=auto"): each depth may make at most `pass_cap` passes
over the training data (MAX_EPOCHS, or MIN_STEPS optimizer steps' worth, at most MAX_PASS_CAP,
where the data are so small that MAX_EPOCHS passes are fewer steps). A depth is eligible if the budget, at its tok/s, gives it at least
MIN_TOKENS_PER_PARAM tokens per parameter within that cap; of those, take the one nearest
TOKENS_PER_PARAM tokens per parameter (in log), which trains for the whole budget. A faster machine
or a longer budget buys more tokens, so a larger model; a small corpus rules out the small models
that would cycle through it many times. When none is eligible, the budget outruns the data: take
the largest depth that completes the cap's passes within the budget with at least `data_floor`
tokens per parameter (MIN_TOKENS_PER_PARAM at and above FLOOR_TOKENS training tokens, less on
smaller data, where the grid's winners were larger models stopped at their val minimum), and train
it for those passes only (else the smallest depth, for the budget or its passes, whichever ends first). The run stops there (stopping.py),
and the rest of the budget, which would only repeat the data, is left unspent.

A run that leaves the regime's settings to it (experiment/regime.py: past PASSES passes, attention
dropout, the weight average and no pass cap) is `regularized`, and its data branch is refitted: it
takes the largest depth whose budget makes more than PASSES passes (so the regime regularizes it) and
at least REG_MIN_STEPS optimizer steps and REG_FLOOR tokens per parameter (of at most REG_MAX_PASSES
passes), and trains it for the whole budget (the stop at the val minimum still guards it). A
regularized model keeps gaining from passes a plain one would overfit, so the budget buys a larger
model instead of being left unspent
(docs/performance.md, "DEPTH=auto for regularized training"). The budget branch is the same for both.
For the first generation of GENERATIONS=auto's chain (generations.sizes_chain) the regularized data
branch asks for GENERATION_PASSES passes instead, with at least CHAIN_FLOOR tokens per parameter in
them, among the depths that hold a teacher of their own size: a smaller first generation that reaches
its val minimum in about half the budget, and leaves the rest to generations of its depth distilled
from it (experiment/generations.py); where no depth makes them, the depth is sized as one model's.

The tok/s: on CPU measured here, a few eager steps per depth (probe_and_choose); on CUDA predicted
(predicted_tok_per_s: the MFU gpucheck measured on one such GPU x its peak x the GPUs, less the gradient
traffic between them at an assumed link bandwidth), since measuring a
compiled step takes minutes per depth. The trainer then times the chosen depth's first steps and
says when the rule, at that measured rate, would have picked another depth.

The same arithmetic answers an explicit DEPTH: `supported_depth` is the largest depth on the ladder
that the cap's passes over the data give the floor's tokens per parameter, the most the rule could
ever pick on this data, and `data_lines` warns when a depth will repeat the data more than
MAX_GOOD_EPOCHS times.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from experiment import config
from experiment.hardware import mean_seconds
from experiment.memory import choose_mode, count_params
from experiment.model import GPT, GPTConfig, build_model
from experiment.optim import LRS, ShardedOptimizer
from experiment.runlog import MAX_GOOD_EPOCHS
from experiment.step import forward_backward, optimizer_step

# Fitted (docs/performance.md, DEPTH=auto; the recipe with the bigram table and the LR by depth):
# the loss-minimizing tokens/param, from a parabola in log tokens/param through d2, d4 and d6, was
# 13.0 at a 60 s budget and 12.0 at 180 s; 12.5 is their geometric mean.
TOKENS_PER_PARAM = 12.5
# Checked: the winners repeated Tiny Shakespeare 3.8 (d2, 60 s), 2.3 (d4, 180 s) and 3.1 (d6, 600 s)
# times; the losers the rule must exclude, 11.0 (d2, 180 s) and 8.5 (d4, 600 s). Repeating data past
# about 4 epochs stops paying (Muennighoff et al. 2023); 8 lies between the two groups.
MAX_EPOCHS = config.MAX_EPOCHS
# Checked: the 600 s winner (d6) got 1.1 tokens/param; losers that got less: d4 at 60 s (0.9), d6 at
# 180 s (0.3), d8 at 600 s (0.2).
MIN_TOKENS_PER_PARAM = 1.0
# Fitted on the grid's smallest data (docs/performance.md, "The data branch on small data"): at
# 19,001 training tokens (4,096 tokens a step) the sweep's runs that the stop ended had their val
# minimum after 38-72 steps, while 8 passes are 37. Where MAX_EPOCHS passes are fewer than MIN_STEPS optimizer steps,
# the cap is MIN_STEPS steps' worth of passes; the stop at the val minimum guards the run.
MIN_STEPS = 80
MAX_PASS_CAP = 2 * MAX_EPOCHS  # and at most this many: the grid's winners made up to 16.4 passes
# Fitted on the same cells: a depth that completes its passes needs MIN_TOKENS_PER_PARAM tokens per
# parameter at FLOOR_TOKENS training tokens (the Tiny Shakespeare sweep the floor came from), and
# (train tokens / FLOOR_TOKENS) ** FLOOR_EXPONENT of that below. Winners that completed their passes
# had, at those passes, 0.12 (d6, 19,001 tokens) and 0.47 (d4, 47,501); d6 at 47,501 (0.14 at 8
# passes) lost to d4 by 2.8% on Tiny Shakespeare: exponents 0.53-0.65 separate them.
FLOOR_TOKENS = 1_000_000
FLOOR_EXPONENT = 0.6
# Fitted on the regularized grid (docs/performance.md, "DEPTH=auto for regularized training"; every
# depth with the regime's defaults): a depth needs at least this many optimizer steps in the budget
# (at the probe's tok/s). At 90 s d4 with 377-434 steps won 9 of 10 cells and d6 with 143-160 none;
# at 30 s d4 with 128-153 lost to d2 in 8 of 10. 250 is the middle (in log) of 161-377.
REG_MIN_STEPS = 250
# And at least this many tokens per parameter over the whole budget: without a floor any depth whose
# budget passes the data 4 times would do, on a long budget over small data a model far larger than
# any measured. The one long cell where the larger model won (code, 1.1M characters, 1,800 s: d8 over
# d6) gave it 0.84; the grid's cells never reach the floor.
REG_FLOOR = 0.5
# Counted over at most this many passes: the tokens of passes past it (worth less and less: Muennighoff
# et al. 2023) buy no larger model, else a long budget over small data would take the largest depth
# (40k characters for 31 h on 8 GPUs: d56). The grid's winners needed 21 (d4 on 19,001 tokens).
REG_MAX_PASSES = 32
# GENERATIONS=auto (regularized): the first generation's budget makes at least this many passes. Fitted
# on the whole code corpus (docs/performance.md, "Generations of a smaller model"): DEPTH=auto's one
# model (d8, 5.7 and 11.4 passes at 1,800 and 3,600 s) lost to two generations of the largest depth
# with 34 (d4, 1,800 s) and 25 (d6, 3,600 s) passes, whose first stopped at its val minimum at 43-46%
# of the budget; d6 at 1,800 s (12.7) stopped at 77%, leaving a second generation too little.
GENERATION_PASSES = 16
# And it must see at least this many tokens per parameter in those passes (the budget branch's floor).
# Fitted on one cell, one seed (docs/performance.md, "The chain on small data"): on 90,000 training
# tokens at 600 s a chain of d6 (0.54 tokens per parameter in 16 passes) served 0.009 above a chain of
# d4 (1.8), side by side; the whole corpora's chains (d4 at 19, d6 at 5.9) keep their depths.
CHAIN_FLOOR = MIN_TOKENS_PER_PARAM
# A generation of GENERATIONS=auto plans its schedule for at most this many passes where the regime
# lifts the pass cap and another generation fits after them (regime.pass_cap): the depth above reaches
# its val minimum in about GENERATION_PASSES, so about half way, past the early warmups. Planned for a
# share of many more passes, the generations on 100,000 characters stopped inside the warmups, at
# 12-21% of their schedules (docs/performance.md).
CHAIN_PASSES = 2 * GENERATION_PASSES
LADDER = (2, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 56, 64)
PROBE_STEPS = 2  # timed steps per candidate at the run's micro-batch, after one warm-up step

# MFU against the dense bf16 peak (hardware.PEAK_FLOPS), by depth, as gpucheck measured it on one GPU
# of each kind (compiled, bf16, seq 2048, 524,288 tokens/step): GPU-name fragment -> (MFU by depth,
# the report, the GPU). Other depths take the nearest measured one; GPUs not listed take the H100's.
# The H100 run used the trainer of its day (2026-11-23); the H200 run the current one.
MEASURED_MFU = {
    "H100": ({12: 0.441, 20: 0.494, 24: 0.528}, "reports/gpucheck-h100.md", "one H100 80GB HBM3"),
    "H200": ({12: 0.493, 20: 0.535, 24: 0.564, 32: 0.583}, "reports/gpucheck-h200.md", "one H200"),
}
WEIGHT_BYTES = {"fp32": 4, "bf16": 2}  # and so of each gradient, by the memory plan's precision


@dataclass
class Candidate:
    depth: int
    width: int
    params: int
    tok_per_s: float  # measured, all ranks together
    tokens: float  # in the budget at that rate, at most `cap` passes over the data
    epochs: float  # the passes those tokens make
    budget_epochs: float = 0.0  # the passes the whole budget would make at that rate
    cap: float = float(MAX_EPOCHS)  # the most passes a run may make on this data (pass_cap)
    floor: float = MIN_TOKENS_PER_PARAM  # tokens/param a depth that completes them needs (data_floor)
    regularized: bool = False  # the regime may regularize it and lift the cap: the refitted data branch
    needs: float | None = None  # the passes the data branch needs of the budget: reg_passes, else the cap
    generations: bool = False  # regularized, sized for GENERATIONS=auto's first generation (choose_chain)

    def __post_init__(self):
        if self.needs is None:
            self.needs = self.cap

    @property
    def passes_needed(self) -> float:
        """The passes the data branch takes it at: `needs`, and for GENERATIONS=auto GENERATION_PASSES."""
        return max(self.needs, GENERATION_PASSES) if self.generations else self.needs

    @property
    def chain_tokens_per_param(self) -> float:
        """The tokens per parameter of GENERATION_PASSES passes over the data (CHAIN_FLOOR's measure)."""
        return GENERATION_PASSES * self.tokens / self.epochs / self.params if self.epochs else 0.0

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.params

    @property
    def floor_tokens_per_param(self) -> float:
        """The tokens per parameter the floor is held against: regularized, of at most REG_MAX_PASSES passes."""
        if not self.regularized or self.epochs <= REG_MAX_PASSES:
            return self.tokens_per_param
        return self.tokens_per_param * REG_MAX_PASSES / self.epochs

    @property
    def seconds(self) -> float:
        """The training seconds those tokens take: the budget, or less when the data runs out first."""
        return self.tokens / self.tok_per_s


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


def mfu_table(gpu_name: str) -> tuple[dict[int, float], str, str]:
    """(MFU by depth, the report it comes from, the GPU it was measured on) for this GPU's name."""
    key = next((k for k in MEASURED_MFU if k.lower() in gpu_name.lower()), "H100")
    return MEASURED_MFU[key]


def mfu(depth: int, gpu_name: str, table: dict[int, float] | None = None) -> float:
    """The MFU at the nearest depth of `table` (default: this GPU kind's, mfu_table)."""
    table = table or mfu_table(gpu_name)[0]
    return table[min(table, key=lambda d: abs(d - depth))]


def rule_params(config: GPTConfig) -> int:
    """The parameters the rule's tokens per parameter counts: all but the bigram table, which is
    read a row per token, not multiplied (the rule's constants were set on models without it)."""
    return count_params(dataclasses.replace(config, bigram_vocab=0))


def flops_per_token(config: GPTConfig) -> float:
    """The model's own count (GPT.estimate_flops), on the meta device: nothing is allocated."""
    with torch.device("meta"):
        return GPT(config).estimate_flops()


def with_teacher(rate: float, config: GPTConfig, teacher_flops: float) -> float:
    """The tok/s of a step that also runs a generation's teacher forward (`teacher_flops` per token:
    experiment/teacher.py), from the step's own tok/s at the same FLOP rate. On CPU (d6 student and
    teacher in fp32) the measured cost was 27% of the tok/s, this model's 25%
    (reports/generations-3600-cpu-2026-11-29.md). A teacher in bf16 on a CPU that multiplies bf16 in
    hardware costs less than this prices it (docs/performance.md, "A cheaper teacher")."""
    if not teacher_flops:
        return rate
    step = flops_per_token(config)
    return rate * step / (step + teacher_flops)


def predicted_tok_per_s(config: GPTConfig, peak: float, gpus: int, link_gbps: float, weight_bytes: int = 4,
                        tokens_per_step: int = config.CUDA_DEFAULTS["total_batch_size"], *, gpu_name: str,
                        mfu_by_depth: dict[int, float] | None = None, teacher_flops: float = 0.0) -> float:
    """A prediction, not a measurement: a step's compute at the nearest measured MFU (of this GPU's
    kind, mfu_table, or `mfu_by_depth`: measured on the box itself) x the GPUs' dense bf16 peak (the
    model's training FLOPs per token, and a generation's teacher forward), plus its communication
    (comm_seconds)."""
    flops = flops_per_token(config) + teacher_flops
    compute = tokens_per_step * flops / (mfu(config.depth, gpu_name, mfu_by_depth) * peak * gpus)
    return tokens_per_step / (compute + comm_seconds(config, gpus, link_gbps, weight_bytes))


def comm_seconds(config: GPTConfig, gpus: int, link_gbps: float, weight_bytes: int = 4) -> float:
    """One optimizer step's traffic between GPUs at `link_gbps` bus bandwidth: the gradient all-reduce
    (a ring moves 2 (n-1)/n of the gradient bytes over each link) and the owners' broadcasts of the
    updated weights (ZeRO-1: (n-1)/n of them), with none of it hidden behind the backward pass, which
    DDP's bucketed all-reduce partly does: an upper bound on the time. 0 on one GPU."""
    return 3 * (gpus - 1) / gpus * count_params(config) * weight_bytes / (link_gbps * 1e9)


def pass_cap(train_tokens: int, tokens_per_step: int) -> float:
    """The default cap on passes over the data (MAX_EPOCHS unset), at any depth: MAX_EPOCHS, or as many
    passes as MIN_STEPS optimizer steps make where the data are smaller than that, up to MAX_PASS_CAP
    (data of fewer than a few steps: a smaller TOTAL_BATCH_SIZE is the way to more steps)."""
    steps = math.ceil(10 * MIN_STEPS * tokens_per_step / train_tokens) / 10
    return float(min(MAX_PASS_CAP, max(MAX_EPOCHS, steps)))


def cap_lines(cap: float, train_tokens: int, tokens_per_step: int) -> list[str]:
    """The default cap in words where it is not MAX_EPOCHS, and a warning where even it makes fewer
    than half MIN_STEPS steps (the grid's smallest runs had their val minimum after 38 or more)."""
    steps = cap * train_tokens / tokens_per_step
    lines = [] if cap == MAX_EPOCHS else [
        f"data | MAX_EPOCHS unset: {cap:g} passes, {steps:.0f} optimizer steps of {tokens_per_step:,} tokens "
        f"({MAX_EPOCHS} passes would make {MAX_EPOCHS * train_tokens / tokens_per_step:.0f}; "
        "experiment/autosize.py, pass_cap)"]
    if steps < MIN_STEPS / 2:
        lines.append(f"warning: the data make only {steps:.0f} optimizer steps in {cap:g} passes at "
                     f"TOTAL_BATCH_SIZE={tokens_per_step}, too few to train well; a TOTAL_BATCH_SIZE of at most "
                     f"{MAX_EPOCHS * train_tokens // MIN_STEPS:,} tokens (a multiple of MAX_SEQ_LEN) makes "
                     f"{MIN_STEPS} in {MAX_EPOCHS} passes")
    return lines


def data_floor(train_tokens: int) -> float:
    """Tokens per parameter that a depth completing its passes needs: MIN_TOKENS_PER_PARAM from
    FLOOR_TOKENS training tokens up, falling as a power of the data below."""
    return MIN_TOKENS_PER_PARAM * min(1.0, train_tokens / FLOOR_TOKENS) ** FLOOR_EXPONENT


def reg_passes(train_tokens: int, tokens_per_step: int) -> float:
    """The passes a regularized depth's budget must make for the data branch: PASSES (completes asks
    for more, the regime's threshold) and at least REG_MIN_STEPS optimizer steps."""
    return max(float(MAX_GOOD_EPOCHS), REG_MIN_STEPS * tokens_per_step / train_tokens)


def candidate(config: GPTConfig, tok_per_s: float, budget_s: float, train_tokens: int,
              tokens_per_step: int, regularized: bool = False) -> Candidate:
    cap = pass_cap(train_tokens, tokens_per_step)
    c = Candidate(config.depth, config.n_embd, rule_params(config), tok_per_s, 0.0, 0.0,
                  cap=cap, floor=REG_FLOOR if regularized else data_floor(train_tokens), regularized=regularized,
                  needs=reg_passes(train_tokens, tokens_per_step) if regularized else None)
    return at_rate(c, tok_per_s, budget_s, train_tokens)


def at_rate(c: Candidate, tok_per_s: float, budget_s: float, train_tokens: int) -> Candidate:
    """The candidate at another tok/s: the tokens that buys in the budget, at most its cap's passes
    (regularized: the whole budget's; past PASSES passes the regime lifts the cap, below them the
    cap is not reached)."""
    tokens = tok_per_s * budget_s if c.regularized else min(tok_per_s * budget_s, c.cap * train_tokens)
    return dataclasses.replace(c, tok_per_s=tok_per_s, tokens=tokens, epochs=tokens / train_tokens,
                               budget_epochs=tok_per_s * budget_s / train_tokens)


def check_prediction(candidates: list[dict], depth: int, measured: float, budget_s: float,
                     train_tokens: int, chain: bool = False) -> str:
    """The trainer's measured tok/s at the chosen depth against the prediction it was chosen by: all
    depths' predictions scaled by the same factor, and the rule asked again (`chain`: the rule that
    sized a chain's first generation, choose_chain, with every candidate taken to hold its teacher)."""
    cands = [Candidate(**c) for c in candidates]
    factor = measured / next(c.tok_per_s for c in cands if c.depth == depth)
    again = (choose_chain if chain else choose)([at_rate(c, c.tok_per_s * factor, budget_s, train_tokens) for c in cands])
    head = f"auto | measured {measured:,.0f} tok/s, {factor:.2f}x the predicted: "
    if again.depth == depth:
        return head + f"at that rate the rule picks d{depth} too"
    fresh = f"DEPTH={again.depth}" + ("" if again.regularized else f" MAX_EPOCHS={again.cap:g}")
    return head + (f"warning: at that rate the rule picks d{again.depth}; this run keeps d{depth} (a fresh run with "
                   f"{fresh} follows the measured rate)")


def eligible(c: Candidate) -> bool:
    """The budget branch: at least MIN_TOKENS_PER_PARAM tokens per parameter within the cap."""
    return c.tokens_per_param >= MIN_TOKENS_PER_PARAM and c.budget_epochs <= c.cap


def completes(c: Candidate) -> bool:
    """The data branch: the budget makes the passes it needs (the cap's; regularized, reg_passes),
    which give at least the data's floor of tokens per parameter (regularized: REG_FLOOR)."""
    past = not c.regularized or c.budget_epochs > MAX_GOOD_EPOCHS  # the regime regularizes past PASSES only
    chain = not c.generations or c.chain_tokens_per_param >= CHAIN_FLOOR
    return past and chain and c.budget_epochs >= c.passes_needed and c.floor_tokens_per_param >= c.floor


def sized_for_chain(c: Candidate) -> bool:
    """The data branch chose c for GENERATIONS=auto's first generation: GENERATION_PASSES made."""
    return c.generations and not eligible(c) and completes(c)


def choose(candidates: list[Candidate]) -> Candidate:
    if budget := [c for c in candidates if eligible(c)]:
        return min(budget, key=lambda c: abs(math.log(c.tokens_per_param / TOKENS_PER_PARAM)))
    data = [c for c in candidates if completes(c)]
    return max(data, key=lambda c: c.params) if data else min(candidates, key=lambda c: c.params)


def choose_chain(candidates: list[Candidate], holds=lambda c: True) -> Candidate:
    """GENERATIONS=auto's first generation (generations.sizes_chain): the regularized data branch at
    GENERATION_PASSES passes, among the candidates `holds` keeps (on GPUs, the depths that fit beside a
    teacher of their own size, as the later generations of its depth hold one). Where the budget
    branch decides, or no such depth makes the passes, the one-model choice among them all."""
    one = choose(candidates)
    held = [dataclasses.replace(c, generations=True) for c in candidates if c.regularized and holds(c)]
    if any(eligible(c) for c in candidates) or not held:
        return one
    pick = choose(held)
    return pick if sized_for_chain(pick) else one


def predict_and_choose(make_config, peak: float, gpus: int, gpu_bytes: int, budget_s: float, train_tokens: int,
                       link_gbps: float, gpu_name: str, tokens_per_step: int, regularized: bool = False,
                       teacher: tuple[int, float] = (0, 0.0), generations: bool = False) -> tuple[Candidate, list[Candidate]]:
    """CUDA: every ladder depth that the memory plan fits on these GPUs (at one sequence per
    micro-batch, beside a generation's teacher: `teacher` is its (parameters, forward FLOPs per
    token)), at its predicted tok/s with the teacher's forward; then choose (`generations`: for a
    chain's first generation, choose_chain)."""
    candidates = []
    for depth in ladder(make_config(2).aspect_ratio, make_config(2).head_dim):
        config = make_config(depth)
        if (fit := choose_mode(config, gpus, 1, config.max_seq_len, gpu_bytes, teacher_params=teacher[0])) is None:
            break
        rate = predicted_tok_per_s(config, peak, gpus, link_gbps, WEIGHT_BYTES[fit.precision], tokens_per_step,
                                   gpu_name=gpu_name, teacher_flops=teacher[1])
        candidates.append(candidate(config, rate, budget_s, train_tokens, tokens_per_step, regularized))
    holds = lambda c: holds_own_teacher(make_config(c.depth), gpus, gpu_bytes)
    return choose_chain(candidates, holds) if generations else choose(candidates), candidates


def holds_own_teacher(config: GPTConfig, gpus: int, gpu_bytes: int) -> bool:
    """A chain's later generation of this depth fits these GPUs beside its teacher, one of its size."""
    return choose_mode(config, gpus, 1, config.max_seq_len, gpu_bytes, teacher_params=count_params(config)) is not None


def probe_and_choose(make_config, batch: int, device: torch.device, world_size: int, budget_s: float,
                     train_tokens: int, tokens_per_step: int, regularized: bool = False,
                     teacher_flops: float = 0.0, generations: bool = False) -> tuple[Candidate, list[Candidate]]:
    """Measure the ladder from the smallest depth up until no larger depth can be chosen (larger ones
    only get fewer tokens per parameter and fewer passes: one below the data's floor, one that neither
    completes its passes nor reaches MIN_TOKENS_PER_PARAM, or one eligible below half the target),
    then choose. make_config(depth) -> GPTConfig. A generation's teacher forward (`teacher_flops`
    per token) is priced into each measured rate (with_teacher). `generations`: as predict_and_choose
    (a CPU holds any teacher)."""
    candidates = []
    for depth in ladder(make_config(2).aspect_ratio, make_config(2).head_dim):
        config = make_config(depth)
        try:
            rate = with_teacher(measure_tok_per_s(config, batch, device) * world_size, config, teacher_flops)
        except torch.OutOfMemoryError:
            break
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        candidates.append(c := candidate(config, rate, budget_s, train_tokens, tokens_per_step, regularized))
        if larger_cannot_win(c):
            break
    cuda_bytes = torch.cuda.get_device_properties(device).total_memory if generations and device.type == "cuda" else 0
    holds = lambda c: not cuda_bytes or holds_own_teacher(make_config(c.depth), world_size, cuda_bytes)
    return choose_chain(candidates, holds) if generations else choose(candidates), candidates


def larger_cannot_win(c: Candidate) -> bool:
    """A larger depth gets fewer tokens per parameter and fewer passes than c: none can be chosen once
    c is under the data's floor, or neither completes its passes nor reaches MIN_TOKENS_PER_PARAM, or
    is eligible under half the target (the budget branch then decides, and larger ones are further)."""
    return (c.floor_tokens_per_param < c.floor or (c.budget_epochs < c.needs and c.tokens_per_param < MIN_TOKENS_PER_PARAM)
            or (eligible(c) and c.tokens_per_param < TOKENS_PER_PARAM / 2))


def reason(c: Candidate, candidates: list[Candidate], how: str = "measured", teacher: bool = False) -> str:
    rates = ", ".join(f"d{x.depth} {x.tok_per_s:,.0f}" for x in candidates)
    return (f"auto: d{c.depth} w{c.width}, {c.tokens / 1e6:.1f}M tokens in {c.seconds / 3600:.3f}h, "
            f"{c.tokens / c.params:.1f} tokens/param, {c.epochs:.1f} epochs ({rule(c)}; {how} tok/s"
            + (" with the teacher's forward" if teacher else "") + f": {rates})")


def rule(c: Candidate) -> str:
    """Which branch of the rule chose c, in words."""
    if eligible(c):
        return (f"nearest {TOKENS_PER_PARAM:g} tokens/param of those with >= {MIN_TOKENS_PER_PARAM:g} in at most "
                f"{c.cap:g} epochs of the budget")
    if sized_for_chain(c):
        return (f"the budget outruns the data: GENERATIONS=auto, the largest depth the regime regularizes with at "
                f"least {c.passes_needed:g} epochs, {REG_MIN_STEPS} steps and {c.floor:g} tokens/param (of at most "
                f"{REG_MAX_PASSES} epochs) in the budget and {CHAIN_FLOOR:g} token/param in {GENERATION_PASSES} "
                "epochs, so that the first generation can reach its val minimum in about half of it and leave the "
                "rest to the next")
    if completes(c) and c.regularized:
        return (f"the budget outruns the data: the largest depth the regime regularizes, more than {MAX_GOOD_EPOCHS} "
                f"epochs, at least {REG_MIN_STEPS} steps and {c.floor:g} tokens/param (of at most {REG_MAX_PASSES} epochs) "
                "in the budget, for the whole budget")
    if completes(c):
        return (f"the budget outruns the data: the largest depth with >= {c.floor:.2g} tokens/param in "
                f"{c.cap:g} epochs, stopped there")
    until = f"stopped at {c.cap:g} passes" if c.budget_epochs >= c.cap and not c.regularized else "for the budget"
    return f"no depth has enough tokens per parameter: the smallest, {until}"


def supported_depth(make_config, train_tokens: int, tokens_per_step: int) -> int | None:
    """The largest ladder depth that the cap's passes over train_tokens give the data's floor of
    tokens per parameter; None if even the smallest is too large."""
    cap, floor = pass_cap(train_tokens, tokens_per_step), data_floor(train_tokens)
    fits = [d for d in ladder(make_config(2).aspect_ratio, make_config(2).head_dim)
            if cap * train_tokens / rule_params(make_config(d)) >= floor]
    return max(fits) if fits else None


def supports(make_config, train_tokens: int, tokens_per_step: int) -> str:
    """supported_depth and its bound, in words (the pre-flight's and the planner's line)."""
    best = supported_depth(make_config, train_tokens, tokens_per_step)
    return (f"{f'd{best}' if best else 'less than the smallest depth'} ({data_floor(train_tokens):.2g} token/param "
            f"over at most {pass_cap(train_tokens, tokens_per_step):g} epochs)")


def data_lines(depth: int, make_config, total_tokens: float, train_tokens: int, tokens_per_step: int,
               auto: bool = False, averaged: bool = False, by: str = "DEPTH=auto") -> list[str]:
    """The depth the data supports, and a warning when this depth will repeat the data more than
    MAX_GOOD_EPOCHS times in the budget (naming the weight average when the run is without it). A
    DEPTH=auto run with the average gets a plain line instead: there the repeats are the regularized
    rule's choice (reg_passes), not a setting to reconsider; so does a chain's later generation, whose
    depth and share (`by`) the generations sized."""
    params = rule_params(make_config(depth))
    lines = [f"planner | the data ({train_tokens:,} train tokens) supports up to "
             f"{supports(make_config, train_tokens, tokens_per_step)}; d{depth} has {params:,} params"]
    epochs = total_tokens / train_tokens
    if epochs > MAX_GOOD_EPOCHS and auto and averaged:
        lines.append(f"planner | d{depth} will see the training data {epochs:.1f} times in the budget: past "
                     f"{MAX_GOOD_EPOCHS}, as {by} sized it, with the weight average (docs/training.md, \"Defaults "
                     "by regime\"); more data would still be worth more than the repeats")
    elif epochs > MAX_GOOD_EPOCHS:
        fix = "more data" if auto else "DEPTH=auto, a smaller DEPTH, more data or a smaller budget"
        if not averaged:  # docs/performance.md, "Weight averaging: the first screen"
            fix += "; to make more of the passes, AVERAGE=ema with ATTN_DROPOUT=0.2 (docs/training.md)"
        lines.append(f"warning: d{depth} will see the training data {epochs:.1f} times in the budget (past "
                     f"{MAX_GOOD_EPOCHS}, repeated tokens are worth less and less); consider {fix}")
    return lines
