"""Benchmarks and planners that print numbers (never asserted in tests).

    python -m experiment.tools.bench generate [--checkpoint PATH] [--tokens 1024] [--device auto] [--batch 8] [--depth 12 --members 2]
    python -m experiment.tools.bench plan --depth 64 --nproc 8 --gpu_mem_gb 80 [--seq 2048] [--device_batch_size 2]
    python -m experiment.tools.bench fitprobe --depth 64 --world 8 --device_batch_sizes 1,2,4 [--seq 2048]
    python -m experiment.tools.bench throughput --depth 4 --seq 256 --batch 8 [--aspect_ratio 64 --head_dim 128]
    python -m experiment.tools.bench speedrun --data FILE --seconds 180 [--val_fraction 0.1]
    python -m experiment.tools.bench prepare --mb 100
    python -m experiment.tools.bench profile [--depth 4 --aspect_ratio 32 --seq 256 --batch 16] [--table]
    python -m experiment.tools.bench versus --nanogpt PATH --seconds 180 [--repeats 3] [--ladder 3,5]
    python -m experiment.tools.bench serve [--checkpoint PATH] --clients 1,8,32
    python -m experiment.tools.bench gpucheck [--quick] [--workspace DIR] [--only env,correctness,...]
    python -m experiment.tools.bench repeats --corpus FILE [--chars 300000 --seconds 240 --depths 2,4,6,8]
    python -m experiment.tools.bench save [--depth 6 --write_mbps 50 --rounds 3]
    python -m experiment.tools.bench reduce [--depth 4 --ranks 8]
    python -m experiment.tools.bench teacher [--depths 2,4,6,8] [--checkpoint RUN/gen1/model_N.pt]
    python -m experiment.tools.bench grid --results R.jsonl --corpus A.txt B.txt [--chars ... --seconds ...]

generate: tokens/s for N generated tokens with the KV cache and with the naive path (a full forward
over the last max_seq_len tokens per token), on a checkpoint (default: the newest run's best) or,
with --depth, on a freshly initialised model of that shape. --batch B: B requests decoded side by side
through the server's engine.Batch (the server's path), aggregate tokens/s; --members N (with --depth): an ensemble of N
fresh models, the way `serve --checkpoint A,B` decodes.
plan: the per-GPU memory breakdown of a configuration in every precision/recompute mode, and the
largest device batch that fits in each. Nothing is allocated.
fitprobe: one GPU runs rank 0 of a simulated world (optimizer state only for rank 0's parameters,
collectives skipped) for a few steps and reports its measured peak memory beside the plan, so a
configuration can be checked on one rented GPU before paying for eight.
throughput: training tokens/s (forward, backward, optimizer step) after warm-up, model FLOP/s, MFU
against the GPU's peak by name or, on CPU, against an fp32 matmul peak measured on the spot.
speedrun: trains from scratch for exactly T seconds of budget with the recommended settings for the
device (the trainer's defaults), then prints the val loss on the full val set and the val-loss curve
against training seconds.
profile: one CPU training step under torch.profiler, its time by bucket (matmul, attention, softmax +
loss, norm, elementwise, optimizer, data, host overhead) (experiment/tools/stepprofile.py).
versus: nanoGPT's baby-GPT CPU recipe and ours, one after the other on this machine, same text and
split, both for the same budget: both full-val losses, when ours reaches nanoGPT's final loss, and
whether ours trained with S/3, S/5 ... of the budget ends below it (experiment/tools/versus.py).
prepare: a synthetic corpus of --mb MB prepared in a child process: MB/s, peak memory, cache-hit time
(experiment/tools/prepbench.py).
serve: starts the server on a checkpoint and drives it with 1, 8, 32 clients at once: aggregate tok/s
and p50/p95 latency per client count (experiment/tools/loadtest.py).
gpucheck: every CUDA path of the trainer on one GPU, PASS/WARN/FAIL per item with the numbers, in a
report under $WORKSPACE/gpucheck/<timestamp>/ (experiment/tools/gpucheck.py).
repeats: DEPTH=auto on a corpus the budget would repeat many times against an explicit depth sweep
at the full budget: best val losses, and the seconds the default left unspent (experiment/tools/repeats.py).
save: a blocking checkpoint save against a background one through the trainer's Saver, with the writer
capped at --write_mbps: seconds training was blocked, and the step time while the writer works
(experiment/tools/savebench.py).
reduce: bf16 gradients all-reduced in bf16 (DDP's default with PRECISION=bf16) against their fp32 mean,
NCCL's ring simulated on one CPU: the reduction's error beside the gradients' own rounding and
sampling noise (experiment/tools/reduceprec.py).
grid: DEPTH=auto against a sweep of explicit depths, each with the stop at the val minimum, on a grid of
corpora x data sizes x budgets: auto's regret against the sweep's best, the seconds each spent, the
winner's passes and tokens per parameter; a results file that grows over sittings (experiment/tools/grid.py).
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

from experiment import checkpoint as ckpt
from experiment.distributed import resolve_device, sync
from experiment.files import default_workspace
from experiment.hardware import peak_flops
from experiment.memory import MODES, count_params, format_plan, plan_memory
from experiment.model import DTYPES, GPT, GPTConfig, build_model
from experiment.optim import LRS, ShardedOptimizer
from experiment.step import forward_backward, optimizer_step
from experiment.tools import (ablate, codecorpus, ensemble, gpucheck, grid, loadtest, prepbench, reduceprec, repeats,
                              savebench, stepprofile, teacherbench, versus)
from experiment.tools.probes import cpu_matmul_peak, probe_peak_memory


def bench_generate(model: GPT, n_tokens: int, device: torch.device, allowed_vocab: int, naive: bool = True) -> dict:
    prompt = [0]
    results = {}
    for name, use_cache in (("kv_cache", True), ("naive", False))[: 2 if naive else 1]:
        list(model.generate(prompt, 8, temperature=1.0, generator=torch.Generator().manual_seed(0),
                            use_cache=use_cache, allowed_vocab=allowed_vocab))  # warm-up
        sync(device)
        t0 = time.perf_counter()
        out = list(model.generate(prompt, n_tokens, temperature=1.0, generator=torch.Generator().manual_seed(0),
                                  use_cache=use_cache, allowed_vocab=allowed_vocab))
        sync(device)
        seconds = time.perf_counter() - t0
        results[name] = {"tokens": len(out), "seconds": seconds, "tok_per_s": len(out) / seconds, "ids": out}
    return results


def bench_batch(models: list[GPT], n_tokens: int, requests: int, device: torch.device, allowed_vocab: int,
                first_seed: int = 0) -> dict:
    """Aggregate tokens/s of `requests` generations decoded side by side in one engine.Batch, the
    server's path: one prompt token each, temperature 1, each with its own generator. `models` of
    more than one: an ensemble (the mean of their probabilities). Request i's generator has seed
    first_seed + i, so a request decoded alone can be matched with its place in a batch."""
    from experiment.engine import Batch

    def decode(n: int) -> tuple[float, list[list[int]]]:
        batch = Batch(models, requests, allowed_vocab)
        ids = {batch.join([0], 1.0, None, torch.Generator().manual_seed(first_seed + i))[0]: i for i in range(requests)}
        out = [[] for _ in range(requests)]
        sync(device)
        t0 = time.perf_counter()
        for _ in range(n - 1):
            for member, token in batch.step().items():
                out[ids[member]].append(token)
        sync(device)
        return time.perf_counter() - t0, out

    decode(8)  # warm-up
    seconds, out = decode(n_tokens)
    return {"tokens": sum(map(len, out)), "seconds": seconds, "tok_per_s": sum(map(len, out)) / seconds, "ids": out}


def cmd_plan(args) -> int:
    config = GPTConfig(vocab_size=args.vocab_size, depth=args.depth, aspect_ratio=args.aspect_ratio,
                       head_dim=args.head_dim, max_seq_len=args.seq)
    gpu_bytes = int(args.gpu_mem_gb * 2**30)
    n = count_params(config)
    print(f"plan | d{args.depth} width {config.n_embd} | {n / 1e9:.2f}B params | {args.nproc} GPUs x "
          f"{args.gpu_mem_gb:g} GiB | seq {args.seq} | device batch {args.device_batch_size}")
    plans = [plan_memory(config, args.nproc, args.device_batch_size, args.seq, p, c) for p, c in MODES]
    print(format_plan(plans, gpu_bytes))
    for p, c in MODES:
        fitting = [b for b in (1, 2, 4, 8, 16, 32, 64)
                   if plan_memory(config, args.nproc, b, args.seq, p, c).fits(gpu_bytes)]
        print(f"plan | {p}{' +ckpt' if c else '':6s} | largest device batch that fits: {max(fitting) if fitting else 'none'}")
    return 0


def cmd_fitprobe(args) -> int:
    args.device_batch_sizes = [int(b) for b in args.device_batch_sizes.split(",")]
    args.activation_checkpointing = args.activation_checkpointing == "on"
    device = resolve_device("auto")
    config = GPTConfig(vocab_size=args.vocab_size, depth=args.depth, aspect_ratio=args.aspect_ratio,
                       head_dim=args.head_dim, max_seq_len=args.seq)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"fitprobe | d{args.depth} as rank 0 of {args.world} | {args.precision}"
          f"{' +ckpt' if args.activation_checkpointing else ''} | seq {args.seq} | {name} | torch {torch.__version__}")
    for batch in args.device_batch_sizes:
        planned = plan_memory(config, args.world, batch, args.seq, args.precision, args.activation_checkpointing,
                              cuda=device.type == "cuda", collectives=False)  # one rank of a simulated world
        try:
            peak = probe_peak_memory(config, args.world, batch, args.seq, args.precision,
                                     args.activation_checkpointing, device, steps=args.steps)
            measured = (f"{peak['allocated'] / 2**30:.1f} GiB (reserved {peak['reserved'] / 2**30:.1f} GiB)"
                        if peak is not None else "n/a on CPU")
        except torch.OutOfMemoryError:
            measured = "OUT OF MEMORY"
        print(f"fitprobe | device batch {batch} | measured peak {measured} | planned {planned.total / 2**30:.1f} GiB")
    return 0


def cmd_throughput(args) -> int:
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    config = GPTConfig(vocab_size=args.vocab_size, depth=args.depth, aspect_ratio=args.aspect_ratio,
                       head_dim=args.head_dim, max_seq_len=args.seq)
    model = build_model(config, device)
    opt = ShardedOptimizer(model, **LRS)
    x = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device)

    def step():
        forward_backward(model, x, x)
        optimizer_step(model, opt)

    for _ in range(args.warmup):
        step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync(device)
    seconds = (time.perf_counter() - t0) / args.steps
    tok_s = args.batch * args.seq / seconds
    flops = model.estimate_flops(args.seq) * tok_s
    if cuda:
        name = torch.cuda.get_device_name(device)
        peak, peak_src = peak_flops(name), f"{name} dense bf16 peak"
        mem = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        name, peak = "cpu", cpu_matmul_peak()
        peak_src = f"measured fp32 matmul peak {peak / 1e9:.1f} GFLOP/s, {torch.get_num_threads()} threads"
        mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    mfu = f"{100 * flops / peak:.1f}%" if peak else "- (unknown device)"
    print(f"throughput | d{args.depth} width {config.n_embd} heads {config.n_head} | {model.num_params():,} params | "
          f"seq {args.seq} batch {args.batch} | {name} | torch {torch.__version__}")
    print(f"throughput | {tok_s:,.0f} tok/s | {1000 * seconds:.1f} ms/step | {flops / 1e9:,.1f} GFLOP/s | "
          f"mfu {mfu} ({peak_src}) | peak mem {mem:.2f} GiB")
    return 0


def cmd_speedrun(args) -> int:
    ws = Path(args.workspace or tempfile.mkdtemp(prefix="speedrun-"))
    try:
        r = versus.run_ours(Path(args.data), args.seconds, args.val_fraction, ws, args.train_args)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for t, loss in r.curve:
        print(f"curve | {t:7.1f}s | val_loss {loss:.4f} (eval slice)")
    print(f"speedrun | budget {args.seconds:g}s, used {r.seconds:.1f}s | {r.summary} | val_loss {r.loss:.4f} "
          f"nats/char on the full val set ({r.val_tokens:,} tokens, last {args.val_fraction:g} of the text); "
          f"best step (served) {r.best_loss:.4f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m experiment.tools.bench", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="tokens/s with and without the KV cache")
    g.add_argument("--checkpoint", default=None, help="model_*.pt or run directory (default: newest run's best)")
    g.add_argument("--workspace", default=None, help="where to look for runs (default as in run.sh)")
    g.add_argument("--depth", type=int, default=None, help="bench a fresh model of this depth instead")
    g.add_argument("--max_seq_len", type=int, default=256, help="context of the fresh model")
    g.add_argument("--tokens", type=int, default=1024, help="tokens to generate")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda")
    g.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the weights' dtype")
    g.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    g.add_argument("--naive", type=int, default=1, help="0: the KV-cache path only (the naive one is slow on a big model)")
    g.add_argument("--members", type=int, default=1, help="with --depth: an ensemble of this many fresh models (seeds 0..)")
    g.add_argument("--batch", type=int, default=0,
                   help="N >= 1: N requests decoded side by side through the server's engine.Batch (0: GPT.generate)")
    def shape_flags(p, depth_default=None):
        p.add_argument("--depth", type=int, required=depth_default is None, default=depth_default)
        p.add_argument("--aspect_ratio", type=int, default=64)
        p.add_argument("--head_dim", type=int, default=128)
        p.add_argument("--seq", type=int, default=2048, help="context length")
        p.add_argument("--vocab_size", type=int, default=128, help="padded vocabulary (char corpora: 64-256)")

    pl = sub.add_parser("plan", help="per-GPU memory breakdown for both precision modes")
    shape_flags(pl)
    pl.add_argument("--nproc", type=int, default=8, help="GPUs in all (the ZeRO-1 world size)")
    pl.add_argument("--gpu_mem_gb", type=float, default=80, help="memory of one GPU, GiB")
    pl.add_argument("--device_batch_size", type=int, default=1)
    fp = sub.add_parser("fitprobe", help="measure peak memory of rank 0 of a simulated world on one GPU")
    shape_flags(fp)
    fp.add_argument("--world", type=int, default=8, help="simulated world size")
    fp.add_argument("--device_batch_sizes", default="1,2,4", help="comma-separated micro-batch sizes")
    fp.add_argument("--precision", default="bf16", choices=("fp32", "bf16"))
    fp.add_argument("--activation_checkpointing", default="on", choices=("on", "off"))
    fp.add_argument("--steps", type=int, default=3)
    tp = sub.add_parser("throughput", help="training tokens/s, FLOP/s and MFU after warm-up")
    shape_flags(tp)
    tp.add_argument("--batch", type=int, default=8)
    tp.add_argument("--steps", type=int, default=10)
    tp.add_argument("--warmup", type=int, default=3)
    tp.add_argument("--device", default="auto", help="auto, cpu or cuda")
    sr = sub.add_parser("speedrun", help="train for exactly T seconds of budget, print the val loss")
    sr.add_argument("--data", required=True, help="a .txt file or a directory of them")
    sr.add_argument("--seconds", type=float, required=True, help="training budget")
    sr.add_argument("--val_fraction", type=float, default=0.1)
    sr.add_argument("--workspace", default=None, help="default: a new temp directory")
    sr.add_argument("train_args", nargs="*", help="extra experiment.train flags after --, e.g. -- --depth 6")
    prepbench.add_arguments(sub.add_parser("prepare", help="MB/s and peak memory of preparing a synthetic corpus"))
    loadtest.add_arguments(sub.add_parser("serve", help="the server's aggregate tok/s and latency per client count"))
    stepprofile.add_arguments(sub.add_parser("profile", help="where one CPU training step's time goes"))
    versus.add_arguments(sub.add_parser("versus", help="nanoGPT and ours on one machine, same data and budget"))
    gpucheck.add_arguments(sub.add_parser("gpucheck", help="prove a GPU box: every CUDA path, PASS/FAIL per item"))
    repeats.add_arguments(sub.add_parser("repeats", help="DEPTH=auto against a depth sweep on data the budget repeats"))
    reduceprec.add_arguments(sub.add_parser("reduce", help="bf16 gradients reduced in bf16 against fp32"))
    savebench.add_arguments(sub.add_parser("save", help="training blocked by a checkpoint save, blocking vs background"))
    codecorpus.add_arguments(sub.add_parser("corpus", help="a Python-source benchmark corpus from the standard library"))
    ablate.add_arguments(sub.add_parser("ablate", help="recipe variants side by side on corpora and budgets"))
    grid.add_arguments(sub.add_parser("grid", help="DEPTH=auto against a depth sweep on corpora x sizes x budgets"))
    ensemble.add_arguments(sub.add_parser("ensemble", help="full-val loss of checkpoints and of ensembles of the best k"))
    teacherbench.add_arguments(sub.add_parser("teacher", help="a generation's teacher forward on CPU, fp32 against bf16"))
    return parser


def cmd_generate(args) -> int:
    try:
        device = resolve_device(args.device)
        # A fresh model of the shape a GPU run trains (aspect 64, heads of 128), without the bigram table.
        config = (GPTConfig(vocab_size=128, depth=args.depth, head_dim=128, max_seq_len=args.max_seq_len)
                  if args.depth else None)
        if args.members < 1 or args.batch < 0 or (args.members > 1 and config is None):
            raise ValueError("--members is at least 1, and more than 1 needs --depth (fresh models); --batch is at least 0")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if config is not None:
        # drawn on the device: a d32 drawn on the CPU takes tens of seconds; these weights only time
        models = [build_model(config, device, seed=i, draw_on_device=True).eval() for i in range(args.members)]
        source, allowed = f"fresh d{args.depth}" + (f" x{args.members} (ensemble)" if args.members > 1 else ""), 128
    else:
        workspace = Path(args.workspace) if args.workspace else default_workspace()
        try:
            path = ckpt.resolve_serving_checkpoint(args.checkpoint, workspace)
            model, meta = ckpt.load_model(path, device)
        except ckpt.CheckpointError as e:
            print(f"error: {e} (or pass --depth to bench a fresh model)", file=sys.stderr)
            return 2
        models, source, allowed = [model], str(path), meta["tokenizer"]["vocab_used"]
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    models = [m.to(DTYPES[args.dtype]) for m in models]
    model, c = models[0], models[0].config
    weights = sum(m.num_params() for m in models) * (2 if args.dtype == "bf16" else 4) / 1e9
    print(f"generate | {source} | d{c.depth} width {c.n_embd} ctx {c.max_seq_len} | {model.num_params():,} params | "
          f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'} | torch {torch.__version__} "
          f"| threads {torch.get_num_threads()} | {args.dtype} | weights {weights:.2f} GB")
    if len(models) > 1 or args.batch:
        n = max(1, args.batch)
        r = bench_batch(models, args.tokens, n, device, allowed)
        print(f"generate | batch {n} | {r['tokens']} tokens in {r['seconds']:.2f}s | {r['tok_per_s']:,.1f} tok/s "
              f"in all, {r['tok_per_s'] / n:,.1f} per request")
        if n > 1:  # batch invariance at this size: the batch's last request decoded alone
            alone = bench_batch(models, args.tokens, 1, device, allowed, first_seed=n - 1)["ids"][0]
            print(f"generate | request {n - 1} decoded alone: {'the same' if alone == r['ids'][-1] else 'OTHER'} tokens "
                  f"as in the batch")
        return 0
    r = bench_generate(model, args.tokens, device, allowed, bool(args.naive))
    if not args.naive:
        print(f"generate | kv_cache | {r['kv_cache']['tokens']} tokens in {r['kv_cache']['seconds']:.2f}s | "
              f"{r['kv_cache']['tok_per_s']:,.1f} tok/s")
        return 0
    for name in ("kv_cache", "naive"):
        print(f"generate | {name:8s} | {r[name]['tokens']} tokens in {r[name]['seconds']:.2f}s | "
              f"{r[name]['tok_per_s']:,.1f} tok/s")
    same = r["kv_cache"]["ids"][: c.max_seq_len - 1] == r["naive"]["ids"][: c.max_seq_len - 1]
    print(f"generate | speedup {r['kv_cache']['tok_per_s'] / r['naive']['tok_per_s']:.1f}x | "
          f"same tokens while within the context: {same}")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    commands = {"generate": cmd_generate, "plan": cmd_plan, "fitprobe": cmd_fitprobe, "throughput": cmd_throughput,
                "speedrun": cmd_speedrun, "prepare": prepbench.main, "serve": loadtest.main, "versus": versus.main, "profile": stepprofile.main, "gpucheck": gpucheck.main,
                "repeats": repeats.main, "save": savebench.main, "reduce": reduceprec.main,
                "corpus": codecorpus.main, "ablate": ablate.main, "grid": grid.main, "ensemble": ensemble.main,
                "teacher": teacherbench.main}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
