#!/bin/bash
# Issue 51: kill -9 of a sweep (launcher and running members) mid-way, then the same command; the
# members' final checkpoints against the same sweep uninterrupted. 2 members side by side on 2 cores,
# d4 on Tiny Shakespeare, MAX_STEPS ends each (a budget would end them at clock-dependent steps).
set -u
PY=/work/main/.venv/bin/python
cd /work/main
export DATA_DIR=/work/runs51/data VAL_FRACTION=0.1 PYTHON=$PY SWEEP_PARALLEL=2 TRAINING_HOURS=2 \
  MAX_STEPS=300 SAVE_EVERY_STEPS=50 SEED=7
export SWEEP='DEPTH=4+AVERAGE=ema+ATTN_DROPOUT=0.1 DEPTH=4+SEED=2'
K=/work/runs51/kill
date; git log --oneline -1
WORKSPACE=$K/ref bash experiment/run.sh > $K/ref.log 2>&1; echo "ref rc=$?"; date
setsid env WORKSPACE=$K/killed bash experiment/run.sh > $K/killed1.log 2>&1 &
pid=$!
# kill once both members have a checkpoint at step 100 or later (a third of the way)
until [ -e $K/killed/checkpoints/sweep/d4-average_ema-attn_dropout0.1/meta_000100.json ] && \
      [ -e $K/killed/checkpoints/sweep/d4-seed2/meta_000100.json ]; do sleep 1; done
sleep 7
ls $K/killed/checkpoints/sweep/*/meta_*.json
for lock in $K/killed/checkpoints/sweep/*/.lock; do kill -9 -- -$(ps -o pgid= $(awk '{print $2}' $lock) | tr -d ' ') ; done
kill -9 -- -$pid; sleep 2; echo "killed at $(date)"
WORKSPACE=$K/killed bash experiment/run.sh > $K/killed2.log 2>&1; echo "again rc=$?"; date
$PY $K/compare.py $K/killed/checkpoints/sweep $K/ref/checkpoints/sweep
touch $K/done
