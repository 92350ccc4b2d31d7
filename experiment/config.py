"""The trainer's one config: TrainConfig, its flags, its device defaults and the checks that the
settings can work together. Also what every checkpoint's meta records of the run.

The flags are generated from the dataclass fields (`python -m experiment.train --help`);
experiment/run.sh maps an env override onto each, and the README's table lists them.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from experiment.dataloader import Prepared

# Recipe schedules that won at equal tokens on both CPU corpora (docs/performance.md, "A better model
# per token"): short contexts, half batches and a lower Muon momentum early in the run. The first two
# are off on CUDA until measured there: each context length and the half batch is a torch.compile
# graph of its own.
SEQ_WARMUP_FRAC = 0.3
BATCH_WARMUP_FRAC = 0.3
MUON_MOMENTUM_WARMUP_STEPS = 300  # nanochat's and modded-nanogpt's
# DEPTH=auto on both (experiment/autosize.py). CPU defaults are the recommended small-budget settings
# (docs/performance.md, Tiny Shakespeare on 2 cores): the depth by the auto rule and a narrow shape
# (width 32 per layer) that sees many tokens. The learning rates depend on the depth: cpu_lrs.
CUDA_DEFAULTS = dict(depth="auto", aspect_ratio=64, head_dim=128, warmdown_frac=0.2, seq_warmup_frac=0.0,
                     batch_warmup_frac=0.0,
                     max_seq_len=2048, total_batch_size=524288, training_hours=31.0,
                     save_every_minutes=60.0, eval_every_minutes=30.0, eval_tokens=1 << 20)
CPU_DEFAULTS = dict(depth="auto", aspect_ratio=32, head_dim=64, warmdown_frac=0.4, seq_warmup_frac=SEQ_WARMUP_FRAC,
                    batch_warmup_frac=BATCH_WARMUP_FRAC,
                    max_seq_len=256, total_batch_size=4096, training_hours=0.05,
                    save_every_minutes=1.0, eval_every_minutes=0.5, eval_tokens=1 << 16)
# CPU learning rates by depth (docs/performance.md, "The learning rate across depth"): an LR sweep at
# the depth and budget DEPTH=auto pairs (d2 60 s, d4 180 s, d6 600 s, d8 3000 s) put the best at
# these multiples of LRS, or within 0.001 of it (d8); deeper models take d6's and d8's.
# CUDA takes LRS at every depth (nanochat's, unswept).
CPU_LR_SCALES = ((4, dict(matrix_lr=1.0, embedding_lr=0.5, unembedding_lr=0.5)),
                 (math.inf, dict(matrix_lr=0.5, embedding_lr=0.25, unembedding_lr=0.25)))
CPU_DEVICE_BATCH = 16
MAX_EPOCHS = 8  # the default cap on passes over the data, at any depth (experiment/autosize.py says why)
# The stop at the val minimum (plateau.py; docs/training.md, "The stop at the val minimum"
# says how these were measured): evals every quarter pass, patience 4 evals (a pass), margin 0.2%.
EVAL_EVERY_EPOCHS = 0.25
PLATEAU_EVALS = 4
PLATEAU_MARGIN = 0.002
# In a warmdown the stop compares the mean of the last two val losses: chosen on the recorded curves
# (reports/plateau-curves.md and the code run in docs/performance.md) as the shortest window that kept
# a noisy code run (d4, 150,000 characters) annealing to its best while the overfitting Shakespeare
# runs still stopped within 4-5 evals of their minimum.
WARMDOWN_WINDOW = 2
# The clock's evals take at most this share of the run's time. On 2 CPU cores a d8's eval (65,536
# tokens through the raw weights and the weight average, and a sample) took 12 s against 16 s for 10
# steps: one every 30 s spent 29% of an hour's budget evaluating. The evals and saves by steps and the
# evals by passes (EVAL_EVERY_STEPS, SAVE_EVERY_STEPS, EVAL_EVERY_EPOCHS) keep their cadence.
EVAL_SHARE = 0.1
EVAL_STRETCH = (1 - EVAL_SHARE) / EVAL_SHARE  # an eval's seconds to the next clock-driven one: 9
# GENERATIONS=auto trains at most this many: a bound on the run's files (each finished generation keeps
# its best weights and best.pt: the plan's disk line), and a chain's gains shrink by the fourth.
AUTO_MAX_GENERATIONS = 8
# Of the box's hours, what a sweep of 2 or more members keeps for scoring them once they end (their
# ensembles, or bits per character across tokenizers): it runs after the members, on the box they
# paid for. 8 d56 members take minutes to load and score on one GPU (1M tokens each), against a
# 31 h box: under 1%. The members train the rest; sweep.md says what the scoring took.
SWEEP_SCORING_SHARE = 0.01
GUARDS = ("demo", "repeat", "disk")  # the pre-flight's guards on CUDA, which ALLOW passes (preflight.py)


class ConfigError(Exception):
    """A setting that cannot work; the message names the flag. every_rank: rank 0 decided it and every
    rank raises the same one (broadcast), so rank 0 alone says it (train.main)."""

    def __init__(self, message: str, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank


def opt(help_text: str, default=None, **kwargs):
    """A config field with its flag's help (and argparse extras such as choices) in its metadata."""
    return field(default=default, metadata={"help": help_text, **kwargs})


def parse_flags(cls, argv, prog: str, description: str):
    """An entry point's config dataclass from its command line: one --<field> flag per field, typed
    int, float or str by the field's annotation, with the field's default, help and choices."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    types = {"int": int, "float": float, "str": str}
    for f in dataclasses.fields(cls):
        parser.add_argument(f"--{f.name}", type=types[str(f.type).split(" ")[0]], default=f.default,
                            help=f.metadata["help"], choices=f.metadata.get("choices"))
    return cls(**vars(parser.parse_args(argv)))


@dataclass
class TrainConfig:
    depth: int | str | None = opt("layers; model_dim = depth * aspect_ratio; auto: chosen at start from the "
                                   "throughput (measured on CPU, predicted on CUDA), the budget and the data",
                                   "auto")
    aspect_ratio: int | None = opt("model_dim per layer (default 64 with CUDA, 32 without)")
    head_dim: int | None = opt("attention head size (default 128 with CUDA, 64 without)")
    bigram_embed: int | None = opt("1: add an embedding of each (previous, current) token pair to the input "
                                   "(hashed into 16384 rows past 127 characters); 0: off "
                                   "(default 1 with the char tokenizer, 0 with tiktoken)")
    max_seq_len: int | None = opt("context length (default 2048 with CUDA, 256 without)")
    device_batch_size: int | None = opt("sequences per micro-batch per rank (default: largest that fits "
                                         "on CUDA, 16 on CPU)")
    total_batch_size: int | None = opt("tokens per optimizer step (default 524288 with CUDA, 4096 without)")
    training_hours: float | None = opt("wall-clock budget in hours (default 31 with CUDA, 0.05 without)")
    budget_usd: float | None = opt("if set: hours = budget_usd / (gpu_hourly_usd x world size)")
    gpu_hourly_usd: float = opt("price of one GPU-hour, for budget_usd", 4.0)
    max_epochs: float | None = opt("stop after this many passes over the training data, the LR schedule planned "
                                    "for them (default 8, or 80 optimizer steps' worth, at most 16, where 8 passes make fewer: "
                                    "experiment/autosize.py; 0: none; where the budget passes over the data more than 4 times "
                                    "in a run that may average and stops at its val minimum, 0 by regime: that stop "
                                    "ends the run; 32 for a generation of GENERATIONS=auto whose budget makes at least 44.8)")
    allow: str = opt("pre-flight guards to pass on CUDA, comma-separated: demo (train on the built-in demo data), "
                     "repeat (an explicit DEPTH whose budget repeats the data more than the default cap, with MAX_EPOCHS=0 or above it), disk (less free "
                     "space than the checkpoints need)", "")
    max_steps: int = opt("stop after this many optimizer steps (0: budget only); for tests and benchmarks", 0)
    data_dir: str | None = opt("directory of data files: *.txt, *.jsonl, *.jsonl.gz, *.parquet, sub-directories too "
                               "(or one such file); default $WORKSPACE/data, the demo if it holds none")
    text_field: str = opt("the JSONL field or Parquet column that holds a document", "text")
    workspace: str | None = opt("root of data, prepared, checkpoints, tensorboard "
                                 "(default /workspace/<project> if writable, else the repo)")
    data_mix: str | None = opt("source weights, e.g. web=0.65,code=0.34,math=0.01 (each sub-directory of "
                                "DATA_DIR is a source, its top-level data files one more; default: by size)")
    init_from: str | None = opt("start a fresh run from a trained model's weights: a best.pt, a model_<step>.pt or a "
                                 "run directory (its best); its shape and vocabulary are kept, the new data may use "
                                 "only its characters, and MODEL_TAG defaults to its tag + '-ft'")
    prepared_dir: str | None = opt("a directory that prepare made (the pre-flight passes it): opened as is, "
                                    "DATA_DIR not read")
    tokenizer: str = opt("char, or a tiktoken encoding name", "char")
    alphabet: str | None = opt("allowed characters; data with any other one is rejected")
    val_fraction: float = opt("fraction of each source's tokens held out for validation, drawn across its files (one "
                                 "file: its tail; docs/data.md)", 0.05)
    model_tag: str | None = opt("run directory name (default d<depth>, or auto)")
    resume: str = opt("auto: latest complete checkpoint; never; or a step number", "auto")
    save_every_minutes: float | None = opt("checkpoint cadence (default 60 with CUDA, 1 without); at least "
                                           f"{EVAL_STRETCH:g}x the latest eval's seconds, since a save brings an eval "
                                           "(EVAL_SHARE in experiment/config.py)")
    save_every_steps: int = opt("also checkpoint every N steps (0: off)", 0)
    keep_last: int = opt("complete checkpoints kept (at least 1), plus the best", 3)
    keep_best_optimizer: int = opt("1: a best checkpoint older than the last keep_last keeps its optimizer "
                                    "shards (resumable); 0: only its model and meta (servable)", 0)
    async_save: int = opt("1: each rank copies its share of a checkpoint into host memory and writes it in the "
                          "background while training goes on (when the node's host memory holds the shares); "
                          "0: training waits for every save", 1)
    save_write_mbps: float = opt("cap checkpoint writes at this many MB/s per rank (0: no cap); stands in for a "
                                 "slow volume in tests and benchmarks", 0.0)
    eval_every_minutes: float | None = opt("eval cadence (default 30 with CUDA, 0.5 without); at least "
                                           f"{EVAL_STRETCH:g}x the latest eval's seconds, so that these evals take at "
                                           f"most {EVAL_SHARE:.0%} of the time (EVAL_SHARE in experiment/config.py)")
    eval_every_steps: int = opt("also eval every N steps (0: off)", 0)
    eval_every_epochs: float = opt("also eval every this many passes over the training data (0: off), so that "
                                   "evals see the val minimum on small data too", EVAL_EVERY_EPOCHS)
    eval_tokens: int | None = opt("size of the eval sample: windows at even strides over the val split, the whole "
                                  "split when it holds no more (default 1048576 with CUDA, 65536 without)")
    plateau_evals: int = opt("stop at the val minimum: after this many evals in a row without a gain of "
                             "plateau_margin, the LR warmdown starts at once and the run ends with it; in a "
                             "warmdown, this many without a new low of the mean of its last two val losses end "
                             "the run (0: off: train to the budget or MAX_EPOCHS)", PLATEAU_EVALS)
    plateau_margin: float = opt("the gain, as a fraction of the val loss, that counts as an improvement for "
                                "plateau_evals", PLATEAU_MARGIN)
    sample_tokens: int = opt("tokens sampled at each eval", 64)
    eval_prompt: str | None = opt("the text each eval's sample continues, so samples compare from eval to eval "
                                  "(default: the first 32 tokens of the val split)")
    eval_metric: str | None = opt("your own metric, path/to/file.py:function, called at every eval on rank 0 as "
                                  "function(generate, tokenizer) -> dict of names to numbers (the demo: "
                                  "experiment/demo_metric.py:sums)")
    eval_metric_seconds: float = opt("the time bound of one EVAL_METRIC call; past it that eval has no numbers", 120.0)
    best_by: str = opt("what chooses the best checkpoint: val_loss, or a name EVAL_METRIC returns (higher is "
                       "better; min:<name> for lower)", "val_loss")
    log_every_steps: int = opt("step-line cadence", 10)
    matrix_lr: float | None = opt("Muon learning rate, hidden matrices (default 0.02 with CUDA; without, by "
                                  "depth: 0.02 up to d4, 0.01 deeper; a resume: its checkpoint's)")
    embedding_lr: float | None = opt("AdamW learning rate, embedding and bigram tables, scaled by (768/model_dim)^0.5 "
                                     "(default 0.2 with CUDA; without, by depth: 0.1 up to d4, 0.05 deeper)")
    unembedding_lr: float | None = opt("AdamW learning rate, lm_head, scaled likewise (default 0.004 with CUDA; "
                                       "without, by depth: 0.002 up to d4, 0.001 deeper)")
    warmup_frac: float = opt("fraction of the budget with linear LR warmup", 0.0)
    warmdown_frac: float | None = opt("final fraction of the budget with linear LR warmdown "
                                       "(default 0.2 with CUDA, 0.4 without)")
    final_lr_frac: float = opt("LR multiplier at the end of warmdown", 0.0)
    weight_decay: float = opt("decoupled weight decay of Muon's hidden matrices: each update first multiplies them by "
                              "1 - lr x weight_decay, lr the scheduled matrix LR (0: off)", 0.0)
    adam_weight_decay: float = opt("the same for AdamW's embedding, bigram table and lm_head, each at its own "
                                   "scheduled LR (0: off)", 0.0)
    dropout: float = opt("dropout on each block's attention and MLP outputs before they join the residual stream, "
                         "in training only: evals, samples and serving never drop (0: off)", 0.0)
    attn_dropout: float | None = opt("dropout on the attention weights (SDPA's dropout_p), in training only (0: off; "
                                     "default by regime: 0.2 where the budget passes over the data more than 4 "
                                     "times, else 0: experiment/regime.py; a STUDENT_DEPTH student, and a taught "
                                     "generation whose budget makes at most 10 passes: 0)")
    average: str = opt("weight average kept beside the weights: ema (a power-function EMA over the last "
                       "average_width of the run, evaluated beside the raw weights at every eval; the better "
                       "of the two is the one saved as best and served), none, or auto (by regime: ema where "
                       "the budget passes over the data more than 4 times, else none)", "auto")
    average_width: float = opt("the average's width as a fraction of the steps so far (0 < w <= 0.2886)", 0.1)
    seq_warmup_frac: float | None = opt("short contexts first: over the first half of this fraction of the schedule "
                                        "each sequence is cut into four of max_seq_len/4, over the second half into "
                                        "two (the same tokens per step; 0: off; default 0.3 without CUDA, 0 with)")
    batch_warmup_frac: float | None = opt("small batches first: over this fraction of the schedule each step's batch "
                                          "makes two optimizer steps of half the tokens each (0: off; default 0.3 "
                                          "without CUDA, 0 with)")
    muon_momentum_warmup_steps: int = opt("Muon's momentum rises linearly from 0.85 to 0.95 over this many steps "
                                          "(0: 0.95 from the start)", MUON_MOMENTUM_WARMUP_STEPS)
    generations: int | str = opt("models trained one after another in the run directory (gen1/, gen2/, ...), each "
                                 "from scratch with its own seed on the labels and a teacher's predictions; the best "
                                 "one is served. A number N: N generations sharing the budget equally (1: one model, "
                                 "no teacher). auto: the first generation gets the whole budget (less STUDENT_DEPTH's "
                                 "quarter), and another begins while the one before left enough unspent "
                                 "(docs/training.md)", 1)
    teacher: str = opt("what a generation after the first learns from: previous (the generation before it) or "
                       "ensemble (the mean of the probabilities of all before it)", "previous")
    distill_weight: float | None = opt("the teacher's share of a generation's loss, 0..1: (1 - w) x cross-entropy "
                                       "on the labels + w x T^2 x KL(teacher || student) at temperature T (auto: 0.5 "
                                       "for a generation, 1 for the STUDENT_DEPTH student)", None)
    distill_temperature: float = opt("T, the temperature of both distributions in the distillation term", 1.0)
    student_depth: int = opt("after the generations, a student of this depth (smaller, so that a laptop serves "
                             "it) distilled from the ensemble of all of them; it is the model served. Its budget: "
                             "with GENERATIONS=N an equal share, with auto a quarter of the budget and what the "
                             "chain left (0: none)", 0)
    seed: int = opt("init and data-order seed (generation k adds k - 1)", 1337)
    compile: str = opt("torch.compile: auto (on with CUDA), on, off", "auto")
    ddp_graph_split: int = opt("1: a compiled DDP step is split into one graph per gradient bucket, so each bucket's "
                               "all-reduce overlaps the rest of backward; 0: one graph, all-reduced after backward "
                               "(the fallback if compiling with DDP fails; COMPILE=off is the next one)", 1)
    precision: str = opt("weights: auto (fp32 unless only bf16 fits), fp32, or bf16 (bf16 weights and grads, "
                          "fp32 master shards)", "auto")
    activation_checkpointing: str = opt("recompute blocks in backward: auto (when needed to fit), on, off", "auto")
    device: str = opt("auto, cpu or cuda", "auto")
    dist_backend: str = opt("process group: auto (nccl with CUDA, gloo without) or gloo; with gloo on CUDA, ranks "
                            "beyond the GPU count share GPUs (each plans its memory as if alone: DEVICE_BATCH_SIZE "
                            "is required): a test of the multi-rank path on one GPU, not for training (slow "
                            "all-reduces through host memory)", "auto")


def parse_args(argv=None) -> TrainConfig:
    parser = argparse.ArgumentParser(prog="python -m experiment.train", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(TrainConfig):
        kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
        if f.name == "depth":
            kind = _depth
        elif f.name == "generations":
            kind = _generations
        elif f.default is None and kind is not str:  # optional numbers: "auto" means the device default
            kind = _auto_or(kind)
        parser.add_argument(f"--{f.name}", type=kind, default=f.default, help=f.metadata["help"])
    return TrainConfig(**vars(parser.parse_args(argv)))


def _depth(text: str) -> int | str | None:
    """A number of layers, or auto (the rule of experiment/autosize.py); empty: the device default."""
    if text in ("auto", ""):
        return text or None
    return int(text)


def _generations(text: str) -> int | str:
    return "auto" if text == "auto" else int(text)


def _auto_or(kind):
    def convert(text: str):
        return None if text in ("auto", "") else kind(text)
    convert.__name__ = kind.__name__  # argparse names the type in its error message
    return convert


def default_lrs(cuda: bool, depth: int) -> dict[str, float]:
    from experiment.optim import LRS  # here, not at the top: this module imports no torch (launchfacts.py)
    if cuda:
        return dict(LRS)
    scales = next(scales for deepest, scales in CPU_LR_SCALES if depth <= deepest)
    return {name: LRS[name] * scale for name, scale in scales.items()}


def fill_lrs(cfg: TrainConfig, cuda: bool, kept: dict | None = None) -> dict[str, float]:
    """The learning rates left unset: a resume's from its checkpoint's `train_config` (`kept`: the
    optimizer shards hold no rates, so without it a change to the defaults between a launch and its
    resume would move the run's rate mid-run), else from the depth: after resolve, since DEPTH=auto
    picks it later. Returns the kept rates that differ from today's defaults."""
    moved = {}
    for name, lr in default_lrs(cuda, cfg.depth).items():
        if getattr(cfg, name) is None:
            value = (kept or {}).get(name)
            value = lr if value is None else value  # no checkpoint, or a missing or None entry: today's
            setattr(cfg, name, value)
            if value != lr:
                moved[name] = value
    return moved


def resolve(cfg: TrainConfig, cuda: bool, world_size: int) -> TrainConfig:
    """Fill device-dependent defaults and check that the settings can work together."""
    if cfg.budget_usd is not None and cfg.training_hours is not None:  # one would silently override the other
        raise ConfigError(f"--budget_usd {cfg.budget_usd:g} and --training_hours {cfg.training_hours:g} are both set: "
                          "give one (BUDGET_USD: dollars over the GPUs that run; TRAINING_HOURS: wall-clock hours)")
    defaults = CUDA_DEFAULTS if cuda else CPU_DEFAULTS
    cfg = dataclasses.replace(cfg, **{k: v for k, v in defaults.items() if getattr(cfg, k) is None})
    if not (cfg.depth == "auto" or isinstance(cfg.depth, int) and cfg.depth > 0):
        raise ConfigError(f"--depth must be a positive number of layers or auto, got {cfg.depth!r}")
    if cfg.bigram_embed is None:  # measured on characters only (docs/performance.md, the recipe's ablation)
        cfg.bigram_embed = int(cfg.tokenizer == "char")
    if cfg.max_epochs is not None and cfg.max_epochs < 0:
        raise ConfigError(f"--max_epochs must be >= 0 (0: no limit), got {cfg.max_epochs}")
    for name in ("eval_every_epochs", "plateau_evals", "eval_every_steps", "save_every_steps"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"--{name} must be >= 0, got {getattr(cfg, name)}")
    if cfg.keep_last < 1:  # 0 would delete the step just saved (a preemption's checkpoint included)
        raise ConfigError(f"--keep_last must be >= 1 (the newest complete checkpoint is always kept), got {cfg.keep_last}")
    if not 0 <= cfg.plateau_margin < 1:
        raise ConfigError(f"--plateau_margin must lie in [0, 1) (a fraction of the val loss), got {cfg.plateau_margin}")
    unknown = set(filter(None, cfg.allow.split(","))) - set(GUARDS)
    if unknown:
        raise ConfigError(f"--allow: unknown guard(s) {', '.join(sorted(unknown))}; the guards are {', '.join(GUARDS)}")
    if cfg.model_tag is None:
        cfg.model_tag = "auto" if cfg.depth == "auto" else f"d{cfg.depth}"
    if cfg.budget_usd is not None:
        cfg.training_hours = cfg.budget_usd / (cfg.gpu_hourly_usd * world_size)
    if cfg.training_hours <= 0:
        raise ConfigError(f"--training_hours must be > 0, got {cfg.training_hours}")
    for name, allowed in (("compile", ("auto", "on", "off")), ("precision", ("auto", "fp32", "bf16")),
                          ("activation_checkpointing", ("auto", "on", "off")), ("dist_backend", ("auto", "gloo"))):
        if getattr(cfg, name) not in allowed:
            raise ConfigError(f"--{name} must be one of {', '.join(allowed)}, got {getattr(cfg, name)!r}")
    if cuda and cfg.dist_backend == "gloo" and cfg.device_batch_size is None:
        # Each rank would probe the GPU's memory as if it had the GPU alone, side by side with the others.
        raise ConfigError("--dist_backend gloo on CUDA needs --device_batch_size: ranks that share a GPU "
                          "cannot each probe it for the largest batch")
    if cfg.resume not in ("auto", "never") and not cfg.resume.isdigit():
        raise ConfigError(f"--resume must be auto, never or a step number, got {cfg.resume!r}")
    per_rank = cfg.max_seq_len * world_size
    if cfg.total_batch_size % per_rank:
        raise ConfigError(f"--total_batch_size {cfg.total_batch_size} is not a multiple of max_seq_len "
                          f"{cfg.max_seq_len} x world size {world_size} = {per_rank}")
    if cfg.device_batch_size is None and not cuda:
        cfg.device_batch_size = min(CPU_DEVICE_BATCH, cfg.total_batch_size // per_rank)
    if cfg.device_batch_size is not None and (cfg.total_batch_size // per_rank) % cfg.device_batch_size:
        raise ConfigError(
            f"--total_batch_size {cfg.total_batch_size} is not divisible by device_batch_size "
            f"{cfg.device_batch_size} x max_seq_len {cfg.max_seq_len} x world size {world_size}")
    if not 0 <= cfg.warmup_frac + cfg.warmdown_frac <= 1:
        raise ConfigError("--warmup_frac + --warmdown_frac must lie in [0, 1]")
    check_warmups(cfg)
    check_regularizers(cfg)
    check_metric(cfg)
    check_generations(cfg)
    return cfg


def check_generations(cfg: TrainConfig) -> None:
    if cfg.generations != "auto" and not (isinstance(cfg.generations, int) and cfg.generations >= 1):
        raise ConfigError(f"--generations must be auto or a number >= 1 (1: one model), got {cfg.generations!r}")
    if cfg.teacher not in ("previous", "ensemble"):
        raise ConfigError(f"--teacher must be previous or ensemble, got {cfg.teacher!r}")
    if cfg.distill_weight is not None and not 0 <= cfg.distill_weight <= 1:
        raise ConfigError(f"--distill_weight must lie in [0, 1], got {cfg.distill_weight}")
    if not (math.isfinite(cfg.distill_temperature) and cfg.distill_temperature > 0):
        raise ConfigError(f"--distill_temperature must be a finite number > 0, got {cfg.distill_temperature}")
    if not isinstance(cfg.student_depth, int) or cfg.student_depth < 0:
        raise ConfigError(f"--student_depth must be a depth >= 1 (0: no student), got {cfg.student_depth!r}")
    several = cfg.generations == "auto" or isinstance(cfg.generations, int) and cfg.generations >= 2
    if cfg.student_depth and not several:
        raise ConfigError(f"--student_depth needs GENERATIONS=auto or N of at least 2 (the student learns from the "
                          f"ensemble of the generations and trains after them), got --generations {cfg.generations}")
    if cfg.generations != 1 and cfg.init_from:
        raise ConfigError("--generations other than 1 with --init_from: each generation starts from scratch; "
                          "fine-tune one model (GENERATIONS=1) instead")
    if cfg.generations != 1 and cfg.resume not in ("auto", "never"):
        raise ConfigError(f"--resume {cfg.resume} names one step, but with generations each generation has "
                          "its own steps: use auto or never")


# Other ranks wait in the eval's next collective while rank 0 runs EVAL_METRIC: well inside the
# process group's timeout.
MAX_METRIC_SECONDS = 300.0


def check_metric(cfg: TrainConfig) -> None:
    if not 0 < cfg.eval_metric_seconds <= MAX_METRIC_SECONDS:
        raise ConfigError(f"--eval_metric_seconds must lie in (0, {MAX_METRIC_SECONDS:g}], got {cfg.eval_metric_seconds}")
    parse_best_by(cfg.best_by)  # its spelling; whether a metric returns the name: the trainer's dry call


def check_regularizers(cfg: TrainConfig) -> None:
    from experiment.average import KINDS as AVERAGES, MAX_WIDTH as MAX_AVERAGE_WIDTH  # torch: not at the top
    for name in ("dropout", "attn_dropout"):  # 1 would drop everything; attn_dropout None: by regime
        if getattr(cfg, name) is not None and not 0 <= getattr(cfg, name) < 1:
            raise ConfigError(f"--{name} must lie in [0, 1), got {getattr(cfg, name)}")
    for name in ("weight_decay", "adam_weight_decay"):
        if not (math.isfinite(getattr(cfg, name)) and getattr(cfg, name) >= 0):
            raise ConfigError(f"--{name} must be a finite number >= 0, got {getattr(cfg, name)}")
    if cfg.average not in AVERAGES + ("auto",):
        raise ConfigError(f"--average must be one of {', '.join(AVERAGES + ('auto',))}, got {cfg.average!r}")
    if not 0 < cfg.average_width <= MAX_AVERAGE_WIDTH:
        raise ConfigError(f"--average_width must lie in (0, {MAX_AVERAGE_WIDTH}], got {cfg.average_width}")


def check_warmups(cfg: TrainConfig) -> None:
    """The early-schedule warmups' settings (schedule.warmup_phase), once their device defaults are in."""
    for name in ("seq_warmup_frac", "batch_warmup_frac"):
        if not 0 <= getattr(cfg, name) <= 1:
            raise ConfigError(f"--{name} must lie in [0, 1], got {getattr(cfg, name)}")
    if cfg.seq_warmup_frac and cfg.max_seq_len % 4:
        raise ConfigError(f"--seq_warmup_frac {cfg.seq_warmup_frac} cuts sequences into quarters: max_seq_len "
                          f"{cfg.max_seq_len} must be a multiple of 4 (or set --seq_warmup_frac 0)")
    if cfg.muon_momentum_warmup_steps < 0:
        raise ConfigError(f"--muon_momentum_warmup_steps must be >= 0, got {cfg.muon_momentum_warmup_steps}")


def checkpoint_meta(cfg: TrainConfig, prepared: Prepared, budget_seconds: float, auto: dict | None = None) -> dict:
    """What every checkpoint's meta holds besides the run state: enough to rebuild the tokenizer and
    to refuse a resume on other data, and with DEPTH=auto the choice and its reason."""
    return {"budget_seconds": budget_seconds, "train_config": dataclasses.asdict(cfg), "auto": auto,
            "tokenizer": {k: prepared.meta[k] for k in ("tokenizer", "encoding", "chars", "bos_id", "vocab_size",
                                                        "vocab_used")},
            "prepared": {"dir": str(prepared.dir), "hash": prepared.meta["hash"]}}



# ---------------------------------------------------------------- BEST_BY (experiment/metric.py runs the metric)

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_./-]{0,63}$")  # a metric's name: fits a TensorBoard tag and a table column


@dataclass(frozen=True)
class BestBy:
    """What chooses the best checkpoint: the val loss (name None), or a metric's number; `sign` turns
    it into a score that is lower for better (-1: higher is better)."""
    name: str | None = None
    sign: float = 1.0

    def score(self, val_loss: float, values: dict[str, float] | None) -> float:
        """Lower is better; +inf when the metric has no number this eval (it never becomes the best)."""
        if self.name is None:
            return val_loss
        if not values or self.name not in values:
            return math.inf
        return self.sign * values[self.name]

    def describe(self, score: float) -> str:
        return "" if self.name is None else f"{self.name} {self.sign * score:.4f}"


def parse_best_by(text: str) -> BestBy:
    """BEST_BY: val_loss, <name> or max:<name> (higher is better), min:<name>."""
    if text == "val_loss":
        return BestBy()
    sign, name = (1.0, text[4:]) if text.startswith("min:") else (-1.0, text.removeprefix("max:"))
    if not NAME.match(name):
        raise ConfigError(f"BEST_BY={text!r}: expected val_loss, a metric's name, or min:<name> (letters, digits, "
                          "_ . / -)")
    return BestBy(name, sign)
