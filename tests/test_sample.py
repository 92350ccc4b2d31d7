"""The sample command: the server's decoding on the command line, prompts from flags or a file, errors named."""

import subprocess
import sys
import time

import pytest

from conftest import ENV, REPO

from experiment.sample import SEPARATOR
from experiment.server import ServeConfig, load_engine


def sample(*args, check=True, env=ENV) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "experiment.sample", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert not check or proc.returncode == 0, proc.stderr[-2000:]
    return proc


def server_text(engine, body: dict) -> str:
    """The completion the server returns for a /generate body (its engine, without HTTP)."""
    job = engine.submit(engine.validate(body))
    deadline = time.time() + 60
    while True:
        kind, value = job.events.get(timeout=max(deadline - time.time(), 0.1))
        if kind == "done":
            return value["text"]
        assert kind != "error", value


@pytest.mark.slow
def test_samples_are_what_the_server_returns_for_the_same_seed(workspace):
    run = workspace / "checkpoints/d2"
    out = sample("--checkpoint", run, "--prompt", "12+", "--max_tokens", 24, "--seed", 5, "--num_samples", 2,
                 "--temperature", 0.9, "--top_k", 12)
    samples = out.stdout.split(SEPARATOR + "\n")
    assert len(samples) == 3 and samples[2] == ""  # two samples, each ended by the separator
    assert "sample | " in out.stderr and "(step 30," in out.stderr
    engine = load_engine(ServeConfig(checkpoint=str(run), device="cpu"))
    try:
        for i, text in enumerate(samples[:2]):
            body = {"prompt": "12+", "max_tokens": 24, "temperature": 0.9, "top_k": 12, "seed": 5 + i}
            assert text == "12+" + server_text(engine, body) + "\n"
        assert samples[0] != samples[1]  # seed + i: two different draws
    finally:
        engine.close()


@pytest.mark.slow
def test_a_file_of_prompts_and_the_newest_runs_best_by_default(workspace, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1+1=\\n2+\n30+4=\n")  # \n inside a line stands for a newline
    # WORKSPACE in the environment is where every entry point looks for runs, as the trainer does
    out = sample("--prompt_file", prompts, "--max_tokens", 6, "--temperature", 0, env={**ENV, "WORKSPACE": workspace})
    first, second, rest = out.stdout.split(SEPARATOR + "\n")
    assert first.startswith("1+1=\n2+") and second.startswith("30+4=") and rest == ""


@pytest.mark.slow
def test_bad_input_exits_2_naming_what_is_wrong(workspace, tmp_path):
    run = workspace / "checkpoints/d2"
    for args, message in ((["--checkpoint", run, "--prompt", "hello"], "not in the vocabulary"),
                          (["--checkpoint", tmp_path / "nothing"], "no such checkpoint"),
                          (["--checkpoint", run, "--top_p", 0], "--top_p"),
                          (["--checkpoint", run, "--prompt_file", tmp_path / "absent.txt"], "--prompt_file")):
        proc = sample(*args, check=False)
        assert proc.returncode == 2 and message in proc.stderr and proc.stdout == "", (args, proc.stderr)


@pytest.mark.slow
def test_several_checkpoints_sample_as_the_servers_ensemble(workspace):
    """--checkpoint A,B decodes the ensemble the server decodes for the same seed (export and model
    file of one run: one in bf16, one in fp32, so their probabilities differ)."""
    run = workspace / "checkpoints/d2"
    members = f"{run / 'best.pt'},{run}"
    out = sample("--checkpoint", members, "--prompt", "12+", "--max_tokens", 24, "--seed", 3, "--temperature", 0.9)
    assert out.stderr.count("(step 30,") == 2 and " + " in out.stderr
    engine = load_engine(ServeConfig(checkpoint=members, device="cpu"))
    try:
        body = {"prompt": "12+", "max_tokens": 24, "temperature": 0.9, "seed": 3}
        assert out.stdout == "12+" + server_text(engine, body) + "\n" + SEPARATOR + "\n"
    finally:
        engine.close()
