#!/usr/bin/env bash
# The launcher to run in tmux. Every training setting is an env override named like its flag in
# upper case (DEPTH, TRAINING_HOURS, DATA_DIR, ...: `python -m experiment.train --help` lists them
# with their defaults), or an argument KEY=VALUE; unset means train.py's default for the device.
#   NPROC_PER_NODE   processes per node (default: visible GPUs, or 1 without CUDA)
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT   multi-node torchrun (c10d rendezvous)
#   PREFLIGHT_WAIT_MINUTES   how long a node other than 0 waits for node 0 to prepare the data (120)
set -euo pipefail
# Arguments are settings too, KEY=VALUE, the same as env overrides (bash run.sh train DEPTH=24 ...);
# they win over the environment. Their names are checked against the known ones below.
given=()
for arg in "$@"; do
    if [[ ! "$arg" =~ ^([A-Z][A-Z0-9_]*)=(.*)$ ]]; then
        echo "error: '$arg' is not a setting: arguments are KEY=VALUE, e.g. DEPTH=24 TRAINING_HOURS=10" >&2
        exit 2
    fi
    export "${BASH_REMATCH[1]}=${BASH_REMATCH[2]}"
    given+=("${BASH_REMATCH[1]}")
done
# Relative paths mean relative to where the user stands, not to the repo this script moves into
# (PYTHON only when it is a path: python3 stays a name looked up on the PATH).
for var in DATA_DIR WORKSPACE INIT_FROM PREPARED_DIR PYTHON EVAL_METRIC; do
    if [ -n "${!var:-}" ] && [[ "${!var}" != /* ]] && { [ "$var" != PYTHON ] || [[ "$PYTHON" == */* ]]; }; then
        printf -v "$var" '%s' "$PWD/${!var}"
    fi
done
cd "$(dirname "$0")/.."
# The Python: .venv, created and installed on first use (a fresh clone needs no other step); or
# PYTHON / an active venv, checked against requirements.txt (experiment/pyenv.sh, shared with run.sh).
source experiment/pyenv.sh
setup_python
# The budget counts the box from here (the pre-flight, data preparation, torchrun's start, the
# trainer's setup): experiment/launch.py, launch_started. A sweep's first-wave member counts from the
# sweep's start instead (SWEEP_MEMBER_STARTED: the members' pre-flights came before it).
LAUNCH_STARTED=${SWEEP_MEMBER_STARTED:-$(date +%s.%N)}
export LAUNCH_STARTED
unset SWEEP_MEMBER_STARTED

# The GPUs, the settings and torchrun's flags, from one Python process (experiment/launchfacts.py).
facts_out=$("$PYTHON" -m experiment.launchfacts) || exit $?
mapfile -t facts <<< "$facts_out"
[ "${#facts[@]}" = 3 ] || { echo "error: $PYTHON -m experiment.launchfacts printed no three lines" >&2; exit 1; }
n_gpu=${facts[0]} fields=${facts[1]} torchrun_has_shutdown_timeout=${facts[2]}
if [ "$n_gpu" -gt 0 ]; then default_nproc=$n_gpu; else default_nproc=1; fi
NPROC_PER_NODE=${NPROC_PER_NODE:-$default_nproc}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_PORT=${MASTER_PORT:-29500}
# A worker that dies (OOM kill, NCCL fault) makes torchrun restart all workers, which resume from
# the latest complete checkpoint (RESUME=auto), up to MAX_RESTARTS times.
MAX_RESTARTS=${MAX_RESTARTS:-3}
# On SIGTERM/SIGINT torchrun forwards the signal and waits this long for the workers to finish the
# step and save before it kills them; unset, the pre-flight sizes it to the predicted save (300 s at least).
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-}

# Map env overrides to flags; the flag list (fields) comes from TrainConfig itself, so the two never drift.
launcher="NPROC_PER_NODE NNODES NODE_RANK MASTER_ADDR MASTER_PORT MAX_RESTARTS SHUTDOWN_TIMEOUT PREFLIGHT_WAIT_MINUTES PYTHON PYTHON_CHECK ON_EXIT SWEEP SWEEP_TAG SWEEP_PARALLEL SWEEP_ENSEMBLE_TOKENS SWEEP_ALLOW_IDLE"
known=" ${fields^^} $launcher "
for name in "${given[@]}"; do
    if [[ "$known" != *" $name "* ]]; then
        echo "error: $name is no setting; the settings are: ${fields^^} $launcher (docs/settings.md)" >&2
        exit 2
    fi
done
# A sweep: each member is this launcher again, with its own settings (experiment/sweep.py, docs/sweep.md).
if [ -n "${SWEEP:-}" ]; then
    exec "$PYTHON" -m experiment.sweep
fi
flags=()
for name in $fields; do
    var=${name^^}
    if [ -n "${!var+set}" ]; then
        flags+=("--$name=${!var}")
    fi
done

# torchrun's agent, with one thing more (experiment/agent.py): a launch the trainer ended (a mistake it
# found at the start, a failed final save) ends once, with the trainer's code and no traceback.
if [ "$NNODES" -gt 1 ]; then
    : "${MASTER_ADDR:?MASTER_ADDR must be set when NNODES > 1}"
    launch=(--nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$NPROC_PER_NODE"
            --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv_id="${MODEL_TAG:-run}")
else
    launch=(--standalone --nproc_per_node="$NPROC_PER_NODE")
fi
launch+=(--max-restarts="$MAX_RESTARTS")

# The pre-flight: config, data, resume target and plan in one plain process. A user's error exits 2
# here, once, and torchrun never starts (it would restart the same mistake MAX_RESTARTS times).
plan_file=$(mktemp)
trap 'rm -f "$plan_file"' EXIT
"$PYTHON" -m experiment.preflight --world_size=$((NPROC_PER_NODE * NNODES)) --nproc_per_node="$NPROC_PER_NODE" \
    --node_rank="$NODE_RANK" \
    --wait_minutes="${PREFLIGHT_WAIT_MINUTES:-120}" --shutdown_timeout="${SHUTDOWN_TIMEOUT:-0}" \
    --plan_file="$plan_file" "${flags[@]}" || exit $?
mapfile -t plan < <("$PYTHON" -c 'import json, sys; p = json.load(open(sys.argv[1])); print(p["prepared"]); print(p["run_dir"]); print(p["shutdown_timeout"])' "$plan_file")
prepared=${plan[0]} run_dir=${plan[1]} SHUTDOWN_TIMEOUT=${plan[2]}

# torchrun has a shutdown timeout flag only from torch 2.13 on (2.11 refuses it and starts nothing);
# older ones wait their fixed default (30 s) before SIGKILL.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=$SHUTDOWN_TIMEOUT
if [ "$torchrun_has_shutdown_timeout" = 1 ]; then
    launch+=(--shutdown_timeout="$SHUTDOWN_TIMEOUT")
else
    echo "launcher | this torch's torchrun has no --shutdown_timeout: it waits its own default after a signal"
fi
flags+=("--prepared_dir=$prepared")

# Every worker's stderr also goes to a file in the run directory, which the worker writes itself
# (torchrun's redirect, teed to this console): it outlives a killed launcher, and it is where an
# NCCL timeout lands. NCCL's watchdog aborts the process (TORCH_NCCL_ASYNC_ERROR_HANDLING=3, the
# default): no Python traceback reaches training.log, only the watchdog's lines on stderr. The
# flight recorder keeps the last collectives and dumps them there on a timeout.
launch+=(--log-dir="$run_dir/workers" --redirects=2 --tee=2)
export TORCH_FR_BUFFER_SIZE=${TORCH_FR_BUFFER_SIZE:-2000}
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
export TORCH_FR_DUMP_TEMP_FILE=${TORCH_FR_DUMP_TEMP_FILE:-$run_dir/workers/nccl_trace_rank_}

# One run per run directory: node 0 holds a flock on <run_dir>/.lock from here on; exec keeps the
# descriptor open in torchrun, so the lock lives exactly as long as the launch (the kernel drops it
# when torchrun exits or is killed: the same command after a crash resumes). The pre-flight already
# refused a directory whose lock was held; this closes the window between the two.
if [ "$NODE_RANK" = 0 ]; then
    mkdir -p "$run_dir"
    exec {lock_fd}>>"$run_dir/.lock"
    if ! flock -n "$lock_fd"; then
        echo "error: $run_dir is in use by a running launch ($(cat "$run_dir/.lock")); wait for it, stop it, or choose another MODEL_TAG" >&2
        exit 2
    fi
    printf 'pid %s on %s since %s\n' "$$" "$(hostname)" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$run_dir/.lock"
fi

# A trainer that ends its launch with what a restart would repeat leaves .ended.<host>.<torchrun pid>.<worker pid>.<code>
# for torchrun's restarts (experiment/launch.py); this launch's torchrun may reuse an old pid.
rm -f -- "$run_dir"/.ended."$(uname -n)".*

echo "launcher | gpus visible $n_gpu | nproc_per_node $NPROC_PER_NODE | nnodes $NNODES | node_rank $NODE_RANK |" \
     "max_restarts $MAX_RESTARTS | shutdown_timeout ${SHUTDOWN_TIMEOUT}s"
echo "launcher | overrides: ${flags[*]:-(none: device defaults)}"
agent=("$PYTHON" -m experiment.agent "$run_dir")
echo "launcher | ${agent[*]} ${launch[*]} -m experiment.train ${flags[*]}"
# train.py prints the fully resolved configuration next and appends its lines (and any crash's
# traceback) to training.log in the run directory.
rm -f "$plan_file"
# ON_EXIT: a watcher in its own session (the signals that stop the run do not reach it, and it does
# not hold the run's lock) waits for this process, torchrun after the exec below, to be gone, then
# runs the command once with the outcome in RUN_STATUS, RUN_OUTCOME, BEST_CHECKPOINT, ...
if [ -n "${ON_EXIT:-}" ]; then
    mkdir -p "$run_dir"
    # Not LAUNCH_STARTED: a trainer that ON_EXIT starts is a launch of its own, not this one's
    watcher=(env -u LAUNCH_STARTED setsid "$PYTHON" -m experiment.onexit "$$" "$run_dir" "$(date +%s)" "$ON_EXIT")
    if [ -n "${lock_fd:-}" ]; then
        "${watcher[@]}" {lock_fd}>&- </dev/null >>"$run_dir/on_exit.log" 2>&1 &
    else
        "${watcher[@]}" </dev/null >>"$run_dir/on_exit.log" 2>&1 &
    fi
    echo "launcher | ON_EXIT runs once the run ends (its output: $run_dir/on_exit.log)"
fi
# The workers' agent: torchrun takes over this pid. Each worker watches it (experiment/distributed.py,
# ParentWatch), so a torchrun killed while its workers still import torch leaves none behind.
export LAUNCH_AGENT_PID=$$
exec "${agent[@]}" "${launch[@]}" -m experiment.train "${flags[@]}"
