#!/bin/bash
# Issue 51: DEPTH=auto for 2400 s (the whole 4-member sweep's compute in one run), from the sweep's
# own frozen commit c4aeae9, on the same data and split; then its checkpoint on the whole val split.
set -u
PY=/work/main/.venv/bin/python
cd /work/sweep51
export WORKSPACE=/work/runs51/single/ws DATA_DIR=/work/runs51/data VAL_FRACTION=0.1 PYTHON=$PY
$PY -c "import torch,time;a=torch.randn(1024,1024);t=time.time();[a@a for _ in range(50)];print('peak', 2*1024**3*50/(time.time()-t)/1e9, 'GFLOP/s')"
date
DEPTH=auto TRAINING_HOURS=0.666667 bash experiment/run.sh > /work/runs51/single/train.log 2>&1
echo "train rc=$?"; date
$PY -c "import torch,time;a=torch.randn(1024,1024);t=time.time();[a@a for _ in range(50)];print('peak', 2*1024**3*50/(time.time()-t)/1e9, 'GFLOP/s')"
$PY -m experiment.tools.bench ensemble --device cpu --workspace $WORKSPACE --k 2 \
  --checkpoints $WORKSPACE/checkpoints/*/ > /work/runs51/single/ensemble.log 2>&1
echo "ensemble rc=$?"; date
touch /work/runs51/single/done
