"""The run report: metrics.jsonl, report.md and loss.svg written by the trainer, across a resume, with EVAL_PROMPT."""

import json
import xml.etree.ElementTree as ET

import pytest

from conftest import TINY, run_train

from experiment import checkpoint as ckpt
from experiment.checkpoint import RunState
from experiment.config import EVAL_SHARE
from experiment.dataloader import Prepared
from experiment.report import RunReport, loss_svg

SVG = "{http://www.w3.org/2000/svg}"


def _records():
    out = []
    for step in range(0, 201, 10):
        seconds, tokens = step * 0.5, step * 1000
        out.append({"kind": "train", "step": step, "used_seconds": seconds, "tokens_seen": tokens,
                    "loss": 3 - step / 100, "tok_s": 2000.0, "mfu": None})
        if step % 50 == 0:
            out.append({"kind": "eval", "step": step, "used_seconds": seconds, "tokens_seen": tokens,
                        "val_loss": 3.2 - step / 120, "val_bpc": 4.0,
                        "val_loss_by_source": {"sums": 3.1 - step / 110, "words": 3.3 - step / 130}})
            out.append({"kind": "save", "step": step, "seconds": 0.25, "ok": True})
    return out


FACTS = {"model_tag": "d2", "params": 1000, "budget_seconds": 120.0, "train_tokens": 50_000, "config": {"depth": 2},
         "model": "d2, width 64", "device": "1 x cpu", "batch": "1,000 tokens/step", "data": "50,000 train tokens",
         "best_file": "model_{step:06d}.pt", "auto": None}


def test_the_picture_has_every_curve_and_the_best_marked():
    root = ET.fromstring(loss_svg(_records(), best_step=200))
    lines = root.findall(f".//{SVG}polyline")
    assert len(lines) == 2 * 4  # train, val and two sources, in each of the two panels
    legend = [t.text for t in root.iter(f"{SVG}text")]
    assert {"train", "val", "val sums", "val words"} <= set(legend)
    assert sum(1 for t in legend if t.startswith("best 1.5333 @ 200")) == 2
    # Every plotted point lies inside its panel, x and y, except the step-0 eval (the untrained
    # model's loss, left out of the scale), which runs off the top of its clipped panel. Caught: the
    # y scale inverted (points below the panels' bottom).
    panels = {c.get("id"): c.find(f"{SVG}rect") for c in root.iter(f"{SVG}clipPath")}
    assert len(panels) == 2

    def box(rect):
        x, y, w, h = (float(rect.get(k)) for k in ("x", "y", "width", "height"))
        return x, x + w, y, y + h

    for line in lines:
        x0, x1, y0, y1 = box(panels[line.get("clip-path")[5:-1]])
        points = [tuple(map(float, point.split(","))) for point in line.get("points").split()]
        assert all(x0 - 0.1 <= x <= x1 + 0.1 and y <= y1 + 0.1 for x, y in points)
        assert all(y >= y0 - 0.1 for _, y in points[1:])  # the step-0 point alone may lie above
    best_marker = [c for c in root.iter(f"{SVG}circle") if c.get("r") == "7"]
    assert len(best_marker) == 2
    for circle in best_marker:
        cx, cy = float(circle.get("cx")), float(circle.get("cy"))
        assert any(x0 <= cx <= x1 and y0 <= cy <= y1 for x0, x1, y0, y1 in map(box, panels.values()))
    assert "no loss measured yet" in loss_svg([], best_step=-1)


def test_the_report_reads_back_what_a_resume_keeps(tmp_path):
    report = RunReport(tmp_path, dict(FACTS), resume_step=None)
    for record in _records():
        report.add(record)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "st')  # a line a crash cut short
    st = RunState(step=200, tokens_seen=200_000, used_seconds=100.0, best_val=1.5333, best_step=200)
    report.sample(200, "12+", "30=42")
    report.note("projected end", "in 0.01 h (8 passes)")
    report.write(st, "running")
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# Run report: d2\n\nrunning | step 200")
    assert "| projected end | in 0.01 h (8 passes) |" in md
    assert "| budget | 1.7 min used of 2.0 min, 0.3 min left |" in md
    assert "200.00 tokens/param, 4.00 passes" in md and "| best | val loss 1.5333 at step 200: model_000200.pt |" in md
    assert "## Evals (the latest 5 of 5)" in md and "| sums | words |" in md and "~~~~text\n12+30=42\n~~~~" in md
    ET.fromstring((tmp_path / "loss.svg").read_text())
    resumed = RunReport(tmp_path, dict(FACTS), resume_step=100)
    assert resumed.records and max(r["step"] for r in resumed.records) == 100
    # A launch its trainer refused at the start (launch.end_mistake) leaves an end record with no step
    from experiment.launch import end_record
    end_record(tmp_path, 2, "failed: EVAL_METRIC=m.py:f: ...")
    again = RunReport(tmp_path, dict(FACTS), resume_step=100)
    assert [r["step"] for r in again.records] == [r["step"] for r in resumed.records]


@pytest.mark.slow
def test_the_trainer_writes_the_report_and_samples_from_the_eval_prompt(tmp_path, corpus):
    # No warmdown: the second run below goes on from the first's last step (with one, more steps would
    # go back to a checkpoint from before it: tests/test_extend.py).
    args = [*TINY, "--data_dir", corpus, "--workspace", tmp_path, "--total_batch_size", 256, "--warmdown_frac", 0,
            "--max_steps", 6, "--eval_every_steps", 3, "--sample_tokens", 8]
    proc = run_train(args)
    run_dir = tmp_path / "checkpoints/d2"
    prepared = Prepared.load(ckpt.read_meta(run_dir, 6)["prepared"]["dir"])
    val_start = prepared.tokenizer().decode([int(t) for t in prepared.tokens("val")[:32]])
    samples = [line for line in proc.stdout.splitlines() if line.startswith("sample | ")]
    assert len(samples) == 3 and all(line.startswith(f"sample | {val_start!r} -> ") for line in samples)
    md = (run_dir / "report.md").read_text()
    assert md.startswith("# Run report: d2\n\nfinished: max_steps reached | step 6")
    assert "## Evals (the latest 3 of 3)" in md and "## Checkpoint saves" in md and "## Latest samples" in md
    assert f"(or {(1 - EVAL_SHARE) / EVAL_SHARE:g}x a slower eval)" in md  # the clock's cadence, from its share
    kinds = [json.loads(line)["kind"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert kinds.count("train") == 6 and kinds.count("eval") == 3 and kinds.count("save") == 2

    more = run_train([*args[:-4], "--max_steps", 9, "--eval_prompt", "\n1+1=", "--sample_tokens", 8])
    assert "sample | '\\n1+1=' -> " in more.stdout
    root = ET.fromstring((run_dir / "loss.svg").read_text())
    val = root.findall(f".//{SVG}polyline")[1].get("points").split()
    assert len(val) == 4  # the evals at steps 0, 3, 6 and 9: the resumed run's curve goes on from the first run's


@pytest.mark.slow
def test_an_eval_prompt_the_vocabulary_cannot_spell_exits_2(tmp_path, corpus):
    proc = run_train([*TINY, "--data_dir", corpus, "--workspace", tmp_path, "--total_batch_size", 256,
                      "--max_steps", 2, "--eval_prompt", "hello"], check=False)
    assert proc.returncode == 2 and "--eval_prompt" in proc.stderr


def test_a_days_step_lines_are_thinned_in_the_picture():
    records = [{"kind": "train", "step": s, "used_seconds": s, "tokens_seen": s * 100, "loss": 3 - s / 1e5}
               for s in range(30_001)]
    train = ET.fromstring(loss_svg(records, best_step=-1)).findall(f".//{SVG}polyline")[0]
    points = train.get("points").split()
    assert 1000 < len(points) <= 2000 and points[0].startswith(f"{64:.1f},")  # the first point kept
