"""The data-limited regime on one GPU, in one command (reports/gpu-h200-2026-11-27.md says what it found).

    python3 experiment/tools/gpu_regime_check.py --data DIR --out OUT [--seconds 180] [--deadline 500] [--smoke]

1. Two runs of the trainer on the same data and budget, DEPTH=auto: the defaults (the regime decides
   the attention dropout, the average and the pass cap) and everything off (ATTN_DROPOUT=0
   AVERAGE=none: the cap at the data's passes, as before the regime). Each run's log is timestamped
   line by line and its process's resident memory sampled every 0.1 s, so the host memory of its
   first background save is read beside the trainer's staged figure.
2. Probes in one process: a compiled training step at d12 (and d32 when time is left) with and
   without weight decay, the weight average and dropout, with torch.compile's graph count; the
   average's GPU memory at d32 beside the memory plan's row.
3. tests/test_cuda.py's two-rank eager test, when time is left.

Everything printed also goes to OUT/summary.txt, the logs to OUT/logs.tar.gz. --smoke shrinks every
size so the script runs on a CPU in a few minutes (the way it was tried before the GPU).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
T0 = time.time()


def say(out: Path, text: str) -> None:
    print(text, flush=True)
    with (out / "summary.txt").open("a") as f:
        f.write(text + "\n")


def rss_of(pid: int) -> tuple[int, int]:
    """(VmRSS, VmLck) in bytes of a process, (0, 0) once it is gone."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    except OSError:
        return 0, 0
    kb = lambda k: int(fields.get(k, "0 kB").split()[0]) * 1024  # noqa: E731
    return kb("VmRSS"), kb("VmLck")


def train(out: Path, tag: str, data: Path, seconds: float, flags: list[str], smoke: bool) -> dict:
    """One run of experiment.train; its timestamped log and memory timeline under OUT/runs/tag."""
    ws = Path(f"/tmp/regime-{tag}")
    shutil.rmtree(ws, ignore_errors=True)
    run = out / "runs" / tag
    run.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "experiment.train", "--data_dir", str(data), "--workspace", str(ws),
           "--training_hours", str(seconds / 3600), "--resume", "never", "--model_tag", tag, "--sample_tokens", "0",
           *(["--compile", "off", "--eval_tokens", "20000"] if smoke else []), *flags]
    say(out, f"\n== run {tag}: {' '.join(cmd[1:])}")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    timeline, done = [], threading.Event()

    def sample() -> None:
        while not done.is_set():
            timeline.append((time.time() - T0, *rss_of(proc.pid)))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    lines = []
    with (run / "log.txt").open("w") as log:
        for line in proc.stdout:
            stamp = time.time() - T0
            lines.append((stamp, line.rstrip("\n")))
            log.write(f"{stamp:8.2f} {line}")
            if not line.startswith(("step ", "sample |")) or "val_loss" in line:
                print(f"{stamp:7.1f} {line.rstrip()[:400]}", flush=True)
    rc = proc.wait()
    done.set()
    sampler.join()
    (run / "rss.jsonl").write_text("".join(json.dumps(r) + "\n" for r in timeline))
    for name in ("report.md", "metrics.jsonl"):
        src = ws / "checkpoints" / tag / name
        if src.exists():
            (run / name).write_bytes(src.read_bytes())
    return {"rc": rc, "lines": lines, "timeline": timeline}


def first_save_memory(res: dict) -> str:
    """Resident memory before the first save began (its eval's line) and once it completed (its
    'saved step' line), against the trainer's own staged figure ('checkpoint |' line)."""
    lines, timeline = res["lines"], res["timeline"]
    saved = next((t for t, s in lines if s.startswith("saved step")), None)
    staged = next((s for _, s in lines if s.startswith("checkpoint |")), "checkpoint | (no line)")
    if saved is None:
        return f"host memory | no save completed; {staged}"
    evals = [t for t, s in lines if "val_loss" in s and t < saved]
    began = evals[-1] if evals else saved
    before = [r for r in timeline if r[0] <= began]
    after = [r for r in timeline if began <= r[0] <= saved + 1.0]
    if not before or not after:
        return "host memory | too few samples"
    rss0, peak = before[-1][1], max(r[1] for r in after)
    lck = max(r[2] for r in after)
    return (f"host memory | RSS {rss0 / 1e9:.2f} GB before the first save (eval at {began:.1f}s), peak {peak / 1e9:.2f} GB "
            f"until it completed (+{(peak - rss0) / 1e9:.3f} GB; VmLck {lck / 1e9:.3f} GB) | trainer's figure: {staged}")


def runs_section(out: Path, args) -> None:
    base = ["--depth", "2", "--max_seq_len", "128"] if args.smoke else []
    results = {}
    for tag, flags in (("regime", []), ("off", ["--attn_dropout", "0", "--average", "none"])):
        res = train(out, tag, Path(args.data), args.seconds, base + flags, args.smoke)
        results[tag] = res
        keep = [s for _, s in res["lines"] if s.startswith(("auto", "regime", "average", "memory", "checkpoint |",
                                                            "model ", "planner", "plateau", "warmdown", "stop", "done:",
                                                            "world", "export"))]
        say(out, f"-- {tag}: exit {res['rc']}\n" + "\n".join(keep))
        say(out, first_save_memory(res))
        report = out / "runs" / tag / "report.md"
        if report.exists():
            rows = report.read_text().splitlines()
            end = next((i for i, line in enumerate(rows) if line.startswith("| step |")), len(rows))
            say(out, "\n".join(line for line in rows[:end] if line.startswith("|")))


def probe_section(out: Path, args) -> None:
    """Runs in a child process with its own timeout, so a hung compile cannot take the command."""
    left = args.deadline - (time.time() - T0)
    if left < 45:
        say(out, f"\n== probes skipped: {left:.0f}s left")
        return
    cmd = [sys.executable, str(Path(__file__).resolve()), "--probe", "--out", str(out),
           "--deadline", str(args.deadline), "--t0", str(T0)] + (["--smoke"] if args.smoke else [])
    say(out, f"\n== probes ({left:.0f}s)")
    try:
        subprocess.run(cmd, cwd=REPO, timeout=left + 30)
    except subprocess.TimeoutExpired:
        say(out, "probes | cut at the deadline")


def timed(sync, fn, n: int) -> float:
    sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t) / n


def probes(out: Path, args) -> None:
    import torch
    import torch._dynamo.utils as dyn

    from experiment.average import WeightAverage
    from experiment.memory import plan_memory
    from experiment.model import GPTConfig, build_model
    from experiment.optim import LRS, ShardedOptimizer
    from experiment.step import forward_backward, optimizer_step

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    left = lambda: args.deadline - (time.time() - args.t0)  # noqa: E731
    sizes = [(2, 4, 64)] if args.smoke else [(12, 16, 2048), (32, 4, 2048)]
    for depth, batch, seq in sizes:
        if left() < (40 if depth < 20 else 150):
            say(out, f"probe d{depth} | skipped: {left():.0f}s left")
            continue
        shape = dict(aspect_ratio=32, head_dim=32) if args.smoke else {}
        config = GPTConfig(vocab_size=128, depth=depth, max_seq_len=seq, **shape)
        model = build_model(config, dev, torch.float32, draw_on_device=True)
        opt = ShardedOptimizer(model, **LRS)
        run = torch.compile(model) if cuda else model
        x = torch.randint(0, 128, (batch, seq), device=dev)
        steps = {"n": 0}

        def step() -> None:
            forward_backward(run, x, x)
            optimizer_step(model, opt)
            steps["n"] += 1
            if opt.average is not None:
                opt.average.update(steps["n"])

        def graphs() -> int:
            return int(dyn.counters["stats"]["unique_graphs"])

        tokens, n = batch * seq, 3 if args.smoke else 10
        rows = {}
        for name, setup in (("base", lambda: None),
                            ("weight decay 0.1 + adam 0.01", lambda: setattr_wd(opt, 0.1, 0.01)),
                            ("+ ema average", lambda: setattr(opt, "average", WeightAverage(opt, 0.1))),
                            ("+ attn dropout 0.2", lambda: model.set_dropout(0.0, 0.2)),
                            ("+ residual dropout 0.1", lambda: model.set_dropout(0.1, 0.2))):
            if left() < 30:
                say(out, f"probe d{depth} | {name}: skipped, {left():.0f}s left")
                break
            before_mem = torch.cuda.memory_allocated() if cuda else 0
            setup()
            added = (torch.cuda.memory_allocated() - before_mem) if cuda else 0
            g0, c0 = graphs(), time.time()
            step(), step()  # a compile (if any) and the allocator's warm-up
            first = time.time() - c0
            s = timed(sync, step, n)
            g1 = graphs()
            rate = tokens / s
            rows[name] = rate
            say(out, f"probe d{depth} | {name}: {rate:,.0f} tok/s ({1000 * s:.1f} ms per step of {tokens:,} tokens; "
                     f"{rate / rows['base']:.3f}x base) | first two steps {first:.1f}s | graphs {g0} -> {g1}"
                     + (f" | memory added {added / 1e9:.3f} GB" if added else ""))
            g2 = graphs()
            timed(sync, step, n)
            if graphs() != g2:
                say(out, f"probe d{depth} | {name}: RECOMPILED during steady steps ({g2} -> {graphs()})")
        if opt.average is not None:
            plan = plan_memory(config, 1, batch, seq, "fp32", False, average=True)
            s = timed(sync, lambda: opt.average.update(steps["n"] + 1), n)
            say(out, f"probe d{depth} | the average's update alone: {1000 * s:.2f} ms | plan's row: "
                     f"{plan.rows.get('weight average', 0) / 1e9:.3f} GB for {model.num_params():,} params")
        del model, opt, run
        torch._dynamo.reset()
        if cuda:
            torch.cuda.empty_cache()


def setattr_wd(opt, muon: float, adam: float) -> None:
    import torch

    """The optimizer's weight decays after construction: its torch optimizers' param groups, where
    ShardedOptimizer's constructor puts them (Muon for the matrices, AdamW for the rest)."""
    for o in opt.optimizers:
        for group in o.param_groups:
            group["weight_decay"] = muon if isinstance(o, torch.optim.Muon) else adam


def pytest_section(out: Path, args) -> None:
    left = args.deadline + 40 - (time.time() - T0)  # the last item: it may run 40 s past the deadline
    if left < 45:
        say(out, f"\n== test_cuda two-rank eager skipped: {left:.0f}s left")
        return
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "tests/test_cuda.py", "-k", "two_ranks and eager", "-p",
           "no:cacheprovider"] + (["--cuda-tests-on-cpu"] if args.smoke else [])
    say(out, f"\n== {' '.join(cmd[1:])} ({left:.0f}s)")
    try:
        proc = subprocess.run(cmd, cwd=REPO, timeout=left - 5, capture_output=True, text=True)
        say(out, proc.stdout[-1500:] + proc.stderr[-500:])
    except subprocess.TimeoutExpired:
        say(out, "test_cuda | cut at the deadline")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="")
    p.add_argument("--out", required=True)
    p.add_argument("--seconds", type=float, default=180)
    p.add_argument("--deadline", type=float, default=500, help="seconds from start after which nothing new begins")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--t0", type=float, default=T0, help=argparse.SUPPRESS)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.probe:
        probes(out, args)
        return 0
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    import torch
    say(out, f"commit {commit or '(no git)'} | torch {torch.__version__} | "
             f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'} | data {args.data}")
    try:
        runs_section(out, args)
        probe_section(out, args)
        pytest_section(out, args)
    finally:
        with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
            tar.add(out / "runs", arcname="runs")
        say(out, f"\nall in {time.time() - T0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
