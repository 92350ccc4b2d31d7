"""`bench profile`: where one training step's time goes, on the trainer's own step shape.

    python -m experiment.tools.bench profile [--depth 4 --aspect_ratio 32 --head_dim 64 --seq 256 --batch 16]

A step is what the trainer runs: grad_accum micro-steps of forward + backward, each followed by the
next batch cut from a token array by the trainer's own TokenBatches, then the optimizer step (Muon +
AdamW through ShardedOptimizer). torch.profiler records `--steps` such steps after warm-up; each
aten op's self time goes to one bucket by its name, the optimizer and data regions by where they
ran, and the wall time during which no op runs is host overhead (Python, dispatch, allocation),
measured as the gaps on the profiler's timeline.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from experiment.batches import TokenBatches
from experiment.model import GPTConfig, build_model
from experiment.optim import LRS, ShardedOptimizer
from experiment.step import forward_backward, optimizer_step

# Op-name fragments per bucket, checked in order (the first match wins).
BUCKETS = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_mkl", "mkldnn")),
    ("attention (SDPA)", ("scaled_dot_product", "flash_attention")),
    ("softmax + loss", ("softmax", "nll_loss", "cross_entropy")),
    ("norm", ("rms_norm", "rsqrt", "aten::mean", "aten::pow")),
    ("elementwise (rope, relu^2, residual, casts)", ("aten::",)),
)


REGIONS = ("data", "optimizer")  # record_function regions of the step, each its own bucket


def bucket_of(region: str | None, name: str) -> str:
    if region is not None:
        return region
    for bucket, fragments in BUCKETS:
        if any(f in name for f in fragments):
            return bucket
    return "other"


def profile_steps(config: GPTConfig, batch: int, tokens_per_step: int, steps: int, dtype: torch.dtype | None,
                  device: torch.device) -> tuple[dict[str, float], float, str]:
    """({bucket: seconds per step}, wall seconds per step, the profiler's top-op table)."""
    model = build_model(config, device)
    opt = ShardedOptimizer(model, **LRS)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, 1 << 20).astype(np.uint16)
    batches = TokenBatches(tokens, config.max_seq_len, batch)
    accum = max(1, tokens_per_step // (batch * config.max_seq_len))
    autocast = None if dtype is None else torch.autocast(device.type, dtype=dtype)  # None: the trainer's
    x, y = next(batches)

    def step():
        nonlocal x, y
        for _ in range(accum):
            forward_backward(model, x, y, accum, autocast=autocast)
            with record_function(REGIONS[0]):
                x, y = next(batches)
        with record_function(REGIONS[1]):
            optimizer_step(model, opt)

    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        wall = (time.perf_counter() - t0) / steps
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50)
    return bucket_seconds(prof.events(), steps, wall), wall, table


def bucket_seconds(events, steps: int, wall: float) -> dict[str, float]:
    """Each event's self time per step in its bucket; the data and optimizer regions take their own
    time (Python and numpy work inside them) and their ops' time. Host overhead is measured on the
    profiler's timeline: the wall time during which no recorded event runs (the gaps between
    them), not the wall time minus the buckets, so the buckets' sum checks the self times."""
    regions = [(e.time_range.start, e.time_range.end, e.name) for e in events if e.name in REGIONS]
    seconds: dict[str, float] = {}
    for e in events:
        region = e.name if e.name in REGIONS else next(
            (name for a, b, name in regions if a <= e.time_range.start < b), None)
        key = bucket_of(region, e.name)
        seconds[key] = seconds.get(key, 0.0) + e.self_cpu_time_total / 1e6 / steps
    seconds["host overhead (no op running)"] = max(0.0, wall - covered_us(events) / 1e6 / steps)
    return seconds


def covered_us(events) -> float:
    """Microseconds of the timeline during which at least one event runs (the union of their spans)."""
    total, end = 0.0, -float("inf")
    for a, b in sorted((e.time_range.start, e.time_range.end) for e in events):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def add_arguments(p) -> None:
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--aspect_ratio", type=int, default=32)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16, help="sequences per micro-step")
    p.add_argument("--tokens_per_step", type=int, default=4096)
    p.add_argument("--vocab_size", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--autocast", default="auto", choices=("auto", "bf16"),
                   help="auto: the trainer's (bf16 on CUDA, none on CPU); bf16: bf16 autocast on CPU too")
    p.add_argument("--table", action="store_true", help="also print the profiler's top ops by self time")


def main(args) -> int:
    device = torch.device("cpu")
    config = GPTConfig(vocab_size=args.vocab_size, depth=args.depth, aspect_ratio=args.aspect_ratio,
                       head_dim=args.head_dim, max_seq_len=args.seq)
    dtype = torch.bfloat16 if args.autocast == "bf16" else None
    seconds, wall, table = profile_steps(config, args.batch, args.tokens_per_step, args.steps, dtype, device)
    print(f"profile | d{args.depth} width {config.n_embd} seq {args.seq} | {args.tokens_per_step} tokens/step in "
          f"micro-batches of {args.batch} | autocast {args.autocast} | {torch.get_num_threads()} threads | "
          f"{1000 * wall:.1f} ms/step wall (under the profiler)")
    for name, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
        print(f"profile | {name:45s} {1000 * s:8.1f} ms {100 * s / wall:5.1f}%")
    if args.table:
        print(table)
    return 0
