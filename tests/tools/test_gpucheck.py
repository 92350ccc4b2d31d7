"""gpucheck end to end on the CPU (every item at tiny sizes), and the warm-up rule its e2e item caught.

The trainer's warm-up rule (updated_step_seconds) is the one gpucheck's end-to-end item caught on a
GPU."""

import json
import subprocess
import sys

import pytest

from conftest import ENV, REPO
from experiment.tools.bench import main as bench_main
from experiment.tools.gpucheck_items import ITEMS
from experiment.memory import checkpoint_bytes_per_rank
from experiment.model import GPT, GPTConfig
from experiment.progress import updated_step_seconds


def test_warmup_steps_stay_out_of_the_end_of_run_reserve():
    assert updated_step_seconds(0.0, 40.0, warm=False) == 0.0  # a compile step is not a step's cost
    assert updated_step_seconds(0.8, 40.0, warm=False) == 0.8  # after a resume: the checkpoint's figure stays
    assert updated_step_seconds(0.0, 0.8, warm=True) == 0.8
    assert abs(updated_step_seconds(1.0, 0.5, warm=True) - 0.95) < 1e-12


def test_checkpoint_bytes_per_rank_cover_every_parameter_once():
    config = GPTConfig(vocab_size=64, depth=4, aspect_ratio=32, head_dim=32)
    one = checkpoint_bytes_per_rank(config, 1, "bf16")
    three = checkpoint_bytes_per_rank(config, 3, "bf16")
    assert sum(p for p, _ in three) == one[0][0] and sum(o for _, o in three) == one[0][1]
    n = sum(p.numel() for p in GPT(config).parameters())
    assert one[0][0] == 2 * n  # bf16 weights


def test_unknown_item_is_an_error(capsys):
    assert bench_main(["gpucheck", "--only", "env,bogus"]) == 2
    assert "bogus" in capsys.readouterr().out


def _failed_items(workspace) -> str:
    """Each failing item's own detail, first: the end of stdout is the e2e item's, whatever failed."""
    reports = sorted(workspace.glob("gpucheck/*/report.json"))
    if not reports:
        return "no report.json\n"
    items = json.loads(reports[-1].read_text())["items"]
    return "".join(f"## {i['name']}: {i['status']}\n{i['summary']}\n{i.get('detail', '')[-4000:]}\n\n"
                   for i in items if i["status"] == "FAIL")


@pytest.mark.slow(seconds=200)
def test_quick_gpucheck_on_cpu_passes_and_reports_every_item(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "experiment.tools.bench", "gpucheck", "--quick", "--workspace", tmp_path],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, _failed_items(tmp_path) + proc.stdout[-3000:] + proc.stderr[-2000:]
    (out,) = (tmp_path / "gpucheck").iterdir()
    report = json.loads((out / "report.json").read_text())
    items = {i["name"]: i for i in report["items"]}
    assert list(items) == list(ITEMS)
    assert all(i["status"] in ("PASS", "WARN") for i in items.values()), {n: i["summary"] for n, i in items.items()}
    assert "CPU figure" in report["header"] and "CPU figure" in (out / "report.md").read_text()
    assert items["env"]["figures"]["cpu_fp32_matmul_gflops"] > 0
    assert items["correctness"]["figures"]["passed"] >= 6 and items["correctness"]["figures"]["failure"] == 0
    assert all(r["tok_per_s"] > 0 for r in items["speed"]["figures"].values())
    assert set(items["memory"]["figures"]["fit"]) == {"1", "2"}  # JSON keys
    assert all(r["bytes"] > 0 and r["save_s"] > 0 for r in items["checkpoints"]["figures"]["runs"])
    e2e = items["e2e"]["figures"]
    assert e2e["preempted"] and e2e["resumed"] and e2e["final_step"] > e2e["preempt_step"]
    # the budget kept: past it by 1% or two of the run's own steps (a loaded CPU makes those long),
    # short of it by 1% more than the reserve the run measured for its final eval, save and step
    assert -0.01 - e2e["reserve_s"] / e2e["budget_s"] <= e2e["budget_error"], e2e
    assert e2e["budget_error"] <= max(0.01, 2 * e2e["step_s"] / e2e["budget_s"]), e2e
