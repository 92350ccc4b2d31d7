# Issue 50 item 5: CPU decode speed at d12 and d20 (fresh models of a GPU run's shape), fp32 and bf16,
# 1 and 2 threads, the KV-cache path, 128 tokens after an 8-token warm-up; the matmul peak first.
PY=${PYTHON:-.venv/bin/python}
cd "$(dirname "$0")/../.."
$PY -c "from experiment.tools.probes import cpu_matmul_peak; print('peak GFLOP/s', round(cpu_matmul_peak() / 1e9))"
for d in 12 20; do for dt in fp32 bf16; do for th in 1 2; do
  $PY -m experiment.tools.bench generate --depth $d --max_seq_len 2048 --tokens 128 --dtype $dt --threads $th --naive 0 --device cpu
done; done; done
