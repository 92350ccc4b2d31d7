"""The pre-flight's parts, one condition at a time (the whole pre-flight runs in test_guards.py,
test_regime.py and test_train.py)."""

import dataclasses
import json
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_config
from experiment import preflight
from experiment.config import ConfigError, TrainConfig, parse_args, resolve
from experiment.dataloader import DataError
from experiment.guards import Gpu
from experiment.hardware import peak_flops

H100 = Gpu("NVIDIA H100 PCIe", peak_flops("H100 PCIe"), 80 * 2**30)


def test_more_ranks_than_gpus_is_refused_under_nccl_alone(monkeypatch):
    cfg = TrainConfig()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    preflight.check_ranks_per_gpu(cfg, None, 4)  # no GPU planned for: nothing to count
    preflight.check_ranks_per_gpu(cfg, H100, 4)  # a CUDA plan on this CPU: no GPUs to count
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    preflight.check_ranks_per_gpu(cfg, H100, 2)  # one rank per GPU
    with pytest.raises(ConfigError, match="LOCAL_RANK 2 but 2 GPU"):
        preflight.check_ranks_per_gpu(cfg, H100, 3)
    preflight.check_ranks_per_gpu(dataclasses.replace(cfg, dist_backend="gloo"), H100, 3)  # gloo shares GPUs
    preflight.check_ranks_per_gpu(cfg, None, 3)


def test_the_start_is_checked_as_the_trainer_will_check_it(tmp_path, monkeypatch):
    from experiment import extend, finetune

    calls = []
    monkeypatch.setattr(finetune, "check_target", lambda cfg, config: calls.append(("target", config)))
    monkeypatch.setattr(preflight, "check_resume_target", lambda *args: calls.append(("resume", args[1])))
    monkeypatch.setattr(extend, "rewind_step", lambda run_dir, step, cfg, tokens: calls.append(("rewind", tokens)) or 3)
    prepared = SimpleNamespace(meta={"split": {"train_tokens": 1234}})
    assert preflight.start_checks(TrainConfig(), tmp_path, None, "cfg", prepared) is None and calls == []
    assert preflight.start_checks(TrainConfig(init_from="x"), tmp_path, None, "cfg", prepared) is None
    assert calls == [("target", "cfg")]
    calls.clear()
    assert preflight.start_checks(TrainConfig(init_from="x"), tmp_path, 7, "cfg", prepared) == 3
    assert calls == [("resume", 7), ("rewind", 1234)]  # a resume's weights are its own: no INIT_FROM check


def test_the_regimes_settings_are_a_resumes_own_or_predicted_where_the_gpu_is_known(tmp_path, monkeypatch):
    from experiment import checkpoint as ckpt
    from experiment import regime

    calls, lines = [], []
    monkeypatch.setattr(regime, "keep", lambda cfg, unset, train_config: calls.append(("keep", train_config)))
    monkeypatch.setattr(regime, "estimate_passes", lambda *args: calls.append(("estimate",)) or (12.0, "predicted"))
    monkeypatch.setattr(regime, "fill", lambda cfg, unset, passes, taught: {"passes": passes, "taught": taught})
    monkeypatch.setattr(regime, "line", lambda passes, chosen, how: f"regime {passes} {chosen} {how}")
    monkeypatch.setattr(ckpt, "read_meta", lambda run_dir, step: {"train_config": {"step": step}})
    cfg, config = TrainConfig(max_epochs=0), tiny_config()

    def plan(unset, config=config, gpu=H100, resume=None, teacher_flops=0.0):
        return preflight.plan_regime(cfg, unset, config, gpu, 8, 10**6, tmp_path, resume, 4.0, lines.append,
                                     teacher_flops)

    assert plan(["max_epochs"], resume=5) == 0.0 and calls == [("keep", {"step": 5})] and lines == []
    calls.clear()
    assert plan(["max_epochs"]) == 0.0 and calls == [("estimate",)]
    assert lines == ["preflight | regime 12.0 {'passes': 12.0, 'taught': False} predicted"]
    cfg.distill_weight = 0.5  # a generation with a teacher: the regime hears it is taught
    assert plan(["max_epochs"], teacher_flops=1e6) == 0.0
    assert lines[-1] == "preflight | regime 12.0 {'passes': 12.0, 'taught': True} predicted"
    cfg.distill_weight, calls[:] = None, []
    calls.clear()
    assert plan(["attn_dropout"]) == 4.0  # MAX_EPOCHS given: the data's cap stands
    assert plan([]) == 4.0 and plan(["max_epochs"], config=None) == 0.0
    assert plan(["max_epochs"], gpu=None) == 0.0 and plan(["max_epochs"], gpu=dataclasses.replace(H100, peak=None)) == 0.0
    assert calls == [("estimate",)]  # nothing unset, no model, no GPU, no known peak: the trainer measures
    cfg = TrainConfig(max_epochs=32.0)  # the regime's cap for a generation of GENERATIONS=auto (regime.pass_cap)
    assert plan(["max_epochs"]) == 32.0 and plan(["attn_dropout"]) == 4.0  # the guard takes it; a given one not
    cfg = TrainConfig(max_epochs=None)  # nothing filled it: the data's cap
    assert plan(["max_epochs"], config=None) == 4.0


def test_each_source_is_said_with_its_weight_and_tokens_and_many_sources_are_warned_of():
    def prepared(n):
        return SimpleNamespace(meta={"source_splits": [{"name": f"s{i}", "train": [10, 110 + i], "val": [0, 10]}
                                                       for i in range(n)]})

    lines = preflight.source_lines(TrainConfig(), prepared(2), [0.25, 0.75])
    assert lines == ["preflight | source s0 | weight 0.250 (by size) | 100 train, 10 val tokens",
                     "preflight | source s1 | weight 0.750 (by size) | 101 train, 10 val tokens"]
    mixed = preflight.source_lines(TrainConfig(data_mix="s0=1,s1=3"), prepared(2), [0.25, 0.75])
    assert mixed[0].endswith("weight 0.250 (DATA_MIX) | 100 train, 10 val tokens")
    many = 64  # docs/data.md: "the pre-flight warns above 64 sources"
    assert len(preflight.source_lines(TrainConfig(), prepared(many), [1 / many] * many)) == many
    lines = preflight.source_lines(TrainConfig(), prepared(many + 1), [1 / (many + 1)] * (many + 1))
    assert len(lines) == many + 2 and lines[0].startswith(f"warning: {many + 1} sources (each sub-directory of DATA_DIR is one")
    assert preflight.source_lines(TrainConfig(), prepared(1), None) == []


def test_a_node_other_than_0_takes_a_plan_written_at_most_ten_minutes_before_it_started(tmp_path, monkeypatch):
    plan_file, lines = tmp_path / "plan.json", []
    monkeypatch.setattr(preflight, "time", SimpleNamespace(time=time.time, sleep=lambda s: None))
    started = 10_000.0
    plan_file.write_text(json.dumps({"prepared": "p", "written_at": started - preflight.PLAN_FRESH_SECONDS}))
    assert preflight.wait_for_node0(plan_file, started, 1, lines.append)["prepared"] == "p" and lines == []
    plan_file.write_text(json.dumps({"prepared": "q", "written_at": started + 5}))  # written after this node started
    assert preflight.wait_for_node0(plan_file, started, 1, lines.append)["prepared"] == "q" and lines == []
    plan_file.write_text(json.dumps({"prepared": "old", "written_at": started - preflight.PLAN_FRESH_SECONDS - 1}))
    # the clock read for the deadline (30 s: within it), for the waiting line (33 s), for the deadline (61 s)
    clock = iter([started + 30, started + 33, started + 61])
    monkeypatch.setattr(preflight, "time", SimpleNamespace(time=lambda: next(clock), sleep=lambda s: None))
    with pytest.raises(DataError, match="node 0's pre-flight did not finish within 1 min"):
        preflight.wait_for_node0(plan_file, started, 1, lines.append)
    assert lines == [f"preflight | waiting for node 0 to prepare the data ({plan_file}), 0.6 of 1 min"]
    lines.clear()  # at the deadline itself it still waits; past it, it gives up
    clock = iter([started + 60, started + 60, started + 60.5])
    with pytest.raises(DataError):
        preflight.wait_for_node0(plan_file, started, 1, lines.append)
    assert len(lines) == 1
    assert preflight.PLAN_FRESH_SECONDS == 600


def test_the_plan_lines_say_the_data_the_model_and_what_the_run_starts_from(tmp_path):
    from experiment.launch import model_config

    auto = "".join(["au", "to"])  # as the command line gives it: a string made at run time
    cfg = resolve(parse_args(["--depth", auto, "--max_seq_len", "32"]), cuda=False, world_size=1)
    prepared = SimpleNamespace(dir=tmp_path, meta={"split": {"train_tokens": 4096, "val_tokens": 512}, "vocab_size": 64,
                                                   "vocab_used": 64, "tokenizer": "char"})
    config = model_config(dataclasses.replace(cfg, depth=2), prepared)
    auto = preflight.plan_lines(cfg, prepared, config, 1, None, tmp_path)
    assert " (DEPTH=auto, from the predicted tok/s)" in auto[1]
    assert auto[3] == f"preflight | fresh run in {tmp_path}"
    resumed = preflight.plan_lines(cfg, prepared, config, 1, 12, tmp_path)
    assert "DEPTH=auto" not in resumed[1] and resumed[3] == f"preflight | resumes step 000012 of {tmp_path}"
    given = preflight.plan_lines(dataclasses.replace(cfg, depth=2), prepared, config, 1, None, tmp_path)
    assert "DEPTH=auto" not in given[1]
    unknown = preflight.plan_lines(cfg, prepared, None, 1, None, tmp_path)
    assert "model auto (depth chosen at start" in unknown[1]


def test_main_exits_2_on_a_users_error_and_hands_the_launcher_its_plan(tmp_path, monkeypatch, capsys):
    from experiment.checkpoint import CheckpointError

    plan_file = tmp_path / "plan.json"
    for error in (ConfigError("bad setting"), DataError("no data"), CheckpointError("torn")):
        def failing(*args, error=error, **kwargs):
            raise error
        monkeypatch.setattr(preflight, "preflight", failing)
        assert preflight.main(["--plan_file", str(plan_file)]) == 2
        assert capsys.readouterr().err == f"error: {error}\n"
    assert not plan_file.exists()
    seen = []

    def planned(cfg, world_size, node_rank, wait_minutes, log, shutdown_given, nproc_per_node):
        seen.append((cfg.depth, world_size, node_rank, wait_minutes, shutdown_given, nproc_per_node))
        return {"prepared": "x"}

    monkeypatch.setattr(preflight, "preflight", planned)
    args = ["--world_size", "4", "--nproc_per_node", "2", "--node_rank", "1", "--wait_minutes", "3",
            "--shutdown_timeout", "30", "--plan_file", str(plan_file), "--depth", "3"]
    assert preflight.main(args) == 0 and json.loads(plan_file.read_text()) == {"prepared": "x"}
    assert seen == [(3, 4, 1, 3.0, 30, 2)]
    assert preflight.main([]) == 0 and seen[-1] == ("auto", 1, 0, 120, 0, None)


def test_a_node_other_than_0_prepares_nothing_and_takes_node_0s_plan(tmp_path, monkeypatch):
    waited = []
    monkeypatch.setattr(preflight, "wait_for_node0", lambda plan_file, started, minutes, log:
                        waited.append((plan_file, minutes)) or {"prepared": "node 0's"})
    monkeypatch.setattr(preflight, "prepare_data", lambda *args: pytest.fail("a node > 0 prepared data"))
    cfg = parse_args(["--workspace", str(tmp_path), "--depth", "2", "--device", "cpu"])
    assert preflight.preflight(cfg, 2, 1, 7, lambda line: None) == {"prepared": "node 0's"}
    assert waited == [(tmp_path / "preflight" / "d2.json", 7)]


def test_a_cpu_run_is_warned_of_a_disk_its_checkpoints_would_fill(tmp_path, corpus, monkeypatch):
    """No GPU plan (a CPU run): the disk check still runs, on the checkpoint's bytes at the precision
    the run asks for (no GPU memory to fit: unbounded), and warns rather than refuses."""
    from experiment import guards

    text = (corpus / "sums.txt").read_text()
    two = tmp_path / "two"  # two sources (sub-directories): the pre-flight says each one's weight and tokens
    for name, part in (("a", text[: len(text) // 2]), ("b", text[len(text) // 2:])):
        (two / name).mkdir(parents=True)
        (two / name / "part.txt").write_text(part)
    corpus = two
    sized, asked, lines = [], [], []
    monkeypatch.setattr(preflight, "checkpoint_bytes", lambda config, world, gpu_bytes, precision, average:
                        sized.append((config.depth, world, gpu_bytes, precision, average)) or 123)
    monkeypatch.setattr(guards, "disk_warning", lambda cfg, nbytes, run_dir: asked.append(nbytes) or "warning: full")
    cfg = parse_args(["--workspace", str(tmp_path), "--data_dir", str(corpus), "--depth", "2", "--device", "cpu",
                      "--max_seq_len", "64", "--average", "ema"])
    preflight.preflight(cfg, 1, 0, 1, lines.append)
    assert sized == [(2, 1, 1 << 62, "auto", True)] and asked == [123] and "warning: full" in lines
    assert any(line.startswith("preflight | data ") for line in lines)  # the plan lines are said
    assert any(line.startswith("preflight | source ") for line in lines)  # and each source's
    sized.clear()
    none = "".join(["no", "ne"])  # a setting's value as the command line gives it: a string made at run time
    preflight.preflight(parse_args(["--workspace", str(tmp_path / "plain"), "--data_dir", str(corpus), "--depth", "2",
                                    "--device", "cpu", "--max_seq_len", "64", "--average", none]), 1, 0, 1, lines.append)
    assert sized == [(2, 1, 1 << 62, "auto", False)]
    sized.clear()
    preflight.preflight(parse_args(["--workspace", str(tmp_path / "auto"), "--data_dir", str(corpus), "--device",
                                    "cpu", "--max_seq_len", "64"]), 1, 0, 1, lines.append)
    assert sized == []  # DEPTH=auto on a CPU: the model is chosen at start, its size unknown here


def test_a_fresh_gpu_run_is_refused_a_full_disk_by_the_guard_not_warned(tmp_path, corpus, monkeypatch):
    from test_guards import run_preflight

    from experiment import guards

    asked = []
    monkeypatch.setattr(guards, "disk_warning", lambda cfg, nbytes, run_dir: asked.append(nbytes))
    plan, _ = run_preflight(tmp_path, "--data_dir", corpus, "--depth", 4)
    assert isinstance(plan, dict) and asked == []  # guards.check holds the disk check of a fresh GPU run


def test_the_gpu_is_this_machines_on_cuda_and_the_ranks_per_node_default_to_the_world(tmp_path, monkeypatch):
    from experiment import guards

    asked, checked = [], []
    monkeypatch.setattr(preflight, "wait_for_node0", lambda *args: {"prepared": "p"})
    monkeypatch.setattr(guards, "local_gpu", lambda: asked.append(1) or H100)
    monkeypatch.setattr(preflight, "check_ranks_per_gpu", lambda cfg, gpu, n: checked.append((gpu, n)))
    cfg = parse_args(["--workspace", str(tmp_path), "--depth", "2", "--device", "cpu"])
    preflight.preflight(cfg, 4, 1, 1, lambda line: None)
    assert asked == [] and checked == [(None, 4)]
    monkeypatch.setattr(preflight, "resolve_device", lambda flag: torch.device("cuda"))
    preflight.preflight(cfg, 4, 1, 1, lambda line: None, nproc_per_node=2)
    assert asked == [1] and checked[-1] == (H100, 2)
    monkeypatch.undo()
    if not torch.cuda.is_available():  # DEVICE=cuda without CUDA: the user's error, in one line
        with pytest.raises(ConfigError, match="CUDA is not available"):
            preflight.preflight(parse_args(["--workspace", str(tmp_path), "--device", "cuda"]), 1, 0, 1, print)
