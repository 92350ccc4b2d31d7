"""The items of gpucheck (experiment/tools/gpucheck.py): each `check_<name>(ctx) -> Item` runs one part of
the trainer's CUDA path for real and reports what it measured."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from experiment import checkpoint as ckpt
from experiment.autosize import WEIGHT_BYTES, mfu_table, predicted_tok_per_s
from experiment.checkpoint import RunState
from experiment.config import TrainConfig, checkpoint_meta, resolve
from experiment.dataloader import prepare, write_demo_corpus
from experiment.distributed import Dist, sync
from experiment.files import REPO_ROOT
from experiment.hardware import free_memory, peak_flops
from experiment.memory import checkpoint_bytes_per_rank, choose_mode, plan_memory
from experiment.model import DTYPES, GPTConfig, build_model
from experiment.optim import LRS, ShardedOptimizer
from experiment.report import read_records
from experiment.step import forward_backward, optimizer_step
from experiment.tools.probes import cpu_matmul_peak, measure_speed, probe_peak_memory, profile_step
from experiment.saver import Saver
from experiment.saving import checkpoint_share, restore_checkpoint, write_checkpoint

ITEMS = ("env", "correctness", "ddp", "link", "speed", "memory", "checkpoints", "e2e")
# Items whose verdicts rest on no speed target (pytest, compiled-vs-eager losses, a run's budget against
# the reserve it measured itself, under the same load): on a GPU they run side by side, so the whole
# check fits in 10 minutes. Their own timings (ddp's step times) are taken under that load.
SIDE_BY_SIDE = ("correctness", "ddp", "e2e")
GIB = 2**30
VOCAB = 128  # a char vocabulary padded to a multiple of 64
MFU_GOAL = 0.5  # nanochat reports about 50% on H100 SXM


@dataclass(frozen=True)
class Sizes:
    """How big each item runs. The GPU sizes are the issue's; the CPU ones only prove the code paths."""
    aspect_ratio: int
    head_dim: int
    seq: int
    speed_depths: tuple[int, ...]
    batch_cap: int
    speed_steps: int
    profile_depth: int
    fit_depth: int
    fit_world: int
    fit_batches: tuple[int, ...]
    ckpt_depths: tuple[int, ...]
    e2e_depth: int
    e2e_seconds: float


# The e2e budget holds two launches' starts, both charged to it since the budget counts the launch
# from run.sh's start (pre-flight, imports, compile: about 55 s of d12 on an H200, the resumed one
# about 30 s), and steps on both sides of the preemption.
GPU_FULL = Sizes(64, 128, 2048, (12, 20, 24, 32), 16, 6, 0, 64, 8, (1, 2, 4), (32,), 12, 150)
GPU_QUICK = Sizes(64, 128, 2048, (12, 24), 16, 4, 24, 64, 8, (1,), (24,), 12, 150)
CPU_SIZES = Sizes(32, 32, 64, (2, 4), 4, 3, 4, 8, 8, (1, 2), (2,), 2, 60)


@dataclass
class Item:
    name: str
    status: str  # PASS, WARN, FAIL or SKIP
    summary: str
    figures: dict = field(default_factory=dict)
    detail: str = ""  # Markdown: tables, logs
    seconds: float = 0.0
    side_by_side: bool = False  # ran beside other items (SIDE_BY_SIDE, on a GPU)


@dataclass
class Ctx:
    """What every item needs: where it runs, how big, where it may write, what earlier items found."""
    device: torch.device
    sizes: Sizes
    workspace: Path
    out: Path
    found: dict = field(default_factory=dict)
    children: list = field(default_factory=list)  # processes started in their own session (the e2e launcher)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def stop_children(self) -> None:
        for proc in self.children:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)


# ---------------------------------------------------------------- shared helpers


def _config(ctx: Ctx, depth: int) -> GPTConfig:
    s = ctx.sizes
    return GPTConfig(vocab_size=VOCAB, depth=depth, aspect_ratio=s.aspect_ratio, head_dim=s.head_dim, max_seq_len=s.seq)


def _gpu_bytes(ctx: Ctx) -> int:
    return torch.cuda.get_device_properties(ctx.device).total_memory


def _setup_that_fits(ctx: Ctx, config: GPTConfig):
    """(precision, recompute, device batch, plan) as the trainer would choose them on one GPU: the
    cheapest mode that fits at batch 1, then the largest power-of-two batch <= batch_cap the plan fits."""
    cap, seq = ctx.sizes.batch_cap, config.max_seq_len
    if not ctx.cuda:
        return "fp32", False, cap, plan_memory(config, 1, cap, seq, "fp32", False, cuda=False)
    mode = choose_mode(config, 1, 1, seq, _gpu_bytes(ctx))
    if mode is None:
        raise RuntimeError(f"d{config.depth} does not fit one GPU at device batch 1 in any mode")
    batch = 1
    ckpt_on = mode.activation_checkpointing
    while batch * 2 <= cap and plan_memory(config, 1, batch * 2, seq, mode.precision, ckpt_on).fits(_gpu_bytes(ctx)):
        batch *= 2
    return mode.precision, ckpt_on, batch, plan_memory(config, 1, batch, seq, mode.precision, ckpt_on)


def _peak_flops(ctx: Ctx) -> tuple[float | None, str]:
    if ctx.cuda:
        name = torch.cuda.get_device_name(ctx.device)
        return peak_flops(name), f"{name} dense bf16 peak from the table"
    peak = ctx.found.setdefault("cpu_peak", cpu_matmul_peak())
    return peak, f"measured fp32 matmul peak {peak / 1e9:.0f} GFLOP/s"


def _table(head: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def _status(failed: bool, warned: bool) -> str:
    return "FAIL" if failed else "WARN" if warned else "PASS"


# ---------------------------------------------------------------- 1. environment


def _driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (no nvidia-smi)"


def _torch_pin() -> str | None:
    for line in (REPO_ROOT / "requirements.txt").read_text().splitlines():
        if line.startswith("torch=="):
            return line.split("==")[1].strip()
    return None


def _bf16_matmul_tflops(device: torch.device, n: int = 8192, reps: int = 10) -> float:
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12


def check_env(ctx: Ctx) -> Item:
    figures = {"torch": torch.__version__, "python": sys.version.split()[0]}
    warnings = []
    pin = _torch_pin()
    if pin and torch.__version__.split("+")[0] != pin:
        warnings.append(f"torch {torch.__version__} is not the pinned {pin}: fine for this check; `bash run.sh` "
                        "installs the pin")
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        peak, _ = _peak_flops(ctx)
        figures.update(gpu=props.name, gpus=torch.cuda.device_count(), memory_gib=round(props.total_memory / GIB, 1),
                       capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                       driver=_driver_version(), cuda=torch.version.cuda,
                       nccl=".".join(map(str, torch.cuda.nccl.version())), peak_flops_table=peak,
                       bf16_matmul_tflops_measured=round(_bf16_matmul_tflops(ctx.device), 1))
        if peak is None:
            warnings.append(f"{props.name} is not in the peak FLOP/s table (hardware.PEAK_FLOPS): no MFU is reported")
        if figures["gpus"] < 2:
            warnings.append("one GPU: NCCL collectives are not exercised (the correctness tests run nccl world 2 "
                            "when there are 2 or more GPUs; on one, their two-rank test runs gloo on it)")
    else:
        figures.update(cpu_threads=torch.get_num_threads(), cpu_fp32_matmul_gflops=round(_peak_flops(ctx)[0] / 1e9, 1))
        warnings.append("no CUDA: every figure in this report is a CPU figure at tiny sizes")
    summary = ", ".join(f"{k} {v}" for k, v in figures.items())
    detail = "\n".join(f"- warning: {w}" for w in warnings)
    return Item("env", _status(False, bool(warnings)), summary, figures, detail)


# ---------------------------------------------------------------- 2. correctness (pytest)


def _junit_rows(path: Path) -> list[list]:
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome, message = tag, (el.get("message") or "").replace("\n", " ").replace("|", "/")[:160]
        rows.append([case.get("name"), outcome, f"{float(case.get('time', 0)):.1f}", message])
    return rows


def check_correctness(ctx: Ctx) -> Item:
    junit = ctx.out / "junit.xml"
    # -rA prints each passed test's captured output, where the notes below come from
    cmd = [sys.executable, "-m", "pytest", str(REPO_ROOT / "tests/test_cuda.py"), "-m", "cuda", "-q", "-rA",
           "-p", "no:cacheprovider", f"--junitxml={junit}"] + ([] if ctx.cuda else ["--cuda-tests-on-cpu"])
    if ctx.cuda and importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", "4"]  # pytest-xdist, where the box has it: the tests side by side on the one GPU
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=1200)
    rows = _junit_rows(junit) if junit.exists() else []
    counts = {o: sum(r[1] == o for r in rows) for o in ("passed", "failure", "error", "skipped")}
    failed = proc.returncode != 0 or counts["passed"] == 0
    notes = [line for line in proc.stdout.splitlines() if line.startswith(("sigterm:", "ranks2", "block_linear:"))]
    detail = _table(["test", "outcome", "seconds", "message"], rows) + "".join(f"\n\n{n}" for n in notes)
    if failed:
        detail += f"\n\n```\n{(proc.stdout + proc.stderr)[-3000:]}\n```"
    summary = (f"{counts['passed']} passed, {counts['failure'] + counts['error']} failed, {counts['skipped']} "
               f"skipped (tests/test_cuda.py on {ctx.device.type})")
    return Item("correctness", _status(failed, counts["skipped"] > 0), summary, counts, detail)


# ---------------------------------------------------------------- 3. speed


def _speed_row(r: dict, seq: int) -> list:
    return [f"d{r['depth']}", f"{r['params'] / 1e6:,.0f}M", f"{r['batch']} x {seq} x {r['grad_accum']}",
            r["precision"] + (" +ckpt" if r["activation_checkpointing"] else ""), f"{r['micro_tok_per_s']:,.0f}",
            f"{1000 * r['micro_s']:.1f}", f"{1000 * r['optimizer_s']:.1f}", f"{r['host_overhead_ms']:.1f}",
            f"{r['tok_per_s']:,.0f}", f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-",
            f"{r['predicted']:,.0f}" if r.get("predicted") else "-", f"{r['first_step_s']:.1f}"]


def _profile(ctx: Ctx, results: dict) -> str:
    depth = ctx.sizes.profile_depth
    if depth not in results:
        return ""
    r = results[depth]
    batch = max(r["batch"] // 2, 1)  # eager keeps more activations than the compiled step measured above
    try:
        table = profile_step(_config(ctx, depth), batch, r["precision"], ctx.device)
    except torch.OutOfMemoryError as e:
        free_memory(ctx.device)
        return f"\n\nProfile of d{depth} at batch {batch}: out of memory ({str(e)[:200]})"
    return (f"\n\nProfile of one eager step (one micro-batch of {batch} x {ctx.sizes.seq} and the optimizer) at "
            f"d{depth}, by self {'CUDA' if ctx.cuda else 'CPU'} time:\n\n```\n{table}\n```")


def check_speed(ctx: Ctx) -> Item:
    peak, peak_src = _peak_flops(ctx)
    tokens_per_step = resolve(TrainConfig(), ctx.cuda, 1).total_batch_size  # the default TOTAL_BATCH_SIZE
    results = {}
    for depth in ctx.sizes.speed_depths:
        config = _config(ctx, depth)
        precision, activation_checkpointing, batch, plan = _setup_that_fits(ctx, config)
        r = measure_speed(config, batch, precision, activation_checkpointing, ctx.device, ctx.sizes.speed_steps,
                          compile_model=ctx.cuda, tokens_per_step=tokens_per_step)
        r.update(depth=depth, batch=batch, precision=precision, activation_checkpointing=activation_checkpointing,
                 planned=plan.total, planned_rows=plan.rows,
                 mfu=r["flops_per_token"] * r["tok_per_s"] / peak if peak else None,
                 # what the plan and DEPTH=auto predict for this depth on one such GPU (CUDA only)
                 predicted=predicted_tok_per_s(config, peak, 1, 1.0, WEIGHT_BYTES[precision], tokens_per_step,
                                               gpu_name=torch.cuda.get_device_name(ctx.device))
                 if ctx.cuda and peak else None)
        results[depth] = r
        print(f"gpucheck | speed d{depth}: {r['tok_per_s']:,.0f} tok/s, first step {r['first_step_s']:.1f}s", flush=True)
    ctx.found["speed"] = results
    head = ["size", "params", "batch x seq x accum", "weights", "micro-step tok/s", "micro-step ms",
            "optimizer + syncs ms", "host syncs ms", f"tok/s at {tokens_per_step:,} tokens/step", "MFU",
            "predicted tok/s" + (f" ({mfu_table(torch.cuda.get_device_name(ctx.device))[1]})" if ctx.cuda else ""),
            "first step s" + (" (compile)" if ctx.cuda else "")]
    detail = (f"MFU against the {peak_src}. Random tokens, one device, the trainer's step: autocast bf16, Muon + "
              f"AdamW, {'torch.compile (whole model)' if ctx.cuda else 'eager'}. A step of {tokens_per_step:,} tokens "
              "(the default TOTAL_BATCH_SIZE) is composed of measured parts: grad_accum micro-steps (forward + "
              "backward, timed in a queue) plus one optimizer step with the trainer's two host syncs. 'host syncs' "
              "is a synced step minus a step in a queue of unsynced ones. 'predicted' is what the plan and DEPTH=auto "
              "predict for this depth on one such GPU, from this GPU kind's MFU table (autosize.MEASURED_MFU): where "
              "that table came from an earlier gpucheck of the same kind, a check that it still holds.\n\n"
              + _table(head, [_speed_row(r, ctx.sizes.seq) for r in results.values()]) + _profile(ctx, results))
    goal = results.get(24, {}).get("mfu")
    short = ctx.cuda and goal is not None and goal < MFU_GOAL
    summary = " | ".join(f"d{d} {r['tok_per_s']:,.0f} tok/s" + (f" MFU {100 * r['mfu']:.1f}%" if r["mfu"] else "")
                         for d, r in results.items()) + (f" | d24 below the {100 * MFU_GOAL:.0f}% goal" if short else "")
    figures = {f"d{d}": {k: v for k, v in r.items() if k != "planned_rows"} for d, r in results.items()}
    return Item("speed", _status(False, short), summary, figures, detail)


# ---------------------------------------------------------------- 4. memory


def _context_bytes(ctx: Ctx) -> int:
    """GPU memory outside PyTorch's allocator (CUDA context, library workspaces)."""
    free, total = torch.cuda.mem_get_info(ctx.device)
    return total - free - torch.cuda.memory_reserved(ctx.device)


def _plan_vs_measured(ctx: Ctx, outside: int) -> tuple[list[list], dict]:
    rows, errors = [], {}
    for depth, r in ctx.found.get("speed", {}).items():
        measured = r["peak_reserved"] + outside
        no_overhead = r["planned"] - r["planned_rows"]["overhead"]
        errors[f"d{depth}"] = (r["planned"] - measured) / measured
        rows.append([f"d{depth} batch {r['batch']} (compiled)", f"{r['planned'] / GIB:.1f}",
                     f"{r['peak_allocated'] / GIB:.1f}", f"{measured / GIB:.1f}",
                     f"{(measured - no_overhead) / GIB:.1f} (planned {r['planned_rows']['overhead'] / GIB:.1f})",
                     f"{100 * errors[f'd{depth}']:+.1f}%"])
    return rows, errors


def _fit_rows(ctx: Ctx, outside: int) -> tuple[list[list], dict, dict, bool]:
    """The big model as rank 0 of its world at each device batch: planned vs measured."""
    s = ctx.sizes
    config, rows, errors, fit, failed = _config(ctx, s.fit_depth), [], {}, {}, False
    for batch in s.fit_batches:
        # a simulated world makes no collectives: no NCCL buffers to compare
        plan = plan_memory(config, s.fit_world, batch, s.seq, "bf16", True, cuda=ctx.cuda, collectives=False)
        label = f"d{s.fit_depth} bf16 +ckpt batch {batch}, rank 0 of {s.fit_world}"
        try:
            peak = probe_peak_memory(config, s.fit_world, batch, s.seq, "bf16", True, ctx.device, steps=2)
        except torch.OutOfMemoryError:
            free_memory(ctx.device)
            failed |= plan.fits(_gpu_bytes(ctx))  # the planner said it fits, and it did not
            fit[batch] = "out of memory"
            rows.append([label, f"{plan.total / GIB:.1f}", "OUT OF MEMORY", "", "", ""])
            continue
        if peak is None:  # CPU: the code path ran; there is no allocator peak to compare
            fit[batch] = "ran (CPU)"
            rows.append([label, f"{plan.total / GIB:.3f}", "n/a on CPU", "", "", ""])
            continue
        measured = peak["reserved"] + outside
        errors[f"d{s.fit_depth}_b{batch}"] = err = (plan.total - measured) / measured
        fit[batch] = f"{measured / GIB:.1f} GiB"
        rows.append([label, f"{plan.total / GIB:.1f}", f"{peak['allocated'] / GIB:.1f}", f"{measured / GIB:.1f}",
                     f"{(measured - plan.total + plan.rows['overhead']) / GIB:.1f} (planned "
                     f"{plan.rows['overhead'] / GIB:.1f})", f"{100 * err:+.1f}%"])
    return rows, errors, fit, failed


def check_memory(ctx: Ctx) -> Item:
    s = ctx.sizes
    outside = _context_bytes(ctx) if ctx.cuda else 0
    rows, errors = _plan_vs_measured(ctx, outside) if ctx.cuda else ([], {})
    fit_rows, fit_errors, fit, failed = _fit_rows(ctx, outside)
    errors.update(fit_errors)
    worst = max(errors.values(), key=abs) if errors else 0.0
    head = ["configuration", "planned GiB", "peak allocated GiB", "measured GiB (reserved + outside)",
            "overhead GiB measured", "planner error"]
    detail = (f"Measured = the caching allocator's peak reserved bytes + {outside / GIB:.2f} GiB outside it (CUDA "
              "context, library workspaces). Planner error = (planned - measured) / measured: positive means "
              "the planner is conservative.\n\n" + _table(head, rows + fit_rows))
    summary = (f"worst planner error {100 * worst:+.1f}% over {len(errors)} configurations | "
               f"d{s.fit_depth} as rank 0 of {s.fit_world}: " + ", ".join(f"batch {b} {v}" for b, v in fit.items()))
    return Item("memory", _status(failed, abs(worst) > 0.2), summary,
                {"errors": errors, "outside_bytes": outside, "fit": fit}, detail)


# ---------------------------------------------------------------- 5. checkpoints


def _demo_prepared(ctx: Ctx):
    data = write_demo_corpus(ctx.workspace / "demo_data").parent
    return prepare(data, ctx.workspace, max_seq_len=ctx.sizes.seq)


def _drop_page_cache() -> bool:
    """So the load reads the disk, not the pages the save just wrote (needs root; False otherwise)."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _time_save_load(ctx: Ctx, depth: int, prepared) -> dict:
    """The trainer's own save and resume load of one step of a model with optimizer state."""
    config = _config(ctx, depth)
    precision, activation_checkpointing, _, _ = _setup_that_fits(ctx, config)
    tag = f"gpucheck-d{depth}"
    cfg = resolve(TrainConfig(depth=depth, aspect_ratio=config.aspect_ratio, head_dim=config.head_dim,
                              max_seq_len=config.max_seq_len, total_batch_size=config.max_seq_len, device_batch_size=1,
                              workspace=str(ctx.workspace), model_tag=tag), ctx.cuda, 1)
    run_dir = ctx.workspace / "checkpoints" / tag
    shutil.rmtree(run_dir, ignore_errors=True)
    model = build_model(config, ctx.device, DTYPES[precision], draw_on_device=True,
                        activation_checkpointing=activation_checkpointing)
    opt = ShardedOptimizer(model, **LRS, master_weights=precision == "bf16")
    x = torch.randint(0, VOCAB, (1, config.max_seq_len), device=ctx.device)
    forward_backward(model, x, x)
    optimizer_step(model, opt)  # creates the optimizer state a real checkpoint holds
    d = Dist(0, 0, 1, ctx.device)
    st = RunState(step=1, tokens_seen=x.numel(), used_seconds=1.0, best_val=9.0, best_step=1,
                  data_state={"epoch": 0, "cursor": 0})
    try:
        sync(ctx.device)
        t0 = time.perf_counter()
        error = write_checkpoint(run_dir, model, opt, st, 9.0, checkpoint_meta(cfg, prepared, 3600.0), d)
        if error is not None:
            raise RuntimeError(f"saving a d{depth} checkpoint failed: {error}")
        save_s = time.perf_counter() - t0
        nbytes = sum(p.stat().st_size for p in run_dir.glob("*_000001*.pt"))
        cold = _drop_page_cache()
        t0 = time.perf_counter()
        restore_checkpoint(run_dir, 1, model, opt, d)
        sync(ctx.device)
        load_s = time.perf_counter() - t0
        background = _time_background_saves(ctx, run_dir, model, opt, st, checkpoint_meta(cfg, prepared, 3600.0), x, d)
    finally:
        del model, opt
        free_memory(ctx.device)
        shutil.rmtree(run_dir, ignore_errors=True)
    return {"depth": depth, "precision": precision, "bytes": nbytes, "save_s": save_s, "load_s": load_s,
            "save_gb_s": nbytes / save_s / 1e9, "load_gb_s": nbytes / load_s / 1e9, "cold_load": cold, **background}


def _time_background_saves(ctx: Ctx, run_dir: Path, model, opt, st: RunState, run_meta: dict, x, d: Dist) -> dict:
    """Two saves through the trainer's Saver in the background (the first allocates the pinned host
    buffers, the second reuses them), training steps running while each writes: the seconds
    training was blocked per save, and the step time during a write against without one."""
    def step() -> float:
        t0 = time.perf_counter()
        forward_backward(model, x, x)
        optimizer_step(model, opt)
        sync(ctx.device)
        return time.perf_counter() - t0

    saver = Saver(run_dir, 0, 1, ctx.device, background=True, all_ok=bool, gather=lambda files: [files])
    normal = sorted(step() for _ in range(3))[1]
    blocked, during, written = [], [], 0.0
    for number in (2, 3):
        st.step = number
        t0 = time.perf_counter()
        saver.begin(number, *checkpoint_share(model, opt, st, 9.0, run_meta, d), background=True)
        staged = time.perf_counter() - t0
        while saver.writing():
            during.append(step())
        t0 = time.perf_counter()
        saver.wait()
        pending, error = saver.complete()
        if error is not None:
            raise RuntimeError(f"a background save failed: {error}")
        blocked.append(staged + time.perf_counter() - t0)
        written = pending.write_seconds
    return {"bg_blocked_first_s": blocked[0], "bg_blocked_s": blocked[1], "bg_written_s": written,
            "step_s": normal, "step_writing_s": sorted(during)[len(during) // 2] if during else None,
            "pinned_gb": saver.buffers.nbytes() / 1e9}


def check_checkpoints(ctx: Ctx) -> Item:
    prepared = _demo_prepared(ctx)
    results = [_time_save_load(ctx, depth, prepared) for depth in ctx.sizes.ckpt_depths]
    rows = [[f"d{r['depth']}", r["precision"], f"{r['bytes'] / 1e9:.2f}", f"{r['save_s']:.1f}", f"{r['save_gb_s']:.2f}",
             f"{r['load_s']:.1f}", f"{r['load_gb_s']:.2f}" + ("" if r["cold_load"] else " (page cache)")] for r in results]
    rate = min(r["save_gb_s"] for r in results)
    big = GPTConfig(vocab_size=VOCAB, depth=64, aspect_ratio=64, head_dim=128, max_seq_len=2048)
    parts = checkpoint_bytes_per_rank(big, 8, "bf16")
    ranks = [p + o for p, o in parts]
    rank0_old = sum(p for p, _ in parts) + parts[0][1]  # the whole model, not its part, plus its shard
    detail = (_table(["size", "weights", "GB written", "save s", "save GB/s", "load s", "load GB/s"], rows)
              + f"\n\nSave = the trainer's write_checkpoint (state to host, torch.save, fsync, rename, meta); load = "
              f"its resume load. Extrapolated, not measured: d64 bf16 on 8 ranks writes {sum(ranks) / 1e9:.0f} GB per "
              f"checkpoint, {max(ranks) / 1e9:.1f} GB on the busiest rank. At the slowest save rate measured here "
              f"({rate:.2f} GB/s) one writer takes {max(ranks) / rate / 1e9:.0f} s for a rank's share; if the 8 ranks "
              f"share this disk's rate, {sum(ranks) / rate / 1e9:.0f} s in all. Before the model was written in "
              f"parts, rank 0 alone wrote about {rank0_old / 1e9:.0f} GB.")
    summary = " | ".join(f"d{r['depth']} {r['bytes'] / 1e9:.1f} GB: save {r['save_s']:.1f}s ({r['save_gb_s']:.2f} GB/s), "
                         f"load {r['load_s']:.1f}s ({r['load_gb_s']:.2f} GB/s)" for r in results)
    summary += f" | d64 world 8 extrapolated: {sum(ranks) / rate / 1e9:.0f} s per save at this disk's rate"
    summary += "".join(f" | d{r['depth']} in the background: training blocked {r['bg_blocked_s']:.2f}s per save, "
                       f"{100 * r['bg_blocked_s'] / r['save_s']:.1f}% of the blocking save "
                       f"({r['bg_blocked_first_s']:.2f}s the first, pinning {r['pinned_gb']:.1f} GB), written in "
                       f"{r['bg_written_s']:.1f}s, step {r['step_s']:.3f}s, "
                       + (f"{r['step_writing_s']:.3f}s while writing" if r["step_writing_s"] else "no step while writing")
                       for r in results)
    return Item("checkpoints", "PASS", summary, {"runs": results, "d64_world8_bytes_per_rank": ranks}, detail)


# ---------------------------------------------------------------- compiled DDP


def _run_ddpcheck(ctx: Ctx, world: int, *flags: str) -> dict:
    """experiment/tools/ddpcheck under torchrun: 1 MB buckets, so that even this small model is split
    into several compiled graphs, as a large one is at the trainer's bucket size."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           f"--master_port={port}", "-m", "experiment.tools.ddpcheck", "--device", ctx.device.type,
           "--bucket_mb", "1", "--aspect_ratio", "128", "--head_dim", "64", *(flags or ("--link_mb", "0"))]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=1200)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"world": world, "error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
    return json.loads(lines[-1])


def check_ddp(ctx: Ctx) -> Item:
    """torch.compile over DDP with activation checkpointing and 3 accumulated micro-batches (the
    trainer's GPU combination) against the same steps eager, at world 1 and, with two GPUs or more,
    over every GPU of the box."""
    gpus = torch.cuda.device_count() if ctx.cuda else 1
    worlds = [1, gpus] if gpus >= 2 else [1]
    runs = [_run_ddpcheck(ctx, w) for w in worlds]
    tolerance = 1e-2 if ctx.cuda else 1e-4  # bf16 autocast on CUDA: compiled kernels round differently
    failed = False
    for r in runs:
        if "error" in r:
            failed = True
            continue
        r["loss_rel_diff"] = max(abs(a - b) / abs(a) for a, b in zip(r["eager_losses"], r["compiled_losses"]))
        failed |= r["loss_rel_diff"] > tolerance or not r["grads_in_buckets"]
    summary = " | ".join(
        f"world {r['world']}: " + (f"FAILED ({r['error'][-200:]})" if "error" in r else
                                   f"compiled losses within {r['loss_rel_diff']:.1e} of eager, grads in "
                                   f"{r['buckets']} buckets{'' if r['grads_in_buckets'] else ' NOT kept'}, compile "
                                   f"{r['compile_step_seconds']:.0f}s, step {r['compiled_step_seconds']:.3f}s "
                                   f"compiled vs {r['eager_step_seconds']:.3f}s eager") for r in runs)
    if len(worlds) == 1 and ctx.cuda:
        summary += " | world N not run: one GPU"
    if ctx.cuda:
        summary += " | step times taken beside the other side-by-side items"
    return Item("ddp", _status(failed, False), summary, {"runs": runs})


def check_link(ctx: Ctx) -> Item:
    """The bus bandwidth of an all-reduce over every GPU of the box (256 MB of fp32, NCCL), timed alone:
    what `plan` assumes as LINK_GBPS, which GPUCHECK=<this report.json> replaces with it. On a CPU, 2
    gloo ranks over loopback prove the path (16 MB)."""
    world = torch.cuda.device_count() if ctx.cuda else 2
    if world < 2:
        return Item("link", "SKIP", "one GPU: no all-reduce between GPUs to time")
    r = _run_ddpcheck(ctx, world, "--link_only", "--link_mb", "256" if ctx.cuda else "16")
    if "error" in r:
        return Item("link", "FAIL", f"world {world}: FAILED ({r['error'][-200:]})", r)
    return Item("link", "PASS", f"all-reduce of {r['link_mb']:g} MB over {world} "
                f"{'GPUs' if ctx.cuda else 'gloo ranks'}: {r['link_gbps']:.1f} GB/s bus bandwidth", r)


# ---------------------------------------------------------------- 6. end to end


def _e2e_env(ctx: Ctx, ws: Path) -> dict:
    """experiment/run.sh's environment: the user's, minus any training override it may hold."""
    names = {f.name.upper() for f in fields(TrainConfig)} | {"NPROC_PER_NODE", "NNODES", "NODE_RANK"}
    env = {k: v for k, v in os.environ.items() if k not in names}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = ctx.sizes
    env.update(PYTHON=sys.executable, PYTHONUNBUFFERED="1", WORKSPACE=str(ws), MASTER_PORT=str(port),
               TRAINING_HOURS=str(s.e2e_seconds / 3600), DEPTH=str(s.e2e_depth), MODEL_TAG="e2e",
               SAVE_EVERY_MINUTES="1000", EVAL_EVERY_MINUTES=str(s.e2e_seconds / 4 / 60), SAMPLE_TOKENS="0",
               LOG_EVERY_STEPS="20", MAX_RESTARTS="0", SHUTDOWN_TIMEOUT="120",
               ALLOW="demo,repeat",  # the check trains the demo on purpose, minutes on a small corpus
               # The budget is what it checks: neither the pass cap nor the val minimum (the demo's small
               # corpus overfits a d12 within the minutes) may end the run first.
               MAX_EPOCHS="0", PLATEAU_EVALS="0",
               EVAL_EVERY_EPOCHS="0",  # evals by the clock alone: a quarter pass of the demo is seconds on a GPU
               PYTHON_CHECK="0")  # the env item says when this Python's torch is not the pin
    if ctx.cuda:  # d12 at 16 x 2048 tokens a step: many short steps, so the stop lands close to the budget
        env.update(DEVICE_BATCH_SIZE="16", TOTAL_BATCH_SIZE=str(16 * 2048), EVAL_TOKENS=str(1 << 18))
    else:
        env.update(DEVICE="cpu", ASPECT_RATIO=str(s.aspect_ratio), HEAD_DIM=str(s.head_dim), MAX_SEQ_LEN=str(s.seq),
                   DEVICE_BATCH_SIZE="8", TOTAL_BATCH_SIZE=str(8 * s.seq), EVAL_TOKENS="2048", OMP_NUM_THREADS="1")
    return env


def _launch(env: dict, log: Path) -> subprocess.Popen:
    with open(log, "w") as out:  # the child keeps its own handle
        return subprocess.Popen(["bash", str(REPO_ROOT / "experiment/run.sh")], cwd=REPO_ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for_line(path: Path, text: str, proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if path.exists() and text in path.read_text():
            return True
        time.sleep(0.5)
    return path.exists() and text in path.read_text()


def _used_seconds(run_dir: Path) -> float:
    """The budget seconds a run had used at its last step line (metrics.jsonl), 0 before any."""
    records = read_records(run_dir / "metrics.jsonl")
    return max((r["used_seconds"] for r in records if r.get("kind") == "train"), default=0.0)


def _done_seconds(log_text: str) -> tuple[float, float] | None:
    """(used, budget) seconds from the last run's "done:" line."""
    for line in reversed(log_text.splitlines()):
        if line.startswith("done: ") and "s of " in line:
            used, budget = line.split("(")[1].split(")")[0].split(" of ")
            return float(used.rstrip("s")), float(budget.rstrip("s"))
    return None


def _budget_bounds(state: dict, budget: float | None) -> tuple[float, float, float, float]:
    """(step seconds, reserve seconds, how far short of the budget and how far past it, as fractions)
    a run keeps to. Past it by at most 1%, or two of the run's own steps where those are longer (a
    loaded CPU); short of it by at most 1% more than the reserve the run keeps for its ending (its
    longest eval and save and a step, measured): the budget's end comes before them."""
    step_s = state.get("step_seconds", 0.0)
    reserve_s = step_s + state.get("eval_seconds", 0.0) + state.get("save_seconds", 0.0)
    if not budget:
        return step_s, reserve_s, 0.01, 0.01
    return step_s, reserve_s, 0.01 + reserve_s / budget, max(0.01, 2 * step_s / budget)


def check_e2e(ctx: Ctx) -> Item:
    """A budgeted run of experiment/run.sh (one process per visible GPU), SIGTERM to the launcher as a
    preemption would send it, then the same command again: it must resume and stop at the budget."""
    ws = ctx.workspace / "gpucheck-e2e"
    shutil.rmtree(ws, ignore_errors=True)
    env, budget = _e2e_env(ctx, ws), ctx.sizes.e2e_seconds
    run_dir, train_log = ws / "checkpoints/e2e", ws / "checkpoints/e2e/training.log"
    first = _launch(env, ctx.out / "e2e-run1.log")
    ctx.children.append(first)
    try:
        started = _wait_for_line(train_log, " | loss ", first, 900)
        # The budget counts the start (compile, the metric's dry call: about 40 s of d12 on an H200):
        # signal a quarter into what is left of it at the first step line, by the trainer's own clock,
        # so the resumed run, whose own start is charged too (about 15 s there), has steps left to do.
        used = 0.0
        for _ in range(20 if started else 0):  # the step line comes a moment before its metrics.jsonl record
            used = _used_seconds(run_dir)
            if used:
                break
            time.sleep(0.5)
        time.sleep(0.25 * max(0.0, budget - used) if started else 0)
        first.send_signal(signal.SIGTERM)  # to torchrun, which forwards it once to every worker
        first.wait(timeout=600)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    text = train_log.read_text() if train_log.exists() else ""
    preempted = "received SIGTERM: " in text  # "saving step N", or "completing step M's save, in flight"
    saved = ckpt.complete_steps(run_dir)
    second = _launch(env, ctx.out / "e2e-run2.log")
    ctx.children.append(second)
    try:
        second.wait(timeout=budget + 900)
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
    text = train_log.read_text() if train_log.exists() else ""
    resumed = bool(saved) and f"resumed from {ckpt.model_path(run_dir, saved[-1])}" in text
    done, final = _done_seconds(text), ckpt.complete_steps(run_dir)
    error = (done[0] - done[1]) / done[1] if done else None
    state = ckpt.read_meta(run_dir, final[-1])["state"] if final else {}
    step_s, reserve_s, under, over = _budget_bounds(state, done[1] if done else None)
    figures = {"preempted": preempted, "preempt_step": saved[-1] if saved else None, "resumed": resumed,
               "final_step": final[-1] if final else None, "used_s": done and done[0], "budget_s": done and done[1],
               "budget_error": error, "step_s": step_s, "reserve_s": reserve_s, "exit_codes": [first.returncode,
                                                                                                second.returncode]}
    ok = (preempted and resumed and second.returncode == 0 and error is not None and -under <= error <= over
          and final[-1] > saved[-1])
    summary = (f"preempted at step {figures['preempt_step']} ({'saved' if preempted else 'NO preemption save'}), "
               f"{'resumed' if resumed else 'did NOT resume'}, finished at step {figures['final_step']}, "
               + (f"{done[0]:.1f}s of the {done[1]:.0f}s budget used ({100 * error:+.2f}%)" if done else "no done line"))
    tail = "\n".join(text.splitlines()[-25:])
    return Item("e2e", _status(not ok, False), summary, figures, f"training.log (last lines):\n\n```\n{tail}\n```")
