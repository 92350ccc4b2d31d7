#!/bin/bash
# Issue 51's CPU measurement, one at a time on this idle 2-core machine, from the frozen worktree
# /work/sweep51: (1) a sweep of 4 members on Tiny Shakespeare, 600 s each (TRAINING_HOURS is the
# box's wall clock: 4 waves of 600 s), with its ensembles on the whole val split; (2) DEPTH=auto for
# 2400 s, the whole sweep's compute in one run; (3) every checkpoint on the same val windows.
set -u
PY=/work/main/.venv/bin/python
cd /work/sweep51
export WORKSPACE=/work/runs51/ws DATA_DIR=/work/runs51/data VAL_FRACTION=0.1 PYTHON=$PY
mkdir -p $DATA_DIR && cp /work/shared/data/tinyshakespeare.txt $DATA_DIR/
$PY -c "import torch,time;a=torch.randn(1024,1024);t=time.time();[a@a for _ in range(50)];print('peak', 2*1024**3*50/(time.time()-t)/1e9, 'GFLOP/s')"
date
SWEEP='DEPTH=auto DEPTH=4 DEPTH=8 DEPTH=auto+ATTN_DROPOUT=0.1' TRAINING_HOURS=0.666667 bash experiment/run.sh > /work/runs51/sweep.log 2>&1
echo "sweep rc=$?"; date
$PY -m experiment.tools.bench ensemble --device cpu --workspace $WORKSPACE --k 2 4 \
  --checkpoints $WORKSPACE/checkpoints/sweep/d*/ > /work/runs51/ensemble.log 2>&1
echo "ensemble rc=$?"; date
touch /work/runs51/done
