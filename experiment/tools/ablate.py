"""`bench ablate`: recipe variants trained side by side, each for S seconds of budget (the loss at
equal seconds) and/or N optimizer steps (the loss at equal tokens, the seconds it took beside), on
one or more corpora, the full-val loss of each run appended to a results file and tabled against a
baseline.

    python -m experiment.tools.bench ablate --results R.jsonl --data shakespeare.txt code.txt \\
        --seconds 60 180 --steps 600 --repeats 3 --variant "base:" --variant "bigram:--bigram_embed 1" \\
        [--common "--depth 4"] [--table]

The figure that carries to a GPU is the loss at equal tokens: a CPU second is not a GPU second, but a
token is a token. A steps run fixes the depth (--common "--depth N").

Each repeat runs every variant once, in rotated order, so a drifting machine load favours none. A
variant is a name and the experiment.train flags that make it; --common flags go to every run. The
results file only grows (one JSON line per run), so screens run in several sittings add up; --table
prints the medians from it without training. Measure on an idle machine: nothing else running.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import statistics
import tempfile
from pathlib import Path

import torch

from experiment.tools.probes import cpu_matmul_peak
from experiment.tools.versus import run_ours


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, flags = text.partition(":")
    if not name:
        raise ValueError(f"--variant {text!r}: expected NAME:FLAGS")
    return name, shlex.split(flags)


def budgets(args) -> list[tuple[str, float]]:
    """("seconds", S) for each --seconds, then ("steps", N) for each --steps: the clock's budget and
    the tokens' (N optimizer steps of the run's batch: equal tokens for every variant that keeps it)."""
    return [("seconds", s) for s in args.seconds] + [("steps", n) for n in args.steps]


def run_all(args, variants: list[tuple[str, list[str]]], peak: float) -> None:
    results = Path(args.results)
    for kind, amount in budgets(args):
        for r in range(args.repeats):
            for data in args.data:
                order = variants[r % len(variants):] + variants[: r % len(variants)]
                for name, flags in order:
                    ws = Path(tempfile.mkdtemp(prefix="ablate-"))
                    try:
                        res = run_ours(Path(data), amount if kind == "seconds" else 0.0, args.val_fraction, ws,
                                       shlex.split(args.common) + flags, steps=int(amount) if kind == "steps" else None)
                    finally:
                        shutil.rmtree(ws, ignore_errors=True)
                    row = {"variant": name, "flags": " ".join(flags), "common": args.common,
                           "corpus": Path(data).stem, kind: amount, "loss": res.loss, "best_loss": res.best_loss,
                           "used": res.seconds, "tokens": res.tokens,
                           "summary": res.summary, "peak_gflops": round(peak / 1e9)}
                    print(f"ablate | {row['corpus']} {label(row)} {name}: {res.loss:.4f}, best step {res.best_loss:.4f} "
                          f"({res.summary}; {res.tokens:,} tokens in {res.seconds:.1f} s)", flush=True)
                    with results.open("a") as f:
                        f.write(json.dumps(row) + "\n")


def budget_of(row: dict) -> tuple[str, float]:
    """A row's budget: ("steps", N) for the tokens, else ("seconds", S) for the clock."""
    return ("steps", row["steps"]) if row.get("steps") else ("seconds", row["seconds"])


def label(row: dict) -> str:
    """A row's budget in words: "180 s" or "600 steps"."""
    kind, amount = budget_of(row)
    return f"{amount:g} steps" if kind == "steps" else f"{amount:g} s"


def table(results: Path, baseline: str) -> str:
    """Medians by corpus, budget and variant. A clock budget compares what each variant makes of the
    same seconds; a steps budget what it makes of the same tokens, with the seconds it took beside."""
    rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    groups: dict[tuple, list[dict]] = {}
    for row in rows:  # keyed so that budgets sort by kind, then by amount
        groups.setdefault((row["corpus"], *budget_of(row), row["variant"]), []).append(row)
    lines = ["| corpus | budget | variant | runs | median loss | vs " + baseline + " | median seconds |",
             "|---|---|---|---|---|---|---|"]
    for (corpus, kind, amount, variant), group in sorted(groups.items()):
        med = statistics.median(r["loss"] for r in group)
        base, budget = groups.get((corpus, kind, amount, baseline)), label(group[0])
        delta = f"{med - statistics.median(r['loss'] for r in base):+.4f}" if base and variant != baseline else ""
        used = statistics.median(r["used"] for r in group)
        lines.append(f"| {corpus} | {budget} | {variant} | {len(group)} | {med:.4f} | {delta} | {used:.1f} |")
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--results", required=True, help="JSON-lines file the runs are appended to")
    p.add_argument("--data", nargs="+", default=[], help=".txt corpora")
    p.add_argument("--seconds", type=float, nargs="*", default=[], help="clock budgets, seconds each")
    p.add_argument("--steps", type=int, nargs="*", default=[],
                   help="token budgets, optimizer steps each (equal tokens; --common must name --depth)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--variant", action="append", default=[], help="NAME:TRAIN_FLAGS (repeatable)")
    p.add_argument("--common", default="", help="experiment.train flags for every run")
    p.add_argument("--val_fraction", type=float, default=0.1)
    p.add_argument("--baseline", default="base", help="the variant the others are compared with")
    p.add_argument("--table", action="store_true", help="only print the table of the results file")


def main(args) -> int:
    if not args.table:
        if not args.seconds and not args.steps:
            raise SystemExit("ablate: give --seconds S ... and/or --steps N ...")
        if args.steps and not re.search(r"--depth[ =]\d+", args.common):
            raise SystemExit("ablate: --steps needs --common '--depth N' (DEPTH=auto sizes the model to a clock)")
        variants = [parse_variant(v) for v in args.variant]
        peak = cpu_matmul_peak()
        print(f"ablate | fp32 matmul peak {peak / 1e9:.0f} GFLOP/s, {torch.get_num_threads()} threads, "
              f"torch {torch.__version__}", flush=True)
        run_all(args, variants, peak)
    print(table(Path(args.results), args.baseline))
    return 0
