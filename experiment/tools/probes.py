"""Measurements on the machine at hand, shared by `bench` and `gpucheck`: the CPU's matmul peak, the
peak GPU memory of rank 0 of a simulated world, and the speed of a (compiled) training step.

Nothing here is asserted in tests; callers print or report the numbers.
"""

from __future__ import annotations

import math
import time

import torch

from experiment.distributed import sync
from experiment.hardware import free_memory, mean_seconds
from experiment.model import DTYPES, GPTConfig, build_model
from experiment.optim import LRS, ShardedOptimizer
from experiment.step import forward_backward, optimizer_step


def probe_peak_memory(config: GPTConfig, world: int, batch: int, seq: int, precision: str,
                      activation_checkpointing: bool, device: torch.device, steps: int = 3) -> dict | None:
    """Peak bytes on the GPU ({"allocated", "reserved"} by the caching allocator) of `steps` training
    steps of rank 0 in a simulated world; None on CPU."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(config, device, DTYPES[precision], draw_on_device=True,
                        activation_checkpointing=activation_checkpointing)
    opt = ShardedOptimizer(model, 0, world, **LRS, master_weights=precision == "bf16", communicate=False)
    try:
        for _ in range(steps):
            x = torch.randint(0, config.vocab_size, (batch, seq), device=device)
            forward_backward(model, x, x)
            optimizer_step(model, opt)
        if cuda:
            torch.cuda.synchronize(device)
            return {"allocated": torch.cuda.max_memory_allocated(device),
                    "reserved": torch.cuda.max_memory_reserved(device)}
        return None
    finally:
        del model, opt
        free_memory(device)


def cpu_matmul_peak(n: int = 1024, reps: int = 20) -> float:
    """Best fp32 FLOP/s of an n x n matmul on this CPU with torch's current thread count."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def compose_step(micro_tokens: int, tokens_per_step: int, first: float, micro_s: float, steady: float,
                 queued: float) -> dict:
    """A step of tokens_per_step tokens from measured parts: grad_accum micro-steps, then the
    optimizer and its host syncs (a synced one-micro-step step minus a micro-step)."""
    accum = max(tokens_per_step // micro_tokens, 1)
    optimizer_s = max(steady - micro_s, 0.0)
    step_s = accum * micro_s + optimizer_s
    return {"first_step_s": first, "micro_s": micro_s, "optimizer_s": optimizer_s,
            "host_overhead_ms": 1000 * max(steady - queued, 0.0), "grad_accum": accum, "step_s": step_s,
            "tok_per_s": accum * micro_tokens / step_s, "micro_tok_per_s": micro_tokens / micro_s}


def measure_speed(config: GPTConfig, batch: int, precision: str, activation_checkpointing: bool, device: torch.device,
                  steps: int, compile_model: bool, tokens_per_step: int) -> dict:
    """One rank's training step as the trainer runs it (autocast, Muon/AdamW, bf16 weights with fp32
    masters if asked), on random tokens, measured in parts: the first step (compile included); a
    micro-step (forward + backward) in a queue of micro-steps; a step of one micro-step with the
    optimizer and the trainer's two host syncs (the finite-gradient check, the flags read); the same
    with no sync in a queue (the difference is what the syncs cost). A step of `tokens_per_step`
    tokens is grad_accum micro-steps plus one optimizer step and its syncs; its tok/s is composed
    from those measured parts. Peak memory (allocated, reserved) on CUDA."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(config, device, DTYPES[precision], draw_on_device=True,
                        activation_checkpointing=activation_checkpointing)
    opt = ShardedOptimizer(model, **LRS, master_weights=precision == "bf16")
    run = torch.compile(model) if compile_model else model
    x = torch.randint(0, config.vocab_size, (batch, config.max_seq_len), device=device)
    flags = torch.zeros(4, dtype=torch.int32, device=device)

    def micro() -> None:
        forward_backward(run, x, x)

    def step(host_syncs: bool) -> None:
        micro()
        optimizer_step(model, opt, check_finite=host_syncs)  # the finite-gradient check: host sync 1
        if host_syncs:
            flags.tolist()  # the trainer's per-step decision flags: host sync 2

    try:
        first = mean_seconds(device, 1, step, True)
        mean_seconds(device, 2, step, True)  # allocator and autotuning warm-up
        micro_s = mean_seconds(device, steps, micro)
        model.zero_grad(set_to_none=True)
        steady, queued = mean_seconds(device, steps, step, True), mean_seconds(device, steps, step, False)
        out = compose_step(batch * config.max_seq_len, tokens_per_step, first, micro_s, steady, queued)
        out.update(flops_per_token=model.estimate_flops(config.max_seq_len), params=model.num_params())
        if device.type == "cuda":
            out.update(peak_allocated=torch.cuda.max_memory_allocated(device),
                       peak_reserved=torch.cuda.max_memory_reserved(device))
        return out
    finally:
        del model, opt, run
        torch._dynamo.reset()  # compiled graphs hold the model: let the next size have the memory
        free_memory(device)


def profile_step(config: GPTConfig, batch: int, precision: str, device: torch.device, rows: int = 15) -> str:
    """torch.profiler table of one eager training step after a warm-up step (kernels by self time)."""
    from torch.profiler import ProfilerActivity, profile

    model = build_model(config, device, DTYPES[precision], draw_on_device=True)
    opt = ShardedOptimizer(model, **LRS, master_weights=precision == "bf16")
    x = torch.randint(0, config.vocab_size, (batch, config.max_seq_len), device=device)

    def step():
        forward_backward(model, x, x)
        optimizer_step(model, opt)

    try:
        step()
        sync(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            step()
            sync(device)
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)
    finally:
        del model, opt
        free_memory(device)
