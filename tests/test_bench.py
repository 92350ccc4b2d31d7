import json
import re
import subprocess
import sys

import pytest

from conftest import REPO
from experiment.dataloader import demo_lines


def test_generate_benchmark_prints_both_paths_and_they_agree():
    proc = subprocess.run([sys.executable, "-m", "experiment.bench", "generate", "--depth", "2", "--max_seq_len", "32",
                           "--tokens", "48", "--device", "cpu"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in ("kv_cache", "naive"):
        assert re.search(rf"{name}\s*\| 48 tokens in [\d.]+s \| [\d,.]+ tok/s", proc.stdout)
    assert "same tokens while within the context: True" in proc.stdout


def test_generate_benchmark_without_a_checkpoint_says_why(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "experiment.bench", "generate", "--workspace", tmp_path],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no complete checkpoint" in proc.stderr


def test_throughput_benchmark_prints_rate_flops_and_cpu_mfu():
    proc = subprocess.run([sys.executable, "-m", "experiment.bench", "throughput", "--depth", "2", "--aspect_ratio",
                           "32", "--head_dim", "32", "--seq", "32", "--batch", "4", "--steps", "3", "--device", "cpu"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    m = re.search(r"([\d,]+) tok/s \| [\d.]+ ms/step \| ([\d,.]+) GFLOP/s \| mfu ([\d.]+)% "
                  r"\(measured fp32 matmul peak ([\d.]+) GFLOP/s", proc.stdout)
    assert m, proc.stdout
    tok_s, gflops, mfu, peak = (float(g.replace(",", "")) for g in m.groups())
    assert tok_s > 0 and mfu == pytest.approx(100 * gflops / peak, abs=0.15)


def test_speedrun_trains_for_its_budget_and_reports_full_val_loss(tmp_path):
    data = tmp_path / "sums.txt"
    data.write_text("".join(demo_lines(3000, seed=3)))
    proc = subprocess.run([sys.executable, "-m", "experiment.bench", "speedrun", "--data", data, "--seconds", "6",
                           "--workspace", tmp_path / "ws", "--", "--depth", "2", "--aspect_ratio", "32",
                           "--head_dim", "32", "--max_seq_len", "64", "--total_batch_size", "512"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = re.search(r"budget 6s, used ([\d.]+)s .* val_loss ([\d.]+) nats/char on the full val set \(([\d,]+) tokens",
                  proc.stdout)
    assert m, proc.stdout[-2000:]
    used, loss, n = float(m.group(1)), float(m.group(2)), int(m.group(3).replace(",", ""))
    assert used <= 6 and loss < 3.0  # it learned something (uniform over the vocabulary would be ~4.2)
    val_tokens = json.loads(next((tmp_path / "ws/prepared").glob("*/meta.json")).read_text())["split"]["val_tokens"]
    assert n == (val_tokens - 1) // 64 * 64  # every whole window of the val split
    assert "curve |" in proc.stdout
