"""A sweep: several configurations trained side by side on one box, one per GPU, each an ordinary run.

    SWEEP='DEPTH=16 DEPTH=24 DEPTH=32+WEIGHT_DECAY=0.2' BUDGET_USD=1000 bash experiment/run.sh

experiment/run.sh hands over to this module when SWEEP is set. Members are separated by spaces; a
member's settings by `+` (a value in SWEEP holds neither: set such a setting outside SWEEP, for every
member). Every other setting in the environment applies to every member.

- Each member is `bash experiment/run.sh` with its settings, NPROC_PER_NODE=1, its own GPU
  (CUDA_VISIBLE_DEVICES) and MODEL_TAG=<SWEEP_TAG>/<member tag>: its run directory, checkpoints, stop
  at the val minimum and TensorBoard run are its own, under $WORKSPACE/checkpoints/<SWEEP_TAG>/.
- At most SWEEP_PARALLEL members run at once (default: the visible GPUs; 1 without CUDA); the rest
  wait for a free slot. On GPUs, a sweep that would leave a paid GPU idle (members not a multiple of
  the GPUs, or SWEEP_PARALLEL below them) exits 2 saying the dollars, unless SWEEP_ALLOW_IDLE=1.
- Every member's pre-flight runs before any member starts (the first prepares the data, the others
  find it prepared): a wrong setting or a depth that does not fit exits 2 naming the member. Members
  never prepare at the same time.
- The budget counts the whole box: BUDGET_USD buys BUDGET_USD / (GPU_HOURLY_USD x GPUs) hours of the
  box, TRAINING_HOURS is the box's wall clock; each member gets the box's hours divided by the waves
  it takes (ceil(members / SWEEP_PARALLEL)).
- The same command after a reboot, a kill -9 or a Ctrl-C skips the finished members and resumes the
  others (a member still running from a killed sweep is waited for, then resumed if unfinished).
- A member that fails is reported in the table; the others go on. Two sweeps in one directory: the
  second exits 2.
- sweep.md and sweep.json in the sweep directory, rewritten as members end: each member's served
  val loss, passes, hours, dollars and why it stopped, and the winner (the lowest served val loss).
  `serve` and `sample` given the sweep directory use the winner.
- ON_EXIT runs once, when the sweep ends, with RUN_STATUS (finished: every member finished; stopped;
  failed: a member failed), RUN_DIR (the sweep directory) and the winner's BEST_CHECKPOINT,
  BEST_VAL_LOSS and BEST_EXPORT.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from experiment import checkpoint as ckpt
from experiment.config import CPU_DEFAULTS, CUDA_DEFAULTS, SWEEP_SCORING_SHARE, ConfigError, TrainConfig
from experiment.files import atomic_write_bytes, atomic_write_json, default_workspace
from experiment.report import read_records
from experiment.textbpc import text_key

POLL_SECONDS = 2.0
TABLE = "sweep.md"
RECORD = ckpt.SWEEP_RECORD  # the table as data: what serve and sample read for the winner
LOCK = ".sweep.lock"
SLOT_FILE = ".sweep_slot"  # in a member's run directory: the slot (GPU) it was started on
TAG_RE = re.compile(r"[^A-Za-z0-9._-]+")
FIELDS = {f.name.upper(): f.name for f in dataclasses.fields(TrainConfig)}
OWN = ("MODEL_TAG", "NPROC_PER_NODE", "NNODES", "BUDGET_USD", "TRAINING_HOURS", "WORKSPACE",
       "PREPARED_DIR")  # the sweep sets these itself
MEMBER_LOCK = ".sweep_member.lock"  # held from a member's start to its end (run.sh's .lock comes later)
ENSEMBLE_TOKENS = 1 << 20  # val tokens the ensembles are scored on: +-0.001 nats is ~1M tokens' noise
ENSEMBLE_KS = (2, 4)  # and all the members


class SweepError(ConfigError):
    """A sweep that cannot start: exit 2, one line."""


@dataclass
class Member:
    tag: str
    settings: dict[str, str]
    run_dir: Path
    status: str = "waiting"  # waiting | running | elsewhere (a killed sweep's, still running) | finished | stopped | failed
    outcome: str = ""
    process: subprocess.Popen | None = field(default=None, repr=False)
    slot: int = -1
    started: float = 0.0  # when this sweep started it: only its launch's last words count
    signalled: bool = False
    prepared: str | None = None  # its pre-flight's prepared data: the member's launch reads it (PREPARED_DIR)


def parse_members(text: str) -> list[dict[str, str]]:
    """SWEEP -> each member's settings; SweepError naming a setting that is not one of the trainer's or
    that the sweep sets itself."""
    members = []
    for word in text.split():
        settings = {}
        for item in word.split("+"):
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise SweepError(f"SWEEP: {item!r} is not KEY=VALUE (members are separated by spaces, a member's "
                                 "settings by +)")
            if key in OWN:
                raise SweepError(f"SWEEP: {key} is the sweep's to set (the budget counts the whole box; each member "
                                 "runs on one GPU under SWEEP_TAG)")
            if key not in FIELDS:
                raise SweepError(f"SWEEP: {key} is no setting (docs/settings.md)")
            settings[key] = value
        members.append(settings)
    if not members:
        raise SweepError("SWEEP is empty: give the members, e.g. SWEEP='DEPTH=8 DEPTH=12'")
    tags = [member_tag(m) for m in members]
    if len(set(tags)) < len(tags):
        raise SweepError(f"SWEEP: two members are the same ({', '.join(t for t in tags if tags.count(t) > 1)})")
    return members


def member_tag(settings: dict[str, str]) -> str:
    """DEPTH=16+WEIGHT_DECAY=0.2 -> d16-weight_decay0.2: the member's run directory name."""
    parts = [f"d{v}" if k == "DEPTH" else f"{k.lower()}{v}" for k, v in settings.items()]
    return TAG_RE.sub("_", "-".join(parts))[:100] or "default"


BUDGET_INPUTS = ("BUDGET_USD", "TRAINING_HOURS", "GPU_HOURLY_USD", "SWEEP")


def begun_budget(sweep_dir: Path, budget: dict, log) -> dict:
    """The sweep's budget (its inputs, each member's hours, the seconds kept for scoring): the one the
    sweep began with (sweep.json) when this launch gives the same inputs, else `budget`, computed now.
    A relaunch on another GPU count (BUDGET_USD is dollars for the box) or SWEEP_PARALLEL computes other
    hours, which each begun member would read as an extension or a cut of its own budget."""
    path = sweep_dir / RECORD
    try:
        began = (ckpt.read_json(path) if path.is_file() else {}).get("budget") or {}
    except (ckpt.CheckpointError, OSError) as e:  # the table is rewritten as the members run
        log(f"sweep | warning: {path} unreadable ({e}): the members' hours are computed anew")
        began = {}
    if any(began.get(k, "") != budget[k] for k in BUDGET_INPUTS) or not {"member_hours", "scoring_seconds"} <= set(began):
        return budget  # a first launch, or other inputs
    if abs(began["member_hours"] - budget["member_hours"]) > 1e-9 * budget["member_hours"]:
        log(f"sweep | each member keeps the {began['member_hours']:.3f} h this sweep began with, not the "
            f"{budget['member_hours']:.3f} h of this box's GPUs and SWEEP_PARALLEL (the same "
            f"{', '.join(BUDGET_INPUTS)} as then)")
    return began


def box_hours(env: dict, gpus: int, cuda: bool) -> float:
    """The box's hours: BUDGET_USD over every GPU the sweep holds, else TRAINING_HOURS, else the default."""
    if env.get("BUDGET_USD") and env.get("TRAINING_HOURS"):
        raise SweepError("BUDGET_USD and TRAINING_HOURS are both set: give one (BUDGET_USD: dollars for the whole "
                         "box; TRAINING_HOURS: the box's wall-clock hours)")
    try:
        if env.get("BUDGET_USD"):
            rate = float(env.get("GPU_HOURLY_USD") or TrainConfig.gpu_hourly_usd)
            return float(env["BUDGET_USD"]) / (rate * gpus)
        if env.get("TRAINING_HOURS"):
            return float(env["TRAINING_HOURS"])
    except ValueError as e:
        raise SweepError(f"the sweep's budget: {e} (BUDGET_USD, GPU_HOURLY_USD and TRAINING_HOURS are numbers)") from None
    return (CUDA_DEFAULTS if cuda else CPU_DEFAULTS)["training_hours"]


def last_end(run_dir: Path, since: float = 0.0) -> dict | None:
    """The end record of the member's newest launch since `since` (None when none left one)."""
    ends = [r for r in read_records(run_dir / "metrics.jsonl") if r.get("kind") == "end" and r["time"] >= since]
    return ends[-1] if ends else None


def last_words(run_dir: Path, since: float = 0.0) -> str:
    """The member's outcome as its newest launch since `since` recorded it ("" when none did)."""
    return (last_end(run_dir, since) or {}).get("outcome", "")


def classify(outcome: str, code: int | None, stopping: bool) -> str:
    """A member's status from its launch's own last words and exit code."""
    if outcome.startswith("finished"):
        return "finished"
    if outcome.startswith("failed") or (not outcome and code not in (0, None) and not stopping):
        return "failed"
    return "stopped" if stopping or outcome.startswith("stopped") else "failed"


def lock_held(path: Path) -> bool:
    """Whether another process holds the flock on `path`."""
    if not path.is_file():
        return False
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


def running_elsewhere(run_dir: Path) -> bool:
    """A member some other process runs: a killed sweep's (its member lock), or any launch or trainer
    of that run directory (experiment/run.sh's .lock, the trainer's)."""
    from experiment.launch import LOCK_FILES

    return any(lock_held(run_dir / name) for name in (MEMBER_LOCK, *LOCK_FILES))


def member_row(m: Member, gpu_hourly: float) -> dict:
    """What the table says of a member: its served (best) val loss, passes, hours, dollars, why it stopped."""
    row = {"member": m.tag, "settings": m.settings, "status": m.status, "outcome": m.outcome,
           "val_loss": None, "best_step": None, "passes": None, "hours": None, "usd": None, "run_dir": str(m.run_dir)}
    best = ckpt._best_or_none(m.run_dir)
    if best is not None:
        row.update(val_loss=best["val_loss"], best_step=int(best["step"]), best=best)
    try:
        steps = ckpt.complete_steps(m.run_dir) if m.run_dir.is_dir() else []
        meta = ckpt.read_meta(m.run_dir, steps[-1]) if steps else None
    except (OSError, ckpt.CheckpointError):  # a checkpoint pruned or damaged under us: the next pass reads it
        meta = None
    if meta is not None:
        state = ckpt.run_state(meta)
        prepared = _prepared_meta(meta)
        train_tokens = prepared["split"]["train_tokens"] if prepared else None
        row.update(hours=state.used_seconds / 3600, usd=state.used_seconds / 3600 * gpu_hourly,
                   passes=state.tokens_seen / train_tokens if train_tokens else None,
                   data=meta.get("prepared", {}).get("hash"), text=text_key(prepared) if prepared else None)
    return row


def _prepared_meta(meta: dict) -> dict | None:
    try:
        return json.loads((Path(meta["prepared"]["dir"]) / "meta.json").read_text())
    except (OSError, KeyError, ValueError, TypeError):
        return None


def winner(rows: list[dict]) -> tuple[dict | None, str]:
    """(the member whose served model is best, finished or not: ckpt.pick_winner, as serve finds it;
    why there is none). Members trained on different prepared data (another tokenizer, other text)
    have val losses that do not compare: no winner then."""
    rows = [r for r in rows if r.get("best") is not None]
    if len({r.get("data") for r in rows}) > 1:
        if len({r.get("text") for r in rows}) > 1 or None in {r.get("text") for r in rows}:
            return None, "the members trained on different text: their val losses do not compare"
        if not all(r.get("bpc") for r in rows):
            return None, ("the members' tokenizers differ: their val losses do not compare; the winner by bits per "
                          "character on the val text they share comes when they have ended")
        return min(rows, key=lambda r: r["bpc"]), ""
    best = ckpt.pick_winner([(i, r["best"]) for i, r in enumerate(rows)])
    return (rows[best], "") if best is not None else (None, "no member has a best checkpoint yet")


def write_table(sweep_dir: Path, rows: list[dict], member_hours: float, status: str,
                ensembles: dict | None = None, scoring: dict | None = None, budget: dict | None = None) -> None:
    best, why = winner(rows)
    record = {"status": status, "member_hours": member_hours, **({"budget": budget} if budget else {}), "members": rows,
              "winner": best["member"] if best else None, "no_winner": why, "updated": time.time(),
              **({"ensembles": ensembles} if ensembles else {}), **({"scoring": scoring} if scoring else {})}
    atomic_write_json(sweep_dir / RECORD, record)
    lines = [f"# Sweep: {sweep_dir.name}", "", f"{status} | each member's budget {member_hours:.3f} h | "
             f"updated {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}", "",
             "| member | settings | status | val loss (served) | passes | hours | dollars | why it stopped |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = " **winner**" if best is r else ""
        lines.append(f"| {r['member']}{mark} | {' '.join(f'{k}={v}' for k, v in r['settings'].items())} | "
                     f"{r['status']} | {_num(r['val_loss'], 4)} | {_num(r['passes'], 2)} | {_num(r['hours'], 3)} | "
                     f"{_usd(r['usd'])} | {r['outcome'] or '-'} |")
    by = (best or {}).get("best", {}).get("best_by")
    by = f"bits per character {best['bpc']:.4f} on the val text all members share" if best and best.get("bpc") else by
    lines += ["", f"winner: {best['member']} (val loss {best['val_loss']:.4f}" + (f", chosen by {by}" if by else "")
              + f", {best['run_dir']})" if best else f"winner: none ({why})", ""]
    if any(r.get("bpc") for r in rows):
        lines += ["bits per character on the val text every member held out (tokenizers differ: the val losses do "
                  "not compare): " + ", ".join(f"{r['member']} {r['bpc']:.4f}" for r in rows if r.get("bpc")), ""]
    if ensembles:
        lines += ensemble_lines(ensembles, rows)
    if scoring:
        lines += [f"scoring after the members: {scoring['seconds']:,.1f} s, {_usd(scoring['usd'])} of the box "
                  f"({scoring['seconds'] / scoring['kept']:.0%} of the {scoring['kept']:,.0f} s the members left for it)"
                  if scoring["kept"] else f"scoring after the members: {scoring['seconds']:,.1f} s, {_usd(scoring['usd'])}", ""]
    atomic_write_bytes(sweep_dir / TABLE, "\n".join(lines).encode())


def ensemble_lines(e: dict, rows: list[dict]) -> list[str]:
    """sweep.md's ensembles: each against the best member, on the same val tokens, with its serving cost."""
    tag = {r["run_dir"]: r["member"] for r in rows}

    def name(path: str) -> str:  # a member's checkpoint lies in its run directory
        return tag.get(str(Path(path).parent), path)

    lines = [f"Ensembles (`serve --checkpoint A,B,...`: the mean of the members' probabilities), on {e['tokens']:,} "
             "val tokens:", "", "| model | members | val loss | against the best member | bf16 weights | decode steps a token |",
             "|---|---|---|---|---|---|"]
    best = e["members"][0]
    lines.append(f"| best member | {name(best['path'])} | {best['loss']:.4f} | - | {_bf16_size(best['params'])} | 1 |")
    for x in e["ensembles"]:
        lines.append(f"| best {x['k']} | {' '.join(name(p) for p in x['members'])} | {x['loss']:.4f} | {x['gain']:+.4f} | "
                     f"{_bf16_size(x['params'])} | {x['k']} |")
    return lines + [""]


def _bf16_size(params: int) -> str:
    size = params * 2
    return f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"


def measure_ensembles(sweep: Sweep, rows: list[dict], log) -> dict | None:
    """The ensembles of the best 2, 4 and all members (experiment/ensembles.py) on SWEEP_ENSEMBLE_TOKENS
    val tokens, once the members have ended; None when fewer than two members have a best checkpoint,
    they trained on different data, a stop signal comes, or it fails (logged: the sweep's own outcome
    stands). The metas are compared before any weights are read; then one member at a time is loaded
    (bf16 on CUDA, as an export serves it), scored and freed, so a GPU holds one member at most."""
    usable = [r for r in rows if r.get("best") is not None]
    if sweep.ensemble_tokens == 0 or len(usable) < 2 or winner(rows)[0] is None:
        return None
    import torch

    from experiment.dataloader import Prepared
    from experiment.distributed import resolve_device
    from experiment.ensembles import check_same_data, compare_logprobs, ensemble_sizes, member_logprobs

    try:
        device = resolve_device(sweep.env.get("DEVICE") or "auto")
        paths = [ckpt.resolve_serving_checkpoint(Path(r["run_dir"]), sweep.dir) for r in usable]
        metas = [ckpt.model_meta(p) for p in paths]
        check_same_data(list(zip(metas, map(str, paths))))
        tokens = Prepared.load(Path(metas[0]["prepared"]["dir"])).tokens("val")
        log(f"sweep | the ensembles of the best {', '.join(map(str, ensemble_sizes(ENSEMBLE_KS, len(paths))))} "
            f"of {len(paths)} members, on up to {min(len(tokens), sweep.ensemble_tokens):,} val tokens ...")
        scored = []
        for path in paths:
            model, _ = ckpt.load_model(path, device, torch.bfloat16 if device.type == "cuda" else None)
            scored.append((str(path), model.num_params(),
                           member_logprobs(model, tokens, sweep.ensemble_tokens, lambda: sweep.stopping)))
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
        return compare_logprobs(scored, list(ENSEMBLE_KS))
    except Exception as e:  # noqa: BLE001 (a memory error on a big box as much as a missing file or a stop)
        log(f"sweep | ensembles not measured: {type(e).__name__}: {e}")
        return None


BPC_CHARS = 1 << 18  # characters of the shared val text each member scores (on CPU, d4: seconds)


def measure_bpc(sweep: Sweep, rows: list[dict], log) -> bool:
    """Members of one corpus but several tokenizers: each one's bits per character on the val text
    they all held out (experiment/textbpc.py), in its row as "bpc"; the winner is then the lowest.
    False when that does not apply, a stop signal comes, or it fails (logged)."""
    usable = [r for r in rows if r.get("best") is not None]
    if len(usable) < 2 or len({r.get("data") for r in usable}) < 2 or len({r.get("text") for r in usable}) > 1 \
            or usable[0].get("text") is None:
        return False
    import torch

    from experiment.dataloader import Prepared, tokenizer_from_meta
    from experiment.distributed import resolve_device
    from experiment.textbpc import bits_per_char, common_text, val_texts

    try:
        device = resolve_device(sweep.env.get("DEVICE") or "auto")
        paths = [ckpt.resolve_serving_checkpoint(Path(r["run_dir"]), sweep.dir) for r in usable]
        metas = [ckpt.model_meta(p) for p in paths]
        docs = common_text([val_texts(Prepared.load(Path(m["prepared"]["dir"]))) for m in metas], BPC_CHARS)
        chars = sum(map(len, docs))
        if not chars:
            log("sweep | bits per character not measured: the members' val splits share no text")
            return False
        log(f"sweep | the members' tokenizers differ: bits per character on the {chars:,} val characters all of "
            "them held out ...")
        for r, path, meta in zip(usable, paths, metas):
            model, _ = ckpt.load_model(path, device, torch.bfloat16 if device.type == "cuda" else None)
            r["bpc"] = bits_per_char(model.eval(), tokenizer_from_meta(meta["tokenizer"]), docs,
                                     lambda: sweep.stopping)
            del model
        return True
    except Exception as e:  # noqa: BLE001 (as measure_ensembles: the sweep's own outcome stands)
        for r in usable:
            r.pop("bpc", None)
        log(f"sweep | bits per character not measured: {type(e).__name__}: {e}")
        return False


def _num(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _usd(value) -> str:
    return "-" if value is None else f"${value:,.2f}"


# ---------------------------------------------------------------- the runner


@dataclass
class Sweep:
    dir: Path
    tag: str
    members: list[Member]
    env: dict
    slots: int
    devices: list[str] | None  # CUDA_VISIBLE_DEVICES of each slot; None on CPU
    member_hours: float
    gpu_hourly: float
    lock: object = None  # the sweep directory's flock, held while this process lives
    stopping: bool = False
    ensemble_tokens: int = ENSEMBLE_TOKENS  # SWEEP_ENSEMBLE_TOKENS; 0: no ensembles
    box_gpus: int = 1  # the GPUs the box bills (CPU: 1), idle ones included
    scoring_seconds: float = 0.0  # of the box's hours, kept from the members for scoring them (SWEEP_SCORING_SHARE)
    freed: bool = False  # a slot has come free in this launch: a member started now is not of the first wave
    budget: dict | None = None  # member_hours and scoring_seconds with what they came from (sweep.json: begun_budget)


def idle_gpus(members: int, slots: int, gpus: int, box_hours: float, gpu_hourly: float) -> str | None:
    """What a sweep of `members` on `gpus` GPUs pays for and leaves idle, as the refusal's words;
    None when every GPU trains for the whole box (members a multiple of SWEEP_PARALLEL = the GPUs).
    Each member trains box_hours / waves on one GPU (less the same share of it for scoring them,
    which leaves the ratio alone); the box bills every GPU for box_hours."""
    waves = math.ceil(members / slots)
    idle = gpus * box_hours - members * box_hours / waves
    if idle <= 1e-9 * gpus * box_hours:
        return None
    fit = max(g for g in range(1, min(slots, gpus) + 1) if members % g == 0)  # GPUs these members keep busy
    return (f"{members} member(s) on {gpus} GPUs ({slots} at a time, {waves} wave(s)) leave {idle:,.1f} of the "
            f"{gpus * box_hours:,.1f} GPU-hours idle (${idle * gpu_hourly:,.0f} of ${gpus * box_hours * gpu_hourly:,.0f}) "
            f"buying nothing: give it a multiple of {gpus} members (more depths, or seeds: DEPTH=32+SEED=2)"
            + (", SWEEP_PARALLEL unset" if slots < gpus else "") + f", rent {fit} GPU(s), or set SWEEP_ALLOW_IDLE=1 "
            "to pay for the idle ones anyway")


def setup(env: dict, log) -> Sweep:
    """The members, their budget and the sweep directory's lock; then every unfinished member's
    pre-flight, one after the other (the first prepares the data), before any starts: SweepError
    naming the member."""
    import torch

    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    settings = parse_members(env["SWEEP"])
    tag = env.get("SWEEP_TAG") or "sweep"
    if TAG_RE.search(tag):
        raise SweepError(f"SWEEP_TAG={tag!r}: letters, digits, . _ - only")
    try:
        slots = int(env.get("SWEEP_PARALLEL") or (gpus if cuda else 1))
    except ValueError:
        raise SweepError(f"SWEEP_PARALLEL={env['SWEEP_PARALLEL']!r}: a number of members") from None
    if slots < 1 or (cuda and slots > gpus):
        raise SweepError(f"SWEEP_PARALLEL={slots}: at least 1" + (f", at most the {gpus} visible GPUs" if cuda else ""))
    ensemble_tokens = parse_ensemble_tokens(env)
    waves = math.ceil(len(settings) / slots)
    hours = box_hours(env, gpus if cuda else 1, cuda)  # first: it says what is wrong with the budget's numbers
    gpu_hourly = float(env.get("GPU_HOURLY_USD") or TrainConfig.gpu_hourly_usd)
    idle = idle_gpus(len(settings), slots, gpus, hours, gpu_hourly) if cuda else None
    if idle and env.get("SWEEP_ALLOW_IDLE") != "1":
        raise SweepError(idle)
    visible = (env.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(gpus)))).split(",") if cuda else None
    ignored = [k for k in ("MODEL_TAG", "NPROC_PER_NODE", "NNODES", "PREPARED_DIR") if env.get(k)]
    if ignored:
        log(f"sweep | {', '.join(ignored)} from the environment ignored: the sweep sets them for each member")
    workspace = Path(env["WORKSPACE"]) if env.get("WORKSPACE") else default_workspace()
    sweep_dir = workspace / "checkpoints" / tag
    sweep_dir.mkdir(parents=True, exist_ok=True)
    # The box's hours over all its GPUs (an idle one is paid for too), shared by the waves.
    # Two members or more are scored once they end (SWEEP_SCORING_SHARE): that time comes off their hours.
    kept = SWEEP_SCORING_SHARE * hours if len(settings) >= 2 else 0.0
    lock = take_lock(sweep_dir)  # before sweep.json is read: another launch of this sweep may be writing it
    inputs = {**{k: env.get(k) or None for k in BUDGET_INPUTS}, "SWEEP": sorted(map(member_tag, settings))}
    budget = begun_budget(sweep_dir, {**inputs, "member_hours": (hours - kept) / waves, "scoring_seconds": kept * 3600},
                          log)
    sweep = Sweep(dir=sweep_dir, tag=tag, members=[Member(member_tag(s), s, sweep_dir / member_tag(s)) for s in settings],
                  env={**env, "WORKSPACE": str(workspace)}, slots=slots, devices=visible[:slots] if cuda else None,
                  member_hours=budget["member_hours"], gpu_hourly=gpu_hourly, lock=lock, ensemble_tokens=ensemble_tokens,
                  box_gpus=gpus if cuda else 1, scoring_seconds=budget["scoring_seconds"], budget=budget)
    if idle:
        log(f"sweep | warning: {idle.split(': give it')[0]} (SWEEP_ALLOW_IDLE=1)")
    log(f"sweep | {len(settings)} members in {sweep_dir} | {slots} at a time ({'GPUs ' + ','.join(sweep.devices) if cuda else 'CPU'}) "
        f"| {waves} wave(s) of {sweep.member_hours:.3f} h each"
        + (f" | {sweep.scoring_seconds / 3600:.3f} h kept for scoring them" if sweep.scoring_seconds else ""))
    for m in sweep.members:
        m.outcome = last_words(m.run_dir)
        if running_elsewhere(m.run_dir):  # still running from a killed sweep: it keeps its GPU until it ends
            m.status, m.slot = "elsewhere", _recorded_slot(m.run_dir, sweep.devices)
            log(f"sweep | {m.tag} is still running from an earlier launch: waiting for it to end")
        elif m.outcome.startswith("finished"):
            m.status = "finished"
        elif m.outcome.startswith("failed") and (last_end(m.run_dir) or {}).get("code") != 2:
            keep_failed(sweep, m, log)  # a mistake (code 2) is checked again: its cause may be fixed since
        else:
            m.prepared = preflight_member(sweep, m, log)
    return sweep


def keep_failed(sweep: Sweep, m: Member, log) -> None:
    """A member whose trainer ended it with a failure (a diverged loss, a full disk): a restart would
    repeat it, so a relaunched sweep reports it and does not train it again unasked."""
    m.status = "failed"
    settings = " ".join(f"{k}={v}" for k, v in m.settings.items())
    log(f"sweep | {m.tag} failed in an earlier launch ({m.outcome}): not restarted. To train it again once its "
        f"cause is fixed, on one GPU (CUDA_VISIBLE_DEVICES) with its hours: MODEL_TAG={sweep.tag}/{m.tag} "
        f"NPROC_PER_NODE=1 TRAINING_HOURS={sweep.member_hours:g} {settings} bash experiment/run.sh")


def parse_ensemble_tokens(env: dict) -> int:
    """SWEEP_ENSEMBLE_TOKENS: val tokens the ensembles are scored on (unset: ENSEMBLE_TOKENS; 0: none)."""
    text = env.get("SWEEP_ENSEMBLE_TOKENS") or str(ENSEMBLE_TOKENS)
    if not text.isdigit():
        raise SweepError(f"SWEEP_ENSEMBLE_TOKENS={text!r}: a number of val tokens, 0 for none")
    return int(text)


def _recorded_slot(run_dir: Path, devices: list[str] | None) -> int:
    """The slot whose GPU a member was started on (start() records the device): it stays taken while
    the member runs; -1 when unknown."""
    try:
        device = (run_dir / SLOT_FILE).read_text().strip()
    except OSError:
        return -1
    names = devices if devices is not None else ["cpu"]
    return names.index(device) if device in names else -1


def take_lock(sweep_dir: Path):
    f = open(sweep_dir / LOCK, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "a process that has not said who it is"
        f.close()
        raise SweepError(f"{sweep_dir} is in use by a running sweep ({holder}); wait for it, stop it, or choose "
                         "another SWEEP_TAG") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} since {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")
    f.flush()
    return f


def member_env(sweep: Sweep, m: Member) -> dict:
    env = {k: v for k, v in sweep.env.items() if k not in (*OWN, "SWEEP", "SWEEP_TAG", "SWEEP_PARALLEL", "ON_EXIT")}
    env.update(m.settings, MODEL_TAG=f"{sweep.tag}/{m.tag}", NPROC_PER_NODE="1", WORKSPACE=sweep.env["WORKSPACE"],
               TRAINING_HOURS=repr(sweep.member_hours))
    if m.prepared:  # prepared once by the sweep's pre-flight: the member's own reads it, never prepares
        env["PREPARED_DIR"] = m.prepared
    return env


def member_flags(env: dict) -> list[str]:
    """experiment/run.sh's mapping of settings to the trainer's flags."""
    return [f"--{name}={env[key]}" for key, name in FIELDS.items() if key in env]


def preflight_member(sweep: Sweep, m: Member, log) -> str:
    """The member's pre-flight (experiment/preflight.py, in a process of its own: this one stays off
    the GPUs); returns its prepared data's directory. SweepError naming the member on its error."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        plan_file = Path(tmp) / "plan.json"
        proc = subprocess.run([sys.executable, "-m", "experiment.preflight", "--world_size=1", "--nproc_per_node=1",
                               f"--plan_file={plan_file}", *member_flags(member_env(sweep, m))],
                              env=member_env(sweep, m), capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent.parent)
        for line in proc.stdout.splitlines():
            log(f"sweep | {m.tag} | {line}")
        if proc.returncode != 0:
            words = (proc.stderr.strip().splitlines() or [f"its pre-flight exited {proc.returncode}"])[-1]
            raise SweepError(f"member {m.tag} ({' '.join(f'{k}={v}' for k, v in m.settings.items())}): "
                             + words.removeprefix("error: "))
        return json.loads(plan_file.read_text())["prepared"]


def start(sweep: Sweep, m: Member, slot: int, log) -> None:
    env = member_env(sweep, m)
    if not sweep.freed and sweep.env.get("LAUNCH_STARTED"):
        # The first wave's budgets count from the sweep's launch: the members' pre-flights before it,
        # one after another, are on the box's bill too (experiment/run.sh reads this as its start).
        env["SWEEP_MEMBER_STARTED"] = sweep.env["LAUNCH_STARTED"]
    if sweep.devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = sweep.devices[slot]
    else:  # members side by side on CPU share its cores
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // sweep.slots)))
    m.run_dir.mkdir(parents=True, exist_ok=True)
    (m.run_dir / SLOT_FILE).write_text(f"{sweep.devices[slot] if sweep.devices is not None else 'cpu'}\n")
    m.started, m.signalled = time.time(), False
    # The member lock, taken here and held by the member's processes (pass_fds) from its pre-flight to
    # its end: a relaunched sweep sees the member running even before run.sh takes its own .lock.
    with open(m.run_dir / MEMBER_LOCK, "a+") as lock, open(m.run_dir / "launcher.log", "ab") as out:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # A session of its own: a Ctrl-C in the sweep's terminal reaches the members through the sweep,
        # as one SIGTERM each (each saves and stops), and a member outlives a killed sweep.
        m.process = subprocess.Popen(["bash", str(Path(__file__).parent / "run.sh")], env=env, stdout=out,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                     pass_fds=(lock.fileno(),))
        lock.seek(0)
        lock.truncate()
        lock.write(f"pgid {m.process.pid} since {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")
    m.status, m.slot = "running", slot
    where = f"GPU {sweep.devices[slot]}" if sweep.devices is not None else "CPU"
    log(f"sweep | {m.tag} started on {where} | its log: {m.run_dir / 'launcher.log'}")


def finish(sweep: Sweep, m: Member, log) -> None:
    m.outcome = last_words(m.run_dir, m.started)
    m.status = classify(m.outcome, m.process.returncode, sweep.stopping)
    if not m.outcome:
        m.outcome = f"exit {m.process.returncode} without last words (see {m.run_dir / 'launcher.log'})"
    m.process = None
    log(f"sweep | {m.tag} {m.status}: {m.outcome}")


def step(sweep: Sweep, free: list[int], log) -> bool:
    """One pass of the scheduler: collect ended members, start waiting ones on free slots. True
    while something runs or waits to run."""
    for m in sweep.members:
        if m.process is not None and m.process.poll() is not None:
            finish(sweep, m, log)
            free.append(m.slot)
            sweep.freed = True
        elif m.status == "elsewhere" and not running_elsewhere(m.run_dir):  # a killed sweep's member ended
            ended_elsewhere(sweep, m, log)
            if m.slot >= 0:
                free.append(m.slot)
                sweep.freed = True
        if sweep.stopping:
            signal_member(m)
    for m in [m for m in sweep.members if m.status == "waiting"]:
        if sweep.stopping or not free:
            break
        start(sweep, m, free.pop(0), log)
    if any(m.process is not None or m.status == "elsewhere" for m in sweep.members):
        return True
    return not sweep.stopping and any(m.status == "waiting" for m in sweep.members)


def ended_elsewhere(sweep: Sweep, m: Member, log) -> None:
    """A member a killed sweep left running has ended: finished, failed (kept so), or to be resumed,
    after its pre-flight as every member's before it starts (the prepared data it then reads)."""
    m.outcome = last_words(m.run_dir)
    log(f"sweep | {m.tag}, left running by an earlier launch, ended: {m.outcome or 'without last words'}")
    if m.outcome.startswith("finished") or sweep.stopping:
        m.status = "finished" if m.outcome.startswith("finished") else "stopped"
    elif m.outcome.startswith("failed"):
        keep_failed(sweep, m, log)
    else:
        try:
            m.prepared, m.status = preflight_member(sweep, m, log), "waiting"
        except SweepError as e:  # the others go on; the table says why this one did not
            m.status, m.outcome = "failed", str(e)
            log(f"sweep | {m.tag} not resumed: {e}")


def signal_member(m: Member) -> None:
    """One SIGTERM to a running member's process group (its launch saves and stops), once; a member
    left running by a killed sweep is found by the group its member lock names."""
    if m.signalled:
        return
    pgid = m.process.pid if m.process is not None and m.process.poll() is None else None
    if pgid is None and m.status == "elsewhere":
        try:
            pgid = int((m.run_dir / MEMBER_LOCK).read_text().split()[1])
        except (OSError, IndexError, ValueError):
            return
    if pgid is not None:
        m.signalled = True
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def run(sweep: Sweep, log) -> str:
    """Runs the members to their end (or to a stop signal's); returns the sweep's status."""
    def on_signal(signum, frame):
        first = not sweep.stopping
        sweep.stopping = True
        for m in sweep.members:  # first the members, then the words (a dead terminal may refuse them)
            signal_member(m)
        if first:
            log(f"sweep | {signal.Signals(signum).name}: stopping every member (each saves), starting no more")

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    taken = {m.slot for m in sweep.members if m.status == "elsewhere"}
    free, shown = [s for s in range(sweep.slots) if s not in taken], None
    while step(sweep, free, log):
        rows = [member_row(m, sweep.gpu_hourly) for m in sweep.members]
        if rows != shown:
            write_table(sweep.dir, rows, sweep.member_hours, "running", budget=sweep.budget)
            shown = rows
        time.sleep(POLL_SECONDS)
    statuses = {m.status for m in sweep.members}
    return "failed" if "failed" in statuses else "finished" if statuses == {"finished"} else "stopped"


def on_exit(sweep: Sweep, status: str, rows: list[dict], log) -> None:
    """ON_EXIT, once, with the sweep's status and the winner's checkpoint."""
    command = sweep.env.get("ON_EXIT")
    if not command:
        return
    best, _ = winner(rows)
    run_dir = Path(best["run_dir"]) if best else None
    env = {**sweep.env, "RUN_STATUS": status, "RUN_OUTCOME": f"sweep {status}", "RUN_DIR": str(sweep.dir),
           "BEST_CHECKPOINT": str(ckpt.resolve_serving_checkpoint(run_dir, sweep.dir)) if best else "",
           "BEST_VAL_LOSS": f"{best['val_loss']:.6f}" if best else "",
           "BEST_EXPORT": str(run_dir / ckpt.EXPORT_NAME) if best and (run_dir / ckpt.EXPORT_NAME).is_file() else ""}
    log(f"sweep | ON_EXIT ({status}): {command}")
    with open(sweep.dir / "on_exit.log", "ab") as out:
        subprocess.run(command, shell=True, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)


def scoring(sweep: Sweep, started: float) -> dict:
    """What scoring the members took, since `started`: seconds, and dollars at the box's rate (every
    GPU it bills), against the seconds the members left for it."""
    seconds = time.time() - started
    return {"seconds": seconds, "usd": seconds / 3600 * sweep.box_gpus * sweep.gpu_hourly, "kept": sweep.scoring_seconds}


def main() -> int:
    def log(line: str) -> None:
        try:
            print(line, flush=True)
        except OSError:  # the terminal went away (a dropped ssh): the table and the members' logs remain
            pass

    try:
        sweep = setup(dict(os.environ), log)
    except ConfigError as e:  # SweepError and the members' pre-flight errors, named
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    status, ended = "failed", False
    try:
        status = run(sweep, log)
        ended = True
    finally:  # whatever ends the loop, the table and ON_EXIT still come
        rows = [member_row(m, sweep.gpu_hourly) for m in sweep.members]
        write_table(sweep.dir, rows, sweep.member_hours, status, budget=sweep.budget)
        # Only once the members have ended on their own: not after a stop signal (a preemption leaves
        # minutes, which the members' saves need; one during the scoring stops it), nor while an error
        # unwinds.
        if ended and status != "stopped" and not sweep.stopping:
            started = time.time()
            ensembles = measure_ensembles(sweep, rows, log)
            bpc = not ensembles and measure_bpc(sweep, rows, log)
            cost = scoring(sweep, started)
            if ensembles or bpc or cost["seconds"] >= 1:  # a scoring that failed late cost the box too
                write_table(sweep.dir, rows, sweep.member_hours, status, ensembles, cost, sweep.budget)
        log(f"sweep | {status} | {sweep.dir / TABLE}:")
        log((sweep.dir / TABLE).read_text().rstrip())
        on_exit(sweep, status, rows, log)
    return 1 if status == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())
