"""Benchmarks that print numbers (never asserted in tests).

    python -m experiment.bench generate [--checkpoint PATH] [--tokens 1024] [--device auto]

generate: tokens/s for N generated tokens with the KV cache and with the naive path (a full forward
over the last max_seq_len tokens per token), on a checkpoint (default: the newest run's best) or,
with --depth, on a freshly initialised model of that shape.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from experiment import checkpoint as ckpt
from experiment.model import GPT, GPTConfig


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_generate(model: GPT, n_tokens: int, device: torch.device, allowed_vocab: int) -> dict:
    prompt = [0]
    results = {}
    for name, use_cache in (("kv_cache", True), ("naive", False)):
        list(model.generate(prompt, 8, temperature=1.0, generator=torch.Generator().manual_seed(0),
                            use_cache=use_cache, allowed_vocab=allowed_vocab))  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        out = list(model.generate(prompt, n_tokens, temperature=1.0, generator=torch.Generator().manual_seed(0),
                                  use_cache=use_cache, allowed_vocab=allowed_vocab))
        _sync(device)
        seconds = time.perf_counter() - t0
        results[name] = {"tokens": len(out), "seconds": seconds, "tok_per_s": len(out) / seconds, "ids": out}
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiment.bench", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="tokens/s with and without the KV cache")
    g.add_argument("--checkpoint", default=None, help="model_*.pt or run directory (default: newest run's best)")
    g.add_argument("--workspace", default=None, help="where to look for runs (default as in run.sh)")
    g.add_argument("--depth", type=int, default=None, help="bench a fresh model of this depth instead")
    g.add_argument("--max_seq_len", type=int, default=256, help="context of the fresh model")
    g.add_argument("--tokens", type=int, default=1024, help="tokens to generate")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    if args.depth is not None:
        try:
            model = GPT(GPTConfig(vocab_size=128, depth=args.depth, max_seq_len=args.max_seq_len))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        model.init_weights(seed=0)
        model.to(device).eval()
        source, allowed = f"fresh d{args.depth}", 128
    else:
        workspace = Path(args.workspace) if args.workspace else ckpt.default_workspace()
        try:
            path = ckpt.resolve_serving_checkpoint(args.checkpoint, workspace)
            model, meta = ckpt.load_model(path, device)
        except ckpt.CheckpointError as e:
            print(f"error: {e} (or pass --depth to bench a fresh model)", file=sys.stderr)
            return 2
        source, allowed = str(path), meta["tokenizer"]["vocab_used"]
    c = model.config
    print(f"generate | {source} | d{c.depth} width {c.n_embd} ctx {c.max_seq_len} | {model.num_params():,} params | "
          f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'} | torch {torch.__version__} "
          f"| threads {torch.get_num_threads()}")
    r = bench_generate(model, args.tokens, device, allowed)
    for name in ("kv_cache", "naive"):
        print(f"generate | {name:8s} | {r[name]['tokens']} tokens in {r[name]['seconds']:.2f}s | "
              f"{r[name]['tok_per_s']:,.1f} tok/s")
    same = r["kv_cache"]["ids"][: c.max_seq_len - 1] == r["naive"]["ids"][: c.max_seq_len - 1]
    print(f"generate | speedup {r['kv_cache']['tok_per_s'] / r['naive']['tok_per_s']:.1f}x | "
          f"same tokens while within the context: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
