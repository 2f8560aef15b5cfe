#!/usr/bin/env bash
# Every offline figure of issue 18's "Done when", in one call on the GPU host (~8 minutes):
# `bench offline` three times each for qwen3-0.6b and llama-3.1-8b, with the bf16 cache and with
# --kv-cache-dtype fp8_e4m3 (the bench prints the floor of the cache's dtype), then the batch-1
# step of both (wall, and the decode graph alone). The served figure is the other call:
# scripts/gpu_serve_bench.sh. Run from the repository root with the wheels of
# shared/gpu/README.md installed and PYTHONPATH=/tmp/site:$PWD:$PWD/tests.
#   bash scripts/gpu_issue18_status.sh            # all of it
#   MODELS=qwen3-0.6b DTYPES=auto RUNS=1 bash scripts/gpu_issue18_status.sh
set -uo pipefail
MODELS=${MODELS:-qwen3-0.6b llama-3.1-8b}
DTYPES=${DTYPES:-auto fp8_e4m3}
RUNS=${RUNS:-3}
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
git rev-parse --short HEAD 2>/dev/null
for model in $MODELS; do
  for dtype in $DTYPES; do
    for run in $(seq "$RUNS"); do
      echo "== bench offline $model --kv-cache-dtype $dtype (run $run) =="
      timeout 150 python3 -m minfer bench offline "$model" --kv-cache-dtype "$dtype" 2>&1 \
        | grep -E "^throughput|^prefill|by batch|floor" | head -5
    done
  done
done
for model in $MODELS; do
  echo "== batch 1: $model =="
  OMP_NUM_THREADS=1 timeout 90 python3 scripts/gpu_batch1_split.py "$model" 2>&1 | tail -1
done
