"""The user's own metric: EVAL_METRIC=path/to/file.py:function, called at every eval on rank 0 as
`function(generate, tokenizer) -> dict[str, float]`, within EVAL_METRIC_SECONDS.

`generate(prompt, max_tokens=64, temperature=0.0, top_k=None, stop=None, seed=0) -> str` decodes
the weights the eval chose (greedy by default, a private generator: training's RNG never moves);
`tokenizer` has encode/decode. BEST_BY=<name> (higher is better) or min:<name> makes one of the
returned numbers choose the best checkpoint in place of the val loss. The trainer makes a dry call
on the untrained model before step 0, so a metric that cannot run is one error at the start; a
failure later (an exception, the time bound) costs that eval its numbers, never the run.
The built-in demo's metric is experiment/demo_metric.py.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import numbers
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from experiment.config import NAME, BestBy, ConfigError, TrainConfig, parse_best_by  # noqa: F401 (re-exported)
from experiment.dataloader import DEMO_FILE, Prepared
from experiment.distributed import Dist, broadcast_object
from experiment.evaluation import evaluating

DEMO_METRIC = f"{Path(__file__).parent / 'demo_metric.py'}:sums"  # the built-in demo's, unless EVAL_METRIC is set


class MetricTimeout(BaseException):
    """The metric ran past EVAL_METRIC_SECONDS, or a stop signal came: a BaseException, so that a
    metric's own `except Exception` does not swallow it."""


def load(spec: str) -> Callable:
    """EVAL_METRIC's function: the file is imported as a module of its own. ConfigError names what is
    missing."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name.isidentifier():
        raise ConfigError(f"EVAL_METRIC={spec!r}: expected path/to/file.py:function")
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"EVAL_METRIC={spec!r}: {file} is not a file")
    module_spec = importlib.util.spec_from_file_location(f"eval_metric_{abs(hash(str(file.resolve())))}", file)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"EVAL_METRIC={spec!r}: {file} cannot be imported as Python")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's file: any error it raises is theirs to read, in one line
        raise ConfigError(f"EVAL_METRIC={spec!r}: importing {file} raised {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"EVAL_METRIC={spec!r}: {file} has no function {name}")
    return fn


@contextlib.contextmanager
def time_bound(seconds: float):
    """MetricTimeout in this thread once `seconds` pass (SIGALRM: a metric that loops outside generate
    is bounded too), where this is the main thread; elsewhere generate's own checks bound it."""
    if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise MetricTimeout(f"ran past its {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)  # again every second, until cleared
    try:
        yield
    finally:
        while True:  # an alarm that lands in the clean-up raises there: clean up again, or it repeats forever
            try:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
                break
            except MetricTimeout:
                continue


def generate_fn(model, tok, deadline: float, stopped: Callable[[], bool]) -> Callable[..., str]:
    """The `generate` a metric gets: text in, the completion out (prompt excluded, cut before `stop`).
    It raises MetricTimeout past the deadline or once `stopped()` (a stop signal: the save comes first)."""

    def generate(prompt: str, max_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
                 stop: str | None = None, seed: int = 0) -> str:
        gen = torch.Generator().manual_seed(seed)  # private: the metric never shifts training's RNG
        out, text = [], ""
        # Closed here, inside the time bound: a decoder left for the garbage collector closes later,
        # where an alarm landing in its clean-up is swallowed as an unraisable exception.
        with contextlib.closing(model.generate(tok.encode(prompt), int(max_tokens), temperature=temperature,
                                               top_k=top_k, generator=gen, allowed_vocab=tok.n_real)) as tokens:
            for token in tokens:
                if time.monotonic() > deadline:
                    raise MetricTimeout("ran past its time bound in generate")
                if stopped():
                    raise MetricTimeout("was cut short by a stop signal")
                out.append(token)
                if stop and stop in (text := tok.decode(out)):
                    return text[: text.index(stop)]
        return tok.decode(out)

    return generate


def measure(fn: Callable, model, tok, seconds: float,
            stopped: Callable[[], bool] = lambda: False) -> tuple[dict[str, float] | None, str | None]:
    """(the metric's numbers, None), or (None, what went wrong): an exception, the time bound, a stop
    signal, or a result that is not a dict of names to finite numbers. The random state (CPU and
    the current GPU) is restored after it: a metric that seeds does not move training's."""
    start = time.monotonic()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        # The alarm innermost: it is cleared before no_grad, eval mode and the RNG are put back, so an
        # alarm cannot land in their clean-up (grad mode left off would break every later step).
        with torch.random.fork_rng(devices=devices), evaluating(model), torch.no_grad(), time_bound(seconds):
            result = fn(generate_fn(model, tok, start + seconds, stopped), tok)
    except MetricTimeout as e:
        return None, f"{e}"
    except (Exception, SystemExit) as e:  # the user's code: report it, the run goes on
        return None, f"raised {type(e).__name__}: {e}"
    if time.monotonic() - start > seconds:  # the timeout caught and swallowed by the metric itself
        return None, f"ran past its {seconds:g} s"
    return check_result(result)


def check_result(result) -> tuple[dict[str, float] | None, str | None]:
    if not isinstance(result, Mapping) or not result:
        return None, f"returned {type(result).__name__}, not a non-empty dict of names to numbers"
    values = {}
    for name, value in result.items():
        if not isinstance(name, str) or not NAME.match(name):
            return None, f"returned the name {name!r} (expected letters, digits, _ . / -, at most 64)"
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            return None, f"returned {name}={value!r}, not a finite number"
        values[name] = float(value)
    return values, None


def preflight(fn: Callable, spec: str, best_by: BestBy, model, tok, seconds: float) -> dict[str, float]:
    """The dry call on the untrained model; ConfigError (one line) when it cannot serve the run."""
    values, problem = measure(fn, model, tok, seconds)
    if problem is not None:
        raise ConfigError(f"EVAL_METRIC={spec}: on the model as it starts (before its first step) it {problem}")
    if best_by.name is not None and best_by.name not in values:
        raise ConfigError(f"BEST_BY={best_by.name}: EVAL_METRIC returns {', '.join(values)}, not {best_by.name}")
    return values


@dataclass(frozen=True)
class EvalMetric:
    fn: Callable
    spec: str  # EVAL_METRIC as given (or the demo's)
    tok: object  # the data's tokenizer
    seconds: float  # EVAL_METRIC_SECONDS


def setup(cfg: TrainConfig, d: Dist, model, prepared: Prepared, log) -> EvalMetric | None:
    """EVAL_METRIC (on the built-in demo, the demo's sums unless it is set), loaded on every rank and
    dry-called on rank 0 with the model as it starts: the same ConfigError on every rank if it
    cannot serve the run."""
    demo = any(Path(s["path"]).name == DEMO_FILE for s in prepared.meta["sources"])
    spec = cfg.eval_metric or (DEMO_METRIC if demo else None)
    best_by = parse_best_by(cfg.best_by)
    if spec is None:
        if best_by.name is not None:
            raise ConfigError(f"BEST_BY={cfg.best_by}: names a metric, and EVAL_METRIC is not set")
        return None
    fn, tok, values, problem = None, prepared.tokenizer(), None, None
    if d.master:  # only rank 0 calls it: the other ranks never import the user's file
        try:
            fn = load(spec)
            values = preflight(fn, spec, best_by, model, tok, cfg.eval_metric_seconds)
        except ConfigError as e:
            problem = str(e)
    problem = broadcast_object(problem, d)
    if problem is not None:
        raise ConfigError(problem, every_rank=True)
    log(f"metric | {spec} | before training: " + ", ".join(f"{k} {v:.4f}" for k, v in (values or {}).items())
        + f" | within {cfg.eval_metric_seconds:g} s at each eval | best by {cfg.best_by}")
    return EvalMetric(fn, spec, tok, cfg.eval_metric_seconds)


def adopt_best_by(st, best_by: str, log) -> None:
    """A run resumed under another BEST_BY has no best measured by it: the next eval past step 0
    becomes the best (best.json keeps naming the old one until then)."""
    if parse_best_by(st.best_by) == parse_best_by(best_by):  # acc and max:acc are one
        return
    if st.best_step >= 0:
        log(f"metric | BEST_BY was {st.best_by}, now {best_by}: the best checkpoint (step {st.best_step:06d}) "
            "stands until the next eval, which becomes the best")
    st.best_by, st.best_score = best_by, math.inf


def at_eval(t, loop) -> dict[str, float] | None:
    """EVAL_METRIC's numbers for the weights this eval chose (a Trainer and its Loop), measured on rank 0
    and the same on every rank (BEST_BY may choose by them); None without a metric, or when it failed
    this time (logged)."""
    if t.metric is None:
        return None
    values, problem = None, None
    with t.opt.average.swapped_in() if loop.weights == "average" else contextlib.nullcontext():  # a collective
        if t.d.master:
            values, problem = measure(t.metric.fn, t.model, t.metric.tok, t.metric.seconds,
                                      lambda: bool(loop.stop_signal and loop.stop_signal.signum))
    if problem is not None:
        t.log(f"step {t.st.step:06d} | metric | {t.metric.spec} {problem}; this eval has no metric")
    return broadcast_object(values, t.d)
