"""Per-GPU memory plan of a training configuration, computed before anything is allocated.

Parameter shapes come from the model built on the meta device; ownership from the same partition
the ZeRO-1 optimizer uses (the most loaded rank decides); activation counts from a measurement.
The trainer uses the plan to pick the precision mode and activation checkpointing; `python -m
experiment.tools.bench plan` prints it, and `bench fitprobe` measures the truth on one GPU.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from experiment.average import WeightAverage
from experiment.config import ConfigError
from experiment.distributed import Dist
from experiment.model import GPT, GPTConfig
from experiment.optim import ShardedOptimizer, partition, uses_muon
from experiment.step import forward_backward

# Elements autograd saves for one forward pass, measured on CPU with saved_tensors_hooks over six
# shapes (exact least-squares fit, relative error < 1e-5):
#   19 x layers x B*T*d + 3 x layers x B*heads*T + 3 x B*T*d + 1 x B*T*vocab + 4 x B*T
ACT_LAYER_BTD, ACT_LAYER_BHT, ACT_OUTSIDE_BTD, ACT_HEAD_BTV, ACT_BT = 19, 3, 3, 1, 4
# Measured on one H100 80GB (gpucheck, torch 2.11, reports/gpucheck-h100.md): 0.76 GiB sits outside
# PyTorch's allocator (CUDA context, library workspaces); on top of the rows above, compiled d12-d32
# steps reserved up to 10.5% more (activations that inductor keeps, allocator rounding and cache).
# 0.75 GiB + 11% puts every measured configuration at or under its plan: d12-d32 +0.4..+8%, d64
# with recompute as rank 0 of 8 +11..+19% (its batch-4 plan, 80.0 GiB, says no though 67.5 fit).
OVERHEAD_FIXED_BYTES = int(0.75 * 2**30)
OVERHEAD_FRACTION = 0.11
# NCCL's own buffers on each GPU once the process group's collectives ran, outside PyTorch's
# allocator and so invisible to the device-batch probe, which runs before the first large
# all-reduce: about 1.6 GB for one communicator after an all-reduce (NVIDIA/nccl#864), 1.06 GB on
# 8 x H100 (NVIDIA/nccl#1685). Not measured here; the larger figure, rounded up.
NCCL_BUFFER_BYTES = int(1.6e9)
MODES = (("fp32", False), ("bf16", False), ("fp32", True), ("bf16", True))  # cheapest compute first


@dataclass(frozen=True)
class MemoryPlan:
    precision: str  # "fp32": fp32 weights and grads; "bf16": bf16 weights and grads + fp32 masters
    activation_checkpointing: bool
    rows: dict[str, int]  # bytes per GPU: weights, grads, fp32 masters, optimizer state, activations, overhead
    teacher_params: int = 0  # a generation's teacher, counted in rows["teacher"]

    @property
    def total(self) -> int:
        return sum(self.rows.values())

    def fits(self, gpu_bytes: int) -> bool:
        return self.total <= gpu_bytes


def param_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    return dict(_param_shapes(config))


@functools.lru_cache(maxsize=256)
def _param_shapes(config: GPTConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    # Building a GPT, even on the meta device, takes ~0.1 s at d64; plan asks for the same
    # configurations a hundred times (GPTConfig is frozen, so it keys the cache).
    with torch.device("meta"):
        return tuple((n, tuple(p.shape)) for n, p in GPT(config).named_parameters())



def count_params(config: GPTConfig) -> int:
    """Parameters of a model of this config, from its shapes alone (nothing allocated)."""
    return sum(math.prod(s) for s in param_shapes(config).values())

def activation_bytes(config: GPTConfig, batch: int, seq: int, activation_checkpointing: bool, elem_bytes: int) -> int:
    """Saved activations of one micro-batch. With activation checkpointing, a block keeps only its input and
    one block at a time is recomputed in backward. Logits and the loss are fp32 (4 bytes)."""
    bt, d, heads, layers = batch * seq, config.n_embd, config.n_head, config.n_layer
    block = (ACT_LAYER_BTD * bt * d + ACT_LAYER_BHT * batch * heads * seq) * elem_bytes
    outside = ACT_OUTSIDE_BTD * bt * d * elem_bytes + ACT_HEAD_BTV * bt * config.vocab_size * 4 + ACT_BT * bt * 8
    if activation_checkpointing:
        return layers * bt * d * elem_bytes + block + outside
    return layers * block + outside


def plan_memory(config: GPTConfig, world_size: int, batch: int, seq: int, precision: str,
                activation_checkpointing: bool, cuda: bool = True, collectives: bool | None = None,
                average: bool = False, teacher_params: int = 0) -> MemoryPlan:
    """Bytes per GPU of the most loaded rank. The gradients are DDP's all-reduce buckets themselves
    (wrap_ddp makes them views), so DDP adds no copy; `collectives` (default: CUDA with more than
    one rank) adds NCCL's buffers. A simulated world (the fit probe) makes no collectives. `average`
    (AVERAGE=ema) adds the fp32 weight average of the owned parameters. `teacher_params`: a later
    generation's frozen teacher (experiment/teacher.py), whole on every rank, in bf16 on CUDA (as
    Teacher.load loads it) and fp32 on CPU, and three fp32 tensors of the logits' size: the teacher's
    probabilities and the student's log-probabilities at the temperature, which the distillation term
    (model.distillation_loss) keeps through the backward, and its one product. The teacher's own
    forward (no grad) comes before the student's activations exist and needs less than they do."""
    if collectives is None:
        collectives = cuda and world_size > 1
    shapes = param_shapes(config)
    sizes = {n: math.prod(s) for n, s in shapes.items()}
    owner = partition(sizes, world_size)
    # The most loaded rank decides whether the configuration fits.
    owned = max(([n for n in sizes if owner[n] == r] for r in range(world_size)),
                key=lambda names: sum(sizes[n] for n in names))
    n_params = sum(sizes.values())
    n_owned = sum(sizes[n] for n in owned)
    n_muon = sum(sizes[n] for n in owned if uses_muon(n, shapes[n]))
    weight_bytes = 2 if precision == "bf16" else 4
    rows = {
        "weights": n_params * weight_bytes,
        "grads": n_params * weight_bytes,
        # the fp32 copy of owned parameters, and its fp32 gradient while the optimizer steps
        "fp32 masters": 2 * 4 * n_owned if precision == "bf16" else 0,
        # Muon: one fp32 momentum buffer; AdamW: two fp32 moments
        "optimizer state": 4 * n_muon + 8 * (n_owned - n_muon),
        # on CUDA, autocast keeps activations in bf16 in both modes; CPU training is fp32
        "activations": activation_bytes(config, batch, seq, activation_checkpointing, 2 if cuda else 4),
        "NCCL buffers": NCCL_BUFFER_BYTES if collectives else 0,
    }
    if average:  # fp32, and its cast to the weights' dtype while a save copies it out
        rows["weight average"] = 4 * n_owned + (2 * n_owned if precision == "bf16" else 0)
    if teacher_params:
        rows["teacher"] = teacher_params * (2 if cuda else 4) + 3 * 4 * batch * seq * config.vocab_size
    rows["overhead"] = (OVERHEAD_FIXED_BYTES if cuda else 0) + int(OVERHEAD_FRACTION * sum(rows.values()))
    return MemoryPlan(precision, activation_checkpointing, rows, teacher_params)


def share_tensors(config: GPTConfig, world: int, precision: str, average: bool = False):
    """Per parameter: (the rank that owns it, the bytes of its model-part tensor in the weights'
    dtype, the bytes of its optimizer-shard tensors: fp32 master, then Muon momentum or AdamW's two
    moments, then with `average` the fp32 weight average). What checkpoint_bytes_per_rank and
    staged_bytes_per_rank count."""
    shapes = param_shapes(config)
    owner = partition({n: math.prod(sh) for n, sh in shapes.items()}, world)
    weight = 2 if precision == "bf16" else 4
    for n, sh in shapes.items():
        size = math.prod(sh)
        yield owner[n], size * weight, [4 * size] * ((2 if uses_muon(n, sh) else 3) + average)


def checkpoint_bytes_per_rank(config: GPTConfig, world: int, precision: str,
                              average: bool = False) -> list[tuple[int, int]]:
    """(model part, optimizer shard) bytes each rank writes per checkpoint when the model is saved in
    per-rank parts: its parameters in the weights' dtype; fp32 master + Muon momentum or AdamW moments."""
    part, shard = [0] * world, [0] * world
    for rank, weights, optimizer in share_tensors(config, world, precision, average):
        part[rank] += weights
        shard[rank] += sum(optimizer)
    return list(zip(part, shard))


def pinned_block_bytes(nbytes: int) -> int:
    """What torch's pinned host allocator (CachingHostAllocator) takes for a block of `nbytes`: it
    rounds every request up to a power of two, so a 768 x 768 fp32 matrix (2.36 MB) takes 4.19 MB."""
    return 1 << max(nbytes - 1, 0).bit_length() if nbytes > 0 else 0


def staged_bytes_per_rank(config: GPTConfig, world: int, precision: str, pinned: bool,
                          average: bool = False) -> list[int]:
    """Host memory each rank's staged checkpoint share takes (experiment/saver.py, HostBuffers): one
    buffer per tensor of checkpoint_bytes_per_rank's files, each rounded up as the pinned allocator
    does when `pinned` (CUDA), else exact. The RNG states and AdamW's step counters are left out (bytes)."""
    block = pinned_block_bytes if pinned else (lambda n: n)
    staged = [0] * world
    for rank, weights, optimizer in share_tensors(config, world, precision, average):
        staged[rank] += block(weights) + sum(map(block, optimizer))
    return staged


def checkpoint_bytes(config: GPTConfig, world: int, gpu_bytes: int, precision: str = "auto",
                     average: bool = False) -> int:
    """One checkpoint's bytes, all ranks together, in the precision the memory plan picks at one
    sequence per micro-batch (bf16 when nothing fits)."""
    return sum(part + shard for part, shard in checkpoint_bytes_per_rank(config, world, checkpoint_precision(
        config, world, gpu_bytes, precision), average))


def checkpoint_precision(config: GPTConfig, world: int, gpu_bytes: int, precision: str = "auto") -> str:
    """The weights' precision the memory plan picks at one sequence per micro-batch (bf16 when nothing fits)."""
    mode = choose_mode(config, world, 1, config.max_seq_len, gpu_bytes, precision)
    return mode.precision if mode else ("bf16" if precision == "auto" else precision)


def choose_mode(config: GPTConfig, world_size: int, batch: int, seq: int, gpu_bytes: int,
                precision: str = "auto", activation_checkpointing: str = "auto",
                teacher_params: int = 0) -> MemoryPlan | None:
    """The cheapest mode (fp32 before bf16, no recompute before recompute) that fits, honouring
    any setting that is not "auto"; None if nothing fits."""
    for p, c in MODES:
        if precision not in ("auto", p) or activation_checkpointing not in ("auto", "on" if c else "off"):
            continue
        plan = plan_memory(config, world_size, batch, seq, p, c, teacher_params=teacher_params)
        if plan.fits(gpu_bytes):
            return plan
    return None


def host_average_bytes(config: GPTConfig, world: int, gpu_bytes: int, precision: str = "auto", batch: int = 1,
                       activation_checkpointing: str = "auto", teacher_params: int = 0) -> int:
    """The largest rank's host memory for AVERAGE=ema's fp32 average when it does not fit on the GPU
    beside the mode the plan picks at device batch `batch` (place_average's rule), else 0; with a
    generation's teachers (`teacher_params`) on the GPU beside it, as the trainer plans them."""
    mode = choose_mode(config, world, batch, config.max_seq_len, gpu_bytes, precision, activation_checkpointing,
                       teacher_params)
    if mode is None or plan_memory(config, world, batch, config.max_seq_len, mode.precision,
                                   mode.activation_checkpointing, average=True,
                                   teacher_params=teacher_params).fits(gpu_bytes):
        return 0
    sizes = {n: math.prod(s) for n, s in param_shapes(config).items()}
    owner = partition(sizes, world)
    return max(4 * sum(size for n, size in sizes.items() if owner[n] == r) for r in range(world))


def format_plan(plans: list[MemoryPlan], gpu_bytes: int) -> str:
    gib = 2**30
    names = [p.precision + (" +ckpt" if p.activation_checkpointing else "") for p in plans]
    head = f"{'':18s}" + "".join(f"{name:>14s}" for name in names)
    lines = [head]
    for row in plans[0].rows:
        lines.append(f"{row:18s}" + "".join(f"{p.rows[row] / gib:13.1f}G" for p in plans))
    lines.append(f"{'total':18s}" + "".join(f"{p.total / gib:13.1f}G" for p in plans))
    lines.append(f"{'fits ' + f'{gpu_bytes / gib:.0f}G':18s}"
                 + "".join(f"{'yes' if p.fits(gpu_bytes) else 'NO':>14s}" for p in plans))
    return "\n".join(lines)


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


def probe_reserve_bytes(plan: MemoryPlan) -> int:
    """What the device-batch probe (one eager forward+backward of the bare model, before the first
    optimizer step and the first large all-reduce) cannot see and must hold back: the optimizer
    state, the fp32 master gradients and NCCL's buffers. (Its gradients are the size of DDP's
    buckets, which they become.) The plan's overhead row covers what compiling changes."""
    return plan.rows["optimizer state"] + plan.rows["fp32 masters"] // 2 + plan.rows["NCCL buffers"]


def find_device_batch(model: GPT, seq_len: int, per_rank: int, d: Dist, reserve_bytes: int, teacher=None) -> int:
    """Largest power-of-two micro-batch whose forward+backward fits next to `reserve_bytes`
    (probe_reserve_bytes), agreed across ranks (min), and dividing `per_rank`, the sequences per
    rank per optimizer step. With a teacher (experiment/teacher.py) the step the probe tries holds
    its probabilities and the distillation loss, as the generation's steps will."""
    def try_batch(b: int) -> None:
        reserve = None
        try:
            reserve = torch.empty(reserve_bytes, dtype=torch.uint8, device=d.device)
            x = torch.zeros(b, seq_len, dtype=torch.long, device=d.device)
            if teacher is None:
                forward_backward(model, x, x)
            else:
                forward_backward(model, x, x, teacher=teacher.probs(x))
        finally:
            del reserve
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()

    b = largest_fitting_batch(try_batch, 1 << (min(per_rank, 256).bit_length() - 1))
    b = int(d.all_reduce(torch.tensor([b], device=d.device), "min").item())
    if b < 1:
        raise ConfigError("not even device_batch_size 1 fits in GPU memory; lower --depth or --max_seq_len "
                          "(python -m experiment.tools.bench plan shows where the memory goes)")
    while per_rank % b:
        b //= 2
    return b


def choose_memory_mode(model_config: GPTConfig, batch: int, precision: str, activation_checkpointing: str,
                       d: Dist, teacher_params: int = 0) -> MemoryPlan | None:
    """On CUDA, "auto" settings take the cheapest mode the memory plan says fits this GPU at device
    batch `batch` (with a generation's teacher beside the model); on CPU, "auto" is fp32 without
    recompute (returns None: no plan)."""
    if d.device.type != "cuda":
        return None
    gpu_bytes = torch.cuda.get_device_properties(d.device).total_memory
    seq = model_config.max_seq_len
    plan = choose_mode(model_config, d.world_size, batch, seq, gpu_bytes, precision, activation_checkpointing,
                       teacher_params)
    if plan is None:
        plans = [plan_memory(model_config, d.world_size, batch, seq, p, c, teacher_params=teacher_params)
                 for p, c in MODES]
        raise ConfigError(f"d{model_config.depth} with device batch {batch}"
                          + (f" and its teacher ({teacher_params:,} params)" if teacher_params else "")
                          + f" does not fit {gpu_bytes / 2**30:.0f} GiB per GPU on {d.world_size} ranks in any mode "
                          f"allowed:\n{format_plan(plans, gpu_bytes)}")
    return plan


def memory_line(plan: MemoryPlan | None, precision: str, activation_checkpointing: bool, batch: int, d: Dist) -> str:
    """The trainer's memory line: the mode, and on CUDA what the plan counted."""
    gpu_gib = torch.cuda.get_device_properties(d.device).total_memory / 2**30 if plan else 0
    return (f"memory | weights {precision}" + (" with fp32 master shards" if precision == "bf16" else "")
            + f" | activation checkpointing {'on' if activation_checkpointing else 'off'}"
            + (f" | planned {plan.total / 2**30:.1f} GiB of {gpu_gib:.1f} GiB per GPU at device batch {batch}"
               + (f" (its teacher {plan.rows['teacher'] / 2**30:.1f} GiB)" if "teacher" in plan.rows else "")
               if plan else ""))


HOST_AVERAGE_EVERY = 10  # steps between folds of a weight average kept in host memory (place_average)


def place_average(width: float, batch: int, model_config: GPTConfig, plan: MemoryPlan | None, d: Dist,
                  opt: ShardedOptimizer, log) -> WeightAverage:
    """AVERAGE=ema's average: on the GPU when the plan's mode still fits with it at device batch
    `batch`, folded in at every step; else in host memory, folded in every HOST_AVERAGE_EVERY steps
    (a copy of the owned weights across PCIe: d64 on 8 x 80 GB has no room for it). It never changes
    the mode training takes. `plan` None (CPU): beside the weights."""
    on_device = plan is None or plan_memory(
        model_config, d.world_size, batch, model_config.max_seq_len, plan.precision, plan.activation_checkpointing,
        average=True, teacher_params=plan.teacher_params).fits(torch.cuda.get_device_properties(d.device).total_memory)
    where = "beside the weights" if on_device else f"in host memory, folded in every {HOST_AVERAGE_EVERY} steps"
    owned = 4 * sum(t.numel() for t in opt.target.values())
    log(f"average | ema of the last {width:g} of the steps, {where} ({owned / 1e9:.2f} GB on this rank)")
    return (WeightAverage(opt, width) if on_device
            else WeightAverage(opt, width, torch.device("cpu"), HOST_AVERAGE_EVERY))
