"""The pre-flight: everything that can fail for a user's reason, checked in one plain process before
torchrun starts any worker.

    python -m experiment.preflight --world_size N [--node_rank R] [--plan_file F] [train flags]

experiment/run.sh runs it first. It resolves the config for the launch's world size, validates and
prepares the data, picks the resume step and checks that checkpoint against the model and the data,
and prints the plan. A user error exits 2 here with one message, and torchrun is never started (so
never restarted MAX_RESTARTS times over the same mistake). Under torchrun every rank then opens the
prepared directory the pre-flight made (--prepared_dir): no rank prepares while the others wait in
a collective, whose timeout (10 minutes with NCCL) a big corpus would outlast.

Multi-node: the node with NODE_RANK=0 prepares into the shared workspace and writes
<workspace>/preflight/<model_tag>.json last; the other nodes wait for a fresh one of those.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

from experiment import autosize, extend, finetune, generations, guards, regime
from experiment import checkpoint as ckpt
from experiment.checkpoint import CheckpointError
from experiment.config import ConfigError, TrainConfig, parse_args, resolve
from experiment.dataloader import DataError, Prepared
from experiment.distributed import pick_backend, resolve_device
from experiment.files import atomic_write_json, default_workspace
from experiment.hardware import host_available_bytes
from experiment.launch import (check_not_running, check_resume_target, depth_for, dollar_budget, eval_prompt_ids,
                               fill_pass_cap, make_config, model_config, prepare_data, uses_demo)
from experiment.memory import checkpoint_bytes
from experiment.mixture import source_weights
from experiment.model import GPTConfig

# A node other than 0 accepts node 0's plan if it was written at most this long before the node
# itself started: nodes of one launch start within minutes of each other (clocks of a shared file
# system may differ by seconds), and an older plan belongs to an earlier launch.
PLAN_FRESH_SECONDS = 600
WAIT_POLL_SECONDS = 5
MANY_SOURCES = 64


def start_checks(cfg: TrainConfig, run_dir: Path, resume_step: int | None, config: GPTConfig | None,
                 prepared: Prepared) -> int | None:
    """What the run starts from, checked as the trainer will: INIT_FROM's model for a fresh run; for a
    resume the same model on the same data, and settings that extend an annealed run (exit 2 when
    they cannot). Returns the step an extended run goes back to, else None."""
    if resume_step is None:
        if cfg.init_from:
            finetune.check_target(cfg, config)
        return None
    check_resume_target(run_dir, resume_step, config, prepared)
    return extend.rewind_step(run_dir, resume_step, cfg, prepared.meta["split"]["train_tokens"])


def check_ranks_per_gpu(cfg: TrainConfig, gpu: guards.Gpu | None, nproc_per_node: int) -> None:
    """More ranks on this node than GPUs (under NCCL): refused here, not by each worker and its restarts."""
    if gpu is None or not torch.cuda.is_available():  # a CUDA-shaped plan on a CPU (the tests) has no GPUs to count
        return
    try:
        pick_backend(True, cfg.dist_backend, nproc_per_node - 1, torch.cuda.device_count())
    except ValueError as e:
        raise ConfigError(str(e)) from None


def plan_lines(cfg: TrainConfig, prepared: Prepared, config: GPTConfig | None, world_size: int,
               resume_step: int | None, run_dir: Path) -> list[str]:
    split = prepared.meta["split"]
    resume = f"resumes step {resume_step:06d} of {run_dir}" if resume_step is not None else f"fresh run in {run_dir}"
    chosen = " (DEPTH=auto, from the predicted tok/s)" if config and cfg.depth == "auto" and resume_step is None else ""
    model = (f"model d{config.depth}{chosen} width {config.n_embd}, {config.n_head} heads" if config else
             "model auto (depth chosen at start from the throughput measured there)")
    return [
        f"preflight | data {prepared.dir} | {split['train_tokens']:,} train tokens, {split['val_tokens']:,} val "
        f"tokens | vocabulary {prepared.meta['vocab_size']}{records_note(prepared.meta)}",
        f"preflight | {model}, context {cfg.max_seq_len} | world {world_size} | {cfg.total_batch_size:,} tokens/step = "
        f"{cfg.total_batch_size / split['train_tokens']:.4f} epochs/step | budget {cfg.training_hours:.3f}h",
        f"preflight | the data supports up to "
        f"{autosize.supports(make_config(cfg, prepared), split['train_tokens'], cfg.total_batch_size)}",
        f"preflight | {resume}",
    ]


def records_note(meta: dict) -> str:
    """What the record files (JSONL, Parquet) gave: records kept, empty ones skipped; "" with none."""
    files = [s for s in meta.get("sources", []) if "records" in s]
    if not files:
        return ""
    kept, empty = sum(s["records"] for s in files), sum(s["empty_records"] for s in files)
    return f" | {kept:,} records from {len(files):,} record file(s), {empty:,} empty skipped"


def plan_regime(cfg: TrainConfig, unset: list[str], config: GPTConfig | None, gpu: guards.Gpu | None, world_size: int,
                train_tokens: int, run_dir: Path, resume_step: int | None, default_cap: float, log,
                teacher_flops: float) -> float:
    """The regime's settings where the pre-flight can know them (experiment/regime.py): a resume's from
    its checkpoint; a fresh run's on a GPU whose peak is known, from the predicted tok/s the trainer
    predicts too, a later generation's teachers (`teacher_flops` per token) priced in as the trainer
    prices them. Elsewhere the trainer measures. Returns the default pass cap: the regime's where it
    sets it (0: lifted, so the repeat guard leaves a run regularized for its passes alone)."""
    if resume_step is not None:
        regime.keep(cfg, unset, ckpt.read_meta(run_dir, resume_step)["train_config"])
    elif unset and config is not None and gpu is not None and gpu.peak is not None:
        passes, how = regime.estimate_passes(cfg, config, train_tokens, gpu, world_size, None, None, unset,
                                             teacher_flops)
        chosen = regime.fill(cfg, unset, passes, regime.is_taught(cfg, teacher_flops))
        log("preflight | " + regime.line(passes, chosen, how))
    return cfg.max_epochs if "max_epochs" in unset and cfg.max_epochs is not None else default_cap


def source_lines(cfg: TrainConfig, prepared: Prepared, weights: list[float] | None) -> list[str]:
    """Each source's weight and tokens, with a warning when there are many of them."""
    lines = [] if len(weights or []) <= MANY_SOURCES else [
        f"warning: {len(weights)} sources (each sub-directory of DATA_DIR is one, its top-level data files together "
        "another): each is evaluated at every eval and needs a DATA_MIX weight; put texts that belong together in "
        "one sub-directory"]
    for source, w in zip(prepared.meta.get("source_splits", []), weights or []):
        lines.append(f"preflight | source {source['name']} | weight {w:.3f}"
                     f"{' (DATA_MIX)' if cfg.data_mix else ' (by size)'} | {source['train'][1] - source['train'][0]:,} "
                     f"train, {source['val'][1] - source['val'][0]:,} val tokens")
    return lines


def wait_for_node0(plan_file: Path, started: float, wait_minutes: float, log) -> dict:
    """A node other than 0: wait until node 0's pre-flight has written a fresh plan."""
    deadline = started + wait_minutes * 60
    while True:
        if plan_file.is_file():
            plan = ckpt.read_json(plan_file)
            if plan.get("written_at", 0) >= started - PLAN_FRESH_SECONDS:
                return plan
        if time.time() > deadline:
            raise DataError(f"node 0's pre-flight did not finish within {wait_minutes:g} min ({plan_file} missing or "
                            "older than this launch): check that node 0 runs, that WORKSPACE is the same shared "
                            "directory on every node, and node 0's output")
        log(f"preflight | waiting for node 0 to prepare the data ({plan_file}), "
            f"{(time.time() - started) / 60:.1f} of {wait_minutes:g} min")
        time.sleep(WAIT_POLL_SECONDS)


def default_budget_warning(cfg: TrainConfig, world_size: int) -> str:
    """A GPU launch on CUDA's default budget: one GPU rented for an afternoon would pay for a day."""
    return (f"warning: neither TRAINING_HOURS nor BUDGET_USD is set: the GPU default of {cfg.training_hours:g} h "
            f"(${cfg.training_hours * cfg.gpu_hourly_usd * world_size:,.0f} on {world_size} GPU(s)) is the budget; "
            "set the hours or dollars you rent for (docs/one-gpu.md)")


def preflight(cfg: TrainConfig, world_size: int, node_rank: int, wait_minutes: float, log,
              gpu: guards.Gpu | None = None, shutdown_given: int = 0, nproc_per_node: int | None = None) -> dict:
    """Returns the plan ({"prepared": dir, "resume_step": step or None, "shutdown_timeout": s, ...});
    raises ConfigError, DataError or CheckpointError for a user's error. `gpu`: the GPU to plan for
    (the tests hand one in on a CPU); None: this machine's, if CUDA is what the run uses.
    `shutdown_given`: SHUTDOWN_TIMEOUT as the user set it, 0 if unset (guards.shutdown_timeout).
    `nproc_per_node`: ranks per node (None: all on this one), whose staged saves share its memory."""
    started = time.time()
    if gpu is None:
        try:
            gpu = guards.local_gpu() if resolve_device(cfg.device).type == "cuda" else None
        except ValueError as e:
            raise ConfigError(str(e)) from None
    default_budget = cfg.training_hours is None and cfg.budget_usd is None
    cfg = resolve(finetune.apply(cfg), gpu is not None, world_size)
    if gpu is not None and default_budget:
        log(default_budget_warning(cfg, world_size))
    check_ranks_per_gpu(cfg, gpu, nproc_per_node or world_size)
    workspace = Path(cfg.workspace) if cfg.workspace else default_workspace()
    run_dir = workspace / "checkpoints" / cfg.model_tag
    plan_file = workspace / "preflight" / f"{cfg.model_tag}.json"
    if node_rank > 0:
        return wait_for_node0(plan_file, started, wait_minutes, log)
    finetune.check_dir(cfg, run_dir)
    check_not_running(run_dir)  # before minutes of data preparation, not after
    top, launch_cfg = run_dir, cfg  # the launch's: its lock, its workers' logs, ON_EXIT's; its GENERATIONS
    if cfg.generations != 1:  # the checks and the plan are the next generation's (experiment/generations.py)
        gen_cfg, gen_dir, line = generations.pending(cfg, top, world_size)
        log(line)
        if gen_cfg is None:  # all done, or no budget left: nothing trains, so nothing to plan or guard
            plan = {"prepared": str(prepare_data(cfg, workspace, log).dir), "resume_step": None,
                    "world_size": world_size, "run_dir": str(top), "written_at": time.time(),
                    "shutdown_timeout": guards.shutdown_timeout(shutdown_given, None, log)}
            atomic_write_json(plan_file, plan)
            return plan
        cfg, run_dir = gen_cfg, gen_dir
    else:
        generations.check_layout(cfg, top)
    demo = uses_demo(cfg, workspace)
    prepared = prepare_data(cfg, workspace, log)
    weights = source_weights(prepared.meta, cfg.data_mix)
    resume_step = ckpt.pick_resume_step(run_dir, cfg.resume, log)
    unset = regime.left_unset(cfg)  # before the data's pass cap fills MAX_EPOCHS
    default_cap = fill_pass_cap(cfg, prepared, run_dir, resume_step, log)
    dollar_budget(cfg, run_dir, resume_step, world_size, log)
    depth, train_tokens = depth_for(cfg, run_dir, resume_step), prepared.meta["split"]["train_tokens"]
    if depth is None and gpu is not None:
        depth = guards.auto_depth(cfg, make_config(cfg, prepared), gpu, world_size, train_tokens,
                                  regime.regularizes(cfg, unset, train_tokens))
    config = model_config(dataclasses.replace(cfg, depth=depth), prepared) if depth else None
    rewind = start_checks(cfg, run_dir, resume_step, config, prepared)
    make = lambda d: model_config(dataclasses.replace(launch_cfg, depth=d), prepared)
    teacher_flops = guards.teacher_flops_ahead(launch_cfg, config, make, top) if config else 0.0
    default_cap = plan_regime(cfg, unset, config, gpu, world_size, train_tokens, run_dir, resume_step, default_cap, log,
                              teacher_flops)
    eval_prompt_ids(cfg, prepared)  # an EVAL_PROMPT the vocabulary cannot spell fails here, not at the first eval
    for line in plan_lines(cfg, prepared, config, world_size, resume_step, run_dir):
        log(line)
    if rewind is not None:
        log(f"preflight | the settings extend the annealed run: it goes back to step {rewind:06d}, its newest "
            "checkpoint from before the warmdown, and trains on to a new one")
    gpu_plan = (guards.gpu_plan(cfg, config, gpu, world_size, train_tokens, default_cap,
                                guards.teachers_ahead(launch_cfg, config, make, top), teacher_flops)
                if gpu and config else None)
    if gpu_plan:
        log(guards.plan_line(cfg, gpu_plan, world_size, gpu))
        log(guards.staging_line(cfg, gpu_plan, world_size, nproc_per_node or world_size, host_available_bytes()))
    if gpu is not None:
        guards.check(cfg, gpu_plan, demo, workspace, run_dir, resume=resume_step is not None)
        guards.generations_fit(launch_cfg, make, gpu, world_size, top)
    if config is not None and (gpu_plan is None or resume_step is not None):
        ckpt_bytes = (gpu_plan.checkpoint_bytes if gpu_plan
                      else checkpoint_bytes(config, world_size, 1 << 62, cfg.precision, cfg.average != "none"))
        if warning := guards.disk_warning(cfg, ckpt_bytes, run_dir):
            log(warning)
    for line in source_lines(cfg, prepared, weights):
        log(line)
    plan = {"prepared": str(prepared.dir), "resume_step": resume_step, "world_size": world_size,
            "run_dir": str(top), "shutdown_timeout": guards.shutdown_timeout(shutdown_given, gpu_plan, log),
            "written_at": time.time()}
    atomic_write_json(plan_file, plan)
    return plan


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiment.preflight", description=__doc__.split("\n")[0])
    parser.add_argument("--world_size", type=int, default=1, help="ranks the launch will start, all nodes")
    parser.add_argument("--nproc_per_node", type=int, default=None, help="ranks per node (default: world_size)")
    parser.add_argument("--node_rank", type=int, default=0, help="0 prepares; the others wait for its plan")
    parser.add_argument("--wait_minutes", type=float, default=120, help="how long a node > 0 waits for node 0")
    parser.add_argument("--plan_file", default=None, help="also write the plan (JSON) here, for the launcher")
    parser.add_argument("--shutdown_timeout", type=int, default=0, help="SHUTDOWN_TIMEOUT as set (0: unset)")
    args, train_argv = parser.parse_known_args(argv)
    cfg = parse_args(train_argv)
    try:
        plan = preflight(cfg, args.world_size, args.node_rank, args.wait_minutes, lambda msg: print(msg, flush=True),
                         shutdown_given=args.shutdown_timeout, nproc_per_node=args.nproc_per_node)
    except (ConfigError, DataError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    if args.plan_file:
        atomic_write_json(Path(args.plan_file), plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
