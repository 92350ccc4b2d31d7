#!/usr/bin/env bash
# Issue 52's serving items on one GPU, in one command (reports/gpu-h200-2026-11-27-serve.md says what
# it found): batched and ensemble decoding's batch invariance with cuBLAS (tests/test_cuda.py), the
# same test against a mutant whose decode matmul is a plain F.linear (it must fail there), `gpucheck
# --quick` on this code, then decoding's tokens/s of one model and an ensemble of two (GEN picks the
# sizes; last, as it is the part a lease can spare).
#   bash experiment/tools/gpu_serve_check.sh OUT [SMOKE]     (SMOKE=1: tiny sizes on the CPU, to try it first)
set -u
OUT=${1:?OUT}; SMOKE=${2:-0}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
log() { echo "== $(date +%T) $*"; }
{
log "machine"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
$PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
CPUFLAG=(); [ "$SMOKE" = 1 ] && CPUFLAG=(--cuda-tests-on-cpu)

log "1. batch invariance, one model and an ensemble of two, fp32 and bf16"
timeout 120 $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "batched_decoding or block_linear" "${CPUFLAG[@]}" -rA 2>&1 | tail -5

log "2. the same test on a mutant: block_linear as one plain F.linear over the batch (must FAIL)"
rm -rf /tmp/mut && mkdir -p /tmp/mut && cp -r experiment tests /tmp/mut/
$PY - <<'PY'
p = "/tmp/mut/experiment/engine.py"
s = open(p).read()
old = "    rows = x.reshape(B, -1)\n"
assert s.count(old) == 1
open(p, "w").write(s.replace(old, old + "    return F.linear(rows, layer.weight).view(B, 1, -1)\n"))
PY
(cd /tmp/mut && timeout 120 $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "batched_decoding or block_linear" "${CPUFLAG[@]}" 2>&1 | tail -4)

log "3. gpucheck --quick"
if [ "$SMOKE" = 1 ]; then ONLY=(--only env); else ONLY=(); fi
timeout 400 $PY -m experiment.tools.bench gpucheck --quick --workspace /tmp/gc "${ONLY[@]}" > "$OUT/gpucheck.log" 2>&1
echo "gpucheck rc=$?"; tail -30 "$OUT/gpucheck.log"
cp /tmp/gc/gpucheck/*/report.md "$OUT/gpucheck-report.md" 2>/dev/null
log "4. decoding tokens/s (bf16, fresh weights): depth:context:tokens:members:batch from GEN, capped at 150 s"
if [ "$SMOKE" = 1 ]; then DEV=cpu; GEN=${GEN:-"2:64:64:1:1 2:64:64:2:1"}; else DEV=cuda
  GEN=${GEN:-"12:2048:512:1:1 12:2048:512:1:8 12:2048:512:2:1 12:2048:512:2:8 32:2048:256:1:1 32:2048:256:1:8 32:2048:256:2:1 32:2048:256:2:8"}; fi
for size in $GEN; do
  IFS=: read -r depth ctx tokens members batch <<<"$size"
  timeout 150 $PY -m experiment.tools.bench generate --depth "$depth" --max_seq_len "$ctx" --tokens "$tokens" \
    --device $DEV --dtype bf16 --naive 0 --members "$members" --batch "$batch" 2>&1
  echo "   (d$depth, members $members, batch $batch)"
done

log "done"
} 2>&1 | tee "$OUT/summary.txt"
