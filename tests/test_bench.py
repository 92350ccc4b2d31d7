import re
import subprocess
import sys

from conftest import REPO


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
