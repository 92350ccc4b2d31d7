#!/usr/bin/env bash
# Newcomer entry point.
#   bash run.sh          create .venv if missing, install requirements.txt, train (demo on CPU)
#   bash run.sh test     the test suite on every core (--quick: the unit tier; tests/test_x.py -k name: those)
#   bash run.sh serve    serve the best checkpoint of the most recent run
#   bash run.sh sample   sample from it on the command line (--prompt TEXT --max_tokens N ...)
#   bash run.sh export   its best model as one bf16 file to download (--checkpoint RUN_DIR --out FILE)
#   bash run.sh plan     what the data and budget support on the GPUs you would rent (--json); no GPU
#   bash run.sh gpucheck prove a GPU box in minutes (experiment/tools/gpucheck.py); --quick for less
#   bash run.sh mutate   mutation-test a core module against its tests (tests/mutate.py; not part of test)
# Extra arguments go to the command (pytest, experiment.server, .sample, .export, .plan, gpucheck, mutate).
set -euo pipefail
here=$PWD  # relative DATA_DIR and WORKSPACE mean relative to where the user stands
if [[ "${PYTHON:-}" == */* && "$PYTHON" != /* ]]; then PYTHON=$here/$PYTHON; fi  # a path, not a name on PATH
cd "$(dirname "$0")"

usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; }
# Usage first: a typo must not wait for a venv and an install to learn it is one.
case "${1:-train}" in
    -h|--help|help) usage; exit 0 ;;
    train|test|serve|sample|export|plan|gpucheck|mutate) ;;
    *) echo "unknown command: $1" >&2; usage >&2; exit 2 ;;
esac

# The Python (.venv, created and installed on first use; or PYTHON / an active venv, checked):
# experiment/pyenv.sh, which experiment/run.sh uses too.
source experiment/pyenv.sh
setup_python

cmd=${1:-train}
[ $# -gt 0 ] && shift
if [ "$cmd" = test ]; then
    # The whole suite and the quick tier run on every core (pytest-xdist, TEST_WORKERS workers, handed
    # tests in the order tests/conftest.py sets; 0: one process). A file or directory given first runs
    # only it, in one process unless TEST_WORKERS is set.
    # The slowest 40 close the output: what the suite's time goes to.
    where=(tests) workers=${TEST_WORKERS:-$(nproc)}
    if [ "${1:-}" = --quick ]; then shift; set -- -m "not slow" "$@"
    elif [ $# -gt 0 ] && [[ "$1" != -* ]]; then where=() workers=${TEST_WORKERS:-0}; fi
    parallel=()
    if [ "$workers" != 0 ] && "$PYTHON" -c "import xdist" 2>/dev/null; then
        parallel=(-n "$workers" --dist worksteal)
    fi
    exec "$PYTHON" -m pytest "${where[@]}" "${parallel[@]}" --durations=40 "$@"
fi
if [ "$cmd" = mutate ]; then  # its tester is a test-only dependency: installed here, never by a launch
    "$PYTHON" -c "import cosmic_ray" 2>/dev/null \
        || "$PYTHON" -m pip install --disable-pip-version-check -q -r requirements-dev.txt
    exec "$PYTHON" tests/mutate.py "$@"
fi
# The other commands run where the user stands, so that paths they are given (DATA_DIR, --checkpoint,
# --prompt_file) mean what they say; the code is found through PYTHONPATH.
repo=$PWD
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
cd "$here"
case "$cmd" in
    train) exec bash "$repo/experiment/run.sh" "$@" ;;
    serve) exec "$PYTHON" -m experiment.server "$@" ;;
    sample) exec "$PYTHON" -m experiment.sample "$@" ;;
    export) exec "$PYTHON" -m experiment.export "$@" ;;
    plan) exec "$PYTHON" -m experiment.plan "$@" ;;
    gpucheck) exec "$PYTHON" -m experiment.tools.bench gpucheck "$@" ;;
esac
