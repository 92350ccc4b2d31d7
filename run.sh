#!/usr/bin/env bash
# Newcomer entry point.
#   bash run.sh          create .venv if missing, install requirements.txt, train (demo on CPU)
#   bash run.sh test     the test suite (pytest); exits with pytest's status
#   bash run.sh serve    serve the best checkpoint of the most recent run
#   bash run.sh sample   sample from it on the command line (--prompt TEXT --max_tokens N ...)
#   bash run.sh export   its best model as one bf16 file to download (--checkpoint RUN_DIR --out FILE)
#   bash run.sh plan     what the data and budget support on the GPUs you would rent (--json); no GPU
#   bash run.sh gpucheck prove a GPU box in minutes (experiment/tools/gpucheck.py); --quick for less
# Extra arguments go to the command (pytest, experiment.server, .sample, .export, .plan, gpucheck).
set -euo pipefail
here=$PWD  # relative DATA_DIR and WORKSPACE mean relative to where the user stands
cd "$(dirname "$0")"

usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; }
# Usage first: a typo must not wait for a venv and an install to learn it is one.
case "${1:-train}" in
    -h|--help|help) usage; exit 0 ;;
    train|test|serve|sample|export|plan|gpucheck) ;;
    *) echo "unknown command: $1" >&2; usage >&2; exit 2 ;;
esac

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# Reinstall only when requirements.txt changed, so a second `bash run.sh` starts at once.
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ "$(cat .venv/.requirements.sha256 2>/dev/null)" != "$want" ]; then
    .venv/bin/python -m pip install --disable-pip-version-check -q -r requirements.txt
    echo "$want" > .venv/.requirements.sha256
fi
export PATH="$PWD/.venv/bin:$PATH"

cmd=${1:-train}
[ $# -gt 0 ] && shift
if [ "$cmd" = test ]; then
    exec python -m pytest tests "$@"
fi
# The other commands run where the user stands, so that paths they are given (DATA_DIR, --checkpoint,
# --prompt_file) mean what they say; the code is found through PYTHONPATH.
repo=$PWD
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
cd "$here"
case "$cmd" in
    train) exec bash "$repo/experiment/run.sh" "$@" ;;
    serve) exec python -m experiment.server "$@" ;;
    sample) exec python -m experiment.sample "$@" ;;
    export) exec python -m experiment.export "$@" ;;
    plan) exec python -m experiment.plan "$@" ;;
    gpucheck) exec python -m experiment.tools.bench gpucheck "$@" ;;
esac
