"""What the data and the budget support on the GPUs you would rent, before renting: no GPU needed.

    bash run.sh plan [--json]        (or python -m experiment.plan [--json] [--flags])
    TOKENS=350000000 GPUS=8xH100-PCIe TRAINING_HOURS=31 bash run.sh plan --json

Every flag is also an env override named like it in upper case (TOKENS, GPUS, DATA_DIR, ...), as
for experiment/run.sh. For each depth on DEPTH=auto's ladder (the CUDA shape: width 64 per layer,
heads of 128, context 2048) it prints the parameters, the predicted training tok/s, the hours that
1, 4 and the pass cap's passes over the data take (autosize.pass_cap: 8, more on data of few steps), the tokens per parameter the useful hours buy, and
the checkpoint size, the disk retention needs and the minutes a save takes. Then the recommendation:
the depth DEPTH=auto picks on those GPUs (experiment/autosize.py, from the same predictions), the
hours worth paying for (never past the cap's passes) and the dollars the budget leaves unspent.
Where the trainer's defaults regularize (a data-limited run), the launch line adds GENERATIONS=auto
and the depth is the one DEPTH=auto sizes its first generation at (autosize.GENERATION_PASSES).

With DATA_DIR it first runs the pre-flight's data checks (dataloader.validate: UTF-8, empty
files, NUL bytes, each source's val share), so data the rented box would refuse is refused here.
It ends with the launch line to paste and the run directory that launch writes, and a table of the
recommended depth on 1, 2, 4 and 8 GPUs: hours and dollars; with HOURS_AVAILABLE, the fewest GPUs
that finish in time.

The tok/s are predictions, not measurements: a step's compute at the MFU gpucheck measured on one GPU of
that kind (autosize.MEASURED_MFU: H200 at d12-d32, H100 at d12-d24 and for GPUs not listed, each with
its report) times the GPU's dense bf16 peak times
the GPU count, plus its traffic between the GPUs (the gradient all-reduce and ZeRO-1's weight
broadcasts) at LINK_GBPS, unhidden (autosize.comm_seconds): more GPUs are not linearly faster.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from experiment import autosize, generations, regime, servemem
from experiment.guards import EXTRA_CHECKPOINTS
from experiment.config import AUTO_MAX_GENERATIONS, CUDA_DEFAULTS, PLATEAU_EVALS, SWEEP_SCORING_SHARE, opt, parse_flags
from experiment.dataloader import DataError, validate
from experiment.files import default_workspace
from experiment.hardware import DISK_WRITE_GBPS, PCIE_GBPS, NVLINK_GBPS, link_gbps, peak_flops
from experiment.memory import checkpoint_bytes, checkpoint_precision, choose_mode, count_params
from experiment.model import GPTConfig

GPU_MEMORY_GIB = (("H200", 141), ("H100", 80), ("A100", 80))  # by name fragment, most specific first
VOCAB_CHAR, VOCAB_TIKTOKEN = 256, 100352  # padded; the embedding barely moves the FLOPs
CHARS_PER_TOKEN = {"char": 1.0, "tiktoken": 4.0}  # tiktoken: the bytes / 4 the count above assumes
GPU_COUNTS = (1, 2, 4, 8)  # the rows of the same run on fewer GPUs
GPUS_PER_NODE = 8  # a rented box's GPUs at most: more come as several nodes (NNODES)


@dataclass
class PlanConfig:
    tokens: int | None = opt("training + val tokens of the corpus; unset: counted in DATA_DIR")
    data_dir: str | None = opt("data files to count: *.txt, *.jsonl, *.jsonl.gz, *.parquet (default $WORKSPACE/data)")
    text_field: str = opt("the JSONL field or Parquet column that holds a document, as for training", "text")
    tokenizer: str = opt("char, or a tiktoken encoding name (counted as bytes / 4: set TOKENS for the exact "
                         "figure)", "char")
    alphabet: str | None = opt("allowed characters, as for training: data with any other one is refused")
    val_fraction: float = opt("held out for validation", 0.05)
    gpus: str | None = opt("e.g. 8xH100-PCIe, 8xH100-SXM, 8xH200 (default: the GPUs visible here, else "
                           "8xH100-PCIe)")
    training_hours: float | None = opt(f"budget in hours (default {CUDA_DEFAULTS['training_hours']:g})")
    budget_usd: float | None = opt("budget in dollars: hours = budget_usd / (gpu_hourly_usd x GPUs)")
    gpu_hourly_usd: float = opt("price of one GPU-hour", 4.0)
    hours_available: float | None = opt("the wall-clock hours you can wait: the plan recommends the fewest GPUs "
                                        "that finish in them")
    link_gbps: float | None = opt(f"bus bandwidth of the gradient all-reduce between GPUs, GB/s (default "
                                  f"{PCIE_GBPS:g} for PCIe cards, {NVLINK_GBPS:g} for NVLink: assumed, not measured)")
    disk_write_gbps: float = opt("the checkpoint disk's write rate, GB/s (a network volume's low end)",
                                 DISK_WRITE_GBPS)
    keep_last: int = opt("complete checkpoints kept, plus the best", 3)
    gpucheck: str | None = opt("report.json of `bash run.sh gpucheck` on the rented box (or one like it): the MFU it "
                               "measured per depth replaces the table's, so the tok/s rest on that box's own speed")
    max_seq_len: int = opt("context length", CUDA_DEFAULTS["max_seq_len"])
    regularizers: str = opt("auto: the trainer's defaults (past 4 passes the regime regularizes the run and DEPTH=auto "
                            "sizes for that); off: a run with ATTN_DROPOUT=0 AVERAGE=none (the plain rule: at most the "
                            "pass cap's passes), which the launch line then pins", "auto")
    json: int = opt("1: print one JSON object instead of the table", 0)


@dataclass
class Gpus:
    count: int
    name: str
    peak: float  # dense bf16 FLOP/s of one
    memory_bytes: int
    link_gbps: float  # the all-reduce's bus bandwidth between them
    measured: tuple[dict[int, float], str, str] | None = None  # (MFU by depth, source, GPU) from a gpucheck report
    link_source: str = "assumed: LINK_GBPS"  # where link_gbps comes from, in the plan line's words

    @property
    def mfu_by_depth(self) -> dict[int, float] | None:
        """The MFU gpucheck measured on the box, if given: it replaces autosize's table."""
        return self.measured[0] if self.measured else None


def gpu_kind(name: str) -> tuple[str, int] | None:
    """(name fragment, GPU memory GiB) of a GPU's kind (GPU_MEMORY_GIB), None if unknown."""
    return next(((f, gib) for f, gib in GPU_MEMORY_GIB if f.lower() in name.lower()), None)


def gpucheck_link(items: dict) -> tuple[float, int] | None:
    """(bus GB/s, GPUs) of the all-reduce a gpucheck report's link item timed over the box's GPUs, if any."""
    link = (items.get("link") or {}).get("figures") or {}
    return (link["link_gbps"], link["world"]) if link.get("link_gbps") and link.get("device") == "cuda" else None


def gpucheck_mfu(path: str, gpus: Gpus) -> tuple[tuple[dict[int, float], str, str], tuple[float, int] | None]:
    """((MFU by depth, its source, the GPU), the all-reduce's (GB/s, GPUs) or None) that a gpucheck
    report.json measured; ValueError naming the file and what is missing or does not match the GPUS
    being planned."""
    try:
        items = {i["name"]: i for i in json.loads(Path(path).read_text())["items"]}
        gpu = items["env"]["figures"].get("gpu")
        speed = items["speed"]["figures"]
        link = gpucheck_link(items)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"GPUCHECK {path}: not a gpucheck report.json with its env and speed items ({e})") from None
    table = {int(k.removeprefix("d")): r["mfu"] for k, r in speed.items() if r.get("mfu")}
    if gpu is None or not table:
        raise ValueError(f"GPUCHECK {path}: " + ("it ran without CUDA (no GPU in its env item)" if gpu is None else
                                                 "its speed item has no MFU (a GPU of unknown peak)")
                         + ": there is no measured GPU speed to plan from")
    if peak_flops(gpu) != gpus.peak or gpu_kind(gpu) != gpu_kind(gpus.name):  # H100 SXM and H200 share a peak
        raise ValueError(f"GPUCHECK {path}: measured on {gpu}, but GPUS is {gpus.count}x{gpus.name}: plan the GPUs "
                         "it measured, or measure the ones you plan")
    return (table, f"gpucheck {path}", gpu), link


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
    kind = gpu_kind(name)
    memory = kind[1] if kind else None
    if not sep or not count.isdigit() or int(count) < 1 or peak is None or memory is None:
        raise ValueError(f"GPUS {spec!r}: expected COUNTxNAME with a GPU whose peak is known, e.g. 8xH100-PCIe, "
                         "8xH100-SXM, 8xH200, 8xA100")
    if int(count) > GPUS_PER_NODE and int(count) % GPUS_PER_NODE:
        raise ValueError(f"GPUS {spec!r}: more than {GPUS_PER_NODE} GPUs come as nodes of {GPUS_PER_NODE} (NNODES): "
                         f"plan a multiple of {GPUS_PER_NODE}")
    return Gpus(int(count), name, peak, memory * 2**30, link_gbps(name))


def count_tokens(cfg: PlanConfig) -> tuple[int, str]:
    """(tokens, how they were counted): TOKENS, else DATA_DIR's, after the pre-flight's checks
    (DataError names the first problem): characters, or with tiktoken bytes / 4, and the BOS that
    prepare writes before each file."""
    if cfg.tokens is not None:
        return cfg.tokens, "TOKENS"
    data_dir = Path(cfg.data_dir) if cfg.data_dir else default_workspace() / "data"
    v = validate(data_dir, cfg.tokenizer, cfg.alphabet, cfg.val_fraction, cfg.max_seq_len, text_field=cfg.text_field)
    sources = f"{len(v['sources'])} source(s) of {data_dir}, checked as the pre-flight checks them"
    if not v["exact"]:
        return v["tokens"], f"estimated as bytes / 4 in {sources} (set TOKENS to be exact)"
    return v["tokens"], f"characters in {sources}"


def model_config(depth: int, cfg: PlanConfig, vocab: int) -> GPTConfig:
    return GPTConfig(vocab_size=vocab, depth=depth, aspect_ratio=CUDA_DEFAULTS["aspect_ratio"],
                     head_dim=CUDA_DEFAULTS["head_dim"], max_seq_len=cfg.max_seq_len,
                     bigram_vocab=vocab if cfg.tokenizer == "char" else 0)


def tok_per_s(config: GPTConfig, gpus: Gpus, count: int) -> tuple[float, float] | None:
    """(tok/s, seconds of a step spent communicating) predicted on `count` of these GPUs, in the
    precision the memory plan picks; None if it does not fit."""
    fit = choose_mode(config, count, 1, config.max_seq_len, gpus.memory_bytes)
    if fit is None:
        return None
    weight_bytes = autosize.WEIGHT_BYTES[fit.precision]
    return (autosize.predicted_tok_per_s(config, gpus.peak, count, gpus.link_gbps, weight_bytes, gpu_name=gpus.name,
                                         mfu_by_depth=gpus.mfu_by_depth),
            autosize.comm_seconds(config, count, gpus.link_gbps, weight_bytes))


def rung(depth: int, cfg: PlanConfig, gpus: Gpus, train_tokens: int, budget_s: float,
         vocab: int) -> tuple[dict, autosize.Candidate]:
    """One depth's row of the table and its DEPTH=auto candidate."""
    config = model_config(depth, cfg, vocab)
    predicted = tok_per_s(config, gpus, gpus.count)
    fits = predicted is not None
    rate = predicted[0] if fits else autosize.predicted_tok_per_s(config, gpus.peak, gpus.count, gpus.link_gbps,
                                                                  gpu_name=gpus.name,
                                                                  mfu_by_depth=gpus.mfu_by_depth)
    # The trainer's defaults leave the regime's settings to it: the regularized rule (autosize.reg_passes)
    # unless the plan is for a run with the regularizers off
    c = autosize.candidate(config, rate, budget_s, train_tokens, CUDA_DEFAULTS["total_batch_size"],
                           regularized=cfg.regularizers == "auto")
    # The weight average's copy too where the trainer may keep one (AVERAGE=auto), as the pre-flight's disk
    # guard counts it: REGULARIZERS=off pins AVERAGE=none on the launch line
    ckpt = checkpoint_bytes(config, gpus.count, gpus.memory_bytes, average=cfg.regularizers == "auto")
    return {"depth": depth, "params": c.params, "tok_per_s": c.tok_per_s, "fits": fits,
            "hours_per_pass": train_tokens / c.tok_per_s / 3600, "useful_hours": c.seconds / 3600,
            "tokens": c.tokens, "tokens_per_param": c.tokens_per_param, "epochs": c.epochs,
            "budget_epochs": c.budget_epochs,
            "checkpoint_gb": ckpt / 1e9, "disk_peak_gb": (cfg.keep_last + EXTRA_CHECKPOINTS) * ckpt / 1e9,
            "save_minutes": ckpt / (cfg.disk_write_gbps * 1e9) / 60,
            # what a finished generation keeps (generations.shrink): its best weights, and best.pt in bf16
            "generation_gb": c.params * (autosize.WEIGHT_BYTES[checkpoint_precision(config, gpus.count,
                                                                                   gpus.memory_bytes)] + 2) / 1e9,
            **servemem.serving_needs(config, c.params, CHARS_PER_TOKEN["char" if cfg.tokenizer == "char" else "tiktoken"])}, c


def gpu_rows(cfg: PlanConfig, gpus: Gpus, config: GPTConfig, tokens: float, budget_usd: float) -> list[dict]:
    """The chosen depth's tokens on 1, 2, 4 and 8 of these GPUs (and the count asked for): hours,
    dollars, and whether they fit the budget's dollars and finish within HOURS_AVAILABLE."""
    rows = []
    for count in sorted({*GPU_COUNTS, gpus.count}):
        predicted = tok_per_s(config, gpus, count)
        rate, comm = predicted or (None, None)
        hours = tokens / rate / 3600 if rate else None
        rows.append({"gpus": count, "fits": rate is not None, "tok_per_s": rate, "hours": hours,
                     "usd": hours * count * cfg.gpu_hourly_usd if rate else None,
                     "comm_share": comm * rate / CUDA_DEFAULTS["total_batch_size"] if rate else None,
                     "in_budget": rate is not None and hours * count * cfg.gpu_hourly_usd <= budget_usd * (1 + 1e-9),
                     "in_time": rate is not None and (cfg.hours_available is None or hours <= cfg.hours_available)})
    return rows


def launch_budget(p: dict, cfg: PlanConfig, count: int) -> tuple[float, float]:
    """(hours, dollars) of the launch line's run on `count` GPUs: the budget's dollars buy more hours
    on fewer GPUs, capped at HOURS_AVAILABLE."""
    hours = min(p["budget_usd"] / (cfg.gpu_hourly_usd * count), cfg.hours_available or math.inf)
    return hours, hours * count * cfg.gpu_hourly_usd


def launch_line(p: dict, cfg: PlanConfig, count: int) -> tuple[str, str]:
    """What to paste on the rented box, and the run directory it writes: the GPU count the plan priced
    (NPROC_PER_NODE; past 8, nodes of 8), the plan's depth, explicit, with the default pass cap, the
    budget in dollars (BUDGET_USD: the trainer turns it into hours on the GPUs it starts on),
    GENERATIONS=auto where the data-limited recipe trains (what one model leaves unspent buys more
    models) and a generation fits beside its teacher, and every planned setting that is not the
    trainer's default, quoted for the shell."""
    usd = launch_budget(p, cfg, count)[1]
    nodes = {"NNODES": count // GPUS_PER_NODE} if count > GPUS_PER_NODE else {}  # and NODE_RANK, MASTER_ADDR
    generations = {"GENERATIONS": "auto"} if p["regime"]["regularized"] and p.get("teacher_fits", True) else {}
    settings = {**nodes, "NPROC_PER_NODE": min(count, GPUS_PER_NODE), "DEPTH": p["depth"],
                "BUDGET_USD": _cents(usd), **generations, **planned_settings(cfg)}
    return _shell(settings), f"$WORKSPACE/checkpoints/d{p['depth']}"


def planned_settings(cfg: PlanConfig) -> dict:
    """Every planned setting that is not the trainer's default: a launch line carries them."""
    defaults = {f.name: f.default for f in dataclasses.fields(PlanConfig)}
    settings = {name.upper(): getattr(cfg, name) for name in ("tokenizer", "alphabet", "val_fraction", "text_field",
                                                              "gpu_hourly_usd", "keep_last")
                if getattr(cfg, name) != defaults[name]}
    if cfg.max_seq_len != CUDA_DEFAULTS["max_seq_len"]:
        settings["MAX_SEQ_LEN"] = cfg.max_seq_len
    if cfg.regularizers == "off":
        settings |= {"ATTN_DROPOUT": 0, "AVERAGE": "none"}
    return settings


def _cents(usd: float) -> str:
    return f"{max(math.floor(usd * 100) / 100, 0.01):.2f}".rstrip("0").rstrip(".")  # cents, never above


def _shell(settings: dict) -> str:
    return " ".join(f"{k}={shlex.quote(str(v))}" for k, v in settings.items()) + " bash experiment/run.sh"


def plan(cfg: PlanConfig) -> dict:
    gpus = parse_gpus(cfg.gpus)
    if cfg.gpucheck is not None:
        gpus.measured, link = gpucheck_mfu(cfg.gpucheck, gpus)
        if link is not None:
            gpus.link_gbps, gpus.link_source = link[0], f"MEASURED by gpucheck over {link[1]} GPUs"
    if cfg.link_gbps is not None:
        gpus.link_gbps, gpus.link_source = cfg.link_gbps, "LINK_GBPS"
    if cfg.regularizers not in ("auto", "off"):
        raise ValueError(f"REGULARIZERS must be auto or off, got {cfg.regularizers!r}")
    if cfg.hours_available is not None and cfg.hours_available <= 0:
        raise ValueError(f"HOURS_AVAILABLE must be > 0, got {cfg.hours_available:g}")
    tokens, counted = count_tokens(cfg)
    train_tokens = int(tokens * (1 - cfg.val_fraction))
    hours = cfg.budget_usd / (cfg.gpu_hourly_usd * gpus.count) if cfg.budget_usd is not None else \
        cfg.training_hours or CUDA_DEFAULTS["training_hours"]
    vocab = VOCAB_CHAR if cfg.tokenizer == "char" else VOCAB_TIKTOKEN
    ladder = autosize.ladder(CUDA_DEFAULTS["aspect_ratio"], CUDA_DEFAULTS["head_dim"])
    # A regularized pick trains the whole budget: sized for the hours the launch line will buy
    size_hours = min(hours, cfg.hours_available) if cfg.hours_available and cfg.regularizers == "auto" else hours
    pairs = [rung(d, cfg, gpus, train_tokens, size_hours * 3600, vocab) for d in ladder]
    fitting = [c for r, c in pairs if r["fits"]]
    # What a run that keeps the regularizers off would train instead (the plain rule, at most the cap's passes)
    plain = autosize.choose([autosize.candidate(model_config(c.depth, cfg, vocab), c.tok_per_s, hours * 3600, train_tokens,
                                                CUDA_DEFAULTS["total_batch_size"]) for c in fitting])
    base = {"tokens": tokens, "train_tokens": train_tokens, "counted": counted, "budget_hours": hours,
            "rungs": [r for r, _ in pairs], "plain": {"depth": plain.depth, "hours": plain.seconds / 3600,
                                                     "passes": plain.epochs}}
    best = autosize.choose(fitting)
    p = sized(cfg, gpus, vocab, base, best)
    if p["regime"]["regularized"]:
        p = chain_sized(cfg, gpus, vocab, base, p, best, fitting)
    p["sweep"] = sweep_plan(p, cfg, gpus, [r["depth"] for r in p["rungs"] if r["fits"]], vocab)
    return p


def chain_sized(cfg: PlanConfig, gpus: Gpus, vocab: int, base: dict, p: dict, best: autosize.Candidate,
                fitting: list[autosize.Candidate]) -> dict:
    """The launch line's GENERATIONS=auto: its first generation sized for the chain, as DEPTH=auto sizes
    it (autosize.GENERATION_PASSES), among the depths that hold a teacher of their size; where none
    makes the passes, or the chain's depth would not take GENERATIONS, the plan `p` for one model."""
    holds = lambda c: autosize.holds_own_teacher(model_config(c.depth, cfg, vocab), gpus.count, gpus.memory_bytes)
    chain = autosize.choose_chain(fitting, holds)
    if not chain.generations or chain.depth == best.depth:
        return p
    q = sized(cfg, gpus, vocab, base, chain)
    return {**q, "one_model": {"depth": best.depth, "passes": p["regime"]["budget_passes"]}} if q["teacher_fits"] else p


def sized(cfg: PlanConfig, gpus: Gpus, vocab: int, base: dict, best: autosize.Candidate) -> dict:
    """The plan for DEPTH=auto's candidate `best`: its hours, GPUs, regime, student and launch line."""
    chosen = next(r for r in base["rungs"] if r["depth"] == best.depth)
    hours, per_hour = base["budget_hours"], cfg.gpu_hourly_usd * gpus.count
    by_depth, mfu_source, measured_on = gpus.measured or autosize.mfu_table(gpus.name)
    rows = gpu_rows(cfg, gpus, model_config(best.depth, cfg, vocab), chosen["tokens"], hours * per_hour)
    in_time = [r["gpus"] for r in rows if r["in_time"] and r["in_budget"]]
    p = {**base, "depth": chosen["depth"], "hours": chosen["useful_hours"],  # recommend_on prices it
         "budget_usd": hours * per_hour, "usd_per_hour": per_hour,
         "gpus": f"{gpus.count} x {gpus.name}", "gpu_count": gpus.count, "peak_flops": gpus.peak,
         "max_passes": chosen["epochs"], "stops_at_val_minimum": PLATEAU_EVALS > 0,
         "mfu_source": mfu_source, "mfu_measured_on": measured_on, "mfu_by_depth": by_depth,
         "mfu_from_box": gpus.measured is not None,
         "pass_cap": best.cap,
         "rule": autosize.rule(best) + (f"; past {regime.PASSES} passes regularized and no pass cap (a generation of "
                                        f"GENERATIONS=auto: {autosize.CHAIN_PASSES} where another fits after them), the stop at "
                                        "the val minimum the guard" if best.regularized
                                        and best.budget_epochs > regime.PASSES else
                                        f"; never more than {best.cap:g} passes (repeated data is worth less and less: "
                                        "Muennighoff et al. 2023)"),
         "link_gbps": gpus.link_gbps, "link_source": gpus.link_source, "hours_available": cfg.hours_available, "gpu_table": rows,
         "recommended_gpus": min(in_time) if cfg.hours_available is not None and in_time else gpus.count}
    recommend_on(p, cfg, rows)
    p["regime"] = regime_plan(p, cfg, rows, best.tok_per_s)
    # A generation after the first holds its teacher beside it (GENERATIONS=auto's second: one): another
    # model of this depth on each GPU
    config = model_config(best.depth, cfg, vocab)
    teachers = generations.teachers_held(2, "previous") * count_params(config)
    p["teacher_fits"] = choose_mode(config, p["recommended_gpus"], 1, config.max_seq_len, gpus.memory_bytes,
                                    teacher_params=teachers) is not None
    p["student"] = student_plan(p, cfg, gpus, vocab) if p["regime"]["regularized"] and p["teacher_fits"] else None
    p["launch"], p["run_dir"] = launch_line(p, cfg, p["recommended_gpus"])
    if p["regime"]["regularized"] and p["teacher_fits"]:  # the launch line's GENERATIONS=auto (launch_line):
        p["regime"]["settings"]["MAX_EPOCHS"] = regime.pass_cap("auto", p["regime"]["budget_passes"])  # the first's
    return p


# A sweep's regularization around regime.RECIPE's attention dropout (0.2, the first: every depth gets
# the recipe before any gets another strength), for members whose budget makes them data-limited.
SWEEP_DROPOUTS = (0.2, 0.1, 0.3)


def sweep_plan(p: dict, cfg: PlanConfig, gpus: Gpus, depths: list[int], vocab: int) -> dict | None:
    """Where one GPU trains the recommended depth's passes within the hours the budget buys the box,
    a sweep instead of one run over every GPU (docs/sweep.md): one member per GPU, each for the box's
    hours (less SWEEP_SCORING_SHARE, kept for scoring them) on its own GPU, no gradients between GPUs. The members: the recommended depth and
    the depths beside it; past regime.PASSES passes (data-limited) each at SWEEP_DROPOUTS' attention
    dropouts in turn, else each with other seeds (members for an ensemble). None on one GPU, or on
    more than one box's GPUs (a sweep runs on one box)."""
    count, hours = gpus.count, p["budget_hours"]
    if cfg.hours_available is not None:
        hours = min(hours, cfg.hours_available)
    one = next(r for r in p["gpu_table"] if r["gpus"] == 1)
    member = hours * (1 - SWEEP_SCORING_SHARE)  # as experiment/sweep.py gives its members
    if not 2 <= count <= GPUS_PER_NODE or not one["fits"] or one["hours"] > member:  # a sweep runs on one box
        return None
    i = depths.index(p["depth"])
    rates = {d: tok_per_s(model_config(d, cfg, vocab), gpus, 1)  # None: does not fit one GPU
             for d in [p["depth"]] + depths[max(i - 1, 0):i] + depths[i + 1:i + 2]}  # the pick, below, above
    passes = {d: r[0] * member * 3600 / p["train_tokens"] for d, r in rates.items() if r is not None}
    near = list(passes)
    members = [_sweep_member(d, passes[d], variant, cfg.regularizers == "auto") for variant in range(count)
               for d in near][:count]
    passes = {d: passes[d] for d in near[:count]}  # the depths the members use
    ddp = next(r for r in p["gpu_table"] if r["gpus"] == count)
    usd = hours * count * cfg.gpu_hourly_usd
    launch = _shell({"SWEEP": " ".join(members), "BUDGET_USD": _cents(usd), **planned_settings(cfg)})
    return {"members": members, "member_hours": member, "box_hours": hours, "usd": usd, "passes": passes,
            "single_gpu_hours": one["hours"], "ddp_gpus": count, "ddp_hours": ddp["hours"], "ddp_usd": ddp["usd"],
            "launch": launch}


def _sweep_member(depth: int, passes: float, variant: int, regularized: bool = True) -> str:
    """A sweep member's settings: variant 0 is the depth with the trainer's defaults; later variants of a
    data-limited depth take SWEEP_DROPOUTS' next dropout (with a seed once they repeat), of any other
    depth, or with the regularizers off, another seed."""
    if variant == 0:
        return f"DEPTH={depth}"
    if passes <= regime.PASSES or not regularized:
        return f"DEPTH={depth}+SEED={variant}"
    dropout = SWEEP_DROPOUTS[variant % len(SWEEP_DROPOUTS)]
    return f"DEPTH={depth}+ATTN_DROPOUT={dropout}" + (f"+SEED={variant}" if variant >= len(SWEEP_DROPOUTS) else "")


def recommend_on(p: dict, cfg: PlanConfig, rows: list[dict]) -> None:
    """The recommendation's hours and dollars on the GPUs the launch line names (fewer than those
    asked for when HOURS_AVAILABLE lets fewer finish): one GPU count from the recommendation to
    the launch line. Unspent: what the launch line's budget leaves."""
    count = p["recommended_gpus"]
    hours, usd = launch_budget(p, cfg, count)
    row = next(r for r in rows if r["gpus"] == count)
    if count != p["gpu_count"]:  # else the table's own figures, for the GPUs asked for
        p["hours"] = row["hours"]
    p["hours"] = min(p["hours"], hours)  # at most what the launch line's budget buys
    p["usd"] = p["hours"] * count * cfg.gpu_hourly_usd
    p.update(launch_hours=hours, launch_usd=usd, unspent_usd=max(usd - p["usd"], 0.0))


def regime_plan(p: dict, cfg: PlanConfig, rows: list[dict], rate: float) -> dict:
    """What the trainer's defaults by regime (experiment/regime.py) make of the launch line's run: the
    passes its budget makes at the recommended depth on the recommended GPUs; past regime.PASSES, the
    data-limited recipe, which trains on past the pass cap until the stop at the val minimum, at most
    the whole budget."""
    count = p["recommended_gpus"]
    rate = next((r["tok_per_s"] for r in rows if r["gpus"] == count and r["fits"]), rate)
    hours = launch_budget(p, cfg, count)[0]
    passes = rate * hours * 3600 / p["train_tokens"]
    limited = passes > regime.PASSES
    recipe = limited and cfg.regularizers == "auto"  # REGULARIZERS=off: the launch line pins them off
    values = regime.RECIPE if recipe else regime.OFF
    return {"budget_passes": passes, "gpus": count, "data_limited": limited, "regularized": recipe,
            "settings": {k.upper(): v for k, v in values.items()}, "hours_at_most": hours if recipe else None,
            "usd_at_most": hours * cfg.gpu_hourly_usd * count if recipe else None}


def table(p: dict) -> str:
    by_depth = p["mfu_by_depth"]
    cap_head = f"{p['pass_cap']:g} passes h"
    measured = ", ".join(f"d{d} {100 * m:.1f}%" for d, m in by_depth.items())
    lines = [f"plan | data: {p['train_tokens']:,} training tokens ({p['tokens']:,} {p['counted']}, "
             "minus the val split)",
             f"plan | GPUs: {p['gpus']} at {p['peak_flops'] / 1e12:.0f} TFLOP/s bf16 each | "
             f"${p['usd_per_hour']:.2f}/hour | budget {p['budget_hours']:.1f} h = ${p['budget_usd']:,.0f}",
             f"plan | tok/s are PREDICTED: MFU measured on {p['mfu_measured_on']} ({p['mfu_source']}: {measured}) x "
             f"peak x GPUs, less the gradient traffic at {p['link_gbps']:g} GB/s between GPUs ({p['link_source']}); "
             + ("the MFU MEASURED on this box, one GPU at a time" if p["mfu_from_box"] else "not measured on these GPUs")
             + f"; * outside d{min(by_depth)}-d{max(by_depth)} the nearest measured MFU is taken (small depths: an upper bound)",
             f"{'depth':>5} {'params':>8} {'tok/s':>11} {'1 pass h':>9} {'4 passes h':>11} "
             f"{cap_head:>11} {'useful h':>9} {'tok/param':>9} {'ckpt GB':>8} "
             f"{'disk GB':>8} {'save min':>8} {'serve GB':>8} {'CPU ch/s':>9}"]
    for r in p["rungs"]:
        measured_depth = min(by_depth) <= r["depth"] <= max(by_depth)
        rate = f"{r['tok_per_s']:,.0f}" + ("" if measured_depth else "*")
        lines.append(f"{'d' + str(r['depth']):>5} {_count(r['params']):>8} {rate:>11} "
                     f"{r['hours_per_pass']:>9.2f} {4 * r['hours_per_pass']:>11.2f} "
                     f"{p['pass_cap'] * r['hours_per_pass']:>11.2f} {r['useful_hours']:>9.2f} "
                     f"{r['tokens_per_param']:>9.1f} {r['checkpoint_gb']:>8.1f} {r['disk_peak_gb']:>8.0f} "
                     f"{r['save_minutes']:>8.1f} {r['serve_gb']:>8.1f} "
                     f"{r['cpu_chars_per_s']:>8.1f}{' ' if r['cpu_measured'] else '*'}"
                     + ("" if r["fits"] else "  does not fit in memory"))
    lines += ["plan | disk GB: KEEP_LAST + the best + the one before the warmdown + the one being written; save min: one checkpoint at the "
              "disk's write rate",
              "plan | serve GB: the bf16 weights and one request's KV cache (each more concurrent request adds "
              f"{p['rungs'][-1]['kv_slot_gb']:.2f} GB at d{p['rungs'][-1]['depth']}); CPU ch/s: one request decoding on "
              f"{servemem.CPU_DECODE_MACHINE}, MEASURED at d{' and d'.join(map(str, servemem.CPU_DECODE_TOK_S))}, "
              "* scaled from the nearest by the weights a step multiplies (below d12 an upper bound: a step's fixed costs "
              "dominate); an H200 decoded one d12 request at 93 tok/s, eight at 822 (docs/serving.md)",
              f"recommendation | DEPTH={p['depth']} on {p['recommended_gpus']} GPU(s) for {p['hours']:.2f} h "
              f"(${p['usd']:,.0f}) of the launch line's ${p['launch_usd']:,.0f} ({p['launch_hours']:.1f} h on "
              f"{p['recommended_gpus']}); ${p['unspent_usd']:,.0f} unspent",
              f"recommendation | at most {p['max_passes']:.1f} passes"
              + ("; stops earlier when val stops improving (the warmdown starts at the val minimum: "
                 "docs/training.md)" if p["stops_at_val_minimum"] else ""),
              f"recommendation | rule: {p['rule']}"] + regime_lines(p)
    return "\n".join(lines + gpu_lines(p) + sweep_lines(p))


def sweep_lines(p: dict) -> list[str]:
    sw = p["sweep"]
    if sw is None:
        return []
    passes = ", ".join(f"d{d} {n:.1f}" for d, n in sw["passes"].items())
    return [f"sweep | one GPU trains d{p['depth']}'s {p['max_passes']:.1f} passes in {sw['single_gpu_hours']:.2f} h, within "
            f"the box's {sw['box_hours']:.2f} h (the budget's, or HOURS_AVAILABLE if fewer): a sweep spends them on "
            f"{len(sw['members'])} "
            f"configurations side by side, one per GPU, each for {sw['member_hours']:.2f} h, the rest kept for "
            f"scoring them (${sw['usd']:,.0f} in all; passes each: {passes}, PREDICTED)",
            "sweep | it measures the size and the regularization on your data, serves the winner, and scores the "
            "ensembles of the best members (docs/sweep.md); no gradients cross between GPUs",
            f"sweep | one run over all {sw['ddp_gpus']} GPUs instead: d{p['depth']}'s passes in {sw['ddp_hours']:.2f} h "
            f"(${sw['ddp_usd']:,.0f}), its gradients all-reduced between GPUs",
            f"sweep | launch: {sw['launch']}"]


# A model a laptop serves: one request decodes at least this many characters a second on the reference
# 2-core CPU (servemem.CPU_DECODE_MACHINE), faster than people read (15-25).
LAPTOP_CHARS_PER_S = 30.0


def student_plan(p: dict, cfg: PlanConfig, gpus: Gpus, vocab: int) -> dict | None:
    """When a laptop cannot serve the plan's depth: the largest depth that it serves, as a STUDENT_DEPTH
    after two generations of the plan's depth (taught by both, which sit beside it on each GPU)."""
    rows = {r["depth"]: r for r in p["rungs"]}
    fast = [r for r in p["rungs"] if r["cpu_chars_per_s"] >= LAPTOP_CHARS_PER_S and r["depth"] < p["depth"]]
    if rows[p["depth"]]["cpu_chars_per_s"] >= LAPTOP_CHARS_PER_S or not fast:
        return None
    r = max(fast, key=lambda r: r["depth"])
    config = model_config(r["depth"], cfg, vocab)
    # the student of GENERATIONS=2 (the third model) is taught by the ensemble of both generations
    teachers = generations.teachers_held(3, "ensemble") * count_params(model_config(p["depth"], cfg, vocab))
    if choose_mode(config, p["recommended_gpus"], 1, config.max_seq_len, gpus.memory_bytes,
                   teacher_params=teachers) is None:
        return None
    return {"depth": r["depth"], "serve_gb": r["serve_gb"], "cpu_chars_per_s": r["cpu_chars_per_s"],
            "cpu_measured": r["cpu_measured"], "serve_gb_of_depth": rows[p["depth"]]["serve_gb"],
            "cpu_chars_per_s_of_depth": rows[p["depth"]]["cpu_chars_per_s"]}


def generation_lines(p: dict) -> list[str]:
    one = p.get("one_model")
    sizing = (f"; sized for it: d{p['depth']}, whose budget makes {p['regime']['budget_passes']:.1f} passes (at least "
              f"{autosize.GENERATION_PASSES}), where one model alone would be d{one['depth']} ({one['passes']:.1f} passes)"
              if one else "")
    capped = p["regime"]["settings"].get("MAX_EPOCHS")  # regime.pass_cap: where another generation fits after it
    lines = [f"recommendation | GENERATIONS=auto: when the stop at the val minimum "
             + (f"(or its {capped:g} passes, MAX_EPOCHS={capped:g}) " if capped else "") + f"ends d{p['depth']} with budget left, "
             "the rest trains more models of its depth from scratch, each distilled from the one before; the best one "
             f"is served{sizing} (measured on a CPU only, on 100,000 to 1.1M characters: docs/training.md, \"Generations\")",
             *generation_disk_lines(p)]
    st = p.get("student")
    if st:
        lines.append(f"recommendation | to serve on a laptop: d{p['depth']} needs {st['serve_gb_of_depth']:.1f} GB and decodes "
                     f"{st['cpu_chars_per_s_of_depth']:.1f} ch/s on the 2-core CPU above; GENERATIONS=2 "
                     f"STUDENT_DEPTH={st['depth']} instead of GENERATIONS=auto trains two d{p['depth']}, then a "
                     f"d{st['depth']} student taught by both, a third of the budget each, and serves the student: "
                     f"{st['serve_gb']:.2f} GB, {st['cpu_chars_per_s']:.0f} ch/s"
                     + ("" if st["cpu_measured"] else " (scaled)") + ". MEASURED ON A CPU ONLY: how much of their quality a student "
                     "keeps (a d2 of three d4 generations on 100,000 characters: 42% of their ensemble's gain; a d6 "
                     "of a d8 and a d4 generation on 1.1M characters: 25%; "
                     "Kim et al. 2025: 83% at 8x smaller; docs/performance.md)")
    return lines


def generation_disk_lines(p: dict) -> list[str]:
    """What GENERATIONS=auto keeps on disk beyond the disk GB column (generations.shrink)."""
    row = next((x for x in p.get("rungs", []) if x["depth"] == p["depth"]), None)
    if row is None:
        return []
    return [f"recommendation | GENERATIONS=auto on disk: each finished generation keeps its best weights and best.pt, "
            f"{row['generation_gb']:,.1f} GB in all, beside the disk GB column: up to "
            f"{(AUTO_MAX_GENERATIONS - 1) * row['generation_gb']:,.0f} GB more if all {AUTO_MAX_GENERATIONS} run"]


def regime_lines(p: dict) -> list[str]:
    r = p["regime"]
    settings = regime.settings_text({k.lower(): v for k, v in r["settings"].items()})
    head = (f"recommendation | regime: the launch line's budget makes {r['budget_passes']:.1f} passes at "
            f"d{p['depth']} on {r['gpus']} GPU(s)")
    if not r["data_limited"]:
        return [f"{head}, at most {regime.PASSES}: the trainer's defaults are {settings} (no regularizer)"]
    if not r.get("regularized", True):
        return [f"{head}, more than {regime.PASSES}: data-limited, but REGULARIZERS=off: the launch line pins "
                f"{settings}, so the run stops at the pass cap or its val minimum"]
    spends = (f"it trains the whole {r['hours_at_most']:.2f} h (${r['usd_at_most']:,.0f}) unless the stop at the val "
              "minimum ends it first" if p.get("hours", 0) >= r["hours_at_most"] * (1 - 1e-9) else
              f"it trains on past the pass cap until the stop at the val minimum, at most the whole "
              f"{r['hours_at_most']:.2f} h (${r['usd_at_most']:,.0f}): it may spend more than the hours above")
    plain = p.get("plain")
    beside = (f"; with ATTN_DROPOUT=0 AVERAGE=none the plain rule trains d{plain['depth']} for {plain['passes']:.1f} "
              f"passes, {plain['hours']:.2f} h on these GPUs, and leaves the rest unspent" if plain else "")
    return [f"{head}, more than {regime.PASSES}: data-limited, so the trainer's defaults are {settings}: regularized, "
            + spends,
            *(generation_lines(p) if p.get("teacher_fits", True) else [
                f"recommendation | no GENERATIONS: a generation after the first holds d{p['depth']} and its teacher, "
                f"another d{p['depth']}, on each GPU, which the memory plan says do not fit: with budget left at the "
                "val minimum, a smaller DEPTH (or more GPUs' memory) lets later generations spend it"]),
            f"recommendation | d{p['depth']} and what its passes buy are EXTRAPOLATED: the rule that sized it was checked on "
            "2-core CPU grids of up to 1.1M characters and d8; the regularizers' gain also on one H200 run of d10 on 9.9M "
            "(docs/performance.md, \"DEPTH=auto for regularized training\")" + beside]


def gpu_lines(p: dict) -> list[str]:
    """The recommended depth's run on fewer GPUs, the launch line and the run directory."""
    lines = [f"gpus | d{p['depth']}'s {p['max_passes']:.1f} passes on fewer GPUs (PREDICTED; comm: the share of a "
             "step spent moving gradients and weights between GPUs, not overlapped):",
             f"{'GPUs':>6} {'tok/s':>11} {'hours':>8} {'dollars':>8} {'comm':>6}"]
    for r in p["gpu_table"]:
        lines.append(f"{r['gpus']:>6} " + (f"{r['tok_per_s']:>11,.0f} {r['hours']:>8.2f} {'$' + format(r['usd'], ',.0f'):>8} "
                                           f"{r['comm_share']:>6.0%}" + ("" if r["in_budget"] else "  over the budget")
                                           + ("" if r["in_time"] else "  past HOURS_AVAILABLE")
                                           if r["fits"] else "does not fit in memory"))
    if p["hours_available"] is None and any(r["fits"] for r in p["gpu_table"]):
        cheapest = min((r for r in p["gpu_table"] if r["fits"]), key=lambda r: r["usd"])
        lines.append(f"gpus | the cheapest: {cheapest['gpus']} GPU(s), ${cheapest['usd']:,.0f} in {cheapest['hours']:.2f} h; "
                     "HOURS_AVAILABLE=<hours you can wait> recommends the fewest that finish in them")
    elif p["hours_available"] is not None:
        lines.append(f"gpus | rent {p['recommended_gpus']}: the fewest that finish within HOURS_AVAILABLE="
                     f"{p['hours_available']:g} and the budget"
                     if any(r["in_time"] and r["in_budget"] for r in p["gpu_table"])
                     else f"gpus | none finishes within HOURS_AVAILABLE={p['hours_available']:g} and the budget: the launch line "
                          f"is for {p['recommended_gpus']}, and its budget ends the run on time")
    lines += [f"launch | on the rented box, with the data in $WORKSPACE/data: {p['launch']}",
              f"launch | it writes {p['run_dir']} (WORKSPACE: /workspace/<repo> where /workspace is writable, "
              "else the repository)",
              "launch | to stop paying when it ends, add ON_EXIT='[ \"$RUN_STATUS\" != stopped ] && runpodctl stop pod "
              "$RUNPOD_POD_ID' (RunPod; on a VM: sudo shutdown -h now): it runs once the launch ends, a finished "
              "run's best.pt and report.md already on /workspace, which a stopped pod keeps; never after a "
              "preemption (docs/survival.md)"]
    return lines


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
