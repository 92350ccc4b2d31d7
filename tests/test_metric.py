"""EVAL_METRIC and BEST_BY: the user's own numbers at every eval, bounded in time, checked before
training, and able to choose the best checkpoint; the demo's sums are one."""

import json
import time

import pytest
import torch

from conftest import TINY, run_train, tiny_config, write_corpus

from experiment import checkpoint as ckpt
from experiment import metric
from experiment.config import ConfigError, TrainConfig, resolve
from experiment.dataloader import prepare
from experiment.model import build_model


def _function(body: str) -> str:
    return "def f(generate, tokenizer):\n    " + body + "\n"


def _model_and_tok(tmp_path):
    prepared = prepare(write_corpus(tmp_path), tmp_path / "ws", max_seq_len=32)
    model = build_model(tiny_config(vocab_size=prepared.meta["vocab_size"]), seed=1)
    return model, prepared.tokenizer()


def _metric_file(tmp_path, body: str, name: str = "m.py"):
    path = tmp_path / name
    path.write_text(body)
    return path


GENERATES = '''
def score(generate, tokenizer):
    a, b = generate("12+3=", max_tokens=6), generate("12+3=", max_tokens=6)
    c = generate("12+3=", max_tokens=6, temperature=1.0, seed=5)
    cut = generate("12+3=", max_tokens=6, stop=a[2])
    return {"same": float(a == b), "length": len(a), "cut": len(cut), "sampled": float(c == generate(
        "12+3=", max_tokens=6, temperature=1.0, seed=5)), "vocab": len(tokenizer.decode(tokenizer.encode("1+1")))}
'''


def test_a_metric_gets_greedy_generate_and_the_tokenizer_and_leaves_the_model_as_it_was(tmp_path):
    model, tok = _model_and_tok(tmp_path)
    fn = metric.load(f"{_metric_file(tmp_path, GENERATES)}:score")
    greedy = tok.decode(list(model.generate(tok.encode("12+3="), 6, temperature=0, allowed_vocab=tok.n_real)))
    rng, was = torch.get_rng_state(), model.training
    values, problem = metric.measure(fn, model, tok, 30)
    assert problem is None, problem
    assert len(greedy) >= 3
    assert values == {"same": 1.0, "length": len(greedy), "cut": greedy.index(greedy[2]), "sampled": 1.0, "vocab": 3.0}
    assert torch.equal(rng, torch.get_rng_state()) and model.training == was  # training's RNG and mode untouched


@pytest.mark.parametrize("spec, message", [
    ("m.py", "expected path/to/file.py:function"),
    (":f", "expected path/to/file.py:function"),
    ("m.py:", "expected path/to/file.py:function"),
    ("m.py:1f", "expected path/to/file.py:function"),
    ("m.txt:f", "m.txt cannot be imported as Python"),
    ("missing.py:f", "missing.py is not a file"),
    ("m.py:nope", "m.py has no function nope"),
    ("broken.py:f", "importing .*broken.py raised NameError: name 'undefined' is not defined"),
])
def test_a_metric_that_cannot_be_loaded_is_one_error_naming_eval_metric(tmp_path, monkeypatch, spec, message):
    monkeypatch.chdir(tmp_path)
    _metric_file(tmp_path, "def f(generate, tokenizer):\n    return {'x': 1}\n")
    _metric_file(tmp_path, "undefined\n", "broken.py")
    _metric_file(tmp_path, "def f(generate, tokenizer):\n    return {'x': 1}\n", "m.txt")
    with pytest.raises(ConfigError, match=f"EVAL_METRIC='{spec}': {message}"):
        metric.load(spec)


@pytest.mark.parametrize("body, problem", [
    ("return {'x': 1 / 0}", "raised ZeroDivisionError: division by zero"),
    ("return [1.0]", "returned list, not a non-empty dict"),
    ("return {}", "returned dict, not a non-empty dict"),
    ("return {'x': float('nan')}", "returned x=nan, not a finite number"),
    ("return {'x': True}", "returned x=True, not a finite number"),
    ("return {'x': '1'}", "returned x='1', not a finite number"),
    ("return {'a b': 1.0}", "returned the name 'a b'"),
    ("return {'x': generate('')}", "raised ValueError: generate needs at least one prompt token"),
])
def test_a_failing_metric_is_reported_as_its_problem_never_raised(tmp_path, body, problem):
    model, tok = _model_and_tok(tmp_path)
    fn = metric.load(f"{_metric_file(tmp_path, _function(body))}:f")
    values, said = metric.measure(fn, model, tok, 30)
    assert values is None and said.startswith(problem), said


@pytest.mark.parametrize("body", [
    "while True:\n        pass",  # outside generate: the alarm stops it
    # the first alarm swallowed: the alarm comes again (every second) and stops the second loop
    "try:\n        while True:\n            pass\n    except BaseException:\n        pass\n    while True:\n        pass",
    # the alarm swallowed and a result returned: past its time all the same, so no numbers
    "try:\n        while True:\n            pass\n    except BaseException:\n        pass\n    return {'x': 1}",
    "while True:\n        try:\n            generate('1', max_tokens=4)\n        except Exception:\n            pass",
    "while True:\n        try:\n            sum(range(10000))\n        except Exception:\n            pass",
])
@pytest.mark.slow
def test_a_metric_past_its_time_bound_has_no_numbers(tmp_path, body):
    model, tok = _model_and_tok(tmp_path)
    fn = metric.load(f"{_metric_file(tmp_path, _function(body))}:f")
    t0 = time.monotonic()
    values, problem = metric.measure(fn, model, tok, 0.5)
    assert values is None and "ran past its" in problem and time.monotonic() - t0 < 10


def test_a_stop_signal_cuts_a_metric_short_at_its_next_token_and_its_seeding_moves_no_training_rng(tmp_path):
    model, tok = _model_and_tok(tmp_path)
    calls = []
    body = "import torch; torch.manual_seed(7); generate('1', max_tokens=50); return {'n': 1}"
    fn = metric.load(f"{_metric_file(tmp_path, _function(body))}:f")
    rng = torch.get_rng_state()
    values, problem = metric.measure(fn, model, tok, 30, stopped=lambda: calls.append(1) or len(calls) > 3)
    assert values is None and problem == "was cut short by a stop signal" and len(calls) == 4
    assert metric.measure(fn, model, tok, 30)[0] == {"n": 1.0} and torch.equal(rng, torch.get_rng_state())


def test_an_alarm_in_the_decoders_clean_up_is_raised_where_generate_is_called_never_swallowed(tmp_path):
    """The decoder is closed inside the bound, not left to the garbage collector: an alarm landing in
    its clean-up is raised to the metric's caller, where the bound catches it; in a finalizer Python
    would swallow it (pytest's PytestUnraisableExceptionWarning)."""
    _, tok = _model_and_tok(tmp_path)

    class Decoder:
        def generate(self, idx, max_new_tokens, **kwargs):
            try:
                while True:
                    yield 1
            finally:
                raise metric.MetricTimeout("an alarm in the clean-up")

    generate = metric.generate_fn(Decoder(), tok, time.monotonic() + 30, stopped=lambda: True)
    with pytest.raises(metric.MetricTimeout, match="an alarm in the clean-up"):
        generate("1")


def test_off_the_main_thread_generate_bounds_the_metric_itself_and_a_quick_one_within_a_second_counts(tmp_path):
    """No alarm outside the main thread (signals are the main thread's): the deadline checked at every
    generated token stops a metric that only generates; a quick metric is measured under a bound of
    less than a second too."""
    import threading

    model, tok = _model_and_tok(tmp_path)
    looping = metric.load(f"{_metric_file(tmp_path, _function('while True: generate(chr(49), max_tokens=4)'))}:f")
    quick = metric.load(f"{_metric_file(tmp_path, _function('return {chr(120): 1}'), 'q.py')}:f")
    out = {}
    worker = threading.Thread(target=lambda: out.update(loop=metric.measure(looping, model, tok, 0.5),
                                                       quick=metric.measure(quick, model, tok, 0.9)))
    worker.start()
    worker.join(30)
    assert not worker.is_alive() and out["loop"] == (None, "ran past its time bound in generate")
    assert out["quick"] == ({"x": 1.0}, None) and metric.measure(quick, model, tok, 0.9) == ({"x": 1.0}, None)


class _Recorder:
    """A stand-in model that records what generate asked of it and answers with the prompt's last token."""

    def __init__(self):
        self.training, self.asked = True, []

    def eval(self):
        self.training = False

    def train(self, mode=True):
        self.training = mode

    def generate(self, ids, n, temperature, top_k, generator, allowed_vocab):
        self.asked.append((n, temperature, top_k, generator.initial_seed()))
        yield from [ids[-1]] * n  # a generator, as GPT.generate is


def test_generate_asks_64_greedy_tokens_seeded_0_by_default(tmp_path):
    _, tok = _model_and_tok(tmp_path)
    model = _Recorder()
    fn = metric.load(f"{_metric_file(tmp_path, _function('return {chr(110): len(generate(chr(49)))}'))}:f")
    assert metric.measure(fn, model, tok, 30) == ({"n": 64.0}, None) and model.asked == [(64, 0.0, None, 0)]


def test_best_by_is_the_val_loss_a_higher_number_or_with_min_a_lower_one():
    assert metric.parse_best_by("val_loss").score(1.5, {"acc": 0.9}) == 1.5
    acc, err = metric.parse_best_by("acc"), metric.parse_best_by("min:err")
    assert acc == metric.parse_best_by("max:acc")
    assert acc.score(1.5, {"acc": 0.9}) < acc.score(1.5, {"acc": 0.8})  # lower score is better
    assert err.score(1.5, {"err": 0.1}) < err.score(1.5, {"err": 0.2})
    assert acc.score(1.5, None) == acc.score(1.5, {"other": 1.0}) == float("inf")  # no number: never the best
    assert acc.describe(acc.score(0, {"acc": 0.75})) == "acc 0.7500" and err.describe(err.score(0, {"err": 0.25})) == "err 0.2500"
    assert metric.parse_best_by("".join(["val_", "loss"])) == metric.BestBy()  # a string built at run time
    assert len({acc, metric.parse_best_by("max:acc"), err}) == 2  # hashable: frozen
    with pytest.raises(ConfigError, match="BEST_BY='min:'"):
        resolve(TrainConfig(best_by="min:"), cuda=False, world_size=1)  # its spelling, at the start
    with pytest.raises(ConfigError, match="--eval_metric_seconds must lie in"):
        resolve(TrainConfig(eval_metric_seconds=0), cuda=False, world_size=1)


COUNTER = '''
import os
calls = 0

def f(generate, tokenizer):
    """-(how many times rank 0 called it): the dry call is 1, step 0's eval 2, the first eval after it 3."""
    global calls
    calls += 1
    assert os.environ.get("RANK", "0") == "0"
    if calls == FAIL_AT:
        raise RuntimeError("a bad record")
    return {"calls": -calls, "text": len(generate("1+1=", max_tokens=3))}
'''


def _counter(tmp_path, fail_at: int = 0, name: str = "counter.py"):
    return _metric_file(tmp_path, f"FAIL_AT = {fail_at}\n" + COUNTER, name)


@pytest.mark.slow
def test_best_by_a_metric_chooses_the_best_checkpoint_on_every_rank(tmp_path):
    """The val loss falls from eval to eval; BEST_BY=calls (higher is better) makes the first eval after
    step 0 the best, on both ranks, so best.json, the report and what is served name that step."""
    path = _counter(tmp_path)
    common = [*TINY, "--data_dir", write_corpus(tmp_path), "--max_steps", 6, "--eval_every_steps", 2,
              "--eval_every_minutes", 1000, "--save_every_steps", 2, "--total_batch_size", 256,
              "--eval_metric", f"{path}:f", "--plateau_evals", 0]
    proc = run_train([*common, "--workspace", tmp_path / "ws", "--best_by", "calls"], nproc=2)
    run_dir = tmp_path / "ws/checkpoints/d2"
    assert "metric | " + f"{path}:f | before training: calls -1.0000, text 3.0000" in proc.stdout
    assert "step 000004 | metric | calls -4.0000 | text 3.0000 | best by calls -3.0000 @ 000002" in proc.stdout
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["metric"]["calls"] for r in evals] == [-2, -3, -4, -5]
    assert evals[-1]["val_loss"] < evals[1]["val_loss"]  # by val loss the best would be step 6
    assert ckpt.read_best(run_dir)["step"] == 2 == ckpt.read_meta(run_dir, 6)["state"]["best_step"]
    report = (run_dir / "report.md").read_text()
    assert "at step 2" in report and "chosen by calls (calls -3.0000)" in report and "| calls | text |" in report
    by_loss = run_train([*common, "--workspace", tmp_path / "ws2"], nproc=1)  # BEST_BY=val_loss: the metric only reports
    assert ckpt.read_best(tmp_path / "ws2/checkpoints/d2")["step"] == 6
    assert not [line for line in by_loss.stdout.splitlines() if "| metric | calls" in line and "best by" in line]
    # Extended under BEST_BY=min:calls: the next eval becomes the best, then the lowest number wins,
    # the final step's (each eval's number is lower than the one before).
    resumed = run_train([*common, "--workspace", tmp_path / "ws", "--best_by", "min:calls", "--max_steps", 14])
    assert "BEST_BY was calls, now min:calls: the best checkpoint (step 000002) stands" in resumed.stdout
    assert ckpt.read_best(run_dir)["step"] == 14 == max(ckpt.complete_steps(run_dir))
    assert ckpt.read_best(run_dir)["best_by"] == "min:calls"


@pytest.mark.slow
def test_a_metric_that_cannot_run_stops_the_start_and_one_that_fails_later_costs_only_that_eval(tmp_path):
    common = [*TINY, "--data_dir", write_corpus(tmp_path), "--max_steps", 4, "--eval_every_steps", 2,
              "--eval_every_minutes", 1000, "--total_batch_size", 256]
    path = _counter(tmp_path)
    bad = run_train([*common, "--workspace", tmp_path / "a", "--eval_metric", f"{path}:f", "--best_by", "acc"],
                    check=False)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].endswith(
        "BEST_BY=acc: EVAL_METRIC returns calls, text, not acc"), bad.stderr
    assert not list((tmp_path / "a/checkpoints/d2").glob("model_*.pt"))
    dry_fails, eval_fails = _counter(tmp_path, 1, "dry.py"), _counter(tmp_path, 3, "later.py")  # call 3: step 2's eval
    dry = run_train([*common, "--workspace", tmp_path / "b", "--eval_metric", f"{dry_fails}:f"], check=False)
    later = run_train([*common, "--workspace", tmp_path / "c", "--eval_metric", f"{eval_fails}:f"])
    assert dry.returncode == 2 and "Traceback" not in dry.stderr
    assert (f"EVAL_METRIC={dry_fails}:f: on the model as it starts (before its first step) it raised RuntimeError: "
            "a bad record") in dry.stderr
    no_metric = run_train([*common, "--workspace", tmp_path / "d", "--best_by", "acc"], check=False)
    assert no_metric.returncode == 2 and "BEST_BY=acc: names a metric, and EVAL_METRIC is not set" in no_metric.stderr
    assert (f"step 000002 | metric | {eval_fails}:f raised RuntimeError: a bad record; this eval has no metric"
            in later.stdout)
    assert "step 000004 | metric | calls -4.0000" in later.stdout


@pytest.mark.slow
def test_the_demo_reports_its_held_out_sums_through_the_metric(tmp_path):
    proc = run_train([*TINY, "--workspace", tmp_path, "--max_steps", 2, "--total_batch_size", 256])
    assert "training on the built-in arithmetic demo" in proc.stdout
    assert "demo_metric.py:sums | before training: sums_correct 0.0000" in proc.stdout
    assert "step 000002 | metric | sums_correct " in proc.stdout


@pytest.mark.slow
def test_a_relative_eval_metric_is_relative_to_where_the_launcher_is_started(tmp_path):
    import subprocess

    from conftest import ENV, REPO

    _metric_file(tmp_path, _function("return {'ok': 1}"))
    env = {**ENV, "WORKSPACE": str(tmp_path / "ws"), "DATA_DIR": str(write_corpus(tmp_path)), "EVAL_METRIC": "m.py:f",
           "MAX_STEPS": "1", "DEPTH": "2", "ASPECT_RATIO": "32", "HEAD_DIM": "32", "MAX_SEQ_LEN": "32",
           "TOTAL_BATCH_SIZE": "256", "DEVICE_BATCH_SIZE": "4", "SAMPLE_TOKENS": "0", "EVAL_TOKENS": "512"}
    proc = subprocess.run(["bash", str(REPO / "experiment" / "run.sh")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"metric | {tmp_path / 'm.py'}:f | before training: ok 1.0000" in proc.stdout


def test_the_demo_runs_its_sums_unless_eval_metric_names_another_and_a_changed_best_by_restarts_the_best(tmp_path):
    from experiment.checkpoint import RunState
    from experiment.dataloader import write_demo_corpus
    from experiment.distributed import Dist

    cpu, lines = Dist(0, 0, 1, torch.device("cpu")), []
    demo = prepare(write_demo_corpus(tmp_path / "demo", n_lines=3000).parent, tmp_path / "ws", max_seq_len=32)
    model = build_model(tiny_config(vocab_size=demo.meta["vocab_size"]), seed=1)
    m = metric.setup(TrainConfig(), cpu, model, demo, lines.append)
    assert m.spec == metric.DEMO_METRIC and m.seconds == 120.0 and "sums_correct 0.0000" in lines[-1]
    assert hash(m)  # frozen: the trainer holds it for the run
    other = _metric_file(tmp_path, _function("return {'x': 2}"))
    m = metric.setup(TrainConfig(eval_metric=f"{other}:f", best_by="min:x"), cpu, model, demo, lines.append)
    assert m.spec == f"{other}:f" and lines[-1].endswith("best by min:x") and "x 2.0000" in lines[-1]
    plain, _ = _model_and_tok(tmp_path)
    prepared = prepare(tmp_path / "corpus", tmp_path / "ws", max_seq_len=32)
    assert metric.setup(TrainConfig(), cpu, plain, prepared, lines.append) is None
    early = tmp_path / "early"  # a file named before the demo's: no demo
    early.mkdir()
    (early / "a.txt").write_text((tmp_path / "corpus" / "sums.txt").read_text())
    assert metric.setup(TrainConfig(), cpu, plain, prepare(early, tmp_path / "ws", max_seq_len=32), lines.append) is None
    with pytest.raises(ConfigError, match="BEST_BY=acc: names a metric, and EVAL_METRIC is not set"):
        metric.setup(TrainConfig(best_by="acc"), cpu, plain, prepared, lines.append)
    with pytest.raises(ConfigError, match="BEST_BY=y: EVAL_METRIC returns x, not y"):
        metric.setup(TrainConfig(eval_metric=f"{other}:f", best_by="y"), cpu, model, demo, lines.append)
    st = RunState(best_val=1.5, best_step=4, best_score=1.5)
    metric.adopt_best_by(st, "val_loss", lines.append)
    assert (st.best_score, st.best_by) == (1.5, "val_loss")
    metric.adopt_best_by(st, "acc", lines.append)
    assert (st.best_score, st.best_by, st.best_step) == (float("inf"), "acc", 4) and "BEST_BY was val_loss" in lines[-1]
    st.best_score, n = -0.5, len(lines)
    metric.adopt_best_by(st, "max:acc", lines.append)  # the same, spelled otherwise
    assert st.best_score == -0.5 and len(lines) == n
    fresh = RunState()
    metric.adopt_best_by(fresh, "acc", lines.append)
    assert fresh.best_by == "acc" and len(lines) == n  # no best to speak of


def test_an_alarm_that_lands_in_the_time_bounds_clean_up_still_clears_the_timer(monkeypatch):
    """The repeating alarm firing as the metric returns, before the timer is cleared: the clean-up is
    done anyway, so no alarm goes off later inside training."""
    import signal

    real_setitimer, fired = signal.setitimer, []

    def alarm_on_first_clear(which, seconds, interval=0.0):
        if seconds == 0 and not fired:
            fired.append(1)
            raise metric.MetricTimeout("ran past its 5 s")  # what the handler raises when the alarm lands here
        return real_setitimer(which, seconds, interval)

    before = signal.getsignal(signal.SIGALRM)
    monkeypatch.setattr(signal, "setitimer", alarm_on_first_clear)
    with metric.time_bound(5.0):
        pass
    monkeypatch.undo()
    assert fired and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) == before


def test_grad_mode_is_put_back_after_the_alarm_is_cleared(tmp_path, monkeypatch):
    """An alarm landing in no_grad's exit would leave grad mode off for every later training step:
    measure clears the timer before no_grad (and eval mode and the RNG) are put back."""
    import signal

    model, tok = _model_and_tok(tmp_path)
    real_no_grad, armed_at_exit = torch.no_grad, []

    class Watched:
        def __enter__(self):
            self.inner = real_no_grad()
            return self.inner.__enter__()

        def __exit__(self, *exc):
            armed_at_exit.append(signal.getitimer(signal.ITIMER_REAL) != (0.0, 0.0))
            return self.inner.__exit__(*exc)

    monkeypatch.setattr(torch, "no_grad", Watched)
    assert metric.measure(lambda generate, tok: {"n": 1.0}, model, tok, 30) == ({"n": 1.0}, None)
    monkeypatch.undo()
    assert armed_at_exit == [False] and torch.is_grad_enabled()
