"""`bench speedrun` and `bench versus`: our trainer for exactly S seconds of budget, and the same beside
unmodified nanoGPT on the same machine, data and split, one after the other.

    python -m experiment.tools.bench versus --nanogpt PATH_TO_NANOGPT --seconds 180 [--repeats 3]

nanoGPT runs its README's "baby GPT" CPU command (4 layers, 4 heads, width 128, context 64, batch 12,
no dropout, no compile) from a copy of its files, on Tiny Shakespeare char-level bins written here the
way its prepare.py writes them (first 90% train, last 10% val). Its schedule is fixed in iterations,
so a short calibration run measures its seconds per iteration and per eval, and max_iters (= its
lr_decay_iters) is sized so that its whole loop, evals included, fills the budget (within 5%, else
it is re-sized from that run's own timing and run again, at most twice); its eval interval
stays near its config's 250 and divides max_iters, so its last eval saves the final weights. Both
final losses are over every whole window of the same val text. Two ways to say how much sooner ours
gets there:
- "reach": the budget second at which the S-second run's eval curve first gets to nanoGPT's final
  loss (linear between evals, which errs late on a convex curve). Its evals here cover the whole val
  split, the text of both final losses: the trainer's default slice (the first 65,536 tokens) is
  easier text and reads ~0.09 lower on Tiny Shakespeare.
- per token (`--per_token 1`, the default): ours at the depth its S-second run chose, trained again
  on exactly nanoGPT's token count (the schedule sized to those optimizer steps, the clock out of
  the way). A CPU second does not carry to a GPU; a token does: this is the gap a GPU run inherits.
- the budget ladder (`--ladder 3,5`): ours trained from scratch with a budget of S/r for each r, as a
  user would run it, schedule and DEPTH=auto included; met where that run ends at or below nanoGPT's
  S-second loss. This is a speedrun's measure, and the fair one where both schedules are sized to
  their budget, as here: the curve's reach reads a run before its warmdown.
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from experiment import checkpoint as ckpt
from experiment.dataloader import Prepared
from experiment.distributed import Dist
from experiment.evaluation import evaluate
from experiment.files import REPO_ROOT
from experiment.report import read_records
from experiment.tools.probes import cpu_matmul_peak

NANO_BLOCK, NANO_BATCH = 64, 12
BABY_GPT = ["--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1", f"--block_size={NANO_BLOCK}",
            f"--batch_size={NANO_BATCH}", "--n_layer=4", "--n_head=4", "--n_embd=128", "--dropout=0.0"]
NANO_TOKENS_PER_ITER = NANO_BATCH * NANO_BLOCK  # the targets of one iteration
NANO_EVAL_INTERVAL = 250  # config/train_shakespeare_char.py
CALIBRATION_ITERS = 60
LOOP_TOLERANCE = 0.05  # nanoGPT's loop must fill the budget within 5%
WHOLE_VAL = ["--eval_tokens", str(1 << 40)]  # ours' in-run evals: the whole val split (the slice is clipped to it)


@dataclass
class Result:
    loss: float  # nats/char over every whole window of the val split
    curve: list[tuple[float, float]]  # (budget seconds, val loss) at each eval
    seconds: float  # budget (ours) or loop time (nanoGPT) actually used
    summary: str
    val_tokens: int  # predicted tokens in the final loss
    best_loss: float | None = None  # ours: the same loss for the best-val step, the one the run serves
    tokens: int = 0  # training tokens seen
    depth: int | None = None  # ours: the depth trained
    tokens_per_step: int = 0


# ------------------------------------------------------------------------------------------ ours


def run_ours(data: Path, seconds: float, val_fraction: float, workspace: Path, train_args: list[str],
             eval_every_seconds: float | None = None, steps: int | None = None) -> Result:
    """Train from scratch for `seconds` of budget with the trainer's defaults (plus train_args) and
    evaluate the final model and the best-val step on the whole val split. With `steps`, the budget is
    tokens instead: that many optimizer steps (the schedule follows them; MAX_STEPS), the clock out of
    the way, the stop at the val minimum and the pass cap off, evals every sixth of them; train_args
    must then name the depth (DEPTH=auto sizes to a clock)."""
    if steps:  # neither the stop at the val minimum nor the pass cap may end it short of its tokens
        budget = ["--training_hours", "1000", "--max_steps", str(steps), "--eval_every_steps", str(max(1, steps // 6)),
                  "--eval_every_minutes", "1e9", "--plateau_evals", "0", "--max_epochs", "0"]
    else:
        budget = ["--training_hours", str(seconds / 3600),
                  "--eval_every_minutes", str((eval_every_seconds or seconds / 6) / 60)]
    cmd = [sys.executable, "-m", "experiment.train", "--data_dir", str(data), "--workspace", str(workspace),
           *budget, "--val_fraction", str(val_fraction), "--model_tag", "speedrun", "--resume", "never",
           "--sample_tokens", "0", "--save_every_minutes", "1e9", "--log_every_steps", "50", *train_args]
    print(f"speedrun | {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"training exited {proc.returncode}")
    run_dir = workspace / "checkpoints" / "speedrun"
    step = ckpt.complete_steps(run_dir)[-1]
    last = ckpt.model_path(run_dir, step)
    loss, meta, val_tokens = _full_val_loss(last)
    # The run serves its best-val step, which a run that repeats its data ends far from; both on the
    # full val split. The server's own lookup names it.
    served = ckpt.resolve_serving_checkpoint(run_dir, workspace)
    best_loss = loss if served == last else _full_val_loss(served)[0]
    curve = [(r["used_seconds"], r["val_loss"]) for r in read_records(run_dir / "metrics.jsonl") if r["kind"] == "eval"]
    c = meta["model_config"]
    tokens_per_step = meta["train_config"]["total_batch_size"]
    auto = (meta.get("auto") or {}).get("reason")
    summary = (f"d{c['depth']} w{c['depth'] * c['aspect_ratio']} seq {c['max_seq_len']}, {step} steps x "
               f"{tokens_per_step} tokens" + (f" ({auto})" if auto else ""))
    return Result(loss, curve, meta["state"]["used_seconds"], summary, val_tokens, best_loss,
                  tokens=meta["state"]["tokens_seen"], depth=c["depth"], tokens_per_step=tokens_per_step)


def _full_val_loss(model_file: Path) -> tuple[float, dict, int]:
    """(loss over every whole window of the val split, the step's meta, the tokens it predicted)."""
    model, meta = ckpt.load_model(model_file)
    prepared = Prepared.load(meta["prepared"]["dir"])
    seq, n_val = model.config.max_seq_len, len(prepared.tokens("val"))
    loss, _, _ = evaluate(model, prepared, seq, 16, n_val, Dist(0, 0, 1, torch.device("cpu")))
    return loss, meta, (n_val - 1) // seq * seq


# --------------------------------------------------------------------------------------- nanoGPT


def write_nanogpt_copy(nanogpt: Path, text: str, dest: Path) -> None:
    """nanoGPT's files (the anchor is read-only) and its shakespeare_char bins, as its prepare.py
    makes them, without the download."""
    for name in ("train.py", "model.py", "configurator.py", "config/train_shakespeare_char.py"):
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(nanogpt / name, dest / name)
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    data = dest / "data" / "shakespeare_char"
    data.mkdir(parents=True, exist_ok=True)
    cut = int(len(text) * 0.9)
    for split, part in (("train", text[:cut]), ("val", text[cut:])):
        np.array([stoi[ch] for ch in part], dtype=np.uint16).tofile(data / f"{split}.bin")
    meta = {"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}
    (data / "meta.pkl").write_bytes(pickle.dumps(meta))


def _run_nanogpt_once(copy: Path, max_iters: int, eval_interval: int) -> tuple[list[float], list[tuple[int, float]]]:
    """Run nanoGPT; (seconds of each iteration as it reports them, [(iteration, val loss)] per eval).
    An iteration's reported time includes the eval and checkpoint that ran before it."""
    cmd = [sys.executable, "train.py", "config/train_shakespeare_char.py", *BABY_GPT, "--out_dir=out",
           "--always_save_checkpoint=True", f"--max_iters={max_iters}", f"--lr_decay_iters={max_iters}",
           f"--eval_interval={eval_interval}"]
    proc = subprocess.run(cmd, cwd=copy, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nanoGPT exited {proc.returncode}: {proc.stderr[-2000:]}")
    iters = [float(m) / 1000 for m in re.findall(r"^iter \d+: loss [\d.]+, time ([\d.]+)ms", proc.stdout, re.M)]
    evals = [(int(i), float(v)) for i, v in re.findall(r"^step (\d+): train loss [\d.]+, val loss ([\d.]+)",
                                                       proc.stdout, re.M)]
    return iters, evals


def size_nanogpt(iter_s: float, eval_s: float, seconds: float) -> tuple[int, int]:
    """(max_iters, eval_interval) whose loop (iterations plus evals at 0, every interval and at the end)
    fills `seconds`, with an interval near nanoGPT's 250 that divides max_iters."""
    n = max(1, int((seconds - eval_s) / (iter_s + eval_s / NANO_EVAL_INTERVAL)))
    n_evals = max(1, round(n / NANO_EVAL_INTERVAL))
    interval = max(1, n // n_evals)
    return interval * n_evals, interval


NANO_EVAL = """
import json, sys, numpy as np, torch, torch.nn.functional as F
from model import GPT, GPTConfig
ck = torch.load('out/ckpt.pt', map_location='cpu', weights_only=True)
model = GPT(GPTConfig(**ck['model_args']))
model.load_state_dict({k.removeprefix('_orig_mod.'): v for k, v in ck['model'].items()})
model.eval()
val = torch.from_numpy(np.fromfile('data/shakespeare_char/val.bin', dtype=np.uint16).astype(np.int64))
seq = ck['model_args']['block_size']
n = (len(val) - 1) // seq
x, y = val[: n * seq].view(n, seq), val[1 : n * seq + 1].view(n, seq)
total = 0.0
with torch.no_grad():
    for i in range(0, n, 64):
        logits, _ = model(x[i : i + 64], y[i : i + 64])
        total += F.cross_entropy(logits.flatten(0, 1), y[i : i + 64].flatten(), reduction='sum').item()
print(json.dumps({'loss': total / (n * seq), 'tokens': n * seq, 'iter_num': ck['iter_num']}))
"""


def _timing(iters: list[float], eval_iters: list[int]) -> tuple[float, float]:
    """(seconds per iteration, seconds per eval + checkpoint) from a run's reported iteration times."""
    evals = set(eval_iters)
    skip = min(5, len(iters) // 2)  # the first iterations warm up; a short run (a loaded machine) keeps half
    iter_s = statistics.median([t for i, t in enumerate(iters[skip:], skip) if i not in evals] or iters[-1:])
    at_evals = [iters[i] for i in evals if i < len(iters)]
    return iter_s, max(0.0, statistics.median(at_evals) - iter_s) if at_evals else 0.0


def run_nanogpt(nanogpt: Path, text: str, seconds: float, workspace: Path) -> Result:
    """Calibrate, size, run; a run whose loop misses the budget by more than LOOP_TOLERANCE (the
    machine's speed drifts between the calibration and the run) is re-sized from its own timing and
    run again, at most twice."""
    copy = workspace / "nanogpt"
    write_nanogpt_copy(nanogpt, text, copy)
    half = CALIBRATION_ITERS // 2
    iter_s, eval_s = _timing(_run_nanogpt_once(copy, CALIBRATION_ITERS, half)[0], [half, CALIBRATION_ITERS])
    for attempt in range(3):
        max_iters, interval = size_nanogpt(iter_s, eval_s, seconds)
        print(f"versus | nanoGPT {'calibration' if attempt == 0 else 're-sized from its last run'}: "
              f"{1000 * iter_s:.1f} ms/iter, {eval_s:.2f} s/eval+save -> max_iters {max_iters}, "
              f"eval_interval {interval}", flush=True)
        shutil.rmtree(copy / "out", ignore_errors=True)
        iters, evals = _run_nanogpt_once(copy, max_iters, interval)
        within = abs(sum(iters) - seconds) <= LOOP_TOLERANCE * seconds
        print(f"versus | nanoGPT run {attempt + 1}: loop {sum(iters):.1f}s against {seconds:g}s: "
              f"{'within' if within else 'missed by more than'} {LOOP_TOLERANCE:.0%}", flush=True)
        if within:
            break
        iter_s, eval_s = _timing(iters, [i for i, _ in evals if i])
    else:  # a machine whose speed swings this much between runs makes the losses incomparable too
        print(f"versus | WARNING: nanoGPT's loop missed its {seconds:g}s budget three times: the machine's "
              "speed drifts between runs; compare the losses only from an idle machine", flush=True)
    elapsed = np.cumsum([0.0] + iters)
    curve = [(float(elapsed[i]), v) for i, v in evals]  # an eval's time: the loop seconds before it
    out = subprocess.run([sys.executable, "-c", NANO_EVAL], cwd=copy, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"nanoGPT eval failed: {out.stderr[-2000:]}")
    final = json.loads(out.stdout.strip().splitlines()[-1])
    if final["iter_num"] != max_iters:
        raise RuntimeError(f"nanoGPT's last checkpoint is iteration {final['iter_num']}, not {max_iters}")
    summary = f"{max_iters} iters x {NANO_TOKENS_PER_ITER} tokens, loop {elapsed[-1]:.1f}s"
    return Result(final["loss"], curve, float(elapsed[-1]), summary, final["tokens"],
                  tokens=max_iters * NANO_TOKENS_PER_ITER)


# ---------------------------------------------------------------------------------------- compare


def seconds_to_reach(curve: list[tuple[float, float]], target: float) -> float | None:
    """First budget second at which the curve is at or below target, linear between points."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if l1 <= target:
            return t1 if l0 == l1 else t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return curve[0][0] if curve and curve[0][1] <= target else None


def compare(nano: Result, ours: Result, seconds: float) -> dict:
    reach = seconds_to_reach(ours.curve, nano.loss)
    return {"nanogpt": nano.loss, "ours": ours.loss, "delta": ours.loss - nano.loss, "reach_s": reach,
            "speedup": seconds / reach if reach else None}


def _fmt_reach(r: dict) -> str:
    if r["reach_s"] is None:
        return "never"
    return f"{r['reach_s']:.1f}s ({r['speedup']:.1f}x)"


def run_repeat(r: int, nanogpt: Path, data: Path, text: str, ws: Path, args) -> dict:
    """Both sides once, in alternating order so a drifting machine load favours neither; prints and
    returns the comparison."""
    sides = {}
    for side in (("nanogpt", "ours") if r % 2 == 0 else ("ours", "nanogpt")):
        sides[side] = (run_nanogpt(nanogpt, text, args.seconds, ws) if side == "nanogpt" else
                       run_ours(data, args.seconds, 0.1, ws / "ours", [*WHOLE_VAL, *args.train_args]))
    nano, ours = sides["nanogpt"], sides["ours"]
    row = compare(nano, ours, args.seconds)
    print(f"versus | repeat {r + 1} | nanoGPT {nano.loss:.4f} ({nano.summary}) | ours {ours.loss:.4f} "
          f"({ours.summary}, used {ours.seconds:.1f}s) | ours - nanoGPT {row['delta']:+.4f} | ours reaches "
          f"{nano.loss:.4f} at {_fmt_reach(row)}", flush=True)
    print("versus | curves (budget s: val loss; nanoGPT's 20 random batches, ours every window) | nanoGPT "
          + ", ".join(f"{t:.0f}: {v:.3f}" for t, v in nano.curve)
          + " | ours " + ", ".join(f"{t:.0f}: {v:.3f}" for t, v in ours.curve), flush=True)
    if args.per_token:
        row["per_token"] = per_token(nano, ours, data, ws, args)
    row["ladder"] = {}
    for ratio in args.ladder:
        short = run_ours(data, args.seconds / ratio, 0.1, ws / f"ours-{ratio:g}x", [*WHOLE_VAL, *args.train_args])
        row["ladder"][ratio] = short.loss
        print(f"versus | repeat {r + 1} | ladder {ratio:g}x: ours with a {args.seconds / ratio:.1f}s budget ends at "
              f"{short.loss:.4f} ({short.summary}), nanoGPT - ours {nano.loss - short.loss:+.4f}: "
              f"{'met' if short.loss <= nano.loss else 'MISSED'}", flush=True)
    return row


def per_token(nano: Result, ours: Result, data: Path, ws: Path, args) -> float:
    """Ours at the depth its S-second run chose, trained on as many tokens as nanoGPT's S-second run
    (steps of ours' batch, rounded up; the schedule sized to them, the clock out of the way): the
    loss at equal tokens, the figure a GPU run inherits. Returns ours' loss minus nanoGPT's."""
    steps = math.ceil(nano.tokens / ours.tokens_per_step)
    run = run_ours(data, 0.0, 0.1, ws / "ours-tokens", [*WHOLE_VAL, *args.train_args, "--depth", str(ours.depth)],
                   steps=steps)
    gap = run.loss - nano.loss
    if run.tokens < nano.tokens:  # train_args ended it early (a MAX_STEPS or budget of their own)
        print(f"versus | per token | warning: ours stopped at {run.tokens:,} tokens, short of nanoGPT's", flush=True)
    print(f"versus | per token | nanoGPT {nano.loss:.4f} on {nano.tokens:,} tokens | ours {run.loss:.4f} on "
          f"{run.tokens:,} ({run.summary}, {run.seconds:.1f}s) | ours - nanoGPT {gap:+.4f}; ours' {args.seconds:g}s "
          f"run saw {ours.tokens:,}", flush=True)
    return gap


def add_arguments(p) -> None:
    p.add_argument("--nanogpt", default=str(REPO_ROOT.parent / "shared" / "anchors" / "nanogpt"),
                   help="an unmodified nanoGPT checkout (train.py, model.py, configurator.py, config/)")
    p.add_argument("--seconds", type=float, required=True, help="the budget of each side")
    p.add_argument("--data", default=str(REPO_ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"),
                   help="one .txt file (nanoGPT's char-level recipe takes one)")
    p.add_argument("--repeats", type=int, default=1, help="runs of both; the summary gives the medians")
    p.add_argument("--ladder", type=_ratios, default=[3.0, 5.0],
                   help="comma-separated r: also train ours alone with a budget of S/r (none: empty string)")
    p.add_argument("--per_token", type=int, default=1,
                   help="1: also train ours on nanoGPT's token count at the depth its run chose (0: skip)")
    p.add_argument("--workspace", default=None, help="default: a new temp directory, removed at the end")
    p.add_argument("train_args", nargs="*", help="extra experiment.train flags for ours after --")


def _ratios(text: str) -> list[float]:
    ratios = [float(x) for x in text.split(",") if x.strip()]
    if any(r <= 1 for r in ratios):
        raise argparse.ArgumentTypeError(f"each ratio must be above 1, got {text!r}")
    return ratios


def main(args) -> int:
    nanogpt, data = Path(args.nanogpt), Path(args.data)
    missing = [str(p) for p in (nanogpt / "train.py", data) if not p.is_file()]
    if missing:
        print(f"versus | skipped: not found: {', '.join(missing)} (pass --nanogpt PATH and --data FILE)")
        return 0
    text = data.read_text(encoding="utf-8")
    keep = args.workspace is not None
    root = Path(args.workspace) if keep else Path(tempfile.mkdtemp(prefix="versus-"))
    print(f"versus | {data.name}, val = last 10% | budget {args.seconds:g}s each | fp32 matmul peak "
          f"{cpu_matmul_peak() / 1e9:.0f} GFLOP/s, {torch.get_num_threads()} threads, torch {torch.__version__}",
          flush=True)
    try:
        rows = [run_repeat(r, nanogpt, data, text, root / f"repeat{r + 1}", args) for r in range(args.repeats)]
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in rows) for k in ("nanogpt", "ours", "delta")}
    reaches = [r["reach_s"] if r["reach_s"] is not None else math.inf for r in rows]
    reach = statistics.median(reaches)
    print(f"versus | median of {len(rows)} | nanoGPT {med['nanogpt']:.4f} | ours {med['ours']:.4f} | "
          f"ours - nanoGPT {med['delta']:+.4f} | reach {reach:.1f}s = {args.seconds / reach:.1f}x | goals: "
          f"reach <= {args.seconds / 5:g}s {'met' if reach <= args.seconds / 5 else 'MISSED'}, "
          f"ours <= nanoGPT - 0.25 {'met' if med['delta'] <= -0.25 else 'MISSED'}")
    if args.per_token:
        gap = statistics.median(r["per_token"] for r in rows)
        print(f"versus | median of {len(rows)} | per token: ours - nanoGPT at nanoGPT's tokens {gap:+.4f} | goal "
              f"<= -0.25 {'met' if gap <= -0.25 else 'MISSED'}")
    for ratio in args.ladder:
        loss = statistics.median(r["ladder"][ratio] for r in rows)
        print(f"versus | median of {len(rows)} | ladder {ratio:g}x: ours with a {args.seconds / ratio:.1f}s budget "
              f"{loss:.4f}, nanoGPT's {args.seconds:g}s {med['nanogpt']:.4f}: "
              f"{'met' if loss <= med['nanogpt'] else 'MISSED'}")
    return 0
