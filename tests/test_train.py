"""The trainer end to end: budget, evals, best tracking, resume, config errors, parts per rank."""

import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, TINY, run_meta, run_train, tiny_config
from experiment import checkpoint as ckpt
from experiment.config import ConfigError, TrainConfig, fill_lrs, parse_args, resolve
from experiment.model import GPT
from experiment.optim import lr_multiplier, partition
from experiment.hardware import peak_flops


def _params(run_dir, step):
    """The step's weights, whichever layout (one file, or one part per rank) holds them."""
    return ckpt.load_model_state(run_dir, step)


def test_lr_multiplier_follows_the_budget_fraction():
    f = lambda p: lr_multiplier(p, warmup_frac=0.1, warmdown_frac=0.2, final_lr_frac=0.1)
    assert f(0.0) == 0.0 and f(0.05) == pytest.approx(0.5)
    assert f(0.1) == f(0.5) == f(0.8) == 1.0
    assert f(0.9) == pytest.approx(0.55) and f(1.0) == pytest.approx(0.1) and f(1.7) == pytest.approx(0.1)
    values = [f(i / 100) for i in range(80, 101)]
    assert all(a > b for a, b in zip(values, values[1:]))  # warmdown is strictly decreasing to the end


def test_cpu_learning_rates_follow_the_depth_and_a_given_one_is_kept():
    def lrs(argv, cuda=False):
        cfg = resolve(parse_args(argv), cuda=cuda, world_size=1)
        assert cfg.matrix_lr is None or "--matrix_lr" in argv  # the depth may still be auto here
        fill_lrs(cfg, cuda)
        return pytest.approx((cfg.matrix_lr, cfg.embedding_lr, cfg.unembedding_lr))

    assert lrs(["--depth", "2"]) == (0.02, 0.1, 0.002) and lrs(["--depth", "4"]) == (0.02, 0.1, 0.002)
    assert lrs(["--depth", "6"]) == (0.01, 0.05, 0.001) and lrs(["--depth", "12"]) == (0.01, 0.05, 0.001)
    assert lrs(["--depth", "6", "--embedding_lr", "0.3"]) == (0.01, 0.3, 0.001)
    assert lrs(["--depth", "6"], cuda=True) == (0.02, 0.2, 0.004)


def test_settings_that_cannot_work_are_named():
    with pytest.raises(ConfigError, match="--total_batch_size 1000 is not a multiple of max_seq_len 256"):
        resolve(TrainConfig(total_batch_size=1000), cuda=False, world_size=1)
    with pytest.raises(ConfigError, match="not divisible by device_batch_size 3"):
        resolve(TrainConfig(device_batch_size=3), cuda=False, world_size=2)
    cfg = resolve(TrainConfig(budget_usd=8.0), cuda=True, world_size=8)
    assert cfg.training_hours == pytest.approx(0.25) and cfg.depth == "auto" and cfg.model_tag == "auto"
    # the plan's launch line holds BUDGET_USD: a TRAINING_HOURS added to it would be ignored, so it is refused
    with pytest.raises(ConfigError, match="--budget_usd 96 and --training_hours 40 are both set: give one"):
        resolve(TrainConfig(budget_usd=96.0, training_hours=40.0), cuda=True, world_size=1)
    # KEEP_LAST=0 would have the prune delete the step it just completed, a preemption's save included
    with pytest.raises(ConfigError, match="--keep_last must be >= 1"):
        resolve(TrainConfig(keep_last=0), cuda=False, world_size=1)
    # every N steps counts from 1 (0: off); a negative N is a typo, not "off"
    for name in ("eval_every_steps", "save_every_steps", "eval_every_epochs", "plateau_evals"):
        with pytest.raises(ConfigError, match=f"--{name} must be >= 0, got -5"):
            resolve(TrainConfig(**{name: -5}), cuda=False, world_size=1)


def test_peak_flops_by_name_and_none_for_unknown():
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA GeForce RTX 4090") is None


@pytest.mark.slow
def test_two_ranks_equal_one_rank_and_shards_name_owned_params(tmp_path, corpus):
    # Same global batch: 1 rank x 2 accumulation micro-steps == 2 ranks x 1 micro-step.
    common = [*TINY, "--data_dir", corpus, "--max_steps", 3, "--total_batch_size", 256]
    run_train([*common, "--workspace", tmp_path / "one"], nproc=1)
    run_train([*common, "--workspace", tmp_path / "two"], nproc=2)
    one = _params(tmp_path / "one/checkpoints/d2", 3)
    two = _params(tmp_path / "two/checkpoints/d2", 3)
    initial = GPT(tiny_config(bigram=True))  # the char tokenizer brings the bigram table
    initial.init_weights(seed=1337)
    for name, p in one.items():
        torch.testing.assert_close(two[name], p, atol=2e-5, rtol=1e-4, msg=name)
        assert not torch.equal(p, initial.state_dict()[name]), f"{name} never trained"
    run_dir = tmp_path / "two/checkpoints/d2"
    shards = [ckpt.load_tensors(ckpt.optim_path(run_dir, 3, r)) for r in range(2)]
    expected = partition({n: p.numel() for n, p in one.items()}, 2)
    for r, shard in enumerate(shards):
        owned = {n for n, o in expected.items() if o == r}
        assert set(shard["owned"]) == owned and set(shard["state"]) == owned
        # Each rank wrote the weights it owns (plain names), and no rank the whole model.
        assert set(ckpt.load_tensors(ckpt.model_part_path(run_dir, 3, r))) == owned
    assert not ckpt.model_path(run_dir, 3).exists()
    assert ckpt.model_path(tmp_path / "one/checkpoints/d2", 3).exists()
    assert not list((tmp_path / "one/checkpoints/d2").glob("model_*_rank*.pt"))
    meta = run_meta(tmp_path / "two", 3)
    assert meta["world_size"] == meta["model_parts"] == 2 and len(meta["data_positions"]) == 2
    assert run_meta(tmp_path / "one", 3)["model_parts"] == 1
    assert meta["val_loss"] == pytest.approx(run_meta(tmp_path / "one", 3)["val_loss"], abs=1e-4)
    # The server's path: the run directory resolves to model_<step>.pt, naming the step in parts.
    served = ckpt.resolve_serving_checkpoint(run_dir, tmp_path)
    assert served == ckpt.model_path(run_dir, 3)
    model, _ = ckpt.load_model(served)
    assert all(torch.equal(t, two[n]) for n, t in model.state_dict().items())


@pytest.mark.slow
def test_resume_after_a_crash_equals_the_uninterrupted_run(tmp_path, corpus):
    common = [*TINY, "--data_dir", corpus, "--max_steps", 6, "--save_every_steps", 3, "--total_batch_size", 256]
    run_train([*common, "--workspace", tmp_path / "a"])
    a_dir, b_dir = tmp_path / "a/checkpoints/d2", tmp_path / "b/checkpoints/d2"
    shutil.copytree(a_dir, b_dir)
    ckpt.meta_path(b_dir, 6).unlink()  # as if killed while saving step 6: its files exist, its meta not
    ckpt.model_path(b_dir, 6).write_bytes(b"half-written")
    proc = run_train([*common, "--workspace", tmp_path / "b"])
    assert "resumed from" in proc.stdout and "step 3," in proc.stdout
    a, b = _params(a_dir, 6), _params(b_dir, 6)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    sa, sb = (ckpt.load_tensors(ckpt.optim_path(d, 6, 0))["state"] for d in (a_dir, b_dir))
    assert all(torch.equal(sa[n][k], sb[n][k]) for n in sa for k in sa[n])
    assert run_meta(tmp_path / "a", 6)["data_positions"] == run_meta(tmp_path / "b", 6)["data_positions"]


@pytest.mark.slow(seconds=45)
def test_budget_stop_two_ranks_then_second_launch_resumes(tmp_path, corpus):
    budget = 10.0  # the launch's setup counts in it: a loaded CPU's two gloo ranks take seconds to start
    args = [*TINY, "--data_dir", corpus, "--workspace", tmp_path, "--total_batch_size", 256,
            "--training_hours", budget / 3600, "--eval_every_minutes", 0.02, "--save_every_minutes", 0.02]
    proc = run_train(args, nproc=2, timeout=180)
    run_dir = tmp_path / "checkpoints/d2"
    final = ckpt.complete_steps(run_dir)[-1]
    meta = run_meta(tmp_path, final)
    step_ms = [int(m) for m in re.findall(r"dt (\d+)ms", proc.stdout)]
    assert meta["state"]["used_seconds"] <= budget  # the hard limit holds, final eval and save included
    assert budget - meta["state"]["used_seconds"] < 1.0 + 3 * max(step_ms) / 1000  # and little of it is wasted
    best = json.loads((run_dir / "best.json").read_text())
    assert best["step"] in ckpt.complete_steps(run_dir) and best["val_loss"] == meta["state"]["best_val"]
    assert list((tmp_path / "tensorboard/d2").glob("events.out.tfevents.*"))
    log = (run_dir / "training.log").read_text()
    assert "done:" in log and re.search(r"step \d{6} \| val_loss \d\.\d{4} \| val_bpc", log)
    # two ranks saved the best step in parts: the last lines name those and the run directory to serve
    assert f"best checkpoint {run_dir}/model_{best['step']:06d}_rank{{0..1}}.pt" in log
    assert f"--checkpoint {run_dir}, which serves its best" in log
    assert ckpt.optim_path(run_dir, final, 1).exists()

    again = run_train(args, nproc=2, timeout=180)  # budget spent: resumes, trains nothing more
    assert f"resumed from {ckpt.model_path(run_dir, final)}" in again.stdout
    assert ckpt.complete_steps(run_dir)[-1] == final and "restart | " not in again.stdout  # nothing trained, nothing charged
    # More budget: back to where the warmdown began, on to a new one (4 s of 14, and the restart's setup
    # now counts in the budget too: the relaunch above trained nothing and was charged nothing).
    more = run_train([*args[:-6], "--training_hours", (budget + 10) / 3600, *args[-4:]], nproc=2, timeout=180)
    assert "extend | the settings extend the run: going back from step" in more.stdout
    assert "resumed from" in more.stdout and ckpt.complete_steps(run_dir)[-1] > final
    assert run_meta(tmp_path, ckpt.complete_steps(run_dir)[-1])["state"]["used_seconds"] <= budget + 10


@pytest.mark.slow
def test_a_resume_whose_lost_seconds_leave_no_room_trains_nothing_and_reports_them_spent(tmp_path, corpus):
    """A kill -9 lost 5 s past the newest checkpoint of a run with 1 s left: the relaunch
    trains no step (the charge would carry it past the budget) and is charged nothing in its
    checkpoint, but the seconds it reports used (a generation's record, which sizes the next
    generation's share) count the lost ones: they were spent."""
    from experiment import train
    from experiment.distributed import Dist
    from experiment.runlog import RunLog

    budget = 6.0
    args = [*TINY, "--data_dir", corpus, "--workspace", tmp_path, "--total_batch_size", 256, "--max_epochs", 0,
            "--plateau_evals", 0, "--training_hours", budget / 3600]
    run_train(args)
    run_dir = tmp_path / "checkpoints/d2"
    final = ckpt.complete_steps(run_dir)[-1]
    # as if the run had ended with 1 s of its budget left (room for a step, not for the 5 s lost)
    meta = json.loads(ckpt.meta_path(run_dir, final).read_text())
    meta["state"]["used_seconds"] = used = meta["state"]["used_seconds"] - 1.0
    ckpt.meta_path(run_dir, final).write_text(json.dumps(meta))
    (run_dir / "heartbeat.json").write_text(json.dumps({"step": final, "used_seconds": used + 5.0, "time": 0,
                                                        "world_size": 1}))
    cfg = resolve(parse_args(list(map(str, args)) + ["--device", "cpu"]), cuda=False, world_size=1)
    t = train.setup(cfg, Dist(0, 0, 1, torch.device("cpu")), tmp_path, run_dir, RunLog(None))
    assert t.resume_step == final and t.lost_seconds == pytest.approx(5.0, abs=0.01)
    assert train.train_loop(t) == 0
    assert ckpt.complete_steps(run_dir)[-1] == final  # no step trained
    assert run_meta(tmp_path, final)["state"]["restart_seconds"] == 0.0  # nothing charged in the checkpoint
    assert used + 5.0 <= t.used_final < used + 5.0 + 3.0  # the lost seconds reported spent, once


@pytest.mark.slow
def test_a_run_that_stopped_gaining_in_its_warmdown_stops_and_a_second_launch_trains_no_more(tmp_path, corpus):
    """With the LRs at 0 nothing gains after step 1; the whole run is warmdown (WARMDOWN_FRAC=1), so
    the mean of the last 2 val losses is set at step 2 and 2 evals without a new low of it end the run
    at step 4, and the same command again resumes and ends at once."""
    args = [*TINY, "--data_dir", corpus, "--workspace", tmp_path, "--total_batch_size", 128,
            "--matrix_lr", 0, "--embedding_lr", 0, "--unembedding_lr", 0, "--max_steps", 50,
            "--eval_every_steps", 1, "--plateau_evals", 2, "--warmdown_frac", 1]
    proc = run_train(args)
    assert "plateau | the mean of the last 2 val losses has not gone below its lowest in this warmdown for 2 evals" \
        in proc.stdout
    assert ckpt.complete_steps(tmp_path / "checkpoints/d2")[-1] == 4  # the mean set at 2, no gain at 3 and 4
    again = run_train(args)
    assert "resumed from" in again.stdout and "the val loss stopped improving" in again.stdout
    assert ckpt.complete_steps(tmp_path / "checkpoints/d2")[-1] == 4


@pytest.mark.slow
def test_bad_data_and_bad_settings_exit_nonzero_and_write_nothing(tmp_path, corpus):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_train([*TINY, "--data_dir", empty, "--workspace", tmp_path / "ws"], check=False)
    assert proc.returncode == 2 and f"{empty}: no data files" in proc.stderr
    assert not list((tmp_path / "ws").rglob("*.pt"))
    proc = run_train([*TINY, "--data_dir", corpus, "--workspace", tmp_path / "ws", "--total_batch_size", 100],
                     check=False)
    assert proc.returncode == 2 and "--total_batch_size 100 is not a multiple" in proc.stderr
    run_train([*TINY, "--data_dir", corpus, "--workspace", tmp_path / "ws", "--max_steps", 1])
    proc = run_train([*TINY, "--data_dir", corpus, "--workspace", tmp_path / "ws", "--resume", "never"], check=False)
    assert proc.returncode == 2 and "--resume never, but" in proc.stderr
    assert ckpt.complete_steps(tmp_path / "ws/checkpoints/d2") == [1]


def test_the_docs_document_every_setting():
    import dataclasses

    from conftest import REPO

    settings = (REPO / "docs" / "settings.md").read_text()
    for f in dataclasses.fields(TrainConfig):
        assert f"`{f.name.upper()}`" in settings, f"docs/settings.md lacks {f.name.upper()}"
    assert "docs/settings.md" in (REPO / "README.md").read_text()  # and the README points there


@pytest.mark.slow
def test_launcher_maps_env_overrides_to_flags(tmp_path, corpus):
    import os
    import subprocess
    import sys

    from conftest import REPO

    env = {**os.environ, "DEPTH": "2", "ASPECT_RATIO": "32", "HEAD_DIM": "32", "MAX_SEQ_LEN": "32",
           "DEVICE_BATCH_SIZE": "auto", "TOTAL_BATCH_SIZE": "256", "MAX_STEPS": "1", "SAMPLE_TOKENS": "0",
           "MODEL_TAG": "envtag", "DATA_DIR": "corpus", "WORKSPACE": "ws", "OMP_NUM_THREADS": "1",
           "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}", "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(REPO / "experiment/run.sh")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    config = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("config "))[7:])
    assert (config["depth"], config["max_seq_len"], config["model_tag"]) == (2, 32, "envtag")
    assert config["device_batch_size"] == 8  # "auto" -> the CPU default
    assert config["data_dir"] == str(tmp_path / "corpus")  # relative to where the user launched
    assert ckpt.complete_steps(tmp_path / "ws/checkpoints/envtag") == [1]
    # The pre-flight prepared the data; the trainer opened that directory.
    assert "preflight | data " in proc.stdout and config["prepared_dir"].startswith(str(tmp_path / "ws/prepared/"))
    # experiment/launchfacts.py's three lines: no GPU here, and the pinned torch's torchrun takes the
    # pre-flight's shutdown timeout
    assert "launcher | gpus visible 0 | nproc_per_node 1 |" in proc.stdout
    assert re.search(r"experiment\.agent \S+ .*--shutdown_timeout=\d+ ", proc.stdout), proc.stdout


def test_launchfacts_says_gpus_settings_and_whether_torchrun_takes_a_shutdown_timeout(monkeypatch, capsys, tmp_path):
    import dataclasses
    import importlib.metadata

    from experiment import launchfacts
    from experiment.config import TrainConfig

    import torch

    nodes = launchfacts.may_have_gpus
    monkeypatch.setattr(launchfacts, "may_have_gpus", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    launchfacts.main()
    gpus, fields, flag = capsys.readouterr().out.splitlines()
    assert (gpus, flag) == ("3", "1")  # the pinned torch 2.13's torchrun has the flag
    assert fields.split() == [f.name for f in dataclasses.fields(TrainConfig)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a sign of a GPU, but no CUDA: 0
    launchfacts.main()
    assert capsys.readouterr().out.splitlines()[0] == "0"
    monkeypatch.setattr(launchfacts, "may_have_gpus", lambda: False)  # no driver nodes: 0, torch not asked
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    launchfacts.main()
    assert capsys.readouterr().out.splitlines()[0] == "0"
    for version, flag in [("2.11.0+cu128", False), ("2.12.1", False), ("2.13.0+cpu", True), ("2.13.1", True),
                          ("2.14.0", True), ("3.0.0", True), ("1.13.1", False), ("nightly", False),
                          ("2.13.0a0+git1234", False), ("2.13.0.dev20260101+cu128", False), ("2.13.0rc1", False),
                          ("2.14.0.dev20260301", True), ("2.13", True)]:
        monkeypatch.setattr(importlib.metadata, "version", lambda name, v=version: v)
        assert launchfacts.has_shutdown_timeout() is flag, version

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "version", missing)  # unreadable: no flag, no failure
    assert not launchfacts.has_shutdown_timeout()
    # The signs of a GPU: none; nvidiactl alone is not one, nor an empty driver list; nvidia0, WSL2's
    # dxg, Jetson's nvhost-*, a GPU in the driver's list each are.
    dev, gpus = tmp_path / "dev", tmp_path / "gpus"
    dev.mkdir()
    assert not nodes(dev, gpus)
    (dev / "nvidiactl").touch()
    gpus.mkdir()
    assert not nodes(dev, gpus)
    for sign in (dev / "nvidia0", dev / "dxg", dev / "nvhost-gpu", gpus / "0000:01:00.0"):
        sign.touch()
        assert nodes(dev, gpus), sign
        sign.unlink()
    assert not nodes(dev, gpus)


def test_launchfacts_imports_no_torch_where_no_gpu_can_be():
    """The point of may_have_gpus: a launch on a machine with no sign of an NVIDIA GPU pays no torch
    import for its facts (the config module imports none either)."""
    from experiment import launchfacts
    if launchfacts.may_have_gpus():
        pytest.skip("this machine shows a sign of an NVIDIA GPU: the facts import torch here, as they must")
    code = ("import runpy, sys; runpy.run_module('experiment.launchfacts', run_name='__main__'); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[0] == "0" and out.splitlines()[-1] == "False", out


@pytest.mark.slow
def test_launcher_arguments_are_settings_and_anything_else_exits_2(tmp_path, corpus):
    import os
    import subprocess
    import sys

    from conftest import REPO

    env = {**os.environ, "OMP_NUM_THREADS": "1", "DEPTH": "64", "PATH": f"{os.path.dirname(sys.executable)}:"
           f"{os.environ['PATH']}", "PYTHON": sys.executable}

    def launch(*args):
        return subprocess.run(["bash", str(REPO / "run.sh"), "train", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)

    proc = launch("DEPTH=2", "ASPECT_RATIO=32", "HEAD_DIM=32", "MAX_SEQ_LEN=32", "TOTAL_BATCH_SIZE=256",
                  "MAX_STEPS=1", "SAMPLE_TOKENS=0", "MODEL_TAG=argtag", f"DATA_DIR={corpus}", "WORKSPACE=ws")
    assert proc.returncode == 0, proc.stderr[-2000:]
    config = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("config "))[7:])
    assert (config["depth"], config["model_tag"]) == (2, "argtag")  # the argument wins over DEPTH=64 in the env
    assert ckpt.complete_steps(tmp_path / "ws/checkpoints/argtag") == [1]
    for bad, message in ((["--depth=2"], "'--depth=2' is not a setting"), (["DEPHT=2"], "DEPHT is no setting")):
        proc = launch(*bad)
        assert proc.returncode == 2 and message in proc.stderr and "config {" not in proc.stdout, proc.stderr


def _launch(tmp_path, **env):
    import os
    import subprocess
    import sys

    from conftest import REPO

    env = {**os.environ, "DEPTH": "2", "ASPECT_RATIO": "32", "HEAD_DIM": "32", "MAX_SEQ_LEN": "32",
           "DEVICE_BATCH_SIZE": "4", "TOTAL_BATCH_SIZE": "256", "MAX_STEPS": "2", "SAMPLE_TOKENS": "0",
           "WORKSPACE": str(tmp_path / "ws"), "OMP_NUM_THREADS": "1", "NPROC_PER_NODE": "2",
           "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}", "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(REPO / "experiment/run.sh")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("env, message", [
    ({"DATA_DIR": "empty"}, "empty: no data files"),
    ({"TOTAL_BATCH_SIZE": "100"}, "--total_batch_size 100 is not a multiple of max_seq_len 32 x world size 2"),
    ({"RESUME": "7"}, "--resume 7: no complete checkpoint at that step"),
    ({"DATA_MIX": "web=1"}, "DATA_MIX names 'web', which is no source"),
])
@pytest.mark.slow
def test_a_users_error_under_a_2_rank_launch_exits_2_before_torchrun(tmp_path, env, message):
    (tmp_path / "empty").mkdir()
    proc = _launch(tmp_path, **env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "torch.distributed" not in proc.stdout + proc.stderr
    assert "config {" not in proc.stdout  # no worker ever started


@pytest.mark.slow(seconds=25)
@pytest.mark.parametrize("restarts", ["3", "0"])  # 0: torchrun fails at once, and the agent reads the marker
def test_a_users_error_the_trainer_finds_ends_the_launch_once_with_exit_2(tmp_path, corpus, restarts):
    """EVAL_METRIC whose function raises on the untrained model: only the trainer finds it (before its
    first step). The launch ends there: the config printed once, exit 2, the error once, no
    traceback, and torchrun's one restart sets nothing up (experiment/agent.py). Rank 0 decides it for
    both ranks, and says it alone."""
    metric = tmp_path / "m.py"
    metric.write_text("def f(generate, tokenizer):\n    raise RuntimeError('a bad record')\n")
    proc = _launch(tmp_path, DATA_DIR=str(corpus), EVAL_METRIC=f"{metric}:f", MAX_RESTARTS=restarts)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert out.count("config {") == 1  # rank 0 prints it, at the one attempt that set up
    refused = "on the model as it starts (before its first step) it raised RuntimeError: a bad record"
    assert proc.stderr.count(refused) == 1 and out.count("error:") == 1, out[-3000:]  # rank 0 says it
    assert "Traceback" not in out and "ChildFailedError" not in out and "not restarting" not in out
    # torchrun's attempts (its --log-dir): the one that set up, and at most one restart that found the marker
    attempts = sorted(p.name for p in (tmp_path / "ws/checkpoints/d2/workers").glob("*/attempt_*"))
    assert attempts == (["attempt_0", "attempt_1"] if restarts == "3" else ["attempt_0"]), attempts
    end = json.loads((tmp_path / "ws/checkpoints/d2/metrics.jsonl").read_text().splitlines()[-1])
    assert end["kind"] == "end" and end["code"] == 2 and end["outcome"] == f"failed: EVAL_METRIC={metric}:f: {refused}"


@pytest.mark.slow
def test_a_sweep_member_of_the_first_wave_counts_its_budget_from_the_sweeps_start(tmp_path, corpus):
    """experiment/run.sh takes SWEEP_MEMBER_STARTED (experiment/sweep.py sets it for the first wave)
    as the launch's start: the 200 s of the members' pre-flights before it are in the budget used."""
    proc = _launch(tmp_path, DATA_DIR=str(corpus), MAX_STEPS="1", NPROC_PER_NODE="1", TRAINING_HOURS="1",
                   SWEEP_MEMBER_STARTED=repr(time.time() - 200))
    assert proc.returncode == 0, proc.stderr[-2000:]
    used = run_meta(tmp_path / "ws", 1)["state"]["used_seconds"]
    assert 200 <= used < 300, used


@pytest.mark.slow
def test_a_resume_on_other_data_is_refused_by_the_preflight(tmp_path, corpus):
    assert _launch(tmp_path, DATA_DIR=str(corpus)).returncode == 0
    (corpus / "sums.txt").write_text((corpus / "sums.txt").read_text()[: 30000])
    proc = _launch(tmp_path, DATA_DIR=str(corpus), MAX_STEPS="4")
    assert proc.returncode == 2 and "trained on prepared data" in proc.stderr and "config {" not in proc.stdout


@pytest.mark.slow
def test_a_node_other_than_0_waits_for_node_0s_plan(tmp_path, capsys):
    import threading

    from experiment import preflight
    from experiment.files import atomic_write_json

    args = ["--workspace", str(tmp_path), "--depth", "2"]
    lines = []
    assert preflight.main([*args, "--node_rank", "1", "--wait_minutes", "0.001"]) == 2
    assert "node 0's pre-flight did not finish" in capsys.readouterr().err  # and says what to check
    plan_file = tmp_path / "preflight/d2.json"
    atomic_write_json(plan_file, {"prepared": "old", "written_at": time.time() - 3600})  # an earlier launch's
    timer = threading.Timer(0.5, atomic_write_json, (plan_file, {"prepared": "new", "written_at": time.time()}))
    timer.start()
    try:
        cfg = preflight.parse_args(args)
        plan = preflight.preflight(cfg, world_size=2, node_rank=1, wait_minutes=1, log=lines.append)
    finally:
        timer.cancel()
    assert plan["prepared"] == "new"


def _two_sources(parent):
    """Two sources that differ: sums (digits) and a text of letters, so their losses differ."""
    from conftest import write_corpus

    d = write_corpus(parent)
    (d / "sums").mkdir()
    (d / "sums.txt").rename(d / "sums" / "sums.txt")
    (d / "words").mkdir()
    (d / "words" / "a.txt").write_text("the cat sat on the mat\n" * 1500)
    return d


@pytest.mark.slow
def test_data_mix_continues_exactly_across_a_resume_from_2_ranks_to_1(tmp_path):
    data = _two_sources(tmp_path)
    args = [*TINY, "--data_dir", data, "--max_steps", 6, "--save_every_steps", 3, "--total_batch_size", 256,
            "--data_mix", "sums=0.2,words=0.8", "--eval_every_steps", 3]
    reference = run_train([*args, "--workspace", tmp_path / "ref"], nproc=2)
    assert "data | mixture sums 0.200, words 0.800" in reference.stdout
    run_dir = tmp_path / "resumed/checkpoints/d2"
    run_dir.mkdir(parents=True)
    for p in (tmp_path / "ref/checkpoints/d2").iterdir():
        if "_000003" in p.name:
            shutil.copy(p, run_dir / p.name)
    run_train([*args, "--workspace", tmp_path / "resumed"], nproc=1)
    ref, got = (ckpt.load_model_state(ws / "checkpoints/d2", 6) for ws in (tmp_path / "ref", tmp_path / "resumed"))
    assert all(torch.equal(ref[n], got[n]) for n in ref)  # the same windows, in the same order
    assert run_meta(tmp_path / "resumed", 6)["data_positions"][0] == run_meta(tmp_path / "ref", 6)["data_positions"][0]
    assert run_meta(tmp_path / "ref", 6)["data_positions"][0]["cursor"] == 6 * 256 // 32


@pytest.mark.slow
def test_each_source_gets_its_own_val_loss_and_the_total_is_weighted(tmp_path):
    data = _two_sources(tmp_path)
    proc = run_train([*TINY, "--data_dir", data, "--workspace", tmp_path, "--max_steps", 4, "--total_batch_size", 256])
    line = next(l for l in proc.stdout.splitlines() if "val_loss by source" in l)
    assert re.search(r"\| sums \d+\.\d{4} \| words \d+\.\d{4}$", line), line
    records = map(json.loads, (tmp_path / "checkpoints/d2/metrics.jsonl").read_text().splitlines())
    record = [r for r in records if r["kind"] == "eval"][-1]
    splits = ckpt.read_meta(tmp_path / "checkpoints/d2", 4)
    sizes = {"sums": 0, "words": 0}
    for name in sizes:
        s = next(s for s in json.loads((Path(splits["prepared"]["dir"]) / "meta.json").read_text())["source_splits"]
                 if s["name"] == name)
        sizes[name] = s["train"][1] - s["train"][0]
    weights = {n: v / sum(sizes.values()) for n, v in sizes.items()}  # no DATA_MIX: by size
    by_source = record["val_loss_by_source"]
    assert by_source["sums"] != pytest.approx(by_source["words"], abs=0.01)
    assert record["val_loss"] == pytest.approx(sum(weights[n] * by_source[n] for n in by_source), rel=1e-9)


def test_an_eval_due_when_the_budget_has_no_room_for_another_makes_this_step_the_last():
    from types import SimpleNamespace

    import torch

    from experiment import saving, stopping
    from experiment.checkpoint import RunState
    from experiment.distributed import Dist

    cfg = SimpleNamespace(eval_every_minutes=1.0, eval_every_steps=0, save_every_minutes=60.0, save_every_steps=0,
                          plateau_evals=4, max_steps=0, warmdown_frac=0.4, seq_warmup_frac=0.3, batch_warmup_frac=0.3)
    now = time.time()
    for eval_ago, used, writing, last in ((120, 95.0, 0, 1), (10, 95.0, 0, 0), (120, 92.0, 0, 0), (10, 95.0, 2, 1)):
        # reserve 4 s (eval 2 + save 1 + step 1) of a 100 s budget; an eval due now costs 3 s more,
        # and a background write still at work what it has left (the final save waits for it)
        st = RunState(step=50, used_seconds=used, eval_seconds=2.0, save_seconds=1.0, step_seconds=1.0)
        saver = SimpleNamespace(seconds_left=lambda save_seconds, left=writing: float(left))
        t = SimpleNamespace(cfg=cfg, d=Dist(0, 0, 1, torch.device("cpu")), st=st, max_steps=10**9, budget_seconds=100.0,
                            max_tokens=math.inf, saver=saver, first_save_seconds=1.0, eval_every_tokens=math.inf,
                            restart_lost=0.0, restart_setup=0.0)
        loop = SimpleNamespace(eval_seconds=0.0, last_eval_time=now - eval_ago, last_save_time=now, reserve_seconds=4.0)
        assert stopping.decide(t, loop, 0)[:2] == (last, int(eval_ago > 60)), (eval_ago, used)
        assert loop.progress == used / 96.0  # the schedule's progress, rank 0's, rides with the decisions
        # 92-95 s of 96 s (the budget less the reserve): past 60%, the warmdown begins here, unless the run ends
        assert stopping.decide(t, loop, 0)[5] == 1 - last
        assert stopping.decide(t, loop, 0)[6:] == (1, 0)  # past the early-schedule warmups
    # Before the first save its estimate stands in: 92.5 + 4 + an eval (2) and a save (1.5) due now
    # reach the budget; counting the save as free would not.
    st.used_seconds, st.save_seconds, t.saver = 92.5, 0.0, SimpleNamespace(seconds_left=lambda save_seconds: 0.0)
    loop.last_eval_time, t.first_save_seconds = now - 120, 1.5
    assert stopping.decide(t, loop, 0)[:2] == (1, 1) and saving.save_seconds(t) == 1.5
    t.first_save_seconds = 0.0
    assert stopping.decide(t, loop, 0)[:2] == (0, 1)
    # EVAL_EVERY_EPOCHS: an eval is due once a quarter pass of tokens has gone by since the last
    loop.last_eval_time, st.used_seconds, t.eval_every_tokens = now, 50.0, 1000.0
    st.tokens_seen, st.last_eval_tokens = 5000, 4001
    assert stopping.decide(t, loop, 0)[:2] == (0, 0)
    st.last_eval_tokens = 4000
    assert stopping.decide(t, loop, 0)[:2] == (0, 1)
    # the warmups' phase by the furthest progress reached: 9.6 s of 96 is 10% (quarter contexts, half
    # batches), 19.2 s 20% (half contexts, half batches); a longer budget (an extension) goes back to none
    fresh = RunState(step=5, used_seconds=9.6, eval_seconds=2.0, save_seconds=1.0, step_seconds=1.0)
    t.st, loop.last_eval_time = fresh, now
    assert stopping.decide(t, loop, 0)[6:] == (4, 1)
    fresh.used_seconds = 19.2
    assert stopping.decide(t, loop, 0)[6:] == (2, 1) and fresh.warmup_progress == pytest.approx(0.2)
    t.budget_seconds = 1000.0
    assert stopping.decide(t, loop, 0)[6:] == (2, 1)  # 2% of the longer budget, but 20% was reached
    fresh.anneal_start_tokens = 0  # the val minimum's anneal began at this step: this step and its resume
    assert stopping.decide(t, loop, 0)[6:] == (2, 1)  # are in the warmups still, the next ones are not
    fresh.tokens_seen = 4096
    assert stopping.decide(t, loop, 0)[6:] == (1, 0)
    t.st, t.budget_seconds = st, 100.0
    # a warmdown the stop at the val minimum started ends the run when it is done; PLATEAU_EVALS=0 overrules it
    st.anneal_start_tokens, st.anneal_tokens = 3000, 2000
    assert stopping.decide(t, loop, 0)[0] == 1
    cfg.plateau_evals = 0
    assert stopping.decide(t, loop, 0)[0] == 0


def test_a_step_whose_phase_changed_is_timed_like_a_warm_up_step():
    """The warmups' phase changing (shorter sequences or half batches begin or end) runs new shapes: on
    CUDA a graph compiled mid-run. Such a step stays out of the step-time average and the throughput,
    and keeps setup's collective timeout; the next warm step goes back to the step's."""
    from types import SimpleNamespace

    from experiment import progress
    from experiment.checkpoint import RunState
    from experiment.distributed import Dist
    from experiment.trainer import Loop

    cfg = SimpleNamespace(log_every_steps=1000, total_batch_size=256)
    t = SimpleNamespace(cfg=cfg, d=Dist(0, 0, 1, torch.device("cpu")), st=RunState(step=20, step_seconds=0.1),
                        resume_step=None, restart_lost=0.0, restart_setup=0.0)
    loop = Loop(x=None, y=None, data_state={}, started=0.0, used_at_start=0.0, last_eval_time=0.0,
                last_save_time=0.0, last_saved_step=0, last_complete_step=0, planned=True, phase="step")
    progress.begin_step(t, loop)
    assert loop.phase == "step"  # the same shapes: the step's timeout
    loop.reshaped = True
    progress.begin_step(t, loop)
    assert loop.phase == "setup"
    progress.record_step(t, loop, torch.zeros(()), 1.0, time.time() - 30.0)  # a 30 s compile
    assert t.st.step_seconds == 0.1 and loop.measured_time == 0 and loop.phase == "setup"
    loop.reshaped = False
    progress.record_step(t, loop, torch.zeros(()), 1.0, progress.begin_step(t, loop) - 0.2)
    assert t.st.step_seconds == pytest.approx(0.9 * 0.1 + 0.1 * 0.2, abs=0.01) and loop.measured_time > 0
    assert loop.phase == "step"


def test_a_warmdown_once_begun_stays_begun_for_the_stop_at_the_val_minimum():
    """The budget's fraction can dip below the warmdown's start when the measured reserve shrinks: an
    eval there still belongs to the warmdown, whose test (the window's mean makes no new low for
    PLATEAU_EVALS evals) ends the run. Taken for the peak LR's, it would start a second warmdown."""
    from types import SimpleNamespace

    from experiment import plateau
    from experiment.checkpoint import RunState
    from experiment.distributed import Dist

    cfg = SimpleNamespace(plateau_evals=2, plateau_margin=0.002, warmdown_frac=0.4, total_batch_size=1,
                          gpu_hourly_usd=4.0)
    t = SimpleNamespace(cfg=cfg, st=RunState(), d=Dist(0, 0, 1, torch.device("cpu")), log=lambda line: None,
                        budget_seconds=100.0, prepared=SimpleNamespace(meta={"split": {"train_tokens": 100}}))
    stopped = []
    loop = SimpleNamespace(used=lambda: 0.0, stop=lambda code, outcome: stopped.append(outcome))
    for step, (progress, val) in enumerate([(0.65, 2.0), (0.55, 2.1), (0.55, 2.2), (0.55, 2.3)], start=1):
        t.st.step = t.st.tokens_seen = step
        loop.val_loss, loop.progress = val, progress
        plateau.plateau_check(t, loop)
    assert t.st.plateau_stopped and t.st.anneal_start_tokens == -1
    assert stopped and "stopped improving during the warmdown" in stopped[0]


@pytest.mark.slow(seconds=24)
def test_a_damaged_newest_step_is_found_by_the_preflight_and_the_run_resumes_the_one_before(tmp_path, corpus):
    first = _launch(tmp_path, DATA_DIR=str(corpus), MAX_STEPS="4", SAVE_EVERY_STEPS="2")
    assert first.returncode == 0, first.stderr[-2000:]
    run_dir = tmp_path / "ws/checkpoints/d2"
    assert (run_dir / "best.pt").is_file() and "export | step" in first.stdout  # the run's end exports its best
    damaged = run_dir / "model_000004_rank1.pt"
    damaged.write_bytes(damaged.read_bytes()[:200])  # a partial copy
    again = _launch(tmp_path, DATA_DIR=str(corpus), MAX_STEPS="6", SAVE_EVERY_STEPS="2")
    assert again.returncode == 0, again.stderr[-2000:]
    out = again.stdout
    assert f"warning: checkpoint step 000004 is damaged ({damaged}: 200 bytes" in out
    assert "preflight | resumes step 000002" in out and "Traceback" not in again.stderr
    assert (run_dir / "meta_000004.json.damaged").is_file()  # set aside by the trainer; step 4 written anew
    assert ckpt.complete_steps(run_dir)[-1] == 6 and ckpt.damaged_files(run_dir, 4) == []


@pytest.mark.slow
def test_the_launch_keeps_each_workers_stderr_in_the_run_directory(tmp_path, corpus):
    # NCCL's watchdog aborts a worker with lines on its stderr only: they land beside training.log,
    # written by the worker itself (so a killed launcher loses none), and still reach the console.
    proc = _launch(tmp_path, DATA_DIR=str(corpus), NPROC_PER_NODE="2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_dir = tmp_path / "ws/checkpoints/d2"
    logs = sorted(run_dir.glob("workers/*/attempt_0/*/stderr.log"))
    assert [p.parent.name for p in logs] == ["0", "1"]
    assert "--log-dir" in proc.stdout and "--redirects=2 --tee=2" in proc.stdout  # the launcher line says so


def test_the_warmup_schedules_by_progress_and_step():
    from experiment.optim import muon_momentum
    from experiment.schedule import context_split
    assert [context_split(p, 0.3) for p in (0.0, 0.149, 0.15, 0.299, 0.3, 0.9)] == [4, 4, 2, 2, 1, 1]
    assert context_split(0.0, 0.0) == 1  # off
    assert [muon_momentum(s, 300) for s in (0, 150, 300, 10_000)] == pytest.approx([0.85, 0.90, 0.95, 0.95])
    assert muon_momentum(0, 0) == 0.95  # off


def test_early_steps_train_shorter_sequences_in_two_half_batch_updates_at_a_rising_momentum(tmp_path, corpus,
                                                                                             monkeypatch):
    from experiment import train
    from experiment.model import GPT
    from experiment.optim import ShardedOptimizer

    shapes, momenta = [], []
    forward, step = GPT.forward, ShardedOptimizer.step

    def record_forward(self, idx, targets=None, **kw):
        if self.training:
            shapes.append(tuple(idx.shape))
        return forward(self, idx, targets, **kw)

    def record_step(self):
        momenta.append(self.optimizers[0].param_groups[0]["momentum"])
        return step(self)

    monkeypatch.setattr(GPT, "forward", record_forward)
    monkeypatch.setattr(ShardedOptimizer, "step", record_step)
    # 4 steps of 4 sequences of 32 (one micro-batch each): the schedule's progress is step / 4
    code = train.main([*map(str, TINY), "--data_dir", str(corpus), "--workspace", str(tmp_path), "--max_steps", "4",
                       "--total_batch_size", "128", "--seq_warmup_frac", "1", "--batch_warmup_frac", "0.5",
                       "--muon_momentum_warmup_steps", "2"])
    assert code == 0
    # steps 0-1 (progress < 0.5): 16 sequences of 8, as two updates of 8; steps 2-3: 8 of 16, one update
    assert shapes == [(8, 8)] * 4 + [(8, 16)] * 2
    assert momenta == pytest.approx([0.85, 0.85, 0.90, 0.90, 0.95, 0.95])
    meta = run_meta(tmp_path, 4)
    assert meta["state"]["tokens_seen"] == 4 * 128  # the same tokens as without the warmups
    adam = [s for s in ckpt.load_tensors(ckpt.optim_path(tmp_path / "checkpoints/d2", 4, 0))["state"].values()
            if "step" in s]
    assert adam and all(float(s["step"]) == 6 for s in adam)  # every update reached the optimizer


def test_the_warmups_settings_are_checked():
    for settings, message in ((dict(seq_warmup_frac=1.5), "--seq_warmup_frac must lie in [0, 1]"),
                              (dict(batch_warmup_frac=-0.1), "--batch_warmup_frac must lie in [0, 1]"),
                              (dict(max_seq_len=30, total_batch_size=3840), "max_seq_len 30 must be a multiple of 4"),
                              (dict(muon_momentum_warmup_steps=-1), "--muon_momentum_warmup_steps must be >= 0")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            resolve(TrainConfig(**settings), cuda=False, world_size=1)
    resolve(TrainConfig(max_seq_len=30, total_batch_size=3840, seq_warmup_frac=0), cuda=False, world_size=1)


def test_only_the_first_models_setup_errors_end_the_launch(monkeypatch, tmp_path):
    """train.run marks a setup error of the launch's first model (no teachers), on its first attempt, as
    one a restart would repeat; a later generation's (its teacher's load) or a restart's (after a crash:
    its setup passed once) may be mended by a restart, and is not."""
    from experiment import train as trainmod
    from experiment.checkpoint import CheckpointError

    def refuse(*args):
        raise CheckpointError("cannot load the teacher")

    monkeypatch.setattr(trainmod, "setup", refuse)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    for teachers, restart, at_start in ((None, "0", True), ([{"file": "gen1/best.pt"}], "0", False), (None, "1", False)):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart)  # 1: a restart after a crash, whose setup passed once
        with pytest.raises(CheckpointError) as e:
            trainmod.run(TrainConfig(), None, tmp_path, tmp_path, print, 0.0, teachers)
        assert e.value.at_start is at_start


def test_the_agent_gives_the_markers_code_only_when_the_trainers_decision_failed_first(monkeypatch, tmp_path):
    """experiment/agent.py around torchrun's main: its exit code is the marker's when torchrun ended
    cleanly after the marker, or failed first with that very code (MAX_RESTARTS=0); a crash that
    came first keeps torchrun's own error, as does one of a worker that left no marker (a restart that
    crashed after the marker)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from experiment import agent, launch

    def failing(code, pid=4242):
        def main(args):
            raise ChildFailedError("experiment.train", {0: ProcessFailure(0, pid, code, "<N/A>")})
        return main

    monkeypatch.setenv(launch.AGENT_READS_ENDED, "")  # the agent sets it for its workers: undone after the test
    me, host = launch.os.getpid(), launch.socket.gethostname()
    stale = tmp_path / f".ended.{host}.{me}.77.2"
    monkeypatch.setattr(torchrun, "main", lambda args: stale.exists() and 1)  # what a first worker would read
    stale.touch()  # an earlier launch's, whose torchrun had this pid: gone before any worker starts
    assert agent.main([str(tmp_path)]) == 0 and not stale.exists()

    def ended(pid, code, failed=None):  # worker `pid` leaves its marker; then torchrun fails with `failed`, or not
        def main(args):
            (tmp_path / f".ended.{host}.{me}.{pid}.{code}").touch()
            if failed:
                failing(failed[1], failed[0])(args)
        return main

    monkeypatch.setattr(torchrun, "main", ended(4242, 2, (4242, 2)))  # MAX_RESTARTS=0: the marker's worker failed
    assert agent.main([str(tmp_path)]) == 2
    assert launch.marker_codes(tmp_path, me) == {4242: 2} and launch.marker_codes(tmp_path, 1) == {}
    monkeypatch.setattr(torchrun, "main", ended(4242, 2))  # one restart found the marker and exited 0
    assert agent.main([str(tmp_path)]) == 2
    for failed in ((4343, 2), (4242, 1)):  # another worker with that code, the marker's with another: a crash
        monkeypatch.setattr(torchrun, "main", ended(4242, 2, failed))
        with pytest.raises(ChildFailedError):  # torchrun's own report
            agent.main([str(tmp_path)])
    monkeypatch.setattr(launch, "ended_code", lambda run_dir, pid: (2, 0.0))
    monkeypatch.setattr(torchrun, "main", failing(-9))  # a kill came first: not the trainer's decision
    with pytest.raises(ChildFailedError):
        agent.main([str(tmp_path)])
    monkeypatch.setattr(torchrun, "main", lambda args: None)  # one restart found the marker and exited 0
    assert agent.main([str(tmp_path)]) == 2
    monkeypatch.setattr(launch, "ended_code", lambda run_dir, pid: None)
    assert agent.main([str(tmp_path)]) == 0  # a run that ended well
    monkeypatch.setattr(torchrun, "main", failing(1))
    with pytest.raises(ChildFailedError):  # a crash with no marker: torchrun's report
        agent.main([str(tmp_path)])
