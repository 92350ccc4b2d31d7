"""The trainer's two records: what setup() builds once (Trainer) and what changes from step to step
without being checkpointed (Loop). The loop (experiment/train.py) and its rooms (saving, stopping,
plateau, schedule, trainstep, progress) read and write them; the checkpointed state is t.st
(checkpoint.RunState)."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from experiment.checkpoint import RunState
from experiment.config import TrainConfig
from experiment.batches import TokenBatches
from experiment.dataloader import Prepared
from experiment.distributed import PHASE_TIMEOUTS, Dist
from experiment.metric import BestBy, EvalMetric
from experiment.mixture import MixedBatches
from experiment.model import GPT
from experiment.optim import ShardedOptimizer
from experiment.report import NullReport, RunReport
from experiment.runlog import RunLog
from experiment.saver import Saver


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
    export_share: float  # the final export's time as a share of a save's (saving.export_share)
    eval_every_tokens: float  # EVAL_EVERY_EPOCHS passes over the training data; inf when off
    eval_coverage: tuple[int, int, bool]  # (tokens an eval predicts, tokens in the val split, all of it)
    launched: float  # time.time() when this process's trainer began: a restart's setup counts from there
    lost_seconds: float  # rank 0's: what the last launch trained past the resumed checkpoint (restarts.py)
    metric: EvalMetric | None = None  # EVAL_METRIC (experiment/metric.py), or the demo's
    best_by: BestBy = BestBy()  # BEST_BY: what chooses the best checkpoint
    teacher: object = None  # a later generation's frozen teacher (experiment/generations.py), else None
    outcome: str = "running"  # the loop's, once it ends: what a generation's record keeps
    used_final: float = 0.0  # budget seconds used at the loop's end, the final eval, save and export included
    stop_signum: int = 0  # a stop signal the loop saw (0: none), also one that came after its last decision
    # A resume's cost not yet charged: rank 0's, broadcast to every rank (restarts.restart_cost); charged at
    # the first step it trains (restarts.charge), and counted before it (stopping.decide)
    restart_lost: float = 0.0
    restart_setup: float = 0.0

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
    last_eval_time: float  # the latest eval's end, or its step's save once begun (saving.maybe_save)
    last_save_time: float
    last_saved_step: int  # the latest save begun
    last_complete_step: int  # the latest save completed
    eval_seconds: float = 0.0  # the latest eval's duration in this process (stopping.eval_stretch)
    reserve_seconds: float = 0.0  # measured: the final eval + save + one step fit in what is left
    val_loss: float = math.nan  # the latest eval's, of the weights it chose (`weights`)
    weights: str = "raw"  # which weights the latest eval chose, and a save writes: "raw", or "average" (AVERAGE)
    # The best of the latest completed save (RunState.best()): what a failed best save falls back to (an
    # eval's own "before" could name a step whose background save is still in flight, then fails).
    saved_best: tuple = (math.inf, -1, "raw", math.inf)
    score: float = math.nan  # the latest eval's, as BEST_BY compares it (lower is better)
    stop_signal: object = None  # the loop's StopSignal: its signum once a stop signal came
    progress: float = 0.0  # the fraction of the LR schedule done at this step: rank 0's, from decide
    split: int = 1  # the step's early-schedule phase, rank 0's (decide): sequences cut into this many
    halve: int = 0  # 1: the step's tokens in two updates of half the rows each
    last_beat: float = 0.0  # when rank 0 last wrote the heartbeat (restarts.beat)
    beat_failed: bool = False
    reshaped: bool = False  # the phase changed at this step: new shapes (on CUDA, a graph compiled now)
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
