"""The suite's own machinery: the `alone` lock (conftest.machine_share) under pytest-xdist."""

import subprocess
import sys
import textwrap

import pytest

from conftest import REPO


@pytest.mark.slow(seconds=15)
def test_a_pytest_started_by_a_test_never_waits_on_the_lock_its_parent_holds(tmp_path):
    """gpucheck runs tests/test_cuda.py in a pytest of its own, from inside a test. That pytest
    inherits the xdist workers' environment; had it taken the machine lock, it would wait on the
    turnstile an `alone` test on the other worker holds while that test waits for the parent's
    shared lock: a whole suite hung, load 0. Here: one worker's test starts a nested pytest a moment
    after the other worker's `alone` test queued for the machine; all must end."""
    pytest.importorskip("xdist")
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import importlib.util, sys
        sys.path.insert(0, {str(REPO)!r})
        spec = importlib.util.spec_from_file_location("suite_conftest", {str(REPO / "tests/conftest.py")!r})
        suite = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(suite)
        machine_share, pytest_configure = suite.machine_share, suite.pytest_configure
    """))
    (tmp_path / "inner.py").write_text("def test_inner():\n    pass\n")
    (tmp_path / "test_parent.py").write_text(textwrap.dedent(f"""
        import subprocess, sys, time

        def test_parent():
            time.sleep(3)  # the other worker's alone test is queued by now, holding the turnstile
            subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            {str(tmp_path / "inner.py")!r}], check=True, timeout=30)
    """))
    (tmp_path / "test_alone.py").write_text("import pytest\n\n\n@pytest.mark.alone\ndef test_alone():\n    pass\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p",
                           "no:cacheprovider", "test_parent.py", "test_alone.py"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_each_worker_starts_on_its_longest_tests_whatever_the_count():
    """pytest-xdist's worksteal cuts the collected list into one run a worker (worker i gets
    len(left) // (k - i) of what is left; WorkStealingScheduling.check_schedule): each cut must be
    one worker's run of the ordered tests, longest first. Every k-th item, on an odd count, put the
    first run's last test (an `alone` one) at the head of the second, where it waited out the
    suite's longest test with a core idle."""
    from conftest import worker_runs

    for k in (1, 2, 3, 4):
        for n in range(k, 40):
            listed, runs = worker_runs(list(range(n)), k), []
            for i in range(k):
                size = len(listed) // (k - i)
                runs.append(listed[:size])
                del listed[:size]
            assert sorted(x for run in runs for x in run) == list(range(n))
            assert [run[0] for run in runs] == list(range(k)), (n, k, runs)  # the k longest, one each
            assert all(run == sorted(run) for run in runs)  # each run in the order given
            assert max(len(run) for run in runs) - min(len(run) for run in runs) <= 1
