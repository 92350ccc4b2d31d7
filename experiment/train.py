"""Train a depth-parameterized char GPT under a hard wall-clock budget.

    torchrun --standalone --nproc_per_node=N -m experiment.train [--flags]   (or python -m ...)

Raw DDP (nccl on CUDA, gloo on CPU or with DIST_BACKEND=gloo), ZeRO-1 optimizer shards
(experiment/optim.py), bf16 autocast on GPU, periodic eval summed over all ranks, best-val tracking,
atomic checkpoints, automatic resume.
The budget is wall-clock seconds of the training loop (evals and saves included), persisted across
restarts; the LR schedule is a function of the budget fraction used, so warmdown ends at the deadline
whatever the step speed.

This file holds setup and the loop. What the loop calls lives beside it: stopping.py (each step's
decisions), plateau.py (the stop at the val minimum), schedule.py, trainstep.py (the step),
saving.py (the saves) and progress.py (the step line and the plan from the measured rate); the
records they share are trainer.py's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch

from experiment import autosize, extend, finetune, generations, guards, launch, metric, regime, restarts
from experiment import checkpoint as ckpt
from experiment.checkpoint import CheckpointError, RunState, pick_resume_step
from experiment.config import ConfigError, TrainConfig, checkpoint_meta, parse_args, resolve
from experiment.batches import TokenBatches
from experiment.dataloader import DataError, Prepared
from experiment.distributed import (Dist, ParentWatch, StopSignal, all_ranks_ok, broadcast_object, local_backend,
                                    resolve_device, setup_distributed, wrap_ddp)
from experiment.evaluation import eval_coverage, evaluate
from experiment.files import default_workspace
from experiment.hardware import link_gbps
from experiment.memory import choose_memory_mode, find_device_batch, memory_line, place_average, probe_reserve_bytes
from experiment.mixture import MixedBatches, source_weights
from experiment.model import DTYPES, GPT, GPTConfig, build_model
from experiment.optim import ShardedOptimizer
from experiment.plateau import plateau_check
from experiment.progress import begin_step, record_step
from experiment.report import NullReport, RunReport, run_facts
from experiment.runlog import NullWriter, RunLog, log_crash, record_metric, report_eval, report_sample
from experiment.saving import (checkpoint_seconds, export_best, export_share, finish_save, make_saver, maybe_save,
                               repair_best, restore_checkpoint)
from experiment.stopping import decide, final_reserve, last_outcome, stop_grace, stopped_at_minimum, unspent_text
from experiment.teacher import Teacher
from experiment.trainer import Loop, Trainer
from experiment.trainstep import train_step


# ---------------------------------------------------------------- setup


def prepare_data(cfg: TrainConfig, d: Dist, workspace: Path, run_dir: Path,
                 log: RunLog) -> tuple[Prepared, int | None, int | None, object, float]:
    """Rank 0 takes the run directory's trainer lock, opens the data and picks the resume step (and
    for settings that extend an annealed run, its newest checkpoint from before the warmdown: extend.py); a failure
    there reaches every rank. Under experiment/run.sh the data is the pre-flight's prepared
    directory (--prepared_dir), so no rank waits in this broadcast while another prepares; a bare
    torchrun prepares here. Returns (data, resume step, the step whose weights to load instead or None,
    the lock: rank 0's open file, else None, (the seconds the last launch trained past the resumed
    checkpoint: restarts.lost_seconds, their GPU-seconds on its GPU count beyond this one's))."""
    setup, lock = None, None
    if d.master:
        try:
            lock = launch.hold_trainer_lock(run_dir)
            prepared = launch.prepare_data(cfg, workspace, log)
            resume_step = pick_resume_step(run_dir, cfg.resume, log, quarantine=True)
            launch.fill_pass_cap(cfg, prepared, run_dir, resume_step, log)
            lost = restarts.lost_seconds(run_dir, resume_step, cfg)
            gpu_fix = restarts.lost_on_other_gpus(run_dir, lost, d.world_size)
            launch.dollar_budget(cfg, run_dir, resume_step, d.world_size, log, gpu_fix)
            train_tokens = prepared.meta["split"]["train_tokens"]
            setup = {"prepared": str(prepared.dir), "resume_step": resume_step, "max_epochs": cfg.max_epochs,
                     "training_hours": cfg.training_hours, "lost": (lost, gpu_fix),
                     "rewind_step": None if resume_step is None else extend.rewind_step(run_dir, resume_step, cfg,
                                                                                        train_tokens)}
        except (DataError, ConfigError, CheckpointError) as e:
            setup = {"error": str(e)}
    setup = broadcast_object(setup, d)
    if "error" in setup:
        raise ConfigError(setup["error"], every_rank=True)
    cfg.max_epochs = setup["max_epochs"]  # rank 0's pass cap (launch.fill_pass_cap), on every rank
    cfg.training_hours = setup["training_hours"]  # and its budget (launch.dollar_budget)
    return Prepared.load(setup["prepared"]), setup["resume_step"], setup["rewind_step"], lock, setup["lost"]


def build_model_and_optimizer(cfg: TrainConfig, d: Dist, model_config: GPTConfig, log: RunLog,
                              init: dict | None = None, teacher: Teacher | None = None) -> tuple[GPT, ShardedOptimizer]:
    """In the precision and activation-checkpointing mode that fits (CUDA: the memory plan, a teacher
    counted), and on CUDA without --device_batch_size the largest micro-batch that fits (sets
    cfg.device_batch_size; with a teacher, its probabilities and the distillation loss in the probe's
    step). `init`: the weights to start from (INIT_FROM), else the seed's initialization."""
    plan = choose_memory_mode(model_config, cfg.device_batch_size or 1, cfg.precision, cfg.activation_checkpointing, d,
                              teacher.num_params() if teacher else 0)
    precision = plan.precision if plan else ("fp32" if cfg.precision == "auto" else cfg.precision)
    activation_checkpointing = plan.activation_checkpointing if plan else cfg.activation_checkpointing == "on"
    model = build_model(model_config, d.device, DTYPES[precision], init, seed=cfg.seed,
                        activation_checkpointing=activation_checkpointing)  # identical on every rank
    opt = ShardedOptimizer(model, d.rank, d.world_size, matrix_lr=cfg.matrix_lr, embedding_lr=cfg.embedding_lr,
                           unembedding_lr=cfg.unembedding_lr, master_weights=precision == "bf16",
                           weight_decay=cfg.weight_decay, adam_weight_decay=cfg.adam_weight_decay)
    model.set_dropout(cfg.dropout, cfg.attn_dropout)
    if cfg.average == "ema":
        opt.average = place_average(cfg.average_width, cfg.device_batch_size or 1, model_config, plan, d, opt, log)
    log(memory_line(plan, precision, activation_checkpointing, cfg.device_batch_size or 1, d))
    if cfg.device_batch_size is None:
        reserve_bytes = probe_reserve_bytes(plan) if plan else 0
        per_rank = cfg.total_batch_size // (cfg.max_seq_len * d.world_size)
        cfg.device_batch_size = find_device_batch(model, cfg.max_seq_len, per_rank, d, reserve_bytes, teacher)
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


def setup(cfg: TrainConfig, d: Dist, workspace: Path, run_dir: Path, log: RunLog,
          launched: float | None = None, teachers: list[dict] | None = None) -> Trainer:
    """`launched`: when the budget's clock began (launch.launch_started; a generation's, when the one
    before it ended): a fresh run's setup counts in its budget from there, a restart's is charged.
    `teachers`: a later generation's (experiment/generations.py), loaded and checked here."""
    launched = time.time() if launched is None else launched
    cuda = d.device.type == "cuda"
    gpu = guards.local_gpu(d.device) if cuda else None
    log(f"world {d.world_size} x {gpu.name if gpu else 'cpu'} | torch {torch.__version__}")
    unset = regime.left_unset(cfg)  # before the data's pass cap fills MAX_EPOCHS
    prepared, resume_step, rewind_step, lock, (lost, gpu_fix) = prepare_data(cfg, d, workspace, run_dir, log)
    assert cfg.max_epochs is not None, "the pass cap is set with the data (launch.fill_pass_cap)"
    teacher = Teacher.for_run(cfg, d.device, prepared, teachers, log) if teachers else None
    auto, probe_seconds = (choose_depth(cfg, d, gpu, prepared, run_dir, resume_step, unset, log, teacher)
                           if cfg.depth == "auto" else (None, 0))
    launch.fill_rates(cfg, cuda, run_dir, resume_step, log)
    model_config = launch.model_config(cfg, prepared)
    regime_seconds, regime_line = regime.settle(cfg, d, gpu, model_config, prepared.meta["split"]["train_tokens"], run_dir,
                                                resume_step, auto, unset, log, teacher.flops_per_token() if teacher else 0)
    if resume_step is not None:
        launch.check_resume_target(run_dir, resume_step, model_config, prepared)
    # Each rank its own stream: dropout's masks differ across ranks as their data does (weights are
    # drawn from a seeded generator of their own, the data order from numpy: neither reads this one).
    torch.manual_seed(cfg.seed + d.rank)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls outside autocast
    model, opt, st = start_state(cfg, d, run_dir, model_config, prepared, resume_step, rewind_step,
                                 probe_seconds + regime_seconds, log, teacher)
    st.gpu_seconds_base += gpu_fix  # the lost seconds are charged on these GPUs, but were spent on those
    if d.master:  # files of a save that a crash cut short; the loaded step is complete, so never these
        ckpt.remove_incomplete(run_dir)
        launch.clear_ended(run_dir)
        if resume_step is not None:
            repair_best(run_dir, st, log)
    weights = source_weights(prepared.meta, cfg.data_mix)
    own_metric = metric.setup(cfg, d, model, prepared, log)  # the dry call, before any step
    metric.adopt_best_by(st, cfg.best_by, log)
    ddp = wrap_ddp(model, d)
    use_compile = cfg.compile == "on" or (cfg.compile == "auto" and cuda)
    if teacher is not None and use_compile:
        teacher.compile()
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
        resume_step=resume_step, rewind_step=rewind_step, grad_accum=grad_accum,
        budget_seconds=budget_seconds, run_meta=checkpoint_meta(cfg, prepared, budget_seconds, auto),
        flops_per_token=model.estimate_flops(cfg.max_seq_len), peak=gpu.peak if gpu else None,
        report=RunReport(run_dir, run_facts(cfg, d, model, prepared, budget_seconds, grad_accum, auto, coverage)
                         | {"regime": regime_line and regime_line.removeprefix("regime | ")}, resume_step, log)
        if d.master else NullReport(),
        eval_prompt=launch.eval_prompt_ids(cfg, prepared), lock=lock,
        max_tokens=cfg.max_epochs * prepared.meta["split"]["train_tokens"] if cfg.max_epochs else math.inf,
        saver=make_saver(cfg, d, model, run_dir, log), first_save_seconds=checkpoint_seconds(model, d.world_size, cfg.average != "none"),
        export_share=export_share(model, d.world_size, cfg.average != "none"),
        eval_every_tokens=cfg.eval_every_epochs * prepared.meta["split"]["train_tokens"] or math.inf,
        eval_coverage=coverage, launched=launched, lost_seconds=lost, metric=own_metric,
        best_by=metric.parse_best_by(cfg.best_by), teacher=teacher)
    log(f"model {model.num_params():,} params (d{cfg.depth}, width {model_config.n_embd}, "
        f"{model_config.n_head} heads) | {t.flops_per_token:.3e} FLOP/token | batch {cfg.device_batch_size} x "
        f"{cfg.max_seq_len} x {d.world_size} ranks x {t.grad_accum} accum = {cfg.total_batch_size:,} tokens/step | "
        f"budget {cfg.training_hours:.3f}h | tensorboard {workspace / 'tensorboard' / cfg.model_tag}")
    if resume_step is None:  # DEPTH=auto's probe (start_state's) is part of it
        t.st.used_seconds = max(t.st.used_seconds, time.time() - launched)
    return t


def start_state(cfg: TrainConfig, d: Dist, run_dir: Path, model_config: GPTConfig, prepared: Prepared,
                resume_step: int | None, rewind_step: int | None, probe_seconds: float,
                log: RunLog, teacher: Teacher | None = None) -> tuple[GPT, ShardedOptimizer, RunState]:
    """The model, optimizer and run state the loop starts from: fresh (from INIT_FROM's weights when
    set), a resumed step, or for an extended run the checkpoint from before its warmdown with the
    resumed step's counters (extend.py)."""
    init = None
    if cfg.init_from and resume_step is None:  # a fresh run from a trained model's weights
        finetune.check_target(cfg, model_config)
        init, line = finetune.weights(cfg)
        log(line)
    model, opt = build_model_and_optimizer(cfg, d, model_config, log, init, teacher)
    if resume_step is None:
        return model, opt, RunState(used_seconds=probe_seconds)  # DEPTH=auto's probe is part of the budget
    load = resume_step if rewind_step is None else rewind_step
    st = restore_checkpoint(run_dir, load, model, opt, d)
    if rewind_step is not None:
        st = extend.rewound(st, ckpt.run_state(ckpt.read_meta(run_dir, resume_step)))
        log(extend.rewind_line(rewind_step, resume_step, st, prepared.meta["split"]["train_tokens"]))
    elif extend.drop_anneal(st, cfg):
        log(f"extend | PLATEAU_EVALS=0: the warmdown the val minimum started at step {st.step:06d} is dropped; "
            "training on at the peak LR")
    st.gpu_seconds_base = launch.spent_base(ckpt.read_meta(run_dir, resume_step), d.world_size)
    log(f"resumed from {ckpt.model_path(run_dir, load)}: step {st.step}, {st.used_seconds / 3600:.3f}h used, "
        f"best {st.best_val:.4f} @ {st.best_step:06d}")
    return model, opt, st


def choose_depth(cfg: TrainConfig, d: Dist, gpu: guards.Gpu | None, prepared: Prepared, run_dir: Path,
                 resume_step: int | None, unset: list[str], log: RunLog, teacher: Teacher | None) -> tuple[dict, float]:
    """DEPTH=auto: sets cfg.depth (sized for the regime's recipe where the run leaves it to the
    regime: regime.regularizes). A resume keeps its checkpoint's depth. A fresh run on a GPU whose
    peak is known predicts each depth's tok/s (autosize.predict_and_choose: no compile per depth);
    otherwise every rank measures the ladder at once (so each sees the load training will put on the
    machine). A generation's teacher: its memory and forward FLOPs priced in; a chain's first generation:
    sized to leave budget for the next (generations.sizes_chain; "chain" records it). Rank 0's choice is
    taken. Returns (what the checkpoint meta records, seconds the choice took)."""
    if resume_step is not None:
        meta = ckpt.read_meta(run_dir, resume_step)
        cfg.depth, auto = meta["model_config"]["depth"], meta.get("auto") or {}
        log(f"auto: d{cfg.depth} kept from the checkpoint ({auto.get('reason', 'no reason recorded')})")
        return auto, 0.0
    t0 = time.time()
    make_config, train_tokens = launch.make_config(cfg, prepared), prepared.meta["split"]["train_tokens"]
    regularized, first = regime.regularizes(cfg, unset, train_tokens), generations.sizes_chain(cfg)
    predicted, taught = gpu is not None and gpu.peak is not None, (teacher.num_params(), teacher.flops_per_token()) \
        if teacher else (0, 0.0)
    if predicted:
        chosen, candidates = autosize.predict_and_choose(make_config, gpu.peak, d.world_size, gpu.memory_bytes,
                                                         cfg.training_hours * 3600, train_tokens, link_gbps(gpu.name),
                                                         gpu.name, cfg.total_batch_size, regularized, taught, first)
    else:
        chosen, candidates = autosize.probe_and_choose(make_config, cfg.device_batch_size or 1, d.device,
                                                       d.world_size, cfg.training_hours * 3600, train_tokens,
                                                       cfg.total_batch_size, regularized, taught[1], first)
    how = "predicted" if predicted else "measured"
    auto = broadcast_object({"depth": chosen.depth, "reason": autosize.reason(chosen, candidates, how, bool(teacher)),
                             "how": how, "chain": autosize.sized_for_chain(chosen),
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
    if restarts.restarted(t):
        restarts.restart_cost(t, now)  # charged at the first step this resume trains (begin_step)
    loop = Loop(x=x, y=y, data_state=data_state, started=now, used_at_start=t.st.used_seconds,
                last_eval_time=now, last_save_time=now, last_saved_step=first,
                # An extended run's weights are the rewound step's, not those saved as step `first`.
                last_complete_step=first if t.rewind_step is None else t.rewind_step,
                saved_best=t.st.best())  # a resume's best: its checkpoint is complete
    return loop


# ---------------------------------------------------------------- the loop


def run(cfg: TrainConfig, d: Dist, workspace: Path, run_dir: Path, log: RunLog, launched: float,
        teachers: list[dict] | None = None) -> tuple[int, str, float]:
    """One model in run_dir: (the exit code, the loop's outcome, the budget seconds it used, the
    final eval, save and export included). A stop signal that came after the loop's last decision
    (during the final eval or save) makes the outcome a stop: a run of generations must not begin
    the next one then."""
    try:
        t = setup(cfg, d, workspace, run_dir, log, launched, teachers)
    except (ConfigError, DataError, CheckpointError) as e:
        # The launch's first model, on its first attempt: a restart would meet the same mistake (train()).
        # A restart's setup (after a crash) or a later generation's (its teacher's load) may meet what one mends.
        e.at_start = not teachers and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        raise
    try:
        code = train_loop(t)
        outcome = t.outcome
        if code == 0 and t.stop_signum and not outcome.startswith("stopped"):
            outcome = f"stopped: {signal.Signals(t.stop_signum).name} after the final step ({outcome})"
        return code, outcome, t.used_final
    finally:
        if t.lock is not None:  # a later run in this process (the tests) takes it again
            t.lock.close()


def train_loop(t: Trainer) -> int:
    d, log = t.d, t.log
    loop = start_loop(t)
    with StopSignal(announce=d.master, grace=lambda: stop_grace(t)) as stop_signal:
        loop.stop_signal = stop_signal  # an EVAL_METRIC call in progress gives way to the save
        for step in range(t.st.step, t.max_steps + 1):
            t.st.step, t.st.used_seconds = step, loop.used()
            loop.reserve_seconds = final_reserve(t)  # the final eval, save, export and step
            last_step, eval_due, save_due, signum, writing, warmdown, split, halve = decide(
                t, loop, stop_signal.signum, t.saver.writing())
            loop.reshaped = (split, halve) != (loop.split, loop.halve)
            loop.split, loop.halve = split, halve
            if t.saver.pending is not None and not writing:  # every rank's writer is done
                finish_save(t, loop)
            if last_step:
                loop.stop(0, last_outcome(t))
            if signum:  # preempted: save what we have now; an eval would spend the grace period
                name = signal.Signals(signum).name
                loop.stop(0, f"stopped: {name} at step {step}; the same command resumes it")
                log(f"received {name}: " + (f"completing step {t.saver.pending.step:06d}'s save, in flight, and exiting"
                                             if writing else f"saving step {step:06d} and exiting"))
            elif (eval_due or save_due or last_step) and step != t.st.last_eval_step:
                maybe_eval(t, loop)
            maybe_save(t, loop, save_due, preempted=bool(signum), writing=bool(writing))
            if not t.st.warmdown_begun and (warmdown or t.st.anneal_start_tokens == t.st.tokens_seen) and not signum:
                # The LR warmdown begins with this step's update: an extended run goes back to the newest
                # checkpoint from before it (this step's own, once complete: finish_save).
                t.st.warmdown_begun, t.st.warmdown_step = True, loop.last_complete_step
            if loop.end is not None:
                break
            t0 = begin_step(t, loop)
            loss_sum, mult = train_step(t, loop)
            if loop.end is not None:
                break
            record_step(t, loop, loss_sum, mult, t0)
            restarts.beat(t, loop)
        # One that came after the last decide() (the final eval or save), agreed by every rank: run() reads it.
        late = torch.tensor([stop_signal.signum], dtype=torch.float64, device=d.device)
        t.stop_signum = int(d.all_reduce(late, "max").item())
    if t.saver.pending is not None:  # the loop broke off (a diverging run) with a save in flight
        finish_save(t, loop, wait=True)
    restarts.beat(t, loop, force=True)  # what a stop on an earlier step's checkpoint leaves to train again
    if not loop.end:  # None: a resume at or past max_steps had no step left to run
        finish(t, loop)
    outcome = loop.outcome if loop.end is not None else "finished: no step was left to run"
    # The lost seconds of a resume that trained no step (its charge not made) were spent all the same: a
    # later generation's share must not get them again (its setup is forgiven: restarts.charge)
    t.outcome, t.used_final = outcome, loop.used() + t.restart_lost
    t.report.add({"kind": "end", "step": t.st.step, "outcome": outcome, "code": loop.end or 0, "time": time.time()})
    t.report.write(t.st, outcome)
    if loop.end == 1:  # the trainer's own decision (a failed final save, a diverging loss): a restart repeats it
        launch.end_launch(t.run_dir)
    return loop.end or 0


def maybe_eval(t: Trainer, loop: Loop) -> None:
    """Eval over all ranks, best tracking, the eval report and the stop at the val minimum
    (plateau_check; every rank saw the same reduced val loss, so all agree)."""
    cfg, st, step, t0 = t.cfg, t.st, t.st.step, time.time()
    args = (t.model, t.prepared, cfg.max_seq_len, cfg.device_batch_size, cfg.eval_tokens, t.d, t.weights)
    raw, average = evaluate(*args), None
    if t.opt.average is not None:
        with t.opt.average.swapped_in():
            average = evaluate(*args)
    # The better of the two is what this step's checkpoint holds, what best tracks and what the stop
    # at the val minimum watches: every rank saw the same reduced losses, so all choose alike. A step
    # saved already (a preemption's save, which skips the eval a resume runs now) is not written again:
    # its model files hold the raw weights, so its eval stands for those.
    better = average is not None and average[0] < raw[0] and step != loop.last_saved_step
    loop.weights = "average" if better else "raw"
    loop.val_loss, val_bpc, by_source = average if loop.weights == "average" else raw
    values = metric.at_eval(t, loop)
    loop.score = t.best_by.score(loop.val_loss, values)
    st.last_eval_step, st.last_eval_tokens = step, st.tokens_seen
    if step > 0 and loop.score < st.best_score:
        st.set_best((loop.val_loss, step, loop.weights, loop.score))
    t.report.add(report_eval(step, raw, average, loop.weights, st, t.eval_coverage, t.log, t.writer)
                 | record_metric(step, values, t.best_by, st, t.log, t.writer))
    if t.d.master and cfg.sample_tokens > 0:
        report_sample(step, t.model, t.prepared, t.eval_prompt, cfg.sample_tokens, t.log, t.report)
    t.report.write(st, "running")
    if step > 0 and cfg.plateau_evals and loop.end is None:  # the final eval decides nothing
        plateau_check(t, loop)
    loop.last_eval_time = time.time()  # the clock's cadence counts from the eval's end (stopping.eval_stretch)
    loop.eval_seconds = loop.last_eval_time - t0
    st.eval_seconds = max(st.eval_seconds, loop.eval_seconds)


def finish(t: Trainer, loop: Loop) -> None:
    t.writer.close()
    best = ckpt.read_best(t.run_dir) if t.d.master else None
    if best is not None:
        # With several ranks the step is in parts, model_<step>_rank<r>.pt: name files that exist.
        files = (ckpt.model_path(t.run_dir, best["step"]) if t.d.world_size == 1
                 else t.run_dir / f"model_{best['step']:06d}_rank{{0..{t.d.world_size - 1}}}.pt")
        if not loop.outcome.startswith("stopped"):  # a preemption's grace is for the checkpoint alone
            t.log(export_best(t.run_dir))
            restarts.after_export(t, loop)
        spent = loop.used()  # the final eval, save and export included
        t.log(f"serve it: bash run.sh serve   (or: python -m experiment.server --checkpoint {t.run_dir}, which "
              "serves its best)")
        left = unspent_text(t, t.budget_seconds - spent)
        unspent = (f" | the val loss stopped improving: {left} of the budget unspent" if stopped_at_minimum(t)
                   else f" | the data's {t.cfg.max_epochs:g} passes are done: {left} of the budget "
                   "unspent" if t.st.tokens_seen >= t.max_tokens else "")
        lost = f", {t.st.restart_seconds:.1f}s of it lost to restarts" if t.st.restart_seconds else ""
        t.log(f"done: step {t.st.step:06d}, {spent / 3600:.3f}h of {t.cfg.training_hours:.3f}h used "
              f"({spent:.1f}s of {t.budget_seconds:.1f}s){lost} | best checkpoint {files} (val_loss "
              f"{best['val_loss']:.4f}" + (", the weight average" if best.get("weights") == "average" else "")
              + ")" + unspent)


# ---------------------------------------------------------------- entry


def train(cfg: TrainConfig, d: Dist) -> int:
    launched = launch.launch_started()
    cfg = resolve(finetune.apply(cfg), d.device.type == "cuda", d.world_size)
    workspace = Path(cfg.workspace) if cfg.workspace else default_workspace()
    run_dir = workspace / "checkpoints" / cfg.model_tag
    finetune.check_dir(cfg, run_dir)
    # Every rank asks, so that all exit together even where one node's marker is missing.
    ended = launch.launch_ended(run_dir)
    if not all_ranks_ok(ended is None, d):  # exit 0 only where every rank's agent reads its own node's code
        return 0 if all_ranks_ok(launch.not_restarting(run_dir, ended, d.master) == 0, d) else 1
    log = RunLog(run_dir / "training.log" if d.master else None)
    log(f"config {json.dumps(dataclasses.asdict(cfg))}")
    try:
        generations.on_rank_0(d, lambda: generations.check_layout(cfg, run_dir))
        if cfg.generations != 1:
            return generations.run_all(cfg, d, workspace, run_dir, log, launched, run)
        return run(cfg, d, workspace, run_dir, log, launched)[0]
    except (ConfigError, DataError, CheckpointError) as e:
        launch.end_mistake(run_dir, e, d.master)  # one at the start ends the launch: a restart would repeat it
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
        if d is None or d.local_rank == 0 or not getattr(e, "every_rank", False):  # one line a node
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
