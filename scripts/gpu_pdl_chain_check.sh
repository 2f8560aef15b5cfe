#!/usr/bin/env bash
# Whether MINFER_PDL=chain (docs/PERFORMANCE.md section 18) can become the default: the whole GPU
# test suite with it, then the offline workload and the batch-1 steps with and without it,
# alternating in one call. Run from the repository root on the GPU host, with the wheels of
# shared/gpu/README.md installed and PYTHONPATH=/tmp/site:$PWD:$PWD/tests.
set -uo pipefail
echo "== GPU suite, MINFER_PDL=chain =="
MINFER_PDL=chain timeout 300 python3 -m pytest -q -p no:cacheprovider tests/engine/test_parity.py \
  tests/engine/test_prefill_graphs_gpu.py tests/kernels tests/engine/test_fp8_kv_cache.py \
  tests/engine/test_logit_adjustments_gpu.py 2>&1 | tail -5
bench() { timeout 150 python3 -m minfer bench offline "$@" 2>&1 | grep -E "^throughput|by batch|this run is at" | head -3; }
for mode in 1 chain 1 chain; do
  echo "== MINFER_PDL=$mode: bench offline qwen3-0.6b =="
  MINFER_PDL=$mode bench qwen3-0.6b
done
for mode in 1 chain; do
  echo "== MINFER_PDL=$mode: batch 1 =="
  MINFER_PDL=$mode timeout 60 python3 scripts/gpu_batch1_split.py qwen3-0.6b 2>&1 | tail -1
  MINFER_PDL=$mode timeout 90 python3 scripts/gpu_batch1_split.py llama-3.1-8b 2>&1 | tail -1
done
