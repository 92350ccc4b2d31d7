"""The launchers' Python check (experiment/pyenv.sh, experiment/envcheck.py): a given interpreter that
lacks the pinned packages is refused in one line before anything runs."""

import shutil
import subprocess
import sys

import pytest
from importlib import metadata

from conftest import ENV, REPO

from experiment import envcheck


def test_problems_name_the_mismatch_and_the_missing(tmp_path):
    req = tmp_path / "requirements.txt"
    torch_version = metadata.version("torch")
    req.write_text(f"# comment\ntorch=={torch_version.split('+')[0]}\nnumpy\npytest\n")
    assert envcheck.problems(envcheck.requirements(str(req))) == []  # a local build tag (+cpu) matches its pin
    req.write_text("torch==0.0.1\nno-such-package-here\npytest==0.0.1  # tests only: not asked of a launch\n"
                   "pyarrow==0.0.1  # Parquet data only: not asked of a launch either\n")
    found = envcheck.problems(envcheck.requirements(str(req)))
    assert found == [f"torch {torch_version}, requirements.txt pins torch==0.0.1", "no no-such-package-here"]


def test_launch_with_a_python_of_another_torch_exits_2_in_one_line(tmp_path):
    """The whole launcher, in a copy of the repository whose requirements.txt pins a torch this Python
    lacks, with PYTHON given: exit 2, one error line naming both versions and the fix, nothing started."""
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "experiment", repo / "experiment", ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "requirements.txt").write_text("torch==0.0.1\nnumpy\n")
    proc = subprocess.run(["bash", str(repo / "experiment/run.sh")], cwd=tmp_path,
                          env={**ENV, "PYTHON": sys.executable, "WORKSPACE": str(tmp_path / "ws")},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    assert f"torch {metadata.version('torch')}, requirements.txt pins torch==0.0.1" in lines[0]
    assert "pip install -r requirements.txt" in lines[0]
    assert not (tmp_path / "ws").exists()  # refused before the pre-flight


@pytest.mark.slow
def test_run_sh_test_runs_the_suite_or_only_the_file_it_is_given():
    """`bash run.sh test tests/test_x.py` runs that file, not the suite beside it; `bash run.sh test -k y`
    selects from the whole suite."""
    env = {**ENV, "PYTHON": sys.executable}

    def collected(*args):
        proc = subprocess.run(["bash", str(REPO / "run.sh"), "test", *args, "--collect-only", "-q"], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return {line.split("::")[0] for line in proc.stdout.splitlines() if "::" in line}

    assert collected("tests/test_mutate.py") == {"tests/test_mutate.py"}
    # the quick tier: the whole suite less the tests marked slow (or using a shared run)
    proc = subprocess.run(["bash", str(REPO / "run.sh"), "test", "--quick", "--collect-only", "-q"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    quick = {line for line in proc.stdout.splitlines() if "::" in line}
    assert "tests/test_pyenv.py::test_problems_name_the_mismatch_and_the_missing" in quick
    assert "tests/test_pyenv.py::test_run_sh_test_runs_the_suite_or_only_the_file_it_is_given" not in quick  # marked
    assert "tests/test_server.py::test_an_engine_failure_costs_the_requests_in_flight_not_the_server" not in quick
    assert len(quick) > 300 and "deselected" in proc.stdout, proc.stdout[-2000:]
    assert collected("-k", "lines_name_one_stretch or problems_name_the_mismatch") == {
        "tests/test_mutate.py", "tests/test_pyenv.py"}
