"""The determinism runs of reports/gpucheck-h200.md, kept as they ran (not imported by anything).

    python3 experiment/tools/determinism_check.py DIR on|off NPROC   (DIAG_CPU=1: on the CPU)

Two uninterrupted runs (a, b) and one cut by SIGTERM after the save of step 40 and resumed (c), on
tests/conftest.py's tiny config; prints one JSON line of how they differ."""
import json, os, signal, subprocess, sys, time
from pathlib import Path
sys.path[:0] = [str(Path(__file__).resolve().parents[2] / "tests"), str(Path(__file__).resolve().parents[2])]
from conftest import ENV, REPO, TINY, train_cmd, write_corpus
from experiment import checkpoint as ckpt

root = Path(sys.argv[1]); root.mkdir(parents=True, exist_ok=True)
compile_flag = sys.argv[2]  # on / off
nproc = int(sys.argv[3])
dev = "cuda" if os.environ.get("DIAG_CPU") is None else "cpu"
steps = 120
corpus = write_corpus(root)
args = [*TINY, "--data_dir", corpus, "--device", dev, "--total_batch_size", 512, "--max_steps", steps,
        "--save_every_steps", 20, "--keep_last", 2, "--plateau_evals", 0, "--async_save", 1,
        "--activation_checkpointing", "on", "--compile", compile_flag]
if nproc > 1:
    args += ["--dist_backend", "gloo"]
tr = ("--standalone",) if nproc > 1 else ()

def run(ws):
    subprocess.run(train_cmd([*args, "--workspace", ws], nproc, torchrun=tr), cwd=REPO, env=ENV, check=True,
                   capture_output=True)

def losses(ws):
    p = ws / "checkpoints/d2/metrics.jsonl"
    return {r["step"]: r["loss"] for r in map(json.loads, p.read_text().splitlines()) if r.get("kind") == "train"}

def wdiff(a, b):
    x, y = ckpt.load_model_state(a / "checkpoints/d2", steps), ckpt.load_model_state(b / "checkpoints/d2", steps)
    return max((x[k].float() - y[k].float()).abs().max().item() for k in x)

def first_diff(a, b):
    d = [s for s in sorted(a) if s in b and a[s] != b[s]]
    return (d[0], a[d[0]], b[d[0]]) if d else None

run(root / "a"); run(root / "b")
ws = root / "c"; rd = ws / "checkpoints/d2"
p = subprocess.Popen(train_cmd([*args, "--workspace", ws], nproc, torchrun=tr), cwd=REPO, env=ENV,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
while max(ckpt.complete_steps(rd), default=0) < 40 and p.poll() is None:
    time.sleep(0.002)
kids = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split() if nproc > 1 else [str(p.pid)]
os.kill(int(kids[0]), signal.SIGTERM)
p.wait()
cut = ckpt.complete_steps(rd)[-1]
run(ws)
A, B, C = losses(root / "a"), losses(root / "b"), losses(ws)
print(json.dumps({"compile": compile_flag, "nproc": nproc, "cut": cut,
                  "a_vs_b_first_diff": first_diff(A, B), "a_vs_b_weights": wdiff(root / "a", root / "b"),
                  "a_vs_resumed_first_diff": first_diff(A, C), "a_vs_resumed_weights": wdiff(root / "a", ws),
                  "a_vs_b_loss_max": max(abs(A[s] - B[s]) for s in A),
                  "a_vs_resumed_loss_max_after_cut": max(abs(A[s] - C[s]) for s in C if s > cut)}), flush=True)
