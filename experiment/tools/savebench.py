"""bench save: what a checkpoint save costs training, blocking against in the background.

    python -m experiment.tools.bench save [--depth 6 --aspect_ratio 64 --seq 256 --batch 8] [--write_mbps 50]

One process trains a model of the given shape on random tokens and saves it through the trainer's
Saver, in rounds (median of --rounds): --steps steps without a save (the normal step time); one
blocking save (training waits for all of it); one background save, training steps while its writer
works. Prints, per round and as medians: the blocking save's seconds, the seconds the background
save blocked training (the copy to host memory plus the completion), and the step time while the
writer works against the normal one. --write_mbps caps the writer's rate, standing in for a network
volume (0: the local disk as fast as it goes). Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from experiment import checkpoint as ckpt
from experiment.distributed import resolve_device, sync
from experiment.model import GPTConfig, build_model
from experiment.optim import LRS, ShardedOptimizer
from experiment.saver import WRITER_NICE, Saver
from experiment.step import forward_backward, optimizer_step


def add_arguments(p) -> None:
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--aspect_ratio", type=int, default=64)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--write_mbps", type=float, default=50.0, help="the writer's cap in MB/s (0: none)")
    p.add_argument("--writer_nice", type=int, default=WRITER_NICE, help="the background writer's nice value")
    p.add_argument("--steps", type=int, default=5, help="steps timed without a save, per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="auto")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a new temp directory)")


def main(args) -> int:
    device = resolve_device(args.device)
    config = GPTConfig(vocab_size=256, depth=args.depth, aspect_ratio=args.aspect_ratio, head_dim=args.head_dim,
                       max_seq_len=args.seq)
    model = build_model(config, device, torch.float32, seed=0)
    opt = ShardedOptimizer(model, matrix_lr=0.02, embedding_lr=LRS["embedding_lr"],
                           unembedding_lr=LRS["unembedding_lr"])
    x = torch.randint(0, 256, (args.batch, args.seq), device=device)

    def step() -> float:
        t0 = time.perf_counter()
        forward_backward(model, x, x, 1)
        optimizer_step(model, opt)
        sync(device)
        return time.perf_counter() - t0

    run_dir = Path(args.dir or tempfile.mkdtemp(prefix="savebench-"))
    saver = Saver(run_dir, 0, 1, device, background=True, all_ok=bool, gather=lambda files: [files],
                  write_bps=args.write_mbps * 1e6, writer_nice=args.writer_nice)
    for _ in range(2):
        step()  # warm-up
    cap = f"capped at {args.write_mbps:g} MB/s" if args.write_mbps else "uncapped"
    print(f"bench save | d{args.depth}, {model.num_params():,} params on {device} | writer {cap}, nice "
          f"{args.writer_nice} | {torch.get_num_threads()} training threads", flush=True)
    rows = [one_round(r, step, saver, model, opt, args.steps) for r in range(args.rounds)]
    med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    print(f"median of {args.rounds} | blocking save {med['blocking']:.2f}s | background save blocked training "
          f"{med['blocked']:.3f}s = {100 * med['blocked'] / med['blocking']:.1f}% of the blocking save, written in "
          f"{med['background']:.2f}s beside training | step "
          f"{med['step']:.3f}s normally, {med['step_writing']:.3f}s while writing "
          f"({100 * (med['step_writing'] / med['step'] - 1):+.1f}%) | {med['bytes'] / 1e6:.0f} MB per save")
    return 0


def one_round(r: int, step, saver: Saver, model, opt, n_steps: int) -> dict:
    normal = statistics.median(step() for _ in range(n_steps))

    def share(step_number: int):
        meta = {"step": step_number, "val_loss": None, "state": {"best_step": -1}, "world_size": 1}
        return model.state_dict(), {**opt.shard_state(), "rng": {"cpu": torch.get_rng_state()}}, meta

    t0 = time.perf_counter()
    saver.begin(2 * r, *share(2 * r), background=False)
    _, error = saver.complete()
    blocking = time.perf_counter() - t0
    assert error is None, error
    files = sum(f.stat().st_size for f in saver.run_dir.glob(f"*_{2 * r:06d}*.pt"))

    t0 = time.perf_counter()
    saver.begin(2 * r + 1, *share(2 * r + 1), background=True)
    blocked = time.perf_counter() - t0
    during = []
    while saver.writing():
        during.append(step())
    t0 = time.perf_counter()
    saver.wait()
    pending, error = saver.complete()
    blocked += time.perf_counter() - t0
    assert error is None, error
    # The last step may have outlasted the write: it ran partly without the writer; count it only
    # when it is the only one.
    during = during[:-1] or during
    ckpt.prune(saver.run_dir, keep_last=0)  # the next round's saves need the room, not these
    row = {"blocking": blocking, "blocked": blocked, "background": pending.write_seconds, "step": normal,
           "step_writing": statistics.median(during) if during else float("nan"), "bytes": files}
    print(f"round {r + 1} | blocking save {blocking:.2f}s | background save blocked {blocked:.3f}s, written in "
          f"{row['background']:.2f}s | step {normal:.3f}s, {row['step_writing']:.3f}s while writing ({len(during)} "
          "steps)", flush=True)
    return row
