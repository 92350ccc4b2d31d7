"""bench repeats: DEPTH=auto on a corpus the budget would repeat many times, against an explicit sweep.

    python -m experiment.tools.bench repeats --corpus tinyshakespeare.txt --chars 300000 --seconds 240

The first --chars characters of --corpus, one budget. First each depth of --depths trained for the
whole budget (explicit DEPTH with MAX_EPOCHS=0: no pass cap), then the default run (DEPTH=auto), which stops
after MAX_EPOCHS passes when the budget outlasts them. Every run evaluates every half pass over the
data (the same token positions for every depth) and keeps its best. Prints per run the depth, its
passes, the seconds used, the best val loss and where it was reached; then the default run's best
against the sweep's best, and the seconds it left unspent. Runs one after another on this machine:
nothing else should run beside it (the budget is wall-clock).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from experiment import checkpoint as ckpt

BATCH = 4096  # the CPU default tokens/step


@dataclass
class Result:
    name: str
    depth: int
    passes: float
    used: float
    best: float
    best_passes: float
    unspent: str


def add_arguments(p) -> None:
    p.add_argument("--corpus", required=True, help="a .txt file; its first --chars characters are the corpus")
    p.add_argument("--chars", type=int, default=300_000)
    p.add_argument("--seconds", type=float, default=240, help="the budget of every run")
    p.add_argument("--depths", default="2,4,6,8", help="the explicit sweep")
    p.add_argument("--workspace", default=None, help="default: a new temp directory")


def run_one(name: str, flags: list[str], data: Path, ws: Path, seconds: float, eval_steps: int) -> Result:
    cmd = [sys.executable, "-m", "experiment.train", "--data_dir", str(data), "--workspace", str(ws),
           "--model_tag", name, "--training_hours", str(seconds / 3600), "--eval_every_steps", str(eval_steps),
           "--eval_every_minutes", "1000", "--save_every_minutes", "1000", "--sample_tokens", "0",
           "--resume", "never", "--log_every_steps", "100", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    done = next(line for line in proc.stdout.splitlines() if line.startswith("done:"))
    run_dir = ws / "checkpoints" / name
    last = ckpt.complete_steps(run_dir)[-1]
    meta, best = ckpt.read_meta(run_dir, last), ckpt.read_best(run_dir)
    train_tokens = json.loads((Path(meta["prepared"]["dir"]) / "meta.json").read_text())["split"]["train_tokens"]
    used = float(done.split("(")[1].split("s of ")[0])
    unspent = done.split("passes are done: ")[1].split(" of the budget")[0] if "passes are done" in done else "-"
    return Result(name, meta["model_config"]["depth"], meta["state"]["tokens_seen"] / train_tokens, used,
                  best["val_loss"], best["step"] * BATCH / train_tokens, unspent)


def main(args) -> int:
    ws = Path(args.workspace or tempfile.mkdtemp(prefix="repeats-"))
    data = ws / "data"
    data.mkdir(parents=True, exist_ok=True)
    text = Path(args.corpus).read_text(encoding="utf-8")[: args.chars]
    (data / "corpus.txt").write_text(text, encoding="utf-8")
    eval_steps = max(1, round(0.5 * 0.95 * len(text) / BATCH))  # every half pass (the val split is 5%)
    print(f"repeats | {len(text):,} characters of {args.corpus} | budget {args.seconds:g}s per run | eval every "
          f"{eval_steps} steps (half a pass) | {ws}", flush=True)
    results = []
    try:
        for depth in [int(d) for d in args.depths.split(",")]:
            results.append(run_one(f"d{depth}", ["--depth", str(depth), "--max_epochs", "0"], data, ws, args.seconds,
                                   eval_steps))
            print_result(results[-1])
        auto = run_one("auto", [], data, ws, args.seconds, eval_steps)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print_result(auto)
    sweep_best = min(results, key=lambda r: r.best)
    print(f"repeats | default (DEPTH=auto) d{auto.depth}: best {auto.best:.4f} in {auto.used:.1f}s, "
          f"{(auto.best / sweep_best.best - 1) * 100:+.2f}% against the sweep's best (d{sweep_best.depth}, "
          f"{sweep_best.best:.4f} in {sweep_best.used:.1f}s) | unspent {auto.unspent}")
    return 0


def print_result(r: Result) -> None:
    print(f"repeats | {r.name:>5} | d{r.depth} | {r.passes:6.2f} passes | {r.used:6.1f}s used | best val_loss "
          f"{r.best:.4f} after {r.best_passes:5.2f} passes | unspent {r.unspent}", flush=True)
