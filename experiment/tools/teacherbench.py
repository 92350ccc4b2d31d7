"""bench teacher: a generation's teacher forward on this CPU, fp32 against bf16 autocast.

    python -m experiment.tools.bench teacher [--depths 2,4,6,8] [--checkpoint RUN/gen1/model_N.pt]

Times Teacher.probs (experiment/teacher.py), the call each step of a distilled generation makes, on
one micro-batch of the CPU default (16 x 256 tokens), its two precisions alternated, the median of
--repeats. By default fresh models of the CPU default shape (aspect 32, heads of 64, the bigram
table) over 65 symbols (Tiny Shakespeare's); with --checkpoint a trained model, whose two probability
sets are the ones worth comparing (the mean KL(fp32 || bf16) a position: how far bf16 moves the
targets; a fresh model's outputs are nearly uniform). Says whether this CPU multiplies bf16 in
hardware, which is what the trainer's choice follows.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from experiment import checkpoint as ckpt
from experiment.config import CPU_DEFAULTS, CPU_DEVICE_BATCH
from experiment.model import GPTConfig, build_model
from experiment.teacher import Teacher, native_cpu_bf16


def add_arguments(p) -> None:
    p.add_argument("--depths", default="2,4,6,8", help="fresh models of these depths (comma-separated)")
    p.add_argument("--checkpoint", default=None, help="a trained model file instead of fresh models")
    p.add_argument("--batch", type=int, default=CPU_DEVICE_BATCH)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)


def time_probs(teacher: Teacher, x: torch.Tensor) -> float:
    start = time.perf_counter()
    teacher.probs(x)
    return time.perf_counter() - start


def compare(name: str, model, args) -> None:
    x = torch.randint(0, model.config.vocab_size, (args.batch, min(args.seq, model.config.max_seq_len)),
                      generator=torch.Generator().manual_seed(0))
    slow, fast = Teacher([model], 1.0, cpu_bf16=False), Teacher([model], 1.0, cpu_bf16=True)
    times = {"fp32": [], "bf16": []}
    for teacher in (slow, fast):
        teacher.probs(x)  # warm: oneDNN's first call picks its kernels
    for _ in range(args.repeats):
        times["fp32"].append(time_probs(slow, x))
        times["bf16"].append(time_probs(fast, x))
    fp32, bf16 = (statistics.median(times[k]) * 1000 for k in ("fp32", "bf16"))
    p, q = slow.probs(x), fast.probs(x)
    kl = (p * (p.clamp_min(1e-12).log() - q.clamp_min(1e-12).log())).sum(-1).mean().item()
    print(f"teacher | {name} | {model.num_params():,} params | {x.numel():,} tokens | fp32 {fp32:.1f} ms | "
          f"bf16 {bf16:.1f} ms | bf16/fp32 {bf16 / fp32:.2f} | KL(fp32 || bf16) {kl:.2e}")


def main(args) -> int:
    try:
        if args.batch < 1 or args.seq < 1 or args.repeats < 1:
            raise ValueError("--batch, --seq and --repeats are at least 1")
        configs = [GPTConfig(vocab_size=65, depth=int(d), aspect_ratio=CPU_DEFAULTS["aspect_ratio"],
                             head_dim=CPU_DEFAULTS["head_dim"], max_seq_len=args.seq, bigram_vocab=65)
                   for d in args.depths.split(",") if d.strip()]
    except ValueError as e:  # a depth that is no number, or no shape (odd depths: width 32 x depth, heads of 64)
        print(f"error: {e}", file=sys.stderr)
        return 2
    native = native_cpu_bf16()
    print(f"teacher | this CPU multiplies bf16 in hardware: {native} (the trainer's teacher runs in "
          f"{Teacher([], 1.0, native).precision(torch.device('cpu'))}) | threads {torch.get_num_threads()} | "
          f"torch {torch.__version__}")
    if args.checkpoint:
        try:
            model, _ = ckpt.load_model(args.checkpoint, torch.device("cpu"))
        except ckpt.CheckpointError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        compare(args.checkpoint, model, args)
        return 0
    for config in configs:
        compare(f"fresh d{config.depth}", build_model(config, "cpu", torch.float32, seed=0), args)
    return 0
