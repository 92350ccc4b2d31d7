"""Mutation testing: one core module against the tests that cover it, with cosmic-ray (a test-only
dependency, requirements-dev.txt; `bash run.sh mutate` installs it on first use).

    bash run.sh mutate experiment/extend.py [--tests "tests/test_extend.py -k unit"] [--timeout S]
                                            [--out reports/mutation-extend.jsonl] [--since main] [--lines A-B]

cosmic-ray rewrites the module on disk for each mutant and runs the test command, so this runs in a
copy of the repository's tracked files (with ../shared beside it when present): the working tree is
never touched, and a run cut short leaves nothing mutated. A mutant counts as killed when the tests
fail (or time out). Skipped, because they say nothing about behaviour: mutations inside log and
message text (an f-string, the arguments of a log or print call, the message of a raised error),
type annotations (never evaluated here) and lines marked `# pragma: no mutate`; with --since REV,
also every line a change did not touch (`git diff REV` of the module): a change's own mutants in
minutes, where the whole module takes an hour or more; with --lines A-B, every line outside them (one
function of a large module). Prints the module's score (killed / tried) and every survivor
with its line and diff; --out writes one JSON line per mutant. tests/README.md says what a survivor
must get.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The tests that cover each module, fast ones first (-x stops a killed mutant at its first failure).
# A module not listed needs --tests.
TESTS = {
    "experiment/extend.py": "tests/test_extend.py",
    "experiment/finetune.py": "tests/test_finetune.py -k 'init_from or fine_tune_writes'",
    "experiment/launchfacts.py": "tests/test_train.py -k 'launchfacts or maps_env'",
    "experiment/saver.py": "tests/test_saver.py",
    "experiment/saving.py": "tests/test_saver.py tests/test_checkpoint.py "
                            "tests/test_average.py::test_a_failed_best_save_falls_back_to_the_saved_best_and_its_weights "
                            "tests/test_average.py::test_the_saver_and_the_first_save_estimate_count_the_average",
    "experiment/restarts.py": "tests/test_resilience.py -k 'lost_seconds or charged_once or heartbeat_is'",
    "experiment/plan.py": "tests/test_plan_units.py tests/test_plan.py -k 'not issue_example and not counted_in "
                          "and not refuses_data and not hours_available_picks and not bad_gpus'",
    "experiment/preflight.py": "tests/test_preflight.py tests/test_guards.py "
                               "tests/test_regime.py::test_the_preflight_plans_the_recipe_and_the_repeat_guard_leaves_it",
    "experiment/autosize.py": "tests/test_autosize.py -k 'not trainer_chooses and not a_run_stops and not an_unset_max_epochs'",
    "experiment/schedule.py": "tests/test_schedule.py tests/test_train.py -k 'test_schedule or warmup_schedules or eval_due'",
    "experiment/plateau.py": "tests/test_schedule.py tests/test_train.py tests/test_plateau.py "
                             "-k 'plateau_gain or plateau_check or start_anneal or stays_begun or noisy'",
    "experiment/stopping.py": "tests/test_stopping.py tests/test_train.py -k 'test_stopping or eval_due'",
    "experiment/evaluation.py": "tests/test_evaluation.py tests/test_regularize.py",
    "experiment/optim.py": "tests/test_regularize.py tests/test_optim.py tests/test_average.py",
    "experiment/average.py": "tests/test_average.py",
    "experiment/regime.py": "tests/test_regime.py",
    "experiment/model.py": "tests/test_regularize.py tests/test_model.py",
    "experiment/engine.py": "tests/test_engine.py",
    "experiment/server.py": "tests/test_server.py -k 'kv or ensemble or mps or batching or cli'",
    "experiment/servemem.py": "tests/test_server.py -k 'kv or free_memory or mps or cli or ensemble'",
    "experiment/checkpoint.py": "tests/test_server.py -k 'ensemble or cli' tests/test_checkpoint.py",
    "experiment/metric.py": "tests/test_metric.py -k 'not sweep and not demo and not best_by_a_metric and not cannot_run'",
    "experiment/sweep.py": "tests/test_sweep.py",
    "experiment/ensembles.py": "tests/test_sweep.py tests/tools/test_bench.py -k ensemble",
    "experiment/dataloader.py": "tests/test_dataloader.py",
    "experiment/config.py": "tests/test_regularize.py tests/test_train.py::test_settings_that_cannot_work_are_named "
                            "tests/test_train.py::test_cpu_learning_rates_follow_the_depth_and_a_given_one_is_kept",
}
# Calls whose arguments are text for a person: the trainer's log (t.log, log), print, the report's
# notes and the warnings a check returns.
MESSAGE_CALLS = {"log", "print", "note", "warn", "warning", "append_line"}
PRAGMA = "pragma: no mutate"


def message_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """((line, col), (end line, end col)) of every stretch of `source` that is text for a person:
    f-strings, the arguments of MESSAGE_CALLS, and the arguments of an error raised (its type is
    behaviour and stays mutable). Lines 1-based, columns 0-based, as cosmic-ray's positions."""
    return _spans(source)[0]


def annotation_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The type annotations: never evaluated under `from __future__ import annotations` (every core
    module has it), so `int | None` made `int + None` changes nothing."""
    return _spans(source)[1]


def _spans(source: str):
    spans, annotations = [], []

    def span(node):
        spans.append(((node.lineno, node.col_offset), (node.end_lineno, node.end_col_offset)))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.JoinedStr):
            span(node)
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in MESSAGE_CALLS:
                for arg in [*node.args, *(k.value for k in node.keywords)]:
                    span(arg)
        elif isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            for arg in [*node.exc.args, *(k.value for k in node.exc.keywords)]:
                span(arg)
        for note in (getattr(node, "annotation", None), getattr(node, "returns", None)):
            if note is not None:
                annotations.append(((note.lineno, note.col_offset), (note.end_lineno, note.end_col_offset)))
    return spans, annotations


def in_message(start: tuple[int, int], end: tuple[int, int], spans) -> bool:
    return any(a <= start and end <= b for a, b in spans)


def skip_reason(source_lines: list[str], spans, start: tuple[int, int], end: tuple[int, int],
                annotations=()) -> str | None:
    if in_message(start, end, spans):
        return "message"
    if in_message(start, end, annotations):
        return "annotation"
    last = end[0] - (1 if end[1] == 0 else 0)  # a zone ending at a line's start ends on the line before
    if any(PRAGMA in source_lines[i - 1] for i in range(start[0], last + 1)):
        return "pragma"
    return None


def changed_lines(diff: str) -> set[int]:
    """The new side's line numbers that a unified diff (`git diff -U0`) adds or changes."""
    lines = set()
    for hunk in re.finditer(r"^@@ -\S+ \+(\d+)(?:,(\d+))? @@", diff, flags=re.M):
        start, count = int(hunk.group(1)), int(hunk.group(2) or 1)
        lines.update(range(start, start + count))
    return lines


def lines_since(module: str, rev: str) -> set[int]:
    diff = subprocess.run(["git", "diff", "-U0", rev, "--", module], cwd=REPO, check=True, capture_output=True,
                          text=True).stdout
    return changed_lines(diff)


def copy_repo(dest: Path) -> Path:
    """The repository's tracked and untracked-not-ignored files under dest/repo, and ../shared beside
    it as a link when present (tests that read it skip without it)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True).stdout.decode().split("\0")
    repo = dest / "repo"
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, repo / name)
    if (REPO.parent / "shared").exists():
        (dest / "shared").symlink_to(REPO.parent / "shared")
    return repo


def line_span(spec: str) -> set[int]:
    """--lines A-B as the set of its line numbers (1-based, both ends included)."""
    first, dash, last = spec.partition("-")
    if not (dash and first.isdigit() and last.isdigit() and 0 < int(first) <= int(last)):
        raise ValueError(f"--lines {spec}: expected A-B, two line numbers from 1 with A <= B")
    return set(range(int(first), int(last) + 1))


def test_command(tests: str) -> str:
    return f"{shlex.quote(sys.executable)} -m pytest -x -q -p no:cacheprovider {tests}"


def mark_skips(session: Path, module: Path, only: set[int] | None = None) -> dict[str, str]:
    """Marks the session's mutants of message text, annotations and pragma lines skipped, and with
    `only` those on no line of it; returns {job id: reason}."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    source = module.read_text()
    lines, (spans, annotations), skipped = source.splitlines(), _spans(source), {}
    with use_db(str(session), WorkDB.Mode.open) as db:
        for item in db.work_items:
            reasons = {skip_reason(lines, spans, tuple(m.start_pos), tuple(m.end_pos), annotations)
                       if only is None or m.start_pos[0] in only else "unchanged" for m in item.mutations}
            if None not in reasons:
                skipped[item.job_id] = reasons.pop()
                db.set_result(item.job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED))
    return skipped


def results(session: Path, skipped: dict[str, str]) -> list[dict]:
    from cosmic_ray.work_db import WorkDB, use_db

    rows = []
    with use_db(str(session), WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            m = item.mutations[0]
            outcome = ("skipped: " + skipped.get(item.job_id, "?") if result.worker_outcome == "skipped"
                       else "survived" if result.test_outcome == "survived"
                       else "incompetent" if result.test_outcome == "incompetent" else "killed")
            rows.append({"line": m.start_pos[0], "operator": m.operator_name, "occurrence": m.occurrence,
                         "outcome": outcome, "diff": result.diff})
    return sorted(rows, key=lambda r: (r["line"], r["operator"], r["occurrence"]))


def summary(module: str, rows: list[dict], seconds: float) -> list[str]:
    killed = sum(r["outcome"] == "killed" for r in rows)
    survived = [r for r in rows if r["outcome"] == "survived"]
    odd = sum(r["outcome"] == "incompetent" for r in rows)
    skipped = sum(r["outcome"].startswith("skipped") for r in rows)
    tried = killed + len(survived)
    score = f"{100 * killed / tried:.1f}%" if tried else "n/a"
    lines = [f"mutate | {module}: {killed} of {tried} mutants killed ({score}); {len(survived)} survived, "
             f"{skipped} skipped (message text, annotations, pragma, lines unchanged), {odd} incompetent | {seconds / 60:.1f} min"]
    for r in survived:
        diff = "\n".join(x for x in (r["diff"] or "").splitlines() if x[:1] in "+-" and x[:3] not in ("+++", "---"))
        lines.append(f"survived | line {r['line']} | {r['operator']} #{r['occurrence']}\n{diff}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("module", help="a core module, e.g. experiment/extend.py")
    p.add_argument("--tests", help="pytest arguments (default: the module's entry in TESTS)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one mutant's tests may take")
    p.add_argument("--out", help="write one JSON line per mutant here")
    p.add_argument("--since", metavar="REV", help="mutate only the lines changed since this git revision")
    p.add_argument("--lines", metavar="A-B", help="mutate only lines A to B (one function of a large module)")
    args = p.parse_args(argv)
    module = Path(args.module).as_posix()
    if not (REPO / module).is_file():
        print(f"error: {module}: no such file in {REPO}", file=sys.stderr)
        return 2
    tests = args.tests or TESTS.get(module)
    if not tests:
        print(f"error: {module}: no tests known for it; name them with --tests", file=sys.stderr)
        return 2
    only = lines_since(module, args.since) if args.since else None
    if only is not None and not only:
        print(f"error: {module}: no line changed since {args.since}", file=sys.stderr)
        return 2
    if args.lines:
        try:
            span = line_span(args.lines)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        only = span if only is None else only & span
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="mutate-") as tmp:
        repo = copy_repo(Path(tmp))
        command = test_command(tests)
        if subprocess.run(command, shell=True, cwd=repo, capture_output=True).returncode != 0:
            print(f"error: the tests fail on the unmutated code: {command}", file=sys.stderr)
            return 1
        config = repo / "mutate.toml"
        config.write_text(f'[cosmic-ray]\nmodule-path = "{module}"\ntimeout = {args.timeout}\n'
                          f"excluded-modules = []\ntest-command = {json.dumps(command)}\n"
                          '[cosmic-ray.distributor]\nname = "local"\n')
        session = repo / "mutate.sqlite"
        cr = [sys.executable, "-m", "cosmic_ray.cli"]
        subprocess.run([*cr, "init", str(config), str(session)], cwd=repo, check=True)
        skipped = mark_skips(session, repo / module, only)
        subprocess.run([*cr, "exec", str(config), str(session)], cwd=repo, check=True)
        rows = results(session, skipped)
    print("\n".join(summary(module, rows, time.time() - t0)))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            f.writelines(json.dumps({"module": module, **r}) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
