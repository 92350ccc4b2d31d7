"""SWEEP: several runs side by side from one launcher command, their table and winner, a failing
member, a second sweep refused, and the same command after a kill."""

import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from conftest import ENV, REPO, TINY, kill_tree, run_train, wait_gone, write_corpus

from experiment import checkpoint as ckpt
from experiment import sweep

# The trainer's tiny shape (conftest.TINY) as settings every member shares.
TINY_ENV = {"ASPECT_RATIO": "32", "HEAD_DIM": "32", "MAX_SEQ_LEN": "32", "DEVICE_BATCH_SIZE": "4",
            "SAMPLE_TOKENS": "0", "EVAL_TOKENS": "512", "ATTN_DROPOUT": "0", "AVERAGE": "none",
            "TOTAL_BATCH_SIZE": "256", "EVAL_EVERY_STEPS": "3", "SAVE_EVERY_STEPS": "3", "MAX_RESTARTS": "0"}


def launch(tmp_path, members: str, extra=None, wait=True):
    env = {**ENV, **TINY_ENV, "WORKSPACE": str(tmp_path / "ws"), "DATA_DIR": str(tmp_path / "corpus"),
           "SWEEP": members, "TRAINING_HOURS": "1", **(extra or {})}
    cmd = ["bash", str(REPO / "experiment" / "run.sh")]
    if not wait:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def test_members_parse_to_settings_and_tags_and_the_budget_counts_the_box():
    members = sweep.parse_members("DEPTH=8 DEPTH=12+WEIGHT_DECAY=0.2")
    assert members == [{"DEPTH": "8"}, {"DEPTH": "12", "WEIGHT_DECAY": "0.2"}]
    assert [sweep.member_tag(m) for m in members] == ["d8", "d12-weight_decay0.2"]
    assert sweep.member_tag({"EVAL_METRIC": "/a b/m.py:f"}) == "eval_metric_a_b_m.py_f"
    for text, message in (("DEPTH=8 NOPE=1", "NOPE is no setting"), ("DEPTH8", "'DEPTH8' is not KEY=VALUE"),
                          ("DEPTH=8 DEPTH=8", "two members are the same"), ("", "SWEEP is empty"),
                          ("MODEL_TAG=x", "MODEL_TAG is the sweep's to set")):
        with pytest.raises(sweep.SweepError, match=message):
            sweep.parse_members(text)
    # $1000 on 8 GPUs at $4: 31.25 h of the box; TRAINING_HOURS is the box's wall clock
    assert sweep.box_hours({"BUDGET_USD": "1000"}, 8, True) == 31.25
    assert sweep.box_hours({"BUDGET_USD": "100", "GPU_HOURLY_USD": "2"}, 1, False) == 50
    assert sweep.box_hours({"TRAINING_HOURS": "3"}, 8, True) == 3
    with pytest.raises(sweep.SweepError, match="both set"):
        sweep.box_hours({"BUDGET_USD": "1", "TRAINING_HOURS": "1"}, 1, False)
    # SWEEP_ENSEMBLE_TOKENS
    assert sweep.parse_ensemble_tokens({}) == sweep.ENSEMBLE_TOKENS == 1 << 20
    assert sweep.parse_ensemble_tokens({"SWEEP_ENSEMBLE_TOKENS": ""}) == 1 << 20  # set empty: the default
    assert [sweep.parse_ensemble_tokens({"SWEEP_ENSEMBLE_TOKENS": v}) for v in ("0", "512")] == [0, 512]
    for bad in ("1e6", "x", " 5"):
        with pytest.raises(sweep.SweepError, match="a number of val tokens, 0 for none"):
            sweep.parse_ensemble_tokens({"SWEEP_ENSEMBLE_TOKENS": bad})


def test_a_sweep_that_would_leave_paid_gpus_idle_is_refused_with_the_dollars(tmp_path, monkeypatch):
    # The README's old example: 3 members on 8 GPUs, $1000 at $4: 31.25 h of the box, 5 GPUs idle
    words = sweep.idle_gpus(3, 8, 8, 31.25, 4.0)
    assert "leave 156.2 of the 250.0 GPU-hours idle ($625 of $1,000)" in words and "a multiple of 8 members" in words
    assert "rent 3 GPU(s)" in words and "rent 5 GPU(s)" in sweep.idle_gpus(10, 8, 8, 31.25, 4.0)
    assert sweep.idle_gpus(8, 8, 8, 31.25, 4.0) is None and sweep.idle_gpus(16, 8, 8, 31.25, 4.0) is None
    assert "leave 93.8 of the 250.0 GPU-hours idle" in sweep.idle_gpus(10, 8, 8, 31.25, 4.0)  # a last wave of 2
    assert "($500 of $1,000)" in sweep.idle_gpus(8, 4, 8, 31.25, 4.0)  # SWEEP_PARALLEL=4: 4 GPUs never used
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    env = {"SWEEP": "DEPTH=32 DEPTH=24 DEPTH=40", "BUDGET_USD": "1000", "WORKSPACE": str(tmp_path)}
    with pytest.raises(sweep.SweepError, match=r"\$625 of \$1,000"):
        sweep.setup(env, print)
    assert not (tmp_path / "checkpoints").exists()  # refused before the sweep's directory and lock


@pytest.mark.slow(seconds=61)
def test_a_sweep_trains_its_members_side_by_side_reports_a_winner_and_a_failing_member(tmp_path):
    write_corpus(tmp_path)
    bad = tmp_path / "bad_metric.py"
    bad.write_text("def f(generate, tokenizer):\n    raise ValueError('broken')\n")  # fails in the trainer, past the pre-flight
    members = f"DEPTH=1+SEED=3 DEPTH=2+SEED=3 DEPTH=2+EVAL_METRIC={bad}:f"
    marker = tmp_path / "on_exit.txt"
    on_exit = f'echo "$RUN_STATUS $BEST_VAL_LOSS $RUN_DIR" >> {marker}'
    proc = launch(tmp_path, members, {"MAX_STEPS": "6", "SWEEP_PARALLEL": "2", "ON_EXIT": on_exit,
                                      "SWEEP_ENSEMBLE_TOKENS": "512"})  # the trainer's own eval windows
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # a member failed
    sweep_dir = tmp_path / "ws/checkpoints/sweep"
    record = json.loads((sweep_dir / "sweep.json").read_text())
    rows = {r["member"]: r for r in record["members"]}
    good = [rows["d1-seed3"], rows["d2-seed3"]]
    assert [r["status"] for r in good] == ["finished", "finished"]
    assert all(r["outcome"] == "finished: max_steps reached" for r in good)
    failed = rows[sweep.member_tag({"DEPTH": "2", "EVAL_METRIC": f"{bad}:f"})]
    assert failed["status"] == "failed" and failed["val_loss"] is None
    assert record["winner"] == min(good, key=lambda r: r["val_loss"])["member"]
    best = rows[record["winner"]]
    assert best["val_loss"] == ckpt.read_best(sweep_dir / record["winner"])["val_loss"] and best["passes"] > 0
    assert best["usd"] == pytest.approx(best["hours"] * 4.0) and best["hours"] > 0  # GPU_HOURLY_USD's default
    # the box's hour, less 1% kept for scoring the members once they end, over 2 waves
    assert "3 members in" in proc.stdout and "2 at a time (CPU) | 2 wave(s) of 0.495 h each | 0.010 h kept for " \
        "scoring them" in proc.stdout
    table = (sweep_dir / "sweep.md").read_text()
    assert f"| {record['winner']} **winner** |" in table and "| failed |" in table and table in proc.stdout + "\n"
    # The ensemble of the two finished members, on the windows the trainer evaluated (EVAL_TOKENS=512):
    # each member's loss there is its served val loss, and the mean of two members' probabilities is
    # never worse than their mean loss (Jensen), nor equal to the best member's.
    e = record["ensembles"]
    assert e["tokens"] == 512 and [m["loss"] for m in e["members"]] == pytest.approx(
        sorted(r["val_loss"] for r in good), abs=1e-4)
    [pair] = e["ensembles"]
    assert pair["k"] == 2 and pair["loss"] < sum(r["val_loss"] for r in good) / 2 and pair["loss"] != e["members"][0]["loss"]
    assert pair["gain"] == pytest.approx(pair["loss"] - e["members"][0]["loss"])
    assert f"| best 2 | {record['winner']} " in table and f"| {pair['loss']:.4f} | {pair['gain']:+.4f} |" in table
    # what the scoring took, in seconds and at the box's rate (CPU: one "GPU" at GPU_HOURLY_USD's $4)
    scored = record["scoring"]
    assert 0 < scored["seconds"] < 60 and scored["usd"] == pytest.approx(scored["seconds"] / 3600 * 4.0)
    assert scored["kept"] == pytest.approx(36.0) and f"scoring after the members: {scored['seconds']:,.1f} s" in table
    # ON_EXIT once, for the sweep, with the winner's loss
    assert marker.read_text() == f"failed {best['val_loss']:.6f} {sweep_dir}\n"
    # serve and sample given the sweep directory use the winner's best
    assert ckpt.resolve_serving_checkpoint(sweep_dir, tmp_path) == ckpt.resolve_serving_checkpoint(
        sweep_dir / record["winner"], tmp_path)
    # The same command again: the finished members are skipped, the failed one is tried again.
    again = launch(tmp_path, members, {"MAX_STEPS": "6", "SWEEP_PARALLEL": "2", "SWEEP_ENSEMBLE_TOKENS": "0"})
    assert again.returncode == 1 and "d1-seed3 started" not in again.stdout and "d2-seed3 started" not in again.stdout
    assert "ensembles" not in json.loads((sweep_dir / "sweep.json").read_text())  # 0: none measured
    assert f"{failed['member']} started on CPU" in again.stdout


@pytest.mark.slow
def test_a_bad_member_stops_the_sweep_before_any_member_starts_and_a_second_sweep_is_refused(tmp_path):
    write_corpus(tmp_path)
    proc = launch(tmp_path, "DEPTH=2 DEPTH=2+MAX_SEQ_LEN=30", {"MAX_STEPS": "6"})
    assert proc.returncode == 2 and "started on" not in proc.stdout
    assert "error: member d2-max_seq_len30 (DEPTH=2 MAX_SEQ_LEN=30): --total_batch_size 256 is not a multiple" \
        in proc.stderr, proc.stderr
    assert not list((tmp_path / "ws/checkpoints/sweep").rglob("model_*.pt"))
    held = open(tmp_path / "ws/checkpoints/sweep" / sweep.LOCK, "a+")
    import fcntl
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    proc = launch(tmp_path, "DEPTH=2", {"MAX_STEPS": "6"})
    assert proc.returncode == 2 and "is in use by a running sweep" in proc.stderr
    proc = launch(tmp_path, "DEPTH=2", {"MAX_STEPS": "6", "SWEEP_ENSEMBLE_TOKENS": "-1"})
    assert proc.returncode == 2 and "SWEEP_ENSEMBLE_TOKENS='-1': a number of val tokens" in proc.stderr
    held.close()


@pytest.mark.slow(seconds=130)
def test_the_same_command_after_a_kill_minus_9_resumes_every_member(tmp_path):
    """The sweep and its member killed -9 mid-run (a reboot): the same command resumes the member from
    its checkpoint and ends it as an uninterrupted run would (the same final step and weights)."""
    write_corpus(tmp_path)
    # Saves capped at 1.5 MB/s: each (1.5 MB) takes about a second, so the kill lands mid-run on a busy
    # machine too.
    extra = {"MAX_STEPS": "30", "SAVE_EVERY_STEPS": "5", "SEED": "4", "SAVE_WRITE_MBPS": "1.5"}
    first = launch(tmp_path, "DEPTH=2", extra, wait=False)
    run_dir = tmp_path / "ws/checkpoints/sweep/d2"
    deadline = time.time() + 300
    while not [s for s in (ckpt.complete_steps(run_dir) if run_dir.is_dir() else []) if 5 <= s < 20]:
        assert time.time() < deadline and first.poll() is None, first.stdout.read() if first.poll() is not None else ""
        time.sleep(0.5)
    member_pid = int((run_dir / ".lock").read_text().split()[1])  # its launcher, now torchrun's agent
    # the sweep, its member (a session of its own) and the member's workers (each another), all at
    # once: none sees another die first
    tree = kill_tree(first.pid)
    assert member_pid in tree
    first.wait()
    wait_gone(tree)
    log = (run_dir / "training.log").read_text()
    assert "received SIGTERM" not in log and "done:" not in log, log[-2000:]  # killed, not stopped
    assert max(ckpt.complete_steps(run_dir)) < 30  # killed mid-run
    again = launch(tmp_path, "DEPTH=2", extra)
    assert again.returncode == 0, again.stdout[-3000:]
    assert "resumed from" in (run_dir / "training.log").read_text()
    ref = tmp_path / "ref"
    ref.mkdir()
    write_corpus(ref)
    # the same sweep, never interrupted (its saves unthrottled: the write rate changes no weight)
    assert launch(ref, "DEPTH=2", {**extra, "SAVE_WRITE_MBPS": "0"}).returncode == 0
    got, want = (ckpt.load_model_state(d, 30) for d in (run_dir, ref / "ws/checkpoints/sweep/d2"))
    assert all((got[n] == want[n]).all() for n in want)



def test_a_relaunched_sweep_keeps_a_failed_member_failed_and_checks_one_left_running_before_resuming_it(
        tmp_path, monkeypatch):
    """A member whose trainer ended it with a failure is not trained again unasked (a restart repeats
    it); a member a killed sweep left running, which then ended unfinished, gets its pre-flight and
    prepared data before it resumes, as every member does."""
    def ended(tag: str, outcome: str) -> None:
        d = tmp_path / "checkpoints/sweep" / tag
        d.mkdir(parents=True, exist_ok=True)
        with open(d / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"kind": "end", "outcome": outcome, "code": 1, "time": time.time()}) + "\n")

    checked, refuse = [], set()

    def preflight(sw, m, log):
        checked.append(m.tag)
        if m.tag in refuse:
            raise sweep.SweepError(f"member {m.tag} (DEPTH=4): no such GPU")
        return f"/prepared/{m.tag}"

    monkeypatch.setattr(sweep, "preflight_member", preflight)
    ended("d2", "failed: the loss diverged at step 40")
    lines = []
    sw = sweep.setup({"SWEEP": "DEPTH=2 DEPTH=3 DEPTH=4", "WORKSPACE": str(tmp_path)}, lines.append)
    try:
        d2, d3, d4 = sw.members
        assert d2.status == "failed" and checked == ["d3", "d4"], checked  # d2's pre-flight never ran
        assert any("d2 failed in an earlier launch (failed: the loss diverged at step 40): not restarted" in x
                   and "MODEL_TAG=sweep/d2 NPROC_PER_NODE=1 TRAINING_HOURS=" in x and "DEPTH=2 bash experiment/run.sh" in x
                   for x in lines), lines
        checked.clear()
        d3.status = "elsewhere"  # as if a killed sweep had left it running, and it ended stopped
        ended("d3", "stopped: SIGTERM at step 12")
        sweep.ended_elsewhere(sw, d3, lines.append)
        assert (d3.status, d3.prepared, checked) == ("waiting", "/prepared/d3", ["d3"])
        ended("d4", "stopped: SIGTERM at step 3")
        refuse.add("d4")
        sweep.ended_elsewhere(sw, d4, lines.append)
        assert d4.status == "failed" and "no such GPU" in d4.outcome
        ended("d3", "failed: the disk is full")
        sweep.ended_elsewhere(sw, d3, lines.append)
        assert d3.status == "failed" and checked == ["d3", "d4"]
    finally:
        sw.lock.close()


def test_a_members_status_comes_from_its_own_launchs_last_words_and_the_winner_from_comparable_bests(tmp_path):
    assert sweep.classify("finished: the budget is spent", 0, False) == "finished"
    assert sweep.classify("failed: the loss diverged", 1, True) == "failed"  # a failure while stopping stays one
    assert sweep.classify("", 1, False) == "failed" and sweep.classify("", 0, False) == "failed"
    assert sweep.classify("stopped: SIGTERM at step 4", 0, False) == "stopped"
    assert sweep.classify("", 143, True) == "stopped"
    run_dir = tmp_path / "m"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"kind": "end", "outcome": "stopped: SIGINT", "time": 100.0})
                                           + "\n" + json.dumps({"kind": "eval", "step": 3}) + "\n")
    assert sweep.last_words(run_dir) == "stopped: SIGINT" and sweep.last_words(run_dir, since=101.0) == ""
    rows = [{"member": "a", "best": {"val_loss": 1.5, "step": 2}, "data": "h1"},
            {"member": "b", "best": {"val_loss": 1.2, "step": 4}, "data": "h1"},
            {"member": "c", "best": None, "data": None}]
    assert sweep.winner(rows)[0]["member"] == "b"
    by_metric = [{**r, "best": {**r["best"], "best_by": "acc", "score": -0.9 if r["member"] == "a" else -0.5}}
                 for r in rows[:2]]
    assert sweep.winner(by_metric)[0]["member"] == "a"  # chosen by the same metric: its score decides
    mixed = [rows[0], {**rows[1], "data": "h2"}]
    assert sweep.winner(mixed) == (None, "the members trained on different text: their val losses do not compare")
    assert sweep.winner([rows[2]]) == (None, "no member has a best checkpoint yet")
    (run_dir / sweep.SLOT_FILE).write_text("3\n")
    assert sweep._recorded_slot(run_dir, ["2", "3"]) == 1 and sweep._recorded_slot(run_dir, ["0", "1"]) == -1
    (run_dir / sweep.SLOT_FILE).write_text("cpu\n")
    assert sweep._recorded_slot(run_dir, None) == 0 and sweep._recorded_slot(tmp_path, None) == -1


@pytest.mark.slow
def test_the_ensembles_of_the_best_members_are_scored_on_the_trainers_windows(tmp_path):
    """measure_ensembles, without a sweep around it: two finished runs and one without a checkpoint.
    Each member's loss on the trainer's eval windows is its served val loss; the pair's is the mean of
    their probabilities, computed here independently; none when it cannot compare or fails."""
    import torch

    from experiment import ensembles
    from experiment.batches import val_batches
    from experiment.dataloader import Prepared

    corpus = write_corpus(tmp_path)
    ws = tmp_path / "ws"
    for tag, extra in (("a", ["--seed", "1"]), ("b", ["--seed", "2", "--depth", "1"])):
        run_train([*TINY, "--data_dir", corpus, "--workspace", ws, "--model_tag", tag, "--max_steps", "4",
                   "--eval_every_steps", "2", "--compile", "off", "--total_batch_size", "256", *extra])
    (ws / "checkpoints/c").mkdir()
    rows = [sweep.member_row(sweep.Member(t, {"SEED": t}, ws / "checkpoints" / t), 4.0) for t in "abc"]
    lines = []
    sw = sweep.Sweep(dir=ws / "checkpoints", tag="t", members=[], env={"DEVICE": "cpu"}, slots=1, devices=None,
                     member_hours=1.0, gpu_hourly=4.0, ensemble_tokens=512)
    e = sweep.measure_ensembles(sw, rows, lines.append)
    assert e is not None, lines
    good = sorted(rows[:2], key=lambda r: r["val_loss"])
    assert e["tokens"] == 512 and [m["loss"] for m in e["members"]] == pytest.approx([r["val_loss"] for r in good], abs=1e-5)
    assert [m["path"] for m in e["members"]] == [str(ckpt.resolve_serving_checkpoint(Path(r["run_dir"]), ws))
                                                 for r in good]
    (a, meta), (b, _) = (ckpt.load_model(Path(m["path"])) for m in e["members"])
    members, prepared = [a, b], Path(meta["prepared"]["dir"])
    tokens = Prepared.load(prepared).tokens("val")
    nll = []
    with torch.no_grad():
        for x, y in val_batches(tokens, 32, 4, 512):
            p = sum(m(x).softmax(-1) for m in members) / 2
            nll.append(-p.gather(-1, y[..., None]).log().flatten())
    [pair] = e["ensembles"]
    assert pair["k"] == 2 and pair["loss"] == pytest.approx(torch.cat(nll).double().mean().item(), abs=1e-6)
    assert pair["gain"] == pytest.approx(pair["loss"] - e["members"][0]["loss"])
    assert pair["params"] == sum(m.num_params() for m in members) and pair["members"] == [m["path"] for m in e["members"]]
    assert lines == ["sweep | the ensembles of the best 2 of 2 members, on up to 512 val tokens ..."]
    assert [ensembles.ensemble_sizes((2, 4), n) for n in (1, 2, 3, 4, 6)] == [[], [2], [2, 3], [2, 4], [2, 4, 6]]
    metas = [({"prepared": {"hash": h}, "model_config": {"max_seq_len": n}}, f"m{i}")
             for i, (h, n) in enumerate((("a", 32), ("a", 32), ("b", 32)))]
    ensembles.check_same_data(metas[:2])
    for other in (metas[2], ({"prepared": {"hash": "a"}, "model_config": {"max_seq_len": 64}}, "m3"),
                  ({"prepared": {"hash": "0"}, "model_config": {"max_seq_len": 32}}, "m4")):
        with pytest.raises(ValueError, match=f"{other[1]} was prepared from other data or has another context than m0"):
            ensembles.check_same_data(metas[:2] + [other])
    table = "\n".join(sweep.ensemble_lines(e, rows))
    assert f"| best member | {good[0]['member']} | {e['members'][0]['loss']:.4f} | - | " in table
    assert (f"| best 2 | {good[0]['member']} {good[1]['member']} | {pair['loss']:.4f} | {pair['gain']:+.4f} | "
            f"{pair['params'] * 2 / 1e6:.1f} MB | 2 |") in table and "on 512 val tokens" in table
    assert sweep._bf16_size(50_000_000) == "0.10 GB" and sweep._bf16_size(49_999_999) == "100.0 MB"
    assert sweep._bf16_size(1_610_000_000) == "3.22 GB"
    # three members (the worse one twice): the best 2 (the pair again) and all 3
    three = sweep.measure_ensembles(sw, rows + [good[1]], lines.append)
    assert [x["k"] for x in three["ensembles"]] == [2, 3] and three["ensembles"][0]["loss"] == pytest.approx(pair["loss"])
    # None: SWEEP_ENSEMBLE_TOKENS=0, one member with a checkpoint, members of other data, a failure
    assert sweep.measure_ensembles(dataclasses.replace(sw, ensemble_tokens=0), rows, lines.append) is None
    assert sweep.measure_ensembles(sw, rows[:1] + rows[2:], lines.append) is None
    assert sweep.measure_ensembles(sw, [rows[0], {**rows[1], "data": "other"}], lines.append) is None
    sweep.write_table(tmp_path, rows, 1.0, "finished", e)  # sweep.json holds them, sweep.md shows them
    record = json.loads((tmp_path / sweep.RECORD).read_text())
    assert record["ensembles"] == e and record["winner"] == good[0]["member"] and "| best 2 |" in (tmp_path / sweep.TABLE).read_text()
    sweep.write_table(tmp_path, rows, 1.0, "finished", None)
    assert "ensembles" not in json.loads((tmp_path / sweep.RECORD).read_text())
    assert "Ensembles" not in (tmp_path / sweep.TABLE).read_text()
    sw.stopping = True  # a stop signal while scoring: none
    assert sweep.measure_ensembles(sw, rows, lines.append) is None and "a stop signal came" in lines[-1]
    sw.stopping = False
    prepared.rename(tmp_path / "gone")  # the members' data is not where they were trained
    assert sweep.measure_ensembles(sw, rows, lines.append) is None and lines[-1].startswith("sweep | ensembles not measured: ")


def test_the_ensembles_arithmetic_and_the_members_data_check_alone():
    """compare_logprobs on made-up log-probabilities where the pair beats either member; ensemble_sizes
    with a k of 1; check_same_data with the odd member second, a shorter context, and equal contexts of
    2048 held in two int objects."""
    import math

    import torch

    from experiment import ensembles

    lp = lambda *p: torch.tensor([math.log(x) for x in p])
    e = ensembles.compare_logprobs([("a", 10, lp(0.9, 0.1)), ("b", 20, lp(0.2, 0.8))], [2])
    assert [m["path"] for m in e["members"]] == ["b", "a"] and e["tokens"] == 2
    [pair] = e["ensembles"]
    assert pair["loss"] == pytest.approx(-(math.log(0.55) + math.log(0.45)) / 2)
    assert pair["gain"] == pytest.approx(pair["loss"] - e["members"][0]["loss"]) and pair["gain"] < -0.2
    assert (pair["params"], pair["members"]) == (30, ["b", "a"])
    assert ensembles.ensemble_sizes((1, 2, 4), 6) == [2, 4, 6]
    meta = lambda h, n: {"prepared": {"hash": h}, "model_config": {"max_seq_len": n}}
    for odd in (meta("b", 32), meta("a", 16)):
        with pytest.raises(ValueError, match="m1 was prepared from other data or has another context than m0"):
            ensembles.check_same_data([(meta("a", 32), "m0"), (odd, "m1"), (meta("a", 32), "m2")])
    ensembles.check_same_data([(meta("a", 2048), "m0"), (meta("a", int("2048")), "m1")])
    # a member's scores carry no autograd graph (no_grad: the scoring holds one model's activations at most)
    from experiment.model import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=16, depth=1, aspect_ratio=16, head_dim=16, max_seq_len=8))
    scores = ensembles.member_logprobs(model, torch.arange(40) % 16, max_tokens=32)
    assert scores.shape == (32,) and not scores.requires_grad


def test_the_ensembles_come_only_when_the_members_ended_on_their_own(monkeypatch, tmp_path):
    """Not after a stop signal (a preemption's minutes are the saves'), nor while an error unwinds;
    the table is written whatever ends the loop."""
    sw = sweep.Sweep(dir=tmp_path, tag="t", members=[], env={}, slots=1, devices=None, member_hours=1.0, gpu_hourly=4.0)
    calls = []
    monkeypatch.setattr(sweep, "setup", lambda env, log: sw)
    monkeypatch.setattr(sweep, "measure_ensembles", lambda *args: calls.append(args[0]))

    def broken(s, log):
        raise RuntimeError("the loop broke")

    monkeypatch.setattr(sweep, "run", broken)
    with pytest.raises(RuntimeError, match="the loop broke"):
        sweep.main()
    assert calls == [] and json.loads((tmp_path / sweep.RECORD).read_text())["status"] == "failed"
    for status, code, measured in (("stopped", 0, False), ("finished", 0, True), ("failed", 1, True)):
        calls.clear()
        monkeypatch.setattr(sweep, "run", lambda s, log, status=status: status)
        assert sweep.main() == code and calls == ([sw] if measured else []), status
    sw.stopping = True  # a signal after the members ended, before the loop returned: none either
    calls.clear()
    assert sweep.main() == 1 and calls == []


def _one_text_two_prepared(tmp_path, corpus, *second):
    """Two finished runs of one corpus prepared two ways (the second with `second`'s settings), as a
    sweep's members, and their rows."""
    run = lambda tag, *extra: run_train([*TINY, "--data_dir", corpus, "--workspace", tmp_path, "--model_tag",
                                         f"sw/{tag}", "--max_steps", 4, "--save_every_steps", 2,
                                         "--eval_every_steps", 2, *extra])
    run("first")
    run("second", *second)
    members = [sweep.Member(tag, {}, tmp_path / "checkpoints/sw" / tag, status="finished") for tag in ("first", "second")]
    return members, [sweep.member_row(m, 4.0) for m in members]


@pytest.mark.slow
def test_members_of_one_text_prepared_two_ways_are_ranked_by_bits_per_character(tmp_path, corpus):
    """Two prepared directories of one corpus (here ALPHABET differs: another directory, the same
    text): their val losses are not compared, so the winner is the lowest bits per character on the
    val text both held out, each member scoring it with its own tokenizer (experiment/textbpc.py)."""
    from types import SimpleNamespace

    from experiment import textbpc
    from experiment.dataloader import Prepared, tokenizer_from_meta
    members, rows = _one_text_two_prepared(tmp_path, corpus, "--alphabet",
                                           "".join(sorted(set((corpus / "sums.txt").read_text()))) + "!#%")
    assert rows[0]["data"] != rows[1]["data"] and rows[0]["text"] == rows[1]["text"]
    assert sweep.winner(rows)[0] is None and "bits per character" in sweep.winner(rows)[1]
    lines = []
    box = SimpleNamespace(env={"DEVICE": "cpu"}, dir=tmp_path / "checkpoints/sw", stopping=False)
    assert sweep.measure_bpc(box, rows, lines.append) and all(0 < r["bpc"] < 8 for r in rows)
    # each member's figure is its own model on the shared text, by hand
    path = ckpt.resolve_serving_checkpoint(members[1].run_dir, tmp_path)
    model, meta = ckpt.load_model(path)
    docs = textbpc.common_text([textbpc.val_texts(Prepared.load(ckpt.model_meta(ckpt.resolve_serving_checkpoint(
        m.run_dir, tmp_path))["prepared"]["dir"])) for m in members], sweep.BPC_CHARS)
    assert sum(map(len, docs)) > 1000 and "val characters all of them held out" in lines[0]
    assert textbpc.bits_per_char(model.eval(), tokenizer_from_meta(meta["tokenizer"]), docs) == pytest.approx(
        rows[1]["bpc"])
    rows[0]["bpc"] += 0.1  # the lower one wins, in either order
    assert sweep.winner(rows)[0] is rows[1] is sweep.winner(rows[::-1])[0]
    sweep.write_table(box.dir, rows, 1.0, "finished")
    assert f"chosen by bits per character {rows[1]['bpc']:.4f}" in (box.dir / "sweep.md").read_text()
    other = [{**rows[0], "text": "another corpus"}, rows[1]]  # other text: still no winner
    assert sweep.winner(other)[0] is None and "different text" in sweep.winner(other)[1]


@pytest.mark.slow
def test_a_char_and_a_bpe_member_of_one_text_get_a_winner_by_bits_per_character(tmp_path, corpus):
    """The same with TOKENIZER=gpt2 beside char, where the encoding files can be had (offline
    machines cannot download them)."""
    from types import SimpleNamespace

    from experiment.dataloader import DataError, TiktokenTokenizer
    pytest.importorskip("tiktoken")
    try:
        TiktokenTokenizer("gpt2")
    except DataError as e:
        pytest.skip(str(e))
    _, rows = _one_text_two_prepared(tmp_path, corpus, "--tokenizer", "gpt2")
    box = SimpleNamespace(env={"DEVICE": "cpu"}, dir=tmp_path / "checkpoints/sw", stopping=False)
    assert sweep.measure_bpc(box, rows, print)
    assert rows[0]["bpc"] != rows[1]["bpc"] and sweep.winner(rows)[0] is min(rows, key=lambda r: r["bpc"])


def test_bits_per_character_of_a_model_that_knows_nothing_is_the_log_of_its_vocabulary():
    import math

    import torch

    from conftest import tiny_config
    from experiment import textbpc
    from experiment.dataloader import CharTokenizer
    from experiment.model import GPT
    model = GPT(tiny_config(vocab_size=64)).eval()
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every next character equally likely
    docs = ["abcabc" * 20, "cab"]
    assert textbpc.bits_per_char(model, CharTokenizer("abc"), docs) == pytest.approx(math.log2(64), rel=1e-5)
    tails = [{"s": "x\x00one\x00two"}, {"s": "one\x00two"}, {"s": "ne\x00two"}]
    assert textbpc.common_text(tails, 100) == ["ne", "two"] and textbpc.common_text(tails, 3) == ["ne", "t"]


def test_the_members_leave_one_percent_of_the_box_for_scoring_them(tmp_path, monkeypatch):
    """Two members or more are scored after they end, on the box: 1% of its hours is kept for that
    (SWEEP_SCORING_SHARE); one member is never scored, and keeps it all. The scoring's cost is priced
    at every GPU the box bills."""
    monkeypatch.setattr(sweep, "preflight_member", lambda sw, m, log: None)  # the members' own checks aside
    env = {"TRAINING_HOURS": "2", "GPU_HOURLY_USD": "3"}
    two = sweep.setup({**env, "SWEEP": "DEPTH=1 DEPTH=2", "WORKSPACE": str(tmp_path / "a")}, lambda line: None)
    assert two.member_hours == pytest.approx(2 * 0.99 / 2) and two.scoring_seconds == pytest.approx(72)  # 2 waves
    one = sweep.setup({**env, "SWEEP": "DEPTH=1", "WORKSPACE": str(tmp_path / "b")}, lambda line: None)
    assert one.member_hours == 2 and one.scoring_seconds == 0
    cost = sweep.scoring(dataclasses.replace(two, box_gpus=8), time.time() - 36)
    assert cost["seconds"] == pytest.approx(36, abs=1) and cost["usd"] == pytest.approx(cost["seconds"] / 3600 * 8 * 3)
    assert cost["kept"] == pytest.approx(72)


def test_the_first_waves_budgets_count_from_the_sweeps_start(tmp_path, monkeypatch):
    """The members' pre-flights run one after another before any starts, on the box's bill: a member
    of the first wave counts its budget from the sweep's own start (experiment/run.sh reads
    SWEEP_MEMBER_STARTED as its LAUNCH_STARTED); one that starts once a slot came free, from its own."""
    from types import SimpleNamespace

    envs = []
    monkeypatch.setattr(sweep.subprocess, "Popen",
                        lambda cmd, env, **kw: envs.append(env) or SimpleNamespace(pid=1, poll=lambda: 0, returncode=0))
    sw = sweep.Sweep(dir=tmp_path, tag="t", members=[], env={"LAUNCH_STARTED": "123.5", "WORKSPACE": str(tmp_path)},
                     slots=1, devices=None, member_hours=1.0, gpu_hourly=4.0)
    sw.members = [sweep.Member(f"d{d}", {"DEPTH": str(d)}, tmp_path / f"d{d}") for d in (1, 2)]
    free = [0]
    sweep.step(sw, free, lambda line: None)  # d1 starts; d2 waits for the slot
    assert envs[0]["SWEEP_MEMBER_STARTED"] == "123.5" and len(envs) == 1
    sweep.step(sw, free, lambda line: None)  # d1 has ended: its slot is free, d2 starts
    assert len(envs) == 2 and "SWEEP_MEMBER_STARTED" not in envs[1]


def test_a_relaunch_keeps_the_members_hours_the_sweep_began_with(tmp_path, monkeypatch):
    """A member's hours come from the box (BUDGET_USD over its GPUs, SWEEP_PARALLEL's waves): a relaunch
    with another SWEEP_PARALLEL (or GPU count) and the same budget gives every member the hours it began
    with, so no begun member reads an extension; another budget is the user's, and is computed anew."""
    monkeypatch.setattr(sweep, "preflight_member", lambda sw, m, log: None)
    env = {"TRAINING_HOURS": "2", "SWEEP": "DEPTH=1 DEPTH=2", "WORKSPACE": str(tmp_path)}

    def launch(**more):
        lines = []
        sw = sweep.setup({**env, **more}, lines.append)
        sweep.write_table(sw.dir, [], sw.member_hours, "stopped", budget=sw.budget)  # as run() leaves it
        sw.lock.close()
        return sw, lines

    first, _ = launch(SWEEP_PARALLEL="1")  # two waves of 0.99 h
    assert first.member_hours == pytest.approx(0.99) and first.scoring_seconds == pytest.approx(72)
    again, lines = launch(SWEEP_PARALLEL="2")  # one wave would be 1.98 h
    assert again.member_hours == pytest.approx(0.99) and again.scoring_seconds == pytest.approx(72)
    assert any("keeps the 0.990 h this sweep began with, not the 1.980 h" in line for line in lines)
    assert json.loads((first.dir / sweep.RECORD).read_text())["budget"]["member_hours"] == pytest.approx(0.99)
    same, _ = launch(SWEEP_PARALLEL="2", SWEEP="DEPTH=2  DEPTH=1")  # the same members, in another order
    assert same.member_hours == pytest.approx(0.99)
    more, _ = launch(SWEEP_PARALLEL="2", TRAINING_HOURS="4")  # a larger budget: the user's extension
    assert more.member_hours == pytest.approx(3.96) and more.scoring_seconds == pytest.approx(144)
    (more.dir / sweep.RECORD).write_text("{torn")  # unreadable: computed anew, and said
    torn, lines = launch(SWEEP_PARALLEL="1", TRAINING_HOURS="4")
    assert torn.member_hours == pytest.approx(1.98) and any("unreadable" in line for line in lines)
