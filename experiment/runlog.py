"""Rank 0's record of a run: the human lines (stdout and training.log), TensorBoard, the eval report.

Off rank 0 the log is a no-op and the writer a null sink, so callers never branch on the rank.
"""

from __future__ import annotations

import contextlib
import sys
import time
import traceback
from pathlib import Path

from experiment.checkpoint import RunState
from experiment.dataloader import Prepared
from experiment.evaluation import sample_text
from experiment.metric import BestBy
from experiment.mixture import epochs_per_source
from experiment.model import GPT


class RunLog:
    """Rank 0's human lines: stdout and the run's training.log (and `also`: a generation's lines go to
    the run's own log too, so one `tail -f` follows every generation). Off rank 0 every call is a no-op."""

    def __init__(self, path: Path | None, also: Path | None = None):
        self.path, self.also, self.failing = path, also, False
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, msg: str) -> None:
        if self.path is None:
            return
        print(msg, flush=True)
        try:
            for path in filter(None, (self.path, self.also)):
                with open(path, "a") as f:
                    f.write(msg + "\n")
            self.failing = False
        except OSError as e:  # a full disk must not stop the run; stdout still has every line
            if not self.failing:
                print(f"warning: cannot append to {self.path} ({e}); lines go to stdout only", file=sys.stderr,
                      flush=True)
            self.failing = True


def log_crash(log_path: Path, rank: int) -> None:
    """Every rank appends its traceback to training.log: a run that died overnight says why."""
    with contextlib.suppress(OSError):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a") as f:
            f.write(f"[rank {rank}] crashed at {time.strftime('%Y-%m-%d %H:%M:%S')}:\n{traceback.format_exc()}")


class NullWriter:
    def add_scalar(self, *args, **kwargs): ...
    def flush(self): ...
    def close(self): ...



def report_eval(step: int, raw: tuple, average: tuple | None, weights: str, st: RunState,
                coverage: tuple[int, int, bool], log: RunLog, writer) -> dict:
    """The eval line (with several sources, the weighted loss, then each source's) and TensorBoard;
    returns the eval's metrics record. raw, average: evaluation.evaluate's (loss, bpc, by source) of
    the weights and of their average (None without AVERAGE); `weights`: the one the eval chose, whose
    loss is the line's val_loss.
    `coverage`: (tokens the eval read, tokens in the val split, all)."""
    chosen = average if weights == "average" else raw
    val_loss, val_bpc, by_source = chosen
    best = f"{st.best_val:.4f} @ {st.best_step:06d}" if st.best_step >= 0 else "- (step 0 is not saved)"
    if average is not None and st.best_step >= 0:
        best += f" ({st.best_weights})"
    which = ("" if average is None else f" (the average; raw weights {raw[0]:.4f})" if weights == "average"
             else f" (raw weights; the average {average[0]:.4f})")
    log(f"step {step:06d} | val_loss {val_loss:.4f}{which} | val_bpc {val_bpc:.4f} | best {best} | "
        f"{coverage[0]:,}/{coverage[1]:,} val tokens")
    writer.add_scalar("val/loss", val_loss, step)
    writer.add_scalar("val/bpc", val_bpc, step)
    writer.add_scalar("val/eval_tokens", coverage[0], step)
    record = {"kind": "eval", "step": step, "used_seconds": round(st.used_seconds, 3), "tokens_seen": st.tokens_seen,
              "val_loss": val_loss, "val_bpc": val_bpc, "eval_tokens": coverage[0]}
    if average is not None:
        writer.add_scalar("val/loss_raw", raw[0], step)
        writer.add_scalar("val/loss_average", average[0], step)
        record.update(val_loss_raw=raw[0], val_loss_average=average[0],
                      weights=weights)
    if by_source:
        log(f"step {step:06d} | val_loss by source | " + " | ".join(f"{n} {v:.4f}" for n, v in by_source.items()))
        for name, loss in by_source.items():
            writer.add_scalar(f"val/loss/{name}", loss, step)
        record["val_loss_by_source"] = by_source
    writer.flush()
    return record


def record_metric(step: int, values: dict[str, float] | None, best_by: BestBy, st: RunState, log: RunLog,
                  writer) -> dict:
    """EVAL_METRIC's line and TensorBoard scalars (val/metric/<name>); the eval record's part."""
    if values is None:
        return {}
    best = f" | best by {best_by.describe(st.best_score)} @ {st.best_step:06d}" if best_by.name and st.best_step >= 0 else ""
    log(f"step {step:06d} | metric | " + " | ".join(f"{n} {v:.4f}" for n, v in values.items()) + best)
    for name, value in values.items():
        writer.add_scalar(f"val/metric/{name}", value, step)
    writer.flush()
    return {"metric": values}


def report_sample(step: int, model: GPT, prepared: Prepared, prompt: list[int], n_tokens: int, log: RunLog,
                  report) -> None:
    """Rank 0: the model's continuation of the eval prompt."""
    tok = prepared.tokenizer()
    text = sample_text(model, tok, prompt, n_tokens)
    log(f"sample | {tok.decode(prompt)!r} -> {text!r}")
    report.sample(step, tok.decode(prompt), text)


def log_step(log: RunLog, writer, step: int, loss: float, lr: float, lr_mult: float, dt: float, tok_s: float,
             mfu: float | None, mem_gib: float, used_h: float, budget_h: float, eta: tuple[float, str]) -> None:
    """The step line and the same values to TensorBoard; eta: (hours to the projected end, its cause)."""
    log(f"step {step:06d} | loss {loss:.4f} | lr {lr:.2e} | dt {1000 * dt:.0f}ms | tok/s {tok_s:,.0f} | "
        f"mfu {f'{100 * mfu:.1f}%' if mfu is not None else '-'} | mem {mem_gib:.1f}GiB | "
        f"used {used_h:.2f}h/{budget_h:.2f}h | eta {eta[0]:.2f}h ({eta[1]})")
    for name, value in (("train/loss", loss), ("train/lr_multiplier", lr_mult), ("perf/tok_per_s", tok_s),
                        ("perf/mem_gib", mem_gib)):
        writer.add_scalar(name, value, step)
    if mfu is not None:
        writer.add_scalar("perf/mfu", mfu, step)


def planner_line(rate: float, seconds_left: float, step: int, tokens_seen: int, tokens_per_step: int,
                 budget_h: float, train_tokens: int, n_params: int) -> str:
    """From the measured tok/s: the steps, tokens, epochs and tokens per parameter the budget buys."""
    total = tokens_seen + rate * seconds_left
    return (f"planner | measured {rate:,.0f} tok/s | projected {int(step + rate * seconds_left / tokens_per_step):,} "
            f"steps, {total:,.0f} tokens in the {budget_h:.3f}h budget | {total / train_tokens:.2f} epochs | "
            f"{total / n_params:.1f} tokens/param")



# Repeating data up to about 4 epochs is nearly as good as new data; beyond, returns fall off fast
# (Muennighoff et al. 2023, "Scaling Data-Constrained Language Models").
MAX_GOOD_EPOCHS = 4


def source_epoch_lines(total_tokens: float, weights: list[float], splits: list[dict]) -> list[str]:
    """Each source's epochs over the budget's projected tokens, and a warning for any source that
    repeats more than MAX_GOOD_EPOCHS times."""
    sizes = [s["train"][1] - s["train"][0] for s in splits]
    epochs = epochs_per_source(total_tokens, weights, sizes)
    lines = ["planner | epochs by source | " + " | ".join(
        f"{s['name']} {w:.3f} of the mix, {e:.2f} epochs" for s, w, e in zip(splits, weights, epochs))]
    for s, e in zip(splits, epochs):
        if e > MAX_GOOD_EPOCHS:
            lines.append(f"warning: source {s['name']} will be seen {e:.1f} times in the budget (more than "
                         f"{MAX_GOOD_EPOCHS}: it will be memorized more than learned); give it a lower DATA_MIX "
                         "weight or add text")
    return lines
