"""GENERATIONS: models trained one after another, each distilled from a frozen teacher; the best served."""

import hashlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import time
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import ENV, REPO, TINY, kill_tree, run_train, tiny_config, train_cmd, wait_gone
from experiment import checkpoint as ckpt
from experiment.checkpoint import CheckpointError
from experiment.model import GPT, distillation_loss
from experiment.teacher import Teacher, native_cpu_bf16

# Step-bounded: the schedule follows the steps (a budget of hours is never near), evals and saves at
# fixed steps, no stop at the val minimum: every launch of the same settings trains the same weights.
STEPS = 16
ARGS = [*TINY, "--max_steps", STEPS, "--total_batch_size", 128, "--eval_every_steps", 4, "--save_every_steps", 4,
        "--plateau_evals", 0, "--save_every_minutes", 1000, "--eval_every_minutes", 1000]


def _hand_loss(logits, targets, teacher, weight, temperature) -> float:
    """The distillation loss position by position in float64."""
    z, p = logits.double().numpy().reshape(-1, logits.shape[-1]), teacher.double().numpy().reshape(-1, logits.shape[-1])
    hard, soft, n = 0.0, 0.0, 0
    for row, target, probs in zip(z, targets.reshape(-1).tolist(), p):
        if target == -1:
            continue
        n += 1
        hard += np.log(np.exp(row - row.max()).sum()) + row.max() - row[target]
        scaled = row / temperature
        log_q = scaled - (np.log(np.exp(scaled - scaled.max()).sum()) + scaled.max())
        soft += sum(pi * (np.log(pi) - lq) for pi, lq in zip(probs, log_q) if pi > 0)
    return (1 - weight) * hard / n + weight * temperature**2 * soft / n


@pytest.mark.parametrize("weight,temperature", [(0.5, 1.0), (0.3, 2.0), (1.0, 0.5), (0.0, 1.0)])
def test_the_distillation_loss_is_the_hand_computed_mix_of_labels_and_teacher(weight, temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g) * 3
    targets = torch.randint(0, 7, (2, 5), generator=g)
    targets[0, 1] = targets[1, 4] = -1  # positions with no target take no part
    teacher = torch.softmax(torch.randn(2, 5, 7, generator=g) * 2, dim=-1)
    teacher[1, 2] = torch.tensor([0.5, 0.5, 0, 0, 0, 0, 0])  # zeros: 0 log 0 = 0
    got = distillation_loss(logits, targets, teacher, weight, temperature).item()
    assert got == pytest.approx(_hand_loss(logits, targets, teacher, weight, temperature), rel=1e-5, abs=1e-6)
    if weight == 0.0:  # the labels alone: the plain loss
        assert got == pytest.approx(F.cross_entropy(logits.view(-1, 7), targets.view(-1), ignore_index=-1).item(),
                                    rel=1e-6)
    own = torch.softmax(logits / temperature, dim=-1)  # a teacher that agrees adds nothing
    assert distillation_loss(logits, targets, own, 1.0, temperature).item() == pytest.approx(0.0, abs=1e-5)


def test_the_teacher_is_frozen_and_gives_the_mean_of_its_members_probabilities():
    config = tiny_config()
    a, b = GPT(config), GPT(config)
    torch.manual_seed(1)
    for p in b.parameters():
        p.data.add_(0.1 * torch.randn_like(p))
    a.set_dropout(0.5, 0.5)  # what it trained with; a teacher never drops
    teacher = Teacher([a, b], temperature=2.0, cpu_bf16=False)
    x = torch.randint(0, config.vocab_size, (3, 9))
    want = (torch.softmax(a(x) / 2, -1) + torch.softmax(b(x) / 2, -1)) / 2
    assert torch.allclose(teacher.probs(x), want, atol=1e-6)
    # On a CPU with native bf16 the forward runs in bf16: other numbers, the same distribution
    fast = Teacher([a, b], temperature=2.0, cpu_bf16=True).probs(x)
    assert fast.dtype == torch.float32 and not torch.equal(fast, want)
    assert torch.allclose(fast, want, atol=0.02) and torch.allclose(fast.sum(-1), torch.ones(3, 9), atol=1e-5)
    assert torch.equal(teacher.probs(x), teacher.probs(x))  # eval mode: no dropout
    assert not any(p.requires_grad for m in (a, b) for p in m.parameters()) and not a.training
    assert teacher.num_params() == a.num_params() + b.num_params()
    assert [Teacher([a], 1.0, cpu_bf16=bf16).precision(torch.device(kind)) for kind, bf16 in
            (("cpu", False), ("cpu", True), ("cuda", False), ("meta", True))] == ["fp32", "bf16", "bf16", "fp32"]
    # CUDA keeps the trainer's precision context (distributed.autocast_for); the CPU's follows cpu_bf16
    with warnings.catch_warnings():  # torch warns that a CUDA context on a machine without CUDA is off
        warnings.simplefilter("ignore")
        contexts = [Teacher([a], 1.0, cpu_bf16=bf16).autocast(torch.device(kind)) for kind, bf16 in
                    (("cpu", False), ("cpu", True), ("cuda", False))]
    assert [(c.device, c.fast_dtype, c._enabled) for c in contexts[:2]] == [("cpu", torch.bfloat16, False),
                                                                             ("cpu", torch.bfloat16, True)]
    assert contexts[2].device == "cuda"


@pytest.mark.parametrize("caps,native", [({"avx512_bf16": True, "amx_bf16": False}, True),
                                         ({"avx512_bf16": False, "amx_bf16": True}, True),
                                         ({"avx512_bf16": False, "amx_bf16": False, "amx_tile": True}, False),
                                         ({"asimd": True}, False), (None, False)])
def test_the_teacher_runs_in_bf16_only_on_a_cpu_that_multiplies_bf16_in_hardware(monkeypatch, caps, native):
    def query():
        if caps is None:
            raise RuntimeError("no capability query here")
        return caps
    monkeypatch.setattr(torch.cpu, "get_capabilities", query)
    assert native_cpu_bf16() is native and Teacher([], 1.0).cpu_bf16 is native


@pytest.mark.slow
def test_a_teacher_from_other_data_or_another_tokenizer_is_refused(tmp_path, corpus):
    run_train([*ARGS, "--data_dir", corpus, "--workspace", tmp_path, "--max_steps", 4])
    file = ckpt.resolve_serving_checkpoint(tmp_path / "checkpoints/d2", tmp_path)
    meta = ckpt.model_meta(file)
    from experiment.teacher import meta_digest
    member = [{"generation": 1, "file": str(file), "meta_sha256": meta_digest(file)}]
    same = types.SimpleNamespace(meta={"hash": meta["prepared"]["hash"], **meta["tokenizer"]})
    assert Teacher.load(member, same, torch.device("cpu"), 1.0, 32).num_params() > 0
    other_data = types.SimpleNamespace(meta={**same.meta, "hash": "0" * 16})
    with pytest.raises(CheckpointError, match="trained on other data"):
        Teacher.load(member, other_data, torch.device("cpu"), 1.0, 32)
    other_chars = types.SimpleNamespace(meta={**same.meta, "chars": "abc"})
    with pytest.raises(CheckpointError, match="another tokenizer"):
        Teacher.load(member, other_chars, torch.device("cpu"), 1.0, 32)
    with pytest.raises(CheckpointError, match="context 32 is shorter"):
        Teacher.load(member, same, torch.device("cpu"), 1.0, 64)
    with pytest.raises(CheckpointError, match="not the one recorded"):
        Teacher.load([{**member[0], "meta_sha256": "f" * 64}], same, torch.device("cpu"), 1.0, 32)


def _gen(ws: Path, k: int) -> Path:
    return ws / "checkpoints/d2" / f"gen{k}"


def _final(run_dir: Path) -> dict:
    """The best step's weights: all a finished generation keeps (generations.shrink)."""
    return ckpt.load_model_state(run_dir, ckpt.read_best(run_dir)["step"])


def _record(ws: Path) -> dict:
    return json.loads((ws / "checkpoints/d2/generations.json").read_text())


@pytest.mark.slow
def test_two_generations_share_the_budget_distill_the_second_from_the_first_and_serve_the_best(tmp_path, corpus):
    ws = tmp_path / "gens"
    proc = run_train([*ARGS, "--data_dir", corpus, "--workspace", ws, "--generations", 2])
    top = ws / "checkpoints/d2"
    record = _record(ws)
    first, second = record["generations"]
    assert [first["seed"], second["seed"]] == [1337, 1338]
    assert first["budget_seconds"] == pytest.approx(1800)  # an hour over two
    assert second["budget_seconds"] == pytest.approx(3600 - first["used_seconds"])
    assert first["teachers"] == [] and [t["generation"] for t in second["teachers"]] == [1]
    assert second["teachers"][0]["file"] == f"gen1/model_{first['best']['step']:06d}.pt"
    assert all(g["outcome"].startswith("finished") for g in (first, second)), record
    precision = "bf16" if native_cpu_bf16() else "fp32"  # a CPU with native bf16 runs the teacher in it
    assert "teacher | " in (_gen(ws, 2) / "training.log").read_text()
    assert f"| forward in {precision}" in (_gen(ws, 2) / "training.log").read_text()
    assert "teacher | " not in (_gen(ws, 1) / "training.log").read_text()
    top_log = (top / "training.log").read_text()  # one tail -f follows every generation
    assert "teacher | " in top_log and top_log.count("done: step") == 2
    assert (ws / "tensorboard/d2/gen2").is_dir()
    for g in (first, second):  # a finished generation keeps its best step's weights alone (and best.pt)
        assert ckpt.complete_steps(_gen(ws, g["index"])) == [g["best"]["step"]]
        assert not list(_gen(ws, g["index"]).glob("optim_*")) and (_gen(ws, g["index"]) / "best.pt").is_file()
    # served: the generation with the lower val loss, by every way of naming the run
    best_gen = min((first, second), key=lambda g: g["best"]["val_loss"])
    served = ckpt.resolve_serving_checkpoint(top, ws)
    assert served == _gen(ws, best_gen["index"]) / f"model_{best_gen['best']['step']:06d}.pt"
    assert ckpt.resolve_serving_checkpoint(None, ws) == served
    top_best = json.loads((top / "best.json").read_text())
    assert top_best["generation"] == best_gen["index"] and top_best["val_loss"] == best_gen["best"]["val_loss"]
    assert os.path.samefile(top / "best.pt", _gen(ws, best_gen["index"]) / "best.pt")
    report = (top / "report.md").read_text()
    assert f"gen{best_gen['index']} (served)" in report and len(re.findall(r"^\| gen\d", report, re.M)) == 2
    assert f"serving gen{best_gen['index']}" in proc.stdout
    # the launch's last words where ON_EXIT and a sweep read them, and ON_EXIT's best: the served step
    from experiment import onexit
    env = onexit.outcome_env(top, 0)
    assert env["RUN_STATUS"] == "finished" and f"serving gen{best_gen['index']}" in env["RUN_OUTCOME"], env
    assert env["BEST_CHECKPOINT"] == str(served) and env["BEST_EXPORT"] == str(top / "best.pt")
    # The teacher changed what the second generation learned: with weight 0 it is a plain run of its seed,
    # to the bit (the teacher's forward passes touch no random stream and no data).
    run_train([*ARGS, "--data_dir", corpus, "--workspace", tmp_path / "w0", "--generations", 2, "--distill_weight", 0])
    run_train([*ARGS, "--data_dir", corpus, "--workspace", tmp_path / "plain", "--seed", 1338])
    plain, weight0, taught = _final(tmp_path / "plain/checkpoints/d2"), _final(_gen(tmp_path / "w0", 2)), _final(_gen(ws, 2))
    assert all(torch.equal(plain[k], weight0[k]) for k in plain)
    assert not all(torch.equal(plain[k], taught[k]) for k in plain)
    assert all(torch.equal(a, b) for a, b in zip(_final(_gen(ws, 1)).values(), _final(_gen(tmp_path / "w0", 1)).values()))


@pytest.mark.slow
def test_a_student_of_another_depth_learns_from_the_ensemble_and_is_the_model_served(tmp_path, corpus):
    """GENERATIONS=2 STUDENT_DEPTH=1: two d2 generations, then a d1 student whose teacher is both of them
    (a teacher of another depth than its student), served by best.json, best.pt and the done line."""
    ws = tmp_path / "ws"
    proc = run_train([*ARGS, "--data_dir", corpus, "--workspace", ws, "--generations", 2, "--student_depth", 1])
    top = ws / "checkpoints/d2"
    record = _record(ws)
    assert [g.get("depth") for g in record["generations"]] == [None, None, 1]
    assert [t["generation"] for t in record["generations"][2]["teachers"]] == [1, 2]
    assert all(g["outcome"].startswith("finished") for g in record["generations"]), record
    model, _ = ckpt.load_model(ckpt.resolve_serving_checkpoint(top, ws), torch.device("cpu"))
    assert model.config.n_layer == 1 and json.loads((top / "best.json").read_text())["generation"] == 3
    assert os.path.samefile(top / "best.pt", _gen(ws, 3) / "best.pt")
    assert "serving gen3 (the student, d1)" in proc.stdout
    assert "| gen3 (the student, d1) (served) |" in (top / "report.md").read_text()


def _wait_for_second_generation(ws: Path, launch: subprocess.Popen, step: int = 5) -> None:
    """Until the second generation has saved `step` (the launch still running): a kill's moment."""
    deadline = time.time() + 240
    while not (ckpt.complete_steps(_gen(ws, 2)) if _gen(ws, 2).is_dir() else []) or \
            ckpt.complete_steps(_gen(ws, 2))[-1] < step:
        assert launch.poll() is None and time.time() < deadline, f"the second generation never reached step {step}"
        time.sleep(0.01)


@pytest.mark.slow
def test_a_kill_9_in_the_second_generation_resumes_it_and_ends_as_the_uninterrupted_run(tmp_path, corpus):
    args = [*ARGS, "--data_dir", corpus, "--generations", 2, "--save_every_steps", 1]
    run_train([*args, "--workspace", tmp_path / "ref"])
    ws = tmp_path / "killed"
    proc = subprocess.Popen(train_cmd([*args, "--workspace", ws], 1, torchrun=()), cwd=REPO, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_second_generation(ws, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert ckpt.complete_steps(_gen(ws, 2))[-1] < STEPS, "the kill came too late to test anything"
    assert _record(ws)["generations"][1]["outcome"] is None
    before = _record(ws)["generations"][1]
    # other settings on the relaunch change nothing of a generation begun: its record holds its share,
    # teacher and distillation settings
    again = run_train([*args, "--workspace", ws, "--teacher", "ensemble", "--distill_weight", "0.9",
                       "--training_hours", "3"])
    assert _record(ws)["generations"][1] | {"outcome": None, "used_seconds": None, "best": None} == before
    assert "generation 1 of 2" not in again.stdout  # done before the kill: not trained again
    assert "resumed from" in again.stdout and "teacher | " in again.stdout
    for k in (1, 2):
        ref, got = _final(_gen(tmp_path / "ref", k)), _final(_gen(ws, k))
        assert all(torch.equal(ref[n], got[n]) for n in ref), f"gen{k}"
    assert (_gen(ws, 1) / "training.log").read_text().count("done: ") == 1


@pytest.mark.slow
def test_generations_on_two_ranks_keep_one_record_and_a_kill_9_in_the_second_resumes_as_the_uninterrupted_run(
        tmp_path, corpus):
    """The box's way: every generation on every rank (DDP over gloo here). Rank 0 alone writes the
    record, the logs and best.json; a kill -9 of the workers and their agent in the second generation
    resumes it, and both generations end with the weights of an uninterrupted two-rank run."""
    args = [*ARGS, "--data_dir", corpus, "--generations", 2, "--save_every_steps", 1, "--total_batch_size", 256]
    ref = run_train([*args, "--workspace", tmp_path / "ref"], nproc=2)
    record = _record(tmp_path / "ref")
    first, second = record["generations"]
    assert record["world_size"] == 2 and all(g["outcome"].startswith("finished") for g in (first, second)), record
    assert second["teachers"][0]["file"] == f"gen1/model_{first['best']['step']:06d}.pt"
    top = tmp_path / "ref/checkpoints/d2"
    log = (top / "training.log").read_text()
    assert log.count("done: step") == 2 and log.count("teacher | ") == 1, log[-2000:]  # rank 0's lines alone
    assert ref.stdout.count("teacher | ") == 1 and "generation 1 of 2" in ref.stdout
    best_gen = min((first, second), key=lambda g: g["best"]["val_loss"])
    assert json.loads((top / "best.json").read_text())["generation"] == best_gen["index"]
    ws = tmp_path / "killed"
    agent = subprocess.Popen(train_cmd([*args, "--workspace", ws], 2), cwd=REPO, env=ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_second_generation(ws, agent)
    tree = kill_tree(agent.pid)  # the workers too: torchrun starts each in a session of its own
    agent.wait()
    wait_gone(tree)
    assert ckpt.complete_steps(_gen(ws, 2))[-1] < STEPS, "the kill came too late to test anything"
    assert _record(ws)["generations"][1]["outcome"] is None
    again = run_train([*args, "--workspace", ws], nproc=2)
    assert "resumed from" in again.stdout and "generation 1 of 2" not in again.stdout
    for k in (1, 2):
        want, got = _final(_gen(tmp_path / "ref", k)), _final(_gen(ws, k))
        assert all(torch.equal(want[n], got[n]) for n in want), f"gen{k}"


@pytest.mark.slow
def test_a_damaged_teacher_stops_the_resume_with_one_line(tmp_path, corpus):
    args = [*ARGS, "--data_dir", corpus, "--workspace", tmp_path, "--generations", 2]
    run_train(args)
    top = tmp_path / "checkpoints/d2"
    record = _record(tmp_path)
    record["generations"][1]["outcome"] = None  # as if the second generation were cut short before a save
    (top / "generations.json").write_text(json.dumps(record))
    shutil.rmtree(top / "gen2")
    teacher_file = top / record["generations"][1]["teachers"][0]["file"]
    meta = ckpt.meta_path(teacher_file.parent, record["generations"][0]["best"]["step"])
    meta.write_text(meta.read_text() + " ")  # still valid JSON, no longer the meta the record pinned
    proc = run_train(args, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: teacher gen1") and "replaced or damaged" in errors[0], errors
    assert "Traceback" not in proc.stderr + proc.stdout
    # the pre-flight finds it first, before torchrun starts
    from experiment import preflight
    assert preflight.main([*map(str, args)]) == 2


@pytest.mark.slow
def test_a_directory_holds_one_model_or_generations_never_both(tmp_path, corpus, capsys):
    from experiment import preflight, train
    args = [*map(str, ARGS), "--data_dir", str(corpus), "--workspace", str(tmp_path), "--max_steps", "2"]
    assert train.main(args) == 0
    capsys.readouterr()
    assert train.main([*args, "--generations", "2"]) == 2
    assert "holds a one-model run's checkpoints" in capsys.readouterr().err
    assert preflight.main([*args, "--generations", "2"]) == 2
    assert "holds a one-model run's checkpoints" in capsys.readouterr().err
    assert train.main([*args, "--model_tag", "g", "--generations", "2"]) == 0
    capsys.readouterr()
    assert preflight.main([*args, "--model_tag", "g"]) == 2
    assert "is a run of generations (2 begun" in capsys.readouterr().err
    # a relaunch of the finished run: the pre-flight says so and plans no fresh run in its directory
    assert preflight.main([*args, "--model_tag", "g", "--generations", "2"]) == 0
    out = capsys.readouterr().out
    assert "all 2 generations in" in out and "are done" in out and "fresh run" not in out, out
    assert train.main([*args, "--model_tag", "g"]) == 2  # a bare trainer refuses it as well
    assert "is a run of generations (2 begun" in capsys.readouterr().err
    assert train.main([*args, "--model_tag", "g/gen2"]) == 2  # a generation as a model of its own
    assert "is a generation of the run in" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value,says", [("--generations", "0", "--generations must be auto or a number >= 1"),
                                             ("--teacher", "all", "--teacher must be previous or ensemble"),
                                             ("--distill_weight", "1.5", "--distill_weight must lie in [0, 1]"),
                                             ("--distill_temperature", "0", "--distill_temperature must be"),
                                             ("--resume", "12", "each generation has its own steps"),
                                             ("--student_depth", "-1", "--student_depth must be a depth >= 1")])
def test_bad_generation_settings_exit_2_before_any_step(tmp_path, corpus, flag, value, says, capsys):
    from experiment import train
    extra = ["--generations", "2"] if flag != "--generations" else []
    code = train.main([*map(str, ARGS), "--data_dir", str(corpus), "--workspace", str(tmp_path), *extra, flag, value])
    err = capsys.readouterr().err
    assert code == 2 and says in err and err.startswith("error: "), err
    assert not (tmp_path / "checkpoints").exists()


def _fake_generation(top: Path, k: int, step: int, val_loss: float, used: float, depth: int = 2,
                     chain: bool = False) -> dict:
    """gen<k>/ with a best.json and the meta of its best step: what begin() and the winner read."""
    d = top / f"gen{k}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "best.json").write_text(json.dumps({"step": step, "val_loss": val_loss, "weights": "raw"}))
    ckpt.meta_path(d, step).write_text(json.dumps({"step": step, "gen": k, "model_config": {"depth": depth},
                                                   "auto": {"chain": chain}}))
    (d / "best.pt").write_bytes(b"gen%d" % k)
    return {"index": k, "dir": f"gen{k}", "seed": 1337 + k - 1, "budget_seconds": 0.0, "teachers": [],
            "outcome": "finished", "used_seconds": used, "best": json.loads((d / "best.json").read_text())}


@pytest.mark.parametrize("teacher,expected", [("previous", [3]), ("ensemble", [1, 2, 3])])
def test_a_generation_begins_with_its_share_its_seed_and_its_teachers(tmp_path, teacher, expected):
    from experiment import generations
    from experiment.config import TrainConfig
    top = tmp_path / "run"
    done = [_fake_generation(top, 1, 10, 1.5, 100.0), _fake_generation(top, 2, 20, 1.3, 200.0),
            _fake_generation(top, 3, 30, 1.4, 50.0)]
    record = {"generations": [dict(g) for g in done]}
    (top / "generations.json").write_text(json.dumps(record))
    cfg = TrainConfig(generations=5, teacher=teacher, seed=7, training_hours=1000 / 3600, model_tag="run")
    gen_cfg, gen_dir, line = generations.pending(cfg, top)
    g = generations.begin(top, record, 4, cfg, 1000.0)
    assert g["budget_seconds"] == pytest.approx((1000 - 350) / 2) == pytest.approx(gen_cfg.training_hours * 3600)
    assert g["seed"] == gen_cfg.seed == 10 and gen_dir == top / "gen4" and "generation 4 of 5 starts" in line
    assert gen_cfg.model_tag == "run/gen4" and gen_cfg.budget_usd is None
    assert [t["generation"] for t in g["teachers"]] == expected
    # the count the pre-flight's memory check holds beside generation 4 (guards.generations_fit)
    assert generations.teachers_held(4, generations.teacher_kind(cfg, 4, False)) == len(expected)
    assert g["teachers"][-1]["file"] == "gen3/model_000030.pt"
    assert g["teachers"][-1]["meta_sha256"] == hashlib.sha256(ckpt.meta_path(top / "gen3", 30).read_bytes()).hexdigest()
    assert generations.read_record(top)["generations"][3] == g  # written before the generation trains
    short = {"generations": [dict(g) for g in done]}  # 0.5 s left over two generations: none begins
    assert generations.begin(tmp_path, short, 4, cfg, 350.5) is None and not (tmp_path / "generations.json").exists()
    # the winner: gen2, by val loss; best.json and best.pt follow it
    generations.publish_best(top, generations.read_record(top), print)
    assert json.loads((top / "best.json").read_text()) == {**done[1]["best"], "generation": 2, "dir": "gen2"}
    assert (top / "best.pt").read_bytes() == b"gen2" and os.path.samefile(top / "best.pt", top / "gen2/best.pt")
    assert ckpt.generation_winner(top) == top / "gen2"
    generations.publish_best(top, generations.read_record(top), print)  # the same winner again: no temp link left
    assert sorted(p.name for p in top.iterdir() if p.name.startswith(".")) == []
    assert os.path.samefile(top / "best.pt", top / "gen2/best.pt") and os.stat(top / "best.pt").st_nlink == 2
    (top / "gen2/best.pt").unlink()  # the winner without its export: no best.pt of another generation's
    generations.publish_best(top, generations.read_record(top), print)
    assert not (top / "best.pt").exists() and json.loads((top / "best.json").read_text())["generation"] == 2


def test_a_student_comes_after_the_generations_learns_from_all_of_them_at_its_depth_and_is_served(tmp_path):
    """STUDENT_DEPTH: after GENERATIONS=N, one more model at that depth with an equal share, taught by
    the ensemble of every generation before it (whatever TEACHER says), and served even where a larger
    generation's val loss is lower: the user named its size to serve it."""
    from experiment import generations
    from experiment.config import ConfigError, TrainConfig, check_generations
    top = tmp_path / "run"
    done = [_fake_generation(top, 1, 10, 1.5, 100.0), _fake_generation(top, 2, 20, 1.3, 200.0)]
    record = {"generations": [dict(g) for g in done]}
    (top / "generations.json").write_text(json.dumps(record))
    cfg = TrainConfig(generations=2, student_depth=1, depth=4, teacher="previous", training_hours=1000 / 3600,
                      model_tag="run", distill_temperature=2.0)
    assert generations.ahead(dataclasses.replace(cfg, generations=3, teacher="ensemble"), top) == [(3, False, 2),
                                                                                                  (4, True, 3)]
    gen_cfg, gen_dir, line = generations.pending(cfg, top)
    assert gen_dir == top / "gen3" and "generation 3 of 3 (the student, d1) starts" in line and gen_cfg.depth == 1
    assert gen_cfg.attn_dropout == 0.0 and "attention dropout 0 (the student's)" in line  # the pre-flight's view
    g = generations.begin(top, record, 3, cfg, 1000.0)
    assert g["student"] and g["depth"] == 1 and g["teacher"] == "ensemble"
    assert [t["generation"] for t in g["teachers"]] == [1, 2] and g["budget_seconds"] == pytest.approx(700)
    # the count the pre-flight's check and the plan's student line hold beside it
    assert generations.teachers_held(3, generations.teacher_kind(cfg, 3, True)) == 2
    # what is left to train (the pre-flight's checks): the begun student, with both; one more
    # generation before it with three; one model alone
    assert generations.ahead(cfg, top) == [(3, True, 2)]
    assert generations.ahead(dataclasses.replace(cfg, generations=1, student_depth=None), tmp_path) == [(1, False, 0)]
    assert generations.generation_config(cfg, g).depth == 1
    # the student trains without attention dropout unless ATTN_DROPOUT is given; a generation by regime
    assert generations.generation_config(cfg, g).attn_dropout == 0.0
    assert generations.generation_config(cfg, {**done[1], "distill": None}).attn_dropout is None
    assert generations.generation_config(dataclasses.replace(cfg, attn_dropout=0.1), g).attn_dropout == 0.1
    before = {k: v for k, v in g.items() if k != "attn_dropout"}  # a student begun before the rule: as it began
    assert generations.generation_config(cfg, before).attn_dropout is None
    # one given at the launch that begins the student is recorded: a relaunch without it keeps it
    given_record = generations.student_fields(dataclasses.replace(cfg, attn_dropout=0.2))
    assert generations.generation_config(cfg, {**g, **given_record}).attn_dropout == 0.2
    assert generations.generation_config(cfg, {**done[1], "distill": None}).depth == 4  # the run's depth
    # DISTILL_WEIGHT=auto: the student learns from the ensemble alone, a generation half from the labels;
    # one given is every generation's; a begun generation keeps the weight it recorded
    assert g["distill"] == [1.0, 2.0] and gen_cfg.distill_weight == 1.0
    assert generations.generation_config(cfg, g).distill_weight == 1.0
    assert generations.generation_config(cfg, {**done[1], "distill": None}).distill_weight == 0.5
    given = dataclasses.replace(cfg, distill_weight=0.7)
    assert [generations.distill_weight(given, student) for student in (False, True)] == [0.7, 0.7]
    assert generations.generation_config(given, g).distill_weight == 1.0
    assert generations.generation_config(given, {**done[1], "distill": None}).distill_weight == 0.7
    # the first of three equal shares, the student's counted
    assert generations.share({"generations": []}, 1, cfg, 900.0) == pytest.approx(300)
    assert generations.winner(generations.read_record(top))["index"] == 2  # the student has no best yet
    g.update(outcome="finished", best={"step": 5, "val_loss": 1.45, "weights": "raw"})
    assert generations.winner({"generations": [*done, g]})["index"] == 3  # 1.45 over gen2's 1.3: still served
    assert ckpt.generation_winner(top) == top / "gen2"  # no best.json yet: the student has no best either
    (top / "gen3").mkdir()
    (top / "gen3/best.json").write_text(json.dumps(g["best"]))
    assert ckpt.generation_winner(top) == top / "gen3"  # the student with a best, as winner() says
    # The begun student is the run's last model: a relaunch with another count or depth is refused.
    for other in (dict(generations=3), dict(student_depth=2), dict(generations="auto", student_depth=0)):
        with pytest.raises(ConfigError, match=r"student \(gen3, d1\) has begun.*GENERATIONS=2 STUDENT_DEPTH=1"):
            generations.pending(dataclasses.replace(cfg, **other), top)
    generations.pending(cfg, top)  # the same settings resume it
    # a student begun after GENERATIONS=8 sits where auto's would (the ninth): auto does not resume it
    eight = tmp_path / "eight"
    eight.mkdir()
    gens = [{"index": k, "outcome": "finished"} for k in range(1, 9)] + [{"index": 9, "outcome": None, "student": True,
                                                                          "depth": 1}]
    (eight / "generations.json").write_text(json.dumps({"generations": gens}))
    with pytest.raises(ConfigError, match=r"student \(gen9, d1\) has begun.*GENERATIONS=8 STUDENT_DEPTH=1"):
        generations.check_student(generations.read_record(eight), dataclasses.replace(cfg, generations="auto"))
    generations.check_student(generations.read_record(eight), dataclasses.replace(cfg, generations=8))
    with pytest.raises(ConfigError, match=r"GENERATIONS=8 STUDENT_DEPTH=1"):  # fewer generations than it followed
        generations.check_student(generations.read_record(eight), dataclasses.replace(cfg, generations=7))
    check_generations(TrainConfig(generations="auto", student_depth=1))  # after the auto chain
    for bad in (dict(generations=1), dict(student_depth=-2)):
        with pytest.raises(ConfigError, match="--student_depth"):
            check_generations(TrainConfig(**{"generations": 2, "student_depth": 1, **bad}))


def test_auto_gives_the_first_generation_the_whole_budget_and_another_while_enough_is_left(tmp_path):
    from experiment import generations
    from experiment.config import TrainConfig
    from experiment.stopping import MAX_STEPS_OUTCOME
    cfg = TrainConfig(generations="auto", training_hours=600 / 3600, model_tag="run")
    assert generations.share({"generations": []}, 1, cfg, 600.0) == 600.0
    first = {"used_seconds": 330.0, "outcome": "finished: the val loss stopped improving"}
    assert generations.share({"generations": [first]}, 2, cfg, 600.0) == pytest.approx(270.0)
    # 0.4 of the first's 330 s is 132 s: 130 s left begins none, 133 s does
    second = {"used_seconds": 140.0, "outcome": "finished: the budget is spent"}
    assert generations.share({"generations": [first, second]}, 3, cfg, 600.0) is None
    assert generations.share({"generations": [first, second]}, 3, cfg, 603.0) == pytest.approx(133.0)
    assert generations.share({"generations": [{**first, "outcome": MAX_STEPS_OUTCOME}]}, 2, cfg, 600.0) is None
    assert generations.count(cfg) == generations.AUTO_MAX_GENERATIONS
    top = tmp_path / "run"
    top.mkdir()
    gen_cfg, gen_dir, line = generations.pending(cfg, top)
    assert gen_dir == top / "gen1" and gen_cfg.training_hours == cfg.training_hours
    assert "generation 1 (GENERATIONS=auto) starts" in line and "600s of the budget" in line


def test_auto_begins_a_generation_after_one_that_stopped_at_its_val_minimum_with_budget_left(tmp_path):
    """run_all under auto, each generation's training replaced by what it leaves behind."""
    from experiment import generations
    from experiment.config import TrainConfig
    from experiment.distributed import Dist
    from experiment.runlog import RunLog
    from experiment.stopping import MAX_STEPS_OUTCOME
    top = tmp_path / "run"
    ends = {1: ("finished: the val loss stopped improving ...", 330.0, 1.46),
            2: ("finished: the budget is spent", 265.0, 1.43)}
    calls = []

    def run_one(cfg, d, workspace, gen_dir, log, launched, teachers):
        k = int(gen_dir.name[3:])
        calls.append((k, cfg.training_hours * 3600, [t["generation"] for t in teachers], cfg.seed))
        outcome, used, loss = ends[k]
        made = _fake_generation(top, k, 10 * k, loss, used)
        return 0, outcome, made["used_seconds"]

    cfg = TrainConfig(generations="auto", training_hours=600 / 3600, model_tag="run", seed=5)
    d = Dist(0, 0, 1, torch.device("cpu"))
    assert generations.run_all(cfg, d, tmp_path, top, RunLog(None), time.time(), run_one) == 0
    assert [(k, round(s, 6), t, seed) for k, s, t, seed in calls] == [(1, 600.0, [], 5), (2, 270.0, [1], 6)]
    record = generations.read_record(top)
    assert [g["used_seconds"] for g in record["generations"]] == [330.0, 265.0]  # 5 s left: no third
    assert json.loads((top / "best.json").read_text())["generation"] == 2
    assert "| gen2 (served) |" in (top / "report.md").read_text()
    # a first generation that MAX_STEPS ended is the last, budget left or not
    ends[1] = (MAX_STEPS_OUTCOME, 100.0, 1.5)
    calls.clear()
    shutil.rmtree(top)
    assert generations.run_all(cfg, d, tmp_path, top, RunLog(None), time.time(), run_one) == 0
    assert [k for k, *_ in calls] == [1]


def test_under_auto_a_student_trains_after_the_chain_on_its_reserve_and_what_the_chain_left(tmp_path):
    """GENERATIONS=auto STUDENT_DEPTH: the chain's generations share the budget less STUDENT_RESERVE;
    when the next would get too little, the student trains on the rest, taught by the ensemble of the
    whole chain, as GENERATIONS=N's student would (no chain pass cap); nothing trains after it, and a
    relaunch with another setting is refused."""
    from experiment import generations
    from experiment.config import ConfigError, TrainConfig
    from experiment.distributed import Dist
    from experiment.runlog import RunLog
    from experiment.stopping import MAX_STEPS_OUTCOME
    top = tmp_path / "run"
    ends = {1: ("finished: the val loss stopped improving ...", 300.0, 1.46),
            2: ("finished: the budget is spent", 140.0, 1.43), 3: ("finished: the budget is spent", 160.0, 1.40)}
    calls = []

    def run_one(cfg, d, workspace, gen_dir, log, launched, teachers):
        k = int(gen_dir.name[3:])
        calls.append((k, round(cfg.training_hours * 3600, 6), [t["generation"] for t in teachers], cfg.depth,
                       cfg.distill_weight, cfg.generations))
        outcome, used, loss = ends[k]
        return 0, outcome, _fake_generation(top, k, 10 * k, loss, used)["used_seconds"]

    cfg = TrainConfig(generations="auto", student_depth=2, depth=4, training_hours=600 / 3600, model_tag="run")
    assert generations.count(cfg) == generations.AUTO_MAX_GENERATIONS + 1
    assert generations.ahead(cfg, top)[0] == (1, False, 0)
    d = Dist(0, 0, 1, torch.device("cpu"))
    assert generations.run_all(cfg, d, tmp_path, top, RunLog(None), time.time(), run_one) == 0
    # 600 s, 150 of them the student's: gen1 450; gen2 the 150 gen1 left (>= 0.4 x 300); then 10 s
    # would be left to a third: the student gets them and its 150
    assert calls == [(1, 450.0, [], 4, 0.5, "auto"), (2, 150.0, [1], 4, 0.5, "auto"), (3, 160.0, [1, 2], 2, 1.0, 2)]
    record = generations.read_record(top)
    assert record["generations"][2]["student"] and record["generations"][2]["auto"]
    assert record["generations"][2]["attn_dropout"] == 0.0
    assert json.loads((top / "best.json").read_text())["generation"] == 3  # the student is served
    gen_cfg, gen_dir, line = generations.pending(cfg, top)
    assert gen_cfg is None and "its student (the last model) has trained" in line
    assert generations.run_all(cfg, d, tmp_path, top, RunLog(None), time.time(), run_one) == 0 and len(calls) == 3
    for other in (dict(generations=2), dict(generations=8), dict(student_depth=3), dict(student_depth=0)):
        with pytest.raises(ConfigError, match=r"student \(gen3, d2\) has begun.*GENERATIONS=auto STUDENT_DEPTH=2"):
            generations.pending(dataclasses.replace(cfg, **other), top)
    assert generations.ahead(cfg, top) == []  # nothing after the student
    # the pre-flight's look at a run killed in gen2: what the chain leaves is not known yet, so
    # the student is taken as the last it may be
    running = {"generations": [record["generations"][0], {**record["generations"][1], "outcome": None,
                                                          "used_seconds": None}]}
    (top / "generations.json").write_text(json.dumps(running))
    assert generations.ahead(cfg, top) == [(2, False, 1), *((k, False, 1) for k in range(3, 9)), (9, True, 8)]
    # ... and at a run whose chain has ended: the student is next, with every generation
    record["generations"] = record["generations"][:2]
    (top / "generations.json").write_text(json.dumps(record))
    assert generations.ahead(cfg, top) == [(3, True, 2)]
    gen_cfg, gen_dir, line = generations.pending(cfg, top)
    assert "generation 3 (GENERATIONS=auto) (the student, d2) starts" in line and gen_cfg.depth == 2
    assert gen_cfg.training_hours * 3600 == pytest.approx(160.0) and gen_cfg.generations == 2
    # the record decides for a begun generation, whatever the budget now says: none of three begun
    # chain generations is the student, even on a budget that would leave the chain no share
    three = {"generations": [{"used_seconds": 300.0, "outcome": "finished"}] * 3}
    assert not any(generations.is_student(three, k, cfg, 300.0) for k in (1, 2, 3))
    # a chain that ended after its first: the student is the second
    one = {"generations": [{"used_seconds": 440.0, "outcome": "finished: the val loss stopped improving"}]}
    assert generations.is_student(one, 2, cfg, 600.0) and not generations.is_student(one, 2, cfg, 1200.0)
    # the pre-flight's look: after gen1 the chain goes on (its budget in seconds); a begun student is
    # the student while it runs
    (top / "generations.json").write_text(json.dumps({"generations": [record["generations"][0]]}))
    assert generations.ahead(cfg, top)[0] == (2, False, 1)
    begun = {"index": 3, "student": True, "depth": 2, "auto": True, "outcome": None, "used_seconds": None}
    (top / "generations.json").write_text(json.dumps({"generations": [*record["generations"], begun]}))
    assert generations.ahead(cfg, top) == [(3, True, 2)]
    (top / "generations.json").write_text(json.dumps(record))
    # the chain ends after 8 generations, and after one that MAX_STEPS ended (the last, not the first)
    eight_done = {"generations": [{"used_seconds": 10.0, "outcome": "finished"}] * 8}
    assert generations.chain_share(eight_done, 8, cfg, 6000.0) is not None
    assert generations.chain_share(eight_done, 9, cfg, 6000.0) is None
    assert generations.is_student(eight_done, 9, cfg, 6000.0)
    bounded = {"generations": [{"used_seconds": 10.0, "outcome": "finished"},
                               {"used_seconds": 10.0, "outcome": MAX_STEPS_OUTCOME}]}
    assert generations.chain_share(bounded, 3, cfg, 6000.0) is None
    # a student with under a second left is not begun (a relaunch on a smaller budget)
    spent = {"generations": [{"used_seconds": 599.5, "outcome": "finished: the budget is spent"}]}
    assert generations.is_student(spent, 2, cfg, 600.0) and generations.share(spent, 2, cfg, 600.0) is None
    assert generations.share(spent, 2, cfg, 601.0) == pytest.approx(1.5)
    # without STUDENT_DEPTH the same chain takes all 600 s and the third would get 160 s (>= 120)
    plain = dataclasses.replace(cfg, student_depth=0)
    assert generations.share(record, 3, plain, 600.0) == pytest.approx(160.0)
    assert not generations.is_student(record, 3, plain, 600.0)


@pytest.mark.parametrize("generations,depth,teacher,chained,later", [
    ("auto", "auto", "previous", True, 6), ("auto", "auto", "previous", False, "auto"),
    ("auto", "auto", "ensemble", True, "auto"), ("auto", 4, "previous", False, 4), (3, "auto", "previous", True, "auto")])
def test_under_generations_and_depth_auto_later_generations_take_the_first_ones_depth(tmp_path, generations, depth,
                                                                                      teacher, chained, later):
    """GENERATIONS=auto with DEPTH=auto and TEACHER=previous: generation 1 is sized for the chain
    (DEPTH=auto, GENERATION_PASSES; its meta says "chain"), each later one trains at its depth, recorded
    when it begins (a resume keeps it) and shown by the pre-flight. A first generation not sized for
    the chain (a run begun before the rule, or where no depth made the passes), TEACHER=ensemble, an
    explicit DEPTH and GENERATIONS=N (equal shares) leave each later generation sized for its own."""
    from experiment import generations as gens
    from experiment.config import TrainConfig
    from experiment.distributed import Dist
    top, depths, lines = tmp_path / "run", [], []

    def run_one(cfg, d, workspace, gen_dir, log, launched, teachers):
        depths.append(cfg.depth)
        if gen_dir.name != "gen1":
            return 0, "stopped: a signal", 0.0  # generation 2 begun, not done: a relaunch resumes it
        _fake_generation(top, 1, 10, 1.5, 330.0, depth=6 if cfg.depth == "auto" else cfg.depth, chain=chained)
        return 0, "finished: the val loss stopped improving", 330.0

    cfg = TrainConfig(generations=generations, depth=depth, teacher=teacher, training_hours=600 / 3600,
                      model_tag="run")
    launch = lambda: gens.run_all(cfg, Dist(0, 0, 1, torch.device("cpu")), tmp_path, top, lines.append, time.time(),
                                  run_one)
    assert launch() == 0 and depths == [depth, later]
    assert gens.read_record(top)["generations"][1].get("depth") == (6 if later == 6 else None)
    gen_cfg, gen_dir, line = gens.pending(cfg, top)
    assert gen_dir == top / "gen2" and gen_cfg.depth == later and "generation 2" in line
    assert launch() == 0 and depths == [depth, later, later]  # the resume keeps it
    assert any(f"generation 2 {gens.of(cfg)} | d6, the first's |" in x for x in lines) == (later == 6), lines
    # only the first generation of the chain is sized for it (the trainer and the pre-flight ask this)
    first = gens.generation_config(cfg, gens.read_record(top)["generations"][0])
    assert gens.sizes_chain(first) == (generations == "auto" and teacher == "previous" and depth == "auto")
    assert not gens.sizes_chain(gen_cfg)
    built = lambda *parts: "".join(parts)  # settings from the environment are strings built at run time
    assert gens.chained(TrainConfig(generations=built("au", "to"), depth=built("au", "to"), teacher=built("pre", "vious")))
    if later == 6:  # gen3 takes gen2's recorded depth; a first generation whose best meta is broken is said
        gen2 = {**gens.read_record(top)["generations"][1], "outcome": "finished"}
        assert gens.chain_depth(top, [gens.read_record(top)["generations"][0], gen2], cfg) == {"depth": 6}
        # the latest generation's recorded depth, not the second's; one with none recorded asks the first's meta
        assert gens.chain_depth(top, [gens.read_record(top)["generations"][0], gen2, {**gen2, "depth": 8}],
                                cfg) == {"depth": 8}
        unrecorded = {k: v for k, v in gen2.items() if k != "depth"} | {"best": None}
        assert gens.chain_depth(top, [gens.read_record(top)["generations"][0], unrecorded], cfg) == {"depth": 6}
        meta = ckpt.meta_path(top / "gen1", 10)
        meta.write_text(json.dumps({"step": 10, "auto": {"chain": True}}))
        with pytest.raises(CheckpointError, match="meta_000010.json: no model depth"):
            gens.chain_depth(top, gens.read_record(top)["generations"][:1], cfg)
        meta.unlink()
        with pytest.raises(CheckpointError, match="meta_000010.json: cannot read"):
            gens.chain_depth(top, gens.read_record(top)["generations"][:1], cfg)
        assert gens.chain_depth(top, [{**gens.read_record(top)["generations"][0], "best": None}], cfg) == {}


def test_a_finished_generation_keeps_its_best_weights_and_a_relaunch_finishes_a_cut_short_shrink(tmp_path):
    """generations.shrink: the best step's model files and meta, best.pt; a kill between the record
    and the shrink (or inside it) is made up by the next launch's refresh; nothing goes while best.json
    names no complete step (a teacher must stay loadable)."""
    from experiment import generations
    gen = tmp_path / "run/gen1"

    def step(k: int, complete: bool = True):
        gen.mkdir(parents=True, exist_ok=True)
        ckpt.model_path(gen, k).write_bytes(b"m" * 10)
        ckpt.optim_path(gen, k, 0).write_bytes(b"o" * 40)
        if complete:
            ckpt.meta_path(gen, k).write_text(json.dumps({"step": k}))

    for k in (4, 8, 12):
        step(k)
    step(16, complete=False)  # a save a kill cut short
    (gen / "best.pt").write_bytes(b"export")
    lines = []
    generations.shrink(gen, lines.append)  # no best.json: nothing can name the step to keep
    assert ckpt.complete_steps(gen) == [4, 8, 12] and not lines
    (gen / "best.json").write_text(json.dumps({"step": 8, "val_loss": 1.0}))
    record = {"generations": [{"index": 1, "dir": "gen1", "seed": 1, "budget_seconds": 9.0, "teachers": [],
                               "outcome": "finished: the budget is spent", "used_seconds": 9.0,
                               "best": {"step": 8, "val_loss": 1.0}}]}
    (tmp_path / "run/generations.json").write_text(json.dumps(record))
    generations.refresh(tmp_path / "run", lines.append)  # a relaunch after a kill before the shrink
    assert ckpt.complete_steps(gen) == [8] and sorted(p.name for p in gen.iterdir()) == [
        "best.json", "best.pt", "meta_000008.json", "model_000008.pt"]
    assert "gen1 done: 2 step(s) and the best step's optimizer state pruned" in lines[-1]
    generations.refresh(tmp_path / "run", lines.append)  # again: nothing left to do, nothing said
    assert len([x for x in lines if "pruned" in x]) == 1


def test_a_run_of_generations_on_a_dollar_budget_keeps_its_gpu_count():
    from experiment import generations
    from experiment.config import ConfigError, TrainConfig
    record = {"generations": [], "world_size": 8}
    dollars, hours = TrainConfig(generations="auto", budget_usd=100.0), TrainConfig(generations="auto")
    with pytest.raises(ConfigError, match="began on 8 GPU\\(s\\) with BUDGET_USD"):
        generations.check_world(record, dollars, 4)
    generations.check_world(record, dollars, 8)
    generations.check_world(record, hours, 4)  # hours are hours on any count
    generations.check_world({"generations": []}, dollars, 4)  # none begun yet


@pytest.mark.slow
def test_a_launch_with_generations_auto_trains_in_gen1_and_serves_it(tmp_path, corpus):
    from experiment import train
    args = [*map(str, ARGS), "--data_dir", str(corpus), "--workspace", str(tmp_path), "--generations", "auto",
            "--max_steps", "4"]
    assert train.main(args) == 0
    top = tmp_path / "checkpoints/d2"
    assert [g["outcome"] for g in _record(tmp_path)["generations"]] == ["finished: max_steps reached"]
    assert ckpt.generation_winner(top) == top / "gen1" and (top / "best.pt").is_file()
    assert not ckpt.complete_steps(top)  # the steps are gen1's


@pytest.mark.slow
def test_a_stop_signal_in_a_generations_final_eval_ends_the_launch_there(tmp_path, corpus, monkeypatch, capsys):
    """A SIGTERM after the loop's last decision (its final eval) is a stop: the next generation does not
    begin in a launch that is being stopped, the run directory records the stop for ON_EXIT, and the
    same command then goes on."""
    from experiment import onexit, train
    final_eval = train.maybe_eval

    def signalled(t, loop):
        if loop.end is not None and t.run_dir.name == "gen1":
            os.kill(os.getpid(), signal.SIGTERM)
        return final_eval(t, loop)

    monkeypatch.setattr(train, "maybe_eval", signalled)
    args = [*map(str, ARGS), "--data_dir", str(corpus), "--workspace", str(tmp_path), "--generations", "2",
            "--max_steps", "4"]
    assert train.main(args) == 0
    top = tmp_path / "checkpoints/d2"
    assert [g["outcome"] for g in _record(tmp_path)["generations"]] == [None]
    assert onexit.outcome_env(top, 0)["RUN_STATUS"] == "stopped"
    monkeypatch.setattr(train, "maybe_eval", final_eval)
    capsys.readouterr()
    assert train.main(args) == 0
    assert [g["outcome"] is not None for g in _record(tmp_path)["generations"]] == [True, True]
    assert onexit.outcome_env(top, 0)["RUN_STATUS"] == "finished"


@pytest.mark.slow
def test_the_setup_of_a_generation_after_another_in_one_launch_counts_in_its_budget(tmp_path, corpus, monkeypatch):
    from experiment import train
    from experiment.teacher import Teacher
    load = Teacher.load.__func__

    def slow_load(cls, *a, **kw):
        time.sleep(3)
        return load(cls, *a, **kw)

    monkeypatch.setattr(Teacher, "load", classmethod(slow_load))
    assert train.main([*map(str, ARGS), "--data_dir", str(corpus), "--workspace", str(tmp_path), "--generations", "2",
                       "--max_steps", "4"]) == 0
    used = {k: ckpt.read_meta(_gen(tmp_path, k), 4)["state"]["used_seconds"] for k in (1, 2)}
    assert used[1] < 3 <= used[2], used
