"""GENERATIONS > 1: models trained one after another in one run directory, each from scratch (its
own seed) on the labels and a frozen teacher's predictions: the generation before it (TEACHER=previous,
a chain) or the mean of all before it (ensemble). Compute that one model cannot use (it stops at its
val minimum, or the data's passes are done) buys the next generation instead.

    <run_dir>/generations.json   the record: each generation's seed, budget, teachers and outcome
    <run_dir>/gen<k>/            generation k: an ordinary run directory (checkpoints, best.json,
                                 best.pt, report.md, training.log); TensorBoard <MODEL_TAG>/gen<k>
    <run_dir>/best.json          the served generation's best (with "generation" and "dir"): the
                                 STUDENT_DEPTH student's once it has one, else the best generation's
    <run_dir>/best.pt            its export (a hard link to gen<k>/best.pt)
    <run_dir>/report.md          the generations side by side

The budget: generation k starts with an equal share of what the generations before it left,
(budget - used) / (generations left); with GENERATIONS=auto, all they left (less STUDENT_RESERVE of
the budget for a STUDENT_DEPTH student, which trains on that and the rest when the chain ends).
Recorded when it begins, so that a resume keeps its schedule.
A teacher's forward passes run inside the step, so its cost is the student's budget's.
A kill at any moment resumes the generation it hit (its checkpoints, its recorded teacher); a
launch with more GENERATIONS (and budget) adds generations. train.py stays a loop of one model:
this module calls it once per generation.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import re
import shutil
import time
from pathlib import Path
from typing import Callable

import torch

from experiment import checkpoint as ckpt
from experiment import launch
from experiment.checkpoint import CheckpointError
from experiment.config import AUTO_MAX_GENERATIONS, ConfigError, TrainConfig
from experiment.distributed import PHASE_TIMEOUTS, Dist, broadcast_object
from experiment.files import atomic_write_bytes, atomic_write_json
from experiment.runlog import RunLog
from experiment.stopping import MAX_STEPS_OUTCOME
from experiment.teacher import meta_digest

RECORD = ckpt.GENERATIONS_RECORD
MIN_SHARE_SECONDS = 1.0  # a generation with less would end at its first step
# Nor less than this part of an equal share: an undertrained generation would teach every later one.
MIN_SHARE_FRACTION = 0.25
# GENERATIONS=auto: another generation while the budget left is at least this part of what the first
# used. A student learns fast from its teacher: on 100,000 characters, chain generations of 150 s each
# (under half the ~330 s one model took to its val minimum) each beat that model (docs/performance.md).
AUTO_MIN_SHARE = 0.4
# DISTILL_WEIGHT=auto. A generation keeps half its loss on the labels. The student learns from the
# ensemble alone: its targets carry more than the labels, and on 100,000 characters the same d4
# student of the same four generations served 1.4048 against 1.4263 with half (it trained on
# past the labels' val minimum: 462 steps against 282; docs/performance.md).
GENERATION_WEIGHT = 0.5
STUDENT_WEIGHT = 1.0
# ATTN_DROPOUT unset: the student trains without it, whatever the regime. Its targets are the
# ensemble's probabilities, not the labels it would overfit; paired on the same teachers (100,000
# characters, two seeds), it served 0.005-0.006 lower than with the regime's 0.2 (docs/performance.md).
STUDENT_ATTN_DROPOUT = 0.0
# GENERATIONS=auto with STUDENT_DEPTH: the chain's generations leave this part of the budget to the
# student, which gets it and whatever the chain left when it ends (docs/training.md). Chosen, not
# screened: GENERATIONS=N's students had a fifth to a seventh and learned most of their teachers'
# gain; one value measured (docs/performance.md).
STUDENT_RESERVE = 0.25


def read_record(top: Path) -> dict:
    path = top / RECORD
    if not path.is_file():
        return {"generations": []}
    return ckpt.read_json(path)


def check_layout(cfg: TrainConfig, top: Path) -> None:
    """One run directory holds one model's run or a run of generations, never both: the two would
    share best.json and best.pt, and serving would follow whichever wrote last."""
    if cfg.generations != 1 and ckpt.complete_steps(top):
        raise ConfigError(f"{top} holds a one-model run's checkpoints; a run of generations needs a directory of "
                          "its own: set another MODEL_TAG")
    if (top.parent / RECORD).is_file() and re.fullmatch(r"gen\d+", top.name):
        raise ConfigError(f"{top} is a generation of the run in {top.parent}: relaunch that run (its MODEL_TAG and "
                          "GENERATIONS), which resumes this generation with its teacher")
    if cfg.generations == 1 and (top / RECORD).is_file():
        n = sum(not g.get("student") for g in read_record(top)["generations"])
        raise ConfigError(f"{top} is a run of generations ({n} begun, {RECORD}): relaunch it with GENERATIONS "
                          f"of at least {n}, or set another MODEL_TAG for one model")


def count(cfg: TrainConfig) -> int:
    """The most generations this launch may train (a STUDENT_DEPTH student is one more, the last)."""
    return (AUTO_MAX_GENERATIONS if cfg.generations == "auto" else cfg.generations) + (1 if cfg.student_depth else 0)


def is_student(record: dict, k: int, cfg: TrainConfig, budget: float) -> bool:
    """Whether generation k (begun, or the next to begin) is the STUDENT_DEPTH student: the last of
    count(cfg) with GENERATIONS=N; with auto, the one after the chain ends (chain_share)."""
    gens = record["generations"]
    if k <= len(gens):
        return bool(gens[k - 1].get("student"))
    if not cfg.student_depth or k < 2:
        return False
    return chain_share(record, k, cfg, budget) is None if cfg.generations == "auto" else k == count(cfg)


def student_done(record: dict) -> bool:
    """Whether the run's student has trained: it is the last model, nothing trains after it."""
    return any(g.get("student") and g["outcome"] is not None for g in record["generations"])


def student_fields(cfg: TrainConfig) -> dict:
    """The record fields of a STUDENT_DEPTH student: its depth, that it followed an auto chain, and
    its attention dropout (ATTN_DROPOUT as given, else STUDENT_ATTN_DROPOUT; recorded, so that a
    relaunch without ATTN_DROPOUT keeps it, and a student begun before the field resumes with what
    its checkpoint resolved)."""
    dropout = STUDENT_ATTN_DROPOUT if cfg.attn_dropout is None else cfg.attn_dropout
    return {"student": True, "depth": cfg.student_depth, **({"auto": True} if cfg.generations == "auto" else {}),
            "attn_dropout": dropout}


def distill_weight(cfg: TrainConfig, student: bool) -> float:
    """A generation's DISTILL_WEIGHT: the one given, else (auto) STUDENT_WEIGHT for the STUDENT_DEPTH
    student and GENERATION_WEIGHT for a generation."""
    if cfg.distill_weight is not None:
        return cfg.distill_weight
    return STUDENT_WEIGHT if student else GENERATION_WEIGHT


def teacher_kind(cfg: TrainConfig, k: int, student: bool) -> str | None:
    """What teaches generation k: none (the first), the ensemble of all before it (the STUDENT_DEPTH
    student, whatever TEACHER says), else TEACHER (previous or ensemble)."""
    return None if k == 1 else "ensemble" if student else cfg.teacher


def teachers_held(k: int, kind: str | None) -> int:
    """How many models teach generation k of this kind: the one rule the trainer's teachers
    (teachers_for), the pre-flight's memory check (guards.generations_fit) and the plan's student
    line (plan.student_plan) count by."""
    return 0 if kind is None else k - 1 if kind == "ensemble" else 1


def ahead(cfg: TrainConfig, top: Path) -> list[tuple[int, bool, int]]:
    """Each generation of the run in `top` not done yet, the next first: (k, whether it is the
    STUDENT_DEPTH student, how many models of the generations' depth teach it). One model: [(1, False, 0)].
    Past the next one, an auto chain's student is taken as the last of count(cfg)."""
    record = read_record(top)
    gens, out = record["generations"], []
    if student_done(record):
        return []
    done = sum(g["outcome"] is not None for g in gens)
    settled = done == len(gens)  # what the chain left is known
    budget = math.inf if cfg.training_hours is None else cfg.training_hours * 3600  # None: not resolved yet
    for k in range(done + 1, count(cfg) + 1):
        known = k <= len(gens) or (k == len(gens) + 1 and settled)
        student = (is_student(record, k, cfg, budget) if known else bool(cfg.student_depth) and k == count(cfg))
        out.append((k, student, teachers_held(k, teacher_kind(cfg, k, student))))
        if student:
            break
    return out


def of(cfg: TrainConfig) -> str:
    return "(GENERATIONS=auto)" if cfg.generations == "auto" else f"of {count(cfg)}"


def check_student(record: dict, cfg: TrainConfig) -> None:
    """A begun student is the run's last model: a relaunch names the run as it began (GENERATIONS and
    STUDENT_DEPTH); another count would take the student for a generation and train more after it."""
    begun = [g for g in record["generations"] if g.get("student")]
    if not begun:
        return
    g = begun[-1]
    same = (cfg.generations == "auto") == bool(g.get("auto")) and (g.get("auto") or count(cfg) == g["index"])
    if not same or cfg.student_depth != g["depth"]:
        raise ConfigError(f"this run's student (gen{g['index']}, d{g['depth']}) has begun, after {g['index'] - 1} "
                          f"generations: relaunch it with GENERATIONS={'auto' if g.get('auto') else g['index'] - 1} "
                          f"STUDENT_DEPTH={g['depth']}, or set another MODEL_TAG")


def share(record: dict, k: int, cfg: TrainConfig, budget: float) -> float | None:
    """Generation k's budget seconds; None when that is too little to train a useful generation, and
    for any after the student. GENERATIONS=N: an equal share of what the generations before it left.
    auto: chain_share; its student, all that the chain left."""
    gens = record["generations"][: k - 1]
    if any(g.get("student") for g in gens):
        return None
    left = budget - sum(g["used_seconds"] for g in gens)
    if cfg.generations == "auto":
        if is_student(record, k, cfg, budget):
            return left if left >= MIN_SHARE_SECONDS else None
        return chain_share(record, k, cfg, budget)
    seconds = left / (count(cfg) - k + 1)
    return seconds if seconds >= max(MIN_SHARE_SECONDS, MIN_SHARE_FRACTION * budget / count(cfg)) else None


def chain_share(record: dict, k: int, cfg: TrainConfig, budget: float) -> float | None:
    """GENERATIONS=auto: generation k of the chain gets all the generations before it left (less the
    student's reserve, STUDENT_RESERVE of the budget, with STUDENT_DEPTH), when that is at least
    AUTO_MIN_SHARE of what the first used (it stopped at its val minimum, or its passes were done);
    none after MAX_STEPS ended the one before (the user bounded each generation), nor past
    AUTO_MAX_GENERATIONS."""
    gens = record["generations"][: k - 1]
    left = budget * (1 - (STUDENT_RESERVE if cfg.student_depth else 0)) - sum(g["used_seconds"] for g in gens)
    if not gens:
        return left
    enough = left >= max(MIN_SHARE_SECONDS, AUTO_MIN_SHARE * gens[0]["used_seconds"])
    return left if enough and k <= AUTO_MAX_GENERATIONS and gens[-1]["outcome"] != MAX_STEPS_OUTCOME else None


def sizes_chain(cfg: TrainConfig) -> bool:
    """DEPTH=auto sizes this generation for the chain (autosize.GENERATION_PASSES): the first generation
    of GENERATIONS=auto with TEACHER=previous, the chains measured (generation_config names it gen1)."""
    return chained(cfg) and cfg.model_tag.rsplit("/", 1)[-1] == "gen1"


def chained(cfg: TrainConfig) -> bool:
    """The run's generations are a chain DEPTH=auto sizes: GENERATIONS=auto, TEACHER=previous, DEPTH=auto."""
    return cfg.generations == "auto" and cfg.teacher == "previous" and cfg.depth == "auto"


def chain_depth(top: Path, done: list[dict], cfg: TrainConfig) -> dict:
    """A later generation of a chain that DEPTH=auto sized (sizes_chain) takes the first one's depth:
    the chains measured were of one depth, and a depth re-sized for what the first left would be
    another, unmeasured, chain. A first generation sized otherwise (a run begun before the rule)
    leaves each later one sized for its own share, as before."""
    if not chained(cfg) or not done:
        return {}
    if "depth" in done[-1]:  # the generation before took it already
        return {"depth": done[-1]["depth"]}
    first = done[0]
    if not first.get("best"):  # no eval chose a step: its depth is read from no meta, and each sizes its own
        return {}
    meta = ckpt.read_meta(top / first["dir"], int(first["best"]["step"]))
    try:
        sized, depth = bool((meta.get("auto") or {}).get("chain")), int(meta["model_config"]["depth"])
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{ckpt.meta_path(top / first['dir'], int(first['best']['step']))}: no model depth "
                              f"({e!r}); restore it, or start the run afresh (another MODEL_TAG)") from e
    return {"depth": depth} if sized else {}


def head(top: Path, done: list[dict], k: int, cfg: TrainConfig, seconds: float, student: bool) -> dict:
    """What generation k's record begins with (the pre-flight shows it before `begin` writes it)."""
    return {"index": k, "dir": f"gen{k}", "seed": cfg.seed + k - 1, "budget_seconds": seconds,
            **(student_fields(cfg) if student else chain_depth(top, done, cfg))}


def teachers_for(top: Path, done: list[dict], how: str) -> list[dict]:
    """The generation record's teachers: the best step of the generation before (previous) or of
    every one before (ensemble), each with the digest of its meta."""
    chosen = done[len(done) - teachers_held(len(done) + 1, how):]
    out = []
    for g in chosen:
        file = ckpt.resolve_serving_checkpoint(top / g["dir"], top)
        out.append({"generation": g["index"], "file": str(file.relative_to(top)), "meta_sha256": meta_digest(file)})
    return out


def check_teachers(top: Path, g: dict) -> None:
    """The teachers a begun generation recorded still have the metas it pinned (the pre-flight's
    early look; the trainer loads and checks each in full: teacher.Teacher.load)."""
    for t in g["teachers"]:
        if meta_digest(top / t["file"]) != t["meta_sha256"]:
            raise CheckpointError(f"teacher gen{t['generation']} ({top / t['file']}): its meta is not the one recorded "
                                  "when this generation began (the step was replaced or damaged); restore it, or "
                                  "start the run afresh")


def check_world(record: dict, cfg: TrainConfig, world_size: int | None) -> None:
    """A run of generations with BUDGET_USD keeps its GPU count: each generation's share is recorded
    in seconds of the box it began on, so another count would spend other dollars."""
    began = record.get("world_size")
    if cfg.budget_usd is not None and world_size is not None and began not in (None, world_size):
        raise ConfigError(f"this run of generations began on {began} GPU(s) with BUDGET_USD, whose shares are hours "
                          f"of that box: relaunch it on {began} (NPROC_PER_NODE), or give TRAINING_HOURS instead")


def begin(top: Path, record: dict, k: int, cfg: TrainConfig, budget: float, world_size: int = 1) -> dict | None:
    """Rank 0: generation k's record, written before it trains; None when no budget is left for it."""
    done = record["generations"][: k - 1]
    seconds = share(record, k, cfg, budget)
    if seconds is None:
        return None
    student = is_student(record, k, cfg, budget)
    how = teacher_kind(cfg, k, student)
    g = {**head(top, done, k, cfg, seconds, student), "teacher": how,
         "teachers": teachers_for(top, done, how) if done else [],
         "distill": [distill_weight(cfg, student), cfg.distill_temperature] if done else None,
         "began": time.time(), "outcome": None, "used_seconds": None, "best": None}
    record["generations"].append(g)
    record["budget_seconds"], record["world_size"] = budget, world_size
    atomic_write_json(top / RECORD, record)
    return g


def recorded_dropout(cfg: TrainConfig, g: dict) -> float | None:
    """The attention dropout generation g's record sets (a student's: student_fields), unless the
    launch gives ATTN_DROPOUT; None: the launch's setting stands."""
    return g["attn_dropout"] if "attn_dropout" in g and cfg.attn_dropout is None else None


def dropout_text(cfg: TrainConfig, g: dict) -> str:
    """The recorded attention dropout in words, where it is set (the regime line leaves it out)."""
    dropout = recorded_dropout(cfg, g)
    return "" if dropout is None else f"attention dropout {dropout:g} (the student's)"


def names(g: dict) -> str:
    return " + ".join(f"gen{t['generation']}" for t in g["teachers"])


def title(g: dict) -> str:
    """gen<k>, and what it is when it is the student."""
    return f"gen{g['index']}" + (f" (the student, d{g['depth']})" if g.get("student") else "")


def generation_config(cfg: TrainConfig, g: dict) -> TrainConfig:
    """The one-model config generation g trains with: its seed and budget; its run directory and
    TensorBoard logs under the run's (model_tag <tag>/gen<k>). A student trains with the attention
    dropout its record holds (recorded_dropout). The student of an auto chain trains as
    GENERATIONS=N's would, N the generations before it: nothing follows it, so neither the chain's
    pass cap nor its "left to the next generation" applies. (With a chain of one that is
    GENERATIONS=1 beside STUDENT_DEPTH, a pair check_generations refuses in a launch's settings: a
    generation's config is never checked as one.)"""
    distill = g["distill"] or [distill_weight(cfg, bool(g.get("student"))), cfg.distill_temperature]
    after_chain = {"generations": g["index"] - 1} if g.get("auto") else {}
    dropout = recorded_dropout(cfg, g)
    no_dropout = {} if dropout is None else {"attn_dropout": dropout}
    return dataclasses.replace(cfg, seed=g["seed"], training_hours=g["budget_seconds"] / 3600, budget_usd=None,
                               model_tag=f"{cfg.model_tag}/{g['dir']}", distill_weight=distill[0],
                               distill_temperature=distill[1], depth=g.get("depth", cfg.depth), **after_chain,
                               **no_dropout)


def pending(cfg: TrainConfig, top: Path, world_size: int | None = None) -> tuple[TrainConfig | None, Path | None, str]:
    """What the next launch trains, for the pre-flight: (the generation's one-model config, its run
    directory, a line saying which generation), or (None, None, a line) when all GENERATIONS are
    done or no budget is left. A generation not begun yet is shown with the share it would get now
    (and no teacher yet); a begun one's teachers are checked."""
    check_layout(cfg, top)
    record = read_record(top)
    check_world(record, cfg, world_size)
    check_student(record, cfg)
    gens = record["generations"]
    done = [g for g in gens if g["outcome"] is not None]
    if student_done(record):
        return None, None, f"preflight | the run in {top} is done: its student (the last model) has trained"
    if len(done) >= count(cfg):
        return None, None, (f"preflight | all {count(cfg)} generations in {top} are done; a larger GENERATIONS "
                            "(and budget) adds more")
    k = len(done) + 1
    if k <= len(gens):
        g, how = gens[k - 1], "resumes"
        check_teachers(top, g)
    else:
        budget = cfg.training_hours * 3600
        seconds = share(record, k, cfg, budget)
        if seconds is None:
            return None, None, f"preflight | no budget left for generation {k} {of(cfg)} in {top}"
        g, how = {**head(top, done, k, cfg, seconds, is_student(record, k, cfg, budget)), "distill": None}, "starts"
    dropout = dropout_text(cfg, g)
    line = (f"preflight | generation {k} {of(cfg)}{' (the student, d%d)' % g['depth'] if g.get('student') else ''} "
            f"{how} in {top / g['dir']}: seed {g['seed']}, " + (f"{dropout}, " if dropout else "")
            + f"{g['budget_seconds']:.0f}s of the budget" + (f", {len(done)} done" if done else ""))
    return generation_config(cfg, g), top / g["dir"], line


def on_rank_0(d: Dist, fn: Callable):
    """fn() on rank 0, its result on every rank; its error raised on every rank (none waits for
    a rank that failed alone)."""
    result = None
    if d.master:
        try:
            result = {"value": fn()}
        except (CheckpointError, ConfigError, OSError) as e:
            result = {"error": str(e)}
    result = broadcast_object(result, d)
    if "error" in result:
        error = CheckpointError(result["error"])
        error.every_rank = True  # rank 0's, on every rank: said once a node (train.main)
        raise error
    return result["value"]


def release() -> None:
    """What a finished generation held: its model, optimizer, compiled graphs and cached GPU memory,
    before the next one probes the GPU for its batch."""
    torch._dynamo.reset()  # first: its caches hold graphs that hold the model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_all(cfg: TrainConfig, d: Dist, workspace: Path, top: Path, log: RunLog, launched: float,
            run_one: Callable) -> int:
    """Train the generations not yet done, in order; `run_one` is train.run (one model in one run
    directory -> (exit code, outcome, budget seconds used)). Returns the launch's exit code. Rank 0
    leaves the launch's end in <run_dir>/metrics.jsonl, where ON_EXIT and a sweep read it."""
    budget = cfg.training_hours * 3600
    if d.master:  # a kill inside finish() left these behind the record
        refresh(top, log)
    for k in range(1, count(cfg) + 1):
        record = on_rank_0(d, lambda: read_record(top))
        gens = record["generations"]
        if student_done(record):
            break
        if k <= len(gens) and gens[k - 1]["outcome"] is not None:
            continue  # done in an earlier launch
        on_rank_0(d, lambda: (check_world(record, cfg, d.world_size), check_student(record, cfg)))
        g = gens[k - 1] if k <= len(gens) else on_rank_0(d, lambda: begin(top, record, k, cfg, budget, d.world_size))
        if g is None:
            log(f"generations | no budget left for generation {k} {of(cfg)}")
            break
        d.set_timeout(PHASE_TIMEOUTS["setup"])  # the last generation's loop left the step's
        dropout = dropout_text(cfg, g)
        log(f"generations | generation {k} {of(cfg)}" + (f" | the student, d{g['depth']}" if g.get("student") else
                                                           f" | d{g['depth']}, the first's" if g.get("depth") else "")
            + f" | seed {g['seed']} | budget {g['budget_seconds']:.1f}s"
            + (f" | {dropout}" if dropout else "")
            + (f" | teacher {names(g)} (distill weight {g['distill'][0]:g}, temperature {g['distill'][1]:g})"
               if g["teachers"] else " | no teacher"))
        gen_dir = top / g["dir"]
        teachers = [{**t, "file": str(top / t["file"])} for t in g["teachers"]]
        code, outcome, used = run_one(generation_config(cfg, g), d, workspace, gen_dir,
                                      RunLog(gen_dir / "training.log" if d.master else None, top / "training.log"),
                                      launched, teachers)
        launched = time.time()  # the next generation's setup (this one's record, best files, release) from here
        d.set_timeout(PHASE_TIMEOUTS["setup"])
        if code != 0 or outcome == "running" or outcome.startswith("stopped"):
            if code == 1:  # the trainer's own failure (train_loop): torchrun's restarts look for it here
                launch.end_launch(top)
            if d.master:
                launch.end_record(top, code, f"{outcome.split(':')[0]}: generation {k} {of(cfg)}: {outcome}")
            return code  # a failure, or a stop signal: the same command resumes this generation
        on_rank_0(d, lambda: finish(top, k, outcome, used, log))
        release()
    if d.master:
        g = summary(top, log)
        launch.end_record(top, 0, f"finished: {len(read_record(top)['generations'])} generation(s)"
                   + (f", serving gen{g['index']} (val_loss {g['best']['val_loss']:.4f})" if g else ""))
    return 0


def refresh(top: Path, log: RunLog) -> None:
    try:
        record = read_record(top)
        publish_best(top, record, log)
        if record["generations"]:
            write_report(top, record)
    except (CheckpointError, OSError) as e:
        log(f"warning: the run's best.json, best.pt or report.md not brought up to date ({e})")
        return
    for g in record["generations"]:  # finish() records the outcome first: a kill may come before its shrink
        if g["outcome"] is not None:
            shrink(top / g["dir"], log)


def finish(top: Path, k: int, outcome: str, used: float, log: RunLog) -> None:
    """Rank 0, at generation k's end: its outcome in the record, then the run's best and report, then
    its checkpoints but the best step's weights go."""
    record = read_record(top)
    g = record["generations"][k - 1]
    g.update(outcome=outcome, used_seconds=used, best=ckpt.read_best(top / g["dir"]))
    atomic_write_json(top / RECORD, record)
    refresh(top, log)  # and the generation's shrink


def shrink(gen_dir: Path, log: RunLog) -> None:
    """A finished generation is never trained again (a launch with more budget adds generations), so
    it keeps only what serving and teaching read: its best step's weights and meta, best.pt. A run of
    generations then holds one model's checkpoints, not one per generation (d56: 87 GB each).
    Idempotent (refresh repeats it after a kill); nothing goes while best.json names no complete step."""
    try:
        best = ckpt.read_best(gen_dir)
        if best is None or int(best["step"]) not in ckpt.complete_steps(gen_dir):
            return
        size = lambda: sum(p.stat().st_size for p in gen_dir.iterdir() if p.is_file())
        before = size()
        ckpt.remove_incomplete(gen_dir)  # a save or a prune that a kill cut short
        steps = ckpt.prune(gen_dir, keep_last=0)
        shards = ckpt.drop_old_best_optimizer(gen_dir, keep_last=0)
        freed = before - size()
    except (OSError, CheckpointError) as e:  # the files stay; the disk guard of the next launch counts them
        log(f"warning: {gen_dir}'s checkpoints not pruned ({e})")
        return
    if steps or shards is not None:
        log(f"generations | {gen_dir.name} done: {len(steps)} step(s) and the best step's optimizer state pruned, "
            f"{freed / 1e9:.2f} GB freed; its best step's weights and best.pt stay")


def winner(record: dict) -> dict | None:
    """The generation served (checkpoint.served_generation: the newest STUDENT_DEPTH student with a
    best step, else the one whose best is best)."""
    gens = record["generations"]
    key = ckpt.served_generation([(i, bool(g.get("student")), g.get("best")) for i, g in enumerate(gens)])
    return None if key is None else gens[key]


def publish_best(top: Path, record: dict, log: RunLog) -> None:
    """<run_dir>/best.json and best.pt: the winning generation's (best.pt a hard link, so no second
    copy of the weights; a copy where links fail; removed while the winner has none, so the two
    never name different generations)."""
    g = winner(record)
    if g is None:
        return
    atomic_write_json(top / "best.json", {**g["best"], "generation": g["index"], "dir": g["dir"]})
    src, out = top / g["dir"] / ckpt.EXPORT_NAME, top / ckpt.EXPORT_NAME
    if not src.is_file():
        out.unlink(missing_ok=True)
        return
    tmp = top / f".{ckpt.EXPORT_NAME}.{os.getpid()}.tmp"
    try:
        tmp.unlink(missing_ok=True)
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
        os.replace(tmp, out)
        # A rename onto another link of the same file does nothing and leaves tmp (POSIX): the winner
        # unchanged since the last refresh.
        tmp.unlink(missing_ok=True)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        log(f"warning: {out} not written ({e}); {src} holds the same model")


def write_report(top: Path, record: dict) -> None:
    g_best = winner(record)
    lines = ["# Generations", "", "| generation | seed | teacher | budget s | used s | best val_loss | outcome |",
             "|---|---|---|---|---|---|---|"]
    for g in record["generations"]:
        teacher = names(g) or "none"
        best = g.get("best") or {}
        val = f"{best['val_loss']:.4f}" if math.isfinite(best.get("val_loss", math.nan)) else "-"
        mark = " (served)" if g_best is not None and g is g_best else ""
        used = f"{g['used_seconds']:.1f}" if g["used_seconds"] is not None else "-"
        lines.append(f"| {title(g)}{mark} | {g['seed']} | {teacher} | {g['budget_seconds']:.1f} | {used} | {val} | "
                     f"{g['outcome'] or 'running'} |")
    served = ("the student (STUDENT_DEPTH), distilled from the ensemble of the generations before it" if g_best
              and g_best.get("student") else "the generation with the best val loss")
    lines += ["", f"Each generation's own report: gen<k>/report.md. The served model is {served} (best.json names it)."]
    atomic_write_bytes(top / "report.md", ("\n".join(lines) + "\n").encode())


def summary(top: Path, log: RunLog) -> dict | None:
    """The last line of a run of generations; returns the served generation's record."""
    record = read_record(top)
    g = winner(record)
    parts = [f"{title(x)} {x['best']['val_loss']:.4f}" for x in record["generations"] if x.get("best")]
    log(f"generations | done: {len(record['generations'])} generation(s): {', '.join(parts) or 'none with a best'}"
        + (f" | serving {title(g)} ({top / ckpt.EXPORT_NAME})" if g else ""))
    return g
