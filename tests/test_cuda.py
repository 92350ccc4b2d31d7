"""The trainer's CUDA paths on a real GPU: bf16, compile, the KV cache, bf16 masters, kill -9, SIGTERM.

bf16 autocast, torch.compile, the KV cache, batched and ensemble decoding's batch invariance, bf16
weights with fp32 master shards across a resume, kill -9 during a save, SIGTERM, two ranks sharing one
GPU (DIST_BACKEND=gloo) through a SIGTERM and a resume. Marked `cuda` and skipped without CUDA. `python -m experiment.tools.bench gpucheck` runs them through
pytest; without CUDA it passes --cuda-tests-on-cpu and they run at the same tiny sizes on the CPU.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest
import torch

from conftest import ENV, REPO, TINY, kill_tree, train_cmd, wait_gone, write_corpus
from experiment import checkpoint as ckpt
from experiment.model import GPT, GPTConfig

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def device(request) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if request.config.getoption("--cuda-tests-on-cpu"):
        return torch.device("cpu")
    pytest.skip("needs CUDA (gpucheck runs these on the CPU with --cuda-tests-on-cpu)")


def _model(device, depth=2, seq=64, seed=0, aspect_ratio=64, head_dim=32) -> GPT:
    model = GPT(GPTConfig(vocab_size=64, depth=depth, aspect_ratio=aspect_ratio, head_dim=head_dim, max_seq_len=seq))
    model.init_weights(seed=seed)
    with torch.no_grad():  # residual outputs start at zero; give the blocks something to compute
        for block in model.blocks:
            block.attn.c_proj.weight.normal_(0, 0.02)
            block.mlp.c_proj.weight.normal_(0, 0.02)
        model.lm_head.weight.normal_(0, 0.05)
    return model.to(device)


def _batch(device, batch=4, seq=64):
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (batch, seq + 1), generator=gen)
    return x[:, :-1].to(device), x[:, 1:].to(device)


def test_bf16_autocast_loss_is_close_to_fp32(device):
    model = _model(device)
    x, y = _batch(device)
    with torch.no_grad():
        fp32 = model(x, y).item()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            bf16 = model(x, y).item()
    assert abs(bf16 - fp32) < 0.02 * fp32, (fp32, bf16)


def test_compiled_loss_and_gradients_match_eager(device):
    model = _model(device)
    compiled = torch.compile(model)
    x, y = _batch(device)
    losses, grads = [], []
    for m in (model, compiled):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = m(x, y)
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten().float() for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
    tol = 1e-2 if device.type == "cuda" else 1e-4  # bf16 kernels fuse and round differently
    assert abs(losses[0] - losses[1]) < tol * losses[0], losses
    rel = (grads[0] - grads[1]).norm() / grads[0].norm()
    assert rel < 5 * tol, rel.item()


def test_kv_cache_generation_equals_full_reforward(device):
    model = _model(device, seq=64).eval()
    prompt = [3, 1, 4, 1, 5]
    cached = list(model.generate(prompt, 40, temperature=0, use_cache=True))
    full = list(model.generate(prompt, 40, temperature=0, use_cache=False))
    assert cached == full
    # and the logits themselves, not only their argmax
    from experiment.model import KVCache

    ids = torch.tensor([prompt + cached[:20]], device=device)
    with torch.no_grad():
        ref = model(ids)[0, -1]
        cache = KVCache(model.config, 1, device, torch.float32)
        model(ids[:, :-1], cache=cache)
        step = model(ids[:, -1:], cache=cache)[0, -1]
    assert torch.allclose(ref, step, atol=1e-3, rtol=1e-3), (ref - step).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_decoding_gives_each_request_what_it_gets_alone_one_model_and_an_ensemble(device, dtype):
    """The server's guarantee with cuBLAS: a request's tokens do not depend on what is decoded beside
    it, for one model and for an ensemble of two (each member's decode invariant, the mean row by row).
    Requests join and leave at random steps; context 32, so caches are rebuilt mid-batch. On CUDA the
    width is d32's 2048 (two layers): at width 256 an H200's cuBLAS gave a plain F.linear's rows the
    same bits for 1 to 8 rows, so a decode without block_linear passed there."""
    from test_engine import requests_for, run_schedule

    shape = dict(depth=2, aspect_ratio=1024, head_dim=128) if device.type == "cuda" else dict(depth=2)
    models = [_model(device, seq=32, seed=s, **shape).to(dtype).eval() for s in (0, 1)]
    for m in models:
        with torch.no_grad():
            m.lm_head.weight.mul_(20)  # peaked enough that greedy and top-k rows are not ties
    requests = requests_for(4, n=10, longest=60)
    outs = {}
    for name, ms in (("one", models[:1]), ("ensemble", models)):
        outs[name] = run_schedule(ms, requests, 4, seed=4)
        assert outs[name] == [run_schedule(ms, [r], 1, seed=0)[0] for r in requests], name
    assert outs["one"] != outs["ensemble"]  # the second member changes what is decoded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_linear_gives_a_row_the_same_bits_in_any_batch_on_the_device(device, dtype):
    """engine.block_linear, the decode's matmul, bit for bit whatever the batch, at d32's width on CUDA.
    Prints how many rows a plain F.linear gets otherwise (cuBLAS picks kernels by the row count):
    the reason block_linear exists, measured."""
    from experiment.engine import block_linear

    width = 2048 if device.type == "cuda" else 64
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(width, width, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(width, width, generator=gen) / width**0.5)
    layer = layer.to(device, dtype)
    x = torch.randn(1024, 1, width, generator=gen).to(device, dtype)

    def by_batch(f, b):
        return torch.cat([f(x[i : i + b]) for i in range(0, len(x), b)])

    blocked = {b: by_batch(lambda r: block_linear(r, layer), b) for b in (1, 2, 7, 64)}
    plain = {b: by_batch(lambda r: torch.nn.functional.linear(r, layer.weight), b) for b in (1, 2, 7, 64)}
    differ = {b: int((plain[b] != plain[1]).any(-1).sum()) for b in (2, 7, 64)}
    print(f"block_linear: {device.type} {dtype}: rows a plain F.linear gets otherwise than alone, by batch: {differ}")
    for b in (2, 7, 64):
        assert torch.equal(blocked[b], blocked[1]), b


def _args(tmp_path, device, *extra):
    corpus = tmp_path / "corpus" if (tmp_path / "corpus").exists() else write_corpus(tmp_path)
    return [*TINY, "--data_dir", corpus, "--device", device.type, "--compile", "off", "--total_batch_size", 256, *extra]


def _run(args, nproc=1, timeout=300):
    cmd = train_cmd(args, nproc, torchrun=("--standalone",) if nproc > 1 else ())
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc


def _weights(ws, step, tag="d2"):
    return ckpt.load_model_state(ws / "checkpoints" / tag, step)


def _assert_equal_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k}: max diff {(a[k].float() - b[k].float()).abs().max().item()}"


def _nprocs():
    return [1, 2] if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else [1]


@pytest.mark.parametrize("nproc", _nprocs())
def test_bf16_master_shards_save_then_resume_is_bit_exact(tmp_path, device, nproc):
    args = _args(tmp_path, device, "--precision", "bf16", "--save_every_steps", 3, "--max_steps", 6)
    _run([*args, "--workspace", tmp_path / "a"], nproc)
    a_dir, b_dir = tmp_path / "a/checkpoints/d2", tmp_path / "b/checkpoints/d2"
    b_dir.mkdir(parents=True)
    for p in a_dir.glob("*_000003*"):  # step 3 alone, as if the run had stopped there
        shutil.copy(p, b_dir / p.name)
    _run([*args, "--workspace", tmp_path / "b"], nproc)
    a, b = _weights(tmp_path / "a", 6), _weights(tmp_path / "b", 6)
    assert a["lm_head.weight"].dtype == torch.bfloat16
    _assert_equal_weights(a, b)


def _wait(predicate, timeout, what):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def _save_in_progress(run_dir) -> bool:
    """A checkpoint's temp file, or files of a step newer than the newest complete one (no meta yet).
    An older step's files without a meta are a prune's (it removes the meta first), not a save's."""
    names = [p.name for p in run_dir.iterdir()] if run_dir.is_dir() else []
    newest = max(ckpt.complete_steps(run_dir), default=-1)
    steps = [int(m.group(1)) for n in names if n.endswith(".pt") and (m := re.search(r"_(\d{6})", n))]
    temps = [n for n in names if n.endswith(".tmp") and n.startswith((".model_", ".optim_", ".meta_"))]
    return bool(temps) or any(step > newest for step in steps)


@pytest.mark.parametrize("nproc", _nprocs())
def test_kill9_during_a_save_then_resume_equals_the_uninterrupted_run(tmp_path, device, nproc):
    # no stop at the val minimum: on a GPU its noisy evals can end the runs before step 30
    steps = ["--save_every_steps", 1, "--max_steps", 30, "--keep_last", 2, "--plateau_evals", 0]
    _run([*_args(tmp_path, device, *steps), "--workspace", tmp_path / "a"], nproc)
    ws = tmp_path / "b"
    run_dir = ws / "checkpoints/d2"
    # Its saves written at 2 MB/s (a fraction of a second each, a tiny model's saves otherwise last
    # milliseconds), so a loaded machine's poll still finds one in progress; the rate changes no weight.
    cmd = train_cmd([*_args(tmp_path, device, *steps), "--workspace", ws, "--save_write_mbps", 2], nproc,
                    torchrun=("--standalone",) if nproc > 1 else ())
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait(lambda: len(ckpt.complete_steps(run_dir)) >= 2 or proc.poll() is not None, 240, "two saves")
    deadline = time.time() + 60
    while not _save_in_progress(run_dir) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None and _save_in_progress(run_dir), "the run ended before a save could be caught"
    tree = kill_tree(proc.pid)  # torchrun's workers too (sessions of their own): killpg would miss them
    proc.wait()
    wait_gone(tree)
    # what the kill left: a save in progress (the poll's find and the kill are milliseconds apart; a
    # save lasts a fraction of a second), and no worker that stopped on its own, as a SIGTERM or a dead
    # agent would stop it
    assert _save_in_progress(run_dir), sorted(p.name for p in run_dir.iterdir())
    assert "received SIGTERM" not in (run_dir / "training.log").read_text()
    killed_at = ckpt.complete_steps(run_dir)
    _run([*_args(tmp_path, device, *steps), "--workspace", ws], nproc)
    assert ckpt.complete_steps(run_dir)[-1] == 30, killed_at
    _assert_equal_weights(_weights(tmp_path / "a", 30), _weights(ws, 30))


def test_sigterm_saves_within_one_step_and_exits_zero(tmp_path, device):
    ws = tmp_path / "ws"
    log = ws / "checkpoints/d2/training.log"
    # blocking saves: no earlier save's write can be in flight at the signal (that case stops on it,
    # test_resilience.py)
    cmd = train_cmd([*_args(tmp_path, device, "--async_save", 0), "--workspace", ws], 1, torchrun=())
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait(lambda: log.exists() and "step 000008 | loss" in log.read_text(), 240, "step 8")
    logged = max(int(line.split()[1]) for line in log.read_text().splitlines() if " | loss " in line)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    saved = ckpt.complete_steps(ws / "checkpoints/d2")[-1]
    # The step in flight when the signal came finishes and is the one saved; no step trains after it.
    # Which step that is depends on how fast this test sends the signal (a step here lasts milliseconds,
    # so a loaded machine's delay between reading the log and signalling spans several), hence the
    # trainer's own word for it, checked against the log on both sides.
    announced = re.search(r"received SIGTERM: saving step (\d+)", out)
    trained = max(int(line.split()[1]) for line in log.read_text().splitlines() if " | loss " in line)
    assert announced and int(announced.group(1)) == saved, (saved, out[-1000:])
    assert logged <= saved and trained <= saved, (logged, saved, trained)
    assert ckpt.read_meta(ws / "checkpoints/d2", saved)["val_loss"] is None  # no eval in the grace period
    print(f"sigterm: exited {time.time() - t0:.2f}s after the signal, saved step {saved} (last logged {logged})")


def _train_losses(ws, tag="d2") -> dict[int, float]:
    path = ws / "checkpoints" / tag / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return {r["step"]: r["loss"] for r in records if r.get("kind") == "train"}


@pytest.mark.parametrize("compiled", [False, True] if torch.cuda.is_available() else [False],
                         ids=lambda c: "compiled" if c else "eager")
def test_two_ranks_on_one_device_match_one_rank_and_resume_after_sigterm(tmp_path, device, compiled):
    """The 8-GPU path as far as one GPU allows: two ranks on one device (DIST_BACKEND=gloo; NCCL
    refuses two ranks on one GPU), DDP with 2 micro-batches accumulated per rank, activation
    checkpointing, background saves every 20 steps (10 on a CPU), a SIGTERM to one worker after two of them
    completed, and a resume. Against one rank (4 micro-batches of the same sequences): losses within
    bf16 tolerance. Against the same two ranks uninterrupted: eager, the same final weights bit for
    bit, the proof that the resume is exact; compiled (CUDA only), within the spread of two
    uninterrupted compiled runs, which on an H200 already differed at step 3 while eager ones were
    bit-identical, resumed or not (reports/gpucheck-h200.md): that variant proves compile + gloo +
    resume run and agree to bf16 noise, not that the resume is exact. On a CPU (gpucheck without
    CUDA), the eager variant only."""
    cuda = device.type == "cuda"
    # Half the steps on a CPU, where the test proves the code paths, not the agreement's spread.
    steps, every = (120, 20) if cuda else (60, 10)
    args = _args(tmp_path, device, "--total_batch_size", 512, "--max_steps", steps, "--save_every_steps", every,
                 "--keep_last", 2, "--plateau_evals", 0, "--async_save", 1, "--activation_checkpointing", "on",
                 "--compile", "on" if compiled else "off")
    two = [*args, "--dist_backend", "gloo"]
    _run([*args, "--workspace", tmp_path / "one"], 1)
    _run([*two, "--workspace", tmp_path / "two"], 2)
    ws = tmp_path / "cut"
    run_dir = ws / "checkpoints/d2"
    with open(tmp_path / "cut.log", "w") as out:  # a file, not a pipe nobody reads while the test polls
        agent = subprocess.Popen(train_cmd([*two, "--workspace", ws], 2), cwd=REPO, env=ENV, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait(lambda: max(ckpt.complete_steps(run_dir), default=0) >= 2 * every or agent.poll() is not None, 600,
              "the first two background saves")
        workers = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout.split()
        for pid in workers[:1]:  # a preemption signal reaching one worker: the trainer stops them all
            os.kill(int(pid), signal.SIGTERM)
        agent.wait(timeout=300)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
    assert agent.returncode == 0, (tmp_path / "cut.log").read_text()[-2000:]
    cut = ckpt.complete_steps(run_dir)[-1]
    log = (run_dir / "training.log").read_text()
    assert "received SIGTERM" in log and 2 * every <= cut < steps, (cut, log[-1000:])
    again = _run([*two, "--workspace", ws], 2)
    assert f"resumed from {ckpt.model_path(run_dir, cut)}" in again.stdout
    one, ref, resumed = (_train_losses(tmp_path / name) for name in ("one", "two", "cut"))
    # bf16 autocast (CUDA): the worlds sum gradients in another order. Measured on an H200, compiled:
    # world 2 against 1 at most 5.8e-4 over steps 1-40 and 7.1e-3 over all 120.
    tol = 1e-2 if cuda else 1e-4
    rel = {s: abs(one[s] - ref[s]) / one[s] for s in ref}
    after = {s: abs(resumed[s] - ref[s]) / ref[s] for s in resumed if s > cut}
    a, b = _weights(tmp_path / "two", steps), _weights(ws, steps)
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    early = max(rel[s] for s in rel if s <= 2 * every)
    print(f"ranks2 ({'compiled' if compiled else 'eager'}): world 2 vs 1 loss rel diff max {early:.2e} over steps "
          f"1-{2 * every}, {max(rel.values()):.2e} over all {len(rel)}; SIGTERM saved step {cut}; resumed vs uninterrupted: "
          f"loss rel diff max {max(after.values()):.2e}, final weights max abs diff {diff:.1e}")
    assert early < tol, rel
    if compiled:
        assert max(after.values()) < 2 * tol, after  # the spread of two uninterrupted compiled runs
    else:
        assert all(resumed[s] == ref[s] for s in after), "the resumed steps' losses differ"
        _assert_equal_weights(a, b)
