#!/bin/bash
# The second half of kill.sh, with the members' real directory names (kill.sh waited on a wrong one;
# its first launch of the killed sweep was already running when this took over).
set -u
PY=/work/main/.venv/bin/python
cd /work/main
export DATA_DIR=/work/runs51/data VAL_FRACTION=0.1 PYTHON=$PY SWEEP_PARALLEL=2 TRAINING_HOURS=2 \
  MAX_STEPS=300 SAVE_EVERY_STEPS=50 SEED=7
export SWEEP='DEPTH=4+AVERAGE=ema+ATTN_DROPOUT=0.1 DEPTH=4+SEED=2'
K=/work/runs51/kill
S=$K/killed/checkpoints/sweep
until [ -e $S/d4-averageema-attn_dropout0.1/meta_000100.json ] && [ -e $S/d4-seed2/meta_000100.json ]; do sleep 1; done
sleep 7
ls $S/*/meta_*.json
for lock in $S/*/.lock; do kill -9 -- -$(ps -o pgid= $(awk '{print $2}' $lock) | tr -d ' ') ; done
pkill -9 -f "experiment.sweep"; sleep 2; echo "killed at $(date)"
ps aux | grep -c "[e]xperiment"
WORKSPACE=$K/killed bash experiment/run.sh > $K/killed2.log 2>&1; echo "again rc=$?"; date
PYTHONPATH=/work/main $PY $K/compare.py $S $K/ref/checkpoints/sweep
touch $K/done
