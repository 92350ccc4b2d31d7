"""Train a depth-parameterized char GPT under a hard wall-clock budget.

    torchrun --standalone --nproc_per_node=N -m experiment.train [--flags]   (or python -m ...)

Raw DDP (nccl on CUDA, gloo on CPU or with DIST_BACKEND=gloo), ZeRO-1 optimizer shards
(experiment/optim.py), bf16 autocast on GPU, periodic eval summed over all ranks, best-val tracking,
atomic checkpoints, automatic resume.
The budget is wall-clock seconds of the training loop (evals and saves included), persisted across
restarts; the LR schedule is a function of the budget fraction used, so warmdown ends at the deadline
whatever the step speed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from experiment import autosize, extend, export, finetune, guards, launch
from experiment.guards import DISK_WRITE_GBPS
from experiment import checkpoint as ckpt
from experiment.checkpoint import CheckpointError, Retention, RunState, pick_resume_step
from experiment.config import ConfigError, TrainConfig, checkpoint_meta, fill_lrs, parse_args, resolve
from experiment.dataloader import DataError, Prepared, TokenBatches
from experiment.distributed import (PHASE_TIMEOUTS, Dist, ParentWatch, StopSignal, all_ranks_ok, broadcast_object,
                                    gather_objects, local_backend, resolve_device, setup_distributed,
                                    wrap_ddp)
from experiment.evaluation import eval_coverage, evaluate
from experiment.files import default_workspace, volume
from experiment.hardware import host_available_bytes, link_gbps, memory_gib
from experiment.memory import (checkpoint_bytes_per_rank, choose_memory_mode, find_device_batch, probe_reserve_bytes,
                               staged_bytes_per_rank)
from experiment.mixture import MixedBatches, source_weights
from experiment.model import DTYPES, GPT, GPTConfig, build_model
from experiment.optim import ShardedOptimizer, lr_multiplier, muon_momentum
from experiment.onexit import last_words
from experiment.report import NullReport, RunReport
from experiment.saver import HOST_STAGING_FRACTION, Saver
from experiment.runlog import (NullWriter, RunLog, log_crash, log_step, planner_line, report_eval, report_sample,
                               source_epoch_lines)
from experiment.step import forward_backward, optimizer_step

# The first steps after a (re)start hold torch.compile and allocator warm-up: tens of seconds on a
# GPU, not a step's cost. They stay out of the throughput figures and the end-of-run reserve.
WARMUP_STEPS = 3
MAX_NONFINITE_IN_A_ROW = 5  # then the run is diverging, not unlucky: stop rather than burn the budget


@dataclass
class Trainer:
    """What setup() builds once and the loop only uses."""
    cfg: TrainConfig
    d: Dist
    log: RunLog
    run_dir: Path
    prepared: Prepared
    model: GPT
    opt: ShardedOptimizer
    ddp: torch.nn.Module  # DDP-wrapped with more than one rank, else the model itself
    train_model: torch.nn.Module  # ddp, compiled when --compile is on
    batches: TokenBatches | MixedBatches
    weights: list[float] | None  # of the data's sources (DATA_MIX, else by size); None for one source
    writer: object  # a SummaryWriter on rank 0, else a NullWriter
    st: RunState  # the checkpointed state: step, tokens, budget used, best, measured durations
    resume_step: int | None
    rewind_step: int | None  # an extended run: the checkpoint whose weights it goes on from (extend.py)
    grad_accum: int
    budget_seconds: float
    run_meta: dict  # what every checkpoint's meta records of the run
    flops_per_token: float
    peak: float | None  # the GPU's dense bf16 FLOP/s, for MFU; None on CPU or an unknown GPU
    report: RunReport | NullReport  # metrics.jsonl, report.md and loss.svg on rank 0; a no-op elsewhere
    eval_prompt: list[int]  # the token ids every eval's sample continues
    lock: object  # rank 0: the run directory's trainer lock, held while this process lives; else None
    max_tokens: float  # MAX_EPOCHS passes over the training data: the run stops there; inf without a cap
    saver: Saver  # this rank's checkpoint writer (in the background when staging fits)
    first_save_seconds: float  # what a save is taken to cost until one is measured (checkpoint_seconds)
    eval_every_tokens: float  # EVAL_EVERY_EPOCHS passes over the training data; inf when off
    eval_coverage: tuple[int, int, bool]  # (tokens an eval predicts, tokens in the val split, all of it)

    @property
    def max_steps(self) -> int:
        return self.cfg.max_steps or sys.maxsize


@dataclass
class Loop:
    """What changes from step to step and is not checkpointed."""
    x: torch.Tensor  # the prefetched micro-batch
    y: torch.Tensor
    data_state: dict  # the data position before it, so a resume replays it
    started: float  # time.time() at the loop's start
    used_at_start: float  # budget seconds used by earlier runs of this model
    last_eval_time: float
    last_save_time: float
    last_eval_step: int
    last_eval_tokens: int  # tokens_seen at the latest eval: EVAL_EVERY_EPOCHS counts from there
    last_saved_step: int  # the latest save begun
    last_complete_step: int  # the latest save completed
    reserve_seconds: float = 0.0  # measured: the final eval + save + one step fit in what is left
    val_loss: float = math.nan
    # The best of the latest completed save, (val, step): what a failed best save falls back to (an
    # eval's own "before" could name a step whose background save is still in flight, then fails).
    saved_best: tuple = (math.inf, -1)
    progress: float = 0.0  # the fraction of the LR schedule done at the latest step (this rank's clock)
    split: int = 1  # the step's early-schedule phase, rank 0's (decide): sequences cut into this many
    halve: int = 0  # 1: the step's tokens in two updates of half the rows each
    measured_tokens: int = 0
    measured_time: float = 0.0
    planned: bool = False
    bad_in_a_row: int = 0
    phase: str = "setup"  # which of PHASE_TIMEOUTS the process group waits: setup until warmed up
    # The one way the loop stops (stop()): the exit code once the run must end. 0 (budget, max_steps,
    # the stop at the val minimum, a stop signal) ends it after this step's save; 1 (a failed final
    # save, a diverging run) ends it at once. `outcome` says why, for the report.
    end: int | None = None
    outcome: str = "running"

    def stop(self, code: int, outcome: str) -> None:
        self.end, self.outcome = code, outcome

    def enter(self, phase: str, d: Dist) -> None:
        if phase != self.phase:
            d.set_timeout(PHASE_TIMEOUTS[phase])
            self.phase = phase

    def used(self) -> float:
        """Budget seconds, summed over restarts."""
        return self.used_at_start + time.time() - self.started


# ---------------------------------------------------------------- setup


def prepare_data(cfg: TrainConfig, d: Dist, workspace: Path, run_dir: Path,
                 log: RunLog) -> tuple[Prepared, int | None, int | None, object]:
    """Rank 0 takes the run directory's trainer lock, opens the data and picks the resume step (and
    for settings that extend an annealed run, its newest checkpoint from before the warmdown: extend.py); a failure
    there reaches every rank. Under experiment/run.sh the data is the pre-flight's prepared
    directory (--prepared_dir), so no rank waits in this broadcast while another prepares; a bare
    torchrun prepares here. Returns (data, resume step, the step whose weights to load instead or None,
    the lock: rank 0's open file, else None)."""
    setup, lock = None, None
    if d.master:
        try:
            lock = launch.hold_trainer_lock(run_dir)
            prepared = launch.prepare_data(cfg, workspace, log)
            resume_step = pick_resume_step(run_dir, cfg.resume, log, quarantine=True)
            launch.fill_pass_cap(cfg, prepared, run_dir, resume_step, log)
            train_tokens = prepared.meta["split"]["train_tokens"]
            setup = {"prepared": str(prepared.dir), "resume_step": resume_step, "max_epochs": cfg.max_epochs,
                     "rewind_step": None if resume_step is None else extend.rewind_step(run_dir, resume_step, cfg,
                                                                                        train_tokens)}
        except (DataError, ConfigError, CheckpointError) as e:
            setup = {"error": str(e)}
    setup = broadcast_object(setup, d)
    if "error" in setup:
        raise ConfigError(setup["error"])
    cfg.max_epochs = setup["max_epochs"]  # rank 0's pass cap (launch.fill_pass_cap), on every rank
    return Prepared.load(setup["prepared"]), setup["resume_step"], setup["rewind_step"], lock


def build_model_and_optimizer(cfg: TrainConfig, d: Dist, model_config: GPTConfig, log: RunLog,
                              init: dict | None = None) -> tuple[GPT, ShardedOptimizer]:
    """In the precision and activation-checkpointing mode that fits (CUDA: the memory plan), and on
    CUDA without --device_batch_size the largest micro-batch that fits (sets cfg.device_batch_size).
    `init`: the weights to start from (INIT_FROM), else the seed's initialization."""
    plan = choose_memory_mode(model_config, cfg.device_batch_size or 1, cfg.precision, cfg.activation_checkpointing, d)
    precision = plan.precision if plan else ("fp32" if cfg.precision == "auto" else cfg.precision)
    activation_checkpointing = plan.activation_checkpointing if plan else cfg.activation_checkpointing == "on"
    model = build_model(model_config, d.device, DTYPES[precision], init, seed=cfg.seed,
                        activation_checkpointing=activation_checkpointing)  # identical on every rank
    opt = ShardedOptimizer(model, d.rank, d.world_size, matrix_lr=cfg.matrix_lr, embedding_lr=cfg.embedding_lr,
                           unembedding_lr=cfg.unembedding_lr, master_weights=precision == "bf16")
    gpu_gib = torch.cuda.get_device_properties(d.device).total_memory / 2**30 if plan else 0
    log(f"memory | weights {precision}" + (" with fp32 master shards" if precision == "bf16" else "")
        + f" | activation checkpointing {'on' if activation_checkpointing else 'off'}"
        + (f" | planned {plan.total / 2**30:.1f} GiB of {gpu_gib:.1f} GiB per GPU at device batch "
           f"{cfg.device_batch_size or 1}" if plan else ""))
    if cfg.device_batch_size is None:
        reserve_bytes = probe_reserve_bytes(plan) if plan else 0
        per_rank = cfg.total_batch_size // (cfg.max_seq_len * d.world_size)
        cfg.device_batch_size = find_device_batch(model, cfg.max_seq_len, per_rank, d, reserve_bytes)
        log(f"device_batch_size auto -> {cfg.device_batch_size}")
        # The probe's tries (up to out-of-memory) are no part of training: on an H100 the step line
        # showed 78.1 GiB at d12 for a step that needs a fraction of it.
        torch.cuda.reset_peak_memory_stats(d.device)
    return model, opt


def compiled(ddp: torch.nn.Module) -> torch.nn.Module:
    """The step's model under torch.compile with static shapes: the warmups' shorter sequences and half
    batches get graphs of their own, and the whole step's stays specialized (an automatic dynamic
    dimension would follow it for the rest of the run)."""
    return torch.compile(ddp, dynamic=False)


def setup(cfg: TrainConfig, d: Dist, workspace: Path, run_dir: Path, log: RunLog) -> Trainer:
    cuda = d.device.type == "cuda"
    gpu = guards.local_gpu(d.device) if cuda else None
    log(f"world {d.world_size} x {gpu.name if gpu else 'cpu'} | torch {torch.__version__}")
    prepared, resume_step, rewind_step, lock = prepare_data(cfg, d, workspace, run_dir, log)
    assert cfg.max_epochs is not None, "the pass cap is set with the data (launch.fill_pass_cap)"
    auto, probe_seconds = (choose_depth(cfg, d, gpu, prepared, run_dir, resume_step, log) if cfg.depth == "auto"
                           else (None, 0))
    fill_lrs(cfg, cuda)
    model_config = launch.model_config(cfg, prepared)
    if resume_step is not None:
        launch.check_resume_target(run_dir, resume_step, model_config, prepared)
    torch.manual_seed(cfg.seed)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls outside autocast
    model, opt, st = start_state(cfg, d, run_dir, model_config, prepared, resume_step, rewind_step, probe_seconds,
                                 log)
    if d.master:  # files of a save that a crash cut short; the loaded step is complete, so never these
        ckpt.remove_incomplete(run_dir)
        launch.clear_ended(run_dir)
        if resume_step is not None:
            repair_best(run_dir, st, log)
    weights = source_weights(prepared.meta, cfg.data_mix)
    ddp = wrap_ddp(model, d)
    use_compile = cfg.compile == "on" or (cfg.compile == "auto" and cuda)
    torch._dynamo.config.optimize_ddp = bool(cfg.ddp_graph_split)  # read when the compiled DDP step is traced
    writer = NullWriter()
    if d.master:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=str(workspace / "tensorboard" / cfg.model_tag))
    budget_seconds = cfg.training_hours * 3600
    coverage = eval_coverage(prepared, cfg.eval_tokens, cfg.max_seq_len, weights)
    grad_accum = cfg.total_batch_size // (cfg.device_batch_size * cfg.max_seq_len * d.world_size)
    t = Trainer(
        cfg=cfg, d=d, log=log, run_dir=run_dir, prepared=prepared, model=model, opt=opt, ddp=ddp,
        train_model=compiled(ddp) if use_compile else ddp,
        batches=make_batches(cfg, d, prepared, weights, st.data_state, log), weights=weights, writer=writer, st=st,
        resume_step=resume_step, rewind_step=rewind_step,
        grad_accum=grad_accum,
        budget_seconds=budget_seconds, run_meta=checkpoint_meta(cfg, prepared, budget_seconds, auto),
        flops_per_token=model.estimate_flops(cfg.max_seq_len),
        peak=gpu.peak if gpu else None,
        report=RunReport(run_dir, report_facts(cfg, d, model, prepared, budget_seconds, grad_accum, auto, coverage),
                         resume_step, log)
        if d.master else NullReport(),
        eval_prompt=launch.eval_prompt_ids(cfg, prepared), lock=lock,
        max_tokens=cfg.max_epochs * prepared.meta["split"]["train_tokens"] if cfg.max_epochs else math.inf,
        saver=make_saver(cfg, d, model, run_dir, log), first_save_seconds=checkpoint_seconds(model, d.world_size),
        eval_every_tokens=cfg.eval_every_epochs * prepared.meta["split"]["train_tokens"] or math.inf,
        eval_coverage=coverage)
    log(f"model {model.num_params():,} params (d{cfg.depth}, width {model_config.n_embd}, "
        f"{model_config.n_head} heads) | {t.flops_per_token:.3e} FLOP/token | batch {cfg.device_batch_size} x "
        f"{cfg.max_seq_len} x {d.world_size} ranks x {t.grad_accum} accum = {cfg.total_batch_size:,} tokens/step | "
        f"budget {cfg.training_hours:.3f}h | tensorboard {workspace / 'tensorboard' / cfg.model_tag}")
    return t


def start_state(cfg: TrainConfig, d: Dist, run_dir: Path, model_config: GPTConfig, prepared: Prepared,
                resume_step: int | None, rewind_step: int | None, probe_seconds: float,
                log: RunLog) -> tuple[GPT, ShardedOptimizer, RunState]:
    """The model, optimizer and run state the loop starts from: fresh (from INIT_FROM's weights when
    set), a resumed step, or for an extended run the checkpoint from before its warmdown with the
    resumed step's counters (extend.py)."""
    init = None
    if cfg.init_from and resume_step is None:  # a fresh run from a trained model's weights
        finetune.check_target(cfg, model_config)
        init, line = finetune.weights(cfg)
        log(line)
    model, opt = build_model_and_optimizer(cfg, d, model_config, log, init)
    if resume_step is None:
        return model, opt, RunState(used_seconds=probe_seconds)  # DEPTH=auto's probe is part of the budget
    load = resume_step if rewind_step is None else rewind_step
    st = restore_checkpoint(run_dir, load, model, opt, d)
    if rewind_step is not None:
        st = extend.rewound(st, ckpt.run_state(ckpt.read_meta(run_dir, resume_step)))
        log(extend.rewind_line(rewind_step, resume_step, st, prepared.meta["split"]["train_tokens"]))
    log(f"resumed from {ckpt.model_path(run_dir, load)}: step {st.step}, {st.used_seconds / 3600:.3f}h used, "
        f"best {st.best_val:.4f} @ {st.best_step:06d}")
    return model, opt, st


def make_saver(cfg: TrainConfig, d: Dist, model: GPT, run_dir: Path, log: RunLog) -> Saver:
    """Saves in the background when ASYNC_SAVE=1 and the node's host memory holds every local rank's
    staged share within HOST_STAGING_FRACTION of what is available (on every node), else blocking.
    On CUDA the share is counted as the pinned allocator takes it (memory.staged_bytes_per_rank)."""
    precision = "bf16" if model.wte.weight.dtype == torch.bfloat16 else "fp32"
    share = staged_bytes_per_rank(model.config, d.world_size, precision, pinned=d.device.type == "cuda")[d.rank]
    need, available = share * d.local_world_size, host_available_bytes()
    background = bool(cfg.async_save) and all_ranks_ok(need <= HOST_STAGING_FRACTION * available, d)
    if background:
        log(f"checkpoint | saves write in the background: {share / 1e9:.2f} GB per rank staged in host memory "
            f"({need / 1e9:.2f} GB of {available / 1e9:.1f} GB available on this node)")
    elif cfg.async_save:
        log(f"warning: this node's ranks would stage {need / 1e9:.1f} GB of checkpoint in host memory, more than "
            f"{HOST_STAGING_FRACTION:g} x the {available / 1e9:.1f} GB available: every save blocks training")
    else:
        log("checkpoint | saves block training (ASYNC_SAVE=0)")
    return Saver(run_dir, d.rank, d.world_size, d.device, background, all_ok=lambda ok: all_ranks_ok(ok, d),
                 gather=lambda files: gather_objects(files, d), write_bps=cfg.save_write_mbps * 1e6)


def report_facts(cfg: TrainConfig, d: Dist, model: GPT, prepared: Prepared, budget_seconds: float, accum: int,
                 auto: dict | None, coverage: tuple[int, int, bool]) -> dict:
    """What the run report says the run is: fixed at setup."""
    c, meta = model.config, prepared.meta
    device = torch.cuda.get_device_name(d.device) if d.device.type == "cuda" else "cpu"
    return {
        "model_tag": cfg.model_tag, "params": model.num_params(), "budget_seconds": budget_seconds,
        "train_tokens": meta["split"]["train_tokens"], "config": dataclasses.asdict(cfg),
        "model": f"d{c.depth}, width {c.n_embd}, {c.n_head} heads, context {c.max_seq_len}",
        "device": f"{d.world_size} x {device}",
        "batch": f"{cfg.total_batch_size:,} tokens/step = {cfg.device_batch_size} x {cfg.max_seq_len} x "
                 f"{d.world_size} ranks x {accum} accumulated",
        "data": f"{meta['split']['train_tokens']:,} train and {meta['split']['val_tokens']:,} val tokens "
                f"({meta['tokenizer']} tokenizer, vocabulary {meta['vocab_used']}) in {prepared.dir}",
        "best_file": "model_{step:06d}.pt" if d.world_size == 1 else f"model_{{step:06d}}_rank0..{d.world_size - 1}.pt",
        "auto": (auto or {}).get("reason"),
        "eval": f"{eval_sample_text(coverage)}, every {cfg.eval_every_minutes:g} min"
                + (f" or {cfg.eval_every_epochs:g} passes" if cfg.eval_every_epochs else "")
                + (f"; stop at the val minimum: {cfg.plateau_evals} evals without a gain of {cfg.plateau_margin:.1%} "
                   f"at the peak LR start the warmdown, {cfg.plateau_evals} evals in a warmdown without a new low of "
                   f"the mean of the last {WARMDOWN_WINDOW} val losses end the run" if cfg.plateau_evals
                   else "; no stop at the val minimum (PLATEAU_EVALS=0)"),
    }


def eval_sample_text(coverage: tuple[int, int, bool]) -> str:
    read, total, whole = coverage
    if whole:
        return f"{read:,} of the {total:,} val tokens (the whole split, in whole windows)"
    return f"{read:,} of the {total:,} val tokens ({read / total:.0%}, windows at even strides over the split)"


def restore_checkpoint(run_dir: Path, step: int, model: GPT, opt: ShardedOptimizer, d: Dist) -> RunState:
    """Model, this rank's optimizer state (from whichever shards hold its parameters: any world size)
    and RNG from a complete step; returns its run state."""
    model_state, shards, meta = ckpt.load_checkpoint(run_dir, step)
    model.load_state_dict(model_state)
    opt.load_shards(shards)
    own = shards[d.rank] if d.rank < len(shards) else shards[0]
    torch.set_rng_state(own["rng"]["cpu"])
    if d.device.type == "cuda" and "cuda" in own["rng"]:
        torch.cuda.set_rng_state(own["rng"]["cuda"], d.device)
    return ckpt.run_state(meta)


def write_checkpoint(run_dir: Path, model: GPT, opt: ShardedOptimizer, st: RunState, val_loss: float | None,
                     run_meta: dict, d: Dist) -> str | None:
    """The step saved here and now (ckpt.save_checkpoint); None when the step is complete, else why
    not (on every rank alike). The loop saves through its Saver instead (maybe_save)."""
    return ckpt.save_checkpoint(run_dir, st.step, *checkpoint_share(model, opt, st, val_loss, run_meta, d), d.rank,
                                d.world_size, all_ok=lambda ok: all_ranks_ok(ok, d),
                                gather=lambda files: gather_objects(files, d))


def checkpoint_share(model: GPT, opt: ShardedOptimizer, st: RunState, val_loss: float | None, run_meta: dict,
                     d: Dist) -> tuple[dict, dict, dict]:
    """This rank's share of the step as plain data: (its model part, its optimizer shard with the RNG
    states, the step's meta). The tensors are the live ones (a collective: every rank's data position)."""
    state = ckpt.strip_compile_prefix(model.state_dict())
    rng = {"cpu": torch.get_rng_state()}
    if d.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(d.device)
    meta = {
        "step": st.step, "val_loss": val_loss, "state": dataclasses.asdict(st),
        "data_positions": gather_objects(st.data_state, d), "world_size": d.world_size,
        "model_parts": d.world_size,  # model_<step>.pt alone, or one model_<step>_rank<r>.pt per rank
        "model_config": model.config.to_dict(), "weights_dtype": str(model.wte.weight.dtype).removeprefix("torch."),
        "activation_checkpointing": model.activation_checkpointing, **run_meta, "saved_at": time.time(),
    }
    mine = state if d.world_size == 1 else ckpt.model_part(state, opt.owner, d.rank)
    return mine, {**opt.shard_state(), "rng": rng}, meta


def choose_depth(cfg: TrainConfig, d: Dist, gpu: guards.Gpu | None, prepared: Prepared, run_dir: Path,
                 resume_step: int | None, log: RunLog) -> tuple[dict, float]:
    """DEPTH=auto: sets cfg.depth. A resume keeps its checkpoint's depth. A fresh run on a GPU whose
    peak is known predicts each depth's tok/s (autosize.predict_and_choose: no compile per depth);
    otherwise every rank measures the ladder at once (so each sees the load training will put on the
    machine). Rank 0's choice is taken. Returns (what the checkpoint meta records, seconds the
    choice took)."""
    if resume_step is not None:
        meta = ckpt.read_meta(run_dir, resume_step)
        cfg.depth, auto = meta["model_config"]["depth"], meta.get("auto") or {}
        log(f"auto: d{cfg.depth} kept from the checkpoint ({auto.get('reason', 'no reason recorded')})")
        return auto, 0.0
    t0 = time.time()
    make_config, train_tokens = launch.make_config(cfg, prepared), prepared.meta["split"]["train_tokens"]
    predicted = gpu is not None and gpu.peak is not None
    if predicted:
        chosen, candidates = autosize.predict_and_choose(make_config, gpu.peak, d.world_size, gpu.memory_bytes,
                                                         cfg.training_hours * 3600, train_tokens, link_gbps(gpu.name),
                                                         gpu.name, cfg.total_batch_size)
    else:
        chosen, candidates = autosize.probe_and_choose(make_config, cfg.device_batch_size or 1, d.device,
                                                       d.world_size, cfg.training_hours * 3600, train_tokens,
                                                       cfg.total_batch_size)
    how = "predicted" if predicted else "measured"
    auto = broadcast_object({"depth": chosen.depth, "reason": autosize.reason(chosen, candidates, how), "how": how,
                             "candidates": [dataclasses.asdict(c) for c in candidates]}, d)
    cfg.depth = auto["depth"]
    log(f"{auto['reason']} | took {time.time() - t0:.1f}s, counted in the budget")
    return auto, time.time() - t0


def make_batches(cfg: TrainConfig, d: Dist, prepared: Prepared, weights: list[float] | None, state: dict | None,
                 log: RunLog) -> TokenBatches | MixedBatches:
    """With DATA_MIX over several sources, windows drawn by weight, each inside one source; else the
    whole training stream's windows in a per-epoch permutation (sources weighted by size)."""
    mixed = bool(cfg.data_mix) and weights is not None
    if state is not None and ("positions" in state) != mixed:  # DATA_MIX set or unset since the checkpoint
        log("data | DATA_MIX changed since the checkpoint: the data order starts afresh")
        state = None
    if not mixed:
        return TokenBatches(prepared.tokens("train"), cfg.max_seq_len, cfg.device_batch_size, d.rank, d.world_size,
                            cfg.seed, state)
    ranges = [tuple(s["train"]) for s in prepared.meta["source_splits"]]
    log("data | mixture " + ", ".join(f"{s['name']} {w:.3f}" for s, w in zip(prepared.meta["source_splits"], weights)))
    return MixedBatches(prepared.tokens("train"), ranges, weights, cfg.max_seq_len, cfg.device_batch_size, d.rank,
                        d.world_size, cfg.seed, state)


def start_loop(t: Trainer) -> Loop:
    data_state = t.batches.state()  # the position before the prefetched batch: a resume replays it
    x, y = (v.to(t.d.device, non_blocking=True) for v in next(t.batches))
    first = t.st.step if t.resume_step is not None else -1
    now = time.time()
    return Loop(x=x, y=y, data_state=data_state, started=now, used_at_start=t.st.used_seconds, last_eval_time=now,
                last_save_time=now, last_eval_step=first, last_eval_tokens=t.st.tokens_seen, last_saved_step=first,
                # An extended run's weights are the rewound step's, not those saved as step `first`.
                last_complete_step=first if t.rewind_step is None else t.rewind_step,
                saved_best=(t.st.best_val, t.st.best_step))  # a resume's best: its checkpoint is complete


# ---------------------------------------------------------------- the loop


def run(cfg: TrainConfig, d: Dist, workspace: Path, run_dir: Path, log: RunLog) -> int:
    t = setup(cfg, d, workspace, run_dir, log)
    try:
        return train_loop(t)
    finally:
        if t.lock is not None:  # a later run in this process (the tests) takes it again
            t.lock.close()


def train_loop(t: Trainer) -> int:
    d, log = t.d, t.log
    loop = start_loop(t)
    with StopSignal(announce=d.master, grace=lambda: stop_grace(t)) as stop_signal:
        for step in range(t.st.step, t.max_steps + 1):
            t.st.step, t.st.used_seconds = step, loop.used()
            # The final eval, save and step (the LR schedule ends where they begin)
            loop.reserve_seconds = t.st.eval_seconds + save_seconds(t) + t.st.step_seconds
            last_step, eval_due, save_due, signum, writing, warmdown, loop.split, loop.halve = decide(
                t, loop, stop_signal.signum, t.saver.writing())
            if t.saver.pending is not None and not writing:  # every rank's writer is done
                finish_save(t, loop)
            if last_step:
                loop.stop(0, last_outcome(t))
            if signum:  # preempted: save what we have now; an eval would spend the grace period
                name = signal.Signals(signum).name
                loop.stop(0, f"stopped: {name} at step {step}; the same command resumes it")
                log(f"received {name}: " + (f"completing step {t.saver.pending.step:06d}'s save, in flight, and exiting"
                                             if writing else f"saving step {step:06d} and exiting"))
            elif (eval_due or save_due or last_step) and step != loop.last_eval_step:
                maybe_eval(t, loop)
            maybe_save(t, loop, save_due, preempted=bool(signum), writing=bool(writing))
            if not t.st.warmdown_begun and (warmdown or t.st.anneal_start_tokens == t.st.tokens_seen) and not signum:
                # The LR warmdown begins with this step's update: an extended run goes back to the newest
                # checkpoint from before it (this step's own, once complete: finish_save).
                t.st.warmdown_begun, t.st.warmdown_step = True, loop.last_complete_step
            if loop.end is not None:
                break
            t0 = time.time()
            loss_sum, mult = train_step(t, loop)
            if loop.end is not None:
                break
            record_step(t, loop, loss_sum, mult, t0)
    if t.saver.pending is not None:  # the loop broke off (a diverging run) with a save in flight
        finish_save(t, loop, wait=True)
    if not loop.end:  # None: a resume at or past max_steps had no step left to run
        finish(t, loop)
    outcome = loop.outcome if loop.end is not None else "finished: no step was left to run"
    t.report.add({"kind": "end", "step": t.st.step, "outcome": outcome, "code": loop.end or 0, "time": time.time()})
    t.report.write(t.st, outcome)
    if loop.end == 1:  # the trainer's own decision (a failed final save, a diverging loss): a restart repeats it
        launch.end_launch(t.run_dir)
    return loop.end or 0


# After a stop signal, a rank that has not exited within the step, the save and this margin hangs
# (a collective with a dead peer, a device sync): it exits at once (StopSignal's grace timer).
STOP_MARGIN_SECONDS = 60.0


def stop_grace(t: Trainer) -> float:
    """Seconds a stopping rank gets: twice its step and its longest save plus a margin."""
    return STOP_MARGIN_SECONDS + 2 * (t.st.step_seconds + save_seconds(t))


def checkpoint_seconds(model: GPT, world_size: int) -> float:
    """A save before one has been measured: the whole checkpoint at the network volume's rate the
    plan assumes (every rank writes its share at once, into one volume)."""
    precision = "bf16" if model.wte.weight.dtype == torch.bfloat16 else "fp32"
    total = sum(a + b for a, b in checkpoint_bytes_per_rank(model.config, world_size, precision))
    return total / (DISK_WRITE_GBPS * 1e9)


def save_seconds(t: Trainer) -> float:
    """What a save takes: the longest measured so far (background writes included, which share the
    machine with training and so run long: the final save's reserve errs on the safe side), else
    the estimate, so a budget that ends before the first save still keeps room for it."""
    return t.st.save_seconds or t.first_save_seconds


def decide(t: Trainer, loop: Loop, signum: int, writing: bool = False) -> tuple[int, ...]:
    """(last step, eval due, save due, signal, a rank still writing a save, the schedule's warmdown
    begins at this step, the step's context split, its halved batch: 0 or 1). Rank 0 decides the
    clock-driven flags; a stop signal may reach any rank, and so may a writer still at work. One
    all-reduce (max) gives every rank the same decisions, so none is left waiting in a collective."""
    cfg, d, st, step = t.cfg, t.d, t.st, t.st.step
    eval_due = (time.time() - loop.last_eval_time >= cfg.eval_every_minutes * 60
                or (cfg.eval_every_steps > 0 and step % cfg.eval_every_steps == 0) or step == 0
                or st.tokens_seen - loop.last_eval_tokens >= t.eval_every_tokens)
    save_due = (time.time() - loop.last_save_time >= cfg.save_every_minutes * 60
                or (cfg.save_every_steps > 0 and step % cfg.save_every_steps == 0 and step > 0))
    # An eval (and the save a new best brings) or a save due now is paid for on top of the reserve
    # for the final ones: when both no longer fit, this step is the last, and its eval the final one.
    save = save_seconds(t)
    due_now = (st.eval_seconds + save) * eval_due + save * (save_due and not eval_due)
    # What a save in flight still needs: the final save waits for it. Not in the schedule's reserve,
    # which would dip the LR during every background write.
    in_flight = t.saver.seconds_left(save)
    last = (step >= t.max_steps or st.tokens_seen >= t.max_tokens or stopped_at_minimum(t)
            or st.used_seconds + loop.reserve_seconds + in_flight + due_now >= t.budget_seconds)
    progress = schedule_progress(t, loop)
    warmdown = not st.warmdown_begun and progress > 1 - cfg.warmdown_frac and not last
    # The phase decides how many updates (and collectives) the step makes: every rank takes rank 0's.
    split, halve = warmup_phase(cfg, st, progress) if d.master else (0, 0)
    flags = torch.tensor([d.master and last, d.master and eval_due, d.master and save_due, signum, writing,
                          d.master and warmdown, split, halve], dtype=torch.int32, device=d.device)
    return tuple(int(v) for v in d.all_reduce(flags, "max").tolist())


def warmup_phase(cfg: TrainConfig, st: RunState, progress: float) -> tuple[int, int]:
    """(the context split, halved batch: 0 or 1) of the early-schedule warmups at this step. They follow
    the furthest schedule progress reached (st.warmup_progress: an extension does not return to them)
    and end when a warmdown begins: the val minimum's anneal trains whole sequences and batches."""
    # From the step after an anneal begins: the step that began it (its eval came after this
    # decision) trained in the warmups, and so does its resume, whose checkpoint records the anneal.
    if st.warmdown_begun or 0 <= st.anneal_start_tokens < st.tokens_seen:
        return 1, 0
    st.warmup_progress = max(st.warmup_progress, progress)
    return context_split(st.warmup_progress, cfg.seq_warmup_frac), int(st.warmup_progress < cfg.batch_warmup_frac)


def stopped_at_minimum(t: Trainer) -> bool:
    """The stop at the val minimum ended the run: a warmdown stopped gaining, or the one it started
    is done. PLATEAU_EVALS=0 on a resume overrules it: the run goes back to its checkpoint from before
    the warmdown and trains on (extend.py)."""
    st = t.st
    return bool(t.cfg.plateau_evals) and (st.plateau_stopped or st.anneal_start_tokens >= 0
                                          and st.tokens_seen >= st.anneal_start_tokens + st.anneal_tokens)


def last_outcome(t: Trainer) -> str:
    if t.st.step >= t.max_steps:
        return "finished: max_steps reached"
    if stopped_at_minimum(t):
        return plateau_outcome(t, t.st.used_seconds)
    if t.st.tokens_seen >= t.max_tokens:
        return f"finished: {t.cfg.max_epochs:g} passes over the training data (MAX_EPOCHS), before the budget"
    return "finished: the budget is spent"


def maybe_eval(t: Trainer, loop: Loop) -> None:
    """Eval over all ranks, best tracking, the eval report and the stop at the val minimum
    (plateau_check; every rank saw the same reduced val loss, so all agree)."""
    cfg, st, step = t.cfg, t.st, t.st.step
    t0 = time.time()
    loop.val_loss, val_bpc, by_source = evaluate(t.model, t.prepared, cfg.max_seq_len, cfg.device_batch_size,
                                                 cfg.eval_tokens, t.d, t.weights)
    loop.last_eval_step, loop.last_eval_time, loop.last_eval_tokens = step, time.time(), st.tokens_seen
    new_best = step > 0 and loop.val_loss < st.best_val
    if new_best:
        st.best_val, st.best_step = loop.val_loss, step
    t.report.add(report_eval(step, loop.val_loss, val_bpc, by_source, st, t.eval_coverage, t.log, t.writer))
    if t.d.master and cfg.sample_tokens > 0:
        report_sample(step, t.model, t.prepared, t.eval_prompt, cfg.sample_tokens, t.log, t.writer, t.report)
    t.report.write(st, "running")
    if step > 0 and cfg.plateau_evals and loop.end is None:  # the final eval decides nothing
        plateau_check(t, loop)
    st.eval_seconds = max(st.eval_seconds, time.time() - t0)


# The stop at the val minimum in a warmdown compares the mean of the last two val losses: chosen on
# the recorded curves (reports/plateau-curves.md and the code run in docs/performance.md) as the
# shortest window that kept a noisy code run (d4, 150,000 characters) annealing to its best while the
# overfitting Shakespeare runs still stopped within 4-5 evals of their minimum.
WARMDOWN_WINDOW = 2


def plateau_check(t: Trainer, loop: Loop) -> None:
    """The stop at the val minimum, on evals after step 0: at the LR's peak, PLATEAU_EVALS evals in a
    row without a gain (plateau_gain) start the warmdown at once (start_anneal), and the run ends
    with it; in a warmdown (the schedule's or that one), PLATEAU_EVALS without a gain end the run at
    once: the repetition of the data now outweighs the anneal, and the best step is saved already.
    docs/training.md, "The stop at the val minimum"."""
    cfg, st = t.cfg, t.st
    # Rank 0's word on whether a warmdown has begun (the schedule's follows each rank's clock); once
    # begun it stays begun, though the budget's fraction can dip when the measured reserve shrinks.
    in_warmdown = st.warmdown_seen or st.anneal_start_tokens >= 0 or loop.progress > 1 - cfg.warmdown_frac
    flag = torch.tensor([int(t.d.master and in_warmdown)], dtype=torch.int32, device=t.d.device)
    in_warmdown = bool(t.d.all_reduce(flag, "max").item())
    if in_warmdown and not st.warmdown_seen:  # a count from the peak LR does not carry over
        begin_warmdown_count(st)
    gained = plateau_gain(cfg, st, loop.val_loss, in_warmdown)
    if gained is None or gained:
        return
    st.evals_without_gain += 1
    if st.evals_without_gain < cfg.plateau_evals:
        return
    passes = st.tokens_seen / t.prepared.meta["split"]["train_tokens"]
    best = f"best {st.best_val:.4f} at step {st.best_step}"
    if not in_warmdown:
        start_anneal(t, passes, best)
        return
    st.plateau_stopped = True
    t.log(f"plateau | the mean of the last {WARMDOWN_WINDOW} val losses has not gone below its lowest in this "
          f"warmdown for {st.evals_without_gain} evals ({best}): stopping at {passes:.2f} passes")
    loop.stop(0, plateau_outcome(t, loop.used()))


def plateau_gain(cfg: TrainConfig, st: RunState, val_loss: float, in_warmdown: bool) -> bool | None:
    """Whether this eval gains (and if so it becomes the reference, the count starts again); None while
    a warmdown's window fills. At the LR's peak: its val loss is PLATEAU_MARGIN (a fraction) below the
    last gaining one's, so a slow creep adds up to a gain. In a warmdown: the mean of its last
    WARMDOWN_WINDOW val losses is below the lowest such mean in it. The annealing LR moves the val
    loss to a level of its own, which a best from the peak LR does not measure, and on a noisy val
    set (2% from eval to eval on code) one lucky eval must not become the bar; an extended run's
    warmdown is so held to its own evals too."""
    if in_warmdown:
        st.warmdown_window = (st.warmdown_window + [val_loss])[-WARMDOWN_WINDOW:]
        if len(st.warmdown_window) < WARMDOWN_WINDOW:
            return None
        level = sum(st.warmdown_window) / WARMDOWN_WINDOW
        gained = level < st.plateau_ref
    else:
        level = val_loss
        gained = level < st.plateau_ref * (1 - cfg.plateau_margin)
    if gained:
        st.plateau_ref, st.evals_without_gain = level, 0
    return gained


def start_anneal(t: Trainer, passes: float, best: str) -> None:
    """The warmdown the val minimum starts: as long as the schedule's would be for a run planned to
    end here (warmdown_frac / (1 - warmdown_frac) of the tokens so far); the run ends with it."""
    cfg, st = t.cfg, t.st
    wd = cfg.warmdown_frac
    st.anneal_start_tokens = st.tokens_seen
    st.anneal_tokens = max(cfg.total_batch_size, round(st.tokens_seen * wd / max(1 - wd, 1e-9)))
    begin_warmdown_count(st)  # the warmdown gets its own evals
    end = (st.tokens_seen + st.anneal_tokens) / t.prepared.meta["split"]["train_tokens"]
    t.log(f"plateau | no gain of {cfg.plateau_margin:.1%} in {cfg.plateau_evals} evals ({best}): the LR warmdown "
          f"starts now at {passes:.2f} passes and the run ends with it at {end:.2f} passes (PLATEAU_EVALS=0 trains "
          "to the budget)")


def begin_warmdown_count(st: RunState) -> None:
    st.warmdown_seen, st.evals_without_gain, st.plateau_ref, st.warmdown_window = True, 0, math.inf, []


def plateau_outcome(t: Trainer, used: float) -> str:
    """Why a run that the stop at the val minimum ended stopped, and the budget it left."""
    st, left = t.st, unspent_text(t, max(t.budget_seconds - used, 0))
    if st.plateau_stopped:
        return (f"finished: the val loss stopped improving during the warmdown (best {st.best_val:.4f} at step "
                f"{st.best_step}); {left} of the budget unspent")
    passes = st.anneal_start_tokens / t.prepared.meta["split"]["train_tokens"]
    return (f"finished: the val loss stopped improving at {passes:.2f} passes and the warmdown started there is "
            f"done; {left} of the budget unspent")


def maybe_save(t: Trainer, loop: Loop, save_due: bool, preempted: bool, writing: bool = False) -> None:
    """A checkpoint when one is due, at the last step or at a new best: staged and written in the
    background (Saver), completed at a later step once every rank's writer is done. A save in
    flight is completed first (one at a time: when `writing`, some rank's writer was still at work
    at this step's start, and the wait is logged and counted); the final save is written here and
    completed before the run ends, and when it fails the run ends with 1."""
    st, step, final = t.st, t.st.step, loop.end is not None
    # No periodic save during a streak of skipped updates: retention must not push the last
    # checkpoint from before the streak out. (Skipped updates leave the weights valid, so the final
    # save still happens, and so does a new best's: best.json must name a step that exists.)
    if not ((save_due or final or st.best_step == step) and step != loop.last_saved_step
            and (final or st.best_step == step or not loop.bad_in_a_row)):
        return
    if t.saver.pending is not None:
        before, t0 = t.saver.pending.step, time.time()
        finish_save(t, loop, wait=True)
        waited = time.time() - t0
        if preempted and loop.last_complete_step == before:
            # A stop signal during a write: that save, complete now, is the one the run stops on. A second
            # would spend another whole write of the grace period; the steps since it are trained again.
            t.log(f"save | stopping on step {before:06d}'s checkpoint, whose write was in flight at the signal "
                  f"(waited {waited:.1f}s); a resume trains the {step - before} steps since it again")
            loop.outcome = loop.outcome.replace(f"at step {step};", f"at step {step}, on step {before}'s checkpoint;")
            return
        if preempted:
            t.log(f"save | saving step {step:06d} instead")
        if final and not preempted:
            t.log(f"save | the final save waited {waited:.1f}s for step {before:06d}'s write to finish")
        elif writing:
            st.save_waits, st.save_wait_seconds = st.save_waits + 1, st.save_wait_seconds + waited
            t.log(f"save | step {step:06d} waited {waited:.1f}s for step {before:06d}'s write to finish "
                  f"({st.save_waits} waits, {st.save_wait_seconds:.1f}s in all: saves come due faster than one "
                  "writes; a longer SAVE_EVERY_MINUTES avoids it)")
    st.used_seconds, st.data_state = loop.used(), loop.data_state
    share = checkpoint_share(t.model, t.opt, st, None if preempted else loop.val_loss, t.run_meta, t.d)
    t.saver.begin(step, *share, background=not final,
                  context={"final": final})
    loop.last_saved_step, loop.last_save_time = step, time.time()  # a failed save is retried when due again
    if not t.saver.pending.background:  # written already (the final save, or staging is off): on every rank
        finish_save(t, loop, wait=True)


def finish_save(t: Trainer, loop: Loop, wait: bool = False) -> None:
    """Complete the pending save on every rank (collectives), once every rank's writer is done:
    `wait` joins this rank's writer first. Logs it, prunes, and on failure keeps best.json naming
    a step that exists."""
    st = t.st
    phase, t0 = loop.phase, time.time()
    loop.enter("save", t.d)  # ranks may wait here for the slowest writer
    if wait:
        t.saver.wait()
    p, error = t.saver.complete()
    loop.enter(phase, t.d)
    blocked = p.staged_seconds + time.time() - t0 if p.background else time.time() - p.started
    st.save_seconds = max(st.save_seconds, p.write_seconds)
    t.report.add({"kind": "save", "step": p.step, "seconds": round(p.write_seconds, 3), "blocked": round(blocked, 3),
                  "ok": error is None})
    if error is None:
        loop.last_complete_step = p.step
        loop.saved_best = (p.meta["state"]["best_val"], p.meta["state"]["best_step"])
        if st.warmdown_begun and not p.meta["state"]["warmdown_begun"]:
            st.warmdown_step = p.step  # begun before the warmdown, completed in it: the newest from before it
        if t.d.master:
            retention = Retention(t.cfg.keep_last, bool(t.cfg.keep_best_optimizer),
                                  st.warmdown_step if st.warmdown_begun else -1)
            t.log(f"saved step {p.step:06d} -> {t.run_dir}" + (" (best)" if p.meta["state"]["best_step"] == p.step else "")
                  + f" | written in {p.write_seconds:.1f}s, training blocked {blocked:.2f}s"
                  + ckpt.retain(t.run_dir, retention, t.log))
        return
    if p.context["final"]:
        t.log(f"error: the final checkpoint, step {p.step:06d}, could not be written to {t.run_dir} ({error}); "
              f"{volume_text(t.run_dir)}; the latest complete checkpoint is "
              + (f"step {loop.last_complete_step:06d}" if loop.last_complete_step >= 0 else "none")
              + ": the same command resumes from it once the volume has room")
        loop.stop(1, f"failed: the final checkpoint, step {p.step:06d}, could not be written (training.log says why)")
        return
    stopping = loop.end is not None  # a preemption's save in flight failed: the step it found is saved next
    t.log(f"error: checkpoint step {p.step:06d} not saved ({error}); earlier checkpoints are kept"
          + ("" if stopping else ", training goes on"))
    if t.saver.block_from_now_on() and not stopping:
        t.log("save | every later save blocks training: a save failed, and the host memory staged for saves "
              "is given back")
    if st.best_step == p.step:  # best.json must name a checkpoint that exists; evals stay counted
        st.best_val, st.best_step = loop.saved_best
        if p.step < loop.last_eval_step == st.step and loop.val_loss < st.best_val:
            # this step's eval (made while that earlier write was in flight) beats the best that
            # stands: its save, begun next, makes it the best
            st.best_val, st.best_step = loop.val_loss, st.step


def volume_text(run_dir: Path) -> str:
    try:
        mount, free = volume(run_dir)
    except OSError as e:
        return f"its volume cannot be read ({e})"
    return f"the volume {mount} has {free / 1e6:,.1f} MB free"


def repair_best(run_dir: Path, st: RunState, log: RunLog) -> None:
    """Rank 0 on a resume: best.json names the best step the resumed checkpoint records (a kill
    between a step's meta and its best.json leaves it naming an older one)."""
    try:
        if ckpt.repair_best(run_dir, st.best_val, st.best_step):
            log(f"best.json names step {st.best_step:06d} again, the best its checkpoint records")
    except (OSError, CheckpointError) as e:  # the old best.json stands (rank 0 alone must not leave here)
        log(f"warning: best.json could not be rewritten to name step {st.best_step:06d} ({e})")


def train_step(t: Trainer, loop: Loop) -> tuple[torch.Tensor, float]:
    """One step: grad_accum micro-batches, the gradient all-reduce on the last only, and the update;
    early in the schedule (loop.split, loop.halve: decide) in shorter sequences and as two updates of
    half the tokens each. Returns (the summed loss, on the device; the LR multiplier); a diverging
    run stops the loop."""
    cfg, d, st = t.cfg, t.d, t.st
    loop.progress = schedule_progress(t, loop)
    mult = lr_multiplier(loop.progress, cfg.warmup_frac, cfg.warmdown_frac, cfg.final_lr_frac)
    if st.anneal_start_tokens >= 0 and cfg.plateau_evals:  # the warmdown the val minimum started, or the schedule's
        done = (st.tokens_seen - st.anneal_start_tokens) / max(st.anneal_tokens, 1)
        mult = min(mult, lr_multiplier(done, 0.0, 1.0, cfg.final_lr_frac))
    t.opt.set_lr_multiplier(mult)
    t.opt.set_muon_momentum(muon_momentum(st.step, cfg.muon_momentum_warmup_steps))
    rows = loop.x.size(0) * loop.split  # the same tokens, shorter sequences
    if loop.halve and rows > 1:
        loss_sum = half_batch_steps(t, loop, rows)
    else:
        loss_sum = torch.zeros((), device=d.device)
        for micro in range(t.grad_accum):
            loss_sum += micro_backward(t, micro, *(v.reshape(rows, -1) for v in (loop.x, loop.y)))
            next_micro_batch(t, loop)
    if loop.end is None:  # else a first half's skipped update ended the run (a diverging loss)
        apply_update(t, loop)
    st.tokens_seen += cfg.total_batch_size
    return loss_sum, mult


def micro_backward(t: Trainer, micro: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One of the update's grad_accum micro-batches; the gradient all-reduce waits for the last."""
    defer = t.ddp if t.d.world_size > 1 and micro < t.grad_accum - 1 else None
    return forward_backward(t.train_model, x, y, t.grad_accum, defer_sync=defer)


def next_micro_batch(t: Trainer, loop: Loop) -> None:
    loop.data_state = t.batches.state()
    # Prefetch: on GPU the kernels queued above still run while the CPU slices the next batch.
    loop.x, loop.y = (v.to(t.d.device, non_blocking=True) for v in next(t.batches))


def half_batch_steps(t: Trainer, loop: Loop, rows: int) -> torch.Tensor:
    """The step's tokens as two optimizer steps (the batch warmup): the first half of the rows of
    every micro-batch, then the second half. Halving rows, not micro-batches, keeps the two updates'
    data the same on any world size (with the same device batch), so elastic resumes stay exact.
    Returns the step's mean loss, summed on the device."""
    micro_batches = []
    for _ in range(t.grad_accum):
        micro_batches.append(tuple(v.reshape(rows, -1) for v in (loop.x, loop.y)))
        next_micro_batch(t, loop)
    loss_sum = torch.zeros((), device=t.d.device)
    for half in (slice(0, rows // 2), slice(rows // 2, rows)):
        if half.start:  # the first half's update; the second's is the step's own (train_step)
            apply_update(t, loop)
            if loop.end is not None:
                break
        for micro, (x, y) in enumerate(micro_batches):
            loss_sum += micro_backward(t, micro, x[half], y[half]) / 2
    return loss_sum


def context_split(progress: float, seq_warmup_frac: float) -> int:
    """Into how many shorter sequences each max_seq_len one is cut at this point of the schedule:
    4 over the first half of seq_warmup_frac, 2 over its second half, then 1 (docs/training.md)."""
    if progress >= seq_warmup_frac:
        return 1
    return 4 if progress < seq_warmup_frac / 2 else 2


def schedule_progress(t: Trainer, loop: Loop) -> float:
    """The fraction of the LR schedule done at this step: of the budget (less the reserve for the
    final eval and save), of max_steps (a max_steps run is reproducible: its schedule follows steps)
    or of the MAX_EPOCHS passes, whichever is furthest, so the schedule ends where the run does."""
    st = t.st
    progress = st.used_seconds / max(t.budget_seconds - loop.reserve_seconds, 1e-9)
    if t.cfg.max_steps:
        progress = max(progress, st.step / t.cfg.max_steps)
    return max(progress, st.tokens_seen / t.max_tokens)


def apply_update(t: Trainer, loop: Loop) -> None:
    """The optimizer step, skipped when the gradients are not finite; MAX_NONFINITE_IN_A_ROW skips in
    a row end the run. DDP leaves identical gradients on every rank, so every rank reaches the same
    verdict."""
    if optimizer_step(t.model, t.opt):
        loop.bad_in_a_row = 0
        return
    t.st.nonfinite_steps += 1
    loop.bad_in_a_row += 1
    t.log(f"step {t.st.step + 1:06d} | non-finite loss or gradients: update skipped "
          f"({loop.bad_in_a_row} in a row, {t.st.nonfinite_steps} in all)")
    if loop.bad_in_a_row >= MAX_NONFINITE_IN_A_ROW:
        t.log(f"error: {loop.bad_in_a_row} non-finite updates in a row; stopping. The last good checkpoint is "
              f"step {max(loop.last_complete_step, 0):06d}; lower the learning rates or check the data")
        loop.stop(1, f"failed: {loop.bad_in_a_row} non-finite updates in a row")


def updated_step_seconds(previous: float, dt: float, warm: bool) -> float:
    """Moving average of the step time, which the reserve for the final eval + save includes.
    Warm-up steps leave it as it was (0 on a fresh start, the checkpoint's on a resume): on an H100
    a 30 s compile step taken for a step's cost stopped an 80 s run after one step."""
    if not warm:
        return previous
    return 0.9 * previous + 0.1 * dt if previous else dt


def record_step(t: Trainer, loop: Loop, loss_sum: torch.Tensor, mult: float, t0: float) -> None:
    """Step time and throughput; the step line every log_every_steps; once, the planner's projection."""
    cfg, d, st = t.cfg, t.d, t.st
    logging = (st.step + 1) % cfg.log_every_steps == 0
    if logging:  # the mean over ranks, not rank 0's; .item() syncs the device, so only on logging steps
        train_loss = (d.all_reduce(loss_sum) / d.world_size).item()
    dt = time.time() - t0
    warm = st.step - (t.resume_step or 0) >= WARMUP_STEPS
    st.step_seconds = updated_step_seconds(st.step_seconds, dt, warm)
    if warm:
        loop.measured_tokens += cfg.total_batch_size
        loop.measured_time += dt
        loop.enter("step", d)  # compiled and warmed up: a collective that waits minutes now is a hang
    tok_s = cfg.total_batch_size / dt
    if logging:
        mfu = t.flops_per_token * tok_s / (t.peak * d.world_size) if t.peak else None
        rate = loop.measured_tokens / loop.measured_time if loop.measured_time else tok_s
        seconds, cause = projected_end(t, loop.used(), rate)
        log_step(t.log, t.writer, st.step + 1, train_loss, t.opt.matrix_lr(), mult, dt, tok_s, mfu,
                 memory_gib(d.device), loop.used() / 3600, cfg.training_hours, (seconds / 3600, cause))
        t.report.note("projected end", f"in {seconds / 3600:.2f} h ({cause}), at step {st.step + 1}'s measured "
                                       f"{rate:,.0f} tok/s")
        t.report.add({"kind": "train", "step": st.step + 1, "used_seconds": round(loop.used(), 3),
                      "tokens_seen": st.tokens_seen, "loss": train_loss, "tok_s": tok_s, "mfu": mfu})
    if not loop.planned and loop.measured_time > 0 and st.step - (t.resume_step or 0) >= 10:
        loop.planned = True
        plan_from_measured_rate(t, loop, loop.measured_tokens / loop.measured_time)


def projected_end(t: Trainer, used: float, rate: float) -> tuple[float, str]:
    """Seconds to the run's end at `rate` tok/s, and what ends it: the first of the budget, the
    MAX_EPOCHS passes, the warmdown that the val minimum started, and max_steps."""
    st = t.st
    ends = [(t.budget_seconds - used, "budget")]
    if t.max_tokens < math.inf:
        ends.append(((t.max_tokens - st.tokens_seen) / rate, f"{t.cfg.max_epochs:g} passes"))
    if st.anneal_start_tokens >= 0 and t.cfg.plateau_evals:
        ends.append(((st.anneal_start_tokens + st.anneal_tokens - st.tokens_seen) / rate,
                     "the warmdown the val minimum started"))
    if t.cfg.max_steps:
        ends.append(((t.cfg.max_steps - st.step - 1) * t.cfg.total_batch_size / rate, "max_steps"))
    seconds, cause = min(ends)
    return max(seconds, 0.0), cause


def plan_from_measured_rate(t: Trainer, loop: Loop, rate: float) -> None:
    """Once, from the tok/s measured over the first warm steps: the projection to the end of the run
    (the budget, or MAX_EPOCHS passes when they come first: then the seconds left unspent), the data
    warnings, and for a predicted DEPTH=auto choice the measured rate against the prediction."""
    cfg, st, train_tokens = t.cfg, t.st, t.prepared.meta["split"]["train_tokens"]
    left = max(t.budget_seconds - st.used_seconds - loop.reserve_seconds, 0)
    to_cap = (t.max_tokens - st.tokens_seen) / rate
    plan = planner_line(rate, min(left, to_cap), st.step + 1, st.tokens_seen, cfg.total_batch_size,
                        cfg.training_hours, train_tokens, t.model.num_params())
    t.log(plan)
    t.report.note("plan", plan.removeprefix("planner | "))
    if to_cap < left:
        t.log(f"planner | MAX_EPOCHS={cfg.max_epochs:g}: the data's passes end about {to_cap / 3600:.3f}h from now; the "
              f"run stops there with about {unspent_text(t, left - to_cap)} of the budget unspent (MAX_EPOCHS=0 "
              "trains the whole budget)")
    total = min(st.tokens_seen + rate * left, t.max_tokens)
    for line in autosize.data_lines(cfg.depth, launch.make_config(cfg, t.prepared), total, train_tokens,
                                    cfg.total_batch_size, auto=t.run_meta["auto"] is not None):
        t.log(line)
    if t.weights:
        for line in source_epoch_lines(total, t.weights, t.prepared.meta["source_splits"]):
            t.log(line)
    auto = t.run_meta["auto"] or {}
    if auto.get("how") == "predicted" and t.resume_step is None:
        t.log(autosize.check_prediction(auto["candidates"], cfg.depth, rate, t.budget_seconds, train_tokens))


def unspent_text(t: Trainer, seconds: float) -> str:
    """Seconds, hours, and on GPUs the dollars at GPU_HOURLY_USD."""
    usd = f", ${seconds / 3600 * t.cfg.gpu_hourly_usd * t.d.world_size:,.0f}" if t.d.device.type == "cuda" else ""
    return f"{seconds:,.0f}s ({seconds / 3600:.2f}h{usd})"


def finish(t: Trainer, loop: Loop) -> None:
    t.writer.close()
    best = ckpt.read_best(t.run_dir) if t.d.master else None
    if best is not None:
        # With several ranks the step is in parts, model_<step>_rank<r>.pt: name files that exist.
        files = (ckpt.model_path(t.run_dir, best["step"]) if t.d.world_size == 1
                 else t.run_dir / f"model_{best['step']:06d}_rank{{0..{t.d.world_size - 1}}}.pt")
        spent = loop.used()  # the final eval and save included
        if not loop.outcome.startswith("stopped"):  # a preemption's grace is for the checkpoint alone
            t.log(export_best(t.run_dir))
        t.log(f"serve it: bash run.sh serve   (or: python -m experiment.server --checkpoint {t.run_dir}, which "
              "serves its best)")
        left = unspent_text(t, t.budget_seconds - spent)
        unspent = (f" | the val loss stopped improving: {left} of the budget unspent" if stopped_at_minimum(t)
                   else f" | the data's {t.cfg.max_epochs:g} passes are done: {left} of the budget "
                   "unspent" if t.st.tokens_seen >= t.max_tokens else "")
        t.log(f"done: step {t.st.step:06d}, {spent / 3600:.3f}h of {t.cfg.training_hours:.3f}h used "
              f"({spent:.1f}s of {t.budget_seconds:.1f}s) | best checkpoint {files} (val_loss {best['val_loss']:.4f})"
              + unspent)


def export_best(run_dir: Path) -> str:
    """Rank 0 at the end: the best step as one bf16 file, <run_dir>/best.pt; the line that says so.
    A failure (a full disk) costs the file, not the run: the checkpoints hold the same model."""
    try:
        out, facts = export.export(run_dir, None, run_dir.parent)
    except (CheckpointError, OSError) as e:
        return f"warning: the best model was not exported as one file ({e}); python -m experiment.export retries"
    return export.describe(out, facts)


# ---------------------------------------------------------------- entry


def train(cfg: TrainConfig, d: Dist) -> int:
    cfg = resolve(finetune.apply(cfg), d.device.type == "cuda", d.world_size)
    workspace = Path(cfg.workspace) if cfg.workspace else default_workspace()
    run_dir = workspace / "checkpoints" / cfg.model_tag
    finetune.check_dir(cfg, run_dir)
    # Every rank asks, so that all exit together even where one node's marker is missing.
    ended = launch.launch_ended(run_dir)
    if not all_ranks_ok(ended is None, d):
        if d.master:
            print(f"error: not restarting: the trainer ended this launch with a failure that a restart would repeat "
                  f"({(ended and last_words(run_dir, ended - 60)) or 'its outcome is not on record'}; training.log "
                  f"in {run_dir} says more)", file=sys.stderr, flush=True)
        return 1
    log = RunLog(run_dir / "training.log" if d.master else None)
    log(f"config {json.dumps(dataclasses.asdict(cfg))}")
    try:
        return run(cfg, d, workspace, run_dir, log)
    except (ConfigError, DataError, CheckpointError):
        raise  # reported as a one-line error by main()
    except BaseException:
        log_crash(run_dir / "training.log", d.rank)
        raise


def main(argv=None) -> int:
    cfg = parse_args(argv)
    ParentWatch().start()
    d = None
    try:
        try:
            cuda = resolve_device(cfg.device).type == "cuda"
            backend = local_backend(cuda, cfg.dist_backend)
        except ValueError as e:  # only these: one from the process group itself is no config error
            raise ConfigError(str(e)) from None
        d = setup_distributed(cuda, backend)
        return train(cfg, d)
    except (ConfigError, DataError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        if d is not None:
            d.close()


if __name__ == "__main__":
    code = main()
    # Leave without interpreter finalization: with gloo, about 1 exit in 20 aborted there ("terminate
    # called without an active exception", C++ threads torn down after Python; pytorch PR #179291)
    # and turned a finished run into a failed one. Everything we wrote is closed and flushed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
