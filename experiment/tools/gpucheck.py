"""gpucheck: prove a GPU box in minutes, before paying for a day on it.

    python3 -m experiment.tools.bench gpucheck [--quick] [--workspace DIR] [--only ITEM,...]
    bash run.sh gpucheck [same flags]

Exercises every CUDA path of the trainer on one GPU and says PASS, WARN or FAIL per item, with the
numbers: environment, correctness (tests/test_cuda.py through pytest), speed and MFU, memory (planner
against measured peaks, the d64 world-8 fit), checkpoint save/load rates, and an end-to-end run of
experiment/run.sh with a preemption and a resume. The report (report.md, report.json) is rewritten
under $WORKSPACE/gpucheck/<timestamp>/ after every item, so a check cut short still leaves one.
Without CUDA every item runs at tiny sizes on the CPU, and the report says its figures are CPU
figures. The items themselves are in experiment/tools/gpucheck_items.py.
"""

from __future__ import annotations

import argparse
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch

from experiment.files import atomic_write_bytes, atomic_write_json, default_workspace
from experiment.tools import gpucheck_items
from experiment.tools.gpucheck_items import CPU_SIZES, GPU_FULL, GPU_QUICK, ITEMS, SIDE_BY_SIDE, Ctx, Item


class Report:
    """report.md and report.json, rewritten atomically after every item."""

    def __init__(self, out: Path, header: str):
        self.out, self.header, self.items, self.started = out, header, [], time.time()

    def add(self, item: Item) -> None:
        self.items.append(item)
        atomic_write_bytes(self.out / "report.md", self.markdown().encode())
        atomic_write_json(self.out / "report.json", {"header": self.header, "items": [asdict(i) for i in self.items]})

    def markdown(self) -> str:
        together = [i.name for i in self.items if i.side_by_side]
        lines = [self.header, "", f"{time.time() - self.started:.0f} s so far"
                 + (f"; {', '.join(together)} ran side by side (their seconds overlap)" if together else ""), "",
                 "| item | result | seconds | summary |", "|---|---|---|---|"]
        lines += [f"| {i.name} | **{i.status}** | {i.seconds:.0f} | {i.summary} |" for i in self.items]
        for i in self.items:
            lines += ["", f"## {i.name}: {i.status}", "", i.summary]
            if i.detail:
                lines += ["", i.detail]
        return "\n".join(lines) + "\n"


def run_item(ctx: Ctx, name: str) -> Item:
    t0 = time.time()
    print(f"gpucheck | {name} ...", flush=True)
    try:
        item = getattr(gpucheck_items, f"check_{name}")(ctx)
    except Exception as e:  # one broken item must not hide the others' results
        item = Item(name, "FAIL", f"crashed: {type(e).__name__}: {str(e)[:300]}",
                    detail=f"```\n{traceback.format_exc()[-4000:]}\n```")
    item.seconds = time.time() - t0
    print(f"gpucheck | {name}: {item.status} ({item.seconds:.0f}s) | {item.summary}", flush=True)
    return item


def run_items(ctx: Ctx, names: list[str], report: Report) -> None:
    """env first; then, on a GPU, the items SIDE_BY_SIDE together (each runs its own subprocesses);
    then the rest in turn. On a CPU every item runs in turn: 2 cores would make the end-to-end run's
    budget check a test of the machine's load."""
    together = [n for n in names if n in SIDE_BY_SIDE] if ctx.cuda else []
    first = [n for n in names if n == "env"]
    rest = [n for n in names if n not in first and n not in together]
    pool = ThreadPoolExecutor(max_workers=max(len(together), 1))
    try:
        for name in first:
            report.add(run_item(ctx, name))
        for item in pool.map(lambda n: run_item(ctx, n), together):
            item.side_by_side = True
            report.add(item)
        for name in rest:
            report.add(run_item(ctx, name))
    except BaseException:  # Ctrl-C reaches this thread only: end what the items launched in their own sessions
        ctx.stop_children()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="fewer sizes and a 90-second end-to-end run")
    p.add_argument("--workspace", default=None, help="report and scratch root (default: as WORKSPACE in run.sh)")
    p.add_argument("--only", default=",".join(ITEMS), help=f"comma-separated items of: {', '.join(ITEMS)}")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")


def main(args) -> int:
    from experiment.distributed import resolve_device

    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in ITEMS]
    if unknown:
        print(f"error: --only: unknown item(s) {', '.join(unknown)}; choose from {', '.join(ITEMS)}")
        return 2
    device = resolve_device(args.device)
    sizes = (GPU_QUICK if args.quick else GPU_FULL) if device.type == "cuda" else CPU_SIZES
    workspace = Path(args.workspace) if args.workspace else default_workspace()
    out = workspace / "gpucheck" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else "CPU (no CUDA): every figure below is a CPU figure at tiny sizes, not a GPU measurement")
    header = (f"# gpucheck {time.strftime('%Y-%m-%d %H:%M:%S')} on {where}\n\n"
              f"{'quick' if args.quick else 'full'} run; sizes {asdict(sizes)}")
    report = Report(out, header)
    print(header, flush=True)
    run_items(Ctx(device, sizes, workspace, out), names, report)
    print(report.markdown(), flush=True)
    print(f"gpucheck | report: {out / 'report.md'} and report.json", flush=True)
    failed = [i.name for i in report.items if i.status == "FAIL"]
    print(f"gpucheck | {'FAIL: ' + ', '.join(failed) if failed else 'PASS'}", flush=True)
    return 1 if failed else 0
