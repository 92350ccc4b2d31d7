"""Compiled DDP with activation checkpointing and gradient accumulation, against the same steps eager.

    torchrun --nproc_per_node=N -m experiment.tools.ddpcheck [--device cpu|cuda] [--depth 2] [--accum 3]

The trainer's combination on GPUs: torch.compile over DDP (which splits the graph at DDP's buckets,
torch._dynamo.config.optimize_ddp), activation checkpointing in every block, and micro-batches
accumulated under no_sync. Each rank builds the same model twice from one seed, wraps both as the
trainer does (distributed.wrap_ddp, also at world 1) and trains --steps steps of --accum
micro-batches with each: one compiled, one eager, on the same data. Rank 0 prints one JSON line: the
step losses of both, the largest parameter difference after the last step, whether every gradient
was still a view into DDP's buckets, the compile and step seconds, and with more than one rank the
bus bandwidth of an all-reduce of --link_mb MB over all of them (link_gbps: what plan's LINK_GBPS
assumes; --link_only: that alone). gpucheck runs it on the GPU(s): its "compiled DDP" item at world 1
and world N over every GPU of the box, beside other items; its "link" item --link_only, alone, so the
links carry nothing else. tests/test_distributed.py runs it on CPU with 2 gloo ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from experiment.distributed import resolve_device, setup_distributed, sync, wrap_ddp
from experiment.model import build_model, GPTConfig
from experiment.optim import LRS, ShardedOptimizer
from experiment.step import forward_backward, optimizer_step


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiment.tools.ddpcheck", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--aspect_ratio", type=int, default=32)
    p.add_argument("--head_dim", type=int, default=32)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--accum", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--bucket_mb", type=float, default=None, help="DDP's bucket size (default: the trainer's)")
    p.add_argument("--graph_split", type=int, default=1, help="torch._dynamo.config.optimize_ddp (0: one graph)")
    p.add_argument("--link_mb", type=float, default=64, help="the timed all-reduce's size (world > 1; 0: none)")
    p.add_argument("--link_only", action="store_true", help="time the all-reduce only, no training")
    return p.parse_args(argv)


def train(args, d, compiled: bool, data: torch.Tensor) -> dict:
    config = GPTConfig(vocab_size=256, depth=args.depth, aspect_ratio=args.aspect_ratio, head_dim=args.head_dim,
                       max_seq_len=args.seq)
    model = build_model(config, d.device, seed=7, activation_checkpointing=True)
    opt = ShardedOptimizer(model, d.rank, d.world_size, **LRS)
    ddp = wrap_ddp(model, d, always=True, bucket_mb=args.bucket_mb)
    run = torch.compile(ddp) if compiled else ddp
    losses, seconds, storages = [], [], []
    for step in range(args.steps):
        sync(d.device)
        t0 = time.perf_counter()
        total = torch.zeros((), device=d.device)
        for micro in range(args.accum):
            x = data[step, micro, d.rank].to(d.device)
            total += forward_backward(run, x, x, args.accum, defer_sync=ddp if micro < args.accum - 1 else None)
            # where the gradients live: a few bucket storages, the same ones micro-batch after micro-batch
            # once DDP has rebuilt its buckets after the first step (a dropped gradient would be one more)
            storages.append(len({p.grad.untyped_storage().data_ptr() for p in model.parameters()}))
        optimizer_step(model, opt)
        losses.append(float(d.all_reduce(total) / d.world_size))
        sync(d.device)
        seconds.append(time.perf_counter() - t0)
    later = storages[args.accum:]
    in_buckets = max(storages) < len(list(model.parameters())) and len(set(later)) <= 1
    return {"losses": losses, "seconds": seconds, "in_buckets": in_buckets, "buckets": storages[-1],
            "params": {n: p.detach().float().cpu() for n, p in model.named_parameters()}}


def link_bandwidth(d, mb: float, iters: int = 5) -> float | None:
    """Bus bandwidth (GB/s) of an all-reduce of `mb` MB of fp32 over every rank, counted as nccl-tests
    count it (2 (n-1)/n x bytes / seconds: what a ring moves over each link), after 2 warm-ups; None
    on one rank or with mb 0."""
    if d.world_size == 1 or mb <= 0:
        return None
    import torch.distributed as dist

    x = torch.ones(max(int(mb * 1e6 / 4), 1), device=d.device)
    for _ in range(2):
        dist.all_reduce(x)
    sync(d.device)
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    sync(d.device)
    seconds = (time.perf_counter() - t0) / iters
    return 2 * (d.world_size - 1) / d.world_size * x.numel() * 4 / seconds / 1e9


def main(argv=None) -> int:
    args = parse(argv)
    device = resolve_device(args.device)
    d = setup_distributed(device.type == "cuda")
    if d.world_size == 1:  # DDP needs a process group, even of one
        import torch.distributed as dist

        dist.init_process_group("nccl" if d.device.type == "cuda" else "gloo", rank=0, world_size=1,
                                store=dist.HashStore())
    if args.link_only:
        link = link_bandwidth(d, args.link_mb)
        if d.rank == 0:
            print(json.dumps({"device": d.device.type, "world": d.world_size, "link_mb": args.link_mb,
                              "link_gbps": link}), flush=True)
        d.close()
        return 0
    torch._dynamo.config.optimize_ddp = bool(args.graph_split)
    data = torch.randint(0, 256, (args.steps, args.accum, d.world_size, args.batch, args.seq),
                         generator=torch.Generator().manual_seed(11))
    eager = train(args, d, False, data)
    compiled = train(args, d, True, data)
    diff = max((compiled["params"][n] - p).abs().max().item() for n, p in eager["params"].items())
    link = link_bandwidth(d, args.link_mb)
    scale = max(p.abs().max().item() for p in eager["params"].values())
    if d.rank == 0:
        print(json.dumps({
            "device": str(d.device.type), "world": d.world_size, "depth": args.depth, "accum": args.accum,
            "graph_split": args.graph_split, "torch": torch.__version__,
            "eager_losses": eager["losses"], "compiled_losses": compiled["losses"],
            "buckets": compiled["buckets"], "max_param_diff": diff, "max_param": scale, "grads_in_buckets": compiled["in_buckets"] and eager["in_buckets"],
            "compile_step_seconds": compiled["seconds"][0], "compiled_step_seconds": compiled["seconds"][-1],
            "eager_step_seconds": eager["seconds"][-1], "link_mb": args.link_mb, "link_gbps": link}), flush=True)
    d.close()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # as the trainer: no interpreter finalization under gloo
