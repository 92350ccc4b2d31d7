"""What a run leaves to read: metrics.jsonl, and report.md with loss.svg beside it in the run directory.

Rank 0 keeps a RunReport (other ranks a NullReport, so callers have no `if master:`). Every step
line, eval and save adds a record to metrics.jsonl; report.md and loss.svg are rewritten, each
atomically, at every eval and at the end. A resumed run reads metrics.jsonl back (records up to
the step it resumes), so the curve covers every restart. The picture is drawn here: no plotting
dependency, plain SVG that any browser or Markdown viewer shows.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from xml.sax.saxutils import escape

from typing import TYPE_CHECKING

from experiment.files import atomic_write_bytes

if TYPE_CHECKING:
    from experiment.config import TrainConfig
    from experiment.dataloader import Prepared
    from experiment.distributed import Dist
    from experiment.model import GPT

KEPT_SAMPLES = 3  # the latest eval samples the report shows
TABLE_ROWS = 12  # the latest evals and saves the report lists
MAX_TRAIN_POINTS = 2000  # of the train curve in the picture: a day's step lines thinned evenly
PALETTE = ("#d9480f", "#2b8a3e", "#7048e8", "#c2255c", "#0b7285", "#e67700")  # per-source val curves


class NullReport:
    def add(self, record: dict) -> None: ...
    def note(self, key: str, value: str) -> None: ...
    def sample(self, step: int, prompt: str, text: str) -> None: ...
    def write(self, state, status: str) -> None: ...


class RunReport:
    def __init__(self, run_dir: Path, facts: dict, resume_step: int | None, log=print):
        """facts: what the run is (model, batch, data, budget, config), fixed at setup; log: where a
        failed write (a full disk) is reported, once until writes succeed again: the run goes on."""
        self.run_dir, self.facts, self.samples, self.log, self.failing = Path(run_dir), facts, [], log, False
        self.path = self.run_dir / "metrics.jsonl"
        # A launch the trainer refused at its start left an end record with no step: never one to resume.
        self.records = [r for r in read_records(self.path)
                        if resume_step is not None and r.get("step", math.inf) <= resume_step]

    def add(self, record: dict) -> None:
        self.records.append(record)
        self._try(self._append, record)

    def _append(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def _try(self, write, *args) -> None:
        try:
            write(*args)
            self.failing = False
        except OSError as e:
            if not self.failing:
                self.log(f"warning: the run report could not be written ({e}); training goes on")
            self.failing = True

    def note(self, key: str, value: str) -> None:
        """A fact learned during the run (the planner's projection), shown from the next write on."""
        self.facts[key] = value

    def sample(self, step: int, prompt: str, text: str) -> None:
        self.samples = [*self.samples, (step, prompt, text)][-KEPT_SAMPLES:]

    def write(self, state, status: str) -> None:
        """report.md and loss.svg from the records so far; `state` is the run's RunState."""
        self._try(atomic_write_bytes, self.run_dir / "loss.svg", loss_svg(self.records, state.best_step).encode())
        self._try(atomic_write_bytes, self.run_dir / "report.md", markdown(self, state, status).encode())


def read_records(path: Path) -> list[dict]:
    """metrics.jsonl's records; a line a crash cut short is skipped."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


# ---------------------------------------------------------------- report.md


def markdown(report: RunReport, st, status: str) -> str:
    f, records = report.facts, report.records
    evals = [r for r in records if r.get("kind") == "eval"]
    trains = [r for r in records if r.get("kind") == "train"]
    saves = [r for r in records if r.get("kind") == "save"]
    budget, used = f["budget_seconds"], st.used_seconds
    speed = trains[-1] if trains else None
    rows = [
        ("model", f"{f['model']}: {f['params']:,} parameters"),
        ("device", f["device"]), ("batch", f["batch"]), ("data", f["data"]),
        ("budget", f"{_duration(used)} used of {_duration(budget)}, {_duration(max(budget - used, 0))} left"
                   + (f"; {_duration(st.restart_seconds)} of it lost to restarts (training a crash or a stop threw "
                      "away, and the restarts' setup)" if st.restart_seconds else "")),
        ("tokens", f"{st.tokens_seen:,} seen: {st.tokens_seen / f['params']:.2f} tokens/param, "
                   f"{st.tokens_seen / f['train_tokens']:.2f} passes over the training data"),
        ("speed", "not measured yet" if speed is None else f"{speed['tok_s']:,.0f} tok/s, MFU "
                  + (f"{100 * speed['mfu']:.1f}%" if speed.get("mfu") is not None else "- (no known peak)")
                  + f" (step {speed['step']})"),
        ("best", f"val loss {st.best_val:.4f} at step {st.best_step}: {f['best_file'].format(step=st.best_step)}"
                 + (", the weight average (AVERAGE), which beat the raw weights" if st.best_weights == "average"
                    else ", the raw weights: their average (AVERAGE) did not beat them"
                    if f["config"].get("average", "none") != "none" else "")
                 + _best_by(f["config"].get("best_by", "val_loss"), evals, st.best_step) if st.best_step >= 0
                 else "no checkpoint yet"),
    ] + [(k, f[k]) for k in ("eval", "plan", "auto", "regime") if f.get(k)]
    if status == "running" and f.get("projected end"):  # the step line's eta, as of the latest step line
        rows.append(("projected end", f["projected end"]))
    lines = [f"# Run report: {f['model_tag']}", "",
             f"{status} | step {st.step} | updated {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}", "",
             "![train and val loss against time and tokens; the best checkpoint marked](loss.svg)", "",
             "| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows], ""]
    lines += _eval_table(evals) + _save_table(saves) + _sample_lines(report.samples)
    lines += ["## Config", "", "```json", json.dumps(f["config"], indent=1), "```", ""]
    return "\n".join(lines)


def _best_by(best_by: str, evals: list[dict], best_step: int) -> str:
    """The best's line when BEST_BY names an EVAL_METRIC number: which, and its value at the best step."""
    if best_by == "val_loss":
        return ""
    name = best_by.split(":", 1)[1] if best_by.startswith(("min:", "max:")) else best_by
    value = next(((r.get("metric") or {}).get(name) for r in reversed(evals) if r["step"] == best_step), None)
    return f"; chosen by {best_by}" + (f" ({name} {value:.4f})" if value is not None else "")


def _eval_table(evals: list[dict]) -> list[str]:
    if not evals:
        return []
    sources = list(evals[-1].get("val_loss_by_source") or {})
    metrics = list(dict.fromkeys(n for r in evals[-TABLE_ROWS:] for n in (r.get("metric") or {})))
    head = ["step", "budget used", "tokens", "val loss", "val bpc", *sources, *metrics]
    rows = [[str(r["step"]), _duration(r["used_seconds"]), f"{r['tokens_seen']:,}", f"{r['val_loss']:.4f}",
             f"{r['val_bpc']:.4f}", *(f"{(r.get('val_loss_by_source') or {}).get(s, math.nan):.4f}" for s in sources),
             *(f"{(r.get('metric') or {}).get(n, math.nan):.4f}" for n in metrics)]
            for r in evals[-TABLE_ROWS:]]
    return [f"## Evals (the latest {len(rows)} of {len(evals)})", "", _row(head), _row(["---"] * len(head)),
            *map(_row, rows), ""]


def _save_table(saves: list[dict]) -> list[str]:
    if not saves:
        return []
    rows = [[str(r["step"]), f"{r['seconds']:.2f}", f"{r.get('blocked', r['seconds']):.2f}", "yes" if r["ok"] else "failed"]
            for r in saves[-TABLE_ROWS:]]
    return [f"## Checkpoint saves (the latest {len(rows)} of {len(saves)}; written: until the files were on disk, "
            "blocked: what training waited)", "",
            _row(["step", "written (s)", "blocked (s)", "complete"]), _row(["---"] * 4), *map(_row, rows), ""]


def _sample_lines(samples: list[tuple]) -> list[str]:
    if not samples:
        return []
    out = ["## Latest samples (the eval prompt, then the model's continuation)", ""]
    for step, prompt, text in reversed(samples):
        out += [f"Step {step}, prompt {json.dumps(prompt)}:", "", "~~~~text", prompt + text, "~~~~", ""]
    return out


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds >= 7200 else f"{seconds / 60:.1f} min"


def _row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


# ---------------------------------------------------------------- loss.svg

W, H, TOP, BOTTOM, LEFT, GAP = 980, 400, 48, 52, 64, 56  # pixels: two panels side by side


def loss_svg(records: list[dict], best_step: int) -> str:
    """Train loss (grey), val loss (blue), each source's val loss (dashed) against time (left panel)
    and tokens seen (right), the best eval circled in red."""
    series = _series(records)
    # The untrained model's step-0 val loss (about ln(vocabulary)) would squash the rest of the curve:
    # the scale leaves it out and the line runs off the top of the panel.
    values = [y for label, _, pts in series for t, tokens, y in pts if tokens > 0 or label == "train"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
           'font-family="sans-serif" font-size="12">', f'<rect width="{W}" height="{H}" fill="white"/>']
    if not values:
        out.append(f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle">no loss measured yet</text>')
        return "\n".join(out + ["</svg>"])
    lo, hi = min(values), max(values)
    pad = (hi - lo) * 0.05 or 0.5
    lo, hi = lo - pad, hi + pad
    seconds = max(t for _, _, pts in series for t, _, _ in pts)
    hours = seconds >= 7200
    width = (W - 2 * LEFT - GAP) / 2
    best = next((r for r in records if r.get("kind") == "eval" and r["step"] == best_step), None)
    for i, (label, unit) in enumerate((("time", 3600 if hours else 60), ("tokens", None))):
        x0 = LEFT + i * (width + GAP)
        out += _panel(series, best, x0, width, lo, hi, i, unit,
                      f"{'hours' if hours else 'minutes'} of budget used" if unit else "tokens seen")
    out += _legend(series)
    return "\n".join(out + ["</svg>"])


def _series(records: list[dict]) -> list[tuple[str, str, list[tuple]]]:
    """(label, style, [(seconds, tokens, loss)]) per curve."""
    train = [(r["used_seconds"], r["tokens_seen"], r["loss"]) for r in records if r.get("kind") == "train"]
    train = train[:: max(1, -(-len(train) // MAX_TRAIN_POINTS))]
    evals = [r for r in records if r.get("kind") == "eval"]
    out = [("train", 'stroke="#adb5bd" stroke-width="1.5"', train),
           ("val", 'stroke="#1c5bd9" stroke-width="2.5"', [(r["used_seconds"], r["tokens_seen"], r["val_loss"])
                                                           for r in evals])]
    sources = list(evals[-1].get("val_loss_by_source") or {}) if evals else []
    for name, color in zip(sources, PALETTE * (len(sources) // len(PALETTE) + 1)):
        pts = [(r["used_seconds"], r["tokens_seen"], r["val_loss_by_source"][name]) for r in evals
               if name in (r.get("val_loss_by_source") or {})]
        out.append((f"val {name}", f'stroke="{color}" stroke-width="1.5" stroke-dasharray="5 3"', pts))
    return [(label, style, [p for p in pts if math.isfinite(p[2])]) for label, style, pts in out]


def _panel(series, best, x0: float, width: float, lo: float, hi: float, axis: int, unit, xlabel: str) -> list[str]:
    y0, height = TOP, H - TOP - BOTTOM
    xmax = max((p[axis] for _, _, pts in series for p in pts), default=1) or 1

    def xy(p) -> str:
        return f"{x0 + width * p[axis] / xmax:.1f},{y0 + height * (hi - p[2]) / (hi - lo):.1f}"

    clip = f"panel{axis}"
    out = [f'<clipPath id="{clip}"><rect x="{x0}" y="{y0}" width="{width:.1f}" height="{height}"/></clipPath>',
           f'<rect x="{x0}" y="{y0}" width="{width:.1f}" height="{height}" fill="none" stroke="#495057"/>']
    for v in _ticks(lo, hi):
        y = y0 + height * (hi - v) / (hi - lo)
        out.append(f'<line x1="{x0}" x2="{x0 + width:.1f}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e9ecef"/>')
        out.append(f'<text x="{x0 - 6}" y="{y + 4:.1f}" text-anchor="end">{v:g}</text>')
    for v in _ticks(0, xmax / (unit or 1)):
        x = x0 + width * v * (unit or 1) / xmax
        out.append(f'<text x="{x:.1f}" y="{y0 + height + 18}" text-anchor="middle">{_short(v, unit is None)}</text>')
    out.append(f'<text x="{x0 + width / 2:.1f}" y="{H - 12}" text-anchor="middle">{xlabel}</text>')
    out.append(f'<text x="{x0}" y="{y0 - 10}">loss (nats/token)</text>')
    for label, style, pts in series:
        if len(pts) > 1:
            out.append(f'<polyline fill="none" {style} clip-path="url(#{clip})" points="{" ".join(map(xy, pts))}"/>')
        if label == "val":
            out += [f'<circle cx="{xy(p).split(",")[0]}" cy="{xy(p).split(",")[1]}" r="2.5" fill="#1c5bd9" '
                    f'clip-path="url(#{clip})"/>' for p in pts]
    if best is not None and math.isfinite(best["val_loss"]):
        cx, cy = xy((best["used_seconds"], best["tokens_seen"], best["val_loss"])).split(",")
        out.append(f'<circle cx="{cx}" cy="{cy}" r="7" fill="none" stroke="#e03131" stroke-width="2.5"/>')
        out.append(f'<text x="{float(cx) - 10:.1f}" y="{float(cy) - 12:.1f}" text-anchor="end" fill="#e03131" stroke="white" stroke-width="4" paint-order="stroke">best '
                   f'{best["val_loss"]:.4f} @ {best["step"]}</text>')
    return out


def _legend(series) -> list[str]:
    out, x = [], LEFT
    for label, style, _ in series:
        out.append(f'<line x1="{x}" x2="{x + 24}" y1="16" y2="16" {style}/>')
        out.append(f'<text x="{x + 30}" y="20">{escape(label)}</text>')
        x += 40 + 8 * len(label)
    return out


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round values (1, 2 or 5 times a power of ten apart) within [lo, hi]."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    step = min((m * 10 ** math.floor(math.log10(raw)) for m in (1, 2, 5, 10)), key=lambda s: abs(s - raw))
    first = math.ceil(lo / step) * step
    return [round(first + i * step, 12) for i in range(int((hi - first) / step) + 1)]


def _short(v: float, tokens: bool) -> str:
    if not tokens:
        return f"{v:g}"
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            return f"{v / div:g}{suffix}"
    return f"{v:g}"


# ---------------------------------------------------------------- the run's facts


def run_facts(cfg: TrainConfig, d: Dist, model: GPT, prepared: Prepared, budget_seconds: float, accum: int,
                 auto: dict | None, coverage: tuple[int, int, bool]) -> dict:
    """What the run report says the run is: fixed at setup (train.setup)."""
    import dataclasses

    import torch

    from experiment.config import EVAL_STRETCH, WARMDOWN_WINDOW
    c, meta = model.config, prepared.meta
    device = torch.cuda.get_device_name(d.device) if d.device.type == "cuda" else "cpu"
    return {
        "model_tag": cfg.model_tag, "params": model.num_params(), "budget_seconds": budget_seconds,
        "train_tokens": meta["split"]["train_tokens"], "config": dataclasses.asdict(cfg),
        "model": f"d{c.depth}, width {c.n_embd}, {c.n_head} heads, context {c.max_seq_len}",
        "device": f"{d.world_size} x {device}",
        "batch": f"{cfg.total_batch_size:,} tokens/step = {cfg.device_batch_size} x {cfg.max_seq_len} x "
                 f"{d.world_size} ranks x {accum} accumulated",
        "data": f"{meta['split']['train_tokens']:,} train and {meta['split']['val_tokens']:,} val tokens "
                f"({meta['tokenizer']} tokenizer, vocabulary {meta['vocab_used']}) in {prepared.dir}",
        "best_file": "model_{step:06d}.pt" if d.world_size == 1 else f"model_{{step:06d}}_rank0..{d.world_size - 1}.pt",
        "auto": (auto or {}).get("reason"),
        "eval": f"{eval_sample_text(coverage)}, every {cfg.eval_every_minutes:g} min "
                f"(or {EVAL_STRETCH:g}x a slower eval)"
                + (f" or {cfg.eval_every_epochs:g} passes" if cfg.eval_every_epochs else "")
                + (f"; stop at the val minimum: {cfg.plateau_evals} evals without a gain of {cfg.plateau_margin:.1%} "
                   f"at the peak LR start the warmdown, {cfg.plateau_evals} evals in a warmdown without a new low of "
                   f"the mean of the last {WARMDOWN_WINDOW} val losses end the run" if cfg.plateau_evals
                   else "; no stop at the val minimum (PLATEAU_EVALS=0)"),
    }


def eval_sample_text(coverage: tuple[int, int, bool]) -> str:
    read, total, whole = coverage
    if whole:
        return f"{read:,} of the {total:,} val tokens (the whole split, in whole windows)"
    return f"{read:,} of the {total:,} val tokens ({read / total:.0%}, windows at even strides over the split)"
