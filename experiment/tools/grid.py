"""`bench grid`: DEPTH=auto against a sweep of explicit depths on a grid of corpora x data sizes x budgets.

    python -m experiment.tools.bench grid --results R.jsonl --corpus shakespeare.txt code.txt \\
        --chars 20000 150000 600000 --seconds 30 90 [--depths 2,4,6,8] [--table]

A cell is one corpus cut to its first --chars characters and one budget. In each cell every depth of
--depths trains from scratch for the whole budget (an explicit DEPTH with MAX_EPOCHS=0: no pass cap), then the default
run (DEPTH=auto, its probe and its pass cap included; --auto adds variants); every run keeps the trainer's default stop at
the val minimum. Each run appends one JSON line to --results as it ends: the full-val loss of the
step it serves (its best), the budget seconds it used, its passes and tokens per parameter, and why
it stopped. A run already in the file is skipped, so the grid grows over several sittings; --table
prints the cells from the file without training: auto's regret against the sweep's best and the
seconds each spent. Runs one after another: nothing else should run beside it (the budget is wall-clock).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

from experiment import checkpoint as ckpt
from experiment.autosize import rule_params
from experiment.model import GPTConfig
from experiment.report import read_records
from experiment.tools.ablate import parse_variant
from experiment.tools.probes import cpu_matmul_peak
from experiment.tools.versus import run_ours

VAL_FRACTION = 0.05  # the trainer's default


def add_arguments(p) -> None:
    p.add_argument("--results", required=True, help="a JSON-lines file that only grows")
    p.add_argument("--corpus", nargs="+", required=True, help=".txt files (bench corpus writes the code one)")
    p.add_argument("--chars", type=int, nargs="+", default=[20_000, 150_000, 600_000])
    p.add_argument("--seconds", type=float, nargs="+", default=[30.0, 90.0], help="the budgets")
    p.add_argument("--depths", default="2,4,6,8", help="the explicit sweep")
    p.add_argument("--auto", action="append", default=None, metavar="NAME:FLAGS",
                   help="a DEPTH=auto run and its extra flags, e.g. 'auto16:--max_epochs 16' (repeatable; "
                        "default 'auto:', the trainer's defaults; 'none': the sweep alone); the table compares each with "
                        "the sweep")
    p.add_argument("--seed", type=int, default=None,
                   help="every run's SEED (default: the trainer's); one seed per results file, as a cell's runs "
                        "are keyed by name")
    p.add_argument("--table", action="store_true", help="print the table from --results; train nothing")


def run_cell(corpus: Path, chars: int, seconds: float, depths: list[int], autos: list[tuple[str, list[str]]],
             peak: float, results: Path, seed: int | None = None) -> None:
    """Every run of one cell not yet in `results`, sweep first, then auto, each appended as it ends;
    the data written once into a temp workspace."""
    done = cells(read_rows(results)).get((corpus.stem, chars, seconds), {})
    todo = [(name, flags) for name, flags in [(f"d{d}", ["--depth", str(d), "--max_epochs", "0"]) for d in depths] + autos
            if name not in done]
    if not todo:
        return
    ws = Path(tempfile.mkdtemp(prefix="grid-"))
    try:
        data = ws / "data"
        data.mkdir()
        (data / "corpus.txt").write_text(corpus.read_text(encoding="utf-8")[:chars], encoding="utf-8")
        for name, flags in todo:
            run_ws = ws / name
            res = run_ours(data, seconds, VAL_FRACTION, run_ws, flags + ([] if seed is None else ["--seed", str(seed)]))
            row = describe(name, res, run_ws / "checkpoints" / "speedrun", corpus.stem, chars, seconds, peak)
            with results.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"grid | {corpus.stem} {chars:,} chars {seconds:g}s {name}: served {row['served']:.4f} "
                  f"in {row['used']:.1f}s | {row['outcome']}", flush=True)
            shutil.rmtree(run_ws / "checkpoints", ignore_errors=True)
    finally:
        shutil.rmtree(ws, ignore_errors=True)


def describe(name: str, res, run_dir: Path, corpus: str, chars: int, seconds: float, peak: float) -> dict:
    """One run's row: the served step's full-val loss, the seconds, passes and tokens/param it took."""
    meta = ckpt.read_meta(run_dir, ckpt.complete_steps(run_dir)[-1])
    state, best = meta["state"], ckpt.read_best(run_dir)
    train_tokens = json.loads((Path(meta["prepared"]["dir"]) / "meta.json").read_text())["split"]["train_tokens"]
    end = [r for r in read_records(run_dir / "metrics.jsonl") if r["kind"] == "end"]
    params = rule_params(GPTConfig(**meta["model_config"]))  # as DEPTH=auto counts them
    return {"corpus": corpus, "chars": chars, "seconds": seconds, "run": name,
            "depth": meta["model_config"]["depth"], "served": res.best_loss, "final": res.loss,
            "used": round(state["used_seconds"], 2), "passes": round(state["tokens_seen"] / train_tokens, 3),
            "best_passes": round(best["step"] * meta["train_config"]["total_batch_size"] / train_tokens, 3),
            "tokens_per_param": round(state["tokens_seen"] / params, 3), "train_tokens": train_tokens,
            "outcome": end[-1]["outcome"] if end else "", "peak_gflops": round(peak / 1e9),
            "attn_dropout": meta["train_config"].get("attn_dropout"), "average": meta["train_config"].get("average"),
            "seed": meta["train_config"].get("seed"),
            **regime_estimate(run_dir / "training.log"),
            "candidates": {f"d{c['depth']}": round(c["tok_per_s"]) for c in (meta.get("auto") or {}).get("candidates", [])}}


def regime_estimate(log_path: Path) -> dict:
    """The regime line's passes and tok/s (the rate a rule sees at this depth before training), if
    the run left its settings to the regime."""
    found = re.search(r"regime \| the budget makes about ([\d.]+) passes .*? at the \w+ ([\d,]+) tok/s",
                      log_path.read_text(errors="replace") if log_path.exists() else "")
    return {"regime_passes": float(found[1]), "regime_tok_per_s": int(found[2].replace(",", ""))} if found else {}


def read_rows(results: Path) -> list[dict]:
    return [json.loads(line) for line in results.read_text().splitlines() if line.strip()] if results.exists() else []


def cells(rows: list[dict]) -> dict[tuple, dict[str, dict]]:
    out: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        out.setdefault((r["corpus"], r["chars"], r["seconds"]), {})[r["run"]] = r
    return out


def table(rows: list[dict]) -> str:
    """Per cell and DEPTH=auto variant: its served loss, the sweep's best, the regret, the seconds,
    the winner's passes and tokens per parameter."""
    lines = ["| corpus | chars | budget | run | auto | sweep's best | regret | seconds: auto / winner | winner's "
             "passes, tokens/param | GFLOP/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (corpus, chars, seconds), runs in sorted(cells(rows).items()):
        sweep = [r for n, r in runs.items() if not n.startswith("auto")]
        if not sweep:
            continue
        win = min(sweep, key=lambda r: r["served"])
        for name, auto in sorted((n, r) for n, r in runs.items() if n.startswith("auto")):
            regret = auto["served"] / win["served"] - 1
            lines.append(f"| {corpus} | {chars:,} | {seconds:g} s | {name} | d{auto['depth']} {auto['served']:.4f} | "
                         f"d{win['depth']} {win['served']:.4f} | {regret:+.2%}{'' if regret <= 0.01 else ' (miss)'} | "
                         f"{auto['used']:.0f} / {win['used']:.0f} | {win['passes']:.1f}, "
                         f"{win['tokens_per_param']:.2f} | {auto['peak_gflops']} |")
    return "\n".join(lines)


def main(args) -> int:
    results = Path(args.results)
    if not args.table:
        peak = cpu_matmul_peak()
        print(f"grid | fp32 matmul peak {peak / 1e9:.0f} GFLOP/s | results {results}", flush=True)
        depths = [int(d) for d in args.depths.split(",")]
        autos = [] if args.auto == ["none"] else [parse_variant(a) for a in args.auto or ["auto:"]]
        for seconds in args.seconds:
            for chars in args.chars:
                for corpus in map(Path, args.corpus):
                    run_cell(corpus, chars, seconds, depths, autos, peak, results, args.seed)  # skips runs done
    print(table(read_rows(results)))
    return 0
