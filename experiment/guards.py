"""The pre-flight's plan on CUDA and its guards: the costly mistakes refused before the GPUs bill.

On CUDA the pre-flight predicts the run (gpu_plan): the depth (DEPTH=auto decides it here by the
same prediction the trainer uses), its tok/s, the passes over the data the budget buys, the hours
the run will train, one checkpoint's size and the disk that retention needs. Then the guards, each
a ConfigError (exit 2, after the plan line) unless ALLOW names it:

    demo    the run would train on the built-in demo data (the corpus is not where it looks)
    repeat  the run would repeat the training data more than the default cap (autosize.pass_cap: 8
            passes, more on data of few optimizer steps) because MAX_EPOCHS is set to 0 or above it
            with an explicit DEPTH: more than the data can use; the default stops there
    disk    the free space under WORKSPACE (plus what the run directory already holds, which
            retention replaces) is below the planned peak: KEEP_LAST + EXTRA_CHECKPOINTS (the
            best, the newest one from before the warmdown, the one being written)

And with GENERATIONS=N and a DEPTH set, generations_fit: every later generation fits beside its
teachers (no ALLOW: the trainer would refuse it at that generation's start).

They only decide, from what they are handed: the tests give them a CUDA-shaped config on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from experiment import autosize, generations
from experiment.config import ConfigError, TrainConfig
from experiment.files import volume
from experiment.hardware import DISK_WRITE_GBPS, link_gbps, peak_flops
from experiment.memory import (checkpoint_bytes, checkpoint_precision, choose_mode, count_params, host_average_bytes,
                               staged_bytes_per_rank)
from experiment.saver import HOST_STAGING_FRACTION

# Checkpoints on disk beside the newest KEEP_LAST at the peak: the best, the newest one from before the
# LR warmdown (kept for training longer: experiment/extend.py) and the one being written.
EXTRA_CHECKPOINTS = 3


@dataclass
class Gpu:
    name: str
    peak: float | None  # dense bf16 FLOP/s; None for a GPU hardware.py does not know
    memory_bytes: int


@dataclass
class GpuPlan:
    depth: int
    tok_per_s: float  # predicted, all GPUs
    budget_epochs: float  # passes over the training data the whole budget buys
    epochs: float  # the passes the run trains: the budget's, or MAX_EPOCHS when fewer
    default_cap: float  # the passes MAX_EPOCHS unset stops at (launch.default_pass_cap)
    hours: float  # the hours those take
    checkpoint_bytes: int
    staged_rank_bytes: int  # the largest rank's share staged in pinned host memory (background saves)
    disk_peak_bytes: int
    save_seconds: float  # the checkpoint at DISK_WRITE_GBPS: what a save takes, every rank into one volume
    host_average_bytes: int = 0  # the largest rank's weight average in host memory (too large for its GPU)


DEFAULT_SHUTDOWN_SECONDS = 300


def local_gpu(device: int | torch.device = 0) -> Gpu:
    """The GPU `device` as the plan and DEPTH=auto see it (the pre-flight's and the trainer's one lookup)."""
    name = torch.cuda.get_device_name(device)
    return Gpu(name, peak_flops(name), torch.cuda.get_device_properties(device).total_memory)


def auto_depth(cfg: TrainConfig, make_config, gpu: Gpu, world_size: int, train_tokens: int,
               regularized: bool) -> int | None:
    """The depth DEPTH=auto will build on these GPUs (the trainer predicts the same); None when the
    GPU's peak is unknown (the trainer then measures at start). A chain's first generation is sized
    for the chain (generations.sizes_chain; the later ones are given its depth: generations.chain_depth)."""
    if gpu.peak is None:
        return None
    chosen, _ = autosize.predict_and_choose(make_config, gpu.peak, world_size, gpu.memory_bytes,
                                            cfg.training_hours * 3600, train_tokens, link_gbps(gpu.name), gpu.name,
                                            cfg.total_batch_size, regularized, generations=generations.sizes_chain(cfg))
    return chosen.depth


def predicted_rate(cfg: TrainConfig, config, gpu: Gpu, world_size: int, teacher_flops: float = 0.0) -> float:
    """The tok/s the plan predicts for `config` on these GPUs (gpu.peak known), all GPUs together; a
    generation's teacher forward (`teacher_flops` per token) in its compute, as DEPTH=auto prices it."""
    precision = checkpoint_precision(config, world_size, gpu.memory_bytes, cfg.precision)
    return autosize.predicted_tok_per_s(config, gpu.peak, world_size, link_gbps(gpu.name),
                                        autosize.WEIGHT_BYTES[precision], cfg.total_batch_size, gpu_name=gpu.name,
                                        teacher_flops=teacher_flops)


def gpu_plan(cfg: TrainConfig, config, gpu: Gpu, world_size: int, train_tokens: int,
             default_cap: float, teachers: tuple[int, ...] = (0,), teacher_flops: float = 0.0) -> GpuPlan | None:
    """The plan line's and the guards' figures for `config`; `teachers`: the teachers' parameters
    beside it in each generation still to train (teachers_ahead); `teacher_flops`: the next one's
    teachers' forward, priced into its rate as the regime prices it. The weight average's host memory is
    the largest over them: it does not grow with the teachers (one can move the mode to bf16, where
    the average fits on the GPU again, and teachers that fit no mode leave nothing planned)."""
    if gpu.peak is None:
        return None
    average = cfg.average != "none"  # AVERAGE=auto counts it: the trainer's regime may turn it on
    precision = checkpoint_precision(config, world_size, gpu.memory_bytes, cfg.precision)
    rate = predicted_rate(cfg, config, gpu, world_size, teacher_flops)
    budget_epochs = rate * cfg.training_hours * 3600 / train_tokens
    assert cfg.max_epochs is not None, "the pass cap is set with the data (launch.fill_pass_cap)"
    epochs = min(budget_epochs, cfg.max_epochs or budget_epochs)
    ckpt = checkpoint_bytes(config, world_size, gpu.memory_bytes, cfg.precision, average)
    staged = max(staged_bytes_per_rank(config, world_size, precision, pinned=True, average=average))
    host_average = max(host_average_bytes(config, world_size, gpu.memory_bytes, cfg.precision, cfg.device_batch_size or 1,
                                          cfg.activation_checkpointing, t) for t in teachers) if average else 0
    return GpuPlan(config.depth, rate, budget_epochs, epochs, default_cap,
                   epochs * train_tokens / rate / 3600, ckpt, staged,
                   (cfg.keep_last + EXTRA_CHECKPOINTS) * ckpt, ckpt / (DISK_WRITE_GBPS * 1e9), host_average)


def teachers_ahead(launch_cfg: TrainConfig, config, make_config, top: Path) -> tuple[int, ...]:
    """The teachers' parameters beside `config`, the next generation's model, in each generation of the
    launch still to train with that model (the generations, or the STUDENT_DEPTH student when it is
    next; a later student is another model, of its own depth, not counted). One model: (0,). A student after
    DEPTH=auto's generations: (0,), their depth is not known here."""
    ahead = generations.ahead(launch_cfg, top)
    pending_student = ahead[0][1] if ahead else False
    teacher = teacher_config(launch_cfg, config, make_config, pending_student)
    if teacher is None:
        return (0,)
    params = count_params(teacher)
    return tuple(n * params for _, is_student, n in ahead if is_student == pending_student) or (0,)


def teacher_config(launch_cfg: TrainConfig, config, make_config, student: bool):
    """The model a generation's teachers are, as the pre-flight can know it: the run's DEPTH, else
    `config`, the next generation's own (DEPTH=auto); None for a student after DEPTH=auto's
    generations, whose depth is not known here."""
    if isinstance(launch_cfg.depth, int):
        return make_config(launch_cfg.depth)
    return None if student else config


def teacher_flops_ahead(launch_cfg: TrainConfig, config, make_config, top: Path) -> float:
    """The forward FLOPs per token of the next generation's teachers (its teachers' count at
    teacher_config's depth; Teacher.flops_per_token), for the pre-flight's regime and plan lines: the
    trainer prices the same into its passes. 0 for one model or a first generation, and for a student
    after DEPTH=auto's generations. Under DEPTH=auto the teachers are taken at the next generation's
    depth: a chain's (chain_depth); elsewhere each generation chose its own, so the figure is an estimate."""
    ahead = generations.ahead(launch_cfg, top)
    teacher = teacher_config(launch_cfg, config, make_config, ahead[0][1]) if ahead else None
    return ahead[0][2] * autosize.flops_per_token(teacher) / 3 if teacher else 0.0


def generations_fit(cfg: TrainConfig, make_config, gpu: Gpu, world_size: int, top: Path) -> None:
    """GENERATIONS with an explicit DEPTH: every later generation holds its teachers beside it (the one
    before it, or with TEACHER=ensemble all before it; a STUDENT_DEPTH student all N). One that fits
    these GPUs in no memory mode is refused now, before the generations before it spend their shares
    (the trainer would find it only at that generation's start). The generations of the run in `top`
    that are done are not checked again. GENERATIONS=auto: its second generation (one teacher), and
    a STUDENT_DEPTH student once it is next (every generation of the chain teaches it); an
    ensemble's later ones, and a student not yet known to be next, are checked at their start.
    DEPTH=auto picks a depth that fits beside its teacher itself (a chain's first generation, one
    that holds a teacher of its size: autosize.holds_own_teacher; a STUDENT_DEPTH student beside
    DEPTH=auto's is checked at its start). make_config(depth): the model config of that depth."""
    n = cfg.generations
    if n == 1 or not isinstance(cfg.depth, int):
        return
    params = count_params(make_config(cfg.depth))
    ahead = generations.ahead(cfg, top)
    for k, is_student, held in ahead:
        if k == 1 or (n == "auto" and k > 2 and not (is_student and k == ahead[0][0])):
            continue
        model = make_config(cfg.student_depth if is_student else cfg.depth)
        name = f"the student (d{model.depth})" if is_student else f"generation {k}"
        teachers = params * held
        if choose_mode(model, world_size, cfg.device_batch_size or 1, model.max_seq_len, gpu.memory_bytes,
                       cfg.precision, cfg.activation_checkpointing, teachers) is None:
            raise ConfigError(f"GENERATIONS={n}: {name} holds d{model.depth} and {teachers:,} parameters of teachers "
                              f"on each GPU, which fit {gpu.memory_bytes / 2**30:.0f} GiB on {world_size} ranks in no "
                              "memory mode: set a smaller DEPTH (or DEPTH=auto), "
                              + ("TEACHER=previous, " if teachers > params and not is_student else "")
                              + ("a smaller STUDENT_DEPTH, " if is_student else "")
                              + ("GENERATIONS=1" if n == "auto" else "fewer GENERATIONS")
                              + ", or more GPUs (docs/training.md, generations)")


def shutdown_timeout(given: int, p: GpuPlan | None, log) -> int:
    """The seconds torchrun waits after forwarding a stop signal before SIGKILL: SHUTDOWN_TIMEOUT as
    given (with a warning when the predicted preemption save does not fit in it), else enough for
    twice that save plus a minute, at least DEFAULT_SHUTDOWN_SECONDS. The save is the whole
    checkpoint at DISK_WRITE_GBPS: the ranks write their shares at once, into one network volume."""
    need = 2 * p.save_seconds + 60 if p else 0
    if given:
        if p and given < p.save_seconds:
            log(f"warning: a preemption save takes about {p.save_seconds:.0f} s ({p.checkpoint_bytes / 1e9:.1f} GB at "
                f"{DISK_WRITE_GBPS} GB/s), more than SHUTDOWN_TIMEOUT={given}: a preemption would lose "
                f"the steps since the last checkpoint; leave SHUTDOWN_TIMEOUT unset (it is then "
                f"{max(DEFAULT_SHUTDOWN_SECONDS, int(need + 1))} s)")
        return given
    return max(DEFAULT_SHUTDOWN_SECONDS, int(need + 1))


def plan_line(cfg: TrainConfig, p: GpuPlan, world_size: int, gpu: Gpu) -> str:
    unspent = cfg.training_hours - p.hours
    rest = "left to the next generation" if cfg.generations == "auto" else f"of the {cfg.training_hours:g}h budget unspent"
    stop = (f"stops after {p.epochs:g} passes at {p.hours:.2f}h, {unspent:.2f}h (${unspent * cfg.gpu_hourly_usd * world_size:,.0f}) "
            f"{rest}" if p.epochs < p.budget_epochs - 1e-9
            else f"trains the whole {cfg.training_hours:g}h budget, {p.epochs:.1f} passes over the data"
            + (" (less if the stop at the val minimum ends it)" if cfg.plateau_evals else ""))
    _, source, measured_on = autosize.mfu_table(gpu.name)
    return (f"preflight | plan d{p.depth}: {p.tok_per_s:,.0f} tok/s PREDICTED on {world_size} x {gpu.name} (MFU "
            f"measured on {measured_on}, {source}) | {stop} | checkpoint {p.checkpoint_bytes / 1e9:.1f} GB, "
            f"disk peak {p.disk_peak_bytes / 1e9:.1f} GB, a save about {p.save_seconds:.0f} s at {DISK_WRITE_GBPS} GB/s")


def staging_line(cfg: TrainConfig, p: GpuPlan, world_size: int, nproc_per_node: int, available: int) -> str:
    """Whether saves can write in the background: this node's ranks stage their checkpoint shares in
    host memory, which must hold them within saver.HOST_STAGING_FRACTION of what is available (the
    trainer checks the same at start and otherwise saves blocking), counted as the pinned allocator
    takes it (each buffer rounded up to a power of two). A weight average too large for the GPUs lives
    in host memory too, from the first step: the trainer measures what is available after it, so
    it is counted here as taken."""
    average = p.host_average_bytes * nproc_per_node
    held = f", beside the weight average's {average / 1e9:.1f} GB there" if average else ""
    if average > available:
        return (f"warning: the weight average ({average / 1e9:.1f} GB on this node, too large for the GPUs) does not "
                f"fit in the {available / 1e9:.1f} GB of host memory available: AVERAGE=none trains without it")
    available -= average
    need = p.staged_rank_bytes * nproc_per_node
    if not cfg.async_save:
        return f"preflight | saves block training (ASYNC_SAVE=0): about {p.save_seconds:.0f} s each"
    if need > HOST_STAGING_FRACTION * available:
        return (f"warning: background saves would stage {need / 1e9:.1f} GB of checkpoint in this node's host memory"
                f"{held}, more than {HOST_STAGING_FRACTION:g} x the {max(available, 0) / 1e9:.1f} GB left available: "
                f"every save will block training for about {p.save_seconds:.0f} s")
    return (f"preflight | saves write in the background: {need / 1e9:.1f} GB staged in host memory per node{held} "
            f"({available / 1e9:.0f} GB available); training waits only for the copy")


def check(cfg: TrainConfig, p: GpuPlan | None, demo: bool, workspace: Path, run_dir: Path, resume: bool = False) -> None:
    """ConfigError naming every guard that fails and is not in ALLOW, each with its way out. The disk
    guard refuses a fresh run only: a resume hears it as a warning (disk_warning)."""
    allowed = set(filter(None, cfg.allow.split(",")))
    errors = []
    if demo and "demo" not in allowed:
        errors.append(f"no data files in {workspace / 'data'}: this would train on the built-in demo data; put the "
                      "corpus there or set DATA_DIR (ALLOW=demo trains on the demo)")
    if p is not None and p.default_cap and p.epochs > p.default_cap + 1e-9 and "repeat" not in allowed:
        errors.append(f"d{p.depth} would see the training data {p.epochs:.1f} times in the {cfg.training_hours:g}h "
                      f"budget (predicted), past {p.default_cap:g} (repeated data is worth less and less); leave "
                      f"MAX_EPOCHS unset (it then stops at {p.default_cap:g}), use DEPTH=auto, fewer TRAINING_HOURS, or "
                      "ALLOW=repeat")
    if p is not None and "disk" not in allowed and not resume and (short := disk_shortfall(cfg, p.checkpoint_bytes,
                                                                                           run_dir)):
        errors.append(short + "; free space, lower KEEP_LAST, or ALLOW=disk")
    if errors:
        raise ConfigError("; and ".join(errors))


def disk_shortfall(cfg: TrainConfig, checkpoint_bytes: int, run_dir: Path) -> str | None:
    """Why the volume cannot hold the planned peak (KEEP_LAST + EXTRA_CHECKPOINTS),
    counting what the run directory holds now (retention replaces it); None when it can."""
    mount, free = volume(run_dir)  # the run directory's own volume (it may be a mount of its own)
    peak, free = (cfg.keep_last + EXTRA_CHECKPOINTS) * checkpoint_bytes, free + held_bytes(run_dir)
    if free >= peak:
        return None
    return (f"the volume {mount} of {run_dir} has {free / 1e9:.3g} GB free (with what {Path(run_dir).name} holds now), below the planned "
            f"peak {peak / 1e9:.3g} GB ({cfg.keep_last} + {EXTRA_CHECKPOINTS} checkpoints of {checkpoint_bytes / 1e9:.3g} GB)")


def disk_warning(cfg: TrainConfig, checkpoint_bytes: int, run_dir: Path) -> str | None:
    """The disk guard where it does not refuse (a resume, a CPU run): the line to print, if any."""
    short = disk_shortfall(cfg, checkpoint_bytes, run_dir)
    return short and (f"warning: {short}: a save that finds the volume full fails and training goes on, but a final "
                      "one ends the run; free space or lower KEEP_LAST")


def held_bytes(run_dir: Path) -> int:
    """What the run directory holds now: retention deletes its old checkpoints as new ones come."""
    return sum(f.stat().st_size for f in Path(run_dir).glob("*") if f.is_file()) if Path(run_dir).is_dir() else 0
