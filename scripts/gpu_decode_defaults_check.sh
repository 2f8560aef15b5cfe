#!/usr/bin/env bash
# The decode defaults set from scripts/gpu_pdl_chain_check.sh and scripts/gpu_prologue_check.sh
# (docs/PERFORMANCE.md section 20): MINFER_PDL=1 chains launches of <= 2 rows only, and
# MINFER_GEMV_PROLOGUE=auto folds a prologue only where gemv.prologue_pays. In one call: the
# tests that go through both, the layer chains with each prologue folded alone, then the batch-1
# steps and the offline workload with the new defaults against the old ones (release-only PDL,
# no prologues), alternating. Run from the repository root on the GPU host, with the wheels of
# shared/gpu/README.md installed and PYTHONPATH=/tmp/site:$PWD:$PWD/tests.
set -uo pipefail
old="MINFER_PDL=release MINFER_GEMV_PROLOGUE=off"
echo "== tests, defaults =="
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernel_gemv.py \
  tests/engine/test_parity.py 2>&1 | tail -3
echo "== layer chains =="
timeout 120 python3 scripts/gpu_gemv.py --rows 1,2 --chains-only 2>&1 | grep -v "^NVIDIA\|^H200"
for setting in new old; do
  envs=$([ $setting = old ] && echo "$old" || echo "")
  echo "== batch 1, $setting defaults ${envs} =="
  env $envs timeout 60 python3 scripts/gpu_batch1_split.py qwen3-0.6b 2>&1 | tail -1
  env $envs timeout 90 python3 scripts/gpu_batch1_split.py llama-3.1-8b 2>&1 | tail -1
done
for setting in new old new old new; do
  envs=$([ $setting = old ] && echo "$old" || echo "")
  echo "== bench offline qwen3-0.6b, $setting defaults ${envs} =="
  env $envs timeout 100 python3 -m minfer bench offline qwen3-0.6b 2>&1 \
    | grep -E "^throughput|by batch|this run is at" | head -3
done
