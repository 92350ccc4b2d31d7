"""What the data and the budget support on the GPUs you would rent, before renting: no GPU needed.

    bash run.sh plan [--json]        (or python -m experiment.plan [--json] [--flags])
    TOKENS=350000000 GPUS=8xH100-PCIe TRAINING_HOURS=31 bash run.sh plan --json

Every flag is also an env override named like it in upper case (TOKENS, GPUS, DATA_DIR, ...), as
for experiment/run.sh. For each depth on DEPTH=auto's ladder (the CUDA shape: width 64 per layer,
heads of 128, context 2048) it prints the parameters, the predicted training tok/s, the hours that
1, 4 and MAX_EPOCHS passes over the data take, the tokens per parameter the useful hours buy, and
the checkpoint size, the disk retention needs and the minutes a save takes. Then the recommendation:
the depth DEPTH=auto picks on those GPUs (experiment/autosize.py, from the same predictions), the
hours worth paying for (never past MAX_EPOCHS passes) and the dollars the budget leaves unspent.

The tok/s are predictions, not measurements: the MFU measured on one H100 at d12-d24
(autosize.MEASURED_MFU, from reports/gpucheck-h100.md) times the GPU's dense bf16 peak times the GPU count,
divided by the model's training FLOPs per token. Scaling over GPUs is taken as linear.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from experiment import autosize
from experiment.guards import DISK_WRITE_GBPS
from experiment.config import CUDA_DEFAULTS, PLATEAU_EVALS, opt, parse_flags
from experiment.dataloader import DataError, list_sources
from experiment.files import default_workspace
from experiment.hardware import peak_flops
from experiment.memory import checkpoint_bytes, choose_mode
from experiment.model import GPTConfig

GPU_MEMORY_GIB = (("H200", 141), ("H100", 80), ("A100", 80))  # by name fragment, most specific first
CHUNK = 1 << 26


@dataclass
class PlanConfig:
    tokens: int | None = opt("training + val tokens of the corpus; unset: counted in DATA_DIR")
    data_dir: str | None = opt("*.txt files to count (default $WORKSPACE/data)")
    tokenizer: str = opt("char, or a tiktoken encoding name (counted as bytes / 4: set TOKENS for the exact "
                         "figure)", "char")
    val_fraction: float = opt("held out for validation", 0.05)
    gpus: str | None = opt("e.g. 8xH100-PCIe, 8xH100-SXM, 8xH200 (default: the GPUs visible here, else "
                           "8xH100-PCIe)")
    training_hours: float | None = opt(f"budget in hours (default {CUDA_DEFAULTS['training_hours']:g})")
    budget_usd: float | None = opt("budget in dollars: hours = budget_usd / (gpu_hourly_usd x GPUs)")
    gpu_hourly_usd: float = opt("price of one GPU-hour", 4.0)
    disk_write_gbps: float = opt("the checkpoint disk's write rate, GB/s (a network volume's low end)",
                                 DISK_WRITE_GBPS)
    keep_last: int = opt("complete checkpoints kept, plus the best", 3)
    max_seq_len: int = opt("context length", CUDA_DEFAULTS["max_seq_len"])
    json: int = opt("1: print one JSON object instead of the table", 0)


@dataclass
class Gpus:
    count: int
    name: str
    peak: float  # dense bf16 FLOP/s of one
    memory_bytes: int


def parse_gpus(spec: str | None) -> Gpus:
    """'8xH100-PCIe' -> 8 GPUs named 'H100 PCIe'; None: the GPUs visible here, else 8xH100-PCIe."""
    if spec is None:
        if torch.cuda.is_available():
            spec = f"{torch.cuda.device_count()}x{torch.cuda.get_device_name(0)}"
        else:
            spec = "8xH100-PCIe"
    count, sep, name = spec.partition("x")
    name = name.replace("-", " ").strip()
    peak = peak_flops(name) or peak_flops(name + " SXM")
    memory = next((gib for fragment, gib in GPU_MEMORY_GIB if fragment in name), None)
    if not sep or not count.isdigit() or int(count) < 1 or peak is None or memory is None:
        raise ValueError(f"GPUS {spec!r}: expected COUNTxNAME with a GPU whose peak is known, e.g. 8xH100-PCIe, "
                         "8xH100-SXM, 8xH200, 8xA100")
    return Gpus(int(count), name, peak, memory * 2**30)


def count_tokens(cfg: PlanConfig) -> tuple[int, str]:
    """(tokens, how they were counted): TOKENS, else the characters (or bytes / 4) of DATA_DIR's *.txt,
    streamed (a character is a UTF-8 byte that is no continuation byte)."""
    if cfg.tokens is not None:
        return cfg.tokens, "TOKENS"
    data_dir = Path(cfg.data_dir) if cfg.data_dir else default_workspace() / "data"
    files = list_sources(data_dir)
    total = 0
    for path in files:
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                b = np.frombuffer(chunk, dtype=np.uint8)
                total += int(np.count_nonzero((b & 0xC0) != 0x80)) if cfg.tokenizer == "char" else len(b)
    if cfg.tokenizer != "char":
        return total // 4, f"estimated as bytes / 4 in {len(files)} file(s) of {data_dir} (set TOKENS to be exact)"
    return total, f"characters in {len(files)} file(s) of {data_dir}"


def rung(depth: int, cfg: PlanConfig, gpus: Gpus, train_tokens: int, budget_s: float, vocab: int) -> dict:
    config = GPTConfig(vocab_size=vocab, depth=depth, aspect_ratio=CUDA_DEFAULTS["aspect_ratio"],
                       head_dim=CUDA_DEFAULTS["head_dim"], max_seq_len=cfg.max_seq_len,
                       bigram_vocab=vocab if cfg.tokenizer == "char" else 0)
    c = autosize.candidate(config, autosize.predicted_tok_per_s(config, gpus.peak, gpus.count), budget_s,
                           train_tokens)
    fits = choose_mode(config, gpus.count, 1, cfg.max_seq_len, gpus.memory_bytes) is not None
    ckpt = checkpoint_bytes(config, gpus.count, gpus.memory_bytes)
    return {"depth": depth, "params": c.params, "tok_per_s": c.tok_per_s, "fits": fits,
            "hours_per_pass": train_tokens / c.tok_per_s / 3600, "useful_hours": c.seconds / 3600,
            "tokens": c.tokens, "tokens_per_param": c.tokens_per_param, "epochs": c.epochs,
            "budget_epochs": c.budget_epochs,
            "checkpoint_gb": ckpt / 1e9, "disk_peak_gb": (cfg.keep_last + 2) * ckpt / 1e9,
            "save_minutes": ckpt / (cfg.disk_write_gbps * 1e9) / 60}


def plan(cfg: PlanConfig) -> dict:
    gpus = parse_gpus(cfg.gpus)
    tokens, counted = count_tokens(cfg)
    train_tokens = int(tokens * (1 - cfg.val_fraction))
    hours = cfg.budget_usd / (cfg.gpu_hourly_usd * gpus.count) if cfg.budget_usd is not None else \
        cfg.training_hours or CUDA_DEFAULTS["training_hours"]
    vocab = 256 if cfg.tokenizer == "char" else 100352  # padded; the embedding barely moves the FLOPs
    ladder = autosize.ladder(CUDA_DEFAULTS["aspect_ratio"], CUDA_DEFAULTS["head_dim"])
    rungs = [rung(d, cfg, gpus, train_tokens, hours * 3600, vocab) for d in ladder]
    fitting = [r for r in rungs if r["fits"]]
    candidates = [autosize.Candidate(r["depth"], r["depth"] * CUDA_DEFAULTS["aspect_ratio"], r["params"],
                                     r["tok_per_s"], r["tokens"], r["epochs"], r["budget_epochs"]) for r in fitting]
    best = autosize.choose(candidates)
    chosen = next(r for r in fitting if r["depth"] == best.depth)
    per_hour = cfg.gpu_hourly_usd * gpus.count
    return {"depth": chosen["depth"], "hours": chosen["useful_hours"], "usd": chosen["useful_hours"] * per_hour,
            "unspent_usd": (hours - chosen["useful_hours"]) * per_hour, "budget_hours": hours,
            "budget_usd": hours * per_hour, "usd_per_hour": per_hour, "tokens": tokens, "train_tokens": train_tokens,
            "counted": counted, "gpus": f"{gpus.count} x {gpus.name}", "peak_flops": gpus.peak,
            "max_passes": chosen["epochs"], "stops_at_val_minimum": PLATEAU_EVALS > 0,
            "mfu_source": autosize.MFU_SOURCE, "rule": autosize.rule(best) + f"; never more than {autosize.MAX_EPOCHS} "
            "passes (repeated data is worth less and less: Muennighoff et al. 2023)", "rungs": rungs}


def table(p: dict) -> str:
    measured = ", ".join(f"d{d} {100 * m:.1f}%" for d, m in autosize.MEASURED_MFU.items())
    lines = [f"plan | data: {p['train_tokens']:,} training tokens ({p['tokens']:,} {p['counted']}, "
             "minus the val split)",
             f"plan | GPUs: {p['gpus']} at {p['peak_flops'] / 1e12:.0f} TFLOP/s bf16 each | "
             f"${p['usd_per_hour']:.2f}/hour | budget {p['budget_hours']:.1f} h = ${p['budget_usd']:,.0f}",
             f"plan | tok/s are PREDICTED: MFU measured on one H100 ({p['mfu_source']}: {measured}) x peak x GPUs, "
             "not measured on these GPUs; * outside d12-d24 the nearest measured MFU is taken (small depths: an "
             "upper bound)",
             f"{'depth':>5} {'params':>8} {'tok/s':>11} {'1 pass h':>9} {'4 passes h':>11} "
             f"{f'{autosize.MAX_EPOCHS} passes h':>11} {'useful h':>9} {'tok/param':>9} {'ckpt GB':>8} "
             f"{'disk GB':>8} {'save min':>8}"]
    for r in p["rungs"]:
        measured_depth = min(autosize.MEASURED_MFU) <= r["depth"] <= max(autosize.MEASURED_MFU)
        rate = f"{r['tok_per_s']:,.0f}" + ("" if measured_depth else "*")
        lines.append(f"{'d' + str(r['depth']):>5} {_count(r['params']):>8} {rate:>11} "
                     f"{r['hours_per_pass']:>9.2f} {4 * r['hours_per_pass']:>11.2f} "
                     f"{autosize.MAX_EPOCHS * r['hours_per_pass']:>11.2f} {r['useful_hours']:>9.2f} "
                     f"{r['tokens_per_param']:>9.1f} {r['checkpoint_gb']:>8.1f} {r['disk_peak_gb']:>8.0f} "
                     f"{r['save_minutes']:>8.1f}" + ("" if r["fits"] else "  does not fit in memory"))
    lines += ["plan | disk GB: KEEP_LAST + the best + the one being written; save min: one checkpoint at the "
              "disk's write rate",
              f"recommendation | DEPTH={p['depth']} for {p['hours']:.2f} h (${p['usd']:,.0f}) of the "
              f"{p['budget_hours']:.1f} h budget; ${p['unspent_usd']:,.0f} unspent",
              f"recommendation | at most {p['max_passes']:.1f} passes"
              + ("; stops earlier when val stops improving (the warmdown starts at the val minimum: "
                 "docs/training.md)" if p["stops_at_val_minimum"] else ""),
              f"recommendation | rule: {p['rule']}"]
    return "\n".join(lines)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def env_overrides(argv: list[str]) -> list[str]:
    """Each field's env override (its name in upper case) as a flag, before the command line's own."""
    flags = [f"--{f.name}={os.environ[f.name.upper()]}" for f in dataclasses.fields(PlanConfig)
             if os.environ.get(f.name.upper())]
    return flags + ["--json=1" if a == "--json" else a for a in argv]


def main(argv=None) -> int:
    cfg = parse_flags(PlanConfig, env_overrides(sys.argv[1:] if argv is None else argv), "python -m experiment.plan",
                      __doc__.split("\n")[0])
    try:
        p = plan(cfg)
    except (ValueError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(p) if cfg.json else table(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
