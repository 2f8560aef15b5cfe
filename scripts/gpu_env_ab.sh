#!/usr/bin/env bash
# A/B of decode settings that are environment variables (MINFER_PDL, MINFER_GEMV_PROLOGUE,
# MINFER_GEMV_EPILOGUE, ...), in one call on the GPU host: the GPU tests that go through the
# decode path, the layer chains of scripts/gpu_gemv.py, then the batch-1 steps and the offline
# workload with the defaults ("new") against OLD's settings, alternating. Run from the repository
# root with the wheels of shared/gpu/README.md installed and PYTHONPATH=/tmp/site:$PWD:$PWD/tests.
#   OLD="MINFER_GEMV_EPILOGUE=off" bash scripts/gpu_env_ab.sh
#   OLD="MINFER_PDL=release MINFER_GEMV_PROLOGUE=off" TESTS=0 CHAINS=0 \
#     OFFLINE="qwen3-0.6b,llama-3.1-8b,qwen3-0.6b --kv-cache-dtype fp8_e4m3" ROUNDS="new old new" \
#     bash scripts/gpu_env_ab.sh
set -uo pipefail
OLD=${OLD:-MINFER_GEMV_EPILOGUE=off}
TESTS=${TESTS:-1}
CHAINS=${CHAINS:-1}
BATCH1=${BATCH1:-qwen3-0.6b llama-3.1-8b}
OFFLINE=${OFFLINE:-qwen3-0.6b}
ROUNDS=${ROUNDS:-new old new old new}
git rev-parse --short HEAD 2>/dev/null
if [ "$TESTS" = 1 ]; then
  echo "== GPU tests, defaults =="
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernel_gemv.py \
    tests/kernels/test_kernel_fp8_kv.py tests/engine/test_parity.py \
    tests/engine/test_prefill_graphs_gpu.py tests/engine/test_logit_adjustments_gpu.py 2>&1 | tail -4
fi
if [ "$CHAINS" = 1 ]; then
  echo "== layer chains =="
  timeout 150 python3 scripts/gpu_gemv.py --rows 1,2 --chains-only 2>&1 | grep -v "^NVIDIA\|^H200"
fi
for setting in new old; do
  envs=$([ $setting = old ] && echo "$OLD" || echo "")
  for model in $BATCH1; do
    echo "== batch 1 $model, $setting ${envs} =="
    env $envs OMP_NUM_THREADS=1 timeout 90 python3 scripts/gpu_batch1_split.py "$model" 2>&1 | tail -1
  done
done
# OFFLINE: workloads separated by commas, each a model and its bench flags
IFS=',' read -ra WORKLOADS <<< "$OFFLINE"
for workload in "${WORKLOADS[@]}"; do
  for setting in $ROUNDS; do
    envs=$([ $setting = old ] && echo "$OLD" || echo "")
    echo "== bench offline $workload, $setting ${envs} =="
    env $envs timeout 150 python3 -m minfer bench offline $workload 2>&1 \
      | grep -E "^throughput|by batch|this run is at" | head -3
  done
done
