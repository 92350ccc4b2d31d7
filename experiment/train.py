"""Train a depth-parameterized char GPT under a hard wall-clock budget.

    torchrun --standalone --nproc_per_node=N -m experiment.train [--flags]   (or python -m ...)

Raw DDP (nccl on CUDA, gloo on CPU), ZeRO-1 optimizer shards (experiment/optim.py), bf16 autocast on
GPU, periodic eval summed over all ranks, best-val tracking, atomic checkpoints, automatic resume.
The budget is wall-clock seconds of the training loop (evals and saves included), persisted across
restarts; the LR schedule is a function of the budget fraction used, so warmdown ends at the deadline
whatever the step speed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import resource
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from experiment import checkpoint as ckpt
from experiment.checkpoint import (CheckpointError, Retention, RunState, load_checkpoint, pick_resume_step,
                                   save_checkpoint)
from experiment.files import default_workspace
from experiment.distributed import (Dist, StopSignal, autocast_for, broadcast_object, resolve_device,
                                    setup_distributed)
from experiment.dataloader import (DEMO_FILE, DataError, Prepared, TokenBatches, demo_lines, prepare, val_batches,
                                   write_demo_corpus)
from experiment.memory import MODES, MemoryPlan, choose_mode, format_plan, plan_memory
from experiment.model import GPT, GPTConfig
from experiment.optim import ShardedOptimizer

# Dense bf16 peak FLOP/s by device-name fragment, most specific first (design.md). An unknown device
# reports no MFU rather than a wrong one.
PEAK_FLOPS = (("H100 PCIe", 756e12), ("H100 SXM", 989e12), ("H100 80GB HBM3", 989e12),
              ("H200", 989e12), ("A100", 312e12))
# CPU defaults are the recommended small-budget settings: the best of the speedruns in the README's
# Performance table (Tiny Shakespeare, 180 s on 2 cores); a narrow model that sees many tokens wins.
CUDA_DEFAULTS = dict(depth=64, aspect_ratio=64, head_dim=128, matrix_lr=0.02, warmdown_frac=0.2,
                     max_seq_len=2048, total_batch_size=524288, training_hours=31.0,
                     save_every_minutes=60.0, eval_every_minutes=30.0, eval_tokens=1 << 20)
CPU_DEFAULTS = dict(depth=4, aspect_ratio=32, head_dim=64, matrix_lr=0.04, warmdown_frac=0.4,
                    max_seq_len=256, total_batch_size=4096, training_hours=0.05,
                    save_every_minutes=1.0, eval_every_minutes=0.5, eval_tokens=1 << 16)
CPU_DEVICE_BATCH = 16
# The first steps after a (re)start hold torch.compile and allocator warm-up: tens of seconds on a
# GPU, not a step's cost. They stay out of the throughput figures and the end-of-run reserve.
WARMUP_STEPS = 3
MAX_NONFINITE_IN_A_ROW = 5  # then the run is diverging, not unlucky: stop rather than burn the budget


class ConfigError(Exception):
    """A setting that cannot work; the message names the flag."""


def _opt(help_text: str, default=None):
    return field(default=default, metadata={"help": help_text})


@dataclass
class TrainConfig:
    depth: int | None = _opt("layers; model_dim = depth * aspect_ratio (default 64 with CUDA, 4 without)")
    aspect_ratio: int | None = _opt("model_dim per layer (default 64 with CUDA, 32 without)")
    head_dim: int | None = _opt("attention head size (default 128 with CUDA, 64 without)")
    max_seq_len: int | None = _opt("context length (default 2048 with CUDA, 256 without)")
    device_batch_size: int | None = _opt("sequences per micro-batch per rank (default: largest that fits "
                                         "on CUDA, 16 on CPU)")
    total_batch_size: int | None = _opt("tokens per optimizer step (default 524288 with CUDA, 4096 without)")
    training_hours: float | None = _opt("wall-clock budget in hours (default 31 with CUDA, 0.05 without)")
    budget_usd: float | None = _opt("if set: hours = budget_usd / (gpu_hourly_usd x world size)")
    gpu_hourly_usd: float = _opt("price of one GPU-hour, for budget_usd", 4.0)
    max_steps: int = _opt("stop after this many optimizer steps (0: budget only); for tests and benchmarks", 0)
    data_dir: str | None = _opt("directory of *.txt (or one .txt); default $WORKSPACE/data, demo if empty")
    workspace: str | None = _opt("root of data, prepared, checkpoints, tensorboard "
                                 "(default /workspace/<project> if writable, else the repo)")
    tokenizer: str = _opt("char, or a tiktoken encoding name", "char")
    alphabet: str | None = _opt("allowed characters; data with any other one is rejected")
    val_fraction: float = _opt("last fraction of the tokens held out for validation", 0.05)
    model_tag: str | None = _opt("run directory name (default d<depth>)")
    resume: str = _opt("auto: latest complete checkpoint; never; or a step number", "auto")
    save_every_minutes: float | None = _opt("checkpoint cadence (default 60 with CUDA, 1 without)")
    save_every_steps: int = _opt("also checkpoint every N steps (0: off)", 0)
    keep_last: int = _opt("complete checkpoints kept, plus the best", 3)
    keep_best_optimizer: int = _opt("1: a best checkpoint older than the last keep_last keeps its optimizer "
                                    "shards (resumable); 0: only its model and meta (servable)", 0)
    eval_every_minutes: float | None = _opt("eval cadence (default 30 with CUDA, 0.5 without)")
    eval_every_steps: int = _opt("also eval every N steps (0: off)", 0)
    eval_tokens: int | None = _opt("size of the fixed val slice (default 1048576 with CUDA, 65536 without)")
    early_stop_evals: int = _opt("stop after N evals without improvement (0: off)", 0)
    sample_tokens: int = _opt("tokens sampled at each eval", 64)
    log_every_steps: int = _opt("step-line cadence", 10)
    matrix_lr: float | None = _opt("Muon learning rate, hidden matrices (default 0.02 with CUDA, 0.04 without)")
    embedding_lr: float = _opt("AdamW learning rate, embedding (scaled by (768/model_dim)^0.5)", 0.2)
    unembedding_lr: float = _opt("AdamW learning rate, lm_head (scaled likewise)", 0.004)
    warmup_frac: float = _opt("fraction of the budget with linear LR warmup", 0.0)
    warmdown_frac: float | None = _opt("final fraction of the budget with linear LR warmdown "
                                       "(default 0.2 with CUDA, 0.4 without)")
    final_lr_frac: float = _opt("LR multiplier at the end of warmdown", 0.0)
    seed: int = _opt("init and data-order seed", 1337)
    compile: str = _opt("torch.compile: auto (on with CUDA), on, off", "auto")
    precision: str = _opt("weights: auto (fp32 unless only bf16 fits), fp32, or bf16 (bf16 weights and grads, "
                          "fp32 master shards)", "auto")
    activation_checkpointing: str = _opt("recompute blocks in backward: auto (when needed to fit), on, off", "auto")
    device: str = _opt("auto, cpu or cuda", "auto")


def parse_args(argv=None) -> TrainConfig:
    parser = argparse.ArgumentParser(prog="python -m experiment.train", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(TrainConfig):
        kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
        if f.default is None and kind is not str:  # optional numbers: "auto" means the device default
            kind = _auto_or(kind)
        parser.add_argument(f"--{f.name}", type=kind, default=f.default, help=f.metadata["help"])
    return TrainConfig(**vars(parser.parse_args(argv)))


def _auto_or(kind):
    def convert(text: str):
        return None if text in ("auto", "") else kind(text)
    convert.__name__ = kind.__name__  # argparse names the type in its error message
    return convert


def resolve(cfg: TrainConfig, cuda: bool, world_size: int) -> TrainConfig:
    """Fill device-dependent defaults and check that the settings can work together."""
    defaults = CUDA_DEFAULTS if cuda else CPU_DEFAULTS
    cfg = dataclasses.replace(cfg, **{k: v for k, v in defaults.items() if getattr(cfg, k) is None})
    if cfg.model_tag is None:
        cfg.model_tag = f"d{cfg.depth}"
    if cfg.budget_usd is not None:
        cfg.training_hours = cfg.budget_usd / (cfg.gpu_hourly_usd * world_size)
    if cfg.training_hours <= 0:
        raise ConfigError(f"--training_hours must be > 0, got {cfg.training_hours}")
    for name, allowed in (("compile", ("auto", "on", "off")), ("precision", ("auto", "fp32", "bf16")),
                          ("activation_checkpointing", ("auto", "on", "off"))):
        if getattr(cfg, name) not in allowed:
            raise ConfigError(f"--{name} must be one of {', '.join(allowed)}, got {getattr(cfg, name)!r}")
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
    return cfg


def lr_multiplier(progress: float, warmup_frac: float, warmdown_frac: float, final_lr_frac: float) -> float:
    """LR multiplier at a fraction `progress` of the budget: linear warmup, constant, linear warmdown."""
    p = min(max(progress, 0.0), 1.0)
    if warmup_frac > 0 and p < warmup_frac:
        return p / warmup_frac
    if warmdown_frac > 0 and p > 1 - warmdown_frac:
        return final_lr_frac + (1 - final_lr_frac) * (1 - p) / warmdown_frac
    return 1.0


def peak_flops(device_name: str) -> float | None:
    for fragment, flops in PEAK_FLOPS:
        if fragment in device_name:
            return flops
    return None


# ---------------------------------------------------------------- logging


class RunLog:
    """Rank 0's human lines: stdout and the run's training.log. Off rank 0 every call is a no-op."""

    def __init__(self, path: Path | None):
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, msg: str) -> None:
        if self.path is None:
            return
        print(msg, flush=True)
        with open(self.path, "a") as f:
            f.write(msg + "\n")


def log_crash(log_path: Path, rank: int) -> None:
    """Every rank appends its traceback to training.log: a run that died overnight says why."""
    with contextlib.suppress(OSError):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a") as f:
            f.write(f"[rank {rank}] crashed at {time.strftime('%Y-%m-%d %H:%M:%S')}:\n{traceback.format_exc()}")


class NullWriter:
    def add_scalar(self, *args, **kwargs): ...
    def add_text(self, *args, **kwargs): ...
    def flush(self): ...
    def close(self): ...


# ---------------------------------------------------------------- pieces of the loop


def updated_step_seconds(previous: float, dt: float, warm: bool) -> float:
    """Moving average of the step time, which the reserve for the final eval + save includes.
    Warm-up steps leave it as it was (0 on a fresh start, the checkpoint's on a resume): on an H100
    a 30 s compile step taken for a step's cost stopped an 80 s run after one step."""
    if not warm:
        return previous
    return 0.9 * previous + 0.1 * dt if previous else dt


def gradients_finite(model: torch.nn.Module) -> bool:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return bool(torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum()).item())  # syncs the device


def memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def build_model(config: GPTConfig, device: torch.device, precision: str = "fp32", recompute: bool = False,
                seed: int = 0, draw_on_device: bool = False) -> GPT:
    """Built on the meta device and materialized in place, in its final dtype: d64 in fp32 is 51 GB,
    which no rank should hold in host memory first. Same seed, CPU generator: same weights anywhere
    (`draw_on_device`: a fast draw on the device, for probes)."""
    with torch.device("meta"):
        model = GPT(config)
    if precision == "bf16":  # cast while still on meta: materializing fp32 first would cost 2x on the GPU
        model.to(torch.bfloat16)
    model.to_empty(device=device)
    model.init_weights(seed=seed, draw_on_device=draw_on_device)
    model.activation_checkpointing = recompute
    return model


@torch.no_grad()
def evaluate(model: GPT, prepared: Prepared, seq_len: int, batch_size: int, max_tokens: int, d: Dist,
             autocast) -> tuple[float, float]:
    """(val loss in nats/token, bits per character) over the first max_tokens of val, summed over all
    ranks."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=d.device)  # [sum of losses, tokens]
    for x, y in val_batches(prepared.tokens("val"), seq_len, batch_size, max_tokens, d.rank, d.world_size):
        x, y = x.to(d.device), y.to(d.device)
        with autocast:
            total[0] += model(x, y, reduction="sum").double()
        total[1] += y.numel()
    if d.world_size > 1:
        dist.all_reduce(total)
    model.train()
    loss = (total[0] / total[1]).item()
    split = prepared.meta["split"]
    chars_per_token = split["val_chars"] / split["val_tokens"]
    return loss, loss / math.log(2) / chars_per_token


def sample_text(model: GPT, prepared: Prepared, n_tokens: int) -> str:
    """A short sample from the start of a document (BOS)."""
    tok = prepared.tokenizer()
    gen = torch.Generator().manual_seed(0)  # a private generator: sampling never shifts training RNG
    out = model.generate([tok.bos_id], n_tokens, temperature=0.8, top_k=None, generator=gen,
                         allowed_vocab=tok.n_real)
    return tok.decode(list(out))


def demo_accuracy(model: GPT, prepared: Prepared, n: int = 50) -> tuple[int, int]:
    """For the built-in arithmetic corpus: how many of n held-out sums the model completes exactly."""
    tok = prepared.tokenizer()
    correct = 0
    for line in demo_lines(n, seed=99):
        prompt, answer = line.split("=")
        # In the corpus a line follows a newline (BOS only opens the file), so the prompt does too.
        ids = tok.encode("\n" + prompt + "=")
        out = model.generate(ids, len(answer) + 1, temperature=0, allowed_vocab=tok.n_real)
        correct += tok.decode(list(out)).split("\n")[0] == answer.strip()
    return correct, n


def report_eval(step: int, val_loss: float, val_bpc: float, st: RunState, model: GPT, prepared: Prepared,
                sample_tokens: int, master: bool, log: RunLog, writer, run_dir: Path) -> None:
    """The eval line, TensorBoard, metrics.jsonl, a sample and (on the demo corpus) its accuracy."""
    best = f"{st.best_val:.4f} @ {st.best_step:06d}" if st.best_step >= 0 else "- (step 0 is not saved)"
    log(f"step {step:06d} | val_loss {val_loss:.4f} | val_bpc {val_bpc:.4f} | best {best}")
    writer.add_scalar("val/loss", val_loss, step)
    writer.add_scalar("val/bpc", val_bpc, step)
    if master:  # machine-readable curve: val loss against the budget seconds used
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "used_seconds": round(st.used_seconds, 3), "tokens_seen": st.tokens_seen,
                                "val_loss": val_loss, "val_bpc": val_bpc}) + "\n")
    if master and sample_tokens > 0:
        log(f"sample | {sample_text(model, prepared, sample_tokens)!r}")
        if any(Path(s["path"]).name == DEMO_FILE for s in prepared.meta["sources"]):
            ok, n = demo_accuracy(model, prepared)
            log(f"demo | {ok}/{n} sums of a separate draw completed correctly (greedy)")
            writer.add_scalar("val/demo_accuracy", ok / n, step)
    writer.flush()


def log_step(log: RunLog, writer, step: int, loss: float, lr: float, lr_mult: float, dt: float, tok_s: float,
             mfu: float | None, mem_gib: float, used_h: float, budget_h: float) -> None:
    """The step line and the same values to TensorBoard."""
    log(f"step {step:06d} | loss {loss:.4f} | lr {lr:.2e} | dt {1000 * dt:.0f}ms | tok/s {tok_s:,.0f} | "
        f"mfu {f'{100 * mfu:.1f}%' if mfu is not None else '-'} | mem {mem_gib:.1f}GiB | "
        f"used {used_h:.2f}h/{budget_h:.2f}h | eta {max(budget_h - used_h, 0):.2f}h")
    for name, value in (("train/loss", loss), ("train/lr_multiplier", lr_mult), ("perf/tok_per_s", tok_s),
                        ("perf/mem_gib", mem_gib)):
        writer.add_scalar(name, value, step)
    if mfu is not None:
        writer.add_scalar("perf/mfu", mfu, step)


def planner_line(rate: float, seconds_left: float, step: int, tokens_seen: int, tokens_per_step: int,
                 budget_h: float, train_tokens: int, n_params: int) -> str:
    """From the measured tok/s: the steps, tokens, epochs and tokens per parameter the budget buys."""
    total = tokens_seen + rate * seconds_left
    return (f"planner | measured {rate:,.0f} tok/s | projected {int(step + rate * seconds_left / tokens_per_step):,} "
            f"steps, {total:,.0f} tokens in the {budget_h:.3f}h budget | {total / train_tokens:.2f} epochs | "
            f"{total / n_params:.1f} tokens/param")


def checkpoint_meta(cfg: TrainConfig, prepared: Prepared, budget_seconds: float) -> dict:
    """What every checkpoint's meta holds besides the run state: enough to rebuild the tokenizer and
    to refuse a resume on other data."""
    return {"budget_seconds": budget_seconds, "train_config": dataclasses.asdict(cfg),
            "tokenizer": {k: prepared.meta[k] for k in ("tokenizer", "encoding", "chars", "bos_id", "vocab_size",
                                                        "vocab_used")},
            "prepared": {"dir": str(prepared.dir), "hash": prepared.meta["hash"]}}


def largest_fitting_batch(try_batch, start: int) -> int:
    """Halves from `start` (a power of two) until try_batch(b) runs without running out of memory;
    0 if not even 1 fits."""
    b = start
    while b >= 1:
        try:
            try_batch(b)
            return b
        except torch.OutOfMemoryError:
            b //= 2
    return 0


def find_device_batch(model: GPT, cfg: TrainConfig, d: Dist, autocast, reserve_bytes: int) -> int:
    """Largest power-of-two micro-batch whose forward+backward fits next to `reserve_bytes` (the
    optimizer state and fp32 master gradients, allocated only at the first step), agreed across
    ranks (min), and dividing the per-rank batch."""
    per_rank = cfg.total_batch_size // (cfg.max_seq_len * d.world_size)

    def try_batch(b: int) -> None:
        reserve = None
        try:
            reserve = torch.empty(reserve_bytes, dtype=torch.uint8, device=d.device)
            x = torch.zeros(b, cfg.max_seq_len, dtype=torch.long, device=d.device)
            with autocast:
                model(x, x).backward()
        finally:
            del reserve
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()

    b = largest_fitting_batch(try_batch, 1 << (min(per_rank, 256).bit_length() - 1))
    agreed = torch.tensor([b], device=d.device)
    if d.world_size > 1:
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    b = int(agreed.item())
    if b < 1:
        raise ConfigError("not even device_batch_size 1 fits in GPU memory; lower --depth or --max_seq_len "
                          "(python -m experiment.bench plan shows where the memory goes)")
    while per_rank % b:
        b //= 2
    return b


def choose_memory_mode(cfg: TrainConfig, model_config: GPTConfig, d: Dist) -> MemoryPlan | None:
    """On CUDA, "auto" settings take the cheapest mode the memory plan says fits this GPU; on CPU,
    "auto" is fp32 without recompute (returns None: no plan)."""
    if d.device.type != "cuda":
        return None
    gpu_bytes = torch.cuda.get_device_properties(d.device).total_memory
    batch = cfg.device_batch_size or 1
    plan = choose_mode(model_config, d.world_size, batch, cfg.max_seq_len, gpu_bytes,
                       cfg.precision, cfg.activation_checkpointing)
    if plan is None:
        plans = [plan_memory(model_config, d.world_size, batch, cfg.max_seq_len, p, c) for p, c in MODES]
        raise ConfigError(f"d{cfg.depth} with device batch {batch} does not fit {gpu_bytes / 2**30:.0f} GiB per GPU "
                          f"on {d.world_size} ranks in any mode allowed:\n{format_plan(plans, gpu_bytes)}")
    return plan


# ---------------------------------------------------------------- main


def train(cfg: TrainConfig, d: Dist) -> int:
    cuda = d.device.type == "cuda"
    cfg = resolve(cfg, cuda, d.world_size)
    workspace = Path(cfg.workspace) if cfg.workspace else default_workspace()
    run_dir = workspace / "checkpoints" / cfg.model_tag
    log = RunLog(run_dir / "training.log" if d.master else None)
    log(f"config {json.dumps(dataclasses.asdict(cfg))}")
    try:
        return run(cfg, d, workspace, run_dir, log)
    except (ConfigError, DataError, CheckpointError):
        raise  # reported as a one-line error by main()
    except BaseException:
        log_crash(run_dir / "training.log", d.rank)
        raise


def run(cfg: TrainConfig, d: Dist, workspace: Path, run_dir: Path, log: RunLog) -> int:
    cuda = d.device.type == "cuda"
    log(f"world {d.world_size} x {torch.cuda.get_device_name(d.device) if cuda else 'cpu'} | torch {torch.__version__}")

    # Rank 0 prepares the data and picks the resume step; a failure there reaches every rank.
    setup = None
    if d.master:
        try:
            data_dir = Path(cfg.data_dir) if cfg.data_dir else workspace / "data"
            if cfg.data_dir is None and not (data_dir.is_dir() and any(data_dir.glob("*.txt"))):
                data_dir = write_demo_corpus(workspace / "demo_data").parent
                log(f"no *.txt in {workspace / 'data'}: training on the built-in arithmetic demo ({data_dir})")
            prepared = prepare(data_dir, workspace, cfg.tokenizer, cfg.alphabet, cfg.val_fraction, cfg.max_seq_len)
            resume_step = pick_resume_step(run_dir, cfg.resume)
            setup = {"prepared": str(prepared.dir), "resume_step": resume_step}
        except (DataError, ConfigError, CheckpointError) as e:
            setup = {"error": str(e)}
    setup = broadcast_object(setup, d)
    if "error" in setup:
        raise ConfigError(setup["error"])
    prepared = Prepared(Path(setup["prepared"]), json.loads((Path(setup["prepared"]) / "meta.json").read_text()))
    resume_step = setup["resume_step"]

    model_config = GPTConfig(vocab_size=prepared.meta["vocab_size"], depth=cfg.depth, aspect_ratio=cfg.aspect_ratio,
                             head_dim=cfg.head_dim, max_seq_len=cfg.max_seq_len)
    if resume_step is not None:
        meta = ckpt.read_meta(run_dir, resume_step)
        if meta["model_config"] != model_config.to_dict():
            raise ConfigError(f"{ckpt.meta_path(run_dir, resume_step)}: model config {meta['model_config']} differs "
                              f"from the requested {model_config.to_dict()}; use another --model_tag")
        if meta["prepared"]["hash"] != prepared.meta["hash"]:
            raise ConfigError(f"{ckpt.meta_path(run_dir, resume_step)}: trained on prepared data "
                              f"{meta['prepared']['hash']}, but the data now hashes to {prepared.meta['hash']}")
    torch.manual_seed(cfg.seed)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls outside autocast
    plan = choose_memory_mode(cfg, model_config, d)
    precision = plan.precision if plan else ("fp32" if cfg.precision == "auto" else cfg.precision)
    recompute = plan.checkpointing if plan else cfg.activation_checkpointing == "on"
    model = build_model(model_config, d.device, precision, recompute, cfg.seed)  # identical on every rank
    autocast = autocast_for(d.device)
    opt = ShardedOptimizer(model, d.rank, d.world_size, matrix_lr=cfg.matrix_lr, embedding_lr=cfg.embedding_lr,
                           unembedding_lr=cfg.unembedding_lr, master_weights=precision == "bf16")
    log(f"memory | weights {precision}" + (" with fp32 master shards" if precision == "bf16" else "")
        + f" | activation checkpointing {'on' if recompute else 'off'}"
        + (f" | planned {plan.total / 2**30:.1f} GiB of {torch.cuda.get_device_properties(d.device).total_memory / 2**30:.1f}"
           f" GiB per GPU at device batch {cfg.device_batch_size or 1}" if plan else ""))
    if cfg.device_batch_size is None:
        reserve = plan.rows["optimizer state"] + plan.rows["fp32 masters"] // 2 if plan else 0
        cfg.device_batch_size = find_device_batch(model, cfg, d, autocast, reserve)
        log(f"device_batch_size auto -> {cfg.device_batch_size}")
        # The probe's tries (up to out-of-memory) are no part of training: on an H100 the step line
        # showed 78.1 GiB at d12 for a step that needs a fraction of it.
        torch.cuda.reset_peak_memory_stats(d.device)
    grad_accum = cfg.total_batch_size // (cfg.device_batch_size * cfg.max_seq_len * d.world_size)

    st = RunState()
    if resume_step is not None:
        st = load_checkpoint(run_dir, resume_step, model, opt, d)
        log(f"resumed from {ckpt.model_path(run_dir, resume_step)}: step {st.step}, "
            f"{st.used_seconds / 3600:.3f}h used, best {st.best_val:.4f} @ {st.best_step:06d}")
    if d.master:  # files of a save that a crash cut short; the loaded step is complete, so never these
        ckpt.remove_incomplete(run_dir)
    batches = TokenBatches(prepared.tokens("train"), cfg.max_seq_len, cfg.device_batch_size, d.rank,
                           d.world_size, cfg.seed, st.data_state)

    ddp = DDP(model, device_ids=[d.local_rank] if cuda else None, gradient_as_bucket_view=True) \
        if d.world_size > 1 else model
    use_compile = cfg.compile == "on" or (cfg.compile == "auto" and cuda)
    train_model = torch.compile(ddp) if use_compile else ddp
    writer = NullWriter()
    if d.master:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=str(workspace / "tensorboard" / cfg.model_tag))

    budget_seconds = cfg.training_hours * 3600
    run_meta = checkpoint_meta(cfg, prepared, budget_seconds)
    retention = Retention(cfg.keep_last, bool(cfg.keep_best_optimizer))
    flops_per_token = model.estimate_flops(cfg.max_seq_len)
    peak = peak_flops(torch.cuda.get_device_name(d.device)) if cuda else None
    tokens_per_step = cfg.total_batch_size
    log(f"model {model.num_params():,} params (d{cfg.depth}, width {model_config.n_embd}, "
        f"{model_config.n_head} heads) | {flops_per_token:.3e} FLOP/token | batch {cfg.device_batch_size} x "
        f"{cfg.max_seq_len} x {d.world_size} ranks x {grad_accum} accum = {tokens_per_step:,} tokens/step | "
        f"budget {cfg.training_hours:.3f}h | tensorboard {workspace / 'tensorboard' / cfg.model_tag}")

    # The saved data position is the one before the prefetched batch, so a resume replays it.
    data_state = batches.state()
    x, y = (t.to(d.device, non_blocking=True) for t in next(batches))
    max_steps = cfg.max_steps or sys.maxsize
    last_eval_time = last_save_time = time.time()
    last_saved_step = last_eval_step = st.step if resume_step is not None else -1
    val_loss = math.nan
    measured_tokens, measured_time, planned = 0, 0.0, False
    bad_in_a_row = 0
    loop_start, used_at_start = time.time(), st.used_seconds
    def used() -> float:  # budget seconds, summed over restarts
        return used_at_start + time.time() - loop_start

    with StopSignal(announce=d.master) as stop_signal:
        for step in range(st.step, max_steps + 1):
            st.step = step
            st.used_seconds = used()
            reserve = st.eval_seconds + st.save_seconds + st.step_seconds  # measured: the final eval+save fits
            # Rank 0 decides the clock-driven flags; a stop signal may reach any rank. One all-reduce
            # (max) gives every rank the same decisions, so none is left waiting in a collective.
            flags = torch.tensor([
                d.master and (step >= max_steps or st.used_seconds + reserve >= budget_seconds),
                d.master and ((time.time() - last_eval_time >= cfg.eval_every_minutes * 60)
                              or (cfg.eval_every_steps > 0 and step % cfg.eval_every_steps == 0) or step == 0),
                d.master and ((time.time() - last_save_time >= cfg.save_every_minutes * 60)
                              or (cfg.save_every_steps > 0 and step % cfg.save_every_steps == 0 and step > 0)),
                stop_signal.signum,
            ], dtype=torch.int32, device=d.device)
            if d.world_size > 1:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            last_step, eval_due, save_due, signum = (int(v) for v in flags.tolist())
            if signum:  # preempted: save what we have now; an eval would spend the grace period
                log(f"received {signal.Signals(signum).name}: saving step {step:06d} and exiting")
                last_step, eval_due = True, False
            elif (eval_due or save_due or last_step) and step != last_eval_step:
                t0 = time.time()
                val_loss, val_bpc = evaluate(model, prepared, cfg.max_seq_len, cfg.device_batch_size,
                                             cfg.eval_tokens, d, autocast)
                last_eval_step, last_eval_time = step, time.time()
                previous_best = (st.best_val, st.best_step, st.evals_since_best)
                if step > 0 and val_loss < st.best_val:
                    st.best_val, st.best_step, st.evals_since_best = val_loss, step, 0
                elif step > 0:
                    st.evals_since_best += 1
                report_eval(step, val_loss, val_bpc, st, model, prepared, cfg.sample_tokens, d.master, log, writer,
                            run_dir)
                if cfg.early_stop_evals and st.evals_since_best >= cfg.early_stop_evals:
                    log(f"early stop: {st.evals_since_best} evals without improvement")
                    last_step = True  # every rank saw the same reduced val loss, so all agree
                st.eval_seconds = max(st.eval_seconds, time.time() - t0)

            # No periodic save during a streak of skipped updates: retention must not push the last
            # checkpoint from before the streak out. (Skipped updates leave the weights valid, so the
            # final save still happens.)
            if ((save_due or last_step or st.best_step == step) and step != last_saved_step
                    and (last_step or not bad_in_a_row)):
                t0 = time.time()
                st.used_seconds = used()
                saved = save_checkpoint(run_dir, model, opt, data_state, st, None if signum else val_loss,
                                        run_meta, retention, d, log)
                last_save_time = time.time()  # a failed save is retried at the next due time, not every step
                st.save_seconds = max(st.save_seconds, time.time() - t0)
                if saved:
                    last_saved_step = step
                elif last_step:
                    log("error: the final checkpoint could not be written; the latest complete one is kept")
                    return 1
                elif st.best_step == step:  # best.json must name a checkpoint that exists
                    st.best_val, st.best_step, st.evals_since_best = previous_best

            if last_step:
                break

            # ---- one optimizer step: grad_accum micro-batches, gradient all-reduce on the last only
            t0 = time.time()
            progress = st.used_seconds / max(budget_seconds - reserve, 1e-9)
            if cfg.max_steps:  # a max_steps run is reproducible: its schedule follows steps
                progress = max(progress, step / cfg.max_steps)
            mult = lr_multiplier(progress, cfg.warmup_frac, cfg.warmdown_frac, cfg.final_lr_frac)
            opt.set_lr_multiplier(mult)
            loss_sum = torch.zeros((), device=d.device)
            for micro in range(grad_accum):
                sync = micro == grad_accum - 1
                with (contextlib.nullcontext() if sync or d.world_size == 1 else ddp.no_sync()), autocast:
                    loss = train_model(x, y) / grad_accum
                loss.backward()
                loss_sum += loss.detach()
                data_state = batches.state()
                # Prefetch: on GPU the kernels queued above still run while the CPU slices the next batch.
                x, y = (t.to(d.device, non_blocking=True) for t in next(batches))
            # DDP leaves identical gradients on every rank, so every rank reaches the same verdict.
            if gradients_finite(model):
                opt.step()
                bad_in_a_row = 0
            else:
                st.nonfinite_steps += 1
                bad_in_a_row += 1
                log(f"step {step + 1:06d} | non-finite loss or gradients: update skipped "
                    f"({bad_in_a_row} in a row, {st.nonfinite_steps} in all)")
                if bad_in_a_row >= MAX_NONFINITE_IN_A_ROW:
                    log(f"error: {bad_in_a_row} non-finite steps in a row; stopping. The last good checkpoint is "
                        f"step {max(last_saved_step, 0):06d}; lower the learning rates or check the data")
                    return 1
            model.zero_grad(set_to_none=True)
            st.tokens_seen += tokens_per_step

            if (step + 1) % cfg.log_every_steps == 0:
                if d.world_size > 1:  # the logged loss is the mean over ranks, not rank 0's
                    dist.all_reduce(loss_sum)
                    loss_sum /= d.world_size
                train_loss = loss_sum.item()  # syncs the device; only on logging steps
            dt = time.time() - t0
            warm = step - (resume_step or 0) >= WARMUP_STEPS
            st.step_seconds = updated_step_seconds(st.step_seconds, dt, warm)
            if warm:
                measured_tokens += tokens_per_step
                measured_time += dt
            tok_s = tokens_per_step / dt
            if (step + 1) % cfg.log_every_steps == 0:
                mfu = flops_per_token * tok_s / (peak * d.world_size) if peak else None
                log_step(log, writer, step + 1, train_loss, opt.matrix_lr(), mult, dt, tok_s, mfu,
                         memory_gib(d.device), used() / 3600, cfg.training_hours)
            if not planned and measured_time > 0 and step - (resume_step or 0) >= 10:
                planned = True
                left = max(budget_seconds - st.used_seconds - reserve, 0)
                log(planner_line(measured_tokens / measured_time, left, step + 1, st.tokens_seen, tokens_per_step,
                                 cfg.training_hours, prepared.meta["split"]["train_tokens"], model.num_params()))

    writer.close()
    best = ckpt.read_best(run_dir) if d.master else None
    if best is not None:
        path = ckpt.model_path(run_dir, best["step"])
        spent = used()  # the final eval and save included
        log(f"done: step {st.step:06d}, {spent / 3600:.3f}h of {cfg.training_hours:.3f}h used "
            f"({spent:.1f}s of {budget_seconds:.1f}s) | "
            f"best checkpoint {path} (val_loss {best['val_loss']:.4f})")
        log(f"serve it: bash run.sh serve   (or: python -m experiment.server --checkpoint {path})")
    return 0


def main(argv=None) -> int:
    cfg = parse_args(argv)
    d = None
    try:
        try:
            cuda = resolve_device(cfg.device).type == "cuda"
        except ValueError as e:
            raise ConfigError(str(e)) from None
        d = setup_distributed(cuda)
        return train(cfg, d)
    except (ConfigError, DataError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        if d is not None and d.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
            d.store = None  # only now: the group's threads may use the store until they are gone


if __name__ == "__main__":
    code = main()
    # Leave without interpreter finalization: with gloo, about 1 exit in 20 aborted there ("terminate
    # called without an active exception", C++ threads torn down after Python; pytorch PR #179291)
    # and turned a finished run into a failed one. Everything we wrote is closed and flushed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
